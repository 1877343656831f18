"""`tune bench`: our layer against the PyTorch baselines and the memory floor, every row checked."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tuner import manifest
from tuner.baselines import TorchStack
from tuner.config import DecoderConfig
from tuner.device import DeviceInfo
from tuner.kernels.attention import AttnConfig
from tuner.kernels._common import REL_TOLERANCE, tile_cap
from tuner.kernels.gemm import GemmConfig, GemmProblem, check, cluster_tile, grid
from tuner.kernels.norm import NormConfig
from tuner.layer import (DecoderStack, check_config, default_config, dtype_name, fit_config, qkv_attn_error,
                         random_stack_weights, repair_config, stack_depth)
from tuner.shapes import DecoderShape
from tuner.timing import copy_bandwidth_bytes_per_s, policy, time_replay


def hand_picked(shape: DecoderShape, norms: int = 2) -> DecoderConfig:
    """Tiles picked by hand for small M (weights-bound GEMMs want many programs), PDL + full prefetch.

    block_m covers all rows up to 64 so each weight tile is read by few programs; block_n 64 and split-K
    on the long-K FFN2 put ~100 programs on the 132 SMs; block_k 128 halves the K iterations, each of
    which waits on a load (H200, bert-base: 37.3 -> 30.3 us per layer against block_k 64, perf-notes).
    Attention in 16-row query tiles (12 heads x 8 = 96 programs on bert-base), all keys of a 128-token
    sequence in one block (H200, bert-base: 22.14 against 22.77 us with 64-key blocks in 2 stages); TMA
    loads in the GEMMs where the rows allow (fit_config; H200: bert-base 26.3 -> 24.6 us, bert-large 32.8
    -> 30.1).
    ``norms``: NormConfig.fuse of both norms, 2 by default (row sums from the producing GEMM: no norm
    kernel; H200, bert-base 28.2 -> 27.1 us, perf-notes section 7); 0 keeps the norm kernels (``tune
    verify`` checks every kernel).
    """
    m = shape.tokens
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    gemm = GemmConfig(block_m=bm, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=4, tma=1)
    k_tiles_ffn2 = -(-shape.ffn // 64)
    cfg = DecoderConfig(
        norm1=NormConfig(rows_per_program=1, num_warps=4, fuse=norms), qkv=gemm,
        attn=AttnConfig(block_m=16, block_n=min(128, tile_cap(shape.seq)), num_warps=4, num_stages=1),
        out=gemm, norm2=NormConfig(rows_per_program=1, num_warps=4, fuse=norms), ffn1=gemm,
        ffn2=GemmConfig(block_m=bm, block_n=64, block_k=128, num_warps=4, num_stages=4, tma=1,
                        split_k=4 if k_tiles_ffn2 >= 16 else 1),
    )
    return fit_config(cfg, shape).with_knobs(0.0, 1.0)


# Many tokens: the GEMMs are bound by their MMAs, not by streaming their weights, and every GEMM launches several
# waves of CTAs. H200, 4x512x768x12x3072 (2,048 tokens), one process (docs/perf-notes.md section 37): 128x128x64
# tiles in 8 warps and 4 stages, every pair at (-1, -1), 89.8 us a layer against 105.5 for the 64-row tiles a
# default-budget study kept (torch.compile 91.0); the same tiles with every pair at (0, 1) 139.6 (the dependent
# kernels launched early take SMs from their predecessor's later waves); the norms folded into the GEMMs 88.3.
MANY_TOKENS = 512


def hand_picked_many(shape: DecoderShape, norms: int = 2) -> DecoderConfig:
    """Tiles picked by hand for many tokens (:data:`MANY_TOKENS` and more): 128x128x64 in 8 warps and 4 stages, TMA
    loads, no split, the norms folded into the GEMMs (``norms``: NormConfig.fuse), every pair at (-1, -1)."""
    gemm = GemmConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4, tma=1)
    base = default_config(shape)
    cfg = replace(base, qkv=gemm, out=gemm, ffn1=gemm, ffn2=gemm, norm1=replace(base.norm1, fuse=norms),
                  norm2=replace(base.norm2, fuse=norms))
    return fit_config(cfg, shape)


# Wide layers at a few tokens (d_model 4096, 128 tokens): their long GEMMs have tiles enough to fill the chip with
# wide ones, and their rate is the MMAs' (128 FLOP a weight byte). H200, 1x128x4096x32x11008 (perf notes 37.5): alone,
# QKV and FFN1 in 128x128x128 tiles, 8 warps, 3 stages, take 32.6 and 31.9 us against 41.8 and 40.8 in a study's
# top-1 tiles (cuBLAS 29.1, 30.8; device call 8); in the layer, that top-1 with them 126.9 us against 143.3 (call 11).
# The split wide tiles that were faster alone for the out-projection and FFN2 (64x128 split 2) lose in the layer
# (+2 to +5 us), and the norms folded into these GEMMs cost 33 us: the seed keeps the norm kernels. A study found
# none of it: QKV's and FFN1's tiles are three parameters from its top-1.
WIDE_TILES = (GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3, tma=1),
              GemmConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4, tma=1))


def hand_picked_wide(shape: DecoderShape, num_sms: int) -> DecoderConfig | None:
    """hand_picked with the norm kernels, and each GEMM in the first of :data:`WIDE_TILES` whose CTAs make 60-100%
    of ``num_sms`` (the others keep hand_picked's tiles); None where no GEMM has such tiles (the presets: their
    GEMMs are too narrow for wide tiles in one wave), and from :data:`MANY_TOKENS` tokens (hand_picked_many)."""
    if shape.tokens >= MANY_TOKENS:
        return None
    hp = hand_picked(shape, norms=0)
    out = {}
    for name, (m, n, k) in shape.gemms().items():
        for c in WIDE_TILES:
            tiles, splits = grid(c, m, n)
            if 0.6 * num_sms <= tiles * splits <= num_sms and check(c, GemmProblem(m, n, k)) is None:
                out[name] = replace(c, overlap_ratio=0.0, prefetch_ratio=1.0)
                break
    return fit_config(replace(hp, **out), shape) if out else None


# A kernel's prefetch pulls its weights into L2 before its wait; where they are a large part of the L2, the kernel
# evicts what it prefetched before it reads it. H200 (60 MB of L2), 1x128x4096x32x11008 (QKV's weights 100 MB,
# FFN1's and FFN2's 90 MB), one process (perf notes 37): a default-budget study's top-1 177.1 us a layer with
# every prefetch at 1.0, 150.9 with 0.2, 150.8 with none (torch.compile 121.0). The seeds prefetch at most half the
# L2 a kernel.
PREFETCH_L2_SHARE = 0.5
_PREFETCH_GRID = (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)


def fit_prefetch(cfg: DecoderConfig, shape: DecoderShape, l2_bytes: int | None, dtype_bytes: int = 2) -> DecoderConfig:
    """``cfg`` with each GEMM's prefetch ratio (and the one-kernel layer's) lowered to the largest of 1.0, 0.8, ...,
    0.0 that prefetches at most :data:`PREFETCH_L2_SHARE` of ``l2_bytes`` of its weights; ratios below that, or
    negative (no prefetch), are kept. ``l2_bytes`` None: ``cfg`` unchanged."""
    if not l2_bytes:
        return cfg

    def fit(ratio: float, weight_bytes: int) -> float:
        cap = next(p for p in _PREFETCH_GRID if p * weight_bytes <= PREFETCH_L2_SHARE * l2_bytes or p == 0.0)
        return ratio if ratio <= cap else cap

    out = {}
    for name, (_, n, k) in shape.gemms().items():
        c = getattr(cfg, name)
        out[name] = replace(c, prefetch_ratio=fit(c.prefetch_ratio, n * k * dtype_bytes))
    out["layer"] = replace(cfg.layer, prefetch_ratio=fit(cfg.layer.prefetch_ratio, shape.weight_bytes(dtype_bytes)))
    return replace(cfg, **out)


# A clustered GEMM pays where its CTAs launch as one wave beside its predecessor's: up to ~3/4 of the SMs (a constant
# for the 132-SM H200 it was measured on, as many as an H100 SXM has; it only shapes a seed, the search still tries the
# rest). H200, in one process: bert-base's out-projection and FFN2, 24 tiles in clusters of 4 (96 CTAs), pay (19.7
# against 20.4-20.6 us); bert-large's 32 tiles in clusters of 4 (128 CTAs) do not: FFN2 +2.4 us a layer, the
# out-projection +1.3, where the out-projection in clusters of 2 (64 CTAs) gives -0.4 to -0.6, and FFN2 in 64x128
# tiles (64 CTAs) -0.2 to -0.45 (perf notes 35.2).
ONE_WAVE_CTAS = 96


def _cluster_split(c: GemmConfig, gemm: tuple[int, int, int], splits) -> int | None:
    """The largest of ``splits`` that the cluster kernel runs on ``c``'s tiles and whose CTAs (tiles x the split) fit
    ONE_WAVE_CTAS, else None."""
    from tuner.kernels import cluster_gemm

    bm, bn = cluster_tile(c, GemmProblem(*gemm))
    tiles = -(-gemm[0] // bm) * -(-gemm[1] // bn)
    return max((s for s in splits if tiles * s <= ONE_WAVE_CTAS and cluster_gemm.split_error(s, bn) is None),
               default=None)


def hand_picked_cluster(shape: DecoderShape, norms: int = 2, xchg16: bool = True, mlp: bool = True,
                        out_proj: bool = True, attn_in: bool = True,
                        block_prefetch: float | None = 0.4, qkv_attn: bool = True) -> DecoderConfig:
    """hand_picked with the split-K reduced inside thread-block clusters (GemmConfig.cluster, Hopper): FFN2's four
    splits, and the out-projection split four ways in 64-wide K tiles (H200, bert-base: 20.4-20.6 -> 19.7 us
    a layer), each where its CTAs launch as one wave (ONE_WAVE_CTAS; bert-large: the out-projection split two ways,
    FFN2 in 64x128 tiles).
    ``xchg16``: the partials exchanged in 16 bits (cluster 2; H200, bert-base 19.68-19.79 -> 19.11-19.36 us, tiny
    11.09-11.30 -> 10.16-10.18: perf notes section 22), else in fp32 (cluster 1). ``mlp``: on a few tokens, the
    feed-forward block as one kernel where it fits (``ffn2.fuse``: perf notes section 23); ``out_proj``: with it the
    out-projection computed in that kernel too where it fits (``out.fuse``: perf notes section 24); ``attn_in``: and
    the attention in front of it where it fits (``attn.fuse``: perf notes section 25); ``block_prefetch``: with the
    attention there, the block's ``ffn1.prefetch_ratio`` (the share of its weight tiles loaded before the wait; None:
    hand_picked's). ``qkv_attn``: where the attention is not in that block, the attention computed by QKV's kernel
    where it runs (``qkv.fuse``: perf notes section 27).
    Where a GEMM's tiles do not fit the CUDA kernel it keeps the Triton kernels (repair)."""
    from tuner.kernels import cluster_gemm, mlp_cluster

    hp = hand_picked(shape, norms)
    gemms = shape.gemms()
    cl = 2 if xchg16 else 1
    # The out-projection split four ways, or two where four would not launch as one wave (bert-large); FFN2 at
    # hand_picked's split, in 64-column tiles or, where those would not launch as one wave, 128 (bert-large: 64
    # CTAs, -0.2 to -0.45 us a layer against Triton's split 4 and its reduction kernel; 64-column tiles in clusters
    # of 2 measured +0.6: perf notes 35.2).
    out_c = replace(hp.out, block_n=64, block_k=64, num_stages=6, cluster=cl)
    want = {}
    if (s := _cluster_split(out_c, gemms["out"], cluster_gemm.SPLITS)) is not None:
        want["out"] = replace(out_c, split_k=s)
    for ffn2 in (hp.ffn2, replace(hp.ffn2, block_n=128)):  # (or in the kernel's wider tiles: half the CTAs)
        if _cluster_split(ffn2, gemms["ffn2"], (ffn2.split_k,)) is not None:
            want["ffn2"] = replace(ffn2, cluster=cl)
            break
    few = shape.batch * shape.seq <= 64 and norms == 2
    if few:
        # A few tokens (tiny): QKV split four ways in clusters too, its LayerNorm applied in the cluster epilogue
        # from FFN2's row sums (H200, tiny: 11.12-11.34 -> 10.97 us). On 128 tokens every clustered QKV or FFN1
        # measured slower: the distributed-shared-memory exchange of a 128-wide partial costs more than the
        # split saves (docs/perf-notes.md section 16).
        want["qkv"] = replace(hp.qkv, block_k=64, num_stages=2, split_k=4, cluster=cl)
    kw = {n: c for n, c in want.items() if check(c, GemmProblem(*gemms[n])) is None}
    out = replace(hp, **kw)
    if few and mlp and mlp_cluster.error(shape.tokens, shape.d_model, shape.ffn) is None:
        # and the feed-forward block as one kernel (H200, tiny: 10.16-10.21 -> 9.23-9.28 us)
        out = replace(out, ffn2=replace(out.ffn2, fuse=1))
        if out_proj and mlp_cluster.error(shape.tokens, shape.d_model, shape.ffn, out_proj=True) is None:
            # and the out-projection in front of it (H200, tiny: 9.62-9.71 -> 8.79-8.87 us)
            out = replace(out, out=replace(out.out, fuse=1))
            if (attn_in and shape.batch == 1 and shape.head_dim == 64
                    and mlp_cluster.error(shape.tokens, shape.d_model, shape.ffn, out_proj=True, attn=True) is None):
                # and the attention in front of that (H200, tiny: 8.85-8.86 -> 8.27-8.37 us, perf notes 25.4), with
                # only wo's tiles before the wait (tiny: 8.14 -> 7.84 us, perf notes 26.4)
                out = replace(out, attn=replace(out.attn, fuse=1))
                if block_prefetch is not None:
                    out = replace(out, ffn1=replace(out.ffn1, prefetch_ratio=block_prefetch))
    if qkv_attn and norms == 2 and not out.attn.fuse:
        # QKV and the attention in one kernel, a cluster a head (H200, bert-base 19.02-19.19 -> 18.69-18.81 us,
        # bert-large 25.99-26.27 -> 25.10-25.19: perf notes 27)
        fused = replace(out, qkv=replace(out.qkv, fuse=1))
        if qkv_attn_error(shape, fused) is None:
            out = fused
    return out


