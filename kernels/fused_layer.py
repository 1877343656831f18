"""The whole pre-LN decoder layer in one persistent kernel: one launch per layer instead of seven.

    a = x + out(attn(qkv(LN1(x))));   y = a + ffn2(gelu(ffn1(LN2(a))))

``programs`` persistent programs (at most one per SM, so that all of them are resident at once) walk
five phases, each a loop over the phase's work items ``pid, pid + programs, ...``:

1. QKV GEMM with LayerNorm 1 fused (gamma/beta folded into the weights, row sums gathered in the K loop:
   ``gemm.fold_layernorm``), bias.
2. causal attention on the packed QKV (``attention._attn_rows``).
3. out-projection GEMM, bias, residual ``x``.
4. FFN1 GEMM with LayerNorm 2 fused, bias, GELU.
5. FFN2 GEMM, bias, residual ``a``.

A grid barrier separates the phases (an arrival counter per barrier: release on arrival, acquire on
the spin). Every GEMM phase may split K: each split stores an fp32 partial, and the last split of a tile
to arrive (per-tile counter) sums the partials and applies the epilogue, so split-K needs no extra
launch or barrier. The last program to leave resets every counter for the next launch.

The knobs follow CUTLASS example 63 at layer granularity (DESIGN.md):

* ``prefetch_ratio`` in ``[0, 1]``: before ``gdc_wait`` the programs pull the first ``prefetch_ratio`` of
  each of the four weight matrices into L2 (128-byte lines, evict_last), spread over all programs, so
  the whole layer's weight stream starts at once while the predecessor still runs.
* ``overlap_ratio < 0``: launched without PDL. In ``[0, 1]``: launched with PDL; ``gdc_wait`` before the
  first read of ``x`` and before any global write; ``gdc_launch_dependents`` at the start of phase
  ``1 + floor(4 * overlap_ratio)`` (0: right after the wait; 1: when FFN2 starts).

In the Triton interpreter the programs run one after another, so a barrier could never be passed by
more than one program: the launcher runs a single program there (the same code, every barrier
trivially complete).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tuner.device import DeviceInfo

from . import cluster_gemm, layer_cuda
from ._common import (HALF_DTYPES, KnobConfig, effective_config, empty_split, fit_split_k, globaltimer, interpreting,
                      launch, launch_mode, pdl_trigger, pdl_wait, pipeline_buffers, pow2, prefetch_count, prefetch_l2,
                      ratio_error, smem_limit, tile_cap, trigger_index)
from .attention import HEAD_DIM_MAX, HEAD_DIM_MIN, _attn_rows, block_d
from .gemm import _epilogue, _epilogue_inputs, _epilogue_with, _ln_apply, _ln_correct, act_code

GEMM_PHASES = ("qkv", "out", "ffn1", "ffn2")
# The sync buffer (int32, zeroed once): counters 0-3 for the four barriers, 4 for the exit, then from
# _TILE_COUNTERS on one per split-K tile (the kernel spells these offsets as literals).
_TILE_COUNTERS = 8
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class FusedLayerConfig(KnobConfig):
    # 1: the layer runs as this one kernel and the seven per-kernel configs are not used. 2: the same layer as one
    # CUDA kernel with a readiness flag per tile instead of grid barriers (layer_cuda.py; Hopper; 64x64 tiles, so
    # only programs, num_stages, out_split_k, ffn2_split_k and the ratios apply); elsewhere the Triton kernel runs
    # its tiles.
    fuse: int = 0
    programs: int = 0  # persistent programs; 0: one per SM (capped at the SM count)
    num_warps: int = 4
    num_stages: int = 3  # software pipeline depth of every GEMM K loop
    block_m: int = 64  # rows of every GEMM tile
    block_k: int = 64
    qkv_block_n: int = 64
    qkv_split_k: int = 1
    out_block_n: int = 32
    out_split_k: int = 1
    ffn1_block_n: int = 64
    ffn1_split_k: int = 1
    ffn2_block_n: int = 64
    ffn2_split_k: int = 4
    attn_block_m: int = 64
    attn_block_n: int = 64
    overlap_ratio: float = -1.0
    prefetch_ratio: float = -1.0


@dataclass(frozen=True)
class LayerProblem:
    tokens: int  # batch * seq
    seq: int
    d_model: int
    heads: int
    ffn: int
    dtype_bytes: int = 2

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def gemms(self) -> dict[str, tuple[int, int, int]]:
        m, d, f = self.tokens, self.d_model, self.ffn
        return {"qkv": (m, 3 * d, d), "out": (m, d, d), "ffn1": (m, f, d), "ffn2": (m, d, f)}


def _n_items(c: FusedLayerConfig, m: int, n: int, g: str) -> tuple[int, int]:
    """(tiles, work items = tiles * split) of GEMM phase ``g``."""
    tiles = triton.cdiv(m, c.block_m) * triton.cdiv(n, getattr(c, f"{g}_block_n"))
    return tiles, tiles * getattr(c, f"{g}_split_k")


def workspace_numel(c: FusedLayerConfig, p: LayerProblem) -> int:
    """fp32 elements for split-K partials (and their LayerNorm row sums): the largest phase's need."""
    need = 0
    for g, (m, n, _) in p.gemms().items():
        if getattr(c, f"{g}_split_k") > 1:
            _, items = _n_items(c, m, n, g)
            need = max(need, items * c.block_m * (getattr(c, f"{g}_block_n") + 2))
    return need


