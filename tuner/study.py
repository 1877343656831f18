"""`tune decoder`: the Optuna study over per-kernel tiles and (overlap, prefetch) ratios, and its run folder.

Strategy: one joint TPE (multivariate) study over every kernel's parameters. Its first trials are
enqueued: the baseline (default tiles, every pair at (-1,-1)), and the hand-picked tiles with and
without PDL + full prefetch, so every speedup is against a baseline measured in the same run and TPE
starts from a known-good region. Parameters that clamp to an already-measured config reuse that result.

One study may be shared by several processes (``tune decoder --workers N``, or the same command on
several hosts): the trial budget is the study's, counted from the storage (``counts_against_budget``),
so the processes together run exactly ``--trials`` trials. A process killed mid-trial leaves a FAIL
trial that does not count and one retry of it (tuner.storage).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import optuna
from optuna.trial import TrialState

from tuner import manifest
from tuner.config import GEMMS, ConfigError, DecoderConfig
from tuner.evaluate import TrialResult
from tuner.kernels import cluster_gemm
from tuner.layer import default_config, idle_kernels, launch_key, qkv_attn_error, unlaunched_kernels
from tuner.shapes import DecoderShape
from tuner.space import SearchSpace, from_config, suggest, to_config, trial_params
from tuner.storage import (LATENCY_ATTR, OWNER_ATTR, TIME_ATTRS, await_owners, default_url, interrupted, open_storage,
                           owner_alive, recover_orphans, redact, this_owner)
from tuner.worker import WorkerStartError, one_line

SAMPLERS = ("tpe", "random", "grid", "cmaes", "gp", "qmc")
# Samplers that draw only FloatDistribution/IntDistribution parameters together; a categorical one goes to their
# independent sampler (random). And the packages Optuna's samplers import when they first draw.
NUMERIC_ONLY = ("cmaes", "qmc")
NEEDS = {"cmaes": ("cmaes",), "qmc": ("scipy",), "gp": ("scipy",)}
MAX_GRID = 1_000_000
SEEDING_ATTR = "seeding"  # the study's user attribute: the owner (tuner.storage.this_owner) of its creator


class StudyError(ValueError):
    pass


def make_sampler(name: str, seed: int, space: SearchSpace, pdl: bool, parallel: bool = False):
    import warnings

    with warnings.catch_warnings():  # the user chose the sampler: Optuna's "experimental" notes are noise here
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return _sampler(name, seed, space, pdl, parallel)


def _sampler(name: str, seed: int, space: SearchSpace, pdl: bool, parallel: bool):
    if name == "tpe":
        # constant_liar: with several workers, a running trial counts as a bad result for the others'
        # proposals, so two GPUs do not measure the same region at once.
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=10, constant_liar=parallel)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name in NUMERIC_ONLY and all(d.choices is not None for d in space.params(pdl).values()):
        raise StudyError(f"--sampler {name} draws only numeric ranges, and every parameter of this search space is a "
                         "list of choices: Optuna would draw them all at random. Use tpe, gp or random, or a "
                         "--search-space with {low, high} ratio ranges")
    missing = [m for m in NEEDS.get(name, ()) if importlib.util.find_spec(m) is None]
    if missing:  # (else every trial fails in the sampler: ModuleNotFoundError)
        raise StudyError(f"--sampler {name} needs the Python package {' and '.join(missing)} (pip install "
                         f"{' '.join(missing)})")
    if name == "qmc":
        return optuna.samplers.QMCSampler(seed=seed, warn_independent_sampling=False)
    if name == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    if name == "grid":
        grid = {}
        for k, d in space.params(pdl).items():
            if d.choices is None:
                raise StudyError("--sampler grid needs categorical choices only (no continuous ratio ranges)")
            grid[k] = list(d.choices)
        size = math.prod(len(v) for v in grid.values())
        if size > MAX_GRID:  # GridSampler lists every point up front: the default space would not fit in memory
            raise StudyError(f"--sampler grid: the search space has {size:.2g} points (at most {MAX_GRID:.0e}); "
                             "give a small --search-space or another sampler")
        return optuna.samplers.GridSampler(grid, seed=seed)
    raise StudyError(f"unknown sampler {name!r}: choose one of {', '.join(SAMPLERS)}")


def study_name(shape: DecoderShape, dtype: str, device_name: str, l2: str, replayed: bool) -> str:
    """A study's identity: shape, dtype, GPU model and L2 policy (workers must match all of them)."""
    name = f"decoder-{shape.spec}-{dtype}-{device_name.replace(' ', '_')}-{l2}"
    return name + ("-replay" if replayed else "")


def config_hash(cfg: DecoderConfig, shape: DecoderShape) -> str:
    """What a measured configuration launches (tuner.layer.launch_key: fields no launch reads left out and, on
    ``shape``, the GEMMs' ratios as their launches read them), hashed: the study measures once each set of launches,
    and a trial that repeats one reuses its measurement. Every hash a study compares is taken on its shape."""
    return hashlib.sha1(json.dumps(launch_key(cfg, shape), sort_keys=True).encode()).hexdigest()[:12]


def stored_hash(trial, shape: DecoderShape) -> str | None:
    """:func:`config_hash` of the configuration a stored trial measured (its ``config`` attribute), recomputed: a study
    continued from an older tuner, whose hash kept fields no launch reads, then merges what launches the same. The
    stored ``config_hash`` where the configuration does not load."""
    attrs = trial.user_attrs
    if "config" in attrs:
        try:
            return config_hash(DecoderConfig.from_dict(attrs["config"]), shape)
        except (ConfigError, KeyError, TypeError, ValueError):
            pass
    return attrs.get("config_hash")


@dataclass
class StudyOptions:
    trials: int = 120  # the study's total budget, shared by every worker process
    # seconds of search, per process; None: the whole budget (the command line's default time limit applies only where
    # neither --trials nor --timeout is given, cli.DEFAULT_TIMEOUT_S)
    timeout_s: float | None = None
    sampler: str = "tpe"
    seed: int = 0
    storage: object = None  # a URL (sqlite:///..., postgresql://..., journal:PATH) or an Optuna storage
    study_name: str | None = None
    top_k: int = 10
    dtype: str = "float16"
    l2: str = "cold"
    remeasure_rounds: int = 40
    progress: bool = True
    workers: int = 1  # study processes sharing the study (recorded in the manifest)
    # compile workers of each study process (tuner.worker.Compilers, _search_pipelined); 1: none, each candidate
    # compiles in the measuring worker (as does every candidate of a replay)
    compilers: int = 1
    worker_index: int = 0  # this process's index: its sampler seed is seed + index, so workers differ
    # TPE only: after every ``local_every``-th trial, queue a neighbour of the best trial so far (one
    # categorical parameter moved to an adjacent choice); 0 = off. See neighbour().
    local_every: int = 2
    # Correctness checks of each top-k config before its re-measurement, on fresh input (0: none; a replay checks
    # nothing). A trial is checked once; a race caught only part of the time passes one check often.
    rechecks: int = 5


@dataclass
class SearchTimes:
    """Where a process's search spent its time (the line `tune decoder` prints when its search ends): the
    measurements it made and their seconds in the measuring worker; with compile workers, the seconds it waited with
    nothing compiled to measure, and each compile's seconds in its worker."""
    measured: int = 0
    measure_s: float = 0.0
    wait_s: float = 0.0
    compiles: list = field(default_factory=list)
    compilers: int = 1

    def add(self, other: SearchTimes) -> SearchTimes:
        return SearchTimes(self.measured + other.measured, self.measure_s + other.measure_s,
                           self.wait_s + other.wait_s, self.compiles + other.compiles,
                           max(self.compilers, other.compilers))

    @property
    def compile_median_s(self) -> float | None:
        return statistics.median(self.compiles) if self.compiles else None

    def to_dict(self) -> dict:
        """The manifest's account of it (``search``, beside the search's seconds)."""
        median = self.compile_median_s
        return {"measured": self.measured, "measure_s": round(self.measure_s, 1), "compilers": self.compilers,
                **({"wait_s": round(self.wait_s, 1), "compiles": len(self.compiles),
                    "compile_median_s": round(median, 2) if median is not None else None}
                   if self.compilers > 1 else {})}

    def describe(self) -> str:
        """"N measured in M s (M/N s each), W s waiting for C compile workers (T s a compile, median)", or without
        compile workers "N measured in M s (M/N s each, compiles included)"; "" where nothing was measured."""
        if not self.measured:
            return ""
        text = (f"{self.measured} measured in {self.measure_s:.0f} s ({self.measure_s / self.measured:.2f} s each"
                + (", compiles included)" if self.compilers <= 1 else ")"))
        if self.compilers > 1:
            median = self.compile_median_s
            compile_s = f"{median:.2f} s a compile, median" if median is not None else "none compiled"
            text += f", {self.wait_s:.0f} s waiting for {self.compilers} compile workers ({compile_s})"
        return text


