import json
import zlib
from dataclasses import replace

import numpy as np
import pytest
import torch

from tuner.device import DeviceInfo
from tuner.kernels._common import rel_error, rel_tolerance
from tuner.kernels.gemm import GemmConfig, GemmProblem, NoReduction, check, linear, linear_ref, smem_bytes

from devices import A100, H100  # (tests/ is on sys.path under pytest)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _inputs(m, n, k, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) / k**0.5).to(dtype).to(device)
    w = torch.randn(n, k, generator=g).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device)
    r = torch.randn(m, n, generator=g).to(dtype).to(device)
    return x, w, b, r


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation", [None, "gelu", "silu"], ids=["id", "gelu", "silu"])
@pytest.mark.parametrize("res", [False, True], ids=["nores", "res"])
def test_linear_odd_shape(dtype, bias, activation, res, device):
    m, k, n = 37, 200, 90
    x, w, b, r = _inputs(m, n, k, dtype, device, seed=zlib.crc32(repr((bias, activation, res)).encode()) % 1000)
    b = b if bias else None
    r = r if res else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)  # poisoned: every element must be written
    cfg = GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=2, num_stages=2)
    linear(x, w, b, config=cfg, activation=activation, residual=r, out=out)
    err = rel_error(out, linear_ref(x, w, b, activation=activation, residual=r))
    assert err < rel_tolerance(dtype), err


