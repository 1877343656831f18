"""Shared memory that Triton allocates for this package's Triton kernels, compiled for a GPU architecture without a GPU.

A case runs the kernel's own launcher (``gemm.linear``, ``fused_layer.decoder_layer``) on CPU stand-ins of its tensors,
behaving as on a GPU of the case's architecture (PDL, L2 prefetch and the hardware-tanh GELU from sm_90, one program an
SM of an H100), with the kernel's launch recorded instead of run. Triton's own argument binder for that target then
specialises the recorded arguments as the GPU launch does (pointers and ints divisible by 16, ints equal to 1 as
constants, TMA descriptors as ``tensordesc<...>``): without the divisibility the K loops' loads are not pipelined and
the count is far below the GPU's. The answer is the compiled kernel's ``metadata.shared``.

:func:`compiled_shared` runs this file as a script in a process without TRITON_INTERPRET (the test suite sets it, and
the interpreter replaces the kernels the compiler reads): the script reads a JSON list of cases from stdin and prints
the list of byte counts. A case is a dict with ``arch`` (compute capability as an int, 90: sm_90) and either

* ``kind: "gemm"``, ``config`` (GemmConfig fields), ``problem`` ``[m, n, k]`` and ``launch``, linear's epilogue:
  ``bias``, ``residual``, ``stats_out`` (bools), ``activation``, ``ln`` (0: none; 1: LayerNorm folded, row sums
  gathered in the K loop; 2: row sums read from a producer's ``ln_stats``: NormConfig.fuse's values) and with ln 2
  ``ln_parts``, the producer's row-sum parts (``ln_stats.shape[0]``, GemmProblem.ln_parts); fp16; or
* ``kind: "layer"``, ``config`` (FusedLayerConfig fields) and ``problem`` ``[tokens, seq, d_model, heads, ffn]``.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from tuner.kernels import _common, gemm
from tuner.kernels import fused_layer as fl
from tuner.layer import LayerWeights
from tuner.shapes import DecoderShape

H100_SMS = 132


def compiled_shared(cases: list[dict]) -> list[int]:
    """Every case's ``metadata.shared``, compiled in a subprocess without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__], input=json.dumps(cases), capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


def _as_on(arch: int) -> None:
    """The launchers from here on behave as on a GPU of compute capability ``arch`` (this process is thrown away)."""
    mode = _common.LaunchMode(pdl=arch >= 90, prefetch=arch >= 90, upcast_bf16=False)  # (DeviceInfo.supports_pdl)
    for module in (_common, gemm, fl):  # (effective_config reads _common's)
        module.launch_mode = lambda x: mode

    def act_code(activation, x):  # gemm.act_code's GPU branch (x is a CPU stand-in)
        return 3 if activation == "gelu" and gemm._FAST_GELU else gemm._ACT_CODE[activation]

    gemm.act_code = fl.act_code = act_code
    fl.programs_for = lambda c, x: min(H100_SMS, c.programs or H100_SMS)


def _recorded(launch, fns: list[JITFunction]) -> list[tuple[JITFunction, tuple, dict]]:
    """The kernel launches of ``launch()`` among ``fns``, in order, each (kernel, args, kwargs); none of them runs."""
    calls = []
    for fn in fns:
        fn.run = lambda *args, grid, warmup, _fn=fn, **kwargs: calls.append((_fn, args, kwargs))
    try:
        launch()
    finally:
        for fn in fns:
            del fn.run
    return calls


def _shared(fn: JITFunction, args: tuple, kwargs: dict, arch: int) -> int:
    """``fn`` compiled for ``arch`` from a launch's arguments: what JITFunction.run does before it compiles (Triton
    3.6's runtime/jit.py), with a backend of that target instead of the current device's."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    bind = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = bind(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                          options=options.__dict__).metadata.shared


def _gemm_launch(case: dict):
    m, n, k = case["problem"]
    launch = case["launch"]
    e = lambda *shape, dtype=torch.float16: torch.empty(shape, dtype=dtype)  # noqa: E731
    c = gemm.GemmConfig(**case["config"])
    kw = {}
    if launch.get("ln"):
        kw["ln_colsum"] = e(n, dtype=torch.float32)
        if launch["ln"] == 2:
            kw["ln_stats"] = e(launch["ln_parts"], m, 2, dtype=torch.float32)
    if launch.get("stats_out"):
        kw["stats_out"] = e(gemm.stats_parts(c, n), m, 2, dtype=torch.float32)
    # _unchecked: a config over the default device's shared memory is compiled too.
    return lambda: gemm.linear(e(m, k), e(n, k), e(n) if launch.get("bias") else None, config=c,
                               activation=launch.get("activation"),
                               residual=e(m, n) if launch.get("residual") else None, _unchecked=True, **kw)


@functools.cache
def _layer_weights(shape: DecoderShape) -> fl.LayerTensors:
    """What the layer runtime passes the launcher (the norms folded: fp32 folded biases and column sums)."""
    return LayerWeights.random(shape, torch.float16, "cpu", torch.Generator().manual_seed(0)).fused()


def _layer_launch(case: dict):
    tokens, seq, d_model, heads, ffn = case["problem"]
    c = fl.FusedLayerConfig(**case["config"])
    w = _layer_weights(DecoderShape(tokens // seq, seq, d_model, heads, ffn))
    x, out = torch.empty(tokens, d_model, dtype=torch.float16), torch.empty(tokens, d_model, dtype=torch.float16)
    scratch = fl.LayerScratch(c, fl.LayerProblem(tokens, seq, d_model, heads, ffn), torch.float16, "cpu")
    fl.check = lambda *args: None  # a config over the default device's shared memory is compiled too
    return lambda: fl.decoder_layer(x, w, seq=seq, heads=heads, config=c, scratch=scratch, out=out)


# kind: (the launch of a case, the kernels it may launch; the first launched is compiled)
KINDS = {"gemm": (_gemm_launch, [gemm._gemm_kernel, gemm._splitk_reduce_kernel]),
         "layer": (_layer_launch, [fl._layer_kernel])}


def shared(case: dict) -> int:
    """One case's ``metadata.shared`` (in this process: it must run without TRITON_INTERPRET)."""
    _as_on(case["arch"])
    make_launch, fns = KINDS[case["kind"]]
    fn, args, kwargs = _recorded(make_launch(case), fns)[0]
    return _shared(fn, args, kwargs, case["arch"])


if __name__ == "__main__":
    assert not os.environ.get("TRITON_INTERPRET"), "compile_smem.py compiles for a GPU: run it without TRITON_INTERPRET"
    print(json.dumps([shared(case) for case in json.load(sys.stdin)]))
