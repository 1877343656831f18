"""Without a CUDA GPU every kernel runs in the Triton interpreter. TRITON_INTERPRET is read when a
kernel is decorated, so it is set here, before any test imports a kernel module."""

import os
import time
from pathlib import Path

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if HAS_GPU else "cpu"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    # With pytest-xdist (`-n 2 --dist loadgroup`, the README's command) a file's tests run in one worker, so its
    # module fixtures are built once; with a GPU every test runs in one worker, so no two share the GPU and no
    # timing is measured beside another test. (Without xdist the marker means nothing.)
    skip = None if HAS_GPU else pytest.mark.skip(reason="needs a CUDA GPU: run through the device tool (pytest -m gpu)")
    for item in items:
        item.add_marker(pytest.mark.xdist_group("gpu" if HAS_GPU else item.path.name))
        if skip and item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE


# The CUDA kernels' variants that the GPU tests build (nvcc, one process each), recorded by a GPU run of the suite with
# PDL_TUNE_BUILD_LOG=tests/data/gpu_builds.jsonl (tuner.kernels._nvcc). A cold machine spent ~400 of the suite's ~550 s
# building them one after another (docs/perf-notes.md section 66.6).
GPU_BUILDS = Path(__file__).parent / "data" / "gpu_builds.jsonl"


def pytest_collection_finish(session):
    """On a Hopper GPU with nvcc, build the variants the selected tests' files build (GPU_BUILDS) side by side before
    the first test, one nvcc a CPU; those already cached cost nothing. Once per run: not in a second xdist worker."""
    worker = getattr(session.config, "workerinput", {}).get("workerid", "gw0")
    if not HAS_GPU or worker != "gw0" or not GPU_BUILDS.exists() or torch.cuda.get_device_capability() != (9, 0):
        return
    from tuner.kernels import _nvcc

    if _nvcc.nvcc() is None:
        return
    root = Path(__file__).parent.parent
    say = session.config.pluginmanager.get_plugin("terminalreporter")
    try:  # (a speed-up only: whatever fails here, each test still builds what it needs)
        files = {Path(item.path).resolve().relative_to(root).as_posix() for item in session.items
                 if Path(item.path).resolve().is_relative_to(root)}
        builds = _nvcc.read_build_log(GPU_BUILDS, files)
        t0 = time.time()
        built, errors = _nvcc.prebuild(builds, os.cpu_count() or 1)
        text = (f"{built} of the {len(builds)} CUDA kernel variants these tests build were built now, side by side, in "
                f"{time.time() - t0:.0f} s" + (f"; {len(errors)} failed: {errors[0]}" if errors else ""))
    except Exception as e:  # noqa: BLE001
        builds, text = True, f"no prebuild ({type(e).__name__}: {e})"
    if say is not None and builds:
        say.write_line(f"conftest: {text}")
