"""The QKV projection and causal attention of short sequences as one kernel: one program per (batch, head).

For ``seq <= 128`` one program can hold a head's whole Q, K and V (``seq x head_dim`` each): it runs the
projection's K loop over ``d_model`` for the head's three column slices of ``W_qkv`` at once (three fp32
accumulators), applies the fused LayerNorm and the bias, and computes ``softmax(q k^T) v`` for all its
rows from registers. The ``[tokens, 3*d_model]`` qkv tensor is never written, and the layer loses a
kernel boundary (AttnConfig.fuse = 1).

    out[b*seq + s, h*hd:(h+1)*hd] = attention(LN(x) @ W_qkv^T + b_qkv)   for head h of batch b

The price: ``batch*heads`` programs (12 for bert-base), each streaming ``seq x d_model`` of x and
``3*hd x d_model`` of weights. The tiles come from the QKV GemmConfig: ``block_k``, ``num_warps``,
``num_stages``, ``tma`` and the (overlap, prefetch) pair; its ``block_m``/``block_n``/``group_m``/``split_k``
do not apply (the row tile is the sequence, the column tile the head).

PDL and prefetch follow the GEMM's contract (tuner.kernels.gemm): before ``gdc_wait`` a program touches
only its weights (prefetch); the trigger comes after ``floor((k_tiles-1)*overlap)`` K tiles counted from
the wait.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tuner.device import DeviceInfo

from ._common import (effective_config, launch_mode, pdl_trigger, pdl_wait, pow2, prefetch_count, prefetch_l2,
                      smem_limit, tile_cap, trigger_index)
from .gemm import GemmConfig, _ln_correct, _row_stats_in

SEQ_MAX = 128
_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class QkvAttnProblem:
    batch: int
    seq: int
    heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def d_model(self) -> int:
        return self.heads * self.head_dim


def seq_tile(seq: int) -> int:
    """The program's row tile: the sequence padded to a power of two (at least 16, for tl.dot)."""
    return tile_cap(seq)


def smem_bytes(c: GemmConfig, p: QkvAttnProblem) -> int:
    """The K loop's stages (the x tile and the head's three weight tiles; one 8-byte mbarrier a stage
    with TMA), or, if larger, the attention's operands after the loop (q, k, v and p in fp16)."""
    sp = seq_tile(p.seq)
    loop = c.num_stages * ((sp + 3 * p.head_dim) * c.block_k * p.dtype_bytes + 8 * c.tma)
    return max(loop, (3 * sp * p.head_dim + sp * sp) * 2)


def check(config: GemmConfig, problem: QkvAttnProblem, device: DeviceInfo | None = None) -> str | None:
    """Why the fused QKV + attention cannot run ``problem`` with the QKV config's tiles; None when it can."""
    c, p = config, problem
    if p.seq > SEQ_MAX:
        return f"fused QKV + attention needs seq <= {SEQ_MAX} (one program holds a head's K and V), got {p.seq}"
    if not pow2(p.head_dim) or not 16 <= p.head_dim <= 128:
        return f"fused QKV + attention needs a power-of-two head_dim in 16..128, got {p.head_dim}"
    if not pow2(c.block_k) or c.block_k < 16 or c.block_k > tile_cap(p.d_model):
        return f"block_k={c.block_k} must be a power of two in 16..{tile_cap(p.d_model)}"
    if c.num_warps not in (4, 8, 16):
        return f"num_warps={c.num_warps} must be 4, 8 or 16 for the fused QKV + attention"
    if c.num_stages < 1 or c.num_stages > 8:
        return f"num_stages={c.num_stages} must be in 1..8"
    sp = seq_tile(p.seq)
    regs = (3 * sp * p.head_dim) // (32 * c.num_warps)
    if regs > 128:
        return (f"three {sp}x{p.head_dim} fp32 accumulators need {regs} registers per thread "
                f"(> 128 with num_warps={c.num_warps})")
    if c.tma not in (0, 1):
        return f"tma={c.tma} must be 0 or 1"
    if c.tma and (p.d_model * p.dtype_bytes) % 16:
        return f"tma=1 needs rows of 16-byte multiples (d_model={p.d_model} x {p.dtype_bytes} B)"
    limit = smem_limit(device)
    need = smem_bytes(c, p)
    if need > limit:
        return f"shared memory {need} B > {limit} B (num_stages*(seq+3*head_dim)*block_k*bytes)"
    for name in ("overlap_ratio", "prefetch_ratio"):
        r = getattr(c, name)
        if math.isnan(r) or r > 1.0:
            return f"{name}={r} must be negative (off) or in [0, 1]"
    return None


