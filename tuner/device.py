"""What the tuner needs to know about a GPU, read once from the device (never changed)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Shared memory per block when no GPU is named (the H100/H200 opt-in limit, 227 KiB).
SMEM_DEFAULT_BYTES = 227 * 1024


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    capability: tuple[int, int]
    num_sms: int
    l2_bytes: int
    smem_per_block_bytes: int  # opt-in maximum dynamic shared memory per block
    # whether nvcc (the CUDA toolkit) is there to build the package's CUDA kernels (kernels/*.cu) at their first use:
    # pip's torch and triton do not bring it, and without it each such trial crashed in its build
    nvcc: bool = True

    @property
    def supports_pdl(self) -> bool:
        # griddepcontrol and the L2 prefetch hint used here need sm_90 (Hopper) or newer.
        return self.capability[0] >= 9

    @classmethod
    def from_torch(cls, device=None) -> "DeviceInfo":
        import torch

        idx = torch.device(device if device is not None else "cuda").index
        idx = torch.cuda.current_device() if idx is None else idx
        return _cached(idx)

    @classmethod
    def interpreter(cls) -> "DeviceInfo":
        """The Triton interpreter on the CPU: no PDL, no prefetch; limits of an H100 for validity."""
        return cls("triton-interpreter", (0, 0), 132, 50 * 2**20, SMEM_DEFAULT_BYTES)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["capability"] = list(self.capability)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceInfo":
        return cls(d["name"], tuple(d["capability"]), int(d["num_sms"]), int(d["l2_bytes"]),
                   int(d["smem_per_block_bytes"]), bool(d.get("nvcc", True)))  # (recordings before session 46)


_CACHE: dict[int, DeviceInfo] = {}


def _cached(idx: int) -> DeviceInfo:
    if idx not in _CACHE:
        import torch

        from tuner.kernels._nvcc import nvcc

        p = torch.cuda.get_device_properties(idx)
        smem = getattr(p, "shared_memory_per_block_optin", 0) or SMEM_DEFAULT_BYTES
        _CACHE[idx] = DeviceInfo(p.name, (p.major, p.minor), p.multi_processor_count,
                                 int(getattr(p, "L2_cache_size", 50 * 2**20)), int(smem), nvcc() is not None)
    return _CACHE[idx]


def current() -> DeviceInfo:
    """The GPU if there is one, else the interpreter."""
    import torch

    return DeviceInfo.from_torch() if torch.cuda.is_available() else DeviceInfo.interpreter()


def require_gpu(script: str, dry_run_ok: bool = False) -> None:
    """A diagnostics script's first step (scripts/*.py): where no CUDA GPU is visible, one line on stderr and exit
    status 2, not a traceback from inside torch. ``dry_run_ok``: the script has a CPU dry run under
    TRITON_INTERPRET=1."""
    import os
    import sys
    from pathlib import Path

    import torch

    if torch.cuda.is_available() or (dry_run_ok and os.environ.get("TRITON_INTERPRET") == "1"):
        return
    dry = " (or TRITON_INTERPRET=1 for its CPU dry run)" if dry_run_ok else ""
    print(f"{Path(script).name}: needs a CUDA GPU and none is visible{dry}; it is a diagnostic for the GPU machine "
          "(README.md, Performance notes)", file=sys.stderr)
    sys.exit(2)