def _record(trial, cfg: DecoderConfig, res: TrialResult, shape: DecoderShape):
    """The measurement's attributes on ``trial`` (anything with ``set_user_attr``). The status goes last: a trial
    whose process died with the status written has the rest too, and storage.recover_orphans ends it as measured."""
    trial.set_user_attr("reason", res.reason[:500])
    trial.set_user_attr("spread_us", res.spread_us if not math.isnan(res.spread_us) else None)
    trial.set_user_attr("approximated", res.approximated)
    if res.served_from is not None:  # (a replay)
        trial.set_user_attr("served_from", res.served_from)
    trial.set_user_attr("config_hash", config_hash(cfg, shape))
    trial.set_user_attr("config", cfg.to_dict())
    trial.set_user_attr(LATENCY_ATTR, res.latency_us if res.status == "ok" else None)
    trial.set_user_attr("status", res.status)


def _record_crash(trial, e: BaseException):
    """A candidate whose evaluation raised: its trial fails with the reason, the study goes on."""
    trial.set_user_attr("reason", f"{type(e).__name__}: {' '.join(str(e).split())}"[:500])
    trial.set_user_attr("status", "crashed")  # (last, as in _record)


# ----------------------------------------------------------------------------------------------
# The budget, shared by every process of the study
# ----------------------------------------------------------------------------------------------

def counts_against_budget(t) -> bool:
    """A trial that is or will be evaluated. Not counted: an interrupted one (storage.interrupted: its process was
    killed or stopped mid-trial; its retry counts instead) and a PRUNED one (a worker found the budget spent)."""
    return t.state != TrialState.PRUNED and not interrupted(t)


def spent(trials) -> int:
    """Budget spent: evaluated, running and queued trials."""
    return sum(counts_against_budget(t) for t in trials)


def evaluated(trials) -> int:
    """Trials with a result (what the progress bar and the tables count)."""
    return sum(t.state.is_finished() and counts_against_budget(t) for t in trials)


def _budget_done(study, budget: int, trials=None) -> bool:
    trials = study.get_trials(deepcopy=False) if trials is None else trials
    return spent(trials) >= budget and not any(t.state == TrialState.WAITING for t in trials)


# ----------------------------------------------------------------------------------------------
# Opening the study, searching, and the whole run
# ----------------------------------------------------------------------------------------------

def _device_name(evaluator) -> str:
    return getattr(evaluator, "device_name", None) or evaluator.device.name


def storage_url(opts: StudyOptions, out_root: Path) -> str:
    """What the manifest records as the storage."""
    if opts.storage is None:
        return default_url(out_root, opts.workers)
    return redact(opts.storage) if isinstance(opts.storage, str) else type(opts.storage).__name__


# What an identity's fingerprints stand for, in the refusal's words.
_FINGERPRINTS = {"space": "another search space", "recording": "another replay recording"}


def _check_identity(study, ident: dict) -> None:
    """Refuse a process whose shape, dtype, GPU model, L2 policy, search space or replay recording differs from the
    study's: its trials would not be comparable, or (another space) Optuna would fail every one of them. A study
    written before a key was recorded takes this process's value for it; but for the recording, which its trials
    tell (a replayed trial's reason says so): replayed and measured timings never share a study."""
    old = study.user_attrs.get("identity") or {}
    done = [] if "recording" in old else study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if "recording" not in old and (old or done):  # (written before the key: what its trials say they are)
        replayed = any(str(t.user_attrs.get("reason", "")).startswith("replayed") for t in done)
        # (a replay's takes, as before the key, the recording of the process that continues it)
        old = {**old, "recording": (ident.get("recording") or "unnamed") if replayed else None}
    if (old.get("recording") is None) != (ident.get("recording") is None) and "recording" in old:
        held, here = (("measured", "replays a recording") if old["recording"] is None else
                      ("replayed (served from a recording)", "measures on the GPU"))
        raise StudyError(f"study {study.study_name!r} holds {held} timings and this process {here}: the two are "
                         "never mixed in one study; its trials are kept; give another --out or --study-name")
    # nvcc (a Hopper GPU's measured run: whether it builds the CUDA kernels) goes one way only. A study that measured
    # them cannot go on where they do not build: its top configurations would be re-measured on the Triton kernels
    # that cluster_gemm.usable falls back to, under their names. The other way its trials stay what they measured.
    if old.get("nvcc") and ident.get("nvcc") is False:
        raise StudyError(f"study {study.study_name!r} ran where nvcc builds the CUDA kernels, and this process has "
                         "no nvcc (PATH or $CUDA_HOME/bin): its configurations would not be re-measured as themselves; "
                         "its trials are kept; install the CUDA toolkit, or give another --out or --study-name")
    if "nvcc" in ident:
        ident = dict(ident, nvcc=bool(old.get("nvcc")) or ident["nvcc"])
    diff = {k: v for k, v in ident.items() if k in old and old[k] != v and k != "nvcc"}
    if not diff:
        if {**old, **ident} != old:
            study.set_user_attr("identity", {**old, **ident})
        return
    if "gpu" in diff:
        raise StudyError(f"study {study.study_name!r} runs on {old.get('gpu')}, this process on {ident['gpu']}: "
                         "workers of one study must use the same GPU model (or give another --study-name)")
    words = ", ".join(f"{_FINGERPRINTS[k]} ({old[k]}, here {v})" if k in _FINGERPRINTS else f"{k} {old[k]!r} "
                      f"(here {v!r})" for k, v in diff.items())
    raise StudyError(f"study {study.study_name!r} was started with {words}: its trials are kept; give another --out "
                     "or --study-name")


def _enqueue_first_trials(study, shape: DecoderShape, pdl: bool, space: SearchSpace, log=print,
                          budget: int | None = None, l2_bytes: int | None = None, num_sms: int | None = None) -> None:
    """The baseline and the hand-picked tiles (with and without knobs), where the space holds them; on many
    tokens, the hand-picked tiles for them too (tuner.bench.hand_picked_many), and for wide layers on ``num_sms``
    SMs, wide tiles (tuner.bench.hand_picked_wide). Every seed prefetches at most half of ``l2_bytes`` a kernel
    (tuner.bench.fit_prefetch; None: as picked).

    A seed outside a user's restricted space is not enqueued (Optuna would reject its values, and the
    search must stay inside what the user asked for); the baseline is measured anyway in the final
    phase, interleaved with the top-k, and every speedup is against that measurement.
    """
    from tuner.bench import (MANY_TOKENS, fit_prefetch, hand_picked, hand_picked_cluster, hand_picked_fused,
                             hand_picked_many, hand_picked_wide, square_split_ffn2)

    hp = hand_picked(shape)
    norm_kernels = hand_picked(shape, norms=0)
    layer = hand_picked_fused(shape)
    seeds = [(default_config(shape), {"is_baseline": True}), (hp if pdl else hp.without_knobs(), None),
             (layer if pdl else layer.without_knobs(), None)]
    if pdl:
        # the CUDA layer kernel's (Hopper), where the space holds it (search_spaces/layer-kernel.yaml)
        seeds += [(hand_picked_fused(shape, cuda=True), None), (hp.without_knobs(), None), (norm_kernels, None)]
        # The clustered seed as far as the space holds it: without the attention in QKV's kernel, with all of the
        # block's weights before the wait, without the attention in the fused feed-forward block, without the
        # out-projection there, without the block, then without the 16-bit exchange (and the attention in QKV's).
        for kw in ({}, {"qkv_attn": False}, {"block_prefetch": None}, {"attn_in": False}, {"out_proj": False},
                   {"mlp": False}, {"mlp": False, "xchg16": False}, {"mlp": False, "xchg16": False, "qkv_attn": False}):
            clustered = hand_picked_cluster(shape, **kw)
            if space.contains(from_config(clustered, pdl), pdl):
                break
        if clustered != hp:
            seeds.insert(2, (clustered, None))
            # and the same with every GEMM's L2 hints on: they act as one policy across the kernels (H100, tiny: -0.2
            # us together, within the noise one at a time), which neither a one-parameter local step nor TPE's
            # per-parameter model finds easily (two default-budget tiny runs without this seed never met it)
            hinted = replace(clustered, **{g: replace(getattr(clustered, g), hints=1) for g in GEMMS})
            if space.contains(from_config(hinted, pdl), pdl):
                seeds.insert(3, (hinted, None))
            # and the same with FFN2 in 128x128 tiles split 8 where its CTAs then stream fewer bytes (bert-large: the
            # weights read once, not once a 64-row tile; perf notes 40): four parameters from the seed's FFN2, which
            # neither the local step nor TPE's model reaches
            square = square_split_ffn2(clustered, shape)
            if square is not None and space.contains(from_config(square, pdl), pdl):
                seeds.insert(3, (square, None))
        # and the hand-picked tiles with the attention in QKV's kernel, where it runs: on bert-large the clustered
        # seed's out-projection and FFN2 are slow, and a study that meets the fusion only there may not return to it
        # (session 16's run: 3 of 62 trials; perf notes 27)
        hp_qa = replace(hp, qkv=replace(hp.qkv, fuse=1))
        if qkv_attn_error(shape, hp_qa) is None and space.contains(from_config(hp_qa, pdl), pdl):
            seeds.insert(3, (hp_qa, None))
    if shape.tokens >= MANY_TOKENS:
        seeds.insert(1, (hand_picked_many(shape), None))
    if num_sms and (wide := hand_picked_wide(shape, num_sms)) is not None:
        seeds.insert(1, (wide if pdl else wide.without_knobs(), None))
    # (a seed already in the study, queued by a process that died before it marked the study seeded, is not queued
    # again)
    queued = [t.params or t.system_attrs.get("fixed_params") or {} for t in study.get_trials(deepcopy=False)]
    enqueued = 0
    for cfg, attrs in seeds:
        if budget is not None and enqueued >= budget:  # never more seeds than the budget: none is left waiting
            break
        cfg = fit_prefetch(cfg, shape, l2_bytes)
        params = from_config(cfg, pdl)
        # What the config does not launch (the seven per-kernel configs under the one-kernel layer, the layer
        # kernel's own fields without it, an idle kernel's tiles) takes any value of the space: below 32 tokens the
        # seeds' tiles fitted to the sequence (attention 16 wide) are no choice of the default space, which left every
        # seed out of a 16-token study until session 46 (TPE then began from random tiles 3.5x slower than the
        # baseline: perf notes 57)
        unread = _unread_params(cfg)
        for name, dim in space.params(pdl).items():
            if unread(name) and dim.choices is not None and params[name] not in dim.choices:
                params[name] = dim.choices[0]
        if space.contains(params, pdl):
            if params not in queued:
                study.enqueue_trial(params, user_attrs=attrs)
            enqueued += 1
        elif attrs:
            log(f"{shape.label}: the baseline's tiles are outside {space.source}: it is measured in the final "
                "phase only")
    study.set_user_attr("seeded", True)  # (last: a process killed before this leaves the study to the next one)


