"""QKV and the attention in one kernel (kernels/qkv_attn.cu, ``qkv.fuse: 1``): its validity rules everywhere, the CUDA
kernel against its torch reference on a Hopper GPU (pytest -m gpu)."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tuner.kernels import _nvcc, qkv_attn
from tuner.kernels._common import rel_error, rel_tolerance
from tuner.kernels.gemm import fold_layernorm

gpu = pytest.mark.gpu


def test_launch_argtypes_match_the_c_signature():
    assert _nvcc.c_argtypes(qkv_attn.SOURCE.read_text(), "qkv_attn_launch") == qkv_attn.LAUNCH_ARGTYPES


@pytest.mark.parametrize("seq, head_dim, d, stages, parts, needle", [
    (129, 64, 768, 4, None, "seq <= 128"),
    (128, 32, 768, 4, None, "head_dim 64"),
    (128, 64, 768, 1, None, "2..12 stages"),
    (128, 64, 768, 4, 33, "1..32 parts"),
    (128, 64, 768, 12, None, "shared memory"),
])
def test_error(seq, head_dim, d, stages, parts, needle):
    assert needle in (qkv_attn.error(seq, head_dim, d, stages, parts) or "")


def test_error_names_a_batch_past_the_grid_axis():
    from tuner.shapes import resolve

    # its grid is (heads, batch, 3 x row tiles): a grid's second axis holds 65535 sequences
    assert qkv_attn.error(2, 64, 768, 4, batch=65535) is None
    assert "batch <= 65535" in qkv_attn.error(2, 64, 768, 4, batch=65536)
    from tuner.bench import hand_picked, hand_picked_cluster
    from tuner.layer import check_config, repair_config
    from tuner.shapes import DecoderShape

    hp = hand_picked(resolve("bert-base"))
    cfg = replace(hp, qkv=replace(hp.qkv, fuse=1), norm1=replace(hp.norm1, fuse=2))
    fits, many = (DecoderShape(b, 2, 768, 12, 3072, name=f"{b}-sequences") for b in (65535, 65536))
    assert "qkv" not in check_config(cfg, fits) and repair_config(cfg, fits).qkv.fuse == 1
    assert "batch <= 65535" in check_config(cfg, many)["qkv"] and repair_config(cfg, many).qkv.fuse == 0
    assert hand_picked_cluster(many).qkv.fuse == 0  # the clustered seed leaves it off there


def test_error_accepts_bert_shapes():
    assert qkv_attn.error(128, 64, 768, 8, 12) is None and qkv_attn.error(32, 64, 256, 4) is None
    assert qkv_attn.smem_bytes(8, 128) == 1024 + 21 * 8192 + 136 and qkv_attn.smem_bytes(4, 32) == 1024 + 11 * 8192 + 72


@pytest.mark.parametrize("cycles", [False, True], ids=["globaltimer", "clock64"])
def test_trace_buffer_fits_the_launch(cycles, monkeypatch):
    # a trace of 3 x row tiles x heads x sequences CTAs, 6 or 10 stamps each (qkv_attn.cu's stamp writes every slot of
    # its row: a narrower buffer is refused before the launch)
    monkeypatch.setattr(qkv_attn, "TRACE_CYCLES", cycles)
    x = torch.zeros(2 * 100, 256, dtype=torch.float16)
    trace, per_rank = qkv_attn.trace_buffer(x, 100)
    assert per_rank == 4 * 2 and tuple(trace.shape) == (3 * 2 * 8, 10 if cycles else 6)
    w, b, out = torch.zeros(768, 256, dtype=x.dtype), torch.zeros(768, dtype=x.dtype), torch.zeros_like(x)
    with pytest.raises(ValueError, match="trace"):
        qkv_attn.launch(x, w, b, out, seq=100, trace=trace[:, :-1])


def test_traced_launch_keeps_one_trace_per_launch():
    # the diagnostics scripts' wrapper: one buffer per (out, weight) pair, made at its first launch and passed to every
    # later one, keys in first-launch order, each with its CTAs a cluster rank
    calls = []
    traces, order, ranks = {}, [], {}
    launch = qkv_attn.traced(lambda x, w, b, out, **kw: calls.append(kw["trace"]), traces, order, ranks)
    x = torch.zeros(2 * 100, 256, dtype=torch.float16)
    w, b, out1, out2 = torch.zeros(768, 256), torch.zeros(768), torch.zeros_like(x), torch.zeros_like(x)
    for out in (out1, out2, out1):
        launch(x, w, b, out, seq=100)
    assert order == [(out1.data_ptr(), w.data_ptr()), (out2.data_ptr(), w.data_ptr())]
    assert calls[0] is calls[2] is traces[order[0]] and calls[1] is traces[order[1]]
    assert ranks == {key: 4 * 2 for key in order} and tuple(calls[1].shape) == (3 * 2 * 8, qkv_attn.TRACE_SLOTS)


def test_layer_rules():
    """qkv.fuse 1 needs attn.fuse 0, norm1.fuse 0 or 2, head_dim 64, seq <= 128; repair_config unfuses it elsewhere."""
    from tuner.bench import hand_picked, hand_picked_cluster
    from tuner.layer import check_config, qkv_attn_error, repair_config
    from tuner.shapes import DecoderShape, resolve

    base, tiny = resolve("bert-base"), resolve("tiny")
    hp = hand_picked(base)
    cfg = replace(hp, qkv=replace(hp.qkv, fuse=1), norm1=replace(hp.norm1, fuse=2))
    assert check_config(cfg, base) == {} and repair_config(cfg, base).qkv.fuse == 1
    one = replace(cfg, norm1=replace(cfg.norm1, fuse=1))
    assert "norm1.fuse 0 or 2" in check_config(one, base)["qkv"] and repair_config(one, base).qkv.fuse == 0
    assert "is 0 or 1" in check_config(replace(cfg, qkv=replace(cfg.qkv, fuse=2)), base)["qkv"]
    blk = hand_picked_cluster(tiny)  # the attention already in the fused block
    both = replace(blk, qkv=replace(blk.qkv, fuse=1))
    assert "attn.fuse 0" in check_config(both, tiny)["qkv"] and repair_config(both, tiny).qkv.fuse == 0
    # fp32: the kernel takes 16-bit operands (an fp32 study measured it as a trial of rel. error inf on the H200)
    assert "16-bit operands" in qkv_attn_error(base, cfg, dtype_bytes=4) and repair_config(cfg, base, 4).qkv.fuse == 0
    long = DecoderShape(1, 256, 768, 12, 3072, name="256-tokens")
    assert "seq <= 128" in check_config(cfg, long)["qkv"] and repair_config(cfg, long).qkv.fuse == 0
    assert "it must be 0 here" in check_config(replace(cfg, ffn1=replace(cfg.ffn1, fuse=1)), base)["ffn1"]
    # the row sums it reads (norm1.fuse 2) come in at most 32 parts: an unsplit FFN2 of 32-wide tiles on d_model 2048
    # writes 64 (the launcher refused it, so the trial crashed instead of being invalid)
    wide = DecoderShape(1, 128, 2048, 32, 8192, name="d2048")
    many = replace(cfg, ffn2=replace(cfg.ffn2, fuse=0, block_n=32, split_k=1))
    assert "1..32 parts, not 64" in check_config(many, wide)["qkv"] and repair_config(many, wide).qkv.fuse == 0
    assert "qkv" not in check_config(replace(many, ffn2=replace(many.ffn2, block_n=64)), wide)
    # the clustered seed computes the attention in QKV's kernel where the fused block does not
    assert hand_picked_cluster(base).qkv.fuse == 1 and hand_picked_cluster(base, qkv_attn=False).qkv.fuse == 0
    assert hand_picked_cluster(tiny).qkv.fuse == 0 and hand_picked_cluster(tiny, attn_in=False).qkv.fuse == 1
    from tuner.report import format_tiles

    assert format_tiles(cfg.to_dict()["kernels"]).split("; ")[1] == "attn in qkv"


def test_the_launcher_refuses_what_the_kernel_cannot_read():
    """An fp32 tensor reaches the kernel as 16-bit words: refused before anything is compiled or launched."""
    x, w, out = torch.zeros(128, 768), torch.zeros(3 * 768, 768), torch.zeros(128, 768)
    with pytest.raises(ValueError, match="16-bit operands"):
        qkv_attn.launch(x, w, torch.zeros(3 * 768), out, seq=128)



def _hopper():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CUDA kernel needs a Hopper GPU")


def _reference(x, w, b, seq, ln=None):
    """fp32: causal attention of LN(x) @ w.T + b per sequence and head of 64."""
    xf = x.float()
    if ln is not None:
        xf = F.layer_norm(xf, (x.shape[1],), ln[0], ln[1], 1e-5)
    qkv = xf @ w.float().T + b.float()
    m, d = x.shape
    q, k, v = (t.reshape(m // seq, seq, d // 64, 64).transpose(1, 2) for t in qkv.split(d, dim=1))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(1, 2).reshape(m, d)


@gpu
@pytest.mark.parametrize("batch, seq, d", [(1, 128, 768), (1, 17, 256), (2, 100, 256), (1, 64, 128), (3, 33, 192),
                                           (1, 65, 320), (2, 128, 128)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ln", [False, True], ids=["plain", "layernorm-folded"])
def test_qkv_attn_matches_reference(batch, seq, d, dtype, ln, push=None):
    out, ref = _run(batch, seq, d, dtype, ln, push)
    assert rel_error(out, ref) < rel_tolerance(dtype)


def _run(batch, seq, d, dtype, ln, push=None, hints=0):
    """The kernel's output and the fp32 reference for one case (seeded by the shape)."""
    _hopper()
    m = batch * seq
    g = torch.Generator().manual_seed(seq + d)
    r = lambda *s, sc=1.0: (torch.randn(*s, generator=g) * sc).to(dtype).cuda()  # noqa: E731
    x, w, b = r(m, d), r(3 * d, d, sc=d ** -0.5), r(3 * d, sc=0.1)
    out = torch.full((m, d), float("nan"), dtype=dtype, device="cuda")
    if ln:
        gamma, beta = (1 + r(d, sc=0.1)).float(), r(d, sc=0.1).float()
        wf, bf, u = fold_layernorm(w, b, gamma, beta)
        xf = x.float()
        # the producer's row sums in parts of 64 columns, as FFN2's epilogue writes them
        parts = torch.stack([xf.view(m, -1, 64).sum(2).T, (xf * xf).view(m, -1, 64).sum(2).T], dim=2).contiguous()
        qkv_attn.launch(x, wf, bf, out, seq=seq, stages=4, trigger_k=0, n_pref=4, ln_stats=parts, ln_colsum=u,
                        push=push, hints=hints)
        ref = _reference(x, w, b, seq, ln=(gamma, beta))
    else:
        qkv_attn.launch(x, w, b, out, seq=seq, stages=3, trigger_k=-1, n_pref=0, push=push, hints=hints)
        ref = _reference(x, w, b, seq)
    torch.cuda.synchronize()
    return out, ref


