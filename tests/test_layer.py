import json

import pytest
import torch

from tuner.bench import hand_picked
from tuner.config import ConfigError, DecoderConfig
from tuner.layer import (DecoderStack, LayerWeights, check_config, cold_weights, default_config, hot_error,
                         kernel_weights, layer_ref, stack_depth, torch_layer)
from tuner.shapes import PRESETS, DecoderShape, ShapeError, resolve

ODD = DecoderShape(1, 17, 32, 1, 90, name="odd")  # seq 17, one head of dim 32, ffn 90


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_stack_matches_reference_odd_shape(dtype, device):
    small = hand_picked(ODD).with_knobs(0.4, 1.0)  # knobs switch off by themselves in the interpreter
    assert check_config(small, ODD) == {}, check_config(small, ODD)
    st = DecoderStack(ODD, small, n_layers=2, dtype=dtype, device=device, seed=1)
    err = st.check(seed=7)
    assert err < st.tolerance(), err


@pytest.mark.parametrize("fuse", [(1, 0), (0, 1), (1, 1), (2, 0), (0, 2), (2, 2), (2, 1)],
                         ids=["fuse-norm1", "fuse-norm2", "fuse-both", "stats-norm1", "stats-norm2", "stats-both",
                              "stats-norm1-reload-norm2"])
def test_stack_with_fused_norms(fuse, device, dtype=torch.float16):
    # fuse 2: row sums from the producing GEMM (the previous layer's FFN2, this layer's out-projection);
    # the first layer has no producer and gathers them in QKV's K loop. Three layers: two consume them.
    from dataclasses import replace

    cfg = hand_picked(ODD)
    cfg = replace(cfg, norm1=replace(cfg.norm1, fuse=fuse[0]), norm2=replace(cfg.norm2, fuse=fuse[1]))
    st = DecoderStack(ODD, cfg, n_layers=3, dtype=dtype, device=device, seed=4)
    assert len(st.launches("norm1")) == (0 if fuse[0] else 3)
    assert (st.bufs[0].y_stats is not None) == (fuse[0] == 2) and (st.bufs[0].h_stats is not None) == (fuse[1] == 2)
    err = st.check(seed=9)
    assert err < st.tolerance(), err


@pytest.mark.parametrize("fuse", [(1, 1), (2, 2)], ids=["fuse-both", "stats-both"])
def test_stack_with_fused_norms_bf16(fuse, device):
    # bfloat16's 8-bit mantissa in the folded weights and the row sums, at the interpreter's bound of 1e-2 (session 48:
    # it rounds as the GPU does)
    test_stack_with_fused_norms(fuse, device, torch.bfloat16)


def test_stack_with_statistics_from_split_k_producers(device):
    # The producers run split-K: the reduction kernel writes the row sums, one part per 64 columns.
    from dataclasses import replace

    from tuner.kernels.gemm import GemmConfig

    shape = DecoderShape(1, 9, 80, 2, 96, name="odd2")
    cfg = hand_picked(shape)
    split = GemmConfig(block_m=16, block_n=16, block_k=16, split_k=3, num_warps=1)
    cfg = replace(cfg, norm1=replace(cfg.norm1, fuse=2), norm2=replace(cfg.norm2, fuse=2), out=split, ffn2=split)
    assert check_config(cfg, shape) == {}
    st = DecoderStack(shape, cfg, n_layers=3, dtype=torch.float32, device=device, seed=5)
    assert st.bufs[0].h_stats.shape == (2, 9, 2)
    err = st.check(seed=10)
    assert err < st.tolerance(), err


