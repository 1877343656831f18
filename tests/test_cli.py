"""`tune` end to end on CPU: `tune decoder --replay` serves the H200 recording in tests/data (a real
`tune decoder` run), then resume, export, report, shapes, and every user mistake: exit code 2, one line
on stderr, no traceback, nothing written.

``tuner.cli.main(argv)`` runs in-process; one test runs the installed `tune` console script.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.resources
import io
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import optuna
import pandas as pd
import pytest
import yaml

import tuner
from tuner import space as space_mod
from tuner.cli import main
from tuner.config import DecoderConfig
from tuner.export import ConfigMismatchWarning
from tuner.layer import default_config
from tuner.report import REPLAYED_LINE
from tuner.shapes import PRESETS

REPLAY = Path(__file__).parent / "data" / "replay-bert-base-h200"
ROOT = Path(__file__).resolve().parents[1]
BUDGET = 25
STATUSES = {"ok", "invalid", "compile_error", "out_of_resources", "incorrect", "timeout", "crashed"}
SEED_HEADERS = ["Rank", "Latency(us)", "±", "Speedup", "QKV(o,p)", "Output(o,p)", "FFN1(o,p)", "FFN2(o,p)", "tiles"]
TOPK_COLUMNS = ["rank", "trial", "latency_us", "spread_us", "speedup", "tie", "qkv_op", "out_op", "ffn1_op",
                "ffn2_op", "tiles", "replayed", "approximated"]
PNG = b"\x89PNG\r\n\x1a\n"


def tune(*argv) -> tuple[int, str, str]:
    """``tune ARGV`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def decoder(out, trials=BUDGET, *extra) -> tuple[int, str, str]:
    return tune("decoder", "--replay", REPLAY, "--trials", trials, "--no-progress", "--out", out, *extra)


def run_folder(stdout: str) -> Path:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("run folder: ")]
    assert len(lines) == 1, stdout[-2000:]
    return Path(lines[0][len("run folder: "):])


def study_of(run: Path) -> optuna.Study:
    """The study a run folder came from, opened from ``<out>/studies.db`` (the default storage)."""
    manifest = json.loads((run / "manifest.json").read_text())
    out_root = run.parent.parent
    return optuna.load_study(study_name=manifest["study_name"],
                             storage=f"sqlite:///{(out_root / 'studies.db').as_posix()}")


def finished(study) -> list[tuple]:
    """(number, state, params, value) of every finished trial, in order."""
    return [(t.number, t.state.name, t.params, t.value) for t in study.trials if t.state.is_finished()]


def snapshot(folder: Path) -> dict:
    """Every file under ``folder`` with a hash of its bytes (to show that nothing was written)."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """One replayed `tune decoder` run of the budget, shared by the tests that only read it."""
    out = tmp_path_factory.mktemp("results")
    rc, stdout, stderr = decoder(out)
    assert rc == 0, stderr
    return out, run_folder(stdout), stdout, stderr


@pytest.fixture
def run_copy(first, tmp_path):
    """A copy of the shared run folder that a test may change."""
    return Path(shutil.copytree(first[1], tmp_path / "run"))


# ------------------------------------------------------------------------------------------------
# tune decoder --replay, end to end
# ------------------------------------------------------------------------------------------------

def test_decoder_replay_writes_the_run_folder(first):
    out, run, stdout, stderr = first
    assert run.parent == out / "bert-base"
    assert stdout.startswith("REPLAYING ") and "nothing is measured now" in stdout.splitlines()[0]
    assert "Traceback" not in stderr
    for name in ("manifest.json", "trials.csv", "topk.md", "topk.csv", "topk.json", "best.json"):
        assert (run / name).is_file(), name
    for name in ("history", "topk"):
        png = run / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == PNG, png
    assert (out / "studies.db").is_file()


def test_replay_reads_its_recording_once(tmp_path, monkeypatch):
    """In this process (a replay's default) the evaluator the command line was checked with serves the study."""
    from tuner import evaluate

    built = []
    real = evaluate.ReplayEvaluator.__init__

    def counting(self, *a, **k):
        built.append(a)
        real(self, *a, **k)

    monkeypatch.setattr(evaluate.ReplayEvaluator, "__init__", counting)
    rc, stdout, stderr = decoder(tmp_path, 2)
    assert rc == 0, stderr
    assert len(built) == 1, built
    assert json.loads((run_folder(stdout) / "manifest.json").read_text())["n_trials"] == 2


def test_manifest_says_replayed(first):
    _, run, _, _ = first
    m = json.loads((run / "manifest.json").read_text())
    assert m["replayed"] is True and m["kind"] == "decoder"
    assert m["gpu"]["name"] == "NVIDIA H200"  # the GPU the recording was made on
    assert m["shape"]["name"] == "bert-base" and m["n_trials"] == BUDGET
    assert str(REPLAY) in json.dumps(m)  # where the timings came from
    assert m["pdl_tune"] == tuner.__version__  # (an installed copy's provenance, where its git revision is unknown)


def test_trials_csv(first):
    _, run, _, _ = first
    trials = pd.read_csv(run / "trials.csv")
    assert trials["number"].tolist() == list(range(BUDGET))
    assert set(trials["status"]) <= STATUSES
    assert (trials["status"] == "ok").sum() >= 3
    base = trials[trials["is_baseline"]]
    assert base["number"].tolist() == [0] and base["status"].item() == "ok"
    # The baseline row is the default tiles with every pair at (-1, -1), parameter by parameter.
    for name, value in space_mod.from_config(default_config(PRESETS["bert-base"])).items():
        assert base[name].item() == value, name
    assert trials.loc[trials["status"] != "ok", "latency_us"].isna().all()


def test_topk_tables(first):
    _, run, stdout, _ = first
    md = (run / "topk.md").read_text()
    assert md.splitlines()[0] == REPLAYED_LINE
    header = next(ln for ln in md.splitlines() if ln.replace(" ", "").startswith("|Rank|"))
    assert [c.strip() for c in header.strip("|").split("|")] == SEED_HEADERS
    assert md in stdout  # the table is printed too
    topk = pd.read_csv(run / "topk.csv")
    assert topk.columns.tolist()[:len(TOPK_COLUMNS)] == TOPK_COLUMNS
    assert 1 <= len(topk) <= 10 and topk["rank"].tolist() == list(range(1, len(topk) + 1))
    assert topk["replayed"].all()  # a CSV read on its own still says where its timings came from
    tj = json.loads((run / "topk.json").read_text())
    assert tj["replayed"] is True and [r["trial"] for r in tj["rows"]] == topk["trial"].tolist()


def test_best_json(first):
    _, run, _, _ = first
    best = json.loads((run / "best.json").read_text())
    topk = json.loads((run / "topk.json").read_text())
    assert best["schema_version"] == 1 and best["replayed"] is True
    assert best["config"] == topk["rows"][0]["config"]
    assert best["speedup"] == pytest.approx(best["baseline_us"] / best["latency_us"])


def test_rerun_continues_the_same_study(first, tmp_path):
    before = finished(study_of(first[1]))
    assert len(before) == BUDGET
    out = Path(shutil.copytree(first[0], tmp_path / "results"))

    # The same command again: the budget is spent, nothing new is run.
    rc, stdout, stderr = decoder(out)
    assert rc == 0, stderr
    again = run_folder(stdout)
    assert finished(study_of(again)) == before
    assert json.loads((again / "manifest.json").read_text())["n_trials"] == BUDGET

    # A larger budget adds exactly the difference, and keeps every completed trial as it was.
    rc, stdout, stderr = decoder(out, BUDGET + 5)
    assert rc == 0, stderr
    more = run_folder(stdout)
    after = study_of(more)
    now = finished(after)
    assert len(now) == BUDGET + 5 and now[:BUDGET] == before
    assert [t.number for t in after.trials] == list(range(BUDGET + 5))
    # No completed trial is run again: a new trial whose config was already measured reuses that result.
    hashes = {t.user_attrs["config_hash"]: t.number for t in after.trials[:BUDGET] if "config_hash" in t.user_attrs}
    for t in after.trials[BUDGET:]:
        h = t.user_attrs.get("config_hash")
        if h in hashes:
            assert t.user_attrs.get("duplicate_of") is not None, t.number
    assert len(pd.read_csv(more / "trials.csv")) == BUDGET + 5
    assert len({first[1].name, again.name, more.name}) == 3  # three runs, three folders


def test_rerun_with_another_identity_is_refused(first, tmp_path):
    out = Path(shutil.copytree(first[0], tmp_path / "results"))
    name = json.loads((first[1] / "manifest.json").read_text())["study_name"]
    before, files = finished(study_of(out / "bert-base" / first[1].name)), snapshot(out)
    # (with --replay, dtype and L2 policy are the recording's: another search space is what can differ)
    narrow = _space_file(tmp_path, lambda d: d["gemm"].update(block_m=[32, 64]))
    rc, stdout, stderr = decoder(out, BUDGET + 5, "--study-name", name, "--search-space", narrow)
    assert rc == 2 and stderr.startswith("tune: error: ") and stderr.count("\n") == 1, stderr
    assert name in stderr and "--study-name" in stderr and "another search space" in stderr
    # the default study of the same --out likewise
    rc, stdout, stderr = decoder(out, BUDGET + 5, "--search-space", narrow)
    assert rc == 2 and "another search space" in stderr and stderr.count("\n") == 1, stderr
    assert finished(study_of(out / "bert-base" / first[1].name)) == before
    assert snapshot(out) == files


def test_export(first, tmp_path):
    _, run, _, _ = first
    target = tmp_path / "exported" / "best.json"
    rc, stdout, stderr = tune("export", run, "-o", target)
    # (a replayed run: exported, with a note on stderr that its timings were served; its top-1 is a configuration
    # the recording measured, since session 52 even where the replay reached it through an approximated trial)
    assert rc == 0 and str(target) in stdout
    assert stderr == f"tune: note: {run} was replayed: its timings were served from a recording, not measured\n"
    exported = json.loads(target.read_text())
    assert exported == json.loads((run / "best.json").read_text())
    assert exported["replayed"] is True and exported["approximated"] is False
    with pytest.warns(ConfigMismatchWarning, match="chosen in a replay: its timing was served from a recording, not "
                                                   "measured"):
        cfg = tuner.load_config(target, shape="bert-base", gpu="NVIDIA H200", strict=True)
    assert isinstance(cfg, DecoderConfig) and cfg.to_dict() == exported["config"]
    # Without -o the JSON goes to stdout.
    rc, stdout, _ = tune("export", run)
    assert rc == 0 and json.loads(stdout) == exported


def test_export_of_another_rank(first, run_copy, tmp_path):
    # the second row of the table, with its own figures (a user whose model may not launch the top-1's kernels)
    _, run, _, _ = first
    rows = json.loads((run / "topk.json").read_text())["rows"]
    target = tmp_path / "rank2.json"
    rc, stdout, stderr = tune("export", run, "--rank", 2, "-o", target)
    assert rc == 0 and str(target) in stdout, stderr
    exported = json.loads(target.read_text())
    assert exported["rank"] == 2 and exported["trial"] == rows[1]["trial"] and exported["config"] == rows[1]["config"]
    assert (exported["latency_us"], exported["speedup"]) == (rows[1]["latency_us"], rows[1]["speedup"])
    assert "knobs_off_us" not in exported and exported["approximated"] == rows[1]["approximated"]
    assert ("rank 2's from the nearest" in stderr) == rows[1]["approximated"]
    with pytest.warns(ConfigMismatchWarning, match="chosen in a replay"):
        assert tuner.load_config(target, shape="bert-base", gpu="NVIDIA H200").to_dict() == rows[1]["config"]
    rc, stdout, _ = tune("export", run, "--rank", 1)
    assert rc == 0 and json.loads(stdout) == json.loads((run / "best.json").read_text())
    assert_user_error(*tune("export", run, "--rank", len(rows) + 1), [f"--rank {len(rows) + 1}",
                                                                      f"ranks 1 to {len(rows)}"])
    assert_user_error(*tune("export", run, "--rank", 0), ["--rank 0", "must be 1"])
    (run_copy / "topk.json").unlink()
    assert_user_error(*tune("export", run_copy, "--rank", 2), ["no readable topk.json"])


def test_report_redraws_tables_and_plots(first, run_copy):
    md = (run_copy / "topk.md").read_text()
    for name in ("topk.md", "topk.csv"):
        (run_copy / name).unlink()
    shutil.rmtree(run_copy / "plots")
    rc, stdout, stderr = tune("report", run_copy)
    assert rc == 0 and stderr == ""
    assert (run_copy / "topk.md").read_text() == md and md in stdout
    assert (run_copy / "topk.csv").is_file()
    for name in ("history", "topk"):
        assert (run_copy / "plots" / f"{name}.png").read_bytes()[:8] == PNG


def test_shapes():
    rc, stdout, stderr = tune("shapes")
    assert rc == 0 and stderr == ""
    for name, shape in PRESETS.items():
        line = next(ln for ln in stdout.splitlines() if ln.startswith(name + " "))
        assert shape.spec in line
    assert set(PRESETS) == {"tiny", "bert-base", "bert-large"}


def _tune_script() -> str:
    """The `tune` console script of this Python's installation (pip install -e . puts it beside python)."""
    script = shutil.which("tune", path=str(Path(sys.executable).parent)) or shutil.which("tune")
    assert script, "no `tune` console script: install the project with `pip install -e .`"
    return script


def test_console_script(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    out = tmp_path / "results"
    p = subprocess.run([_tune_script(), "decoder", "--replay", str(REPLAY), "--trials", "6", "--top-k", "3",
                        "--no-progress", "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    run = run_folder(p.stdout)
    assert (run / "best.json").is_file() and len(pd.read_csv(run / "trials.csv")) == 6
    assert "Traceback" not in p.stderr
    # A user mistake through the real entry point: one line, exit code 2, nothing written.
    bad = tmp_path / "bad"
    p = subprocess.run([_tune_script(), "decoder", "--shape", "bert-huge", "--replay", str(REPLAY), "--out", str(bad)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.startswith("tune: error: unknown shape 'bert-huge'") and p.stderr.count("\n") == 1, p.stderr
    assert not bad.exists()


def test_a_shape_typo_fails_before_torch_is_imported():
    """A typo in --shape or a number fails at once: before the imports that load torch (seconds on a GPU box)."""
    code = ("import sys; from tuner.cli import main; "
            "rc = [main(['decoder', '--shape', 'bert-huge']), main(['decoder', '--trials', '0'])]; "
            "print(rc, 'torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "[2, 2] False", (p.stdout, p.stderr)
    assert p.stderr.count("\n") == 2 and "unknown shape 'bert-huge'" in p.stderr and "--trials 0" in p.stderr


# ------------------------------------------------------------------------------------------------
# User mistakes: exit code 2, one line, no traceback, nothing written
# ------------------------------------------------------------------------------------------------

def _space_file(folder: Path, edit=None, text=None) -> Path:
    path = folder / "my-space.yaml"
    if text is None:
        data = yaml.safe_load(importlib.resources.files("tuner.search_spaces").joinpath("decoder.yaml").read_text())
        edit(data)
        text = yaml.safe_dump(data, sort_keys=False)
    path.write_text(text)
    return path


def _unknown_gemm_key(d):
    d["gemm"]["blockk"] = [32]


def _non_list(d):
    d["gemm"]["group_m"] = 8


def _ratio_1_5(d):
    d["ratios"]["overlap"] = [-1.0, 0.5, 1.5]


# (id, extra argv for `tune decoder --replay REPLAY --no-progress --out OUT`, words the message must contain).
# "{space}" is replaced with a search-space file written by the test.
BAD_DECODER = [
    ("unknown-shape", ["--shape", "bert-huge"], ["unknown shape 'bert-huge'", "tiny, bert-base, bert-large"]),
    ("shape-zero", ["--shape", "1x0x768x12x3072"], ["seq=0", "positive"]),
    ("shape-negative", ["--shape", "1x128x-768x12x3072"], ["d_model=-768", "positive"]),
    ("shape-four-numbers", ["--shape", "1x128x768x12"], ["BxSxDxHxF"]),
    ("shape-not-numbers", ["--shape", "1x128xbigx12x3072"], ["five integers"]),
    ("shape-heads-do-not-divide", ["--shape", "1x128x770x12x3072"], ["d_model=770", "heads=12"]),
    ("shape-head-dim-16", ["--shape", "1x128x256x16x1024"], ["head dim 16"]),
    ("shape-head-dim-256", ["--shape", "1x128x1024x4x4096"], ["head dim 256"]),
    ("shape-32-bit-offsets", ["--shape", "2048x128x2048x16x8192"], ["tokens*max(3*d_model, ffn) = 2147483648",
                                                                   "32-bit offsets"]),
    ("trials-0", ["--trials", "0"], ["--trials 0"]),
    ("trials-negative", ["--trials", "-3"], ["--trials -3"]),
    ("unknown-sampler", ["--sampler", "anneal"], ["--sampler anneal", "tpe, random, grid, cmaes, gp, qmc"]),
    ("grid-over-the-default-space", ["--sampler", "grid"], ["--sampler grid", "points"]),
    ("unknown-dtype", ["--dtype", "fp8"], ["--dtype fp8", "float16"]),
    ("top-k-0", ["--top-k", "0"], ["--top-k 0"]),
    ("space-missing", ["--search-space", "{missing}"], ["{missing}", "not found"]),
    ("space-bad-yaml", ["--search-space", "{space}"], ["{space}", "not valid YAML", "line 3"]),
    ("space-unknown-key", ["--search-space", "{space}"], ["{space}", "gemm:", "'blockk'"]),
    ("space-non-list", ["--search-space", "{space}"], ["{space}", "gemm.group_m:", "list"]),
    ("space-ratio-1.5", ["--search-space", "{space}"], ["{space}", "ratios.overlap:", "1.5"]),
    ("storage-not-a-url", ["--storage", "notaurl"], ["--storage", "notaurl"]),
    ("storage-unreachable-postgresql", ["--storage", "postgresql://nobody@127.0.0.1:1/x"],
     ["--storage", "postgresql://nobody@127.0.0.1:1/x"]),
    ("replay-missing", ["--replay", "{missing}"], ["--replay", "{missing}"]),
    ("replay-of-another-shape", ["--shape", "tiny"], ["1x128x768x12x3072", "1x32x256x4x1024"]),
    ("replay-of-another-dtype", ["--dtype", "float32"], ["--dtype float32", "measured with --dtype float16"]),
    ("replay-of-another-l2-policy", ["--l2", "hot"], ["--l2 hot", "measured with --l2 cold"]),
    ("replay-of-shape-file-shapes", ["--shape-file", "{shapes}"], ["--replay serves one recording"]),
    ("storage-journal-onto-another-file", ["--storage", "journal:{notes}"], ["{notes}", "not an Optuna journal"]),
    ("storage-sqlite-without-a-file", ["--storage", "sqlite:///"], ["sqlite:///PATH needs a file"]),
    ("storage-sqlite-in-memory", ["--storage", "sqlite:///:memory:"], ["sqlite:///PATH needs a file"]),
    ("seed-negative", ["--seed", "-1"], ["--seed -1"]),
    ("out-empty", ["--out", ""], ["--out ''"]),
    ("out-blank", ["--out", " "], ["--out ' '"]),
    ("replay-path-too-long", ["--replay", "{long}"], ["File name too long"]),
    ("space-ratios-empty-list", ["--search-space", "{space}"], ["{space}", "'ratios' must be a mapping"]),
    ("space-kernel-override-not-a-mapping", ["--search-space", "{space}"], ["{space}", "kernels.ffn2: expected a map"]),
    ("storage-sqlite-of-another-program", ["--storage", "sqlite:///{userdb}"], ["{userdb}", "not an Optuna database"]),
    ("storage-sqlite-not-a-database", ["--storage", "sqlite:///{notes}"], ["{notes}", "not a SQLite database"]),
    ("shape-file-empty", ["--shape-file", "{empty}"], ["{empty}", "it is empty"]),
    ("shape-file-name-climbs-out", ["--shape-file", "{climb}"], ["name '../../escaped'", "letters, digits"]),
    ("shape-file-preset-name", ["--shape-file", "{posing}"], ["name 'bert-base' is the preset 1x128x768x12x3072's",
                                                                "1x64x768x12x3072", "another name"]),
    ("shape-underscore", ["--shape", "1x1_28x768x12x3072"], ["five integers"]),
    ("shape-negative-first", ["--shape=-1x128x768x12x3072"], ["batch=-1", "positive"]),
    ("shape-file-name-not-text", ["--shape-file", "{number}"], ["name 42"]),
    ("shape-file-batch-true", ["--shape-file", "{boolean}"], ["batch=True", "positive integer"]),
    ("shape-file-key-missing", ["--shape-file", "{partial}"], ["shapes[0]: missing heads, ffn",
                                                               "a shape needs batch, seq, d_model, heads, ffn"]),
    ("shape-file-key-unknown", ["--shape-file", "{extra}"], ["shapes[0]: unknown key layers", "a shape takes batch"]),
    ("sampler-cmaes-over-choices", ["--sampler", "cmaes"], ["--sampler cmaes draws only numeric ranges"]),
]
SPACE_TEXT = {"space-bad-yaml": "version: 1\ngemm: [16, 32\nnorm: {}\n"}
SPACE_EDIT = {"space-unknown-key": _unknown_gemm_key, "space-non-list": _non_list, "space-ratio-1.5": _ratio_1_5,
              "space-ratios-empty-list": lambda d: d.update(ratios=[]),
              "space-kernel-override-not-a-mapping": lambda d: d.update(kernels={"ffn2": 0})}
SHAPE_FILES = {  # (the recording's shape, so that the shape file is the only mistake)
    "{empty}": "shapes: []\n",
    "{climb}": "shapes:\n  - {batch: 1, seq: 128, d_model: 768, heads: 12, ffn: 3072, name: ../../escaped}\n",
    "{posing}": "shapes:\n  - {batch: 1, seq: 64, d_model: 768, heads: 12, ffn: 3072, name: bert-base}\n",
    "{number}": "shapes:\n  - {batch: 1, seq: 128, d_model: 768, heads: 12, ffn: 3072, name: 42}\n",
    "{boolean}": "shapes:\n  - {batch: true, seq: 128, d_model: 768, heads: 12, ffn: 3072}\n",
    "{partial}": "shapes:\n  - {batch: 1, seq: 128, d_model: 768}\n",  # (a TypeError's text about __init__ before)
    "{extra}": "shapes:\n  - {batch: 1, seq: 128, d_model: 768, heads: 12, ffn: 3072, layers: 12}\n",
}


def assert_user_error(rc, stdout, stderr, words):
    assert rc == 2, (rc, stderr[-3000:])
    assert "Traceback" not in stderr and "Traceback" not in stdout
    assert stderr.startswith("tune: error: ") and stderr.count("\n") == 1, stderr
    for w in words:
        assert w in stderr, (w, stderr)


@pytest.mark.parametrize("argv, words", [(a, w) for _, a, w in BAD_DECODER], ids=[i for i, _, _ in BAD_DECODER])
def test_decoder_user_mistake(tmp_path, request, monkeypatch, argv, words):
    case = request.node.callspec.id
    # No mistake may reach Optuna's GridSampler, which would list every combination of the default space.
    monkeypatch.setattr(optuna.samplers, "GridSampler", lambda *a, **k: pytest.fail("GridSampler was built"))
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    subst = {"{missing}": str(inputs / "nope"), "{shapes}": str(inputs / "shapes.yaml"),
             "{notes}": str(inputs / "notes"), "{long}": str(inputs / ("x" * 300))}
    (inputs / "notes").write_text("a file of the user's\n")
    subst["{userdb}"] = str(inputs / "user.db")
    con = sqlite3.connect(inputs / "user.db")
    con.execute("CREATE TABLE notes (text)")
    con.commit()
    con.close()
    userdb = (inputs / "user.db").read_bytes()
    for key, text in SHAPE_FILES.items():
        subst[key] = str(inputs / f"shapes-{key.strip('{}')}.yaml")
        Path(subst[key]).write_text(text)
    (inputs / "shapes.yaml").write_text("shapes:\n  - {batch: 1, seq: 32, d_model: 256, heads: 4, ffn: 1024}\n"
                                        "  - {batch: 1, seq: 64, d_model: 256, heads: 4, ffn: 1024}\n")
    if case in SPACE_TEXT or case in SPACE_EDIT:
        subst["{space}"] = str(_space_file(inputs, SPACE_EDIT.get(case), SPACE_TEXT.get(case)))

    def fill(text: str) -> str:
        for key, value in subst.items():
            text = text.replace(key, value)
        return text

    out = tmp_path / "results"
    rc, stdout, stderr = tune("decoder", "--replay", REPLAY, "--trials", "3", "--no-progress", "--out", out,
                              *[fill(a) for a in argv])
    assert_user_error(rc, stdout, stderr, [fill(w) for w in words])
    assert not out.exists() or not any(out.iterdir()), sorted(out.rglob("*"))
    assert (inputs / "notes").read_text() == "a file of the user's\n"  # a file named as a journal stays as it was
    assert (inputs / "user.db").read_bytes() == userdb  # and a database of the user's
    assert not (tmp_path / "escaped").exists()


def test_decoder_without_gpu_points_to_replay(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: `tune decoder` would start a real study")
    out = tmp_path / "results"
    rc, stdout, stderr = tune("decoder", "--shape", "tiny", "--trials", "3", "--out", out)
    assert_user_error(rc, stdout, stderr, ["CUDA GPU", "`tune decoder --replay replay-bert-base-h200-20261128` "
                                                       "replays the H200 run of record shipped with the package"])
    assert not out.exists() or not any(out.iterdir())


def test_tune_without_a_command_names_what_is_missing_in_the_user_s_words():
    rc, stdout, stderr = tune()
    assert rc == 2 and stderr == "tune: error: the following arguments are required: COMMAND (see tune --help)\n"


def test_report_on_a_folder_without_trials_csv(run_copy):
    (run_copy / "trials.csv").unlink()
    files = snapshot(run_copy)
    assert_user_error(*tune("report", run_copy), [str(run_copy), "trials.csv is missing"])
    assert snapshot(run_copy) == files


def test_report_on_no_folder(tmp_path):
    assert_user_error(*tune("report", tmp_path / "nope"), [str(tmp_path / "nope"), "not a run folder"])


def test_export_keeps_an_existing_file_unless_forced(first, tmp_path):
    _, run, _, _ = first
    other = Path(shutil.copytree(run, tmp_path / "other-run"))
    files = snapshot(other)
    for target in (other / "trials.csv", other / "best.json"):
        assert_user_error(*tune("export", run, "-o", target), [str(target), "a file of that name exists", "--force"])
    for target in (str(other), str(tmp_path / "new-folder") + "/"):  # a folder, or a name that says it is one
        for force in ((), ("--force",)):
            assert_user_error(*tune("export", run, "-o", target, *force), [target, "names a folder"])
    assert not (tmp_path / "new-folder").exists()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # (a device or FIFO is never replaced, --force or not)
    assert_user_error(*tune("export", run, "-o", fifo, "--force"), [str(fifo), "not a regular file"])
    assert fifo.is_fifo()
    assert snapshot(other) == files and not list(tmp_path.rglob("*.tmp"))
    target = tmp_path / "best.json"
    assert tune("export", run, "-o", target)[0] == 0
    target.write_text("edited")
    rc, stdout, stderr = tune("export", run, "-o", target, "--force")
    assert rc == 0 and json.loads(target.read_text()) == json.loads((run / "best.json").read_text())
    assert snapshot(other) == files and not list(tmp_path.rglob("*.tmp"))
    # a best.json whose config does not load is refused here as `tune bench --config` would refuse it
    (other / "best.json").write_text(json.dumps(dict(json.loads((run / "best.json").read_text()), config={})))
    assert_user_error(*tune("export", other), [str(other), "config schema_version"])
    # and one that loads but cannot run its own shape
    best = json.loads((run / "best.json").read_text())
    best["config"]["kernels"]["ffn1"].update(block_m=-5, num_warps=3)
    (other / "best.json").write_text(json.dumps(best))
    assert_user_error(*tune("export", other), [str(other), "cannot run its shape 1x128x768x12x3072", "ffn1"])
    # a best.json without its shape (edited) is checked against the run's manifest's: a tile past the problem is
    # refused; a folder without a manifest either is exported with a note that nothing was checked
    best = json.loads((run / "best.json").read_text())
    best["config"]["kernels"]["qkv"]["block_m"] = 4096
    del best["shape"]
    (other / "best.json").write_text(json.dumps(best))
    assert_user_error(*tune("export", other), [str(other), "cannot run its shape 1x128x768x12x3072", "qkv",
                                               "block_m=4096"])
    # and without its dtype, the manifest's: an out-projection tile that fits fp16's shared memory, not fp32's
    man = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps(dict(man, dtype="float32")))
    best["config"]["kernels"]["qkv"] = json.loads((run / "best.json").read_text())["config"]["kernels"]["qkv"]
    best["config"]["kernels"]["out"].update(block_m=128, block_n=128, block_k=128, num_stages=3, num_warps=8,
                                            cluster=0, split_k=1)
    del best["dtype"]
    (other / "best.json").write_text(json.dumps(best))
    assert_user_error(*tune("export", other), [str(other), "cannot run its shape", "out: shared memory 3932",
                                               "B > 232448 B"])  # (393,216 B and the row sums' scratch, if any)
    (other / "manifest.json").unlink()
    rc, stdout, stderr = tune("export", other)
    assert rc == 0 and json.loads(stdout) == best and "not checked against one" in stderr, stderr
    # a file of the user's named like the temporary of the atomic write is left alone
    (tmp_path / "mine.json.tmp").write_text("the user's")
    assert tune("export", run, "-o", tmp_path / "mine.json")[0] == 0
    assert (tmp_path / "mine.json.tmp").read_text() == "the user's"
    assert_user_error(*tune("export", run, "-o", ""), ["-o ''", "give a file name"])
    under_a_file = tmp_path / "mine.json" / "x.json"
    assert_user_error(*tune("export", run, "-o", under_a_file),
                      [f"-o {under_a_file}: cannot write it in", "not a folder"])
    assert_user_error(*tune("notebook", "--out", ""), ["--out ''", "give a folder"])


@pytest.mark.parametrize("command", ["bench", "verify", "notebook"])
@pytest.mark.parametrize("out", ["", " "])
def test_a_blank_out_is_refused_as_typed(tmp_path, monkeypatch, command, out):
    # Path('') is this folder: a blank --out would have written bench/ or verify/ here, unasked
    monkeypatch.chdir(tmp_path)
    assert_user_error(*tune(command, "--out", out), [f"--out {out!r}", "give a folder"])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("case", ["no-best-json", "schema-99", "invalid-json"])
def test_export_of_a_bad_run_folder(run_copy, tmp_path, case):
    best = run_copy / "best.json"
    if case == "no-best-json":
        best.unlink()
        words = [str(run_copy), "no best.json"]
    elif case == "schema-99":
        best.write_text(json.dumps(dict(json.loads(best.read_text()), schema_version=99)))
        words = [str(best), "schema_version 99"]
    else:
        best.write_text("{half a file")
        words = [str(best), "not valid JSON"]
    files, target = snapshot(run_copy), tmp_path / "exported.json"
    assert_user_error(*tune("export", run_copy, "-o", target), words)
    assert not target.exists() and snapshot(run_copy) == files


def test_summary_across_runs_writes_latest_and_stamped(first, tmp_path, capsys):
    # `tune decoder --shape all` ends with this; the replay serves one shape, so the same run stands twice.
    from tuner.cli import _write_summary

    _write_summary([first[1], first[1]], tmp_path)
    latest = (tmp_path / "summary.md").read_text()
    stamped = sorted(tmp_path.glob("summary-*.md"))
    assert len(stamped) == 1 and stamped[0].read_text() == latest
    assert "SUMMARY OF ALL SHAPES" in latest and "REPLAYED" in latest and "bert-base" in latest


TINY_BEST = Path(__file__).parent / "data" / "best-tiny-h200.json"  # best.json of the H200 run 20261122-061019


def test_bench_measures_a_config_on_its_own_shape(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: `tune bench` would measure")
    # Without --shape: the config's own shape (tiny), so the only complaint on a CPU box is the missing GPU.
    assert_user_error(*tune("bench", "--config", TINY_BEST, "--out", tmp_path), ["tune bench", "CUDA GPU"])
    # Another --shape: refused before any GPU work, naming both shapes.
    assert_user_error(*tune("bench", "--config", TINY_BEST, "--shape", "bert-base", "--out", tmp_path),
                      ["--config", "1x32x256x4x1024", "1x128x768x12x3072"])
    assert_user_error(*tune("bench", "--config", tmp_path / "nope.json"), ["--config", "no best.json"])
    assert not any(tmp_path.iterdir())
    no_shape = tmp_path / "no-shape.json"
    d = json.loads(TINY_BEST.read_text())
    del d["shape"]
    no_shape.write_text(json.dumps(d))
    assert_user_error(*tune("bench", "--config", no_shape, "--out", tmp_path / "out"),
                      [str(no_shape), "no valid 'shape'", "--shape"])
    # Another --dtype: refused before any GPU work (until session 48 it measured the config in float16, whatever
    # it was tuned in, and said nothing); without --dtype, the config's own
    assert_user_error(*tune("bench", "--config", TINY_BEST, "--dtype", "bfloat16", "--out", tmp_path / "out"),
                      ["--config", "tuned in float16, not --dtype bfloat16", "leave --dtype out"])
    from tuner.cli import _config_dtype, _read_best

    def dtype_of(path):
        return _config_dtype(_read_best(str(path)), str(path))

    d = json.loads(TINY_BEST.read_text())
    bf16 = tmp_path / "bf16" / "best.json"
    bf16.parent.mkdir()
    bf16.write_text(json.dumps(dict(d, dtype="bfloat16")))
    assert dtype_of(bf16) == "bfloat16" and dtype_of(TINY_BEST) == "float16"
    del d["dtype"]  # a hand-edited best.json without one: its run's manifest's, else none
    bf16.write_text(json.dumps(d))
    assert dtype_of(bf16) is None
    (bf16.parent / "manifest.json").write_text(json.dumps({"dtype": "bfloat16"}))
    assert dtype_of(bf16.parent) == "bfloat16"
    assert_user_error(*tune("bench", "--config", bf16, "--dtype", "float16", "--out", tmp_path / "out"),
                      ["tuned in bfloat16, not --dtype float16"])
    assert_user_error(*tune("bench", "--config", bf16, "--out", tmp_path / "out"), ["tune bench", "CUDA GPU"])


def test_bench_reads_its_config_once(tmp_path, monkeypatch):
    # (until session 50 `tune bench --config` read best.json three times or more: for its shape, its dtype, and its
    # config once a shape and once more on the GPU; a file rewritten meanwhile could mix two runs)
    from tuner import export

    reads = []
    read_best = export.read_best
    monkeypatch.setattr(export, "read_best", lambda path: reads.append(path) or read_best(path))
    rc, stdout, stderr = tune("bench", "--config", TINY_BEST, "--out", tmp_path / "out")
    assert rc == 2 and "CUDA GPU" in stderr, stderr  # (this machine has none: it stops after every file check)
    assert reads == [str(TINY_BEST)], reads


def test_a_shape_file_alone_gives_its_shapes_only(tmp_path):
    from tuner.cli import _shapes

    f = tmp_path / "shapes.yaml"
    f.write_text("shapes:\n  - {batch: 1, seq: 32, d_model: 256, heads: 4, ffn: 1024}\n")
    assert [s.spec for s in _shapes(None, str(f))] == ["1x32x256x4x1024"]
    assert [s.spec for s in _shapes(["tiny"], str(f))] == ["1x32x256x4x1024"] * 2
    assert [s.spec for s in _shapes(None)] == ["1x128x768x12x3072"]  # neither: bert-base


# ------------------------------------------------------------------------------------------------
# Broken files the user hands over: one line each, naming the file (found by an audit of session 27)
# ------------------------------------------------------------------------------------------------

def _edit_json(path: Path, edit) -> None:
    d = json.loads(path.read_text())
    path.write_text(json.dumps(edit(d)))


def _set(key, value):
    return lambda d: dict(d, **{key: value})


def _cut_last_row(path: Path) -> None:
    """The file as a copy cut short leaves it: the last row ends after its first field (not inside a quoted one)."""
    data = path.read_bytes()
    start = data.rstrip(b"\n").rfind(b"\n") + 1
    path.write_bytes(data[:data.index(b",", start) + 1])


BAD_RECORDINGS = {  # what is wrong with a copy of the replay recording -> the words of the refusal
    "manifest-is-a-list": (lambda r: (r / "manifest.json").write_text("[1, 2]"), ["manifest.json", "mapping"]),
    "manifest-shape-is-text": (lambda r: _edit_json(r / "manifest.json", _set("shape", "bert-base")), ["'shape'"]),
    "manifest-gpu-is-text": (lambda r: _edit_json(r / "manifest.json", _set("gpu", "H100")), ["'gpu'"]),
    "manifest-without-baselines": (lambda r: _edit_json(r / "manifest.json", lambda d: {k: v for k, v in d.items()
                                                                                      if k != "baselines"}),
                                   ["'baselines'"]),
    "manifest-not-utf8": (lambda r: (r / "manifest.json").write_bytes(b'{"caf\xe9": 1}'), ["manifest.json",
                                                                                          "cannot be read"]),
    "trials-header-only": (lambda r: (r / "trials.csv").write_text(
        (r / "trials.csv").read_text().splitlines()[0] + "\n"), ["trials.csv", "no trials"]),
    "trials-without-status": (lambda r: pd.read_csv(r / "trials.csv").drop(columns=["status"]).to_csv(
        r / "trials.csv", index=False), ["trials.csv", "status"]),
    "trials-latency-text": (lambda r: pd.read_csv(r / "trials.csv").assign(latency_us="fast").to_csv(
        r / "trials.csv", index=False), ["latency_us", "not numeric"]),
    "breakdown-not-per-kernel": (lambda r: (r / "breakdown.json").write_text('{"best": 5}'), ["breakdown.json"]),
    "manifest-policy-a-list": (lambda r: _edit_json(r / "manifest.json", _set("policy", [])), ["'policy'"]),
    "manifest-gpu-name-a-number": (lambda r: _edit_json(r / "manifest.json", lambda d: dict(d, gpu=dict(d["gpu"],
                                                                                                    name=5))),
                                   ["gpu.name"]),
    "manifest-dtype-float8": (lambda r: _edit_json(r / "manifest.json", _set("dtype", "float8")), ["dtype 'float8'"]),
    "manifest-l2-warm": (lambda r: _edit_json(r / "manifest.json", lambda d: dict(d, policy=dict(d["policy"],
                                                                                             l2="warm"))),
                         ["policy.l2 'warm'"]),
    "manifest-baseline-negative": (lambda r: _edit_json(r / "manifest.json", lambda d: dict(d, baselines=dict(
        d["baselines"], baseline_us=-5))), ["baseline_us", "positive"]),
    "trials-latency-nan": (lambda r: pd.read_csv(r / "trials.csv").assign(latency_us=float("nan")).to_csv(
        r / "trials.csv", index=False), ["trials.csv", "positive, finite latency_us"]),
    "trials-latency-negative": (lambda r: pd.read_csv(r / "trials.csv").assign(latency_us=-3.0).to_csv(
        r / "trials.csv", index=False), ["trials.csv", "positive, finite latency_us"]),
    "trials-parameter-text": (lambda r: pd.read_csv(r / "trials.csv").assign(**{"qkv.block_m": "abc"}).to_csv(
        r / "trials.csv", index=False), ["trials.csv", "not a number"]),
    "trials-spread-negative": (lambda r: pd.read_csv(r / "trials.csv").assign(spread_us=-1.0).to_csv(
        r / "trials.csv", index=False), ["trials.csv", "spread_us of 0 or more"]),
    "manifest-capability-a-number": (lambda r: _edit_json(r / "manifest.json", lambda d: dict(
        d, gpu=dict(d["gpu"], capability=9))), ["gpu.capability", "[9, 0]"]),
    "manifest-l2-bytes-text": (lambda r: _edit_json(r / "manifest.json", lambda d: dict(
        d, gpu=dict(d["gpu"], l2_bytes="big"))), ["gpu.l2_bytes", "'big'"]),
    "manifest-measured-on-a-list": (lambda r: _edit_json(r / "manifest.json", _set("measured_on", [9, 0])),
                                    ["'measured_on' must be a mapping"]),
    "manifest-measured-on-sms-text": (lambda r: _edit_json(r / "manifest.json", lambda d: dict(
        d, measured_on=dict(d["measured_on"], num_sms="many"))), ["measured_on must name", "num_sms"]),
    "manifest-dtype-a-list": (lambda r: _edit_json(r / "manifest.json", _set("dtype", ["float16"])),
                              ["dtype ['float16']"]),
    "manifest-shape-name-climbs-out": (lambda r: _edit_json(r / "manifest.json", lambda d: dict(
        d, shape=dict(d["shape"], name="../../escaped"))), ["name '../../escaped'"]),
    "breakdown-figure-text": (lambda r: (r / "breakdown.json").write_text('{"best": {"qkv": "fast"}}'),
                              ["breakdown.json", "figures"]),
    "trials-cut-at-a-row": (lambda r: (r / "trials.csv").write_text(
        "".join((r / "trials.csv").read_text().splitlines(keepends=True)[:50])), ["trials.csv has 49 trials", "120"]),
    "trials-cut-mid-line": (lambda r: _cut_last_row(r / "trials.csv"), ["trials.csv ends in the middle of a line"]),
}


@pytest.mark.parametrize("case", list(BAD_RECORDINGS))
def test_replay_of_a_broken_recording(tmp_path, case):
    rec = Path(shutil.copytree(REPLAY, tmp_path / "rec"))
    edit, words = BAD_RECORDINGS[case]
    edit(rec)
    out = tmp_path / "results"
    rc, stdout, stderr = tune("decoder", "--replay", rec, "--trials", "3", "--no-progress", "--out", out)
    assert_user_error(rc, stdout, stderr, ["--replay", str(rec)] + words)
    assert not out.exists() or not any(out.iterdir())


def test_replay_of_a_best_json_is_refused(first, tmp_path):
    out = tmp_path / "results"
    rc, stdout, stderr = tune("decoder", "--replay", first[1] / "best.json", "--trials", "3", "--no-progress",
                              "--out", out)
    assert_user_error(rc, stdout, stderr, ["best.json", "trials.csv"])


def test_replay_of_a_replayed_run_is_refused(run_copy, tmp_path):
    # A replay's figures were served, most from the nearest recorded configuration: replayed again, they would come
    # back as the recording's own (and say "recorded on" the GPU of a run that never ran there).
    out = tmp_path / "results"
    rc, stdout, stderr = tune("decoder", "--replay", run_copy, "--trials", "3", "--no-progress", "--out", out)
    assert_user_error(rc, stdout, stderr, ["is itself a replay", "replay-bert-base-h200", "the GPU run"])
    assert stderr.count(str(run_copy)) == 1, stderr
    man = json.loads((run_copy / "manifest.json").read_text())  # its trials.csv alone, with a manifest that says not
    (run_copy / "manifest.json").write_text(json.dumps(dict(man, replayed=False)))
    rc, stdout, stderr = tune("decoder", "--replay", run_copy / "trials.csv", "--trials", "3", "--no-progress",
                              "--out", out)
    assert_user_error(rc, stdout, stderr, ["trials.csv", "approximated"])
    partial = Path(shutil.copytree(REPLAY, tmp_path / "run.partial"))
    rc, stdout, stderr = tune("decoder", "--replay", partial, "--trials", "3", "--no-progress", "--out", out)
    assert_user_error(rc, stdout, stderr, [".partial", "never ended"])
    assert not out.exists()


BAD_RUNS = {  # what is wrong with a copy of a run folder -> the words of `tune report`'s refusal
    "rows-are-text": (lambda r: _edit_json(r / "topk.json", _set("rows", "none")), ["'rows' is not a list"]),
    "row-without-latency": (lambda r: _edit_json(r / "topk.json", lambda d: dict(d, rows=[{"rank": 1}])),
                            ["rows[0]", "latency_us"]),
    "no-rows": (lambda r: (r / "topk.json").write_text("{}"), ["topk.json has no 'rows'"]),
    "negative-spread": (lambda r: _edit_json(r / "topk.json", lambda d: dict(
        d, rows=[dict(d["rows"][0], spread_us=-3)] + d["rows"][1:])), ["rows[0]", "negative spread_us"]),
    "trials-cut-mid-line": (lambda r: _cut_last_row(r / "trials.csv"), ["trials.csv ends in the middle of a line"]),
    "trials-cut-at-a-row": (lambda r: (r / "trials.csv").write_text(
        "".join((r / "trials.csv").read_text().splitlines(keepends=True)[:5])), ["trials.csv has 4 trials"]),
    "manifest-shape-is-text": (lambda r: _edit_json(r / "manifest.json", _set("shape", "x")), ["'shape'"]),
    "breakdown-not-per-kernel": (lambda r: (r / "breakdown.json").write_text('{"best": 5}'), ["breakdown.json"]),
    "plots-is-a-file": (lambda r: (shutil.rmtree(r / "plots"), (r / "plots").write_text("x")), ["plots",
                                                                                             "cannot write"]),
    "row-kernel-is-text": (lambda r: _edit_json(r / "topk.json", lambda d: dict(d, rows=[dict(
        d["rows"][0], config=dict(d["rows"][0]["config"], kernels=dict(d["rows"][0]["config"]["kernels"],
                                                                          ffn2="x")))])), ["rows[0]"]),
    "breakdown-figure-is-text": (lambda r: (r / "breakdown.json").write_text('{"best": {"qkv": "fast"}}'),
                                 ["breakdown.json"]),
    "row-latency-400-digits": (lambda r: _edit_json(r / "topk.json", lambda d: dict(
        d, rows=[dict(d["rows"][0], latency_us=10**400)] + d["rows"][1:])), ["rows[0]", "latency_us"]),
}


@pytest.mark.parametrize("case", list(BAD_RUNS))
def test_report_of_a_broken_run_folder(run_copy, case):
    edit, words = BAD_RUNS[case]
    drawn = (run_copy / "topk.md").read_bytes()
    edit(run_copy)
    assert_user_error(*tune("report", run_copy), words)
    assert (run_copy / "topk.md").read_bytes() == drawn  # refused before anything is redrawn


# One rule for breakdown.json (tuner.manifest.breakdown_problem), in tune report and in a replay alike: a mapping whose
# 'best' and 'baseline' map kernels to finite JSON numbers, either may be null; 'floor_us' a finite number or null.
BREAKDOWNS = {
    "figure-nan": ('{"best": {"qkv": NaN}}', False),
    "figure-true": ('{"best": {"qkv": true}}', False),
    "figure-numeric-text": ('{"best": {"qkv": "1.5"}}', False),
    "a-list": ("[1, 2]", False),
    "floor-text": ('{"best": {"qkv": 1.5}, "floor_us": "3.3"}', False),
    "best-null": ('{"best": null, "baseline": {"qkv": 1.5}, "floor_us": 3.3}', True),
    "figure-a-400-digit-integer": ('{"best": {"qkv": 1' + "0" * 400 + '}}', False),
}


@pytest.mark.parametrize("case", list(BREAKDOWNS))
def test_report_and_replay_read_a_breakdown_by_one_rule(run_copy, tmp_path, case):
    # (the loaders themselves: the commands' one-line refusals of a bad breakdown.json are in BAD_RUNS and
    # BAD_RECORDINGS)
    from tuner.evaluate import ReplayEvaluator
    from tuner.report import load_run

    text, fine = BREAKDOWNS[case]
    rec = Path(shutil.copytree(REPLAY, tmp_path / "rec"))
    verdicts = []
    for folder, load in ((run_copy, load_run), (rec, ReplayEvaluator)):
        (folder / "breakdown.json").write_text(text)
        try:
            load(folder)
            verdicts.append(None)
        except ValueError as e:
            verdicts.append(str(e))
    if fine:
        assert verdicts == [None, None]
    else:
        assert all(v is not None and "breakdown.json" in v for v in verdicts), verdicts


@pytest.mark.parametrize("field, value", [("shape", "tiny"), ("shape", {"batch": 1}), ("gpu", "H100")])
def test_bench_config_with_a_malformed_field(tmp_path, field, value):
    bad = tmp_path / "best.json"
    bad.write_text(json.dumps(dict(json.loads(TINY_BEST.read_text()), **{field: value})))
    assert_user_error(*tune("bench", "--config", bad, "--shape", "tiny", "--out", tmp_path), [str(bad), f"{field}"])


def test_export_of_an_unreadable_best_json(run_copy, tmp_path):
    (run_copy / "best.json").write_bytes(b'{"caf\xe9": 1}')
    assert_user_error(*tune("export", run_copy), [str(run_copy / "best.json"), "cannot be read"])


@pytest.mark.parametrize("flag", ["--timeout", "--trial-timeout"])
def test_nan_seconds_are_refused(tmp_path, flag):
    assert_user_error(*decoder(tmp_path / "results", 3, flag, "nan"), [flag, "nan"])


def test_out_that_cannot_hold_run_folders(tmp_path):
    # checked before the search: the run folder would be lost after it (its trials kept in the storage)
    f = tmp_path / "a-file"
    f.write_text("x")
    storage = f"sqlite:///{(tmp_path / 'elsewhere.db').as_posix()}"
    for out in (f, f / "results"):
        assert_user_error(*decoder(out, 3, "--storage", storage), [f"--out {out}", "cannot write run folders"])
    assert not (tmp_path / "elsewhere.db").exists()


def test_report_draws_a_breakdown_with_a_kernel_on_one_side_only(run_copy):
    (run_copy / "breakdown.json").write_text('{"best": {"x": 1.5}}')
    plot = run_copy / "plots" / "breakdown.png"
    plot.unlink(missing_ok=True)
    rc, stdout, stderr = tune("report", run_copy)
    assert rc == 0, stderr
    assert plot.stat().st_size > 0  # drawn: the kernel's baseline bar left out, not the plot
    from tuner.report import breakdown_data, load_run
    df = breakdown_data(load_run(run_copy))
    assert df["kernel"].tolist() == ["x", "sum"] and df["best_us"].tolist() == [1.5, 1.5]
    assert df["baseline_us"].isna().all()


def test_a_path_the_system_refuses_is_one_line(tmp_path):
    long = tmp_path / ("x" * 300)
    for argv in (("report", long), ("export", long), ("bench", "--config", long, "--out", tmp_path)):
        rc, stdout, stderr = tune(*argv)
        assert rc == 2 and "Traceback" not in stderr and stderr.count("\n") == 1, (argv, stderr)


def test_bench_and_verify_numbers_and_out_before_the_gpu(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    assert_user_error(*tune("bench", "--reps", "0", "--out", tmp_path), ["--reps 0"])
    assert_user_error(*tune("verify", "--trials", "0", "--out", tmp_path), ["--trials 0"])
    for cmd in ("bench", "verify"):
        assert_user_error(*tune(cmd, "--out", f / "results"), [f"--out {f / 'results'}", "cannot write"])


def test_one_process_continues_the_journal_of_a_workers_run(tmp_path):
    out = tmp_path / "results"
    rc, stdout, stderr = decoder(out, 6, "--workers", "2")
    assert rc == 0, stderr
    assert (out / "studies.journal").is_file() and not (out / "studies.db").exists()
    rc, stdout, stderr = decoder(out, 8)  # one process, the same --out: the same study, 2 trials more
    assert rc == 0, stderr
    assert json.loads((run_folder(stdout) / "manifest.json").read_text())["n_trials"] == 8
    assert not (out / "studies.db").exists()
    half = Path(shutil.copytree(REPLAY, tmp_path / "half"))
    pd.read_csv(half / "trials.csv").assign(latency_us=lambda t: t["latency_us"] / 2).to_csv(
        half / "trials.csv", index=False)
    rc, stdout, stderr = tune("decoder", "--replay", half, "--trials", 8, "--no-progress", "--out", out)
    assert rc == 2 and "another replay recording" in stderr, stderr


@pytest.mark.parametrize("cut", ["last 40 bytes", "in a trial's end"])
def test_a_journal_whose_last_record_was_cut_short_keeps_its_trials(tmp_path, cut):
    # A kill or a full disk mid-write leaves half a record; Optuna reads past it but would append the next record to
    # that line, after which nothing in the file can be read. The torn bytes are set aside; every trial stays.
    out = tmp_path / "results"
    rc, stdout, stderr = decoder(out, 4, "--workers", "2")
    assert rc == 0, stderr
    journal = out / "studies.journal"
    data = journal.read_bytes()
    if cut == "in a trial's end":  # (the file as it was when a process died writing its trial's last record)
        lines = data.splitlines(keepends=True)
        last = max(i for i, ln in enumerate(lines)  # (set_trial_state_values: a trial's COMPLETE and its value)
                   if json.loads(ln)["op_code"] == 6 and json.loads(ln)["state"] == 1)
        data = b"".join(lines[:last + 1])  # (the cut below lands inside that record)
        journal.write_bytes(data)
    written = _journal_trials(journal)  # number -> (state, value)
    journal.write_bytes(data[:-40])
    complete = _journal_trials(journal)  # what Optuna reads of it
    assert len(complete) >= 3, complete
    # The last record is the twin's (the first worker adds it) or, where the second worker's trial ended after it,
    # that trial's end (1 of 24 runs under load in session 50; the test then failed). A cut there leaves that trial
    # RUNNING, with its measurement recorded and its process gone: the next run ends it as it was measured.
    torn = {n for n, (state, _) in complete.items() if state == "RUNNING"}
    assert len(torn) == (cut == "in a trial's end") or (cut == "last 40 bytes" and len(torn) <= 1), complete
    rc, stdout, stderr = decoder(out, 6, "--workers", "2")
    seen = f"torn tail {data[-40:]!r}; complete {complete}; stderr {stderr[-3000:]}"
    assert rc == 0, seen
    asides = list(out.glob("studies.journal.torn-*"))
    assert len(asides) == 1, (asides, seen)
    assert asides[0].read_bytes() == data[data[:-40].rfind(b"\n") + 1:-40], (asides[0].read_bytes()[:200], seen)
    assert "last record was cut short" in stderr and "every complete record is kept" in stderr, seen
    measured = {n for n in torn if written[n][0] == "COMPLETE"}  # (not a surplus trial that was being pruned)
    assert ("ended as measured" in stdout) == bool(measured), (stdout[-3000:], seen)
    n_trials = json.loads((run_folder(stdout) / "manifest.json").read_text())["n_trials"]
    assert n_trials == 6, (n_trials, _journal_trials(journal), seen)
    rc, stdout, stderr = decoder(out, 7)  # and the file reads whole afterwards
    assert rc == 0 and "cut short" not in stderr, stderr
    assert json.loads((run_folder(stdout) / "manifest.json").read_text())["n_trials"] == 7
    after = _journal_trials(journal)
    # (counted as the budget counts: a surplus trial that a worker pruned when it found the budget spent is not;
    # session 50 saw one in 1 of 12 runs under load)
    assert _journal_trials(journal, counted=True) == 7, (after, written, complete)
    assert all(after[n] == written[n] for n in complete if written[n][0] == "COMPLETE"), (after, written, complete)


def test_a_journal_record_that_lost_only_its_newline_is_kept(tmp_path):
    from tuner.storage import _set_aside_torn_record

    journal = tmp_path / "studies.journal"
    journal.write_bytes(b'{"op_code": 0}\n{"op_code": 1}')
    _set_aside_torn_record(journal)
    assert journal.read_bytes() == b'{"op_code": 0}\n{"op_code": 1}\n' and not list(tmp_path.glob("*.torn-*"))


def _journal_trials(path, counted: bool = False) -> dict | int:
    """A journal's trials, number -> (state, value); ``counted``: how many count against the budget."""
    from optuna.storages.journal import JournalFileBackend

    from tuner.study import counts_against_budget

    storage = optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    (name,) = [s.study_name for s in optuna.study.get_all_study_summaries(storage)]
    trials = optuna.load_study(study_name=name, storage=storage).trials
    if counted:
        return sum(map(counts_against_budget, trials))
    return {t.number: (t.state.name, t.value) for t in trials}


def test_unknown_arguments_are_named_by_their_subcommand():
    rc, stdout, stderr = tune("decoder", "--bogus", "1")
    assert rc == 2 and stderr == "tune decoder: error: unrecognized arguments: --bogus 1 (see tune decoder --help)\n"
    rc, stdout, stderr = tune("decoder", "--timeout", "abc")
    assert rc == 2 and stderr.count("\n") == 1 and "--timeout" in stderr and "tune decoder --help" in stderr


def test_notebook_writes_the_shipped_notebook_and_keeps_an_existing_one(tmp_path):
    out = tmp_path / "new" / "folder"
    rc, stdout, stderr = tune("notebook", "--out", out)
    assert rc == 0, stderr
    assert (out / "analysis.ipynb").read_bytes() == (Path(tuner.__file__).parents[1] / "notebooks" /
                                                    "analysis.ipynb").read_bytes()
    assert_user_error(*tune("notebook", "--out", out), [str(out / "analysis.ipynb"), "it is kept"])
    f = tmp_path / "a-file"
    f.write_text("x")
    for o in (f, f / "sub"):
        rc, stdout, stderr = tune("notebook", "--out", o)
        assert rc == 2 and stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert f.read_text() == "x"


def test_the_shipped_recording_replays_by_name_from_any_folder(tmp_path, monkeypatch):
    # An installed copy has no tests/data: its recording is found by its name, or by the README's path's last part.
    monkeypatch.chdir(tmp_path)
    for given in ("replay-bert-base-h200", "tests/data/replay-bert-base-h200"):
        rc, stdout, stderr = tune("decoder", "--replay", given, "--trials", 3, "--timeout", 5, "--no-progress",
                                  "--out", tmp_path / given.replace("/", "-"))
        assert rc == 0, stderr
        assert "replay-bert-base-h200: timings recorded on NVIDIA H200, nothing is measured now" in stdout
        assert (run_folder(stdout) / "best.json").is_file()
    assert_user_error(*tune("decoder", "--replay", "replay-nope", "--no-progress", "--out", tmp_path / "x"),
                      ["--replay replay-nope: no such file or folder", "replay-bert-base-h200"])
    assert not (tmp_path / "x").exists()


def test_a_storage_damaged_inside_is_one_line(tmp_path):
    # A SQLite file damaged in its pages passes the header check and failed in Optuna's queries (a traceback); a
    # journal with a broken line in the middle named "line 1 column 31" of the one record the decoder was given.
    out = tmp_path / "results"
    assert decoder(out, 4)[0] == 0
    db = out / "studies.db"
    data = bytearray(db.read_bytes())
    data[10 * 4096:20 * 4096] = random.Random(0).randbytes(10 * 4096)  # (its schema, on the first pages, reads)
    db.write_bytes(bytes(data))
    rc, stdout, stderr = decoder(out, 6)
    assert rc == 1 and "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert "cannot be read or written" in stderr and "move the damaged file aside" in stderr
    journal = tmp_path / "j" / "studies.journal"
    assert decoder(tmp_path / "j", 4, "--storage", f"journal:{journal}")[0] == 0
    lines = journal.read_bytes().splitlines(keepends=True)
    lines[len(lines) // 2] = lines[len(lines) // 2][:30] + b"\n"
    journal.write_bytes(b"".join(lines))
    rc, stdout, stderr = decoder(tmp_path / "j", 6, "--storage", f"journal:{journal}")
    assert rc == 2 and f"its line {len(lines) // 2 + 1} of {len(lines)} is not a whole record" in stderr, stderr


def test_a_storage_failing_only_in_its_heartbeat_thread_is_one_line(tmp_path, monkeypatch):
    # Optuna beats in a thread of each trial (RDB storages); a storage that failed only there (a SQLite file damaged
    # in that table) printed a thread's traceback a trial while the study went on.
    from tuner import cli

    def broken(self, trial_id):
        raise optuna.exceptions.StorageInternalError("database disk image is malformed")

    monkeypatch.setattr(optuna.storages.RDBStorage, "record_heartbeat", broken)
    monkeypatch.setattr(cli, "_THREAD_FAILURES", set())
    rc, stdout, stderr = decoder(tmp_path / "results", 4)
    assert rc == 0 and "Traceback" not in stderr, stderr
    said = [ln for ln in stderr.splitlines() if "heartbeat" in ln]
    assert len(said) == 1 and said[0].startswith("tune: warning: the study storage failed in a background thread")
    assert "database disk image is malformed; the run goes on" in said[0]
    assert len(finished(study_of(run_folder(stdout)))) == 4
    assert threading.excepthook is not cli._thread_failed  # (main puts the interpreter's back)


def test_an_unfinished_run_folder_is_refused(tmp_path):
    # study.finish writes the run folder as NAME.partial and renames it when complete; a run stopped in between
    # leaves the .partial folder, which `tune report` and `tune export` took as a run folder.
    out = tmp_path / "results"
    rc, stdout, stderr = decoder(out, 4)
    run = run_folder(stdout)
    partial = Path(shutil.copytree(run, run.with_name(run.name + ".partial")))
    for argv in (["report", partial], ["export", partial], ["report", str(partial) + "/"]):
        rc, stdout, stderr = tune(*argv)
        assert rc == 2 and "the unfinished folder of a run" in stderr and "run the same `tune decoder`" in stderr
    assert tune("export", run)[0] == 0


@pytest.mark.parametrize("error", ["triton", "cuda"])
def test_a_kernel_failure_in_bench_is_one_line(error, monkeypatch, capsys, tmp_path):
    # On the GPU (stood in for here: the GPU checks and the bench itself replaced) a kernel that fails, Triton's
    # out-of-resources or a CUDA error as torch raises it, ends `tune bench` in one line, not a traceback.
    import tuner.bench
    import tuner.cli as cli
    from triton.runtime.errors import OutOfResources

    def fail(*a, **k):
        raise (OutOfResources(300000, 232448, "shared memory") if error == "triton"
               else RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors ..."))

    monkeypatch.setattr(cli, "_need_gpu", lambda *a: None)
    monkeypatch.setattr(cli, "_check_fits", lambda *a: None)
    monkeypatch.setattr(tuner.bench, "run_bench", fail)
    assert main(["bench", "--shape", "tiny", "--no-compile", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tune: error: tune bench tiny: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert {"triton": "OutOfResources", "cuda": "illegal memory access"}[error] in err


def test_trials_alone_run_the_whole_budget_and_a_time_limit_says_when_it_stops_a_study(tmp_path, monkeypatch):
    # --trials without --timeout: every trial, no default time limit (until session 46 the default 120 s cut a
    # --trials 400 short without a word); a time limit that stops a study before its budget says so in the log, the
    # table's Run line and the manifest
    from tuner import faults

    monkeypatch.setenv(faults.ENV, json.dumps({"sleep_s": 0.4}))  # each replayed trial takes 0.4 s
    rc, stdout, stderr = decoder(tmp_path / "whole", 6)
    assert rc == 0, stderr
    run = run_folder(stdout)
    assert len(pd.read_csv(run / "trials.csv")) == 6 and "stopped by the time limit" not in stdout
    assert json.loads((run / "manifest.json").read_text())["budget"] == {"trials": 6, "timeout_s": None}
    rc, stdout, stderr = decoder(tmp_path / "cut", 40, "--timeout", 2)
    assert rc == 0, stderr
    run = run_folder(stdout)
    n = len(pd.read_csv(run / "trials.csv"))
    assert n < 40 and "before the 40-trial budget" in stdout and "stopped by the time limit, 2 s" in stdout
    assert "stopped by the 2 s time limit before its 40-trial budget" in (run / "topk.md").read_text()
    assert json.loads((run / "manifest.json").read_text())["budget"] == {"trials": 40, "timeout_s": 2.0}
    rc, stdout, stderr = tune("decoder", "--replay", REPLAY, "--no-progress", "--out", tmp_path / "default",
                              "--timeout", 1)
    assert rc == 0 and json.loads((run_folder(stdout) / "manifest.json").read_text())["budget"]["trials"] == 120


def test_the_default_time_limit_applies_only_without_trials():
    import argparse

    from tuner.cli import DEFAULT_TIMEOUT_S, _check_decoder_numbers

    def timeout(trials, limit):
        args = argparse.Namespace(trials=trials, timeout=limit, trial_timeout=120.0, top_k=10, workers=None, seed=0,
                                  out="results", compilers=None, replay=None)
        _check_decoder_numbers(args)
        return args.timeout

    assert timeout(None, None) == DEFAULT_TIMEOUT_S == 120.0
    assert timeout(400, None) is None and timeout(400, 30.0) == 30.0 and timeout(None, 30.0) == 30.0
    # the Python API the same way: StudyOptions(trials=400) runs its 400 trials (until session 47 it had the
    # command line's 120 s as its default, and cut them short without a word)
    from tuner.study import StudyOptions

    assert StudyOptions(trials=400).timeout_s is None


def test_ctrl_c_while_optuna_records_a_trial_is_an_interruption(tmp_path, monkeypatch):
    # Optuna 5.0's _run_trial turns a KeyboardInterrupt inside its tell into an UnboundLocalError ('updated_state');
    # until session 48 that reached the user as a traceback and exit 1, not the interruption it is
    import optuna.study._optimize as optimize

    tell, calls = optimize._tell_with_warning, []

    def interrupted_third_tell(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return tell(*args, **kwargs)

    monkeypatch.setattr(optimize, "_tell_with_warning", interrupted_third_tell)
    rc, stdout, stderr = decoder(tmp_path, 6)
    assert rc == 130, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == "tune: interrupted; completed trials are kept in the study storage"
    assert "Traceback" not in stderr
    trials = optuna.load_study(study_name=optuna.get_all_study_summaries(f"sqlite:///{tmp_path}/studies.db")[0]
                               .study_name, storage=f"sqlite:///{tmp_path}/studies.db").trials
    assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials) == 2


def test_a_misspelt_dtype_in_best_json_is_refused(tmp_path):
    # until session 48 `tune export` checked such a config as float16's 2-byte operands, and `tune bench --config`
    # measured it in float16, both silently
    run = tmp_path / "run"
    run.mkdir()
    (run / "best.json").write_text(json.dumps(dict(json.loads(TINY_BEST.read_text()), dtype="bf16")))
    assert_user_error(*tune("export", run), [str(run), "dtype 'bf16'", "float16, bfloat16, float32"])
    assert_user_error(*tune("bench", "--config", run / "best.json", "--out", tmp_path / "out"),
                      ["--config", "dtype 'bf16'"])


# Session 48's audit of bad input (a helper fuzzing every subcommand): each of these was a traceback, a hang or a
# silent wrong result until then.
RUN_OF_RECORD = Path(__file__).resolve().parent.parent / "results" / "bert-base" / "20261128-004550-tpe"


def test_replay_workers_beyond_the_cores_are_refused(tmp_path):
    # --workers 1000 under --replay started a thousand processes that each imported torch
    limit = max(2, os.cpu_count() or 1)
    assert_user_error(*decoder(tmp_path, 2, "--workers", limit + 1), [f"--workers {limit + 1}", f"at most {limit}"])
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.parametrize("flag", ["--shape-file", "--storage", "--study-name", "--search-space"])
def test_a_blank_flag_value_is_refused(tmp_path, flag):
    # ("$UNSET" in a script: --shape-file '' tuned bert-base, --storage '' the default storage, without a word)
    assert_user_error(*decoder(tmp_path, 2, flag, ""), [f"{flag} ''", "empty"])
    assert_user_error(*decoder(tmp_path, 2, flag, "  "), [f"{flag} '  '", "empty"])
    assert_user_error(*tune("bench", "--config", "", "--out", tmp_path), ["--config ''", "empty"])


def test_a_config_kernel_that_is_not_a_mapping_is_one_line(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUN_OF_RECORD, run)
    best = json.loads((run / "best.json").read_text())
    best["config"]["kernels"]["qkv"] = []
    (run / "best.json").write_text(json.dumps(best))
    assert_user_error(*tune("export", run), [str(run), "qkv must be a mapping", "not list"])


def test_a_ratio_step_too_small_is_refused_with_the_file(tmp_path):
    text = importlib.resources.files("tuner.search_spaces").joinpath("decoder.yaml").read_text()
    spec = yaml.safe_load(text)
    for step in (5e-324, 1e-300):
        spec["ratios"]["overlap"] = {"low": 0.0, "high": 1.0, "step": step}
        f = tmp_path / "tiny-step.yaml"
        f.write_text(yaml.safe_dump(spec))
        assert_user_error(*decoder(tmp_path / "out", 2, "--search-space", f), [str(f), "step", "more than 1,000,000"])


@pytest.mark.parametrize("name", ["topk.json", "manifest.json"])
def test_report_of_a_run_whose_json_is_null(tmp_path, name):
    run = tmp_path / "run"
    shutil.copytree(RUN_OF_RECORD, run)
    (run / name).write_text("null\n")
    rc, stdout, stderr = tune("report", run)
    assert rc == 2 and "Traceback" not in stderr and f"{name} is not a JSON object" in stderr, stderr[-2000:]


def test_files_nested_too_deeply_are_one_line(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("shapes:\n  - " + "[" * 5000 + "]" * 5000 + "\n")
    assert_user_error(*decoder(tmp_path / "out", 2, "--shape-file", deep), [str(deep), "nested too deeply"])
    run = tmp_path / "run"
    shutil.copytree(RUN_OF_RECORD, run)
    (run / "topk.json").write_text("[" * 100000 + "]" * 100000)
    rc, stdout, stderr = tune("report", run)
    assert rc == 2 and "Traceback" not in stderr and "nested too deeply" in stderr, stderr[-2000:]


def test_a_malformed_fault_setting_is_one_line(tmp_path, monkeypatch):
    from tuner import faults

    for text in ("{", "[]", '{"rules": 5}'):
        monkeypatch.setenv(faults.ENV, text)
        assert_user_error(*decoder(tmp_path, 2), [faults.ENV, "JSON object"])


RECORD_RUNS = {"tiny": "tiny/20261128-004319-tpe", "bert-base": "bert-base/20261128-004550-tpe",
               "bert-large": "bert-large/20261128-004818-tpe"}


@pytest.mark.parametrize("shape", RECORD_RUNS)
def test_the_run_of_record_replays_by_name_as_it_was_recorded(shape, tmp_path, monkeypatch):
    # The shipped recordings of the run of record are its run folders' files, copied as written (a replay serves what
    # the GPU measured, nothing else), and each replays by name from any folder, with the baselines it recorded.
    from tuner.cli import RECORD_REPLAY, shipped_recordings

    name = f"replay-{shape}-h200-20261128"
    assert name in shipped_recordings() and RECORD_REPLAY in shipped_recordings()
    recording, run = REPLAY.parent / name, ROOT / "results" / RECORD_RUNS[shape]
    assert sorted(p.name for p in recording.iterdir()) == ["best.json", "breakdown.json", "manifest.json", "trials.csv"]
    for f in recording.iterdir():
        assert f.read_bytes() == (run / f.name).read_bytes(), f
    monkeypatch.chdir(tmp_path)
    rc, stdout, stderr = tune("decoder", "--replay", name, "--trials", 3, "--timeout", 5, "--no-progress", "--out",
                              tmp_path / "r")
    assert rc == 0, stderr
    assert f"{name}: timings recorded on NVIDIA H200, nothing is measured now" in stdout
    base = json.loads((recording / "manifest.json").read_text())["baselines"]
    assert f"torch.compile latency: {base['compile_us']:.2f} us" in stdout, stdout
    served = json.loads((run_folder(stdout) / "topk.json").read_text())
    assert served["replayed"] and served["compile_us"] == base["compile_us"]


def test_the_readme_replay_example_is_what_the_command_prints(tmp_path, monkeypatch):
    # The README's worked example quotes the replay of the run of record: its header and summary lines verbatim and
    # its first two rows up to the tiles column. They come from the recording and the search's path through it: a
    # change to either (a new seed, TPE's draws) shows here first.
    text = (ROOT / "README.md").read_text()
    command = "tune decoder --replay tests/data/replay-bert-base-h200-20261128 --trials 120"
    at = text.index("```\n" + command + "\n```")
    block = text[at:].split("```")[3].strip().splitlines()  # (the fenced output that follows the command)
    quoted = [ln for ln in block if ln.startswith(("- ", "REPLAYED", "Top 10"))]

    def cells(lines):  # a table row's cells before the tiles column: rank, latency, ±, speedup and the four (o,p)
        return [[c.strip() for c in ln.split("|")[1:9]] for ln in lines
                if ln.startswith("|") and ln.split("|")[1].strip()[:1].isdigit()]

    rows = cells(block)
    assert len(quoted) == 8 and len(rows) == 2, block
    monkeypatch.chdir(ROOT)
    rc, stdout, stderr = tune(*command.split()[1:], "--no-progress", "--out", tmp_path)
    assert rc == 0, stderr
    lines = stdout.splitlines()
    stale = [q for q in quoted if q not in lines] + [r for r, p in zip(rows, cells(lines)) if r != p]
    assert not stale, f"README.md's replay example is out of date: run `{command}` and paste its output; {stale}"


