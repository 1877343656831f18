"""The one timing module: CUDA-graph replay, warm-up, median and spread, recorded L2 policy.

Rules (DESIGN): only graph replays are timed (Triton's Python launch costs tens of us per kernel); no L2
flush between kernels (it would break the PDL chain); clocks, power and every other GPU setting are
left as found. Each sample is one replay of the whole stack between two CUDA events.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch


@dataclass
class Timing:
    median_us: float  # per layer
    spread_us: float  # half the inter-quartile range, per layer
    samples: int
    raw_us: list[float] = field(default_factory=list, repr=False)  # per layer, each replay

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("raw_us")
        return d

    def ties(self, other: "Timing") -> bool:
        """Two medians closer than their combined spreads cannot be told apart."""
        return abs(self.median_us - other.median_us) <= self.spread_us + other.spread_us


def summarize(per_layer_us: list[float]) -> Timing:
    xs = sorted(per_layer_us)
    q = statistics.quantiles(xs, n=4) if len(xs) >= 4 else [xs[0], statistics.median(xs), xs[-1]]
    return Timing(statistics.median(xs), (q[2] - q[0]) / 2, len(xs), list(per_layer_us))


def capture(fn: Callable[[], object], warmup: int = 2) -> torch.cuda.CUDAGraph:
    """Capture ``fn`` (already compiled by the warm-up on a side stream) into one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def _replay_times_us(replay: Callable[[], None], reps: int) -> list[float]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        replay()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def time_replay(replay: Callable[[], None], n_layers: int, *, reps: int = 30, warmup: int = 5) -> Timing:
    """Median and spread of per-layer time over ``reps`` replays, after ``warmup`` replays."""
    for _ in range(warmup):
        replay()
    torch.cuda.synchronize()
    return summarize([t / n_layers for t in _replay_times_us(replay, reps)])


REMEASURE_WARMUP = 3  # warm-up replays of each candidate before an interleaved re-measurement


def time_interleaved(replays: list[Callable[[], None]], n_layers: list[int], *, rounds: int = 30,
                     warmup: int = REMEASURE_WARMUP) -> list[Timing]:
    """A B C A B C ...: drift (clocks, temperature) hits every candidate alike.

    Each sample is the second of two back-to-back replays, as in :func:`time_replay` (and the torch baselines):
    timing a lone replay after a synchronize also counts the host's graph submission between the start
    event and the first kernel (H200, bert-base: 20.81 us in the study, 21.36 in this re-measure with one
    replay a sample; ~7 us a stack, so the shallower the stack the larger the error)."""
    for r in replays:
        for _ in range(warmup):
            r()
    torch.cuda.synchronize()
    samples: list[list[float]] = [[] for _ in replays]
    for _ in range(rounds):
        for i, r in enumerate(replays):
            samples[i].append(_replay_times_us(r, 2)[1] / n_layers[i])
    return [summarize(s) for s in samples]


def copy_bandwidth_bytes_per_s(n_bytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written (METHOD.md)."""
    a = torch.empty(n_bytes // 2, dtype=torch.float16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = _replay_times_us(lambda: b.copy_(a), reps)
    return 2 * n_bytes / (statistics.median(ts) * 1e-6)


def policy(l2: str, n_layers: int, reps: int, warmup: int) -> dict:
    return {"l2": l2, "stack_layers": n_layers, "reps": reps, "warmup": warmup, "graph": True,
            "statistic": "median of per-replay stack time / layers; spread = IQR/2",
            "l2_flush_between_kernels": False, "clocks_changed": False}


def final_policy(rounds: int, torch_reps: int, torch_warmup: int) -> dict:
    """How a run's last figures are measured (the manifest's policy["final"]; policy() is the search's): the top-k
    table, best.json, the baseline of the speedups and the knobs-off pair by :func:`time_interleaved`, the torch
    baselines by time_replay."""
    return {"remeasure": {"rounds": rounds, "warmup": REMEASURE_WARMUP, "order": "interleaved A B A B",
                          "sample": "the second of two back-to-back replays",
                          "figures": "top-k, best.json, the baseline of the speedups, the knobs-off pair"},
            "torch_baselines": {"reps": torch_reps, "warmup": torch_warmup}}


def kernel_records(replay: Callable[[], None], reps: int) -> list[tuple[str, float, float]]:
    """Every kernel the GPU ran during ``reps`` calls of ``replay``, as (name, start us, end us) from
    CUPTI (torch.profiler), in start order: the per-kernel view of a graph replay (scripts/timeline.py,
    scripts/gemm_probe.py). Diagnostics only; the tuner's figures come from time_replay."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "trace.json")
        prof.export_chrome_trace(p)
        with open(p) as f:
            ev = json.load(f)["traceEvents"]
    ks = sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    return [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ks]