def _unread_params(cfg: DecoderConfig):
    """A predicate on search-space parameter names: True for those no launch of ``cfg`` reads (``kernel.field``; a
    kernel's ``fuse`` switch is always read: it decides what runs)."""
    idle = unlaunched_kernels(cfg)  # (as launch_key counts them)

    def unread(name: str) -> bool:
        kernel, field = name.split(".", 1)
        if cfg.fused:
            return kernel != "layer"
        if kernel == "layer":
            return field != "fuse"
        return kernel in idle and field != "fuse"
    return unread


def _space_cannot_run(shape: DecoderShape, space: SearchSpace, pdl: bool) -> str | None:
    """Why no configuration of ``space`` can run ``shape`` (None when some may): a space of the CUDA layer kernel
    only (layer.fuse 2) on a shape that kernel does not take, or without Hopper's PDL. Every trial would fail."""
    from tuner.kernels import layer_cuda

    fuse = space.params(pdl).get("layer.fuse")
    if fuse is None or not fuse.choices or set(fuse.choices) != {2}:
        return None
    why = layer_cuda.problem_error(shape.tokens, shape.seq, shape.d_model, shape.heads, shape.ffn)
    if why is None and not pdl:
        why = "the CUDA layer kernel needs a Hopper GPU"
    return why and f"its only kernel is the CUDA layer kernel (layer.fuse 2), and {why}"


