"""tuner.report on a hand-built run folder: the tables' content and the plots' data, then the files."""

from __future__ import annotations

import io
import json
import statistics
from pathlib import Path
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from tuner import report
from tuner.config import GEMMS, KERNELS, DecoderConfig
from tuner.report import RunFolderError

BASELINE_US = 40.0
COMPILE_US = 38.7
SHAPE = {"batch": 1, "seq": 128, "d_model": 768, "heads": 12, "ffn": 3072, "name": "bert-base"}

# (number, status, latency_us, qkv (overlap, prefetch)). out and ffn1 sit at (0.0, 0.0) and ffn2 at
# (-1, -1) in every trial but the baseline (trial 0, everything at (-1, -1)).
TRIALS = [
    (0, "ok", 40.0, (-1.0, -1.0)),
    (1, "ok", 38.0, (0.8, 0.2)),
    (2, "ok", 39.0, (0.4, -1.0)),
    (3, "incorrect", None, (1.0, 1.0)),
    (4, "ok", 36.0, (0.8, 0.2)),
    (5, "compile_error", None, (0.2, 0.2)),
    (6, "ok", 37.0, (0.4, -1.0)),
    (7, "ok", 41.0, (-1.0, -1.0)),
    (8, "ok", 35.0, (0.8, 0.2)),
    (9, "ok", 36.5, (0.0, 0.0)),
    (10, "ok", 38.5, (0.4, -1.0)),
    (11, "ok", 35.2, (0.0, 0.0)),
]
OK_SPEEDUP = {n: BASELINE_US / lat for n, st, lat, _ in TRIALS if st == "ok"}
FFN1_TILES = {"block_m": 32, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 4, "split_k": 2}


def _config(number: int) -> DecoderConfig:
    qkv_op = TRIALS[number][3]
    cfg = DecoderConfig()
    if number == 0:
        return cfg
    knobs = {n: replace(c, overlap_ratio=0.0, prefetch_ratio=0.0) for n, c in cfg.kernels()}
    knobs["qkv"] = replace(cfg.qkv, overlap_ratio=qkv_op[0], prefetch_ratio=qkv_op[1])
    knobs["ffn2"] = cfg.ffn2  # (-1, -1): not in the chain
    knobs["attn"] = replace(cfg.attn, overlap_ratio=0.0, prefetch_ratio=-1.0)
    if number == 8:
        knobs["ffn1"] = replace(knobs["ffn1"], **FFN1_TILES)
    return replace(cfg, **knobs)


def _trial_row(number, status, latency_us) -> dict:
    ok = status == "ok"
    row = {"number": number, "status": status,
           "reason": "" if ok else {"incorrect": "max abs err 3.1 > atol 0.01",
                                    "compile_error": "PTXASError: too many registers"}[status],
           "latency_us": latency_us if ok else float("nan"), "spread_us": 0.25 if ok else float("nan"),
           "speedup": BASELINE_US / latency_us if ok else float("nan"), "approximated": False,
           "is_baseline": number == 0}
    for kernel, fields in _config(number).to_dict()["kernels"].items():
        for field, value in fields.items():
            row[f"{kernel}.{field}"] = value
    return row


def _topk_row(rank, trial, spread_us, tie) -> dict:
    lat = dict((n, l) for n, _, l, _ in TRIALS)[trial]
    return {"rank": rank, "trial": trial, "latency_us": lat, "spread_us": spread_us,
            "speedup": BASELINE_US / lat, "tie": tie, "config": _config(trial).to_dict()}


def make_run(root, *, name="bert-base", replayed=False, importance=False, breakdown=True,
             knobs_off_us=37.0, rows=True):
    run_dir = root / name / "run-1"
    run_dir.mkdir(parents=True)
    manifest = {"schema_version": 1, "shape": dict(SHAPE, name=name), "dtype": "float16",
                "gpu": {"name": "NVIDIA H200", "capability": [9, 0]}, "replayed": replayed,
                "sampler": "tpe", "policy": {"l2": "cold"}, "n_trials": len(TRIALS),
                "baselines": {"baseline_us": BASELINE_US, "eager_us": 44.6, "compile_us": COMPILE_US,
                              "floor_us": 3.4}}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    pd.DataFrame([_trial_row(n, s, l) for n, s, l, _ in TRIALS]).to_csv(run_dir / "trials.csv", index=False)
    topk = {"baseline_us": BASELINE_US, "baseline_spread_us": 0.2, "compile_us": COMPILE_US,
            "replayed": replayed,
            "rows": [_topk_row(1, 8, 0.3, False), _topk_row(2, 11, 0.3, True), _topk_row(3, 4, 0.2, False)]
            if rows else [],
            "knobs_off": {"latency_us": knobs_off_us, "spread_us": 0.3, "slowdown": knobs_off_us / 35.0}
            if rows else None}
    (run_dir / "topk.json").write_text(json.dumps(topk))
    if breakdown:
        best = {"norm1": 2.0, "qkv": 6.0, "attn": 5.0, "out": 3.0, "norm2": 2.0, "ffn1": 8.0, "ffn2": 8.5}
        base = {k: v + 1.0 for k, v in best.items()}
        (run_dir / "breakdown.json").write_text(json.dumps({"best": best, "baseline": base, "floor_us": 3.4}))
    if importance:
        (run_dir / "importance.json").write_text(json.dumps(
            {"qkv.overlap_ratio": 0.1, "ffn1.block_n": 0.5, "out.prefetch_ratio": 0.4}))
    return run_dir


