"""A run's best.json loaded into a model the way the README shows (tuner.runtime.TunedStack, the user's nn.Modules),
timed beside the stack the tuner timed (tuner.layer.DecoderStack, same config, same depth) and beside the same layers
as one TunedLayer each (one CUDA graph a layer, replayed back to back), interleaved in one process.

    python3 scripts/stack_check.py SHAPE BEST_JSON [--layers N] [--rounds R]

Prints µs a layer (median, IQR/2) and each one's error against its fp32 reference. Diagnostic: the tuner's figures
come from `tune decoder` alone.
"""

from __future__ import annotations

import argparse
import sys
import warnings


def main(argv=None) -> int:
    from tuner.device import require_gpu

    require_gpu(__file__)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape")
    ap.add_argument("best_json")
    ap.add_argument("--layers", type=int, default=None, help="stack depth (default: the tuner's cold stack's)")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args(argv)
    import torch
    from torch import nn

    import tuner
    from tuner.device import DeviceInfo
    from tuner.layer import DecoderStack, rel_error, stack_depth
    from tuner.runtime import TunedLayer, TunedStack
    from tuner.shapes import resolve
    from tuner.timing import time_interleaved

    shape, dtype, dev = resolve(args.shape), torch.float16, "cuda"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a best.json tuned on another H200 than this one: same model, same name)
        cfg = tuner.load_config(args.best_json, shape=shape)
    n = args.layers or stack_depth(shape, 2, DeviceInfo.from_torch(torch.device(dev)).l2_bytes)

    class MyLayer(nn.Module):  # the README's stand-in for a model's layer
        def __init__(self, d, ffn):
            super().__init__()
            self.ln1, self.qkv, self.out = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ln2, self.ffn1, self.ffn2 = nn.LayerNorm(d), nn.Linear(d, ffn), nn.Linear(ffn, d)

    torch.manual_seed(0)
    mine = [MyLayer(shape.d_model, shape.ffn) for _ in range(n)]
    model = TunedStack(cfg, shape, mine, dtype=dtype, device=dev)
    model.capture()
    tuned = DecoderStack(shape, model.config, n_layers=n, dtype=dtype, device=dev, seed=0)
    tuned.capture()
    singles = [TunedLayer(cfg, shape, m, dtype=dtype, device=dev) for m in mine]
    for s in singles:
        s.capture()

    def chain():  # each layer's graph in turn, each reading the previous one's output buffer
        singles[0].graph.replay()
        for a, b in zip(singles, singles[1:]):
            b._x.copy_(a.buffers.y)
            b.graph.replay()

    x = torch.randn(shape.batch, shape.seq, shape.d_model, dtype=dtype, device=dev)
    singles[0]._x.copy_(x.view(shape.tokens, shape.d_model))
    err_stack = rel_error(model(x), model.reference(x))
    ins = [x.view(shape.tokens, shape.d_model)] + model.outputs()[:-1]
    err_layers = max(rel_error(yi, tuner.layer.layer_ref(shape, w, xi))
                     for w, xi, yi in zip(model.weights, ins, model.outputs()))
    t = time_interleaved([model.stack.graph.replay, tuned.graph.replay, chain], [n, n, n], rounds=args.rounds)
    print(f"{torch.cuda.get_device_name()}, {shape.label} ({shape.spec}), {n} layers, {args.best_json}")
    for name, r in zip(("TunedStack (your modules, one graph)", "DecoderStack (the tuner's stack)",
                        "one TunedLayer a layer (a graph each)"), t):
        print(f"  {name:40s} {r.median_us:7.2f} us a layer (± {r.spread_us:.2f})")
    print(f"  TunedStack error: worst layer on its own input {err_layers:.1e}; the whole stack against the fp32 "
          f"chain {err_stack:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
