"""The decoder layer built from our kernels, a stack of L such layers, and its torch references.

A pre-LN causal decoder layer (DESIGN):
    a = x + out(attn(qkv(norm1(x))))          # residual fused into the out-projection epilogue
    y = a + ffn2(gelu(ffn1(norm2(a))))        # gelu into FFN1's epilogue, residual into FFN2's
Seven kernels (plus one split-K reduction per GEMM with split_k > 1), all launched back to back on
preallocated buffers with no torch op between them, so that a CUDA graph captures one PDL chain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from tuner.config import GEMMS, DecoderConfig
from tuner.device import DeviceInfo
from tuner.kernels import attention as attn_k
from tuner.kernels import fused_layer as fused_k
from tuner.kernels import gemm as gemm_k
from tuner.kernels import norm as norm_k
from tuner.kernels._common import (hopper_error, prefetch_count, rel_error, rel_tolerance, smem_limit, tile_cap,
                                   trigger_index)
from tuner.names import gemm_kernels, reads_l2_hints
from tuner.shapes import DecoderShape

LN_EPS = 1e-5
# tune verify's race checks: how long the predecessor's odd column tiles hold back their stores (ns; gemm.linear's
# _slow_ns, the cluster kernel's held build), far longer than a dependent's launch behind it.
SLOW_NS = gemm_k.cluster_gemm.SLOW_NS
# A racy kernel's name for a GEMM's split-K reduction kernel (the Triton kernels' second launch): "ffn2" + REDUCE.
REDUCE = ".reduce"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def dtype_name(dtype) -> str:
    """``dtype`` (a torch dtype or its name) by the name best.json, the manifests and the command line give it."""
    return str(dtype).removeprefix("torch.")


def element_bytes(name) -> int:
    """Bytes an element of the DTYPES name, as check_config and repair_config count them. Anything else (a best.json
    or an evaluator that names no dtype) counts as float16, the tuner's default."""
    return DTYPES.get(name, torch.float16).itemsize if isinstance(name, str) else torch.float16.itemsize


def mlp_error(shape: DecoderShape, cfg: DecoderConfig, dtype_bytes: int = 2,
              device: DeviceInfo | None = None) -> str | None:
    """Why ``ffn2.fuse`` 1 or 2 (the feed-forward block as one kernel, kernels/mlp_cluster.cu, with 128 or 64 hidden
    columns a CTA), with ``out.fuse`` 1 the out-projection in front of it and with ``attn.fuse`` 1 the attention
    in front of that, cannot run this shape; None when it can (``device`` None: the GPU is not checked)."""
    from tuner.kernels import mlp_cluster

    if cfg.norm2.fuse == 1:
        return "needs norm2.fuse 0 or 2 (the row sums from the out-projection), not 1"
    if cfg.out.fuse and cfg.norm2.fuse != 2:
        return "with out.fuse 1 needs norm2.fuse 2 (LayerNorm 2 folded into the block), not 0"
    if cfg.attn.fuse:
        if not cfg.out.fuse:
            return "with attn.fuse 1 needs out.fuse 1 (the out-projection in the block too)"
        if shape.batch != 1 or shape.head_dim != 64:
            return f"with attn.fuse 1 needs batch 1 and head_dim 64, not {shape.batch} and {shape.head_dim}"
    return (mlp_cluster.error(shape.tokens, shape.d_model, shape.ffn, dtype_bytes, smem_limit(device), mlp_fs(cfg),
                              out_proj=bool(cfg.out.fuse), attn=bool(cfg.attn.fuse))
            or hopper_error(device))


def mlp_fs(cfg: DecoderConfig) -> int:
    """Hidden columns a CTA of the one-kernel feed-forward block: ``ffn2.fuse`` 1 -> 128, 2 -> 64."""
    return 64 if cfg.ffn2.fuse == 2 else 128


def mlp_out_fused(shape: DecoderShape, cfg: DecoderConfig, dtype, device) -> bool:
    """Whether the one-kernel feed-forward block also computes the out-projection (``out.fuse`` 1 where it runs)."""
    return bool(cfg.out.fuse) and mlp_fused(shape, cfg, dtype, device)


def mlp_fused(shape: DecoderShape, cfg: DecoderConfig, dtype, device) -> bool:
    """Whether the layer runs its feed-forward block as one kernel: ``ffn2.fuse`` 1 where it can run (mlp_error),
    on a Hopper GPU and not in the interpreter. Elsewhere FFN1 and FFN2 run their own configs."""
    from tuner.kernels import cluster_gemm

    return (cfg.ffn2.fuse in (1, 2) and not cfg.fused and cluster_gemm.usable(device)
            and mlp_error(shape, cfg, torch.empty(0, dtype=dtype).element_size()) is None)


def qkv_attn_error(shape: DecoderShape, cfg: DecoderConfig, device: DeviceInfo | None = None,
                   dtype_bytes: int = 2) -> str | None:
    """Why ``qkv.fuse`` 1 (the attention computed by the QKV kernel, kernels/qkv_attn.cu) cannot run this shape and
    config; None when it can (``device`` None: the GPU is not checked)."""
    from tuner.kernels import qkv_attn

    if dtype_bytes != 2:
        return "needs 16-bit operands (fp16 or bf16)"
    if cfg.attn.fuse:
        return "needs attn.fuse 0 (with attn.fuse 1 the attention is computed by FFN1's kernel)"
    if cfg.norm1.fuse == 1:
        return "needs norm1.fuse 0 or 2 (the row sums from the previous layer), not 1"
    parts = ln_parts(shape, cfg, dtype_bytes, device).get("qkv")  # the previous layer's FFN2's (norm1.fuse 2)
    return (qkv_attn.error(shape.seq, shape.head_dim, shape.d_model, gemm_k.cluster_stages(cfg.qkv), parts,
                           smem_limit=smem_limit(device), batch=shape.batch)
            or hopper_error(device))


def qkv_attn_fused(shape: DecoderShape, cfg: DecoderConfig, dtype, device) -> bool:
    """Whether the layer computes its attention in the QKV kernel: ``qkv.fuse`` 1 where it can run
    (qkv_attn_error), on a Hopper GPU and not in the interpreter. Elsewhere QKV and the attention run their own
    configs."""
    from tuner.kernels import cluster_gemm

    return (cfg.qkv.fuse == 1 and not cfg.fused and cluster_gemm.usable(device)
            and qkv_attn_error(shape, cfg, dtype_bytes=torch.empty(0, dtype=dtype).element_size()) is None)


