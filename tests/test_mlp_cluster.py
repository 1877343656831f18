"""The feed-forward block in one kernel (kernels/mlp_cluster.cu): its validity rules everywhere, the CUDA kernel
against its torch reference on a Hopper GPU (pytest -m gpu)."""

import pytest
import torch

from tuner.kernels import mlp_cluster
from tuner.kernels._common import REL_TOLERANCE, rel_error
from tuner.kernels.gemm import fold_layernorm


@pytest.mark.parametrize("m, d, f, needle", [
    (32, 256, 1000, "hidden columns"),
    (32, 256, 2048, "hidden columns"),
    (32, 200, 1024, "multiple of 128"),
    (32, 768, 1024, "up to 512"),
])
def test_error(m, d, f, needle):
    assert needle in (mlp_cluster.error(m, d, f) or "")


def test_error_accepts_tiny():
    assert mlp_cluster.error(32, 256, 1024) is None
    assert mlp_cluster.stats_parts(256, 1024) == 16  # one part a CTA: 128 / 8 columns
    assert mlp_cluster.stats_parts(256, 512) == 8


def _inputs(m, d, f, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, sc=1.0: (torch.randn(*s, generator=g) * sc).to(dtype).cuda()  # noqa: E731
    return (r(m, d), r(f, d, sc=d ** -0.5), r(f, sc=0.1), r(d, f, sc=f ** -0.5), r(d, sc=0.1), r(m, d),
            (1 + r(d, sc=0.1)).float(), r(d, sc=0.1).float())


gpu = pytest.mark.gpu


def _hopper():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CUDA kernel needs a Hopper GPU")


@gpu
@pytest.mark.parametrize("m, d, f", [(32, 256, 1024), (17, 256, 1024), (64, 256, 512), (45, 128, 256),
                                     (100, 256, 1024), (32, 384, 1024), (32, 512, 512)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mlp_matches_reference(m, d, f, dtype):
    _hopper()
    x, w1, b1, w2, b2, res, _, _ = _inputs(m, d, f, dtype)
    out = torch.full((m, d), float("nan"), dtype=dtype, device="cuda")
    mlp_cluster.launch(x, w1, b1, w2, b2, res, out, act=1)
    torch.cuda.synchronize()
    assert rel_error(out, mlp_cluster.mlp_ref(x, w1, b1, w2, b2, res)) < REL_TOLERANCE[dtype]


@gpu
@pytest.mark.parametrize("m, d, f, pdl", [(32, 256, 1024, False), (32, 256, 1024, True), (77, 256, 512, True)])
def test_mlp_layernorm_folded_and_stats(m, d, f, pdl):
    """norm2 fused (fuse 2): LN applied from the producer's row sums with folded w1; row sums of y written."""
    _hopper()
    dtype = torch.float16
    x, w1, b1, w2, b2, res, gamma, beta = _inputs(m, d, f, dtype, seed=1)
    w1f, b1f, u = fold_layernorm(w1, b1, gamma, beta)
    xf = x.float()
    ln_stats = torch.stack([xf.sum(1), (xf * xf).sum(1)], dim=1)[None].contiguous()  # one part
    parts = mlp_cluster.stats_parts(d, f)
    stats = torch.full((parts, m, 2), float("nan"), device="cuda")
    out = torch.full((m, d), float("nan"), dtype=dtype, device="cuda")
    mlp_cluster.launch(x, w1f, b1f, w2, b2, res, out, act=3, stats_out=stats, ln_stats=ln_stats, ln_colsum=u,
                       pdl=pdl)
    torch.cuda.synchronize()
    ref = mlp_cluster.mlp_ref(x, w1, b1, w2, b2, res, ln=(gamma, beta))
    assert rel_error(out, ref) < REL_TOLERANCE[dtype]
    o = out.float()
    assert rel_error(stats.sum(0), torch.stack([o.sum(1), (o * o).sum(1)], dim=1)) < 1e-3