def repair(config: GemmConfig, problem: QkvAttnProblem, device: DeviceInfo | None = None) -> GemmConfig:
    """The nearest config that passes :func:`check` on resources: more warps (up to 16) until the three
    accumulators fit the registers, then fewer stages until the shared memory fits."""
    from dataclasses import replace

    c = replace(config, num_warps=max(config.num_warps, 4))
    sp = seq_tile(problem.seq)
    while c.num_warps < 16 and (3 * sp * problem.head_dim) // (32 * c.num_warps) > 128:
        c = replace(c, num_warps=c.num_warps * 2)
    while c.num_stages > 1 and smem_bytes(c, problem) > smem_limit(device):
        c = replace(c, num_stages=c.num_stages - 1)
    return c


@triton.jit
def _qkv_attn_kernel(
    x_ptr, w_ptr, bias_ptr, u_ptr, ln_stats_ptr, out_ptr,
    # TMA descriptors of x [M, D] and w [3D, D] (USE_TMA; else the same pointers again, unused)
    x_desc, w_desc,
    M, D, seq, heads,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    trigger_k, n_prefetch, ln_eps, ln_parts, qk_scale,
    SEQ_P: tl.constexpr, HD: tl.constexpr, BLOCK_K: tl.constexpr, HAS_LN: tl.constexpr,
    LN_STATS_IN: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, USE_TMA: tl.constexpr,
    UPCAST: tl.constexpr, LINES: tl.constexpr, LINE_ELEMS: tl.constexpr, RACY_READ_BEFORE_WAIT: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // heads
    h = pid % heads
    row0 = b * seq
    offs_s = tl.arange(0, SEQ_P)
    rows = row0 + offs_s
    mask_s = offs_s < seq
    offs_d = tl.arange(0, HD)
    offs_k = tl.arange(0, BLOCK_K)
    # The head's columns of q, k and v in W_qkv's rows (and in the bias, the colsums).
    cq = h * HD + offs_d
    ck = D + cq
    cv = 2 * D + cq
    k_tiles = tl.cdiv(D, BLOCK_K)

    if PREFETCH:
        # Weights only, before gdc_wait: the head's three slices of the first n_prefetch K tiles.
        lines = tl.arange(0, LINES) * LINE_ELEMS
        for i in range(0, tl.minimum(n_prefetch, k_tiles)):
            k_idx = tl.minimum(i * BLOCK_K + lines, D)
            prefetch_l2(w_ptr + cq[:, None] * stride_wn + k_idx[None, :] * stride_wk)
            prefetch_l2(w_ptr + ck[:, None] * stride_wn + k_idx[None, :] * stride_wk)
            prefetch_l2(w_ptr + cv[:, None] * stride_wn + k_idx[None, :] * stride_wk)

    x_rows = x_ptr + rows[:, None] * stride_xm
    row_ok = rows[:, None] < M
    if RACY_READ_BEFORE_WAIT:
        # Test-only defect: reads x before gdc_wait. The correctness gate must catch it.
        a0 = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=row_ok & (offs_k[None, :] < D), other=0.0)
    pdl_wait(USE_PDL)
    pdl_trigger(0, trigger_k, USE_PDL)
    acc_q = tl.zeros((SEQ_P, HD), dtype=tl.float32)
    acc_k = tl.zeros((SEQ_P, HD), dtype=tl.float32)
    acc_v = tl.zeros((SEQ_P, HD), dtype=tl.float32)
    if HAS_LN:
        s1 = tl.zeros((SEQ_P,), dtype=tl.float32)
        s2 = tl.zeros((SEQ_P,), dtype=tl.float32)
    for i in range(0, k_tiles):
        kk = i * BLOCK_K + offs_k
        if USE_TMA:
            a = x_desc.load([row0, i * BLOCK_K])
            wq = w_desc.load([h * HD, i * BLOCK_K]).T
            wk = w_desc.load([D + h * HD, i * BLOCK_K]).T
            wv = w_desc.load([2 * D + h * HD, i * BLOCK_K]).T
        else:
            a = tl.load(x_rows + kk[None, :] * stride_xk, mask=row_ok & (kk[None, :] < D), other=0.0)
            kmask = kk[:, None] < D
            wq = tl.load(w_ptr + cq[None, :] * stride_wn + kk[:, None] * stride_wk, mask=kmask, other=0.0)
            wk = tl.load(w_ptr + ck[None, :] * stride_wn + kk[:, None] * stride_wk, mask=kmask, other=0.0)
            wv = tl.load(w_ptr + cv[None, :] * stride_wn + kk[:, None] * stride_wk, mask=kmask, other=0.0)
        if RACY_READ_BEFORE_WAIT:
            if i == 0:
                a = a0
        if HAS_LN and not LN_STATS_IN:
            # Row sums from a second (volatile) load of the tile, as in the GEMM (see gemm._gemm_kernel).
            af = tl.load(x_rows + kk[None, :] * stride_xk, mask=row_ok & (kk[None, :] < D), other=0.0,
                         volatile=True).to(tl.float32)
            s1 += tl.sum(af, axis=1)
            s2 += tl.sum(af * af, axis=1)
        if UPCAST:
            a = a.to(tl.float32)
            wq = wq.to(tl.float32)
            wk = wk.to(tl.float32)
            wv = wv.to(tl.float32)
        acc_q = tl.dot(a, wq, acc_q)
        acc_k = tl.dot(a, wk, acc_k)
        acc_v = tl.dot(a, wv, acc_v)
        pdl_trigger(i + 1, trigger_k, USE_PDL)

    if HAS_LN:
        if LN_STATS_IN:
            s1, s2 = _row_stats_in(ln_stats_ptr, rows, M, ln_parts, SEQ_P)
        acc_q = _ln_correct(acc_q, s1, s2, u_ptr, cq, 3 * D, D, ln_eps)
        acc_k = _ln_correct(acc_k, s1, s2, u_ptr, ck, 3 * D, D, ln_eps)
        acc_v = _ln_correct(acc_v, s1, s2, u_ptr, cv, 3 * D, D, ln_eps)
    # Rounded to the activation dtype, as the unfused QKV GEMM stores them; rows past the sequence (the
    # next batch's or zero padding) are zeroed so that they add nothing below.
    dt = out_ptr.dtype.element_ty
    q = (acc_q + tl.load(bias_ptr + cq).to(tl.float32)[None, :]).to(dt)
    k = tl.where(mask_s[:, None], acc_k + tl.load(bias_ptr + ck).to(tl.float32)[None, :], 0.0).to(dt)
    v = tl.where(mask_s[:, None], acc_v + tl.load(bias_ptr + cv).to(tl.float32)[None, :], 0.0).to(dt)
    if UPCAST:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    valid = mask_s[None, :] & (offs_s[:, None] >= offs_s[None, :])
    s = tl.where(valid, s, float("-inf"))
    m = tl.max(s, 1)
    p = tl.math.exp2(s - m[:, None])
    l_i = tl.sum(p, 1)
    o = tl.dot(p.to(v.dtype), v) / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_om + cq[None, :] * stride_on, o.to(dt), mask=mask_s[:, None])


