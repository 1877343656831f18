"""The GPUs that the CPU tests describe to check(), smem_bytes() and repair() (tests/ is on sys.path under
pytest). Shared-memory limits are the opt-in per-block maxima the drivers report."""

from tuner.device import DeviceInfo

H100 = DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 132, 50 << 20, 232448)
H200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 60 << 20, 232448)
A100 = DeviceInfo("NVIDIA A100-SXM4-80GB", (8, 0), 108, 40 << 20, 166912)