@pytest.fixture
def run_dir(tmp_path):
    return make_run(tmp_path)


@pytest.fixture
def run(run_dir):
    return report.load_run(run_dir)


def _table(md: str) -> list[list[str]]:
    """The first pipe table of a Markdown text as cells (header first, separator dropped)."""
    lines = md.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("|")), len(lines))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = lines[start:end]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in rows]
    return [cells[0]] + cells[2:]


def test_names_match_tuner_config():
    assert report.KERNELS is KERNELS and report.GEMMS is GEMMS  # (one copy, in tuner.names)


def test_the_tiles_show_l2_hints_exactly_where_a_launch_keeps_them():
    # (tuner.names.reads_l2_hints is the one copy of the rule; before session 50 report and layer each spelled it)
    from itertools import product

    from tuner.layer import launched_config

    for g, cluster, fuse, ffn2_fuse in product(GEMMS, (0, 1, 2), (0, 1, 2), (0, 1, 2)):
        if g == "ffn2" and fuse != ffn2_fuse:
            continue
        cfg = DecoderConfig()
        cfg = cfg.edited([f"{g}.hints=1", f"{g}.cluster={cluster}", f"{g}.fuse={fuse}"])
        if g != "ffn2":
            cfg = cfg.edited([f"ffn2.fuse={ffn2_fuse}"])
        if g in ("out", "ffn2") and fuse:  # (shown as computed by FFN1's kernel: no tiles, no hints)
            continue
        kept = getattr(launched_config(cfg), g).hints == 1
        part = [p for p in report.format_tiles(cfg.to_dict()["kernels"]).split("; ") if p.startswith(g + " ")]
        assert len(part) == 1 and part[0].endswith("/l2hints") == kept, (g, cluster, fuse, ffn2_fuse, part, kept)
        assert kept == (cluster > 0 or (g == "qkv" and fuse == 1) or (g == "ffn1" and ffn2_fuse > 0))


@pytest.mark.parametrize("name", ["tiny", "bert-base", "bert-large"])
def test_the_tiles_show_the_cluster_kernel_exactly_where_a_layer_runs_it(name):
    # A clustered QKV or FFN1 that folds its LayerNorm runs on the Triton kernels in every layer where its row sums
    # come from its K loop or from a producer with more parts than the cluster kernel reads (tuner.names.
    # gemm_kernels). The report judges that without torch, on the run's shape (report._ln_parts, its copy of
    # tuner.layer.ln_parts): over repaired random configurations, its parts and its '/cluster' suffixes must be the
    # layer's. (Producer tiles of 16 columns give bert-base 48 parts, past the 32 the cluster kernel reads.)
    import random

    from devices import H200

    from tuner.layer import _gemm_kernels, ln_parts, repair_config
    from tuner.shapes import PRESETS

    shape = PRESETS[name]
    rng = random.Random(name)
    seen = set()
    for _ in range(600):
        edits = [f"norm1.fuse={rng.choice((0, 1, 2, 2))}", f"norm2.fuse={rng.choice((0, 1, 2, 2))}",
                 f"ffn2.fuse={rng.choice((0, 0, 1, 2))}", f"out.fuse={rng.choice((0, 0, 1))}",
                 f"qkv.fuse={rng.choice((0, 0, 1))}"]
        for g in GEMMS:
            split = rng.choice((1, 1, 2, 4))
            edits += [f"{g}.cluster={rng.choice((0, 2)) if split > 1 else 0}", f"{g}.split_k={split}",
                      f"{g}.block_n={rng.choice((16, 16, 32, 64, 128))}", f"{g}.block_m={rng.choice((32, 64, 64))}",
                      f"{g}.tma={rng.choice((0, 1, 1))}", f"{g}.hints={rng.choice((0, 1))}"]
        cfg = repair_config(DecoderConfig().edited(edits), shape, 2, H200)
        kernels, dims = cfg.to_dict()["kernels"], shape.to_dict()
        parts = ln_parts(shape, cfg)
        tiles = {p.split(" ")[0]: p for p in report.format_tiles(kernels, dims).split("; ")}
        for g in GEMMS:
            ran = _gemm_kernels(cfg, g, shape)
            if g in ("qkv", "ffn1") and ran:
                assert report._ln_parts(kernels, g, dims) == parts.get(g), (g, edits)
            if not ran or g not in tiles or g == "qkv" and cfg.qkv.fuse:
                continue  # (computed in another kernel's launch: shown as such)
            assert ("/cluster" in tiles[g]) == ("cluster" in ran), (g, ran, tiles[g], edits)
            if getattr(cfg, g).cluster:
                seen.add((g, {"qkv": cfg.norm1, "ffn1": cfg.norm2}.get(g, cfg.norm1).fuse if g in ("qkv", "ffn1")
                          else 0, ran))
    # every judgement of a clustered GEMM came up: by its norm's fuse, and past the parts the cluster kernel reads
    # where 16-column producer tiles give more than 32 (d_model > 512)
    want = {("qkv", 1, ("triton",)), ("qkv", 2, ("triton", "cluster")), ("qkv", 0, ("cluster",)),
            ("ffn1", 1, ("triton",)), ("ffn1", 2, ("cluster",)), ("ffn1", 0, ("cluster",)), ("out", 0, ("cluster",))}
    if shape.d_model > 512:
        want |= {("qkv", 2, ("triton",)), ("ffn1", 2, ("triton",))}
    assert want <= seen, want - seen


