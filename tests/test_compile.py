"""Compile-only launches and the search's compile workers (tuner.worker.Compilers, study._search_pipelined)."""

import json
import math
import time
import warnings
from dataclasses import replace
from pathlib import Path

import optuna
import pytest
import torch

from tuner import space
from tuner.evaluate import CompileEvaluator, ReplayEvaluator
from tuner.kernels import _common
from tuner.kernels import fused_layer as fk
from tuner.layer import DecoderStack, default_config, fit_config
from tuner.shapes import DecoderShape, resolve
from tuner.storage import interrupted
from tuner.study import (StudyOptions, compile_env, compile_spec, counts_against_budget, make_sampler, search, spent,
                         trials_frame)
from tuner.worker import Compilers, EvaluatorSpec, auto_compilers


HAS_GPU = torch.cuda.is_available()  # (conftest.py: without one, the kernels run in the Triton interpreter)
DEVICE = "cuda" if HAS_GPU else "cpu"
ODD = DecoderShape(1, 17, 32, 1, 90, name="odd")  # seq 17, one head of dim 32, ffn 90
REPLAY = Path(__file__).parent / "data" / "replay-bert-base-h200"
RESULTS = Path(__file__).parent.parent / "results"


def _configs(shape: DecoderShape) -> dict:
    """The default, the one-kernel layers (Triton and, on Hopper, CUDA) and, on the presets, the best configuration
    of session 55's main job (the CUDA kernels: clustered GEMMs, QKV with the attention, the feed-forward block)."""
    out = {"default": default_config(shape),
           "layer-triton": fit_config(replace(default_config(shape), layer=fk.FusedLayerConfig(fuse=1)), shape)}
    if HAS_GPU:
        out["layer-cuda"] = fit_config(replace(default_config(shape), layer=fk.FusedLayerConfig(
            fuse=2, num_stages=8, out_block_n=64, out_split_k=4, ffn2_split_k=4)), shape)
        best = sorted(RESULTS.glob(f"session55/{shape.name}/*/best.json"))
        if best:
            from tuner.config import DecoderConfig

            out["best"] = DecoderConfig.from_dict(json.loads(best[-1].read_text())["config"])
    return out


def _poisoned(st: DecoderStack) -> list:
    """Every buffer a launch writes set to NaN (DecoderStack.poison), and the one-kernel layers' sync counters as they
    are: what a launch would change."""
    syncs = [b.fused.sync.clone() for b in st.bufs if b.fused is not None]
    st.poison()
    return syncs


def test_compile_only_is_the_launch_as_a_warm_up():
    class Kernel:
        def __init__(self):
            self.calls = []

        def __getitem__(self, grid):
            return lambda *a, **kw: self.calls.append(("launch", grid, a, kw))

        def warmup(self, *a, grid, **kw):
            self.calls.append(("warmup", grid, a, kw))

    k = Kernel()
    _common.launch(k, (3, 2), 1, "x", BLOCK=64, num_warps=4, launch_pdl=True)
    assert not _common.compiling()
    with _common.compile_only():
        assert _common.compiling()
        _common.launch(k, (3, 2), 1, "x", BLOCK=64, num_warps=4, launch_pdl=True)
        with _common.compile_only():
            pass
        assert _common.compiling()  # (a nested one leaves the outer one on)
    assert not _common.compiling()
    (a, b) = k.calls
    assert a[0] == "launch" and b[0] == "warmup" and a[1:] == b[1:]


def _compile_only_run(shape: DecoderShape) -> None:
    """Each of _configs' stacks run under compile_only: every buffer stays as poisoned (no kernel ran; in the
    interpreter, none was interpreted). On the GPU, a CompileEvaluator (what a compile worker runs: one layer's
    weights under two layers) compiles the configuration first, and then neither that run nor the real one after it
    compiles anything (Triton's and nvcc's caches hold every kernel they launch, under its own key); the real run
    passes its check."""
    import triton

    from tuner.kernels import _nvcc

    compiler = CompileEvaluator(shape, device=DEVICE) if DEVICE == "cuda" else None
    for name, cfg in _configs(shape).items():
        if compiler is not None:
            assert compiler.evaluate(cfg).status == "ok", name
        compiled, built = [], []
        old_hook, old_build = triton.knobs.runtime.jit_post_compile_hook, _nvcc.build
        triton.knobs.runtime.jit_post_compile_hook = lambda *a, **kw: compiled.append(kw.get("key"))
        _nvcc.build = lambda *a, **kw: built.append(a) or old_build(*a, **kw)
        try:
            st = DecoderStack(shape, cfg, n_layers=2, dtype=torch.float16, device=DEVICE, seed=1)
            syncs = _poisoned(st)
            with _common.compile_only():
                st.run()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            for b in st.bufs:
                assert all(t.isnan().all() for t in b.all()), name
            fused = [b for b in st.bufs if b.fused is not None]
            assert all(torch.equal(s, b.fused.sync) for s, b in zip(syncs, fused)), name
            err = st.check(seed=3)
        finally:
            triton.knobs.runtime.jit_post_compile_hook, _nvcc.build = old_hook, old_build
        assert err < st.tolerance(), (name, err)
        if compiler is not None:
            assert compiled == [] and built == [], (name, len(compiled), len(built))


