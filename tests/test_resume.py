"""Kill and resume: `kill -9` of `tune decoder` mid-trial, then the same command. Completed trials are kept,
the interrupted one is marked failed (it does not count) and retried once, and the study ends with exactly
its budget of evaluated trials. SQLite (with Optuna's heartbeat) and the journal file (no heartbeat: the
dead owner's pid gives it away) both recover; so does a trial whose host went away (the heartbeat)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tuner import faults, space
from tuner.evaluate import ReplayEvaluator
from tuner.storage import OWNER_ATTR, open_storage, this_owner
from tuner.study import SEEDING_ATTR, StudyOptions, open_study, search, trial_status

REPLAY = Path(__file__).parent / "data" / "replay-bert-base-h200"
BUDGET = 8


def tune_decoder(out: Path, storage: str, *extra, hang_after: int | None = None) -> subprocess.Popen:
    """`tune decoder --replay` as its own process; ``hang_after``: the evaluations after that many never return
    (tuner.faults), so that a kill or a Ctrl-C lands mid-trial however late the test's poll sees it.

    The child gets Ctrl-C's default disposition: a test run started in the background of a non-interactive shell
    (``pytest ... &``) ignores SIGINT, an ignored signal survives exec, and Python then installs no
    KeyboardInterrupt handler, so the study would never see the test's SIGINT."""
    env = {k: v for k, v in os.environ.items() if k != faults.ENV}
    if hang_after is not None:
        env[faults.ENV] = json.dumps({"hang_after": hang_after})
    cmd = [sys.executable, "-m", "tuner.cli", "decoder", "--replay", str(REPLAY), "--trials", str(BUDGET),
           "--out", str(out), "--storage", storage, "--no-progress", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def load(storage) -> optuna.Study:
    """The one study in ``storage`` (a URL or an opened storage)."""
    storage = open_storage(storage) if isinstance(storage, str) else storage
    [summary] = optuna.get_all_study_summaries(storage)
    return optuna.load_study(study_name=summary.study_name, storage=storage)


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def gone_pid() -> int:
    """A pid no process of this host has: above the kernel's pid_max (the pid of an exited process may be
    reused by the time the code under test looks it up)."""
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    except (OSError, ValueError):
        return 2**22 + 1  # (Linux's largest pid_max)


def trials_midway(storage):
    """Two trials done and the third running: the moment to kill."""
    try:
        trials = load(storage).get_trials(deepcopy=False)
    except Exception:  # noqa: BLE001 - the study is not created yet
        return False
    done = [t for t in trials if t.state.is_finished()]
    running = [t for t in trials if t.state == TrialState.RUNNING and OWNER_ATTR in t.user_attrs]
    return len(done) >= 2 and bool(running)


@pytest.mark.parametrize("storage_kind, isolation", [("sqlite", "--isolation"), ("journal", "--no-isolation")])
def test_kill_mid_trial_then_resume(tmp_path, storage_kind, isolation):
    out = tmp_path / "results"
    storage = (f"sqlite:///{(tmp_path / 'studies.db').as_posix()}" if storage_kind == "sqlite"
               else f"journal:{tmp_path / 'studies.journal'}")
    proc = tune_decoder(out, storage, isolation, hang_after=2)
    watch = open_storage(storage)  # opened once: the test polls it while the study runs

    def midway():  # the evaluator worker (if any) first: the kill then follows the storage's answer at once
        evaluators = children(proc.pid)
        return [evaluators] if trials_midway(watch) else None  # (a list of one: [[]] without isolation is true)

    [evaluators] = wait_until(midway, 60, "two finished trials and one running")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # The trial the kill interrupted, from the storage: on a loaded machine it may be a later one than the poll saw.
    trials = load(storage).get_trials(deepcopy=False)
    running = [t for t in trials if t.state == TrialState.RUNNING]
    assert len(running) == 1, [(t.number, t.state) for t in running]
    before = {t.number: (t.state, t.value) for t in trials if t.state.is_finished()}
    # The evaluator worker notices its study process is gone and exits: no worker keeps holding a GPU.
    wait_until(lambda: not any(alive(p) for p in evaluators), 10, "the orphaned evaluator worker to exit")
    assert not out.exists() or not list(out.rglob("best.json")), "the killed run wrote a run folder"

    rerun = tune_decoder(out, storage, isolation)
    stdout, _ = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, stdout[-3000:]
    assert f"trial(s) {running[0].number} were interrupted" in stdout

    trials = load(storage).get_trials(deepcopy=False)
    by_number = {t.number: t for t in trials}
    for n, (state, value) in before.items():  # nothing completed was lost or changed
        assert (by_number[n].state, by_number[n].value) == (state, value)
    killed = by_number[running[0].number]
    assert killed.state == TrialState.FAIL and trial_status(killed) == "interrupted"
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == killed.number]
    # The retry has the killed trial's parameters (those it had drawn before the kill: it may have died
    # while drawing them), and is finished.
    assert len(retries) == 1 and retries[0].state.is_finished()
    assert killed.params.items() <= retries[0].params.items()
    assert retries[0].user_attrs[OWNER_ATTR]["pid"] == rerun.pid
    evaluated = [t for t in trials if t.state.is_finished() and trial_status(t) != "interrupted"]
    assert len(evaluated) == BUDGET and len(trials) == BUDGET + 1
    assert not [t for t in trials if not t.state.is_finished()]
    [run] = [p.parent for p in out.rglob("best.json")]
    assert not list(out.rglob("*.partial")) and len(open(run / "trials.csv").readlines()) == 1 + BUDGET + 1


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_heartbeat_retries_the_trial_of_a_lost_host(tmp_path):
    """A RUNNING trial whose owner is on another host (no pid to check) goes stale when its heartbeats
    stop: Optuna's heartbeat fails it and tuner.storage's callback queues one retry."""
    url = f"sqlite:///{(tmp_path / 'studies.db').as_posix()}"
    storage = open_storage(url, heartbeat_interval_s=1, grace_period_s=2)
    replay = ReplayEvaluator(REPLAY)
    opts = StudyOptions(trials=5, storage=storage, progress=False, sampler="random")
    study = open_study(replay.shape, replay, space.load(), opts, tmp_path, log=lambda *a: None)
    lost = study.ask()  # the baseline, taken by a process on a host that then went away
    lost.set_user_attr(OWNER_ATTR, {"host": "another-host", "pid": 1, "start": None})
    storage.record_heartbeat(lost._trial_id)
    done = study.ask()  # and a trial that host had measured, but not ended, when it went away
    for k, v in ((OWNER_ATTR, {"host": "another-host", "pid": 1, "start": None}), ("config", {"kernels": {}}),
                 ("latency_us", 1234.5), ("status", "ok")):
        done.set_user_attr(k, v)
    storage.record_heartbeat(done._trial_id)
    time.sleep(3)
    # (the whole budget: run_study would keep its last trial for the top-1's knobs-off twin)
    search(study, replay.shape, replay, space.load(), opts, log=lambda *a: None, budget=opts.trials)
    trials = study.get_trials(deepcopy=False)
    assert trials[0].state == TrialState.FAIL and trial_status(trials[0]) == "interrupted"
    [retry] = [t for t in trials if t.system_attrs.get("failed_trial") == 0]
    assert retry.user_attrs["is_baseline"] and trial_status(retry) == "ok"
    assert retry.user_attrs[OWNER_ATTR]["pid"] == os.getpid()  # not the lost owner, copied over
    [copy] = [t for t in trials if t.system_attrs.get("failed_trial") == done.number]  # (its result, not measured)
    assert copy.state == TrialState.COMPLETE and copy.value == 1234.5 and trial_status(trials[done.number]) == \
        "interrupted"
    assert sum(t.state.is_finished() and trial_status(t) != "interrupted" for t in trials) == 5