def test_gemm_checks_count_the_row_sum_parts_they_read():
    # QKV reads FFN2's row sums (norm1.fuse 2: 768 / 256 = 3 parts), FFN1 the out-projection's (norm2.fuse 2: 6), as
    # LayerBuffers allocates them; check_config and repair_config count their scratch (gemm.stats_scratch) on a GPU
    # whose limit is QKV's count without it, and the block kernel's parts where it runs (tiny, as on Hopper).
    from dataclasses import replace

    from tuner.device import DeviceInfo
    from tuner.kernels import gemm
    from tuner.layer import LayerBuffers, fit_config, ln_parts, repair_config

    shape = resolve("bert-base")
    base = fit_config(DecoderConfig(), shape)
    qkv = gemm.GemmConfig(block_m=32, block_n=256, block_k=128, num_warps=8, num_stages=4)
    cfg = replace(base, qkv=qkv, ffn2=replace(base.ffn2, block_n=256), out=replace(base.out, block_n=128),
                  norm1=replace(base.norm1, fuse=2), norm2=replace(base.norm2, fuse=2))
    assert ln_parts(shape, cfg) == {"qkv": 3, "ffn1": 6}
    b = LayerBuffers(shape, cfg, torch.float16, "cpu")
    assert (b.y_stats.shape[0], b.h_stats.shape[0]) == (3, 6)
    assert gemm.stats_scratch(qkv, 3) > 0
    tight = DeviceInfo("tight", (9, 0), 132, 50 << 20, gemm.smem_bytes(qkv, 2))
    unfused = replace(cfg, norm1=replace(cfg.norm1, fuse=0))
    assert "shared memory" in check_config(cfg, shape, 2, tight)["qkv"]
    assert "qkv" not in check_config(unfused, shape, 2, tight)
    assert repair_config(cfg, shape, 2, tight).qkv.num_stages == 3
    assert repair_config(unfused, shape, 2, tight).qkv.num_stages == 4
    tiny = resolve("tiny")
    block = fit_config(DecoderConfig(), tiny)
    block = replace(block, norm1=cfg.norm1, norm2=cfg.norm2, ffn2=replace(block.ffn2, fuse=1))
    assert ln_parts(tiny, block) == {"qkv": 16, "ffn1": 4}  # (one part a CTA of the block kernel)
    assert ln_parts(tiny, replace(block, out=replace(block.out, fuse=1))) == {"qkv": 16}
    assert ln_parts(tiny, block, 2, DeviceInfo.interpreter()) == {"qkv": 4, "ffn1": 4}  # (no block kernel there)


def test_stack_check_catches_unwritten_output(device):
    st = DecoderStack(ODD, hand_picked(ODD), n_layers=1, dtype=torch.float32, device=device, seed=1)
    st.run = lambda: None  # nothing launched: the poisoned output must fail the check
    assert st.check(seed=3) == float("inf")


def _layer_by_hand(shape, w, x):
    """The pre-LN layer written out in float64 from its definition (DESIGN): no F.layer_norm, no SDPA, no F.gelu."""
    w = [t.double() for t in w.tensors()]
    ln1_w, ln1_b, w_qkv, b_qkv, w_out, b_out, ln2_w, ln2_b, w_ffn1, b_ffn1, w_ffn2, b_ffn2 = w

    def norm(t, g, b):
        mu = t.mean(-1, keepdim=True)
        return (t - mu) / torch.sqrt(((t - mu) ** 2).mean(-1, keepdim=True) + 1e-5) * g + b

    bsz, s, d, h, hd = shape.batch, shape.seq, shape.d_model, shape.heads, shape.head_dim
    x = x.double()
    qkv = norm(x, ln1_w, ln1_b) @ w_qkv.T + b_qkv  # [tokens, 3d]: q, k, v, each heads x head_dim
    out = torch.empty(bsz * s, d, dtype=torch.float64, device=x.device)
    future = torch.triu(torch.ones(s, s, dtype=torch.bool, device=x.device), 1)
    for b in range(bsz):
        rows = slice(b * s, (b + 1) * s)
        for j in range(h):
            q, k, v = (qkv[rows, i * d + j * hd: i * d + (j + 1) * hd] for i in range(3))
            scores = (q @ k.T / hd ** 0.5).masked_fill(future, float("-inf"))
            out[rows, j * hd:(j + 1) * hd] = torch.softmax(scores, -1) @ v
    hid = x + out @ w_out.T + b_out
    f = norm(hid, ln2_w, ln2_b) @ w_ffn1.T + b_ffn1
    f = 0.5 * f * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (f + 0.044715 * f ** 3)))
    return hid + f @ w_ffn2.T + b_ffn2