def sync_numel(c: FusedLayerConfig, p: LayerProblem) -> int:
    return _TILE_COUNTERS + max(_n_items(c, m, n, g)[0] for g, (m, n, _) in p.gemms().items())


LN_PHASES = ("qkv", "ffn1")  # the phases that also load their A tile for the LayerNorm row sums


def smem_bytes(c: FusedLayerConfig, p: LayerProblem, device: DeviceInfo | None = None) -> int:
    """Triton's shared memory for the kernel: its largest phase (phases run one after another).

    A GEMM phase's K loop keeps ``num_stages`` A+B buffers where Triton 3.6 makes the dot a Hopper wgmma
    (``block_m`` >= 64, whole warpgroups), one fewer where it makes it mma.sync, and in the LayerNorm phases
    ``num_stages - 1`` more A tiles for the row sums' second load; the attention phase one Q, K and V tile. Checked
    against ``triton.compile``'s ``metadata.shared`` for sm_90 and sm_80 (tests/test_fused_layer.py) and against the
    GPU's "Required" of the configs a study's launches failed with (results/*/trials.csv, status out_of_resources,
    before this count). Without a device (``fit``) and on the interpreter it counts as on Hopper, the larger of the
    two.
    """
    bufs, _ = pipeline_buffers(c.num_stages, c.block_m, c.num_warps, device)
    a = c.block_m * c.block_k * p.dtype_bytes
    gemm = max(bufs * (a + getattr(c, f"{g}_block_n") * c.block_k * p.dtype_bytes)
               + (c.num_stages - 1) * a * (g in LN_PHASES)
               for g in GEMM_PHASES)
    attn = (c.attn_block_m + 2 * c.attn_block_n) * block_d(p.head_dim) * p.dtype_bytes
    return max(gemm, attn)


