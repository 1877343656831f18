# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Analysis of a `tune decoder` run
#
# This notebook reads one run folder (`results/<shape>/<run-id>/`: `manifest.json`, `trials.csv`,
# `topk.json`, optional `breakdown.json` and `importance.json`) through the project's own API
# (`tuner.report`): the tables and plots are the ones `tune decoder` and `tune report` write, from the
# same functions. It needs no GPU.
#
# Set `RUN_DIR` below to a run folder, or leave it `None`: the newest committed run under `results/`
# is used, and when none is committed yet, a run is **replayed** on the fly from the H200 run of record's
# bert-base recording in `tests/data/replay-bert-base-h200-20261128` (`tune decoder --replay`: timings served
# from that recording, nothing measured now; every table and title then says REPLAYED).
#
# Opened in the checkout, it reads the checkout's `results/`. A copy written by `tune notebook` beside an
# installed pdl-tune (no checkout) reads the nearest `results/` folder at or above its own folder, where
# `tune decoder` writes by default, and replays the recording shipped with the package.
#
# `COMPARE_DIR` is the second run of the side-by-side comparison at the end (two GPUs, two samplers or
# two dtypes); `None` picks one, as explained there.

# %%
import os

RUN_DIR = os.environ.get("PDL_TUNE_RUN") or None  # e.g. "results/bert-base/20261122-215557-tpe"
COMPARE_DIR = os.environ.get("PDL_TUNE_COMPARE") or None
# trials of an on-the-fly replay (about 15 s for 60 on a laptop)
REPLAY_TRIALS = int(os.environ.get("PDL_TUNE_REPLAY_TRIALS") or 60)

# %%
import atexit
import contextlib
import io
import json
import shutil
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from IPython.display import Image, Markdown, display


def find_checkout(start: Path) -> Path | None:
    """The repository root (pyproject.toml beside tuner/), from the notebook's folder or the root itself."""
    for p in [start, *start.parents]:
        if (p / "pyproject.toml").is_file() and (p / "tuner").is_dir():
            return p
    return None


HERE = Path.cwd().resolve()
CHECKOUT = find_checkout(HERE)
if CHECKOUT is not None:  # the checkout's results/ and recording; works without `pip install -e .` too
    ROOT = CHECKOUT
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    RECORDING = ROOT / "tests" / "data" / "replay-bert-base-h200-20261128"
else:  # a copy from `tune notebook` beside an installed pdl-tune: the runs under the nearest results/ folder
    # (`tune decoder` writes to ./results by default), the recording shipped with the package
    import importlib.resources

    ROOT = next((p for p in [HERE, *HERE.parents] if (p / "results").is_dir()), HERE)
    RECORDING = Path(str(importlib.resources.files("tuner.recordings") / "replay-bert-base-h200-20261128"))

from tuner import report  # noqa: E402  (the data functions and renderers of `tune report`)

RESULTS = ROOT / "results"
SCRATCH = Path(tempfile.mkdtemp(prefix="pdl-tune-analysis-"))  # replays and re-drawn plots; results/ stays untouched
atexit.register(shutil.rmtree, SCRATCH, ignore_errors=True)  # removed when the kernel shuts down
pd.set_option("display.width", 200)
pd.set_option("display.max_columns", 40)


def rel(p) -> str:
    p = Path(p)
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


# %% [markdown]
# ## Which run
#
# Committed run folders are the folders under `results/` that hold a `topk.json`: `results/<shape>/<run-id>/`, and
# the same under another `--out` such as `results/h100/` (the `bench` and `verify` folders hold other kinds of run).
# A replay is made in a scratch folder with its own study storage, so it never joins a real study.

# %%
def committed_runs(results: Path = RESULTS) -> list[Path]:
    """Every complete decoder run folder under results/, oldest first (run ids start with a time stamp)."""
    runs = [p.parent for p in results.rglob("topk.json")
            if not any(part.endswith(".partial") for part in p.relative_to(results).parts)]
    return sorted(runs, key=lambda p: (json.loads((p / "manifest.json").read_text()).get("created", ""), p.name))