def test_ctrl_c_mid_trial_then_resume_retries_that_trial(tmp_path):
    """Ctrl-C (SIGINT) mid-trial: Optuna fails the trial itself (no process is left dead to find), and the next run
    retried none of it before. The interrupted trial is retried once, as after a kill; the baseline included."""
    out, storage = tmp_path / "results", f"sqlite:///{(tmp_path / 'studies.db').as_posix()}"
    proc = tune_decoder(out, storage, "--no-isolation", hang_after=2)
    watch = open_storage(storage)
    wait_until(lambda: trials_midway(watch), 60, "two finished trials and one running")
    proc.send_signal(signal.SIGINT)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, stdout[-2000:]
    [killed] = [t for t in load(storage).get_trials(deepcopy=False) if t.state == TrialState.FAIL]
    assert trial_status(killed) == "interrupted"

    rerun = tune_decoder(out, storage, "--no-isolation")
    stdout, _ = rerun.communicate(timeout=120)
    assert rerun.returncode == 0 and f"trial(s) {killed.number} were interrupted" in stdout, stdout[-3000:]
    trials = load(storage).get_trials(deepcopy=False)
    [retry] = [t for t in trials if t.system_attrs.get("failed_trial") == killed.number]
    assert retry.state.is_finished() and trial_status(retry) == "ok"
    assert sum(t.state.is_finished() and trial_status(t) != "interrupted" for t in trials) == BUDGET
    assert sum(bool(t.user_attrs.get("is_baseline")) and trial_status(t) == "ok" for t in trials) == 1


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_an_interrupted_trial_is_retried_once_only(tmp_path):
    # recover_orphans queues one retry of a FAIL trial with no measurement, and none for the retry itself.
    from tuner.storage import recover_orphans

    study = optuna.create_study(storage=open_storage(f"sqlite:///{(tmp_path / 'studies.db').as_posix()}"))
    first = study.ask({"x": optuna.distributions.IntDistribution(0, 9)})
    first.set_user_attr("eval_s", 1.5)  # (Ctrl-C after the evaluator returned, before the measurement was recorded)
    study.tell(first, state=TrialState.FAIL)  # what Optuna records for a trial that Ctrl-C interrupted
    done = study.ask()
    done.set_user_attr("status", "incorrect")  # (a failed trial with a status is the candidate's own failure)
    study.tell(done, state=TrialState.FAIL)
    assert recover_orphans(study) == [first.number] and recover_orphans(study) == []
    retry = study.ask()  # the queued copy
    assert study.trials[retry.number].system_attrs.get("failed_trial") == first.number
    assert retry.params == first.params
    assert "eval_s" not in study.trials[retry.number].user_attrs  # (measured again: its seconds will be its own)
    study.tell(retry, state=TrialState.FAIL)
    assert recover_orphans(study) == []


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_a_trial_whose_end_was_lost_ends_as_it_was_measured(tmp_path):
    # A process that dies after the measurement but before (or while) writing the trial's end: a journal's torn last
    # record in session 50, where the trial was failed and its retry copied the failure (FAIL, status "ok", no value)
    # instead of measuring, so the measurement was lost and two slots of the budget spent on it. A helper's audit of
    # 91 crash points then found the first fix ending a trial whose config was not yet written (finish: KeyError),
    # and a trial that died before its owner was written left RUNNING forever.
    from tuner.storage import LATENCY_ATTR, recover_orphans
    from tuner.study import counts_against_budget, trial_status

    study = optuna.create_study(storage=open_storage(f"sqlite:///{(tmp_path / 'studies.db').as_posix()}"))
    x = optuna.distributions.IntDistribution(0, 9)
    dead = {**this_owner(), "pid": gone_pid(), "start": None}
    measured, failed, older, stopped, unwritten, ownerless, late = (study.ask({"x": x}) for _ in range(7))
    for t, status, latency, config in ((measured, "ok", 12.5, True), (failed, "incorrect", None, True),
                                       (older, "ok", "absent", True), (unwritten, "ok", 9.0, False)):
        t.set_user_attr(OWNER_ATTR, dead)
        if config:
            t.set_user_attr("config", {"kernels": {}})
        if latency != "absent":  # (a study begun before session 50 recorded no latency)
            t.set_user_attr(LATENCY_ATTR, latency)
        t.set_user_attr("status", status)
    stopped.set_user_attr("status", "ok")  # Ctrl-C between the measurement and the trial's end (an older study)
    study.tell(stopped, state=TrialState.FAIL)
    for k, v in (("owner", dead), ("config", {"kernels": {}}), ("eval_s", 0.4), (LATENCY_ATTR, 7.5), ("status", "ok")):
        late.set_user_attr(k, v)  # Ctrl-C (or the heartbeat) after the status: its result is all there
    study.tell(late, state=TrialState.FAIL)
    kept = []
    assert recover_orphans(study, kept) == [older.number, stopped.number, unwritten.number]
    assert kept == [measured.number, failed.number, late.number]
    assert study.trials[ownerless.number].state == TrialState.RUNNING  # (started just now: maybe a live process's)
    assert recover_orphans(study, ownerless_after_s=0) == [ownerless.number]  # (started over that long ago)
    ts = study.trials
    assert ts[measured.number].state == TrialState.COMPLETE and ts[measured.number].value == 12.5
    assert ts[failed.number].state == TrialState.FAIL and trial_status(ts[failed.number]) == "incorrect"
    for n in (older.number, stopped.number, unwritten.number, ownerless.number, late.number):  # only retries count
        assert trial_status(ts[n]) == "interrupted" and not counts_against_budget(ts[n])
    retries = {t.system_attrs.get("failed_trial"): t for t in ts[7:]}
    assert sorted(retries) == sorted([older.number, stopped.number, unwritten.number, ownerless.number, late.number])
    copy = retries[late.number]  # (not measured again: a copy with its result)
    assert copy.state == TrialState.COMPLETE and copy.value == 7.5 and OWNER_ATTR not in copy.user_attrs
    assert copy.user_attrs["eval_s"] == 0.4  # (the measurement it copies, and its seconds)
    assert all(retries[n].state == TrialState.WAITING for n in retries if n != late.number)
    assert recover_orphans(study, ownerless_after_s=0) == []


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_a_trial_without_an_owner_is_awaited_then_retried(tmp_path):
    # (the audit's continuation right after the kill: the owner-less trial was younger than the grace period, so the
    # run ended one trial short; opening the study now waits for an owner, up to the grace period, then retries it)
    import datetime
    import time

    from tuner.storage import await_owners, recover_orphans

    study = optuna.create_study(storage=open_storage(f"sqlite:///{(tmp_path / 'studies.db').as_posix()}"))
    x = optuna.distributions.IntDistribution(0, 9)
    live = study.ask({"x": x})
    calls, said = [], []

    def clock():  # the live process writes its owner during the first poll
        calls.append(1)
        if len(calls) == 2:
            live.set_user_attr(OWNER_ATTR, this_owner())
        return datetime.datetime.now()

    await_owners(study, ownerless_after_s=60, log=said.append, poll_s=0.01, clock=clock)
    assert len(calls) == 2 and said == []  # (one poll, nothing said)
    dead = study.ask({"x": x})
    t0 = time.monotonic()
    await_owners(study, ownerless_after_s=1.0, log=said.append, poll_s=0.05)
    assert 0.5 <= time.monotonic() - t0 < 5 and len(said) == 1 and f"trial(s) {dead.number} have no owner" in said[0]
    assert recover_orphans(study, ownerless_after_s=1.0) == [dead.number]
    assert study.trials[live.number].state == TrialState.RUNNING  # (its owner is this live process)


