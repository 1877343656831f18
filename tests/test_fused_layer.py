"""The one-kernel layer (tuner.kernels.fused_layer) against the fp32 torch layer, on odd shapes.

In the interpreter the launcher runs one program, so every barrier and split-K fix-up path runs
(trivially complete); the GPU tests run the real grid, with PDL between layers and repeated replays
(the counters must come back to zero after every launch).
"""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tuner.bench import hand_picked_fused
from tuner.config import DecoderConfig
from tuner.kernels import fused_layer as fk
from tuner.kernels._common import rel_error, rel_tolerance
from tuner.layer import DecoderStack, LayerWeights, check_config, fit_config, layer_problem, layer_ref
from tuner.report import format_tiles, gemm_op
from tuner.shapes import DecoderShape, resolve
from tuner import space

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from devices import A100, H100, H200  # noqa: E402  (tests/ is on sys.path under pytest)
from smem_check import refused_layer_configs  # noqa: E402  (the scan of the committed runs' refused launches)

ODD = DecoderShape(1, 17, 32, 1, 90, name="odd")  # seq 17, one head of dim 32, ffn 90: every tile masked
TWO = DecoderShape(2, 24, 64, 2, 96, name="two")  # two sequences, two heads

SMALL = fk.FusedLayerConfig(fuse=1, block_m=16, block_k=32, qkv_block_n=64, out_block_n=32, ffn1_block_n=32,
                            ffn2_block_n=16, ffn2_split_k=2, attn_block_m=16, attn_block_n=16)
# Split-K in every GEMM (the LayerNorm row sums then travel with the partials), big tiles.
SPLIT = fk.FusedLayerConfig(fuse=1, block_m=64, block_k=16, qkv_block_n=32, qkv_split_k=3, out_split_k=2,
                            ffn1_block_n=64, ffn1_split_k=2, ffn2_block_n=64, ffn2_split_k=5, attn_block_m=32,
                            attn_block_n=16, num_warps=8, num_stages=2)


def run_layer(shape, cfg, dtype, device, seed=0, racy=None):
    g = torch.Generator().manual_seed(seed)
    w = LayerWeights.random(shape, dtype, device, g)
    x = torch.randn(shape.tokens, shape.d_model, generator=g).to(dtype).to(device)
    p = layer_problem(shape, x.element_size())
    cfg = fk.fit(cfg, p)
    assert fk.check(cfg, p) is None, fk.check(cfg, p)
    scratch = fk.LayerScratch(cfg, p, dtype, device)
    out = torch.full_like(x, float("nan"))
    fk.decoder_layer(x, w.fused(), seq=shape.seq, heads=shape.heads, config=cfg, scratch=scratch, out=out,
                     _racy=racy)
    return rel_error(out, layer_ref(shape, w, x)), scratch


@pytest.mark.parametrize("shape", [ODD, TWO], ids=["odd", "two-seqs"])
@pytest.mark.parametrize("cfg", [SMALL, SPLIT], ids=["small-tiles", "split-k-everywhere"])
def test_fused_layer_matches_reference(shape, cfg, device):
    err, scratch = run_layer(shape, cfg, torch.float16, device)
    assert err < 1e-2, err
    # The last program out reset every barrier and tile counter for the next launch.
    assert int(scratch.sync.abs().sum()) == 0


@pytest.mark.parametrize("shape", [ODD, TWO], ids=["odd", "two-seqs"])
def test_fused_layer_bf16(shape, device):
    err, _ = run_layer(shape, SMALL, torch.bfloat16, device)
    assert err < rel_tolerance(torch.bfloat16), err


def test_racy_variant_is_the_qkv_phase_only(device):
    # tune verify's racy variant of the Triton layer kernel: its QKV phase reads x before gdc_wait. Launched alone
    # without PDL there is nothing to race with, so it computes the same layer; a phase it has no variant for is
    # refused.
    err, _ = run_layer(TWO, SMALL, torch.float16, device, racy="qkv")
    assert err < 1e-2, err
    with pytest.raises(ValueError, match="racy variant is its QKV phase, not 'attn'"):
        run_layer(TWO, SMALL, torch.float16, device, racy="attn")


def test_fused_stack_in_the_runtime(device):
    cfg = replace(hand_picked_fused(TWO), layer=replace(fit_config(DecoderConfig(layer=SMALL), TWO).layer,
                                                        overlap_ratio=0.0, prefetch_ratio=1.0))
    assert check_config(cfg, TWO) == {}
    st = DecoderStack(TWO, cfg, n_layers=2, dtype=torch.float16, device=device, seed=3)
    assert len(st.launches("layer")) == 2 and st.launches("qkv") == []
    err = st.check(seed=5)
    assert err < st.tolerance(), err


