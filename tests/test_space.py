"""tuner.space: the YAML search space, its Optuna distributions and the params <-> DecoderConfig mapping.

Pure data: no GPU, no timing. Bad spaces are built from the shipped default, edited one key at a time,
so the tests follow the format when the default gains a key.
"""

from __future__ import annotations

import copy
import importlib.resources
from dataclasses import fields

import optuna
import pytest
import yaml

from tuner import space
from tuner.bench import hand_picked
from tuner.config import CONFIGS as CONFIG_NAMES, KERNELS, KIND
from tuner.layer import default_config
from tuner.shapes import PRESETS
from tuner.space import RATIOS, SpaceError

ON_SWITCH = [True, False]


def default_data() -> dict:
    """The shipped decoder.yaml as a dict (package data, as an installed `tune` reads it)."""
    text = importlib.resources.files("tuner.search_spaces").joinpath("decoder.yaml").read_text()
    return yaml.safe_load(text)


def write_space(tmp_path, data, name="space.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def edited(edit) -> dict:
    data = copy.deepcopy(default_data())
    edit(data)
    return data


def load_edit(tmp_path, edit):
    return space.load(write_space(tmp_path, edited(edit)))


# ------------------------------------------------------------------------------------------------
# The shipped default
# ------------------------------------------------------------------------------------------------

def test_default_space_loads_from_package_data():
    sp = space.load()
    assert sp.source == "decoder.yaml (default)"
    params = sp.params()
    assert {name.split(".")[0] for name in params} == set(CONFIG_NAMES)
    for k in CONFIG_NAMES:
        assert f"{k}.overlap_ratio" in params and f"{k}.prefetch_ratio" in params
    # The seed's grid, categorical.
    assert params["qkv.overlap_ratio"].choices == (-1.0, 0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert params["ffn2.prefetch_ratio"].choices == (-1.0, 0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    # Attention has no weights: its prefetch ratio is pinned off.
    assert params["attn.prefetch_ratio"].choices == (-1.0,)
    assert all(isinstance(d.distribution(), optuna.distributions.CategoricalDistribution) for d in params.values())


def test_every_param_is_a_field_of_its_kernel_config():
    """to_config drops names that are not dataclass fields: a YAML key the config lacks would be searched
    and then silently ignored."""
    for name in space.load().params():
        kernel, field = name.split(".", 1)
        assert field in {f.name for f in fields(KIND[kernel])}, name


def test_params_without_pdl_drop_the_ratios():
    sp = space.load()
    with_pdl, without = sp.params(pdl=True), sp.params(pdl=False)
    assert not [n for n in without if n.split(".", 1)[1] in RATIOS]
    assert set(without) == {n for n in with_pdl if n.split(".", 1)[1] not in RATIOS}
    assert len(with_pdl) - len(without) == 2 * len(CONFIG_NAMES)


@pytest.mark.parametrize("shape", list(PRESETS), ids=list(PRESETS))
@pytest.mark.parametrize("which", ["default", "hand_picked", "hand_picked_knobs_off", "hand_picked_cluster"])
def test_enqueued_configs_lie_inside_the_default_space(shape, which):
    """The study enqueues these as its first trials; a value outside a categorical's choices would make
    Optuna reject the enqueued trial."""
    from tuner.bench import hand_picked_cluster

    cfg = {"default": default_config, "hand_picked": hand_picked, "hand_picked_cluster": hand_picked_cluster,
           "hand_picked_knobs_off": lambda s: hand_picked(s).without_knobs()}[which](PRESETS[shape])
    values = space.from_config(cfg)
    for name, dim in space.load().params().items():
        assert values[name] in dim.choices, (name, values[name], dim.choices)


def test_gemm_fuse_is_ffn2s_outs_and_qkvs(tmp_path):
    # The gemm family's fuse choices apply to FFN2 and the out-projection (computed by FFN1's kernel) and to QKV (the
    # attention in its kernel); FFN1 keeps 0, and an override that gives it 1 is an error that names it.
    sp = space.load()
    assert all(sp.dims[k]["fuse"].choices == (0, 1) for k in ("ffn2", "out", "qkv"))
    assert sp.dims["ffn1"]["fuse"].choices == (0,)
    old = load_edit(tmp_path, lambda d: d["gemm"].pop("fuse"))  # a file written before the switch
    assert old.dims["ffn2"]["fuse"].choices == (0,) and old.dims["qkv"]["fuse"].choices == (0,)
    three = load_edit(tmp_path, lambda d: d["gemm"].update(fuse=[0, 1, 2]))
    assert three.dims["out"]["fuse"].choices == (0, 1) and three.dims["qkv"]["fuse"].choices == (0, 1)
    with pytest.raises(SpaceError, match=r"kernels.out.fuse: expected a list of 0 and 1"):
        load_edit(tmp_path, lambda d: d.update(kernels={"out": {"fuse": [0, 2]}}))
    with pytest.raises(SpaceError, match=r"kernels.qkv.fuse: expected a list of 0 and 1"):
        load_edit(tmp_path, lambda d: d.update(kernels={"qkv": {"fuse": [0, 2]}}))
    with pytest.raises(SpaceError, match=r"kernels.ffn1.fuse: only ffn2, out and qkv can be fused"):
        load_edit(tmp_path, lambda d: d.update(kernels={"ffn1": {"fuse": [0, 1]}}))


def test_attn_fuse_switch(tmp_path):
    # attn.fuse: 0 the attention kernel, 1 the attention in the fused block; a file without it keeps the kernel.
    assert space.load().dims["attn"]["fuse"].choices == (0, 1)
    assert load_edit(tmp_path, lambda d: d["attn"].pop("fuse")).dims["attn"]["fuse"].choices == (0,)
    with pytest.raises(SpaceError, match=r"attn.fuse"):
        load_edit(tmp_path, lambda d: d["attn"].update(fuse=[0, 2]))


# ------------------------------------------------------------------------------------------------
# Continuous ranges and overrides
# ------------------------------------------------------------------------------------------------

def continuous(data):
    data["ratios"] = {"overlap": {"low": 0.0, "high": 1.0, "off": True}, "prefetch": {"low": 0.0, "high": 1.0}}


def test_continuous_range_is_a_float_distribution_with_an_on_switch(tmp_path):
    sp = load_edit(tmp_path, continuous)
    dim = sp.params()["qkv.overlap_ratio"]
    assert (dim.choices, dim.low, dim.high, dim.off) == (None, 0.0, 1.0, True)
    assert dim.distribution() == optuna.distributions.FloatDistribution(0.0, 1.0)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(8):
        trial = study.ask()
        params = space.suggest(trial, sp)
        dists = trial.distributions
        # off: true -> a boolean switch; when it is off, the ratio is -1 and no float is drawn.
        assert dists["qkv.overlap_ratio.on"] == optuna.distributions.CategoricalDistribution(ON_SWITCH)
        if trial.params["qkv.overlap_ratio.on"]:
            assert dists["qkv.overlap_ratio"] == optuna.distributions.FloatDistribution(0.0, 1.0)
            assert 0.0 <= params["qkv.overlap_ratio"] <= 1.0
        else:
            assert "qkv.overlap_ratio" not in dists and params["qkv.overlap_ratio"] == -1.0
        # No off: no switch, always a float in range.
        assert "qkv.prefetch_ratio.on" not in dists
        assert 0.0 <= params["qkv.prefetch_ratio"] <= 1.0
        # Attention's prefetch stays pinned off even in a continuous space.
        assert params["attn.prefetch_ratio"] == -1.0
        study.tell(trial, 1.0)


def test_continuous_switch_off_and_on_with_fixed_values(tmp_path):
    sp = load_edit(tmp_path, continuous)
    base = space.from_config(default_config(PRESETS["bert-base"]))
    fixed = {k: v for k, v in base.items() if not k.endswith("_ratio")}
    fixed.update({f"{k}.prefetch_ratio": 0.5 for k in CONFIG_NAMES if k != "attn"}, **{"attn.prefetch_ratio": -1.0})
    off = dict(fixed, **{f"{k}.overlap_ratio.on": False for k in CONFIG_NAMES})
    assert all(space.suggest(optuna.trial.FixedTrial(off), sp)[f"{k}.overlap_ratio"] == -1.0 for k in KERNELS)
    on = dict(fixed, **{f"{k}.overlap_ratio.on": True for k in CONFIG_NAMES}, **{f"{k}.overlap_ratio": 0.3 for k in CONFIG_NAMES})
    cfg = space.to_config(space.suggest(optuna.trial.FixedTrial(on), sp))
    assert cfg.qkv.overlap_ratio == 0.3 and cfg.ffn2.prefetch_ratio == 0.5 and cfg.attn.prefetch_ratio == -1.0


def test_stepped_range(tmp_path):
    sp = load_edit(tmp_path, lambda d: d.update(ratios={"overlap": {"low": 0.0, "high": 1.0, "step": 0.25}}))
    assert sp.params()["out.overlap_ratio"].distribution() == optuna.distributions.FloatDistribution(
        0.0, 1.0, step=0.25)
    # A ratio the YAML leaves out is off.
    assert sp.params()["out.prefetch_ratio"].choices == (-1.0,)


def test_overrides_under_kernels(tmp_path):
    sp = load_edit(tmp_path, lambda d: d.update(kernels={"ffn2": {"split_k": [1, 2, 4, 8]},
                                                         "qkv": {"overlap_ratio": [-1.0, 0.5]},
                                                         "attn": {"block_m": [64]}}))
    params, default = sp.params(), space.load().params()
    assert params["ffn2.split_k"].choices == (1, 2, 4, 8)
    assert params["ffn1.split_k"] == default["ffn1.split_k"]  # the other GEMMs keep the family's list
    assert params["qkv.overlap_ratio"].choices == (-1.0, 0.5)
    assert params["out.overlap_ratio"] == default["out.overlap_ratio"]
    assert params["attn.block_m"].choices == (64,)


def test_cache_hints_switch(tmp_path):
    # GemmConfig.hints is a per-GEMM switch of the default space; a space written before it (no gemm.hints) keeps
    # every GEMM on the default L2 policy.
    params = space.load().params()
    assert all(params[f"{k}.hints"].choices == (0, 1) for k in ("qkv", "out", "ffn1", "ffn2"))
    old = load_edit(tmp_path, lambda d: d["gemm"].pop("hints")).params()
    assert all(old[f"{k}.hints"].choices == (0,) for k in ("qkv", "out", "ffn1", "ffn2"))


def test_attention_prefetch_override_is_rejected(tmp_path):
    path = write_space(tmp_path, edited(lambda d: d.update(kernels={"attn": {"prefetch_ratio": [0.5]}})))
    with pytest.raises(SpaceError) as e:
        space.load(path)
    assert str(path) in str(e.value) and "kernels.attn.prefetch_ratio:" in str(e.value)
    assert "attention has no weights" in str(e.value)


# ------------------------------------------------------------------------------------------------
# Every malformed space names the file and the key
# ------------------------------------------------------------------------------------------------

def _set(*keys, value):
    def edit(data):
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return edit


def _drop(*keys):
    def edit(data):
        node = data
        for k in keys[:-1]:
            node = node[k]
        del node[keys[-1]]
    return edit


BAD_SPACES = [
    # (id, edit, words the message must contain besides the file name)
    ("unknown-top-level-key", _set("ratio", value={"overlap": [0.5]}), ["'ratio'"]),
    ("unknown-family-key", _set("gemm", "blockk", value=[32]), ["gemm:", "'blockk'"]),
    ("missing-family-key", _drop("gemm", "split_k"), ["gemm:", "'split_k'", "missing"]),
    ("family-not-a-mapping", _set("norm", value=[1, 2]), ["'norm'"]),
    ("non-list-value", _set("gemm", "group_m", value=8), ["gemm.group_m:", "list"]),
    ("empty-list", _set("gemm", "block_n", value=[]), ["gemm.block_n:", "non-empty"]),
    ("zero-tile", _set("attn", "block_m", value=[0, 32]), ["attn.block_m:", "positive integer"]),
    ("fractional-tile", _set("gemm", "block_m", value=[16, 1.5]), ["gemm.block_m:", "1.5"]),
    ("string-choice", _set("norm", "num_warps", value=["four"]), ["norm.num_warps:", "'four'"]),
    ("switch-not-0-or-1", _set("gemm", "tma", value=[0, 2]), ["gemm.tma:", "0 (off) or 1 (on)"]),
    ("layer-switch-3", _set("layer", "fuse", value=[0, 3]), ["layer.fuse:", "0 (off) or 1 or 2"]),
    ("norm-switch-3", _set("norm", "fuse", value=[0, 3]), ["norm.fuse:", "0 (off) or 1 or 2"]),
    ("cluster-switch-3", _set("gemm", "cluster", value=[0, 3]), ["gemm.cluster:", "0 (off) or 1 or 2"]),
    ("hints-switch-2", _set("gemm", "hints", value=[0, 2]), ["gemm.hints:", "0 (off) or 1 (on)"]),
    ("ratio-1.5", _set("ratios", "overlap", value=[-1.0, 0.5, 1.5]), ["ratios.overlap:", "1.5"]),
    ("ratio-not-a-list", _set("ratios", "prefetch", value=0.5), ["ratios.prefetch:", "list"]),
    ("ratios-unknown-key", _set("ratios", "overlapp", value=[0.5]), ["'ratios'", "overlap"]),
    ("range-low-above-high", _set("ratios", "prefetch", value={"low": 0.8, "high": 0.2}), ["ratios.prefetch:", "low"]),
    ("range-above-1", _set("ratios", "overlap", value={"low": 0.0, "high": 1.5}), ["ratios.overlap:", "high=1.5"]),
    ("range-unknown-key", _set("ratios", "overlap", value={"low": 0.0, "high": 1.0, "stp": 0.1}),
     ["ratios.overlap:", "'stp'"]),
    ("range-bad-step", _set("ratios", "overlap", value={"low": 0.0, "high": 1.0, "step": -0.1}),
     ["ratios.overlap.step:"]),
    ("range-step-not-dividing", _set("ratios", "overlap", value={"low": 0.0, "high": 1.0, "step": 0.3}),
     ["ratios.overlap.step:", "must divide high - low = 1"]),
    ("range-bad-off", _set("ratios", "overlap", value={"low": 0.0, "high": 1.0, "off": "yes"}),
     ["ratios.overlap.off:"]),
    ("unknown-kernel", _set("kernels", "ffn3", value={"split_k": [1]}), ["kernels:", "'ffn3'"]),
    ("unknown-kernel-key", _set("kernels", "qkv", "blok_m", value=[16]), ["kernels.qkv.blok_m:"]),
    ("kernel-key-of-another-family", _set("kernels", "norm1", "block_k", value=[16]), ["kernels.norm1.block_k:"]),
    ("kernel-ratio-2.0", _set("kernels", "qkv", "overlap_ratio", value=[2.0]), ["kernels.qkv.overlap_ratio:", "2.0"]),
    ("kernel-override-not-a-mapping", _set("kernels", "out", value=[1]), ["kernels.out:", "mapping"]),
    ("kernels-not-a-mapping", _set("kernels", value=["qkv"]), ["'kernels'"]),
    ("version-2", _set("version", value=2), ["version 2"]),
    # choices no problem and no GPU can run: each kernel's field_error, the first rules of its check()
    ("warps-3", _set("gemm", "num_warps", value=[4, 3]),
     ["gemm.num_warps:", "choice 3 can never run", "1, 2, 4, 8, 16"]),
    ("tile-48", _set("gemm", "block_m", value=[64, 48]), ["gemm.block_m:", "choice 48", "power of two >= 16"]),
    ("gemm-stages-9", _set("gemm", "num_stages", value=[9]), ["gemm.num_stages:", "choice 9", "1..8"]),
    ("norm-rows-3", _set("norm", "rows_per_program", value=[1, 3]), ["norm.rows_per_program:", "choice 3"]),
    ("norm-warps-32", _set("norm", "num_warps", value=[32]), ["norm.num_warps:", "choice 32"]),
    ("attn-tile-8", _set("attn", "block_n", value=[8]), ["attn.block_n:", "choice 8", "power of two >= 16"]),
    ("kernel-warps-6", _set("kernels", "ffn2", "num_warps", value=[6]), ["kernels.ffn2.num_warps:", "choice 6"]),
]


@pytest.mark.parametrize("edit, words", [(e, w) for _, e, w in BAD_SPACES], ids=[i for i, _, _ in BAD_SPACES])
def test_malformed_space_names_file_and_key(tmp_path, edit, words):
    path = write_space(tmp_path, edited(edit), name="my-space.yaml")
    with pytest.raises(SpaceError) as e:
        space.load(path)
    msg = str(e.value)
    assert isinstance(e.value, ValueError) and "\n" not in msg
    assert msg.startswith(f"{path}: "), msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("text, words", [
    ("version: 1\ngemm: [16, 32\nnorm: {}\n", ["not valid YAML", "line 3"]),
    ("version: 1\nratios:\n  overlap: [0.5]\n   prefetch: [0.5]\n", ["not valid YAML", "line 4"]),
    ("- 16\n- 32\n", ["mapping at the top level"]),
    ("", ["mapping at the top level"]),
    # PyYAML keeps a repeated key's last value: a second section replaced the first without a word
    ("version: 1\ngemm: {block_m: [64]}\nnorm: {}\ngemm: {block_m: [32]}\n", ["duplicate key 'gemm'", "line 4"]),
    ("version: 1\ngemm:\n  block_m: [64]\n  block_m: [32]\n", ["duplicate key 'block_m'", "line 4"]),
], ids=["unclosed-list", "bad-indent", "a-list", "empty-file", "a-section-twice", "a-field-twice"])
def test_unparseable_space_names_file_and_line(tmp_path, text, words):
    path = write_space(tmp_path, text, name="broken.yaml")
    with pytest.raises(SpaceError) as e:
        space.load(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_bare_off_key_of_a_range(tmp_path):
    # `{low: 0, high: 1, step: 0.1, off: true}` as README writes it: YAML 1.1 reads the bare key off as false
    text = yaml.safe_dump(edited(lambda d: d["ratios"].update(overlap="RANGE")), sort_keys=False)
    text = text.replace("RANGE", "{low: 0, high: 1, step: 0.1, off: true}")
    assert False in yaml.safe_load(text)["ratios"]["overlap"]  # (what PyYAML hands over)
    dim = space.load(write_space(tmp_path, text)).params()["qkv.overlap_ratio"]
    assert (dim.low, dim.high, dim.step, dim.off) == (0.0, 1.0, 0.1, True)


@pytest.mark.parametrize("text, words", [
    ("version: 1\n1: x\nzzz: y\n", ["unknown key(s) ['1', 'zzz']"]),
    ("version: true\n", ["version True is not supported"]),
    ("{low: 0, high: 1, 1: 2, 2.5: 3}", ["ratios.overlap", "'1'", "'2.5'"]),
], ids=["mixed-top-level-keys", "version-true", "mixed-range-keys"])
def test_keys_of_mixed_types_are_named(tmp_path, text, words):
    if text.startswith("{"):  # a range of the overlap ratio in the default space
        text = yaml.safe_dump(edited(lambda d: d["ratios"].update(overlap="RANGE")), sort_keys=False).replace(
            "RANGE", text)
    with pytest.raises(SpaceError) as e:
        space.load(write_space(tmp_path, text))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_non_list_fuse_override_of_ffn1(tmp_path):
    with pytest.raises(SpaceError, match=r"kernels.ffn1.fuse"):
        load_edit(tmp_path, lambda d: d.update(kernels={"ffn1": {"fuse": 1}}))


def test_unreadable_space_file(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes(b"version: 1\n# caf\xe9\n")
    with pytest.raises(SpaceError, match="cannot read the search space file") as e:
        space.load(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_shipped_spaces_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the checkout, as after `pip install .`
    assert {"decoder", "fused-layer", "layer-kernel"} <= set(space.shipped())
    for name in ("fused-layer", "layer-kernel.yaml"):
        sp = space.load(name)
        assert "(shipped)" in sp.source and sp.params()
    assert space.load("decoder").params() == space.load().params()
    # a file of the user's of that name, in the working folder, comes first
    write_space(tmp_path, edited(lambda d: d["gemm"].update(block_m=[64])), "fused-layer.yaml")
    assert space.load("fused-layer.yaml").params()["qkv.block_m"].choices == (64,)


def test_missing_space_file(tmp_path):
    with pytest.raises(SpaceError, match="search space file not found") as e:
        space.load(tmp_path / "nope.yaml")
    assert str(tmp_path / "nope.yaml") in str(e.value)


# ------------------------------------------------------------------------------------------------
# params <-> DecoderConfig
# ------------------------------------------------------------------------------------------------

CONFIGS = {"default": default_config, "hand_picked": hand_picked}


@pytest.mark.parametrize("shape", list(PRESETS), ids=list(PRESETS))
@pytest.mark.parametrize("which", list(CONFIGS))
def test_config_round_trip(shape, which):
    cfg = CONFIGS[which](PRESETS[shape])
    params = space.from_config(cfg)
    assert set(params) >= set(space.load().params())
    assert space.to_config(params) == cfg
    # Without PDL the ratios are not parameters, and the config comes back with every pair at (-1, -1).
    no_pdl = space.from_config(cfg, pdl=False)
    assert not [n for n in no_pdl if n.split(".", 1)[1] in RATIOS]
    assert space.to_config(no_pdl) == cfg.without_knobs()


def test_suggested_params_build_a_config():
    sp = space.load()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(5):
        trial = study.ask()
        params = space.suggest(trial, sp)
        assert set(params) == set(sp.params())
        cfg = space.to_config(params)
        assert space.from_config(cfg) == params
        study.tell(trial, 1.0)