def test_the_interpreter_rounds_bf16_to_nearest():
    # The Triton interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest even): kernels/_common wraps its
    # conversion, so that the CPU's bfloat16 errors are the GPU's (half of them, until session 48) and its bound 1e-2
    import triton
    import triton.language as tl

    from tuner.kernels._common import INTERPRETER_ROUNDS_BF16, interpreting

    if not interpreting():
        pytest.skip("the interpreter's conversion (on the GPU the hardware rounds)")
    assert INTERPRETER_ROUNDS_BF16 and rel_tolerance(torch.bfloat16) == 1e-2

    @triton.jit
    def store(x_ptr, y_ptr, z_ptr, N: tl.constexpr):
        o = tl.arange(0, N)
        v = tl.load(x_ptr + o)
        tl.store(y_ptr + o, v)  # (the store's own conversion)
        tl.store(z_ptr + o, (v * 1.0).to(tl.bfloat16))

    x = torch.randn(1024, generator=torch.Generator().manual_seed(0)) * torch.logspace(-40, 38, 1024)
    x[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    y, z = torch.empty(1024, dtype=torch.bfloat16), torch.empty(1024, dtype=torch.bfloat16)
    store[(1,)](x, y, z, 1024)
    want = x.to(torch.bfloat16).view(torch.int16)
    assert torch.equal(y.view(torch.int16), want) and torch.equal(z.view(torch.int16), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("split_k", [2, 3, 7])
def test_linear_split_k(dtype, split_k, device):
    m, k, n = 37, 200, 90
    x, w, b, r = _inputs(m, n, k, dtype, device, seed=split_k)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    cfg = GemmConfig(block_m=16, block_n=32, block_k=16, split_k=split_k, overlap_ratio=0.5, prefetch_ratio=1.0)
    assert check(cfg, GemmProblem(m, n, k)) is None
    linear(x, w, b, config=cfg, activation="gelu", residual=r, out=out)
    assert rel_error(out, linear_ref(x, w, b, activation="gelu", residual=r)) < rel_tolerance(dtype)


def test_racy_reduction_needs_a_reduction_kernel(device):
    # tune verify's racy split-K reduction (its partials read before gdc_wait): launched without PDL it has nothing to
    # race with and reduces as the shipped kernel does; a launch without a reduction kernel refuses it
    m, k, n = 37, 200, 90
    x, w, b, r = _inputs(m, n, k, torch.float16, device, seed=11)
    cfg = GemmConfig(block_m=16, block_n=32, block_k=16, split_k=3)
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device=device)
    linear(x, w, b, config=cfg, residual=r, out=out, _racy_reduce=True)
    assert rel_error(out, linear_ref(x, w, b, residual=r)) < rel_tolerance(torch.float16)
    with pytest.raises(NoReduction, match="_racy_reduce is a defect of the split-K reduction kernel"):
        linear(x, w, b, config=replace(cfg, split_k=1), out=out, _racy_reduce=True)


def test_linear_big_tile_small_problem(device):
    # Tiles larger than the problem in M (masked rows), the biggest tile the check allows for N and K.
    m, k, n = 5, 64, 128
    x, w, b, _ = _inputs(m, n, k, torch.float16, device, seed=3)
    cfg = GemmConfig(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=1)
    out = linear(x, w, b, config=cfg)
    assert rel_error(out, linear_ref(x, w, b)) < 1e-2


@pytest.mark.parametrize(
    "cfg, problem, needle",
    [
        (GemmConfig(block_m=48), GemmProblem(128, 768, 768), "power of two"),
        (GemmConfig(block_k=8), GemmProblem(128, 768, 768), "power of two"),
        (GemmConfig(num_warps=3), GemmProblem(128, 768, 768), "num_warps"),
        (GemmConfig(block_k=64, split_k=13), GemmProblem(128, 768, 768), "exceeds the 12 K tiles"),
        (GemmConfig(block_k=64, split_k=5), GemmProblem(128, 768, 768), "without K tiles"),
        (GemmConfig(block_m=128, block_n=256, block_k=128, num_stages=4), GemmProblem(128, 768, 768), "shared memory"),
        (GemmConfig(block_m=256), GemmProblem(128, 768, 768), "exceeds the problem"),
        (GemmConfig(block_m=128, block_n=256, num_warps=2), GemmProblem(128, 768, 768), "registers"),
        (GemmConfig(overlap_ratio=1.5), GemmProblem(128, 768, 768), "overlap_ratio"),
        (GemmConfig(prefetch_ratio=float("nan")), GemmProblem(128, 768, 768), "prefetch_ratio"),
        (GemmConfig(hints=3), GemmProblem(128, 768, 768), "hints=3 must be 0 or 1"),
        (GemmConfig(split_k=8), GemmProblem(32768, 12288, 4096), "split_k*M*N = 3221225472"),  # a 7B QKV prefill
    ],
    ids=["bm48", "bk8", "warps3", "splitk>tiles", "empty-split", "smem", "bm>M", "regs", "overlap", "nan", "hints3",
         "workspace>int32"],
)
def test_check_rejects(cfg, problem, needle):
    why = check(cfg, problem, DeviceInfo.interpreter())
    assert why is not None and needle in why, why


def test_fit_keeps_the_split_k_workspace_within_32_bit_offsets():
    from tuner.kernels.gemm import fit

    qkv = GemmProblem(32768, 12288, 4096)  # 7B-class prefill (32x1024 tokens): split 8 would index 3.2e9 partials
    assert fit(GemmConfig(split_k=8), qkv).split_k == 4 and check(fit(GemmConfig(split_k=8), qkv), qkv) is None
    assert fit(GemmConfig(split_k=8), GemmProblem(128, 768, 3072)).split_k == 8  # (small M: untouched)


def test_check_accepts_defaults_and_linear_refuses_invalid(device):
    assert check(GemmConfig(), GemmProblem(128, 768, 768)) is None
    x, w, _, _ = _inputs(16, 32, 32, torch.float16, device, seed=0)
    with pytest.raises(ValueError, match="invalid GemmConfig"):
        linear(x, w, config=GemmConfig(block_m=48))


def test_gemm_config_json_roundtrip():
    c = GemmConfig(block_m=32, block_n=128, block_k=64, group_m=4, num_warps=8, num_stages=4, split_k=2,
                   overlap_ratio=0.4, prefetch_ratio=1.0)
    assert GemmConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(ValueError, match="unknown keys"):
        GemmConfig.from_dict({"block_q": 3})
    # JSON numbers or CSV text; a fraction, a boolean or a word is named, never rounded to a tile
    assert GemmConfig.from_dict({"block_m": "64", "split_k": 2.0, "overlap_ratio": "0.2"}) == GemmConfig(
        block_m=64, split_k=2, overlap_ratio=0.2)
    for field, value in (("block_m", 64.7), ("num_warps", True), ("block_k", "big"), ("prefetch_ratio", "most")):
        with pytest.raises(ValueError, match=f"GemmConfig: {field}={value!r} must be"):
            GemmConfig.from_dict({field: value})
    # numpy's numbers (a table's) are read; an integer past a float's range is refused, not an OverflowError
    assert GemmConfig.from_dict({"block_m": np.int64(64), "overlap_ratio": np.float64(0.5)}) == GemmConfig(
        block_m=64, overlap_ratio=0.5)
    with pytest.raises(ValueError, match="GemmConfig: block_m=1000.* must be an integer"):
        GemmConfig.from_dict({"block_m": 10**400})


def test_interpreter_switches_knobs_off():
    if torch.cuda.is_available():
        pytest.skip("interpreter only")
    from tuner.kernels.gemm import effective_config

    c = effective_config(GemmConfig(overlap_ratio=0.6, prefetch_ratio=0.8), torch.zeros(1))
    assert c.overlap_ratio == -1.0 and c.prefetch_ratio == -1.0


def test_fast_gelu_only_where_inline_asm_runs():
    # ACT 3 (GELU with tanh.approx.f32, inline asm) only on a GPU outside the interpreter; the interpreter and
    # CPU tensors get the exp/divide form (ACT 1), which the odd-shape tests above check against torch.
    from tuner.kernels.gemm import act_code

    assert act_code("gelu", torch.zeros(1)) == 1 and act_code(None, torch.zeros(1)) == 0
    assert act_code("silu", torch.zeros(1)) == 2


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("split_k", [1, 3])
def test_linear_layernorm_prologue(dtype, split_k, device):
    m, k, n = 37, 200, 90
    x, w, b, r = _inputs(m, n, k, dtype, device, seed=11 + split_k)
    x = (x * k**0.5 + 0.5).to(dtype)  # O(1) rows with a non-zero mean, as in a residual stream
    g = torch.Generator().manual_seed(5)
    lw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(device)
    lb = (0.1 * torch.randn(k, generator=g)).to(dtype).to(device)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    cfg = GemmConfig(block_m=16, block_n=32, block_k=32, split_k=split_k)
    linear(x, w, b, config=cfg, activation="gelu", residual=r, out=out, ln_weight=lw, ln_bias=lb)
    ref = linear_ref(x, w, b, activation="gelu", residual=r, ln_weight=lw, ln_bias=lb)
    assert rel_error(out, ref) < rel_tolerance(dtype)


def test_linear_layernorm_needs_both(device):
    x, w, _, _ = _inputs(16, 32, 32, torch.float16, device, seed=0)
    with pytest.raises(ValueError, match="go together"):
        linear(x, w, config=GemmConfig(block_m=16, block_n=32, block_k=32),
               ln_weight=torch.ones(32, dtype=torch.float16, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("block_k, stages, warps", [(64, 4, 4), (128, 2, 4), (128, 4, 4), (128, 6, 4), (256, 3, 4)])
def test_layernorm_prologue_on_gpu_tiles(block_k, stages, warps):
    # Regression: reducing the MMA operand for the row sums came out wrong at block_k 128 / 4 warps
    # (triton 3.6, H200); the kept path reloads the tile for the statistics.
    from tuner.kernels.gemm import fold_layernorm

    m, k, n = 128, 768, 2304
    x, w, b, _ = _inputs(m, n, k, torch.float16, "cuda", seed=21)
    x = (x * k**0.5 + 0.3).half()
    g = torch.Generator().manual_seed(8)
    lw = (1 + 0.1 * torch.randn(k, generator=g)).half().cuda()
    lb = (0.1 * torch.randn(k, generator=g)).half().cuda()
    wf, bf, u = fold_layernorm(w, b, lw, lb)
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    cfg = GemmConfig(block_m=64, block_n=64, block_k=block_k, num_stages=stages, num_warps=warps, overlap_ratio=0.0)
    linear(x, wf, bf, config=cfg, ln_colsum=u, out=out)
    torch.cuda.synchronize()
    assert rel_error(out, linear_ref(x, w, b, ln_weight=lw, ln_bias=lb)) < 1e-2


# bert-base's GEMMs, each launched with the epilogue the layer gives it (a fused LayerNorm's row sums gathered in the
# K loop, ln 1, or read from the producer's stats_out, ln 2: the problem's ln_parts, 12 from 64-column tiles, 2 or 3
# from wider ones), and a config for each way the count can come out: wgmma buffers (block_m >= 64, 4 or 8 warps),
# mma.sync's one fewer (block_m 32, or 2 warps), TMA's mbarriers, one stage, the split-K partial tile over a small loop
# (128x256, 8 warps: 131072 B against 49152 of buffers), over the limit, and the row sums' scratch (stats_scratch:
# warps across a few parts, 16 rows at 16 warps).
BERT_GEMMS = {"qkv": (GemmProblem(128, 2304, 768), dict(bias=True, ln=1)),
              "qkv-stats": (GemmProblem(128, 2304, 768, ln_parts=12), dict(bias=True, ln=2)),
              "out": (GemmProblem(128, 768, 768), dict(bias=True, residual=True, stats_out=True)),
              "ffn1": (GemmProblem(128, 3072, 768, ln_parts=12), dict(bias=True, activation="gelu", ln=2)),
              "ffn1-2": (GemmProblem(128, 3072, 768, ln_parts=2), dict(bias=True, activation="gelu", ln=2)),
              "ffn1-3": (GemmProblem(128, 3072, 768, ln_parts=3), dict(bias=True, activation="gelu", ln=2)),
              "ffn2": (GemmProblem(128, 768, 3072), dict(bias=True, residual=True))}
SMEM_CASES = {
    "wgmma": ("ffn1", GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4)),
    "wgmma-tma": ("qkv", GemmConfig(block_m=64, block_n=128, block_k=128, num_stages=3, tma=1)),
    "mma.sync-tma": ("ffn2", GemmConfig(block_m=32, block_n=64, block_k=128, num_stages=5, tma=1)),
    "mma.sync": ("out", GemmConfig(block_m=32, block_n=128, block_k=64, num_stages=4)),
    "2warps": ("ffn1", GemmConfig(block_m=64, block_n=64, block_k=64, num_warps=2, num_stages=3)),
    "1stage": ("ffn1", GemmConfig(block_m=64, block_n=64, block_k=64, num_stages=1)),
    "split-partial": ("out", GemmConfig(block_m=128, block_n=256, block_k=32, num_warps=8, num_stages=2, split_k=2)),
    "split-tma": ("qkv-stats", GemmConfig(block_m=128, block_n=64, block_k=64, num_stages=6, split_k=3, tma=1)),
    "over-limit": ("ffn2", GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4)),
    "2parts": ("ffn1-2", GemmConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=4)),
    "3parts": ("ffn1-3", GemmConfig(block_m=32, block_n=64, block_k=64, num_warps=8, num_stages=3)),
    "16rows-16warps": ("ffn1", GemmConfig(block_m=16, block_n=128, block_k=64, num_warps=16, num_stages=3)),
}


