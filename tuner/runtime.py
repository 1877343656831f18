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

import os
import warnings
from dataclasses import fields

import torch

from tuner.config import ConfigError, DecoderConfig
from tuner.device import DeviceInfo
from tuner.layer import (DTYPES, LN_EPS, LayerBuffers, LayerWeights, check_config, layer_forward, layer_ref,
                         repair_config)
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


def layer_dtype(dtype) -> torch.dtype:
    """A dtype the kernels run (float16, bfloat16, float32), given as a torch dtype or by its name; WeightsError
    otherwise."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    raise WeightsError(f"dtype {dtype!r}: the layer runs in {', '.join(DTYPES)} (a torch dtype or its name)")


def _warn_eps(module: torch.nn.Module) -> None:
    """The kernels normalise with LN_EPS; a module whose LayerNorm has another eps gets other outputs where a row's
    variance is near eps (BERT's 1e-12: rows of variance ~1e-6 and below), so say so."""
    for name in ("ln1", "ln2"):
        eps = getattr(getattr(module, name, None), "eps", LN_EPS)
        if isinstance(eps, (int, float)) and eps != LN_EPS:
            warnings.warn(f"weights: {name}.eps is {eps:g}; the layer's LayerNorm uses {LN_EPS:g} (rows whose "
                          f"variance is near either differ from your module's)", UserWarning, stacklevel=4)


def as_layer_weights(weights, shape: DecoderShape, *, dtype=None, device=None) -> LayerWeights:
    """LayerWeights from a LayerWeights, a dict of tensors or an ``nn.Module`` (its state dict), under either
    spelling of MODULE_NAMES, checked against ``shape`` and copied to ``dtype``/``device``: the layer holds its own
    weights (and the LayerNorm-folded ones it computes from them once), so a later change to the caller's tensors
    is not seen, whatever the dtype."""
    if isinstance(weights, LayerWeights):
        tensors = {f.name: getattr(weights, f.name) for f in fields(LayerWeights)}
    elif isinstance(weights, torch.nn.Module):
        tensors = dict(weights.state_dict())
        _warn_eps(weights)
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
    dtype = layer_dtype(picked["w_qkv"].dtype if dtype is None else dtype)
    device = torch.device(device) if device is not None else picked["w_qkv"].device
    return LayerWeights(**{n: t.detach().to(device=device, dtype=dtype, memory_format=torch.contiguous_format,
                                            copy=True) for n, t in picked.items()})


class TunedLayer:
    """One decoder layer on our kernels with a tuned configuration and your weights.

    ``config``: a DecoderConfig (``tuner.load_config("results/<shape>/<run>/best.json")``), or the path of a
    best.json or run folder, which is loaded so. ``shape``: a DecoderShape, a preset name or ``BxSxDxHxF``.
    ``weights``: see :func:`as_layer_weights` (copied: later changes to yours are not seen). ``dtype``: float16,
    bfloat16 or float32 (default: the weights'). The input is ``[batch, seq, d_model]`` or
    ``[batch*seq, d_model]`` of exactly that size (the buffers are preallocated). Tiles larger than the
    shape are shrunk to it, and what no longer fits is moved to the nearest config that runs, as the search does
    (``repair_config``: e.g. split-K in clusters, or the one-kernel feed-forward block, switched off where the
    shape leaves too few K tiles or does not fit the kernel), so a config tuned on one shape runs on another:
    correctly, but its timings do not transfer. PDL and prefetch switch themselves off where the device cannot do
    them (before Hopper, in the Triton interpreter).

    ``layer(x)`` returns the layer's output buffer, which the next call overwrites (as a CUDA graph's
    static output would): ``.clone()`` it to keep it.
    """

    def __init__(self, config: DecoderConfig | str | os.PathLike, shape: DecoderShape | str, weights, *, dtype=None,
                 device=None):
        if not isinstance(shape, DecoderShape):
            shape = resolve(shape)  # (ShapeError for what is neither a preset nor BxSxDxHxF)
        self.shape = shape
        if isinstance(config, (str, os.PathLike)):
            from tuner.export import load_config

            config = load_config(config, shape=shape)
        elif not isinstance(config, DecoderConfig):
            raise TypeError(f"TunedLayer: config is a {type(config).__name__}; give a DecoderConfig "
                            "(tuner.load_config(path)) or the path of a best.json")
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
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"TunedLayer: x is a {type(x).__name__}, not a torch.Tensor")
        if tuple(x.shape) not in ((s.batch, s.seq, s.d_model), (s.tokens, s.d_model)):
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
