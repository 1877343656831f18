"""A tuned layer in your own PyTorch code: ``TunedLayer(config, shape, weights)(x)``.

The configuration comes from a run's ``best.json`` (``tuner.load_config``); the weights are yours. The
layer is the one the tuner timed (``tuner.layer``): a pre-LN causal decoder layer

    a = x + out(attn(qkv(ln1(x))))
    y = a + ffn2(gelu_tanh(ffn1(ln2(a))))

with the same kernels, launch order and preallocated buffers (``layer_forward`` / ``LayerBuffers``), so
``capture()`` records the same PDL chain in a CUDA graph. The ``qkv`` weight is ``[3*d_model, d_model]``
with the rows of Q, then K, then V, each head's ``head_dim`` rows contiguous (``nn.Linear`` layout,
``out_features x in_features``), as ``tuner.layer.torch_layer`` reads it.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from tuner.config import ConfigError, DecoderConfig
from tuner.device import DeviceInfo
from tuner.layer import LayerBuffers, LayerWeights, check_config, layer_forward, layer_ref, repair_config
from tuner.shapes import DecoderShape, resolve

# Each LayerWeights field, and the state-dict name of the same tensor in a module laid out as
# ln1 (LayerNorm), qkv, out (Linear), ln2 (LayerNorm), ffn1, ffn2 (Linear).
MODULE_NAMES = {
    "ln1_w": "ln1.weight", "ln1_b": "ln1.bias",
    "w_qkv": "qkv.weight", "b_qkv": "qkv.bias",
    "w_out": "out.weight", "b_out": "out.bias",
    "ln2_w": "ln2.weight", "ln2_b": "ln2.bias",
    "w_ffn1": "ffn1.weight", "b_ffn1": "ffn1.bias",
    "w_ffn2": "ffn2.weight", "b_ffn2": "ffn2.bias",
}


class WeightsError(ValueError):
    """The user's weights do not fit the layer: the message names the tensor and what was expected."""


def expected_shapes(shape: DecoderShape) -> dict[str, tuple[int, ...]]:
    """The shape of every LayerWeights tensor for ``shape`` (nn.Linear weights are [out, in])."""
    d, f = shape.d_model, shape.ffn
    return {"ln1_w": (d,), "ln1_b": (d,), "w_qkv": (3 * d, d), "b_qkv": (3 * d,), "w_out": (d, d), "b_out": (d,),
            "ln2_w": (d,), "ln2_b": (d,), "w_ffn1": (f, d), "b_ffn1": (f,), "w_ffn2": (d, f), "b_ffn2": (d,)}


def as_layer_weights(weights, shape: DecoderShape, *, dtype=None, device=None) -> LayerWeights:
    """LayerWeights from a LayerWeights, a dict of tensors or an ``nn.Module`` (its state dict), under either
    spelling of MODULE_NAMES, checked against ``shape`` and moved to ``dtype``/``device``."""
    if isinstance(weights, LayerWeights):
        tensors = {f.name: getattr(weights, f.name) for f in fields(LayerWeights)}
    elif isinstance(weights, torch.nn.Module):
        tensors = dict(weights.state_dict())
    elif isinstance(weights, dict):
        tensors = dict(weights)
    else:
        raise WeightsError(f"weights: expected a LayerWeights, a dict of tensors or an nn.Module, "
                           f"got {type(weights).__name__}")
    picked, missing = {}, []
    for name, module_name in MODULE_NAMES.items():
        t = tensors.get(name, tensors.get(module_name))
        if t is None:
            missing.append(f"{name} (or {module_name})")
        else:
            picked[name] = t
    if missing:
        raise WeightsError(f"weights: missing {', '.join(missing)}; a layer needs {', '.join(MODULE_NAMES)} "
                           f"or the module names {', '.join(MODULE_NAMES.values())}")
    want = expected_shapes(shape)
    for name, t in picked.items():
        if not isinstance(t, torch.Tensor):
            raise WeightsError(f"weights: {name} is a {type(t).__name__}, not a tensor")
        if tuple(t.shape) != want[name]:
            raise WeightsError(f"weights: {name} has shape {tuple(t.shape)}, expected {want[name]} for shape "
                               f"{shape.spec} (BxSxDxHxF)")
    dtype = dtype or picked["w_qkv"].dtype
    device = torch.device(device) if device is not None else picked["w_qkv"].device
    return LayerWeights(**{n: t.detach().to(device=device, dtype=dtype).contiguous() for n, t in picked.items()})