def check(config: FusedLayerConfig, problem: LayerProblem, device: DeviceInfo | None = None) -> str | None:
    """Why ``config`` cannot (or should not) run ``problem`` on ``device``; None when it is valid.

    The one validity rule: the search space, the evaluator and the tests all call this.
    """
    c, p = config, problem
    if c.fuse not in (0, 1, 2):
        return f"fuse={c.fuse} must be 0, 1 or 2"
    if p.tokens < 1 or p.seq < 1 or p.tokens % p.seq or p.d_model % p.heads:
        return f"problem tokens={p.tokens} seq={p.seq} d_model={p.d_model} heads={p.heads} is not a layer"
    if c.fuse == 2:
        why = (layer_cuda.problem_error(p.tokens, p.seq, p.d_model, p.heads, p.ffn)
               or layer_cuda.config_error(c, p.tokens, p.d_model, p.ffn))
        if why:
            return why
        if layer_cuda.smem_bytes(c.num_stages) > smem_limit(device):
            return f"shared memory {layer_cuda.smem_bytes(c.num_stages)} B > {smem_limit(device)} B"
        # The Triton kernel runs the same tiles where the CUDA one cannot (the interpreter, other GPUs); its rules
        # (programs, ratios) hold for the CUDA kernel too.
        return check(fit(layer_cuda.triton_equivalent(c), p), p, device)
    if not HEAD_DIM_MIN <= p.head_dim <= HEAD_DIM_MAX:
        return f"head_dim={p.head_dim} is not supported: it must be in {HEAD_DIM_MIN}..{HEAD_DIM_MAX}"
    if c.num_warps not in (2, 4, 8):
        return f"num_warps={c.num_warps} must be one of 2, 4, 8"
    if not 1 <= c.num_stages <= 8:
        return f"num_stages={c.num_stages} must be in 1..8"
    sms = device.num_sms if device is not None else None
    if c.programs < 0 or (sms is not None and c.programs > sms):
        return (f"programs={c.programs} must be in 0..{sms if sms else 'the SM count'} "
                f"(every program must be resident for the grid barriers)")
    blocks = ["block_m", "block_k", "attn_block_m", "attn_block_n"] + [f"{g}_block_n" for g in GEMM_PHASES]
    for name in blocks:
        v = getattr(c, name)
        if not pow2(v) or v < 16:
            return f"{name}={v} must be a power of two >= 16 (tl.dot)"
    caps = {"block_m": p.tokens, "attn_block_m": p.seq, "attn_block_n": p.seq}
    for name, dim in caps.items():
        if getattr(c, name) > tile_cap(dim):
            return f"{name}={getattr(c, name)} exceeds the problem ({dim} -> {tile_cap(dim)})"
    for g, (m, n, k) in p.gemms().items():
        bn = getattr(c, f"{g}_block_n")
        if bn > tile_cap(n):
            return f"{g}_block_n={bn} exceeds N={n}"
        if c.block_k > tile_cap(k):
            return f"block_k={c.block_k} exceeds K={k} of {g}"
        k_tiles = triton.cdiv(k, c.block_k)
        sk = getattr(c, f"{g}_split_k")
        if sk < 1 or sk > k_tiles:
            return f"{g}_split_k={sk} must be in 1..{k_tiles} (K tiles of K={k} at block_k={c.block_k})"
        if empty_split(k_tiles, sk):
            return f"{g}_split_k={sk} leaves a split without K tiles (K tiles={k_tiles})"
        if c.block_m * bn // (32 * c.num_warps) > 256:
            return f"{g}: accumulator {c.block_m}x{bn} needs more than 256 registers per thread at num_warps={c.num_warps}"
    limit = smem_limit(device)
    need = smem_bytes(c, p, device)
    if need > limit:
        return f"shared memory {need} B > {limit} B"
    return ratio_error("overlap_ratio", c.overlap_ratio) or ratio_error("prefetch_ratio", c.prefetch_ratio)


def fit(config: FusedLayerConfig, problem: LayerProblem, device: DeviceInfo | None = None) -> FusedLayerConfig:
    """Shrink tiles that exceed the problem, reduce each split_k until every split has K tiles, and
    lower num_stages until the shared memory of ``device`` fits (what the search measures for a sampled
    combination)."""
    from dataclasses import replace

    c, p = config, problem
    if c.fuse == 2 and layer_cuda.problem_error(p.tokens, p.seq, p.d_model, p.heads, p.ffn):
        return fit(layer_cuda.triton_equivalent(c), p, device)  # (a shape the CUDA kernel cannot run: the Triton one)
    if c.fuse == 2:  # 64x64 tiles: only the splits (to divisors of the K tiles) and the ring depth move
        nd, nf = p.d_model // 64, p.ffn // 64
        div = lambda s, n: max([d for d in range(1, max(s, 1) + 1) if n > 0 and n % d == 0] or [1])  # noqa: E731
        c = replace(c, out_split_k=div(c.out_split_k, nd), ffn2_split_k=div(c.ffn2_split_k, nf),
                    num_stages=min(max(c.num_stages, 2), layer_cuda.MAX_STAGES))
        while c.num_stages > 2 and layer_cuda.smem_bytes(c.num_stages) > smem_limit(device):
            c = replace(c, num_stages=c.num_stages - 1)
        return c
    cap = lambda v, dim: min(v, tile_cap(dim))  # noqa: E731
    kw = {"block_m": cap(c.block_m, p.tokens), "attn_block_m": cap(c.attn_block_m, p.seq),
          "attn_block_n": cap(c.attn_block_n, p.seq),
          "block_k": cap(c.block_k, min(k for _, _, k in p.gemms().values()))}
    for g, (_, n, _) in p.gemms().items():
        kw[f"{g}_block_n"] = cap(getattr(c, f"{g}_block_n"), n)
    c = replace(c, **kw)
    c = replace(c, **{f"{g}_split_k": fit_split_k(getattr(c, f"{g}_split_k"), triton.cdiv(k, c.block_k))
                      for g, (_, _, k) in p.gemms().items()})
    while c.num_stages > 1 and smem_bytes(c, p, device) > smem_limit(device):
        c = replace(c, num_stages=c.num_stages - 1)
    while c.num_warps < 8 and max(c.block_m * getattr(c, f"{g}_block_n") for g in GEMM_PHASES) // (
            32 * c.num_warps) > 256:
        c = replace(c, num_warps=c.num_warps * 2)
    return c


