"""The one-kernel decoder layer in CUDA (``layer_kernel.cu``): ``FusedLayerConfig.fuse == 2`` on a Hopper GPU.

One persistent CTA an SM walks a static list of tasks (QKV tiles, attention heads, out-projection splits, FFN1
tiles, FFN2 splits) and waits for a readiness flag per 64 x 64 tile instead of a kernel boundary or a grid barrier;
the weight tiles of a CTA's next task stream into its shared-memory ring while its current task finishes. Every
GEMM tile is 64 x 64 (wgmma), so of ``FusedLayerConfig`` only ``programs``, ``num_stages`` (the ring), the splits of
the out-projection and FFN2 and the two ratios apply:

* ``overlap_ratio`` < 0: no PDL. In [0, 1]: launched with PDL; a CTA calls ``griddepcontrol.launch_dependents``
  when it starts task ``round(ratio * tasks a CTA)`` (0: right after its wait), so that the next layer's CTAs
  can take an SM (and load their first weights) once this layer's footprint leaves room.
* ``prefetch_ratio`` < 0: the first task's weight tiles only (into the ring, before the wait). In [0, 1]: also
  the weight lines of the first ``1 + round(ratio * tasks a CTA)`` tasks into L2 (``prefetch.global.L2`` by the
  consumer threads, before the wait).

Elsewhere (the interpreter, other GPUs) ``fused_layer.decoder_layer`` runs the Triton layer kernel with the same
tiles (:func:`triton_equivalent`).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import replace
from pathlib import Path

import torch

from . import _nvcc
from ._common import HALF_DTYPES, compiling

SOURCE = Path(__file__).with_name("layer_kernel.cu")
TILE = 64
MAX_STAGES = 12  # layer_kernel.cu's MAX_STAGES
GEN_SLOTS = 1024  # layer_kernel.cu's GEN_SLOTS: the most CTAs
FLAG_STRIDE = 32  # layer_kernel.cu's FLAG_STRIDE: ints from one flag to the next (a 128-byte line each)
MAX_TRACE = 8  # layer_kernel.cu's MAX_TRACE: tasks a CTA stamps
TRACE_ROW, TR_FULL, TR_B, TR_A, TR_EPI = 64, 17, 33, 49, 25  # layer_kernel.cu's trace layout (int64 [grid, TRACE_ROW])
PHASES = ("qkv", "attn", "out", "ffn1", "ffn2")
USE_PDL, RACY_SHIFT, NO_LN_SUMS = 1, 4, 256
# Extra launch flags for A/B diagnostics (scripts/layer_probe.py's diag=N); 0 in every real run.
DIAG_FLAGS = 0
# layer_launch's parameters (tests/test_layer_cuda.py checks them against the C signature): 19 pointers (x, y, qkv,
# attn, h, f1, w_qkv, b_qkv, u_qkv, w_out, b_out, w_ffn1, b_ffn1, u_ffn1, w_ffn2, b_ffn2, ws, sync, trace), 12 ints
# (M, seq, D, heads, F, s_out, s_ffn2, stages, grid, trigger, pf_tasks, flags), eps, the TMA descriptors (device), the
# stream, the error buffer and its length.
LAUNCH_ARGTYPES = ([ctypes.c_void_p] * 19 + [ctypes.c_int] * 12
                   + [ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int])
# layer_encode's: the host buffer, 9 pointers (x, qkv, attn, h, f1, w_qkv, w_out, w_ffn1, w_ffn2), M, D, F, kt, the
# error buffer and its length.
ENCODE_ARGTYPES = [ctypes.c_void_p] * 10 + [ctypes.c_int] * 4 + [ctypes.c_char_p, ctypes.c_int]
N_MAPS = 9  # layer_kernel.cu's N_MAPS (128 bytes each)
# Called as launch_enter_hook(kernel name, launched with PDL) before every launch (tune verify's census).
launch_enter_hook = None

_LIBS: dict[tuple[int, int], ctypes.CDLL] = {}


def smem_bytes(stages: int) -> int:
    """Dynamic shared memory (layer_kernel.cu's layer_smem_bytes): alignment, the ring of 64x64 A and B tiles, the
    attention tiles (Q, two K, two V), the epilogue's fp32 staging tile (rows of 68), the row statistics, the
    mbarriers."""
    return (1024 + stages * 2 * TILE * TILE * 2 + 5 * TILE * TILE * 2 + TILE * (TILE + 4) * 4 + TILE * 8 + 16
            + 16 * stages + 24)


def sync_ints(tokens: int, d_model: int, heads: int, ffn: int) -> int:
    """int32 counters a layer needs (layer_kernel.cu's layer_sync_ints)."""
    mt, nd, nf = math.ceil(tokens / TILE), d_model // TILE, ffn // TILE
    return GEN_SLOTS + mt * (3 * nd + heads + nd + nf + 2 * nd) * FLAG_STRIDE


def workspace_numel(tokens: int, d_model: int) -> int:
    """fp32 split-K sums of the out-projection's and FFN2's tiles (kept zero between launches by the kernel)."""
    return 2 * math.ceil(tokens / TILE) * (d_model // TILE) * TILE * TILE


def problem_error(tokens: int, seq: int, d_model: int, heads: int, ffn: int) -> str | None:
    """Why the CUDA layer kernel cannot run this layer shape (None when it can)."""
    if d_model % heads or d_model // heads != 64:
        return f"head dim {d_model // max(heads, 1)} (fuse 2 needs head dim 64)"
    if d_model % TILE or ffn % TILE:
        return f"d_model={d_model} and ffn={ffn} must be multiples of {TILE} (fuse 2)"
    if seq > 128:
        return f"seq={seq} > 128 (fuse 2: one attention tile holds all keys)"
    if tokens != seq and seq % TILE:
        return f"seq={seq} with batch > 1 must be a multiple of {TILE} (fuse 2: a row tile lies in one sequence)"
    return None


def config_error(c, tokens: int, d_model: int, ffn: int) -> str | None:
    """Why ``c`` (FusedLayerConfig, fuse 2) is invalid for the shape, the shape's own limits aside."""
    nd, nf = d_model // TILE, ffn // TILE
    if c.out_split_k < 1 or nd % c.out_split_k:
        return f"out_split_k={c.out_split_k} must divide the out-projection's {nd} K tiles (fuse 2)"
    if c.ffn2_split_k < 1 or nf % c.ffn2_split_k:
        return f"ffn2_split_k={c.ffn2_split_k} must divide FFN2's {nf} K tiles (fuse 2)"
    if not 2 <= c.num_stages <= MAX_STAGES:
        return f"num_stages={c.num_stages} must be in 2..{MAX_STAGES} (fuse 2: the ring of 64x64 A and B tiles)"
    return None


def triton_equivalent(c):
    """The Triton layer kernel's config for a fuse-2 config (the interpreter's and non-Hopper GPUs' path)."""
    return replace(c, fuse=1, num_warps=4, num_stages=min(c.num_stages, 4), block_m=TILE, block_k=TILE,
                   qkv_block_n=TILE, qkv_split_k=1, out_block_n=TILE, ffn1_block_n=TILE, ffn1_split_k=1,
                   ffn2_block_n=TILE, attn_block_m=TILE, attn_block_n=TILE)


# A/B only: the MMAs as m64n128k16 reading past each B tile (wrong results; the time of wider MMAs).
WGMMA_N = 64


def library(bf16: int) -> ctypes.CDLL:
    key = (bf16, WGMMA_N, _nvcc.build_key())
    if key in _LIBS:
        return _LIBS[key]
    lib = _nvcc.build(SOURCE, {"LK_BF16": bf16, "LK_WGMMA_N": WGMMA_N}, "layer_kernel")
    lib.layer_launch.argtypes = LAUNCH_ARGTYPES
    lib.layer_launch.restype = ctypes.c_int
    lib.layer_encode.argtypes = ENCODE_ARGTYPES
    lib.layer_encode.restype = ctypes.c_int
    for fn, n in (("layer_smem_bytes", 1), ("layer_sync_ints", 4), ("chunk_tiles", 4)):
        getattr(lib, fn).argtypes = [ctypes.c_int] * n
        getattr(lib, fn).restype = ctypes.c_int
    if (lib.layer_variant() != bf16 | (0 if WGMMA_N == 64 else 2) or lib.layer_smem_bytes(4) != smem_bytes(4)
            or lib.layer_sync_ints(128, 768, 12, 3072) != sync_ints(128, 768, 12, 3072)):
        raise RuntimeError(f"layer_kernel: {lib._name} does not match layer_cuda.py (layout or variant)")
    _LIBS[key] = lib
    return lib


def tasks_per_cta(tokens: int, d_model: int, heads: int, ffn: int, s_out: int, s_ffn2: int, grid: int) -> int:
    mt, nd, nf = math.ceil(tokens / TILE), d_model // TILE, ffn // TILE
    total = mt * (3 * nd + heads + nd * s_out + nf + nd * s_ffn2)
    return math.ceil(total / min(grid, total))


def _descriptors(lib, x, w, scratch, F: int, kt: int) -> torch.Tensor:
    """The layer's TMA descriptors on the device, encoded once per set of buffers (cached on the scratch)."""
    ptrs = (x.data_ptr(), scratch.qkv.data_ptr(), scratch.attn.data_ptr(), scratch.h.data_ptr(),
            scratch.ffn1.data_ptr(), w.w_qkv.data_ptr(), w.w_out.data_ptr(), w.w_ffn1.data_ptr(), w.w_ffn2.data_ptr())
    key = ptrs + (kt,)
    maps = scratch.maps.get(key)
    if maps is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("layer kernel: these buffers were never launched outside a CUDA graph capture; launch "
                               "the layer once before capturing it (its TMA descriptors are copied to the GPU then)")
        err = ctypes.create_string_buffer(512)
        host = ctypes.create_string_buffer(N_MAPS * 128)
        M, D = x.shape
        if lib.layer_encode(host, *ptrs, M, D, F, kt, err, len(err)) != 0:
            raise RuntimeError(err.value.decode(errors="replace"))
        maps = torch.frombuffer(bytearray(host.raw), dtype=torch.uint8).to(x.device)
        scratch.maps[key] = maps
    return maps


def launch(x, w, scratch, out, *, seq: int, heads: int, config, eps: float, grid: int, trace=None,
           racy: str | None = None) -> None:
    """One launch on the current stream. ``w``: fused_layer.LayerTensors; ``scratch``: fused_layer.LayerScratch
    (its ``ws`` zeroed, its ``sync`` zeroed once); ``racy``: a phase (PHASES) whose tasks load their activations
    without waiting for their flags (test-only defect)."""
    if racy is not None and racy not in PHASES:
        raise ValueError(f"layer kernel: racy={racy!r} is not a phase ({', '.join(PHASES)})")
    if x.dtype not in HALF_DTYPES:  # (its tiles are 16-bit words: fp32 would be read as garbage)
        raise ValueError(f"layer kernel: x is {x.dtype}; the kernel takes 16-bit operands (fp16 or bf16)")
    if getattr(scratch, "grid", grid) != grid:
        # Each CTA counts its launches in its own generation word of scratch.sync: under another grid the CTAs'
        # counts part, and a CTA behind would take the flags of an earlier launch as ready (stale tiles).
        raise ValueError(f"layer kernel: this scratch was launched with a grid of {scratch.grid} CTAs, not {grid}: "
                         "its sync words count each CTA's launches; give each grid its own LayerScratch")
    M, D = x.shape
    F = w.w_ffn1.shape[0]
    c = config
    per_cta = tasks_per_cta(M, D, heads, F, c.out_split_k, c.ffn2_split_k, grid)
    # (ratio 1: task per_cta, which no CTA reaches: the dependents launch as this grid's CTAs exit)
    trigger = -1 if c.overlap_ratio < 0 else int(round(min(c.overlap_ratio, 1.0) * per_cta))
    pf = 0 if c.prefetch_ratio < 0 else int(round(min(c.prefetch_ratio, 1.0) * per_cta))
    flags = (USE_PDL if c.overlap_ratio >= 0 else 0) | ((PHASES.index(racy) + 1) << RACY_SHIFT if racy else 0)
    flags |= DIAG_FLAGS
    p = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
    err = ctypes.create_string_buffer(512)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    lib = library(int(x.dtype == torch.bfloat16))
    if compiling():  # (compile_only: the build is this launch's whole work)
        scratch.grid = grid
        return
    if launch_enter_hook is not None:
        launch_enter_hook("layer_kernel", c.overlap_ratio >= 0)
    maps = _descriptors(lib, x, w, scratch, F, lib.chunk_tiles(D // TILE, D // TILE // c.out_split_k,
                                                               F // TILE // c.ffn2_split_k, c.num_stages))
    rc = lib.layer_launch(
        p(x), p(out), p(scratch.qkv), p(scratch.attn), p(scratch.h), p(scratch.ffn1), p(w.w_qkv), p(w.b_qkv),
        p(w.u_qkv), p(w.w_out), p(w.b_out), p(w.w_ffn1), p(w.b_ffn1), p(w.u_ffn1), p(w.w_ffn2), p(w.b_ffn2),
        p(scratch.ws), p(scratch.sync), p(trace), M, seq, D, heads, F, c.out_split_k, c.ffn2_split_k, c.num_stages,
        grid, trigger, pf, flags, eps, maps.data_ptr(), stream, err, len(err))
    if rc != 0:
        raise RuntimeError(err.value.decode(errors="replace"))
    scratch.grid = grid
