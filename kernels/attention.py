"""Causal flash-attention forward that reads the QKV GEMM's packed output in place.

``qkv`` is ``[batch*seq, 3*D]`` with ``D = heads*head_dim`` (row ``b*seq + s``): q in columns ``[0, D)``,
k in ``[D, 2D)``, v in ``[2D, 3D)``, head ``h`` at offset ``h*head_dim`` inside each part. It is read with
its own strides (no permute, no copy). The output is ``[batch*seq, D]``, head ``h`` at columns
``h*head_dim``: the layout the output-projection GEMM reads.

One program per (``block_m`` query rows, batch*head); online softmax in fp32 with ``exp2`` (log2(e)
folded into the scale), fp32 accumulation. Causal programs stop at their diagonal KV block.

PDL (the same contract as the GEMM, DESIGN.md):

* ``overlap_ratio < 0``: launched without PDL, no early trigger.
* ``overlap_ratio`` in ``[0, 1]``: launched with PDL; every program calls ``gdc_wait`` before it reads
  ``qkv`` and before any store, and ``gdc_launch_dependents`` after
  ``floor((n_kv_blocks - 1) * overlap_ratio)`` KV blocks of its own (causal programs have different
  counts, so the point is computed in the kernel; after 0 blocks: before ``gdc_wait``).
* Attention has no weights: ``prefetch_ratio`` must stay negative.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
import triton
import triton.language as tl

from tuner.device import DeviceInfo

from ._common import (GRID_YZ_LIMIT, KnobConfig, effective_config, launch, launch_field_error, launch_mode, pdl_trigger,
                      pdl_wait, ratio_error, smem_limit, tile_cap)

HEAD_DIM_MIN, HEAD_DIM_MAX = 32, 128
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttnConfig(KnobConfig):
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    # 1: computed by the fused feed-forward block's kernel (kernels/mlp_cluster.cu ATT_IN), in front of the
    # out-projection it computes there too (out.fuse 1): no attention kernel. Rules: tuner.layer.mlp_error.
    fuse: int = 0
    overlap_ratio: float = -1.0
    prefetch_ratio: float = -1.0


@dataclass(frozen=True)
class AttnProblem:
    batch: int
    seq: int
    heads: int
    head_dim: int
    dtype_bytes: int = 2




def block_d(head_dim: int) -> int:
    """The head dim as the kernel tiles it: the next power of two (masked beyond ``head_dim``)."""
    return tile_cap(head_dim)


def smem_bytes(c: AttnConfig, head_dim: int, dtype_bytes: int) -> int:
    """K and V tiles per pipeline stage plus the resident Q tile."""
    bd = block_d(head_dim)
    return c.num_stages * c.block_n * bd * 2 * dtype_bytes + c.block_m * bd * dtype_bytes


def repair(config: AttnConfig, problem: AttnProblem, device: DeviceInfo | None = None) -> AttnConfig:
    """The nearest config within ``device``'s shared memory: fewer stages, then (one stage still over: a long
    head in fp32) half the key tile, then half the query tile, down to 16."""
    c, limit = config, smem_limit(device)
    while c.num_stages > 1 and smem_bytes(c, problem.head_dim, problem.dtype_bytes) > limit:
        c = replace(c, num_stages=c.num_stages - 1)
    while smem_bytes(c, problem.head_dim, problem.dtype_bytes) > limit and max(c.block_n, c.block_m) > 16:
        c = replace(c, **({"block_n": c.block_n // 2} if c.block_n >= c.block_m else {"block_m": c.block_m // 2}))
    return c


def field_error(c: AttnConfig) -> str | None:
    """Why a field of ``c`` is invalid whatever the problem and the GPU (the search space refuses such a choice when
    it is read); None when each field alone can run. The first rules of :func:`check`."""
    return launch_field_error(c, ("block_m", "block_n"))


def check(config: AttnConfig, problem: AttnProblem, device: DeviceInfo | None = None) -> str | None:
    """Why ``config`` cannot (or should not) run ``problem`` on ``device``; None when it is valid.

    The one validity rule: the search space, the evaluator and the tests all call this.
    """
    c, p = config, problem
    for name in ("batch", "seq", "heads"):
        v = getattr(p, name)
        if v < 1:
            return f"problem {name}={v} must be >= 1"
    why = field_error(c)
    if why:
        return why
    if not HEAD_DIM_MIN <= p.head_dim <= HEAD_DIM_MAX:
        return (f"head_dim={p.head_dim} is not supported: it must be in {HEAD_DIM_MIN}..{HEAD_DIM_MAX} "
                f"(padded to a power of two inside the kernel)")
    # A tile much larger than the sequence is the same program as a smaller one doing masked work.
    cap = tile_cap(p.seq)
    for name in ("block_m", "block_n"):
        if getattr(c, name) > cap:
            return f"{name}={getattr(c, name)} exceeds the problem (seq={p.seq} -> {cap})"
    limit = smem_limit(device)
    need = smem_bytes(c, p.head_dim, p.dtype_bytes)
    if need > limit:
        return (f"shared memory {need} B > {limit} B "
                f"(num_stages*block_n*BLOCK_D*2*bytes + block_m*BLOCK_D*bytes)")
    why = ratio_error("overlap_ratio", c.overlap_ratio)
    if why:
        return why
    if math.isnan(c.prefetch_ratio) or c.prefetch_ratio >= 0:
        return f"prefetch_ratio={c.prefetch_ratio}: attention has no weights to prefetch (must be negative)"
    return None


@triton.jit
def _trigger_block(n_blocks, overlap):
    """The KV block after which a program of ``n_blocks`` triggers its dependents: floor((n_blocks - 1) * overlap),
    in fp32 as the kernel computes it (:func:`launch_knobs` reads the same in Python)."""
    return ((n_blocks - 1) * overlap).to(tl.int32)


def launch_knobs(c: AttnConfig, seq: int, causal: bool = True) -> tuple[int, ...]:
    """What a launch over ``seq`` reads of ``c``'s overlap ratio: the KV block after which its programs trigger
    their dependents (:func:`_trigger_block`, -1: no PDL), one for each count of KV blocks a program reads (causal
    programs stop at their diagonal), fewest first. The study's launch key (tuner.layer.launch_key) reads it, so two
    ratios that launch the same are measured once. In fp32, as the kernel computes it (numpy's float32 product is
    IEEE's, as the GPU's and the interpreter's are)."""
    if c.overlap_ratio < 0:
        return (-1,)
    if causal:
        ends = np.minimum(seq, np.arange(1, triton.cdiv(seq, c.block_m) + 1, dtype=np.int64) * c.block_m)
        counts = np.unique(-(-ends // c.block_n))
    else:
        counts = np.array([triton.cdiv(seq, c.block_n)])
    triggers = (counts - 1).astype(np.float32) * np.float32(max(c.overlap_ratio, 0.0))
    return tuple(triggers.astype(np.int32).tolist())


@triton.jit
def _attn_rows(q, k_base, v_base, offs_m, seq, head_dim, stride_qt, stride_qc, qk_scale, n_blocks, trigger_j,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
               USE_PDL: tl.constexpr, UPCAST: tl.constexpr):
    """softmax(q k^T) v for one tile of query rows over its first ``n_blocks`` KV blocks (online softmax),
    issuing the PDL trigger once ``trigger_j`` blocks are done (0: the caller triggers). Shared by this kernel
    and the fused layer kernel."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_nb = tl.arange(0, BLOCK_N)
    mask_d = offs_d < head_dim
    # Finite start: a row with every key masked so far keeps p == 0 and alpha == 1 (no inf - inf).
    m_i = tl.full([BLOCK_M], -1.0e38, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for j in range(0, n_blocks):
        offs_n = j * BLOCK_N + offs_nb
        mask_n = offs_n < seq
        # K loaded transposed, [BLOCK_D, BLOCK_N]; padding rows/cols read as 0.
        kt = tl.load(k_base + offs_n[None, :] * stride_qt + offs_d[:, None] * stride_qc,
                     mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_qt + offs_d[None, :] * stride_qc,
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, kt) * qk_scale
        valid = mask_n[None, :]
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        qk = tl.where(valid, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
        pdl_trigger(j + 1, trigger_j, USE_PDL)

    return acc / l_i[:, None]


@triton.jit
def _attn_fwd_kernel(
    # pointers
    qkv_ptr, out_ptr,
    # sizes
    seq, heads, head_dim, D,
    # strides
    stride_qt, stride_qc, stride_ot, stride_oc,
    # softmax scale * log2(e); the PDL trigger ratio (ignored without PDL)
    qk_scale, overlap,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    USE_PDL: tl.constexpr, UPCAST: tl.constexpr, RACY_READ_BEFORE_WAIT: tl.constexpr,
    ONE_AXIS: tl.constexpr,
):
    if ONE_AXIS:
        # More (sequence, head) pairs than a grid's second axis holds (65535; its first holds 2^31 - 1): one axis,
        # in the order of the (query tiles, pairs) grid below. Only there: the division cost up to 3% at 1x128x12.
        pid = tl.program_id(0)
        m_tiles = tl.cdiv(seq, BLOCK_M)
        pid_m = pid % m_tiles
        pid_bh = pid // m_tiles
    else:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads

    # Row b*seq + s of qkv / out; int64 so that large batch*seq*stride never wraps.
    row0 = (b * seq).to(tl.int64)
    q_base = qkv_ptr + row0 * stride_qt + (h * head_dim) * stride_qc
    k_base = qkv_ptr + row0 * stride_qt + (D + h * head_dim) * stride_qc
    v_base = qkv_ptr + row0 * stride_qt + (2 * D + h * head_dim) * stride_qc
    o_base = out_ptr + row0 * stride_ot + (h * head_dim) * stride_oc

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seq
    mask_d = offs_d < head_dim

    # KV blocks of this program: causal stops at the block holding its last (valid) query row.
    if CAUSAL:
        kv_end = tl.minimum(seq, (pid_m + 1) * BLOCK_M)
    else:
        kv_end = seq
    n_blocks = tl.cdiv(kv_end, BLOCK_N)

    if USE_PDL:
        # After floor((n_blocks - 1) * overlap) of this program's KV blocks (overlap in [0, 1]); after 0:
        # before gdc_wait, so that the out-projection launches and prefetches its weights meanwhile.
        trigger_j = _trigger_block(n_blocks, overlap)
    else:
        trigger_j = -1
    pdl_trigger(0, trigger_j, USE_PDL)
    q_ptrs = q_base + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qc
    q_mask = mask_m[:, None] & mask_d[None, :]
    if RACY_READ_BEFORE_WAIT:
        # Test-only defect: reads this program's Q tile before gdc_wait. The correctness gate must catch it.
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)
        pdl_wait(USE_PDL)
    else:
        pdl_wait(USE_PDL)
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    acc = _attn_rows(q, k_base, v_base, offs_m, seq, head_dim, stride_qt, stride_qc, qk_scale, n_blocks, trigger_j,
                     BLOCK_M, BLOCK_N, BLOCK_D, CAUSAL, USE_PDL, UPCAST)
    tl.store(o_base + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_oc,
             acc.to(out_ptr.dtype.element_ty), mask=q_mask)


def _check_inputs(qkv: torch.Tensor, batch: int, seq: int, heads: int, head_dim: int) -> int:
    D = heads * head_dim
    if qkv.dim() != 2 or tuple(qkv.shape) != (batch * seq, 3 * D):
        raise ValueError(f"attention: qkv {tuple(qkv.shape)} must be [batch*seq, 3*heads*head_dim] = "
                         f"({batch * seq}, {3 * D})")
    return D


def attention(qkv: torch.Tensor, *, batch: int, seq: int, heads: int, head_dim: int,
              config: AttnConfig = AttnConfig(), out: torch.Tensor | None = None, causal: bool = True,
              sm_scale: float | None = None, _racy_read_before_wait: bool = False) -> torch.Tensor:
    """softmax(q k^T * sm_scale [causal]) v per (batch, head), read from the packed ``qkv`` in place."""
    D = _check_inputs(qkv, batch, seq, heads, head_dim)
    why = check(config, AttnProblem(batch, seq, heads, head_dim, qkv.element_size()),
                DeviceInfo.from_torch(qkv.device) if qkv.is_cuda else None)
    if why:
        raise ValueError(f"attention: invalid AttnConfig for batch={batch} seq={seq} heads={heads} "
                         f"head_dim={head_dim}: {why}")
    if out is None:
        out = torch.empty((batch * seq, D), device=qkv.device, dtype=qkv.dtype)
    elif tuple(out.shape) != (batch * seq, D) or out.dtype != qkv.dtype or out.device != qkv.device:
        raise ValueError(f"attention: out {tuple(out.shape)} {out.dtype} must be ({batch * seq}, {D}) {qkv.dtype}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    mode = launch_mode(qkv)
    c = effective_config(config, qkv)
    use_pdl = c.overlap_ratio >= 0
    m_tiles, pairs = triton.cdiv(seq, c.block_m), batch * heads
    one_axis = pairs > GRID_YZ_LIMIT
    grid = (m_tiles * pairs,) if one_axis else (m_tiles, pairs)
    launch(_attn_fwd_kernel, grid,
        qkv, out,
        seq, heads, head_dim, D,
        qkv.stride(0), qkv.stride(1), out.stride(0), out.stride(1),
        float(sm_scale) * _LOG2E, float(max(c.overlap_ratio, 0.0)),
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_D=block_d(head_dim), CAUSAL=bool(causal),
        USE_PDL=use_pdl, UPCAST=mode.upcast_bf16 and qkv.dtype == torch.bfloat16,
        RACY_READ_BEFORE_WAIT=_racy_read_before_wait, ONE_AXIS=one_axis,
        num_warps=c.num_warps, num_stages=c.num_stages, launch_pdl=use_pdl,
    )
    return out


def attention_ref(qkv: torch.Tensor, *, batch: int, seq: int, heads: int, head_dim: int,
                  causal: bool = True, sm_scale: float | None = None) -> torch.Tensor:
    """fp32 torch reference of :func:`attention` (returns fp32 ``[batch*seq, heads*head_dim]``)."""
    D = _check_inputs(qkv, batch, seq, heads, head_dim)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    x = qkv.float()

    def part(i):  # [batch, heads, seq, head_dim]
        return x[:, i * D:(i + 1) * D].reshape(batch, seq, heads, head_dim).transpose(1, 2)

    q, k, v = part(0), part(1), part(2)
    s = (q @ k.transpose(-1, -2)) * sm_scale
    if causal:
        keep = torch.ones(seq, seq, dtype=torch.bool, device=qkv.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    o = torch.softmax(s, dim=-1) @ v
    return o.transpose(1, 2).reshape(batch * seq, D)
