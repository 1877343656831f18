"""The cluster split-K GEMM (``cluster_gemm.cu``): built with nvcc on first use, called through ctypes.

``gemm.linear`` calls :func:`launch` for a ``GemmConfig`` with ``cluster=1`` on a Hopper GPU (compute capability
9.0): the ``split_k`` programs of a tile form one thread-block cluster and reduce their partials through
distributed shared memory, so no reduction kernel follows. Everywhere else (the Triton interpreter, other GPUs),
and for a GEMM whose fused LayerNorm gathers its row sums in the K loop, the Triton kernel runs the same config
with its reduction kernel, as PDL and prefetch are switched off where they cannot run. A LayerNorm whose row sums
come from the producer (``norm.fuse: 2``) is applied in the cluster kernel's epilogue. Each variant (operand
dtype, split, epilogue, tile) is built once
per source version into ``$PDL_TUNE_CACHE`` (default ``~/.cache/pdl-tune``) and shared by every process, the
tuner's workers included.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

# cluster_gemm.cu's MAX_LN_PARTS: the producer's row-sum parts a fused LayerNorm may read (the tuner's copy)
from tuner.names import MAX_LN_PARTS  # noqa: F401

from . import _nvcc
from ._common import compiling

SOURCE = Path(__file__).with_name("cluster_gemm.cu")
SPLITS = (2, 4, 8)  # CTAs a cluster (the K splits of one tile); 8 needs 128-column tiles (split_error)
# A traced launch's int64 stamps a program: entry, wait returned, K loop done, end (scripts/trace_gemms.py).
TRACE_SLOTS = 4
# How long a held build's odd column tiles hold their stores (tune verify): cluster_gemm.cu's SLOW_NS, checked at load.
SLOW_NS = 20_000
BLOCK = 64  # K is consumed in 64-wide tiles (the 128-byte swizzle span of 16-bit elements)
TILES = (64, 128)  # the output tile's rows (one consumer warpgroup per 64) and columns
MAX_STAGES = 12  # cluster_gemm.cu's MAX_STAGES
# cluster_gemm.cu's epilogue bits (compile time: one library per variant; the activation in bits 6-7) and flags.
HAS_BIAS, BIAS_F32, HAS_RES, LN_IN, STATS_OUT, XCHG16 = 1, 2, 4, 8, 16, 32
USE_PDL, EARLY_SHIFT, NO_SPREAD, ALL_SLABS = 64, 8, 4096, 16384
# Shapes whose tiles divide M and N (with 16-byte aligned output rows) run a build without the epilogue's bounds
# checks (CG_EVEN; A/B switch cg_even=0 of scripts/timeline.py)
EVEN_BUILDS = True
# One CTA to an SM: a launch of more CTAs than half the SMs pads its shared memory past half an SM
# (cluster_gemm.cu). False: A/B only (switch cg_spread=0 of scripts/timeline.py).
SPREAD = True
# The most weight tiles a CTA loads into shared memory before griddepcontrol.wait (the rest of its prefetch goes to
# L2 only); None: one per stage. (A/B switch of scripts/timeline.py: cg_early=N.)
EARLY_TILES: int | None = None
# Push every row slab of a split tile, also those whose rows all lie past M (which nobody stores). False: skip them
# (tiny's 32 tokens on 64-row tiles: half of the exchange). True: A/B only (switch cg_all_slabs=1 of timeline.py).
ALL_SLABS_PUSHED = False
# Called as launch_enter_hook(kernel name, launched with PDL) before every launch, like Triton's
# triton.knobs.runtime.launch_enter_hook (tune verify's launch census); None: no hook.
launch_enter_hook = None


def stage_bytes(bm: int = 64, bn: int = 64) -> int:
    """One stage of the K loop: a bm x 64 A tile and a bn x 64 B tile of 16-bit elements."""
    return (bm + bn) * BLOCK * 2


def part_bytes(bm: int = 64, bn: int = 64) -> int:
    """One fp32 partial tile in shared memory (rows padded by 4 floats)."""
    return bm * (bn + 4) * 4


def smem_bytes(stages: int, bm: int = 64, bn: int = 64) -> int:
    """Dynamic shared memory of a launch (cluster_gemm.cu's cluster_gemm_smem_bytes): 1 KB for the swizzle
    alignment, the stages, the slabs pushed by the other CTAs (one partial tile), mbarriers."""
    return 1024 + stages * stage_bytes(bm, bn) + part_bytes(bm, bn) + 16 * stages + 8


def split_error(split: int, bn: int = 64) -> str | None:
    """Why the kernel cannot split a tile of ``bn`` columns ``split`` ways: a CTA reduces and stores bm / split rows,
    2 x split threads a row, each at least 8 columns (one 16-byte store): bn >= 16 x split."""
    if split not in SPLITS:
        return f"needs split_k in {SPLITS}, not {split}"
    if bn < 16 * split:
        return f"split_k={split} needs tiles of {16 * split} columns or more, not {bn}"
    return None


def stages_error(stages: int, bm: int = 64, bn: int = 64) -> str | None:
    """Why the kernel cannot run ``stages`` stages of a bm x bn tile (shared-memory size aside): after the loop
    the stages hold the CTA's fp32 partial tile."""
    if stages < 2 or stages > MAX_STAGES:
        return f"must be in 2..{MAX_STAGES}"
    if stages * stage_bytes(bm, bn) < part_bytes(bm, bn):
        return f"must hold the {part_bytes(bm, bn)} B partial tile ({stage_bytes(bm, bn)} B a stage)"
    return None


_LIBS: dict[tuple[int, ...], ctypes.CDLL] = {}
# cluster_gemm_launch's parameters (tests/test_cluster_gemm.py checks them against the C signature): 9 pointers
# (x, w, bias, res, out, stats_out, trace, ln_stats, ln_colsum), 13 ints (M, N, K, 4 strides, per_split, stages,
# trigger_k, n_pref, flags, ln_parts), ln_eps, the stream, the error buffer and its length.
LAUNCH_ARGTYPES = ([ctypes.c_void_p] * 9 + [ctypes.c_int] * 13
                   + [ctypes.c_float, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int])


def library(bf16: int, split: int, epi: int, bm: int = 64, bn: int = 64, hints: int = 0,
            diag: int = 0, even: int = 0) -> ctypes.CDLL:
    """The library of one variant (``diag``: CG_DIAG, _nvcc.diag's bits; ``even``: the tiles divide M and N and the
    output rows are 16-byte aligned, so the epilogue has no bounds checks), built now if this source version has not
    been built for it on this machine (nvcc, a few seconds)."""
    key = (bf16, split, epi, bm, bn, _nvcc.build_key(), hints, diag, even)
    if key in _LIBS:
        return _LIBS[key]
    lib = _nvcc.build(SOURCE, {"CG_BF16": bf16, "CG_SC": split, "CG_EPI": epi, "CG_BM": bm, "CG_BN": bn,
                                  "HOPPER_CACHE_HINTS": hints, "CG_DIAG": diag, "CG_EVEN": even},
                      "cluster_gemm")
    lib.cluster_gemm_launch.argtypes = LAUNCH_ARGTYPES
    lib.cluster_gemm_launch.restype = ctypes.c_int
    lib.cluster_gemm_smem_bytes.argtypes = [ctypes.c_int]
    lib.cluster_gemm_smem_bytes.restype = ctypes.c_int
    lib.cluster_gemm_slow_ns.restype = ctypes.c_longlong
    if (lib.cluster_gemm_smem_bytes(4) != smem_bytes(4, bm, bn) or lib.cluster_gemm_trace_slots() != TRACE_SLOTS
            or lib.cluster_gemm_slow_ns() != SLOW_NS
            or lib.cluster_gemm_variant() != (bf16 | (split << 1) | (epi << 8) | (bm // 64 << 16) | (bn // 64 << 20)
                                              | (diag << 24) | (even << 28))):
        raise RuntimeError(f"cluster_gemm: {lib._name} does not match cluster_gemm.py "
                           "(shared-memory layout, variant, trace slots or hold)")
    _LIBS[key] = lib
    return lib


def usable(device) -> bool:
    """Whether the package's CUDA kernels (this one, layer_kernel.cu) run on ``device`` (Hopper, not under the
    interpreter, with nvcc to build them). Elsewhere the Triton kernels run the same configuration."""
    from tuner.device import DeviceInfo

    from ._common import interpreting

    d = torch.device(device)
    if d.type != "cuda" or interpreting():
        return False
    info = DeviceInfo.from_torch(d)  # (cached: read once a device)
    return info.capability == (9, 0) and info.nvcc


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def launch(x, weight, out, *, bias=None, residual=None, stats_out=None, trace=None, split=4, per_split=0, stages=4,
           trigger_k=-1, n_pref=0, act=0, racy=False, bm=64, bn=64, ln_stats=None, ln_colsum=None,
           ln_eps=1e-5, xchg16=False, hints=0, held=False) -> None:
    """One launch on the current stream. ``per_split``, ``trigger_k`` and ``n_pref`` count 64-wide K tiles; the
    output tile is ``bm`` x ``bn``. With ``ln_stats`` ([parts, M, 2] fp32, the row sums of x from its producer) and
    ``ln_colsum``, the weights are LayerNorm-folded (gemm.fold_layernorm) and the epilogue applies the norm.
    ``xchg16``: the split-K partials are exchanged in x's 16-bit type, not fp32 (half the bytes). ``hints``: L2
    eviction hints on the TMA loads (hopper.cuh's HOPPER_CACHE_HINTS): bit 0 the weights evict-first, bit 1 the
    activations evict-last (GemmConfig.hints 1 is 3). ``held`` (test-only, tune verify): the build whose CTAs of odd
    column tiles hold their stores back :data:`SLOW_NS` after the exchange."""
    M, K = x.shape
    N = weight.shape[0]
    if (ln_stats is None) != (ln_colsum is None):
        raise ValueError("cluster_gemm: ln_stats and ln_colsum go together")
    why = split_error(split, bn)
    if why:  # (before nvcc, whose static_assert would say it less clearly)
        raise ValueError(f"cluster_gemm: {why}")
    epi = ((HAS_BIAS if bias is not None else 0) | (BIAS_F32 if bias is not None and bias.dtype == torch.float32
                                                    else 0)
           | (HAS_RES if residual is not None else 0) | (STATS_OUT if stats_out is not None else 0)
           | (LN_IN if ln_stats is not None else 0) | (XCHG16 if xchg16 else 0) | (act << 6))
    flags = USE_PDL if trigger_k >= 0 else 0
    if not SPREAD:
        flags |= NO_SPREAD
    if EARLY_TILES is not None:
        flags |= (min(EARLY_TILES, 14) + 1) << EARLY_SHIFT
    if ALL_SLABS_PUSHED:
        flags |= ALL_SLABS
    err = ctypes.create_string_buffer(512)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    even = int(M % bm == 0 and N % bn == 0 and out.stride(0) % 8 == 0 and out.data_ptr() % 16 == 0
               and EVEN_BUILDS)
    lib = library(int(x.dtype == torch.bfloat16), split, epi, bm, bn, hints, _nvcc.diag(trace, racy, held=held), even)
    if compiling():  # (compile_only: the build is this launch's whole work)
        return
    if launch_enter_hook is not None:
        launch_enter_hook("cluster_gemm_kernel", trigger_k >= 0)
    rc = lib.cluster_gemm_launch(
        _ptr(x), _ptr(weight), _ptr(bias), _ptr(residual), _ptr(out), _ptr(stats_out), _ptr(trace), _ptr(ln_stats),
        _ptr(ln_colsum), M, N, K, x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0), per_split, stages, trigger_k, n_pref, flags, ln_stats.shape[0] if ln_stats is not None else 0,
        ln_eps, stream, err, len(err))
    if rc != 0:
        raise RuntimeError(err.value.decode(errors="replace"))
