"""The CUDA kernels' build log and the side-by-side prebuild (tuner.kernels._nvcc; tests/conftest.py prebuilds the
GPU tests' variants with them). Needs nvcc, not a GPU: the libraries are built, never loaded on a device."""

import json
import subprocess

import pytest

from tuner.kernels import _nvcc

# Two variants of the clustered GEMM that no production path builds (a 64x64 tile split 2, bf16, epilogues 0 and 1).
VARIANTS = [{"CG_BF16": 1, "CG_SC": 2, "CG_EPI": e, "CG_BM": 64, "CG_BN": 64} for e in (0, 1)]

pytestmark = pytest.mark.skipif(_nvcc.nvcc() is None, reason="needs nvcc (the CUDA toolkit): builds the kernels")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDL_TUNE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_build_log_names_each_build_and_the_test_that_asked(cache, tmp_path, monkeypatch):
    log = tmp_path / "builds.jsonl"
    monkeypatch.setenv(_nvcc.BUILD_LOG_ENV, str(log))
    src = _nvcc.HERE / "cluster_gemm.cu"
    _nvcc.build(src, VARIANTS[0], "test")
    _nvcc.build(src, VARIANTS[0], "test")  # (cached: logged again, read once)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert lines == [{"source": "cluster_gemm.cu", "defines": VARIANTS[0], "test": "tests/test_prebuild.py"}] * 2
    log.write_text(log.read_text() + "not json\n" + json.dumps({"source": "qkv_attn.cu", "defines": {"QA_BF16": 0},
                                                               "test": "tests/test_qkv_attn.py"}) + "\n")
    assert _nvcc.read_build_log(log) == [{"source": "cluster_gemm.cu", "defines": VARIANTS[0]},
                                         {"source": "qkv_attn.cu", "defines": {"QA_BF16": 0}}]
    assert _nvcc.read_build_log(log, {"tests/test_qkv_attn.py"}) == [{"source": "qkv_attn.cu",
                                                                       "defines": {"QA_BF16": 0}}]


def test_prebuild_builds_side_by_side_what_a_launch_then_finds_cached(cache, monkeypatch):
    builds = [{"source": "cluster_gemm.cu", "defines": d} for d in VARIANTS]
    assert _nvcc.prebuild(builds + [{"source": "nope.cu", "defines": {}}], jobs=2) == (
        2, [f"nope.cu: no such kernel source in {_nvcc.HERE}"])
    src = _nvcc.HERE / "cluster_gemm.cu"
    assert all(_nvcc.library_path(src, d, "test").exists() for d in VARIANTS)
    assert _nvcc.prebuild(builds, jobs=2) == (0, [])  # (both cached)

    def no_nvcc(*args, **kwargs):
        raise AssertionError(f"nvcc ran again: {args}")

    monkeypatch.setattr(subprocess, "run", no_nvcc)  # a launch's build of either variant is a cache hit
    assert [_nvcc.compile_library(src, d, "test") for d in VARIANTS] == [_nvcc.library_path(src, d, "test")
                                                                         for d in VARIANTS]


def test_the_gpu_suite_prebuilds_the_variants_of_the_selected_files(cache, tmp_path, monkeypatch):
    # tests/conftest.py's hook, with the GPU it needs taken as present (the builds themselves are real nvcc builds)
    from pathlib import Path

    import torch

    import conftest

    log = tmp_path / "gpu_builds.jsonl"
    log.write_text("".join(json.dumps({"source": "cluster_gemm.cu", "defines": d, "test": t}) + "\n"
                           for d, t in zip(VARIANTS, ("tests/test_cluster_gemm.py", "tests/test_other.py"))))
    monkeypatch.setattr(conftest, "HAS_GPU", True)
    monkeypatch.setattr(conftest, "GPU_BUILDS", log)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    said = []

    class Session:
        class config:
            class pluginmanager:
                get_plugin = staticmethod(lambda name: type("R", (), {"write_line": staticmethod(said.append)}))

        items = [type("Item", (), {"path": Path(conftest.__file__).parent / "test_cluster_gemm.py"})]

    conftest.pytest_collection_finish(Session)
    src = _nvcc.HERE / "cluster_gemm.cu"
    assert [_nvcc.library_path(src, d, "test").exists() for d in VARIANTS] == [True, False]  # (the selected file's)
    assert said and said[0].startswith("conftest: 1 of the 1 CUDA kernel variants these tests build were built now")
    log.write_text("not a build\n")  # (nothing for these tests: nothing said)
    said.clear()
    conftest.pytest_collection_finish(Session)
    assert said == []
