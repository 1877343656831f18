"""`tune decoder --workers N` / `--gpus 0,1,..`: several study processes on one study, one per GPU.

The parent opens the study first (identity, first trials), then starts one search-only ``tune decoder``
per GPU, each pinned with ``CUDA_VISIBLE_DEVICES`` and sharing the study through the storage (a journal
file by default, or the user's RDB URL). The budget is the study's, so together they run ``--trials``
trials. The parent draws the progress bar from the storage (every worker's trials), waits for all of
them, then re-measures the top-k and writes the run folder once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tuner.layer import default_config
from tuner.study import StudyOptions, evaluated, finish, open_study, progress_bar, storage_url, update_progress

POLL_S = 1.0


@dataclass
class Worker:
    index: int
    gpu: str | None  # CUDA_VISIBLE_DEVICES of the worker; None: not pinned (replay)
    proc: subprocess.Popen

    @property
    def label(self) -> str:
        return f"worker {self.index}" + (f" (GPU {self.gpu})" if self.gpu is not None else "")


def start_worker(index: int, gpu: str | None, argv: list[str]) -> Worker:
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    # stdin closed: a worker never prompts; stdout and stderr stay the terminal's, so a worker that
    # refuses to join (another GPU model) says why in its own words.
    proc = subprocess.Popen([sys.executable, "-m", "tuner.cli", *argv], env=env, stdin=subprocess.DEVNULL)
    return Worker(index, gpu, proc)


def wait_for(workers: list[Worker], study, opts: StudyOptions, label: str) -> list[Worker]:
    """Wait for every worker, drawing the study's progress; returns the workers that failed."""
    bar = progress_bar(study, opts.trials, label) if opts.progress else None
    try:
        while any(w.proc.poll() is None for w in workers):
            time.sleep(POLL_S)
            if bar is not None:
                update_progress(bar, study)
        if bar is not None:
            update_progress(bar, study)
    except KeyboardInterrupt:
        stop(workers)
        raise
    finally:
        if bar is not None:
            bar.close()
    return [w for w in workers if w.proc.returncode != 0]


def stop(workers: list[Worker]) -> None:
    for w in workers:
        if w.proc.poll() is None:
            w.proc.terminate()
    for w in workers:
        try:
            w.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            w.proc.kill()


def run_workers(shape, evaluator, space, opts: StudyOptions, out_root: Path, command: list[str],
                gpus: list[str | None], worker_argv, log=print) -> tuple[Path, list[str]]:
    """Search with one process per entry of ``gpus``, then finish here. ``worker_argv(index, study_name)``
    is the command line of a worker. Returns the run folder and one line per worker that failed."""
    study = open_study(shape, evaluator, space, opts, out_root, log)
    t0 = time.time()
    workers = [start_worker(i, gpu, worker_argv(i, study.study_name)) for i, gpu in enumerate(gpus)]
    failed = wait_for(workers, study, opts, shape.label)
    problems = [f"{w.label} exited with code {w.proc.returncode}" for w in failed]
    for p in problems:
        log(f"{shape.label}: {p}")
    took = time.time() - t0
    log(f"{shape.label}: {evaluated(study.get_trials(deepcopy=False))} trials in the study from {len(workers)} "
        f"workers, search took {took:.0f}s")
    run = finish(study, shape, evaluator, space, opts, out_root, command, default_config(shape),
                 storage_url(opts, out_root), log, search={"seconds": round(took, 1)})  # (each worker said its own)
    return run, problems