def square_split_ffn2(cfg: DecoderConfig, shape: DecoderShape) -> DecoderConfig | None:
    """``cfg`` with a clustered FFN2 in 128x128 tiles split eight ways (clusters of 8; 8 warps, 4 stages of 64-wide K
    tiles), where those launch as one wave (ONE_WAVE_CTAS) and each CTA streams fewer bytes than ``cfg``'s FFN2 CTAs
    ((rows + columns of its tile) x K / split: 128-row tiles read the weights once, not once a 64-row tile); else
    None. H100, bert-large (64x128 split 4: 64 CTAs of 384 KB; these: 64 of 256 KB): 24.58-24.70 us a layer against
    25.04-25.08; bert-base (64x64 split 4, 96 CTAs of 192 KB; these: 48 of 192 KB) +1.2 (perf notes 40)."""
    f = cfg.ffn2
    if not f.cluster or f.fuse or cfg.ffn1.fuse:
        return None
    sq = replace(f, block_m=128, block_n=128, num_warps=8, split_k=8, block_k=64, num_stages=4)
    gemm = shape.gemms()["ffn2"]
    bm, bn = cluster_tile(f, GemmProblem(*gemm))
    fewer_bytes = (128 + 128) / 8 < (bm + bn) / f.split_k
    if not fewer_bytes or _cluster_split(sq, gemm, (8,)) is None or check(sq, GemmProblem(*gemm)) is not None:
        return None
    return replace(cfg, ffn2=sq)


