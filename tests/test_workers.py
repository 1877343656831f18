"""Several study processes on one study (`tune decoder --workers N`, or the same command on several hosts):
the budget is the study's, so together they run exactly ``--trials`` trials, with no trial lost or run
twice; the parent counts every worker's trials and writes one run folder; a process on another GPU model
is refused. On the CPU the workers replay the H200 recording."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import optuna
import pandas as pd
import pytest
from optuna.trial import TrialState

from tuner import faults, space
from tuner.cli import main
from tuner.layer import default_config
from tuner.evaluate import ReplayEvaluator
from tuner.storage import OWNER_ATTR, open_storage, this_owner
from tuner.study import StudyError, StudyOptions, open_study, search, trial_status

REPLAY = Path(__file__).parent / "data" / "replay-bert-base-h200"
BUDGET = 16
OTHER_GPU = "NVIDIA H100 80GB HBM3"


def tune(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def load(url: str, name: str | None = None) -> optuna.Study:
    storage = open_storage(url)
    name = name or optuna.get_all_study_summaries(storage)[0].study_name
    return optuna.load_study(study_name=name, storage=storage)


def evaluated_trials(trials) -> list:
    return [t for t in trials if t.state.is_finished() and t.state != TrialState.PRUNED
            and trial_status(t) != "interrupted"]


def assert_budget_kept(trials, budget: int) -> None:
    """Exactly ``budget`` evaluated trials, numbered without gaps or repeats, none left running or queued;
    a trial left out because the budget was gone is marked so."""
    assert sorted(t.number for t in trials) == list(range(len(trials)))
    assert len(evaluated_trials(trials)) == budget
    assert not [t for t in trials if not t.state.is_finished()]
    assert all(t.user_attrs.get("surplus") for t in trials if t.state == TrialState.PRUNED)
    assert sum(bool(t.user_attrs.get("is_baseline")) for t in trials) == 1


def test_two_workers_share_the_budget(tmp_path, monkeypatch):
    # Each trial takes 0.3 s, and neither worker starts its first until both are there (however late a loaded
    # machine starts one), so that both take part.
    monkeypatch.setenv(faults.ENV, json.dumps({"sleep_s": 0.3, "barrier": {"dir": str(tmp_path / "barrier"),
                                                                           "parties": 2}}))
    out = tmp_path / "results"
    rc, stdout, stderr = tune("decoder", "--replay", REPLAY, "--workers", 2, "--trials", BUDGET, "--no-progress",
                              "--out", out)
    assert rc == 0, stderr[-3000:]
    assert (out / "studies.journal").is_file() and not (out / "studies.db").exists()  # journal by default
    trials = load(f"journal:{out / 'studies.journal'}").get_trials(deepcopy=False)
    assert_budget_kept(trials, BUDGET)
    pids = {t.user_attrs[OWNER_ATTR]["pid"] for t in evaluated_trials(trials)}
    assert len(pids) == 2 and os.getpid() not in pids, pids  # both workers ran trials, the parent none
    [run] = [p.parent for p in out.rglob("best.json")]
    table = pd.read_csv(run / "trials.csv")
    assert len(table) == BUDGET and set(table["worker_pid"]) == pids
    assert json.loads((run / "manifest.json").read_text())["workers"] == 2
    assert f"{BUDGET} trials in the study from 2 workers" in stdout


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_running_trials_of_other_workers_count_against_the_budget(tmp_path):
    """Two trials held RUNNING by another (live) worker: this process runs only the rest of the budget."""
    replay = ReplayEvaluator(REPLAY)
    opts = StudyOptions(trials=6, sampler="random", progress=False,
                        storage=f"sqlite:///{(tmp_path / 'studies.db').as_posix()}")
    study = open_study(replay.shape, replay, space.load(), opts, tmp_path, log=lambda *a: None)
    other = [study.ask() for _ in range(2)]
    for t in other:
        t.set_user_attr(OWNER_ATTR, this_owner())  # alive: not an orphan
    # (the whole budget: search alone would keep the last trial for the top-1's knobs-off twin)
    search(study, replay.shape, replay, space.load(), opts, log=lambda *a: None, budget=opts.trials)
    mine = [t for t in study.get_trials(deepcopy=False) if t.state.is_finished()]
    assert len(mine) == 4
    for t in other:  # the other worker finishes them
        t.set_user_attr("status", "ok")
        study.tell(t, 1.0)
    assert len(evaluated_trials(study.get_trials(deepcopy=False))) == 6


def test_a_trial_beyond_the_budget_is_left_out(tmp_path):
    """Budget 2, three trials queued (the first trial, the seeds capped at the budget less the slot kept for the
    knobs-off twin, and two more queued here): the third is picked up, found beyond the budget and pruned as
    surplus (what happens when several workers ask for the last slot at once)."""
    replay = ReplayEvaluator(REPLAY)
    opts = StudyOptions(trials=2, sampler="random", progress=False,
                        storage=f"sqlite:///{(tmp_path / 'studies.db').as_posix()}")
    study = open_study(replay.shape, replay, space.load(), opts, tmp_path, log=lambda *a: None)
    for _ in range(2):
        study.enqueue_trial(space.from_config(default_config(replay.shape)))
    search(study, replay.shape, replay, space.load(), opts, log=lambda *a: None, budget=opts.trials)
    trials = study.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.PRUNED]
    assert trials[2].user_attrs["surplus"] and len(evaluated_trials(trials)) == 2


class OnAnotherGpu:
    """The recording, as if this process ran on another GPU model."""

    device_name = OTHER_GPU

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("as_worker", [False, True], ids=["command", "worker"])
def test_a_process_on_another_gpu_model_refuses_to_join(tmp_path, as_worker):
    url = f"sqlite:///{(tmp_path / 'studies.db').as_posix()}"
    replay = ReplayEvaluator(REPLAY)
    opts = StudyOptions(storage=url, study_name="shared", progress=False)
    open_study(replay.shape, OnAnotherGpu(replay), space.load(), opts, tmp_path, log=lambda *a: None)
    queued = len(load(url, "shared").trials)  # the first trials its creator queued (the seeds)
    assert queued >= 6
    extra = ["--search-only", "--worker-index", 1] if as_worker else []
    rc, stdout, stderr = tune("decoder", "--replay", REPLAY, "--study-name", "shared", "--storage", url,
                              "--trials", 3, "--no-progress", "--out", tmp_path / "results", *extra)
    assert rc == 2 and "Traceback" not in stderr and stderr.count("\n") == 1, stderr
    for words in (OTHER_GPU, "NVIDIA H200", "same GPU model") + (("worker 1",) if as_worker else ()):
        assert words in stderr, (words, stderr)
    assert load(url, "shared").user_attrs["identity"]["gpu"] == OTHER_GPU
    assert len(load(url, "shared").trials) == queued  # none run, none added
    with pytest.raises(StudyError, match="same GPU model"):
        open_study(replay.shape, replay, space.load(), opts, tmp_path)


BAD_WORKERS = [
    ("workers-0", ["--replay", REPLAY, "--workers", 0], ["--workers 0", "at least 1"]),
    ("workers-negative", ["--replay", REPLAY, "--workers", -2], ["--workers -2"]),
    ("gpus-empty-entry", ["--gpus", "0,,1"], ["--gpus '0,,1'", "0,1,2,3"]),
    ("gpus-not-numbers", ["--gpus", "first"], ["--gpus 'first'"]),
    ("gpus-superscript-digits", ["--gpus", "0,\u00b9"], ["--gpus", "0,1,2,3"]),
    ("gpus-twice", ["--gpus", "0,1,0"], ["GPU 0 listed twice"]),
    ("gpus-and-workers-disagree", ["--gpus", "0,1", "--workers", 3], ["--workers 3", "2 GPUs"]),
    ("gpus-with-replay", ["--replay", REPLAY, "--gpus", "0,1"], ["--gpus", "--workers N"]),
    ("trial-timeout-0", ["--replay", REPLAY, "--trial-timeout", 0], ["--trial-timeout 0"]),
    ("storage-unknown-dialect", ["--replay", REPLAY, "--storage", "nosuchdb://x/y"], ["--storage", "nosuchdb"]),
    ("storage-password-hidden", ["--replay", REPLAY, "--storage", "postgresql://me:s3cret@127.0.0.1:1/db"],
     ["postgresql://me:***@127.0.0.1:1/db"]),
]


@pytest.mark.parametrize("argv, words", [(a, w) for _, a, w in BAD_WORKERS], ids=[i for i, _, _ in BAD_WORKERS])
def test_bad_worker_options(tmp_path, argv, words):
    out = tmp_path / "results"
    rc, stdout, stderr = tune("decoder", "--trials", 3, "--no-progress", "--out", out, *argv)
    assert rc == 2 and "Traceback" not in stderr and stderr.count("\n") == 1, stderr
    assert stderr.startswith("tune: error: ")
    for w in words:
        assert w in stderr, (w, stderr)
    assert "s3cret" not in stderr
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing written, not even results/
