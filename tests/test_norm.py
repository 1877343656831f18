import json

import pytest
import torch

from tuner.device import DeviceInfo
from tuner.kernels._common import rel_error, rel_tolerance
from tuner.kernels.norm import (NormConfig, NormProblem, check, effective_config, layer_norm, layer_norm_ref,
                                rms_norm, rms_norm_ref)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _inputs(m, n, dtype, device, seed):
    """Random, never-zero inputs: x with an offset and spread so LayerNorm's centring matters."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, n, generator=g) * 2.0 + 0.5).to(dtype).to(device)
    r = torch.randn(m, n, generator=g).to(dtype).to(device)
    w = (1.0 + 0.5 * torch.randn(n, generator=g)).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device)
    return x, r, w, b


def _nan(m, n, dtype, device):
    return torch.full((m, n), float("nan"), dtype=dtype, device=device)  # poisoned: every element must be written


def _run_and_check(kind, x, r, w, b, config, res, device, **kw):
    """Runs ``kind`` with poisoned outputs, compares with the fp32 reference under rel_tolerance."""
    m, n = x.shape
    dtype = x.dtype
    out = _nan(m, n, dtype, device)
    r_out = _nan(m, n, dtype, device) if res else None
    rr = r if res else None
    if kind == "layer":
        got = layer_norm(x, w, b, config=config, residual=rr, out=out, residual_out=r_out, **kw)
        ref = layer_norm_ref(x, w, b, residual=rr)
    else:
        got = rms_norm(x, w, config=config, residual=rr, out=out, residual_out=r_out, **kw)
        ref = rms_norm_ref(x, w, residual=rr)
    if res:
        y, s = got
        ref_y, ref_s = ref
        assert y is out and s is r_out
        err_s = rel_error(s, ref_s)
        assert err_s < rel_tolerance(dtype), f"residual sum: {err_s}"
    else:
        y, ref_y = got, ref
        assert y is out
    err = rel_error(y, ref_y)
    assert err < rel_tolerance(dtype), err


# (rows, cols, rows_per_program): rows not divisible by 4, cols not a power of two; 1 row at rpp 1 only
# (the check refuses more rows per program than the problem has).
CASES = [(37, 200, 1), (37, 200, 4), (17, 90, 1), (17, 90, 4), (1, 768, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("res", [False, True], ids=["nores", "res"])
@pytest.mark.parametrize("m, n, rpp", CASES, ids=[f"{m}x{n}-rpp{r}" for m, n, r in CASES])
def test_norm_odd_shapes(dtype, kind, res, m, n, rpp, device):
    seed = (m * 1000 + n * 10 + rpp + (kind == "rms") * 7 + res * 3) % 1000
    x, r, w, b = _inputs(m, n, dtype, device, seed)
    cfg = NormConfig(rows_per_program=rpp, num_warps=2)
    assert check(cfg, NormProblem(m, n)) is None
    _run_and_check(kind, x, r, w, b, cfg, res, device)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_norm_knobs_set(kind, device):
    # Ratios set: switched off in the interpreter, real PDL launch + prefetch on a Hopper GPU.
    m, n = 37, 200
    x, r, w, b = _inputs(m, n, torch.float16, device, seed=11)
    cfg = NormConfig(rows_per_program=4, num_warps=4, overlap_ratio=0.5, prefetch_ratio=1.0)
    assert check(cfg, NormProblem(m, n)) is None
    _run_and_check(kind, x, r, w, b, cfg, True, device)
    _run_and_check(kind, x, r, w, b, cfg, False, device)


def test_layer_norm_without_bias_and_allocated_outputs(device):
    m, n = 9, 130
    x, r, w, _ = _inputs(m, n, torch.float32, device, seed=5)
    y = layer_norm(x, w, None)
    assert y.dtype == x.dtype and rel_error(y, layer_norm_ref(x, w, None)) < rel_tolerance(torch.float32)
    y, s = rms_norm(x, w, residual=r, config=NormConfig(rows_per_program=2))
    ref_y, ref_s = rms_norm_ref(x, w, residual=r)
    assert s.dtype == x.dtype and s.shape == x.shape
    assert rel_error(y, ref_y) < rel_tolerance(torch.float32) and rel_error(s, ref_s) < rel_tolerance(torch.float32)


def test_racy_flag_runs_without_a_predecessor(device):
    # The test-only early read of x is harmless when nothing writes x concurrently: output stays exact.
    m, n = 17, 90
    x, r, w, b = _inputs(m, n, torch.float16, device, seed=7)
    _run_and_check("layer", x, r, w, b, NormConfig(rows_per_program=4), True, device, _racy_read_before_wait=True)


@pytest.mark.parametrize(
    "cfg, problem, needle",
    [
        (NormConfig(rows_per_program=3), NormProblem(128, 768), "power of two"),
        (NormConfig(rows_per_program=0), NormProblem(128, 768), "power of two"),
        (NormConfig(rows_per_program=128), NormProblem(4096, 768), "power of two"),
        (NormConfig(num_warps=3), NormProblem(128, 768), "num_warps"),
        (NormConfig(), NormProblem(128, 65537), "cols"),
        (NormConfig(rows_per_program=16), NormProblem(5, 768), "exceeds the problem"),
        (NormConfig(overlap_ratio=1.5), NormProblem(128, 768), "overlap_ratio"),
        (NormConfig(overlap_ratio=float("nan")), NormProblem(128, 768), "overlap_ratio"),
        (NormConfig(prefetch_ratio=float("nan")), NormProblem(128, 768), "prefetch_ratio"),
    ],
    ids=["rpp3", "rpp0", "rpp128", "warps3", "cols>64k", "rpp>rows", "overlap", "overlap-nan", "prefetch-nan"],
)
def test_check_rejects(cfg, problem, needle):
    why = check(cfg, problem, DeviceInfo.interpreter())
    assert why is not None and needle in why, why


def test_check_accepts_and_launcher_refuses_invalid(device):
    assert check(NormConfig(), NormProblem(128, 768)) is None
    assert check(NormConfig(rows_per_program=8, num_warps=16, overlap_ratio=0.0, prefetch_ratio=0.0),
                 NormProblem(5, 65536)) is None
    x, _, w, b = _inputs(4, 32, torch.float16, device, seed=0)
    with pytest.raises(ValueError, match="invalid NormConfig"):
        layer_norm(x, w, b, config=NormConfig(num_warps=3))
    with pytest.raises(ValueError, match="invalid NormConfig"):
        rms_norm(x, w, config=NormConfig(rows_per_program=8))


def test_norm_config_json_roundtrip():
    c = NormConfig(rows_per_program=8, num_warps=8, overlap_ratio=0.25, prefetch_ratio=1.0)
    assert NormConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert c.without_knobs() == NormConfig(rows_per_program=8, num_warps=8)
    with pytest.raises(ValueError, match="unknown keys.*rows_per_block"):
        NormConfig.from_dict({"rows_per_block": 2})


def test_interpreter_switches_knobs_off():
    if torch.cuda.is_available():
        pytest.skip("interpreter only")
    c = effective_config(NormConfig(overlap_ratio=0.6, prefetch_ratio=0.8), torch.zeros(1))
    assert c.overlap_ratio == -1.0 and c.prefetch_ratio == -1.0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("overlap", [0.0, 1.0])
@pytest.mark.parametrize("rpp", [1, 4], ids=["rpp1", "rpp4"])
def test_norm_pdl_chain_gpu(dtype, overlap, rpp, device):
    """PDL on: a PDL GEMM writes x, the norm (PDL, prefetch) reads it, another norm reads its output.

    Every kernel waits before reading its predecessor's output, so the chain must match the references.
    """
    from tuner.kernels.gemm import GemmConfig, linear, linear_ref

    m, n, k = 333, 768, 256
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(m, k, generator=g) / k**0.5).to(dtype).to(device)
    wg = torch.randn(n, k, generator=g).to(dtype).to(device)
    _, r, w, b = _inputs(m, n, dtype, device, seed=2)
    cfg = NormConfig(rows_per_program=rpp, num_warps=4, overlap_ratio=overlap, prefetch_ratio=1.0)
    if torch.cuda.get_device_capability()[0] >= 9:
        assert effective_config(cfg, a) == cfg
    for _ in range(3):
        out1, out2, s1 = _nan(m, n, dtype, device), _nan(m, n, dtype, device), _nan(m, n, dtype, device)
        x = linear(a, wg, config=GemmConfig(block_m=64, block_n=64, block_k=32, overlap_ratio=overlap))
        layer_norm(x, w, b, config=cfg, residual=r, out=out1, residual_out=s1)
        rms_norm(out1, w, config=cfg, out=out2)
        torch.cuda.synchronize()
        x_ref = linear_ref(a, wg).to(dtype)
        ref1, ref_s = layer_norm_ref(x_ref, w, b, residual=r)
        ref2 = rms_norm_ref(ref1.to(dtype), w)
        for got, ref in ((s1, ref_s), (out1, ref1), (out2, ref2)):
            assert rel_error(got, ref) < rel_tolerance(dtype)
