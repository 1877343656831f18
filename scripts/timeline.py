"""Where a per-kernel layer spends its time: every kernel's start and end inside the timed CUDA graph.

usage: python3 scripts/timeline.py SHAPE [--hot] [--red=BMxBN] [--layers=N] [VARIANT[@switch=0|1,...] ...]
variants: hp, hp-off, hp-fused-norms, hp-stats-norms, a best.json, BASE:kernel.field=value,..., or compile / eager
(the torch.compile and eager baselines' kernels on the same weights)
switches (module flags, for one variant; A/B of kernel code in one process): fast_gelu, early_stats, cg_early=N,
desc_prefetch, cg_spread, cg_all_slabs, cg_even, qa_chunk=N, qa_push=N, mufu, cluster_policy=N (0 default, 1 spread,
2 load balancing: the clustered launches' scheduling policy preference), sync_domain=N (0 default, 1 remote: the
clustered launches' memory synchronization domain).
For each variant: a cold stack of L layers in one CUDA graph (as the tuner times it); a few replays under
torch.profiler (CUPTI records each kernel of a graph); per kernel of a middle layer (of two layers, the
second), median over layers and replays, in us: the start relative to the previous kernel's end (negative:
launched early by PDL), the duration, and what it adds to the layer (its end minus the previous kernel's end). The un-profiled
per-layer time of the same graph is printed beside, for the profiler's own cost.
"""

import statistics
import sys
from dataclasses import replace

import torch

import tuner.kernels.gemm as gemm_k
from tuner.bench import hand_picked
from tuner.device import DeviceInfo
from tuner.export import load_config
from tuner.layer import DecoderStack, check_config, fit_config, random_stack_weights, stack_depth
from tuner.shapes import resolve
from tuner.timing import kernel_records, time_replay


def variant(shape, name):
    """hp, hp-off, hp-fused-norms, a best.json, or BASE:kernel.field=value,... (e.g. hp:out.split_k=3)."""
    if ":" in name:
        base, edits = name.split(":", 1)
        return fit_config(variant(shape, base).edited(edits.split(",")), shape)
    hp = hand_picked(shape)
    if name == "hp":
        return hp
    if name == "hp-off":
        return hp.without_knobs()
    if name in ("hp-fused-norms", "hp-stats-norms"):
        f = 1 if name == "hp-fused-norms" else 2
        return replace(hp, norm1=replace(hp.norm1, fuse=f), norm2=replace(hp.norm2, fuse=f))
    return load_config(name, shape=shape)


def _switches():
    from tuner.kernels import _nvcc, cluster_gemm, qkv_attn

    return {"fast_gelu": (gemm_k, "_FAST_GELU"), "early_stats": (gemm_k, "_EARLY_STATS"),
            "desc_prefetch": (gemm_k, "_DESC_PREFETCH"), "cg_early": (cluster_gemm, "EARLY_TILES"),
            "cg_spread": (cluster_gemm, "SPREAD"), "cg_all_slabs": (cluster_gemm, "ALL_SLABS_PUSHED"),
            "cg_even": (cluster_gemm, "EVEN_BUILDS"),
            "qa_chunk": (qkv_attn, "CHUNK"), "qa_push": (qkv_attn, "PUSH"),
            "mufu": (_nvcc, "MUFU_MATH"), "cluster_policy": (_nvcc, "CLUSTER_POLICY"),
            "sync_domain": (_nvcc, "MEM_SYNC_DOMAIN")}


_DEFAULTS = {}


def apply_switches(name: str) -> str:
    """Set the module flags of ``name``'s ``@switch=0|1,...`` suffix (every other flag back to its default);
    returns the variant without the suffix."""
    switches = _switches()
    if not _DEFAULTS:
        _DEFAULTS.update({sw: getattr(*sw) for sw in switches.values()})
    for (mod, attr), v in _DEFAULTS.items():
        setattr(mod, attr, v)
    if "@" in name:
        for e in name.split("@", 1)[1].split(","):
            key, v = e.split("=")
            ints = ("cg_early", "qa_chunk", "qa_push", "cluster_policy", "sync_domain")
            setattr(*switches[key], int(v) if key in ints else bool(int(v)))
    return name.split("@", 1)[0]


