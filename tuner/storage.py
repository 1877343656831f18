"""The study's storage: one URL for one process or many, and trials that outlive the process that ran them.

Optuna's storage is the distributed engine: several study processes (one per GPU, or one per host) share
one study through it. URLs: ``sqlite:///PATH`` (embedded default, one process), ``journal:PATH`` (Optuna's
journal file, several processes on one host), ``postgresql://...`` (several hosts).

A study process killed mid-trial (``kill -9``, a lost host) leaves its trial RUNNING forever. Two ways
bring it back, both ending in the same place (the trial FAIL, one WAITING copy of its parameters that
the next trial of any process picks up):

* every trial records its owner (host, pid, process start time); a process that opens the study fails
  the RUNNING trials of dead owners on its own host at once (any storage), and those that never named an owner
  (a process killed as it began the trial) once they are ``GRACE_PERIOD_S`` old;
* RDB storages also run Optuna's heartbeat, which catches owners on other hosts after ``grace_period_s``.

A trial whose measurement had ended when its process died (its latency and status written, its end not) is not
retried: it ends as it was measured (recover_orphans).
"""

from __future__ import annotations

import copy
import datetime
import fcntl
import inspect
import itertools
import math
import os
import re
import socket
import time
import warnings
from pathlib import Path

import optuna
from optuna.trial import TrialState

JOURNAL_PREFIX = "journal:"
HEARTBEAT_INTERVAL_S = 10
# Six missed heartbeats: a study process busy compiling still beats (the beat is a thread, and the
# candidate runs in another process), so a 60 s silence means the process is gone.
GRACE_PERIOD_S = 60
OWNER_ATTR = "owner"
# A measured trial's latency, recorded with its status before the trial ends: a process that dies between the two
# (or while writing the end) leaves the measurement in the storage, and recover_orphans completes the trial with it.
LATENCY_ATTR = "latency_us"
# A measured trial's seconds: ``eval_s`` in the measuring worker (the evaluator's call: the compile where no compile
# worker did it ahead, the check and the timing), ``compile_s`` in a compile worker (study._search_pipelined). A
# duplicate copies neither (it took none), nor does a retry that measures again.
TIME_ATTRS = ("eval_s", "compile_s")


class StorageError(ValueError):
    """A storage URL that is malformed or cannot be opened (the user's URL or server)."""


def default_url(out_root: Path, workers: int = 1) -> str:
    """SQLite for one study process; a journal file when several processes write (SQLite locks them out), and for
    one process where an earlier --workers run left one and no SQLite file is there (its studies continue)."""
    journal, db = out_root / "studies.journal", out_root / "studies.db"
    if workers > 1 or (journal.is_file() and not db.exists()):
        return f"{JOURNAL_PREFIX}{journal.as_posix()}"
    return f"sqlite:///{db.as_posix()}"


def redact(url: str) -> str:
    """The URL without its password, for messages and manifests."""
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", url)


def _local_path(url: str) -> Path | None:
    """The file a journal or SQLite URL names (None for a server URL or in-memory SQLite)."""
    if url.startswith(JOURNAL_PREFIX):
        return Path(url[len(JOURNAL_PREFIX):])
    if url.startswith("sqlite:///") and len(url) > len("sqlite:///"):
        return Path(url[len("sqlite:///"):])
    return None


def _retry_callback():
    """``RetryHeartbeatStaleTrialCallback`` (optuna >= 4.9) or its older name, retrying a trial once."""
    cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None) or optuna.storages.RetryFailedTrialCallback

    class RetryOnce(cls):
        def __call__(self, study, trial):
            # The copy must not inherit the dead owner, or another process's recovery could fail it
            # again between the moment it is picked up and the moment its new owner is written.
            trial = copy.deepcopy(trial)
            trial.user_attrs = {k: v for k, v in trial.user_attrs.items() if k != OWNER_ATTR}
            latency = measured_latency(trial)
            if latency is None:  # (measured again: its seconds will be the retry's own)
                trial.user_attrs = {k: v for k, v in trial.user_attrs.items() if k not in TIME_ATTRS}
                super().__call__(study, trial)
                return
            # Its measurement had ended (the heartbeat failed it, or a Ctrl-C landed after its status): a copy with
            # that result takes its place instead of a second measurement.
            study.add_trial(optuna.trial.create_trial(
                params=trial.params, distributions=trial.distributions, value=latency, user_attrs=trial.user_attrs,
                system_attrs={"failed_trial": trial.number,
                              "retry_history": [*trial.system_attrs.get("retry_history", []), trial.number]}))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experimental-feature warnings, once per process
        return RetryOnce(max_retry=1)