def ln_parts(shape: DecoderShape, cfg: DecoderConfig, dtype_bytes: int = 2,
             device: DeviceInfo | None = None, mlp: bool | None = None) -> dict[str, int]:
    """The producer's row-sum parts that each Triton GEMM reads with ``ln_stats`` (gemm_k.GemmProblem.ln_parts; a
    GEMM not named reads none), the sizes of LayerBuffers' h_stats and y_stats: QKV the previous layer's FFN2's with
    norm1.fuse 2 (the one-kernel feed-forward block's where it runs: ``mlp``, by default ffn2.fuse 1 or 2 and
    mlp_error None, ``device`` None as on Hopper), FFN1 the out-projection's with norm2.fuse 2 (none where that block
    computes the out-projection)."""
    from tuner.kernels import mlp_cluster

    d = shape.d_model
    if mlp is None:
        mlp = cfg.ffn2.fuse in (1, 2) and mlp_error(shape, cfg, dtype_bytes, device) is None
    parts = {}
    if cfg.norm1.fuse == 2:
        parts["qkv"] = mlp_cluster.stats_parts(d, shape.ffn, mlp_fs(cfg)) if mlp else gemm_k.stats_parts(cfg.ffn2, d)
    if cfg.norm2.fuse == 2 and not (mlp and cfg.out.fuse):
        parts["ffn1"] = gemm_k.stats_parts(cfg.out, d)
    return parts


def check_config(cfg: DecoderConfig, shape: DecoderShape, dtype_bytes: int = 2,
                 device: DeviceInfo | None = None) -> dict[str, str]:
    """Why each kernel's config is invalid for ``shape`` (empty when all are valid). A fused layer
    checks only its one kernel: the seven per-kernel configs are not launched."""
    if cfg.fused:
        why = fused_k.check(cfg.layer, layer_problem(shape, dtype_bytes), device)
        return {"layer": why} if why else {}
    bad = {}
    m, d = shape.tokens, shape.d_model
    parts = ln_parts(shape, cfg, dtype_bytes, device)
    for name in ("norm1", "norm2"):
        why = norm_k.check(getattr(cfg, name), norm_k.NormProblem(m, d, dtype_bytes), device)
        if why:
            bad[name] = why
    for name, (gm, gn, gk) in shape.gemms().items():
        why = gemm_k.check(getattr(cfg, name), gemm_k.GemmProblem(gm, gn, gk, dtype_bytes, parts.get(name, 0)),
                           device)
        fuse = getattr(cfg, name).fuse
        if why is None and name == "ffn1" and fuse:
            why = "fuse is FFN2's, the out-projection's (computed by FFN1's kernel) and QKV's; it must be 0 here"
        if why is None and name == "qkv" and fuse:
            if fuse != 1:
                why = f"fuse={fuse} is FFN2's; QKV's is 0 or 1 (the attention in QKV's kernel)"
            else:
                why = qkv_attn_error(shape, cfg, device, dtype_bytes)
                why = why and f"fuse=1 (the attention in QKV's kernel) {why}"
        if why is None and name == "out" and fuse:
            if fuse != 1:
                why = f"fuse={fuse} is FFN2's; the out-projection's is 0 or 1 (computed by FFN1's kernel)"
            elif not cfg.ffn2.fuse:
                why = "fuse=1 (the out-projection in FFN1's kernel) needs ffn2.fuse 1 or 2"
            else:
                why = mlp_error(shape, cfg, dtype_bytes, device)
                why = why and f"fuse=1 (the out-projection in FFN1's kernel) {why}"
        if why is None and name == "ffn2" and fuse:
            why = mlp_error(shape, cfg, dtype_bytes, device)
            why = why and f"fuse={fuse} (the feed-forward block as one kernel) {why}"
        if why:
            bad[name] = why
    why = attn_k.check(cfg.attn, attn_k.AttnProblem(shape.batch, shape.seq, shape.heads, shape.head_dim,
                                                    dtype_bytes), device)
    if why is None and cfg.attn.fuse:
        if cfg.attn.fuse != 1:
            why = f"fuse={cfg.attn.fuse} must be 0 or 1 (1: the attention in FFN1's kernel)"
        elif not cfg.ffn2.fuse or not cfg.out.fuse:
            why = "fuse=1 (the attention in FFN1's kernel) needs ffn2.fuse 1 or 2 and out.fuse 1"
        else:
            why = mlp_error(shape, cfg, dtype_bytes, device)
            why = why and f"fuse=1 (the attention in FFN1's kernel) {why}"
    if why:
        bad["attn"] = why
    return bad


def layer_problem(shape: DecoderShape, dtype_bytes: int = 2) -> fused_k.LayerProblem:
    return fused_k.LayerProblem(shape.tokens, shape.seq, shape.d_model, shape.heads, shape.ffn, dtype_bytes)


def fit_config(cfg: DecoderConfig, shape: DecoderShape, dtype_bytes: int = 2,
               device: DeviceInfo | None = None) -> DecoderConfig:
    """Shrink tiles that exceed the shape (tiny layers have 32 rows and 32 keys), and the one-kernel layer's stages to
    the shared memory of ``device`` for ``dtype_bytes`` operands."""
    from dataclasses import replace

    fitted = {n: gemm_k.fit(getattr(cfg, n), gemm_k.GemmProblem(m, nn, k)) for n, (m, nn, k) in shape.gemms().items()}
    cap = tile_cap(shape.seq)
    attn = replace(cfg.attn, block_m=min(cfg.attn.block_m, cap), block_n=min(cfg.attn.block_n, cap))
    rows = 1 << max(0, shape.tokens - 1).bit_length()  # a norm's rows a program: at most the rows there are
    norms = {n: replace(c, rows_per_program=min(c.rows_per_program, rows))
             for n, c in (("norm1", cfg.norm1), ("norm2", cfg.norm2))}
    return replace(cfg, attn=attn, layer=fused_k.fit(cfg.layer, layer_problem(shape, dtype_bytes), device), **norms,
                   **fitted)


