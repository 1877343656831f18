"""What an all-to-all exchange inside a thread-block cluster costs by itself (scripts/xchg_bench.cu;
docs/perf-notes.md, section 25): per cluster size and slab size, median cycles a CTA of the pack (stores, proxy fence,
CTA barrier), of the pushes until the last slab arrived, and of a bare cluster barrier. usage: python3
scripts/xchg_bench.py [--pull] (the C - 1 slabs read by ld.shared::cluster after a cluster barrier instead)"""

import ctypes
import sys
from pathlib import Path

import torch

from tuner.kernels import _nvcc

SOURCE = Path(__file__).with_name("xchg_bench.cu")


def main():
    lib = _nvcc.build(SOURCE, {"XB": 1}, "xchg_bench")
    lib.xchg_run.argtypes = _nvcc.c_argtypes(SOURCE.read_text(), "xchg_run")
    err = ctypes.create_string_buffer(256)
    pull = int("--pull" in sys.argv)
    what = "barrier and loads of the slabs" if pull else "pushes to last slab"
    for c in (2, 4, 8, 16):
        for slab in (256, 1280, 4096, 8192):
            if 2 * c * slab > 200 * 1024:  # (shared memory)
                continue
            for clusters in (1, 16 // c * 2):
                out = torch.zeros(clusters * c, 3, dtype=torch.int64, device="cuda")
                meds = []
                for _ in range(5):
                    rc = lib.xchg_run(c, clusters, slab, pull, out.data_ptr(), err)
                    assert rc == 0, err.value
                    torch.cuda.synchronize()
                    meds.append(out.double().median(0).values)
                m = torch.stack(meds).median(0).values.tolist()
                print(f"cluster {c:2d} x {clusters:2d}, slabs {slab:5d} B ({(c - 1) * slab / 1024:5.1f} KB in, "
                      f"{(c - 1) * slab / 1024:5.1f} KB out a CTA): pack {m[0]:5.0f}, {what} {m[1]:5.0f}, "
                      f"bare cluster barrier {m[2]:5.0f} cycles", flush=True)


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