def test_reference_layer_matches_the_layer_written_out(device):
    # The fp32 reference every kernel is checked against, against the layer computed by hand in float64, on a shape
    # with two sequences and three heads (a wrong head split, causal mask, norm or GELU in the reference shows here).
    shape = DecoderShape(2, 17, 96, 3, 90, name="odd-heads")
    w = DecoderStack(shape, DecoderConfig(), n_layers=1, dtype=torch.float32, device=device, seed=2).weights[0]
    for t in (w.ln1_w, w.ln1_b, w.ln2_w, w.ln2_b):  # not the ones and zeros they start as: the affine part counts
        t.copy_(torch.randn_like(t))
    x = torch.randn(shape.tokens, shape.d_model, device=device)
    want = _layer_by_hand(shape, w, x)
    assert (layer_ref(shape, w, x).double() - want).norm() / want.norm() < 1e-5
    assert (torch_layer(shape, w, x).double() - want).norm() / want.norm() < 1e-5


def test_decoder_config_roundtrip_and_errors():
    cfg = hand_picked(PRESETS["bert-base"])
    assert DecoderConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ConfigError, match="schema_version"):
        DecoderConfig.from_dict({"schema_version": 99, "kernels": {}})
    with pytest.raises(ConfigError, match="unknown kernels"):
        DecoderConfig.from_dict({"schema_version": 1, "kernels": {"mlp": {}}})
    assert cfg.without_knobs().attn.overlap_ratio == -1.0 and cfg.attn.prefetch_ratio == -1.0


def test_presets_and_custom_shapes():
    assert resolve("bert-base").spec == "1x128x768x12x3072"
    assert resolve("1x64x512x8x2048").head_dim == 64
    assert resolve(" 1 x 128 x 768 x 12 x 3072 ").spec == "1x128x768x12x3072"  # (spaces as before; not '1_28')
    assert abs(PRESETS["bert-base"].weight_bytes(2) / 1e6 - 14.2) < 0.1  # DESIGN: 14.2 MB
    # more (sequence, head) pairs than a grid's second axis holds (refused until session 46; the attention kernel's
    # grid is one axis now, and qkv.fuse 1 names the batch itself)
    assert resolve("4096x16x512x16x512").batch * 16 == 65536 and resolve("65536x1x64x1x64").batch == 65536
    for bad, needle in [("gpt9", "unknown shape"), ("1x0x768x12x3072", "positive"),
                        ("1x128x770x12x3072", "not divisible"), ("1x128x768x48x3072", "head dim"),
                        ("1x128x768x12", "BxSxDxHxF"), ("1xax768x12x3072", "five integers"),
                        ("1x262144x4096x32x8192", "32-bit offsets"),
                        ("1x1x49152x384x49152", "largest weight")]:
        with pytest.raises(ShapeError, match=needle):
            resolve(bad)


def test_a_stack_beyond_the_gpus_memory_is_refused():
    # 2x32 tokens of a 64-wide layer: ~7,500 layers to hold 3x an H200's L2 in weights, each with its activations.
    from tuner.layer import memory_error

    why = memory_error(resolve("65535x2x32x1x64"), 2, 60 * 2**20, "cold", 140 * 2**30)
    assert why and "11046 layers" in why and "more than this GPU's 140 GiB" in why, why
    for shape in ("tiny", "bert-base", "bert-large", "32x1024x4096x32x11008"):  # (the 7B-class prefill fits)
        assert memory_error(resolve(shape), 2, 60 * 2**20, "cold", 80 * 2**30) is None


def test_stack_depth_cold_is_three_l2():
    s = PRESETS["bert-base"]
    n = stack_depth(s, 2, 60 * 2**20)
    assert n * s.weight_bytes(2) >= 3 * 60 * 2**20 > (n - 1) * s.weight_bytes(2)


