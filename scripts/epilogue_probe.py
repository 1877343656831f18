"""Is a CUDA GEMM's epilogue slow by itself, or only among other kernels? A CUDA graph of R launches of bert-base's
clustered out-projection (128x768x768, 64x64 tiles, split 4, 16-bit exchange; PDL chain), per-program %globaltimer
stamps (as scripts/trace_gemms.py), in two orders:

  alone        the cluster GEMM R times back to back: its code stays in each SM's instruction caches
  interleaved  each launch followed by a Triton GEMM of FFN1's shape (128x3072x768), whose code displaces it

Printed: per order, the median over launches (after the first) and programs of the K loop and of the epilogue
(loop end -> program end), and the graph's time per cluster launch.

usage: python3 scripts/epilogue_probe.py [R]
"""

import statistics
import sys

import torch

from tuner.kernels import cluster_gemm
from tuner.kernels.gemm import GemmConfig, grid, linear
from tuner.timing import capture, time_replay


def main():
    R = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    g = torch.Generator().manual_seed(0)
    m, d, f = 128, 768, 3072
    x = torch.randn(m, d, generator=g).half().cuda()
    w = (torch.randn(d, d, generator=g) / d**0.5).half().cuda()
    w1 = (torch.randn(f, d, generator=g) / d**0.5).half().cuda()
    res = torch.randn(m, d, generator=g).half().cuda()
    cl = GemmConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=6, split_k=4, tma=1, cluster=2,
                    overlap_ratio=0.0, prefetch_ratio=1.0)
    tr = GemmConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4, tma=1, overlap_ratio=0.0,
                    prefetch_ratio=1.0)
    out = torch.empty(m, d, dtype=torch.float16, device="cuda")
    out1 = torch.empty(m, f, dtype=torch.float16, device="cuda")
    tiles, splits = grid(cl, m, d)
    for order in ("alone", "interleaved", "alone", "interleaved"):
        traces = [torch.zeros(tiles * splits, cluster_gemm.TRACE_SLOTS, dtype=torch.int64, device="cuda")
                  for _ in range(R)]

        def run():
            for i in range(R):
                linear(x, w, residual=res, config=cl, out=out, _trace=traces[i])
                if order == "interleaved":
                    linear(x, w1, config=tr, out=out1, activation="gelu")

        gr = capture(run)
        t = time_replay(gr.replay, R, reps=20, warmup=3)
        gr.replay()
        torch.cuda.synchronize()
        loops, epis = [], []
        for tr_i in traces[1:]:
            ts = tr_i.cpu().double() / 1000.0  # us
            loops += (ts[:, 2] - ts[:, 1]).tolist()
            epis += (ts[:, 3] - ts[:, 2]).tolist()
        print(f"{order:12s} {t.median_us:6.2f} us a cluster launch (graph); loop {statistics.median(loops):.2f} us, "
              f"epilogue {statistics.median(epis):.2f} us (median of {len(epis)} programs), "
              f"epilogue mean {statistics.fmean(epis):.2f}")


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