def replay_run(sampler: str = "tpe", trials: int = REPLAY_TRIALS) -> Path:
    """`tune decoder --replay` of the recording (RECORDING) into a scratch folder; returns the run folder."""
    from tuner.cli import main

    out = Path(tempfile.mkdtemp(prefix=f"replay-{sampler}-", dir=SCRATCH))
    argv = ["decoder", "--replay", str(RECORDING), "--sampler", sampler, "--trials", str(trials), "--no-progress",
            "--out", str(out), "--storage", f"journal:{out / 'studies.journal'}"]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(argv)
    assert rc == 0, f"tune {' '.join(argv)} failed ({rc}): {stderr.getvalue()[-2000:]}"
    lines = [ln for ln in stdout.getvalue().splitlines() if ln.startswith("run folder: ")]
    assert len(lines) == 1, stdout.getvalue()[-2000:]
    return Path(lines[0][len("run folder: "):])


COMMITTED = committed_runs()
if RUN_DIR is not None:
    run_dir = Path(RUN_DIR) if Path(RUN_DIR).is_absolute() else ROOT / RUN_DIR
    source = "given"
elif COMMITTED:
    real = [p for p in COMMITTED if not report.load_run(p).replayed]
    run_dir = (real or COMMITTED)[-1]
    source = "the newest committed run"
else:
    run_dir = replay_run("tpe")
    source = f"REPLAYED from {rel(RECORDING)} (no committed run folder under results/ yet)"

run = report.load_run(run_dir)
print(f"run folder: {rel(run.path)} ({source})")
print(f"{len(COMMITTED)} committed run folder(s) under results/: " + (", ".join(rel(p) for p in COMMITTED) or "none"))
print(f"runs read from {RESULTS}; replays from {RECORDING}")
if run.replayed:
    display(Markdown(f"**{report.REPLAYED_LINE}**"))

# %% [markdown]
# ## What this notebook relies on
#
# The trials table must have the columns below, a completed baseline trial (every kernel at (-1,-1),
# default tiles), and only the statuses the tuner writes (`interrupted`: a trial whose study process
# died mid-trial, which the storage retries). On a GPU before Hopper the ratio columns are absent: the
# search space drops the knobs it cannot run.

# %%
ALLOWED_STATUSES = set(report.STATUSES) | {"interrupted"}
TILE_PARAMS = ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages")

gpu = run.manifest.get("gpu") or {}
has_knobs = bool(gpu.get("capability")) and int(gpu["capability"][0]) >= 9
trials = run.trials
required = ["number", "status", "latency_us", "spread_us", "speedup", "is_baseline"]
required += [f"{g}.{p}" for g in report.GEMMS for p in ("block_m", "block_n", "block_k", "split_k")]
if has_knobs:
    required += [f"{g}.{r}" for g in report.GEMMS for r in ("overlap_ratio", "prefetch_ratio")]
missing = [c for c in required if c not in trials.columns]
assert not missing, f"trials.csv lacks {missing}"

unknown = set(trials["status"]) - ALLOWED_STATUSES
assert not unknown, f"statuses outside {sorted(ALLOWED_STATUSES)}: {sorted(unknown)}"

baseline_trials = trials[trials["is_baseline"] & (trials["status"] == "ok")]
if baseline_trials.empty:  # (a space without the baseline's config, e.g. --search-space layer-kernel: the speedups
    print("no baseline trial in this study's space: speedups are over the baseline re-measured at the end")
ratio_cols = [c for c in trials.columns if c.endswith((".overlap_ratio", ".prefetch_ratio"))]
assert (baseline_trials[ratio_cols].astype(float) < 0).all().all(), "the baseline trial has a knob switched on"
assert run.baseline_us is not None, "no baseline latency in topk.json or the manifest"
assert len(run.rows) >= 1, "topk.json has no re-measured configuration"
assert (trials["status"] == "ok").sum() >= 1

