"""Attention in the QKV GEMM's tail (``AttnConfig.fuse`` 1, ``attention.attn_tail``): the program that stores the
last Q/K/V tile of a (row tile, head) runs that task's attention. CPU: the interpreter runs the programs one after
another, which checks the task bookkeeping (which tiles a task needs, counters back at zero) on odd shapes. GPU:
the same with every program in flight at once, inside a PDL chain and a CUDA graph, with a racy variant that the
checks must catch."""

from dataclasses import replace

import pytest
import torch

from tuner.bench import hand_picked
from tuner.kernels._common import REL_TOLERANCE, rel_error
from tuner.kernels.attention import AttnProblem, AttnTail, attention_ref, tail_counters, tail_error
from tuner.kernels.gemm import GemmConfig, linear, linear_ref
from tuner.layer import DecoderStack, check_config, repair_config
from tuner.shapes import DecoderShape


def _qkv_with_tail(batch, seq, heads, head_dim, cfg, kv_block, dtype, device, causal=True, racy=False, seed=0,
                   overlap=-1.0):
    D = heads * head_dim
    M, K = batch * seq, 48
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    w = (torch.randn(3 * D, K, generator=g) / K**0.5).to(dtype).to(device)
    bias = torch.randn(3 * D, generator=g).to(dtype).to(device)
    qkv = torch.full((M, 3 * D), float("nan"), dtype=dtype, device=device)
    att = torch.full((M, D), float("nan"), dtype=dtype, device=device)  # an unwritten element stays NaN
    cnt = tail_counters(M, heads, cfg.block_m, device)
    tail = AttnTail(att, cnt, batch, seq, heads, head_dim, block_n=kv_block, causal=causal, racy=racy)
    linear(x, w, bias, config=replace(cfg, overlap_ratio=overlap), out=qkv, attention=tail)
    return x, w, bias, qkv, att, cnt


# (batch, seq, heads, head_dim), QKV tile (block_m, block_n), key block: a sequence tail that is not a whole
# row tile, several row tiles (causal tasks of 1..3 K/V row tiles), heads of two QKV column tiles each, the
# padded head dim (48 -> 64), batches whose row tiles stay inside their sequence, a key block past seq.
CASES = [
    ((1, 37, 2, 32), (16, 32), 16),
    ((2, 32, 3, 32), (16, 16), 16),
    ((1, 40, 2, 48), (16, 16), 32),
    ((2, 16, 2, 64), (16, 32), 64),
]
IDS = ["b1s37h2d32", "b2s32h3d32-2tiles-a-head", "b1s40h2d48", "b2s16h2d64"]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape, tile, kv", CASES, ids=IDS)
def test_tail_matches_attention_ref(shape, tile, kv, causal, device):
    b, s, h, d = shape
    cfg = GemmConfig(block_m=tile[0], block_n=tile[1], block_k=16, num_stages=1,
                     num_warps=1 if tile[0] * tile[1] < 512 else 4)
    assert tail_error(cfg.block_m, cfg.block_n, cfg.split_k, AttnProblem(b, s, h, d), kv) is None
    x, w, bias, qkv, att, cnt = _qkv_with_tail(b, s, h, d, cfg, kv, torch.float16, device, causal=causal)
    assert rel_error(qkv, linear_ref(x, w, bias)) < REL_TOLERANCE[torch.float16]
    err = rel_error(att, attention_ref(qkv, batch=b, seq=s, heads=h, head_dim=d, causal=causal))
    assert err < REL_TOLERANCE[torch.float16], err
    assert int(cnt.abs().sum()) == 0, "every launch leaves the task counters at zero for the next"


def test_tail_bf16_and_a_second_launch_on_the_same_counters(device):
    b, s, h, d = 1, 33, 2, 32
    cfg = GemmConfig(block_m=16, block_n=32, block_k=16, num_stages=1, num_warps=4)
    for seed in (1, 2):  # the second launch reuses the counters the first left at zero
        x, w, bias, qkv, att, cnt = _qkv_with_tail(b, s, h, d, cfg, 16, torch.bfloat16, device, seed=seed)
        err = rel_error(att, attention_ref(qkv, batch=b, seq=s, heads=h, head_dim=d))
        assert err < REL_TOLERANCE[torch.bfloat16], err


def test_racy_tail_runs_a_task_before_its_inputs(device):
    # The test-only defect runs a task at its first input tile. In the interpreter the programs run in order,
    # so the Q tile of row tile 0 comes first and its task reads K and V tiles still NaN.
    cfg = GemmConfig(block_m=16, block_n=32, block_k=16, num_stages=1, num_warps=4)
    b, s, h, d = 1, 37, 2, 32
    *_, qkv, att, _ = _qkv_with_tail(b, s, h, d, cfg, 16, torch.float32, device, racy=True)
    assert not rel_error(att, attention_ref(qkv, batch=b, seq=s, heads=h, head_dim=d)) < 1e-2


@pytest.mark.parametrize("tile, split, problem, needle", [
    ((16, 32), 2, AttnProblem(1, 37, 2, 32), "split_k 1"),
    ((16, 64), 1, AttnProblem(1, 37, 2, 32), "inside one head"),
    ((16, 32), 1, AttnProblem(2, 37, 2, 32), "inside one sequence"),
])
def test_tail_error(tile, split, problem, needle):
    assert needle in tail_error(tile[0], tile[1], split, problem, 16)


