"""tuner.worker: candidates run in a supervised worker process. A candidate that crashes, segfaults, hangs,
raises or computes wrong output fails only its own trial, with its status; the worker is replaced and the
study completes its budget.

Faults come from tuner.faults.FaultyEvaluator around the replay of the H200 recording (tests/data), so
every case runs on the CPU in a few seconds.
"""

from __future__ import annotations

import importlib.resources
import os
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tuner import faults, space
from tuner.bench import hand_picked
from tuner.evaluate import ReplayEvaluator
from tuner.layer import default_config
from tuner.shapes import PRESETS
from tuner.study import StudyOptions, run_study
from tuner.worker import EvaluatorSpec, IsolatedEvaluator, WorkerStartError

REPLAY = Path(__file__).parent / "data" / "replay-bert-base-h200"
BERT_BASE = PRESETS["bert-base"]
TIMEOUT_S = 3.0
BASE = default_config(BERT_BASE)  # recorded as ok, and matched by no rule below


def with_qkv(**kw):
    return replace(BASE, qkv=replace(BASE.qkv, **kw))


# (action, a config that triggers it, expected status, words in the reason, does the worker restart)
FAULTS = [
    ("crash", with_qkv(block_m=128), "crashed", ["worker died", "exit code 11"], True),
    ("segfault", with_qkv(block_m=32), "crashed", ["worker died", "SIGSEGV"], True),
    ("hang", with_qkv(block_m=16), "timeout", ["within 3 s", "killed"], True),
    ("raise", with_qkv(block_n=128), "crashed", ["RuntimeError", "injected fault"], True),
    ("compile_error", with_qkv(block_n=32), "compile_error", ["CompilationError"], False),
    ("incorrect", with_qkv(num_warps=8), "incorrect", ["wrong output"], False),
]
RULES = [
    {"match": {"qkv.block_m": 128}, "action": "crash"},
    {"match": {"qkv.block_m": 32}, "action": "segfault"},
    {"match": {"qkv.block_m": 16}, "action": "hang"},
    {"match": {"qkv.block_n": 128}, "action": "raise"},
    {"match": {"qkv.block_n": 32}, "action": "compile_error"},
    {"match": {"qkv.num_warps": 8}, "action": "incorrect"},
]


def faulty_spec(rules=RULES, sleep_s=0.0) -> EvaluatorSpec:
    return faults.wrap(EvaluatorSpec("replay", {"path": str(REPLAY)}), rules, sleep_s)


@pytest.fixture(scope="module")
def isolated():
    # No compile allowance on the first trial of a worker: every case here would wait for it.
    with IsolatedEvaluator(faulty_spec(), trial_timeout_s=TIMEOUT_S, first_trial_extra_s=0.0) as ev:
        yield ev


def test_fault_configs_are_valid_and_distinct():
    """Each fault config must reach its rule: valid for bert-base (an invalid one is refused first),
    and matched by exactly its own rule."""
    inner = ReplayEvaluator(REPLAY)
    ev = faults.FaultyEvaluator(faulty_spec().kwargs["inner"], RULES)
    for action, cfg, *_ in FAULTS:
        assert inner.invalid(cfg) is None, action
        assert ev.matching_action(cfg) == action
    assert ev.matching_action(BASE) is None


@pytest.mark.parametrize("action, cfg, status, words, restarts", FAULTS, ids=[f[0] for f in FAULTS])
def test_fault_fails_only_its_trial(isolated, action, cfg, status, words, restarts):
    starts = isolated.starts
    res = isolated.evaluate(cfg)
    assert res.status == status, res
    for w in words:
        assert w in res.reason, (w, res.reason)
    # The next candidate is measured as usual, by a fresh worker where the fault may have broken it.
    after = isolated.evaluate(BASE)
    assert after.status == "ok" and not after.approximated
    assert isolated.starts == starts + int(restarts)


def test_the_interface_is_forwarded(isolated):
    inner = ReplayEvaluator(REPLAY)
    assert (isolated.pdl, isolated.replayed, isolated.device_name) == (inner.pdl, True, "NVIDIA H200")
    assert isolated.shape == inner.shape and isolated.manifest == inner.manifest
    assert isolated.worker_pid != os.getpid()
    assert isolated.remeasure([BASE], rounds=2) == inner.remeasure([BASE], rounds=2)
    assert isolated.breakdown(BASE) == inner.breakdown(BASE)
    assert isolated.baselines(BASE) == inner.baselines(BASE)
    assert isolated.policy() == inner.policy()
    assert isolated.final_policy(40) == inner.final_policy(40)
    assert isolated.dtype_name == inner.dtype_name == "float16"  # (the study repairs its trials for it)
    bad = with_qkv(block_m=256, block_k=256, num_stages=6)
    assert isolated.invalid(bad) == inner.invalid(bad) and inner.invalid(bad)


