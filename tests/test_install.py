"""`pip install .` outside the checkout: the wheel holds tuner, tuner.kernels (the kernels/ folder, with the CUDA
sources nvcc builds on a Hopper GPU) and tuner.search_spaces, and `python -m tuner` run from another folder finds
them in the installed copy, not in this checkout.

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


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    pytest.importorskip("setuptools", reason="building the wheel without network needs setuptools in this Python")
    tmp = tmp_path_factory.mktemp("install")
    src, wheels, target = tmp / "src", tmp / "wheels", tmp / "site"
    # what the sdist of a clean checkout holds (setuptools' build/ folder then lands here, not in the checkout)
    for name in ("tuner", "kernels", "search_spaces"):
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
    assert not any(n.startswith(("kernels/", "search_spaces/", "tests/", "results/")) for n in names)
    assert "tuner/cli.py" in names


def test_installed_tune_runs_outside_the_checkout(installed):
    """A replayed study from another folder: the installed copy's search space and kernels, the console entry point's
    main through `python -m tuner`."""
    _, target, tmp = installed
    env = {**os.environ, "PYTHONPATH": str(target)}
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
    res = subprocess.run([sys.executable, "-m", "tuner", "decoder", "--replay", str(REPLAY), "--trials", "6",
                          "--no-progress", "--out", str(out)],
                         cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-2000:])
    assert "REPLAYING" in res.stdout
    (folder,) = [ln.split(": ", 1)[1] for ln in res.stdout.splitlines() if ln.startswith("run folder: ")]
    assert {"manifest.json", "trials.csv", "topk.json", "best.json"} <= {p.name for p in Path(folder).iterdir()}