def test_hot_is_only_for_a_model_whose_weights_fit_in_l2():
    # --l2 hot times the model's own depth on the premise that its weights stay in L2 between forwards; bert-base's
    # 12 layers hold 170 MB, 2.7x an H200's L2, so a "hot" stack of them was a cold one labelled hot.
    tiny, base = PRESETS["tiny"], PRESETS["bert-base"]
    assert stack_depth(tiny, 2, 60 * 2**20, "hot") == tiny.depth  # 4 layers, 6.3 MB
    assert hot_error(tiny, 2, 60 * 2**20) is None
    with pytest.raises(ValueError, match=r"bert-base's 12 layers hold 170.1 MB of weights, 2.7x this GPU's 60 MiB"):
        stack_depth(base, 2, 60 * 2**20, "hot")
    assert hot_error(base, 2, 200 * 2**20) is None  # (fits a larger L2)
    assert hot_error(tiny, 4, tiny.depth * tiny.weight_bytes(4) - 1)  # (the dtype's bytes count)


def _weights(shape, n):
    g = torch.Generator().manual_seed(0)
    return [LayerWeights.random(shape, torch.float16, "cpu", g) for _ in range(n)]


def test_a_kernel_timed_alone_cycles_three_l2_of_its_own_weights():
    # The per-kernel breakdown times each kernel's launches alone in a graph. A stack deep enough for the whole
    # layer's weights holds only 0.75-0.84x the L2 of QKV's (bert-base, 14 layers, 60 MiB): those stayed in L2 from
    # one replay to the next. The kernel's own stack is deepened with copies whose matrices it reads are cloned.
    shape, l2 = PRESETS["bert-base"], 60 * 2**20
    base = _weights(shape, 2)
    for names in (("w_qkv",), ("w_out",), ("w_ffn1", "w_ffn2")):
        w = cold_weights(base, names, 2, l2)
        per = sum(getattr(base[0], n).numel() for n in names) * 2
        assert len(w) * per >= 3 * l2 > (len(w) - 1) * per
        assert w[:2] == base
        stores = {getattr(x, n).data_ptr() for x in w for n in names}
        assert len(stores) == len(w) * len(names)  # every layer's matrices in memory of their own
        assert w[5].w_qkv is base[1].w_qkv or "w_qkv" in names  # what the kernel does not read is shared
        assert torch.equal(w[5].w_out, base[1].w_out)
    assert cold_weights(base, (), 2, l2) is base  # the norms and the attention read no weight matrix
    big = _weights(PRESETS["tiny"], 3)
    assert cold_weights(big, ("w_qkv",), 2, 1024) is not big and len(cold_weights(big, ("w_qkv",), 2, 1024)) == 3


@pytest.mark.parametrize("fuse, names", [(0, ("w_ffn1",)), (1, ("w_ffn1", "w_ffn2")),
                                         (2, ("w_ffn1", "w_ffn2", "w_out"))])
def test_the_weights_a_launch_reads(fuse, names):
    from types import SimpleNamespace

    b = SimpleNamespace(mlp=fuse > 0, mlp_out=fuse > 1)
    assert kernel_weights("ffn1", b) == names
    assert kernel_weights("qkv", b) == ("w_qkv",) and kernel_weights("ffn2", b) == ("w_ffn2",)
    assert kernel_weights("attn", b) == kernel_weights("norm1", b) == ()
    assert kernel_weights("out", b) == ("w_out",)
    assert kernel_weights("layer", b) == ("w_qkv", "w_out", "w_ffn1", "w_ffn2")


@pytest.mark.gpu
def test_interleaved_timing_matches_back_to_back():
    # The top-k re-measure (time_interleaved) and the study's and torch baselines' measurement (time_replay)
    # agree within 2%: neither counts the host's graph submission before the first kernel.
    from tuner.device import DeviceInfo
    from tuner.timing import time_interleaved, time_replay

    shape = resolve("bert-base")
    n = stack_depth(shape, 2, DeviceInfo.from_torch().l2_bytes)
    st = DecoderStack(shape, hand_picked(shape), n_layers=n, dtype=torch.float16, device="cuda", seed=2)
    st.capture()
    back = time_replay(st.replay, n, reps=30).median_us
    [inter] = time_interleaved([st.replay], [n], rounds=30)
    assert abs(inter.median_us - back) < 0.02 * back, (inter.median_us, back)


