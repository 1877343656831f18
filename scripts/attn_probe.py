"""The fused block's in-kernel attention on its own (scripts/attn_probe.cu; docs/perf-notes.md, section 25): clock64
cycles per warp of tiny's 8 tasks (4 heads x 2 blocks of 16 query rows, 32 keys), or of the first 4 (one warp an
SM sub-partition), code cold and warm; cut after S, after the softmax, or whole.
usage: python3 scripts/attn_probe.py"""

import zlib
from pathlib import Path

import torch

from tuner.kernels import _nvcc

SOURCE = Path(__file__).with_name("attn_probe.cu")


def main():
    kernel = (SOURCE.parent.parent / "kernels" / "mlp_cluster.cu").read_bytes()  # (included: part of the build key)
    lib = _nvcc.build(SOURCE, {"AP": zlib.crc32(kernel)}, "attn_probe")
    lib.attn_probe.argtypes = _nvcc.c_argtypes(SOURCE.read_text(), "attn_probe")
    out = torch.zeros(8, 2, dtype=torch.int64, device="cuda")
    for stop, what in ((1, "S only"), (2, "S and the softmax"), (3, "all")):
        for ntasks in (8, 4):
            for _ in range(3):
                assert lib.attn_probe(32, ntasks, stop, out.data_ptr()) == 0
                torch.cuda.synchronize()
            print(f"{what:18s} {ntasks} tasks: cycles per warp, first pass {out[:ntasks, 0].tolist()}, second "
                  f"{out[:ntasks, 1].tolist()}", flush=True)


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
