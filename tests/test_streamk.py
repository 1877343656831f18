"""Stream-K (GemmConfig.stream_k): the tiles' K iterations dealt out evenly to the programs, shared tiles summed by
their last contributor. Odd shapes, program counts that split tiles two to five ways, the fused LayerNorm from the
producer's row sums, and the counters left at zero for the next launch (a CUDA graph replays the same buffers)."""

import pytest
import torch

from tuner.kernels._common import REL_TOLERANCE, rel_error
from tuner.kernels.gemm import (GemmConfig, GemmProblem, _STREAMK_BUFFERS, check, fold_layernorm, linear, linear_ref,
                                stats_parts, streamk_parts)

from test_gemm import _inputs  # (tests/ is on sys.path under pytest)

SK = GemmConfig(block_m=16, block_n=32, block_k=16, num_warps=1, num_stages=1, stream_k=1)


def _counters_zero():
    return all(int(cnt.abs().sum()) == 0 for _, cnt in _STREAMK_BUFFERS.values())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("m, n, k, programs, tma", [
    (37, 90, 80, 7, 0),    # 3x3 tiles of 5 K tiles: 45 iterations over 7 programs, tiles split 2-3 ways
    (17, 64, 96, 4, 1),    # TMA, one row tile
    (37, 90, 80, 64, 0),   # more programs than tiles: every tile split 5 ways, one iteration a program
    (37, 90, 80, 1, 0),    # one program covers every tile whole: no partial at all
])
def test_streamk_matches_reference(dtype, m, n, k, programs, tma, device):
    x, w, b, r = _inputs(m, n, k, dtype, device, seed=m + programs)
    cfg = GemmConfig(**{**SK.to_dict(), "tma": tma})
    assert check(cfg, GemmProblem(m, n, k, x.element_size())) is None
    for act in (None, "gelu"):
        out = torch.full((m, n), float("nan"), dtype=dtype, device=device)  # poisoned: every element written
        linear(x, w, b, config=cfg, activation=act, residual=r, out=out, _programs=programs)
        ref = linear_ref(x, w, b, activation=act, residual=r)
        assert rel_error(out, ref) < REL_TOLERANCE[dtype], (act, rel_error(out, ref))
    assert _counters_zero()


def test_streamk_layernorm_from_the_producer(device):
    # h writes its rows' sums; the stream-K GEMM normalises h with them after summing its tiles' partials.
    dtype = torch.float16
    m, k1, d, n = 37, 72, 96, 50
    x, w1, b1, _ = _inputs(m, d, k1, dtype, device, seed=3)
    r = (torch.randn(m, d, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype).to(device)
    _, w2, b2, _ = _inputs(m, n, d, dtype, device, seed=4)
    g = torch.Generator().manual_seed(6)
    lw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(device)
    lb = (0.1 * torch.randn(d, generator=g)).to(dtype).to(device)
    c1 = GemmConfig(block_m=16, block_n=32, block_k=16)
    stats = torch.full((stats_parts(c1, d), m, 2), float("nan"), dtype=torch.float32, device=device)
    h = linear(x, w1, b1, config=c1, residual=r, stats_out=stats)
    wf, bf, u = fold_layernorm(w2, b2, lw, lb)
    sk_stats = torch.full((stats_parts(SK, n), m, 2), float("nan"), dtype=torch.float32, device=device)
    out = linear(h, wf, bf, config=SK, ln_colsum=u, ln_stats=stats, activation="gelu", stats_out=sk_stats,
                 _programs=5)
    ref = linear_ref(h, w2, b2, ln_weight=lw, ln_bias=lb, activation="gelu")
    assert rel_error(out, ref) < REL_TOLERANCE[dtype]
    # the stream-K GEMM's own row sums (a LayerNorm's statistics for its successor), of the values before rounding
    torch.testing.assert_close(sk_stats.sum(0)[:, 0], out.float().sum(1), rtol=2e-3, atol=2e-2)
    assert _counters_zero()


def test_streamk_rules():
    p = GemmProblem(128, 3072, 768)
    assert "needs split_k=1 and cluster=0" in check(GemmConfig(stream_k=1, split_k=2), p)
    assert "needs split_k=1 and cluster=0" in check(GemmConfig(stream_k=1, cluster=1, split_k=2, tma=1), p)
    assert "stream_k=2 must be 0 or 1" in check(GemmConfig(stream_k=2), p)
    # bert-base FFN1 at 64x64x128 on 132 SMs: 576 iterations, 4-5 a program, a tile's 6 met by at most 3 programs
    assert streamk_parts(6, 576, 132) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("block_k, overlap", [(128, 0.0), (64, 0.0), (128, -1.0)])
def test_streamk_on_gpu_graph_replays(block_k, overlap):
    # bert-base's FFN1 on every SM, in a CUDA graph replayed 20 times: the counters go back to zero every launch.
    m, k, n = 128, 768, 3072
    x, w, b, r = _inputs(m, n, k, torch.float16, "cuda", seed=block_k)
    cfg = GemmConfig(block_m=64, block_n=64, block_k=block_k, num_stages=4, tma=1, stream_k=1,
                     overlap_ratio=overlap, prefetch_ratio=1.0 if overlap >= 0 else -1.0)
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    linear(x, w, b, config=cfg, activation="gelu", out=out)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        linear(x, w, b, config=cfg, activation="gelu", out=out)
    ref = linear_ref(x, w, b, activation="gelu")
    for _ in range(20):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert rel_error(out, ref) < 1e-2
    assert _counters_zero()
