"""Inside each GEMM of the timed stack: when its programs start, leave gdc_wait, finish the K loop and end.

usage: python3 scripts/trace_gemms.py SHAPE [--hot] CONFIG [CONFIG ...]   (CONFIG: a best.json or a timeline.py
variant, e.g. best.json:out.split_k=2, with timeline.py's @switch=0|1 suffixes; --hot: every layer the same weights,
so that they stay in L2)
The stack is built and captured as the tuner times it (cold weights, one CUDA graph); every GEMM launch
gets a trace buffer and stamps %globaltimer (ns) per program at four points (kernels/_common.stamp):
entry, gdc_wait returned, K loop done, epilogue stored. Per GEMM of the middle layers (median over layers):
  launched early  first wait return - first entry (how long its programs sat waiting/prefetching)
  entry skew      last entry - first entry (~0 when every program finds a free SM at once)
  wait skew       last wait return - first wait return
  loop            median over programs of (loop done - wait return)
  epilogue        median over programs of (end - loop done)
  span            last end - first wait return (the GEMM's share of the critical path)
  boundary        first wait return - the previous GEMM's last end (where the two are consecutive)
  split skew      (split-K reduced in a cluster) median over tiles of the spread of its splits' K-loop ends: how long
                  the first split to finish waits for the last one's partial
With ffn2.fuse 1 the row "ffn1" is the feed-forward block as one kernel (kernels/mlp_cluster.cu): its "loop" is
both GEMMs (the token tile's load included, and with out.fuse 1 the out-projection and its exchange), its "epilogue"
the exchange and the stores.
The stamps add a few instructions per program: compare the un-traced per-layer time printed beside.
%globaltimer advances in coarse steps on the H200 (the medians land on multiples of 0.25 us): read the
figures as +- 0.25 us.
"""

import os
import statistics
import sys

import torch

import tuner.kernels.gemm as gemm_k
from tuner.kernels import cluster_gemm, mlp_cluster, qkv_attn
from tuner.device import DeviceInfo
from tuner.layer import DecoderStack, layer_launches, random_stack_weights, stack_depth
from tuner.shapes import resolve
from tuner.timing import time_replay


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timeline import apply_switches, variant  # noqa: E402


def main():
    hot = "--hot" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--hot"]
    shape = resolve(args[0])
    for name in args[1:]:
        trace(shape, name, hot)