def repair_config(cfg: DecoderConfig, shape: DecoderShape, dtype_bytes: int = 2,
                  device: DeviceInfo | None = None) -> DecoderConfig:
    """fit_config (for the dtype and the device), then the attention kernel fitted to their shared memory, each
    GEMM moved to its nearest config within shared memory and registers
    (gemm_k.repair), and the attention, the out-projection and FFN2 unfused where the one-kernel feed-forward block
    cannot run them (mlp_error): what the search measures for a sampled combination of tiles."""
    from dataclasses import replace

    cfg = fit_config(cfg, shape, dtype_bytes, device)
    # the attention kernel within this dtype's and GPU's shared memory
    cfg = replace(cfg, attn=attn_k.repair(cfg.attn, attn_k.AttnProblem(shape.batch, shape.seq, shape.heads,
                                                                       shape.head_dim, dtype_bytes), device))
    if cfg.attn.fuse and (not cfg.ffn2.fuse or not cfg.out.fuse or mlp_error(shape, cfg, dtype_bytes, device)):
        cfg = replace(cfg, attn=replace(cfg.attn, fuse=0))  # the attention kernel runs
    if cfg.out.fuse and (not cfg.ffn2.fuse or mlp_error(shape, cfg, dtype_bytes, device)):
        cfg = replace(cfg, out=replace(cfg.out, fuse=0))  # the out-projection runs its own config
    if cfg.ffn2.fuse and mlp_error(shape, cfg, dtype_bytes, device):  # FFN1 and FFN2 run their own configs
        cfg = replace(cfg, ffn2=replace(cfg.ffn2, fuse=0))
    # (after those: they decide which GEMM's row sums QKV and FFN1 read, ln_parts; the GEMMs' tiles do not decide them)
    parts = ln_parts(shape, cfg, dtype_bytes, device)
    cfg = replace(cfg, **{n: gemm_k.repair(getattr(cfg, n), gemm_k.GemmProblem(m, nn, k, dtype_bytes, parts.get(n, 0)),
                                           device)
                          for n, (m, nn, k) in shape.gemms().items()})
    # (after QKV's stages: its depth)
    if cfg.qkv.fuse and (cfg.qkv.fuse != 1 or qkv_attn_error(shape, cfg, device, dtype_bytes)):
        cfg = replace(cfg, qkv=replace(cfg.qkv, fuse=0))  # QKV and the attention run their own configs
    return cfg


def idle_kernels(cfg: DecoderConfig) -> set[str]:
    """The kernels of the seven that a config, as :func:`repair_config` leaves it, does not launch (layer_launches
    leaves them out; their configs are read nowhere but in their ``fuse`` switch): a fused norm, the attention in QKV's
    kernel or in the feed-forward block, the out-projection and FFN2 in that block. None under the one-kernel layer,
    whose own parameters are apart. (The first layer of a stack with norm1.fuse 2 runs its attention kernel: one layer
    of the 8 to 120 the tuner times, ignored here.)"""
    if cfg.fused:
        return set()
    idle = {n for n in ("norm1", "norm2") if getattr(cfg, n).fuse}
    if cfg.ffn2.fuse:
        idle.add("ffn2")
    if cfg.out.fuse:
        idle.add("out")
    if cfg.attn.fuse or cfg.qkv.fuse == 1:
        idle.add("attn")
    return idle


# FFN1's fields that the one-kernel feed-forward block does not read: it reads FFN1's prefetch ratio, its L2 hints,
# and of its overlap ratio only whether it is on (the block triggers its dependents right after its wait).
_BLOCK_UNREAD = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages", "split_k", "tma", "cluster")
# QKV's fields that its kernel with the attention (qkv.fuse 1, kernels/qkv_attn.py) does not read: it reads QKV's
# pipeline depth (num_stages * block_k, gemm.cluster_stages), ratios and L2 hints.
_QKV_ATTN_UNREAD = ("block_m", "block_n", "group_m", "num_warps", "split_k", "tma", "cluster")


def _gemm_kernels(cfg: DecoderConfig, gemm: str, shape: DecoderShape | None = None) -> tuple[str, ...]:
    """The kernels that run ``gemm`` in the stack's layers (tuner.names.gemm_kernels: the rule, shared with the
    report), judged on ``shape``'s :func:`ln_parts` (the size of the buffer the launch reads) where its LayerNorm's
    row sums come from its producer; with ``shape`` None, not judged."""
    c = getattr(cfg, gemm)
    norm = {"qkv": cfg.norm1, "ffn1": cfg.norm2}.get(gemm)
    norm_fuse = norm.fuse if norm is not None else 0
    parts = ln_parts(shape, cfg).get(gemm) if shape is not None and norm_fuse == 2 else None
    return gemm_kernels(gemm, c.cluster, c.fuse, cfg.ffn2.fuse, norm_fuse, parts)


def unlaunched_kernels(cfg: DecoderConfig) -> set[str]:
    """:func:`idle_kernels` as the whole stack launches them: with ``qkv.fuse`` 1 and ``norm1.fuse`` 2 the first
    layer has no row sums of its input and runs QKV and the attention kernel apart, on the attention's own config."""
    idle = idle_kernels(cfg)
    if cfg.qkv.fuse == 1 and cfg.norm1.fuse == 2 and not cfg.attn.fuse:
        idle.discard("attn")
    return idle


