"""tuner.study with the replay evaluator: samplers, the study's identity, the enqueued baseline, and the
replay's honesty about configurations it did not record.

Timings come from the H200 recording in tests/data/replay-bert-base-h200 (a real `tune decoder` run).
"""

from __future__ import annotations

import copy
import importlib.resources
import json
import math
import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import optuna
import pandas as pd
import pytest
import yaml

from tuner import space
from tuner.bench import hand_picked, hand_picked_cluster, hand_picked_fused
from tuner.config import DecoderConfig
from tuner.evaluate import ReplayEvaluator
from tuner.kernels.norm import NormConfig
from tuner.layer import check_config, default_config
from tuner.shapes import PRESETS, resolve
from tuner.study import SAMPLERS, StudyError, StudyOptions, _repairer, config_hash, make_sampler, run_study, study_name

REPLAY = Path(__file__).parent / "data" / "replay-bert-base-h200"
BERT_BASE = PRESETS["bert-base"]

SAMPLER_CLASSES = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler,
                   "grid": optuna.samplers.GridSampler, "cmaes": optuna.samplers.CmaEsSampler,
                   "gp": optuna.samplers.GPSampler, "qmc": optuna.samplers.QMCSampler}


def default_data() -> dict:
    return yaml.safe_load(importlib.resources.files("tuner.search_spaces").joinpath("decoder.yaml").read_text())


def grid_space() -> space.SearchSpace:
    """A space small enough to enumerate without PDL: per family, the tile values of bert-base's baseline
    (the study enqueues it first, so it must lie inside), plus the hand-picked block_k and TMA switch."""
    data = copy.deepcopy(default_data())
    data["kernels"] = {}
    data["ratios"] = {"overlap": [-1.0, 0.0], "prefetch": [-1.0, 1.0]}
    used = {}
    for cfg, fields in ((default_config(BERT_BASE), None), (hand_picked(BERT_BASE), ("block_k", "tma"))):
        for name, value in space.from_config(cfg, pdl=False).items():
            kernel, field = name.split(".", 1)
            if fields is None or field in fields:
                used.setdefault((space.FAMILY[kernel], field), set()).add(value)
    for fam in ("gemm", "norm", "attn", "layer"):
        data[fam] = {field: sorted(used[(fam, field)]) for field in data[fam]}
    sp = space.parse(data, "grid test space")
    assert math.prod(len(d.choices) for d in sp.params(pdl=False).values()) <= 50_000
    return sp


def continuous_space() -> space.SearchSpace:
    data = copy.deepcopy(default_data())
    data["ratios"]["overlap"] = {"low": 0.0, "high": 1.0, "off": True}
    return space.parse(data, "continuous test space")


@pytest.fixture
def replay():
    return ReplayEvaluator(REPLAY)


def opts(**kw) -> StudyOptions:
    return StudyOptions(**{"trials": 6, "top_k": 2, "progress": False, "remeasure_rounds": 2, **kw})


def run(tmp_path, evaluator, sp=None, log=lambda *a: None, **kw) -> Path:
    return run_study(evaluator.shape, evaluator, sp or space.load(), opts(**kw), tmp_path, ["pytest"], log=log)


def load_study(tmp_path, name):
    return optuna.load_study(study_name=name, storage=f"sqlite:///{(tmp_path / 'studies.db').as_posix()}")


# ------------------------------------------------------------------------------------------------
# Samplers
# ------------------------------------------------------------------------------------------------

def test_samplers_are_the_six_names():
    assert SAMPLERS == tuple(SAMPLER_CLASSES)


@pytest.mark.filterwarnings("ignore:QMCSampler is experimental")
@pytest.mark.parametrize("name", SAMPLERS)
def test_make_sampler(name):
    # Grid enumerates every combination up front: only the small space (no PDL ratios) is enumerable. CMA-ES and QMC
    # draw numeric ranges only: a space with a continuous ratio.
    sp, pdl = ((grid_space(), False) if name == "grid" else (continuous_space(), True) if name in ("cmaes", "qmc")
               else (space.load(), True))
    assert isinstance(make_sampler(name, 0, sp, pdl), SAMPLER_CLASSES[name])


@pytest.mark.parametrize("name", ["cmaes", "qmc"])
def test_a_numeric_sampler_is_refused_on_a_space_of_choices_only(name):
    # The shipped space is all lists of choices: Optuna's CMA-ES and QMC samplers then drew every parameter with
    # their independent sampler (random), and the run said "sampler cmaes"
    with pytest.raises(StudyError, match=f"--sampler {name} draws only numeric ranges, .* Use tpe, gp or random"):
        make_sampler(name, 0, space.load(), True)


@pytest.mark.parametrize("name, package", [("gp", "scipy"), ("qmc", "scipy"), ("cmaes", "cmaes")])
def test_a_sampler_whose_package_is_missing_is_refused(name, package, monkeypatch):
    # (else each trial failed in the sampler with ModuleNotFoundError, and the study went on to its end)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == package else real(m, *a))
    with pytest.raises(StudyError, match=f"--sampler {name} needs the Python package {package} "
                                         rf"\(pip install {package}\)"):
        make_sampler(name, 0, continuous_space(), True)


def test_grid_rejects_continuous_ranges():
    with pytest.raises(StudyError, match=r"--sampler grid needs categorical choices only"):
        make_sampler("grid", 0, continuous_space(), True)
    # Without PDL the continuous ratios are not searched, so the grid has nothing to reject.
    data = copy.deepcopy(default_data())
    data["ratios"]["overlap"] = {"low": 0.0, "high": 1.0}
    small = grid_space()
    small = space.SearchSpace("continuous ratios, no PDL",
                              {k: dict(small.dims[k], overlap_ratio=space.Dim(low=0.0, high=1.0)) for k in small.dims})
    assert isinstance(make_sampler("grid", 0, small, False), optuna.samplers.GridSampler)


def _no_grid(*args, **kwargs):
    raise AssertionError("GridSampler built for a space too large to enumerate")


def test_grid_refuses_a_space_too_large_to_enumerate(monkeypatch):
    """Optuna's GridSampler lists every combination up front: the default space (about 1e47 of them)
    must be refused at once, not exhaust the memory (the stub keeps a regression from doing that here)."""
    monkeypatch.setattr(optuna.samplers, "GridSampler", _no_grid)
    with pytest.raises(StudyError, match=r"--sampler grid: the search space has .* points"):
        make_sampler("grid", 0, space.load(), True)


def test_unknown_sampler():
    with pytest.raises(StudyError, match="unknown sampler 'anneal': choose one of tpe, random, grid, cmaes, gp, qmc"):
        make_sampler("anneal", 0, space.load(), True)


@pytest.mark.filterwarnings("ignore:QMCSampler is experimental")
@pytest.mark.parametrize("name", SAMPLERS)
def test_every_sampler_runs_a_replayed_study(tmp_path, replay, name):
    """The contract every sampler passes: the budget is spent, the baseline comes first, every trial has a
    status, and the run folder is written."""
    if name == "grid":
        replay.pdl = False  # the grid space is only enumerable without the ratios
    sp = grid_space() if name == "grid" else continuous_space() if name in ("cmaes", "qmc") else None
    folder = run(tmp_path, replay, sp, sampler=name)
    trials = pd.read_csv(folder / "trials.csv")
    assert len(trials) == 6 and trials["number"].tolist() == list(range(6))
    assert trials.loc[0, "is_baseline"] and trials["is_baseline"].sum() == 1
    assert trials.loc[0, "status"] == "ok"  # the enqueued baseline was accepted by the sampler's space
    assert set(trials["status"]) <= {"ok", "invalid", "compile_error", "out_of_resources", "incorrect",
                                     "timeout", "crashed"}
    assert (trials["status"] == "ok").any()
    assert (folder / "best.json").is_file() and (folder / "topk.md").is_file()
    # each ok trial's speedup over the search's baseline trial (DESIGN's "speedups"); a failed trial has none
    ok = trials["status"] == "ok"
    assert trials.loc[ok, "speedup"].tolist() == pytest.approx(
        (trials.loc[0, "latency_us"] / trials.loc[ok, "latency_us"]).tolist())
    assert trials.loc[~ok, "speedup"].isna().all()
    # the manifest says how its last figures were taken: a replay re-measures nothing
    policy = json.loads((folder / "manifest.json").read_text())["policy"]
    assert "nothing is re-measured" in policy["final"]["replayed"]


# ------------------------------------------------------------------------------------------------
# The study's identity
# ------------------------------------------------------------------------------------------------

def test_study_name_holds_shape_dtype_gpu():
    name = study_name(BERT_BASE, "float16", "NVIDIA H200", "cold", replayed=False)
    assert "1x128x768x12x3072" in name and "float16" in name and "NVIDIA_H200" in name and " " not in name
    others = [study_name(PRESETS["bert-large"], "float16", "NVIDIA H200", "cold", False),
              study_name(BERT_BASE, "bfloat16", "NVIDIA H200", "cold", False),
              study_name(BERT_BASE, "float16", "NVIDIA H100 80GB HBM3", "cold", False),
              study_name(BERT_BASE, "float16", "NVIDIA H200", "hot", False),
              study_name(BERT_BASE, "float16", "NVIDIA H200", "cold", True)]
    assert len({name, *others}) == 6
    assert others[-1].endswith("replay")  # a replayed study never mixes with a measured one


# (ids avoid the bare word "gpu": conftest skips every test whose keywords contain it)
@pytest.mark.parametrize("change", ["dtype", "gpu-model", "l2"])
def test_study_of_another_identity_refuses_to_continue(tmp_path, replay, change):
    first = run(tmp_path, replay, study_name="shared", trials=3)
    before = [(t.number, t.params, t.value) for t in load_study(tmp_path, "shared").trials]
    kw = {"study_name": "shared", "trials": 5}
    if change == "dtype":
        kw["dtype"] = "bfloat16"
    elif change == "l2":
        kw["l2"] = "hot"
    else:
        replay.device_name = "NVIDIA H100 80GB HBM3"  # a worker on another GPU model
    with pytest.raises(StudyError, match="study 'shared'") as e:
        run(tmp_path, replay, **kw)
    assert "--study-name" in str(e.value) and "\n" not in str(e.value)
    assert {"dtype": "bfloat16", "l2": "hot", "gpu-model": "NVIDIA H100 80GB HBM3"}[change] in str(e.value)
    # Nothing was run or written for the refused worker.
    assert [(t.number, t.params, t.value) for t in load_study(tmp_path, "shared").trials] == before
    assert [p.name for p in first.parent.iterdir()] == [first.name]


@pytest.mark.parametrize("change", ["search-space", "recording"])
def test_study_of_another_space_or_recording_refuses_to_continue(tmp_path, replay, change):
    # The same --out (and so the same default study) with another search space: Optuna would fail every new trial
    # ("dynamic value space"); with another replay recording, the new run would be served the old one's timings.
    name = study_name(BERT_BASE, "float16", "NVIDIA H200", "cold", replayed=True)
    run(tmp_path, replay, trials=3)
    before = [(t.number, t.params, t.value) for t in load_study(tmp_path, name).trials]
    default = yaml.safe_load(importlib.resources.files("tuner.search_spaces").joinpath("decoder.yaml").read_text())
    sp = None
    if change == "search-space":
        sp = space.parse(dict(default, gemm=dict(default["gemm"], block_m=[32, 64])), "narrow.yaml")
    else:
        other = tmp_path / "other"
        shutil.copytree(REPLAY, other)
        t = pd.read_csv(other / "trials.csv")
        t["latency_us"] = t["latency_us"] / 2
        t.to_csv(other / "trials.csv", index=False)
        replay = ReplayEvaluator(other)
    with pytest.raises(StudyError, match=f"study '{name}'") as e:
        run(tmp_path, replay, sp, trials=5)
    words = {"search-space": "another search space", "recording": "another replay recording"}[change]
    assert words in str(e.value) and "--out" in str(e.value) and "\n" not in str(e.value)
    assert [(t.number, t.params, t.value) for t in load_study(tmp_path, name).trials] == before
    # The same space read again (another file, the same content) and the same recording continue.
    run(tmp_path, ReplayEvaluator(REPLAY), space.parse(default, "copy.yaml"), trials=4)
    assert len(load_study(tmp_path, name).trials) == 4