def open_study(shape: DecoderShape, evaluator, space: SearchSpace, opts: StudyOptions, out_root: Path,
               log=print) -> optuna.Study:
    """Create or load the study, check that this process may join it, recover the trials of dead
    processes, and queue the first trials once."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    pdl = bool(evaluator.pdl)
    why = _space_cannot_run(shape, space, pdl)
    if why:
        raise StudyError(f"{space.source} cannot run shape {shape.spec}: {why}")
    dev_name = _device_name(evaluator)
    name = opts.study_name or study_name(shape, opts.dtype, dev_name, opts.l2, evaluator.replayed)
    storage = opts.storage if opts.storage is not None else default_url(out_root, opts.workers)
    if isinstance(storage, str):
        storage = open_storage(storage)
    # (with compile workers, a process has trials in flight too: _search_pipelined)
    sampler = make_sampler(opts.sampler, opts.seed + opts.worker_index, space, pdl,
                           parallel=opts.workers > 1 or opts.compilers > 1)
    try:
        study = optuna.create_study(study_name=name, storage=storage, direction="minimize", sampler=sampler)
        study.set_user_attr(SEEDING_ATTR, this_owner())  # (first: another process then knows who queues the seeds)
        created = True
    except optuna.exceptions.DuplicatedStudyError:
        study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
        created = False
    ident = {"shape": shape.spec, "dtype": opts.dtype, "gpu": dev_name, "l2": opts.l2, "space": space.fingerprint()}
    # (None: measured; a replay's is never None, so that the two never share a study)
    ident["recording"] = (getattr(evaluator, "fingerprint", None) or "unnamed") if evaluator.replayed else None
    device = None if evaluator.replayed else getattr(evaluator, "device", None)
    if device is not None and device.capability == (9, 0):  # (where the rules ask for it: tuner.kernels._common)
        ident["nvcc"] = bool(device.nvcc)
    _check_identity(study, ident)
    # Another sampler or seed may continue a study (its trials stay comparable), but the run says so: the manifest
    # names only this run's.
    drawn = {"sampler": opts.sampler, "seed": opts.seed}
    first = study.user_attrs.get("drawn_by")
    if first is None:
        study.set_user_attr("drawn_by", drawn)
    elif first != drawn and opts.worker_index == 0:
        log(f"{shape.label}: this study began with --sampler {first.get('sampler')} --seed {first.get('seed')}; "
            f"its trials from now on are drawn with --sampler {opts.sampler} --seed {opts.seed}")
    await_owners(study, log=(lambda msg: log(f"{shape.label}: {msg}")) if opts.worker_index == 0 else None)
    kept = []
    lost = recover_orphans(study, kept)
    if lost:
        log(f"{shape.label}: trial(s) {', '.join(map(str, lost))} were interrupted (their process died or was "
            "stopped mid-trial): marked failed, retried once")
    if kept:
        log(f"{shape.label}: trial(s) {', '.join(map(str, kept))} were measured, but their process died before "
            "it recorded their end: ended as measured")
    # The first trials are queued by the process that created the study (processes started together on several
    # hosts would otherwise queue them once each), and the study is marked seeded once they all are. A study whose
    # creator died before that (killed right after it started) gets the missing ones from the next process that
    # opens it (_creator_gone).
    trials = study.get_trials(deepcopy=False)
    # (a study from before the "seeded" mark has its baseline measured; one killed while queueing has it waiting)
    seeded = study.user_attrs.get("seeded") or any(t.user_attrs.get("is_baseline") and t.state.is_finished()
                                                   for t in trials)
    if created or (not seeded and _creator_gone(study)):
        dev = _device_dict(evaluator)
        _enqueue_first_trials(study, shape, pdl, space, log, budget=search_budget(space, pdl, opts),
                              l2_bytes=dev.get("l2_bytes"), num_sms=dev.get("num_sms"))
    return study


def _creator_gone(study, wait_s: float = 2.0) -> bool:
    """Whether the process that created ``study`` died before it marked the study seeded: its owner, written right
    after the study, is a dead process of this host, or was never written (``wait_s`` allows for a creator between
    the two). A creator on another host, or alive, is left to queue the seeds itself."""
    deadline = time.monotonic() + wait_s
    while True:
        attrs = study.user_attrs
        if attrs.get("seeded"):
            return False
        if SEEDING_ATTR in attrs:
            return owner_alive(attrs[SEEDING_ATTR]) is False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.1)


def _repairer(shape: DecoderShape, evaluator):
    """params -> the config the evaluator measures for them (tuner.layer.repair_config on its GPU and dtype; a replay's:
    the recording's GPU, ReplayEvaluator.measured_on)."""
    from tuner.layer import element_bytes, repair_config

    dtype_bytes = element_bytes(getattr(evaluator, "dtype_name", None))
    device = getattr(evaluator, "measured_on" if evaluator.replayed else "device", None)
    return lambda params: repair_config(to_config(params), shape, dtype_bytes, device)


# The statuses of a measurement that a repeat of its launches does not copy but measures again (no status: the trial's
# process died; a crash or a timeout may not recur).
_REMEASURED = (None, "crashed", "timeout")


class _Objective:
    """The objective: claim a slot of the shared budget, then evaluate (or reuse a measured duplicate). In two halves
    for a pipelined search (_search_pipelined): ``start`` claims the slot and draws the configuration, ``finish``
    measures it; a call does both."""

    def __init__(self, study, shape: DecoderShape, evaluator, space: SearchSpace, budget: int, log):
        self.study, self.shape, self.evaluator, self.space, self.budget, self.log = (
            study, shape, evaluator, space, budget, log)
        self.pdl = bool(evaluator.pdl)
        self.owner = this_owner()
        done = [t for t in study.get_trials(deepcopy=False) if t.state.is_finished()]
        # config hash -> (trial number, value, user attrs) of a measured config: the stored trials', then
        # this process's (a live optuna.Trial has no .value, so the cache keeps plain values).
        self.cache = {}
        for t in done:  # (where several launch the same, the first that did not fail)
            if interrupted(t):  # (no result to reuse; its retry measures it)
                continue
            h = stored_hash(t, shape)
            if h is not None and (h not in self.cache or self.cache[h][2].get("status") in _REMEASURED):
                self.cache[h] = (t.number, t.value, dict(t.user_attrs))
        self.repaired = _repairer(shape, evaluator)
        self.times = SearchTimes()  # where this process's search spent its time (search returns it)

    def __call__(self, trial: optuna.Trial) -> float:
        started = self.start(trial)
        return started if isinstance(started, float) else self.finish(trial, started)

    def start(self, trial: optuna.Trial) -> float | DecoderConfig:
        """The configuration to measure, or the trial's value where it needs no measurement (a duplicate of a measured
        one, or a candidate that failed before its measurement). Raises TrialPruned where the budget is spent."""
        trial.set_user_attr(OWNER_ATTR, self.owner)  # who to ask whether this trial is still running
        earlier = [t for t in self.study.get_trials(deepcopy=False) if t.number < trial.number]
        if spent(earlier) >= self.budget:
            # Several processes asked for a trial at once and the others took the last slots: this one
            # is left out (PRUNED, not counted) rather than running past the budget.
            trial.set_user_attr("surplus", True)
            raise optuna.TrialPruned("the budget was spent by other workers")
        try:
            params = suggest(trial, self.space, self.pdl)
            # Tiles beyond the problem, the shared memory or the registers are moved to the nearest config
            # that runs (the trial records the config it measured); what still fails check() is invalid.
            cfg = self.repaired(params)
            reused = self.reuse(trial, cfg)
            return cfg if reused is None else reused
        except Exception as e:  # noqa: BLE001 - a trial without a status would be taken for an interrupted one
            return self._crashed(trial, e)

    def reuse(self, trial, cfg: DecoderConfig) -> float | None:
        """Where a trial of this study measured what ``cfg`` launches (and did not crash or time out), its result
        copied onto ``trial`` (``duplicate_of``: its number), as the trial's value; else None."""
        h = config_hash(cfg, self.shape)
        if h not in self.cache or self.cache[h][2].get("status") in _REMEASURED:
            return None
        number, value, attrs = self.cache[h]
        trial.set_user_attr("duplicate_of", number)
        for k, v in sorted(attrs.items(), key=lambda kv: kv[0] == "status"):  # (the status last, as in _record)
            if k not in ("is_baseline", OWNER_ATTR, "duplicate_of", "neighbour_of", "knobs_off_of", *TIME_ATTRS):
                trial.set_user_attr(k, v)
        return float(value) if value is not None else float("nan")

    def finish(self, trial: optuna.Trial, cfg: DecoderConfig) -> float:
        """Measure ``cfg`` for ``trial``: its latency, or NaN (a FAIL trial for Optuna) where the candidate failed; the
        status says why."""
        try:
            t0 = time.perf_counter()
            res = self.evaluator.evaluate(cfg)
            took = time.perf_counter() - t0
            if not self.evaluator.replayed:  # (a replay's are look-ups)
                self.times.measured += 1
                self.times.measure_s += took
                trial.set_user_attr("eval_s", round(took, 3))
            _record(trial, cfg, res, self.shape)
            value = res.latency_us if res.status == "ok" else float("nan")
            self.cache[config_hash(cfg, self.shape)] = (trial.number, value, dict(trial.user_attrs))
            return value
        except WorkerStartError:
            raise  # no worker, no trial: stop the study rather than fail every trial the same way
        except Exception as e:  # noqa: BLE001 - a trial without a status would be taken for an interrupted one
            return self._crashed(trial, e)

    def _crashed(self, trial, e: Exception) -> float:
        self.log(f"trial {trial.number}: {type(e).__name__}: {e}")
        _record_crash(trial, e)
        return float("nan")


# A GEMM's tile-shape parameters that trade off against each other: how many CTAs the GEMM launches and how much
# each streams. A step that moves one of them moves a second with it half the time, so that the search can cross a
# worse midpoint: bert-large's FFN2 from Triton 64x64 tiles split 4 (128 CTAs) to clusters of 64x128 tiles (64 CTAs)
# gains 0.2-0.5 us a layer, and the step into clusters alone (64x64 tiles, 128 CTAs) loses 2.2 (H200,
# docs/perf-notes.md section 35); the study found it only from a seed.
PAIRED = ("block_m", "block_n", "split_k", "cluster")


# The (overlap, prefetch) pairs also act as a policy across the kernels: whether the dependent kernels may launch
# early, and how much of the weights go to L2 ahead. A step sets one of the two ratios of every kernel that acts to
# one value of its grid, a step in KNOB_SWEEP: from a top-1 with every prefetch at 1.0 on 1x128x4096x32x11008,
# all at 0.2 is -15% (H200, 177.1 -> 150.9 us a layer; perf notes 37), six one-kernel steps away.
RATIOS = ("overlap_ratio", "prefetch_ratio")
KNOB_SWEEP = 0.15
# Draws of a local step before the study gives up on it for this trial: a step can land on a configuration that launches
# what the best trial does (FFN1's tiles under the one-kernel feed-forward block, which reads none of them; tiny's
# studies spent 7-8 of their ~48 measurements on such steps in sessions 29 and 35).
NEIGHBOUR_TRIES = 8


def _sweep(params: dict, dims: dict, names: list, rng) -> dict | None:
    """``params`` with one of :data:`RATIOS` set to one value for every kernel in ``names`` whose grid holds it;
    None where no value would move any."""
    field = RATIOS[int(rng.integers(len(RATIOS)))]
    cols = [n for n in names if n.partition(".")[2] == field]
    values = sorted({v for n in cols for v in dims[n].choices if v != params[n]})
    if not values:
        return None
    to = values[int(rng.integers(len(values)))]
    return {**{n: params[n] for n in dims}, **{n: to for n in cols if to in dims[n].choices}}


def _step(choices: list, value, rng):
    """The choice next to ``value`` in ``choices`` (sorted), up or down at random; at an end, the other one."""
    i = choices.index(value) if value in choices else 0
    j = i + (1 if rng.random() < 0.5 else -1)
    return choices[j if 0 <= j < len(choices) else 2 * i - j]


def neighbour(params: dict, space: SearchSpace, pdl: bool, rng, idle=frozenset()) -> dict | None:
    """``params`` with one categorical parameter moved to an adjacent choice (a local step around the
    best trial). Only parameters that act are moved: the one-kernel layer's when it is on, else the
    seven kernels' (and the switch between the two), and of the kernels in ``idle`` (not launched:
    tuner.layer.idle_kernels) only their ``fuse`` switch. The GEMMs' L2 hints (``*.hints``) move together: the
    policies act as one (H100, tiny: QKV's and FFN1's together -0.2 us, either alone -0.05 at most;
    docs/perf-notes.md section 30), so a one-kernel step would not find them; likewise one step in
    :data:`KNOB_SWEEP` sets an overlap or a prefetch ratio of every acting kernel to one value. A step in
    one of a GEMM's :data:`PAIRED` parameters moves a second of them too, half the time. A step into a cluster also
    moves the GEMM's split to the cluster kernel's smallest where it has no cluster split. None where the
    space has continuous ranges."""
    dims = space.params(pdl)
    if any(d.choices is None for d in dims.values()) or set(dims) - set(params):
        return None
    fused = params.get("layer.fuse") == 1
    names = [n for n, d in dims.items() if len(d.choices) > 1
             and (n == "layer.fuse" or n.startswith("layer.") == fused)
             and (n.partition(".")[0] not in idle or n.endswith(".fuse"))]
    if not names:
        return None
    if rng.random() < KNOB_SWEEP and (swept := _sweep(params, dims, names, rng)) is not None:
        return swept
    name = names[int(rng.integers(len(names)))]
    to = _step(sorted(dims[name].choices), params[name], rng)
    moved = [n for n in names if n.endswith(".hints") and to in dims[n].choices] if name.endswith(".hints") else [name]
    out = {**{n: params[n] for n in dims}, **{n: to for n in moved}}
    gemm, _, field = name.partition(".")
    if gemm in GEMMS and field in PAIRED and rng.random() < 0.5:
        others = [f"{gemm}.{f}" for f in PAIRED if f != field and f"{gemm}.{f}" in names]
        if others:
            second = others[int(rng.integers(len(others)))]
            out[second] = _step(sorted(dims[second].choices), params[second], rng)
            moved.append(second)
    cluster, split = gemm + ".cluster", gemm + ".split_k"
    bn = out.get(gemm + ".block_n", 64)
    if ((cluster in moved or gemm + ".block_n" in moved) and out.get(cluster, 0) != 0 and split in dims
            and cluster_gemm.split_error(out[split], bn) is not None):
        # Into a cluster from a split the cluster kernel lacks (unsplit, say, or 8 on 64-column tiles), or a clustered
        # split 8 onto 64-column tiles: with the fewest splits the kernel runs there, or repair would switch the
        # cluster off and the step would measure the same configuration or leave the cluster kernel. (bert-large's
        # out-projection in clusters of 2, -0.5 us a layer, lay two such steps from every top-1 of sessions 16-23.)
        fits = sorted(s for s in cluster_gemm.SPLITS
                      if s in dims[split].choices and cluster_gemm.split_error(s, bn) is None)
        if fits:
            out[split] = fits[0]
    return out


def _best_trial(trials):
    """The completed trial with the lowest latency; None where none has one."""
    ok = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None and not math.isnan(t.value)]
    return min(ok, key=lambda t: t.value, default=None)


