"""Evaluators: how a candidate DecoderConfig becomes a trial result.

``GpuEvaluator`` builds the stack on the GPU, checks it against the fp32 reference and times it in a
CUDA graph. ``ReplayEvaluator`` serves timings recorded by an earlier GPU run and always says so. The
study only talks to this interface, so search, reports and CLI are tested without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from tuner.config import KERNELS, DecoderConfig
from tuner.shapes import DecoderShape

STATUSES = ("ok", "invalid", "compile_error", "out_of_resources", "incorrect", "timeout", "crashed")


@dataclass
class TrialResult:
    status: str
    latency_us: float = math.nan
    spread_us: float = math.nan
    reason: str = ""
    rel_error: float = math.nan
    approximated: bool = False
    # a replay: the recorded trial whose timing was served (its number in the recording; the configuration's own
    # where it launches what that trial launched, its nearest recorded one's where approximated)
    served_from: int | None = None
    # the evaluation's wall seconds where the caller timed it (a compile worker's compile: tuner.worker.Compilers)
    seconds: float = math.nan

    def __post_init__(self):
        assert self.status in STATUSES, self.status


@dataclass
class Baselines:
    baseline_us: float
    baseline_spread_us: float
    eager_us: float | None = None
    compile_us: float | None = None
    floor_us: float | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def classify(exc: BaseException) -> tuple[str, str]:
    """An exception raised while compiling or running a candidate -> (status, one-line reason)."""
    name = type(exc).__name__
    msg = " ".join(str(exc).split())[:300]
    if name == "OutOfResources":
        return "out_of_resources", msg
    if name in ("CompilationError", "PTXASError", "CompileTimeAssertionFailure", "MLIRCompilationError"):
        return "compile_error", f"{name}: {msg}"
    if "out of resource" in msg.lower():
        return "out_of_resources", msg
    if name == "ValueError" and "invalid" in msg and "Config" in msg:
        # A launcher's own check() refused it: it never reached the compiler.
        return "invalid", msg
    return "crashed", f"{name}: {msg}"


class Remeasured(NamedTuple):
    """One configuration's figure from ``remeasure``: median and spread (IQR/2), us per layer, and the anchor's median
    from the same group (None where no anchor was asked for)."""
    median_us: float
    spread_us: float
    anchor_us: float | None = None


# What a re-measurement leaves free beside its stacks: the torch baselines' and the timing's own allocations.
REMEASURE_RESERVE = 2 * 2**30


def group_room(per_stack: int, free: int, reserve: int = REMEASURE_RESERVE) -> int:
    """How many more stacks of ``per_stack`` bytes fit in ``free`` bytes beside ``reserve`` (10% margin each)."""
    return max(0, int((free - reserve) // max(1.1 * per_stack, 1)))


class GpuEvaluator:
    replayed = False
    TORCH_REPS_FACTOR = 2  # the torch baselines take this many times the search's repetitions

    def __init__(self, shape: DecoderShape, *, dtype="float16", l2: str = "cold", reps: int = 30, warmup: int = 5,
                 seed: int = 0):
        import torch

        from tuner.device import DeviceInfo
        from tuner.layer import DTYPES, random_stack_weights, stack_depth

        self.shape, self.dtype_name, self.dtype = shape, dtype, DTYPES[dtype]
        self.device = DeviceInfo.from_torch()
        self.esize = torch.tensor([], dtype=self.dtype).element_size()
        self.n_layers = stack_depth(shape, self.esize, self.device.l2_bytes, l2)
        self.l2, self.reps, self.warmup, self.seed = l2, reps, warmup, seed
        self.weights = random_stack_weights(shape, self.n_layers, self.dtype, "cuda", seed)
        self._checks = 0
        self.remeasure_groups: list[list[int]] = []  # re-measurements split for memory (remeasure)
        self.remeasure_anchored: list[bool] = []  # each one's: the anchor in every group

    @property
    def pdl(self) -> bool:
        return self.device.supports_pdl

    def policy(self) -> dict:
        from tuner.timing import policy

        return policy(self.l2, self.n_layers, self.reps, self.warmup)

    def final_policy(self, rounds: int) -> dict:
        from tuner.timing import final_policy

        pol = final_policy(rounds, self.TORCH_REPS_FACTOR * self.reps, self.warmup)
        if self.remeasure_groups:  # the stacks did not fit together: each group interleaved, one after another
            pol["remeasure"]["groups"] = self.remeasure_groups
            pol["remeasure"]["anchored"] = self.remeasure_anchored
        return pol

    def _stack(self, cfg: DecoderConfig):
        from tuner.layer import DecoderStack

        st = DecoderStack(self.shape, cfg, n_layers=self.n_layers, dtype=self.dtype, weights=self.weights)
        st.capture()
        return st

    def invalid(self, cfg: DecoderConfig) -> str | None:
        from tuner.layer import check_config

        bad = check_config(cfg, self.shape, self.esize, self.device)
        return "; ".join(f"{k}: {v}" for k, v in bad.items()) or None

    # Test-only defects (tuner.faults' gpu_* actions): real kernels that fail on the real GPU.
    DEFECTS = ("racy", "oob", "smem")

    def evaluate(self, cfg: DecoderConfig, defect: str | None = None) -> TrialResult:
        from dataclasses import replace

        from tuner.timing import time_replay

        if defect:  # the defects live in the per-kernel launches
            cfg = replace(cfg, layer=replace(cfg.layer, fuse=0))
        why = self.invalid(cfg)
        if why:
            return TrialResult("invalid", reason=why)
        if defect == "racy":  # reads its input before gdc_wait, with every kernel in the PDL chain
            cfg = cfg.with_knobs(0.0, 1.0)
        if defect == "smem":  # 278528 B of shared memory as triton 3.6 compiles it for sm_90 (> 232448 B)
            cfg = replace(cfg, qkv=replace(cfg.qkv, block_m=32, block_n=512, block_k=256, num_stages=4,
                                           num_warps=8, split_k=1))
        try:
            if defect in ("racy", "oob", "smem"):
                from tuner.layer import DecoderStack

                st = DecoderStack(self.shape, cfg, n_layers=self.n_layers, dtype=self.dtype, weights=self.weights)
                if defect == "racy":
                    st.racy = (1, "ffn2")
                elif defect == "oob":
                    st.oob_layer = 1
                else:  # launched past its config check: Triton's launcher meets the real limit
                    st.unchecked = True
                st.capture()
            else:
                st = self._stack(cfg)
            err, why = self._check(st)
            if why:
                return TrialResult("incorrect", reason=why, rel_error=err)
            t = time_replay(st.replay, self.n_layers, reps=self.reps, warmup=self.warmup)
            return TrialResult("ok", t.median_us, t.spread_us, rel_error=err)
        except Exception as e:  # a failing candidate fails its trial, never the study
            status, reason = classify(e)
            return TrialResult(status, reason=reason)

    def recheck(self, cfg: DecoderConfig, checks: int = 5) -> str | None:
        """Why ``cfg`` fails one of ``checks`` more correctness checks of its captured stack, each on fresh random
        input with every buffer poisoned first (DecoderStack.check); None when all pass."""
        st = self._stack(cfg)
        for i in range(1, checks + 1):
            _, why = self._check(st)
            if why:
                return f"{why} in check {i} of {checks}"
        return None

    def _check(self, st) -> tuple[float, str | None]:
        """One correctness check of ``st`` on fresh random input (a new seed every check): its relative error, and
        why it fails (None when within the tolerance)."""
        self._checks += 1
        err = st.check(seed=self.seed * 100003 + self._checks)
        return err, (None if err < st.tolerance() else f"rel. error {err:.3g} > {st.tolerance():g}")

    def remeasure(self, cfgs: list[DecoderConfig], rounds: int = 40, anchor: int | None = None) -> list[Remeasured]:
        """Interleaved A B A B re-measurement with more repetitions.

        Each captured stack holds its own activations over the stack's depth: on a large shape (65,536 tokens of
        bert-like width: tens of GB a stack on an H200) a few do not fit the GPU together although each trial did. The
        stacks are then measured in groups that fit, each interleaved, one group after another (the first stack's
        footprint decides a group's size); ``final_policy`` records the groups. ``anchor`` (an index of ``cfgs``: the
        baseline a caller divides by) is measured in every group, so that each figure has the anchor's timing from its
        own group beside it (``Remeasured.anchor_us``; the anchor's own figure is its first group's). Where not one
        more stack fits beside the anchor's, every stack is measured alone and the anchor_us is its first figure."""
        import gc

        import torch

        from tuner.timing import time_interleaved

        n = len(cfgs)
        out: list = [None] * n
        base: list = [None] * n
        todo = [i for i in range(n) if i != anchor]
        groups = []
        alone = anchor is None  # (groups without the anchor: none given, or none fits beside it)
        while todo or not groups:
            gc.collect()
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info()[0]
            members = [todo.pop(0) if alone else anchor]
            stacks = [self._stack(cfgs[members[0]])]
            torch.cuda.empty_cache()  # (what building it cached and freed is not its footprint: session 46's call 3)
            after = torch.cuda.mem_get_info()[0]
            room = group_room(free - after, after)
            while todo and len(stacks) < 1 + room:
                try:
                    stacks.append(self._stack(cfgs[todo[0]]))
                except torch.cuda.OutOfMemoryError:  # (a larger workspace than the first stack's)
                    break
                members.append(todo.pop(0))
            if not alone and len(members) == 1 and todo:
                alone = True  # not one more stack beside the anchor's: one at a time from here
            groups.append(len(stacks))
            ts = time_interleaved([s.replay for s in stacks], [self.n_layers] * len(stacks), rounds=rounds)
            del stacks
            for i, t in zip(members, ts):
                if out[i] is None:  # (the anchor: its first group's)
                    out[i] = (t.median_us, t.spread_us)
                    base[i] = ts[0].median_us if members[0] == anchor else None
        if anchor is not None:
            base = [out[anchor][0] if b is None else b for b in base]
        if len(groups) > 1:
            self.remeasure_groups.append(groups)
            self.remeasure_anchored.append(anchor is not None and not alone)
            print(f"re-measured {n} stacks in {len(groups)} groups of {groups} (each interleaved"
                  + ("" if anchor is None else ", the baseline in each") + "; they do not fit in the GPU's memory "
                  "together)", flush=True)
        return [Remeasured(m, s, b) for (m, s), b in zip(out, base)]

    def breakdown(self, cfg: DecoderConfig) -> dict[str, float]:
        """Each kernel timed alone (all its launches across a stack in one graph), us per layer; without the first
        layer where that one launches other kernels. Under the cold policy a kernel's stack is as deep as its own
        weights need to hold 3x the L2 (layer.cold_weights): the whole layer's stack would keep QKV's and the
        out-projection's weights in L2 from one replay to the next."""
        import torch

        from tuner.layer import DecoderStack, cold_weights, kernel_weights
        from tuner.timing import capture, time_replay

        st = self._stack(cfg)
        st.replay()
        torch.cuda.synchronize()
        # Where the first layer runs other kernels (its QKV gathers the row sums no producer wrote), the layers after
        # it are the ones the figures describe.
        skip = st.first_layer_differs()
        out = {}
        for k in ("layer",) if cfg.fused else KERNELS:
            ks, launches = st, st.launches(k, skip_first=skip)
            if not launches:  # fused away: this kernel costs nothing of its own
                out[k] = 0.0
                continue
            if self.l2 == "cold":
                w = cold_weights(self.weights, kernel_weights(k, st.bufs[-1]), self.esize, self.device.l2_bytes)
                if len(w) > len(self.weights):
                    ks = DecoderStack(self.shape, cfg, n_layers=len(w), dtype=self.dtype, weights=w)
                    ks.run()  # (its buffers written once: the kernel alone reads what its producers left)
                    torch.cuda.synchronize()
                    launches = ks.launches(k, skip_first=skip)
            g = capture(lambda: [f() for f in launches], warmup=1)
            out[k] = time_replay(g.replay, ks.n_layers - int(skip), reps=self.reps, warmup=self.warmup).median_us
            del g, ks
        return out

    def baselines(self, default: DecoderConfig, with_compile: bool = True) -> Baselines:
        """The torch eager and torch.compile stacks on the same weights, each checked and timed, and the DRAM floor
        (``default`` is the study's to measure, beside its top-k)."""
        import torch

        from tuner.baselines import TorchStack
        from tuner.layer import rel_tolerance
        from tuner.timing import copy_bandwidth_bytes_per_s

        reps = self.TORCH_REPS_FACTOR * self.reps
        extra, times = {}, {}
        for name, compiled in (("eager", False), ("compile", True)) if with_compile else (("eager", False),):
            try:
                ts = TorchStack(self.shape, self.weights, self.dtype, compiled=compiled)
                # checked as every candidate is: a torch figure beside ours is the same layer, computed right
                extra[f"{name}_rel_error"] = err = ts.check(self.seed)
                if not err < rel_tolerance(self.dtype):
                    print(f"torch {name} baseline: rel. error {err:.3g} > {rel_tolerance(self.dtype):g} against the "
                          "fp32 reference (timed anyway; manifest baselines.extra)")
                times[name] = ts.time(reps, self.warmup).median_us
                del ts
            except Exception as e:  # noqa: BLE001 - a baseline that cannot compile is reported, not fatal
                if not compiled:
                    raise
                print(f"torch.compile baseline failed: {type(e).__name__}: {e}")
        torch.cuda.synchronize()
        bw = copy_bandwidth_bytes_per_s()
        extra["copy_bandwidth_bytes_per_s"] = bw
        # (the default config's own figure, baseline_us, is the study's: measured interleaved with the top-k)
        return Baselines(math.nan, math.nan, times["eager"], times.get("compile"),
                         self.shape.weight_bytes(self.esize) / bw * 1e6, extra)


