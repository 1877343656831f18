"""The CUDA layer kernel (kernels/layer_kernel.cu, FusedLayerConfig.fuse = 2) against the fp32 torch layer.

On the CPU: its validity rules, its ctypes declaration and shared-memory layout against the C source, and the
Triton kernel that runs a fuse-2 config where the CUDA one cannot. On a Hopper GPU: odd shapes (partial row tiles,
several sequences, seq 32 to 128), both dtypes, every split and ring depth the search can pick, PDL between layers
and many replays of one graph (the flags are never reset: each launch waits for its own generation), and the
test-only racy variants, which the correctness check must catch.
"""

import ctypes
from dataclasses import replace

import pytest
import torch

from tuner.bench import hand_picked_fused
from tuner.config import DecoderConfig
from tuner.kernels import _nvcc, layer_cuda
from tuner.kernels._common import rel_tolerance
from tuner.kernels import fused_layer as fk
from tuner.layer import DecoderStack, check_config, fit_config, layer_problem
from tuner.shapes import DecoderShape, resolve

from devices import H200  # (tests/ is on sys.path under pytest)
from test_fused_layer import run_layer

CUDA2 = fk.FusedLayerConfig(fuse=2, num_stages=8, out_split_k=4, ffn2_split_k=4)
SMALL = DecoderShape(1, 24, 128, 2, 192, name="small")  # head dim 64, seq 24: one partial row tile


def test_launch_argtypes_match_the_c_signature():
    want = _nvcc.c_argtypes(layer_cuda.SOURCE.read_text(), "layer_launch")
    assert len(want) == 36 and all(t == ctypes.c_void_p for t in want[:19])
    assert layer_cuda.LAUNCH_ARGTYPES == want
    assert layer_cuda.ENCODE_ARGTYPES == _nvcc.c_argtypes(layer_cuda.SOURCE.read_text(), "layer_encode")


@pytest.mark.skipif(_nvcc.nvcc() is None, reason="needs nvcc")
def test_layout_matches_the_c_source(tmp_path, monkeypatch):
    # Built for sm_90a here too (the library loads without a GPU): its shared-memory and counter layouts are the
    # Python side's.
    monkeypatch.setenv("PDL_TUNE_CACHE", str(tmp_path))
    monkeypatch.setattr(layer_cuda, "_LIBS", {})
    lib = layer_cuda.library(1)
    for stages in (2, 8, 10):
        assert lib.layer_smem_bytes(stages) == layer_cuda.smem_bytes(stages)
    for shp in (resolve("tiny"), resolve("bert-large"), SMALL):
        assert lib.layer_sync_ints(shp.tokens, shp.d_model, shp.heads, shp.ffn) == layer_cuda.sync_ints(
            shp.tokens, shp.d_model, shp.heads, shp.ffn)


def test_check_fuse2():
    p = layer_problem(resolve("bert-base"))
    assert fk.check(CUDA2, p, H200) is None
    for name in ("tiny", "bert-large"):
        assert fk.check(fit_config(DecoderConfig(layer=CUDA2), resolve(name)).layer, layer_problem(resolve(name)),
                        H200) is None
    cases = {
        "out_split_k=5 must divide": replace(CUDA2, out_split_k=5),
        "ffn2_split_k=5 must divide": replace(CUDA2, ffn2_split_k=5),
        "num_stages=13 must be in 2..12": replace(CUDA2, num_stages=13),
        "shared memory": replace(CUDA2, num_stages=11),
        "programs=140": replace(CUDA2, programs=140),
        "fuse=3 must be 0, 1 or 2": replace(CUDA2, fuse=3),
    }
    for words, cfg in cases.items():
        why = fk.check(cfg, p, H200)
        assert why and words in why, (words, why)
    shapes = {"head dim 32": DecoderShape(1, 128, 256, 8, 512), "seq=256 > 128": DecoderShape(1, 256, 768, 12, 3072),
              "multiple of 64": DecoderShape(2, 48, 128, 2, 256), "ffn=200": DecoderShape(1, 32, 128, 2, 200)}
    for words, shp in shapes.items():
        why = fk.check(CUDA2, layer_problem(shp), H200)
        assert why and words in why, (words, why)