def test_the_row_sum_parts_limit_is_the_cuda_kernels():
    # tuner.names.MAX_LN_PARTS (the report's judgement, cluster_gemm's and mlp_cluster's checks) is the limit each
    # CUDA kernel that folds a LayerNorm compiles in
    import re

    from tuner.kernels import cluster_gemm
    from tuner.names import MAX_LN_PARTS

    for cu in ("cluster_gemm.cu", "qkv_attn.cu", "mlp_cluster.cu"):
        text = (Path(cluster_gemm.__file__).with_name(cu)).read_text()
        assert re.findall(r"constexpr int MAX_LN_PARTS = (\d+);", text) == [str(MAX_LN_PARTS)], cu


def test_the_tiles_judge_a_folded_gemm_only_with_the_shape():
    cfg = DecoderConfig().edited(["norm2.fuse=2", "ffn1.cluster=2", "ffn1.split_k=2", "out.block_n=16"])
    kernels = cfg.to_dict()["kernels"]
    ffn1 = lambda text: next(p for p in text.split("; ") if p.startswith("ffn1 "))  # noqa: E731
    assert ffn1(report.format_tiles(kernels)).endswith("/cluster16")  # (not judged: shown as configured)
    # bert-base: 768 / 16 = 48 row-sum parts, more than the cluster kernel reads: FFN1 runs on the Triton kernels
    assert "/cluster" not in ffn1(report.format_tiles(kernels, {"d_model": 768, "ffn": 3072}))
    assert ffn1(report.format_tiles(kernels, {"d_model": 256, "ffn": 1024})).endswith("/cluster16")  # 16 parts
    assert "/cluster" not in ffn1(report.format_tiles(DecoderConfig().edited(
        ["norm2.fuse=1", "ffn1.cluster=2", "ffn1.split_k=2"]).to_dict()["kernels"]))  # row sums from its K loop


def test_load_run_reads_every_file(run):
    assert len(run.trials) == len(TRIALS)
    assert run.trials["is_baseline"].dtype == bool and run.trials["is_baseline"].sum() == 1
    assert run.trials.loc[run.trials["status"] == "ok", "reason"].eq("").all()
    assert run.trials.loc[run.trials["number"] == 3, "reason"].item().startswith("max abs err")
    assert run.breakdown["floor_us"] == 3.4 and run.importance is None
    assert (run.shape_name, run.dims, run.gpu_name) == ("bert-base", "1x128x768x12x3072", "NVIDIA H200")


@pytest.mark.parametrize("missing", [["trials.csv"], ["manifest.json", "topk.json"]], ids=["trials", "two"])
def test_load_run_names_missing_files(run_dir, missing):
    for name in missing:
        (run_dir / name).unlink()
    with pytest.raises(RunFolderError) as e:
        report.load_run(run_dir)
    msg = str(e.value)
    assert isinstance(e.value, ValueError) and "\n" not in msg
    assert all(f"{name} is missing" in msg for name in missing)


def test_load_run_names_unreadable_file(run_dir):
    (run_dir / "topk.json").write_text("{not json")
    with pytest.raises(RunFolderError, match=r"topk\.json: not valid JSON \(.* at line 1\)"):
        report.load_run(run_dir)


def test_load_run_names_unreadable_table(run_dir):
    (run_dir / "trials.csv").write_bytes(b"")
    with pytest.raises(RunFolderError, match=r"trials\.csv: cannot be read as a table of trials \("):
        report.load_run(run_dir)


def test_load_run_on_no_folder(tmp_path):
    with pytest.raises(RunFolderError, match="no such run folder"):
        report.load_run(tmp_path / "nope")


@pytest.mark.parametrize("o, p, text", [(0.8, 0.2, "(0.8,0.2)"), (-1, -1, "(-1.0,-1.0)"), (0.0, 1.0, "(0.0,1.0)"),
                                        (0.35, -1.0, "(0.35,-1.0)"), (None, 0.2, "(-,0.2)")])
def test_format_op_like_the_seed(o, p, text):
    assert report.format_op(o, p) == text


def test_topk_markdown_table(run):
    md = report.topk_markdown(run)
    table = _table(md)
    assert table[0] == ["Rank", "Latency(us)", "±", "Speedup", "QKV(o,p)", "Output(o,p)", "FFN1(o,p)",
                        "FFN2(o,p)", "tiles"]
    assert len(table) == 4
    first = table[1]
    assert first[:4] == ["1", "35.00", "0.30", f"{40 / 35:.2f}x"]
    assert first[4:8] == ["(0.8,0.2)", "(0.0,0.0)", "(0.0,0.0)", "(-1.0,-1.0)"]
    assert "ffn1 32x128x64/8w4s/sk2" in first[8] and first[8].startswith("qkv 64x64x64/4w3s/sk1; out ")


