"""Hand-made variants of one shape, measured interleaved in one process, with a per-kernel breakdown.

usage: python3 scripts/perf_probe.py bert-base [OUT.json]
Every variant passes the correctness gate before it is timed. Used for docs/perf-notes.md.
"""

import json
import sys
from dataclasses import replace

from tuner.bench import hand_picked
from tuner.evaluate import GpuEvaluator
from tuner.layer import default_config, fit_config
from tuner.shapes import resolve


def gemms(cfg, **kw):
    return replace(cfg, **{n: replace(getattr(cfg, n), **kw) for n in ("qkv", "out", "ffn1", "ffn2")})


def fused(cfg):
    return replace(cfg, norm1=replace(cfg.norm1, fuse=1), norm2=replace(cfg.norm2, fuse=1))


def main():
    shape = resolve(sys.argv[1])
    ev = GpuEvaluator(shape)
    hp = hand_picked(shape)
    f = fused(hp)
    f = fused(hp)
    v = {
        "baseline (-1,-1) default tiles": default_config(shape),
        "hand-picked, knobs off": hp.without_knobs(),
        "hand-picked (0,1)": hp,
        "hp (0,1) bk128 s4": gemms(hp, block_k=128, num_stages=4),
        "hp (0,1) bk128 s6": gemms(hp, block_k=128, num_stages=6),
        "hp (0,1) bk256 s3": gemms(hp, block_k=256, num_stages=3),
        "fused norms (0,1)": f,
        "fused bk128 s4": gemms(f, block_k=128, num_stages=4),
        "fused bk128 s6": gemms(f, block_k=128, num_stages=6),
        "fused bk256 s3": gemms(f, block_k=256, num_stages=3),
        "fused bk128 s6 bn32": gemms(f, block_k=128, num_stages=6, block_n=32),
        "fused bk128 s6 knobs off": gemms(f, block_k=128, num_stages=6).without_knobs(),
        "fused bk128 s6 (1,1)": gemms(f, block_k=128, num_stages=6).with_knobs(1.0, 1.0),
        "fused bk128 s6 (0,-1)": gemms(f, block_k=128, num_stages=6).with_knobs(0.0, -1.0),
    }
    v = {k: fit_config(c, shape) for k, c in v.items()}
    res = {}
    good = {}
    for name, cfg in v.items():
        r = ev.evaluate(cfg)
        res[name] = {"status": r.status, "reason": r.reason, "search_us": r.latency_us}
        if r.status == "ok":
            good[name] = cfg
    meas = ev.remeasure(list(good.values()), rounds=30)
    for (name, cfg), (m, s, _) in zip(good.items(), meas):
        res[name].update(latency_us=m, spread_us=s, breakdown=ev.breakdown(cfg), config=cfg.to_dict())
    base = res["baseline (-1,-1) default tiles"]["latency_us"]
    print(f"{'variant':<40} {'us/layer':>9} {'±':>5} {'speedup':>8}  per kernel (alone)")
    for name, r in res.items():
        if "latency_us" not in r:
            print(f"{name:<40} {r['status']}: {r['reason'][:80]}")
            continue
        bd = " ".join(f"{k}={t:.1f}" for k, t in r["breakdown"].items())
        print(f"{name:<40} {r['latency_us']:9.2f} {r['spread_us']:5.2f} {base / r['latency_us']:7.2f}x  {bd}")
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as fh:
            json.dump({"shape": shape.to_dict(), "device": ev.device.to_dict(), "variants": res}, fh, indent=1)


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
