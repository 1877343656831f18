"""tuner.export: reading best.json back (``tuner.load_config``), and the warnings and errors it owes the user.

These tests check file handling only, so they use a synthetic best.json: the fields load_config reads
(schema_version, shape, gpu, config) and no timings. A best.json written by a real (replayed) run is
exported and loaded end to end in tests/test_cli.py.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import tuner
from tuner.bench import hand_picked
from tuner.config import ConfigError, DecoderConfig
from tuner.export import BEST_SCHEMA_VERSION, ConfigMismatchWarning, load_config, read_best
from tuner.shapes import PRESETS

H200 = "NVIDIA H200"
H100 = "NVIDIA H100 80GB HBM3"


def synthetic_best(folder, *, shape="bert-base", gpu=H200, cfg=None, **override):
    """A synthetic best.json (no measurements in it) in ``folder``; returns its path."""
    shape_obj = PRESETS[shape]
    cfg = cfg or hand_picked(shape_obj)
    d = {"schema_version": BEST_SCHEMA_VERSION, "kind": "pdl-tune best configuration (synthetic test fixture)",
         "shape": shape_obj.to_dict(), "dtype": "float16", "gpu": {"name": gpu, "capability": [9, 0]},
         "config": cfg.to_dict()}
    d.update(override)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "best.json"
    path.write_text(json.dumps(d))
    return path


@pytest.fixture
def best(tmp_path):
    return synthetic_best(tmp_path / "run")


def test_load_config_returns_the_decoder_config(best):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same shape, same GPU: not a word
        cfg = load_config(best, shape="bert-base", gpu=H200, strict=True)
    assert isinstance(cfg, DecoderConfig) and cfg == hand_picked(PRESETS["bert-base"])
    # The package-level entry point, a run folder instead of the file, a spec instead of the preset name.
    assert tuner.load_config(best.parent, shape="1x128x768x12x3072", gpu=H200, strict=True) == cfg


@pytest.mark.parametrize("shape", list(PRESETS), ids=list(PRESETS))
def test_round_trip_for_every_preset(tmp_path, shape):
    cfg = hand_picked(PRESETS[shape])
    path = synthetic_best(tmp_path, shape=shape, cfg=cfg)
    assert load_config(path, shape=shape, gpu=H200, strict=True) == cfg


@pytest.mark.parametrize("kw, words", [
    ({"shape": "bert-large"}, ["tuned for shape 1x128x768x12x3072", "loaded for 1x128x1024x16x4096"]),
    ({"shape": "1x256x768x12x3072"}, ["tuned for shape 1x128x768x12x3072", "loaded for 1x256x768x12x3072"]),
    ({"gpu": H100}, [f"tuned on {H200}", f"loaded on {H100}"]),
    ({"shape": "tiny", "gpu": H100}, ["tuned for shape", f"loaded on {H100}"]),
    ({"dtype": "bfloat16"}, ["tuned in float16", "loaded in bfloat16"]),
    ({"dtype": torch.float32}, ["tuned in float16", "loaded in float32"]),
], ids=["other-preset", "other-seq", "other-gpu", "both", "other-dtype", "other-torch-dtype"])
def test_mismatch_warns_and_strict_raises(best, kw, words):
    kw = {"gpu": H200, **kw}
    with pytest.warns(ConfigMismatchWarning) as rec:
        cfg = load_config(best, **kw)
    assert cfg == hand_picked(PRESETS["bert-base"])  # it still loads: the config runs, its timings do not transfer
    msg = str(rec[0].message)
    assert str(best) in msg and all(w in msg for w in words), msg
    with pytest.raises(ConfigError) as e:
        load_config(best, strict=True, **kw)
    assert all(w in str(e.value) for w in words)


def test_the_tuned_dtype_loads_quietly(best):
    # by name or as a torch dtype; a best.json without a dtype (hand-edited) is not compared
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(best, gpu=H200, dtype="float16", strict=True)
        load_config(best, gpu=H200, dtype=torch.float16, strict=True)
        load_config(synthetic_best(best.parent / "no-dtype", dtype=None), gpu=H200, dtype="bfloat16", strict=True)


def test_no_gpu_named_and_none_visible_means_no_gpu_check(best):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: load_config compares against it")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(best, shape="bert-base", strict=True)


@pytest.mark.parametrize("content, words", [
    ({"schema_version": 99}, ["schema_version 99", f"expected {BEST_SCHEMA_VERSION}"]),
    ({"schema_version": None}, ["schema_version None"]),
    ("not json {", ["not valid JSON", "line 1"]),
    ("[1, 2]", ["schema_version"]),
    ({"config": None}, ["no 'config'"]),
    ({"config": [1, 2]}, ["no 'config'"]),
    ({"dtype": "bf16"}, ["dtype 'bf16'", "float16, bfloat16, float32"]),
    ({"dtype": ["float16"]}, ["dtype ['float16']"]),
], ids=["schema-99", "no-schema", "invalid-json", "a-list", "no-config", "config-a-list", "misspelt-dtype",
        "dtype-a-list"])
def test_bad_best_json_raises_config_error(tmp_path, content, words):
    path = synthetic_best(tmp_path)
    if isinstance(content, str):
        path.write_text(content)
    elif content == {"config": None}:
        d = json.loads(path.read_text())
        del d["config"]
        path.write_text(json.dumps(d))
    else:
        path.write_text(json.dumps({**json.loads(path.read_text()), **content}))
    for fn in (read_best, load_config):
        with pytest.raises(ConfigError) as e:
            fn(path)
        msg = str(e.value)
        assert str(path) in msg and "\n" not in msg
        assert all(w in msg for w in words), msg


def test_config_of_another_schema_inside_best_json(tmp_path):
    cfg = hand_picked(PRESETS["bert-base"]).to_dict()
    path = synthetic_best(tmp_path, config=dict(cfg, schema_version=2))
    with pytest.raises(ConfigError, match="schema_version 2") as e:
        load_config(path)
    assert str(path) in str(e.value)
    path = synthetic_best(tmp_path, config={"schema_version": 1, "kernels": {"ffn3": {}}})
    with pytest.raises(ConfigError, match="ffn3") as e:
        load_config(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("where", ["missing-file", "folder-without-best"])
def test_missing_best_json(tmp_path, where):
    path = tmp_path / "nope.json" if where == "missing-file" else tmp_path
    with pytest.raises(ConfigError, match="no best.json found") as e:
        load_config(path)
    assert str(path) in str(e.value)


def test_edited_config():
    # The diagnostics scripts' kernel.field=value variants: ints stay ints, a dotted value is a float, the rest
    # of the config is untouched.
    from dataclasses import replace

    base = DecoderConfig()
    cfg = base.edited(["out.split_k=4", "ffn2.prefetch_ratio=0.6", "attn.block_m=16"])
    assert cfg.out.split_k == 4 and isinstance(cfg.out.split_k, int)
    assert cfg.ffn2.prefetch_ratio == 0.6 and cfg.attn.block_m == 16
    assert cfg == replace(base, out=replace(base.out, split_k=4), ffn2=replace(base.ffn2, prefetch_ratio=0.6),
                          attn=replace(base.attn, block_m=16))
    assert base.edited([]) == base


def test_element_bytes_of_each_dtype_name():
    """The element size `tune export`'s check and the study's repair count shared memory in: each dtype's own, and
    float16's where a best.json or an evaluator names none the tuner knows."""
    import torch

    from tuner.layer import DTYPES, element_bytes

    for name, dtype in DTYPES.items():
        assert element_bytes(name) == torch.empty(0, dtype=dtype).element_size()
    assert element_bytes(None) == element_bytes("float64") == element_bytes(16) == 2
