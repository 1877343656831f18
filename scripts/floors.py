"""Per-kernel floors of a per-kernel layer config: what each kernel must move, at rates measured in this process.

usage: python3 scripts/floors.py SHAPE CONFIG [CONFIG ...]   (CONFIG: a best.json or a timeline.py variant)

Per kernel of the layer (norms that are fused into a GEMM launch nothing and move nothing of their own):
  weights     MB read from DRAM once a layer (the stack's weights are cold: they do not fit L2)
  L2->SM      MB the config's tiles pull from L2 into the SMs: every GEMM program its A rows and B columns over its
              K slice (A is read once per column tile, B once per row tile), the residual, and a split-K
              reduction kernel's fp32 partials; attention: every program its Q rows and its causal keys' K and V;
              an unfused norm: its rows
  DRAM floor  weights / the device-to-device copy bandwidth (tuner.timing.copy_bandwidth_bytes_per_s)
  L2 floor    L2->SM bytes / the chip's L2 -> SM rate (scripts/tma_bench.py: every SM loading L2-resident TMA boxes)
  floor       the larger of the two (they can overlap)
Beside it, `scripts/timeline.py SHAPE CONFIG` gives what each kernel adds to the layer in the timed graph.
"""

import math
import os
import sys

import torch

from tuner.shapes import resolve
from tuner.timing import copy_bandwidth_bytes_per_s

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timeline import variant  # noqa: E402
from tma_bench import l2_to_sm_bytes_per_s  # noqa: E402


def gemm_l2_bytes(m: int, n: int, k: int, c, residual: bool, esize: int = 2) -> float:
    mt, nt = math.ceil(m / c.block_m), math.ceil(n / c.block_n)
    b = (nt * m * k + mt * n * k) * esize  # A once per column tile, B once per row tile
    if residual:
        b += m * n * esize
    if c.split_k > 1 and not c.cluster:
        b += c.split_k * m * n * 4  # the reduction kernel reads every split's fp32 partial
    return b


def attn_l2_bytes(batch: int, seq: int, heads: int, c, head_dim: int = 64, esize: int = 2) -> float:
    total = 0
    for t in range(math.ceil(seq / c.block_m)):
        q_rows = min(c.block_m, seq - t * c.block_m)
        keys = min(seq, math.ceil((t + 1) * c.block_m / c.block_n) * c.block_n)  # causal: up to its last row
        total += (q_rows + 2 * keys) * head_dim * esize
    return total * batch * heads


def floors(shape, cfg, dram_bw: float, l2_bw: float) -> list[tuple[str, float, float, float, float]]:
    m, d = shape.tokens, shape.d_model
    rows = []
    if not cfg.norm1.fuse:
        rows.append(("norm1", 0.0, m * d * 2))
    g = shape.gemms()

    def gemm(name: str, residual: bool):  # its weights ([N, K], read once) and its tiles' bytes
        _, n, k = g[name]
        return name, n * k * 2, gemm_l2_bytes(*g[name], getattr(cfg, name), residual)

    rows.append(gemm("qkv", False))
    rows.append(("attn", 0.0, attn_l2_bytes(shape.batch, shape.seq, shape.heads, cfg.attn, d // shape.heads)))
    rows.append(gemm("out", True))
    if not cfg.norm2.fuse:
        rows.append(("norm2", 0.0, m * d * 2))
    rows.append(gemm("ffn1", False))
    rows.append(gemm("ffn2", True))
    return [(k, w, b, w / dram_bw * 1e6, b / l2_bw * 1e6) for k, w, b in rows]


def main():
    shape = resolve(sys.argv[1])
    dram_bw = copy_bandwidth_bytes_per_s()
    l2_bw = l2_to_sm_bytes_per_s()
    print(f"rates measured here: DRAM copy {dram_bw / 1e12:.2f} TB/s, L2 -> SM {l2_bw / 1e12:.2f} TB/s "
          f"({torch.cuda.get_device_name()})")
    for name in sys.argv[2:]:
        cfg = variant(shape, name)
        print(f"\n## {shape.name} {name}: per-kernel floors")
        print("| kernel | weights MB | L2->SM MB | DRAM floor us | L2 floor us | floor us |")
        print("|---|---:|---:|---:|---:|---:|")
        tot = [0.0] * 5
        for k, w, b, fd, fl in floors(shape, cfg, dram_bw, l2_bw):
            print(f"| {k} | {w / 1e6:.2f} | {b / 1e6:.2f} | {fd:.2f} | {fl:.2f} | {max(fd, fl):.2f} |")
            for i, v in enumerate((w, b, fd, fl, max(fd, fl))):
                tot[i] += v
        print(f"| sum | {tot[0] / 1e6:.2f} | {tot[1] / 1e6:.2f} | {tot[2]:.2f} | {tot[3]:.2f} | {tot[4]:.2f} |")


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