def _queue_neighbour(study, space: SearchSpace, pdl: bool, opts: StudyOptions, number: int, trials,
                     repaired=None, budget: int | None = None, shape: DecoderShape | None = None) -> bool:
    """After every ``local_every``-th trial: queue a neighbour of the best so far, while the budget
    leaves room for it and the sampler's own next proposal (nothing is left waiting at the end).
    ``trials``: the study's trials as just read; ``repaired``: params -> the config measured for them
    (_repairer), whose kernels not launched the step leaves alone and whose launches it changes (local_step);
    ``budget``: the search's (default the study's); ``shape``: the study's, on which launches are compared
    (config_hash). Returns whether a trial was queued."""
    if opts.sampler != "tpe" or opts.local_every <= 0 or number % opts.local_every != opts.local_every - 1:
        return False
    budget = opts.trials if budget is None else budget
    if any(t.state == TrialState.WAITING for t in trials) or budget - spent(trials) < 2:
        return False
    best = _best_trial(trials)
    if best is None:
        return False
    import numpy as np

    # (the best trial's params went through ``repaired`` when it was evaluated: this cannot fail where that did not)
    p = local_step(best.params, space, pdl, np.random.default_rng(opts.seed + 1000 * opts.worker_index + number),
                   repaired, shape)
    if p is None:
        return False
    study.enqueue_trial(p, user_attrs={"neighbour_of": best.number})
    return True


def local_step(params: dict, space: SearchSpace, pdl: bool, rng, repaired=None,
               shape: DecoderShape | None = None) -> dict | None:
    """A :func:`neighbour` of ``params`` that launches something else: ``repaired`` (params -> the config measured
    for them, _repairer) names the kernels that are not launched, and a draw whose config launches what ``params``
    do (:func:`config_hash` on ``shape``, the study's: given with ``repaired``) is drawn again,
    :data:`NEIGHBOUR_TRIES` times at most. None where no draw moves."""
    if repaired is not None and shape is None:
        raise TypeError("local_step: repaired needs the study's shape, on which launches are compared")
    here = repaired(params) if repaired is not None else None
    idle = idle_kernels(here) if here is not None else frozenset()
    launches = config_hash(here, shape) if here is not None else None
    for _ in range(NEIGHBOUR_TRIES):
        p = neighbour(params, space, pdl, rng, idle)
        if p is None or here is None or config_hash(repaired(p), shape) != launches:
            return p
    return None


def _twin_ratios(space: SearchSpace, pdl: bool) -> list[str] | None:
    """The ratio parameters knobs_off_twin sets to -1.0; None where there is no twin to measure (no PDL, or a ratio
    without -1.0 in its grid)."""
    dims = space.params(pdl)
    ratios = [n for n in dims if n.partition(".")[2] in RATIOS]
    if not pdl or not ratios or any(dims[n].choices is None or -1.0 not in dims[n].choices for n in ratios):
        return None
    return ratios


def search_budget(space: SearchSpace, pdl: bool, opts: StudyOptions) -> int:
    """The trials the search may spend: the study's budget, less the one knobs_off_twin keeps for itself."""
    return opts.trials - (1 if opts.trials >= 2 and _twin_ratios(space, pdl) else 0)


def compile_spec(evaluator):
    """The compile workers' EvaluatorSpec for ``evaluator``'s candidates (tuner.evaluate.CompileEvaluator on its shape,
    dtype and seed), or None where its candidates compile nothing (a replay) or it names no GPU evaluator."""
    from tuner.worker import EvaluatorSpec

    if evaluator.replayed:
        return None
    spec = getattr(evaluator, "spec", None)
    if spec is None:  # (an evaluator in this process)
        if type(evaluator).__name__ != "GpuEvaluator":
            return None
        kw = dict(shape=evaluator.shape, dtype=evaluator.dtype_name, seed=evaluator.seed)
    else:
        if spec.kind == "faults":  # (test-only: a GPU evaluator with defects)
            spec = spec.kwargs["inner"]
        if spec.kind != "gpu":
            return None
        kw = {k: spec.kwargs[k] for k in ("shape", "dtype", "seed") if k in spec.kwargs}
    return EvaluatorSpec("compile", kw)


def compile_env(evaluator) -> dict[str, str] | None:
    """The environment of ``evaluator``'s compile workers: its own GPU pin (an isolated evaluator's worker env; in this
    process, the current device where it is not the first visible one), so that they compile on its GPU."""
    if getattr(evaluator, "spec", None) is not None:
        return dict(getattr(evaluator, "env", None) or {})
    import torch

    i = torch.cuda.current_device()
    if i == 0:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(k) for k in range(torch.cuda.device_count())]
    return {"CUDA_VISIBLE_DEVICES": ids[i].strip()}


def search(study, shape: DecoderShape, evaluator, space: SearchSpace, opts: StudyOptions, log=print,
           budget: int | None = None, timeout_s: float | None = None, compilers=None) -> SearchTimes:
    """Run trials until ``budget`` (default: search_budget) is spent (by this process and every other) or
    ``timeout_s`` (default: the options') has passed. With TPE, every ``local_every``-th trial is followed by a
    neighbour of the best (_queue_neighbour). With ``opts.compilers`` of 2 or more (and a GPU evaluator), or a
    tuner.worker.Compilers pool given, the trials are pipelined: _search_pipelined. Returns where its time went."""
    pdl = bool(evaluator.pdl)
    budget = search_budget(space, pdl, opts) if budget is None else budget
    timeout_s = opts.timeout_s if timeout_s is None else timeout_s
    if _budget_done(study, budget):
        return SearchTimes()
    objective = _Objective(study, shape, evaluator, space, budget, log)
    bar = progress_bar(study, opts.trials, shape.label) if opts.progress else None
    t0 = time.time()
    repaired = _repairer(shape, evaluator)

    def after_trial(st, tr) -> bool:
        """Whether the budget is spent."""
        # One read of the trial list serves the rest of the hook (again only after it queued a trial).
        recover_orphans(st)  # a sibling process may have died mid-trial (it reads the running ones)
        trials = st.get_trials(deepcopy=False)
        if _queue_neighbour(st, space, pdl, opts, tr.number, trials, repaired, budget, shape):
            trials = st.get_trials(deepcopy=False)
        if bar is not None:
            update_progress(bar, st, timeout_s - (time.time() - t0) if timeout_s else None, trials)
        return _budget_done(st, budget, trials)

    own = None
    if compilers is None and opts.compilers > 1 and (spec := compile_spec(evaluator)) is not None:
        from tuner.worker import TRIAL_TIMEOUT_S, Compilers

        compilers = own = Compilers(spec, opts.compilers, env=compile_env(evaluator),
                                    compile_timeout_s=getattr(evaluator, "trial_timeout_s", TRIAL_TIMEOUT_S))
    try:
        if compilers is not None:
            objective.times.compilers = compilers.n
            _search_pipelined(study, objective, compilers, timeout_s, after_trial)
        else:
            # catch=(): the objective gives every failing candidate its status itself; what still escapes
            # (no worker, Ctrl-C) must stop the study, not be counted as a trial.
            study.optimize(objective, n_trials=None, timeout=timeout_s,
                           callbacks=[lambda st, tr: after_trial(st, tr) and st.stop()], catch=())
    finally:
        if own is not None:
            own.close()
        if bar is not None:
            bar.close()
        if compilers is not None and compilers.start_errors:  # (the search ran, slower: say why)
            log(f"warning: {len(compilers.start_errors)} compile worker start(s) failed, their candidates compiled "
                f"while measured; first: {compilers.start_errors[0]}")
    return objective.times


