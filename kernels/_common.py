"""What every kernel family shares: where PDL and prefetch can run, the PDL trigger arithmetic,
and the in-kernel helpers (L2 prefetch of weight tiles, the PDL trigger)."""

from __future__ import annotations

import contextlib
import math
import os
import threading
from dataclasses import asdict, dataclass, fields, replace

import torch
import triton
import triton.language as tl

from tuner.device import SMEM_DEFAULT_BYTES, DeviceInfo
from tuner.manifest import is_number

# CUDA launches at most this many programs along a grid's second and third axes (the first holds 2^31 - 1).
GRID_YZ_LIMIT = 65535
GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HALF_DTYPES = (torch.float16, torch.bfloat16)  # what the CUDA kernels (*.cu) take: their tiles are 16-bit words


class KnobConfig:
    """What every kernel config shares: a JSON form and the (overlap, prefetch) pair.

    Subclasses are frozen dataclasses whose float fields end in ``_ratio``; every other field is an int.
    """

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown keys {sorted(unknown)}; expected {sorted(names)}")
        return cls(**{k: _field_value(cls.__name__, k, v) for k, v in d.items()})

    def without_knobs(self):
        """Same tiles, launched without PDL and without prefetch: (-1, -1)."""
        return replace(self, overlap_ratio=-1.0, prefetch_ratio=-1.0)


def _field_value(owner: str, name: str, v):
    """A config field read from JSON or CSV: a number for a ratio, an integer (or a float with no fraction)
    otherwise, as a number or its text; anything else is named, never rounded."""
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            pass
    ok = is_number(v)
    if name.endswith("_ratio"):
        if not ok:
            raise ValueError(f"{owner}: {name}={v!r} must be a number")
        return float(v)
    if not ok or v != int(v):
        raise ValueError(f"{owner}: {name}={v!r} must be an integer")
    return int(v)