def launched_config(cfg: DecoderConfig, shape: DecoderShape | None = None) -> DecoderConfig:
    """``cfg`` (as :func:`repair_config` leaves it) with every field that no launch of any layer of the stack reads
    set to its default: two configurations that launch the same kernels with the same arguments become equal, so
    the study measures such a pair once (tuner.study.config_hash). Reset:

    * the one-kernel layer's fields where it is off, the seven kernels' where it is on;
    * an idle kernel's (:func:`idle_kernels`) but its ``fuse`` switch; not the attention behind QKV's kernel
      (``qkv.fuse`` 1) with ``norm1.fuse`` 2, which the stack's first layer runs with its own config;
    * under the one-kernel feed-forward block, FFN1's tile fields, and its overlap ratio to 0 where it is on;
    * the L2 hints of a GEMM that only the Triton kernels run (``cluster`` 0, and neither QKV in the attention's
      kernel nor FFN1 as the feed-forward block; or a clustered one that :func:`_gemm_kernels` runs on them alone):
      they ignore it (gemm.GemmConfig.hints);
    * under QKV's kernel with the attention (``qkv.fuse`` 1), QKV's Triton tile fields (_QKV_ATTN_UNREAD), but where
      ``norm1.fuse`` is 2: the stack's first layer then runs QKV on the Triton kernels;
    * ``group_m`` of a GEMM that only the cluster kernel runs (:func:`_gemm_kernels`, judged on ``shape`` where a
      folded LayerNorm may run it on the Triton kernels), whose tile order is fixed.

    Fields a launch reads in a coarser form (a ratio rounded to a K tile, QKV's depth under ``qkv.fuse`` 1) are kept as
    they are."""
    default = DecoderConfig()
    if cfg.fused:
        return replace(default, layer=cfg.layer)
    out = {"layer": default.layer}  # (off: its switch is the default's too)
    for name in unlaunched_kernels(cfg):
        out[name] = replace(getattr(default, name), fuse=getattr(cfg, name).fuse)
    if cfg.ffn2.fuse:  # FFN1's launch is the one-kernel feed-forward block
        f = cfg.ffn1
        out["ffn1"] = replace(f, **{k: getattr(default.ffn1, k) for k in _BLOCK_UNREAD},
                              overlap_ratio=0.0 if f.overlap_ratio >= 0 else -1.0)
    if cfg.qkv.fuse == 1 and cfg.norm1.fuse != 2:
        out["qkv"] = replace(cfg.qkv, **{k: getattr(default.qkv, k) for k in _QKV_ATTN_UNREAD})
    for g in GEMMS:
        c = out.get(g, getattr(cfg, g))
        kernels = _gemm_kernels(cfg, g, shape)
        if c.hints != getattr(default, g).hints and (not reads_l2_hints(g, c.cluster, c.fuse, cfg.ffn2.fuse)
                                                     or kernels == ("triton",)):
            c = out[g] = replace(c, hints=getattr(default, g).hints)
        if kernels == ("cluster",):
            out[g] = replace(c, group_m=getattr(default, g).group_m)
    return replace(cfg, **out)


def qkv_attn_knobs(c: gemm_k.GemmConfig, shape: DecoderShape) -> tuple[int, int]:
    """What QKV's kernel with the attention (``qkv.fuse`` 1) reads of QKV's two ratios: its trigger and prefetch
    count in 64-wide K tiles. The one place: the launch (layer_launches) and the launch key (:func:`launch_key`)."""
    k_tiles = shape.d_model // 64
    return trigger_index(k_tiles, c.overlap_ratio), prefetch_count(k_tiles, c.prefetch_ratio)


def launch_key(cfg: DecoderConfig, shape: DecoderShape) -> dict:
    """What ``cfg`` (as repair_config leaves it) launches, as a dict the study hashes (tuner.study.config_hash):
    :func:`launched_config`'s fields, and on ``shape`` each GEMM's two ratios replaced by what its launches read of
    them (a trigger and a prefetch count in K tiles: gemm.triton_knobs, gemm.cluster_knobs, qkv_attn_knobs, and
    mlp_cluster.early_tiles for FFN1 as the feed-forward block), so ratios that round to the same K tile are one
    launch. A GEMM that runs on both kernels (QKV clustered under ``norm1.fuse`` 2) keys both kernels'. A norm
    kernel's ratios likewise by its trigger row and prefetch lines (norm.launch_knobs), the attention kernel's overlap
    ratio by its programs' trigger blocks (attention.launch_knobs), the Triton layer kernel's (``layer.fuse`` 1) by its
    trigger phase and prefetched lines (fused_layer.launch_knobs)."""
    key = launched_config(cfg, shape).to_dict()
    if cfg.fused:
        # The Triton layer kernel's trigger phase and prefetched lines (fused_layer.launch_knobs), for both element
        # sizes as the norms' below; the CUDA layer kernel's trigger counts tasks a CTA, which depends on the GPU's SM
        # count that the key does not know: its ratios are keyed as given.
        if cfg.layer.fuse == 1:
            d, f = shape.d_model, shape.ffn
            weights = [3 * d * d, d * d, f * d, d * f]
            _key_launches(key, "layer", [("layer", *fused_k.launch_knobs(cfg.layer, weights, b)) for b in (2, 4)])
        return key
    from tuner.kernels import mlp_cluster

    unlaunched = unlaunched_kernels(cfg)
    for g, (_, _, k) in shape.gemms().items():
        c = getattr(cfg, g)
        if g in unlaunched:
            continue
        if g == "ffn1" and cfg.ffn2.fuse:  # the block: on PDL, the weight tiles it loads before its wait
            pdl = c.overlap_ratio >= 0
            kinds = [("block", pdl, mlp_cluster.early_tiles(c.prefetch_ratio, shape.d_model, mlp_fs(cfg),
                                                            bool(cfg.out.fuse)) if pdl else -1)]
        elif g == "qkv" and c.fuse == 1:  # (the first layer under norm1.fuse 2 runs QKV on the Triton kernels)
            kinds = [("qkv_attn", *qkv_attn_knobs(c, shape))]
            if cfg.norm1.fuse == 2:
                kinds.append(("triton", *gemm_k.triton_knobs(c, k)))
        else:
            knobs = {"triton": gemm_k.triton_knobs, "cluster": gemm_k.cluster_knobs}
            kinds = [(kind, *knobs[kind](c, k)) for kind in _gemm_kernels(cfg, g, shape)]
        _key_launches(key, g, kinds)
    # A norm kernel's trigger and prefetch lines; the lines of a weight vector count its element's bytes, which the
    # key does not know: it holds both sizes the layer runs in (2: fp16 and bf16, 4: fp32), merging only where both do
    for n in ("norm1", "norm2"):
        if n not in unlaunched:
            _key_launches(key, n, [("norm", *norm_k.launch_knobs(getattr(cfg, n), shape.d_model, b)) for b in (2, 4)])
    if "attn" not in unlaunched:
        _key_launches(key, "attn", [("attn", *attn_k.launch_knobs(cfg.attn, shape.seq))])
    return key


def _key_launches(key: dict, kernel: str, kinds: list[tuple]) -> None:
    """In :func:`launch_key`'s ``key``, ``kernel``'s two ratios replaced by what its launches read of them."""
    entry = key["kernels"][kernel]
    del entry["overlap_ratio"], entry["prefetch_ratio"]
    entry["launches"] = [list(kind) for kind in kinds]


def default_config(shape: DecoderShape) -> DecoderConfig:
    """The baseline of every comparison: default tiles (fitted to the shape), every pair at (-1, -1)."""
    return fit_config(DecoderConfig(), shape)


