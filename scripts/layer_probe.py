"""The CUDA layer kernel (FusedLayerConfig.fuse = 2) against a per-kernel config, in one process.

usage: python3 scripts/layer_probe.py SHAPE BEST_JSON [VARIANT ...] [--trace] [--compile] [--hot]
VARIANT: comma-separated layer.field=value edits on top of the default fuse-2 config, e.g.
    num_stages=8,out_split_k=4,ffn2_split_k=4,overlap_ratio=-1.0,prefetch_ratio=1.0
and diag=N: extra launch flags for A/B (layer_cuda.DIAG_FLAGS; such a variant is timed even if it fails the check).
--hot: every layer the same weights (they stay in L2).
For each: a cold stack in one CUDA graph (as the tuner times it), the correctness check on 3 replays in a row
(fresh inputs, buffers poisoned), then all candidates timed interleaved (A B C A B C ...). --trace: for the first
fuse-2 variant, every CTA's %globaltimer after its wait and at the end of each task, for a middle layer: when each
phase's tasks end (min / median / max over its tasks, us from the layer's first CTA start). --compile: also
torch.compile's stack, in the same process.
"""

import statistics
import sys

import torch

from tuner.config import DecoderConfig
from tuner.device import DeviceInfo
from tuner.export import load_config
from tuner.kernels import layer_cuda
from tuner.kernels.fused_layer import FusedLayerConfig
from tuner.layer import DecoderStack, check_config, fit_config, random_stack_weights, stack_depth
from tuner.shapes import resolve
from tuner.timing import time_interleaved

BASE = FusedLayerConfig(fuse=2, num_stages=10, out_split_k=4, ffn2_split_k=4, overlap_ratio=-1.0,
                        prefetch_ratio=1.0)


def fused(shape, edits: str) -> tuple[DecoderConfig, int]:
    cfg, diag = DecoderConfig(layer=BASE), 0
    for e in filter(None, edits.split(",")):
        if e.startswith("diag="):
            diag = int(e.split("=")[1])
        elif e.startswith("wgmma_n="):  # A/B build: layer_cuda.WGMMA_N (diag bit 1 << 20 carries it)
            diag |= int(e.split("=")[1]) << 20
        else:
            cfg = cfg.edited([f"layer.{e}"])
    return fit_config(cfg, shape), diag