def test_linear_refuses_a_tail_it_cannot_run(device):
    cfg = GemmConfig(block_m=16, block_n=64, block_k=16, num_stages=1, num_warps=4)
    with pytest.raises(ValueError, match="inside one head"):
        _qkv_with_tail(1, 17, 2, 32, cfg, 16, torch.float32, device)
    x = torch.zeros(17, 48, device=device)
    w = torch.zeros(3 * 64, 48, device=device)
    bad = AttnTail(torch.empty(17, 64, device=device), torch.zeros(1, dtype=torch.int32, device=device), 1, 17, 2, 32)
    with pytest.raises(ValueError, match="counters"):
        linear(x, w, config=GemmConfig(block_m=16, block_n=32, block_k=16, num_warps=4), attention=bad)


ODD = DecoderShape(1, 37, 64, 2, 96, name="odd-tail")


def _fused_attn(shape, **qkv):
    cfg = hand_picked(shape)
    return replace(cfg, qkv=replace(cfg.qkv, split_k=1, cluster=0, **qkv), attn=replace(cfg.attn, fuse=1))


def test_stack_with_attention_in_the_qkv_tail(device):
    cfg = _fused_attn(ODD, block_m=16, block_n=32)
    assert check_config(cfg, ODD) == {}
    st = DecoderStack(ODD, cfg, n_layers=2, dtype=torch.float16, device=device, seed=3)
    assert st.launches("attn") == [] and len(st.launches("qkv")) == 2  # no attention kernel
    err = st.check(seed=5)
    assert err < st.tolerance(), err


def test_repair_and_check_of_the_fused_attention():
    cfg = _fused_attn(ODD, block_m=16, block_n=64)  # a QKV tile across two heads of 32
    assert "inside one head" in check_config(cfg, ODD)["attn"]
    assert repair_config(cfg, ODD).attn.fuse == 0
    ok = _fused_attn(ODD, block_m=16, block_n=32)
    assert repair_config(ok, ODD).attn.fuse == 1


# ---- GPU: every program in flight at once, in the PDL chain, in a graph -------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [-1.0, 0.0], ids=["nopdl", "pdl"])
@pytest.mark.parametrize("shape, tile, kv", [
    ((1, 128, 12, 64), (64, 64), 128),  # bert-base
    ((1, 128, 12, 64), (32, 64), 64),
    ((2, 96, 4, 64), (32, 64), 32),
    ((1, 37, 2, 32), (16, 32), 16),
], ids=["bert-base-64x64-kv128", "bert-base-32x64-kv64", "b2s96", "b1s37"])
def test_tail_gpu(shape, tile, kv, overlap):
    b, s, h, d = shape
    cfg = GemmConfig(block_m=tile[0], block_n=tile[1], block_k=16, num_stages=2, num_warps=4)
    for seed in range(5):
        torch.cuda._sleep(1_000_000)  # queue the launch behind a busy kernel: every program in flight at once
        x, w, bias, qkv, att, cnt = _qkv_with_tail(b, s, h, d, cfg, kv, torch.float16, "cuda", seed=seed,
                                                   overlap=overlap)
        torch.cuda.synchronize()
        err = rel_error(att, attention_ref(qkv, batch=b, seq=s, heads=h, head_dim=d))
        assert err < REL_TOLERANCE[torch.float16], (seed, err)
        assert int(cnt.abs().sum()) == 0


@pytest.mark.gpu
def test_racy_tail_is_caught_gpu():
    b, s, h, d = 1, 128, 12, 64
    cfg = GemmConfig(block_m=64, block_n=64, block_k=16, num_stages=2, num_warps=4)
    caught = 0
    for seed in range(10):
        *_, qkv, att, _ = _qkv_with_tail(b, s, h, d, cfg, 128, torch.float16, "cuda", racy=True, seed=seed)
        torch.cuda.synchronize()
        caught += not rel_error(att, attention_ref(qkv, batch=b, seq=s, heads=h, head_dim=d)) < 1e-2
    assert caught >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "bert-base"])
def test_stack_with_attention_in_the_qkv_tail_gpu(preset):
    # The committed per-kernel best of each shape with attention moved into its QKV tail, in one CUDA graph
    # (the PDL chain), checked over 10 replays on poisoned buffers; the racy tail in layer 1 must be caught.
    from tuner.shapes import resolve

    shape = resolve(preset)
    cfg = _fused_attn(shape, block_m=64, block_n=64)
    cfg = replace(cfg, qkv=replace(cfg.qkv, overlap_ratio=0.0), out=replace(cfg.out, overlap_ratio=0.0))
    assert check_config(cfg, shape) == {}, check_config(cfg, shape)
    st = DecoderStack(shape, cfg, n_layers=3, dtype=torch.float16, seed=2)
    st.capture()
    errs = [st.check(seed=100 + i) for i in range(10)]
    assert max(errs) < st.tolerance(), errs
    st.racy = (1, "attn")
    st.capture()
    caught = sum(not st.check(seed=200 + i, layers=[1]) < st.tolerance() for i in range(10))
    assert caught >= 1