def hand_picked_fused(shape: DecoderShape, cuda: bool = False) -> DecoderConfig:
    """hand_picked's per-kernel tiles plus the one-kernel layer switched on (tuner.kernels.fused_layer):
    8 warps, 64-row tiles, 4-stage K loops, split-K 4 on FFN2, PDL at the start + full weight prefetch
    (H200 phase timelines: docs/perf-notes.md section 6). ``cuda``: the CUDA layer kernel instead (fuse 2, Hopper;
    kernels/layer_kernel.cu): 8-stage rings, the out-projection and FFN2 split 4."""
    from tuner.kernels.fused_layer import FusedLayerConfig

    if cuda:
        layer = FusedLayerConfig(fuse=2, num_stages=8, out_split_k=4, ffn2_split_k=4, overlap_ratio=0.0,
                                 prefetch_ratio=1.0)
    else:
        layer = FusedLayerConfig(fuse=1, num_warps=8, num_stages=4, block_m=64, block_k=64, qkv_block_n=64,
                                 out_block_n=32, ffn1_block_n=64, ffn2_block_n=64, ffn2_split_k=4, attn_block_m=32,
                                 attn_block_n=128, overlap_ratio=0.0, prefetch_ratio=1.0)
    return fit_config(replace(hand_picked(shape), layer=layer), shape)


