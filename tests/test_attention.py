import json
import math

import pytest
import torch

from tuner.device import DeviceInfo
from tuner.kernels import attention as attn_mod
from tuner.kernels._common import rel_error, rel_tolerance
from tuner.kernels.attention import AttnConfig, AttnProblem, attention, attention_ref, check, effective_config

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _qkv(batch, seq, heads, head_dim, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch * seq, 3 * heads * head_dim, generator=g).to(dtype).to(device)


def _poisoned(batch, seq, heads, head_dim, dtype, device):
    # Every element must be written: an unwritten one stays NaN and rel_error turns it into inf.
    return torch.full((batch * seq, heads * head_dim), float("nan"), dtype=dtype, device=device)


# (batch, seq, heads, head_dim), block_m, block_n: odd sequence tails, several heads, the padded head dim
# (48 -> 64) and the widest head dim (128).
SHAPES = [
    ((1, 17, 1, 32), 16, 16),
    ((2, 33, 3, 64), 32, 16),
    ((1, 40, 2, 48), 16, 32),
    ((1, 20, 1, 128), 16, 16),
]
SHAPE_IDS = ["b1s17h1d32", "b2s33h3d64", "b1s40h2d48", "b1s20h1d128"]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("shape, bm, bn", SHAPES, ids=SHAPE_IDS)
def test_attention_matches_ref(shape, bm, bn, dtype, causal, device):
    b, s, h, d = shape
    qkv = _qkv(b, s, h, d, dtype, device, seed=s * 7 + d)
    before = qkv.clone()
    out = _poisoned(b, s, h, d, dtype, device)
    cfg = AttnConfig(block_m=bm, block_n=bn, num_warps=2, num_stages=2)
    assert check(cfg, AttnProblem(b, s, h, d, qkv.element_size())) is None
    res = attention(qkv, batch=b, seq=s, heads=h, head_dim=d, config=cfg, out=out, causal=causal)
    assert res is out
    err = rel_error(out, attention_ref(qkv, batch=b, seq=s, heads=h, head_dim=d, causal=causal))
    assert err < rel_tolerance(dtype), err
    assert torch.equal(qkv, before)  # read only


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("bm, bn", [(16, 16), (16, 32), (32, 16), (32, 32)], ids=["16x16", "16x32", "32x16", "32x32"])
def test_attention_block_combos(bm, bn, causal, device):
    # seq 37: neither a multiple of 16 nor of 32, so every combo has a ragged last query and key block,
    # and causal programs of block_m != block_n stop at a diagonal block that is only partly visible.
    b, s, h, d = 1, 37, 2, 32
    qkv = _qkv(b, s, h, d, torch.float16, device, seed=bm + bn)
    out = _poisoned(b, s, h, d, torch.float16, device)
    attention(qkv, batch=b, seq=s, heads=h, head_dim=d, config=AttnConfig(block_m=bm, block_n=bn), out=out,
              causal=causal)
    err = rel_error(out, attention_ref(qkv, batch=b, seq=s, heads=h, head_dim=d, causal=causal))
    assert err < rel_tolerance(torch.float16), err


def test_causal_differs_from_full(device):
    # Guards the test itself: the two references must differ on these inputs, else causal masking goes untested.
    b, s, h, d = 1, 17, 1, 32
    qkv = _qkv(b, s, h, d, torch.float32, device, seed=1)
    r_c = attention_ref(qkv, batch=b, seq=s, heads=h, head_dim=d, causal=True)
    r_f = attention_ref(qkv, batch=b, seq=s, heads=h, head_dim=d, causal=False)
    assert rel_error(r_c, r_f) > 0.1


def test_sm_scale(device):
    b, s, h, d = 1, 17, 1, 32
    qkv = _qkv(b, s, h, d, torch.float32, device, seed=2)
    cfg = AttnConfig(block_m=16, block_n=16)
    out = attention(qkv, batch=b, seq=s, heads=h, head_dim=d, config=cfg, sm_scale=0.5)
    assert rel_error(out, attention_ref(qkv, batch=b, seq=s, heads=h, head_dim=d, sm_scale=0.5)) < 5e-3
    assert rel_error(out, attention_ref(qkv, batch=b, seq=s, heads=h, head_dim=d)) > 1e-2


