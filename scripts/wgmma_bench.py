"""Cycles per wgmma m64nNk16 issued the way our GEMM loops issue them (scripts/wgmma_bench.cu), on 1 CTA and on one
CTA an SM. usage: python3 scripts/wgmma_bench.py"""

import ctypes
from pathlib import Path

import torch

from tuner.kernels import _nvcc


def main():
    lib = _nvcc.build(Path(__file__).with_name("wgmma_bench.cu"), {"WB": 1}, "wgmma_bench")
    lib.wgmma_bench.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    clock_ghz = torch.cuda.clock_rate() / 1e3 if hasattr(torch.cuda, "clock_rate") else None
    iters = 2000
    for ctas in (1, sms):
        for n, wait, mmas in ((64, 1, 4), (64, 0, 4), (64, 1, 8), (128, 1, 4), (128, 0, 4)):
            cyc = torch.zeros(ctas, dtype=torch.int64, device="cuda")
            sink = torch.zeros(ctas * 128, dtype=torch.float32, device="cuda")
            assert lib.wgmma_bench(n, wait, mmas, cyc.data_ptr(), sink.data_ptr(), 10, ctas) == 0
            assert lib.wgmma_bench(n, wait, mmas, cyc.data_ptr(), sink.data_ptr(), iters, ctas) == 0
            per = cyc.float().median().item() / (iters * mmas)
            macs = 64 * n * 16 / per
            print(f"ctas {ctas:3d}  m64n{n}k16  wait<{wait}>  {mmas} a group: {per:6.1f} cycles a wgmma, "
                  f"{macs:6.0f} MAC/cycle/SM" + (f" (clock {clock_ghz} GHz)" if clock_ghz else ""), flush=True)




def tma():
    lib = _nvcc.build(Path(__file__).with_name("wgmma_bench.cu"), {"WB": 1}, "wgmma_bench")
    lib.tma_bench_run.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 4 + [ctypes.c_void_p, ctypes.c_char_p]
    a = torch.randn(4096, 3072, device="cuda").half()
    b = torch.randn(4096, 3072, device="cuda").half()
    cyc = torch.zeros(1, dtype=torch.int64, device="cuda")
    err = ctypes.create_string_buffer(256)
    for box_rows in (64, 128, 256):
        for maps in (1, 2):
            for slots in (2, 4, 10):
                if slots * box_rows * 128 > 200 * 1024:
                    continue
                boxes = 240
                for _ in range(2):  # the second run: the tensors in L2 from the first
                    assert lib.tma_bench_run(a.data_ptr(), b.data_ptr(), maps, box_rows, boxes, slots,
                                             cyc.data_ptr(), err) == 0, err.value
                c = cyc.item()
                kb = boxes * box_rows * 128 / 1024
                print(f"TMA 1 CTA: box {box_rows}x64, {maps} descriptor(s), {slots} slots: {c / boxes:7.1f} cycles a box, "
                      f"{kb * 1024 / c:6.1f} B/cycle", flush=True)



def icache():
    lib = _nvcc.build(Path(__file__).with_name("wgmma_bench.cu"), {"WB": 1}, "wgmma_bench")
    lib.icache_bench_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    sink = torch.zeros(128, device="cuda")
    cyc = torch.zeros(4, dtype=torch.int64, device="cuda")
    for _ in range(3):
        assert lib.icache_bench_run(sink.data_ptr(), cyc.data_ptr(), 4) == 0
        print("straight run of 4096 FMAs (64 KB of code), 4 passes, cycles each:", cyc.tolist(), flush=True)


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    icache()
    tma()
    main()
