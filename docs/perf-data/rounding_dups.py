"""How many measured trials of recorded studies launched what an earlier one did, up to ratios that round to the same
K iteration (perf notes 47.7). The GEMMs' ratios become their trigger and prefetch points (gemm.linear's Triton and
cluster kernels, the fused QKV kernel; the block's and the other kernels' ratios are kept as they are: a conservative
count). CPU only, on committed run folders.

usage: python docs/perf-data/rounding_dups.py results/<shape>/<stamp>-tpe [...]
"""
import json
import math
import sys

import pandas as pd
from tuner.config import DecoderConfig, GEMMS
from tuner.layer import launched_config
from tuner.shapes import resolve
from tuner.kernels._common import trigger_index, prefetch_count

def key(cfg, shape):
    c = launched_config(cfg)
    d = c.to_dict()
    gem = shape.gemms()
    for g in GEMMS:
        kc = getattr(c, g)
        if g == "qkv" and kc.fuse == 1:  # qkv_attn: 64-wide tiles of d_model
            it = shape.d_model // 64
            d["kernels"][g]["overlap_ratio"] = ("t", trigger_index(it, kc.overlap_ratio))
            d["kernels"][g]["prefetch_ratio"] = ("p", prefetch_count(it, kc.prefetch_ratio))
            continue
        if g == "ffn1" and c.ffn2.fuse:  # the block: keep
            continue
        if g == "ffn2" and c.ffn2.fuse:
            continue
        if g == "out" and c.out.fuse:
            continue
        _, _, K = gem[g]
        per_split = math.ceil(math.ceil(K / kc.block_k) / kc.split_k)
        it = per_split * kc.block_k // 64 if kc.cluster else per_split
        t = trigger_index(it, kc.overlap_ratio)
        if not kc.cluster and kc.split_k > 1:
            t = (t, trigger_index(kc.split_k, kc.overlap_ratio))  # the reduction kernel's trigger too
        d["kernels"][g]["overlap_ratio"] = ("t", t)
        d["kernels"][g]["prefetch_ratio"] = ("p", prefetch_count(it, kc.prefetch_ratio))
    return json.dumps(d, sort_keys=True, default=str)

for folder in sys.argv[1:]:
    shape = resolve(folder.rstrip("/").split("/")[-2])  # results/<preset>/<stamp>-tpe
    t = pd.read_csv(f"{folder}/trials.csv")
    meas = t[t["duplicate_of"].isna() & (t["status"] == "ok")]
    seen, same = {}, []
    cols = [c for c in t.columns if "." in c]
    for _, r in meas.iterrows():
        kern = {}
        for c in cols:
            kname, f = c.split(".", 1)
            v = r[c]
            if isinstance(v, float) and v.is_integer() and not f.endswith("ratio"):
                v = int(v)
            kern.setdefault(kname, {})[f] = v
        cfg = DecoderConfig.from_dict({"schema_version": 1, "kernels": kern})
        kk = key(cfg, shape)
        if kk in seen:
            same.append((int(r["number"]), seen[kk], round(float(r["latency_us"]), 2),
                         round(float(meas.set_index("number").loc[seen[kk], "latency_us"]), 2)))
        else:
            seen[kk] = int(r["number"])
    print(f"{folder}: {len(t)} trials, {len(meas)} measured, {len(same)} launched what an earlier one did up to "
          f"rounding (trial, earlier trial, their us): {same}")