@pytest.mark.parametrize("shape", [ODD, resolve("tiny")], ids=lambda s: s.name)
def test_a_compile_only_run_launches_nothing(shape):
    _compile_only_run(shape)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny", "bert-base", "bert-large"])
def test_a_compile_only_run_launches_nothing_and_leaves_nothing_to_compile_on_the_gpu(name):
    _compile_only_run(resolve(name))


def test_the_compile_evaluator_compiles_and_says_why_a_candidate_fails():
    ev = CompileEvaluator(ODD, device=DEVICE)
    assert ev.evaluate(default_config(ODD)).status == "ok"
    too_big = replace(default_config(ODD), qkv=replace(default_config(ODD).qkv, block_m=48))
    res = ev.evaluate(too_big)
    assert res.status == "invalid" and "qkv" in res.reason and math.isnan(res.latency_us)


def test_compile_spec_names_the_gpu_evaluators_shape_dtype_and_seed(tmp_path):
    from tuner.worker import IsolatedEvaluator

    assert compile_spec(ReplayEvaluator(REPLAY)) is None

    class Gpu:  # what compile_spec reads of an isolated evaluator (starting a GPU worker needs a GPU)
        replayed = False
        spec = EvaluatorSpec("gpu", dict(shape=ODD, dtype="bfloat16", l2="cold", reps=30, seed=4))

    assert compile_spec(Gpu()) == EvaluatorSpec("compile", dict(shape=ODD, dtype="bfloat16", seed=4))
    assert compile_env(Gpu()) == {}  # (the workers inherit this process's environment)
    Gpu.env = {"CUDA_VISIBLE_DEVICES": "3"}  # (tune decoder --gpus 3: the measuring worker's pin)
    assert compile_env(Gpu()) == {"CUDA_VISIBLE_DEVICES": "3"}
    Gpu.spec = EvaluatorSpec("faults", dict(inner=Gpu.spec, rules=[]))
    assert compile_spec(Gpu()).kind == "compile"
    with IsolatedEvaluator(EvaluatorSpec("replay", dict(path=str(REPLAY)))) as iso:
        assert compile_spec(iso) is None


@pytest.mark.parametrize("cpus, processes, n", [(16, 1, 12), (128, 1, 12), (16, 2, 6), (8, 1, 6), (4, 1, 2),
                                                (3, 1, 1), (2, 1, 1), (16, 8, 1)])
def test_auto_compilers_leave_two_cpus_a_process(cpus, processes, n):
    assert auto_compilers(processes, cpus) == n


def _pipelined(tmp_path, evaluator, trials=10, timeout_s=None, compilers=2, compile_s=0.0):
    """A search of ``evaluator`` whose candidates compile in ``compilers`` workers (each compile ``compile_s`` longer:
    tuner.faults' sleep)."""
    from tuner import faults

    sp = space.load()
    storage = f"sqlite:///{(tmp_path / 'studies.db').as_posix()}"
    study = optuna.create_study(storage=storage, sampler=make_sampler("tpe", 0, sp, True, parallel=True))
    opts = StudyOptions(trials=trials, timeout_s=timeout_s, progress=False, compilers=compilers)
    pool = Compilers(faults.wrap(EvaluatorSpec("compile", dict(shape=evaluator.shape, device=DEVICE)),
                                 sleep_s=compile_s), compilers)
    if timeout_s is not None:  # (the workers started first: the time limit is the search's)
        for f in [pool.submit(default_config(evaluator.shape)) for _ in range(compilers)]:
            f.result(timeout=300)
    try:
        search(study, evaluator.shape, evaluator, sp, opts, log=lambda *a: None, budget=trials, compilers=pool)
    finally:
        pool.close()
    return study, pool


