"""What straight-line code costs the first time an SM runs it (instruction fetch), against the same code again
(scripts/icache_bench.cu; docs/perf-notes.md, section 25). Each line: cycles an instruction of the first pass and of
the next two over the same code, medians over warps (max in brackets). usage: python3 scripts/icache_bench.py"""

from pathlib import Path

import torch

from tuner.kernels import _nvcc

SOURCE = Path(__file__).with_name("icache_bench.cu")


def _lib():
    lib = _nvcc.build(SOURCE, {"ICB": 1}, "icache_bench")
    lib.icb_launch.argtypes = _nvcc.c_argtypes(SOURCE.read_text(), "icb_launch")
    return lib


def launch(lib, n, tag, ctas, warps, passes=3):
    out = torch.zeros(ctas * warps * passes, dtype=torch.int64, device="cuda")
    assert lib.icb_launch(n, tag, ctas, warps, passes, out.data_ptr(), 1.0) == 0, (n, tag)
    return out.view(ctas * warps, passes)


def show(what, n, out):
    per = out.double() / n
    med, mx = per.median(0).values.tolist(), per.max(0).values.tolist()
    print(f"{what:58s} N={n:5d}: " + "  ".join(f"pass {p} {m:5.2f} ({x:5.2f})" for p, (m, x) in enumerate(zip(med, mx))),
          flush=True)


def main():
    lib = _lib()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n in (512, 2048, 8192):
        show("first launch of this code, 1 CTA x 1 warp", n, launch(lib, n, 0, 1, 1))
        show("  again at once, 1 x 1", n, launch(lib, n, 0, 1, 1))
        torch.cuda.synchronize()
        show("  again after a sync, 1 x 1", n, launch(lib, n, 0, 1, 1))
        launch(lib, 2048, 1, sms, 4)
        show("  after a 32 KB kernel on every SM, 1 x 1", n, launch(lib, n, 0, 1, 1))
        launch(lib, 16384, 1, sms, 4)
        show("  after a 256 KB kernel on every SM, 1 x 1", n, launch(lib, n, 0, 1, 1))
        show(f"  {sms} CTAs x 8 warps, at once", n, launch(lib, n, 0, sms, 8))
        launch(lib, 2048, 1, sms, 4)
        show(f"  {sms} x 8 after a 32 KB kernel on every SM", n, launch(lib, n, 0, sms, 8))
        launch(lib, 16384, 1, sms, 4)
        show(f"  {sms} x 8 after a 256 KB kernel on every SM", n, launch(lib, n, 0, sms, 8))
        launch(lib, 512, 1, sms, 4)
        launch(lib, 2048, 1, sms, 4)
        launch(lib, 8192, 1, sms, 4)
        show(f"  {sms} x 8 after 8, 32 and 128 KB kernels", n, launch(lib, n, 0, sms, 8))
    torch.cuda.synchronize()


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