print(f"{len(trials)} trials: " + ", ".join(f"{n} {s}" for s, n in trials["status"].value_counts().items()))
print(f"shape {run.shape_name} ({run.dims}), {run.dtype}, {run.gpu_name}, L2 {run.l2_policy}, "
      f"sampler {run.manifest.get('sampler')}, PDL/prefetch knobs searched: {has_knobs}")

# %% [markdown]
# ## Top-k table
#
# Each of the top-k configurations was re-measured at the end of the run, interleaved (A B A B ...)
# with the baseline, each latency is the median per layer and `±` the spread (IQR/2) of those
# replays. A row marked `tie` is within the combined spread of the row above: the measurement cannot
# order them. `(o,p)` is the GEMM's (overlap_ratio, prefetch_ratio); -1.0 means off.

# %%
display(Markdown(report.topk_markdown(run)))

# %%
top = report.topk_frame(run)
assert set(report.TOPK_COLUMNS) <= set(top.columns), set(report.TOPK_COLUMNS) - set(top.columns)
top[report.TOPK_COLUMNS]

# %% [markdown]
# ## Summary across shapes
#
# The seed's summary table over the committed runs beside this one (the same `--out` folder, as
# `tune decoder --shape all` writes them) on the same GPU model: this run for its shape and dtype, the
# newest run for each other; timings of different GPU models are never mixed in one table.

# %%
def summary_runs(primary: report.Run) -> list[report.Run]:
    if primary.replayed and not any(not report.load_run(p).replayed for p in COMMITTED):
        return [primary]  # nothing committed yet: the replayed run alone, labelled
    root = RESULTS if primary.replayed else primary.path.parent.parent  # (the --out its run folder sits in)
    newest = {}
    for p in COMMITTED:  # oldest first: the newest per (shape, dtype) wins
        if p.parent.parent.resolve() != root.resolve():
            continue
        r = report.load_run(p)
        if r.gpu_name == primary.gpu_name and not r.replayed:
            newest[(r.shape_name, r.dtype)] = r
    if not primary.replayed:
        newest[(primary.shape_name, primary.dtype)] = primary
    return sorted(newest.values(), key=lambda r: (r.shape.get("d_model", 0), r.shape.get("ffn", 0), r.dtype))


SUMMARY = summary_runs(run)
display(Markdown(report.summary_markdown(SUMMARY)))
report.summary_frame(SUMMARY)

# %% [markdown]
# ## The plots of `tune report`
#
# Re-drawn into a scratch folder by the functions the CLI calls (`tuner.report.plot_*`), so they show
# this notebook's data even when the run folder's own `plots/` are older. First the optimization history
# (every ok trial, the running best, the baseline and torch.compile) and the re-measured top-k with
# their spread.

# %%
PLOTS = SCRATCH / "plots" / run.path.name
drawn = {name: report.PLOTTERS[name](run, PLOTS / f"{name}.png") for name in report.PLOTS}
print("drawn: " + ", ".join(n for n, p in drawn.items() if p) + "; no data for: "
      + (", ".join(n for n, p in drawn.items() if not p) or "none"))
assert drawn["history"] is not None and drawn["topk"] is not None
display(Image(filename=str(drawn["history"])))
display(Image(filename=str(drawn["topk"])))

# %%
hist = report.history_data(run)
best_at = int(hist["number"].iloc[hist["latency_us"].idxmin()])
print(f"{len(hist)} ok trials; best in the search {hist['best_us'].iloc[-1]:.2f} us, first reached at trial "
      f"{best_at}; baseline {run.baseline_us:.2f} us (re-measured in the top-k table above)")

# %% [markdown]
# ## Parameter importance
#
# Optuna's fANOVA importance of each searched parameter for the latency (`importance.json`, written when
# at least 8 trials passed). Below it, the same importances summed per kernel and per kind of knob:
# tiles against the two PDL/prefetch ratios.

# %%
imp = report.importance_data(run)
if imp.empty:
    print("no importance.json in this run (fewer than 8 ok trials)")