@pytest.mark.parametrize("stored", ["measured", "measured-before-the-key"])
def test_replayed_and_measured_timings_never_share_a_study(tmp_path, replay, stored):
    # A study of measured timings, with the identity a GPU run writes (one older than the key names no recording):
    # a replay under its name must not add served timings to it, nor a measured run continue a replay's study.
    from tuner.study import _check_identity

    url = f"sqlite:///{(tmp_path / 'studies.db').as_posix()}"
    measured = optuna.create_study(study_name="gpu", storage=url)
    ident = {"shape": BERT_BASE.spec, "dtype": "float16", "gpu": "NVIDIA H200", "l2": "cold",
             "space": space.load().fingerprint()}
    measured.set_user_attr("identity", dict(ident, recording=None) if stored == "measured" else ident)
    measured.add_trial(optuna.trial.create_trial(value=20.0))
    with pytest.raises(StudyError, match="'gpu' holds measured timings and this process replays a recording") as e:
        run(tmp_path, replay, study_name="gpu", trials=3)
    assert "--out" in str(e.value) and "\n" not in str(e.value)
    assert [t.value for t in load_study(tmp_path, "gpu").trials] == [20.0]
    run(tmp_path, replay, study_name="replayed", trials=3)
    with pytest.raises(StudyError, match="'replayed' holds replayed .* timings and this process measures"):
        _check_identity(load_study(tmp_path, "replayed"), dict(ident, recording=None))
    assert len(load_study(tmp_path, "replayed").trials) == 3
    # A replay's study from before the key: its trials say they were replayed, so the same replay continues it.
    older = load_study(tmp_path, "replayed")
    older.set_user_attr("identity", {k: v for k, v in older.user_attrs["identity"].items() if k != "recording"})
    run(tmp_path, replay, study_name="replayed", trials=4)
    assert len(load_study(tmp_path, "replayed").trials) == 4


def test_a_study_that_measured_the_cuda_kernels_does_not_go_on_without_nvcc(tmp_path):
    # Its top-k would be re-measured on the Triton kernels that cluster_gemm.usable falls back to, under the CUDA
    # kernels' names (session 46 left nvcc out of the identity). The other way the study goes on.
    from tuner.study import _check_identity

    url = f"sqlite:///{(tmp_path / 'studies.db').as_posix()}"
    ident = {"shape": BERT_BASE.spec, "dtype": "float16", "gpu": "NVIDIA H200", "l2": "cold",
             "space": space.load().fingerprint(), "recording": None}
    with_nvcc = optuna.create_study(study_name="with", storage=url)
    _check_identity(with_nvcc, dict(ident, nvcc=True))
    with pytest.raises(StudyError, match="'with' ran where nvcc builds the CUDA kernels") as e:
        _check_identity(with_nvcc, dict(ident, nvcc=False))
    assert "trials are kept" in str(e.value) and "\n" not in str(e.value)
    without = optuna.create_study(study_name="without", storage=url)
    _check_identity(without, dict(ident, nvcc=False))
    _check_identity(without, dict(ident, nvcc=True))  # (its Triton trials measured what they launched)
    assert without.user_attrs["identity"]["nvcc"] is True
    with pytest.raises(StudyError, match="'without' ran where nvcc"):  # it holds CUDA trials now
        _check_identity(without, dict(ident, nvcc=False))
    older = optuna.create_study(study_name="older", storage=url)  # (before the key: this process's value)
    older.set_user_attr("identity", ident)
    _check_identity(older, dict(ident, nvcc=False))
    assert older.user_attrs["identity"]["nvcc"] is False


def test_same_identity_continues(tmp_path, replay):
    run(tmp_path, replay, study_name="shared", trials=3)
    run(tmp_path, replay, study_name="shared", trials=5)
    assert len(load_study(tmp_path, "shared").trials) == 5


# ------------------------------------------------------------------------------------------------
# The enqueued baseline and the replay
# ------------------------------------------------------------------------------------------------

def test_a_replay_serves_a_breakdown_only_for_the_kernels_it_timed(tmp_path, replay):
    # The recording's breakdown.json timed its baseline and its best configuration: another configuration gets none
    # (a replayed run's breakdown used to show the norm kernels of a best that launches none).
    from tuner.space import to_config

    recorded = json.loads((REPLAY / "breakdown.json").read_text())
    assert replay.breakdown(default_config(BERT_BASE)) == recorded["baseline"]
    row = replay.rows[replay.rows["status"] == "ok"].sort_values("latency_us").iloc[0]  # (no best.json: its fastest)
    best = to_config({k: int(row[k]) if float(row[k]).is_integer() else float(row[k]) for k in replay.params})
    assert replay.breakdown(best) == recorded["best"]
    other = replace(best, ffn1=replace(best.ffn1, num_warps=8 if best.ffn1.num_warps == 4 else 4))
    assert replay.breakdown(other) is None
    folder = run(tmp_path, replay, trials=12)
    top = json.loads((folder / "topk.json").read_text())
    assert all(isinstance(r["approximated"], bool) for r in top["rows"])
    exported = json.loads((folder / "best.json").read_text())
    assert exported["approximated"] == top["rows"][0]["approximated"]
    assert (folder / "breakdown.json").is_file() == (replay.breakdown(DecoderConfig.from_dict(exported["config"]))
                                                       is not None)
    # and a configuration that launches what the best launched (the run of record's trials 40 and 46: FFN1's
    # prefetch at 0.8 or 1.0 over its 3 K tiles, the clustered out-projection's group_m) timed the same kernels
    record = ReplayEvaluator(REPLAY.parent / "replay-bert-base-h200-20261128")
    trials = pd.read_csv(REPLAY.parent / "replay-bert-base-h200-20261128" / "trials.csv").set_index("number")
    best46 = json.loads((REPLAY.parent / "replay-bert-base-h200-20261128" / "best.json").read_text())["config"]
    assert best46 == recorded_config(trials.loc[46]).to_dict()
    expected = json.loads((REPLAY.parent / "replay-bert-base-h200-20261128" / "breakdown.json").read_text())["best"]
    assert record.breakdown(recorded_config(trials.loc[40])) == expected
    assert record.breakdown(recorded_config(trials.loc[38])) is None
    marked = sum("≈" in ln.split("|")[1] for ln in (folder / "topk.md").read_text().splitlines()
                 if ln.startswith("|") and ln.split("|")[1].strip()[:1].isdigit())
    assert marked == sum(r["approximated"] for r in top["rows"])


def test_first_trial_is_the_enqueued_baseline(tmp_path, replay):
    folder = run(tmp_path, replay, sampler="random", trials=7)
    name = study_name(BERT_BASE, "float16", "NVIDIA H200", "cold", replayed=True)
    trials = load_study(tmp_path, name).trials
    base = default_config(BERT_BASE)
    assert trials[0].user_attrs["is_baseline"] and trials[0].params == space.from_config(base)
    assert not any(t.user_attrs.get("is_baseline") for t in trials[1:])
    # Then the hand-picked tiles with PDL + full prefetch, the same with split-K reduced in clusters (and the attention
    # in QKV's kernel), the hand-picked tiles with the attention in QKV's kernel, the clustered seed with every GEMM's
    # L2 hints on, the one-kernel layer, and the hand-picked tiles with the knobs off.
    hp = hand_picked(BERT_BASE)
    assert trials[1].params == space.from_config(hp)
    clustered = hand_picked_cluster(BERT_BASE)
    assert trials[2].params == space.from_config(clustered)
    assert trials[2].params["qkv.fuse"] == 1
    hinted = {**trials[2].params, **{f"{g}.hints": 1 for g in ("qkv", "out", "ffn1", "ffn2")}}
    assert trials[3].params == space.from_config(replace(hp, qkv=replace(hp.qkv, fuse=1)))
    assert trials[4].params == hinted and clustered.qkv.hints == 0
    assert trials[5].params == space.from_config(hand_picked_fused(BERT_BASE))
    assert trials[6].params == space.from_config(hp.without_knobs())
    # The baseline's replayed latency is the recording's baseline trial.
    recorded = pd.read_csv(REPLAY / "trials.csv")
    assert trials[0].value == recorded.loc[recorded["is_baseline"], "latency_us"].item()
    csv = pd.read_csv(folder / "trials.csv")
    assert csv.loc[0, "is_baseline"] and csv.loc[0, "number"] == 0


def test_a_space_without_the_16_bit_exchange_gets_the_fp32_cluster_seed(tmp_path, replay):
    # A user's space written before gemm.cluster 2 (choices 0 and 1): the clustered seed exchanges in fp32, so that
    # it lies inside the space and is still measured.
    data = copy.deepcopy(default_data())
    data["gemm"]["cluster"] = [0, 1]
    run(tmp_path, replay, space.parse(data, "old space"), sampler="random", trials=4)
    name = study_name(BERT_BASE, "float16", "NVIDIA H200", "cold", replayed=True)
    trials = load_study(tmp_path, name).trials
    assert trials[2].params == space.from_config(hand_picked_cluster(BERT_BASE, xchg16=False))
    assert trials[2].params["ffn2.cluster"] == 1


def test_the_clustered_seed_launches_each_clustered_gemm_as_one_wave():
    # bench.ONE_WAVE_CTAS: bert-base's out-projection and FFN2 (24 tiles) split 4 in clusters, 96 CTAs each;
    # bert-large's (32 tiles) would be 128: its out-projection splits 2 ways, its FFN2 takes 64x128 tiles (16)
    from tuner.bench import ONE_WAVE_CTAS

    base, large = hand_picked_cluster(BERT_BASE), hand_picked_cluster(PRESETS["bert-large"])
    assert (base.out.cluster, base.out.split_k, base.ffn2.cluster, base.ffn2.split_k) == (2, 4, 2, 4)
    assert (base.out.block_n, base.ffn2.block_n) == (64, 64)
    assert (large.out.cluster, large.out.split_k, large.ffn2.cluster, large.ffn2.split_k) == (2, 2, 2, 4)
    assert (large.out.block_n, large.ffn2.block_n) == (64, 128)
    assert 2 * 16 * large.out.split_k <= ONE_WAVE_CTAS < 2 * 16 * 4
    assert check_config(large, PRESETS["bert-large"]) == {}