def test_reads_qkv_in_place_and_writes_strided_out(device, monkeypatch):
    # qkv and out are column slices of wider NaN-padded buffers (row strides != 3D and != D): the kernel
    # must use their strides, touch nothing outside them, and get the tensors themselves (no copy).
    b, s, h, d = 2, 19, 2, 32
    D = h * d
    dtype = torch.float16
    buf = torch.full((b * s, 3 * D + 24), float("nan"), dtype=dtype, device=device)
    qkv = buf[:, 8:8 + 3 * D]
    qkv.copy_(_qkv(b, s, h, d, dtype, device, seed=5))
    assert not qkv.is_contiguous() and qkv.stride(0) == 3 * D + 24
    obuf = torch.full((b * s, D + 16), -7.0, dtype=dtype, device=device)
    out = obuf[:, 16:]
    out.fill_(float("nan"))

    seen = {}
    real = attn_mod._attn_fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen["args"] = args
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(attn_mod, "_attn_fwd_kernel", Spy())
    res = attention(qkv, batch=b, seq=s, heads=h, head_dim=d, config=AttnConfig(block_m=16, block_n=16), out=out)
    assert res is out
    qkv_arg, out_arg = seen["args"][:2]
    assert qkv_arg is qkv and out_arg is out
    assert qkv_arg.data_ptr() == buf.data_ptr() + 8 * buf.element_size()
    err = rel_error(out, attention_ref(qkv, batch=b, seq=s, heads=h, head_dim=d))
    assert err < rel_tolerance(dtype), err
    assert torch.all(obuf[:, :16] == -7.0)  # nothing written left of the slice


