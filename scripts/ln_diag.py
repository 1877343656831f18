"""Diagnose (GPU) the fused-LayerNorm statistics path, old (reload=False) against the kept one.

 the fused-LayerNorm GEMM at M=128 K=768 N=2304 over tiles (GPU): rel. error per config."""

import torch

from tuner.device import require_gpu
from tuner.kernels._common import rel_error
from tuner.kernels.gemm import GemmConfig, fold_layernorm, linear, linear_ref

require_gpu(__file__)
torch.manual_seed(0)
M, K, N = 128, 768, 2304
x = torch.randn(M, K, device="cuda").half() + 0.3
w = (torch.randn(N, K, device="cuda") / K**0.5).half()
b = (0.1 * torch.randn(N, device="cuda")).half()
g = (1 + 0.1 * torch.randn(K, device="cuda")).half()
beta = (0.1 * torch.randn(K, device="cuda")).half()
wf, bf, u = fold_layernorm(w, b, g, beta)
ref = linear_ref(x, w, b, ln_weight=g, ln_bias=beta)
for reload in (False, True):
    for bk, st, warps in [(64, 4, 4), (128, 2, 4), (128, 3, 4), (128, 4, 4), (128, 6, 4), (128, 4, 8), (256, 3, 4)]:
        for ov in (-1.0, 0.0):
            cfg = GemmConfig(block_m=64, block_n=64, block_k=bk, num_stages=st, num_warps=warps, overlap_ratio=ov)
            errs = []
            for _ in range(3):
                out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.half)
                linear(x, wf, bf, config=cfg, ln_colsum=u, out=out, _ln_reload=reload)
                torch.cuda.synchronize()
                errs.append(rel_error(out, ref))
            print(f"reload={reload!s:5} bk={bk:3} stages={st} warps={warps} o={ov:4}: rel err {max(errs):.2e}")
