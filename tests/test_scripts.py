"""The diagnostics scripts (scripts/*.py) on a machine without a GPU: one line naming the script and what it needs,
exit status 2, no traceback (tuner.device.require_gpu). CUDA_VISIBLE_DEVICES="" hides a GPU where there is one."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
# ncu_top.py reads a CSV of ncu's output and pipeline_sim.py a recording: they need no GPU (tested below).
GPU_SCRIPTS = sorted(p.name for p in SCRIPTS.glob("*.py") if p.name not in ("ncu_top.py", "pipeline_sim.py"))


def run(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300, env=env,
                          cwd=SCRIPTS.parent)


@pytest.fixture(scope="module")
def gpu_script_runs(request):
    """Every selected script of the test below, started on a pool of one thread a core (at most 4: each run holds a
    torch import, ~0.3 GB): each run spends ~3 s importing torch, so running them side by side saves about half the
    module's time on CI's two cores."""
    selected = [item.callspec.params["name"] for item in request.session.items
                if getattr(item, "function", None) is test_gpu_script_without_a_gpu_says_so_in_one_line]
    with ThreadPoolExecutor(max_workers=min(os.cpu_count() or 2, 4)) as pool:
        yield {name: pool.submit(run, str(SCRIPTS / name), "bert-base") for name in selected}


@pytest.mark.parametrize("name", GPU_SCRIPTS)
def test_gpu_script_without_a_gpu_says_so_in_one_line(name, gpu_script_runs):
    r = gpu_script_runs[name].result()
    assert r.returncode == 2, (r.stdout[-1000:], r.stderr[-2000:])
    assert r.stderr.strip() == (f"{name}: needs a CUDA GPU and none is visible; it is a diagnostic for the GPU "
                                "machine (README.md, Performance notes)"), r.stderr
    assert r.stdout == ""


def test_smem_check_gemm_names_its_cpu_dry_run():
    r = run(str(SCRIPTS / "smem_check.py"), "gemm")
    assert r.returncode == 2 and "(or TRITON_INTERPRET=1 for its CPU dry run)" in r.stderr, r.stderr


def test_ncu_top_without_arguments_prints_its_usage():
    r = run(str(SCRIPTS / "ncu_top.py"))
    assert r.returncode != 0 and r.stderr.startswith("usage: python3 scripts/ncu_top.py SRC.csv"), r.stderr
    r = run(str(SCRIPTS / "ncu_top.py"), "no-such-file.csv")
    assert r.returncode != 0
    assert r.stderr.strip() == "ncu_top.py: cannot read no-such-file.csv (No such file or directory)"


def test_pipeline_sim_compares_the_depths_on_a_recording(tmp_path):
    tiny = "tests/data/replay-tiny-h200-20261128"
    r = run(str(SCRIPTS / "pipeline_sim.py"), tiny, "--depths", "1,3,3-", "--seeds", "1", "--trials", "12",
            "--json", str(tmp_path / "sim.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| replay-tiny")]
    assert [row.split("|")[2].strip() for row in rows] == ["1", "3", "3-"], r.stdout
    import json

    runs = json.loads((tmp_path / "sim.json").read_text())["runs"]
    assert [(x["depth"], x["liar"], len(x["curve"])) for x in runs] == [(1, True, 12), (3, True, 12), (3, False, 12)]
    assert all(x["curve"] == sorted(x["curve"], reverse=True) for x in runs)  # (the best so far only improves)
    r = run(str(SCRIPTS / "pipeline_sim.py"), "no-such-recording")
    assert r.returncode == 2 and r.stderr.startswith("pipeline_sim.py: no-such-recording: ")
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