else:
    display(Image(filename=str(drawn["importance"])))
    parts = imp["param"].str.split(".", n=1, expand=True)
    imp = imp.assign(kernel=parts[0], knob=parts[1] if parts.shape[1] > 1 else "")
    imp["kind"] = np.where(imp["knob"].str.endswith("_ratio"), "overlap/prefetch ratio", "tile / launch")
    display(imp.head(15))
    display(imp.pivot_table(index="kernel", columns="kind", values="importance", aggfunc="sum", fill_value=0.0)
            .reindex([k for k in report.KERNELS if k in set(imp["kernel"])]).round(3))

# %% [markdown]
# ## Speedup over the (overlap, prefetch) plane, per GEMM
#
# `ratio_plane_data`: the median speedup over the baseline of the ok trials in each cell of one GEMM's
# (overlap_ratio, prefetch_ratio) grid (`off` = -1). The other kernels' settings vary within a cell, so
# a cell is a marginal, not a controlled experiment; grey cells were not sampled. Each trial counts at the
# pair its launch reads (`report.trial_pairs`): a one-kernel layer's pair for every GEMM, none for the
# out-projection or FFN2 where the feed-forward block computes them.

# %%
plane = report.ratio_plane_data(run)
if plane.empty:
    print("no ratio columns in trials.csv: the knobs were not searched on this device")
else:
    assert set(plane["gemm"]) <= set(report.GEMMS) and (plane["n_trials"] > 0).all()
    display(Image(filename=str(drawn["ratio_plane"])))
    for g in report.GEMMS:
        piv = report.ratio_plane_pivot(plane, g)
        if not piv.empty:
            display(Markdown(f"**{report.GEMM_TITLES[g]} ({g})**: median speedup, rows prefetch_ratio, "
                             "columns overlap_ratio"))
            display(piv.round(3))

# %% [markdown]
# The distribution behind those medians: per GEMM, the speedup of every ok trial with PDL off/on and
# prefetch off/on (quartiles), then as box plots over the overlap and prefetch ratios.

# %%
def knob_distribution(r: report.Run) -> pd.DataFrame:
    """gemm, pdl, prefetch, n_trials and speedup quartiles over the ok trials, at the pairs their launches read."""
    pairs = report.trial_pairs(r)
    rows = []
    for g in report.GEMMS:
        ok = pairs[pairs["gemm"] == g]
        for (pdl, pre), grp in ok.groupby([ok["overlap_ratio"] >= 0, ok["prefetch_ratio"] >= 0]):
            q = grp["speedup"].quantile([0.25, 0.5, 0.75])
            rows.append({"gemm": g, "pdl": "on" if pdl else "off", "prefetch": "on" if pre else "off",
                         "n_trials": len(grp), "q25": q[0.25], "median": q[0.5], "q75": q[0.75],
                         "max": grp["speedup"].max()})
    return pd.DataFrame(rows)


dist = knob_distribution(run)
if not dist.empty:
    display(dist.round(3))

    pairs = report.trial_pairs(run)
    fig, axes = plt.subplots(2, len(report.GEMMS), figsize=(14, 6), sharey=True, layout="constrained")
    for j, g in enumerate(report.GEMMS):
        ok = pairs[pairs["gemm"] == g]
        for i, knob in enumerate(("overlap_ratio", "prefetch_ratio")):
            v = ok[knob]
            v = v.where(v < 0, v.round(1)).where(v >= 0, -1.0)  # the plot's grid: 0.1 steps, -1 = off
            groups = sorted(v.unique())
            axes[i, j].boxplot([ok.loc[v == x, "speedup"] for x in groups], showfliers=False)
            axes[i, j].set_xticks(range(1, len(groups) + 1), ["off" if x < 0 else f"{x:.1f}" for x in groups],
                                  fontsize=7)
            axes[i, j].axhline(1.0, color="0.5", linewidth=0.8)
            axes[i, j].set_title(f"{report.GEMM_TITLES[g]}: {knob}", fontsize=9)
        axes[0, j].set_ylabel("speedup" if j == 0 else "")
    fig.suptitle(f"Speedup over the baseline by ratio, ok trials ({run.shape_name}, {run.gpu_name}"
                 + (", REPLAYED)" if run.replayed else ")"), fontsize=10)
    plt.show()