def test_smem_bytes_is_what_triton_allocates():
    """The count against triton.compile's allocation for sm_90 (every case) and sm_80 (mma.sync everywhere: the wgmma
    case one buffer fewer, and over the A100's limit), as linear() launches the kernel there, with the problem's
    row-sum parts; and check() refuses exactly the cases over the GPU's limit. No GPU needed (tests/compile_smem.py)."""
    from dataclasses import asdict

    import triton

    from tuner.kernels.gemm import TRITON_VERSION

    if TRITON_VERSION not in ((3, 6), (3, 9)):
        # The count is calibrated on triton 3.6, the GPU machines' version (CI pins it too), and checked on 3.9.
        pytest.skip(f"the shared-memory count is checked on triton 3.6 and 3.9, not {triton.__version__}")

    from compile_smem import compiled_shared

    def count(name, dev):
        gemm, c = SMEM_CASES[name]
        return smem_bytes(c, 2, dev, BERT_GEMMS[gemm][0].ln_parts)

    def case(name, arch):
        gemm, c = SMEM_CASES[name]
        p, launch = BERT_GEMMS[gemm]
        launch = dict(launch, ln_parts=p.ln_parts) if launch.get("ln") == 2 else launch
        return dict(kind="gemm", config=asdict(c), problem=[p.m, p.n, p.k], launch=launch, arch=arch)

    cases = {f"{name}/sm_90": (name, H100) for name in SMEM_CASES}
    cases.update({f"{name}/sm_80": (name, A100) for name in ("wgmma", "over-limit")})
    compiled = dict(zip(cases, compiled_shared([case(name, dev.capability[0] * 10) for name, dev in cases.values()])))
    assert {k: count(name, dev) for k, (name, dev) in cases.items()} == compiled
    for k, (name, dev) in cases.items():
        gemm, c = SMEM_CASES[name]
        why = check(c, BERT_GEMMS[gemm][0], dev) or ""
        assert ("shared memory" in why) == (compiled[k] > dev.smem_per_block_bytes), (k, why)