@dataclass
class Row:
    name: str
    median_us: float
    spread_us: float
    rel_err: float | None
    ok: bool

    def to_dict(self):
        return dict(self.__dict__)


def as_run_here(cfg: DecoderConfig, shape: DecoderShape, dtype_bytes: int, device) -> tuple[DecoderConfig, str]:
    """``cfg`` as this dtype and GPU can run it (tuner.layer.repair_config, as TunedLayer does: e.g. a best.json tuned
    in fp16 launches CUDA kernels of 16-bit operands, which fp32 switches off), and a note for its row naming the
    kernels that changed ('' where none did)."""
    fixed = repair_config(cfg, shape, dtype_bytes, device)
    changed = [n for n, c in fixed.kernels() if c != getattr(cfg, n)]
    return fixed, (f" (repaired for {dtype_bytes}-byte operands on this GPU: {', '.join(changed)})" if changed else "")


def _ours(shape, cfg, dtype, n_layers, weights, reps, warmup, seed, name) -> Row:
    dev = DeviceInfo.from_torch()
    esize = torch.tensor([], dtype=dtype).element_size()
    cfg, note = as_run_here(cfg, shape, esize, dev)
    name += note
    bad = check_config(cfg, shape, esize, dev)
    if bad:
        raise ValueError(f"{name}: invalid config {bad}")
    st = DecoderStack(shape, cfg, n_layers=n_layers, dtype=dtype, weights=weights)
    st.capture()
    err = st.check(seed)
    t = time_replay(st.replay, n_layers, reps=reps, warmup=warmup)
    return Row(name, t.median_us, t.spread_us, err, err < st.tolerance())


