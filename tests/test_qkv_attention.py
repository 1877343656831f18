"""The fused QKV projection + causal attention (tuner.kernels.qkv_attention) against its torch reference."""

import pytest
import torch

from tuner.kernels._common import REL_TOLERANCE, rel_error
from tuner.kernels.gemm import GemmConfig, fold_layernorm
from tuner.kernels.qkv_attention import QkvAttnProblem, check, qkv_attention, qkv_attention_ref

IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _inputs(batch, seq, heads, hd, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    d = heads * hd
    x = torch.randn(batch * seq, d, generator=g) * 1.5 + 0.3
    w = torch.randn(3 * d, d, generator=g) / d ** 0.5
    b = 0.1 * torch.randn(3 * d, generator=g)
    lw = 1 + 0.1 * torch.randn(d, generator=g)
    lb = 0.1 * torch.randn(d, generator=g)
    return [t.to(dtype).to(device) for t in (x, w, b, lw, lb)]


def _stats(x, parts):
    """[parts, M, 2] row sums of x and x^2, split over column chunks as a producer GEMM writes them."""
    chunks = x.float().chunk(parts, dim=1)
    return torch.stack([torch.stack([c.sum(1), (c * c).sum(1)], dim=1) for c in chunks]).contiguous()


# (batch, seq, heads, head_dim), block_k: a sequence below its 32-row tile with a second batch behind it,
# ragged K tiles (d_model 48 at block_k 32), one full 32-row tile, a head dim of 32.
CASES = [((2, 17, 3, 16), 32), ((1, 32, 2, 32), 16), ((2, 9, 2, 16), 16)]
CASE_IDS = ["b2s17h3d16-bk32", "b1s32h2d32-bk16", "b2s9h2d16-bk16"]


@pytest.mark.parametrize("ln", ["none", "loop", "stats"])
@pytest.mark.parametrize("tma", [0, 1], ids=["cp", "tma"])
@pytest.mark.parametrize("case, bk", CASES, ids=CASE_IDS)
def test_qkv_attention_matches_ref(case, bk, tma, ln, device):
    bsz, s, h, hd = case
    x, w, b, lw, lb = _inputs(bsz, s, h, hd, torch.float16, device, seed=s + hd + tma)
    cfg = GemmConfig(block_k=bk, num_warps=4, num_stages=2, tma=tma)
    assert check(cfg, QkvAttnProblem(bsz, s, h, hd)) is None
    out = torch.full((bsz * s, h * hd), float("nan"), dtype=x.dtype, device=device)
    kw, ref_kw = {}, {}
    if ln != "none":
        wf, bf, u = fold_layernorm(w, b, lw, lb)
        w, b = wf, bf
        kw = dict(ln_colsum=u, ln_stats=_stats(x, 3) if ln == "stats" else None)
        ref_kw = dict(ln_weight=lw, ln_bias=lb)
        ref_w, ref_b = _inputs(bsz, s, h, hd, torch.float16, device, seed=s + hd + tma)[1:3]
    else:
        ref_w, ref_b = w, b
    res = qkv_attention(x, w, b, batch=bsz, seq=s, heads=h, config=cfg, out=out, **kw)
    assert res is out
    ref = qkv_attention_ref(x, ref_w, ref_b, batch=bsz, seq=s, heads=h, **ref_kw)
    err = rel_error(out, ref)
    assert err < REL_TOLERANCE[torch.float16], err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=IDS.get)
def test_qkv_attention_dtypes(dtype, device):
    bsz, s, h, hd = 2, 13, 2, 16
    x, w, b, _, _ = _inputs(bsz, s, h, hd, dtype, device, seed=5)
    out = qkv_attention(x, w, b, batch=bsz, seq=s, heads=h, config=GemmConfig(block_k=16, num_stages=2))
    err = rel_error(out, qkv_attention_ref(x, w, b, batch=bsz, seq=s, heads=h))
    assert err < REL_TOLERANCE[dtype], err


def test_qkv_attention_check_limits():
    ok = GemmConfig(block_k=64, num_warps=8, num_stages=3, tma=1)
    assert check(ok, QkvAttnProblem(1, 128, 12, 64)) is None  # bert-base
    assert "seq <= 128" in check(ok, QkvAttnProblem(1, 129, 12, 64))
    assert "power-of-two head_dim" in check(ok, QkvAttnProblem(1, 64, 10, 48))
    # 128 rows x 64 x 3 accumulators do not fit 4 warps' registers
    assert "registers" in check(GemmConfig(block_k=64, num_warps=4, num_stages=3), QkvAttnProblem(1, 128, 12, 64))
    assert "shared memory" in check(GemmConfig(block_k=256, num_warps=8, num_stages=4), QkvAttnProblem(1, 128, 12, 64))
    assert "block_k" in check(GemmConfig(block_k=2048, num_warps=8), QkvAttnProblem(1, 128, 12, 64))


def test_qkv_attention_rejects_bad_input(device):
    x, w, b, _, _ = _inputs(1, 8, 2, 16, torch.float16, device, seed=1)
    with pytest.raises(ValueError, match="do not fit"):
        qkv_attention(x, w, b, batch=2, seq=8, heads=2)
    with pytest.raises(ValueError, match="bias"):
        qkv_attention(x, w, b[:-1], batch=1, seq=8, heads=2)
