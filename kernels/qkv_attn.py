"""The QKV projection and the causal attention in one kernel (``qkv_attn.cu``, ``qkv.fuse: 1``): built with nvcc on
first use, called through ctypes.

One thread-block cluster per (head, sequence) computes the QKV GEMM's 64x64 tiles of that head (Q, K and V of each
64-row tile of the sequence), hands K and V to the Q CTAs through distributed shared memory, and the Q CTAs compute
the causal attention and store it. The layer then has no attention kernel (``tuner.layer``). Hopper only, head_dim
64, sequences of up to 128 tokens; elsewhere the QKV GEMM and the attention kernel run their own configs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from . import _nvcc
from ._common import GRID_YZ_LIMIT, HALF_DTYPES, SMEM_DEFAULT_BYTES, compiling
from .cluster_gemm import MAX_LN_PARTS, MAX_STAGES, _ptr

SOURCE = Path(__file__).with_name("qkv_attn.cu")
TILE_BYTES = 64 * 64 * 2  # one 64-row, 64-wide 16-bit tile
MAX_SEQ = 128  # two 64-row tiles a sequence
BIAS_F32, LN_IN = 2, 8  # qkv_attn.cu's epilogue bits
USE_PDL = 64  # and its run-time flag
# qkv_attn_launch's parameters (tests check them against the C signature): 7 pointers (x, w, bias, out, trace,
# ln_stats, ln_colsum), 11 ints (M, D, seq, 3 strides, stages, trigger_k, n_pref, flags, ln_parts), ln_eps, the
# stream, the error buffer and its length.
LAUNCH_ARGTYPES = ([ctypes.c_void_p] * 7 + [ctypes.c_int] * 11
                   + [ctypes.c_float, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int])
launch_enter_hook = None  # as cluster_gemm.launch_enter_hook (tune verify's launch census)
# K tiles a TMA box (a ring stage's chunk of x and of w): 2 (16 KB boxes) where d_model and the stages allow, else 1.
# (A/B switch qa_chunk=1 of scripts/timeline.py.)
CHUNK = 2
# How a K or V CTA hands its tile to the Q CTAs (the build define QA_PUSH): 0 one bulk copy a Q CTA, 1 st.async of 16
# bytes a thread from its shared-memory tile, 2 st.async of 4 bytes straight from the epilogue's registers (A/B switch
# qa_push=N). H200, same process, builds of one mode each (perf notes 33): bert-base 18.12-18.18 us a layer with 1,
# 18.20-18.26 with 0, 18.36-18.40 with 2; bert-large 24.38-24.45, 24.38-24.42, 24.69-24.79. (Session 17's H100 choice
# of 2 was measured against paths selected by run-time flags, whose branches slowed the others.)
PUSH = 1
# Diagnostics (scripts/qa_cycles.py): a launch with a trace gets its stamps in SM cycles, CYCLE_SLOTS a program, not
# TRACE_SLOTS globaltimer readings (qkv_attn.cu's stamp).
TRACE_CYCLES = False
TRACE_SLOTS, CYCLE_SLOTS = 6, 10


def row_tiles(seq: int) -> int:
    return (seq + 63) // 64


def _trace_geometry(m: int, d: int, seq: int) -> tuple[tuple[int, int], int]:
    """A launch's trace shape ([CTAs, slots], the slots as TRACE_CYCLES says) and the CTAs of a cluster rank (heads x
    sequences): CTA ``prog`` has rank ``prog // that``."""
    per_rank = (d // 64) * (m // seq)
    return (per_rank * 3 * row_tiles(seq), CYCLE_SLOTS if TRACE_CYCLES else TRACE_SLOTS), per_rank


def trace_buffer(x: torch.Tensor, seq: int) -> tuple[torch.Tensor, int]:
    """A zeroed int64 trace for a launch on ``x`` and the CTAs of a cluster rank (the diagnostics scripts')."""
    shape, per_rank = _trace_geometry(*x.shape, seq)
    return torch.zeros(shape, dtype=torch.int64, device=x.device), per_rank


def traced(launch, traces: dict, order: list, ranks: dict):
    """``launch`` (this module's) with one trace buffer per (out, weight) pair, the diagnostics scripts' wrapper: the
    buffers in ``traces``, their keys in first-launch order in ``order``, each launch's CTAs of a cluster rank in
    ``ranks``."""

    def wrapper(x, weight, bias, out, **kw):
        key = (out.data_ptr(), weight.data_ptr())
        if key not in traces:
            traces[key], ranks[key] = trace_buffer(x, kw["seq"])
            order.append(key)
        return launch(x, weight, bias, out, trace=traces[key], **kw)

    return wrapper


def chunk(d_model: int, stages: int) -> int:
    """The K tiles a ring stage loads in one box (CHUNK where it divides both and leaves 2 stages, else 1)."""
    c = CHUNK
    return c if (d_model // 64) % c == 0 and stages % c == 0 and stages // c >= 2 else 1


def smem_bytes(stages: int, seq: int, kc: int = 1) -> int:
    """qkv_attn.cu's qkv_attn_smem_bytes for ``stages`` 64-wide K tiles of x and w in flight (stages / kc ring
    stages): 1 KB of alignment, the stages, the CTA's own tile, the K and V tiles a Q CTA receives, the mbarriers."""
    return 1024 + (2 * stages + 1 + 2 * row_tiles(seq)) * TILE_BYTES + 16 * (stages // kc) + 8


def error(seq: int, head_dim: int, d_model: int, stages: int, ln_parts: int | None = None,
          smem_limit: int = SMEM_DEFAULT_BYTES, batch: int = 1) -> str | None:
    """Why the kernel cannot run this shape and config; None when it can."""
    if batch > GRID_YZ_LIMIT:  # (its grid: heads, batch, 3 x row tiles)
        return f"needs batch <= {GRID_YZ_LIMIT} (a grid axis a sequence), not {batch}"
    if head_dim != 64:
        return f"needs head_dim 64, not {head_dim}"
    if seq > MAX_SEQ:
        return f"needs seq <= {MAX_SEQ} (two 64-row tiles), not {seq}"
    if d_model % 64:
        return f"needs d_model a multiple of 64, not {d_model}"
    if not 2 <= stages <= MAX_STAGES:
        return f"needs 2..{MAX_STAGES} stages of 64-wide K tiles (num_stages * block_k / 64), not {stages}"
    if ln_parts is not None and not 1 <= ln_parts <= MAX_LN_PARTS:
        return f"needs the LayerNorm's row sums in 1..{MAX_LN_PARTS} parts, not {ln_parts}"
    if smem_bytes(stages, seq) > smem_limit:
        return f"needs {smem_bytes(stages, seq)} B of shared memory ({stages} stages)"
    return None


_LIBS: dict[tuple[int, ...], ctypes.CDLL] = {}


def library(bf16: int, epi: int, rt: int, kc: int, hints: int = 0, push: int = PUSH, diag: int = 0) -> ctypes.CDLL:
    """The library of one variant (dtype, epilogue, row tiles a sequence, K tiles a box, L2 hints, K/V hand-over mode,
    diagnostics: QA_DIAG, _nvcc.diag's bits), built on first use (cached)."""
    key = (bf16, epi, rt, kc, _nvcc.build_key(), hints, push, diag)
    if key in _LIBS:
        return _LIBS[key]
    lib = _nvcc.build(SOURCE, {"QA_BF16": bf16, "QA_EPI": epi, "QA_RT": rt, "QA_KC": kc,
                                  "HOPPER_CACHE_HINTS": hints, "QA_PUSH": push, "QA_DIAG": diag}, "qkv_attn")
    lib.qkv_attn_launch.argtypes = LAUNCH_ARGTYPES
    lib.qkv_attn_launch.restype = ctypes.c_int
    lib.qkv_attn_smem_bytes.argtypes = [ctypes.c_int]
    lib.qkv_attn_smem_bytes.restype = ctypes.c_int
    if (lib.qkv_attn_smem_bytes(4) != smem_bytes(4 * kc, 64 * rt, kc)
            or lib.qkv_attn_variant() != bf16 | (epi << 8) | (rt << 16) | (kc << 20) | (push << 24) | (diag << 27)
            or lib.qkv_attn_trace_slots() != (CYCLE_SLOTS if diag & _nvcc.DIAG_CYCLES else TRACE_SLOTS)):
        raise RuntimeError(f"qkv_attn: {lib._name} does not match qkv_attn.py (shared-memory layout, variant or trace "
                           "slots)")
    _LIBS[key] = lib
    return lib


def launch(x, weight, bias, out, *, seq, stages=4, trigger_k=-1, n_pref=0, ln_stats=None, ln_colsum=None,
           ln_eps=1e-5, racy=False, trace=None, push=None, hints=0) -> None:
    """``out = causal_attention(LN(x) @ weight.T + bias)`` per head of 64 and sequence of ``seq`` rows, on the current
    stream. x ``[M, D]``, weight ``[3 D, D]`` (Q, K, V rows), out ``[M, D]``. With ``ln_stats`` ([parts, M, 2] fp32,
    the row sums of x from its producer) and ``ln_colsum``, the weights are LayerNorm-folded (gemm.fold_layernorm).
    ``stages``: 64-wide K tiles of x and w in flight; ``trigger_k``: launch_dependents after that many K tiles (0: at
    the wait; -1: no PDL); ``n_pref``: weight K tiles requested before the wait; ``push``: how K and V reach the Q
    CTAs (PUSH when None); ``hints``: L2 eviction hints on the TMA loads (hopper.cuh's HOPPER_CACHE_HINTS): bit 0 the
    weights evict-first, bit 1 the activations evict-last (GemmConfig.hints 1 is 3)."""
    M, D = x.shape
    if (ln_stats is None) != (ln_colsum is None):
        raise ValueError("qkv_attn: ln_stats and ln_colsum go together")
    if x.dtype not in HALF_DTYPES or weight.dtype != x.dtype or out.dtype != x.dtype:
        raise ValueError(f"qkv_attn: x, weight and out are {x.dtype}, {weight.dtype}, {out.dtype}: the kernel takes "
                         "16-bit operands, one dtype")
    why = error(seq, 64, D, stages, ln_stats.shape[0] if ln_stats is not None else None, batch=M // seq)
    if why is None and (M % seq or weight.shape != (3 * D, D) or out.shape != (M, D)):
        why = f"shapes: x {tuple(x.shape)}, weight {tuple(weight.shape)}, out {tuple(out.shape)}, seq {seq}"
    if why is None and trace is not None and tuple(trace.shape) != (want := _trace_geometry(M, D, seq)[0]):
        why = f"trace {tuple(trace.shape)}, not {want} (the kernel writes every slot)"
    if why:
        raise ValueError(f"qkv_attn: {why}")
    epi = (BIAS_F32 if bias.dtype == torch.float32 else 0) | (LN_IN if ln_stats is not None else 0)
    flags = USE_PDL if trigger_k >= 0 else 0
    err = ctypes.create_string_buffer(512)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    kc = chunk(D, stages)
    lib = library(int(x.dtype == torch.bfloat16), epi, row_tiles(seq), kc, hints, PUSH if push is None else push,
                  _nvcc.diag(trace, racy, TRACE_CYCLES))
    if compiling():  # (compile_only: the build is this launch's whole work)
        return
    if launch_enter_hook is not None:
        launch_enter_hook("qkv_attn_kernel", trigger_k >= 0)
    rc = lib.qkv_attn_launch(
        _ptr(x), _ptr(weight), _ptr(bias), _ptr(out), _ptr(trace), _ptr(ln_stats), _ptr(ln_colsum), M, D, seq,
        x.stride(0), weight.stride(0), out.stride(0), stages // kc, trigger_k, n_pref, flags,
        ln_stats.shape[0] if ln_stats is not None else 0, ln_eps, stream, err, len(err))
    if rc != 0:
        raise RuntimeError(err.value.decode(errors="replace"))
