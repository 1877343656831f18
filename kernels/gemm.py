"""GEMM with fused epilogue, PDL and L2 weight prefetch: ``act(x @ weight.T + bias) + residual``.

``weight`` is in ``nn.Linear`` layout ``[N, K]``. The knobs follow CUTLASS example 63 (DESIGN.md):

* ``overlap_ratio < 0``: launched without PDL, no early trigger. In ``[0, 1]``: launched with PDL; the
  kernel calls ``gdc_wait`` before its first read of ``x``/``residual`` and before any global write, and
  ``gdc_launch_dependents`` after ``floor((k_tiles - 1) * overlap_ratio)`` of its K tiles, counted from
  ``gdc_wait`` (0: right after it, as CUTLASS example 63's DMA warp does; never before it, so that a chain
  of GEMMs launches at most one kernel ahead; the norm, attention and split-K reduction kernels, which
  have no weights of note and run short, trigger before their wait at 0).
* ``prefetch_ratio`` in ``[0, 1]``: before ``gdc_wait`` each program pulls ``ceil(prefetch_ratio * k_tiles)``
  of its own weight K tiles into L2. Weights only: nothing a predecessor writes is touched before the wait.

``split_k > 1`` writes fp32 partials to a workspace and a second kernel (in the PDL chain too, with the
same ratio) sums them and applies the epilogue.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tuner.device import DeviceInfo
from tuner.shapes import OFFSET_LIMIT

from . import cluster_gemm
from ._common import (GRID_YZ_LIMIT, KnobConfig, effective_config, empty_split, fit_split_k, hopper_error, interpreting,
                      launch, launch_field_error, launch_mode, pdl_trigger, pdl_wait, pipeline_buffers, pow2,
                      pre_hopper, prefetch_count, prefetch_l2, ratio_error, smem_limit, spin_ns, stamp, tile_cap,
                      trigger_index)

# (OFFSET_LIMIT: the kernels index with 32-bit offsets; tuner.shapes refuses layers whose tensors reach it, and check
# and fit keep the split-K workspace below it.)

ACTIVATIONS = (None, "gelu", "silu")
_ACT_CODE = {None: 0, "gelu": 1, "silu": 2}
# GELU through the hardware tanh (tanh.approx.f32) where inline asm runs (not in the interpreter): 6
# instructions an element instead of 17 for exp and a division (sm_90 SASS of the FFN1 epilogue: 1038 ->
# ~690 with the norm folded in; 4 warps issue it at about 1.6 ns an instruction, docs/perf-notes.md).
_FAST_GELU = True
# The LayerNorm row sums read from the producer summed in the K loop's first iteration (under its MMAs)
# instead of the epilogue.
_EARLY_STATS = True
# The installed Triton's (major, minor): stats_scratch's layout of the row sums (tests/test_gemm.py checks the count on
# 3.6 and 3.9).
TRITON_VERSION = tuple(int(v) for v in re.findall(r"\d+", triton.__version__)[:2])
# TMA descriptors prefetched at kernel entry, before gdc_wait (inline asm: GPU only). Not in one-stage builds: with
# one stage and split-K, the prefetch made every launch fail with an illegal instruction on the H200 (triton 3.6;
# every tile size tried, 64x64x64 to 64x256x256; one stage without split-K, or two stages, ran correctly), the
# crashed trials of sessions 6-7 (scripts/crash_probe.py, docs/perf-notes.md section 16).
_DESC_PREFETCH = True
# The split-K reduction's tile: 16x64 gives 96 programs for a 128x768 output (H200, bert-base: 22.41 us/layer
# against 22.77 with 32x64, 22.57 with 16x128, 22.97 with 64x64; docs/perf-data/attn-red-variants-session4.log).
_RED_BLOCK_M, _RED_BLOCK_N = 16, 64


class NotSlowable(ValueError):
    """A test-only slowed launch (``_slow_ns``) asked of a kernel that has no such variant."""


class NoReduction(ValueError):
    """A test-only racy split-K reduction (``_racy_reduce``) asked of a launch that runs no reduction kernel."""


@dataclass(frozen=True)
class GemmConfig(KnobConfig):
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    # 1: the K loop loads A and B tiles with the tensor memory accelerator (host-built TMA descriptors,
    # zero-filled out of bounds) instead of cp.async from every thread.
    tma: int = 0
    # 1: on Hopper, the CUDA kernel of cluster_gemm.cu: the split_k (2, 4, or 8 on 128-column tiles) programs of a
    # tile form one thread-block cluster and reduce through distributed shared memory, with no reduction kernel. 2: the
    # same with the partials exchanged in the operands' 16-bit type (half the bytes; each partial rounded once).
    # Elsewhere, and for a GEMM whose fused LayerNorm gathers its row sums in the K loop, this module's kernels run it.
    cluster: int = 0
    # FFN2 only (tuner.layer.check_config): 1 launches no FFN2 kernel; FFN1's launch computes the whole feed-forward
    # block, FFN1, its activation and FFN2, as one kernel (mlp_cluster.cu: Hopper, d_model a multiple of 128 up to
    # 512, ffn 256, 512 or 1024: 128 hidden columns a CTA), under FFN1's overlap ratio, its weights all in shared
    # memory before the wait. 2: the same with 64 hidden columns a CTA (ffn 128 to 1024, clusters of up to 16).
    # Where it does not fit, the two GEMMs run their own configs. On the out-projection, 1 launches no out-projection
    # kernel either: the same kernel computes it in front of the block (with FFN2's fuse 1 or 2 and norm2's fuse 2,
    # the cluster a multiple of d_model / 64 CTAs).
    fuse: int = 0
    # 1: the CUDA kernels (cluster=1/2, QKV's fuse 1, FFN2's fuse 1/2, whose block takes FFN1's) load the weights
    # with an L2 evict-first policy and the activations with evict-last (CUTLASS example 63's hints); the Triton
    # kernels ignore it. H100, same process: tiny 7.69-7.77 -> 7.49-7.54 us with QKV's and FFN1's on (either alone
    # -0.05 at most), bert-base 18.95-19.11 -> 19.00-19.34 with any on (docs/perf-notes.md section 30).
    hints: int = 0
    overlap_ratio: float = -1.0
    prefetch_ratio: float = -1.0


def l2_hints(c: GemmConfig) -> int:
    """The CUDA launchers' ``hints`` bits for ``c`` (hopper.cuh's HOPPER_CACHE_HINTS): both policies where c.hints
    is 1."""
    return 3 * c.hints


@dataclass(frozen=True)
class GemmProblem:
    m: int
    n: int
    k: int
    dtype_bytes: int = 2
    # The producer's row-sum parts that the launch reads (linear's ln_stats.shape[0]; 0: no ln_stats): they take
    # shared memory in the K loop (stats_scratch).
    ln_parts: int = 0




def smem_bytes(c: GemmConfig, dtype_bytes: int, device: DeviceInfo | None = None, ln_parts: int = 0) -> int:
    """Triton's shared memory for :func:`_gemm_kernel` (Triton 3.6): the K loop's A+B buffers or, with split-K, the fp32
    partial tile where it is larger (the epilogue stages it for the workspace store after the loop, in the same memory).

    The loop keeps ``num_stages`` buffers where Triton makes the dot a Hopper wgmma (``block_m`` >= 64, whole
    warpgroups), one fewer (at least one) where it makes it mma.sync (``block_m`` < 64, 1 or 2 warps, any GPU before
    Hopper), each with an 8-byte mbarrier under TMA. Before Hopper the descriptor loads are emulated, with no mbarrier:
    4-byte operands keep one A tile more, 16-bit ones are not pipelined at all (6-35 KB whatever the depth: counted as
    pipelined, an over-count). The split-K store converts ``min(block_m, 16 * num_warps)`` rows of a wgmma accumulator
    at once.

    Checked against ``triton.compile``'s ``metadata.shared`` for sm_90 and sm_80 (tests/test_gemm.py; by hand over
    4,791 compiles of tiles, depths, warps, splits, epilogues, TMA and dtypes: 3,896 exact). Not counted: the epilogue's
    other layout conversions and mma.sync's split-K one, which exceed the loop only where it holds one buffer or
    block_k <= 32, by at most 16 KB in the search space's tiles (56 KB with 16 warps), in kernels of at most 64 KB: far
    below any limit. Without a device (``fit``) and on the interpreter it counts as on Hopper.

    Plus :func:`stats_scratch` for a launch that reads ``ln_parts`` row-sum parts of its producer (``ln_stats``,
    GemmProblem.ln_parts; 0: none), on Triton 3.6 and 3.9 alike (the buffers are the same on both).
    """
    bufs, wgmma = pipeline_buffers(c.num_stages, c.block_m, c.num_warps, device)
    a = c.block_m * c.block_k * dtype_bytes
    b = c.block_n * c.block_k * dtype_bytes
    if c.tma and pre_hopper(device):
        loop = bufs * (a + b) + a * (dtype_bytes == 4)
    else:
        loop = bufs * (a + b + 8 * c.tma)
    partial = min(c.block_m, 16 * c.num_warps) * c.block_n * 4 if wgmma and c.split_k > 1 else 0
    return max(loop, partial) + stats_scratch(c, ln_parts, dtype_bytes)


def stats_scratch(c: GemmConfig, ln_parts: int, dtype_bytes: int = 2) -> int:
    """The shared memory that a launch reading ``ln_parts`` row-sum parts of its producer (``ln_stats``; 0: none) adds
    to :func:`smem_bytes`'s: the parts, a [LN_PARTS, block_m] fp32 tile (LN_PARTS = next_power_of_2(ln_parts)), are
    summed in the K loop's first iteration (EARLY_STATS), and where warps hold different parts of a row that sum takes
    4 B of scratch a row and such warp, beside a pipelined loop's buffers (split_k 1, num_stages > 1).

    Triton 3.9 lays the tile's rows across the lanes (32 a warp) and the other warps across the parts; 3.6 does so only
    where the CTA has more threads than the tile elements, else the parts across the lanes, and so across warps only
    past 32 parts. Where the tile has the shape and order of a tile that the kernel loads or stores through pointers
    (the output's or A's under 3.9: LN_PARTS = block_m = block_n or block_k; B's under 3.6), a thread takes that tile's
    16-byte vectors of it (at most its share of the elements), and 3.9 needs half the scratch for 8 rows a thread. Other
    Triton versions: the larger of the two layouts'.

    Checked against ``metadata.shared`` for sm_90 and sm_80 (tests/test_gemm.py; by hand over 4,386 compiles under
    each of 3.6 and 3.9, 16-bit, every launch with ln_stats beside the same one without, parts 1-256, tiles 16-256,
    warps 1-16, depths, splits, TMA, epilogues): on sm_90, of the 2,829 launches whose buffers smem_bytes counts
    exactly, the count is exact in 2,796 (3.6) and 2,821 (3.9). Over by 512 B: 16x16 A tiles (block_k 16) at 8-16
    warps, which take none. Under: 3.6 with more than 64 parts and a loop smaller than the fp32 accumulator tile (one
    buffer or block_k 32) converts that tile (2 warps: the 16-bit output's) through shared memory, the kernel's whole
    allocation (29 launches, up to the 128 KB of 128x256: below any limit; not counted, as smem_bytes's other
    conversions). sm_80's emulated TMA loops, not pipelined, take none (over-counted, as their buffers)."""
    if not ln_parts or c.split_k > 1 or c.num_stages == 1:
        return 0
    parts = triton.next_power_of_2(ln_parts)
    if TRITON_VERSION == (3, 9):
        layouts = (True,)
    elif TRITON_VERSION == (3, 6):
        layouts = (32 * c.num_warps > parts * c.block_m,)
    else:
        layouts = (True, False)
    return max(_stats_scratch(c, parts, rows_first, dtype_bytes) for rows_first in layouts)


def _stats_scratch(c: GemmConfig, parts: int, rows_first: bool, dtype_bytes: int) -> int:
    """:func:`stats_scratch` for one layout of the tile (Triton's default blocked layout of its order: the rows first
    across the lanes, or the parts)."""
    rows, warps = c.block_m, c.num_warps
    if rows_first:
        same = parts == rows and (c.block_n == rows or (c.block_k == rows and not c.tma))
    else:
        same = (parts, rows) == (c.block_k, c.block_n) and not c.tma
    vec = min(16 // dtype_bytes if same else 1, max(parts * rows // (32 * warps), 1))  # a thread's rows or parts
    if rows_first:
        lanes = min(32, rows // vec)  # along the rows (32 // lanes along the parts)
        split = min(warps // min(warps, max(1, rows // (32 * vec))), max(1, parts * lanes // 32))
        return 4 * rows * split * min(vec, 4) // vec if split > 1 else 0
    split = min(warps, max(1, parts // (32 * vec)))
    return 4 * rows * split if split > 1 else 0


def field_error(c: GemmConfig) -> str | None:
    """Why a field of ``c`` is invalid whatever the problem and the GPU (the search space refuses such a choice when
    it is read); None when each field alone can run. The first rules of :func:`check`."""
    why = launch_field_error(c, ("block_m", "block_n", "block_k"))
    if why:
        return why
    if c.group_m < 1:
        return f"group_m={c.group_m} must be >= 1"
    if c.split_k < 1:
        return f"split_k={c.split_k} must be >= 1"
    if c.tma not in (0, 1):
        return f"tma={c.tma} must be 0 or 1"
    if c.fuse not in (0, 1, 2):
        return f"fuse={c.fuse} must be 0, 1 or 2"
    if c.hints not in (0, 1):
        return f"hints={c.hints} must be 0 or 1"
    return None


def check(config: GemmConfig, problem: GemmProblem, device: DeviceInfo | None = None) -> str | None:
    """Why ``config`` cannot (or should not) run ``problem`` on ``device``; None when it is valid.

    The one validity rule: the search space, the evaluator and the tests all call this.
    """
    c, p = config, problem
    why = field_error(c)
    if why:
        return why
    # A tile much larger than the problem is the same program as a smaller one doing masked work.
    for name, dim in (("block_m", p.m), ("block_n", p.n), ("block_k", p.k)):
        cap = tile_cap(dim)
        if getattr(c, name) > cap:
            return f"{name}={getattr(c, name)} exceeds the problem ({dim} -> {cap})"
    k_tiles = triton.cdiv(p.k, c.block_k)
    if c.split_k > k_tiles:
        return f"split_k={c.split_k} exceeds the {k_tiles} K tiles of K={p.k} at block_k={c.block_k}"
    if empty_split(k_tiles, c.split_k):
        return f"split_k={c.split_k} leaves a split without K tiles (K tiles={k_tiles})"
    if c.split_k > 1 and c.split_k * p.m * p.n >= OFFSET_LIMIT:
        return (f"split_k={c.split_k}: the partials' workspace, split_k*M*N = {c.split_k * p.m * p.n} elements, is "
                "past the 32-bit offsets the kernels index with")
    acc_regs = c.block_m * c.block_n // (32 * c.num_warps)
    if acc_regs > 256:
        return f"accumulator needs {acc_regs} registers per thread (block_m*block_n/(32*num_warps) > 256)"
    if c.block_m * c.block_n < 16 * 16 * c.num_warps // 2:
        return f"tile {c.block_m}x{c.block_n} is too small for num_warps={c.num_warps}"
    if c.tma and (p.k * p.dtype_bytes) % 16:
        return f"tma=1 needs rows of 16-byte multiples (K={p.k} x {p.dtype_bytes} B)"
    limit = smem_limit(device)
    need = smem_bytes(c, p.dtype_bytes, device, p.ln_parts)
    if need > limit:
        return f"shared memory {need} B > {limit} B (smem_bytes: the K loop's A+B buffers, the split-K partial tile)"
    why = _cluster_error(c, p, device)
    if why:
        return why
    return ratio_error("overlap_ratio", c.overlap_ratio) or ratio_error("prefetch_ratio", c.prefetch_ratio)


def triton_knobs(c: GemmConfig, k: int) -> tuple[int, int, int]:
    """What the Triton kernels' launch over ``k`` reads of ``c``'s two ratios: the GEMM's trigger (-1: no PDL) and
    prefetch count, in K tiles of its split, and the split-K reduction kernel's trigger (-1 without one). The one
    place these are computed: :func:`linear` launches with them, and the study's launch key (tuner.layer) reads
    them, so two ratios that launch the same are measured once."""
    per_split = _tiles_a_split(c, k)
    return (trigger_index(per_split, c.overlap_ratio), prefetch_count(per_split, c.prefetch_ratio),
            trigger_index(c.split_k, c.overlap_ratio) if c.split_k > 1 else -1)


def cluster_knobs(c: GemmConfig, k: int) -> tuple[int, int, int]:
    """:func:`triton_knobs` for the cluster kernel: its K tiles a split (64 wide), trigger and prefetch count."""
    per64 = _tiles_a_split(c, k) * c.block_k // cluster_gemm.BLOCK
    return per64, trigger_index(per64, c.overlap_ratio), prefetch_count(per64, c.prefetch_ratio)


def _tiles_a_split(c: GemmConfig, k: int) -> int:
    """The ``block_k``-wide K tiles of one split-K program (the last one may hold fewer)."""
    return triton.cdiv(triton.cdiv(k, c.block_k), c.split_k)


def cluster_stages(c: GemmConfig) -> int:
    """The CUDA kernel's pipeline depth in 64-wide K tiles: the bytes in flight of the Triton config."""
    return c.num_stages * c.block_k // cluster_gemm.BLOCK


def cluster_tile(c: GemmConfig, p: GemmProblem) -> tuple[int, int]:
    """The CUDA kernel's output tile for ``c``: a block_m below 64 that covers every row (M <= block_m, e.g. 32
    tokens) runs as 64 rows, those past M zero-filled by TMA and masked."""
    bm = 64 if (c.block_m < 64 and p.m <= c.block_m) else c.block_m
    return bm, c.block_n


def _cluster_error(c: GemmConfig, p: GemmProblem, device: DeviceInfo | None) -> str | None:
    if c.cluster == 0:
        return None
    if c.cluster not in (1, 2):
        return (f"cluster={c.cluster} must be 0 (Triton kernels), 1 (split-K reduced in a cluster) or 2 (the same, "
                f"partials exchanged in 16 bits)")
    name = f"cluster={c.cluster}"  # (the rules below hold for both exchanges)
    if c.split_k not in cluster_gemm.SPLITS:
        return f"{name} needs split_k in {cluster_gemm.SPLITS}, not {c.split_k}"
    # The kernel's tiles are 64 or 128 rows (one consumer warpgroup, 4 warps, per 64) by 64 or 128 columns.
    bm, bn = cluster_tile(c, p)
    if (bm not in cluster_gemm.TILES or bn not in cluster_gemm.TILES or c.num_warps != 4 * bm // 64
            or c.block_k < 64 or not c.tma):
        return (f"{name} needs 64- or 128-row and -column tiles (or block_m >= M below 64), 4 warps a 64 rows, "
                "block_k >= 64 and tma=1")
    why = cluster_gemm.split_error(c.split_k, bn)
    if why:
        return f"{name} {why}"
    if triton.cdiv(p.m, bm) > GRID_YZ_LIMIT:  # (its grid: column tiles, row tiles, splits)
        return f"{name} needs at most {GRID_YZ_LIMIT} row tiles (a grid axis), not {triton.cdiv(p.m, bm)}"
    if p.dtype_bytes != 2:
        return f"{name} needs 16-bit operands"
    st = cluster_stages(c)
    why = cluster_gemm.stages_error(st, bm, bn)
    if why is None and cluster_gemm.smem_bytes(st, bm, bn) > smem_limit(device):
        why = f"need {cluster_gemm.smem_bytes(st, bm, bn)} B of shared memory"
    if why:
        return f"{name}: {st} stages of 64-wide K tiles (num_stages*block_k/64) {why}"
    why = hopper_error(device)
    return why and f"{name} {why}"


def repair(config: GemmConfig, problem: GemmProblem, device: DeviceInfo | None = None) -> GemmConfig:
    """The nearest config that passes :func:`check` on resources: more warps (up to 8) until the accumulator fits
    the registers, then fewer stages until the shared memory fits (then smaller K or N tiles, where one stage does
    not), the Triton kernels (cluster 0) where
    the CUDA kernel cannot run the tiles or the GPU. The search calls this so that
    a sampled combination of tiles is measured rather than thrown away (on the H200 more than half of
    the default space's samples were over one of these two limits)."""
    c = fit(config, problem)
    while c.num_warps < 8 and c.block_m * c.block_n // (32 * c.num_warps) > 256:
        c = replace(c, num_warps=c.num_warps * 2)
    while c.num_warps > 1 and c.block_m * c.block_n < 16 * 16 * c.num_warps // 2:
        c = replace(c, num_warps=c.num_warps // 2)
    limit = smem_limit(device)  # (after the warps: they decide between wgmma and mma.sync, and so the buffers)
    while c.num_stages > 1 and smem_bytes(c, problem.dtype_bytes, device, problem.ln_parts) > limit:
        c = replace(c, num_stages=c.num_stages - 1)
    # one stage still over (fp32's 4-byte tiles): halve the larger of block_k and block_n, down to 16
    while smem_bytes(c, problem.dtype_bytes, device, problem.ln_parts) > limit and max(c.block_k, c.block_n) > 16:
        c = fit(replace(c, **({"block_k": c.block_k // 2} if c.block_k >= c.block_n else {"block_n": c.block_n // 2})),
                problem)
    if c.cluster and _cluster_error(c, problem, device):  # the tiles or the GPU do not fit the CUDA kernel
        c = replace(c, cluster=0)
    return c


def fit(config: GemmConfig, problem: GemmProblem) -> GemmConfig:
    """Shrink tiles that exceed the problem, reduce split_k until every split has K tiles (and the partials'
    workspace is within 32-bit offsets), and load with cp.async where rows are not 16-byte multiples (no TMA
    descriptor can describe them)."""
    caps = {n: tile_cap(d) for n, d in (("block_m", problem.m), ("block_n", problem.n), ("block_k", problem.k))}
    c = replace(config, **{n: min(getattr(config, n), cap) for n, cap in caps.items()})
    tma = c.tma if (problem.k * problem.dtype_bytes) % 16 == 0 else 0
    k_tiles = triton.cdiv(problem.k, c.block_k)
    split = fit_split_k(c.split_k, k_tiles)
    while split > 1 and split * problem.m * problem.n >= OFFSET_LIMIT:  # (a workspace past 32-bit offsets)
        split = fit_split_k(split // 2, k_tiles)
    return replace(c, split_k=split, tma=tma)


@triton.jit
def _ln_rows(s1, s2, K, eps):
    """Per row, from the sums of x and x^2 over K: rstd and mean * rstd."""
    mean = s1 / K
    rstd = 1.0 / tl.sqrt(tl.maximum(s2 / K - mean * mean, 0.0) + eps)
    return rstd, mean * rstd


@triton.jit
def _ln_apply_rows(acc, rstd, mr, u):
    return rstd[:, None] * acc - mr[:, None] * u[None, :]


@triton.jit
def _ln_apply(acc, s1, s2, u, K, eps):
    """LN(x) @ W'^T from x @ W'^T, W' = W*gamma folded: rstd * (acc - mean * colsum(W')) (fold_layernorm);
    s1, s2: the rows' sums of x and x^2 over K; u: colsum(W') of the tile's columns."""
    rstd, mr = _ln_rows(s1, s2, K, eps)
    return _ln_apply_rows(acc, rstd, mr, u)


@triton.jit
def _ln_correct(acc, s1, s2, u_ptr, offs_n, N, K, eps):
    return _ln_apply(acc, s1, s2, tl.load(u_ptr + offs_n, mask=offs_n < N, other=0.0), K, eps)


def act_code(activation: str | None, x: torch.Tensor) -> int:
    """The kernels' ACT constexpr for ``activation`` on ``x``'s device (3: GELU with the hardware tanh)."""
    code = _ACT_CODE[activation]
    return 3 if code == 1 and _FAST_GELU and x.is_cuda and not interpreting() else code


@triton.jit
def _activate(acc, ACT: tl.constexpr):
    if ACT == 1:  # gelu, tanh approximation: 0.5*(1+tanh(z)) == sigmoid(2z)
        z = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = acc * tl.sigmoid(2.0 * z)
    elif ACT == 2:  # silu
        acc = acc * tl.sigmoid(acc)
    elif ACT == 3:  # gelu as ACT 1 with the SFU's tanh (inline asm, GPU only; relative error <= 2^-11, PTX ISA)
        z = acc * (0.7978845608028654 + 0.035677408136300125 * acc * acc)
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [z], dtype=tl.float32, is_pure=True,
                                      pack=1)
        h = 0.5 * acc
        acc = h + h * t
    return acc


@triton.jit
def _epilogue_inputs(offs_m, offs_n, M, N, bias_ptr, res_ptr, stride_rm, stride_rn, HAS_BIAS: tl.constexpr,
                     HAS_RES: tl.constexpr):
    """The epilogue's bias [BLOCK_N] and residual tile as loaded (zeros where absent): loaded apart from
    the epilogue, so that a kernel can issue them before its K loop. Nothing here uses the values (no
    conversion): a use would make the warps wait for them before the loop."""
    mask_n = offs_n < N
    bias = tl.zeros((offs_n.shape[0],), dtype=bias_ptr.dtype.element_ty)
    r = tl.zeros((offs_m.shape[0], offs_n.shape[0]), dtype=res_ptr.dtype.element_ty)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn,
                    mask=(offs_m[:, None] < M) & mask_n[None, :], other=0.0)
    return bias, r


@triton.jit
def _epilogue_with(acc, bias, r, offs_m, offs_n, M, N, out_ptr, stride_om, stride_on, HAS_BIAS: tl.constexpr,
                   HAS_RES: tl.constexpr, ACT: tl.constexpr):
    """``act(acc + bias) + r`` stored; returns the tile in fp32 before its rounding to the output type, for
    row sums: its columns past N are 0 (their acc, bias and residual are zero-filled, act(0) = 0), its rows
    past M are not (callers mask them). Not re-reading the rounded tile through a select saves 64
    instructions a thread in a 64x64 epilogue (sm_90 build)."""
    if HAS_BIAS:
        acc += bias.to(tl.float32)[None, :]
    acc = _activate(acc, ACT)
    if HAS_RES:
        acc += r.to(tl.float32)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
             mask=mask)
    return acc


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N, bias_ptr, res_ptr, out_ptr, stride_rm, stride_rn, stride_om,
              stride_on, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr):
    bias, r = _epilogue_inputs(offs_m, offs_n, M, N, bias_ptr, res_ptr, stride_rm, stride_rn, HAS_BIAS, HAS_RES)
    return _epilogue_with(acc, bias, r, offs_m, offs_n, M, N, out_ptr, stride_om, stride_on, HAS_BIAS, HAS_RES, ACT)


@triton.jit
def _row_stats_out(y, offs_m, M, stats_ptr, part):
    """This tile's share of its rows' sums of y and y^2 (a LayerNorm's statistics, for the next GEMM),
    as part ``part`` of ``stats [parts, M, 2]``."""
    st = stats_ptr + (part * M + offs_m) * 2
    tl.store(st, tl.sum(y, axis=1), mask=offs_m < M)
    tl.store(st + 1, tl.sum(y * y, axis=1), mask=offs_m < M)


@triton.jit
def _row_stats_parts(stats_ptr, offs_m, M, parts, PARTS: tl.constexpr):
    """Every part's row sums of x and x^2 as loaded, two [PARTS, BLOCK_M] tiles (PARTS: a power of two
    >= parts; 0 past ``parts``): one load each, not a loop of dependent loads (measured on the H200: a
    loop over 12 parts after the K loop held the QKV and FFN1 epilogues ~1 us). Sum them with
    :func:`_row_stats_sum` where they are needed, so that the load can be issued early."""
    p = tl.arange(0, PARTS)
    ptr = stats_ptr + (p[:, None] * M + offs_m[None, :]) * 2
    mask = (p[:, None] < parts) & (offs_m[None, :] < M)
    return tl.load(ptr, mask=mask, other=0.0), tl.load(ptr + 1, mask=mask, other=0.0)


@triton.jit
def _row_stats_sum(p1, p2):
    return tl.sum(p1, axis=0), tl.sum(p2, axis=0)


@triton.jit
def _row_stats_in(stats_ptr, offs_m, M, parts, PARTS: tl.constexpr):
    """The rows' sums of x and x^2, summed over the ``parts`` tiles of the GEMM that produced x."""
    p1, p2 = _row_stats_parts(stats_ptr, offs_m, M, parts, PARTS)
    return _row_stats_sum(p1, p2)


@triton.jit
def _prefetch_tma_descriptors(x):
    """Thread 0 pulls both TMA descriptors (kernel parameters: x_desc is parameter 11 of the PTX entry after
    the 11 pointers, w_desc parameter 16 after x_desc's shape and strides; checked by a GPU test) into the
    descriptor cache, as CUTLASS does at kernel entry: the first TMA load then does not wait for them."""
    return tl.inline_asm_elementwise(
        "{\n\t.reg .pred %tp;\n\t.reg .u32 %tt;\n\tmov.u32 %tt, %tid.x;\n\tsetp.eq.u32 %tp, %tt, 0;\n\t"
        "@%tp prefetch.param.tensormap [_gemm_kernel_param_11];\n\t"
        "@%tp prefetch.param.tensormap [_gemm_kernel_param_16];\n\tmov.u32 $0, 0;\n\t}",
        "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gemm_kernel(
    # pointers
    x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, ws_ptr, ln_u_ptr, stats_ptr, ln_stats_ptr, stats_out_ptr, trace_ptr,
    # TMA descriptors of x [M, K] and w [N, K] (USE_TMA; else the same pointers again, unused)
    x_desc, w_desc,
    # sizes
    M, N, K,
    # strides
    stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_rn, stride_om, stride_on,
    # PDL / prefetch points, in K tiles of this program
    trigger_k, n_prefetch,
    # LayerNorm prologue: eps, and the number of parts of ln_stats (LN_STATS_IN)
    ln_eps, ln_parts,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, UPCAST: tl.constexpr, LINES: tl.constexpr,
    LINE_ELEMS: tl.constexpr,
    RACY_READ_BEFORE_WAIT: tl.constexpr, HAS_LN: tl.constexpr, LN_RELOAD: tl.constexpr,
    OOB_WRITE: tl.constexpr, LN_STATS_IN: tl.constexpr, STATS_OUT: tl.constexpr, USE_TMA: tl.constexpr,
    LN_PARTS: tl.constexpr = 1, TRACE: tl.constexpr = False, EARLY_STATS: tl.constexpr = False,
    DESC_PREFETCH: tl.constexpr = False, SLOW_NS: tl.constexpr = 0,
):
    stamp(trace_ptr, 0, TRACE)
    if USE_TMA and DESC_PREFETCH:
        _prefetch_tma_descriptors(M)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Grouped ordering: GROUP_M row-tiles share their weight column-tiles in L2.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % group) % group_size)
    pid_n = (pid % group) // group_size

    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_first = pid_k * per_split
    n_iters = tl.minimum(per_split, k_tiles - k_first)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    if PREFETCH:
        # Weights do not depend on the predecessor: pull this program's first K tiles into L2 while it
        # is still running. One pointer per 128-byte line, clamped inside the weight.
        n_idx = tl.minimum(offs_n, N - 1)
        lines = tl.arange(0, LINES) * LINE_ELEMS
        for i in range(0, tl.minimum(n_prefetch, n_iters)):
            k_idx = tl.minimum((k_first + i) * BLOCK_K + lines, K - 1)
            prefetch_l2(w_ptr + n_idx[:, None] * stride_wn + k_idx[None, :] * stride_wk)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if RACY_READ_BEFORE_WAIT:
        # Test-only defect: reads x before gdc_wait. The correctness gate must catch it.
        a0 = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k_first * BLOCK_K + offs_k)[None, :] * stride_xk,
                     mask=(offs_m[:, None] < M) & ((k_first * BLOCK_K + offs_k)[None, :] < K), other=0.0)
    pdl_wait(USE_PDL)
    stamp(trace_ptr, 1, TRACE)
    pdl_trigger(0, trigger_k, USE_PDL)
    if SPLIT_K == 1:
        # The epilogue's bias, residual and LayerNorm column sums, requested now: their latency hides
        # behind the K loop instead of following it (the residual is a predecessor's: after the wait).
        bias, r = _epilogue_inputs(offs_m, offs_n, M, N, bias_ptr, res_ptr, stride_rm, stride_rn, HAS_BIAS,
                                   HAS_RES)
        if HAS_LN:
            u = tl.load(ln_u_ptr + offs_n, mask=offs_n < N, other=0.0)
    if HAS_LN:
        # Row sums of the raw x for the fused LayerNorm: from the producer of x (LN_STATS_IN: loaded here,
        # right after the wait, so that their latency hides behind the K loop), else gathered from the A
        # tiles the loop loads anyway.
        if LN_STATS_IN:
            if SPLIT_K == 1:  # (split: the reduction kernel applies the norm)
                p1, p2 = _row_stats_parts(ln_stats_ptr, offs_m, M, ln_parts, LN_PARTS)
                if EARLY_STATS:
                    ln_rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
                    ln_mr = tl.zeros((BLOCK_M,), dtype=tl.float32)
        else:
            s1 = tl.zeros((BLOCK_M,), dtype=tl.float32)
            s2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for i in range(0, n_iters):
        k = (k_first + i) * BLOCK_K + offs_k
        if USE_TMA:
            a = x_desc.load([pid_m * BLOCK_M, (k_first + i) * BLOCK_K])
        else:
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                        mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)
        if RACY_READ_BEFORE_WAIT:
            if i == 0:
                a = a0
        if USE_TMA:
            b = w_desc.load([pid_n * BLOCK_N, (k_first + i) * BLOCK_K]).T
        else:
            b = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None] * stride_wk,
                        mask=(offs_n[None, :] < N) & (k[:, None] < K), other=0.0)
        if HAS_LN and not LN_STATS_IN:
            # The row sums come from a second (volatile) load of the tile, not from the MMA operand: with
            # triton 3.6 on the H200, reducing the operand itself came out wrong (rel. error 0.04-0.19) at
            # block_k 128 with 4 warps and 2-6 stages, right at block_k 64/256 or 8 warps
            # (scripts/ln_diag.py, docs/perf-notes.md). The second load hits L1/L2. _ln_reload=False
            # keeps the old path for that diagnosis only.
            if LN_RELOAD:
                af = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                             mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0, volatile=True).to(tl.float32)
            else:
                af = a.to(tl.float32)
            s1 += tl.sum(af, axis=1)
            s2 += tl.sum(af * af, axis=1)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        if HAS_LN and LN_STATS_IN and SPLIT_K == 1 and EARLY_STATS:
            # Sum the producer's parts while the first tile's MMAs run, not after the loop: with one warp
            # per scheduler the epilogue's instructions are what it costs.
            if i == 0:
                s1, s2 = _row_stats_sum(p1, p2)
                ln_rstd, ln_mr = _ln_rows(s1, s2, K, ln_eps)
        pdl_trigger(i + 1, trigger_k, USE_PDL)
    stamp(trace_ptr, 2, TRACE)
    if SLOW_NS > 0:
        # Test-only (tune verify): the odd column tiles hold their stores back. Their trigger has fired and the
        # other programs' SMs come free, so a dependent launched early by PDL that reads before its wait finds
        # half of this output still poisoned, however late its own CTAs get an SM.
        if pid_n % 2 == 1:
            spin_ns(SLOW_NS, pid)

    if OOB_WRITE:
        # Test-only defect: a store 2 TB past the output, an illegal address the worker must survive.
        tl.store(out_ptr + (1 << 40) + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
                 acc.to(out_ptr.dtype.element_ty))
    if SPLIT_K == 1:
        if HAS_LN:
            if LN_STATS_IN and EARLY_STATS:
                acc = _ln_apply_rows(acc, ln_rstd, ln_mr, u)
            else:
                if LN_STATS_IN:
                    s1, s2 = _row_stats_sum(p1, p2)
                acc = _ln_apply(acc, s1, s2, u, K, ln_eps)
        y = _epilogue_with(acc, bias, r, offs_m, offs_n, M, N, out_ptr, stride_om, stride_on, HAS_BIAS, HAS_RES, ACT)
        if STATS_OUT:
            _row_stats_out(y, offs_m, M, stats_out_ptr, pid_n)
    else:
        ws = ws_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
        if HAS_LN and not LN_STATS_IN:
            if pid_n == 0:  # this split's row sums, once per row tile
                st = stats_ptr + (pid_k * M + offs_m) * 2
                tl.store(st, s1, mask=offs_m < M)
                tl.store(st + 1, s2, mask=offs_m < M)
    stamp(trace_ptr, 3, TRACE)


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr, bias_ptr, res_ptr, out_ptr, ln_u_ptr, stats_ptr, ln_stats_ptr, stats_out_ptr,
    M, N, K,
    stride_rm, stride_rn, stride_om, stride_on,
    trigger_s, ln_eps, ln_parts,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr, USE_PDL: tl.constexpr,
    HAS_LN: tl.constexpr, LN_STATS_IN: tl.constexpr, STATS_OUT: tl.constexpr, LN_PARTS: tl.constexpr,
    SPLIT_P2: tl.constexpr, RACY: tl.constexpr = False,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    # Like the norm (no weights, short): at 0 the trigger goes before gdc_wait, so that the next GEMM
    # launches and prefetches its weights while the split GEMM is still running.
    pdl_trigger(0, trigger_s, USE_PDL)
    if not RACY:
        pdl_wait(USE_PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Unrolled: every split's partial tile is requested before the first is added.
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + s * M * N + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0.0)
        pdl_trigger(s + 1, trigger_s, USE_PDL)
    if RACY:  # test-only (tune verify): the partials above were read before the wait
        pdl_wait(USE_PDL)
    if HAS_LN:
        if LN_STATS_IN:
            s1, s2 = _row_stats_in(ln_stats_ptr, offs_m, M, ln_parts, LN_PARTS)
        else:  # the splits' sums over their K ranges
            s1, s2 = _row_stats_in(stats_ptr, offs_m, M, SPLIT_K, SPLIT_P2)
        acc = _ln_correct(acc, s1, s2, ln_u_ptr, offs_n, N, K, ln_eps)
    y = _epilogue(acc, offs_m, offs_n, M, N, bias_ptr, res_ptr, out_ptr, stride_rm, stride_rn, stride_om,
                  stride_on, HAS_BIAS, HAS_RES, ACT)
    if STATS_OUT:
        _row_stats_out(y, offs_m, M, stats_out_ptr, tl.program_id(1))