def test_a_pipelined_search_spends_its_budget_exactly(tmp_path):
    study, pool = _pipelined(tmp_path, ReplayEvaluator(REPLAY), trials=10, compilers=3)
    trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    assert spent(trials) == 10
    # Three in flight: the first three were asked before the first was told. How many workers that took depends on
    # the machine (a worker whose compile ended before the next ask compiles that one too: CI's 2 loaded CPUs).
    assert max(t.datetime_start for t in trials[:3]) <= trials[0].datetime_complete
    assert 1 <= pool.started <= 3
    if pool.start_errors:  # (the search holds its budget without them, as the next test checks: shown in CI's log)
        warnings.warn(f"compile workers that did not start: {pool.start_errors}")
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    counted = [t for t in trials if counts_against_budget(t)]
    assert all(t.user_attrs.get("status") == "ok" and t.user_attrs.get("owner") for t in counted)


def test_compile_workers_that_cannot_start_slow_the_search_and_say_why(tmp_path):
    sp = space.load()
    study = optuna.create_study(sampler=make_sampler("tpe", 0, sp, True, parallel=True))
    opts = StudyOptions(trials=4, progress=False, compilers=2)
    said, ev = [], _Measured(REPLAY)
    with Compilers(EvaluatorSpec("compile", dict(shape=ev.shape, device="no-such-device")), 2) as pool:
        times = search(study, ev.shape, ev, sp, opts, log=said.append, budget=4, compilers=pool)
    assert spent(study.get_trials()) == 4 and pool.started == 0 and pool.start_errors
    assert times.describe().endswith("waiting for 2 compile workers (none compiled)")
    assert [s for s in said if s.startswith("warning: ") and "compile worker start(s) failed" in s
            and "no-such-device" in s]


class _Measured(ReplayEvaluator):
    """A replay taken for a measurement (its timing recorded as a GPU evaluator's), each one ``measure_s`` long."""
    replayed = False
    measure_s = 0.05

    def evaluate(self, cfg):
        time.sleep(self.measure_s)
        return super().evaluate(cfg)


def test_a_pipelined_search_says_where_its_time_went(tmp_path):
    from tuner import faults

    sp, ev = space.load(), _Measured(REPLAY)
    study = optuna.create_study(sampler=make_sampler("tpe", 0, sp, True, parallel=True))
    opts = StudyOptions(trials=6, progress=False, compilers=2)
    with Compilers(faults.wrap(EvaluatorSpec("compile", dict(shape=ev.shape, device=DEVICE)), sleep_s=0.3), 2) as pool:
        times = search(study, ev.shape, ev, sp, opts, log=lambda *a: None, budget=6, compilers=pool)
    measured = [t for t in study.get_trials() if "eval_s" in t.user_attrs]
    assert times.measured == len(measured) >= 4 and times.compilers == 2  # (a duplicate measures nothing)
    assert all(t.user_attrs["eval_s"] >= 0.05 and t.user_attrs["compile_s"] >= 0.3 for t in measured)
    assert times.measure_s >= 0.05 * len(measured) and len(times.compiles) == len(measured)
    assert times.wait_s >= 0.3  # (6 compiles of 0.3 s in 2 workers against 0.05 s measurements: compile-bound)
    text = times.describe()
    assert text.startswith(f"{len(measured)} measured in ") and "waiting for 2 compile workers" in text
    d = times.to_dict()  # (the manifest's "search")
    assert (d["measured"], d["compilers"], d["compiles"]) == (len(measured), 2, len(measured))
    assert d["compile_median_s"] >= 0.3 and d["wait_s"] >= 0.3
    df = trials_frame(study)
    assert df["eval_s"].notna().sum() == len(measured) and (df["compile_s"] >= 0.3).sum() == len(measured)


def test_a_sequential_search_says_where_its_time_went_and_a_replay_says_nothing():
    sp = space.load()
    for ev, n in ((_Measured(REPLAY), 4), (ReplayEvaluator(REPLAY), 0)):
        study = optuna.create_study(sampler=make_sampler("tpe", 0, sp, True))
        times = search(study, ev.shape, ev, sp, StudyOptions(trials=4, progress=False), log=lambda *a: None, budget=4)
        assert times.measured == n and times.compilers == 1 and not times.compiles and times.wait_s == 0
        assert trials_frame(study)["eval_s"].notna().sum() == n and trials_frame(study)["compile_s"].isna().all()
        assert ("compiles included" in times.describe()) == bool(n) and (times.describe() == "") == (not n)
        assert set(times.to_dict()) == {"measured", "measure_s", "compilers"}  # (no compile workers: no waiting)


