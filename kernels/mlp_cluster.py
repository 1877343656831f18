"""The feed-forward block in one kernel (``mlp_cluster.cu``; Hopper): FFN1, its activation and FFN2 with the hidden
activations kept on chip, the hidden dimension split over a thread-block cluster.

For a small d_model with F = fs x SC hidden columns: fs = 128 hidden columns a CTA and a cluster of SC = 2, 4 or 8,
or fs = 64 and SC = 2 to 16 (half the work a CTA, twice the CTAs; a cluster of 16 is beyond the portable 8). tiny
(d 256, F 1024): 8 CTAs of 128 or 16 of 64, each times 2 column groups. Built with nvcc on first use and called through
ctypes like ``cluster_gemm``; :func:`mlp_ref` is its torch reference.

With ``wo`` (``out.fuse`` 1) the kernel also computes the attention's out-projection in front of the block, each CTA
one 64-column tile of it, gathered in the cluster (needs the cluster a multiple of d / 64 CTAs).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from tuner.names import MAX_LN_PARTS  # mlp_cluster.cu's too: the producer's row-sum parts LN_IN reads

from . import _nvcc
from ._common import GRID_YZ_LIMIT, SMEM_DEFAULT_BYTES, compiling

SOURCE = Path(__file__).with_name("mlp_cluster.cu")
COLUMNS_PER_GROUP = 128  # mlp_cluster.cu's NG
SPLITS = {128: (2, 4, 8), 64: (2, 4, 8, 16)}  # hidden columns a CTA (mlp_cluster.cu's FS) -> cluster sizes
TRACE_SLOTS = 8  # a traced launch's int64 stamps a program (launch's ``trace``)
B1_F32, ATT_IN, LN_IN, STATS_OUT, OUT_IN = 2, 4, 8, 16, 32
USE_PDL = 64
# Called as launch_enter_hook(kernel name, launched with PDL) before every launch (tune verify's launch census, as
# cluster_gemm.launch_enter_hook); None: no hook.
launch_enter_hook = None
LAUNCH_ARGTYPES = ([ctypes.c_void_p] * 13 + [ctypes.c_int] * 12
                   + [ctypes.c_float, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int])
_LIBS: dict[tuple[int, ...], ctypes.CDLL] = {}


def token_tile(m: int) -> int:
    return 32 if m <= 32 else 64


def smem_bytes(d: int, sc: int, bt: int, fs: int = 128, out_proj: bool = False, attn: bool = False) -> int:
    """mlp_cluster.cu's mlp_smem_bytes: the weights (fs x d of w1, 128 x fs of w2), the token tile, h, the partial
    and the slabs received, with ``out_proj`` 64 rows of wo, x's token tile and its row sums, then mbarriers and the
    LayerNorm's row factors; with ``attn`` K's and V's token tiles too."""
    xr, r = bt + 8, COLUMNS_PER_GROUP // sc
    out_in = (d // 64) * (64 * 128 + bt * 128 + bt * 8) if out_proj else 0
    att_in = 2 * (d // 64) * bt * 128 if attn else 0
    return (1024 + (d // 64) * fs * 128 + (fs // 64) * 16384 + (d // 64) * bt * 128 + (fs // 64) * bt * 128
            + COLUMNS_PER_GROUP * xr * 2 + sc * r * xr * 2 + att_in + out_in + 48 + bt * 8)


def error(m: int, d: int, f: int, dtype_bytes: int = 2, smem_limit: int = SMEM_DEFAULT_BYTES, fs: int = 128,
          out_proj: bool = False, attn: bool = False) -> str | None:
    """Why the kernel cannot run this feed-forward block with ``fs`` hidden columns a CTA (and with ``out_proj`` the
    out-projection in front, with ``attn`` the attention before it); None when it can."""
    if dtype_bytes != 2:
        return "needs 16-bit operands"
    if fs not in SPLITS:
        return f"needs {sorted(SPLITS)} hidden columns a CTA, not {fs}"
    if f % fs or f // fs not in SPLITS[fs]:
        return f"needs ffn = {fs} x {SPLITS[fs]} hidden columns, not {f}"
    if d % COLUMNS_PER_GROUP or d > 512:
        return f"needs d_model a multiple of 128 up to 512, not {d}"
    if out_proj and (f // fs) % (d // 64):
        return f"needs the cluster ({f // fs} CTAs) a multiple of d_model / 64 = {d // 64} for the out-projection"
    if attn and (not out_proj or m > 64):
        return "needs the out-projection in the block and up to 64 tokens for the attention in it"
    tiles = -(-m // token_tile(m))
    if tiles > GRID_YZ_LIMIT:  # (its grid: column groups, token tiles, CTAs a cluster)
        return f"needs at most {GRID_YZ_LIMIT} token tiles of {token_tile(m)} (a grid axis), not {tiles}"
    need = smem_bytes(d, f // fs, token_tile(m), fs, out_proj, attn)
    if need > smem_limit:
        return f"needs {need} B of shared memory (> {smem_limit})"
    return None


def programs(m: int, d: int, f: int, fs: int = 128) -> tuple[int, int]:
    """(tiles, splits) of a launch: (column groups x token tiles, CTAs a cluster); program = tile + tiles * split."""
    return d // COLUMNS_PER_GROUP * -(-m // token_tile(m)), f // fs


def stats_parts(d: int, f: int, fs: int = 128) -> int:
    """How many column parts its row sums come in (one a CTA: 128 / SC columns each)."""
    return d // (COLUMNS_PER_GROUP // (f // fs))


def library(bf16: int, sc: int, epi: int, bt: int, d: int, fs: int = 128, hints: int = 0,
            diag: int = 0) -> ctypes.CDLL:
    key = (bf16, sc, epi, bt, d, fs, _nvcc.build_key(), hints, diag)
    if key in _LIBS:
        return _LIBS[key]
    lib = _nvcc.build(SOURCE, {"MLP_BF16": bf16, "MLP_SC": sc, "MLP_EPI": epi, "MLP_BT": bt, "MLP_D": d, "MLP_FS": fs,
                                  "HOPPER_CACHE_HINTS": hints, "MLP_DIAG": diag},
                      "mlp")
    lib.mlp_launch.argtypes = LAUNCH_ARGTYPES
    lib.mlp_launch.restype = ctypes.c_int
    lib.mlp_smem_bytes.restype = ctypes.c_int
    variant = bf16 | (sc << 1) | (epi << 8) | (bt << 16) | ((d // 64) << 24) | ((fs // 64) << 29)
    if (lib.mlp_smem_bytes() != smem_bytes(d, sc, bt, fs, bool(epi & OUT_IN), bool(epi & ATT_IN))
            or lib.mlp_variant() != variant or lib.mlp_diag() != diag or lib.mlp_trace_slots() != TRACE_SLOTS):
        raise RuntimeError(f"mlp: {lib._name} does not match mlp_cluster.py "
                           "(shared-memory layout, variant or trace slots)")
    _LIBS[key] = lib
    return lib


def weight_tiles(d: int, fs: int = 128, out_proj: bool = False) -> int:
    """A CTA's 64-wide weight tiles, in the order the kernel loads them: wo's 64 rows (with the out-projection),
    its w1 slice's, its w2 slice's."""
    return (d // 64 if out_proj else 0) + d // 64 + fs // 64


def early_tiles(prefetch: float, d: int, fs: int = 128, out_proj: bool = False) -> int:
    """How many of :func:`weight_tiles` go into shared memory before griddepcontrol.wait for a prefetch ratio
    (``ffn1.prefetch_ratio``): ``ceil(prefetch * tiles)``, none at -1 (no prefetch), as a GEMM's K tiles."""
    from ._common import prefetch_count

    return prefetch_count(weight_tiles(d, fs, out_proj), prefetch)


def launch(x, w1, b1, w2, b2, residual, out, *, act=3, stats_out=None, ln_stats=None, ln_colsum=None, ln_eps=1e-5,
           pdl=False, racy=False, trace=None, fs=128, wo=None, bo=None, qkv=None, prefetch=1.0,
           hints=0) -> None:
    """``out = act(x @ w1.T + b1) @ w2.T + b2 + residual`` on the current stream (one launch). With ``ln_stats``
    ([parts, M, 2] fp32 row sums of x from its producer) and ``ln_colsum``, w1 and b1 are LayerNorm-folded
    (gemm.fold_layernorm) and the first epilogue applies the norm. ``stats_out`` ([stats_parts, M, 2] fp32): the
    output rows' sums for the next LayerNorm. ``act``: 0 none, 1 GELU (tanh form), 2 SiLU, 3 GELU by tanh.approx.
    ``pdl``: launched with PDL (griddepcontrol.wait before x and residual are read; the dependents launched right
    after it). ``racy``: the test-only defect that loads x before the wait (the correctness gate must catch it).
    ``trace``: int64 [programs, TRACE_SLOTS] %globaltimer stamps (entry, wait returned, both GEMMs done, end, then w1
    landed, x landed, the first GEMM done, the exchange done; programs: :func:`programs`), for scripts/trace_gemms.py.
    ``fs``: hidden columns a CTA, 128 or 64 (:data:`SPLITS`). ``prefetch``: the share of the CTA's weight tiles
    loaded before the wait (:func:`early_tiles`); the others are loaded right after x.

    With ``wo`` and ``bo`` ([D, D], [D]: the out-projection), ``x`` is the attention output and the block's input is
    ``residual + x @ wo.T + bo``, computed in the kernel and never written out; it is also the block's residual. With
    LayerNorm folded (``ln_colsum``), its row sums come from the kernel itself: no ``ln_stats``. With ``qkv`` ([M, 3D],
    batch 1, heads of 64: attn.fuse 1, ATT_IN) the kernel computes the causal attention from it too, and ``x`` is
    not read. ``hints``: L2 eviction hints on the TMA loads (hopper.cuh's HOPPER_CACHE_HINTS): bit 0 the weights
    evict-first, bit 1 the activations evict-last (GemmConfig.hints 1 is 3)."""
    M, D = x.shape
    Fh = w1.shape[0]
    out_proj = wo is not None
    why = error(M, D, Fh, x.element_size(), fs=fs, out_proj=out_proj, attn=qkv is not None)
    if why:
        raise ValueError(f"mlp: {why}")
    if out_proj != (bo is not None):
        raise ValueError("mlp: wo and bo go together")
    if qkv is not None and qkv.shape != (M, 3 * D):
        raise ValueError(f"mlp: qkv must be [{M}, {3 * D}]")
    for name, t in (("x", x), ("w1", w1), ("w2", w2), ("residual", residual), ("out", out), ("wo", wo), ("qkv", qkv)):
        if t is not None and (t.stride(-1) != 1 or t.stride(0) % 8 or t.data_ptr() % 16):
            raise ValueError(f"mlp: {name} must have unit column stride, 16-byte aligned rows")
    if out_proj:
        if ln_stats is not None:
            raise ValueError("mlp: with wo the LayerNorm's row sums come from the kernel: no ln_stats")
    elif (ln_stats is None) != (ln_colsum is None):
        raise ValueError("mlp: ln_stats and ln_colsum go together")
    if ln_stats is not None and not 1 <= ln_stats.shape[0] <= MAX_LN_PARTS:
        raise ValueError(f"mlp: ln_stats has {ln_stats.shape[0]} parts (1..{MAX_LN_PARTS})")
    sc = Fh // fs
    if stats_out is not None and stats_out.shape != (stats_parts(D, Fh, fs), M, 2):
        raise ValueError(f"mlp: stats_out must be [{stats_parts(D, Fh, fs)}, {M}, 2]")
    epi = ((B1_F32 if b1.dtype == torch.float32 else 0) | (LN_IN if ln_colsum is not None else 0)
           | (STATS_OUT if stats_out is not None else 0) | (OUT_IN if out_proj else 0)
           | (ATT_IN if qkv is not None else 0) | (act << 6))
    bt = token_tile(M)
    lib = library(int(x.dtype == torch.bfloat16), sc, epi, bt, D, fs, hints, _nvcc.diag(trace, racy))
    if compiling():  # (compile_only: the build is this launch's whole work)
        return
    if launch_enter_hook is not None:
        launch_enter_hook("mlp_kernel", pdl)
    err = ctypes.create_string_buffer(512)
    p = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
    src = x if qkv is None else qkv  # (ATT_IN: the kernel's x_map reads qkv)
    rc = lib.mlp_launch(p(src), p(w1), p(w2), p(b1), p(b2), p(residual), p(out), p(stats_out), p(ln_stats),
                        p(ln_colsum), p(trace), p(wo), p(bo), M, D, Fh, src.stride(0), w1.stride(0), w2.stride(0),
                        residual.stride(0), out.stride(0), USE_PDL if pdl else 0,
                        ln_stats.shape[0] if ln_stats is not None else 0, wo.stride(0) if out_proj else 0,
                        early_tiles(prefetch, D, fs, out_proj) if pdl else weight_tiles(D, fs, out_proj), ln_eps,
                        torch.cuda.current_stream(x.device).cuda_stream, err, len(err))
    if rc != 0:
        raise RuntimeError(err.value.decode(errors="replace"))


def attention_ref(qkv: torch.Tensor) -> torch.Tensor:
    """Causal attention of one sequence from qkv [M, 3D] (heads of 64), rounded to qkv's dtype: [M, D]."""
    m, d = qkv.shape[0], qkv.shape[1] // 3
    q, k, v = (qkv[:, i * d:(i + 1) * d].float().view(m, d // 64, 64).transpose(0, 1) for i in range(3))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return a.transpose(0, 1).reshape(m, d).to(qkv.dtype)


def mlp_ref(x, w1, b1, w2, b2, residual, *, ln=None, eps=1e-5, wo=None, bo=None) -> torch.Tensor:
    """fp32 reference: ``residual + gelu_tanh(LN(x) @ w1.T + b1) @ w2.T + b2``, ``ln`` = (gamma, beta) or None. With
    ``wo``, ``bo``: the input is first ``residual + x @ wo.T + bo``, rounded to x's dtype as the kernel keeps it, and
    is the residual."""
    if wo is not None:
        x = (residual.float() + F.linear(x.float(), wo.float(), bo.float())).to(x.dtype)
        residual = x
    x32 = x.float()
    if ln is not None:
        x32 = F.layer_norm(x32, (x.shape[1],), ln[0].float(), ln[1].float(), eps)
    h = F.gelu(F.linear(x32, w1.float(), b1.float()), approximate="tanh")
    return residual.float() + F.linear(h, w2.float(), b2.float())