def phase_ends(shape, cfg, stack, layer: int):
    """(phase, [end us of each task]) for one layer of a traced replay."""
    c = cfg.layer
    m, d, f = shape.tokens, shape.d_model, shape.ffn
    mt, nd, nf = -(-m // 64), d // 64, f // 64
    counts = [mt * 3 * nd, mt * shape.heads, mt * nd * c.out_split_k, mt * nf, mt * nd * c.ffn2_split_k]
    total = sum(counts)
    grid = min(total, DeviceInfo.from_torch().num_sms if c.programs == 0 else c.programs)
    tr = stack.traces[layer].cpu()
    t0 = int(tr[:grid, 0].min())
    out = {ph: [] for ph in layer_cuda.PHASES}
    arr = {ph: [] for ph in layer_cuda.PHASES}
    bounds = [sum(counts[:i + 1]) for i in range(5)]
    for j in range(total):
        cta, q = j % grid, j // grid
        if q >= layer_cuda.MAX_TRACE:
            continue
        ph = layer_cuda.PHASES[next(i for i, b in enumerate(bounds) if j < b)]
        arr[ph].append((int(tr[cta, 1 + 2 * q]) - t0) / 1e3)
        out[ph].append((int(tr[cta, 2 + 2 * q]) - t0) / 1e3)
    waits = [(int(v) - t0) / 1e3 for v in tr[:grid, 0]]
    return waits, arr, out


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    trace = "--trace" in sys.argv
    shape = resolve(args[0])
    dev = DeviceInfo.from_torch()
    n = stack_depth(shape, 2, dev.l2_bytes)
    hot = "--hot" in sys.argv
    weights = random_stack_weights(shape, 1 if hot else n, torch.float16, "cuda", 0) * (n if hot else 1)
    cands = {"best.json": (load_config(args[1], shape=shape), 0)}
    for v in args[2:] or [""]:
        cands[f"fuse2 {v or 'base'}"] = fused(shape, v)
    stacks, names = [], []
    for name, (cfg, diag) in cands.items():
        bad = check_config(cfg, shape, 2, dev)
        if bad:
            print(f"{name}: invalid {bad}")
            continue
        st = DecoderStack(shape, cfg, n_layers=n, dtype=torch.float16, weights=weights)
        layer_cuda.DIAG_FLAGS, layer_cuda.WGMMA_N = diag & 0xFFFFF, (diag >> 20) or 64
        try:
            st.capture()
        finally:
            layer_cuda.DIAG_FLAGS, layer_cuda.WGMMA_N = 0, 64
        errs = [st.check(seed=s) for s in range(3)]
        ok = all(e < st.tolerance() for e in errs)
        print(f"{name}: rel err {' '.join(f'{e:.2e}' for e in errs)} {'ok' if ok else 'FAILED'}", flush=True)
        if ok or diag:
            stacks.append(st)
            names.append(name)
    if "--compile" in sys.argv:
        from tuner.baselines import TorchStack

        ts = TorchStack(shape, weights, torch.float16, compiled=True)
        print(f"torch.compile: rel err {ts.check(0):.2e}", flush=True)
        stacks.append(ts)
        names.append("torch.compile")
    res = time_interleaved([s.replay for s in stacks], [s.n_layers for s in stacks], rounds=40)
    for name, t in zip(names, res):
        print(f"{shape.label} {name}: {t.median_us:.2f} us/layer (spread {t.spread_us:.2f})", flush=True)
    if trace:
        for name in (nm for nm in names if nm.startswith("fuse2")):
            show_trace(shape, name, *cands[name], weights, n, dev)


def show_trace(shape, name, cfg, diag, weights, n, dev):
    from tuner.kernels import fused_layer as fk

    st = DecoderStack(shape, cfg, n_layers=n, dtype=torch.float16, weights=weights)
    st.traces = [torch.zeros((dev.num_sms, layer_cuda.TRACE_ROW), dtype=torch.int64, device="cuda")
                 for _ in range(n)]
    orig = fk.decoder_layer
    seen = {}

    def traced(x, w, **kw):
        i = seen.setdefault(id(kw["scratch"]), len(seen))
        return orig(x, w, _times=st.traces[i], **kw)

    fk.decoder_layer = traced
    layer_cuda.DIAG_FLAGS, layer_cuda.WGMMA_N = diag & 0xFFFFF, (diag >> 20) or 64
    try:
        st.capture()
        for _ in range(3):
            st.replay()
        torch.cuda.synchronize()
    finally:
        fk.decoder_layer = orig
        layer_cuda.DIAG_FLAGS, layer_cuda.WGMMA_N = 0, 64
    mid = n // 2
    waits, arrivals, ends = phase_ends(shape, cfg, st, mid)
    f = lambda v: f"{min(v):6.2f} / {statistics.median(v):6.2f} / {max(v):6.2f}"  # noqa: E731
    print(f"{shape.label} {name} trace, layer {mid} of {n} (us from its first CTA's wait; min / median / max): "
          f"waits passed {f(waits)}")
    for ph, v in ends.items():
        if v:
            print(f"  {ph:5s} first input {f(arrivals[ph])}, end {f(v)} ({len(v)} tasks)")
    tr = st.traces[mid].cpu()
    t0 = int(tr[:, 0][tr[:, 0] > 0].min())
    L = layer_cuda
    for cta in (0, 40, 100):
        row = lambda a: " ".join(f"{(int(v) - t0) / 1e3:5.2f}" if int(v) else "  -  " for v in tr[cta, a:a + 12])  # noqa
        print(f"  CTA {cta} first task, K tiles 0-11: B issued  {row(L.TR_B)}")
        print(f"  CTA {cta} first task, K tiles 0-11: A issued  {row(L.TR_A)}")
        print(f"  CTA {cta} first task, chunks 0-7: arrived     {row(L.TR_FULL)[:48]}")
        print(f"  CTA {cta} first task epilogue: loop done, stats, stores, fence, barrier, flag: "
              f"{row(L.TR_EPI)[:36]}")

if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