def test_tune_verify_checks_the_layer_kernel_on_every_preset():
    # tune verify's one-kernel-layer checks (bench.hand_picked_fused): the CUDA kernel's config (this file's CUDA2, PDL
    # at the start, full prefetch) and the Triton one's fit every preset on an H200, so neither check is skipped there
    for name in ("tiny", "bert-base", "bert-large"):
        shape = resolve(name)
        cuda, triton = hand_picked_fused(shape, cuda=True), hand_picked_fused(shape)
        assert cuda.layer == fit_config(DecoderConfig(layer=replace(CUDA2, overlap_ratio=0.0, prefetch_ratio=1.0)),
                                        shape).layer
        assert (cuda.layer.fuse, triton.layer.fuse) == (2, 1)
        assert check_config(cuda, shape, 2, H200) == {} and check_config(triton, shape, 2, H200) == {}


def test_fit_moves_splits_to_divisors():
    fitted = fit_config(DecoderConfig(layer=replace(CUDA2, out_split_k=5, ffn2_split_k=7, num_stages=14)),
                        resolve("bert-base")).layer
    assert (fitted.out_split_k, fitted.ffn2_split_k, fitted.num_stages) == (4, 6, 10)
    assert fk.check(fitted, layer_problem(resolve("bert-base")), H200) is None


def test_fuse2_runs_the_triton_kernel_off_hopper(device):
    if device == "cuda" and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("on Hopper the CUDA kernel runs: the GPU tests below")
    err, scratch = run_layer(SMALL, replace(CUDA2, out_split_k=2, ffn2_split_k=3), torch.float16, device)
    assert not scratch.cuda and scratch.poisonable() == [scratch.ws]
    assert err < 1e-2


def test_fp32_runs_the_triton_kernel_and_the_cuda_launcher_refuses_it(device):
    """The CUDA kernel's tiles are 16-bit words: in fp32, fuse 2 runs the Triton kernel on its tiles (as off Hopper),
    and the CUDA launcher refuses an fp32 tensor rather than read it as 16-bit words."""
    err, scratch = run_layer(SMALL, replace(CUDA2, out_split_k=2, ffn2_split_k=3), torch.float32, device)
    assert not scratch.cuda and err < rel_tolerance(torch.float32)
    with pytest.raises(ValueError, match="16-bit operands"):
        layer_cuda.launch(torch.zeros(64, 64), None, None, None, seq=64, heads=1, config=CUDA2, eps=1e-5, grid=1)


def test_a_scratch_launched_under_one_grid_refuses_another():
    # The kernel counts each CTA's launches in its own generation word of the scratch's sync ints: launched under
    # another grid, a CTA behind would take an earlier launch's flags as ready (the race audit; no caller does it)
    from types import SimpleNamespace

    x = torch.zeros(64, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="launched with a grid of 132 CTAs, not 66: .* its own LayerScratch"):
        layer_cuda.launch(x, None, SimpleNamespace(grid=132), None, seq=64, heads=1, config=CUDA2, eps=1e-5, grid=66)


gpu = pytest.mark.gpu
hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                            reason="needs a Hopper GPU")

ODD = [
    resolve("tiny"), resolve("bert-base"), resolve("bert-large"),
    DecoderShape(1, 96, 512, 8, 1536, name="m96"),        # a partial second row tile
    DecoderShape(2, 128, 256, 4, 512, name="two-seqs"),   # four row tiles, two sequences
    DecoderShape(3, 64, 128, 2, 320, name="three-64"),    # a sequence a row tile
    DecoderShape(1, 17, 64, 1, 64, name="seq17"),         # one head, 17 rows
]


@gpu
@hopper
@pytest.mark.parametrize("shape", ODD, ids=lambda s: s.label)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_layer_kernel_matches_reference(shape, dtype):
    nd, nf = shape.d_model // 64, shape.ffn // 64
    cfg = replace(CUDA2, out_split_k=max(d for d in (1, 2, 3, 4) if nd % d == 0),
                  ffn2_split_k=max(d for d in (1, 2, 3, 4, 5, 6) if nf % d == 0))
    err, scratch = run_layer(shape, cfg, dtype, "cuda")
    assert scratch.cuda
    assert err < (1e-2 if dtype == torch.float16 else 3e-2), err
    assert int(scratch.ws.abs().sum()) == 0  # the last split of each tile zeroed its sums