def test_check_names_the_problem():
    p = layer_problem(resolve("bert-base"))
    ok = fit_config(DecoderConfig(layer=SMALL), resolve("bert-base")).layer
    assert fk.check(ok, p, H200) is None
    cases = {
        "programs=200 must be in 0..132": replace(ok, programs=200),
        "ffn2_split_k=9 leaves a split without K tiles": replace(ok, block_k=64, ffn2_split_k=9, ffn2_block_n=64),
        "block_m=48 must be a power of two": replace(ok, block_m=48),
        "fuse=3 must be 0, 1 or 2": replace(ok, fuse=3),
        "num_warps=3": replace(ok, num_warps=3),
        "shared memory": replace(ok, block_m=128, block_k=128, qkv_block_n=128, num_stages=8),
        "overlap_ratio=1.5": replace(ok, overlap_ratio=1.5),
    }
    for words, cfg in cases.items():
        why = fk.check(cfg, p, H200)
        assert why and words in why, (words, why)
    assert "head_dim=16" in fk.check(ok, fk.LayerProblem(16, 16, 64, 4, 64))


def test_fit_repairs_what_the_search_samples():
    shape = resolve("tiny")
    cfg = fk.FusedLayerConfig(fuse=1, block_m=128, block_k=128, qkv_block_n=256, ffn2_split_k=8, attn_block_m=64,
                              attn_block_n=128, num_stages=8, num_warps=2)
    fitted = fit_config(DecoderConfig(layer=cfg), shape).layer
    assert fk.check(fitted, layer_problem(shape)) is None
    assert (fitted.block_m, fitted.attn_block_m, fitted.attn_block_n) == (32, 32, 32)


BERT_BASE = fk.LayerProblem(128, 128, 768, 12, 3072)
# One of each way a phase can set the kernel's shared memory: a wgmma LayerNorm phase (FFN1 at 128 columns), a
# wgmma plain one (the out-projection), mma.sync at 32 rows and at two warps, one stage (nothing pipelined), the
# attention's tiles over small GEMM tiles, and split-K.
SMEM_CASES = [
    fk.FusedLayerConfig(fuse=1, block_m=64, block_k=128, num_stages=4, ffn1_block_n=128, qkv_block_n=16,
                        out_block_n=16, ffn2_block_n=16, attn_block_m=32, attn_block_n=32),
    fk.FusedLayerConfig(fuse=1, block_m=128, block_k=64, num_stages=3, out_block_n=128, qkv_block_n=16,
                        ffn1_block_n=16, ffn2_block_n=16, attn_block_m=32, attn_block_n=32),
    fk.FusedLayerConfig(fuse=1, block_m=32, block_k=128, num_stages=5, ffn1_block_n=128, qkv_block_n=16,
                        out_block_n=64, ffn2_block_n=32, ffn2_split_k=8, attn_block_m=32, attn_block_n=32),
    fk.FusedLayerConfig(fuse=1, block_m=128, block_k=64, num_stages=3, num_warps=2, out_block_n=64, qkv_block_n=16,
                        ffn1_block_n=16, ffn2_block_n=16, attn_block_m=32, attn_block_n=32),
    fk.FusedLayerConfig(fuse=1, block_m=64, block_k=64, num_stages=1, ffn1_block_n=64, qkv_block_n=16,
                        out_block_n=16, ffn2_block_n=16, attn_block_m=32, attn_block_n=32),
    fk.FusedLayerConfig(fuse=1, block_m=16, block_k=16, num_stages=1, qkv_block_n=16, out_block_n=16,
                        ffn1_block_n=16, ffn2_block_n=16, attn_block_m=64, attn_block_n=128),
    fk.FusedLayerConfig(fuse=1, block_m=64, block_k=64, num_stages=8, num_warps=8, qkv_block_n=32, qkv_split_k=3,
                        out_block_n=16, out_split_k=3, ffn1_block_n=128, ffn2_block_n=16, ffn2_split_k=2,
                        attn_block_m=32, attn_block_n=32),
]


