"""tuner.runtime.TunedLayer and TunedStack (tuned layers in the user's PyTorch code), and the README snippet that uses
them.

The snippet is the fenced block ```python title="load-best"``` of README.md, executed as written except
for its four setting lines (which best.json, which shape, which device, how many layers), so the README cannot drift
from the API. Without a GPU it runs through the Triton interpreter on a small custom shape.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import tuner
import tuner.layer

from tuner.bench import hand_picked
from tuner.config import ConfigError, DecoderConfig
from tuner.export import ConfigMismatchWarning
from tuner.kernels._common import rel_tolerance
from tuner.layer import LayerWeights, check_config
from tuner.runtime import MODULE_NAMES, TunedLayer, TunedStack, WeightsError
from tuner.shapes import DecoderShape

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
REPLAY = ROOT / "tests" / "data" / "replay-bert-base-h200"
SMALL = DecoderShape(1, 24, 64, 2, 96, name="small")  # 24 tokens, head dim 32, ffn 96: odd, and quick to interpret


class ReferenceLayer(nn.Module):
    """A layer laid out with the module names TunedLayer reads."""

    def __init__(self, d, ffn):
        super().__init__()
        self.ln1, self.qkv, self.out = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.ffn1, self.ffn2 = nn.LayerNorm(d), nn.Linear(d, ffn), nn.Linear(ffn, d)


def _module(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    m = ReferenceLayer(SMALL.d_model, SMALL.ffn)
    with torch.no_grad():  # LayerNorm starts at (1, 0): move it so a swapped weight/bias would show
        for ln in (m.ln1, m.ln2):
            ln.weight.add_(0.1 * torch.randn_like(ln.weight))
            ln.bias.add_(0.1 * torch.randn_like(ln.bias))
    return m


def _rel(y, ref) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("form", ["module", "state-dict", "field-names", "layer-weights"])
def test_every_weights_form_gives_the_same_layer(form, device):
    m = _module()
    sd = m.state_dict()
    fields = {f: sd[n] for f, n in MODULE_NAMES.items()}
    weights = {"module": m, "state-dict": sd, "field-names": fields, "layer-weights": LayerWeights(**fields)}[form]
    layer = TunedLayer(hand_picked(SMALL), SMALL, weights, dtype=torch.float16, device=device)
    x = torch.randn(SMALL.batch, SMALL.seq, SMALL.d_model, dtype=torch.float16, device=device)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == torch.float16
    ref = layer.reference(x)
    assert _rel(y, ref) < 1e-2
    # The reference is the plain PyTorch layer on the module's own weights (nothing lost in the conversion).
    with torch.no_grad():
        xf = x.float().cpu().view(SMALL.tokens, SMALL.d_model)
        h = xf + m.out(_attn(m.qkv(m.ln1(xf))))
        want = h + m.ffn2(nn.functional.gelu(m.ffn1(m.ln2(h)), approximate="tanh"))
    assert _rel(ref.cpu().view_as(want), want) < 5e-3


def _attn(qkv):
    s, h, hd = SMALL.seq, SMALL.heads, SMALL.head_dim
    q, k, v = qkv.view(1, s, 3, h, hd).permute(2, 0, 3, 1, 4)
    return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(s, h * hd)


def test_a_config_tuned_for_a_larger_shape_is_fitted(device):
    """best.json of bert-base on a smaller layer: tiles shrink to the shape, the result stays right."""
    from tuner.shapes import PRESETS

    big = hand_picked(PRESETS["bert-large"])
    layer = TunedLayer(big, SMALL, _module(), dtype=torch.float32, device=device)
    assert layer.config.qkv.block_m <= 32 and check_config(layer.config, SMALL) == {}
    x = torch.randn(SMALL.tokens, SMALL.d_model, device=device)
    assert _rel(layer(x), layer.reference(x)) < 5e-3


def test_a_clustered_fused_config_is_repaired_for_a_small_shape(device):
    """tiny's clustered seed (split-K in clusters, the feed-forward block as one kernel) on a layer whose K is one
    tile: the splits and the fused block no longer fit, so they are switched off (as the search does), not refused
    (the README snippet failed this way on tiny's best.json before)."""
    from tuner.bench import hand_picked_cluster
    from tuner.shapes import PRESETS

    cfg = hand_picked_cluster(PRESETS["tiny"])
    assert cfg.qkv.cluster and cfg.ffn2.fuse
    layer = TunedLayer(cfg, SMALL, _module(), dtype=torch.float16, device=device)
    assert layer.config.qkv.cluster == 0 and layer.config.ffn2.fuse == 0
    x = torch.randn(SMALL.tokens, SMALL.d_model, device=device, dtype=torch.float16)
    assert _rel(layer(x), layer.reference(x)) < 1e-2


def test_the_output_buffer_is_reused(device):
    layer = TunedLayer(hand_picked(SMALL), SMALL, _module(), dtype=torch.float32, device=device)
    x1, x2 = (torch.randn(SMALL.tokens, SMALL.d_model, device=device) for _ in range(2))
    y1 = layer(x1)
    kept = y1.clone()
    y2 = layer(x2)
    assert y1.data_ptr() == y2.data_ptr() and not torch.equal(kept, y2)


@pytest.mark.parametrize("case, words", [
    ("missing", ["missing", "qkv.weight", "w_qkv"]),
    ("shape", ["w_ffn1", "(96, 64)", "1x24x64x2x96"]),
    ("type", ["LayerWeights", "list"]),
], ids=["missing-tensor", "wrong-shape", "wrong-type"])
def test_weights_errors_name_the_tensor(case, words):
    sd = dict(_module().state_dict())
    if case == "missing":
        del sd["qkv.weight"]
        weights = sd
    elif case == "shape":
        sd["ffn1.weight"] = sd["ffn1.weight"][:, :32]
        weights = sd
    else:
        weights = [1, 2]
    with pytest.raises(WeightsError) as e:
        TunedLayer(hand_picked(SMALL), SMALL, weights, dtype=torch.float32, device="cpu")
    assert all(w in str(e.value) for w in words), str(e.value)


def test_input_and_config_errors(device):
    layer = TunedLayer(hand_picked(SMALL), SMALL, _module(), dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match=r"\[1, 24, 64\]"):
        layer(torch.randn(2, SMALL.seq, SMALL.d_model, device=device))
    with pytest.raises(ValueError, match="float16"):
        layer(torch.randn(SMALL.tokens, SMALL.d_model, dtype=torch.float16, device=device))
    # as many elements, another layout: [seq, batch, d_model] or a fourth dimension is refused, not read as rows
    for wrong in ((SMALL.seq, SMALL.batch, SMALL.d_model), (SMALL.batch, 1, SMALL.seq, SMALL.d_model)):
        with pytest.raises(ValueError, match=r"must be \[1, 24, 64\] or \[24, 64\]"):
            layer(torch.randn(*wrong, device=device))
    with pytest.raises(TypeError, match="ndarray, not a torch.Tensor"):
        layer(torch.randn(SMALL.tokens, SMALL.d_model).numpy())
    bad = replace(DecoderConfig(), qkv=replace(DecoderConfig().qkv, num_warps=3))
    with pytest.raises(ConfigError, match="qkv: num_warps=3"):
        TunedLayer(bad, SMALL, _module(), dtype=torch.float32, device=device)


def test_the_layer_keeps_its_own_weights(device):
    """The layer copies the weights (and folds the LayerNorms into its copies once): a later in-place change to the
    module's parameters changes neither its output nor its reference, whatever the dtypes (the copy was skipped where
    they matched, and the folded copies then disagreed with the rest: rel. error 0.5)."""
    m = _module()
    cfg = hand_picked(SMALL)
    cfg = replace(cfg, norm1=replace(cfg.norm1, fuse=2), norm2=replace(cfg.norm2, fuse=2))
    layer = TunedLayer(cfg, SMALL, m, dtype=torch.float32, device=device)
    x = torch.randn(SMALL.tokens, SMALL.d_model, device=device)
    y, ref = layer(x).clone(), layer.reference(x)
    with torch.no_grad():
        for t in m.parameters():
            t.mul_(1.5)
    assert torch.equal(layer(x), y) and torch.equal(layer.reference(x), ref)
    assert _rel(y, ref) < rel_tolerance(torch.float32)


@pytest.mark.parametrize("dtype, error", [
    (torch.float64, "dtype torch.float64: the layer runs in float16, bfloat16, float32"),
    (torch.int8, "dtype torch.int8"),
    ("float8", "dtype 'float8'"),
    ("bfloat16", None),  # a dtype's name, as best.json spells it
])
def test_the_dtype_is_one_the_kernels_run(dtype, error):
    if error is None:
        assert TunedLayer(hand_picked(SMALL), SMALL, _module(), dtype=dtype, device="cpu").dtype == torch.bfloat16
        return
    with pytest.raises(WeightsError, match=re.escape(error)):
        TunedLayer(hand_picked(SMALL), SMALL, _module(), dtype=dtype, device="cpu")
    with pytest.raises(WeightsError, match="float64"):  # weights in float64, no dtype given
        TunedLayer(hand_picked(SMALL), SMALL, _module().double(), device="cpu")


def test_config_and_shape_arguments(tmp_path):
    """The config may be a best.json's path (loaded by tuner.load_config); anything else that is not a
    DecoderConfig, or a shape that is neither a DecoderShape nor text, gets an error that says what to give."""
    from tuner.shapes import ShapeError

    best = tmp_path / "best.json"
    best.write_text(json.dumps({"schema_version": 1, "shape": SMALL.to_dict(), "config": hand_picked(SMALL).to_dict()}))
    layer = TunedLayer(str(best), SMALL, _module(), dtype=torch.float32, device="cpu")
    assert layer.config == TunedLayer(hand_picked(SMALL), SMALL, _module(), dtype=torch.float32, device="cpu").config
    with pytest.raises(TypeError, match="config is a dict; give a DecoderConfig"):
        TunedLayer(hand_picked(SMALL).to_dict(), SMALL, _module(), device="cpu")
    with pytest.raises(ShapeError, match="or 'BxSxDxHxF' text, not tuple"):
        TunedLayer(hand_picked(SMALL), (1, 24, 64, 2, 96), _module(), device="cpu")
    with pytest.raises(ShapeError, match="not tuple"):
        tuner.load_config(best, shape=(1, 24, 64, 2, 96))


def test_a_config_tuned_in_another_dtype_warns(tmp_path):
    # its timings do not transfer (as for another shape or GPU); until session 48 a bfloat16 best.json loaded into
    # a float16 layer said nothing
    best = tmp_path / "best.json"
    best.write_text(json.dumps({"schema_version": 1, "shape": SMALL.to_dict(), "dtype": "bfloat16",
                                "config": hand_picked(SMALL).to_dict()}))
    with pytest.warns(ConfigMismatchWarning, match="tuned in bfloat16, loaded in float32"):
        TunedLayer(str(best), SMALL, _module(), dtype=torch.float32, device="cpu")
    with pytest.warns(ConfigMismatchWarning, match="tuned in bfloat16, loaded in float16"):
        TunedStack(str(best), SMALL, [_module(), _module(1)], dtype=torch.float16, device="cpu")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TunedLayer(str(best), SMALL, _module(), dtype=torch.bfloat16, device="cpu")


def test_a_layernorm_eps_other_than_the_kernels_warns():
    m = _module()
    m.ln2.eps = 1e-12  # BERT's
    with pytest.warns(UserWarning, match=r"ln2.eps is 1e-12; the layer's LayerNorm uses 1e-05"):
        TunedLayer(hand_picked(SMALL), SMALL, m, dtype=torch.float32, device="cpu")


def test_capture_needs_cuda():
    layer = TunedLayer(hand_picked(SMALL), SMALL, _module(), dtype=torch.float32, device="cpu")
    with pytest.raises(RuntimeError, match="CUDA"):
        layer.capture()


@pytest.mark.gpu
def test_captured_graph_matches_direct_launches():
    layer = TunedLayer(hand_picked(SMALL), SMALL, _module(), dtype=torch.float16, device="cuda")
    x = torch.randn(SMALL.tokens, SMALL.d_model, dtype=torch.float16, device="cuda")
    direct = layer(x).clone()
    layer.capture()
    for _ in range(3):  # replays read the new input each time
        x2 = torch.randn_like(x)
        assert _rel(layer(x2), layer.reference(x2)) < 1e-2
    assert _rel(layer(x), direct) < 1e-3


# ------------------------------------------------------------------------------------------------
# TunedStack: the model's layers chained as the tuner timed them
# ------------------------------------------------------------------------------------------------

def _chained(norm1_fuse=2) -> DecoderConfig:
    """The run of record's pattern: LayerNorm 1 read from the previous layer's FFN2 row sums, LayerNorm 2 from the
    out-projection's (norm.fuse 2)."""
    c = hand_picked(SMALL)
    return replace(c, norm1=replace(c.norm1, fuse=norm1_fuse), norm2=replace(c.norm2, fuse=2))


def test_a_stack_chains_the_row_sums_from_layer_to_layer(device, monkeypatch):
    layers = [_module(seed) for seed in range(3)]
    stack = TunedStack(_chained(), SMALL, layers, dtype=torch.float16, device=device)
    assert len(stack) == 3 and stack.stack.first_layer_differs()
    # Layers 2 and 3 are handed the row sums the previous layer's FFN2 wrote; the first, none (it gathers its own).
    handed = []
    launches = tuner.layer.layer_launches
    monkeypatch.setattr(tuner.layer, "layer_launches", lambda *a, x_stats=None, **kw: handed.append(x_stats)
                        or launches(*a, x_stats=x_stats, **kw))
    x = torch.randn(SMALL.batch, SMALL.seq, SMALL.d_model, dtype=torch.float16, device=device)
    y = stack(x)
    assert y.shape == x.shape and y.dtype == torch.float16
    assert len(handed) == 3 and handed[0] is None
    assert all(s is b.y_stats for s, b in zip(handed[1:], stack.stack.bufs))
    monkeypatch.undo()
    tol = rel_tolerance(torch.float16)
    # Each layer against the fp32 reference on the input it received, and the whole stack against the fp32 chain.
    ins = [x.view(SMALL.tokens, SMALL.d_model)] + stack.outputs()[:-1]
    for w, xi, yi in zip(stack.weights, ins, stack.outputs()):
        assert _rel(yi, tuner.layer.layer_ref(SMALL, w, xi)) < tol
    assert _rel(y, stack.reference(x)) < 3 * tol
    # The same layers one TunedLayer each (the first layer's path everywhere) give the same model.
    h = x
    for m in layers:
        h = TunedLayer(_chained(), SMALL, m, dtype=torch.float16, device=device)(h).clone()
    assert _rel(y, h) < 3 * tol


def test_a_stack_takes_a_models_module_list_and_a_cuda_layer_kernel_config_elsewhere(device):
    # model.layers as it is (an nn.ModuleList); and a best.json of the CUDA layer kernel (layer.fuse 2, head dim 64
    # only) on a layer of head dim 32: its Triton equivalent runs, as a config tuned for another shape should.
    from dataclasses import replace as rep

    from tuner.kernels.fused_layer import FusedLayerConfig

    cfg = rep(DecoderConfig(), layer=FusedLayerConfig(fuse=2, num_stages=8, out_split_k=4, ffn2_split_k=4))
    stack = TunedStack(cfg, SMALL, nn.ModuleList([_module(0), _module(1)]), dtype=torch.float32, device=device)
    assert stack.config.layer.fuse == 1 and len(stack) == 2
    x = torch.randn(SMALL.tokens, SMALL.d_model, device=device)
    assert _rel(stack(x), stack.reference(x)) < 5e-3


def test_stack_arguments_are_checked(device):
    with pytest.raises(TypeError, match=r"list of each layer's weights, e.g. list\(model.layers\)"):
        TunedStack(_chained(), SMALL, _module(), device=device)
    with pytest.raises(ValueError, match="empty"):
        TunedStack(_chained(), SMALL, [], device=device)
    bad = _module(1).state_dict()
    bad["ffn2.weight"] = bad["ffn2.weight"][:, :-1]
    with pytest.raises(WeightsError, match="w_ffn2"):
        TunedStack(_chained(), SMALL, [_module(0), bad], device=device)
    stack = TunedStack(_chained(), SMALL, [_module(0)], dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match=r"TunedStack: x \(3, 64\) must be"):
        stack(torch.zeros(3, 64, device=device))
    if device == "cpu":
        with pytest.raises(RuntimeError, match="CUDA"):
            stack.capture()


@pytest.mark.gpu
def test_a_captured_stack_matches_its_direct_launches():
    stack = TunedStack(_chained(), SMALL, [_module(s) for s in range(4)], dtype=torch.float16, device="cuda")
    x = torch.randn(SMALL.tokens, SMALL.d_model, dtype=torch.float16, device="cuda")
    direct = stack(x).clone()
    stack.capture()
    for _ in range(3):  # replays read the new input each time
        x2 = torch.randn_like(x)
        assert _rel(stack(x2), stack.reference(x2)) < 3 * rel_tolerance(torch.float16)
    assert _rel(stack(x), direct) < 1e-3


# ------------------------------------------------------------------------------------------------
# The README snippet
# ------------------------------------------------------------------------------------------------

SETTINGS = {  # line prefix in the snippet -> what the test runs instead
    "best_json = ": "best_json = {best!r}",
    "shape = ": "shape = DecoderShape(1, 24, 64, 2, 96)  # a small custom shape (the interpreter is slow)",
    "device, dtype = ": "device, dtype = {device!r}, torch.float16",
    "n_layers = ": "n_layers = 2",
}


def readme_snippet() -> str:
    m = re.search(r'^```python title="load-best"\n(.*?)^```', README.read_text(), re.S | re.M)
    assert m, 'README.md has no ```python title="load-best"``` block'
    return m.group(1)


@pytest.fixture(scope="module")
def best_json(tmp_path_factory) -> Path:
    """A real best.json: the newest committed one, else one written by a short replayed run."""
    committed = sorted(ROOT.glob("results/*/*/best.json"),
                       key=lambda p: json.loads((p.parent / "manifest.json").read_text()).get("created", ""))
    if committed:
        return committed[-1]
    from tuner.cli import main

    out = tmp_path_factory.mktemp("results")
    argv = ["decoder", "--replay", str(REPLAY), "--trials", "12", "--sampler", "random", "--no-progress",
            "--out", str(out), "--storage", f"journal:{out / 'studies.journal'}"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    (best,) = out.glob("*/*/best.json")
    return best


def test_readme_snippet_runs(best_json, device):
    code = readme_snippet()
    for prefix, replacement in SETTINGS.items():
        lines = [ln for ln in code.splitlines() if ln.startswith(prefix)]
        assert len(lines) == 1, f"the README snippet must set {prefix.strip()} on one line of its own"
        code = code.replace(lines[0], replacement.format(best=str(best_json), device=device))
    out = io.StringIO()
    with pytest.warns(ConfigMismatchWarning, match="tuned for shape"), contextlib.redirect_stdout(out):
        scope = {"DecoderShape": DecoderShape}
        exec(compile(code, f"{README.name} (load-best)", "exec"), scope)
    assert isinstance(scope["model"], TunedStack) and len(scope["model"]) == 2
    assert scope["y"].shape == (1, 24, 64)
    printed = re.search(r"rel\. error against the fp32 reference: (\S+)", out.getvalue())
    assert printed, out.getvalue()
    assert float(printed.group(1)) < rel_tolerance(scope["dtype"]), printed.group(0)  # the number, not just the label


def test_readme_links_resolve():
    """Every relative link and image of the README names a file or folder of the checkout."""
    text = README.read_text()
    targets = re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t and not t.startswith("mailto:")]
    assert local, "README.md links no file"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links missing files: {missing}"
