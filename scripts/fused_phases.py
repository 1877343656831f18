"""Where the one-kernel layer spends its time: every program stamps %globaltimer at each phase boundary.

usage: python3 scripts/fused_phases.py SHAPE [OUT.json]
For a few configs: a cold stack of L layers in one CUDA graph, replayed; per boundary the min / median /
max over programs of the time since the layer's first program started (us), averaged over the middle
layers; plus the un-instrumented per-layer time of the same graph for the instrumentation's cost.
"""

import json
import statistics
import sys
from dataclasses import replace

import torch

from tuner.device import DeviceInfo
from tuner.kernels import fused_layer as fk
from tuner.layer import LN_EPS, fit_config, layer_problem, random_stack_weights, stack_depth
from tuner.shapes import resolve
from tuner.timing import capture, time_replay
from tuner.bench import hand_picked_fused
from tuner.config import DecoderConfig

SLOTS = ["start", "prefetched", "waited", "qkv", "bar0", "attn", "bar1", "out", "bar2", "ffn1", "bar3", "ffn2"]


def run(shape, cfg, weights, times: bool):
    p = layer_problem(shape)
    x = torch.randn(shape.tokens, shape.d_model, dtype=torch.float16, device="cuda")
    scr = [fk.LayerScratch(cfg, p, torch.float16, "cuda") for _ in weights]
    outs = [torch.empty_like(x) for _ in weights]
    nprog = fk.programs_for(cfg, x)
    tb = [torch.zeros(nprog, fk.N_STAMPS, 2, dtype=torch.int64, device="cuda") for _ in weights] if times else None
    fw = [w.fused() for w in weights]

    def fn():
        h = x
        for i in range(len(weights)):
            fk.decoder_layer(h, fw[i], seq=shape.seq, heads=shape.heads, config=cfg, scratch=scr[i], out=outs[i],
                             eps=LN_EPS, _times=tb[i] if times else None)
            h = outs[i]

    g = capture(fn)
    t = time_replay(g.replay, len(weights), reps=30, warmup=5)
    return t, tb


def main():
    shape = resolve(sys.argv[1])
    dev = DeviceInfo.from_torch()
    n = stack_depth(shape, 2, dev.l2_bytes)
    weights = random_stack_weights(shape, n, torch.float16, "cuda", 0)
    base = hand_picked_fused(shape).layer
    variants = {
        "hand-picked (0,1)": base,
        "attn 16x128": replace(base, attn_block_m=16),
        "stages 8": replace(base, num_stages=8),
        "bm128 qkv n32/sk2 ffn1 n32 ffn2 n32/sk4": replace(base, block_m=128, qkv_block_n=32, qkv_split_k=2,
                                                           out_block_n=16, ffn1_block_n=32, ffn2_block_n=32),
        "96 programs": replace(base, programs=96),
    }
    report = {}
    for name, c in variants.items():
        c = fit_config(DecoderConfig(layer=c), shape).layer
        plain, _ = run(shape, c, weights, False)
        stamped, tb = run(shape, c, weights, True)
        torch.cuda.synchronize()
        rows = {s: [] for s in SLOTS}
        spans, periods = [], []
        starts = []
        for li in range(1, len(weights) - 1):
            t = tb[li][:, :, 0].double().cpu()  # ns, [programs, slots]
            t0 = t[:, 0].min()
            starts.append(float(t0))
            spans.append(float(t[:, 11].max() - t0) / 1e3)
            for si, s in enumerate(SLOTS):
                col = (t[:, si] - t0) / 1e3
                rows[s].append((float(col.min()), float(col.median()), float(col.max())))
        periods = [(b - a) / 1e3 for a, b in zip(starts, starts[1:])]
        print(f"== {shape.name} {name}: {plain.median_us:.2f} us/layer plain, {stamped.median_us:.2f} stamped; "
              f"span {statistics.median(spans):.2f}, period {statistics.median(periods):.2f} us")
        out = {}
        for s in SLOTS:
            mn = statistics.mean(r[0] for r in rows[s])
            md = statistics.mean(r[1] for r in rows[s])
            mx = statistics.mean(r[2] for r in rows[s])
            out[s] = (mn, md, mx)
            print(f"  {s:<11} min {mn:7.2f}  med {md:7.2f}  max {mx:7.2f}")
        report[name] = {"config": c.to_dict(), "plain_us": plain.median_us, "stamped_us": stamped.median_us,
                        "span_us": statistics.median(spans), "period_us": statistics.median(periods), "slots": out}
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as fh:
            json.dump({"shape": shape.to_dict(), "device": dev.to_dict(), "variants": report}, fh, indent=1)


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
