"""What attention in the QKV GEMM's tail costs, apart from the layer: a CUDA graph of R back-to-back bert-base QKV
GEMMs (PDL chain, the committed top-1's QKV tiles, no LayerNorm) in variants, per launch (us):

  gemm          the GEMM alone
  gemm+attn16   the GEMM, then the attention kernel (16x128 tiles, 96 programs: the top-1's)
  gemm+attn64   the GEMM, then the attention kernel with 64-row tiles (24 programs: the tail's task size)
  tail128/64    attention in the GEMM's tail, keys in blocks of 128 / 64
  tail-count    the tail's arrivals only: counters start far below zero, so no task runs

usage: python3 scripts/tail_probe.py [R]
"""

import sys

import torch

from tuner.kernels.attention import AttnConfig, AttnTail, attention, tail_counters
from tuner.kernels.gemm import GemmConfig, linear
from tuner.timing import capture, time_replay


def main():
    R = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    b, s, h, d = 1, 128, 12, 64
    D = h * d
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b * s, D, generator=g).half().cuda()
    w = (torch.randn(3 * D, D, generator=g) / D**0.5).half().cuda()
    bias = torch.randn(3 * D, generator=g).half().cuda()
    cfg = GemmConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4, tma=1, overlap_ratio=0.0,
                     prefetch_ratio=1.0)
    qkv = torch.empty(b * s, 3 * D, dtype=torch.float16, device="cuda")
    att = torch.empty(b * s, D, dtype=torch.float16, device="cuda")

    def chain(variant):
        cnt = tail_counters(b * s, h, cfg.block_m, "cuda")
        if variant == "tail-count":
            cnt.fill_(-(1 << 30))
        kv = 64 if variant == "tail64" else 128
        tail = AttnTail(att, cnt, b, s, h, d, block_n=kv) if variant.startswith("tail") else None
        acfg = AttnConfig(block_m=64 if variant == "gemm+attn64" else 16, block_n=128, num_warps=4, num_stages=1,
                          overlap_ratio=0.0)

        def run():
            for _ in range(R):
                linear(x, w, bias, config=cfg, out=qkv, attention=tail)
                if variant.startswith("gemm+attn"):
                    attention(qkv, batch=b, seq=s, heads=h, head_dim=d, config=acfg, out=att)
        return run

    for rnd in range(2):
        for v in ("gemm", "gemm+attn16", "gemm+attn64", "tail128", "tail64", "tail-count"):
            gr = capture(chain(v))
            t = time_replay(gr.replay, R, reps=30, warmup=5)
            print(f"round {rnd} {v:12s} {t.median_us:6.2f} us a launch (+- {t.spread_us:.2f})")


if __name__ == "__main__":
    main()