def test_topk_markdown_marks_ties(run):
    ranks = [row[0] for row in _table(report.topk_markdown(run))[1:]]
    assert ranks == ["1", "2 (tie)", "3"]
    assert report.TIES_NOTE in report.topk_markdown(run)


def test_topk_markdown_names_what_rows_that_read_alike_differ_in(tmp_path):
    # The table shows each GEMM's (o,p) and tiles; two rows that differ only in a norm's, the attention's or a GEMM's
    # group_m read alike (168 of the 191 committed tables had such rows). Below the table, each says how it differs.
    run_dir = make_run(tmp_path / "a")
    topk = json.loads((run_dir / "topk.json").read_text())
    base = topk["rows"][1]["config"]
    alike = json.loads(json.dumps(base))
    alike["kernels"]["norm1"]["num_warps"] = 2
    alike["kernels"]["qkv"]["group_m"] = 1
    alike["kernels"]["norm2"]["overlap_ratio"] = 0.4
    topk["rows"][2]["config"] = alike
    topk["rows"].append(dict(topk["rows"][2], rank=4, config=base))
    (run_dir / "topk.json").write_text(json.dumps(topk))
    md = report.topk_markdown(report.load_run(run_dir))
    lines = md.splitlines()
    at = lines.index(report.ALIKE_NOTE)
    assert lines[at + 1:lines.index("", at)] == [
        "- rank 3 reads as rank 2 and differs in norm1.num_warps 2 (rank 2: 4); qkv.group_m 1 (rank 2: 8); "
        "norm2.overlap_ratio 0.4 (rank 2: 0.0)",
        "- rank 4 reads as rank 2 and differs in nothing: the same configuration, measured twice"]
    assert at > lines.index(report.TIES_NOTE)
    # more than four fields: the first four, then how many more
    alike["kernels"]["attn"].update(block_m=16, block_n=16)
    alike["kernels"]["norm2"]["num_warps"] = 1
    (run_dir / "topk.json").write_text(json.dumps(topk))
    assert report.alike_lines(report.load_run(run_dir))[1].endswith("; and 2 more")
    # rows that all read apart: no such lines
    assert report.ALIKE_NOTE not in report.topk_markdown(report.load_run(make_run(tmp_path / "b")))


def test_topk_markdown_shows_the_top1_per_kernel_against_each_kernels_floor(tmp_path):
    # breakdown.json under the table: each kernel alone (best 2.0/6.0/5.0/3.0/2.0/8.0/8.5 us in make_run), its
    # baseline, and each GEMM's share of the 3.4 us floor (its weights' share of the layer's)
    from tuner.shapes import DecoderShape

    shape = DecoderShape.from_dict(SHAPE)
    share = {g: 3.4 * n * k / shape.weight_params for g, (_, n, k) in shape.gemms().items()}
    run_dir = make_run(tmp_path / "a")
    lines = report.topk_markdown(report.load_run(run_dir)).splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("Per-kernel breakdown of the top-1"))
    table = {row[0]: row[1:] for row in _table("\n".join(lines[at:]))[1:]}
    assert list(table) == list(KERNELS) + ["sum"]
    assert table["qkv"] == ["6.00", "7.00", f"{share['qkv']:.2f}", f"{6.0 / share['qkv']:.2f}x"]
    assert table["norm1"] == ["2.00", "3.00", "-", "-"]  # (no weights to speak of)
    assert table["sum"] == ["34.50", "41.50", "3.40", f"{34.5 / 3.4:.2f}x"]
    # the feed-forward block (tiny's): the out-projection and FFN2 computed inside FFN1's kernel, whose floor is then
    # all three GEMMs' weights
    bd = json.loads((run_dir / "breakdown.json").read_text())
    bd["best"].update(attn=0.0, out=0.0, norm2=0.0, ffn2=0.0)
    (run_dir / "breakdown.json").write_text(json.dumps(bd))
    lines = report.topk_markdown(report.load_run(run_dir)).splitlines()
    table = {row[0]: row[1:] for row in _table("\n".join(lines[at:]))[1:]}
    block = share["out"] + share["ffn1"] + share["ffn2"]
    assert table["ffn1"] == ["8.00", "9.00", f"{block:.2f}", f"{8.0 / block:.2f}x"]
    assert table["out"] == ["-", "4.00", "-", "-"] and table["ffn2"] == ["-", "9.50", "-", "-"]
    # the one-kernel layer: one figure, all the GEMMs' floors
    bd["best"] = {"layer": 30.0}
    (run_dir / "breakdown.json").write_text(json.dumps(bd))
    lines = report.topk_markdown(report.load_run(run_dir)).splitlines()
    table = {row[0]: row[1:] for row in _table("\n".join(lines[at:]))[1:]}
    assert table["layer"][2] == f"{sum(share.values()):.2f}" and table["qkv"][0] == table["qkv"][2] == "-"
    # no breakdown.json: no such lines
    md = report.topk_markdown(report.load_run(make_run(tmp_path / "b", breakdown=False)))
    assert "Per-kernel breakdown" not in md