def stats_parts(config: GemmConfig, n: int) -> int:
    """How many column tiles write row sums with ``stats_out`` (the GEMM's, or with split-K the reduction's and
    the cluster kernel's: 64 columns each)."""
    return triton.cdiv(n, config.block_n if config.split_k == 1 else _RED_BLOCK_N)


def grid(config: GemmConfig, m: int, n: int) -> tuple[int, int]:
    """The GEMM kernel's launch grid for an ``[m, n]`` output: (output tiles, splits)."""
    return triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), config.split_k


def workspace_numel(config: GemmConfig, m: int, n: int) -> int:
    """fp32 elements: split-K partials, then 2 row sums per split and row for a fused LayerNorm."""
    return config.split_k * (m * n + 2 * m) if config.split_k > 1 else 0


def fold_layernorm(weight: torch.Tensor, bias: torch.Tensor | None, ln_weight: torch.Tensor,
                   ln_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold LayerNorm's affine part into the following linear layer:

        LN(x) @ W.T + b = rstd * (x @ W'.T - mean * colsum(W')) + b',  W' = W * gamma,  b' = b + W @ beta

    Returns (W' in W's dtype, b' fp32, colsum(W') fp32, summed from the rounded W' the kernel multiplies).
    """
    w32 = weight.float()
    w_f = (w32 * ln_weight.float()[None, :]).to(weight.dtype)
    b_f = w32 @ ln_bias.float() + (bias.float() if bias is not None else 0.0)
    return w_f, b_f.contiguous(), w_f.float().sum(dim=1).contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           config: GemmConfig = GemmConfig(), activation: str | None = None,
           residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
           workspace: torch.Tensor | None = None, ln_weight: torch.Tensor | None = None,
           ln_bias: torch.Tensor | None = None, ln_eps: float = 1e-5, ln_colsum: torch.Tensor | None = None,
           ln_stats: torch.Tensor | None = None, stats_out: torch.Tensor | None = None,
           _racy_read_before_wait: bool = False, _ln_reload: bool = True,
           _oob_write: bool = False, _unchecked: bool = False, _trace: torch.Tensor | None = None,
           _slow_ns: int = 0, _racy_reduce: bool = False) -> torch.Tensor:
    """``act(LN(x) @ weight.T + bias) + residual`` with fp32 accumulation; x ``[M, K]``, weight ``[N, K]``.

    LayerNorm fused away (the norm kernel is not launched): either pass ``ln_weight``/``ln_bias`` (``[K]``;
    the launcher folds them into the weights with torch ops, for one-off calls), or fold once with
    :func:`fold_layernorm` and pass the folded weight/bias with ``ln_colsum`` (what the layer runtime does:
    nothing but the kernels runs in its CUDA graph). The row statistics are gathered from the A tiles the
    K loop loads anyway, so the fusion adds no pass over ``x``; or, with ``ln_stats`` (``[parts, M, 2]``
    fp32, written by the GEMM that produced ``x`` with ``stats_out``), read once in the epilogue.

    ``stats_out`` (``[stats_parts(config, N), M, 2]`` fp32): each column tile also writes its share of the
    output rows' sums of y and y^2, the statistics of a LayerNorm fused into the next GEMM.

    ``_slow_ns`` (test-only, ``tune verify``; on the GPU): the programs of odd column tiles wait
    this long after their K loop before storing, so that a racy dependent meets unwritten output. In the
    interpreter (no PDL) it is ignored; the cluster kernel holds for ``cluster_gemm.SLOW_NS`` only (a build variant)
    and raises :class:`NotSlowable` for any other value.

    ``_racy_reduce`` (test-only, ``tune verify``): the split-K reduction kernel (split_k > 1 on the Triton kernels)
    reads the partials before ``gdc_wait``; :class:`NoReduction` where this launch has no reduction kernel.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K] and [N, K]")
    if activation not in ACTIVATIONS:
        raise ValueError(f"linear: activation {activation!r} must be one of {ACTIVATIONS}")
    if x.dtype != weight.dtype:
        raise ValueError(f"linear: x is {x.dtype} but weight is {weight.dtype}")
    M, K = x.shape
    N = weight.shape[0]
    ln_parts = ln_stats.shape[0] if ln_stats is not None and ln_stats.dim() == 3 else 0
    why = None if _unchecked else check(config, GemmProblem(M, N, K, x.element_size(), ln_parts),
                                        DeviceInfo.from_torch(x.device) if x.is_cuda else None)
    if why:  # _unchecked (test-only): launch anyway, so that a config beyond the GPU's limits fails for real
        raise ValueError(f"linear: invalid GemmConfig for M={M} N={N} K={K}: {why}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"linear: bias {tuple(bias.shape)} must be ({N},)")
    if residual is not None and residual.shape != (M, N):
        raise ValueError(f"linear: residual {tuple(residual.shape)} must be ({M}, {N})")
    if (ln_weight is None) != (ln_bias is None):
        raise ValueError("linear: ln_weight and ln_bias go together")
    if ln_weight is not None:
        if ln_weight.shape != (K,) or ln_bias.shape != (K,):
            raise ValueError(f"linear: ln_weight/ln_bias must be ({K},)")
        if ln_colsum is not None:
            raise ValueError("linear: pass either ln_weight/ln_bias or a folded weight with ln_colsum")
        weight, bias, ln_colsum = fold_layernorm(weight, bias, ln_weight, ln_bias)
    if ln_colsum is not None and (ln_colsum.shape != (N,) or ln_colsum.dtype != torch.float32):
        raise ValueError(f"linear: ln_colsum must be fp32 ({N},)")
    if ln_stats is not None and (ln_colsum is None or ln_stats.dim() != 3 or ln_stats.shape[1:] != (M, 2)
                                 or ln_stats.dtype != torch.float32):
        raise ValueError(f"linear: ln_stats must be fp32 [parts, {M}, 2] and come with a fused LayerNorm")
    if stats_out is not None and (tuple(stats_out.shape) != (stats_parts(config, N), M, 2)
                                  or stats_out.dtype != torch.float32):
        raise ValueError(f"linear: stats_out must be fp32 ({stats_parts(config, N)}, {M}, 2)")
    if out is None:
        out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    mode = launch_mode(x)
    c = effective_config(config, x)
    use_pdl = c.overlap_ratio >= 0
    trigger, n_pref, reduce_trigger = triton_knobs(c, K)
    # The CUDA kernel (cluster=1): the split-K programs of a tile reduce in their cluster, with no workspace and
    # no reduction kernel. A fused LayerNorm that gathers its row sums in the K loop (no ln_stats), or rows that
    # are not contiguous, run on the Triton kernels.
    on_cluster = bool(c.cluster and cluster_gemm.usable(x.device) and out.stride(1) == 1
                      and (ln_colsum is None or (ln_stats is not None
                                                 and ln_stats.shape[0] <= cluster_gemm.MAX_LN_PARTS))
                      and (residual is None or residual.stride(1) == 1))
    if c.split_k > 1:
        need = workspace_numel(c, M, N)
        if workspace is None:
            if not on_cluster:  # (the cluster kernel reduces in shared memory)
                workspace = torch.empty(need, device=x.device, dtype=torch.float32)
        elif workspace.numel() < need or workspace.dtype != torch.float32:
            raise ValueError(f"linear: workspace needs {need} fp32 elements")
    # The fused LayerNorm's per-split row sums live after the partials in the same workspace.
    stats = workspace[c.split_k * M * N:] if (c.split_k > 1 and ln_colsum is not None and not on_cluster) else None
    dummy = out  # never read when the matching HAS_* / LN_* / STATS_* flag is off
    stats_kw = dict(LN_STATS_IN=ln_parts > 0, STATS_OUT=stats_out is not None,
                    LN_PARTS=triton.next_power_of_2(max(ln_parts, 1)))
    lines = max(1, c.block_k * x.element_size() // 128)
    tiles, splits = grid(c, M, N)
    act = act_code(activation, x)
    slots = cluster_gemm.TRACE_SLOTS  # the Triton kernel's stamp() writes as many a program
    if _trace is not None and (_trace.dtype != torch.int64 or _trace.numel() < tiles * splits * slots
                               or _trace.device != x.device):
        raise ValueError(f"linear: _trace must be int64 [{tiles * splits}, {slots}] on {x.device}")
    if c.tma:
        for name, t in (("x", x), ("weight", weight)):
            if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
                raise ValueError(f"linear: tma=1 needs {name} with contiguous, 16-byte aligned rows "
                                 f"(strides {tuple(t.stride())})")
    if _racy_reduce and (on_cluster or c.split_k == 1):
        raise NoReduction("linear: _racy_reduce is a defect of the split-K reduction kernel, which this launch "
                         "does not run (split_k 1 or the cluster kernel)")
    if on_cluster:  # (its TMA descriptors are built by cluster_gemm.launch)
        if _slow_ns not in (0, cluster_gemm.SLOW_NS):
            raise NotSlowable(f"linear: the cluster kernel's held build holds {cluster_gemm.SLOW_NS} ns, "
                              f"not {_slow_ns}")
        if _oob_write:
            raise ValueError("linear: _oob_write is a defect of the Triton kernel only (cluster=0)")
        per64, trigger_k, n_pref64 = cluster_knobs(c, K)
        bm, bn = cluster_tile(c, GemmProblem(M, N, K))
        cluster_gemm.launch(
            x, weight, out, bias=bias, residual=residual, stats_out=stats_out, trace=_trace, split=c.split_k,
            per_split=per64, stages=cluster_stages(c), trigger_k=trigger_k,
            n_pref=n_pref64, act=act, racy=_racy_read_before_wait, bm=bm, bn=bn,
            ln_stats=ln_stats, ln_colsum=ln_colsum, ln_eps=ln_eps,  # (ln_colsum here comes with ln_stats)
            xchg16=c.cluster == 2, hints=l2_hints(c), held=_slow_ns > 0)
        return out
    if c.tma:
        x_desc = TensorDescriptor(x, [M, K], list(x.stride()), [c.block_m, c.block_k])
        w_desc = TensorDescriptor(weight, [N, K], list(weight.stride()), [c.block_n, c.block_k])
    else:
        x_desc, w_desc = x, weight
    launch(_gemm_kernel, (tiles, splits),
        x, weight, bias if bias is not None else dummy, residual if residual is not None else dummy, out,
        workspace if workspace is not None else dummy,
        ln_colsum if ln_colsum is not None else dummy, stats if stats is not None else dummy,
        ln_stats if ln_stats is not None else dummy, stats_out if stats_out is not None else dummy,
        _trace if _trace is not None else dummy, x_desc, w_desc,
        M, N, K,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        residual.stride(0) if residual is not None else 0, residual.stride(1) if residual is not None else 0,
        out.stride(0), out.stride(1),
        trigger, n_pref,
        ln_eps, ln_parts,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, SPLIT_K=c.split_k,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, ACT=act,
        USE_PDL=use_pdl, PREFETCH=n_pref > 0, UPCAST=mode.upcast_bf16 and x.dtype == torch.bfloat16,
        LINES=lines, LINE_ELEMS=128 // x.element_size(), RACY_READ_BEFORE_WAIT=_racy_read_before_wait,
        HAS_LN=ln_colsum is not None, LN_RELOAD=_ln_reload, OOB_WRITE=_oob_write, **stats_kw,
        USE_TMA=bool(c.tma), TRACE=_trace is not None, EARLY_STATS=_EARLY_STATS,
        DESC_PREFETCH=_DESC_PREFETCH and mode.pdl and c.num_stages > 1, SLOW_NS=_slow_ns if mode.pdl else 0,
        num_warps=c.num_warps,
        num_stages=c.num_stages, launch_pdl=use_pdl,
    )
    if c.split_k > 1:
        rgrid = (triton.cdiv(M, _RED_BLOCK_M), triton.cdiv(N, _RED_BLOCK_N))
        launch(_splitk_reduce_kernel, rgrid,
            workspace, bias if bias is not None else dummy, residual if residual is not None else dummy, out,
            ln_colsum if ln_colsum is not None else dummy, stats if stats is not None else dummy,
            ln_stats if ln_stats is not None else dummy, stats_out if stats_out is not None else dummy,
            M, N, K,
            residual.stride(0) if residual is not None else 0, residual.stride(1) if residual is not None else 0,
            out.stride(0), out.stride(1),
            reduce_trigger, ln_eps, ln_parts,
            SPLIT_K=c.split_k, BLOCK_M=_RED_BLOCK_M, BLOCK_N=_RED_BLOCK_N,
            HAS_BIAS=bias is not None, HAS_RES=residual is not None, ACT=act,
            USE_PDL=use_pdl, HAS_LN=ln_colsum is not None, **stats_kw,
            SPLIT_P2=triton.next_power_of_2(c.split_k), RACY=_racy_reduce, num_warps=4, num_stages=1,
            launch_pdl=use_pdl,
        )
    return out


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               activation: str | None = None, residual: torch.Tensor | None = None,
               ln_weight: torch.Tensor | None = None, ln_bias: torch.Tensor | None = None,
               ln_eps: float = 1e-5) -> torch.Tensor:
    """fp32 torch reference of :func:`linear` (returns fp32)."""
    xf = x.float()
    if ln_weight is not None:
        xf = torch.nn.functional.layer_norm(xf, (x.shape[1],), ln_weight.float(), ln_bias.float(), ln_eps)
    y = xf @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    if activation == "gelu":
        y = torch.nn.functional.gelu(y, approximate="tanh")
    elif activation == "silu":
        y = torch.nn.functional.silu(y)
    if residual is not None:
        y = y + residual.float()
    return y