class CompileEvaluator:
    """What a search's compile worker runs (tuner.worker.Compilers): ``evaluate`` compiles every kernel a candidate's
    stack launches, as GpuEvaluator's stack launches it (a first layer and a later one: they can differ), into the
    machine's caches (Triton's on disk, the CUDA kernels' nvcc builds), and launches none of them: a process that
    measures on the same GPU meets no kernel of its. Its result says only whether the compile raised; the measuring
    worker compiles again whatever is missing, and its trial's status is the one that counts."""

    replayed = False
    LAYERS = 2

    def __init__(self, shape: DecoderShape, *, dtype="float16", seed: int = 0, device: str = "cuda"):
        from tuner.device import DeviceInfo
        from tuner.layer import DTYPES, element_bytes, random_stack_weights

        self.shape, self.dtype_name, self.dtype, self.where = shape, dtype, DTYPES[dtype], device
        self.device = DeviceInfo.from_torch() if device == "cuda" else None
        self.esize = element_bytes(dtype)
        # One layer's weights under both layers: a compile needs their shapes, not their values (each worker holds
        # them beside the measuring worker's stack: 12 workers on a 7B-class layer, 3.8 GB besides their contexts).
        self.weights = random_stack_weights(shape, 1, self.dtype, device, seed) * self.LAYERS

    pdl = property(lambda self: self.device is not None and self.device.supports_pdl)
    device_name = property(lambda self: self.device.name if self.device is not None else self.where)

    invalid = GpuEvaluator.invalid  # (the measuring worker's check: shape, element size, device)

    def evaluate(self, cfg: DecoderConfig) -> TrialResult:
        from tuner.kernels._common import compile_only
        from tuner.layer import DecoderStack

        why = self.invalid(cfg)
        if why:
            return TrialResult("invalid", reason=why)
        try:
            with compile_only():
                DecoderStack(self.shape, cfg, n_layers=self.LAYERS, dtype=self.dtype, device=self.where,
                             weights=self.weights).run()
        except Exception as e:  # noqa: BLE001 - the measuring worker meets it again and classifies it
            status, reason = classify(e)
            return TrialResult(status, reason=reason)
        return TrialResult("ok")