def test_topk_markdown_header(run):
    md = report.topk_markdown(run)
    lines = md.splitlines()
    assert lines[0] == "Top 3 configurations for bert-base (1x128x768x12x3072, float16, NVIDIA H200)"
    assert "REPLAYED" not in md
    assert "Baseline latency: 40.00 us (all kernels (-1,-1), default tiles)" in md
    assert "torch.compile latency: 38.70 us" in md
    assert "Top-1 with every (o,p) at (-1,-1), tiles kept: 37.00 us (top-1 is 1.06x faster)" in md
    assert "no measurable difference" not in md
    assert "L2 cold" in md and "12 trials (10 ok, 1 compile_error, 1 incorrect)" in md


def test_topk_markdown_says_when_the_knobs_change_nothing(tmp_path):
    run = report.load_run(make_run(tmp_path, knobs_off_us=35.2))
    assert "within the combined spread: the (o,p) knobs make no measurable difference" in report.topk_markdown(run)


@pytest.mark.parametrize("twin_us, pair, within", [
    # (the table's top-1: 35.0 us +- 0.3; the twin's spread 0.1)
    (36.0, (36.05, 0.1), True),   # beside its twin the top-1 is 0.05 us away (<= 0.1 + 0.1); the table's is 1 us
    (35.2, (35.6, 0.1), False),   # 0.4 us away (> 0.2); the table's is 0.2 us away, inside 0.1 + 0.3
    (35.2, (35.7, None), False),  # a run before top1_spread_us: the table top-1's spread stands in (0.5 > 0.1 + 0.3)
])
def test_knobs_off_verdict_compares_the_top1_measured_beside_it(tmp_path, twin_us, pair, within):
    """The knobs-off line's "within the combined spread" compares the figures it shows: the twin and the top-1
    measured beside it, each with its own spread (the table's top-1 comes from another re-measurement)."""
    run_dir = make_run(tmp_path, knobs_off_us=twin_us)
    topk = json.loads((run_dir / "topk.json").read_text())
    topk["knobs_off"].update(spread_us=0.1, slowdown=twin_us / pair[0], top1_latency_us=pair[0])
    if pair[1] is not None:
        topk["knobs_off"]["top1_spread_us"] = pair[1]
    (run_dir / "topk.json").write_text(json.dumps(topk))
    md = report.topk_markdown(report.load_run(run_dir))
    assert f"{twin_us:.2f} us against {pair[0]:.2f} us for the top-1 measured beside it" in md
    assert ("within the combined spread" in md) == within


def test_topk_markdown_replayed_first_line(tmp_path):
    run = report.load_run(make_run(tmp_path, replayed=True))
    assert report.topk_markdown(run).splitlines()[0] == \
        "REPLAYED (timings served from a recording, not measured now)"


def test_topk_markdown_without_passing_trials(tmp_path):
    run = report.load_run(make_run(tmp_path, rows=False))
    md = report.topk_markdown(run)
    assert "Top 0 configurations" in md and "No configuration passed" in md
    assert report.topk_frame(run).empty


def test_topk_frame_and_csv(run):
    df = report.topk_frame(run)
    assert df["rank"].tolist() == [1, 2, 3] and df["trial"].tolist() == [8, 11, 4]
    assert df["tie"].tolist() == [False, True, False]
    assert df["qkv_op"].tolist() == ["(0.8,0.2)", "(0.0,0.0)", "(0.8,0.2)"]
    assert df.loc[0, "ffn1.split_k"] == 2 and df.loc[1, "ffn1.split_k"] == 1
    md_path, csv_path = report.write_topk(run)
    assert md_path.read_text() == report.topk_markdown(run)
    back = pd.read_csv(csv_path)
    assert back["trial"].tolist() == [8, 11, 4] and "qkv.overlap_ratio" in back.columns


def test_summary(tmp_path):
    runs = [report.load_run(make_run(tmp_path, name="bert-base")),
            report.load_run(make_run(tmp_path, name="tiny", replayed=True))]
    df = report.summary_frame(runs)
    assert df["best_us"].tolist() == [35.0, 35.0]
    assert df.loc[0, "vs_compile"] == pytest.approx(COMPILE_US / 35.0)
    md = report.summary_markdown(runs)
    assert md.splitlines()[0] == f"{report.REPLAYED_LINE}: tiny"
    assert "SUMMARY OF ALL SHAPES" in md
    table = _table(md)
    assert table[0] == ["Shape", "Dimensions", "Baseline(us)", "Best(us)", "Speedup", "torch.compile(us)",
                        "vs compile", "Best_QKV", "Best_Output", "Best_FFN1", "Best_FFN2"]
    assert table[1] == ["bert-base", "1x128x768x12x3072", "40.00", "35.00", "1.14x", "38.70", "1.11x",
                        "(0.8,0.2)", "(0.0,0.0)", "(0.0,0.0)", "(-1.0,-1.0)"]
    assert table[2][0] == "tiny (replayed)"
    path = report.write_summary(runs, tmp_path / "summary.md")
    assert path.read_text() == md
    assert "REPLAYED" not in report.summary_markdown(runs[:1])