@pytest.mark.parametrize("limit", [None, 14], ids=["two-axes", "one-axis"])
@pytest.mark.parametrize("bm", [16, 32])
def test_grid_covers_every_tile_and_pair(bm, limit, device, monkeypatch):
    # Up to a grid's second-axis limit (65535; 14 here, so that the interpreter runs both) the grid is (query tiles,
    # (sequence, head) pairs); past it, one axis in the same order. Either maps onto every (query tile, batch, head).
    b, s, h, d = 3, 41, 5, 32
    if limit is not None:
        monkeypatch.setattr(attn_mod, "GRID_YZ_LIMIT", limit)
    qkv = _qkv(b, s, h, d, torch.float16, device, seed=9)
    out = _poisoned(b, s, h, d, torch.float16, device)
    grids = []
    real = attn_mod._attn_fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(attn_mod, "_attn_fwd_kernel", Spy())
    attention(qkv, batch=b, seq=s, heads=h, head_dim=d, config=AttnConfig(block_m=bm, block_n=16), out=out)
    tiles = -(-s // bm)
    assert grids == [(tiles, b * h) if limit is None else (tiles * b * h,)]
    err = rel_error(out, attention_ref(qkv, batch=b, seq=s, heads=h, head_dim=d))
    assert err < rel_tolerance(torch.float16), err


@pytest.mark.gpu
def test_more_pairs_than_a_grid_axis_holds_gpu():
    # 4,100 sequences x 16 heads = 65,600 (sequence, head) pairs: past a grid's second axis (65535), the kernel's
    # one-axis grid (until session 46 the shape was refused).
    b, s, h, d = 4100, 5, 16, 32
    qkv = _qkv(b, s, h, d, torch.float16, "cuda", seed=12)
    out = _poisoned(b, s, h, d, torch.float16, "cuda")
    attention(qkv, batch=b, seq=s, heads=h, head_dim=d, config=AttnConfig(block_m=16, block_n=16), out=out)
    err = rel_error(out, attention_ref(qkv, batch=b, seq=s, heads=h, head_dim=d))
    assert err < rel_tolerance(torch.float16), err


def test_transposed_qkv_storage(device):
    # Column stride != 1 (qkv stored column-major): still read through its strides.
    b, s, h, d = 1, 17, 1, 32
    base = _qkv(b, s, h, d, torch.float32, device, seed=6)
    qkv = base.t().contiguous().t()
    assert qkv.stride() == (1, b * s)
    out = attention(qkv, batch=b, seq=s, heads=h, head_dim=d, config=AttnConfig(block_m=16, block_n=16))
    assert rel_error(out, attention_ref(base, batch=b, seq=s, heads=h, head_dim=d)) < rel_tolerance(torch.float32)


P = AttnProblem(batch=2, seq=128, heads=12, head_dim=64)


@pytest.mark.parametrize(
    "cfg, problem, needle",
    [
        (AttnConfig(block_m=48), P, "power of two"),
        (AttnConfig(block_n=8), P, "power of two"),
        (AttnConfig(num_warps=3), P, "num_warps"),
        (AttnConfig(num_stages=0), P, "num_stages"),
        (AttnConfig(num_stages=9), P, "num_stages"),
        (AttnConfig(), AttnProblem(2, 128, 12, 16), "head_dim=16"),
        (AttnConfig(), AttnProblem(2, 128, 2, 256), "head_dim=256"),
        (AttnConfig(block_m=64), AttnProblem(1, 17, 1, 32), "exceeds the problem"),
        (AttnConfig(block_m=16, block_n=256), P, "exceeds the problem"),
        (AttnConfig(block_m=128, block_n=256, num_stages=4), AttnProblem(1, 1024, 8, 128), "shared memory"),
        (AttnConfig(overlap_ratio=1.5), P, "overlap_ratio"),
        (AttnConfig(overlap_ratio=float("nan")), P, "overlap_ratio"),
        (AttnConfig(prefetch_ratio=0.0), P, "attention has no weights to prefetch"),
        (AttnConfig(prefetch_ratio=float("nan")), P, "attention has no weights to prefetch"),
        (AttnConfig(), AttnProblem(0, 128, 12, 64), "batch"),
    ],
    ids=["bm48", "bn8", "warps3", "stages0", "stages9", "hd16", "hd256", "bm>seq", "bn>seq", "smem",
         "overlap1.5", "overlap-nan", "prefetch", "prefetch-nan", "batch0"],
)
def test_check_rejects(cfg, problem, needle):
    why = check(cfg, problem, DeviceInfo.interpreter())
    assert why is not None and needle in why, why


def test_check_smem_uses_device_limit():
    cfg = AttnConfig(block_m=128, block_n=128, num_stages=4)
    p = AttnProblem(1, 1024, 8, 128)  # 4*128*128*2*2 + 128*128*2 = 294912 B > 227 KiB
    assert "shared memory" in check(cfg, p)
    assert "shared memory" in check(cfg, p, DeviceInfo.interpreter())
    big = DeviceInfo("big", (9, 0), 132, 50 * 2**20, 288 * 1024)
    assert check(cfg, p, big) is None


@pytest.mark.parametrize("head_dim", [32, 48, 80, 96, 128])
def test_check_accepts(head_dim):
    assert check(AttnConfig(), AttnProblem(1, 128, 4, head_dim)) is None
    assert check(AttnConfig(overlap_ratio=0.0), AttnProblem(1, 128, 4, head_dim)) is None
    assert check(AttnConfig(overlap_ratio=1.0), AttnProblem(1, 128, 4, head_dim)) is None


def test_attention_refuses_invalid(device):
    qkv = _qkv(1, 17, 1, 32, torch.float16, device, seed=0)
    with pytest.raises(ValueError, match="invalid AttnConfig"):
        attention(qkv, batch=1, seq=17, heads=1, head_dim=32, config=AttnConfig(block_m=64))
    with pytest.raises(ValueError, match="no weights"):
        attention(qkv, batch=1, seq=17, heads=1, head_dim=32, config=AttnConfig(16, 16, prefetch_ratio=0.5))
    with pytest.raises(ValueError, match="qkv"):
        attention(qkv, batch=1, seq=16, heads=1, head_dim=32, config=AttnConfig(16, 16))
    with pytest.raises(ValueError, match="out"):
        attention(qkv, batch=1, seq=17, heads=1, head_dim=32, config=AttnConfig(16, 16),
                  out=torch.empty(17, 32, dtype=torch.float32, device=device))


def test_attn_config_json_roundtrip():
    c = AttnConfig(block_m=128, block_n=32, num_warps=8, num_stages=3, overlap_ratio=0.25)
    assert AttnConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert c.without_knobs() == AttnConfig(block_m=128, block_n=32, num_warps=8, num_stages=3)
    with pytest.raises(ValueError, match="unknown keys"):
        AttnConfig.from_dict({"block_k": 3})


def test_launch_knobs_are_the_kernels_trigger_blocks():
    # The study keys the attention's overlap ratio by the KV block its programs trigger after (launch_knobs, in
    # Python); the kernel computes that block in fp32 (_trigger_block, run here by the interpreter). They must agree
    # for every count of KV blocks and every ratio, the awkward ones (thirds, values just under a step) too.
    import triton
    import triton.language as tl

    @triton.jit
    def triggers(n_ptr, out_ptr, overlap, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(out_ptr + offs, attn_mod._trigger_block(tl.load(n_ptr + offs), overlap))

    counts = torch.arange(1, 33, dtype=torch.int32)
    ratios = [0.0, 0.1, 0.2, 0.29, 0.3, 1 / 3, 0.4, 0.6, 2 / 3, 0.7, 0.8, 0.9, 0.99999, 1.0]
    ratios += [math.nextafter(r, 0.0) for r in (1 / 3, 0.5, 1.0)]  # (floor in float64 says 0 at 3, 1 and 1 blocks)
    for r in ratios:
        got = torch.empty_like(counts)
        triggers[(1,)](counts, got, r, N=32)
        want = [attn_mod.launch_knobs(AttnConfig(block_m=16, block_n=16, overlap_ratio=r), 16 * int(n), causal=False)
                for n in counts]
        assert want == [(int(t),) for t in got], r
    # causal programs read 1..n blocks: one trigger for each count, fewest first; -1 without PDL
    c = AttnConfig(block_m=32, block_n=16, overlap_ratio=0.5)
    assert attn_mod.launch_knobs(c, 100) == (0, 1, 2, 3)  # 2, 4, 6 and 7 KV blocks
    assert attn_mod.launch_knobs(c, 100, causal=False) == (3,)
    assert attn_mod.launch_knobs(AttnConfig(), 100) == (-1,)


def test_interpreter_switches_pdl_off():
    if torch.cuda.is_available():
        pytest.skip("interpreter only")
    c = effective_config(AttnConfig(overlap_ratio=0.6), torch.zeros(1))
    assert c.overlap_ratio == -1.0


# --- GPU: PDL on for real -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [0.0, 1.0], ids=["o0", "o1"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(
    "shape, cfg",
    [
        ((2, 128, 12, 64), AttnConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)),
        ((1, 200, 4, 48), AttnConfig(block_m=128, block_n=32, num_warps=8, num_stages=3)),
        ((3, 77, 2, 128), AttnConfig(block_m=32, block_n=64, num_warps=4, num_stages=2)),
        ((1, 17, 1, 32), AttnConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)),
    ],
    ids=["b2s128h12d64", "b1s200h4d48", "b3s77h2d128", "b1s17h1d32"],
)
def test_attention_pdl_gpu(shape, cfg, causal, dtype, overlap):
    from dataclasses import replace

    b, s, h, d = shape
    qkv = _qkv(b, s, h, d, dtype, "cuda", seed=11)
    c = replace(cfg, overlap_ratio=overlap)
    assert effective_config(c, qkv).overlap_ratio == overlap  # PDL really on (Hopper)
    ref = attention_ref(qkv, batch=b, seq=s, heads=h, head_dim=d, causal=causal)
    for _ in range(3):
        out = _poisoned(b, s, h, d, dtype, "cuda")
        attention(qkv, batch=b, seq=s, heads=h, head_dim=d, config=c, out=out, causal=causal)
        torch.cuda.synchronize()
        err = rel_error(out, ref)
        assert err < rel_tolerance(dtype), err


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [0.0, 1.0], ids=["o0", "o1"])
def test_qkv_attention_out_chain_pdl_gpu(overlap):
    # The layer's middle: QKV GEMM -> attention -> output projection, all three in the PDL chain. Each
    # stage is checked against the reference of what its predecessor really wrote (after a sync), so a
    # read of qkv before the GEMM finished shows up as an attention error.
    from tuner.kernels.gemm import GemmConfig, linear, linear_ref

    b, s, h, d = 2, 256, 12, 64
    D = h * d
    dtype = torch.float16
    g = torch.Generator().manual_seed(3)
    x = torch.randn(b * s, D, generator=g).to(dtype).cuda()
    w_qkv = (torch.randn(3 * D, D, generator=g) / D**0.5).to(dtype).cuda()
    w_o = (torch.randn(D, D, generator=g) / D**0.5).to(dtype).cuda()
    gcfg = GemmConfig(block_m=64, block_n=128, block_k=64, overlap_ratio=overlap)
    acfg = AttnConfig(block_m=64, block_n=64, overlap_ratio=overlap)
    for _ in range(5):
        qkv = torch.full((b * s, 3 * D), float("nan"), dtype=dtype, device="cuda")
        att = _poisoned(b, s, h, d, dtype, "cuda")
        y = torch.full((b * s, D), float("nan"), dtype=dtype, device="cuda")
        torch.cuda._sleep(2_000_000)  # queue the chain on the GPU so PDL really overlaps the three kernels
        linear(x, w_qkv, config=gcfg, out=qkv)
        attention(qkv, batch=b, seq=s, heads=h, head_dim=d, config=acfg, out=att)
        linear(att, w_o, config=gcfg, out=y)
        torch.cuda.synchronize()
        assert rel_error(qkv, linear_ref(x, w_qkv)) < rel_tolerance(dtype)
        assert rel_error(att, attention_ref(qkv, batch=b, seq=s, heads=h, head_dim=d)) < rel_tolerance(dtype)
        assert rel_error(y, linear_ref(att, w_o)) < rel_tolerance(dtype)