def test_an_install_without_the_recordings_still_runs_every_command(tmp_path, monkeypatch, capsys):
    # every command's parser names the shipped recordings (--replay's help): where an install left them out, the
    # command line still runs, and --replay by name says there are none
    import importlib.resources

    from tuner.cli import main

    files = importlib.resources.files

    def no_recordings(package):
        if package == "tuner.recordings":
            raise ModuleNotFoundError("No module named 'tuner.recordings'")
        return files(package)

    monkeypatch.setattr(importlib.resources, "files", no_recordings)
    monkeypatch.chdir(tmp_path)
    assert main(["shapes"]) == 0 and "bert-base" in capsys.readouterr().out
    assert main(["decoder", "--replay", "replay-bert-base-h200-20261128", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "no such file or folder (recordings shipped with pdl-tune: none in this install)" in err
    assert not (tmp_path / "results").exists()


def test_a_missing_replay_path_is_not_the_shipped_recording(tmp_path, monkeypatch):
    # a bare name and the README's tests/data/ form find the shipped recording from anywhere; another missing path
    # that ends in its name is refused (until session 48 it was silently replaced by the shipped one)
    missing = tmp_path / "mine" / "replay-bert-base-h200"
    assert_user_error(*tune("decoder", "--replay", missing, "--trials", 2, "--no-progress", "--out", tmp_path / "o"),
                      [f"--replay {missing}", "no such file or folder"])
    import importlib.resources

    from tuner.cli import _replay_path

    monkeypatch.chdir(tmp_path)  # (from the checkout, tests/data/ is a folder there and the path is taken as given)
    shipped = str(importlib.resources.files("tuner.recordings") / "replay-bert-base-h200")
    assert _replay_path("replay-bert-base-h200") == _replay_path("tests/data/replay-bert-base-h200") == shipped
    assert Path(shipped).is_dir()


@pytest.mark.parametrize("damage, words", [
    ("rank-text", ["topk.json's rows[1] has a rank of 'x', not a whole number"]),
    ("rank-null", ["topk.json's rows[1] has a rank of None, not a whole number"]),
    ("spread-huge", ["topk.json's rows[0] has a latency_us or spread_us of 1e+09 us or more"]),
    ("number-huge", ["trials.csv's number column holds something other than trial numbers"]),
    ("speedup-bool", None)])  # (read as numbers: the report is drawn)
def test_report_of_a_run_with_absurd_values_is_one_line(tmp_path, damage, words):
    # (session 48's audit: each crashed tune report partway through its plots, the folder half re-drawn)
    run = tmp_path / "run"
    shutil.copytree(RUN_OF_RECORD, run)
    topk = json.loads((run / "topk.json").read_text())
    trials = pd.read_csv(run / "trials.csv")
    if damage.startswith("rank"):
        topk["rows"][1]["rank"] = "x" if damage == "rank-text" else None
    elif damage == "spread-huge":
        topk["rows"][0]["spread_us"] = 1e308
    elif damage == "number-huge":
        trials["number"] = 1e308
    else:
        trials["speedup"] = True
    (run / "topk.json").write_text(json.dumps(topk))
    trials.to_csv(run / "trials.csv", index=False)
    rc, stdout, stderr = tune("report", run)
    if words is None:
        assert rc == 0 and not stderr, (rc, stderr[-2000:])
    else:  # (the check's own line: since session 49 a plot that fails is also one line, which would hide its loss)
        assert_user_error(rc, stdout, stderr, words)


# Session 49: the leftovers of session 48's audit.
@pytest.mark.parametrize("name, words", [("x" * 513, ["--study-name", "513 characters", "at most 512"]),
                                         ("a\nb", ["--study-name 'a\\nb'", "control character"]),
                                         ("a\tb", ["--study-name 'a\\tb'", "control character"])],
                         ids=["long", "newline", "tab"])
def test_a_study_name_a_storage_cannot_hold_is_refused(tmp_path, name, words):
    # (PostgreSQL refused a name over 512 characters with a traceback mid-run; a newline split the logs' lines)
    assert_user_error(*decoder(tmp_path, 2, "--study-name", name), words)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_study_name_of_512_printable_characters_runs(tmp_path):
    name = "é-" * 256
    rc, stdout, stderr = decoder(tmp_path, 2, "--study-name", name)
    assert rc == 0, stderr[-2000:]
    assert json.loads((run_folder(stdout) / "manifest.json").read_text())["study_name"] == name


def test_a_folder_given_as_a_file_is_named_a_folder(tmp_path):
    (tmp_path / "d").mkdir()
    assert_user_error(*decoder(tmp_path / "o", 2, "--shape-file", tmp_path / "d"), ["a folder, not a shape file"])
    assert_user_error(*decoder(tmp_path / "o", 2, "--search-space", tmp_path / "d"),
                      ["a folder, not a search space file"])


def test_a_folder_named_like_a_shipped_space_does_not_hide_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "decoder").mkdir()
    rc, stdout, stderr = decoder(tmp_path / "o", 2, "--search-space", "decoder")
    assert rc == 0, stderr[-2000:]


@pytest.mark.parametrize("link", ["loop", "dangling"])
def test_out_under_a_link_to_nothing_names_out(tmp_path, link):
    # (it was reported as a --storage problem: the default storage's folder could not be created)
    (tmp_path / "l").symlink_to(tmp_path / ("l" if link == "loop" else "missing"))
    assert_user_error(*decoder(tmp_path / "l" / "x", 2), ["--out", "symbolic link that leads to no folder"])


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_bench_seed_out_of_range_is_refused_before_the_gpu(tmp_path, seed):
    assert_user_error(*tune("bench", "--seed", seed, "--out", tmp_path), [f"--seed {seed}", "must be in 0.."])


def test_report_names_a_plot_that_fails_after_writing_the_rest(tmp_path, monkeypatch):
    from tuner import report

    run = tmp_path / "run"
    shutil.copytree(RUN_OF_RECORD, run)
    monkeypatch.setitem(report.PLOTTERS, "importance", lambda r, p: 1 / 0)
    rc, stdout, stderr = tune("report", run)
    assert_user_error(rc, stdout, stderr, [str(run), "plots/importance.png not drawn (ZeroDivisionError"])
    assert "written " + str(run / "plots" / "topk.png") in stdout


def test_a_plot_that_fails_does_not_cost_a_study_its_run_folder(tmp_path, monkeypatch):
    from tuner import report

    monkeypatch.setitem(report.PLOTTERS, "history", lambda r, p: 1 / 0)
    rc, stdout, stderr = decoder(tmp_path, 4)
    assert rc == 0, stderr[-2000:]
    run = run_folder(stdout)
    assert (run / "best.json").is_file() and (run / "plots" / "topk.png").is_file()
    assert "plots/history.png not drawn (ZeroDivisionError" in stdout + stderr


@pytest.mark.parametrize("extra, words", [(("--compilers", "0"), ["--compilers 0", "at least 1"]),
                                          (("--compilers", "4"), ["--compilers", "a replay compiles nothing"])])
def test_compile_workers_are_refused_where_they_cannot_help(tmp_path, extra, words):
    assert_user_error(*decoder(tmp_path, 2, *extra), words)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_replay_records_that_it_compiled_nothing(tmp_path):
    rc, stdout, stderr = decoder(tmp_path, 3)
    assert rc == 0, stderr[-2000:]
    man = json.loads((run_folder(stdout) / "manifest.json").read_text())
    assert man["compilers"] == 1
    assert list(man["search"]) == ["seconds"] and man["search"]["seconds"] >= 0  # (its look-ups are not measurements)
    [took] = [line for line in stdout.splitlines() if "search took" in line]
    assert "this process" not in took