class TunedLayer:
    """One decoder layer on our kernels with a tuned configuration and your weights.

    ``config``: a DecoderConfig (``tuner.load_config("results/<shape>/<run>/best.json")``). ``shape``: a
    DecoderShape, a preset name or ``BxSxDxHxF``; the input is ``[batch, seq, d_model]`` or
    ``[batch*seq, d_model]`` of exactly that size (the buffers are preallocated). Tiles larger than the
    shape are shrunk to it, and what no longer fits is moved to the nearest config that runs, as the search does
    (``repair_config``: e.g. split-K in clusters, or the one-kernel feed-forward block, switched off where the
    shape leaves too few K tiles or does not fit the kernel), so a config tuned on one shape runs on another:
    correctly, but its timings do not transfer. PDL and prefetch switch themselves off where the device cannot do
    them (before Hopper, in the Triton interpreter).

    ``layer(x)`` returns the layer's output buffer, which the next call overwrites (as a CUDA graph's
    static output would): ``.clone()`` it to keep it.
    """

    def __init__(self, config: DecoderConfig, shape: DecoderShape | str, weights, *, dtype=None, device=None):
        self.shape = resolve(shape) if isinstance(shape, str) else shape
        self.weights = as_layer_weights(weights, self.shape, dtype=dtype, device=device)
        self.dtype, self.device = self.weights.w_qkv.dtype, self.weights.w_qkv.device
        info = DeviceInfo.from_torch(self.device) if self.device.type == "cuda" else DeviceInfo.interpreter()
        self.config = repair_config(config, self.shape, self.weights.w_qkv.element_size(), info)
        bad = check_config(self.config, self.shape, self.weights.w_qkv.element_size(), info)
        if bad:
            raise ConfigError(f"config does not run shape {self.shape.spec}: "
                              + "; ".join(f"{k}: {why}" for k, why in bad.items()))
        # Folding LayerNorm into the next GEMM's weights is a torch op: done once here, never in a graph.
        if self.config.norm1.fuse:
            self.weights.folded("qkv")
        if self.config.norm2.fuse:
            self.weights.folded("ffn1")
        self.buffers = LayerBuffers(self.shape, self.config, self.dtype, self.device)
        self._x = torch.empty((self.shape.tokens, self.shape.d_model), dtype=self.dtype, device=self.device)
        self.graph = None

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        s = self.shape
        if x.numel() != s.tokens * s.d_model or x.shape[-1] != s.d_model:
            raise ValueError(f"TunedLayer: x {tuple(x.shape)} must be [{s.batch}, {s.seq}, {s.d_model}] or "
                             f"[{s.tokens}, {s.d_model}] (shape {s.spec})")
        if x.dtype != self.dtype or x.device != self.device:
            raise ValueError(f"TunedLayer: x is {x.dtype} on {x.device}, the layer is {self.dtype} on {self.device}")
        return x.reshape(s.tokens, s.d_model).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows(x)
        if self.graph is not None:
            self._x.copy_(rows)
            self.graph.replay()
            y = self.buffers.y
        else:
            y = layer_forward(self.shape, self.config, self.weights, rows, self.buffers)
        return y.view(x.shape)

    def capture(self, warmup: int = 2) -> "torch.cuda.CUDAGraph":
        """Record the layer's kernels in one CUDA graph (the chain the tuner timed); later calls replay it.
        Python's launch cost (tens of us per Triton kernel) is then paid once, here."""
        if self.device.type != "cuda":
            raise RuntimeError("TunedLayer.capture: CUDA graphs need a CUDA device; call the layer directly")
        from tuner.timing import capture

        with torch.cuda.device(self.device):
            self.graph = capture(lambda: layer_forward(self.shape, self.config, self.weights, self._x, self.buffers),
                                 warmup=warmup)
        return self.graph

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same layer in fp32 PyTorch from the same weights (what the tuner's correctness gate compares
        against); fp32, in x's shape."""
        return layer_ref(self.shape, self.weights, self._rows(x)).view(x.shape)
