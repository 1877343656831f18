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
