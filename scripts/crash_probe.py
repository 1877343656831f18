"""Which GEMM configurations crash the GPU: each one runs alone in a fresh process (a crash poisons the CUDA
context), three launches with PDL, checked against the fp32 reference.

usage: python3 scripts/crash_probe.py M N K "field=value,..." ["field=value,..." ...]
Each spec edits a GemmConfig (default fields otherwise); a field with a leading underscore sets that flag of
tuner.kernels.gemm instead (e.g. _DESC_PREFETCH=0). Prints one line per spec: ok (rel. error) or the error.
"""

import subprocess
import sys

CHILD = r'''
import sys, torch
from dataclasses import replace
import tuner.kernels.gemm as gemm_k
from tuner.kernels.gemm import GemmConfig, linear, linear_ref
from tuner.kernels._common import rel_error
m, n, k, spec = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
kw = {}
for e in spec.split(","):
    f, v = e.split("=")
    if f.startswith("_"):
        setattr(gemm_k, f, bool(int(v)))
    else:
        kw[f] = float(v) if "." in v else int(v)
cfg = GemmConfig(**kw)
g = torch.Generator().manual_seed(0)
x = torch.randn(m, k, generator=g).half().cuda()
w = (torch.randn(n, k, generator=g) / k**0.5).half().cuda()
r = torch.randn(m, n, generator=g).half().cuda()
s = torch.cuda.Stream()
try:
    with torch.cuda.stream(s):
        for _ in range(3):
            out = linear(x, w, config=cfg, residual=r)
    torch.cuda.synchronize()
    print(f"ok {rel_error(out, linear_ref(x, w, residual=r)):.1e}")
finally:
    import os
    if os.environ.get("PROBE_PTX"):  # the GEMM builds' PTX: parameter declarations and tensormap prefetches
        for cache in gemm_k._gemm_kernel.device_caches.values():
            for kern in cache[0].values():
                for ln in kern.asm["ptx"].splitlines():
                    if "tensormap" in ln or ("_param_1" in ln and ".param" in ln):
                        print("PTX", ln.strip())
'''


def main():
    m, n, k = sys.argv[1:4]
    for spec in sys.argv[4:]:
        try:
            r = subprocess.run([sys.executable, "-c", CHILD, m, n, k, spec], capture_output=True, text=True,
                               timeout=120)
            lines = (r.stdout + r.stderr).strip().splitlines()
            ok = [ln for ln in lines if ln.startswith("ok ")]
            what = ok[-1] if ok and r.returncode == 0 else next(
                (ln for ln in reversed(lines) if "Error" in ln or "error" in ln), f"rc {r.returncode}")
            for ln in lines:
                if ln.startswith("PTX "):
                    print("   ", ln)
        except subprocess.TimeoutExpired:
            what = "timeout (120 s)"
        print(f"{m}x{n}x{k} {spec}: {what[:160]}", flush=True)


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
