"""LayerNorm and RMSNorm with an optional fused residual add, PDL and L2 weight prefetch.

One kernel serves both norms (constexpr ``IS_RMS``). Each program normalises ``rows_per_program``
consecutive rows, the whole row in registers (``BLOCK = next_power_of_2(cols)``), fp32 math inside.
With ``residual`` it first forms ``s = x + residual`` in fp32, stores ``s`` (in ``residual_out``'s dtype)
and normalises ``s``. The knobs follow the GEMM (DESIGN.md):

* ``overlap_ratio < 0``: launched without PDL, no early trigger. In ``[0, 1]``: launched with PDL; every
  program calls ``gdc_wait`` before its first read of ``x``/``residual`` and before any global write, and
  ``gdc_launch_dependents`` after ``floor((rows_per_program - 1) * overlap_ratio)`` rows of its row loop
  (after 0 rows: at the start, before ``gdc_wait``, so that the next kernel launches and prefetches its
  weights while this one still waits).
* ``prefetch_ratio`` in ``[0, 1]``: before ``gdc_wait`` each program pulls the first
  ``ceil(prefetch_ratio * n_lines)`` of the 128-byte lines of gamma (and beta) into L2. Weights only:
  nothing a predecessor writes is touched before the wait.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tuner.device import DeviceInfo

from ._common import (KnobConfig, effective_config, launch, launch_field_error, pdl_trigger, pdl_wait, pow2,
                      prefetch_count, prefetch_l2, ratio_error, trigger_index)

MAX_COLS = 65536  # the whole row lives in registers
MAX_ROWS_PER_PROGRAM = 64


@dataclass(frozen=True)
class NormConfig(KnobConfig):
    rows_per_program: int = 1
    num_warps: int = 4
    overlap_ratio: float = -1.0
    prefetch_ratio: float = -1.0
    # 1: no norm kernel; the next GEMM normalises its input rows in its prologue (gemm.linear(ln_weight=...)).
    # The layer runtime reads this; layer_norm() itself ignores it.
    fuse: int = 0


@dataclass(frozen=True)
class NormProblem:
    rows: int
    cols: int
    dtype_bytes: int = 2




def field_error(c: NormConfig) -> str | None:
    """Why a field of ``c`` is invalid whatever the problem (the search space refuses such a choice when it is
    read); None when each field alone can run. The first rules of :func:`check`."""
    if not pow2(c.rows_per_program) or c.rows_per_program > MAX_ROWS_PER_PROGRAM:
        return f"rows_per_program={c.rows_per_program} must be a power of two in 1..{MAX_ROWS_PER_PROGRAM}"
    return launch_field_error(c, stages=False)


def check(config: NormConfig, problem: NormProblem, device: DeviceInfo | None = None) -> str | None:
    """Why ``config`` cannot (or should not) run ``problem``; None when it is valid.

    The one validity rule: the search space, the evaluator and the tests all call this.
    """
    c, p = config, problem
    rpp = c.rows_per_program
    why = field_error(c)
    if why:
        return why
    if p.cols < 1 or p.cols > MAX_COLS:
        return f"cols={p.cols} must be in 1..{MAX_COLS} (the whole row is held in registers)"
    # More rows per program than the problem has is the same program with masked-off iterations.
    cap = max(1, triton.next_power_of_2(max(p.rows, 1)))
    if rpp > cap:
        return f"rows_per_program={rpp} exceeds the problem ({p.rows} rows -> {cap})"
    return ratio_error("overlap_ratio", c.overlap_ratio) or ratio_error("prefetch_ratio", c.prefetch_ratio)


def _lines(cols: int, elem_bytes: int) -> int:
    """The 128-byte lines of a weight vector of ``cols`` elements."""
    return triton.cdiv(cols * elem_bytes, 128)


def launch_knobs(c: NormConfig, cols: int, elem_bytes: int) -> tuple[int, int]:
    """What a launch over rows of ``cols`` elements of ``elem_bytes`` reads of ``c``'s two ratios: the rows a program
    completes before its trigger (-1: no PDL) and the weight lines it prefetches. The one place these are computed:
    the launch reads them, and so does the study's launch key (tuner.layer.launch_key), so two ratios that launch the
    same are measured once."""
    return trigger_index(c.rows_per_program, c.overlap_ratio), prefetch_count(_lines(cols, elem_bytes),
                                                                              c.prefetch_ratio)


@triton.jit
def _norm_kernel(
    # pointers
    x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr,
    # sizes
    M, N, eps,
    # strides (rows; columns are contiguous)
    stride_xm, stride_rm, stride_om, stride_rom,
    # PDL / prefetch points: rows done before the trigger, the weight lines to prefetch
    trigger_row, n_lines,
    # meta-parameters
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, LINES: tl.constexpr,
    LINE_ELEMS: tl.constexpr,
    RACY_READ_BEFORE_WAIT: tl.constexpr,
):
    pid = tl.program_id(0)
    row0 = pid * ROWS
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N

    if PREFETCH:
        # gamma/beta do not depend on the predecessor: pull their first n_lines 128-byte lines into L2
        # while it is still running. One pointer per line, clamped inside the vector (repeats are harmless).
        line = tl.minimum(tl.arange(0, LINES), n_lines - 1)
        idx = tl.minimum(line * LINE_ELEMS, N - 1)
        prefetch_l2(w_ptr + idx)
        if HAS_BIAS:
            prefetch_l2(b_ptr + idx)

    if RACY_READ_BEFORE_WAIT:
        # Test-only defect: reads x before gdc_wait. The correctness gate must catch it.
        x0 = tl.load(x_ptr + row0 * stride_xm + cols, mask=cmask & (cols * 0 + row0 < M), other=0.0)
    pdl_trigger(0, trigger_row, USE_PDL)
    pdl_wait(USE_PDL)

    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    for r in range(0, ROWS):
        row = row0 + r
        # (the row test broadcast over the columns: triton 3.9's interpreter refuses a mask that combines a
        # tensor with a scalar condition, 'mask has unsupported dtype'; compiled, it is the same compare)
        mask = cmask & (cols * 0 + row < M)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0)
        if RACY_READ_BEFORE_WAIT:
            if r == 0:
                x = x0
        x = x.to(tl.float32)
        if HAS_RES:
            x += tl.load(res_ptr + row * stride_rm + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(res_out_ptr + row * stride_rom + cols, x.to(res_out_ptr.dtype.element_ty), mask=mask)
        if IS_RMS:
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
            y = x * rstd * w
        else:
            mean = tl.sum(x, axis=0) / N
            xc = tl.where(cmask, x - mean, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
            y = xc * rstd * w
            if HAS_BIAS:
                y += b
        tl.store(out_ptr + row * stride_om + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
        pdl_trigger(r + 1, trigger_row, USE_PDL)




def _rows_contiguous(name: str, t: torch.Tensor, shape: tuple[int, ...], fn: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{fn}: {name} {tuple(t.shape)} must be {shape}")
    if t.numel() and shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{fn}: {name} must be contiguous in its last dimension (stride {t.stride()})")


def _norm(fn, x, weight, bias, eps, config, residual, out, residual_out, is_rms, racy):
    if x.dim() != 2:
        raise ValueError(f"{fn}: x {tuple(x.shape)} must be [M, D]")
    M, N = x.shape
    why = check(config, NormProblem(M, N, x.element_size()),
                DeviceInfo.from_torch(x.device) if x.is_cuda else None)
    if why:
        raise ValueError(f"{fn}: invalid NormConfig for rows={M} cols={N}: {why}")
    _rows_contiguous("x", x, (M, N), fn)
    _rows_contiguous("weight", weight, (N,), fn)
    if bias is not None:
        _rows_contiguous("bias", bias, (N,), fn)
        if bias.dtype != weight.dtype:
            raise ValueError(f"{fn}: bias is {bias.dtype} but weight is {weight.dtype}")
    if out is None:
        out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    _rows_contiguous("out", out, (M, N), fn)
    if residual is not None:
        _rows_contiguous("residual", residual, (M, N), fn)
        if residual_out is None:
            residual_out = torch.empty((M, N), device=x.device, dtype=x.dtype)
        _rows_contiguous("residual_out", residual_out, (M, N), fn)
    elif residual_out is not None:
        raise ValueError(f"{fn}: residual_out given without residual")
    if M == 0:
        return (out, residual_out) if residual is not None else out

    c = effective_config(config, x)
    use_pdl = c.overlap_ratio >= 0
    rpp = c.rows_per_program
    total_lines = _lines(N, weight.element_size())
    trigger, n_lines = launch_knobs(c, N, weight.element_size())
    dummy = out  # never read or written when the matching HAS_* flag is off
    grid = (triton.cdiv(M, rpp),)
    launch(_norm_kernel, grid,
        x, residual if residual is not None else dummy, weight, bias if bias is not None else dummy, out,
        residual_out if residual_out is not None else dummy,
        M, N, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        residual_out.stride(0) if residual_out is not None else 0,
        trigger, n_lines,
        BLOCK_N=triton.next_power_of_2(N), ROWS=rpp, IS_RMS=is_rms, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, USE_PDL=use_pdl, PREFETCH=n_lines > 0,
        LINES=triton.next_power_of_2(total_lines), LINE_ELEMS=128 // weight.element_size(),
        RACY_READ_BEFORE_WAIT=racy,
        num_warps=c.num_warps, num_stages=1, launch_pdl=use_pdl,
    )
    return (out, residual_out) if residual is not None else out


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, eps: float = 1e-5,
               config: NormConfig = NormConfig(), residual: torch.Tensor | None = None,
               out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
               _racy_read_before_wait: bool = False):
    """``LayerNorm(x) * weight + bias`` over the last dim of x ``[M, D]``, fp32 statistics.

    With ``residual``: ``s = x + residual`` (fp32, stored into ``residual_out``, allocated in x's dtype if
    None) and returns ``(LayerNorm(s) * weight + bias, residual_out)``.
    """
    return _norm("layer_norm", x, weight, bias, eps, config, residual, out, residual_out, False,
                 _racy_read_before_wait)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6, config: NormConfig = NormConfig(),
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None, _racy_read_before_wait: bool = False):
    """``x / sqrt(mean(x^2) + eps) * weight``; with ``residual`` the same fused add as :func:`layer_norm`."""
    return _norm("rms_norm", x, weight, None, eps, config, residual, out, residual_out, True,
                 _racy_read_before_wait)


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, eps: float = 1e-5,
                   residual: torch.Tensor | None = None):
    """fp32 torch reference of :func:`layer_norm` (returns fp32; ``(normed, s)`` with a residual)."""
    s = x.float() + residual.float() if residual is not None else x.float()
    y = torch.nn.functional.layer_norm(s, (s.shape[-1],), weight.float(),
                                       bias.float() if bias is not None else None, eps)
    return (y, s) if residual is not None else y


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6,
                 residual: torch.Tensor | None = None):
    """fp32 torch reference of :func:`rms_norm` (returns fp32; ``(normed, s)`` with a residual)."""
    s = x.float() + residual.float() if residual is not None else x.float()
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y, s) if residual is not None else y
