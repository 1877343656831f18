"""Test-only: an evaluator that misbehaves on chosen configs, to show that a bad candidate fails its own
trial and never the study.

It wraps another evaluator (normally the replay of ``tests/data/replay-bert-base-h200``) and, for configs
whose flat parameters match a rule (``{"qkv.block_m": 128}``), does one of:

* ``crash``: ``os._exit(11)``, as a worker aborting on a CUDA error;
* ``segfault``: SIGSEGV to itself, as a compiler or driver bug;
* ``hang``: sleeps forever, as a PDL wait that never returns;
* ``raise``: raises, as a kernel launch that fails; ``compile_error`` raises a ``CompilationError``;
* ``incorrect``: returns an ``incorrect`` result, as a racy candidate caught by the correctness check.
* ``gpu_racy``, ``gpu_oob``, ``gpu_smem`` (wrapping the real GPU evaluator): run a real defective kernel:
  FFN2 reading its input before ``gdc_wait``; the QKV GEMM writing 2 TB past its output (illegal
  address); a QKV tile that needs more shared memory than the GPU has (past the validity check).

``sleep_s`` slows every trial down; ``hang_after: N`` lets the first N evaluations through and hangs every
later one (resume tests kill or interrupt the study mid-trial: a trial that never returns is one they
cannot miss, however slowly a loaded machine polls); ``barrier: {"dir": D, "parties": N}`` holds each
evaluator's first evaluation until N evaluators (processes) have reached theirs (tests of several workers
or hosts on one study: each takes part, however late a loaded machine starts one). The command line reads
the same settings from ``PDL_TUNE_FAULTS`` (JSON: ``{"rules": [{"match": {...}, "action": "hang"}],
"sleep_s": 0.5, "hang_after": 2}``), so that a test can drive ``tune decoder`` as a subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import time

from tuner.worker import EvaluatorSpec

ENV = "PDL_TUNE_FAULTS"
ACTIONS = ("crash", "segfault", "hang", "raise", "compile_error", "incorrect", "gpu_racy", "gpu_oob", "gpu_smem")


class CompilationError(Exception):
    """Named like Triton's, so tuner.evaluate.classify files it as ``compile_error``."""


def check_rules(rules: list[dict]) -> list[dict]:
    for r in rules:
        if r.get("action") not in ACTIONS or not isinstance(r.get("match"), dict):
            raise ValueError(f"fault rule {r!r}: expected {{'match': {{param: value}}, 'action': one of {ACTIONS}}}")
    return rules


class FaultyEvaluator:
    """Every attribute and method but ``evaluate`` is the wrapped evaluator's (the final phase is clean)."""

    BARRIER_TIMEOUT_S = 120.0

    def __init__(self, inner: EvaluatorSpec, rules: list[dict] = (), sleep_s: float = 0.0,
                 hang_after: int | None = None, barrier: dict | None = None):
        self.inner = inner.build()
        self.rules = check_rules(list(rules))
        self.sleep_s = sleep_s
        self.hang_after = hang_after
        self.barrier = barrier
        self.evaluations = 0

    def __getattr__(self, name):
        return getattr(self.__dict__["inner"], name)

    def matching_action(self, cfg) -> str | None:
        from tuner.space import from_config

        params = from_config(cfg)
        for r in self.rules:
            if all(params.get(k) == v for k, v in r["match"].items()):
                return r["action"]
        return None

    def wait_at_barrier(self) -> None:
        folder = self.barrier["dir"]
        os.makedirs(folder, exist_ok=True)
        open(os.path.join(folder, str(os.getpid())), "w").close()
        deadline = time.monotonic() + self.BARRIER_TIMEOUT_S
        while len(os.listdir(folder)) < self.barrier["parties"] and time.monotonic() < deadline:
            time.sleep(0.05)

    def evaluate(self, cfg):
        from tuner.evaluate import TrialResult

        if self.barrier and not self.evaluations:
            self.wait_at_barrier()
        time.sleep(self.sleep_s)
        self.evaluations += 1
        if self.hang_after is not None and self.evaluations > self.hang_after:
            time.sleep(1e6)
        why = self.inner.invalid(cfg)
        if why:  # as on a GPU: an invalid config is refused before anything compiles or runs
            return TrialResult("invalid", reason=why)
        action = self.matching_action(cfg)
        if action == "crash":
            os._exit(11)
        if action == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        if action == "hang":
            time.sleep(1e6)
        if action == "raise":
            raise RuntimeError("injected fault: the launch failed")
        if action == "compile_error":
            raise CompilationError("injected fault: the kernel does not compile")
        if action == "incorrect":
            return TrialResult("incorrect", reason="injected fault: wrong output", rel_error=1.0)
        if action and action.startswith("gpu_"):
            return self.inner.evaluate(cfg, defect=action[len("gpu_"):])
        return self.inner.evaluate(cfg)


def wrap(spec: EvaluatorSpec, rules: list[dict] = (), sleep_s: float = 0.0,
         hang_after: int | None = None, barrier: dict | None = None) -> EvaluatorSpec:
    return EvaluatorSpec("faults", {"inner": spec, "rules": check_rules(list(rules)), "sleep_s": float(sleep_s),
                                    "hang_after": None if hang_after is None else int(hang_after),
                                    "barrier": barrier})


def from_env(spec: EvaluatorSpec) -> EvaluatorSpec:
    """``spec`` wrapped in the faults of ``PDL_TUNE_FAULTS``, or unchanged when it is not set."""
    text = os.environ.get(ENV)
    if not text:
        return spec
    try:
        d = json.loads(text)
        return wrap(spec, d.get("rules", []), d.get("sleep_s", 0.0), d.get("hang_after"), d.get("barrier"))
    except (ValueError, TypeError, AttributeError) as e:  # (json's JSONDecodeError is a ValueError)
        raise ValueError(f"{ENV}: expected a JSON object of fault settings ({e})") from None