N_STAMPS = 12  # _stamp slots per program (diagnostics: scripts/fused_phases.py)


@triton.jit
def _stamp(times_ptr, pid, slot, TIMES: tl.constexpr):
    """Diagnostics only (TIMES): %globaltimer (ns) and %clock64 of this program at a phase boundary."""
    if TIMES:
        tl.debug_barrier()
        t = globaltimer(pid)
        c = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [pid], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(times_ptr + (pid * 12 + slot) * 2, t)
        tl.store(times_ptr + (pid * 12 + slot) * 2 + 1, c)


@triton.jit
def _grid_barrier(sync_ptr, idx, NPROG: tl.constexpr):
    """Every program arrives (release: its stores are visible first), then waits for all (acquire)."""
    tl.debug_barrier()  # every thread's stores of this program are issued before the arrival
    tl.atomic_add(sync_ptr + idx, 1, sem="release", scope="gpu")
    while tl.load(sync_ptr + idx, volatile=True) < NPROG:
        pass
    tl.atomic_add(sync_ptr + idx, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _next_phase(sync_ptr, times_ptr, pid, b, trigger_phase, NPROG: tl.constexpr, USE_PDL: tl.constexpr,
                TIMES: tl.constexpr):
    """Between phase ``b + 1`` and ``b + 2`` (1-based): grid barrier ``b`` (stamped on both sides), then
    the PDL trigger if it belongs at the start of the next phase."""
    _stamp(times_ptr, pid, 2 * b + 3, TIMES)
    _grid_barrier(sync_ptr, b, NPROG)
    _stamp(times_ptr, pid, 2 * b + 4, TIMES)
    pdl_trigger(b + 2, trigger_phase, USE_PDL)


@triton.jit
def _gemm_phase(pid, a_ptr, w_ptr, bias_ptr, u_ptr, res_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, eps,
                NPROG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                SPLIT: tl.constexpr, STAGES: tl.constexpr, HAS_LN: tl.constexpr, HAS_RES: tl.constexpr,
                ACT: tl.constexpr, UPCAST: tl.constexpr):
    """``act(LN?(a) @ w.T + bias) + res`` over this program's work items (tile, split); contiguous rows."""
    n_tm = tl.cdiv(M, BM)
    n_tiles = n_tm * tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    per = tl.cdiv(k_tiles, SPLIT)
    n_items = n_tiles * SPLIT
    offs_k = tl.arange(0, BK)
    for item in range(pid, n_items, NPROG):
        tile = item // SPLIT
        s = item % SPLIT
        # Row tiles fastest: programs next to each other share a weight tile in L2.
        offs_m = (tile % n_tm) * BM + tl.arange(0, BM)
        offs_n = (tile // n_tm) * BN + tl.arange(0, BN)
        mask_m = offs_m < M
        mask_n = offs_n < N
        k0 = s * per
        if SPLIT == 1:
            # The epilogue's operands are issued before the K loop: their latency hides under it.
            bias, res = _epilogue_inputs(offs_m, offs_n, M, N, bias_ptr, res_ptr, N, 1, True, HAS_RES)
            if HAS_LN:
                u = tl.load(u_ptr + offs_n, mask=mask_n, other=0.0)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        s1 = tl.zeros((BM,), dtype=tl.float32)
        s2 = tl.zeros((BM,), dtype=tl.float32)
        for i in tl.range(0, tl.minimum(per, k_tiles - k0), num_stages=STAGES):
            k = (k0 + i) * BK + offs_k
            a_ptrs = a_ptr + offs_m[:, None] * K + k[None, :]
            a_mask = mask_m[:, None] & (k[None, :] < K)
            # Activations through L1: no SM reads a buffer of this launch before it is written (each
            # buffer is written once per launch), so no stale line can be hit.
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            b = tl.load(w_ptr + offs_n[None, :] * K + k[:, None], mask=mask_n[None, :] & (k[:, None] < K),
                        other=0.0)
            if HAS_LN:
                # Row sums from a second load of the tile (an L1 hit), not the MMA operand (gemm.py:
                # triton 3.6 on the H200 reduced the operand wrongly at some tiles).
                af = tl.load(a_ptrs, mask=a_mask, other=0.0, cache_modifier=".ca").to(tl.float32)
                s1 += tl.sum(af, axis=1)
                s2 += tl.sum(af * af, axis=1)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        if SPLIT == 1:
            if HAS_LN:
                acc = _ln_apply(acc, s1, s2, u, K, eps)
            _epilogue_with(acc, bias, res, offs_m, offs_n, M, N, out_ptr, N, 1, True, HAS_RES, ACT)
        else:
            # Store this split's partial; the last split of the tile to arrive reduces and finishes it.
            rows = tl.arange(0, BM)
            part = ws_ptr + item * (BM * BN)
            tl.store(part + rows[:, None] * BN + tl.arange(0, BN)[None, :], acc)
            st = ws_ptr + n_items * (BM * BN) + item * (2 * BM) + rows * 2
            if HAS_LN:
                tl.store(st, s1)
                tl.store(st + 1, s2)
            tl.debug_barrier()
            old = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if old == SPLIT - 1:
                acc = tl.zeros((BM, BN), dtype=tl.float32)
                s1 = tl.zeros((BM,), dtype=tl.float32)
                s2 = tl.zeros((BM,), dtype=tl.float32)
                for j in range(0, SPLIT):
                    src = ws_ptr + (tile * SPLIT + j) * (BM * BN)
                    acc += tl.load(src + rows[:, None] * BN + tl.arange(0, BN)[None, :], cache_modifier=".cg")
                    if HAS_LN:
                        sj = ws_ptr + n_items * (BM * BN) + (tile * SPLIT + j) * (2 * BM) + rows * 2
                        s1 += tl.load(sj, cache_modifier=".cg")
                        s2 += tl.load(sj + 1, cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next phase
                if HAS_LN:
                    acc = _ln_correct(acc, s1, s2, u_ptr, offs_n, N, K, eps)
                _epilogue(acc, offs_m, offs_n, M, N, bias_ptr, res_ptr, out_ptr, N, 1, N, 1, True, HAS_RES, ACT)


@triton.jit
def _attn_phase(pid, qkv_ptr, out_ptr, n_batch, seq, heads, head_dim, D, qk_scale,
                NPROG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                UPCAST: tl.constexpr):
    n_qb = tl.cdiv(seq, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    for item in range(pid, n_batch * heads * n_qb, NPROG):
        # The longest causal tiles (last query block) first: they set the phase's length.
        qb = n_qb - 1 - item % n_qb
        bh = item // n_qb
        b = bh // heads
        h = bh % heads
        row0 = (b * seq).to(tl.int64)
        base = qkv_ptr + row0 * (3 * D) + h * head_dim
        offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < seq
        q = tl.load(base + offs_m[:, None] * (3 * D) + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :],
                    other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        n_blocks = tl.cdiv(tl.minimum(seq, (qb + 1) * BLOCK_M), BLOCK_N)
        acc = _attn_rows(q, base + D, base + 2 * D, offs_m, seq, head_dim, 3 * D, 1, qk_scale, n_blocks, -1,
                         BLOCK_M, BLOCK_N, BLOCK_D, True, False, UPCAST)
        tl.store(out_ptr + (row0 + offs_m[:, None]) * D + h * head_dim + offs_d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _prefetch_weights(pid, w_ptr, n_lines, NPROG: tl.constexpr, LINE_ELEMS: tl.constexpr, LINES: tl.constexpr):
    """This program's share of the first ``n_lines`` 128-byte lines of one weight matrix into L2."""
    for first in range(pid * LINES, n_lines, NPROG * LINES):
        idx = tl.minimum(first + tl.arange(0, LINES), n_lines - 1)
        prefetch_l2(w_ptr + idx.to(tl.int64) * LINE_ELEMS)


@triton.jit
def _layer_kernel(
    x_ptr, wqkv_ptr, bqkv_ptr, uqkv_ptr, wout_ptr, bout_ptr, w1_ptr, b1_ptr, u1_ptr, w2_ptr, b2_ptr,
    qkv_ptr, attn_ptr, h_ptr, f1_ptr, y_ptr, ws_ptr, sync_ptr, times_ptr,
    M, D, F, n_batch, seq, heads, head_dim, qk_scale, eps,
    pf_qkv, pf_out, pf_ffn1, pf_ffn2, trigger_phase,
    NPROG: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
    BN_QKV: tl.constexpr, SK_QKV: tl.constexpr, BN_OUT: tl.constexpr, SK_OUT: tl.constexpr,
    BN_F1: tl.constexpr, SK_F1: tl.constexpr, BN_F2: tl.constexpr, SK_F2: tl.constexpr,
    ABM: tl.constexpr, ABN: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, UPCAST: tl.constexpr, LINE_ELEMS: tl.constexpr,
    TIMES: tl.constexpr, GELU: tl.constexpr = 1, RACY: tl.constexpr = False,
):
    pid = tl.program_id(0)
    cnt = sync_ptr + 8
    _stamp(times_ptr, pid, 0, TIMES)
    if PREFETCH:  # weights only: nothing the predecessor writes is touched before the wait
        _prefetch_weights(pid, wqkv_ptr, pf_qkv, NPROG, LINE_ELEMS, 256)
        _prefetch_weights(pid, wout_ptr, pf_out, NPROG, LINE_ELEMS, 256)
        _prefetch_weights(pid, w1_ptr, pf_ffn1, NPROG, LINE_ELEMS, 256)
        _prefetch_weights(pid, w2_ptr, pf_ffn2, NPROG, LINE_ELEMS, 256)
    _stamp(times_ptr, pid, 1, TIMES)
    if not RACY:
        pdl_wait(USE_PDL)
    _stamp(times_ptr, pid, 2, TIMES)
    pdl_trigger(1, trigger_phase, USE_PDL)
    _gemm_phase(pid, x_ptr, wqkv_ptr, bqkv_ptr, uqkv_ptr, x_ptr, qkv_ptr, ws_ptr, cnt, M, 3 * D, D, eps,
                NPROG, BM, BN_QKV, BK, SK_QKV, STAGES, True, False, 0, UPCAST)
    if RACY:  # test-only (tune verify): the QKV phase above read x, the previous launch's output, before the wait
        pdl_wait(USE_PDL)
    _next_phase(sync_ptr, times_ptr, pid, 0, trigger_phase, NPROG, USE_PDL, TIMES)
    _attn_phase(pid, qkv_ptr, attn_ptr, n_batch, seq, heads, head_dim, D, qk_scale, NPROG, ABM, ABN, BLOCK_D,
                UPCAST)
    _next_phase(sync_ptr, times_ptr, pid, 1, trigger_phase, NPROG, USE_PDL, TIMES)
    _gemm_phase(pid, attn_ptr, wout_ptr, bout_ptr, bout_ptr, x_ptr, h_ptr, ws_ptr, cnt, M, D, D, eps,
                NPROG, BM, BN_OUT, BK, SK_OUT, STAGES, False, True, 0, UPCAST)
    _next_phase(sync_ptr, times_ptr, pid, 2, trigger_phase, NPROG, USE_PDL, TIMES)
    _gemm_phase(pid, h_ptr, w1_ptr, b1_ptr, u1_ptr, h_ptr, f1_ptr, ws_ptr, cnt, M, F, D, eps,
                NPROG, BM, BN_F1, BK, SK_F1, STAGES, True, False, GELU, UPCAST)
    _next_phase(sync_ptr, times_ptr, pid, 3, trigger_phase, NPROG, USE_PDL, TIMES)
    _gemm_phase(pid, f1_ptr, w2_ptr, b2_ptr, b2_ptr, h_ptr, y_ptr, ws_ptr, cnt, M, D, F, eps,
                NPROG, BM, BN_F2, BK, SK_F2, STAGES, False, True, 0, UPCAST)
    _stamp(times_ptr, pid, 11, TIMES)
    # The last program out resets the barrier counters for the next launch (the tile counters reset
    # themselves); everyone has passed every barrier by then.
    tl.debug_barrier()
    if tl.atomic_add(sync_ptr + 4, 1, sem="acq_rel", scope="gpu") == NPROG - 1:
        for i in range(0, 5):
            tl.atomic_xchg(sync_ptr + i, 0, sem="relaxed", scope="gpu")


@dataclass
class LayerTensors:
    """The folded weights one launch reads (``gemm.fold_layernorm`` for the two fused norms)."""

    w_qkv: torch.Tensor  # W_qkv * gamma1
    b_qkv: torch.Tensor  # fp32
    u_qkv: torch.Tensor  # fp32 colsum
    w_out: torch.Tensor
    b_out: torch.Tensor
    w_ffn1: torch.Tensor  # W_ffn1 * gamma2
    b_ffn1: torch.Tensor  # fp32
    u_ffn1: torch.Tensor  # fp32 colsum
    w_ffn2: torch.Tensor
    b_ffn2: torch.Tensor


class LayerScratch:
    """Intermediate activations, the split-K workspace and the (zeroed) sync counters of one layer."""

    def __init__(self, config: FusedLayerConfig, problem: LayerProblem, dtype, device):
        m, d, f = problem.tokens, problem.d_model, problem.ffn
        e = lambda n: torch.empty((m, n), dtype=dtype, device=device)  # noqa: E731
        self.qkv, self.attn, self.h, self.ffn1 = e(3 * d), e(d), e(d), e(f)
        # fuse 2 on Hopper: the CUDA kernel's tile flags and split-K sums (the kernel keeps the sums zero between
        # launches, so they are no scratch to poison); elsewhere the Triton kernel's.
        # (and 16-bit operands: in fp32 the Triton kernel runs fuse 2's tiles, as on other GPUs)
        self.cuda = config.fuse == 2 and cluster_gemm.usable(device) and dtype in HALF_DTYPES
        self.maps: dict = {}  # fuse 2: the CUDA kernel's TMA descriptors on the device, per set of buffers
        if self.cuda:
            self.ws = torch.zeros(layer_cuda.workspace_numel(m, d), dtype=torch.float32, device=device)
            self.sync = torch.zeros(layer_cuda.sync_ints(m, d, problem.heads, f), dtype=torch.int32, device=device)
            return
        tc = fit(layer_cuda.triton_equivalent(config), problem) if config.fuse == 2 else config
        self.ws = torch.empty(max(1, workspace_numel(tc, problem)), dtype=torch.float32, device=device)
        self.sync = torch.zeros(sync_numel(tc, problem), dtype=torch.int32, device=device)

    def poisonable(self) -> list[torch.Tensor]:
        """What a correctness check may fill with NaN before a launch (every launch writes it before reading)."""
        return [] if self.cuda else [self.ws]

    def activations(self) -> list[torch.Tensor]:
        return [self.qkv, self.attn, self.h, self.ffn1]


def programs_for(config: FusedLayerConfig, x: torch.Tensor) -> int:
    if x.device.type != "cuda" or interpreting():
        return 1  # the interpreter runs programs one after another: one program passes every barrier
    sms = DeviceInfo.from_torch(x.device).num_sms
    return min(sms, config.programs) if config.programs > 0 else sms


def launch_knobs(c: FusedLayerConfig, weights: list[int], elem_bytes: int) -> tuple[int, tuple[int, ...]]:
    """What the Triton layer kernel's launch reads of ``c``'s two ratios: the phase after which it triggers its
    dependents (``1 + floor(4 * overlap_ratio)``; 0: no PDL) and, for each weight of ``weights`` elements of
    ``elem_bytes``, the 128-byte lines it prefetches. The one place these are computed: the launch reads them, and so
    does the study's launch key (tuner.layer.launch_key), so two ratios that launch the same are measured once."""
    line = 128 // elem_bytes
    # (trigger_index over the five phases: floor(4 * overlap_ratio) of them done, -1 without PDL)
    return 1 + trigger_index(5, c.overlap_ratio), tuple(prefetch_count(triton.cdiv(n, line), c.prefetch_ratio)
                                                        for n in weights)


def decoder_layer(x: torch.Tensor, w: LayerTensors, *, seq: int, heads: int, config: FusedLayerConfig,
                  scratch: LayerScratch, out: torch.Tensor, eps: float = 1e-5,
                  _times: torch.Tensor | None = None, _racy: str | None = None) -> torch.Tensor:
    """One pre-LN causal decoder layer of ``x`` ``[batch*seq, d_model]`` into ``out``, one launch.

    ``_times`` (diagnostics, GPU only): int64 ``[programs, N_STAMPS, 2]`` receiving each program's
    (%globaltimer, %clock64) at the phase boundaries; for fuse 2 on Hopper ``[programs, layer_cuda.TRACE_ROW]``
    (layer_kernel.cu's trace layout). ``_racy`` (test-only): for fuse 2 on Hopper, a phase of layer_cuda.PHASES whose
    tasks read their input without waiting for its flags; on the Triton kernel (fuse 1, or fuse 2 off Hopper) only
    ``"qkv"``, whose phase then reads ``x`` before ``gdc_wait``."""
    M, D = x.shape
    F = w.w_ffn1.shape[0]
    p = LayerProblem(M, seq, D, heads, F, x.element_size())
    why = check(config, p, DeviceInfo.from_torch(x.device) if x.is_cuda else None)
    if why:
        raise ValueError(f"decoder_layer: invalid FusedLayerConfig for {p}: {why}")
    for name, t, shp in (("w_qkv", w.w_qkv, (3 * D, D)), ("w_out", w.w_out, (D, D)), ("w_ffn1", w.w_ffn1, (F, D)),
                         ("w_ffn2", w.w_ffn2, (D, F)), ("out", out, (M, D))):
        if tuple(t.shape) != shp or not t.is_contiguous() or t.dtype != x.dtype:
            raise ValueError(f"decoder_layer: {name} {tuple(t.shape)} {t.dtype} must be contiguous {shp} {x.dtype}")
    mode = launch_mode(x)
    c = effective_config(config, x)
    if c.fuse == 2:
        if scratch.cuda:
            layer_cuda.launch(x, w, scratch, out, seq=seq, heads=heads, config=c, eps=eps,
                              grid=programs_for(c, x), trace=_times, racy=_racy)
            return out
        c = fit(layer_cuda.triton_equivalent(c), p)
    if _racy not in (None, "qkv"):
        raise ValueError(f"decoder_layer: the Triton layer kernel's racy variant is its QKV phase, not {_racy!r}")
    use_pdl = c.overlap_ratio >= 0
    line = 128 // x.element_size()
    trigger, pf = launch_knobs(c, [t.numel() for t in (w.w_qkv, w.w_out, w.w_ffn1, w.w_ffn2)], x.element_size())
    nprog = programs_for(c, x)
    head_dim = D // heads
    launch(_layer_kernel, (nprog,),
        x, w.w_qkv, w.b_qkv, w.u_qkv, w.w_out, w.b_out, w.w_ffn1, w.b_ffn1, w.u_ffn1, w.w_ffn2, w.b_ffn2,
        scratch.qkv, scratch.attn, scratch.h, scratch.ffn1, out, scratch.ws, scratch.sync,
        _times if _times is not None else scratch.sync,
        M, D, F, M // seq, seq, heads, head_dim, _LOG2E / math.sqrt(head_dim), eps,
        *pf, trigger,
        NPROG=nprog, BM=c.block_m, BK=c.block_k, STAGES=c.num_stages,
        BN_QKV=c.qkv_block_n, SK_QKV=c.qkv_split_k, BN_OUT=c.out_block_n, SK_OUT=c.out_split_k,
        BN_F1=c.ffn1_block_n, SK_F1=c.ffn1_split_k, BN_F2=c.ffn2_block_n, SK_F2=c.ffn2_split_k,
        ABM=c.attn_block_m, ABN=c.attn_block_n, BLOCK_D=block_d(head_dim),
        USE_PDL=use_pdl, PREFETCH=sum(pf) > 0, UPCAST=mode.upcast_bf16 and x.dtype == torch.bfloat16,
        LINE_ELEMS=line, TIMES=_times is not None, GELU=act_code("gelu", x), RACY=_racy == "qkv",
        num_warps=c.num_warps, num_stages=1,
        launch_pdl=use_pdl,
    )
    return out