def _qkv_then_attention(x, w, b, s, h, d, overlap, racy):
    """QKV GEMM -> attention in the PDL chain, queued behind a busy kernel so that the GPU, not the
    Python launch overhead, decides when each starts (else attention starts after the GEMM ended)."""
    from tuner.kernels.gemm import GemmConfig, linear

    D = h * d
    qkv = torch.full((b * s, 3 * D), float("nan"), dtype=x.dtype, device="cuda")
    att = _poisoned(b, s, h, d, x.dtype, "cuda")
    torch.cuda._sleep(2_000_000)
    linear(x, w, config=GemmConfig(block_m=64, block_n=128, block_k=64, overlap_ratio=overlap), out=qkv)
    attention(qkv, batch=b, seq=s, heads=h, head_dim=d, config=AttnConfig(overlap_ratio=overlap), out=att,
              _racy_read_before_wait=racy)
    torch.cuda.synchronize()
    return rel_error(att, attention_ref(qkv, batch=b, seq=s, heads=h, head_dim=d))


@pytest.mark.gpu
def test_racy_read_is_caught_gpu():
    # The deliberately racy variant (Q read before gdc_wait) must lose the race visibly: the GEMM triggers
    # after its first K tile, so attention starts while qkv is still NaN. Measured on an H200: 49-50 of 50
    # racy runs wrong, 0 of 50 correct runs. The correct kernel in the same chain must never be.
    b, s, h, d = 1, 128, 12, 64
    g = torch.Generator().manual_seed(7)
    x = torch.randn(b * s, 768, generator=g).to(torch.float16).cuda()
    w = (torch.randn(3 * h * d, 768, generator=g) / 768**0.5).to(torch.float16).cuda()
    tol = rel_tolerance(torch.float16)
    assert all(_qkv_then_attention(x, w, b, s, h, d, 0.0, racy=False) < tol for _ in range(10))
    caught = sum(not _qkv_then_attention(x, w, b, s, h, d, 0.0, racy=True) < tol for _ in range(10))
    assert caught >= 1, "the racy read before gdc_wait was never caught: is PDL really overlapping?"