def run_bench(shape: DecoderShape, *, dtype=torch.float16, l2: str = "cold", reps: int = 50, warmup: int = 10,
              seed: int = 0, extra_configs: dict[str, DecoderConfig] | None = None,
              compile_baseline: bool = True, log=print) -> dict:
    dev = DeviceInfo.from_torch()
    esize = torch.tensor([], dtype=dtype).element_size()
    n_layers = stack_depth(shape, esize, dev.l2_bytes, l2)
    weights = random_stack_weights(shape, n_layers, dtype, "cuda", seed)  # every variant runs on these
    rows: list[Row] = []
    tol = REL_TOLERANCE[dtype]

    t0 = time.time()
    torch_rows = [("torch eager (cuBLAS+SDPA), CUDA graph", False)]
    if compile_baseline:
        torch_rows.append(("torch.compile (inductor default), CUDA graph", True))
    for name, compiled in torch_rows:
        ts = TorchStack(shape, weights, dtype, compiled=compiled)
        e = ts.check(seed)
        t = ts.time(reps, warmup)
        rows.append(Row(name, t.median_us, t.spread_us, e, e < tol))
        del ts
        log(f"  {name.split(' (')[0]} done ({time.time() - t0:.0f}s)")
    rows.append(_ours(shape, default_config(shape), dtype, n_layers, weights, reps, warmup, seed,
                      "ours, (-1,-1), default tiles"))
    hp = hand_picked(shape)
    rows.append(_ours(shape, hp.without_knobs(), dtype, n_layers, weights, reps, warmup, seed,
                      "ours, (-1,-1), hand-picked tiles"))
    rows.append(_ours(shape, hp, dtype, n_layers, weights, reps, warmup, seed,
                      "ours, PDL + full prefetch (0.0,1.0), hand-picked tiles"))
    rows.append(_ours(shape, hand_picked(shape, norms=0), dtype, n_layers, weights, reps, warmup, seed,
                      "ours, (0.0,1.0), hand-picked tiles, with the two norm kernels"))
    rows.append(_ours(shape, hp.with_knobs(1.0, 1.0), dtype, n_layers, weights, reps, warmup, seed,
                      "ours, PDL + full prefetch (1.0,1.0), hand-picked tiles"))
    rows.append(_ours(shape, hand_picked_fused(shape), dtype, n_layers, weights, reps, warmup, seed,
                      "ours, one-kernel layer (0.0,1.0), hand-picked"))
    for name, cfg in (extra_configs or {}).items():
        rows.append(_ours(shape, cfg, dtype, n_layers, weights, reps, warmup, seed, name))
    log(f"  ours done ({time.time() - t0:.0f}s)")
    bw = copy_bandwidth_bytes_per_s()
    floor_us = shape.weight_bytes(esize) / bw * 1e6
    rows.append(Row(f"floor: {shape.weight_bytes(esize) / 1e6:.1f} MB of weights at {bw / 1e12:.2f} TB/s",
                    floor_us, 0.0, None, True))
    return {"shape": shape.to_dict(), "dtype": dtype_name(dtype), "device": dev.to_dict(),
            "policy": policy(l2, n_layers, reps, warmup), "copy_bandwidth_bytes_per_s": bw,
            "rows": [r.to_dict() for r in rows]}