def _search_pipelined(study, objective: _Objective, compilers, timeout_s: float | None, after_trial) -> None:
    """The search with its compiles in ``compilers``' workers: up to ``compilers.n`` trials are asked ahead and
    compiled side by side; each is measured (``objective.finish``, the one evaluator, one at a time) as soon as its
    compile ends, then told, so the measuring worker meets kernels already compiled (docs/perf-notes.md section 67).
    The sampler sees the trials still compiling as running ones (TPE's constant liar). Trials that need no
    measurement (a duplicate, a spent budget) end at once; one that launches what a trial in flight launches waits for
    its measurement and copies it. At the timeout, the trials still compiling end PRUNED and
    ``surplus`` (never measured, not counted); where the budget is spent, those in flight are measured (they are
    within it). A measurement that raises (no worker, Ctrl-C) ends its trial FAIL with no status (retried on
    resume, as under study.optimize) and the rest PRUNED, and stops the search. The objective's ``times`` gathers the
    seconds waited for compiles and each compile's (its trial's ``compile_s``)."""
    from concurrent.futures import FIRST_COMPLETED, wait

    from optuna.storages._heartbeat import get_heartbeat_thread, is_heartbeat_enabled

    times = objective.times
    t0 = time.time()
    left = (lambda: timeout_s - (time.time() - t0)) if timeout_s is not None else (lambda: None)
    inflight = {}  # Future of its compile -> (trial, config, its heartbeat, config_hash)
    # config_hash -> [(trial, config, heartbeat)] of trials that launch what one in flight launches: measured once,
    # then copied (objective.reuse), as a sequential search copies a measured duplicate
    repeats: dict[str, list] = {}
    done = False

    def submit(trial, cfg, beat, h):
        if any(h == other[3] for other in inflight.values()):
            repeats.setdefault(h, []).append((trial, cfg, beat))
        else:
            inflight[compilers.submit(cfg)] = (trial, cfg, beat, h)

    def tell(trial, value=None, state=None, beat=None):
        if beat is not None:
            beat.join()
        if state is None and (value is None or math.isnan(value)):
            state = TrialState.FAIL  # (as study.optimize ends a trial whose objective returned NaN)
        return study.tell(trial, None if state is not None else value, state=state, skip_if_finished=True)

    try:
        while True:
            while not done and len(inflight) < compilers.n and (left() is None or left() > 0):
                if is_heartbeat_enabled(study._storage):  # (as study.optimize does before each trial)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                        optuna.storages.fail_stale_trials(study)
                if _budget_done(study, objective.budget):  # (the trials in flight take its last slots)
                    done = True
                    break
                with warnings.catch_warnings():  # (this loop beats for its trials itself: `beat` below)
                    warnings.filterwarnings("ignore", "Heartbeat of storage is supposed to be used with Study.optimize")
                    trial = study.ask()
                try:
                    started = objective.start(trial)
                except optuna.TrialPruned:  # (another process took the last slot meanwhile)
                    done = after_trial(study, tell(trial, state=TrialState.PRUNED))
                    continue
                except BaseException:
                    tell(trial, state=TrialState.FAIL)
                    raise
                if isinstance(started, float):  # (measured before, or failed before its measurement)
                    done = after_trial(study, tell(trial, started))
                    continue
                beat = get_heartbeat_thread(trial._trial_id, study._storage)
                beat.start()
                submit(trial, started, beat, config_hash(started, objective.shape))
            if not inflight:
                return
            waited = time.perf_counter()
            ready, _ = wait(list(inflight), timeout=left() if not done else None, return_when=FIRST_COMPLETED)
            times.wait_s += time.perf_counter() - waited
            if not ready:  # the time is up: what still compiles is dropped (the finally below)
                return
            # One at a time, each followed by the next ask: a neighbour that after_trial queues takes the slot its
            # trial freed (several told at once would queue one neighbour for all of them).
            compiled = min(ready, key=lambda f: inflight[f][0].number)
            trial, cfg, beat, h = inflight.pop(compiled)
            if compiled.exception() is None and not math.isnan(seconds := compiled.result().seconds):
                times.compiles.append(seconds)
                trial.set_user_attr("compile_s", round(seconds, 3))
            try:
                value = objective.finish(trial, cfg)
            except BaseException:
                tell(trial, state=TrialState.FAIL, beat=beat)
                raise
            done = after_trial(study, tell(trial, value, beat=beat)) or done
            for again, again_cfg, again_beat in repeats.pop(h, []):
                copied = objective.reuse(again, again_cfg)
                if copied is None:  # (it crashed or timed out: measured again, as a sequential search would)
                    submit(again, again_cfg, again_beat, h)
                else:
                    done = after_trial(study, tell(again, copied, beat=again_beat)) or done
    finally:
        for trial, _, beat, *_ in [*inflight.values(), *(r for rs in repeats.values() for r in rs)]:
            trial.set_user_attr("surplus", True)
            tell(trial, state=TrialState.PRUNED, beat=beat)


def knobs_off_twin(study, shape: DecoderShape, evaluator, space: SearchSpace, opts: StudyOptions, log=print) -> bool:
    """Measure the best trial's twin with every (overlap, prefetch) pair at (-1, -1), tiles kept, as one more trial
    (``knobs_off_of``: the best trial's number) where the study has not measured it: the final phase compares the
    two, and a top-1 slower than its own twin would be a best configuration that is not the best measured
    (1x128x4096x32x11008 on an H200: a top-1 at 178 us beside its twin at 154; perf notes 37). The search leaves
    it the budget's last trial (search_budget). Only with PDL where the space holds -1.0 for every ratio, in the
    first worker, and within the budget. The trial is evaluated here and added to the study, not queued: a
    neighbour the search queued just before its timeout would be taken first. Returns whether it ran a trial."""
    pdl = bool(evaluator.pdl)
    ratios = _twin_ratios(space, pdl)
    trials = study.get_trials(deepcopy=False)
    if ratios is None or opts.worker_index != 0 or spent(trials) >= opts.trials:
        return False
    best = _best_trial(trials)
    if best is None:
        return False
    if not set(ratios) <= set(best.params):  # (a study continued with another space)
        return False
    params = {**best.params, **{n: -1.0 for n in ratios}}
    cfg = _repairer(shape, evaluator)(params)
    launches = config_hash(cfg, shape)
    if any(stored_hash(t, shape) == launches for t in trials):
        return False

    class Attrs(dict):
        set_user_attr = dict.__setitem__

    attrs = Attrs(knobs_off_of=best.number)
    try:
        res = evaluator.evaluate(cfg)
        _record(attrs, cfg, res, shape)
        value = res.latency_us if res.status == "ok" else None
    except WorkerStartError:
        raise
    except Exception as e:  # noqa: BLE001 - as in the objective: the candidate fails, the study goes on
        log(f"{shape.label}: trial {best.number}'s twin: {type(e).__name__}: {e}")
        _record_crash(attrs, e)
        value = None
    study.add_trial(optuna.trial.create_trial(
        params=params, distributions={n: best.distributions[n] for n in params}, value=value,
        state=TrialState.COMPLETE if value is not None else TrialState.FAIL, user_attrs=dict(attrs)))
    log(f"{shape.label}: trial {best.number}'s twin with every pair at (-1, -1) "
        f"{'served from the recording' if evaluator.replayed else 'measured'}: "
        + (f"{value:.2f} us" if value is not None else attrs["status"]))
    return True