@pytest.mark.parametrize("name, seeded", [("bert-large", True), ("bert-base", False), ("tiny", False)])
def test_ffn2_in_128x128_tiles_split_8_is_seeded_where_its_ctas_stream_fewer_bytes(name, seeded):
    # bert-large's clustered FFN2 (64x128 split 4: 64 CTAs of (64 + 128) x 4096 / 4 elements) in 128x128 tiles split
    # 8 (64 CTAs of 256 x 4096 / 8) is a seed of its own; bert-base's (64x64 split 4, 96 CTAs) would stream as much on
    # half the CTAs, tiny's FFN2 is in the fused block.
    from tuner.bench import square_split_ffn2
    from tuner.study import _enqueue_first_trials

    shape = PRESETS[name]
    st = optuna.create_study()
    _enqueue_first_trials(st, shape, True, space.parse(default_data(), "default"), log=lambda m: None)
    queued = [t.system_attrs["fixed_params"] for t in st.get_trials(deepcopy=False)]  # (waiting: not yet sampled)
    clustered = hand_picked_cluster(shape)
    square = square_split_ffn2(clustered, shape)
    assert (square is not None) == seeded
    if seeded:
        assert space.from_config(square) in queued
        ffn2 = square.ffn2
        assert (ffn2.block_m, ffn2.block_n, ffn2.split_k, ffn2.num_warps) == (128, 128, 8, 8)
        assert check_config(square, shape) == {} and square.ffn2.cluster == clustered.ffn2.cluster
        assert {k: v for k, v in space.from_config(square).items() if not k.startswith("ffn2.")} == {
            k: v for k, v in space.from_config(clustered).items() if not k.startswith("ffn2.")}
    else:
        assert not any(p["ffn2.split_k"] == 8 and p["ffn2.block_m"] == 128 and p["ffn2.cluster"] for p in queued)


@pytest.mark.parametrize("spec", ["4096x16x512x16x512", "64x8x768x12x3072"])
def test_short_sequences_are_seeded(spec):
    # Below 32 tokens a sequence's attention tiles fit to 16 wide, no choice of the default space: the layer kernel's
    # fields that a per-kernel config never reads carried them and kept every seed, the baseline too, out of the study
    # (session 46, H200: its 3 trials began from TPE's random tiles, the top-1 3.5x slower than the baseline). What no
    # launch reads now takes a value of the space, and the baseline and the many-tokens tiles are queued.
    from tuner.bench import hand_picked_many
    from tuner.study import _enqueue_first_trials

    shape, logged = resolve(spec), []
    st = optuna.create_study()
    _enqueue_first_trials(st, shape, True, space.parse(default_data(), "default"), log=logged.append)
    queued = [t.system_attrs["fixed_params"] for t in st.get_trials(deepcopy=False)]
    assert len(queued) >= 5 and not logged
    assert st.get_trials(deepcopy=False)[0].user_attrs == {"is_baseline": True}
    many = space.from_config(hand_picked_many(shape))
    launched = {k: v for k, v in many.items() if not k.startswith("layer.") or k == "layer.fuse"}
    assert any(launched.items() <= p.items() for p in queued)
    assert many["layer.attn_block_n"] not in (32, 64, 128)  # (what was outside the space)


def recorded_config(row) -> DecoderConfig:
    """The DecoderConfig of a row of the recording's trials.csv."""
    params = {k: (float(v) if k.endswith("_ratio") else int(v)) for k, v in row.items() if "." in k}
    return space.to_config(params)


def test_recorded_config_is_served_exactly(replay):
    recorded = pd.read_csv(REPLAY / "trials.csv")
    assert replay.evaluate(default_config(BERT_BASE)).approximated is False  # the baseline was recorded
    ok = recorded[recorded["status"] == "ok"]
    for _, row in pd.concat([ok.head(3), ok.tail(2)]).iterrows():
        res = replay.evaluate(recorded_config(row))
        assert not res.approximated and res.status == "ok" and res.reason == "replayed"
        assert (res.latency_us, res.spread_us) == (row["latency_us"], row["spread_us"])


def test_a_configuration_that_launches_a_recorded_one_is_served_as_measured():
    # The run of record measured trial 18 and its local step 32, which moved only the clustered out-projection's
    # prefetch ratio (1.0 to 0.8: all 3 of its 64-wide K tiles a split either way): one launch, measured twice. A
    # replay serves such a configuration the recorded launch's timing as its own; one that launches otherwise is still
    # approximated.
    rec = ReplayEvaluator(REPLAY.parent / "replay-bert-base-h200-20261128")
    trials = pd.read_csv(REPLAY.parent / "replay-bert-base-h200-20261128" / "trials.csv").set_index("number")
    assert trials.loc[32, "neighbour_of"] == 18 and (trials.loc[18, "out.prefetch_ratio"],
                                                     trials.loc[32, "out.prefetch_ratio"]) == (1.0, 0.8)
    t18 = recorded_config(trials.loc[18])
    for p in (0.9, 0.7):  # (off the grid: no recorded row holds it; 0.7 rounds up to 3 of 3 tiles too)
        res = rec.evaluate(replace(t18, out=replace(t18.out, prefetch_ratio=p)))
        assert not res.approximated and (res.latency_us, res.spread_us) == tuple(trials.loc[18, ["latency_us",
                                                                                                  "spread_us"]])
    assert rec.evaluate(replace(t18, out=replace(t18.out, prefetch_ratio=0.3))).approximated  # 1 of 3 tiles


def test_a_replay_repairs_for_the_recordings_gpu(tmp_path):
    # session 46's run on an H200 without nvcc (its CUDA kernels repaired to the Triton ones): the clustered seed and
    # the hand-picked tiles with the attention in QKV's kernel, as that study measured them, are served as
    # themselves; until session 47 a replay repaired for no GPU, kept the CUDA kernels and served a neighbour
    from tuner.bench import fit_prefetch, hand_picked_cluster

    recording = Path(__file__).parents[1] / "results/session46/no-nvcc/bert-base/20261128-154112-tpe"
    rep = ReplayEvaluator(recording)
    assert rep.measured_on.name == "NVIDIA H200" and rep.measured_on.nvcc is False
    hp = hand_picked(rep.shape)
    for cfg in (hand_picked_cluster(rep.shape), replace(hp, qkv=replace(hp.qkv, fuse=1))):
        sampled = space.from_config(fit_prefetch(cfg, rep.shape, rep.measured_on.l2_bytes))
        measured = _repairer(rep.shape, rep)(sampled)
        assert check_config(cfg, rep.shape, 2, rep.measured_on) and not check_config(measured, rep.shape, 2,
                                                                                      rep.measured_on)
        res = rep.evaluate(measured)
        assert res.status == "ok" and not res.approximated, res
    # and the replay's run folder names that GPU, nvcc included, as where its timings were measured
    folder = run(tmp_path, rep, sampler="random", trials=3, seed=0)
    assert json.loads((folder / "manifest.json").read_text())["measured_on"] == rep.manifest["measured_on"]


def test_unrecorded_config_is_flagged_approximated(replay):
    cfg = hand_picked(BERT_BASE)
    cfg = replace(cfg, ffn1=replace(cfg.ffn1, overlap_ratio=0.6, num_stages=2))
    recorded = pd.read_csv(REPLAY / "trials.csv")
    cols = [c for c in recorded.columns if "." in c]
    want = space.from_config(cfg)
    assert not (recorded[cols] == pd.Series({c: want[c] for c in cols})).all(axis=1).any(), "pick another config"
    res = replay.evaluate(cfg)
    assert res.approximated and "approximated" in res.reason
    assert res.status == "ok" and math.isfinite(res.latency_us)


def test_config_with_a_parameter_the_recording_lacks_is_approximated(replay):
    if "fuse" not in NormConfig().to_dict():
        pytest.skip("NormConfig has no fuse switch")
    recorded = pd.read_csv(Path(replay.source) / "trials.csv" if Path(replay.source).is_dir() else replay.source)
    assert "norm1.fuse" not in recorded.columns  # the recording predates the switch
    base = default_config(BERT_BASE)
    res = replay.evaluate(replace(base, norm1=replace(base.norm1, fuse=1)))
    assert res.approximated


def test_study_counts_approximated_trials(tmp_path, replay):
    folder = run(tmp_path, replay, sampler="random", trials=12, seed=3)
    trials = pd.read_csv(folder / "trials.csv")
    assert not trials.loc[0, "approximated"]  # the baseline is in the recording
    n = int(trials["approximated"].sum())
    assert n > 0, "a random 50-parameter sample should miss the 120 recorded configs"
    assert f"{n} trials approximated by the replay" in (folder / "topk.md").read_text()


def test_a_replay_table_shows_each_recorded_measurement_once_as_measured(tmp_path):
    # A replay serves an unrecorded configuration its nearest recorded one's timing. Until session 51 the local steps
    # around the recording's best tied it exactly and the first such trial went into best.json: a configuration no GPU
    # measured. Session 51 ranked the recorded one first on a tie; the table still showed nine neighbours at the best's
    # timing, and trials that differ from their nearest recorded configuration in 30 parameters at its timing. Now an
    # approximated trial stands in the table for the configuration it was served, which the recording measured.
    src = REPLAY.parent / "replay-bert-base-h200-20261128"
    rec = ReplayEvaluator(src)
    run_dir = run(tmp_path, rec, trials=80, top_k=10)
    top = json.loads((run_dir / "topk.json").read_text())
    rows, trials = top["rows"], pd.read_csv(run_dir / "trials.csv").set_index("number")
    assert len(rows) == 10 and trials["approximated"].sum() > 0
    recorded = pd.read_csv(src / "trials.csv").set_index("number")
    for r in rows:
        cfg = DecoderConfig.from_dict(r["config"])
        served = rec.evaluate(cfg)  # a configuration the recording measured, at the recorded figures
        assert not r["approximated"] and not served.approximated, r
        assert r["served_from"] == trials.loc[r["trial"], "served_from"] == served.served_from
        assert r["latency_us"] == served.latency_us == recorded.loc[served.served_from, "latency_us"]
        # a row reached through an approximated trial shows the recorded configuration, not the trial's
        assert r["via_neighbour"] == bool(trials.loc[r["trial"], "approximated"])
        if r["via_neighbour"]:
            assert r["config"] == rec.recorded_config(r["served_from"]).to_dict()
            assert r["config"] != recorded_config(trials.loc[r["trial"]]).to_dict()
    assert any(r["via_neighbour"] for r in rows), "no row reached through an approximated trial"
    assert len({r["served_from"] for r in rows}) == len({config_hash(DecoderConfig.from_dict(r["config"]), rec.shape)
                                                         for r in rows}) == len(rows)  # each measurement, launch once
    assert [r["latency_us"] for r in rows] == sorted(r["latency_us"] for r in rows)
    best = json.loads((run_dir / "best.json").read_text())
    assert best["config"] == rows[0]["config"] and best["approximated"] is False
    n = sum(r["via_neighbour"] for r in rows)
    assert f"{n} of these rows {'was' if n == 1 else 'were'} reached by a trial the recording does not hold" in (
        run_dir / "topk.md").read_text()
    # the recording's ranks 1-3 launch alike (trials 40, 44 and 46): one row
    assert sum(r["served_from"] in (40, 44, 46) for r in rows) <= 1


def test_a_replay_approximates_by_what_the_launches_read(tmp_path):
    # The run of record's best (trial 40) switched to the one-kernel layer of its trial 5, at 3 stages, which it did
    # not measure: nothing of trial 40's seven kernels is launched, so the nearest recorded configuration is trial 5
    # (one field apart), not trial 40, whose unread seven kernels' fields it shares (it served 17.40 us, a one-kernel
    # layer at the best's timing, before session 52).
    rec = ReplayEvaluator(REPLAY.parent / "replay-bert-base-h200-20261128")
    recorded = pd.read_csv(REPLAY.parent / "replay-bert-base-h200-20261128" / "trials.csv").set_index("number")
    t5 = rec.recorded_config(5)
    cfg = replace(rec.recorded_config(40), layer=replace(t5.layer, num_stages=3))
    assert t5.layer.fuse == 1 and t5.layer.num_stages == 4
    got = rec.evaluate(cfg)
    assert got.approximated and got.served_from == 5, got
    assert got.latency_us == recorded.loc[5, "latency_us"]