def test_history_data(run):
    df = report.history_data(run)
    assert df["number"].tolist() == [n for n, st, _, _ in TRIALS if st == "ok"]
    assert df["best_us"].is_monotonic_decreasing
    assert df["best_us"].tolist() == df["latency_us"].cummin().tolist()
    assert df["best_us"].iloc[-1] == 35.0 and df["is_baseline"].iloc[0]


def test_ratio_plane_data(run):
    data = report.ratio_plane_data(run)
    assert set(data["gemm"]) == set(GEMMS)
    qkv = report.ratio_plane_pivot(data, "qkv")
    assert qkv.index.tolist() == [-1.0, 0.0, 0.2]          # prefetch_ratio
    assert qkv.columns.tolist() == [-1.0, 0.0, 0.4, 0.8]   # overlap_ratio; failed trials' cells absent
    assert qkv.loc[0.2, 0.8] == pytest.approx(statistics.median(OK_SPEEDUP[n] for n in (1, 4, 8)))
    assert qkv.loc[-1.0, 0.4] == pytest.approx(statistics.median(OK_SPEEDUP[n] for n in (2, 6, 10)))
    assert qkv.loc[-1.0, -1.0] == pytest.approx(statistics.median(OK_SPEEDUP[n] for n in (0, 7)))
    assert pd.isna(qkv.loc[0.2, 0.4])  # not sampled
    n = data.set_index(["gemm", "overlap_ratio", "prefetch_ratio"])["n_trials"]
    assert n[("qkv", 0.8, 0.2)] == 3 and n.xs("qkv").sum() == len(OK_SPEEDUP)
    ffn2 = report.ratio_plane_pivot(data, "ffn2")
    assert ffn2.shape == (1, 1)
    assert ffn2.iloc[0, 0] == pytest.approx(statistics.median(OK_SPEEDUP.values()))


def test_ratio_plane_without_speedup_column(run_dir, run):
    """A run before trials.csv had a speedup column: load_run computes it from the search's baseline trial."""
    trials = pd.read_csv(run_dir / "trials.csv").drop(columns=["speedup"])
    trials.to_csv(run_dir / "trials.csv", index=False)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["baselines"]["search_baseline_us"] = 2 * BASELINE_US
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    data = report.ratio_plane_data(report.load_run(run_dir))
    expected = report.ratio_plane_data(run)
    assert data["median_speedup"].tolist() == pytest.approx((2 * expected["median_speedup"]).tolist())


def test_ratio_planes_take_the_pair_each_launch_reads(run_dir):
    """The out-projection and FFN2 computed in the feed-forward block read no pair of their own: such a trial is
    not in their planes. That block reads FFN1's overlap ratio as on or off (0.0); the one-kernel layer's pair
    (fuse 1 or 2) stands for every GEMM. (The committed tiny run had 15 of a cell's 21 trials at a pair nothing read.)"""
    trials = pd.read_csv(run_dir / "trials.csv")
    n = trials["number"]
    trials.loc[n == 1, "out.fuse"] = 1
    trials.loc[n == 2, ["ffn2.fuse", "ffn1.overlap_ratio"]] = [2, 0.4]
    trials.loc[n == 4, ["layer.fuse", "layer.overlap_ratio", "layer.prefetch_ratio"]] = [2, 0.6, 0.3]
    trials.to_csv(run_dir / "trials.csv", index=False)
    run = report.load_run(run_dir)
    pairs = report.trial_pairs(run).set_index(["gemm", "number"])
    assert ("out", 1) not in pairs.index and ("ffn2", 2) not in pairs.index
    assert ("out", 2) in pairs.index and ("ffn2", 1) in pairs.index
    assert pairs.loc[("ffn1", 2), "overlap_ratio"] == 0.0 and pairs.loc[("ffn1", 1), "overlap_ratio"] == 0.0
    for g in GEMMS:
        assert tuple(pairs.loc[(g, 4), ["overlap_ratio", "prefetch_ratio"]]) == (0.6, 0.3)
    counted = report.ratio_plane_data(run).groupby("gemm")["n_trials"].sum()
    assert counted["out"] == counted["ffn2"] == len(OK_SPEEDUP) - 1
    assert counted["qkv"] == counted["ffn1"] == len(OK_SPEEDUP)
    qkv = report.ratio_plane_pivot(report.ratio_plane_data(run), "qkv")
    assert qkv.loc[0.3, 0.6] == pytest.approx(OK_SPEEDUP[4])


def test_importance_data(tmp_path, run):
    assert report.importance_data(run).empty
    assert report.plot_importance(run, tmp_path / "imp.png") is None and not (tmp_path / "imp.png").exists()
    with_imp = report.load_run(make_run(tmp_path, name="x", importance=True))
    df = report.importance_data(with_imp)
    assert df["param"].tolist() == ["ffn1.block_n", "out.prefetch_ratio", "qkv.overlap_ratio"]


def test_breakdown_data(tmp_path, run):
    df = report.breakdown_data(run)
    assert df["kernel"].tolist() == list(KERNELS) + ["sum"]
    assert df.iloc[-1]["best_us"] == pytest.approx(34.5)
    assert df.iloc[-1]["baseline_us"] == pytest.approx(34.5 + len(KERNELS))
    assert report.breakdown_data(report.load_run(make_run(tmp_path, name="x", breakdown=False))).empty