def test_a_measurement_is_recorded_status_last():
    # (recover_orphans ends a trial as measured once its status is written: everything else must be there by then)
    from tuner.config import DecoderConfig
    from tuner.evaluate import TrialResult
    from tuner.shapes import PRESETS
    from tuner.study import _record, _record_crash

    class Attrs(dict):
        set_user_attr = dict.__setitem__

    rec = Attrs()
    _record(rec, DecoderConfig(), TrialResult(status="ok", latency_us=12.5, spread_us=0.1), PRESETS["tiny"])
    assert list(rec)[-2:] == ["latency_us", "status"] and {"config", "config_hash"} <= set(rec), list(rec)
    crash = Attrs()
    _record_crash(crash, ValueError("x"))
    assert list(crash) == ["reason", "status"]


@pytest.mark.parametrize("queued", [0, 3])
def test_a_study_whose_creator_died_before_seeding_it_gets_its_seeds(tmp_path, queued):
    """A run killed right after it created the study (0 seeds queued), or while it queued them (3): the next run
    queued none before, and the study ran without its baseline and hand-picked seeds for good (tiny's replay: 9.63
    us against 7.36 from a clean start). The next process to open it queues the missing ones."""
    storage = open_storage(f"sqlite:///{(tmp_path / 'studies.db').as_posix()}")
    replay = ReplayEvaluator(REPLAY)
    opts = StudyOptions(trials=BUDGET, storage=storage, progress=False, sampler="random")
    clean = open_study(replay.shape, replay, space.load(), opts, tmp_path / "a", log=lambda *a: None)
    seeds = [t.system_attrs["fixed_params"] for t in clean.get_trials(deepcopy=False)]
    name = clean.study_name + "-killed"
    died = optuna.create_study(study_name=name, storage=storage)
    if queued:  # (killed after it wrote who it was: a process of this host that is gone; else it never wrote it)
        died.set_user_attr(SEEDING_ATTR, {**this_owner(), "pid": gone_pid(), "start": None})
    for p in seeds[:queued]:
        died.enqueue_trial(p, user_attrs={"is_baseline": True} if p == seeds[0] else None)
    study = open_study(replay.shape, replay, space.load(), StudyOptions(**{**opts.__dict__, "study_name": name}),
                       tmp_path / "b", log=lambda *a: None)
    got = [t.system_attrs["fixed_params"] for t in study.get_trials(deepcopy=False)]
    assert got == seeds and study.user_attrs["seeded"]
    assert sum(bool(t.user_attrs.get("is_baseline")) for t in study.get_trials(deepcopy=False)) == 1


