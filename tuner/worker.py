"""Isolated trials: candidates compile and run in a worker process that the study process supervises.

A candidate can take its process down with it: an illegal address leaves the CUDA context unusable, a
compiler bug segfaults, a racy PDL config can hang in ``griddepcontrol.wait``. ``IsolatedEvaluator``
keeps all of that in a child process (a fresh interpreter, so the study process never initialises CUDA
for a candidate and a broken context dies with the child) and turns it into the trial's status:

* no answer within the per-trial timeout -> the child is killed, the trial is ``timeout``;
* the child dies (segfault, ``os._exit``, a CUDA error that aborts) -> the trial is ``crashed`` with the
  exit code or signal;
* the candidate raised -> ``crashed`` (or ``compile_error``/``out_of_resources``), and the child is
  replaced anyway, because a CUDA error poisons the context for every later trial.

The next call starts a fresh child. The evaluator itself is named by a picklable ``EvaluatorSpec``
(kind + keyword arguments), built inside the child.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

# A normal GPU trial (compile 7 kernels, check, time a graph) takes seconds; 120 s means stuck.
TRIAL_TIMEOUT_S = 120.0
# The first trial of a fresh worker also pays CUDA init, the stack's weights and a cold Triton cache.
FIRST_TRIAL_EXTRA_S = 180.0
# Starting a worker (imports, weights) and the final phase's calls (top-k re-measure, torch.compile
# baseline) are long but bounded.
START_TIMEOUT_S = 600.0
CALL_TIMEOUT_S = 3600.0
POLL_S = 0.5


class WorkerError(RuntimeError):
    """The worker failed outside a trial: it could not start, or a re-measure/baseline call failed."""


class WorkerStartError(WorkerError):
    """The worker could not be (re)started: every later trial would fail the same way, so the study stops."""


class _WorkerDied(WorkerError):
    pass


class _WorkerHung(WorkerError):
    pass


@dataclass
class EvaluatorSpec:
    """What to build in the worker: ``gpu`` (GpuEvaluator), ``replay`` (ReplayEvaluator), ``compile``
    (CompileEvaluator: a search's compile worker) or ``faults`` (tuner.faults.FaultyEvaluator, test-only), with the
    keyword arguments of its constructor."""

    kind: str
    kwargs: dict = field(default_factory=dict)

    def build(self):
        if self.kind == "gpu":
            from tuner.evaluate import GpuEvaluator

            return GpuEvaluator(**self.kwargs)
        if self.kind == "replay":
            from tuner.evaluate import ReplayEvaluator

            return ReplayEvaluator(**self.kwargs)
        if self.kind == "compile":
            from tuner.evaluate import CompileEvaluator

            return CompileEvaluator(**self.kwargs)
        if self.kind == "faults":
            from tuner.faults import FaultyEvaluator

            return FaultyEvaluator(**self.kwargs)
        raise ValueError(f"unknown evaluator kind {self.kind!r}: expected gpu, replay, compile or faults")


def exit_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
    """Exit this process when ``parent_pid`` is gone (a ``kill -9`` of the study process must not leave a
    worker holding a GPU). A thread, so it also fires while the main thread hangs in a candidate."""

    def watch():
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class IsolatedEvaluator:
    """The evaluator interface of tuner.evaluate (evaluate, remeasure, breakdown, baselines, policy, final_policy,
    invalid, a replay's recorded_config; pdl, replayed, device, device_name, shape), served by a supervised worker
    process."""

    isolated = True

    def __init__(self, spec: EvaluatorSpec, *, trial_timeout_s: float = TRIAL_TIMEOUT_S,
                 first_trial_extra_s: float = FIRST_TRIAL_EXTRA_S, start_timeout_s: float = START_TIMEOUT_S,
                 call_timeout_s: float = CALL_TIMEOUT_S, env: dict[str, str] | None = None):
        self.spec = spec
        self.trial_timeout_s, self.first_trial_extra_s = trial_timeout_s, first_trial_extra_s
        self.start_timeout_s, self.call_timeout_s = start_timeout_s, call_timeout_s
        self.env = dict(env or {})
        self.starts = 0  # workers started so far: 1 + the number of restarts
        self._proc = self._conn = None
        self._fresh = True  # no trial finished on the current worker yet: allow for its compile time
        self.info = self._start()  # started now: the study needs the device's name and abilities first
        atexit.register(self.close)

    # What the study reads from an evaluator, taken once from the worker.
    pdl = property(lambda self: bool(self.info["pdl"]))
    replayed = property(lambda self: bool(self.info["replayed"]))
    device_name = property(lambda self: self.info["device_name"])
    shape = property(lambda self: self.info["shape"])
    source = property(lambda self: self.info["source"])
    manifest = property(lambda self: self.info["manifest"])
    fingerprint = property(lambda self: self.info.get("fingerprint"))
    dtype_name = property(lambda self: self.info.get("dtype_name"))  # (the study repairs its trials for it)
    worker_pid = property(lambda self: self.info["pid"])

    @property
    def restarts(self) -> int:
        return self.starts - 1

    @property
    def device(self):
        from tuner.device import DeviceInfo

        d = self.info["device"]
        return DeviceInfo.from_dict(d) if d else None

    # ------------------------------------------------------------------ the evaluator interface

    def evaluate(self, cfg):
        from tuner.evaluate import TrialResult

        timeout = self.trial_timeout_s + (self.first_trial_extra_s if self._fresh else 0.0)
        try:
            res = self._call("evaluate", cfg.to_dict(), timeout=timeout)
        except _WorkerHung as e:
            return TrialResult("timeout", reason=str(e))
        except _WorkerDied as e:
            return TrialResult("crashed", reason=str(e))
        self._fresh = False
        if res.status == "crashed":
            self._stop()  # whatever raised may have left the CUDA context broken: the next trial starts clean
        return res

    def remeasure(self, cfgs, rounds: int = 40, anchor: int | None = None):
        return self._call("remeasure", [c.to_dict() for c in cfgs], rounds, anchor, timeout=self.call_timeout_s)

    def breakdown(self, cfg):
        return self._call("breakdown", cfg.to_dict(), timeout=self.call_timeout_s)

    def recheck(self, cfg, checks: int = 5):
        return self._call("recheck", cfg.to_dict(), checks, timeout=self.call_timeout_s)

    def recorded_config(self, number: int):  # (a replay's)
        from tuner.config import DecoderConfig

        d = self._call("recorded_config", number, timeout=self.call_timeout_s)
        return None if d is None else DecoderConfig.from_dict(d)

    def baselines(self, default, with_compile: bool = True):
        return self._call("baselines", default.to_dict(), with_compile, timeout=self.call_timeout_s)

    def invalid(self, cfg) -> str | None:
        return self._call("invalid", cfg.to_dict(), timeout=self.call_timeout_s)

    def policy(self) -> dict:
        return self._call("policy", timeout=self.call_timeout_s)

    def final_policy(self, rounds: int) -> dict:
        return self._call("final_policy", rounds, timeout=self.call_timeout_s)

    def close(self) -> None:
        """Stop the worker (also run at exit)."""
        if self._proc is None:
            return
        try:
            self._conn.send(("close", ()))
            self._proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ the worker process

    def _start(self) -> dict:
        # A fresh interpreter (not fork: CUDA must start clean; not multiprocessing's spawn either: that
        # re-runs the caller's __main__, which a notebook or an unguarded script cannot survive). It gets
        # this process's sys.path, like spawn does, and one end of a socket pair as its connection.
        ours, theirs = socket.socketpair()
        boot = ("import json, sys; sys.path[:0] = json.loads(sys.argv[2]); "
                "from tuner.worker import serve; serve(int(sys.argv[1]))")
        self._proc = subprocess.Popen([sys.executable, "-c", boot, str(theirs.fileno()), json.dumps(sys.path)],
                                      pass_fds=(theirs.fileno(),), env=dict(os.environ, **self.env),
                                      stdin=subprocess.DEVNULL)
        theirs.close()  # only the worker holds its end now
        self._conn = Connection(ours.detach())
        self.starts += 1
        self._fresh = True
        try:
            self._conn.send((self.spec, os.getpid()))
            return self._receive(self.start_timeout_s, "while starting")
        except (WorkerError, OSError) as e:
            self._stop()
            raise WorkerStartError(f"the evaluator worker did not start: {e}") from None

    def _call(self, method: str, *args, timeout: float):
        if self._proc is None:
            self.info = self._start()
        try:
            self._conn.send((method, args))
        except OSError:  # the worker died between two calls
            code = self._exitcode()
            self._stop()
            raise _WorkerDied(f"worker died before {method} ({describe_exit(code)})") from None
        return self._receive(timeout, f"in {method}")

    def _receive(self, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        # Short waits: a dead worker is noticed by its exit status too, in case a process it started
        # still holds its end of the socket open.
        while not wait([self._conn], min(POLL_S, max(0.0, deadline - time.monotonic()))):
            if self._proc.poll() is not None:
                return self._died(what)
            if time.monotonic() >= deadline:
                self._stop()
                raise _WorkerHung(f"no answer {what} within {timeout:.0f} s: worker killed")
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            return self._died(what)  # it died while answering, or just before
        if kind == "error":
            raise WorkerError(payload)
        return payload

    def _died(self, what: str):
        code = self._exitcode()
        self._stop()
        raise _WorkerDied(f"worker died {what} ({describe_exit(code)})")

    def _exitcode(self) -> int | None:
        try:
            return self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def _stop(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._conn.close()
        self._proc = self._conn = None


def auto_compilers(processes: int = 1, cpus: int | None = None) -> int:
    """How many compile workers each of ``processes`` study processes runs by default: the CPUs (this process's
    affinity) less two a process (its own and its measuring worker's), shared out, at most :data:`MAX_COMPILERS`;
    1 (compile in the measuring worker, no pool) where that leaves fewer than two."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = min(MAX_COMPILERS, (cpus - 2 * processes) // max(processes, 1))
    return n if n >= 2 else 1


# Each compile worker holds a CUDA context and one layer's weights on the GPU, and ~1 GB of host memory: the cap is
# what a GPU host is assumed to spare, not a measured optimum. 14 workers compiled 54 bert-base trials' kernels in 24 s
# where one process took 104 s, and with 12 the main job's searches were still bound by their compiles (0.7-0.9 s a
# trial against ~0.1-0.3 s of measurement; H200, 16 CPUs, docs/perf-notes.md section 67).
MAX_COMPILERS = 12


class Compilers:
    """``n`` compile workers (each an :class:`IsolatedEvaluator` of a ``compile`` spec: tuner.evaluate.CompileEvaluator)
    that compile candidates' kernels into the machine's caches side by side while the measuring worker times
    others: a candidate compiled here is measured without compiling (docs/perf-notes.md section 67). ``submit``
    returns a Future of the compile's TrialResult; a compile that fails, hangs or kills its worker only costs the
    measuring worker its own compile (that worker is replaced). The workers start in the background; ``close`` kills
    them (their compiles are no longer wanted)."""

    def __init__(self, spec: EvaluatorSpec, n: int, *, compile_timeout_s: float = TRIAL_TIMEOUT_S,
                 env: dict[str, str] | None = None):
        self.spec, self.n = spec, n
        self._timeout, self._env = compile_timeout_s, env
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._all: list[IsolatedEvaluator] = []
        self._lock = threading.Lock()
        self._closed = False
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="compile")
        self.started = 0  # workers started, restarts included
        self.start_errors: list[str] = []  # why each worker that did not start did not (its compile: the measurer's)

    def submit(self, cfg) -> Future:
        return self._pool.submit(self._compile, cfg)

    def _worker(self) -> IsolatedEvaluator | None:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        try:
            w = IsolatedEvaluator(self.spec, trial_timeout_s=self._timeout, first_trial_extra_s=0.0, env=self._env)
        except (WorkerError, OSError) as e:  # (OSError: the process itself could not be made, e.g. no memory to fork)
            with self._lock:
                self.start_errors.append(one_line(e))
            return None
        with self._lock:
            self.started += 1
            if self._closed:
                w.close()
                return None
            self._all.append(w)
        return w

    def _compile(self, cfg):
        from tuner.evaluate import TrialResult

        w = None if self._closed else self._worker()
        if w is None:
            return TrialResult("crashed", reason="no compile worker")
        try:
            t0 = time.perf_counter()
            res = w.evaluate(cfg)  # (a worker that died or hung is restarted by its next call)
            res.seconds = time.perf_counter() - t0
            return res
        finally:
            self._idle.put(w)

    def close(self) -> None:
        """Kill every worker now and drop the compiles not yet begun."""
        with self._lock:
            self._closed = True
            procs = [w._proc for w in self._all if w._proc is not None]
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for w in self._all:
            w.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------- inside the worker


def serve(fd: int) -> None:
    """The worker's loop (``fd``: its end of the socket): build the evaluator, then answer (method, args)
    until told to close or the study process is gone."""
    os.set_inheritable(fd, False)  # processes the candidate starts must not keep the study's socket open
    conn = Connection(fd)
    # Ctrl-C reaches the whole process group: the study process decides, the worker must not die first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec, parent_pid = conn.recv()
    exit_with_parent(parent_pid)
    try:
        ev = spec.build()
        conn.send(("ok", _describe(ev)))
    except Exception as e:  # noqa: BLE001 - reported to the study process, which raises it there
        conn.send(("error", one_line(e)))
        return
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            return
        if method == "close":
            return
        try:
            reply = ("ok", _dispatch(ev, method, args))
        except Exception as e:  # noqa: BLE001 - a failing call fails that call, not the worker
            reply = ("error", one_line(e))
        conn.send(reply)


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _describe(ev) -> dict:
    dev = getattr(ev, "device", None)
    return {"pdl": bool(ev.pdl), "replayed": bool(ev.replayed),
            "device_name": getattr(ev, "device_name", None) or dev.name,
            "device": dev.to_dict() if dev is not None else None, "shape": ev.shape,
            "source": getattr(ev, "source", None), "manifest": getattr(ev, "manifest", None),
            "fingerprint": getattr(ev, "fingerprint", None), "dtype_name": getattr(ev, "dtype_name", None),
            "pid": os.getpid()}


def _dispatch(ev, method: str, args: tuple):
    from tuner.config import DecoderConfig
    from tuner.evaluate import TrialResult, classify

    cfg = DecoderConfig.from_dict
    if method == "evaluate":
        try:
            return ev.evaluate(cfg(args[0]))
        except Exception as e:  # noqa: BLE001 - an evaluator that raises fails its trial
            status, reason = classify(e)
            return TrialResult(status, reason=reason)
    if method == "remeasure":
        return ev.remeasure([cfg(d) for d in args[0]], rounds=args[1], anchor=args[2])
    if method == "breakdown":
        return ev.breakdown(cfg(args[0]))
    if method == "recheck":
        return ev.recheck(cfg(args[0]), args[1])
    if method == "recorded_config":
        got = ev.recorded_config(args[0])
        return None if got is None else got.to_dict()
    if method == "baselines":
        return ev.baselines(cfg(args[0]), with_compile=args[1])
    if method == "invalid":
        return ev.invalid(cfg(args[0]))
    if method == "policy":
        return ev.policy()
    if method == "final_policy":
        return ev.final_policy(args[0])
    raise ValueError(f"unknown evaluator method {method!r}")
