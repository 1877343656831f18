"""The CUDA kernels' diagnostics (trace stamps, SM-cycle stamps) and test-only racy variant are build variants
(QA_DIAG, CG_DIAG, MLP_DIAG): the production build must carry none of their code, because run-time branches for other
paths have cost a kernel 0.4 us a layer (docs/perf-notes.md, sections 33-34); so is the cluster GEMM's epilogue without
bounds checks (CG_EVEN). Compiled to PTX with nvcc where it is installed (no GPU needed)."""

import re
import subprocess

import pytest

from tuner.kernels import _nvcc, cluster_gemm, mlp_cluster, qkv_attn

KERNELS = {  # source, its diagnostics define, the other defines of a representative variant (bert-base / tiny)
    "qkv_attn": (qkv_attn.SOURCE, "QA_DIAG", {"QA_EPI": qkv_attn.BIAS_F32 | qkv_attn.LN_IN, "QA_RT": 2, "QA_KC": 2}),
    "cluster_gemm": (cluster_gemm.SOURCE, "CG_DIAG", {"CG_SC": 4, "CG_EPI": 45}),
    "mlp_cluster": (mlp_cluster.SOURCE, "MLP_DIAG", {"MLP_SC": 8, "MLP_EPI": 104, "MLP_BT": 32, "MLP_D": 256}),
}
CLOCKS = re.compile(r"%globaltimer|%clock64|%clock\b")


def _ptx(source, defines: dict, tmp_path) -> str:
    out = tmp_path / "k.ptx"
    cmd = [_nvcc.nvcc(), "-std=c++17", "-arch=sm_90a", "-ptx", *(f"-D{k}={v}" for k, v in defines.items()),
           "-o", str(out), str(source)]
    subprocess.run(cmd, check=True, capture_output=True)
    return out.read_text()


@pytest.mark.skipif(_nvcc.nvcc() is None, reason="needs nvcc (CUDA toolkit) to compile the kernels to PTX")
@pytest.mark.parametrize("name", list(KERNELS))
def test_production_build_has_no_diagnostics(name, tmp_path):
    source, diag, defines = KERNELS[name]
    # the defines the launchers ask for (_nvcc.diag): no trace and not racy, a trace buffer, the racy variant
    prod = _ptx(source, {**defines, diag: _nvcc.diag(None, False)}, tmp_path)
    traced = _ptx(source, {**defines, diag: _nvcc.diag(object(), False)}, tmp_path)
    racy = _ptx(source, {**defines, diag: _nvcc.diag(None, True)}, tmp_path)
    assert not CLOCKS.search(prod), f"{name}: the production build reads a clock"
    assert CLOCKS.search(traced), f"{name}: the traced build stamps nothing"
    assert racy != prod, f"{name}: the racy build is the production build"


@pytest.mark.skipif(_nvcc.nvcc() is None, reason="needs nvcc (CUDA toolkit) to compile the kernels to PTX")
def test_even_cluster_gemm_build_has_one_store_path(tmp_path):
    # CG_EVEN (tiles divide M and N, output rows 16-byte aligned; cluster_gemm.launch decides): the epilogue keeps
    # only its 16-byte stores, no element-wise fallback
    source, _, defines = KERNELS["cluster_gemm"]
    scalar = re.compile(r"st\.global\.(b16|u16)")
    general, even = (_ptx(source, {**defines, "CG_EVEN": e}, tmp_path) for e in (0, 1))
    assert scalar.search(general) and not scalar.search(even)
    assert "st.global.v4" in even