@dataclass
class LayerWeights:
    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor
    w_out: torch.Tensor
    b_out: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    w_ffn1: torch.Tensor
    b_ffn1: torch.Tensor
    w_ffn2: torch.Tensor
    b_ffn2: torch.Tensor

    def folded(self, gemm: str):
        """(W', b', colsum) with the preceding LayerNorm folded in (gemm_k.fold_layernorm), computed once."""
        cache = self.__dict__.setdefault("_folded", {})
        if gemm not in cache:
            if gemm == "qkv":
                cache[gemm] = gemm_k.fold_layernorm(self.w_qkv, self.b_qkv, self.ln1_w, self.ln1_b)
            else:
                cache[gemm] = gemm_k.fold_layernorm(self.w_ffn1, self.b_ffn1, self.ln2_w, self.ln2_b)
        return cache[gemm]

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def fused(self) -> fused_k.LayerTensors:
        """What the one-kernel layer reads: both norms folded into the next GEMM (computed once)."""
        if "_fused" not in self.__dict__:
            w_qkv, b_qkv, u_qkv = self.folded("qkv")
            w_ffn1, b_ffn1, u_ffn1 = self.folded("ffn1")
            self._fused = fused_k.LayerTensors(w_qkv, b_qkv, u_qkv, self.w_out, self.b_out, w_ffn1, b_ffn1,
                                               u_ffn1, self.w_ffn2, self.b_ffn2)
        return self._fused

    @classmethod
    def random(cls, shape: DecoderShape, dtype, device, generator: torch.Generator) -> "LayerWeights":
        d, f = shape.d_model, shape.ffn

        def lin(n, k):  # nn.Linear-like scale keeps activations O(1) through a deep stack
            w = torch.randn(n, k, generator=generator) / math.sqrt(k)
            return w.to(dtype).to(device), (0.1 * torch.randn(n, generator=generator)).to(dtype).to(device)

        def ln():
            return ((1 + 0.1 * torch.randn(d, generator=generator)).to(dtype).to(device),
                    (0.1 * torch.randn(d, generator=generator)).to(dtype).to(device))

        ln1_w, ln1_b = ln()
        w_qkv, b_qkv = lin(3 * d, d)
        w_out, b_out = lin(d, d)
        ln2_w, ln2_b = ln()
        w_ffn1, b_ffn1 = lin(f, d)
        w_ffn2, b_ffn2 = lin(d, f)
        return cls(ln1_w, ln1_b, w_qkv, b_qkv, w_out, b_out, ln2_w, ln2_b, w_ffn1, b_ffn1, w_ffn2, b_ffn2)


class LayerBuffers:
    """Every activation of one layer, preallocated: the graph holds no allocation or torch op."""

    def __init__(self, shape: DecoderShape, cfg: DecoderConfig, dtype, device):
        m, d, f = shape.tokens, shape.d_model, shape.ffn
        e = lambda n: torch.empty((m, n), dtype=dtype, device=device)  # noqa: E731
        self.ws = {}
        self.fused = None
        self.mlp = self.mlp_out = self.mlp_attn = self.qkv_attn = False
        self.h_stats = self.y_stats = None
        if cfg.fused:  # the one-kernel layer: its own intermediates, workspace and barrier counters
            self.fused = fused_k.LayerScratch(cfg.layer, layer_problem(shape, e(0).element_size()), dtype, device)
            self.ln1 = self.ln2 = e(0)
            self.qkv, self.attn, self.h, self.ffn1 = self.fused.activations()
            self.y = e(d)
            return
        self.ln1, self.qkv, self.attn, self.h, self.ln2, self.ffn1, self.y = (
            e(d), e(3 * d), e(d), e(d), e(d), e(f), e(d))
        # A norm with fuse 2 reads its rows' sums from the GEMM that wrote the rows: h's from the
        # out-projection (norm2), y's from FFN2 (the next layer's norm1), or from the one-kernel feed-forward block
        # (one part a CTA).
        self.mlp = mlp_fused(shape, cfg, dtype, device)
        self.mlp_out = self.mlp and bool(cfg.out.fuse)
        self.mlp_attn = self.mlp_out and bool(cfg.attn.fuse)  # the attention in the block too: qkv is its input
        # the attention in QKV's kernel (where the layer has its input's row sums for a norm1.fuse of 2: not the
        # stack's first layer): qkv is not written
        self.qkv_attn = qkv_attn_fused(shape, cfg, dtype, device)
        parts = ln_parts(shape, cfg, mlp=self.mlp)
        st = lambda parts: torch.empty((parts, m, 2), dtype=torch.float32, device=device)  # noqa: E731
        self.h_stats = st(parts["ffn1"]) if "ffn1" in parts else None
        self.y_stats = st(parts["qkv"]) if "qkv" in parts else None
        for name, (gm, gn, _) in shape.gemms().items():
            n = gemm_k.workspace_numel(getattr(cfg, name), gm, gn)
            self.ws[name] = torch.empty(n, dtype=torch.float32, device=device) if n else None

    def all(self):
        """Every buffer a launch writes (poisoned before a correctness check); not the sync counters."""
        extra = self.fused.poisonable() if self.fused is not None else []
        extra += [t for t in (self.h_stats, self.y_stats) if t is not None]
        return [self.ln1, self.qkv, self.attn, self.h, self.ln2, self.ffn1, self.y] + extra + [
            w for w in self.ws.values() if w is not None]


