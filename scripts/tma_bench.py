"""How fast one SM takes in data through the TMA unit, by load shape and number of issuing warps, alone and with
every SM loading (scripts/tma_bench.cu; docs/perf-notes.md, section 19). L2-resident data (a 12 MB tensor, read once
before). usage: python3 scripts/tma_bench.py"""

import ctypes
from pathlib import Path

import torch

from tuner.kernels import _nvcc

KINDS = {0: "2-D box", 1: "3-D box", 2: "1-D bulk"}


def main():
    lib = _nvcc.build(Path(__file__).with_name("tma_bench.cu"), {"TB": 1}, "tma_bench")
    lib.tma_ingest.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 6 + [ctypes.c_void_p, ctypes.c_char_p]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    t = torch.randn(2048, 3072, device="cuda").half()
    err = ctypes.create_string_buffer(256)
    cases = []
    for kind, rows_list in ((0, (64, 128, 256)), (1, (128, 192, 256)), (2, (64, 128, 256, 512))):
        for rows in rows_list:
            for warps, slots in ((1, 4), (1, 8), (2, 4), (4, 2)):
                if warps * slots * rows * 128 > 200 * 1024:
                    continue
                cases.append((kind, rows, warps, slots))
    for ctas in (1, sms):
        for kind, rows, warps, slots in cases:
            loads = 96
            out = torch.zeros(2 * ctas * warps, dtype=torch.int64, device="cuda")
            for _ in range(2):
                rc = lib.tma_ingest(t.data_ptr(), kind, rows, loads, slots, warps, ctas, out.data_ptr(), err)
                assert rc == 0, (rc, err.value)
            cyc = out.view(-1, 2)[:, 0].double()
            issue = out.view(-1, 2)[:, 1].double()
            per_sm = loads * warps * rows * 128 / cyc.view(ctas, warps).max(1).values
            print(f"ctas {ctas:3d} {KINDS[kind]:8s} {rows * 128 // 1024:3d} KB  warps {warps} slots {slots}: "
                  f"{per_sm.median().item():6.1f} B/cycle/SM (min {per_sm.min().item():6.1f}), "
                  f"{cyc.median().item() / loads:7.1f} cycles a load a warp, first {slots} issues "
                  f"{issue.median().item():6.0f} cycles", flush=True)


if __name__ == "__main__":
    main()
