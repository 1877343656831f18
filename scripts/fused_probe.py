"""The one-kernel layer (tuner.kernels.fused_layer) against the per-kernel best of a committed run, in
one process: correctness gate, interleaved timing, torch.compile, per-phase nothing (one kernel).

usage: python3 scripts/fused_probe.py SHAPE [BEST_JSON] [OUT.json]
"""

import json
import sys
from dataclasses import replace

from tuner.evaluate import GpuEvaluator
from tuner.export import load_config
from tuner.kernels.fused_layer import FusedLayerConfig
from tuner.layer import default_config, fit_config
from tuner.shapes import resolve


def variants(shape):
    m = shape.tokens
    base = FusedLayerConfig(fuse=1, block_m=min(64, m), block_k=64, num_stages=3, qkv_block_n=64, out_block_n=32,
                            ffn1_block_n=64, ffn2_block_n=64, ffn2_split_k=4, overlap_ratio=0.0, prefetch_ratio=1.0)
    v = {
        "fused (0,1)": base,
        "fused knobs off": base.without_knobs(),
        "fused (-1,1)": replace(base, overlap_ratio=-1.0),
        "fused (0,-1)": replace(base, prefetch_ratio=-1.0),
        "fused (1,1)": replace(base, overlap_ratio=1.0),
        "fused bm128 bn32": replace(base, block_m=min(128, m), qkv_block_n=32, out_block_n=16, ffn1_block_n=32,
                                    ffn2_block_n=32, ffn2_split_k=6),
        "fused bk128 s4": replace(base, block_k=128, num_stages=4),
        "fused split all": replace(base, qkv_split_k=2, out_split_k=4, ffn1_split_k=2, ffn2_split_k=8),
        "fused 8 warps": replace(base, num_warps=8),
        "fused 64 progs": replace(base, programs=64),
        "fused attn 32x32": replace(base, attn_block_m=32, attn_block_n=32),
    }
    return v


def main():
    shape = resolve(sys.argv[1])
    ev = GpuEvaluator(shape)
    v = {"baseline (-1,-1) default tiles": default_config(shape)}
    if len(sys.argv) > 2 and sys.argv[2] != "-":
        v["per-kernel best (committed run)"] = load_config(sys.argv[2], shape=shape)
    v.update({k: replace(default_config(shape), layer=c) for k, c in variants(shape).items()})
    v = {k: fit_config(c, shape) for k, c in v.items()}
    res, good = {}, {}
    for name, cfg in v.items():
        r = ev.evaluate(cfg)
        res[name] = {"status": r.status, "reason": r.reason, "search_us": r.latency_us, "rel_error": r.rel_error}
        print(f"{name}: {r.status} {r.latency_us} {r.reason or ''}", flush=True)
        if r.status == "ok":
            good[name] = cfg
    meas = ev.remeasure(list(good.values()), rounds=30)
    for (name, cfg), (m, s, _) in zip(good.items(), meas):
        res[name].update(latency_us=m, spread_us=s, config=cfg.to_dict())
    b = ev.baselines(default_config(shape))
    base = res["baseline (-1,-1) default tiles"]["latency_us"]
    print(f"torch eager {b.eager_us:.2f}  torch.compile {b.compile_us}  floor {b.floor_us:.2f}")
    print(f"{'variant':<36} {'us/layer':>9} {'±':>5} {'speedup':>8} {'/compile':>8}")
    for name, r in res.items():
        if "latency_us" not in r:
            print(f"{name:<36} {r['status']}: {(r['reason'] or '')[:90]}")
            continue
        print(f"{name:<36} {r['latency_us']:9.2f} {r['spread_us']:5.2f} {base / r['latency_us']:7.2f}x "
              f"{r['latency_us'] / b.compile_us if b.compile_us else float('nan'):8.2f}")
    if len(sys.argv) > 3:
        with open(sys.argv[3], "w") as fh:
            json.dump({"shape": shape.to_dict(), "device": ev.device.to_dict(), "variants": res,
                       "eager_us": b.eager_us, "compile_us": b.compile_us, "floor_us": b.floor_us}, fh, indent=1)


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