def format_table(result: dict) -> str:
    rows = result["rows"]
    eager = rows[0]["median_us"]
    comp = next((r["median_us"] for r in rows if r["name"].startswith("torch.compile")), None)
    sh = result["shape"]
    lines = [f"### {sh['name'] or ''} {sh['batch']}x{sh['seq']}x{sh['d_model']}x{sh['heads']}x{sh['ffn']} "
             f"({result['dtype']}, L2 {result['policy']['l2']}, stack of {result['policy']['stack_layers']} layers, "
             f"{result['device']['name']})", "",
             "| variant | us/layer | ± | vs eager | vs torch.compile | rel. error | check |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        err = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        vs_c = f"{comp / r['median_us']:.2f}x" if comp else ""
        lines.append(f"| {r['name']} | {r['median_us']:.2f} | {r['spread_us']:.2f} | {eager / r['median_us']:.2f}x"
                     f" | {vs_c} | {err} | {'ok' if r['ok'] else 'FAIL'} |")
    return "\n".join(lines) + "\n"


def save(result: dict, out_dir: Path, command: list[str]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest.write_json_atomic(out_dir / "manifest.json", manifest.make(command, kind="bench",
                                                                          shape=result["shape"],
                                                                          dtype=result["dtype"],
                                                                          policy=result["policy"]))
    manifest.write_json_atomic(out_dir / "bench.json", result)
    manifest.write_text_atomic(out_dir / "bench.md", format_table(result))
    return out_dir
