"""The multicast GEMM (``mc_gemm.cu``): built with nvcc on first use, called through ctypes.

``gemm.linear`` calls :func:`launch` for a ``GemmConfig`` with ``mc > 0`` on a Hopper GPU (compute capability
9.0); everywhere else (the Triton interpreter, other GPUs) the Triton kernel runs the same config with ``mc``
ignored, as PDL and prefetch are switched off there. The library is built once per source version into
``$PDL_TUNE_CACHE`` (default ``~/.cache/pdl-tune``) and shared by every process, the tuner's workers included.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("mc_gemm.cu")
CLUSTERS = (1, 2, 4)
BLOCK = 64  # the kernel's tile: 64x64 outputs, K in 64-wide tiles (the 128-byte swizzle span)
MAX_STAGES = 13  # mc_gemm.cu's MAX_STAGES: 13 stages of 16 KB fit the H100/H200's 227 KB
# mc_gemm.cu's epilogue bits (compile time: one library per variant) and runtime flags.
HAS_BIAS, BIAS_F32, HAS_RES, HAS_LN, STATS_OUT, SPLIT = 1, 2, 4, 8, 16, 32
USE_PDL, RACY = 64, 128
NO_MMA = 256
# Diagnostics only (scripts/timeline.py switch mc_no_mma): the K loop without its MMAs, to time the data movement.
_NO_MMA = False


def smem_bytes(stages: int) -> int:
    """Dynamic shared memory of a launch (mc_gemm.cu's mc_gemm_smem_bytes): A and B tiles of 8 KB a stage, two
    mbarriers a stage, 1 KB for the swizzle alignment."""
    return stages * 2 * BLOCK * BLOCK * 2 + 16 * stages + 1024


def nvcc() -> str | None:
    for cand in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _cache_dir() -> Path:
    return Path(os.environ.get("PDL_TUNE_CACHE", Path.home() / ".cache" / "pdl-tune"))


_LIBS: dict[tuple[int, int, int], ctypes.CDLL] = {}


def library(bf16: int, cluster: int, epi: int) -> ctypes.CDLL:
    """The library of one variant (operand dtype, cluster size, epilogue bits), built now if this source version
    has not been built for it on this machine (nvcc, about 2 s)."""
    key = (bf16, cluster, epi)
    if key in _LIBS:
        return _LIBS[key]
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("mc_gemm: nvcc not found (PATH or $CUDA_HOME/bin); the mc > 0 GEMM needs the CUDA toolkit")
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src + compiler.encode()).hexdigest()[:16]
    out = _cache_dir() / f"mc_gemm-{tag}-{bf16}-{cluster}-{epi}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
        os.close(fd)
        cmd = [compiler, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler",
               "-fPIC", f"-DMC_BF16={bf16}", f"-DMC_CLUSTER={cluster}", f"-DMC_EPI={epi}", "-o", tmp, str(SOURCE)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            os.unlink(tmp)
            last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"mc_gemm: nvcc failed: {last}")
        os.replace(tmp, out)  # atomic: concurrent builders (the tuner's workers) never load a partial file
    lib = ctypes.CDLL(str(out))
    P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.mc_gemm_launch.argtypes = [P] * 10 + [I] * 13 + [F, I, P, ctypes.c_char_p, I]
    lib.mc_gemm_launch.restype = I
    lib.mc_gemm_smem_bytes.argtypes = [I]
    lib.mc_gemm_smem_bytes.restype = I
    if lib.mc_gemm_smem_bytes(4) != smem_bytes(4) or lib.mc_gemm_variant() != bf16 | (cluster << 1) | (epi << 8):
        raise RuntimeError(f"mc_gemm: {out} does not match mc_gemm.py (shared-memory layout or variant)")
    _LIBS[key] = lib
    return lib


def usable(x: torch.Tensor) -> bool:
    """Whether the CUDA kernel runs for tensors on ``x``'s device (Hopper, not under the interpreter)."""
    from ._common import interpreting

    return x.is_cuda and not interpreting() and torch.cuda.get_device_capability(x.device) == (9, 0)


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def launch(x, weight, out, *, bias=None, residual=None, workspace=None, ln_colsum=None, ln_stats=None,
           stats_out=None, trace=None, split_k=1, per_split=0, stages=4, cluster=2, trigger_k=-1, n_pref=0,
           ln_eps=1e-5, act=0, racy=False) -> None:
    """One launch on the current stream. ``per_split``, ``trigger_k`` and ``n_pref`` count 64-wide K tiles."""
    M, K = x.shape
    N = weight.shape[0]
    epi = ((HAS_BIAS if bias is not None else 0) | (BIAS_F32 if bias is not None and bias.dtype == torch.float32
                                                    else 0)
           | (HAS_RES if residual is not None else 0) | (HAS_LN if ln_colsum is not None else 0)
           | (STATS_OUT if stats_out is not None else 0) | (SPLIT if split_k > 1 else 0) | (act << 6))
    if split_k > 1:
        epi = SPLIT  # the partials are stored raw; the split-K reduction kernel applies the epilogue
    epi |= NO_MMA if _NO_MMA else 0
    flags = (USE_PDL if trigger_k >= 0 else 0) | (RACY if racy else 0)
    err = ctypes.create_string_buffer(512)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    lib = library(int(x.dtype == torch.bfloat16), cluster, epi)
    rc = lib.mc_gemm_launch(
        _ptr(x), _ptr(weight), _ptr(bias), _ptr(residual), _ptr(out), _ptr(workspace), _ptr(ln_colsum),
        _ptr(ln_stats), _ptr(stats_out), _ptr(trace),
        M, N, K, x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        split_k, per_split, stages, trigger_k, n_pref, ln_stats.shape[0] if ln_stats is not None else 0,
        ln_eps, flags, stream, err, len(err))
    if rc != 0:
        raise RuntimeError(err.value.decode(errors="replace"))