def test_smem_bytes_is_what_triton_allocates():
    """The count against triton.compile's allocation for sm_90 and sm_80 (no GPU needed; compile_smem.py compiles
    the launcher's own launch in a process without the interpreter, which replaces the kernels the compiler reads)."""
    from dataclasses import asdict

    from compile_smem import compiled_shared

    dims = [BERT_BASE.tokens, BERT_BASE.seq, BERT_BASE.d_model, BERT_BASE.heads, BERT_BASE.ffn]
    # Every case on Hopper; before it (mma.sync everywhere: one stage fewer of A+B) the two wgmma ones.
    cases = [(c, H100, 90) for c in SMEM_CASES] + [(c, A100, 80) for c in SMEM_CASES[:2]]
    compiled = compiled_shared([dict(kind="layer", config=asdict(c), problem=dims, arch=arch) for c, _, arch in cases])
    assert [fk.smem_bytes(c, BERT_BASE, dev) for c, dev, _ in cases] == compiled
    assert compiled[-2] < compiled[0] and compiled[-1] < compiled[1]


def test_smem_bytes_refuses_what_the_gpu_refused():
    """Every one-kernel-layer launch that a study's GPU refused for shared memory (the committed run folders' trials,
    status out_of_resources) is refused by check() with the GPU's own count, and fit() repairs it."""
    from tuner.shapes import resolve as shape_of

    refused = refused_layer_configs()
    assert len(refused) >= 4, refused
    for (name, need), sampled in refused.items():
        p = layer_problem(shape_of(name))
        repaired = fk.fit(sampled, p)
        # What the evaluator launched: fit's tiles and splits at the sampled depth (the count before this one
        # lowered none of these depths).
        launched = replace(repaired, num_stages=sampled.num_stages)
        assert fk.smem_bytes(launched, p, H100) == need, (name, launched)
        assert "shared memory" in fk.check(launched, p, H100)
        assert fk.check(repaired, p, H100) is None and repaired.num_stages < launched.num_stages


def test_space_and_reports_know_the_fused_layer():
    sp = space.load()
    params = space.from_config(hand_picked_fused(resolve("bert-base")))
    assert sp.contains(params) and space.to_config(params).fused
    kernels = hand_picked_fused(resolve("bert-base")).to_dict()["kernels"]
    assert format_tiles(kernels).startswith("layer 64x*x64/8w4s qkv n64/sk1")
    assert gemm_op(kernels, "ffn2") == "(0.0,1.0)"
    kernels["layer"]["fuse"] = 0
    assert format_tiles(kernels).startswith("qkv ")


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [(-1.0, -1.0), (0.0, 1.0), (1.0, 0.5)], ids=["off", "pdl0-pf1", "pdl1-pf.5"])
def test_fused_stack_on_gpu_every_replay(knobs):
    """A bert-base stack: correct on several replays in a row (counters reset), with and without PDL."""
    shape = resolve("bert-base")
    cfg = hand_picked_fused(shape)
    cfg = replace(cfg, layer=replace(cfg.layer, overlap_ratio=knobs[0], prefetch_ratio=knobs[1]))
    st = DecoderStack(shape, cfg, n_layers=4, dtype=torch.float16, device="cuda", seed=1)
    st.capture()
    for seed in range(3):
        err = st.check(seed=seed)
        assert err < st.tolerance(), (seed, err)
    for b in st.bufs:
        assert int(b.fused.sync.abs().sum()) == 0


@pytest.mark.gpu
def test_fused_split_everywhere_on_gpu():
    err, scratch = run_layer(resolve("bert-base"), replace(SPLIT, block_m=64, block_k=64, qkv_split_k=2,
                                                           ffn2_split_k=4), torch.float16, "cuda")
    assert err < 1e-2, err


@pytest.mark.gpu
def test_verify_catches_the_racy_qkv_phase():
    """`tune verify`'s check of the Triton one-kernel layer, the stack's layers chained by PDL (verify.run_verify): its
    QKV phase reading x, the previous layer's output, before gdc_wait is caught; without the defect, never a failure.
    Nothing is held: the previous launch is a whole layer, which has no held variant."""
    from tuner.verify import run_verify

    shape = resolve("bert-base")
    res = run_verify(shape, hand_picked_fused(shape), n_layers=3, race_trials=6)
    assert res["census"] == {"launches": 3, "with_pdl": 3, "by_kernel": {"_layer_kernel pdl=True": 3},
                             "pdl_without_wait": []}
    (r,) = res["races"]
    assert r["kernel"] == "qkv" and r["slowed"] is None and r["false_alarms"] == 0 and r["caught"] >= 3, r
