"""What every kernel family shares: where PDL and prefetch can run, the PDL trigger arithmetic,
and the in-kernel helpers (L2 prefetch of weight tiles, the PDL trigger)."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields, replace

import torch
import triton
import triton.language as tl

from tuner.device import SMEM_DEFAULT_BYTES, DeviceInfo

GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
        return cls(**{k: (float(v) if k.endswith("_ratio") else int(v)) for k, v in d.items()})

    def without_knobs(self):
        """Same tiles, launched without PDL and without prefetch: (-1, -1)."""
        return replace(self, overlap_ratio=-1.0, prefetch_ratio=-1.0)


def pow2(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


def tile_cap(dim: int) -> int:
    """The largest useful tl.dot tile along a dimension: its next power of two, at least 16. A larger
    tile is the same program as this one doing masked work."""
    return max(16, triton.next_power_of_2(dim))


def smem_limit(device: DeviceInfo | None) -> int:
    """Shared memory per block on ``device`` (the H100/H200 limit when none is named)."""
    return device.smem_per_block_bytes if device is not None else SMEM_DEFAULT_BYTES


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


@dataclass(frozen=True)
class LaunchMode:
    """What a launcher can really do on the tensor's device."""

    pdl: bool  # launch with programmatic stream serialization + griddepcontrol in the kernel
    prefetch: bool  # inline-asm L2 prefetch
    upcast_bf16: bool  # the interpreter multiplies bf16 bit patterns in tl.dot: compute in fp32
    clusters: bool = False  # thread-block clusters (sm_90+) and the cluster barrier's inline asm


def launch_mode(t: torch.Tensor) -> LaunchMode:
    if t.device.type != "cuda" or interpreting():
        return LaunchMode(pdl=False, prefetch=False, upcast_bf16=True)
    ok = DeviceInfo.from_torch(t.device).supports_pdl
    return LaunchMode(pdl=ok, prefetch=ok, upcast_bf16=False, clusters=ok)


def _allow_dynamic_smem(function: int, nbytes: int) -> None:
    """cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES): Triton sets it only for its own size over 48 KB."""
    import ctypes

    err = ctypes.CDLL("libcuda.so.1").cuFuncSetAttribute(ctypes.c_void_p(function), 8, ctypes.c_int(nbytes))
    if err:
        raise RuntimeError(f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES, {nbytes}) failed: CUDA error {err}")


def launch_clustered(fn, grid: tuple[int, int], cluster: int, *args, extra_smem: int = 0, **kwargs) -> None:
    """Launch ``fn`` over ``grid[0] * cluster`` x ``grid[1]`` programs in clusters of ``cluster``
    consecutive programs along x, the kernel compiled for one CTA (``tl.program_id(0)`` counts CTAs).

    Triton 3.6 launches clusters only for kernels compiled with ``num_ctas > 1``, and those split every
    tile across the cluster (multi-CTA layouts). Its launcher takes the cluster size from the compiled
    kernel's packed metadata ``(num_warps, num_ctas, shared)``: it launches ``gridDim.x = grid[0] *
    num_ctas`` with CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION ``(num_ctas, 1, 1)``. So the one-CTA build is
    compiled (``warmup``), its packed metadata given the cluster size, and launched. ``cluster`` must be
    a constexpr of the kernel's (part of its cache key): every launch of that build is clustered alike.

    ``extra_smem``: bytes of dynamic shared memory past Triton's own, at the byte offset passed to the
    kernel as its ``smem_off`` argument (a multiple of 16; Triton never touches them).
    """
    kernel = fn.warmup(*args, grid=grid, **kwargs)
    kernel = kernel.result() if hasattr(kernel, "result") else kernel
    if getattr(kernel.metadata, "num_ctas", 1) != 1:
        raise RuntimeError(f"launch_clustered: {kernel.name} is a multi-CTA build")
    off = -(-kernel.metadata.shared // 16) * 16
    total = off + extra_smem if extra_smem else kernel.metadata.shared
    num_warps = kernel.metadata.num_warps
    if kernel.packed_metadata != (num_warps, cluster, total):
        kernel._init_handles()  # loads the binary: kernel.function
        if total > 49152:
            _allow_dynamic_smem(kernel.function, total)
        kernel.packed_metadata = (num_warps, cluster, total)
    if extra_smem:
        kwargs["smem_off"] = off
    fn[grid](*args, **kwargs)


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
def cluster_barrier(x):
    """Every thread of the thread-block cluster arrives (release: its earlier writes, global memory
    included, become visible at cluster scope) and waits for all (acquire). Returns 0, computed by the
    asm: callers add it to the addresses of what they read after the barrier, a data dependence that
    keeps those loads below it. ``x``: any int32 scalar (the asm needs an operand). sm_90+, GPU only."""
    return tl.inline_asm_elementwise(
        "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n\tmov.u32 $0, 0;",
        "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def cluster_barrier_relaxed(x):
    """:func:`cluster_barrier` without memory ordering (no fence: ``arrive.relaxed``), for a rendezvous whose
    data are already consumed, e.g. before exit, so that no peer's shared memory goes while it is read."""
    return tl.inline_asm_elementwise(
        "barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;\n\tmov.u32 $0, 0;",
        "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def smem_store_f32(off, val):
    """``val`` into this CTA's dynamic shared memory at byte ``off`` (Triton's ``global_smem`` symbol; the
    launcher must give the kernel shared memory past what Triton uses: launch_clustered's ``extra_smem``).
    Returns 0. GPU only."""
    return tl.inline_asm_elementwise(
        "{\n\t.reg .u32 %sa;\n\tmov.u32 %sa, global_smem;\n\tadd.u32 %sa, %sa, $1;\n\t"
        "st.shared.f32 [%sa], $2;\n\tmov.u32 $0, 0;\n\t}",
        "=r,r,f", [off, val], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def dsmem_load_f32x4(off, rank):
    """Four consecutive fp32 at byte ``off`` (16-byte aligned) of the dynamic shared memory of cluster CTA
    ``rank`` (distributed shared memory: ``mapa`` + one 16-byte ``ld.shared::cluster.v4``). GPU only.
    Element-wise 4-byte remote loads cost one network transaction each (a 64x64 partial exchanged in
    ~5 us on the H200): four elements a load.

    Declared pure, so that Triton's layout passes drop the copies they make of it (an impure asm is kept in
    every layout it is rematerialised in: twice the loads). The caller orders it by data: ``off`` depends on
    the cluster barrier before it, and a barrier after the stores that use its values keeps the peers'
    shared memory alive until it is read."""
    return tl.inline_asm_elementwise(
        "{\n\t.reg .u32 %sa, %sb;\n\tmov.u32 %sa, global_smem;\n\tadd.u32 %sa, %sa, $4;\n\t"
        "mapa.shared::cluster.u32 %sb, %sa, $5;\n\tld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [%sb];\n\t}",
        "=f,=f,=f,=f,r,r", [off, rank], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True,
        pack=1)


@triton.jit
def stamp(trace_ptr, slot, TRACE: tl.constexpr):
    """Diagnostics only (TRACE): this program's %globaltimer (ns) into ``trace_ptr[program, slot]`` of an
    int64 ``[programs, 4]`` tensor (scripts/trace_gemms.py)."""
    if TRACE:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [slot], dtype=tl.int64, is_pure=False,
                                      pack=1)
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


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; inf when ``out`` holds a NaN or Inf (an unwritten element)."""
    o = out.detach().double()
    if not torch.isfinite(o).all():
        return float("inf")
    r = ref.detach().double()
    return float((o - r).norm() / r.norm().clamp_min(1e-30))