def test_held_predecessor_only_where_a_gemm_runs(device):
    # tune verify holds back the stores of the racy kernel's predecessor (DecoderStack.slow) where that is a Triton
    # GEMM. The predecessor is the launch right before, across layers; any other launch refuses to be slowed, and a
    # slowed stack still computes the layer (the interpreter has no PDL: the hold is off there).
    from dataclasses import replace

    from tuner.kernels.gemm import NotSlowable

    cfg = hand_picked(ODD)
    cfg = replace(cfg, norm1=replace(cfg.norm1, fuse=1))
    st = DecoderStack(ODD, cfg, n_layers=2, dtype=torch.float32, device=device, seed=3)
    assert st.predecessor(0, "qkv") is None
    assert st.predecessor(1, "qkv") == (0, "ffn2")
    assert st.predecessor(1, "out") == (1, "attn") and st.predecessor(1, "ffn2") == (1, "ffn1")
    with pytest.raises(ValueError):
        st.predecessor(1, "norm1")  # (fused: not launched)
    for slow in ((1, "attn"), (1, "norm2"), (1, "norm1")):
        st.slow = slow
        with pytest.raises(NotSlowable):
            st.run()
    st.slow = (1, "ffn1")
    err = st.check(seed=4)
    assert err < st.tolerance(), err


def test_slowed_layer_kernel_refuses():
    from dataclasses import replace

    from tuner.kernels.gemm import NotSlowable
    from tuner.layer import layer_launches

    cfg = DecoderConfig()
    cfg = replace(cfg, layer=replace(cfg.layer, fuse=1))
    assert cfg.fused
    st = DecoderStack(ODD, cfg, n_layers=1, dtype=torch.float32, device="cpu", seed=1)
    with pytest.raises(NotSlowable):
        layer_launches(ODD, cfg, st.weights[0], st.x, st.bufs[0], slow="qkv")


@pytest.mark.gpu
def test_the_final_phase_checks_and_breakdown_on_the_gpu():
    # GpuEvaluator.recheck passes a correct config (its checks run the captured stack on fresh input), and the
    # per-kernel breakdown times every kernel over its own cold stack (cold_weights): finite, and alone each kernel
    # pays its whole boundary, so that the kernels add up to at least most of the layer. (Over a deeper stack a
    # kernel's figure also carries less of the replay's fixed cost: H100, bert-base's QKV 5.36 us alone over its 45
    # layers against 5.65 over the layer's 12; perf notes 54.)
    import math

    from tuner.evaluate import GpuEvaluator
    from tuner.timing import time_replay

    shape = resolve("bert-base")
    ev = GpuEvaluator(shape, reps=20, warmup=3)
    cfg = hand_picked(shape)
    assert ev.recheck(cfg, 3) is None
    b = ev.breakdown(cfg)
    assert all(math.isfinite(v) and v >= 0 for v in b.values()) and b["qkv"] > 0 and b["out"] > 0
    layer = time_replay(ev._stack(cfg).replay, ev.n_layers, reps=20, warmup=3).median_us
    assert 0.9 * layer < sum(b.values()) < 1.5 * layer, (b, layer)


def test_group_room_counts_stacks_beside_the_reserve():
    from tuner.evaluate import REMEASURE_RESERVE, group_room

    gib = 2**30
    assert group_room(34 * gib, 100 * gib) == 2  # the 65,536-token layer of session 46: 3 of its stacks, not 4
    assert group_room(34 * gib, 30 * gib) == 0 and group_room(0, 1 * gib) == 0  # (nothing beside the reserve)
    assert group_room(100 * 2**20, 100 * gib) > 100  # a preset's stack: every re-measurement in one group
    assert group_room(gib, REMEASURE_RESERVE + int(2.3 * gib)) == 2 and group_room(gib, REMEASURE_RESERVE + gib) == 0


@pytest.mark.parametrize("room, groups, anchored", [(9, None, None), (2, [[3, 3, 2]], [True]),
                                                   (0, [[1, 1, 1, 1, 1, 1]], [False])])