def test_a_replay_row_keeps_its_trial_where_todays_checks_refuse_the_recorded_configuration(tmp_path):
    # The recording's GPU as the manifest names it, with less shared memory: most recorded configurations are refused
    # today, so an approximated trial served one of them stays in the table as itself, marked approximated, and each
    # recorded timing is still shown once.
    copy_dir = tmp_path / "recording"
    shutil.copytree(REPLAY.parent / "replay-bert-base-h200-20261128", copy_dir)
    man = json.loads((copy_dir / "manifest.json").read_text())
    man["measured_on"]["smem_per_block_bytes"] = 150_000
    (copy_dir / "manifest.json").write_text(json.dumps(man))
    rec = ReplayEvaluator(copy_dir)
    run_dir = run(tmp_path / "out", rec, trials=40, top_k=10)
    rows = json.loads((run_dir / "topk.json").read_text())["rows"]
    trials = pd.read_csv(run_dir / "trials.csv").set_index("number")
    kept = [r for r in rows if r["approximated"]]
    assert kept, "no row of a refused recorded configuration"
    for r in kept:
        assert rec.recorded_config(r["served_from"]) is None and not r["via_neighbour"]
        assert r["config"] == recorded_config(trials.loc[r["trial"]]).to_dict()
    assert len({r["served_from"] for r in rows}) == len(rows)
    # exported, such a row says whose timing it carries
    from tuner.export import config_of, ranked

    got = ranked(run_dir, kept[0]["rank"])
    assert got["approximated"] is True and got["config"] == kept[0]["config"]
    with pytest.warns(UserWarning, match=r"chosen in a replay: .*\(the nearest recorded configuration's\)"):
        config_of(got, run_dir, gpu="NVIDIA H200")


def test_baseline_is_measured_when_the_space_excludes_default_tiles(tmp_path, replay):
    # The seeds are not forced into a space that excludes them; the baseline is measured in the final
    # phase (interleaved with the top-k) and the search stays inside the user's space.
    data = copy.deepcopy(default_data())
    data["gemm"]["block_m"] = [16, 32]  # the baseline's default tiles use block_m 64
    folder = run(tmp_path, replay, space.parse(data, "restricted"), trials=16)
    trials = pd.read_csv(folder / "trials.csv")
    assert not trials["is_baseline"].any()
    assert set(trials["status"]) <= {"ok", "invalid", "incorrect"}
    assert set(trials["qkv.block_m"]) <= {16, 32}
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["baselines"]["baseline_us"] > 0


# ------------------------------------------------------------------------------------------------
# The local step: neighbours of the best trial
# ------------------------------------------------------------------------------------------------

def test_neighbour_moves_one_acting_parameter_to_an_adjacent_choice():
    import numpy as np

    from tuner.kernels.cluster_gemm import split_error
    from tuner.study import PAIRED, neighbour

    sp = space.load()
    params = space.from_config(hand_picked(BERT_BASE))  # (unsplit, unclustered QKV, out-projection and FFN1)
    dims = sp.params(True)

    def adjacent(k, p):
        choices = sorted(dims[k].choices)
        return abs(choices.index(p[k]) - choices.index(params[k])) == 1

    hints = split_fixed = pairs = sweeps = 0
    for seed in range(600):
        p = neighbour(params, sp, True, np.random.default_rng(seed))
        assert sp.contains(p, True)
        moved = [k for k in p if p[k] != params[k]]
        if len({k.split(".")[1] for k in moved}) == 1 and moved[0].endswith("_ratio") and len(moved) > 1:
            # a sweep: one ratio of every acting kernel to one value of its grid (KNOB_SWEEP)
            field = moved[0].split(".")[1]
            assert len({p[k] for k in moved}) == 1 and not any(k.startswith("layer.") for k in moved), moved
            assert {k for k in p if k.endswith("." + field) and p[k] != p[moved[0]] and not k.startswith("layer.")
                    and p[moved[0]] in dims[k].choices} == set(), p
            sweeps += 1
            continue
        if moved[0].endswith(".hints"):  # the GEMMs' L2 hints move together, off to on
            assert moved == [f"{g}.hints" for g in ("qkv", "out", "ffn1", "ffn2")] and {p[k] for k in moved} == {1}
            hints += 1
            continue
        gemm = moved[0].split(".")[0]
        cluster, split = f"{gemm}.cluster", f"{gemm}.split_k"
        if cluster in moved and p[cluster] > 0 and split in moved:
            # into a cluster: a split the cluster kernel runs on the tile's columns, its smallest where the step left
            # it another
            ok = split_error(p[split], p[f"{gemm}.block_n"]) is None
            assert ok and (p[split] == 2 or adjacent(split, p)), (moved, p)
            moved.remove(split)
            split_fixed += split_error(params[split], p[f"{gemm}.block_n"]) is not None
        assert 1 <= len(moved) <= 2, moved
        if len(moved) == 2:  # two tile-shape parameters of one GEMM
            assert {k.split(".")[0] for k in moved} == {gemm} and all(k.split(".")[1] in PAIRED for k in moved), moved
            pairs += 1
        for k in moved:
            assert not k.startswith("layer.") or k == "layer.fuse"  # the one-kernel layer is off: its tiles do not act
            assert adjacent(k, p), (k, params[k], p[k])
    assert hints > 0 and split_fixed > 0 and pairs > 0 and 40 < sweeps < 150  # (KNOB_SWEEP 0.15 of 600)
    assert neighbour(params, continuous_space(), True, np.random.default_rng(0)) is None


@pytest.mark.parametrize("block_n, cluster", [(128, 0), (64, 0), (128, 2)])
def test_neighbour_keeps_a_cluster_split_the_kernel_runs_on_the_tiles_columns(block_n, cluster):
    # FFN2 at split 8: a step into a cluster keeps 8 on 128-column tiles and takes 2 on 64-column ones; a clustered
    # split 8 whose tile narrows to 64 columns takes 2 too (repair would otherwise leave the cluster kernel).
    import numpy as np

    from tuner.kernels.cluster_gemm import split_error
    from tuner.study import neighbour

    sp = space.load()
    base = space.from_config(hand_picked_cluster(PRESETS["bert-large"]))
    params = {**base, "ffn2.block_n": block_n, "ffn2.split_k": 8, "ffn2.cluster": cluster, "ffn2.block_m": 128,
              "ffn2.num_warps": 8}
    kept = narrowed = 0
    for seed in range(3000):
        p = neighbour(params, sp, True, np.random.default_rng(seed))
        moved_in = p["ffn2.cluster"] > 0 and p["ffn2.cluster"] != params["ffn2.cluster"]
        narrowed_to = p["ffn2.cluster"] > 0 and p["ffn2.block_n"] == 64 != params["ffn2.block_n"]
        if not (moved_in or narrowed_to) or p["ffn2.block_n"] not in (64, 128):
            continue  # (256 columns: not a cluster tile, repair's to settle)
        assert split_error(p["ffn2.split_k"], p["ffn2.block_n"]) is None, p
        # 8 kept where it runs, else the smallest split (the step itself may also have moved the split off 8)
        assert p["ffn2.split_k"] in ((8, 2) if p["ffn2.block_n"] == 128 else (2,)), p
        kept += p["ffn2.split_k"] == 8
        narrowed += narrowed_to
    if block_n == 128:
        assert kept > 0  # (into a cluster on 128-column tiles, split 8 stays)
    if cluster:
        assert narrowed > 0  # (a clustered split 8 narrowed to 64 columns takes 2)


def test_neighbour_pairs_cross_a_worse_midpoint():
    """bert-large's FFN2: from Triton 64x64 split 4 into clusters of 64x128 tiles split 4 is one step (section 35)."""
    import numpy as np

    from tuner.study import neighbour

    sp = space.load()
    params = {**space.from_config(hand_picked(BERT_BASE)), "ffn2.block_m": 64, "ffn2.block_n": 64,
              "ffn2.split_k": 4, "ffn2.cluster": 0}
    target = {"ffn2.block_n": 128, "ffn2.cluster": 1}
    hits = sum(all(p[k] == v for k, v in target.items()) and p["ffn2.split_k"] == 4
               for p in (neighbour(params, sp, True, np.random.default_rng(s)) for s in range(3000)))
    assert hits > 0


def test_idle_kernels_are_those_the_layer_does_not_launch():
    from devices import A100, H200  # (tests/ is on sys.path under pytest)

    from tuner.layer import idle_kernels, repair_config

    def idle(shape, cfg, device):
        return idle_kernels(repair_config(cfg, PRESETS[shape], 2, device))

    assert idle("bert-base", default_config(BERT_BASE), H200) == set()  # seven kernels
    # bert-base's seed: the norms folded into the GEMMs, the attention in QKV's kernel
    assert idle("bert-base", hand_picked_cluster(BERT_BASE), H200) == {"norm1", "norm2", "attn"}
    # tiny's: the attention, the out-projection and FFN2 in the feed-forward block's kernel too
    assert idle("tiny", hand_picked_cluster(PRESETS["tiny"]), H200) == {"norm1", "norm2", "attn", "out", "ffn2"}
    # not a Hopper: repair runs the CUDA kernels' work on the Triton kernels, so only the norms are idle
    assert idle("tiny", hand_picked_cluster(PRESETS["tiny"]), A100) == {"norm1", "norm2"}
    assert idle_kernels(hand_picked_fused(BERT_BASE)) == set()  # the one-kernel layer's parameters are apart


