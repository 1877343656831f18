"""How pipelining changes the search's choices, simulated on a recording (no GPU): the study `tune decoder --replay
RECORDING --trials N` runs, with its candidates asked DEPTH ahead as `--compilers DEPTH` keeps them in flight (TPE's
constant liar counts those as bad results), against the sequential search, over several seeds.

    python3 scripts/pipeline_sim.py RECORDING [RECORDING ...] [--depths 1,4,12] [--seeds 5] [--trials 120]
                                    [--json OUT]

A depth's compiles "end" after --compile-s seconds times a random factor in [0.5, 1.5), so that they end out of order
as real compiles of different kernels do; the measurement is the replay's look-up. Prints, per recording and depth,
the served latency of the best trial after 40, 80 and N told trials (the mean over the seeds, and how many seeds came
within 0.05 us of the recording's best), and the local steps (neighbour_of) among the N. The latencies are the recording's (its nearest recorded configuration's where
a search reaches one it does not hold): the comparison is of the searches' choices on one landscape, not a
measurement. Diagnostic (docs/perf-notes.md section 68).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

NEAR_US = 0.05  # a search "reached" the recording's best where its own best is within this of it


class SimCompilers:
    """The interface the search uses of tuner.worker.Compilers (n, submit -> Future of a TrialResult, start_errors,
    close), with a compile that only sleeps: the depth of the pipeline without its cost."""

    def __init__(self, n: int, compile_s: float, seed: int):
        self.n, self.compile_s, self.start_errors = n, compile_s, []
        self._rng = random.Random(seed)
        self._pool = ThreadPoolExecutor(n)

    def submit(self, cfg):
        return self._pool.submit(self._compile, self.compile_s * (0.5 + self._rng.random()))

    @staticmethod
    def _compile(seconds: float):
        from tuner.evaluate import TrialResult

        time.sleep(seconds)
        return TrialResult("ok", seconds=seconds)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def run_one(recording: str, depth: int, seed: int, trials: int, compile_s: float, liar: bool = True) -> dict:
    """One search of ``trials`` on ``recording`` at ``depth`` (1: sequential; ``liar`` False: TPE without its
    constant liar even so): the best served latency after each told trial, in the order they were told, and the
    number of local steps."""
    import optuna

    from tuner import space
    from tuner.evaluate import ReplayEvaluator
    from tuner.study import StudyOptions, make_sampler, open_study, search

    ev = ReplayEvaluator(recording)
    sp = space.load()
    opts = StudyOptions(trials=trials, seed=seed, progress=False, compilers=depth,
                        storage=optuna.storages.InMemoryStorage())
    study = open_study(ev.shape, ev, sp, opts, out_root=None, log=lambda *a: None)
    if not liar:
        study.sampler = make_sampler(opts.sampler, seed, sp, bool(ev.pdl), parallel=False)
    pool = SimCompilers(depth, compile_s, seed) if depth > 1 else None
    t0 = time.time()
    try:
        search(study, ev.shape, ev, sp, opts, log=lambda *a: None, budget=trials, compilers=pool)
    finally:
        if pool is not None:
            pool.close()
    told = sorted((t for t in study.get_trials(deepcopy=False) if t.state.is_finished() and t.datetime_complete),
                  key=lambda t: t.datetime_complete)
    best, curve = float("inf"), []
    for t in told:
        if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None:
            best = min(best, t.value)
        curve.append(best)
    return {"recording": recording, "depth": depth, "liar": liar, "seed": seed, "curve": curve,
            "seconds": time.time() - t0,
            "local_steps": sum("neighbour_of" in t.user_attrs for t in told)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recordings", nargs="+")
    ap.add_argument("--depths", default="1,4,12", help="e.g. 1,4,12; a depth ending in '-' runs TPE without its "
                    "constant liar (12-)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--trials", type=int, default=120)
    ap.add_argument("--compile-s", type=float, default=0.02)
    ap.add_argument("--json", help="write every search's curve here")
    args = ap.parse_args(argv)
    depths = args.depths.split(",")
    if not all(d.rstrip("-").isdigit() and int(d.rstrip("-")) >= 1 for d in depths):
        ap.error(f"--depths {args.depths}: expected positive whole numbers, e.g. 1,4,12 or 12-")
    from tuner.evaluate import ReplayEvaluator

    for rec in args.recordings:  # (each one read before any search: a bad one is one line, not a traceback)
        try:
            ReplayEvaluator(rec)
        except (ValueError, OSError, KeyError) as e:
            print(f"pipeline_sim.py: {rec}: {str(e).splitlines()[0]}", file=sys.stderr)
            return 2
    runs = []
    for rec in args.recordings:
        for depth in depths:
            for seed in range(args.seeds):
                runs.append(run_one(rec, int(depth.rstrip("-")), seed, args.trials, args.compile_s,
                                    liar=not depth.endswith("-")))
                r = runs[-1]
                print(f"# {rec} depth {depth} seed {seed}: best {r['curve'][-1]:.2f} us, {r['local_steps']} local "
                      f"steps, {r['seconds']:.0f} s", file=sys.stderr, flush=True)
    marks = [m for m in (40, 80, args.trials) if m <= args.trials]
    print(f"Each cell: the mean over {args.seeds} seeds of the best served latency (us) after that many told trials; "
          f"in brackets, the seeds whose best is within {NEAR_US} us of the recording's best ok trial.\n")
    print(f"| recording (its best) | depth | {' | '.join(f'after {m}' for m in marks)} | local steps (median) |")
    print(f"|---|---:|{'---:|' * len(marks)}---:|")
    for rec in args.recordings:
        rows = ReplayEvaluator(rec).rows
        top = float(rows.loc[rows["status"] == "ok", "latency_us"].min())
        for depth in depths:
            rs = [r for r in runs if r["recording"] == rec and f"{r['depth']}{'' if r['liar'] else '-'}" == depth]
            cells = []
            for m in marks:
                v = [r["curve"][min(m, len(r["curve"])) - 1] for r in rs]
                cells.append(f"{statistics.mean(v):.2f} ({sum(x <= top + NEAR_US for x in v)}/{len(v)})")
            steps = statistics.median(r["local_steps"] for r in rs)
            name = rec.rstrip("/").split("/")[-1]
            print(f"| {name} ({top:.2f}) | {depth} | {' | '.join(cells)} | {steps:.0f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"command": ["python3", "scripts/pipeline_sim.py", *(argv or sys.argv[1:])], "runs": runs}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