@gpu
@hopper
@pytest.mark.parametrize("edit", [dict(num_stages=2, out_split_k=1, ffn2_split_k=1),
                                  dict(num_stages=3, out_split_k=12, ffn2_split_k=48),
                                  dict(num_stages=10, out_split_k=6, ffn2_split_k=8, programs=40),
                                  dict(num_stages=4, out_split_k=2, ffn2_split_k=16, programs=7)],
                         ids=["2-stages-no-split", "split-every-tile", "10-stages-40-ctas", "7-ctas"])
def test_layer_kernel_splits_stages_and_grids(edit):
    err, _ = run_layer(resolve("bert-base"), replace(CUDA2, **edit), torch.float16, "cuda")
    assert err < 1e-2, err


@gpu
@hopper
@pytest.mark.parametrize("knobs", [(-1.0, -1.0), (0.0, 1.0), (0.5, 0.5), (1.0, 0.0)],
                         ids=["off", "pdl0-pf1", "pdl.5-pf.5", "pdl1-pf0"])
@pytest.mark.parametrize("stages", [4, 10])
def test_layer_kernel_stack_every_replay(knobs, stages):
    """A bert-base stack in one CUDA graph, replayed again and again: correct every time (each launch waits for
    the flags of its own generation), with and without PDL between the layers."""
    shape = resolve("bert-base")
    cfg = fit_config(DecoderConfig(layer=replace(CUDA2, num_stages=stages, overlap_ratio=knobs[0],
                                                 prefetch_ratio=knobs[1])), shape)
    assert check_config(cfg, shape) == {}
    st = DecoderStack(shape, cfg, n_layers=6, dtype=torch.float16, device="cuda", seed=1)
    st.capture()
    for seed in range(4):
        err = st.check(seed=seed)
        assert err < st.tolerance(), (seed, err)
    for _ in range(50):
        st.replay()
    assert st.check(seed=9) < st.tolerance()


@gpu
@hopper
@pytest.mark.parametrize("phase", ["qkv", "attn", "out", "ffn1", "ffn2"])
def test_layer_kernel_racy_phase_is_caught(phase):
    """A phase that loads its activations without waiting for their flags (or, for QKV, before griddepcontrol.wait)
    reads poisoned or stale tiles: the check catches it (with PDL, in a graph, after a slow predecessor)."""
    shape = resolve("bert-base")
    cfg = fit_config(DecoderConfig(layer=replace(CUDA2, overlap_ratio=0.0, prefetch_ratio=1.0)), shape)
    st = DecoderStack(shape, cfg, n_layers=3, dtype=torch.float16, device="cuda", seed=2)
    st.racy = (1, phase)
    st.capture()
    caught = sum(st.check(seed=s, layers=[1]) > st.tolerance() for s in range(10))
    st.racy = None
    st.capture()
    assert all(st.check(seed=s, layers=[1]) < st.tolerance() for s in range(3))
    assert caught >= 5, caught


@gpu
@hopper
def test_verify_checks_every_phase_and_holds_nothing():
    """`tune verify`'s path for a fuse-2 configuration (verify.run_verify): the racy variants are the one launch's
    phases, which have no launch before them to hold back (verify.held_predecessor is None, not an error). Each phase's
    race is still caught, and the kernel without the defect never fails."""
    from tuner.verify import run_verify

    shape = resolve("bert-base")
    cfg = fit_config(DecoderConfig(layer=replace(CUDA2, overlap_ratio=0.0, prefetch_ratio=1.0)), shape)
    res = run_verify(shape, cfg, n_layers=3, race_trials=6)
    assert [r["kernel"] for r in res["races"]] == list(layer_cuda.PHASES)
    for r in res["races"]:
        assert r["slowed"] is None and r["false_alarms"] == 0 and r["caught"] >= 3, r