# %% [markdown]
# ## Effect of the tile sizes, per GEMM
#
# For every GEMM and tile parameter, the median and the best layer latency of the ok trials that used
# each value, and how many there were. The latency is the whole layer's, and the sampler does not
# spread its trials evenly: read a value with few trials as a hint, not a measurement.

# %%
def tile_effect_data(r: report.Run) -> pd.DataFrame:
    """gemm, param, value, median_latency_us, best_latency_us, n_trials over the ok trials."""
    ok = r.trials[(r.trials["status"] == "ok") & r.trials["latency_us"].notna()]
    parts = []
    for g in report.GEMMS:
        for p in TILE_PARAMS:
            col = f"{g}.{p}"
            if col not in ok:
                continue
            agg = (ok.groupby(ok[col].astype(int))["latency_us"]
                   .agg(median_latency_us="median", best_latency_us="min", n_trials="size")
                   .reset_index().rename(columns={col: "value"}))
            agg.insert(0, "param", p)
            agg.insert(0, "gemm", g)
            parts.append(agg)
    return pd.concat(parts, ignore_index=True)


tiles = tile_effect_data(run)
assert set(tiles["gemm"]) == set(report.GEMMS), set(tiles["gemm"])
for p in ("block_m", "block_n", "block_k", "split_k"):
    sub = tiles[tiles["param"] == p]
    cells = sub.assign(cell=[f"{m:.2f} ({n})" for m, n in zip(sub["median_latency_us"], sub["n_trials"])])
    display(Markdown(f"**{p}**: median latency per layer (us) of the ok trials that used each value (n trials)"))
    display(cells.pivot(index="gemm", columns="value", values="cell").reindex(report.GEMMS).fillna("-"))

fig, axes = plt.subplots(1, 4, figsize=(15, 3.6), sharey=True, layout="constrained")
for ax, p in zip(axes, ("block_m", "block_n", "block_k", "split_k")):
    for g in report.GEMMS:
        sub = tiles[(tiles["gemm"] == g) & (tiles["param"] == p)]
        ax.plot(sub["value"], sub["median_latency_us"], marker="o", label=report.GEMM_TITLES[g])
    ax.set_xscale("log", base=2)
    ax.set_xlabel(p)
    ax.axhline(run.baseline_us, color="0.5", linestyle="--", linewidth=0.8)
axes[0].set_ylabel("median latency per layer (us)")
axes[0].legend(fontsize=8)
fig.suptitle(f"Tile sizes per GEMM, ok trials ({run.shape_name}, {run.gpu_name}"
             + (", REPLAYED)" if run.replayed else "); dashed: baseline"), fontsize=10)
plt.show()

# %% [markdown]
# ## Where the time goes, per kernel: best against baseline against the floor
#
# `breakdown_data`: each kernel of the best configuration and of the baseline timed alone (its own
# CUDA graph, per layer, over a stack deep enough that the kernel's own weights are 3x the L2; runs before
# session 43 used the layer's stack, where small kernels' weights stayed in L2), then their sum. Below
# them the whole layer as it really runs (one chain, which is what PDL shortens) and the floor: the
# layer's weights read once at the measured copy bandwidth. `floor_us`: each kernel's own floor, the weights it
# reads (those of the GEMMs computed inside it too) at that bandwidth.

# %%
bd = report.breakdown_data(run)
if bd.empty:
    print("no breakdown.json in this run")