def test_a_creator_still_queueing_the_seeds_is_left_to_it(tmp_path):
    # Processes started together (on several hosts, or here): the one that finds the study created by a live
    # process that has not marked it seeded yet queues nothing (tests/test_postgres.py: one baseline between two).
    storage = open_storage(f"sqlite:///{(tmp_path / 'studies.db').as_posix()}")
    replay = ReplayEvaluator(REPLAY)
    opts = StudyOptions(trials=BUDGET, storage=storage, progress=False, sampler="random", study_name="busy")
    busy = optuna.create_study(study_name="busy", storage=storage)
    busy.set_user_attr(SEEDING_ATTR, this_owner())  # this process: alive
    study = open_study(replay.shape, replay, space.load(), opts, tmp_path, log=lambda *a: None)
    assert study.get_trials(deepcopy=False) == [] and not study.user_attrs.get("seeded")


def test_a_study_continued_with_another_sampler_says_so(tmp_path):
    # The same study goes on under another --sampler or --seed (its trials stay comparable); the run says so, since
    # the manifest names only the sampler of the run that wrote it.
    storage = open_storage(f"sqlite:///{(tmp_path / 'studies.db').as_posix()}")
    replay = ReplayEvaluator(REPLAY)
    said = []
    opts = StudyOptions(trials=BUDGET, storage=storage, progress=False, sampler="tpe")
    open_study(replay.shape, replay, space.load(), opts, tmp_path, log=said.append)
    open_study(replay.shape, replay, space.load(), opts, tmp_path, log=said.append)
    assert not [s for s in said if "began with" in s]
    again = StudyOptions(**{**opts.__dict__, "sampler": "random", "seed": 5})
    open_study(replay.shape, replay, space.load(), again, tmp_path, log=said.append)
    assert [s for s in said if "began with --sampler tpe --seed 0" in s and "--sampler random --seed 5" in s]