def test_topk_data(run):
    df = report.topk_data(run)
    assert df.columns.tolist() == ["rank", "trial", "latency_us", "spread_us", "tie"]
    assert df["latency_us"].tolist() == [35.0, 35.2, 36.0]


def test_write_reports_creates_files(tmp_path):
    run_dir = make_run(tmp_path, importance=True, replayed=True)
    paths = report.write_reports(run_dir)
    names = sorted(p.relative_to(run_dir).as_posix() for p in paths)
    assert names == sorted(["topk.md", "topk.csv"] + [f"plots/{n}.png" for n in report.PLOTS])
    for p in paths:
        assert p.is_file() and p.stat().st_size > 0
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(run_dir.rglob("*.tmp"))


def test_plots_are_written_with_a_palette_that_keeps_what_they_show(tmp_path):
    from PIL import Image

    fig = report._figure(6, 4)
    ax = fig.add_subplot()
    grid = np.linspace(0, 1, 64).reshape(8, 8)
    ax.imshow(grid, cmap="RdYlGn")
    for i in range(8):
        ax.text(i, i, f"{grid[i, i]:.2f}", ha="center", va="center", fontsize=7)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    full = buf.getvalue()
    path = report._save(fig, tmp_path / "plot.png")
    small = path.read_bytes()
    assert len(small) < 0.6 * len(full)
    with Image.open(io.BytesIO(full)) as a, Image.open(path) as b:
        assert b.mode == "P" and a.size == b.size
        diff = np.abs(np.asarray(a.convert("RGB"), dtype=int) - np.asarray(b.convert("RGB"), dtype=int)).max(axis=2)
    assert (diff > 8).mean() < 0.01 and diff.max() < 64
    clear = io.BytesIO()
    Image.new("RGBA", (4, 4), (255, 0, 0, 0)).save(clear, format="PNG")
    assert report.compact_png(clear.getvalue()) == clear.getvalue()  # transparency is kept as it is
    assert report.compact_png(small) == small


def test_the_topk_plot_spans_its_rows_and_names_the_references_beyond_them(tmp_path, monkeypatch):
    # On an axis down from the baseline, ten rows within 1 us of each other were one flat line (session 52): the axis
    # spans the rows with their spreads, and a reference beyond it is a legend entry with its ratio to the top-1.
    drawn = []
    monkeypatch.setattr(report, "_save", lambda fig, path: drawn.append(fig) or Path(path))
    run = report.load_run(make_run(tmp_path / "a"))
    report.plot_topk(run, tmp_path / "topk.png")
    ax = drawn[-1].axes[0]
    lats = [r["latency_us"] for r in run.rows]
    lo, hi = ax.get_ylim()
    assert lo < min(lats) and max(lats) < hi
    assert hi < BASELINE_US and hi < COMPILE_US, (lo, hi)
    labels = ax.get_legend_handles_labels()[1]
    top1 = lats[0]
    assert labels == [f"baseline {BASELINE_US:.2f} us (above the axis: {BASELINE_US / top1:.2f}x the top-1)",
                      f"torch.compile {COMPILE_US:.2f} us (above the axis: {COMPILE_US / top1:.2f}x the top-1)"]
    assert not [ln for ln in ax.get_lines() if len(ln.get_ydata()) and ln.get_ydata()[0] in (BASELINE_US,
                                                                                               COMPILE_US)]
    assert sorted(t.get_text() for t in ax.texts) == sorted(f"{v:.2f}" for v in lats)
    # a reference within the rows' span is drawn as a line
    topk = json.loads((run.path / "topk.json").read_text())
    topk["compile_us"] = lats[1]
    (run.path / "topk.json").write_text(json.dumps(topk))
    man = json.loads((run.path / "manifest.json").read_text())
    man["baselines"]["compile_us"] = lats[1]
    (run.path / "manifest.json").write_text(json.dumps(man))
    run = report.load_run(run.path)
    report.plot_topk(run, tmp_path / "topk.png")
    ax = drawn[-1].axes[0]
    assert f"torch.compile {lats[1]:.2f} us" in ax.get_legend_handles_labels()[1]
    assert [ln for ln in ax.get_lines() if list(ln.get_ydata()) == [lats[1], lats[1]]]


def test_write_reports_skips_plots_without_data(tmp_path):
    run_dir = make_run(tmp_path, breakdown=False, rows=False)
    names = {p.name for p in report.write_reports(run_dir)}
    assert names == {"topk.md", "topk.csv", "history.png", "ratio_plane.png"}


def test_the_manifest_names_one_driver_on_a_host_of_several_gpus(monkeypatch):
    # nvidia-smi prints one driver line a GPU: a manifest of a 2-GPU host held "580.1\n580.1" (the DESIGN audit)
    import subprocess
    import types

    import torch

    from tuner import manifest

    props = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                                  L2_cache_size=60 * 2**20, total_memory=140 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout="580.159.04\n580.159.04\n"))
    env = manifest.environment()
    assert env["driver"] == "580.159.04" and env["gpu"]["name"] == "NVIDIA H200"


def _redrawn_topk(run: str, tmp_path) -> str:
    """topk.md of a committed run folder (``run``, relative to the checkout) re-drawn by this code, in a copy."""
    import shutil
    from pathlib import Path

    copy = Path(shutil.copytree(Path(__file__).parents[1] / run, tmp_path / "run"))
    report.write_reports(copy)
    return (copy / "topk.md").read_text()