def test_a_compile_worker_whose_process_cannot_be_made_is_a_start_error(monkeypatch):
    import tuner.worker

    def no_fork(*args, **kwargs):  # (what subprocess.Popen raises where the host has no memory left to fork)
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(tuner.worker, "IsolatedEvaluator", no_fork)
    with Compilers(EvaluatorSpec("compile", dict(shape=ODD, device=DEVICE)), 1) as pool:
        res = pool.submit(default_config(ODD)).result(timeout=60)
    assert res.status == "crashed" and res.reason == "no compile worker"
    assert pool.start_errors == ["OSError: [Errno 12] Cannot allocate memory"] and pool.started == 0


def test_a_pipelined_search_ends_what_still_compiles_at_its_timeout_unmeasured(tmp_path):
    study, _ = _pipelined(tmp_path, ReplayEvaluator(REPLAY), trials=200, timeout_s=3.0, compilers=3, compile_s=1.0)
    trials = study.get_trials(deepcopy=False)
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    measured = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    dropped = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED]
    assert 1 <= len(measured) < 20 and dropped
    assert all(t.user_attrs.get("surplus") and "status" not in t.user_attrs for t in dropped)


def test_a_pipelined_search_stopped_mid_measurement_leaves_that_trial_to_its_retry(tmp_path):
    class Interrupted(ReplayEvaluator):
        calls = 0

        def evaluate(self, cfg):
            Interrupted.calls += 1
            if Interrupted.calls == 3:
                raise KeyboardInterrupt
            return super().evaluate(cfg)

    with pytest.raises(KeyboardInterrupt):
        _pipelined(tmp_path, Interrupted(REPLAY), trials=10, compilers=3)
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{(tmp_path / 'studies.db').as_posix()}")
    trials = study.get_trials(deepcopy=False)
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    assert [interrupted(t) for t in trials].count(True) == 1  # the one measuring: retried on resume
    assert all(t.user_attrs.get("surplus") for t in trials if t.state == optuna.trial.TrialState.PRUNED)


def test_closing_the_compilers_kills_their_workers():
    pool = Compilers(EvaluatorSpec("compile", dict(shape=ODD, device=DEVICE)), 2)
    first = pool.submit(default_config(ODD)).result(timeout=300)
    assert first.status == "ok" and math.isnan(first.latency_us)
    procs = [w._proc for w in pool._all]
    pool.close()
    assert procs and all(p.poll() is not None for p in procs)
    with pytest.raises(RuntimeError):  # (closed: no compile is taken)
        pool.submit(default_config(ODD))


def test_a_pipelined_search_takes_local_steps_as_often_as_a_sequential_one(tmp_path):
    # Each told trial is followed by the next ask, so the neighbour after_trial queues takes the slot at once
    # (telling every finished compile first queued one neighbour a batch: 16 of 120 trials on the H200 at first,
    # against ~45% in the sequential search).
    study, _ = _pipelined(tmp_path, ReplayEvaluator(REPLAY), trials=40, compilers=4)
    steps = [t for t in study.get_trials(deepcopy=False) if "neighbour_of" in t.user_attrs]
    assert len(steps) >= 12, len(steps)


def test_a_pipelined_search_measures_what_its_trials_in_flight_launch_once(tmp_path):
    # Three trials of one configuration asked together: the first is compiled and measured, the two others wait for it
    # and copy its result (duplicate_of), as a sequential search copies a measured duplicate.
    from tuner.study import config_hash

    class Counting(ReplayEvaluator):
        measured: list = []

        def evaluate(self, cfg):
            Counting.measured.append(config_hash(cfg, self.shape))
            return super().evaluate(cfg)

    ev = Counting(REPLAY)
    sp = space.load()
    study = optuna.create_study(storage=f"sqlite:///{(tmp_path / 'studies.db').as_posix()}",
                                sampler=make_sampler("tpe", 0, sp, True, parallel=True))
    params = space.from_config(default_config(ev.shape))
    for _ in range(3):
        study.enqueue_trial(params)
    opts = StudyOptions(trials=6, progress=False, compilers=3, local_every=0)
    with Compilers(EvaluatorSpec("compile", dict(shape=ev.shape, device=DEVICE)), 3) as pool:
        search(study, ev.shape, ev, sp, opts, log=lambda *a: None, budget=6, compilers=pool)
    first, *again = study.get_trials(deepcopy=False)[:3]
    assert Counting.measured.count(Counting.measured[0]) == 1 and len(Counting.measured) == 4
    assert [t.user_attrs.get("duplicate_of") for t in again] == [first.number] * 2
    assert all(t.value == first.value and t.user_attrs["status"] == "ok" for t in again)