def main():
    hot = "--hot" in sys.argv  # every layer the same weights: they stay in L2 (what prefetch could reach)
    args = [a for a in sys.argv[1:] if a != "--hot"]
    red = [a for a in args if a.startswith("--red=")]  # the split-K reduction's tile, e.g. --red=16x64
    if red:
        gemm_k._RED_BLOCK_M, gemm_k._RED_BLOCK_N = (int(v) for v in red[-1].split("=")[1].split("x"))
        print(f"split-K reduction tile {gemm_k._RED_BLOCK_M}x{gemm_k._RED_BLOCK_N}")
        args = [a for a in args if not a.startswith("--red=")]
    layers = [a for a in args if a.startswith("--layers=")]  # a deeper stack than the tuner's (--layers=8)
    args = [a for a in args if not a.startswith("--layers=")]
    shape = resolve(args[0])
    names = args[1:] or ["hp", "hp-off", "hp-fused-norms"]
    dev = DeviceInfo.from_torch()
    n = int(layers[-1].split("=")[1]) if layers else stack_depth(shape, 2, dev.l2_bytes)
    weights = random_stack_weights(shape, 1 if hot else n, torch.float16, "cuda", 0) * (n if hot else 1)
    reps = 5
    tag = " (weights hot in L2)" if hot else ""
    for name in names:
        if name in ("compile", "eager"):  # the baselines' kernels, the same weights, one graph
            from tuner.baselines import TorchStack

            ts = TorchStack(shape, weights, torch.float16, compiled=name == "compile")
            err = ts.check(1)
            table(f"{shape.name}{tag} torch {name}", ts.replay, n, reps, err)
            continue
        cfg = variant(shape, apply_switches(name))
        bad = check_config(cfg, shape, 2, dev)
        if bad:
            print(f"\n## {shape.name} {name}: invalid {bad}")
            continue
        st = DecoderStack(shape, cfg, n_layers=n, dtype=torch.float16, weights=weights)
        st.capture()
        table(f"{shape.name}{tag} {name}", st.replay, n, reps, st.check(1))


def table(title, replay, n, reps, err):
    """Print the per-kernel table of ``replay`` (a graph of ``n`` layers): median over replays and the middle
    layers (with two layers, the second)."""
    t = time_replay(replay, n, reps=30, warmup=5)
    ks = kernel_records(replay, reps)
    per_rep = len(ks) // reps
    per_layer = per_rep // n
    # The first layer may launch more kernels than the others (extra), e.g. its QKV on the Triton kernels, since
    # its LayerNorm gathers its row sums in the K loop (no producer wrote them): the middle layers come after.
    extra = per_rep - per_layer * n
    if per_rep * reps != len(ks) or extra >= per_layer or n < 2:
        print(f"\n## {title}: {t.median_us:.2f} us/layer un-profiled; rel err {err:.1e}; "
              f"{len(ks)} kernel records for {reps}x{n} layers: no per-kernel table")
        return
    rows = {}
    for r in range(reps):
        rep = ks[r * per_rep:(r + 1) * per_rep]
        for layer in range(1, max(n - 1, 2)):
            for j in range(per_layer):
                i = extra + layer * per_layer + j
                kname, s, e = rep[i]
                prev_end = rep[i - 1][2]
                rows.setdefault(j, []).append((kname, s - prev_end, e - s, e - prev_end))
        layer_us = (rep[-1][2] - rep[0][1]) / n
    med = lambda xs: statistics.median(xs)  # noqa: E731
    print(f"\n## {title}: {t.median_us:.2f} us/layer un-profiled, {layer_us:.2f} profiled; "
          f"rel err {err:.1e}; {per_layer} kernels a layer, {n} layers")
    print("| kernel | start - prev end | duration | adds |")
    print("|---|---:|---:|---:|")
    total = 0.0
    for j, v in rows.items():
        adds = med([x[3] for x in v])
        total += adds
        print(f"| {v[0][0][:40]} | {med([x[1] for x in v]):.2f} | {med([x[2] for x in v]):.2f} | {adds:.2f} |")
    print(f"| sum | | | {total:.2f} |")


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
