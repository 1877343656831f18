"""A tuned layer in your own PyTorch code: ``TunedLayer(config, shape, weights)(x)``, and your model's layers
chained as the tuner timed them: ``TunedStack(config, shape, [weights, ...])(x)``.

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


def _shape(shape) -> DecoderShape:
    return shape if isinstance(shape, DecoderShape) else resolve(shape)  # (ShapeError: neither preset nor BxSxDxHxF)


def _runnable(config, shape: DecoderShape, w: LayerWeights, who: str) -> DecoderConfig:
    """``config`` (a DecoderConfig, or the path of a best.json or run folder) as it runs ``shape`` on ``w``'s device
    and dtype: repaired as the search repairs (tiles shrunk to the shape, what does not fit moved to the nearest
    config that runs), then checked (ConfigError for what still does not run)."""
    if isinstance(config, (str, os.PathLike)):
        from tuner.export import load_config

        config = load_config(config, shape=shape, dtype=w.w_qkv.dtype)
    elif not isinstance(config, DecoderConfig):
        raise TypeError(f"{who}: config is a {type(config).__name__}; give a DecoderConfig "
                        "(tuner.load_config(path)) or the path of a best.json")
    dev = w.w_qkv.device
    info = DeviceInfo.from_torch(dev) if dev.type == "cuda" else DeviceInfo.interpreter()
    config = repair_config(config, shape, w.w_qkv.element_size(), info)
    bad = check_config(config, shape, w.w_qkv.element_size(), info)
    if bad:
        raise ConfigError(f"config does not run shape {shape.spec}: "
                          + "; ".join(f"{k}: {why}" for k, why in bad.items()))
    return config


def _fold(config: DecoderConfig, w: LayerWeights) -> None:
    """Fold each LayerNorm the config fuses into the next GEMM's weights: a torch op, done once, never in a graph."""
    if config.norm1.fuse or config.fused:
        w.folded("qkv")
    if config.norm2.fuse or config.fused:
        w.folded("ffn1")


def _rows(x, shape: DecoderShape, dtype, device, who: str) -> torch.Tensor:
    s = shape
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{who}: x is a {type(x).__name__}, not a torch.Tensor")
    if tuple(x.shape) not in ((s.batch, s.seq, s.d_model), (s.tokens, s.d_model)):
        raise ValueError(f"{who}: x {tuple(x.shape)} must be [{s.batch}, {s.seq}, {s.d_model}] or "
                         f"[{s.tokens}, {s.d_model}] (shape {s.spec})")
    if x.dtype != dtype or x.device != device:
        raise ValueError(f"{who}: x is {x.dtype} on {x.device}, the layer is {dtype} on {device}")
    return x.reshape(s.tokens, s.d_model).contiguous()


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
        self.shape = _shape(shape)
        self.weights = as_layer_weights(weights, self.shape, dtype=dtype, device=device)
        self.dtype, self.device = self.weights.w_qkv.dtype, self.weights.w_qkv.device
        self.config = _runnable(config, self.shape, self.weights, "TunedLayer")
        # Folding LayerNorm into the next GEMM's weights is a torch op: done once here, never in a graph.
        _fold(self.config, self.weights)
        self.buffers = LayerBuffers(self.shape, self.config, self.dtype, self.device)
        self._x = torch.empty((self.shape.tokens, self.shape.d_model), dtype=self.dtype, device=self.device)
        self.graph = None

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return _rows(x, self.shape, self.dtype, self.device, "TunedLayer")

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


class TunedStack:
    """Your model's decoder layers on our kernels, chained as the tuner timed them: one tuned configuration for
    every layer, each layer's weights yours, and on a GPU all of them in one CUDA graph in which each layer's first
    kernel waits under PDL for the previous layer's last one.

    ``layers``: a list (or ``nn.ModuleList``) of weights, one per layer, each as :func:`as_layer_weights` takes it
    (an ``nn.Module`` with ``ln1``, ``qkv``, ``out``, ``ln2``, ``ffn1``, ``ffn2``, a state dict, ...); copied.
    ``config``, ``shape``, ``dtype``, ``device`` and the input as for :class:`TunedLayer`.

    Use it rather than one :class:`TunedLayer` a layer: with ``norm1.fuse: 2`` (every run of record's best) layer
    *i*'s FFN2 writes the row sums of its output for layer *i+1*'s QKV, which has no norm kernel of its own, and with
    ``qkv.fuse: 1`` or a clustered QKV that QKV then runs the kernel the tuner timed. A lone layer, like this stack's
    first, has no such producer: its QKV gathers the row sums itself, on the Triton GEMM (and with ``qkv.fuse: 1`` the
    attention runs as a kernel of its own), as the first layer of the tuner's stack does.
    """

    def __init__(self, config: DecoderConfig | str | os.PathLike, shape: DecoderShape | str, layers, *, dtype=None,
                 device=None):
        from tuner.layer import DecoderStack

        self.shape = _shape(shape)
        if isinstance(layers, (torch.nn.ModuleList, torch.nn.Sequential)):  # (a model's own list of layers)
            layers = list(layers)
        if isinstance(layers, (torch.nn.Module, LayerWeights, dict)) or not hasattr(layers, "__len__"):
            raise TypeError(f"TunedStack: layers is a {type(layers).__name__}; give a list of each layer's weights, "
                            "e.g. list(model.layers) (for one layer, TunedLayer)")
        if not len(layers):
            raise ValueError("TunedStack: layers is empty; give each layer's weights")
        first = as_layer_weights(layers[0], self.shape, dtype=dtype, device=device)
        self.dtype, self.device = first.w_qkv.dtype, first.w_qkv.device
        self.weights = [first] + [as_layer_weights(w, self.shape, dtype=self.dtype, device=self.device)
                                  for w in layers[1:]]
        self.config = _runnable(config, self.shape, first, "TunedStack")
        # (DecoderStack folds each layer's LayerNorms into its GEMMs, once, outside any graph)
        self.stack = DecoderStack(self.shape, self.config, n_layers=len(self.weights), dtype=self.dtype,
                                  device=self.device, weights=self.weights)

    def __len__(self) -> int:
        return len(self.weights)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output for ``x``: its buffer, which the next call overwrites (``.clone()`` to keep it)."""
        self.stack.x.copy_(_rows(x, self.shape, self.dtype, self.device, "TunedStack"))
        self.stack.replay()  # (the graph where captured, else each kernel launched in turn)
        return self.stack.out.view(x.shape)

    def capture(self, warmup: int = 2) -> "torch.cuda.CUDAGraph":
        """Record every layer's kernels in one CUDA graph (the chain the tuner timed); later calls replay it."""
        if self.device.type != "cuda":
            raise RuntimeError("TunedStack.capture: CUDA graphs need a CUDA device; call the stack directly")
        with torch.cuda.device(self.device):
            return self.stack.capture(warmup=warmup)

    def outputs(self) -> list[torch.Tensor]:
        """Each layer's output buffer after the last call, in order (overwritten by the next call)."""
        return [b.y for b in self.stack.bufs]

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same layers in fp32 PyTorch from the same weights, each fed the previous one's fp32 output; fp32, in
        x's shape. Over many layers the 16-bit stack drifts from it as a 16-bit model drifts from its fp32 twin; the
        tuner's gate compares each layer on the input it really received (``DecoderStack.check``)."""
        h = _rows(x, self.shape, self.dtype, self.device, "TunedStack")
        for w in self.weights:
            h = layer_ref(self.shape, w, h)
        return h.view(x.shape)