def pow2(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


def launch_field_error(c, tiles: tuple[str, ...] = (), stages: bool = True) -> str | None:
    """The rules a Triton launch's fields obey alone, whatever the problem: the ``tiles`` (``tl.dot`` operands) powers
    of two >= 16, ``num_warps`` a power of two up to 16 and, with ``stages``, ``num_stages`` in 1..8. The first part of
    each family's ``field_error``."""
    for name in tiles:
        v = getattr(c, name)
        if not pow2(v) or v < 16:
            return f"{name}={v} must be a power of two >= 16 (tl.dot)"
    if c.num_warps not in (1, 2, 4, 8, 16):
        return f"num_warps={c.num_warps} must be one of 1, 2, 4, 8, 16"
    if stages and not 1 <= c.num_stages <= 8:
        return f"num_stages={c.num_stages} must be in 1..8"
    return None


def tile_cap(dim: int) -> int:
    """The largest useful tl.dot tile along a dimension: its next power of two, at least 16. A larger
    tile is the same program as this one doing masked work."""
    return max(16, triton.next_power_of_2(dim))


def smem_limit(device: DeviceInfo | None) -> int:
    """Shared memory per block on ``device`` (the H100/H200 limit when none is named)."""
    return device.smem_per_block_bytes if device is not None else SMEM_DEFAULT_BYTES


def pre_hopper(device: DeviceInfo | None) -> bool:
    """Whether ``device`` is a GPU before Hopper (not when no device is named, nor on the interpreter)."""
    return device is not None and 0 < device.capability[0] < 9


def pipeline_buffers(num_stages: int, block_m: int, num_warps: int, device: DeviceInfo | None) -> tuple[int, bool]:
    """(A+B buffers a Triton 3.6 K loop of ``num_stages`` keeps, whether its dot is a wgmma): ``num_stages`` where the
    dot is a Hopper wgmma (``block_m`` >= 64, whole warpgroups), one fewer (at least one) where it is mma.sync (smaller
    tiles, 1 or 2 warps, any GPU before Hopper). Without a device, and on the interpreter, as on Hopper."""
    wgmma = not pre_hopper(device) and block_m >= 64 and num_warps % 4 == 0
    return (num_stages if wgmma else max(num_stages - 1, 1)), wgmma


def hopper_error(device: DeviceInfo | None) -> str | None:
    """Why the package's CUDA kernels (sm_90a builds) cannot run on ``device``; None on Hopper or when no device is
    named (the GPU is not checked)."""
    if device is not None and device.capability != (9, 0):
        return f"needs a Hopper GPU (compute capability 9.0), not {device.capability}"
    if device is not None and not device.nvcc:
        return "needs nvcc, the CUDA toolkit's compiler (PATH or $CUDA_HOME/bin), to build it"
    return None


def empty_split(k_tiles: int, split_k: int) -> bool:
    """Whether splitting ``k_tiles`` K tiles into ``split_k`` runs of ceil(k_tiles/split_k) leaves the
    last split without a tile."""
    return triton.cdiv(k_tiles, split_k) * (split_k - 1) >= k_tiles


def fit_split_k(split_k: int, k_tiles: int) -> int:
    """The largest split_k <= the requested one (and <= k_tiles) that leaves no split empty."""
    sk = max(1, min(split_k, k_tiles))
    while sk > 1 and empty_split(k_tiles, sk):
        sk -= 1
    return sk


def ratio_error(name: str, r: float) -> str | None:
    """Why a knob value is invalid: negative means off, else it must be in [0, 1]."""
    if not (r < 0 or 0.0 <= r <= 1.0) or math.isnan(r):
        return f"{name}={r} must be negative (off) or in [0, 1]"
    return None


def interpreting() -> bool:
    """True under the Triton interpreter (TRITON_INTERPRET=1, CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _round_bf16_to_nearest_in_the_interpreter() -> bool:
    """The Triton interpreter (3.6 to 3.8 at least) converts float32 to bfloat16 by dropping the low 16 bits, where
    the GPU rounds to nearest even: a kernel's bfloat16 outputs came out ~2x further from the reference on the CPU
    than on the GPU, and the CPU's bfloat16 bound had to be as loose as the GPU's. Its builder's ``cast_impl`` (every
    float32 -> bfloat16 conversion, an explicit ``.to`` or a store's) is wrapped to round as torch does. Returns
    whether it is in place (False where this Triton has no such builder method: the conversion stays as it is)."""
    try:
        import numpy as np
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    builder = getattr(ti, "InterpreterBuilder", None)
    cast = getattr(builder, "cast_impl", None)
    handle = getattr(ti, "TensorHandle", None)
    if cast is None or handle is None:
        return False
    if getattr(cast, "rounds_bf16_to_nearest", False):
        return True

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return handle(rounded.view(torch.int16).numpy().view(np.uint16).reshape(np.shape(src.data)),
                          dst_type.scalar)
        return cast(self, src, dst_type)

    cast_impl.rounds_bf16_to_nearest = True
    builder.cast_impl = cast_impl
    return True


INTERPRETER_ROUNDS_BF16 = interpreting() and _round_bf16_to_nearest_in_the_interpreter()


# Compile-only launches (tuner.evaluate.CompileEvaluator, the search's compile workers): within compile_only(), every
# launcher builds its kernel exactly as it would launch it (Triton's warm-up, which compiles into the on-disk cache
# under the launch's own key; the CUDA kernels' nvcc build) and launches nothing, so that a process measuring on the
# same GPU meets no kernel of theirs. Per thread.
_COMPILE_ONLY = threading.local()


@contextlib.contextmanager
def compile_only():
    """Within: every launch compiles its kernel and launches nothing (:func:`launch`, :func:`compiling`)."""
    before = compiling()
    _COMPILE_ONLY.on = True
    try:
        yield
    finally:
        _COMPILE_ONLY.on = before


def compiling() -> bool:
    """Whether launches only compile here (:func:`compile_only`): a CUDA kernel's launcher returns after its build."""
    return getattr(_COMPILE_ONLY, "on", False)


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, or within :func:`compile_only` its compile alone (``kernel.warmup``, the same
    arguments: the same specialisation, so the real launch finds it compiled)."""
    if compiling():
        return kernel.warmup(*args, grid=grid, **kwargs)
    return kernel[grid](*args, **kwargs)


@dataclass(frozen=True)
class LaunchMode:
    """What a launcher can really do on the tensor's device."""

    pdl: bool  # launch with programmatic stream serialization + griddepcontrol in the kernel
    prefetch: bool  # inline-asm L2 prefetch
    upcast_bf16: bool  # the interpreter multiplies bf16 bit patterns in tl.dot: compute in fp32


def launch_mode(t: torch.Tensor) -> LaunchMode:
    if t.device.type != "cuda" or interpreting():
        return LaunchMode(pdl=False, prefetch=False, upcast_bf16=True)
    ok = DeviceInfo.from_torch(t.device).supports_pdl
    return LaunchMode(pdl=ok, prefetch=ok, upcast_bf16=False)


def effective_config(config, x: torch.Tensor):
    """The config as it really runs on ``x``'s device (PDL and prefetch off where unsupported)."""
    mode = launch_mode(x)
    if not mode.pdl:
        config = replace(config, overlap_ratio=-1.0)
    if not mode.prefetch:
        config = replace(config, prefetch_ratio=-1.0)
    return config


def trigger_index(n_iters: int, overlap_ratio: float) -> int:
    """How many loop iterations a kernel completes before it issues gdc_launch_dependents (DESIGN: after
    floor((k_tiles-1)*o) of its K tiles). At 0 the GEMMs trigger right after gdc_wait, the norm and the
    attention before it (issuing the trigger reads nothing of the predecessor's, and the successor's own
    gdc_wait still waits for this whole grid).

    -1 means: no early trigger (the kernel is not in the PDL chain).
    """
    if overlap_ratio < 0:
        return -1
    return int(math.floor(max(n_iters - 1, 0) * min(overlap_ratio, 1.0)))


def prefetch_count(n_iters: int, prefetch_ratio: float) -> int:
    """How many of its own weight K tiles a program pulls into L2 before gdc_wait."""
    if prefetch_ratio < 0:
        return 0
    return min(n_iters, int(math.ceil(n_iters * min(prefetch_ratio, 1.0))))


@triton.jit
def prefetch_l2(ptrs):
    """Prefetch the 128-byte lines under ``ptrs`` into L2 (evict_last), returning a dummy int32.

    ``is_pure=False`` keeps the compiler from deleting it: nothing consumes the result. Measured on
    the H200 (DESIGN): this moved a norm+GEMM probe from 15.2 to 14.3 us per layer.
    """
    return tl.inline_asm_elementwise(
        "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def globaltimer(x):
    """%globaltimer (ns, int64); ``x``: any int32 scalar (the asm needs an operand). GPU only."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def spin_ns(ns, x):
    """Test-only (``tune verify``): busy-wait ``ns`` nanoseconds on %globaltimer; ``x`` as for :func:`globaltimer`.
    GPU only."""
    t0 = globaltimer(x)
    t = t0
    while t - t0 < ns:
        t = globaltimer(x)


@triton.jit
def stamp(trace_ptr, slot, TRACE: tl.constexpr):
    """Diagnostics only (TRACE): this program's %globaltimer (ns) into ``trace_ptr[program, slot]`` of an
    int64 ``[programs, 4]`` tensor (scripts/trace_gemms.py; cluster_gemm.TRACE_SLOTS, the same for either kernel)."""
    if TRACE:
        t = globaltimer(slot)
        pid = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
        tl.store(trace_ptr + pid * 4 + slot, t)


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_trigger(done, trigger, USE_PDL: tl.constexpr):
    """gdc_launch_dependents once ``done`` iterations are complete, ``trigger`` being trigger_index's."""
    if USE_PDL:
        if done == trigger:
            tl.extra.cuda.gdc_launch_dependents()


# ‖out - ref‖ / ‖ref‖ bounds (METHOD.md): fp16 operands land near 1e-3, bf16 near 4e-3 (measured in the
# interpreter on the GEMM: 2e-4 fp16, 3.3e-3 bf16); fp32 runs as tf32 on the GPU (~3e-4).
REL_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 3e-2, torch.float32: 5e-3}
# The interpreter computes in fp32 (numpy; bf16 upcast by the launchers) and rounds only what it stores: 10x what
# its kernels reach (fp16 ~2e-4, fp32 ~2e-7), so that a kernel computing or storing in a narrower type than it
# should fails on the CPU (bf16 on fp16 data: ~2e-3; fp16 on fp32 data: ~3e-4). bf16: 3x the worst of the CPU suite
# (median 1.7e-3, worst 3.2e-3 over its 64 bf16 comparisons, session 48) where the interpreter rounds to nearest as
# the GPU does; where it truncates (a Triton without the builder method wrapped above: up to 1.03e-2), the GPU's.
INTERPRETER_REL_TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2 if INTERPRETER_ROUNDS_BF16 else 3e-2,
                             torch.float32: 1e-5}


def rel_tolerance(dtype: torch.dtype) -> float:
    """The ‖out - ref‖ / ‖ref‖ bound a kernel's output must meet: REL_TOLERANCE on the GPU, tighter in the
    interpreter, whose arithmetic is exact fp32."""
    return (INTERPRETER_REL_TOLERANCE if interpreting() else REL_TOLERANCE)[dtype]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; inf when ``out`` holds a NaN or Inf (an unwritten element)."""
    o = out.detach().double()
    if not torch.isfinite(o).all():
        return float("inf")
    r = ref.detach().double()
    return float((o - r).norm() / r.norm().clamp_min(1e-30))