# ------------------------------------------------------------------------------------------------
# Crash points: a journal cut where a killed process would have left it, then the study continued
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def crash_base(tmp_path_factory) -> tuple[bytes, dict]:
    """One two-worker study of 6 trials: its journal, and each trial's (state, value, status) from it."""
    out = tmp_path_factory.mktemp("crash") / "base"
    p = subprocess.run([sys.executable, "-m", "tuner.cli", "decoder", "--replay", str(REPLAY), "--trials", "6",
                        "--no-progress", "--out", str(out), "--workers", "2"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return (out / "studies.journal").read_bytes(), _trials_of(out / "studies.journal")


def _trials_of(journal: Path) -> dict:
    study = load(optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal))))
    return {t.number: t for t in study.get_trials(deepcopy=True)}


def _cut(data: bytes, where: str) -> tuple[int, int | None]:
    """(byte offset, trial number) of a crash point in ``data``: within the last search trial to end, right after
    its owner, its config or its status record, or inside its end record; or inside the knobs-off twin's record."""
    lines = data.splitlines(keepends=True)
    recs = [json.loads(ln) for ln in lines]
    ends = [i for i, r in enumerate(recs) if r["op_code"] == 6 and r.get("state") == 1]  # (set_trial_state_values)
    at = lambda i: sum(map(len, lines[:i + 1]))  # noqa: E731  (the offset right after record i)
    if where == "inside the twin":
        [twin] = [i for i, r in enumerate(recs) if r["op_code"] == 4 and r.get("state") == 1]  # (create_trial)
        return at(twin) - len(lines[twin]) // 2, None
    end = ends[-1]
    trial_id = recs[end]["trial_id"]
    if where == "inside its end":
        return at(end) - 20, trial_id
    key = {"after its owner": OWNER_ATTR, "after its config": "config", "after its status": "status"}[where]
    [i] = [i for i, r in enumerate(recs) if r["op_code"] == 8 and r.get("trial_id") == trial_id  # (set_trial_user_attr)
           and key in r.get("user_attr", {})]
    return at(i), trial_id