class ReplayEvaluator:
    """Serves a recording (an earlier GPU run folder, or its trials.csv with manifest.json beside it).

    A config that was recorded gets its recorded result; any other gets the nearest recorded config's
    result (fewest differing parameters among those its launches read, then smallest index distance) and is flagged
    ``approximated``.
    """

    replayed = True

    def __init__(self, path: str | Path, shape: DecoderShape | None = None):
        import hashlib

        import pandas as pd

        from tuner.manifest import breakdown_problem, is_int, is_number, read_json, read_table, trials_cut_short

        p = Path(path)
        folder = p if p.is_dir() else p.parent
        csv = p / "trials.csv" if p.is_dir() else p
        man = folder / "manifest.json"
        if not csv.is_file() or not man.is_file():
            raise FileNotFoundError(f"replay recording {path}: needs trials.csv and manifest.json")
        self.source = str(path)

        def bad(what: str, reason: str) -> ValueError:
            return ValueError(f"replay recording {path}: {what + ' ' if what else ''}{reason}")

        def read(f: Path):
            try:
                return read_json(f)
            except ValueError as e:
                raise bad(f"{f.name}:", str(e)) from None

        if folder.name.endswith(".partial"):
            raise bad("", "is a run folder whose writing never ended (.partial); replay a whole run's folder")
        self.manifest = read(man)
        try:
            df, table = read_table(csv, with_bytes=True)  # (read once: parsed, and hashed below)
        except ValueError as e:
            raise bad(csv.name, str(e)) from None
        # what was recorded, not where: a study's identity (another recording must not join its study)
        self.fingerprint = hashlib.sha1(man.read_bytes() + table).hexdigest()[:12]
        m = self.manifest
        if not isinstance(m, dict):
            raise bad(man.name, f"must be a mapping, not {type(m).__name__}")
        for key in ("shape", "baselines"):
            if not isinstance(m.get(key), dict):
                raise bad(man.name, f"has no '{key}' mapping")
        if not is_number(m["baselines"].get("baseline_us")):
            raise bad(man.name, "has no baselines.baseline_us figure")
        if m.get("gpu") is not None and not isinstance(m["gpu"], dict):
            raise bad(man.name, f"'gpu' must be a mapping, not {type(m['gpu']).__name__}")
        g = m.get("gpu") or {}
        if not isinstance(g.get("name", ""), str):
            raise bad(man.name, "gpu.name must be text")
        cap = g.get("capability")
        if cap is not None and not (isinstance(cap, list) and cap and all(
                is_int(c) for c in cap)):
            raise bad(man.name, f"gpu.capability must be a list of integers such as [9, 0], not {cap!r}")
        l2 = g.get("l2_bytes")
        if l2 is not None and (not is_int(l2) or l2 < 0):
            raise bad(man.name, f"gpu.l2_bytes must be a number of bytes, not {l2!r}")
        if m.get("policy") is not None and not isinstance(m["policy"], dict):
            raise bad(man.name, f"'policy' must be a mapping, not {type(m['policy']).__name__}")
        from tuner.layer import DTYPES

        # what was measured, which a replay serves (tune decoder takes them for its --dtype and --l2)
        self.dtype_name, self.l2 = m.get("dtype", "float16"), (m.get("policy") or {}).get("l2", "cold")
        if not isinstance(self.dtype_name, str) or self.dtype_name not in DTYPES:
            raise bad(man.name, f"dtype {self.dtype_name!r} is not one of {', '.join(DTYPES)}")
        if self.l2 not in ("cold", "hot"):
            raise bad(man.name, f"policy.l2 {self.l2!r} is not cold or hot")
        if not 0 < m["baselines"]["baseline_us"] < float("inf"):
            raise bad(man.name, "baselines.baseline_us must be a positive number of microseconds")
        missing = [c for c in ("status", "latency_us", "spread_us") if c not in df.columns]
        if missing:
            raise bad(csv.name, f"has no {', '.join(missing)} column(s) (is it a run's trials.csv?)")
        if df.empty:
            raise bad(csv.name, "has no trials")
        if m.get("replayed"):  # its figures were served, the approximated ones from other configurations
            raise bad("", f"is itself a replay (of {m.get('replay_source') or 'a recording'}): replay the GPU run it "
                          "was served from")
        if "approximated" in df.columns and df["approximated"].astype(str).str.lower().isin(("true", "1")).any():
            raise bad(csv.name, "holds trials a replay approximated: replay the GPU run it was served from")
        cut = trials_cut_short(table, df, m)
        if cut:
            raise bad(csv.name, cut)
        for c in ("latency_us", "spread_us"):
            if not pd.api.types.is_numeric_dtype(df[c]):
                raise bad(csv.name, f"column {c} is not numeric")
        ok = df[df["status"] == "ok"]
        if ok.empty or not ok["latency_us"].between(0, float("inf"), inclusive="neither").all():
            raise bad(csv.name, "needs trials of status ok, each with a positive, finite latency_us")
        if not ok["spread_us"].between(0, float("inf"), inclusive="left").all():
            raise bad(csv.name, "needs each trial of status ok to have a spread_us of 0 or more, finite")
        from tuner.space import from_config

        # Every parameter a config has today; one the recording predates (e.g. norm*.fuse) stands at its
        # dataclass default in every recorded row, so a config that sets it otherwise is approximated.
        defaults = from_config(DecoderConfig())
        self.params = list(defaults)
        for c in self.params:
            if c not in df.columns:
                df[c] = defaults[c]
        self.rows = df
        try:
            self.keys = {self._key(r): i for i, r in enumerate(df[self.params].to_dict("records"))}
        except (TypeError, ValueError) as e:
            raise bad(csv.name, f"has a parameter value that is not a number ({e})") from None
        rec_shape = DecoderShape.from_dict(self.manifest["shape"])  # (a ShapeError, a ValueError, names what is wrong)
        self.shape = shape or rec_shape
        if shape is not None and shape.spec != rec_shape.spec:
            raise ValueError(f"replay recording {path}: recorded on shape {rec_shape.spec}, not {shape.spec}")
        bpath = folder / "breakdown.json"
        self._breakdown = read(bpath) if bpath.is_file() else None
        if self._breakdown is not None and (why := breakdown_problem(self._breakdown)):
            raise bad(bpath.name, why)
        # Whose breakdown "best" is: the recording's best.json, else (a bare trials.csv) its fastest trial.
        self._best_key = None
        try:
            best = read_json(folder / "best.json") if (folder / "best.json").is_file() else None
            self._best_key = (self._key(from_config(DecoderConfig.from_dict(best["config"]))) if best else
                              self._key(df[df["status"] == "ok"].sort_values("latency_us").iloc[0].to_dict()))
        except (ValueError, KeyError, TypeError):  # (then no breakdown is served for any config but the baseline)
            pass
        # (computed where first asked: the best's launch hash by breakdown, the rows' by _launches, their launched
        # fields by _lookup, recorded trial number -> first row by recorded_config)
        self._best_launch, self._by_launch, self._launched, self._row_of = None, None, None, None
        self.device_name = g.get("name", "unknown")  # (g: the manifest's gpu, checked above)
        # The recording's GPU as its search saw it (tuner.device.DeviceInfo): a sampled config is repaired for it
        # (study._repairer) and checked against it, so that a config the search measured is found again as itself (on
        # a GPU without nvcc the CUDA kernels were repaired away). Where it names less (a GPU's summary: no device).
        self.measured_on = None
        mo = m.get("measured_on")
        if mo is not None and not isinstance(mo, dict):
            raise bad(man.name, f"'measured_on' must be a mapping, not {type(mo).__name__}")
        if mo and {"num_sms", "smem_per_block_bytes"} <= mo.keys():
            from tuner.device import DeviceInfo

            try:
                self.measured_on = DeviceInfo.from_dict(mo)
            except (KeyError, TypeError, ValueError):
                raise bad(man.name, "measured_on must name the GPU's name, capability, num_sms, l2_bytes and "
                          "smem_per_block_bytes") from None
        self.pdl = bool(g) and (g.get("capability") or [0])[0] >= 9

    def _key(self, params: dict) -> tuple:
        return tuple(float(params.get(k, -1.0)) for k in self.params)

    def policy(self) -> dict:
        return dict(self.manifest.get("policy") or {}, replayed_from=self.source)

    def final_policy(self, rounds: int) -> dict:
        return {"replayed": "each figure is the recording's search timing of the configuration, or of the nearest "
                            "recorded one; nothing is re-measured"}

    def invalid(self, cfg: DecoderConfig) -> str | None:
        from tuner.layer import check_config

        bad = check_config(cfg, self.shape, 2, self.measured_on)
        return "; ".join(f"{k}: {v}" for k, v in bad.items()) or None

    @staticmethod
    def _loaded(params: dict, what):
        """``what`` of the configuration of recorded parameters ``params``, as today's code loads it; None where they do
        not load or ``what`` fails on them (ConfigError is a ValueError; a tile of 0 divides by zero)."""
        from tuner.space import to_config

        try:
            return what(to_config(params))
        except (ArithmeticError, KeyError, TypeError, ValueError):
            return None

    def _launch_of(self, params: dict) -> str | None:
        """What recorded parameters launch (tuner.study.config_hash on the recording's shape); None where they do not
        load."""
        from tuner.study import config_hash

        return self._loaded(params, lambda cfg: config_hash(cfg, self.shape))

    def _launches(self) -> dict[str, int]:
        """The recorded rows by what they launch, the first of each that did not fail where several launch the same
        (computed once)."""
        if self._by_launch is None:
            self._by_launch = {}
            for i, (params, status) in enumerate(zip(self.rows[self.params].to_dict("records"), self.rows["status"])):
                h = self._launch_of(params)
                first = self._by_launch.get(h)
                if h is not None and (first is None or (status == "ok" and self.rows["status"].iloc[first] != "ok")):
                    self._by_launch[h] = i
        return self._by_launch

    def _lookup(self, cfg: DecoderConfig) -> tuple[int, bool]:
        """The position of the recorded row that serves ``cfg``, and whether it is another configuration's."""
        from tuner.space import from_config

        params = from_config(cfg)
        want = self._key(params)
        i = self.keys.get(want)
        if i is None:  # a configuration that launches what a recorded one launched was measured: served as its own
            from tuner.study import config_hash

            i = self._launches().get(config_hash(cfg, self.shape))
        if i is not None:
            return i, False
        import numpy as np

        # Nearest in what the launches read (tuner.layer.launched_config): a field no launch reads, such as the
        # one-kernel layer's where it is off, counts for nothing on either side.
        if self._launched is None:
            self._launched = np.asarray([self._launched_key(p) for p in self.rows[self.params].to_dict("records")])
        arr = self._launched
        w = np.asarray(self._launched_key(params))
        diff = (arr != w).sum(axis=1)
        dist = np.abs(np.log2(np.abs(arr) + 2) - np.log2(np.abs(w) + 2)).sum(axis=1)
        ok = (self.rows["status"] == "ok").to_numpy()
        order = np.lexsort((dist, diff, ~ok))  # prefer ok rows, then fewest differences, then closest
        return int(order[0]), True

    def _launched_key(self, params: dict) -> tuple:
        """The parameters of what ``params`` launch (launched_config's fields), as :meth:`_key` orders them; the
        parameters as given where they do not load."""
        from tuner.layer import launched_config
        from tuner.space import from_config

        key = self._loaded(params, lambda cfg: self._key(from_config(launched_config(cfg, self.shape))))
        return self._key(params) if key is None else key

    def _number(self, i: int) -> int:
        """The recorded trial number of row ``i`` (its position where the recording numbers none)."""
        n = self.rows["number"].iloc[i] if "number" in self.rows.columns else None
        try:
            return int(n)
        except (TypeError, ValueError):  # (None, or NaN: no number)
            return i

    def recorded_config(self, number: int) -> DecoderConfig | None:
        """The configuration that recorded trial ``number`` measured, as today's code loads it (served as measured:
        :meth:`evaluate` finds its own row, or the first of its launch); None where it does not load, or today's checks
        refuse it (for the recording's GPU)."""
        if self._row_of is None:  # (built once: finish asks per approximated trial)
            self._row_of = {}
            for i in range(len(self.rows)):
                self._row_of.setdefault(self._number(i), i)
        if number not in self._row_of:
            return None
        cfg = self._loaded(self.rows[self.params].iloc[self._row_of[number]].to_dict(), lambda cfg: cfg)
        return None if cfg is None or self.invalid(cfg) else cfg

    def evaluate(self, cfg: DecoderConfig) -> TrialResult:
        why = self.invalid(cfg)
        if why:
            return TrialResult("invalid", reason=why)
        i, approx = self._lookup(cfg)
        row, n = self.rows.iloc[i].to_dict(), self._number(i)
        status = row["status"] if row["status"] in STATUSES else "crashed"
        reason = row.get("reason") if isinstance(row.get("reason"), str) else ""
        return TrialResult(status, float(row["latency_us"]), float(row["spread_us"]),
                           reason=("replayed" + (f", approximated by recorded trial {n}" if approx else "")
                                   + (f": {reason}" if reason else "")),
                           approximated=approx, served_from=n)

    def recheck(self, cfg, checks: int = 5) -> None:
        """A recording cannot be checked again: nothing is run (the study asks for no re-check of a replay)."""
        return None

    def remeasure(self, cfgs, rounds: int = 40, anchor: int | None = None):
        out = [self.evaluate(c) for c in cfgs]
        base = out[anchor].latency_us if anchor is not None else None
        return [Remeasured(r.latency_us, r.spread_us, base) for r in out]

    def breakdown(self, cfg):
        """The recorded per-kernel breakdown: the baseline's for the default config, the best's for the recording's
        best configuration or one that launches what it launched (tuner.study.config_hash); None for any other (a
        breakdown belongs to the kernels it timed)."""
        from tuner.layer import default_config
        from tuner.space import from_config
        from tuner.study import config_hash

        if cfg == default_config(self.shape):
            return (self._breakdown or {}).get("baseline")
        if self._best_key is None:
            return None
        if self._best_launch is None:
            self._best_launch = self._launch_of(dict(zip(self.params, self._best_key))) or ""
        if self._key(from_config(cfg)) == self._best_key or config_hash(cfg, self.shape) == self._best_launch:
            return (self._breakdown or {}).get("best")
        return None

    def baselines(self, default, with_compile: bool = True) -> Baselines:
        b = self.manifest.get("baselines", {})
        return Baselines(b["baseline_us"], b.get("baseline_spread_us", 0.0), b.get("eager_us"), b.get("compile_us"),
                         b.get("floor_us"), {"replayed_from": self.source})
