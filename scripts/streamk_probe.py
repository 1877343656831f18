"""Stream-K against the tiled GEMM on bert-base's FFN1 alone (issue 6's split-K/stream-K lever).

A chain of L launches of ``gelu(x @ w_i.T + b)`` (each with its own weight, so that they come cold from HBM unless
--hot), with PDL and full prefetch as the layer runs them, in one CUDA graph; us a launch, interleaved. Variants
separate the loop's structure (stream-K with one program a tile: no partial, no counter) from the partial sums
(one program an SM). Also prints each compiled kernel's registers and spills.
usage: python3 scripts/streamk_probe.py [--hot]
"""

import sys
from dataclasses import replace

import torch

import tuner.kernels.gemm as gemm_k
from tuner.kernels.gemm import GemmConfig, linear, linear_ref
from tuner.kernels._common import rel_error
from tuner.timing import time_interleaved

M, N, K, L = 128, 3072, 768, 20
BASE = GemmConfig(block_m=64, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=5, tma=1,
                  overlap_ratio=0.0, prefetch_ratio=1.0)


def main():
    hot = "--hot" in sys.argv
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(M, K, generator=g) / K**0.5).half().cuda()
    ws = [torch.randn(N, K, generator=g).half().cuda() for _ in range(1 if hot else L)] * (L if hot else 1)
    b = torch.randn(N, generator=g).half().cuda()
    outs = [torch.empty(M, N, dtype=torch.float16, device="cuda") for _ in range(L)]
    variants = {
        "tiled 64x64x128 (96 programs)": (BASE, None),
        "stream-K, 96 programs (one a tile: no partials)": (replace(BASE, stream_k=1), 96),
        "stream-K, 132 programs": (replace(BASE, stream_k=1), 132),
        "stream-K, 132 programs, no prefetch": (replace(BASE, stream_k=1, prefetch_ratio=-1.0), 132),
        "stream-K, 132 programs, 2 stages": (replace(BASE, stream_k=1, num_stages=2), 132),
        "stream-K, 132 programs, no PDL": (replace(BASE, stream_k=1, overlap_ratio=-1.0, prefetch_ratio=-1.0), 132),
        "tiled, no PDL": (replace(BASE, overlap_ratio=-1.0, prefetch_ratio=-1.0), None),
    }
    graphs = []
    for name, (cfg, programs) in variants.items():
        run = lambda: [linear(x, w, b, config=cfg, activation="gelu", out=o, _programs=programs)  # noqa: E731
                       for w, o in zip(ws, outs)]
        run()
        torch.cuda.synchronize()
        err = max(rel_error(o, linear_ref(x, w, b, activation="gelu")) for w, o in zip(ws[:2], outs[:2]))
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            run()
        graphs.append((name, gr, err))
    ts = time_interleaved([gr.replay for _, gr, _ in graphs], [L] * len(graphs), rounds=30)
    print(f"## FFN1 {M}x{N}x{K} fp16, {L} launches a graph, weights {'hot' if hot else 'cold'}; us a launch")
    for (name, _, err), t in zip(graphs, ts):
        print(f"{name}: {t.median_us:.2f} (rel err {err:.1e})")
    for fn in (gemm_k._gemm_kernel, gemm_k._streamk_kernel):
        for cache in getattr(fn, "device_caches", {}).values():
            for k in cache[0].values():
                print(f"{fn.fn.__name__}: {k.n_regs} registers, {k.n_spills} spills, {k.metadata.shared} B shared, "
                      f"{k.metadata.num_stages} stages")


if __name__ == "__main__":
    main()
