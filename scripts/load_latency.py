"""How long a kernel's first 16 KB load takes to land in shared memory: one 3-D TMA box, four 2-D boxes, or plain
16-byte loads from 256 threads (scripts/load_latency.cu; docs/perf-notes.md, section 25). The rows were written by
the kernel just before, as a predecessor's output is. usage: python3 scripts/load_latency.py"""

import ctypes
from pathlib import Path

import torch

from tuner.kernels import _nvcc

SOURCE = Path(__file__).with_name("load_latency.cu")
MODES = {0: "TMA, one 3-D box", 1: "TMA, four 2-D boxes", 2: "ld.global x4 a thread", 3: "ld.global.cg x4 a thread"}


def main():
    lib = _nvcc.build(SOURCE, {"LL": 1}, "load_latency")
    lib.ll_run.argtypes = _nvcc.c_argtypes(SOURCE.read_text(), "ll_run")
    err = ctypes.create_string_buffer(256)
    ghz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 1_980_000) / 1e6  # kHz; H200 max 1.98 GHz
    for ctas in (1, 16, 48, 132):
        buf = torch.empty(ctas * 32, 256, dtype=torch.float16, device="cuda")
        out = torch.zeros(ctas, dtype=torch.int64, device="cuda")
        for mode, name in MODES.items():
            cyc = []
            for rep in range(20):
                assert lib.ll_run(buf.data_ptr(), mode, ctas, rep, out.data_ptr(), err) == 0, err.value
                torch.cuda.synchronize()
                if rep >= 2:
                    cyc.append(out.double())
            c = torch.cat(cyc)
            print(f"{ctas:3d} CTAs, {name:26s}: median {c.median().item():6.0f} cycles ({c.median().item() / ghz:5.0f} "
                  f"ns at {ghz:.2f} GHz), p90 {c.quantile(0.9).item():6.0f}", flush=True)


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