def test_launched_config_leaves_out_only_what_no_launch_reads():
    from devices import A100, H200

    from tuner.kernels import gemm as gemm_k
    from tuner.layer import repair_config
    from tuner.study import config_hash

    tiny = PRESETS["tiny"]

    def same(shape, a, b, device=H200):
        shape = PRESETS[shape]
        return (config_hash(repair_config(a, shape, 2, device), shape)
                == config_hash(repair_config(b, shape, 2, device), shape))

    def edit(cfg, **kernels):
        return replace(cfg, **{k: replace(getattr(cfg, k), **f) for k, f in kernels.items()})

    # tiny's seed: FFN1's launch is the one-kernel feed-forward block, which reads FFN1's prefetch ratio and L2
    # hints, and of its overlap ratio only whether it is on
    block = hand_picked_cluster(tiny)
    assert same("tiny", block, edit(block, ffn1=dict(block_n=128, num_stages=5, split_k=2, group_m=1)))
    assert same("tiny", block, edit(block, ffn1=dict(overlap_ratio=0.6)))
    assert not same("tiny", block, edit(block, ffn1=dict(overlap_ratio=-1.0)))
    assert not same("tiny", block, edit(block, ffn1=dict(prefetch_ratio=0.6)))
    assert not same("tiny", block, edit(block, ffn1=dict(hints=1 - block.ffn1.hints)))
    assert same("tiny", block, edit(block, ffn2=dict(block_n=128), out=dict(num_stages=2), attn=dict(block_n=32)))
    assert not same("tiny", block, edit(block, qkv=dict(num_stages=block.qkv.num_stages + 1)))
    # off Hopper the block does not run (repair): FFN1 runs its own tiles
    assert not same("tiny", block, edit(block, ffn1=dict(block_n=128)), A100)
    # bert-base's seed: the norms folded in (their kernels idle); the attention in QKV's kernel, but the stack's
    # first layer (no row sums of its input) runs QKV and the attention apart, on their own configs
    seed = hand_picked_cluster(BERT_BASE)
    assert seed.qkv.fuse == 1 and seed.norm1.fuse == 2
    assert same("bert-base", seed, edit(seed, norm1=dict(num_warps=8), norm2=dict(rows_per_program=4)))
    assert not same("bert-base", seed, edit(seed, attn=dict(block_n=32)))
    assert not same("bert-base", seed, edit(seed, qkv=dict(block_n=128)))
    # L2 hints: read by the CUDA kernels (QKV's with the attention, the clustered out-projection and FFN2), ignored by
    # the Triton kernels (FFN1 here, and every GEMM off Hopper, where repair runs them all on Triton)
    assert (seed.qkv.fuse, seed.out.cluster, seed.ffn1.cluster, seed.ffn2.cluster) == (1, 2, 0, 2)
    for g in ("qkv", "out", "ffn2"):
        flip = edit(seed, **{g: dict(hints=1 - getattr(seed, g).hints)})
        assert not same("bert-base", seed, flip) and same("bert-base", seed, flip, A100), g
    assert same("bert-base", seed, edit(seed, ffn1=dict(hints=1 - seed.ffn1.hints)))
    # group_m of a GEMM on the cluster kernel (its tile order is fixed): the clustered out-projection and FFN2 here;
    # not a clustered GEMM whose folded LayerNorm may run it on the Triton kernels (QKV here, under norm1.fuse 2)
    assert same("bert-base", seed, edit(seed, out=dict(group_m=1), ffn2=dict(group_m=4)))
    assert not same("bert-base", seed, edit(seed, out=dict(group_m=1)), A100)
    plain = edit(seed, qkv=dict(fuse=0, cluster=2, split_k=2, block_m=64, block_n=64, num_warps=4, tma=1))
    assert plain.norm1.fuse == 2 and not same("bert-base", plain, edit(plain, qkv=dict(group_m=1)))
    no_norm = edit(plain, norm1=dict(fuse=0))
    assert same("bert-base", no_norm, edit(no_norm, qkv=dict(group_m=1)))
    # FFN1 clustered with LayerNorm 2 folded on the out-projection's row sums (norm2.fuse 2) runs on the cluster kernel
    # in every layer where that kernel reads all their parts: the seed's split out-projection writes 12; in 16-column
    # tiles unsplit it writes 48, more than the 32 the cluster kernel reads, and FFN1 runs on the Triton kernels
    folded = edit(seed, ffn1=dict(cluster=2, split_k=2))
    assert folded.norm2.fuse == 2 and repair_config(folded, BERT_BASE, 2, H200).ffn1.cluster == 2
    assert same("bert-base", folded, edit(folded, ffn1=dict(group_m=1)))
    narrow = edit(folded, out=dict(cluster=0, split_k=1, block_n=16))
    assert not same("bert-base", narrow, edit(narrow, ffn1=dict(group_m=1)))
    # QKV's Triton tiles under QKV's kernel with the attention, where no layer runs QKV on Triton (norm1.fuse 0)
    attn_qkv = edit(seed, norm1=dict(fuse=0))
    assert repair_config(attn_qkv, BERT_BASE, 2, H200).qkv.fuse == 1
    assert same("bert-base", attn_qkv, edit(attn_qkv, qkv=dict(block_n=128, group_m=1, split_k=2)))
    assert not same("bert-base", attn_qkv, edit(attn_qkv, qkv=dict(num_stages=attn_qkv.qkv.num_stages + 1)))
    # the ratios as the launches read them: a trigger and a prefetch count in K tiles. FFN1 in 256-wide K tiles has 3:
    # prefetch 0.8 and 1.0 both take all 3, 0.2 and 0.4 take 1 and 2; overlap 0 to 0.4 trigger after the first, 0.6
    # after the second, and -1 launches without PDL
    wide = edit(seed, ffn1=dict(block_k=256, num_stages=3, split_k=1))
    assert gemm_k.triton_knobs(repair_config(wide, BERT_BASE, 2, H200).ffn1, 768) == (0, 3, -1)
    assert same("bert-base", wide, edit(wide, ffn1=dict(prefetch_ratio=0.8)))
    assert not same("bert-base", edit(wide, ffn1=dict(prefetch_ratio=0.2)), edit(wide, ffn1=dict(prefetch_ratio=0.4)))
    assert same("bert-base", wide, edit(wide, ffn1=dict(overlap_ratio=0.4)))
    assert not same("bert-base", wide, edit(wide, ffn1=dict(overlap_ratio=0.6)))
    assert not same("bert-base", wide, edit(wide, ffn1=dict(overlap_ratio=-1.0)))
    # QKV's kernel with the attention counts its 12 K tiles of 64: every ratio of the grid is its own launch
    assert not same("bert-base", seed, edit(seed, qkv=dict(overlap_ratio=0.2)))
    assert not same("bert-base", seed, edit(seed, qkv=dict(prefetch_ratio=0.8)))
    # the one-kernel layer's fields where it is off; the seven kernels' where it is on
    base = default_config(BERT_BASE)
    assert same("bert-base", base, edit(base, layer=dict(num_warps=4, block_k=128)))
    assert not same("bert-base", base, edit(base, ffn1=dict(num_stages=4)))
    fused = hand_picked_fused(BERT_BASE)
    assert same("bert-base", fused, edit(fused, qkv=dict(block_n=128), attn=dict(block_n=32)))
    assert not same("bert-base", fused, edit(fused, layer=dict(num_stages=fused.layer.num_stages + 1)))


def _record_gemm_launches(monkeypatch) -> list:
    """gemm.linear's launches recorded, not run (on the CPU, with PDL and prefetch as on Hopper, the cluster kernel
    usable): the list each launch appends (kernel, grid, args, meta) to; the caller clears it between configs."""
    from tuner.kernels import _common, cluster_gemm
    from tuner.kernels import gemm as gemm_k

    launched = []

    class Recorder:  # a Triton kernel: kernel[grid](*args, **meta)
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: launched.append((self.name, grid, a, kw))

    hopper = _common.LaunchMode(pdl=True, prefetch=True, upcast_bf16=False)
    for module in (_common, gemm_k):
        monkeypatch.setattr(module, "launch_mode", lambda t: hopper)
    monkeypatch.setattr(cluster_gemm, "usable", lambda device: True)
    monkeypatch.setattr(cluster_gemm, "launch", lambda *a, **kw: launched.append(("cluster", None, a, kw)))
    monkeypatch.setattr(gemm_k, "_gemm_kernel", Recorder("gemm"))
    monkeypatch.setattr(gemm_k, "_splitk_reduce_kernel", Recorder("reduce"))
    return launched


def _launches_alike(p: list, q: list) -> bool:
    """Two configs' recorded launches (_record_gemm_launches) are the same kernels, grids and arguments: tensors as the
    same view of the same memory (the Triton path slices its row sums from the workspace anew each launch)."""
    import torch

    def same(u, v):
        if torch.is_tensor(u) and torch.is_tensor(v):
            return (u.data_ptr(), u.shape, u.stride(), u.dtype) == (v.data_ptr(), v.shape, v.stride(), v.dtype)
        return not torch.is_tensor(u) and not torch.is_tensor(v) and u == v

    return len(p) == len(q) and all(
        n1 == n2 and g1 == g2 and len(a1) == len(a2) and all(map(same, a1, a2)) and kw1.keys() == kw2.keys()
        and all(same(kw1[k], kw2[k]) for k in kw1) for (n1, g1, a1, kw1), (n2, g2, a2, kw2) in zip(p, q))


