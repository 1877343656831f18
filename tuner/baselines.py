"""PyTorch baselines of the same layer stack (same weights), each replayed from one CUDA graph."""

from __future__ import annotations

import torch

from tuner.kernels._common import rel_error
from tuner.layer import LayerWeights, layer_ref, torch_layer
from tuner.shapes import DecoderShape
from tuner.timing import Timing, capture, time_replay


class TorchStack:
    """L torch layers (eager kernels, or one torch.compile'd layer function reused by every layer)."""

    def __init__(self, shape: DecoderShape, weights: list[LayerWeights], dtype, *, compiled: bool = False,
                 compile_mode: str | None = None):
        self.shape, self.weights, self.dtype = shape, weights, dtype
        self.x = torch.empty((shape.tokens, shape.d_model), dtype=dtype, device="cuda")
        fn = lambda x, *ws: torch_layer(shape, LayerWeights(*ws), x)  # noqa: E731
        self.fn = torch.compile(fn, mode=compile_mode) if compiled else fn
        self.outs: list[torch.Tensor] = []
        self.graph = capture(self._run, warmup=3)

    def _run(self):
        x, outs = self.x, []
        for w in self.weights:
            x = self.fn(x, *w.tensors())
            outs.append(x)
        self.outs = outs

    @property
    def n_layers(self) -> int:
        return len(self.weights)

    def replay(self):
        self.graph.replay()

    def check(self, seed: int) -> float:
        g = torch.Generator().manual_seed(seed)
        self.x.copy_(torch.randn(self.x.shape, generator=g).to(self.dtype))
        for o in self.outs:
            o.fill_(float("nan"))
        self.replay()
        torch.cuda.synchronize()
        worst = 0.0
        for i, o in enumerate(self.outs):
            x_in = self.x if i == 0 else self.outs[i - 1]
            worst = max(worst, rel_error(o, layer_ref(self.shape, self.weights[i], x_in)))
        return worst

    def time(self, reps: int, warmup: int) -> Timing:
        return time_replay(self.replay, self.n_layers, reps=reps, warmup=warmup)