def layer_launches(shape: DecoderShape, cfg: DecoderConfig, w: LayerWeights, x: torch.Tensor, b: LayerBuffers,
                   racy: str | None = None, oob: bool = False, unchecked: bool = False,
                   x_stats: torch.Tensor | None = None, slow: str | None = None) -> list[tuple[str, callable]]:
    """The layer's kernel launches in order, as (kernel name, launch) pairs.

    ``x_stats``: the row sums of ``x`` written by the previous layer's FFN2 (``LayerBuffers.y_stats``),
    for a norm1 with fuse 2; without them (the first layer) QKV gathers them in its K loop (fuse 1).

    ``racy`` names a kernel to launch in its test-only variant that reads its input before gdc_wait (a GEMM's name
    plus :data:`REDUCE`: its split-K reduction kernel, which then reads the partials before its wait; ``NoReduction``
    where the GEMM launches none);
    ``oob`` launches the QKV GEMM in its test-only variant that writes out of bounds (illegal address);
    ``unchecked`` launches the QKV GEMM without its config check (test-only: a config beyond the GPU's
    shared memory then fails in Triton's launcher, as a real out-of-resources fault);
    ``slow`` names a GEMM whose odd column tiles hold back their stores (test-only, ``tune verify``:
    ``gemm.linear``'s ``_slow_ns``, on the Triton or the cluster kernel); any other launch raises ``NotSlowable``.
    """
    r = lambda k: racy == k  # noqa: E731
    sl = lambda k: SLOW_NS if slow == k else 0  # noqa: E731
    if racy is not None and racy.endswith(REDUCE) and cfg.fused:
        raise gemm_k.NoReduction("the one-kernel layer launches no split-K reduction kernel")
    if slow is not None and cfg.fused:
        raise gemm_k.NotSlowable("the one-kernel layer has no slowed variant")
    if cfg.fused:  # racy: a phase of the CUDA layer kernel (fuse 2, Hopper) that skips its flags, or Triton's QKV
        return [("layer", lambda: fused_k.decoder_layer(x, w.fused(), seq=shape.seq, heads=shape.heads,
                                                        config=cfg.layer, scratch=b.fused, out=b.y, eps=LN_EPS,
                                                        _racy=racy))]
    # A fused norm (NormConfig.fuse) launches no kernel: the next GEMM normalises x in its prologue.
    w_qkv, b_qkv, w_ffn1, b_ffn1 = w.w_qkv, w.b_qkv, w.w_ffn1, w.b_ffn1
    ln1 = ln2 = {}
    out_kw, ffn2_kw = {}, {}
    if cfg.norm1.fuse:
        w_qkv, b_qkv, u = w.folded("qkv")
        ln1 = dict(ln_colsum=u, ln_eps=LN_EPS)
        if cfg.norm1.fuse == 2:
            ffn2_kw = dict(stats_out=b.y_stats)
            if x_stats is not None:
                ln1["ln_stats"] = x_stats
    if cfg.norm2.fuse:
        w_ffn1, b_ffn1, u = w.folded("ffn1")
        ln2 = dict(ln_colsum=u, ln_eps=LN_EPS)
        if cfg.norm2.fuse == 2:
            ln2["ln_stats"] = out_kw["stats_out"] = b.h_stats
    launches = [
        ("norm1", lambda: norm_k.layer_norm(x, w.ln1_w, w.ln1_b, eps=LN_EPS, config=cfg.norm1, out=b.ln1,
                                            _racy_read_before_wait=r("norm1"))),
        ("qkv", lambda: gemm_k.linear(x if ln1 else b.ln1, w_qkv, b_qkv, config=cfg.qkv, out=b.qkv,
                                      workspace=b.ws["qkv"], _racy_read_before_wait=r("qkv"), _slow_ns=sl("qkv"),
                                      _racy_reduce=r("qkv" + REDUCE), _oob_write=oob, _unchecked=unchecked, **ln1)),
        ("attn", lambda: attn_k.attention(b.qkv, batch=shape.batch, seq=shape.seq, heads=shape.heads,
                                          head_dim=shape.head_dim, config=cfg.attn, out=b.attn,
                                          _racy_read_before_wait=r("attn"))),
        ("out", lambda: gemm_k.linear(b.attn, w.w_out, w.b_out, config=cfg.out, residual=x, out=b.h,
                                      workspace=b.ws["out"], _racy_read_before_wait=r("out"), _slow_ns=sl("out"),
                                      _racy_reduce=r("out" + REDUCE), **out_kw)),
        ("norm2", lambda: norm_k.layer_norm(b.h, w.ln2_w, w.ln2_b, eps=LN_EPS, config=cfg.norm2, out=b.ln2,
                                            _racy_read_before_wait=r("norm2"))),
        ("ffn1", lambda: gemm_k.linear(b.h if ln2 else b.ln2, w_ffn1, b_ffn1, config=cfg.ffn1,
                                       activation="gelu", out=b.ffn1, workspace=b.ws["ffn1"],
                                       _racy_read_before_wait=r("ffn1"), _slow_ns=sl("ffn1"),
                                       _racy_reduce=r("ffn1" + REDUCE), **ln2)),
        ("ffn2", lambda: gemm_k.linear(b.ffn1, w.w_ffn2, w.b_ffn2, config=cfg.ffn2, residual=b.h, out=b.y,
                                       workspace=b.ws["ffn2"], _racy_read_before_wait=r("ffn2"), _slow_ns=sl("ffn2"),
                                       _racy_reduce=r("ffn2" + REDUCE), **ffn2_kw)),
    ]
    skip = {n for n, c in (("norm1", cfg.norm1), ("norm2", cfg.norm2)) if c.fuse}
    replaced = set()  # GEMMs launched as another kernel
    if b.mlp:  # FFN1 + GELU + FFN2 in one kernel, launched in FFN1's place
        from tuner.kernels import mlp_cluster

        # With out.fuse 1 it starts from the attention's output and computes h = x + out-projection itself.
        h_in, res, o = (b.attn, x, dict(wo=w.w_out, bo=w.b_out)) if b.mlp_out else (b.h if ln2 else b.ln2, b.h, {})
        if b.mlp_attn:  # and with attn.fuse 1 the attention from qkv in front of that
            o["qkv"] = b.qkv
        replaced.add("ffn1")
        launches[5] = ("ffn1", lambda: mlp_cluster.launch(
            h_in, w_ffn1, b_ffn1, w.w_ffn2, w.b_ffn2, res, b.y, act=gemm_k.act_code("gelu", b.h),
            stats_out=ffn2_kw.get("stats_out"), ln_stats=ln2.get("ln_stats"),  # (None with out.fuse: no h_stats)
            ln_colsum=ln2.get("ln_colsum"), ln_eps=LN_EPS, pdl=cfg.ffn1.overlap_ratio >= 0, racy=r("ffn1"),
            fs=mlp_fs(cfg), prefetch=cfg.ffn1.prefetch_ratio, hints=gemm_k.l2_hints(cfg.ffn1), **o))
        skip.add("ffn2")
        if b.mlp_out:
            skip.add("out")
        if b.mlp_attn:
            skip.add("attn")
    if b.qkv_attn and (not ln1 or "ln_stats" in ln1):  # QKV and the attention in one kernel, in QKV's place
        # (the first layer of a stack with norm1.fuse 2 has no row sums of x: there QKV and the attention run apart)
        from tuner.kernels import qkv_attn

        trigger_k, n_pref = qkv_attn_knobs(cfg.qkv, shape)
        launches[1] = ("qkv", lambda: qkv_attn.launch(
            x if ln1 else b.ln1, w_qkv, b_qkv, b.attn, seq=shape.seq, stages=gemm_k.cluster_stages(cfg.qkv),
            trigger_k=trigger_k, n_pref=n_pref, ln_stats=ln1.get("ln_stats"),
            ln_colsum=ln1.get("ln_colsum"), ln_eps=LN_EPS, racy=r("qkv"), hints=gemm_k.l2_hints(cfg.qkv)))
        skip.add("attn")
        replaced.add("qkv")
    on_linear = lambda k: k in GEMMS and k not in skip | replaced  # noqa: E731  (a GEMM that gemm.linear launches)
    if racy is not None and racy.endswith(REDUCE) and not on_linear(racy.removesuffix(REDUCE)):
        raise gemm_k.NoReduction(f"{racy}: no split-K reduction kernel (only gemm.linear's Triton kernels launch one)")
    if slow is not None and not on_linear(slow):
        raise gemm_k.NotSlowable(f"{slow}: no held variant of this launch (only gemm.linear's kernels have one)")
    return [(n, f) for n, f in launches if n not in skip]


