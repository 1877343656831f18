"""The fused block's in-kernel attention on its own (scripts/attn_probe.cu; docs/perf-notes.md, section 25): clock64
cycles per warp of tiny's 8 tasks (4 heads x 2 blocks of 16 query rows, 32 keys), code cold and warm.
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
    for rep in range(5):
        assert lib.attn_probe(32, out.data_ptr()) == 0
        torch.cuda.synchronize()
        print(f"run {rep}: cycles per warp, first pass {out[:, 0].tolist()}, second {out[:, 1].tolist()}", flush=True)


if __name__ == "__main__":
    main()