def search_and_twin(study, shape: DecoderShape, evaluator, space: SearchSpace, opts: StudyOptions,
                    log=print) -> SearchTimes:
    """search, then (first worker) knobs_off_twin, or the search again for the slot kept for the twin where there
    is no twin to measure and time is left. What `tune decoder` and each of its workers run. Returns where the
    searches' time went (the twin's measurement is not in it)."""
    t0 = time.time()
    times = search(study, shape, evaluator, space, opts, log)
    left = None if opts.timeout_s is None else opts.timeout_s - (time.time() - t0)
    if opts.worker_index == 0 and not knobs_off_twin(study, shape, evaluator, space, opts, log) and (
            left is None or left > 0):
        times = times.add(search(study, shape, evaluator, space, opts, log, budget=opts.trials, timeout_s=left))
    return times


def progress_bar(study, budget: int, label: str):
    from tqdm import tqdm

    return tqdm(total=budget, initial=evaluated(study.get_trials(deepcopy=False)), desc=label, unit="trial")


def update_progress(bar, study, seconds_left: float | None = None, trials=None) -> None:
    """Every process's trials, read from the storage (or as just read): best latency and its speedup
    over the baseline."""
    trials = study.get_trials(deepcopy=False) if trials is None else trials
    bar.n = evaluated(trials)
    ok = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    if ok:
        best = min(t.value for t in ok)
        base = next((t.value for t in ok if t.user_attrs.get("is_baseline")), None)
        text = f"best {best:.2f} us" + (f", {base / best:.2f}x" if base else "")
        bar.set_postfix_str(text + (f", <= {seconds_left:.0f}s left" if seconds_left else ""), refresh=False)
    bar.refresh()


def run_study(shape: DecoderShape, evaluator, space: SearchSpace, opts: StudyOptions, out_root: Path,
              command: list[str], log=print) -> Path:
    """Run (or continue) the study for ``shape`` and write its run folder; returns the folder."""
    study = open_study(shape, evaluator, space, opts, out_root, log)
    t0 = time.time()
    times = search_and_twin(study, shape, evaluator, space, opts, log)
    n = evaluated(study.get_trials(deepcopy=False))
    short = (f" (stopped by the time limit, {opts.timeout_s:.0f} s, before the {opts.trials}-trial budget: --trials "
             "without --timeout runs the whole budget)") if opts.timeout_s and n < opts.trials else ""
    # (where the time went; a replay's measurements are look-ups: none counted)
    spent_on = f"; this process: {times.describe()}" if times.measured else ""
    took = time.time() - t0
    log(f"{shape.label}: {n} trials in the study, search took {took:.0f}s{short}{spent_on}")
    return finish(study, shape, evaluator, space, opts, out_root, command, default_config(shape),
                  storage_url(opts, out_root), log,
                  search={"seconds": round(took, 1), **(times.to_dict() if times.measured else {})})


def trial_status(t) -> str:
    """The trial's status; "interrupted" where its process died or was stopped mid-trial (storage.interrupted)."""
    if interrupted(t):
        return "interrupted"
    return t.user_attrs.get("status", "unknown")


def trials_frame(study):
    """One row per finished trial; surplus trials (PRUNED: never evaluated) are left out."""
    import pandas as pd

    rows = []
    for t in study.trials:
        if not t.state.is_finished() or t.state == TrialState.PRUNED:
            continue
        ua = t.user_attrs
        cfg = ua.get("config")
        if not cfg and t.params:  # its evaluation raised, or it was interrupted: the parameters it was given
            try:
                cfg = to_config(trial_params(t.params)).to_dict()
            except ValueError:
                cfg = None
        row = {"number": t.number, "status": trial_status(t),
               "reason": ua.get("reason", ""), "latency_us": t.value if t.value is not None else math.nan,
               "spread_us": ua.get("spread_us") if ua.get("spread_us") is not None else math.nan,
               "approximated": bool(ua.get("approximated", False)), "is_baseline": bool(ua.get("is_baseline", False)),
               "duplicate_of": ua.get("duplicate_of", ""), "retry_of": t.system_attrs.get("failed_trial", ""),
               "neighbour_of": ua.get("neighbour_of", ""), "knobs_off_of": ua.get("knobs_off_of", ""),
               "worker_pid": (ua.get(OWNER_ATTR) or {}).get("pid", ""),
               **{k: ua[k] if ua.get(k) is not None else math.nan for k in TIME_ATTRS}}
        if "served_from" in ua:  # (a replay's trial: the recorded trial whose timing it was served)
            row["served_from"] = ua["served_from"]
        if cfg:
            for k, c in cfg["kernels"].items():
                for f, v in c.items():
                    row[f"{k}.{f}"] = v
        rows.append(row)
    df = pd.DataFrame(rows)
    if "served_from" in df.columns:  # (beside approximated; a trial number, blank where none was served)
        df.insert(df.columns.get_loc("approximated") + 1, "served_from", df.pop("served_from").astype("Int64"))
    return df