def test_a_worker_that_cannot_start_says_why(tmp_path):
    with pytest.raises(WorkerStartError, match="needs trials.csv and manifest.json"):
        IsolatedEvaluator(EvaluatorSpec("replay", {"path": str(tmp_path)}))


def small_space() -> space.SearchSpace:
    """Only the tiles of bert-base's baseline and hand-picked configs (all valid, so faults are reached
    instead of refused as invalid), and every attention num_warps x num_stages pair for the rules."""
    data = yaml.safe_load(importlib.resources.files("tuner.search_spaces").joinpath("decoder.yaml").read_text())
    used = {}
    for cfg in (BASE, hand_picked(BERT_BASE)):
        for name, value in space.from_config(cfg, pdl=False).items():
            kernel, field = name.split(".", 1)
            used.setdefault((space.FAMILY[kernel], field), set()).add(value)
    for fam in ("gemm", "norm", "attn", "layer"):
        data[fam] = {field: sorted(used[(fam, field)]) for field in data[fam]}
    data["attn"].update(num_warps=[2, 4, 8], num_stages=[1, 2, 3])
    data["kernels"] = {}
    return space.parse(data, "small test space")


def test_study_with_faulty_candidates_completes_its_budget(tmp_path):
    """A random search in which candidates crash, hang or compute wrong output: every trial ends with
    its status, each crash or hang costs one worker restart, the budget is spent, the run folder written.
    (Random sampler, seed 5: the 12 trials hit each of the three rules.)"""
    rules = [{"match": {"attn.num_warps": 2, "attn.num_stages": 1}, "action": "crash"},
             {"match": {"attn.num_warps": 8, "attn.num_stages": 1}, "action": "hang"},
             {"match": {"attn.num_warps": 2, "attn.num_stages": 3}, "action": "incorrect"}]
    budget = 12
    opts = StudyOptions(trials=budget, sampler="random", seed=5, top_k=2, remeasure_rounds=2, progress=False)
    with IsolatedEvaluator(faulty_spec(rules), trial_timeout_s=TIMEOUT_S, first_trial_extra_s=0.0) as ev:
        run = run_study(ev.shape, ev, small_space(), opts, tmp_path, ["pytest"], log=lambda *a: None)
        restarts = ev.restarts
    trials = pd.read_csv(run / "trials.csv")
    assert len(trials) == budget
    counts = trials["status"].value_counts().to_dict()
    assert {"ok", "crashed", "timeout", "incorrect"} <= set(counts), counts
    assert restarts == counts["crashed"] + counts["timeout"]
    assert trials.loc[0, "status"] == "ok" and trials.loc[0, "is_baseline"]
    assert (run / "best.json").is_file() and (run / "topk.md").is_file()


def test_in_process_evaluator_that_raises_fails_its_trial(tmp_path):
    """Without isolation (--no-isolation, replay), an evaluator that raises still only fails its trial."""
    ev = faulty_spec([{"match": {"attn.num_warps": 2}, "action": "raise"}]).build()
    opts = StudyOptions(trials=10, sampler="random", seed=2, top_k=2, remeasure_rounds=2, progress=False)
    run = run_study(ev.shape, ev, small_space(), opts, tmp_path, ["pytest"], log=lambda *a: None)
    trials = pd.read_csv(run / "trials.csv")
    assert len(trials) == 10
    crashed = trials[trials["status"] == "crashed"]
    assert len(crashed) and crashed["reason"].str.contains("injected fault").all()
    # its row still has the parameters it was given (until session 46 they came only from the measured config,
    # which a trial whose evaluation raised never recorded: the columns were empty)
    assert (crashed["attn.num_warps"] == 2).all() and crashed["qkv.block_m"].notna().all()
    assert crashed["ffn2.split_k"].notna().all() and crashed["norm1.overlap_ratio"].notna().all()


def test_classify_maps_compiler_and_launcher_failures():
    from tuner.evaluate import classify

    OutOfResources = type("OutOfResources", (Exception,), {})
    PTXASError = type("PTXASError", (Exception,), {})
    assert classify(OutOfResources("out of resource: shared memory, Required: 278528"))[0] == "out_of_resources"
    assert classify(PTXASError("ptxas fatal"))[0] == "compile_error"
    assert classify(ValueError("linear: invalid GemmConfig for M=32 N=768 K=256: shared memory"))[0] == "invalid"
    assert classify(RuntimeError("CUDA error: an illegal memory access was encountered"))[0] == "crashed"