@pytest.mark.parametrize("run, warned", [
    ("results/session46/4096x16x512x16x512/20261128-145204-tpe", True),  # its seeds never entered the study
    ("results/session46/4096x16x512x16x512/20261128-150524-tpe", False),
    ("results/bert-base/20261128-004550-tpe", False),
])
def test_a_top1_slower_than_the_baseline_is_named(tmp_path, run, warned):
    # H200, session 46 call 3: the table's top-1 took 3,527 us a layer against the default configuration's 1,021, and
    # nothing above the table said so
    text = _redrawn_topk(run, tmp_path)
    assert ("WARNING: the baseline, the default configuration, is faster than every row below" in text) == warned
    if warned:
        assert "(1020.70 against 3526.93 us)" in text


@pytest.mark.parametrize("run, grouped", [
    ("results/session46/4096x16x512x16x512/20261128-145204-tpe", True),  # policy.final.remeasure.groups
    ("results/session46/4096x16x512x16x512/20261128-150524-tpe", False),
])
def test_a_remeasurement_in_groups_is_named(tmp_path, run, grouped):
    # "interleaved" was said of rows that were timed one group after another (the review of session 46)
    text = _redrawn_topk(run, tmp_path)
    assert ("Re-measured in groups that fit the GPU's memory ([[1, 1, 1, 1], [1, 1]]" in text) == grouped
    assert "each interleaved with the baseline" not in text  # (its groups were stacks alone: nothing beside them)


def test_a_remeasurement_in_groups_beside_the_baseline_says_so(tmp_path):
    # since session 47 the baseline is in every group where a stack fits beside it (GpuEvaluator.remeasure's anchor),
    # and the manifest says so (policy.final.remeasure.anchored)
    import json
    import shutil
    from pathlib import Path

    run = Path(shutil.copytree(Path(__file__).parents[1] / "results/session46/4096x16x512x16x512/20261128-145204-tpe",
                               tmp_path / "run"))
    man = json.loads((run / "manifest.json").read_text())
    man["policy"]["final"]["remeasure"].update(groups=[[3, 3], [2]], anchored=[True, True])
    (run / "manifest.json").write_text(json.dumps(man))
    report.write_reports(run)
    text = (run / "topk.md").read_text()
    assert "([[3, 3], [2]], one list a re-measurement), one group after another, each interleaved with the baseline" \
        in text and "not interleaved" not in text


def _failing_plot(run, path):
    raise ValueError("a value no check caught")


def test_a_plot_that_fails_is_left_out_and_the_others_drawn(tmp_path, monkeypatch):
    # (a damaged value that load_run's checks miss: one plot fails, not the whole report)
    run_dir = make_run(tmp_path, importance=True)
    monkeypatch.setitem(report.PLOTTERS, "ratio_plane", _failing_plot)
    skipped = []
    names = {p.name for p in report.write_reports(run_dir, skipped)}
    assert names == {"topk.md", "topk.csv"} | {f"{n}.png" for n in report.PLOTS if n != "ratio_plane"}
    assert skipped == ["plots/ratio_plane.png not drawn (ValueError: a value no check caught)"]
    with pytest.raises(RunFolderError, match="ratio_plane.png not drawn"):  # without the list: raised after the rest
        report.write_reports(run_dir)
    assert (run_dir / "plots" / "topk.png").is_file()


def test_a_plot_that_cannot_be_written_is_raised_at_once(tmp_path, monkeypatch):
    run_dir = make_run(tmp_path)

    def unwritable(run, path):
        raise PermissionError(13, "Permission denied", str(path))

    called = []
    assert report.PLOTS[0] == "history"
    for name in report.PLOTS[1:]:
        monkeypatch.setitem(report.PLOTTERS, name, lambda run, path, name=name: called.append(name))
    monkeypatch.setitem(report.PLOTTERS, "history", unwritable)
    with pytest.raises(PermissionError):
        report.write_reports(run_dir, [])
    assert called == []  # (at once: the next plot would fail the same way)


def test_tiles_name_the_cluster_kernel_and_only_hints_a_launch_reads():
    # (the run of record's out-projection and FFN2 ran on the CUDA cluster kernel, and the tiles said nothing of it;
    # '/l2hints' was shown on Triton GEMMs, which ignore the field)
    kernels = DecoderConfig().to_dict()["kernels"]
    for g in GEMMS:
        kernels[g].update(hints=1, tma=1)
    kernels["out"].update(cluster=1, split_k=4)
    kernels["ffn2"].update(cluster=2, split_k=4)
    kernels["qkv"].update(fuse=1)
    parts = report.format_tiles(kernels).split("; ")
    assert parts[0].endswith("/sk1/tma/l2hints") and parts[1] == "attn in qkv"  # QKV's CUDA kernel with the attention
    assert parts[2].endswith("/sk4/tma/cluster/l2hints") and parts[4].endswith("/sk4/tma/cluster16/l2hints")
    assert parts[3].startswith("ffn1 ") and parts[3].endswith("/sk1/tma")  # the Triton GEMM: no hints shown