def test_remeasure_keeps_the_anchor_in_every_group(monkeypatch, room, groups, anchored):
    # The bookkeeping of GpuEvaluator.remeasure's groups on the CPU (tests/test_layer.py's GPU test runs it on the
    # GPU): memory and timing stand in for the GPU's, each group's figures drift by 10% from the group before, and the
    # anchor (the baseline) is in every group where one more stack fits beside it, so each figure over its group's
    # anchor is drift-free. Where none fits (room 0), every stack alone, as before session 47.
    import torch

    from tuner import evaluate, timing
    from tuner.evaluate import GpuEvaluator

    true_us = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]  # the configs' "latencies"; index 2 is the anchor
    ev = object.__new__(GpuEvaluator)
    ev.n_layers, ev.remeasure_groups, ev.remeasure_anchored = 4, [], []
    drift = iter(1 + 0.1 * g for g in range(10))

    def interleaved(replays, n_layers, rounds):
        d = next(drift)
        return [timing.Timing(st.us * d, 0.01, rounds) for st in built[-len(replays):]]

    built = []
    ev._stack = lambda us: built.append(type("Stack", (), {"us": us, "replay": None})()) or built[-1]
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (100, 100))
    monkeypatch.setattr(evaluate, "group_room", lambda per_stack, free: room)
    monkeypatch.setattr(timing, "time_interleaved", interleaved)
    got = ev.remeasure(true_us, rounds=3, anchor=2)
    assert [round(r.median_us / r.anchor_us, 9) for r in got] == [round(u / 30.0, 9) for u in true_us] or room == 0
    assert got[2].median_us == 30.0 and got[2].anchor_us == 30.0  # the anchor's own: its first group's
    pol = ev.remeasure_groups or None, ev.remeasure_anchored or None
    assert pol == (groups, anchored)
    if room == 0:  # one after another, each over the anchor's first figure
        assert [r.anchor_us for r in got] == [30.0] * 6


@pytest.mark.gpu
def test_remeasure_in_groups_where_the_stacks_do_not_fit_together(monkeypatch):
    # A group of one stack beside the first (as though two filled the GPU): three configs in groups of 2 and 1, each
    # timed, and the final policy says so; without the limit, one group and no such entry.
    import math

    from tuner import evaluate
    from tuner.evaluate import GpuEvaluator

    shape = resolve("tiny")
    ev = GpuEvaluator(shape, reps=10, warmup=2)
    cfgs = [hand_picked(shape), default_config(shape), hand_picked(shape).without_knobs()]
    whole = ev.remeasure(cfgs, rounds=5)
    assert "groups" not in ev.final_policy(5)["remeasure"]
    monkeypatch.setattr(evaluate, "group_room", lambda per_stack, free: 1)
    split = ev.remeasure(cfgs, rounds=5)
    assert ev.final_policy(5)["remeasure"]["groups"] == [[2, 1]]
    assert len(split) == 3 and all(math.isfinite(m) and m > 0 for m, *_ in whole + split)
    assert all(abs(a[0] - b[0]) < 0.2 * b[0] for a, b in zip(split, whole)), (split, whole)
    # the baseline (index 1) in every group: groups of 2 and 2, each figure with the baseline's from its own group
    anchored = ev.remeasure(cfgs, rounds=5, anchor=1)
    assert ev.final_policy(5)["remeasure"]["groups"][-1] == [2, 2] and ev.final_policy(5)["remeasure"]["anchored"][-1]
    assert anchored[1].anchor_us == anchored[1].median_us and all(r.anchor_us > 0 for r in anchored)
    ratio = [r.median_us / r.anchor_us for r in anchored]
    assert all(abs(a - w.median_us / whole[1].median_us) < 0.2 * a for a, w in zip(ratio, whole)), (anchored, whole)


@pytest.mark.gpu
def test_hot_is_refused_on_the_gpu_for_a_model_larger_than_its_l2(tmp_path):
    from tuner.cli import main

    for argv in (["decoder", "--shape", "bert-base", "--l2", "hot", "--out", tmp_path],
                 ["bench", "--shape", "bert-large", "--l2", "hot", "--out", tmp_path]):
        assert main([str(a) for a in argv]) == 2
    assert not list(tmp_path.iterdir())