else:
    # (the seven kernels, or "layer" for a one-kernel layer: --search-space fused-layer or layer-kernel)
    assert list(bd["kernel"])[-1] == "sum" and set(bd["kernel"][:-1]) <= set(report.KERNELS) | {"layer"}
    best_us = float(run.best["latency_us"])
    chain = "layer (one chain, served by the replay)" if run.replayed else "layer (one chain, re-measured)"
    extra = pd.DataFrame({"kernel": [chain, "floor (weights read once)"],
                          "best_us": [best_us, run.floor_us], "baseline_us": [run.baseline_us, run.floor_us]})
    table = pd.concat([bd, extra], ignore_index=True)
    table["saved_us"] = table["baseline_us"] - table["best_us"]
    table["best_share_of_sum"] = table["best_us"] / float(bd["best_us"].iloc[-1])
    # each kernel's floor: the weights it reads, those of the GEMMs computed inside it too (topk.md's last table)
    floors, _ = report.breakdown_floors(run)
    table["floor_us"] = table["kernel"].map(floors)
    table["best_over_floor"] = table["best_us"] / table["floor_us"]
    display(table.round(2))
    display(Image(filename=str(drawn["breakdown"])))
    if run.floor_us:
        print(f"best layer {best_us:.2f} us = {best_us / run.floor_us:.1f}x the floor of {run.floor_us:.2f} us; "
              f"baseline {run.baseline_us / run.floor_us:.1f}x")

# %% [markdown]
# The newest committed `tune bench` table of the same shape on the same GPU model, dtype and L2 policy, when there is
# one: our layer at hand-picked tiles against PyTorch eager, torch.compile and the floor.

# %%
def same_setup(m: dict) -> bool:
    return ((m.get("gpu") or {}).get("name") == run.gpu_name and m.get("dtype", "float16") == run.dtype
            and (m.get("policy") or {}).get("l2", "cold") == (run.l2_policy or "cold"))


benches = {b: json.loads((b.parent / "manifest.json").read_text()) for b in RESULTS.rglob("bench.md")
           if b.parent.parent.name == run.shape_name}
bench = sorted((b for b, m in benches.items() if same_setup(m)), key=lambda b: benches[b].get("created", ""))
if bench:
    print(rel(bench[-1]))
    display(Markdown(bench[-1].read_text()))
else:
    print(f"no committed bench of {run.shape_name} on {run.gpu_name} in {run.dtype}, L2 {run.l2_policy}")

# %% [markdown]
# ## Two runs side by side
#
# Two runs of one shape that differ in the GPU model, the sampler or the dtype. Unless `COMPARE_DIR`
# names the second run, it is picked from the committed runs: one of the same shape as the run above
# that differs in one of those; if there is none, the committed run of the recording's shape is
# compared with a replay of the recording under another sampler (random), and if nothing is committed,
# two replays of the recording (TPE above, random here). A replayed side is labelled REPLAYED: its
# timings are looked up in the recording, not measured.

# %%
def setup(r: report.Run) -> tuple:
    return (r.gpu_name, r.manifest.get("sampler"), r.dtype)


def what_differs(a: report.Run, b: report.Run) -> str:
    names = ("GPU", "sampler", "dtype")
    diff = [n for n, x, y in zip(names, setup(a), setup(b)) if x != y]
    for name, key in (("L2 policy", lambda r: r.l2_policy), ("search space", lambda r: r.manifest.get("search_space")),
                      ("tuner revision", lambda r: r.manifest.get("git_revision"))):
        if key(a) != key(b):
            diff.append(name)
    if a.replayed != b.replayed:
        diff.append("measured against replayed")
    return ", ".join(diff) or "nothing but the run (same setup twice)"


RECORDING_SHAPE = json.loads((RECORDING / "manifest.json").read_text())["shape"]["name"]


def pick_pair(primary: report.Run) -> tuple[report.Run, report.Run, str]:
    if COMPARE_DIR is not None:
        other = report.load_run(Path(COMPARE_DIR) if Path(COMPARE_DIR).is_absolute() else ROOT / COMPARE_DIR)
        return primary, other, "given"
    real = [r for r in (report.load_run(p) for p in COMMITTED) if not r.replayed]
    for a in ([] if primary.replayed else [primary]) + real:
        for b in reversed(real):  # the newest such run
            if b.path != a.path and b.dims == a.dims and setup(b) != setup(a):
                return a, b, "two committed runs of one shape"
    if primary.replayed:
        a, why = primary, "two replays of the recording with two samplers (no real run committed)"
    else:
        same = [r for r in real if r.shape_name == RECORDING_SHAPE]
        a = primary if primary.shape_name == RECORDING_SHAPE or not same else same[-1]
        why = "the committed run against a replay of the recording (no second real run of one shape)"
    other = "random" if a.manifest.get("sampler") != "random" else "tpe"
    return a, report.load_run(replay_run(other)), why