def layer_forward(shape: DecoderShape, cfg: DecoderConfig, w: LayerWeights, x: torch.Tensor,
                  b: LayerBuffers, racy: str | None = None) -> torch.Tensor:
    """Launch the layer's kernels on ``x`` into ``b``; returns ``b.y``."""
    for _, launch in layer_launches(shape, cfg, w, x, b, racy):
        launch()
    return b.y


def random_stack_weights(shape: DecoderShape, n_layers: int, dtype, device, seed: int) -> list[LayerWeights]:
    """Distinct random weights for each layer of a stack, the same for a given seed everywhere."""
    g = torch.Generator().manual_seed(seed)
    return [LayerWeights.random(shape, dtype, device, g) for _ in range(n_layers)]


def torch_layer(shape: DecoderShape, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """The same layer in plain PyTorch (cuBLAS + SDPA): the eager and torch.compile baselines, and in
    fp32 the reference."""
    bsz, s, d, h, hd = shape.batch, shape.seq, shape.d_model, shape.heads, shape.head_dim
    n1 = F.layer_norm(x, (d,), w.ln1_w, w.ln1_b, LN_EPS)
    qkv = F.linear(n1, w.w_qkv, w.b_qkv).view(bsz, s, 3, h, hd).permute(2, 0, 3, 1, 4)
    a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
    a = a.transpose(1, 2).reshape(bsz * s, d)
    hid = x + F.linear(a, w.w_out, w.b_out)
    f = F.gelu(F.linear(F.layer_norm(hid, (d,), w.ln2_w, w.ln2_b, LN_EPS), w.w_ffn1, w.b_ffn1), approximate="tanh")
    return hid + F.linear(f, w.w_ffn2, w.b_ffn2)


def layer_ref(shape: DecoderShape, w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """fp32 reference of one layer from the same weights."""
    w32 = LayerWeights(*(t.float() for t in w.tensors()))
    return torch_layer(shape, w32, x.float())


def stack_depth(shape: DecoderShape, dtype_bytes: int, l2_bytes: int, l2_policy: str = "cold") -> int:
    """Layers in the timed stack. Cold: weights >= 3x L2, so no layer finds its weights in L2 (DESIGN). Hot: the
    model's own depth, for a model whose weights fit in the L2 (ValueError, hot_error's line, for one that does
    not: its stack would be timed cold and labelled hot)."""
    if l2_policy == "hot":
        why = hot_error(shape, dtype_bytes, l2_bytes)
        if why:
            raise ValueError(why)
        return shape.depth
    return max(2, math.ceil(3 * l2_bytes / shape.weight_bytes(dtype_bytes)))


def memory_error(shape: DecoderShape, dtype_bytes: int, l2_bytes: int, l2_policy: str, gpu_bytes: int) -> str | None:
    """Why the timed stack of ``shape`` cannot fit in a GPU of ``gpu_bytes``; None when it may. Counted low: each
    layer's weights with the LayerNorm-folded copies of QKV's and FFN1's, and its seven activations; not the split-K
    workspaces, the torch baselines' stacks or the fp32 reference, so a stack that passes may still run out (the
    trial then fails as out of memory, never the study)."""
    n = stack_depth(shape, dtype_bytes, l2_bytes, l2_policy)
    m, d, f = shape.tokens, shape.d_model, shape.ffn
    need = n * (shape.weight_params + 3 * d * d + d * f + m * (8 * d + f)) * dtype_bytes
    if need <= gpu_bytes:
        return None
    return (f"shape {shape.spec}: its timed stack of {n} layers (each layer's weights and activations; {l2_policy} L2: "
            f"{'weights at least 3x the L2' if l2_policy == 'cold' else 'the model depth'}) needs at least "
            f"{need / 2**30:.1f} GiB, more than this GPU's {gpu_bytes / 2**30:.0f} GiB")


def hot_error(shape: DecoderShape, dtype_bytes: int, l2_bytes: int) -> str | None:
    """Why ``--l2 hot`` cannot describe ``shape`` on a GPU with ``l2_bytes`` of L2: its ``depth`` layers' weights
    do not fit there, so a forward never finds them in L2; None when they fit."""
    total = shape.depth * shape.weight_bytes(dtype_bytes)
    if total <= l2_bytes:
        return None
    return (f"--l2 hot: {shape.label}'s {shape.depth} layers hold {total / 1e6:.1f} MB of weights, "
            f"{total / l2_bytes:.1f}x this GPU's {l2_bytes / 2**20:.0f} MiB L2, so a forward never finds them there; "
            "hot is for a model whose weights stay in L2 (use --l2 cold, the default, or a shape file with its depth)")


# The weight matrices each launch of the layer reads (LayerWeights' fields; a fused norm's folded copy of a matrix
# has its size): what a kernel timed alone must find cold (kernel_weights).
_LAUNCH_WEIGHTS = {"qkv": ("w_qkv",), "out": ("w_out",), "ffn1": ("w_ffn1",), "ffn2": ("w_ffn2",),
                   "layer": ("w_qkv", "w_out", "w_ffn1", "w_ffn2")}


def kernel_weights(kernel: str, b: "LayerBuffers") -> tuple[str, ...]:
    """The weight matrices that the launch named ``kernel`` reads in a layer with buffers ``b`` (the one-kernel
    feed-forward block, launched as FFN1, reads FFN2's and, with out.fuse, the out-projection's too); none for the
    norms and the attention, which read activations and vectors only."""
    names = _LAUNCH_WEIGHTS.get(kernel, ())
    if kernel == "ffn1" and b.mlp:
        names += ("w_ffn2",) + (("w_out",) if b.mlp_out else ())
    return names


def cold_weights(weights: list[LayerWeights], names: tuple[str, ...], dtype_bytes: int, l2_bytes: int
                 ) -> list[LayerWeights]:
    """``weights`` extended, where needed, so that the matrices ``names`` of all its layers hold at least 3x the L2:
    the stack that times one kernel alone cold (a stack sized for the whole layer cycles too few bytes of one
    kernel's weights to keep them out of L2). The added layers are copies of the stack's, with those matrices cloned
    into memory of their own; their other tensors are shared (no launch of that kernel reads them)."""
    per_layer = sum(getattr(weights[0], n).numel() for n in names) * dtype_bytes
    if not per_layer:
        return weights
    need = math.ceil(3 * l2_bytes / per_layer)
    return weights + [replace(weights[i % len(weights)], **{n: getattr(weights[i % len(weights)], n).clone()
                                                           for n in names})
                      for i in range(len(weights), need)]


class DecoderStack:
    """L layers with distinct weights and buffers, launched back to back."""

    def __init__(self, shape: DecoderShape, cfg: DecoderConfig, *, n_layers: int, dtype=torch.float16,
                 device="cuda", seed: int = 0, weights: list[LayerWeights] | None = None):
        self.shape, self.cfg, self.dtype, self.device = shape, cfg, dtype, torch.device(device)
        self.weights = weights or random_stack_weights(shape, n_layers, dtype, device, seed)
        self.x = torch.empty((shape.tokens, shape.d_model), dtype=dtype, device=device)
        self.bufs = [LayerBuffers(shape, cfg, dtype, device) for _ in self.weights]
        for w in self.weights:  # folds are torch ops: do them now, never inside a graph capture
            if cfg.norm1.fuse or cfg.fused:
                w.folded("qkv")
            if cfg.norm2.fuse or cfg.fused:
                w.folded("ffn1")
        self.racy: tuple[int, str] | None = None  # (layer, kernel) for the race-detection demonstration
        self.slow: tuple[int, str] | None = None  # (layer, GEMM) whose stores are held back (layer_launches' slow)
        self.oob_layer: int | None = None  # layer whose QKV GEMM writes out of bounds (test-only)
        self.unchecked = False  # every QKV GEMM skips its config check (test-only)
        self.graph = None

    @property
    def n_layers(self) -> int:
        return len(self.weights)

    @property
    def out(self) -> torch.Tensor:
        return self.bufs[-1].y

    def _layer_launches(self, faults: bool = True):
        """(layer index, kernel name, launch) of every layer in order: each layer reads the previous one's output
        and, for a norm with fuse 2, the row sums its FFN2 wrote. ``faults``: with the test-only variants set on
        the stack (racy, oob_layer, unchecked, slow)."""
        x, x_stats = self.x, None
        for i, (w, b) in enumerate(zip(self.weights, self.bufs)):
            kw = dict(racy=self.racy[1] if self.racy and self.racy[0] == i else None, oob=self.oob_layer == i,
                      unchecked=self.unchecked, slow=self.slow[1] if self.slow and self.slow[0] == i else None
                      ) if faults else {}
            for name, fn in layer_launches(self.shape, self.cfg, w, x, b, x_stats=x_stats, **kw):
                yield i, name, fn
            x, x_stats = b.y, b.y_stats

    def _launches(self, faults: bool = True):
        for _, name, fn in self._layer_launches(faults):
            yield name, fn

    def run(self) -> torch.Tensor:
        for _, launch in self._launches():
            launch()
        return self.out

    def launches(self, kernel: str, skip_first: bool = False) -> list:
        """Every launch of one kernel across the stack (for the per-kernel breakdown); ``skip_first``: not the first
        layer's."""
        return [fn for i, name, fn in self._layer_launches(faults=False)
                if name == kernel and not (skip_first and i == 0)]

    def predecessor(self, layer: int, kernel: str) -> tuple[int, str] | None:
        """The (layer, kernel) launched right before ``kernel`` of ``layer`` in the stack (the one it waits for under
        PDL); None for the stack's first launch. A GEMM's split-K reduction kernel (its name plus :data:`REDUCE`) waits
        for that GEMM's K loops, in the same launch of the stack."""
        if kernel.endswith(REDUCE):
            return layer, kernel.removesuffix(REDUCE)
        order = [(i, name) for i, name, _ in self._layer_launches(faults=False)]
        at = order.index((layer, kernel))  # (ValueError where that layer launches no such kernel)
        return order[at - 1] if at else None

    def first_layer_differs(self) -> bool:
        """Whether the first layer runs other kernels than the rest: with norm1.fuse 2 no producer wrote the row sums
        of its input, so its QKV gathers them in a Triton GEMM (and with qkv.fuse 1 the attention kernel runs after
        it; with the clustered QKV the rest run the CUDA kernel)."""
        return self.n_layers > 1 and not self.cfg.fused and self.cfg.norm1.fuse == 2

    def capture(self, warmup: int = 2) -> "torch.cuda.CUDAGraph":
        """One CUDA graph of the whole stack (the warm-up compiles every kernel variant outside it)."""
        from tuner.timing import capture

        self.graph = capture(self.run, warmup=warmup)
        return self.graph

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.run()

    def poison(self) -> None:
        """Every buffer a launch writes (LayerBuffers.all) set to NaN, on the device before this returns."""
        for b in self.bufs:
            for t in b.all():
                t.fill_(float("nan"))
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def check(self, seed: int, layers: list[int] | None = None) -> float:
        """Worst ‖out − ref‖/‖ref‖ over the checked layers after one replay on fresh random input, every
        buffer poisoned with NaN first (an unwritten or raced element gives inf). Each layer is compared
        with the fp32 reference applied to the input that layer really received."""
        g = torch.Generator().manual_seed(seed)
        self.x.copy_(torch.randn(self.x.shape, generator=g).to(self.dtype))
        self.poison()
        self.replay()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        worst = 0.0
        idx = range(self.n_layers) if layers is None else layers
        for i in idx:
            x_in = self.x if i == 0 else self.bufs[i - 1].y
            if not torch.isfinite(x_in).all():
                return float("inf")
            worst = max(worst, rel_error(self.bufs[i].y, layer_ref(self.shape, self.weights[i], x_in)))
        return worst

    def tolerance(self) -> float:
        return rel_tolerance(self.dtype)

    def gemm_names(self):
        return GEMMS