@pytest.mark.parametrize("where", ["after its owner", "after its config", "after its status", "inside its end",
                                   "inside the twin"])
def test_a_study_killed_at_any_point_of_a_trial_keeps_what_it_measured(tmp_path, crash_base, where):
    # Session 50's crash-point audit, in five points: a killed process leaves its journal cut short anywhere. The
    # continuation must keep every value the prefix holds, end a trial whose status was written as measured (its
    # latency and config are written before it), retry one whose status was not, and spend the budget exactly.
    data, full = crash_base
    offset, n = _cut(data, where)
    out = tmp_path / "results"
    out.mkdir()
    (out / "studies.journal").write_bytes(data[:offset])
    before = _trials_of(out / "studies.journal")
    p = subprocess.run([sys.executable, "-m", "tuner.cli", "decoder", "--replay", str(REPLAY), "--trials", "8",
                        "--no-progress", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    from tuner.study import counts_against_budget

    after = _trials_of(out / "studies.journal")
    [run] = [ln.removeprefix("run folder: ") for ln in p.stdout.splitlines() if ln.startswith("run folder: ")]
    assert json.loads((Path(run) / "manifest.json").read_text())["n_trials"] == 8
    assert sum(map(counts_against_budget, after.values())) == 8
    for k, t in before.items():  # nothing measured is lost
        if t.state == TrialState.COMPLETE:
            assert after[k].state == TrialState.COMPLETE and after[k].value == t.value, (k, where)
    if n is not None:
        t = after[n]
        if where in ("after its status", "inside its end"):  # ended as measured, not measured again
            assert t.state == TrialState.COMPLETE and t.value == full[n].value, (where, t.state, t.value)
            assert "ended as measured" in p.stdout and not any(
                u.system_attrs.get("failed_trial") == n for u in after.values())
        else:  # no result yet: retried once
            assert trial_status(t) == "interrupted", (where, t.state, t.user_attrs.get("status"))
            assert sum(u.system_attrs.get("failed_trial") == n for u in after.values()) == 1
    else:  # the torn twin is set aside and measured again
        assert list(out.glob("studies.journal.torn-*")) and any(
            "knobs_off_of" in u.user_attrs for u in after.values())