def _with_driver(url: str) -> str:
    """``postgresql://`` with the driver that is installed. SQLAlchemy 2.1 reads a bare postgresql:// as
    psycopg 3; the test extra installs psycopg2-binary, which then needs ``postgresql+psycopg2://``."""
    import importlib.util

    if not url.startswith("postgresql://") or importlib.util.find_spec("psycopg") is not None:
        return url
    if importlib.util.find_spec("psycopg2") is not None:
        return "postgresql+psycopg2://" + url[len("postgresql://"):]
    return url


def _rdb(url: str, heartbeat_interval_s: int, grace_period_s: int):
    import sqlalchemy.exc

    url = _with_driver(url)
    params = inspect.signature(optuna.storages.RDBStorage).parameters
    cb_name = ("heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback" in params
               else "failed_trial_callback")
    engine_kwargs = {}
    if url.startswith("postgresql"):
        engine_kwargs = {"connect_args": {"connect_timeout": 10}}  # an unreachable host fails in 10 s, not 2 min
    for attempt in range(3):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs,
                                                  heartbeat_interval=heartbeat_interval_s,
                                                  grace_period=grace_period_s, **{cb_name: _retry_callback()})
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
            # Processes started together on an empty database all create Optuna's tables; all but one
            # then fail on "already exists". The tables are there now: opening again succeeds.
            if attempt == 2:
                raise
            time.sleep(0.5 + attempt)


def _is_journal(path: Path) -> bool:
    """An empty file, or one whose first line is an Optuna journal record (a JSON object with an op_code)."""
    import json

    try:
        with open(path, "rb") as f:
            first = f.readline()
        return not first.strip() or "op_code" in json.loads(first)
    except (OSError, ValueError, TypeError):
        return False


def _sqlite_problem(path: Path) -> str | None:
    """Why Optuna must not open this file: not a SQLite database, or one with tables of someone else's (Optuna
    would add its own beside them). None for an empty file or database, Optuna's own (version_info among its
    tables), or one that cannot be read now (locked, or with a journal to roll back: Optuna's to open). Read only."""
    import sqlite3

    with open(path, "rb") as f:
        head = f.read(16)
    if not head:
        return None
    if head != b"SQLite format 3\x00":
        return "is not a SQLite database"
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            con.close()
    except sqlite3.Error:
        return None
    if tables and "version_info" not in tables:
        return "holds tables of its own and is not an Optuna database; Optuna would add its tables to it"
    return None


def _set_aside_torn_record(path: Path) -> None:
    """A journal whose last record was cut short (a process killed mid-write, a full disk): Optuna reads past it, but
    appends its next record to the torn line, after which no reader can parse the file and every trial in it is lost.
    Under the writers' lock (so no record is being written now), the torn bytes move to PATH.torn-<time>, and the
    complete records stay as they were."""
    import json
    import sys

    lock = FlockLock(str(path))
    lock.acquire()
    try:
        with open(path, "rb") as f:
            data = f.read()
        if not data or data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1
        try:  # a whole record that lost only its newline is a record: end the line
            json.loads(data[keep:])
            with open(path, "ab") as f:
                f.write(b"\n")
            return
        except ValueError:
            pass
        aside = path.with_name(f"{path.name}.torn-{time.strftime('%Y%m%d-%H%M%S')}")
        aside.write_bytes(data[keep:])
        with open(path, "r+b") as f:
            f.truncate(keep)
    finally:
        lock.release()
    print(f"tune: {path}'s last record was cut short ({len(data) - keep} bytes, a write that never ended): set aside "
          f"in {aside.name}; every complete record is kept", file=sys.stderr)


def _damaged_record(path: Path) -> str | None:
    """Which record (line) of a journal file is not JSON, as "its line N of M"; None when every line is."""
    import json

    lines = path.read_bytes().splitlines()
    for i, line in enumerate(lines, 1):
        try:
            json.loads(line)
        except ValueError:
            return f"its line {i} of {len(lines)} is not a whole record"
    return None