def trace(shape, name, hot=False):
    cfg = variant(shape, apply_switches(name))
    dev = DeviceInfo.from_torch()
    n = stack_depth(shape, 2, dev.l2_bytes)
    weights = random_stack_weights(shape, 1 if hot else n, torch.float16, "cuda", 0) * (n if hot else 1)
    plain = DecoderStack(shape, cfg, n_layers=n, dtype=torch.float16, weights=weights)
    plain.capture()
    t_plain = time_replay(plain.replay, n, reps=30, warmup=5).median_us
    del plain

    traces = {}  # (out ptr, weight ptr) -> int64 [programs, slots]
    order = []  # launch keys in order, first walk only
    tiling = {}  # launch key -> (tiles, splits) of a cluster launch (programs: tile + tiles * split)
    real = gemm_k.linear

    def traced(x, weight, bias=None, **kw):
        c = kw["config"]  # the layer's configs are fitted already: the grid linear() launches
        key = (kw["out"].data_ptr(), weight.data_ptr())
        if key not in traces:
            tiles, splits = gemm_k.grid(c, x.shape[0], weight.shape[0])
            traces[key] = torch.zeros(tiles * splits, cluster_gemm.TRACE_SLOTS, dtype=torch.int64, device=x.device)
            order.append(key)
            if c.cluster and splits > 1:
                tiling[key] = (tiles, splits)
        return real(x, weight, bias, _trace=traces[key], **kw)

    real_mlp = mlp_cluster.launch
    fused_keys = set()
    out_in = [False, False]  # the block computes the out-projection (its stamps 4 and 5 differ), and the attention
    steps = []  # the fused block's own steps, per layer
    qa_steps = []  # the QKV-and-attention kernel's, per layer

    def traced_mlp(x, w1, b1, w2, b2, residual, out, **kw):  # the feed-forward block as one kernel (ffn2.fuse)
        key = (out.data_ptr(), w1.data_ptr())
        if key not in traces:
            tiles, splits = mlp_cluster.programs(x.shape[0], x.shape[1], w1.shape[0], kw.get("fs", 128))
            traces[key] = torch.zeros(tiles * splits, mlp_cluster.TRACE_SLOTS, dtype=torch.int64, device=x.device)
            order.append(key)
            tiling[key] = (tiles, splits)
            fused_keys.add(key)
            out_in[0] = kw.get("wo") is not None
            out_in[1] = kw.get("qkv") is not None
        return real_mlp(x, w1, b1, w2, b2, residual, out, trace=traces[key], **kw)

    real_qa = qkv_attn.launch
    qa_keys = {}  # key -> heads x batch (CTAs a cluster rank) of a QKV-and-attention launch (qkv.fuse 1)
    traced_qa = qkv_attn.traced(real_qa, traces, order, qa_keys)

    gemm_k.linear, mlp_cluster.launch, qkv_attn.launch = traced, traced_mlp, traced_qa
    st = DecoderStack(shape, cfg, n_layers=n, dtype=torch.float16, weights=weights)
    st.capture()
    t_traced = time_replay(st.replay, n, reps=30, warmup=5).median_us
    st.replay()
    torch.cuda.synchronize()
    gemm_k.linear, mlp_cluster.launch, qkv_attn.launch = real, real_mlp, real_qa

    launched = [nm for nm, _ in layer_launches(shape, cfg, st.weights[0], st.x, st.bufs[0])]
    names = [nm for nm in launched if nm in ("qkv", "out", "ffn1", "ffn2")]
    # a GEMM follows the previous one directly: adjacent launches, and no split-K reduction between them
    follows = {nm: i > 0 and launched[i - 1] in names and getattr(cfg, launched[i - 1]).split_k == 1
               for i, nm in enumerate(launched)}
    per_layer = len(order) // n
    assert per_layer == len(names), (per_layer, names)
    rows = {nm: [] for nm in names}
    for layer in range(1, n - 1):
        prev_end = None
        for j, nm in enumerate(names):
            key = order[layer * per_layer + j]
            t = traces[key].double() / 1000.0  # us
            entry, wait, loop, end = t[:, 0], t[:, 1], t[:, 2], t[:, 3]
            consecutive = follows[nm]
            skew = None
            if key in tiling:
                tiles, splits = tiling[key]
                ends = loop.view(splits, tiles)
                skew = float((ends.max(0).values - ends.min(0).values).median())
            rows[nm].append((float(wait.min() - entry.min()), float(entry.max() - entry.min()),
                             float(wait.max() - wait.min()),
                             float((loop - wait).median()), float((end - loop).median()),
                             float(end.max() - wait.min()),
                             float(wait.min() - prev_end) if (prev_end is not None and consecutive) else None,
                             skew))
            prev_end = float(end.max())
            if key in qa_keys:
                q = (torch.arange(t.shape[0], device=t.device) // qa_keys[key]) % 3 == 0  # the Q CTAs
                qa_steps.append([float(v.median()) for v in (
                    t[q, 3] - loop[q], t[~q, 3] - loop[~q], t[~q, 4] - t[~q, 3], t[q, 4] - t[q, 3],
                    t[q, 5] - t[q, 4], t[q, 5] - wait[q])] + [float(t[q, 5].max() - wait.min())])
            if key in fused_keys:
                w1, xl, g1, red = t[:, 4], t[:, 5], t[:, 6], t[:, 7]
                steps.append([float(v.median()) for v in (w1 - wait, xl - wait, g1 - torch.maximum(w1, xl),
                                                          loop - g1, red - loop, end - red)])
    tag = " (weights hot)" if hot else ""
    print(f"## {shape.name}{tag} {name}: {t_plain:.2f} us/layer un-traced, {t_traced:.2f} traced; {n} layers")
    print("| GEMM | launched early | entry skew | wait skew | loop | epilogue | span | boundary | split skew |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for nm, v in rows.items():
        med = [statistics.median([r[i] for r in v]) if all(r[i] is not None for r in v) else None
               for i in range(len(v[0]))]
        print(f"| {nm} | " + " | ".join("-" if x is None else f"{x:.2f}" for x in med) + " |")
    if qa_steps:
        print("QKV with the attention (us, medians): epilogue Q, epilogue K/V, K/V push, Q's wait for K and V, "
              "attention and store, Q CTA from wait to end, last Q end from first wait: "
              + ", ".join(f"{statistics.median(c):.2f}" for c in zip(*qa_steps)))
    if steps and out_in[0]:
        first = ("Q, K and V landed and every head's attention done" if out_in[1] else "the attention's tile landed")
        print(f"feed-forward block with the out-projection (us, medians; from the wait's return): {first}, x gathered (out-projection, its exchange); then first GEMM (from the later of the two), "
              "h and second GEMM, exchange, epilogue: " + ", ".join(f"{statistics.median(c):.2f}" for c in zip(*steps)))
    elif steps:
        print("feed-forward block (us, medians; from the wait's return): w1 landed, x landed; then first GEMM, h and "
              "second GEMM, exchange, epilogue: " + ", ".join(f"{statistics.median(c):.2f}" for c in zip(*steps)))


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