@pytest.mark.parametrize("kernel", ["cluster", "triton"])
def test_the_launch_key_is_equal_where_the_launches_are(kernel, monkeypatch):
    # config_hash leaves out what the out-projection's launch does not read (a clustered GEMM's group_m) and keys its
    # ratios by the K tiles they round to (a trigger and a prefetch count, and the split-K reduction's trigger): two
    # configurations must hash alike exactly where gemm.linear launches them alike. The launches are recorded, not
    # run (on the CPU, with PDL as on Hopper), for every pair of a sweep of ratios and group_m.
    import itertools

    import torch

    from tuner.kernels import gemm as gemm_k
    from tuner.study import config_hash

    launched = _record_gemm_launches(monkeypatch)
    x, w, b, res, out = (torch.randn(*s).half() for s in ((128, 768), (768, 768), (768,), (128, 768), (128, 768)))
    seed = hand_picked_cluster(BERT_BASE)
    base = seed.out if kernel == "cluster" else replace(seed.out, cluster=0, tma=0, block_k=64)  # 12 K tiles, 4 splits
    assert base.split_k == 4 and bool(base.cluster) == (kernel == "cluster")
    ws = torch.empty(gemm_k.workspace_numel(base, 128, 768))
    ratios = (-1.0, 0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    configs = [replace(base, overlap_ratio=o, prefetch_ratio=p, group_m=g)
               for o, p, g in itertools.product(ratios, ratios, (1, 8))]
    calls = []
    for c in configs:
        launched.clear()
        gemm_k.linear(x, w, b, config=c, residual=res, out=out, workspace=ws)
        calls.append(list(launched))

    hashes = [config_hash(replace(seed, out=c), BERT_BASE) for c in configs]
    merged = 0
    for i, j in itertools.combinations(range(len(configs)), 2):
        assert (hashes[i] == hashes[j]) == _launches_alike(calls[i], calls[j]), (configs[i], configs[j])
        merged += hashes[i] == hashes[j]
    assert {n for n, *_ in calls[-1]} == ({"cluster"} if kernel == "cluster" else {"gemm", "reduce"})
    assert merged > len(configs) // 2  # (the sweep has launches alike to merge, not only the group_m pairs)


@pytest.mark.parametrize("name,gemm,norm_fuse,producer_tiles", [
    ("bert-base", "ffn1", 2, None), ("bert-base", "ffn1", 2, 32), ("bert-base", "ffn1", 2, 16),
    ("bert-large", "ffn1", 2, 32), ("bert-large", "ffn1", 2, 16), ("bert-base", "ffn1", 1, None),
    ("bert-base", "qkv", 2, None), ("bert-base", "qkv", 2, 16), ("bert-base", "qkv", 1, None)])
def test_a_folded_gemm_is_keyed_by_the_kernels_it_launches(name, gemm, norm_fuse, producer_tiles, monkeypatch):
    # A clustered GEMM that folds its LayerNorm: gemm.linear runs it on the Triton kernels where the row sums come from
    # its K loop (fuse 1) and, where they come from its producer (fuse 2: FFN1's the out-projection, QKV's the previous
    # layer's FFN2, so none in the stack's first layer), on the cluster kernel if that reads all their parts
    # (cluster_gemm.MAX_LN_PARTS). The key judges that on the shape (tuner.layer.ln_parts: the parts the layer's
    # buffer holds): the kernels it names, and configurations that hash alike, must be what the stack's launches do.
    # The producer split (12 / 16 parts) or unsplit in 32- or 16-column tiles (24 / 32 on bert-base, 32 / 64 on
    # bert-large: 32 is the most the cluster kernel reads). Recorded, not run, with PDL as on Hopper, over group_m, the
    # L2 hints and a sweep of ratios; QKV under fuse 2 as the first layer and as the later ones launch it.
    import itertools

    import torch
    from devices import H200

    from tuner.kernels import cluster_gemm
    from tuner.kernels import gemm as gemm_k
    from tuner.layer import _gemm_kernels, ln_parts, repair_config

    launched = _record_gemm_launches(monkeypatch)
    shape = PRESETS[name]
    seed = hand_picked_cluster(shape)
    norm, producer = ("norm2", "out") if gemm == "ffn1" else ("norm1", "ffn2")
    cfg = replace(seed, **{gemm: replace(getattr(seed, gemm), cluster=2, split_k=2, fuse=0),
                           norm: replace(getattr(seed, norm), fuse=norm_fuse)})
    if producer_tiles:
        cfg = replace(cfg, **{producer: replace(getattr(cfg, producer), cluster=0, split_k=1, block_n=producer_tiles)})
    cfg = repair_config(cfg, shape, 2, H200)
    c0 = getattr(cfg, gemm)
    assert getattr(cfg, norm).fuse == norm_fuse and c0.cluster == 2 and not c0.fuse and not cfg.ffn2.fuse
    assert producer_tiles is None or getattr(cfg, producer).block_n == producer_tiles
    parts = ln_parts(shape, cfg).get(gemm, 0)
    m, k, n = shape.tokens, shape.d_model, shape.gemms()[gemm][1]
    x, w, b, u, out = (torch.randn(*s).half() for s in ((m, k), (n, k), (n,), (n,), (m, n)))
    u = u.float()
    # the layers' launches: QKV under fuse 2 without row sums (the first layer) and with them (the later ones)
    stats = torch.zeros(parts, m, 2)
    layers = [None] if norm_fuse == 1 else [stats] if gemm == "ffn1" else [None, stats]
    ws = torch.empty(gemm_k.workspace_numel(c0, m, n))
    ratios = (-1.0, 0.0, 0.4, 1.0)
    configs = [replace(cfg, **{gemm: replace(c0, overlap_ratio=o, prefetch_ratio=p, group_m=g, hints=h)})
               for o, p, g, h in itertools.product(ratios, ratios, (1, 8), (0, 1))]
    calls = []
    for c in configs:
        launched.clear()
        for ln_stats in layers:
            gemm_k.linear(x, w, b, config=getattr(c, gemm), out=out, workspace=ws, ln_colsum=u, ln_stats=ln_stats)
        calls.append(list(launched))
    kernels = {"gemm": "triton", "reduce": "triton", "cluster": "cluster"}
    ran = {kernels[kind] for kind, *_ in calls[0]}
    assert set(_gemm_kernels(cfg, gemm, shape)) == ran
    assert ran == ({"triton"} if norm_fuse == 1 or parts > cluster_gemm.MAX_LN_PARTS
                   else {"triton", "cluster"} if gemm == "qkv" else {"cluster"})

    hashes = [config_hash(c, shape) for c in configs]
    for i, j in itertools.combinations(range(len(configs)), 2):
        assert (hashes[i] == hashes[j]) == _launches_alike(calls[i], calls[j]), (getattr(configs[i], gemm),
                                                                                getattr(configs[j], gemm))
    # group_m 1 and 8: the cluster kernel's tile order is fixed; L2 hints 0 and 1: the Triton kernels ignore them
    assert (hashes[0] == hashes[2]) == (ran == {"cluster"}) and (hashes[0] == hashes[1]) == (ran == {"triton"})


def _record_kernel_launches(monkeypatch, module, kernel: str) -> list:
    """``module.<kernel>``'s launches recorded, not run (on the CPU, with PDL and prefetch as on Hopper): the list each
    launch appends (grid, args, meta) to; the caller clears it between configs (:func:`_one_launch` reads it)."""
    from tuner.kernels import _common

    launched = []

    class Recorder:  # a Triton kernel: kernel[grid](*args, **meta)
        def __getitem__(self, grid):
            return lambda *a, **kw: launched.append((grid, a, kw))

    hopper = _common.LaunchMode(pdl=True, prefetch=True, upcast_bf16=False)
    for m in (_common, module):
        if hasattr(m, "launch_mode"):
            monkeypatch.setattr(m, "launch_mode", lambda t: hopper)
    monkeypatch.setattr(module, kernel, Recorder())
    return launched


def _one_launch(launched: list) -> tuple:
    """The one launch recorded (:func:`_record_kernel_launches`): its grid, non-tensor arguments and meta-parameters."""
    import torch

    (grid, a, kw), = launched
    return grid, tuple(v for v in a if not torch.is_tensor(v)), kw


@pytest.mark.parametrize("name", ["tiny", "bert-base"])
def test_the_one_kernel_layers_launch_key_is_equal_where_the_launches_are(name, monkeypatch):
    # The Triton layer kernel (layer.fuse 1) reads its ratios as a trigger phase and each weight's prefetched lines
    # (fused_layer.launch_knobs); the key holds both element sizes, as the norms' does. Configurations must hash alike
    # exactly where fused_layer.decoder_layer launches them alike in fp16 and in fp32 (overlap 0 and 0.2 both trigger
    # after phase 1; prefetch -1 and 0 both take no line). Recorded, not run, with PDL as on Hopper.
    import itertools

    import torch

    from tuner.bench import hand_picked_fused
    from tuner.kernels import fused_layer as fused_k
    from tuner.layer import LayerWeights, layer_problem
    from tuner.study import config_hash

    launched = _record_kernel_launches(monkeypatch, fused_k, "_layer_kernel")
    shape = PRESETS[name]
    cfg = hand_picked_fused(shape)
    assert cfg.layer.fuse == 1
    ratios = (-1.0, 0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    configs = [replace(cfg.layer, overlap_ratio=o, prefetch_ratio=p) for o, p in itertools.product(ratios, ratios)]

    def launches(dtype):
        w = LayerWeights.random(shape, dtype, "cpu", torch.Generator().manual_seed(0)).fused()
        x = torch.randn(shape.tokens, shape.d_model).to(dtype)
        scratch = fused_k.LayerScratch(cfg.layer, layer_problem(shape, x.element_size()), dtype, "cpu")
        calls = []
        for c in configs:
            launched.clear()
            fused_k.decoder_layer(x, w, seq=shape.seq, heads=shape.heads, config=c, scratch=scratch,
                                  out=torch.empty_like(x))
            calls.append(_one_launch(launched))
        return calls

    half, single = launches(torch.float16), launches(torch.float32)
    hashes = [config_hash(replace(cfg, layer=c), shape) for c in configs]
    merged = 0
    for i, j in itertools.combinations(range(len(configs)), 2):
        alike = half[i] == half[j] and single[i] == single[j]
        assert (hashes[i] == hashes[j]) == alike, (configs[i], configs[j])
        merged += alike
    # overlap {0, 0.2} x prefetch {-1, 0} launch alike (6 pairs), overlap 0 and 0.2 at each other prefetch (5) and
    # prefetch -1 and 0 at each other overlap (5)
    assert merged == 6 + 5 + 5


@pytest.mark.parametrize("name", ["tiny", "bert-base"])
def test_the_norms_launch_key_is_equal_where_the_launches_are(name, monkeypatch):
    # A norm kernel's ratios are keyed by its trigger row and prefetch lines (norm.launch_knobs). The key does not know
    # the layer's dtype, and a weight vector in fp32 has twice the lines: configurations must hash alike exactly where
    # norm.layer_norm launches them alike in fp16 and in fp32. Recorded, not run, with PDL as on Hopper, over a sweep
    # of ratios and rows a program (1 row: every ratio in [0, 1] triggers at the start). tiny's 256 columns are 4
    # lines in fp16, where prefetch 0.8 and 1.0 take all 4, and 8 in fp32, where they do not.
    import itertools

    import torch

    from tuner.kernels import norm as norm_k
    from tuner.study import config_hash

    launched = _record_kernel_launches(monkeypatch, norm_k, "_norm_kernel")
    shape = PRESETS[name]
    cfg = default_config(shape)
    assert cfg.norm1.fuse == 0 and cfg.norm2.fuse == 0  # both norm kernels launch
    ratios = (-1.0, 0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    configs = [replace(cfg.norm2, overlap_ratio=o, prefetch_ratio=p, rows_per_program=r)
               for o, p, r in itertools.product(ratios, ratios, (1, 2, 4))]

    def launches(dtype):
        d = shape.d_model
        x, w, b, out = (torch.randn(*s).to(dtype) for s in ((128, d), (d,), (d,), (128, d)))
        calls = []
        for c in configs:
            launched.clear()
            norm_k.layer_norm(x, w, b, config=c, out=out)
            calls.append(_one_launch(launched))
        return calls

    half, single = launches(torch.float16), launches(torch.float32)
    hashes = [config_hash(replace(cfg, norm2=c), shape) for c in configs]
    merged = apart_in_fp32 = 0
    for i, j in itertools.combinations(range(len(configs)), 2):
        assert (hashes[i] == hashes[j]) == (half[i] == half[j] and single[i] == single[j]), (configs[i], configs[j])
        merged += hashes[i] == hashes[j]
        apart_in_fp32 += half[i] == half[j] and single[i] != single[j]
    assert merged > len(configs)  # (rows_per_program 1's ratios, and prefetch 0 beside -1)
    assert bool(apart_in_fp32) == (name == "tiny")
    assert config_hash(replace(cfg, norm1=configs[10]), shape) != config_hash(cfg, shape)


def test_the_attentions_launch_key_is_its_trigger_blocks():
    # The attention kernel's overlap ratio is keyed by the KV blocks its programs trigger after
    # (attention.launch_knobs, checked against the kernel's own fp32 arithmetic in tests/test_attention.py)
    import itertools

    from tuner.kernels import attention as attn_k
    from tuner.study import config_hash

    cfg = default_config(BERT_BASE)
    assert cfg.qkv.fuse == 0 and cfg.attn.fuse == 0  # the attention kernel launches
    ratios = (-1.0, 0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    configs = [replace(cfg.attn, overlap_ratio=o, block_n=n) for o, n in itertools.product(ratios, (16, 64, 128))]
    hashes = [config_hash(replace(cfg, attn=c), BERT_BASE) for c in configs]
    for i, j in itertools.combinations(range(len(configs)), 2):
        a, b = configs[i], configs[j]
        launch_alike = a.block_n == b.block_n and attn_k.launch_knobs(a, 128) == attn_k.launch_knobs(b, 128)
        assert (hashes[i] == hashes[j]) == launch_alike, (a, b)
    # 128-wide KV blocks: one a program, so every ratio in [0, 1] triggers at the start; 16-wide: each its own
    assert len({h for h, c in zip(hashes, configs) if c.block_n == 128}) == 2
    assert len({h for h, c in zip(hashes, configs) if c.block_n == 16}) == len(ratios)


def test_local_step_moves_what_the_launches_read():
    # tiny's studies of sessions 29 and 35 spent 7-8 of their ~48 measurements on local steps that moved only FFN1's
    # tiles under the one-kernel feed-forward block, which reads none of them
    import numpy as np
    from devices import H200

    from tuner.layer import repair_config
    from tuner.study import config_hash, local_step, neighbour

    tiny = PRESETS["tiny"]
    sp = space.load()
    params = space.from_config(hand_picked_cluster(tiny))

    def repaired(p):
        return repair_config(space.to_config(p), tiny, 2, H200)

    here = config_hash(repaired(params), tiny)
    plain = [neighbour(params, sp, True, np.random.default_rng(seed)) for seed in range(200)]
    tile = {f"ffn1.{f}" for f in ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages", "split_k")}
    ffn1_tiles = [p for p in plain if set() < {k for k in p if p[k] != params[k]} <= tile]
    assert ffn1_tiles and all(config_hash(repaired(p), tiny) == here for p in ffn1_tiles)  # what the retry is for
    for seed in range(200):
        p = local_step(params, sp, True, np.random.default_rng(seed), repaired, tiny)
        assert p is not None and config_hash(repaired(p), tiny) != here, seed


def test_neighbour_leaves_the_kernels_not_launched_alone_but_their_switch():
    import numpy as np

    from tuner.study import neighbour

    sp = space.load()
    params = space.from_config(hand_picked_cluster(BERT_BASE))
    idle = {"norm1", "norm2", "attn"}
    moved = set()
    for seed in range(400):
        p = neighbour(params, sp, True, np.random.default_rng(seed), idle)
        moved |= {k for k in p if p[k] != params[k]}
    assert moved & {"norm1.fuse", "norm2.fuse", "attn.fuse"}  # switching a fused kernel back on is a step
    assert not {k for k in moved if k.split(".")[0] in idle and not k.endswith(".fuse")}, moved
    assert {k.split(".")[0] for k in moved} >= {"qkv", "out", "ffn1", "ffn2"}
    unfiltered = set()
    for seed in range(400):
        p = neighbour(params, sp, True, np.random.default_rng(seed))
        unfiltered |= {k for k in p if p[k] != params[k]}
    assert {"attn.block_m", "norm1.num_warps"} <= unfiltered  # without idle every parameter may move


def test_tpe_queues_neighbours_of_the_best(tmp_path, replay):
    folder = run(tmp_path, replay, trials=14)
    trials = pd.read_csv(folder / "trials.csv")
    assert len(trials) == 14  # the budget holds: a neighbour is queued only while it has room
    parents = trials["neighbour_of"].dropna()
    assert len(parents) >= 2 and set(parents.astype(int)) <= set(trials["number"])
    off = pd.read_csv(run(tmp_path / "off", replay, trials=8, local_every=0) / "trials.csv")
    assert off["neighbour_of"].isna().all()


def test_the_best_trials_knobs_off_twin_is_the_budgets_last_trial(tmp_path, replay):
    # 1x128x4096x32x11008 on an H200 (perf notes 37): a top-1 at 178 us whose twin with every pair at (-1, -1)
    # measured 154 in the final phase. The study measures the twin of its best trial as its last trial, through the
    # same gate, so the top-k re-measure can rank it.
    folder = run(tmp_path, replay, trials=6)
    trials = pd.read_csv(folder / "trials.csv")
    assert len(trials) == 6  # the budget holds
    twin = trials.dropna(subset=["knobs_off_of"])
    assert len(twin) == 1 and twin["number"].item() == trials["number"].max()
    parent = trials[trials["number"] == int(twin["knobs_off_of"].item())]
    ratios = [c for c in trials.columns if c.endswith(("overlap_ratio", "prefetch_ratio"))]
    assert (twin[ratios] == -1.0).all(axis=None)
    assert not (parent[ratios] == -1.0).all(axis=None)  # the parent used the knobs
    tiles = [c for c in trials.columns if "." in c and c not in ratios]
    assert (twin[tiles].to_numpy() == parent[tiles].to_numpy()).all()
    # the parent was the best trial before the twin
    assert parent["latency_us"].item() == trials[trials["number"] < twin["number"].item()]["latency_us"].min()
    # With 9 trials the seeds include that twin (the hand-picked tiles without knobs): the slot goes to the search.
    trials = pd.read_csv(run(tmp_path / "nine", replay, trials=9) / "trials.csv")
    assert len(trials) == 9 and trials["knobs_off_of"].isna().all()


def test_no_twin_without_the_ratios_off_and_the_slot_goes_to_the_search(tmp_path, replay):
    data = copy.deepcopy(default_data())
    data["ratios"] = {"overlap": [0.0, 0.2], "prefetch": [0.0, 1.0]}  # no -1.0: the twin is outside the space
    folder = run(tmp_path, replay, space.parse(data, "no-off space"), trials=5)
    trials = pd.read_csv(folder / "trials.csv")
    assert len(trials) == 5 and trials["knobs_off_of"].isna().all()


def test_many_tokens_get_their_own_seed_and_big_weights_a_smaller_prefetch():
    from devices import H200

    from tuner.bench import MANY_TOKENS, fit_prefetch, hand_picked_many
    from tuner.shapes import resolve

    many = resolve("4x512x768x12x3072")
    assert many.tokens >= MANY_TOKENS > BERT_BASE.tokens
    cfg = hand_picked_many(many)
    assert not check_config(cfg, many, 2, H200)  # (no kernel's config is invalid)
    assert (cfg.ffn1.block_m, cfg.ffn1.block_n, cfg.ffn1.num_warps) == (128, 128, 8)
    assert all(c.overlap_ratio == -1.0 and c.prefetch_ratio == -1.0 for _, c in cfg.kernels())
    # fit_prefetch: at most half the L2 (60 MB) a kernel; bert-base's weights (4.7 MB at most) keep 1.0
    big = resolve("1x128x4096x32x11008")
    fitted = fit_prefetch(hand_picked(big), big, H200.l2_bytes)
    assert [getattr(fitted, g).prefetch_ratio for g in ("qkv", "out", "ffn1", "ffn2")] == [0.2, 0.8, 0.2, 0.2]
    assert fit_prefetch(hand_picked(BERT_BASE), BERT_BASE, H200.l2_bytes) == hand_picked(BERT_BASE)
    assert fit_prefetch(hand_picked(big), big, None) == hand_picked(big)
    assert fit_prefetch(default_config(big), big, H200.l2_bytes) == default_config(big)  # no prefetch stays none
    assert fit_prefetch(hand_picked_fused(big), big, H200.l2_bytes).layer.prefetch_ratio == 0.0


def test_wide_layers_get_wide_tiles_where_they_fill_one_wave():
    from devices import H200

    from tuner.bench import hand_picked_wide
    from tuner.kernels.gemm import grid
    from tuner.shapes import resolve

    wide = resolve("1x128x4096x32x11008")
    cfg = hand_picked_wide(wide, H200.num_sms)
    assert not check_config(cfg, wide, 2, H200)
    tiles = {g: (c.block_m, c.block_n, c.num_warps, c.split_k) for g, c in
             (("qkv", cfg.qkv), ("out", cfg.out), ("ffn1", cfg.ffn1), ("ffn2", cfg.ffn2))}
    # (perf notes 37.5, H200: QKV and FFN1 alone within 6-12% of cuBLAS; the out-projection and FFN2 have no unsplit
    # wide tiles that fill 60% of a wave, and keep hand_picked's)
    hp = hand_picked(wide)
    assert tiles == {"qkv": (128, 128, 8, 1), "out": (hp.out.block_m, hp.out.block_n, hp.out.num_warps, hp.out.split_k),
                     "ffn1": (128, 128, 8, 1),
                     "ffn2": (hp.ffn2.block_m, hp.ffn2.block_n, hp.ffn2.num_warps, hp.ffn2.split_k)}
    for g in ("qkv", "ffn1"):
        m, n, _ = wide.gemms()[g]
        t, sp = grid(getattr(cfg, g), m, n)
        assert 0.6 * H200.num_sms <= t * sp <= H200.num_sms
    assert cfg.norm1.fuse == cfg.norm2.fuse == 0  # the norm kernels (folded: +33 us a layer there)
    assert cfg.qkv.overlap_ratio == 0.0 and cfg.qkv.prefetch_ratio == 1.0  # (the study caps it: fit_prefetch)
    for name in ("tiny", "bert-base", "bert-large"):  # too narrow for wide tiles in one wave
        assert hand_picked_wide(PRESETS[name], H200.num_sms) is None
    assert hand_picked_wide(resolve("4x512x768x12x3072"), H200.num_sms) is None  # many tokens: hand_picked_many


def _one_set_of_launches() -> space.SearchSpace:
    data = copy.deepcopy(default_data())
    data["ratios"] = {"overlap": [0.0], "prefetch": [1.0]}
    for fam in ("gemm", "norm", "attn", "layer"):
        data[fam] = {f: [v[0]] for f, v in data[fam].items()}
    data["kernels"] = {"layer": {"num_warps": [4, 8], "block_k": [64, 128]}}  # four points, one set of launches
    data["layer"]["fuse"] = [0]
    return space.parse(data, "one set of launches")


def test_configurations_that_launch_the_same_are_measured_once(tmp_path, replay):
    # The one-kernel layer's fields are read only where it is on: with it off, trials that differ in them alone
    # launch the same kernels, and only the first is measured.
    folder = run(tmp_path, replay, _one_set_of_launches(), trials=8, sampler="random")
    trials = pd.read_csv(folder / "trials.csv")
    assert "crashed" not in set(trials["status"])
    measured = trials[trials["duplicate_of"].isna() & ~trials["is_baseline"]]
    assert len(measured) <= 2, measured  # the space's one set of launches (and the knobs-off twin of the best)
    assert len(trials[trials["duplicate_of"].notna()]) >= 4
    topk = pd.read_csv(folder / "topk.csv")
    assert len(topk) == len(trials[trials["duplicate_of"].isna()].drop_duplicates(
        subset=[c for c in trials.columns if "." in c])), topk  # one row a set of launches


def test_a_study_continued_from_an_older_hash_merges_what_launches_the_same(tmp_path, replay, monkeypatch):
    # A study begun before 1fc3600 stored hashes of the whole configuration, fields no launch reads included. The
    # continued study recomputes them from the stored configurations: it measures none of the four points again.
    import hashlib

    from tuner import study as study_mod

    real = study_mod.config_hash
    monkeypatch.setattr(study_mod, "config_hash", lambda cfg, shape=None: hashlib.sha1(
        json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:12])
    run(tmp_path, replay, _one_set_of_launches(), study_name="old", trials=6, sampler="random", seed=3)
    before = load_study(tmp_path, "old").trials
    measured = [t for t in before if "duplicate_of" not in t.user_attrs and not t.user_attrs.get("is_baseline")
                and t.user_attrs.get("knobs_off_of") is None]
    monkeypatch.setattr(study_mod, "config_hash", real)
    assert len({study_mod.stored_hash(t, BERT_BASE) for t in measured}) < len(measured)  # one set measured twice
    assert all(study_mod.stored_hash(t, BERT_BASE) == real(DecoderConfig.from_dict(t.user_attrs["config"]), BERT_BASE)
               for t in before)
    run(tmp_path, replay, _one_set_of_launches(), study_name="old", trials=9, sampler="random", seed=4)
    new = [t for t in load_study(tmp_path, "old").trials if t.number >= len(before)]
    assert new and all("duplicate_of" in t.user_attrs for t in new), [(t.number, t.user_attrs) for t in new]


def test_a_duplicate_of_this_process_reuses_its_measurement(tmp_path, replay):
    # Regression (H200 run of 2026-11-22, results/*/20261122-02*): a neighbour that repaired to a config
    # this process had measured read .value from the live trial and was marked crashed.
    data = copy.deepcopy(default_data())
    data["kernels"] = {}
    data["ratios"] = {"overlap": [0.0], "prefetch": [1.0]}
    for fam in ("gemm", "norm", "attn", "layer"):
        data[fam] = {f: [v[0]] for f, v in data[fam].items()}
    data["kernels"] = {"qkv": {"block_k": [32, 64]}}  # two configs, eight trials: duplicates in this process
    sp = space.parse(data, "two configs")
    lines = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folder = run(tmp_path, replay, sp, log=lines.append, trials=8, sampler="random")
    # Optuna's importance caveat on so few distinct trials goes to the run's log as one line, not to the terminal
    # as a UserWarning with its source line.
    assert not [w for w in caught if "importance" in str(w.filename)], [str(w.message) for w in caught]
    assert any(line.startswith("parameter importance: ") for line in lines), lines
    trials = pd.read_csv(folder / "trials.csv")
    assert "crashed" not in set(trials["status"]), trials[["number", "status", "reason"]]
    dups = trials[trials["duplicate_of"].notna()]
    assert len(dups) >= 4
    for _, d in dups.iterrows():
        src = trials.set_index("number").loc[int(d["duplicate_of"])]
        assert d["status"] == src["status"] and (d["latency_us"] == src["latency_us"] or d["status"] != "ok")


# ------------------------------------------------------------------------------------------------
# What a trial measures: its params repaired for the evaluator's dtype, device and shape
# ------------------------------------------------------------------------------------------------

def test_trials_are_repaired_for_the_evaluators_dtype():
    """An fp32 study repairs its trials for 4-byte operands (``_repairer`` reads the evaluator's ``dtype_name``): the
    clustered seed's 16-bit-only switches go off and its stages fit. (The supervised worker, the GPU's default
    evaluator, did not pass its dtype on, so its fp32 studies were repaired as fp16 and such trials failed as
    invalid: test_isolation's test_the_interface_is_forwarded checks that the worker forwards ``dtype_name``.)"""
    from types import SimpleNamespace

    from devices import H100  # (tests/ is on sys.path under pytest)

    tiny = PRESETS["tiny"]
    params = space.from_config(hand_picked_cluster(tiny))
    for dtype, size in (("float32", 4), ("float16", 2)):
        ev = SimpleNamespace(dtype_name=dtype, replayed=False, device=H100)
        assert check_config(_repairer(tiny, ev)(params), tiny, size, H100) == {}
    fp16_repair = _repairer(tiny, SimpleNamespace(dtype_name="float16", replayed=False, device=H100))(params)
    assert check_config(fp16_repair, tiny, 4, H100)  # (what an fp32 study measured before)


@pytest.mark.parametrize("spec", ["1x4x64x2x128", "1x1x32x1x32", "1x3x96x1x40"])
def test_a_norm_takes_no_more_rows_a_program_than_the_layer_has(spec):
    """Shapes of fewer than 8 tokens: a sampled rows_per_program past the rows is fitted, not left to fail the check
    (a quarter to three quarters of the default space's draws did)."""
    from devices import H100
    from tuner.layer import repair_config
    from tuner.shapes import parse_spec

    shape = parse_spec(spec)
    cfg = DecoderConfig(norm1=NormConfig(rows_per_program=8), norm2=NormConfig(rows_per_program=16))
    assert check_config(repair_config(cfg, shape, 2, H100), shape, 2, H100) == {}


@pytest.mark.parametrize("space_name", ["decoder", "fused-layer"])
@pytest.mark.parametrize("dtype_bytes, gpu", [(4, "H100"), (2, "A100")])
def test_what_the_space_samples_is_repaired_into_a_config_that_runs(space_name, dtype_bytes, gpu):
    """Draws of a shipped space, repaired for the dtype and the GPU, pass the check: fp32 on Hopper (a quarter to
    almost half of its draws failed: GEMM tiles over the shared memory at one stage, the one-kernel layer fitted for
    2-byte operands, the attention's stages never repaired) and fp16 on an A100 (the one-kernel layer fitted to the
    Hopper's shared memory). Odd shapes too; 40 draws each."""
    import devices
    from tuner.layer import repair_config
    from tuner.shapes import parse_spec
    from tuner.space import suggest, to_config

    device = getattr(devices, gpu)
    sp = space.load(space_name)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=7))
    for spec in ("tiny", "bert-large", "1x17x64x2x96", "1x128x4096x32x11008"):
        shape = PRESETS.get(spec) or parse_spec(spec)
        for _ in range(40):
            cfg = repair_config(to_config(suggest(study.ask(), sp, pdl=device.capability[0] >= 9)), shape,
                                dtype_bytes, device)
            assert check_config(cfg, shape, dtype_bytes, device) == {}, (spec, cfg)


def test_the_cuda_layer_kernels_space_starts_from_its_seed(tmp_path, replay):
    """search_spaces/layer-kernel.yaml holds none of the per-kernel seeds: its first trial is the CUDA layer kernel's
    hand-picked config (before, the study began from random draws), and the seeds outside it take no trial."""
    from tuner.bench import fit_prefetch
    from tuner.study import open_study

    study = open_study(BERT_BASE, replay, space.load("layer-kernel"), opts(trials=6), tmp_path, log=lambda *a: None)
    waiting = [t.system_attrs["fixed_params"] for t in study.get_trials(deepcopy=False)
               if t.state == optuna.trial.TrialState.WAITING]
    seed = fit_prefetch(hand_picked_fused(BERT_BASE, cuda=True), BERT_BASE, replay.manifest["gpu"].get("l2_bytes"))
    assert [p["layer.fuse"] for p in waiting] == [2]
    assert {k: v for k, v in waiting[0].items() if k.startswith("layer.")} == {
        k: v for k, v in space.from_config(seed).items() if k.startswith("layer.")}


@pytest.mark.parametrize("spec, words", [
    ("1x17x64x2x96", "head dim 32"), ("1x256x768x12x3072", "seq=256 > 128"), ("2x48x768x12x3072", "multiple of 64"),
])
def test_a_space_no_configuration_of_which_runs_the_shape_is_refused(spec, words):
    """layer-kernel.yaml on a shape the CUDA layer kernel does not take: refused before the study, in one line, rather
    than every trial failing as invalid."""
    from tuner.shapes import parse_spec
    from tuner.study import _space_cannot_run

    shape = parse_spec(spec)
    why = _space_cannot_run(shape, space.load("layer-kernel"), pdl=True)
    assert words in why and "layer.fuse 2" in why
    assert _space_cannot_run(shape, space.load(), pdl=True) is None  # the default space has kernels that run it
    assert "Hopper" in _space_cannot_run(BERT_BASE, space.load("layer-kernel"), pdl=False)
    assert _space_cannot_run(BERT_BASE, space.load("layer-kernel"), pdl=True) is None


def test_a_config_is_benched_as_this_dtype_and_gpu_can_run_it():
    """`tune bench --config` repairs a best.json for the bench's dtype and GPU and says so in the row's name (an fp16
    run's clusters and fused attention in fp32 raised a traceback); the run of record's best.json benched as tuned
    (fp16, H200) is left as it is."""
    import tuner
    from devices import H200
    from tuner.bench import as_run_here

    base = PRESETS["bert-base"]
    cfg = hand_picked_cluster(base)  # clusters and the attention in QKV's kernel: 16-bit operands only
    assert check_config(cfg, base, 4, H200)
    fixed, note = as_run_here(cfg, base, 4, H200)
    assert check_config(fixed, base, 4, H200) == {} and "4-byte operands" in note and "qkv" in note
    root = Path(__file__).resolve().parents[1] / "results"
    for run in ("tiny/20261127-044730-tpe", "bert-base/20261127-045004-tpe", "bert-large/20261127-045233-tpe"):
        best = tuner.load_config(root / run / "best.json", gpu="NVIDIA H200")
        shape = PRESETS[run.split("/")[0]]
        assert as_run_here(best, shape, 2, H200) == (best, ""), run


# ------------------------------------------------------------------------------------------------
# The final re-check of the top-k
# ------------------------------------------------------------------------------------------------

class _RecheckedReplay(ReplayEvaluator):
    """The recording's timings, with the final phase's re-check answered per config: the study's handling of a
    top-k config that fails it (on a GPU, GpuEvaluator.recheck runs the checks; tests/test_layer.py)."""

    def __init__(self, path, fails):
        from tuner.device import DeviceInfo

        super().__init__(path)
        self.fails, self.asked = fails, []
        self.replayed = False  # (so that the study asks: a replay is never re-checked)
        g = self.manifest["gpu"]  # (an older manifest's names)
        self.device = DeviceInfo(g["name"], tuple(g["capability"]), g["sms"], g["l2_bytes"], 232448)

    def recheck(self, cfg, checks=5):
        self.asked.append(cfg)
        if cfg in self.fails:
            if self.fails[cfg] == "raise":
                raise RuntimeError("the launch failed")
            return self.fails[cfg]
        return None


def test_a_top_config_that_fails_its_recheck_is_left_out(tmp_path, replay):
    replayed = run(tmp_path / "r", replay, top_k=3)
    assert json.loads((replayed / "topk.json").read_text())["recheck"] == {"checks": 0, "failed": []}  # a replay
    assert "not re-checked (replayed)" in (replayed / "topk.md").read_text()
    clean = run(tmp_path / "a", _RecheckedReplay(REPLAY, {}), top_k=3)  # (its rows are its trials' configurations)
    first = json.loads((clean / "topk.json").read_text())["rows"]
    top1, top2 = (DecoderConfig.from_dict(r["config"]) for r in first[:2])
    ev = _RecheckedReplay(REPLAY, {top1: "rel. error inf > 0.01 in check 3 of 5", top2: "raise"})
    got = run(tmp_path / "b", ev, top_k=3)
    topk = json.loads((got / "topk.json").read_text())
    assert [r["trial"] for r in topk["rows"]][:1] == [first[2]["trial"]]  # the third is now the top-1
    assert len(topk["rows"]) == 3 and len(ev.asked) == 5  # two more asked to fill the top-3
    assert topk["recheck"]["checks"] == 5
    assert [f["trial"] for f in topk["recheck"]["failed"]] == [first[0]["trial"], first[1]["trial"]]
    assert "RuntimeError: the launch failed" in topk["recheck"]["failed"][1]["reason"]
    trials = pd.read_csv(got / "trials.csv").set_index("number")
    for f in topk["recheck"]["failed"]:
        assert trials.loc[f["trial"], "status"] == "incorrect"
        assert trials.loc[f["trial"], "reason"].startswith("failed the final re-check: ")
    assert json.loads((got / "best.json").read_text())["config"] == topk["rows"][0]["config"]
    md = (got / "topk.md").read_text()
    assert f"trial {first[0]['trial']} failed (rel. error inf > 0.01 in check 3 of 5) and is left out" in md


def test_a_breakdown_beyond_the_gpus_memory_is_one_line_and_the_run_is_written(tmp_path, monkeypatch, replay):
    # 4096x16x512x16x512 on the H200 (session 46): a kernel's cold stack, hundreds of layers each with its
    # activations, ran out of memory; the run is written without breakdown.json, and the log says why in one line
    from tuner.worker import WorkerError

    ev = replay

    def breakdown(cfg):
        raise WorkerError("OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has ...")

    monkeypatch.setattr(ev, "breakdown", breakdown)
    logged = []
    out = run(tmp_path, ev, log=logged.append)
    assert (out / "best.json").is_file() and not (out / "breakdown.json").exists()
    [line] = [m for m in logged if "breakdown" in m]
    assert "no per-kernel breakdown" in line and "does not fit the GPU's memory" in line and "MiB" not in line


def test_the_first_layers_attention_is_read_under_qkv_fuse():
    # With qkv.fuse 1 and norm1.fuse 2 the stack's first layer runs QKV and the attention kernel apart, on attn's
    # tiles: a seed's attention fields are read there (launched_config keeps them) and are not rewritten (review)
    from tuner.bench import hand_picked
    from tuner.study import _unread_params

    hp = hand_picked(PRESETS["bert-base"])
    cfg = replace(hp, qkv=replace(hp.qkv, fuse=1), norm1=replace(hp.norm1, fuse=2))
    unread = _unread_params(cfg)
    assert not unread("attn.block_m") and not unread("qkv.block_m") and unread("layer.attn_block_n")
    assert unread("norm1.rows_per_program") and not unread("norm1.fuse")
    no_first = replace(cfg, norm1=replace(cfg.norm1, fuse=0))  # (norm1 unfused: every layer runs qkv_attn)
    assert unread("attn.block_m") is False and _unread_params(no_first)("attn.block_m")


def test_the_manifests_gpu_is_the_model_that_measured():
    # --gpus 2,3 on a host whose GPU 0 is another model: the manifest's gpu named GPU 0 until session 47
    from tuner.study import measuring_gpu

    h200 = {"name": "NVIDIA H200", "capability": [9, 0], "num_sms": 132, "l2_bytes": 62914560,
            "smem_per_block_bytes": 232448, "nvcc": True}
    first = {"name": "NVIDIA H200", "capability": [9, 0], "sms": 132, "l2_bytes": 62914560, "memory_bytes": 1}
    assert measuring_gpu(first, h200) is first
    other = dict(first, name="NVIDIA A100-SXM4-80GB", capability=[8, 0], sms=108)
    assert measuring_gpu(other, h200) == {"name": "NVIDIA H200", "capability": [9, 0], "sms": 132,
                                          "l2_bytes": 62914560}
    assert measuring_gpu(None, h200)["name"] == "NVIDIA H200"