@gpu
@pytest.mark.parametrize("batch, seq, d", [(1, 128, 768), (3, 33, 192), (1, 65, 320)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_qkv_attn_mufu_math_against_ieee(batch, seq, d, dtype, monkeypatch):
    # The LayerNorm's row factors and the softmax's 1/sum by the MUFU (the default) against the IEEE division and
    # square root (_nvcc.MUFU_MATH False, the A/B build): both correct, and the two outputs differ by 16-bit rounding
    # at most
    fast, ref = _run(batch, seq, d, dtype, ln=True)
    monkeypatch.setattr(_nvcc, "MUFU_MATH", False)
    ieee, _ = _run(batch, seq, d, dtype, ln=True)
    assert rel_error(fast, ref) < rel_tolerance(dtype) and rel_error(ieee, ref) < rel_tolerance(dtype)
    assert rel_error(fast, ieee.float()) < (2e-3 if dtype == torch.float16 else 1e-2)


@gpu
@pytest.mark.parametrize("batch, seq, d", [(1, 128, 768), (3, 33, 192)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hints", [1, 2, 3])
def test_qkv_attn_with_cache_hints(batch, seq, d, dtype, hints):
    # The builds with L2 eviction hints on the TMA loads (the weights', the activations', both: GemmConfig.hints 1
    # is 3): within the reference's tolerance, with and without the LayerNorm
    for ln in (True, False):
        out, ref = _run(batch, seq, d, dtype, ln=ln, hints=hints)
        assert rel_error(out, ref) < rel_tolerance(dtype)


@gpu
@pytest.mark.parametrize("batch, seq, d", [(1, 128, 768), (2, 100, 256), (1, 65, 320), (3, 33, 192)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("push", [0, 2], ids=["bulk", "st-async-regs"])
def test_qkv_attn_other_pushes(batch, seq, d, dtype, push):
    # K and V handed to the Q CTAs by the A/B builds, not the default 16-byte st.async from shared memory
    # (qkv_attn.PUSH; row tile 0's K and V go to two Q CTAs where seq > 64)
    test_qkv_attn_matches_reference(batch, seq, d, dtype, ln=seq % 2 == 0, push=push)


def _stack_cfg(shape):
    from tuner.bench import hand_picked

    hp = hand_picked(shape)
    return replace(hp, qkv=replace(hp.qkv, fuse=1), norm1=replace(hp.norm1, fuse=2), attn=replace(hp.attn, fuse=0))


@pytest.mark.parametrize("pdl", [True, False])
def test_stack_with_the_attention_in_qkv(pdl, device):
    # On a Hopper GPU the QKV launch computes the attention (no attention launch) from layer 1 on; layer 0 has no row
    # sums of x for its folded LayerNorm and runs the two kernels. Elsewhere (the interpreter) they always run.
    from tuner.layer import DecoderStack
    from tuner.shapes import DecoderShape

    shape = DecoderShape(1, 40, 128, 2, 256, name="odd")
    cfg = _stack_cfg(shape)
    if not pdl:
        cfg = cfg.without_knobs()
    st = DecoderStack(shape, cfg, n_layers=3, dtype=torch.float16, device=device, seed=7)
    fused = device == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    assert st.bufs[1].qkv_attn == fused
    assert len(st.launches("attn")) == (1 if fused else 3)
    err = st.check(seed=3)
    assert err < st.tolerance(), err


@gpu
@pytest.mark.parametrize("push, hints", [(0, 0), (1, 0), (2, 0), (2, 1)],
                         ids=["bulk", "st-async-16B", "st-async-regs", "st-async-regs-l2-hints"])
def test_stack_with_the_attention_in_qkv_graphed(push, hints, monkeypatch):
    _hopper()
    monkeypatch.setattr(qkv_attn, "PUSH", push)
    from tuner.layer import DecoderStack
    from tuner.shapes import resolve

    shape = resolve("bert-base")
    cfg = _stack_cfg(shape)
    if hints:  # every GEMM's L2 hints (those on the CUDA kernels act)
        cfg = replace(cfg, **{g: replace(getattr(cfg, g), hints=1) for g in ("qkv", "out", "ffn1", "ffn2")})
    st = DecoderStack(shape, cfg, n_layers=4, dtype=torch.float16, device="cuda", seed=8)
    st.capture()
    for seed in range(3):
        err = st.check(seed=seed)
        assert err < st.tolerance(), err


@gpu
def test_racy_qkv_attn_is_caught():
    # The test-only defect (the first x tile loaded before griddepcontrol.wait) in layer 1 of a graphed stack.
    _hopper()
    from tuner.layer import DecoderStack
    from tuner.shapes import resolve
    from tuner.verify import race_detection

    shape = resolve("bert-base")
    st = DecoderStack(shape, _stack_cfg(shape), n_layers=4, dtype=torch.float16, device="cuda", seed=9)
    assert st.bufs[1].qkv_attn
    r = race_detection(st, "qkv", layer=1, trials=10)
    assert r["caught"] >= 5 and r["false_alarms"] == 0, r