@pytest.mark.skipif(_nvcc.nvcc() is None, reason="needs nvcc (CUDA toolkit) to build the kernels")
@pytest.mark.parametrize("cycles", [False, True])
def test_traced_builds_write_the_slots_python_allocates(cycles, tmp_path, monkeypatch):
    # A traced build's stamps a program are the launchers' trace width: library() checks it at load (it raises on a
    # mismatch), and the scripts allocate their buffers from these constants. Built and loaded here (no GPU needed).
    monkeypatch.setattr(_nvcc, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(qkv_attn, "_LIBS", {})
    trace = _nvcc.diag(object(), False, cycles)
    lib = qkv_attn.library(0, qkv_attn.BIAS_F32 | qkv_attn.LN_IN, 2, 2, diag=trace)
    assert lib.qkv_attn_trace_slots() == (qkv_attn.CYCLE_SLOTS if cycles else qkv_attn.TRACE_SLOTS)
    if not cycles:  # the GEMM and the feed-forward block have no cycle stamps
        monkeypatch.setattr(cluster_gemm, "_LIBS", {})
        monkeypatch.setattr(mlp_cluster, "_LIBS", {})
        assert cluster_gemm.library(0, 4, 45, 64, 64, 0, trace, 1).cluster_gemm_trace_slots() == cluster_gemm.TRACE_SLOTS
        assert mlp_cluster.library(0, 8, 104, 32, 256, diag=trace).mlp_trace_slots() == mlp_cluster.TRACE_SLOTS


@pytest.mark.skipif(_nvcc.nvcc() is None, reason="needs nvcc (CUDA toolkit) to compile the kernels to PTX")
def test_launch_attribute_switches_change_host_code_only(tmp_path, monkeypatch):
    # _nvcc.CLUSTER_POLICY and MEM_SYNC_DOMAIN (timeline.py's cluster_policy=N and sync_domain=N, A/B of the clustered
    # launches' attributes): libraries of their own, which the launchers' caches tell apart, with the same device code
    # as the production build
    source, _, defines = KERNELS["cluster_gemm"]
    prod_ptx = _ptx(source, defines, tmp_path)
    assert prod_ptx == _ptx(source, {**defines, "HOPPER_CLUSTER_POLICY": 2, "HOPPER_MEM_SYNC_DOMAIN": 1}, tmp_path)
    monkeypatch.setattr(_nvcc, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(cluster_gemm, "_LIBS", {})
    prod = cluster_gemm.library(0, 4, 0)
    monkeypatch.setattr(_nvcc, "CLUSTER_POLICY", 1)
    policy = cluster_gemm.library(0, 4, 0)
    assert policy is not prod and policy._name != prod._name and policy._name.endswith("-cp1.so")
    monkeypatch.setattr(_nvcc, "CLUSTER_POLICY", None)
    monkeypatch.setattr(_nvcc, "MEM_SYNC_DOMAIN", 1)  # (the same value under another define: another file)
    domain = cluster_gemm.library(0, 4, 0)
    assert domain._name.endswith("-sd1.so") and len({prod._name, policy._name, domain._name}) == 3


@pytest.mark.skipif(_nvcc.nvcc() is None, reason="needs nvcc (CUDA toolkit) to build the kernels")
def test_held_cluster_gemm_build_holds_what_python_says(tmp_path, monkeypatch):
    # tune verify's held build (CG_DIAG's DIAG_HELD bit) keeps its odd column tiles' stores back SLOW_NS: the constant
    # lives in cluster_gemm.cu and cluster_gemm.py, and library() refuses a build whose hold differs (raises at load)
    source, _, defines = KERNELS["cluster_gemm"]
    held = _ptx(source, {**defines, "CG_DIAG": _nvcc.DIAG_HELD}, tmp_path)
    assert CLOCKS.search(held) and not CLOCKS.search(_ptx(source, defines, tmp_path))
    monkeypatch.setattr(_nvcc, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(cluster_gemm, "_LIBS", {})
    lib = cluster_gemm.library(0, 4, 45, diag=_nvcc.DIAG_HELD)
    assert lib.cluster_gemm_slow_ns() == cluster_gemm.SLOW_NS
    monkeypatch.setattr(cluster_gemm, "_LIBS", {})
    monkeypatch.setattr(cluster_gemm, "SLOW_NS", cluster_gemm.SLOW_NS + 1)
    with pytest.raises(RuntimeError, match="does not match cluster_gemm.py"):
        cluster_gemm.library(0, 4, 45, diag=_nvcc.DIAG_HELD)


@pytest.mark.skipif(_nvcc.nvcc() is None, reason="needs nvcc (CUDA toolkit) to build the kernels")
def test_shared_memory_counts_are_the_c_sources(tmp_path, monkeypatch):
    # Which configs fit is decided by the Python counts (error(), check()); each library also reports its own from the
    # C source. Built and loaded here (no GPU needed) for variants that move every term: row tiles and K tiles a box;
    # the block's hidden columns a CTA, token tile, out-projection and attention; the GEMM's tile shape.
    monkeypatch.setattr(_nvcc, "cache_dir", lambda: tmp_path)
    for module in (qkv_attn, mlp_cluster, cluster_gemm):
        monkeypatch.setattr(module, "_LIBS", {})
    for rt, kc in ((2, 2), (1, 1)):
        lib = qkv_attn.library(0, qkv_attn.BIAS_F32 | qkv_attn.LN_IN, rt, kc)
        for stages in (2, 4, 6):
            assert lib.qkv_attn_smem_bytes(stages) == qkv_attn.smem_bytes(stages * kc, 64 * rt, kc), (rt, kc, stages)
    full = mlp_cluster.B1_F32 | mlp_cluster.LN_IN | mlp_cluster.STATS_OUT | mlp_cluster.OUT_IN | mlp_cluster.ATT_IN
    for sc, epi, bt, d, fs in ((8, 104, 32, 256, 128), (4, full, 64, 256, 64), (2, 0, 32, 128, 64)):
        lib = mlp_cluster.library(0, sc, epi, bt, d, fs)
        want = mlp_cluster.smem_bytes(d, sc, bt, fs, bool(epi & mlp_cluster.OUT_IN), bool(epi & mlp_cluster.ATT_IN))
        assert lib.mlp_smem_bytes() == want, (sc, epi, bt, d, fs)
    for split, bm, bn in ((4, 64, 64), (8, 128, 128), (2, 128, 64)):
        lib = cluster_gemm.library(0, split, 45, bm, bn)
        for stages in (2, 4, 7):
            assert lib.cluster_gemm_smem_bytes(stages) == cluster_gemm.smem_bytes(stages, bm, bn), (split, bm, bn)