A, B, why = pick_pair(run)
print(f"A: {rel(A.path)}{' (REPLAYED)' if A.replayed else ''}\nB: {rel(B.path)}{' (REPLAYED)' if B.replayed else ''}")
print(f"picked: {why}; they differ in: {what_differs(A, B)}")
if A.dims != B.dims:
    print(f"note: different shapes ({A.dims} against {B.dims}): compare speedups, not latencies")


# %%
def label(r: report.Run) -> str:
    gpu_name, sampler, dtype = setup(r)
    return f"{r.shape_name}, {gpu_name}, {sampler}, {dtype}" + (" (REPLAYED)" if r.replayed else "")


def side_by_side(a: report.Run, b: report.Run) -> pd.DataFrame:
    """One column per run: setup, trial statuses, the summary row (same function as the summary table),
    the knobs-off check and the best (o,p) and tiles."""
    cols = {}
    for r in (a, b):
        s = report.summary_frame([r]).iloc[0]
        ko = r.topk.get("knobs_off") or {}
        cols[label(r)] = {
            "run folder": rel(r.path), "GPU": r.gpu_name, "dtype": r.dtype, "sampler": r.manifest.get("sampler"),
            "L2 policy": r.l2_policy, "replayed": r.replayed,
            "trials": ", ".join(f"{n} {st}" for st, n in r.trials["status"].value_counts().items()),
            "baseline (us)": s["baseline_us"], "best (us)": s["best_us"],
            "best spread ± (us)": r.best.get("spread_us"), "speedup": s["speedup"],
            "torch.compile (us)": s["compile_us"], "vs compile": s["vs_compile"],
            "top-1, knobs off (us)": ko.get("latency_us"),
            "ties in top-k": int(sum(bool(x.get("tie")) for x in r.rows)),
            **{f"best {report.GEMM_TITLES[g]} (o,p)": s[f"best_{g}"] for g in report.GEMMS},
            "best tiles": report.format_tiles((r.best.get("config") or {}).get("kernels") or {}, r.shape),
        }
    return pd.DataFrame(cols)


cmp = side_by_side(A, B)
assert cmp.shape[1] == 2
display(cmp)

# %%
fig, axes = plt.subplots(1, 2, figsize=(14, 4), layout="constrained")
for r, color in ((A, "C0"), (B, "C3")):
    h = report.history_data(r)
    axes[0].scatter(h["number"], h["latency_us"], s=8, alpha=0.35, color=color)
    axes[0].step(h["number"], h["best_us"], where="post", color=color, label=label(r))
    t = report.topk_data(r)
    axes[1].errorbar(t["rank"], t["latency_us"], yerr=t["spread_us"].fillna(0.0), fmt="o", color=color,
                     capsize=3, label=label(r))
axes[0].set_xlabel("trial number")
axes[0].set_ylabel("latency per layer (us)")
axes[0].set_title("Optimization history: ok trials and best so far", fontsize=10)
axes[1].set_xlabel("rank (re-measured, median ± IQR/2)")
axes[1].set_title("Top-k", fontsize=10)
for ax in axes:
    ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# The two runs' (overlap, prefetch) planes, reduced to PDL off/on and prefetch off/on per GEMM (median
# speedup of the ok trials): where both runs agree, the knob's effect does not depend on what differs
# between them.

# %%
da, db = knob_distribution(A), knob_distribution(B)
if da.empty or db.empty:
    print("one of the runs searched no ratios")
else:
    both = da.merge(db, on=["gemm", "pdl", "prefetch"], how="outer", suffixes=(" A", " B"))
    both = both.sort_values(["gemm", "pdl", "prefetch"], key=lambda c: c.map(report.GEMMS.index)
                            if c.name == "gemm" else c, kind="stable")
    display(both[["gemm", "pdl", "prefetch", "n_trials A", "median A", "n_trials B", "median B"]].round(3))