def finish(study, shape, evaluator, space, opts, out_root, command, base_cfg, storage, log,
           search: dict | None = None) -> Path:
    """Re-measure the top-k interleaved, measure baselines and knobs-off, write the run folder (``search``: the
    manifest's account of the search's time, where this process searched)."""
    import optuna.importance
    import pandas as pd

    df = trials_frame(study)
    trial_cfg = {t.number: DecoderConfig.from_dict(t.user_attrs["config"]) for t in study.trials
                 if "config" in t.user_attrs}
    ok = df[(df["status"] == "ok")]
    cfg_of = dict(trial_cfg)  # the configuration each row of the table shows
    via: set[int] = set()
    if evaluator.replayed and "served_from" in ok.columns:
        # An approximated trial was served the timing of the recorded configuration nearest it, not its own: it stands
        # in the table for that configuration, which the recording measured at that timing (as a duplicate trial shows
        # the configuration measured). Where today's code does not load that configuration, the trial's own stays, ≈.
        ok = ok.copy()
        for at, n, src in zip(ok.index, ok["number"], ok["served_from"]):
            recorded = (evaluator.recorded_config(int(src)) if n in trial_cfg and ok.at[at, "approximated"]
                        and not pd.isna(src) else None)
            if recorded is not None:
                cfg_of[n], ok.at[at, "approximated"] = recorded, False
                via.add(int(n))
    # one row for each set of launches (config_hash), the first trial that measured it (a study continued from before
    # config_hash left out what no launch reads may hold two trials of one)
    launches = ok["number"].map(lambda n: config_hash(cfg_of[n], shape) if n in cfg_of else f"trial {n}")
    ok = ok[~launches.duplicated()]
    # (a replay: on a tie the recorded configuration ranks first, and each recorded timing is shown once)
    ok = ok.sort_values(["latency_us", "approximated", "number"], kind="stable")
    if evaluator.replayed and "served_from" in ok.columns:
        ok = ok[ok["served_from"].isna() | ~ok["served_from"].duplicated()]
    if ok.empty:
        raise StudyError(f"{shape.label}: no trial passed (statuses: {df['status'].value_counts().to_dict()})")
    # Each trial passed one correctness check; the fastest are checked again before they are ranked, since a race
    # that one check missed is both fast and wrong. A config that fails is left out of the top-k and trials.csv
    # says so; the next passing trial takes its place.
    checks = 0 if evaluator.replayed else opts.rechecks
    kept, failed = [], []
    for n in ok["number"]:
        if len(kept) == opts.top_k:
            break
        why = _recheck(evaluator, cfg_of[int(n)], checks)
        if why:
            failed.append({"trial": int(n), "reason": why})
            log(f"{shape.label}: trial {int(n)} failed its re-check ({why}): left out of the top-k")
            at = df["number"] == n
            df.loc[at, "status"], df.loc[at, "reason"] = "incorrect", f"failed the final re-check: {why}"
        else:
            kept.append(n)
    if not kept:
        raise StudyError(f"{shape.label}: no trial passed its re-check (statuses: "
                         f"{df['status'].value_counts().to_dict()})")
    top = ok[ok["number"].isin(kept)]
    top_cfgs = [cfg_of[int(n)] for n in top["number"]]
    log(f"{shape.label}: " + (f"serving top-{len(top_cfgs)} and the baseline from the recording" if evaluator.replayed
                              else f"re-measuring top-{len(top_cfgs)} and the baseline, interleaved"))
    meas = evaluator.remeasure(top_cfgs + [base_cfg], rounds=opts.remeasure_rounds, anchor=len(top_cfgs))
    base = evaluator.baselines(base_cfg)
    # The baseline of the speedups: the interleaved re-measurement of (-1,-1) default tiles (each row's speedup over
    # the baseline's figure from its own group, where the stacks did not fit the GPU together: remeasure's anchor).
    base_us, base_spread = meas[-1][:2]
    rows = []
    order = sorted(range(len(top_cfgs)), key=lambda i: (meas[i][0], bool(top["approximated"].iloc[i])))
    for rank, i in enumerate(order, 1):
        lat, spr, beside = meas[i]
        tie = False
        if rows:
            prev = rows[-1]
            tie = abs(lat - prev["latency_us"]) <= spr + prev["spread_us"]
        rows.append({"rank": rank, "trial": int(top["number"].iloc[i]), "latency_us": lat, "spread_us": spr,
                     "speedup": beside / lat, "tie": tie, "config": top_cfgs[i].to_dict()})
        if evaluator.replayed:  # (≈: served the timing of the nearest recorded configuration, not its own)
            rows[-1]["approximated"] = bool(top["approximated"].iloc[i])
            rows[-1]["via_neighbour"] = int(top["number"].iloc[i]) in via  # (the recorded one, in its trial's place)
            if "served_from" in top.columns and not pd.isna(top["served_from"].iloc[i]):
                rows[-1]["served_from"] = int(top["served_from"].iloc[i])
    best_cfg = DecoderConfig.from_dict(rows[0]["config"])
    # Do the knobs pay? The re-measured top-1 against itself with every pair at (-1,-1), tiles kept,
    # interleaved A B A B in one process (the seed's 1.01x was this comparison).
    knobs_off = best_cfg.without_knobs()
    (best_us, best_spread, _), (ko_us, ko_spread, best_beside) = evaluator.remeasure(
        [best_cfg, knobs_off], rounds=opts.remeasure_rounds, anchor=0)
    # The table keeps the top-k re-measurement (one ordering, one set of ties); the pair above is reported
    # beside it (knobs_off.top1_latency_us): each ratio from the measurements taken side by side.
    topk = {"baseline_us": base_us, "baseline_spread_us": base_spread, "compile_us": base.compile_us,
            "eager_us": base.eager_us, "replayed": evaluator.replayed, "rows": rows,
            "recheck": {"checks": checks, "failed": failed},
            "knobs_off": {"latency_us": ko_us, "spread_us": ko_spread, "slowdown": ko_us / best_beside,
                          "top1_latency_us": best_us, "top1_spread_us": best_spread, "config": knobs_off.to_dict()}}
    breakdown = None
    try:
        b_best = evaluator.breakdown(best_cfg)
        b_base = evaluator.breakdown(base_cfg)
        if b_best:
            breakdown = {"best": b_best, "baseline": b_base, "floor_us": base.floor_us}
    except Exception as e:  # noqa: BLE001 - the breakdown is a report, not the result
        if "OutOfMemoryError" in f"{type(e).__name__}: {e}":  # (a worker's error arrives as its text)
            log(f"{shape.label}: no per-kernel breakdown: a kernel's cold stack (deep enough for its own weights to "
                "be 3x the L2, each layer with its activations) does not fit the GPU's memory")
        else:
            log(f"per-kernel breakdown failed: {type(e).__name__}: {e}")
    importance = None
    try:
        if (df["status"] == "ok").sum() >= 8:
            with warnings.catch_warnings(record=True) as caught:  # (Optuna's caveats go to the run's log, one line)
                warnings.simplefilter("always")
                importance = {k: float(v) for k, v in optuna.importance.get_param_importances(study).items()}
            for w in caught:
                log(f"parameter importance: {w.message}")
    except Exception as e:  # noqa: BLE001
        log(f"parameter importance failed: {type(e).__name__}: {e}")

    final = _new_run_dir(out_root / shape.label, f"{opts.sampler}{'-replay' if evaluator.replayed else ''}")
    # Written under a temporary name and renamed when complete: a killed run never leaves a run folder
    # that looks finished but lacks best.json or its tables.
    run = final.with_name(final.name + ".partial")
    dev = _device_dict(evaluator)
    searched_base = df[df["is_baseline"] & (df["status"] == "ok")]
    baselines = dict(base.to_dict(), baseline_us=base_us, baseline_spread_us=base_spread,
                     search_baseline_us=float(searched_base["latency_us"].iloc[0]) if len(searched_base) else None)
    man = manifest.make(command, kind="decoder", shape=shape.to_dict(), dtype=opts.dtype, replayed=evaluator.replayed,
                        replay_source=getattr(evaluator, "source", None), measured_on=dev,
                        policy=dict(evaluator.policy(), final=evaluator.final_policy(opts.remeasure_rounds)),
                        sampler=opts.sampler, seed=opts.seed, study_name=study.study_name,
                        budget={"trials": opts.trials, "timeout_s": opts.timeout_s},
                        storage=storage, n_trials=int((df["status"] != "interrupted").sum()),
                        search_space=space.source, baselines=baselines, statuses=df["status"].value_counts().to_dict(),
                        workers=opts.workers, compilers=opts.compilers if compile_spec(evaluator) else 1,
                        isolated=bool(getattr(evaluator, "isolated", False)), **({"search": search} if search else {}))
    if evaluator.replayed:
        man["gpu"] = evaluator.manifest.get("gpu") or dev  # the GPU the recording was made on
    else:
        man["gpu"] = measuring_gpu(man.get("gpu"), dev)
    manifest.write_json_atomic(run / "manifest.json", man)
    # each ok trial's speedup over the search's own baseline trial, timed as the trials were (the tables' speedups
    # are over the baseline re-measured beside the top-k)
    sb = baselines["search_baseline_us"]
    df.insert(df.columns.get_loc("spread_us") + 1, "speedup",
              (sb / df["latency_us"]).where(df["status"] == "ok") if sb else math.nan)
    manifest.write_text_atomic(run / "trials.csv", df.to_csv(index=False))
    manifest.write_json_atomic(run / "topk.json", topk)
    if breakdown:
        manifest.write_json_atomic(run / "breakdown.json", breakdown)
    if importance:
        manifest.write_json_atomic(run / "importance.json", importance)
    best = {"schema_version": 1, "kind": "pdl-tune best configuration", "shape": shape.to_dict(), "dtype": opts.dtype,
            "gpu": dev, "versions": {k: man.get(k) for k in ("torch", "triton", "optuna", "cuda")},
            "replayed": evaluator.replayed, **({"approximated": rows[0]["approximated"]} if evaluator.replayed else {}),
            "config": best_cfg.to_dict(), "latency_us": rows[0]["latency_us"],
            "spread_us": rows[0]["spread_us"], "baseline_us": base_us, "speedup": rows[0]["speedup"],
            "compile_us": base.compile_us, "knobs_off_us": ko_us, "policy": man["policy"]}
    manifest.write_json_atomic(run / "best.json", best)
    from tuner import report

    skipped: list[str] = []
    report.write_reports(run, skipped)  # (a plot that fails is named, and the run folder still completes)
    for line in skipped:
        log(f"{shape.label}: {line}")
    os.replace(run, final)
    return final


def _recheck(evaluator, cfg: DecoderConfig, checks: int) -> str | None:
    """Why ``cfg`` fails ``checks`` more correctness checks (the evaluator's recheck); None when it passes or
    nothing is checked (0 checks). A check that cannot run at all fails it too."""
    if not checks:
        return None
    try:
        return evaluator.recheck(cfg, checks)
    except Exception as e:  # noqa: BLE001 - a config that no longer runs fails its re-check, not the study
        return one_line(e)


def _new_run_dir(parent: Path, suffix: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run, n = parent / f"{stamp}-{suffix}", 1
    while run.exists() or run.with_name(run.name + ".partial").exists():  # two runs in one second
        n += 1
        run = parent / f"{stamp}-{suffix}-{n}"
    return run


def measuring_gpu(first: dict | None, measured_on: dict) -> dict | None:
    """The manifest's ``gpu``: the summary of this process's first GPU (manifest.environment), where it is the model
    that measured (``measured_on``); otherwise that model's own (``--gpus 2,3`` on a host whose GPU 0 is another model;
    no memory size there)."""
    if first is not None and first.get("name") == measured_on.get("name"):
        return first
    return {"name": measured_on.get("name"), "capability": measured_on.get("capability"),
            "sms": measured_on.get("num_sms"), "l2_bytes": measured_on.get("l2_bytes")}


def _device_dict(evaluator) -> dict:
    if evaluator.replayed:  # (the recording's, where it has one: a replay of this run repairs for that GPU)
        return evaluator.manifest.get("measured_on") or evaluator.manifest.get("gpu") or {"name": evaluator.device_name}
    return evaluator.device.to_dict()