def open_storage(url: str, *, heartbeat_interval_s: int = HEARTBEAT_INTERVAL_S, grace_period_s: int = GRACE_PERIOD_S):
    """The Optuna storage object for ``url``. A folder missing for a SQLite or journal file is created;
    if the storage then fails to open, whatever was created here is removed again (StorageError)."""
    if "://" not in url and not url.startswith(JOURNAL_PREFIX):
        raise StorageError(f"--storage {redact(url)!r}: expected a URL like sqlite:///results/studies.db, "
                           "postgresql://user@host/db, or journal:PATH for a journal file")
    path = _local_path(url)
    if url.startswith("sqlite:") and (path is None or str(path) in (":memory:", "")):
        raise StorageError(f"--storage {redact(url)!r}: sqlite:///PATH needs a file (an in-memory database keeps "
                           "nothing, and several processes cannot share it)")
    existed = path.exists() if path is not None else True
    try:
        created_dirs = _make_parents(path) if path is not None else []
    except OSError as e:
        raise StorageError(f"--storage {redact(url)!r}: cannot create its folder ({e.strerror or e})") from None
    try:
        if url.startswith(JOURNAL_PREFIX):
            if not path or path.is_dir():
                raise StorageError(f"--storage {redact(url)!r}: journal:PATH needs a file path")
            if existed and not _is_journal(path):  # Optuna would append its records to someone else's file
                raise StorageError(f"--storage {redact(url)!r}: {path} exists and is not an Optuna journal file")
            from optuna.storages.journal import JournalFileBackend

            if existed:
                _set_aside_torn_record(path)
            return optuna.storages.JournalStorage(JournalFileBackend(str(path), lock_obj=FlockLock(str(path))))
        why = _sqlite_problem(path) if url.startswith("sqlite:") and existed and path.is_file() else None
        if why:
            raise StorageError(f"--storage {redact(url)!r}: {path} {why}")
        return _rdb(url, heartbeat_interval_s, grace_period_s)
    except Exception as e:  # noqa: BLE001 - any failure here is the user's URL or server
        if path is not None and not existed and path.is_file():
            path.unlink()
        for d in reversed(created_dirs):
            _rmdir_quiet(d)
        if isinstance(e, StorageError):
            raise
        first = " ".join(str(e).split()).replace(url, redact(url))[:200]
        if url.startswith(JOURNAL_PREFIX) and isinstance(e, ValueError) and (bad := _damaged_record(path)):
            # (the decoder's own "line 1 column 31" counts within the one record it was given, not in the file)
            raise StorageError(f"--storage {redact(url)!r}: cannot open it: {bad}, which no reader can parse, so "
                               "none of the study's records can be read; move the file aside to start a new study"
                               ) from None
        hint = " (pip install psycopg2-binary)" if url.startswith("postgresql") and isinstance(e, ImportError) else ""
        raise StorageError(f"--storage {redact(url)!r}: cannot open it ({type(e).__name__}: {first}){hint}") from None


class FlockLock:
    """The journal file's write lock, as an ``flock`` on ``PATH.lock``: the kernel drops it when its holder
    dies. Optuna's default lock is a symlink that a process killed mid-write leaves behind, and every
    other process then waits out its 30 s grace period before breaking it. (Plain Optuna processes writing
    the same journal at the same time would use their own lock: run the journal through `tune` only.)"""

    def __init__(self, journal_path: str):
        self._path = journal_path + ".lock"
        self._fd: int | None = None

    def acquire(self) -> bool:
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        self._fd = fd
        return True

    def release(self) -> None:
        fd, self._fd = self._fd, None
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _make_parents(path: Path) -> list[Path]:
    missing = [p for p in reversed(path.parents) if not p.exists()]
    for p in missing:
        p.mkdir()
    return missing


def _rmdir_quiet(d: Path) -> None:
    try:
        d.rmdir()
    except OSError:
        pass


# ----------------------------------------------------------------------------------------------
# Owners of trials, and the trials of owners that died
# ----------------------------------------------------------------------------------------------

