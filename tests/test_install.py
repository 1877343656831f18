"""`pip install .` outside the checkout: the wheel holds tuner, tuner.kernels (the kernels/ folder, with the CUDA
sources nvcc builds on a Hopper GPU), tuner.search_spaces, tuner.notebooks (the analysis notebook) and
tuner.recordings (the replay recording), and `python -m tuner` run from another folder finds them in the installed
copy, not in this checkout; so does the notebook that `tune notebook` writes there.

Built without network (no build isolation: this Python's setuptools builds it), installed with --target into a
temporary folder that PYTHONPATH puts in front of the editable install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPLAY = ROOT / "tests" / "data" / "replay-bert-base-h200"


def _in_front(target: Path) -> str:
    """PYTHONPATH with the installed copy in front of whatever the environment has there (e.g. the GPU machine's
    folder of carried wheels, where Optuna is)."""
    return os.pathsep.join([str(target)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    pytest.importorskip("setuptools", reason="building the wheel without network needs setuptools in this Python")
    tmp = tmp_path_factory.mktemp("install")
    src, wheels, target = tmp / "src", tmp / "wheels", tmp / "site"
    # what the sdist of a clean checkout holds (setuptools' build/ folder then lands here, not in the checkout)
    for name in ("tuner", "kernels", "search_spaces", "notebooks", "tests/data"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    run = dict(capture_output=True, text=True, timeout=300)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(wheels), str(src)], **run)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = wheels.glob("pdl_tune-*.whl")
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                           str(target), str(wheel)], **run)
    assert inst.returncode == 0, inst.stderr[-2000:]
    return wheel, target, tmp


def test_wheel_holds_the_kernels_sources_and_search_spaces(installed):
    wheel, _, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = {p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".py", ".cu", ".cuh")}
    spaces = {p.name for p in (ROOT / "search_spaces").glob("*.yaml")}
    assert {f"tuner/kernels/{n}" for n in kernels} <= names, sorted(kernels - {n.split("/")[-1] for n in names})
    assert {f"tuner/search_spaces/{n}" for n in spaces} <= names
    recordings = [p for p in REPLAY.parent.glob("replay-*") if p.is_dir()]  # (the run of record's three, the first)
    assert len(recordings) >= 4 and REPLAY in recordings
    assert {"tuner/notebooks/analysis.ipynb"} | {f"tuner/recordings/{p.relative_to(REPLAY.parent)}"
                                                 for r in recordings for p in r.iterdir()} <= names
    assert not any(n.startswith(("kernels/", "search_spaces/", "notebooks/", "tests/", "results/")) for n in names)
    assert "tuner/cli.py" in names


def test_installed_tune_runs_outside_the_checkout(installed):
    """A replayed study from another folder: the installed copy's search space and kernels, the console entry point's
    main through `python -m tuner`."""
    _, target, tmp = installed
    env = {**os.environ, "PYTHONPATH": _in_front(target)}
    probe = subprocess.run(
        [sys.executable, "-c", "import tuner, tuner.kernels.gemm as g, importlib.resources as r;"
         "from tuner import space; print(tuner.__file__); print(g.__file__); print(','.join(space.shipped()));"
         "print(r.files('tuner.kernels').joinpath('cluster_gemm.cu').is_file())"],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-2000:]
    tuner_file, gemm_file, shipped, cu = probe.stdout.split()
    assert Path(tuner_file).is_relative_to(target) and Path(gemm_file).is_relative_to(target)
    assert shipped.split(",") == sorted(p.stem for p in (ROOT / "search_spaces").glob("*.yaml"))
    assert cu == "True"
    out = tmp / "runs"
    # the README's command, whose tests/data path is not there: the recording the installed copy ships, by its name
    assert not (tmp / "tests").exists()
    res = subprocess.run([sys.executable, "-m", "tuner", "decoder", "--replay", "tests/data/" + REPLAY.name,
                          "--trials", "6", "--no-progress", "--out", str(out)],
                         cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-2000:])
    assert f"REPLAYING {target / 'tuner' / 'recordings' / REPLAY.name}: " in res.stdout, res.stdout[:500]
    (folder,) = [ln.split(": ", 1)[1] for ln in res.stdout.splitlines() if ln.startswith("run folder: ")]
    assert {"manifest.json", "trials.csv", "topk.json", "best.json"} <= {p.name for p in Path(folder).iterdir()}


def test_installed_notebook_analyses_runs_outside_the_checkout(installed, monkeypatch):
    """`tune notebook` writes the shipped notebook into a folder outside the checkout, keeps an existing one, and the
    notebook runs there headless on the installed copy: the run under that folder's results/ (a replay of the shipped
    recording, as `tune decoder` writes it by default), the comparison replayed from the shipped recording."""
    nbclient = pytest.importorskip("nbclient", reason="nbclient is in the test extra: pip install -e .[test]")
    pytest.importorskip("ipykernel", reason="ipykernel is in the test extra: pip install -e .[test]")
    import nbformat

    _, target, tmp = installed
    work = tmp / "analysis"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": _in_front(target)}
    tune = lambda *a: subprocess.run([sys.executable, "-m", "tuner", *a], cwd=work, env=env,  # noqa: E731
                                     capture_output=True, text=True, timeout=600)
    res = tune("notebook")
    assert res.returncode == 0 and (work / "analysis.ipynb").is_file(), res.stderr[-2000:]
    shipped = (work / "analysis.ipynb").read_bytes()
    assert shipped == (ROOT / "notebooks" / "analysis.ipynb").read_bytes()
    (work / "analysis.ipynb").write_text("the user's edits")
    res = tune("notebook")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "kept" in res.stderr, res.stderr
    assert (work / "analysis.ipynb").read_text() == "the user's edits"
    (work / "analysis.ipynb").write_bytes(shipped)
    recording = target / "tuner" / "recordings" / "replay-bert-base-h200-20261128"  # (the notebook's: the run of record)
    res = tune("decoder", "--replay", str(recording), "--trials", "6", "--no-progress")
    assert res.returncode == 0, res.stderr[-2000:]

    for var in ("PDL_TUNE_RUN", "PDL_TUNE_COMPARE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PDL_TUNE_REPLAY_TRIALS", "8")  # (the comparison's replay: its length is not what is tested)
    monkeypatch.setenv("PYTHONPATH", _in_front(target))  # (the kernel, a child process, imports the installed tuner)
    nb = nbformat.read(work / "analysis.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(work)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"a cell of the installed notebook failed:\n{e}", pytrace=False)
    text = "\n".join(o.get("text", "") + o.get("data", {}).get("text/plain", "")
                     for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "run folder: results/bert-base/" in text and "REPLAYED" in text, text[:2000]
    assert "1 committed run folder(s) under results/" in text
    # the runs under the notebook's folder, the comparison replayed from the recording shipped with the installed copy
    assert f"runs read from {work.resolve() / 'results'}; replays from {recording.resolve()}" in text.splitlines()
    assert "B: " in text and "(REPLAYED)" in text
