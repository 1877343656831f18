"""The search's compile workers on one GPU: whether they change the timings the measuring process takes while they
compile (they launch no kernel, but share the CPUs), and what each half of a trial costs.

    python3 scripts/compile_bench.py SHAPE TRIALS_CSV OTHER_SHAPE OTHER_TRIALS_CSV [--configs K] [--compilers N]

Takes the first K measured configurations of TRIALS_CSV (a run folder's trials.csv on SHAPE) and times each in a
GpuEvaluator in this process (its compile first, then three measurements), three times over: quiet; while N compile
workers compile the configurations of OTHER_TRIALS_CSV (on OTHER_SHAPE, kernels nobody compiled yet); quiet again.
Prints each configuration's median of the three phases and their ratio. Diagnostic (docs/perf-notes.md section 67).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _configs(path: str, k: int | None):
    """The configurations of a run's measured trials (ok, not copied from another), as today's code loads them
    (ReplayEvaluator.recorded_config)."""
    from tuner.evaluate import ReplayEvaluator

    rec = ReplayEvaluator(path)
    rows = rec.rows[(rec.rows["status"] == "ok") & rec.rows["duplicate_of"].isna()]
    cfgs = [cfg for cfg in (rec.recorded_config(int(n)) for n in rows["number"]) if cfg is not None]
    return cfgs if k is None else cfgs[:k]


def main(argv=None) -> int:
    from tuner.device import require_gpu

    require_gpu(__file__)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape")
    ap.add_argument("trials_csv")
    ap.add_argument("other_shape")
    ap.add_argument("other_trials_csv")
    ap.add_argument("--configs", type=int, default=8)
    ap.add_argument("--compilers", type=int, default=None, help="default: tuner.worker.auto_compilers()")
    args = ap.parse_args(argv)

    from tuner.evaluate import GpuEvaluator
    from tuner.shapes import resolve
    from tuner.worker import Compilers, EvaluatorSpec, auto_compilers

    shape, other = resolve(args.shape), resolve(args.other_shape)
    mine, theirs = _configs(args.trials_csv, args.configs), _configs(args.other_trials_csv, None)
    n = args.compilers or auto_compilers()
    ev = GpuEvaluator(shape)
    for cfg in mine:  # (compiled here, once: each phase below measures only)
        ev.evaluate(cfg)

    def phase(name):
        t0 = time.perf_counter()
        out = []
        for cfg in mine:
            runs = [ev.evaluate(cfg) for _ in range(3)]
            assert all(r.status == "ok" for r in runs), [r.reason for r in runs]
            out.append(statistics.median(r.latency_us for r in runs))
        print(f"{name}: {len(mine)} configurations x 3 in {time.perf_counter() - t0:.1f} s", flush=True)
        return out

    quiet = phase("quiet")
    pool = Compilers(EvaluatorSpec("compile", dict(shape=other, dtype="float16", seed=0)), n)
    t0 = time.perf_counter()
    futures = [pool.submit(cfg) for cfg in theirs]
    while sum(f.done() for f in futures) < n:  # (every worker started and compiling)
        time.sleep(0.2)
    print(f"{n} compile workers started in {time.perf_counter() - t0:.1f} s", flush=True)
    before = sum(f.done() for f in futures)
    busy = phase("busy")
    during = sum(f.done() for f in futures) - before
    left = len(futures) - sum(f.done() for f in futures)
    pool.close()
    print(f"compiles finished during the busy phase: {during} (of {len(futures)}; {left} not yet done)")
    again = phase("quiet again")
    print(f"{'config':>6} {'quiet':>8} {'busy':>8} {'again':>8} {'busy/quiet':>10}")
    for i, (q, b, a) in enumerate(zip(quiet, busy, again)):
        print(f"{i:>6} {q:8.2f} {b:8.2f} {a:8.2f} {b / ((q + a) / 2):10.4f}")
    ratios = [b / ((q + a) / 2) for q, b, a in zip(quiet, busy, again)]
    print(f"busy / quiet: median {statistics.median(ratios):.4f}, min {min(ratios):.4f}, max {max(ratios):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