def qkv_attention(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, batch: int, seq: int, heads: int,
                  config: GemmConfig = GemmConfig(), out: torch.Tensor | None = None,
                  ln_colsum: torch.Tensor | None = None, ln_eps: float = 1e-5, ln_stats: torch.Tensor | None = None,
                  _racy_read_before_wait: bool = False) -> torch.Tensor:
    """Causal ``attention(LN(x) @ weight.T + bias)`` per (batch, head); x ``[batch*seq, D]``, weight
    ``[3D, D]`` (q, k, v blocks of rows, head h at rows ``h*head_dim`` of each), out ``[batch*seq, D]``.

    LayerNorm: pass the folded weight and bias with ``ln_colsum`` (gemm.fold_layernorm), and ``ln_stats``
    (``[parts, M, 2]``, from the producer of x) or none (the row sums are gathered in the K loop).
    """
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"qkv_attention: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be 2-D")
    M, D = x.shape
    if M != batch * seq or heads < 1 or D % heads or tuple(weight.shape) != (3 * D, D):
        raise ValueError(f"qkv_attention: x {tuple(x.shape)}, weight {tuple(weight.shape)} do not fit "
                         f"batch={batch} seq={seq} heads={heads} (x [batch*seq, D], weight [3D, D])")
    if bias is None or tuple(bias.shape) != (3 * D,):
        raise ValueError(f"qkv_attention: bias must be ({3 * D},)")
    if x.dtype != weight.dtype:
        raise ValueError(f"qkv_attention: x is {x.dtype} but weight is {weight.dtype}")
    hd = D // heads
    p = QkvAttnProblem(batch, seq, heads, hd, x.element_size())
    why = check(config, p, DeviceInfo.from_torch(x.device) if x.is_cuda else None)
    if why:
        raise ValueError(f"qkv_attention: invalid config for batch={batch} seq={seq} heads={heads}: {why}")
    if ln_colsum is not None and (ln_colsum.shape != (3 * D,) or ln_colsum.dtype != torch.float32):
        raise ValueError(f"qkv_attention: ln_colsum must be fp32 ({3 * D},)")
    if ln_stats is not None and (ln_colsum is None or ln_stats.dim() != 3 or ln_stats.shape[1:] != (M, 2)
                                 or ln_stats.dtype != torch.float32):
        raise ValueError(f"qkv_attention: ln_stats must be fp32 [parts, {M}, 2] and come with ln_colsum")
    if out is None:
        out = torch.empty((M, D), device=x.device, dtype=x.dtype)
    elif tuple(out.shape) != (M, D) or out.dtype != x.dtype:
        raise ValueError(f"qkv_attention: out {tuple(out.shape)} {out.dtype} must be ({M}, {D}) {x.dtype}")
    mode = launch_mode(x)
    c = effective_config(config, x)
    use_pdl = c.overlap_ratio >= 0
    k_tiles = triton.cdiv(D, c.block_k)
    n_pref = prefetch_count(k_tiles, c.prefetch_ratio)
    sp = seq_tile(seq)
    if c.tma:
        for name, t in (("x", x), ("weight", weight)):
            if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
                raise ValueError(f"qkv_attention: tma=1 needs {name} with contiguous, 16-byte aligned rows "
                                 f"(strides {tuple(t.stride())})")
        x_desc = TensorDescriptor(x, [M, D], list(x.stride()), [sp, c.block_k])
        w_desc = TensorDescriptor(weight, [3 * D, D], list(weight.stride()), [hd, c.block_k])
    else:
        x_desc, w_desc = x, weight
    dummy = out
    _qkv_attn_kernel[(batch * heads,)](
        x, weight, bias, ln_colsum if ln_colsum is not None else dummy, ln_stats if ln_stats is not None else dummy,
        out, x_desc, w_desc,
        M, D, seq, heads,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        trigger_index(k_tiles, c.overlap_ratio), n_pref, ln_eps, ln_stats.shape[0] if ln_stats is not None else 0,
        _LOG2E / math.sqrt(hd),
        SEQ_P=sp, HD=hd, BLOCK_K=c.block_k, HAS_LN=ln_colsum is not None, LN_STATS_IN=ln_stats is not None,
        USE_PDL=use_pdl, PREFETCH=n_pref > 0, USE_TMA=bool(c.tma),
        UPCAST=mode.upcast_bf16 and x.dtype == torch.bfloat16, LINES=max(1, c.block_k * x.element_size() // 128),
        LINE_ELEMS=128 // x.element_size(), RACY_READ_BEFORE_WAIT=_racy_read_before_wait,
        num_warps=c.num_warps, num_stages=c.num_stages, launch_pdl=use_pdl,
    )
    return out


def qkv_attention_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, batch: int, seq: int,
                      heads: int, ln_weight: torch.Tensor | None = None, ln_bias: torch.Tensor | None = None,
                      ln_eps: float = 1e-5) -> torch.Tensor:
    """fp32 torch reference (LayerNorm given unfolded, as ``ln_weight``/``ln_bias``)."""
    from .attention import attention_ref
    from .gemm import linear_ref

    qkv = linear_ref(x, weight, bias, ln_weight=ln_weight, ln_bias=ln_bias, ln_eps=ln_eps)
    return attention_ref(qkv, batch=batch, seq=seq, heads=heads, head_dim=x.shape[1] // heads)