def _start_time(pid: int) -> str | None:
    """The process's start time since boot (Linux): a pid reused by another process has another one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the parenthesised command name


def this_owner() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def owner_alive(owner: dict) -> bool | None:
    """True/False for an owner on this host; None for one on another host (the heartbeat's job)."""
    if owner.get("host") != socket.gethostname():
        return None
    pid = int(owner.get("pid", -1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    start = _start_time(pid)
    return owner.get("start") is None or start is None or start == owner["start"]


def interrupted(t) -> bool:
    """A FAIL trial that is not its candidate's own failure: its process was killed or stopped mid-trial (no status),
    or after the measurement, before the trial's end (status "ok" and no value; its retry is then a copy of the
    recorded result where there is one, measured_latency). Its retry counts, not itself."""
    return t.state == TrialState.FAIL and t.user_attrs.get("status") in (None, "ok")


def await_owners(study: optuna.Study, ownerless_after_s: float = GRACE_PERIOD_S, log=None, poll_s: float = 1.0,
                 clock=datetime.datetime.now) -> None:
    """Wait until every RUNNING trial without an owner has one, or is ``ownerless_after_s`` old (recover_orphans then
    takes its process for dead). A live process writes the owner within a second of Optuna's creating the trial, so
    the wait is one poll where another process has just begun a trial; it is longer only where a process died in
    that moment and the study is opened again at once. Said once in ``log`` after the first poll."""
    for polls in itertools.count():
        now = clock()
        ages = {t.number: age for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if (age := _ownerless_age_s(t, now)) is not None and age < ownerless_after_s}
        if not ages:
            return
        if polls == 1 and log is not None:  # (not at once: a live process's trial gets its owner meanwhile)
            left = ownerless_after_s - min(ages.values())
            log(f"trial(s) {', '.join(map(str, ages))} have no owner process: waiting up to "
                f"{left:.0f} s for one to claim them before they are retried (a process that died as it began them)")
        time.sleep(poll_s)


def _ownerless_age_s(t, now: datetime.datetime) -> float | None:
    """Seconds since Optuna created ``t`` (``datetime_start``: the creating process's local time), where ``t`` has no
    owner yet (study._Objective.start writes it first); None where it has one, or no start."""
    if t.user_attrs.get(OWNER_ATTR) or t.datetime_start is None:
        return None
    return (now - t.datetime_start).total_seconds()


def measured_latency(t) -> float | None:
    """The latency a trial recorded where its measurement ended and passed (status "ok", written last, after the
    latency and the config: study._record); None where it has none."""
    ua = t.user_attrs
    latency = ua.get(LATENCY_ATTR)
    if ua.get("status") == "ok" and "config" in ua and isinstance(latency, (int, float)) and math.isfinite(latency):
        return float(latency)
    return None


def recover_orphans(study: optuna.Study, kept: list[int] | None = None,
                    ownerless_after_s: float = GRACE_PERIOD_S) -> list[int]:
    """Fail the RUNNING trials whose owner process on this host is dead, and queue each for one retry; queue one
    retry, too, for each trial that Optuna failed when its process was interrupted mid-trial (Ctrl-C, interrupted())
    and that has none yet. Returns their numbers. A RUNNING trial whose measurement had ended (its process died
    writing the trial's end: a journal's torn last record) ends as it was measured instead, with no retry: COMPLETE
    with its recorded latency, or FAIL with the status that says why; its number goes to ``kept``, as does that of a
    failed one with a result (measured_latency), whose retry is a copy with that result (RetryOnce). A RUNNING trial
    with no owner, started over ``ownerless_after_s`` ago, is a dead process's too: its process died between
    Optuna's creating the trial and the objective's first write, which a live one makes in well under a second.
    Safe to run from several processes: only the one whose end lands retries a RUNNING trial (an interrupted one
    retried twice at once is measured once: its copies launch the same kernels)."""
    lost = []
    now = datetime.datetime.now()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = t.user_attrs.get(OWNER_ATTR)
        if owner:
            if owner_alive(owner) is not False:
                continue
        elif (age := _ownerless_age_s(t, now)) is None or age < ownerless_after_s:
            continue
        status, latency = t.user_attrs.get("status"), measured_latency(t)
        measured = latency is not None  # (a study begun before session 50 wrote the status first: no latency)
        try:
            if measured:
                study.tell(t.number, latency)
            else:
                study.tell(t.number, state=TrialState.FAIL)
        except Exception:  # noqa: BLE001 - another process ended it first
            continue
        if measured or status not in (None, "ok"):
            if kept is not None:
                kept.append(t.number)
            continue
        _retry(study, study.trials[t.number])
        lost.append(t.number)
    trials = study.get_trials(deepcopy=False)
    retried = {t.system_attrs.get("failed_trial") for t in trials}
    for t in trials:
        if (interrupted(t) and t.number not in retried
                and t.system_attrs.get("failed_trial") is None):  # (a retry is not retried again)
            _retry(study, t)  # (a copy with its result where it has one: RetryOnce)
            if measured_latency(t) is None:
                lost.append(t.number)
            elif kept is not None:
                kept.append(t.number)
    return sorted(lost)


def _retry(study: optuna.Study, trial) -> None:
    """Queue one retry of the failed ``trial`` (_retry_callback)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _retry_callback()(study, trial)