def test_repair_moves_configs_inside_the_limits():
    from tuner.kernels.gemm import repair

    p = GemmProblem(128, 3072, 768)
    c = repair(GemmConfig(block_m=128, block_n=256, block_k=256, num_stages=6, num_warps=2), p, DeviceInfo.interpreter())
    assert check(c, p, DeviceInfo.interpreter()) is None
    assert (c.block_m, c.block_n, c.block_k) == (128, 256, 256) and c.num_warps == 4 and c.num_stages == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("split_producer, split_consumer", [(1, 1), (3, 1), (1, 3), (2, 2)])
def test_layernorm_statistics_from_the_producer(dtype, split_producer, split_consumer, device):
    # h = x @ W1.T + b1 + r writes its rows' sums (stats_out); the next GEMM normalises h with them
    # (ln_stats) instead of gathering them in its K loop: LN(h) @ W2.T + b2 as the reference computes it.
    from tuner.kernels.gemm import fold_layernorm, stats_parts

    m, k1, d, n = 37, 72, 90, 50
    x, w1, b1, _ = _inputs(m, d, k1, dtype, device, seed=40 + split_producer)
    r = (torch.randn(m, d, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype).to(device)
    _, w2, b2, _ = _inputs(m, n, d, dtype, device, seed=50 + split_consumer)
    g = torch.Generator().manual_seed(6)
    lw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(device)
    lb = (0.1 * torch.randn(d, generator=g)).to(dtype).to(device)
    c1 = GemmConfig(block_m=16, block_n=32, block_k=16, split_k=split_producer)
    c2 = GemmConfig(block_m=16, block_n=32, block_k=32, split_k=split_consumer)
    stats = torch.full((stats_parts(c1, d), m, 2), float("nan"), dtype=torch.float32, device=device)
    h = linear(x, w1, b1, config=c1, residual=r, stats_out=stats)
    wf, bf, u = fold_layernorm(w2, b2, lw, lb)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    linear(h, wf, bf, config=c2, out=out, ln_colsum=u, ln_stats=stats, activation="gelu")
    ref = linear_ref(h, w2, b2, ln_weight=lw, ln_bias=lb, activation="gelu")
    assert rel_error(out, ref) < rel_tolerance(dtype)
    hf = h.float()
    # The sums are of the fp32 values before their rounding to h's dtype: within its half-ulps.
    rtol = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(stats.sum(0)[:, 0], hf.sum(1), rtol=rtol, atol=1e-2)
    with pytest.raises(ValueError, match="stats_out must be fp32"):
        linear(x, w1, b1, config=c1, stats_out=stats[:1])
    with pytest.raises(ValueError, match="ln_stats must be fp32"):
        linear(h, w2, b2, config=c2, ln_stats=stats)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("split_k", [1, 3])
def test_linear_tma_loads(dtype, split_k, device):
    # TMA tiles past the edges of x and w read as zeros: odd M and N, K a 16-byte multiple, tiles bigger
    # than the rest of the problem; the same result as the cp.async path.
    m, k, n = 37, 208, 90
    x, w, b, r = _inputs(m, n, k, dtype, device, seed=60 + split_k)
    cfg = GemmConfig(block_m=16, block_n=32, block_k=32, split_k=split_k, tma=1)
    assert check(cfg, GemmProblem(m, n, k, x.element_size())) is None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    linear(x, w, b, config=cfg, activation="gelu", residual=r, out=out)
    assert rel_error(out, linear_ref(x, w, b, activation="gelu", residual=r)) < rel_tolerance(dtype)
    assert "16-byte" in check(replace(cfg, split_k=1), GemmProblem(m, n, 90, 2))
    with pytest.raises(ValueError, match="tma=1 needs x with contiguous"):  # a column view: no descriptor
        linear(torch.empty(k, m, dtype=dtype, device=device).T, w, b, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("split_k, overlap", [(1, 0.0), (4, 0.0), (1, -1.0)])
def test_linear_tma_on_gpu(split_k, overlap):
    m, k, n = 128, 3072, 768
    x, w, b, r = _inputs(m, n, k, torch.float16, "cuda", seed=70 + split_k)
    cfg = GemmConfig(block_m=64, block_n=64, block_k=128, num_stages=4, split_k=split_k, tma=1,
                     overlap_ratio=overlap, prefetch_ratio=1.0 if overlap >= 0 else -1.0)
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    linear(x, w, b, config=cfg, residual=r, out=out)
    torch.cuda.synchronize()
    assert rel_error(out, linear_ref(x, w, b, residual=r)) < 1e-2


@pytest.mark.gpu
def test_linear_trace_stamps_are_ordered():
    # scripts/trace_gemms.py's stamps: every program writes entry <= after wait <= after loop <= end.
    m, k, n = 128, 768, 768
    x, w, b, r = _inputs(m, n, k, torch.float16, "cuda", seed=91)
    cfg = GemmConfig(block_m=64, block_n=64, block_k=128, num_stages=4, tma=1, overlap_ratio=0.0, prefetch_ratio=1.0)
    trace = torch.zeros(24, 4, dtype=torch.int64, device="cuda")
    out = linear(x, w, b, config=cfg, residual=r, _trace=trace)
    torch.cuda.synchronize()
    assert rel_error(out, linear_ref(x, w, b, residual=r)) < 1e-2
    assert (trace > 0).all() and (trace.diff(dim=1) >= 0).all(), trace
    with pytest.raises(ValueError, match="_trace must be int64"):
        linear(x, w, b, config=cfg, _trace=trace[:3])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [128, 100])  # the even build (tiles divide the shape) and the general one
def test_cluster_linear_trace_stamps_are_ordered(m):
    # The cluster GEMM's traced build (CG_DIAG bit 0, hopper.cuh's trace_stamp): every program of every split writes
    # entry <= after wait <= after loop <= end, and the output is the untraced build's.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cluster kernel needs a Hopper GPU")
    k, n, split = 768, 768, 4
    x, w, b, r = _inputs(m, n, k, torch.float16, "cuda", seed=92)
    cfg = GemmConfig(block_m=64, block_n=64, block_k=64, num_stages=6, split_k=split, tma=1, cluster=2,
                     overlap_ratio=0.0, prefetch_ratio=1.0)
    programs = -(-m // 64) * (n // 64) * split
    trace = torch.zeros(programs, 4, dtype=torch.int64, device="cuda")
    out = linear(x, w, b, config=cfg, residual=r, _trace=trace)
    plain = linear(x, w, b, config=cfg, residual=r)
    torch.cuda.synchronize()
    assert rel_error(out, linear_ref(x, w, b, residual=r)) < 1e-2
    assert torch.equal(out, plain)
    assert (trace > 0).all() and (trace.diff(dim=1) >= 0).all(), trace


@pytest.mark.gpu
def test_tma_descriptor_prefetch_names_the_descriptors():
    # _prefetch_tma_descriptors names the PTX parameters of x_desc and w_desc by position: every TMA build
    # launched with PDL must declare both as 128-byte parameters there (and prefetch them).
    import tuner.kernels.gemm as gemm_k

    m, k, n = 96, 256, 160
    x, w, b, r = _inputs(m, n, k, torch.float16, "cuda", seed=93)
    cfg = GemmConfig(block_m=64, block_n=64, block_k=64, num_stages=3, tma=1, overlap_ratio=0.0, prefetch_ratio=1.0)
    out = linear(x, w, b, config=cfg, residual=r)
    torch.cuda.synchronize()
    assert rel_error(out, linear_ref(x, w, b, residual=r)) < 1e-2
    builds = [kern for cache in gemm_k._gemm_kernel.device_caches.values() for kern in cache[0].values()]
    ptx = [kern.asm["ptx"] for kern in builds if "prefetch.param.tensormap" in kern.asm["ptx"]]
    assert ptx
    for text in ptx:
        assert ".param .align 64 .b8 _gemm_kernel_param_11[128]" in text
        assert ".param .align 64 .b8 _gemm_kernel_param_16[128]" in text


@pytest.mark.gpu
def test_one_stage_split_k_tma_with_pdl_runs():
    # Regression: with the TMA descriptors prefetched at kernel entry, one stage, split-K, TMA and PDL failed with
    # an illegal instruction (the crashed trials of sessions 6-7). scripts/crash_probe.py runs the config in a
    # process of its own: a crash would poison this one's CUDA context.
    import subprocess
    import sys
    from pathlib import Path

    probe = Path(__file__).resolve().parents[1] / "scripts" / "crash_probe.py"
    spec = ("block_m=64,block_n=64,block_k=64,num_stages=1,split_k=3,tma=1,overlap_ratio=0.0,"
            "prefetch_ratio=0.0")
    r = subprocess.run([sys.executable, str(probe), "128", "768", "768", spec], capture_output=True, text=True,
                       timeout=300)
    line = r.stdout.strip().splitlines()[-1]
    assert r.returncode == 0 and ": ok " in line, r.stdout[-2000:] + r.stderr[-2000:]
    assert float(line.rsplit(" ", 1)[1]) < 1e-2
