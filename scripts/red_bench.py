"""What a split-K reduction by global vector atomics costs (scripts/red_bench.cu; docs/perf-notes.md, section 34):
us a launch of `adders` x row tiles x column splits CTAs, each adding a 64-row tile into an [M, cols] output, against
the bare launch and against plain stores of the same bytes. Each figure: a CUDA graph of 20 launches in stream order,
median of 15 replays, divided by 20. usage: python3 scripts/red_bench.py"""

import ctypes
from pathlib import Path

import torch

from tuner.kernels import _nvcc

SOURCE = Path(__file__).with_name("red_bench.cu")
LAUNCHES = 20


def main():
    lib = _nvcc.build(SOURCE, {"RB": 1}, "red_bench")
    lib.red_run.argtypes = _nvcc.c_argtypes(SOURCE.read_text(), "red_run")
    err = ctypes.create_string_buffer(256)
    dev = torch.cuda.get_device_properties(0)
    print(f"## {dev.name}, {dev.multi_processor_count} SMs, torch {torch.__version__}; us a launch "
          f"(graph of {LAUNCHES}, median of 15 replays)")
    print("| case | CTAs | KB a CTA (f32) | launch | stores | red f32 | red f16x2 | bulk red f32 | bulk red f16 "
          "| bulk copy | atomics check |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    cases = [  # (name, adders, row tiles, col splits, cols)
        ("out-proj, Q CTAs (bert-base)", 12, 2, 1, 768),
        ("out-proj, Q+K+V CTAs (bert-base)", 12, 2, 3, 768),
        ("out-proj, Q CTAs (bert-large)", 16, 2, 1, 1024),
        ("out-proj, 4 CTAs a row tile (bert-large)", 16, 2, 4, 1024),
        ("FFN2 from FFN1's 96 tiles (bert-base)", 48, 2, 1, 768),
        ("FFN2, clusters of 4 pre-reduced (bert-base)", 12, 2, 4, 768),
        ("FFN2, clusters of 8 pre-reduced (bert-base)", 6, 2, 8, 768),
    ]
    stream = torch.cuda.Stream()
    for name, adders, rt, cs, cols in cases:
        ctas = adders * rt * cs
        row = []
        ok = True
        for mode in range(7):
            dt = torch.float16 if mode in (3, 5) else torch.float32
            if mode >= 4 and 64 * cols // cs * (2 if mode == 5 else 4) > 200 * 1024:
                row.append(float("nan"))
                continue
            out = torch.zeros(64 * rt, cols, dtype=dt, device="cuda")
            priv = torch.zeros(ctas, 64, cols // cs, dtype=dt, device="cuda")

            def launch():
                rc = lib.red_run(adders, rt, cs, cols, mode, out.data_ptr(), priv.data_ptr(),
                                 torch.cuda.current_stream().cuda_stream, err)
                assert rc == 0, err.value

            with torch.cuda.stream(stream):
                launch()
                torch.cuda.synchronize()
                if mode in (2, 4):  # every element: the sum over adders of (1 + adder)
                    ok &= bool((out == adders * (adders + 1) / 2).all())
                if mode in (3, 5):
                    ok &= bool((out.float() == adders).all())
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=stream):
                    for _ in range(LAUNCHES):
                        launch()
            ts = []
            for _ in range(17):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) * 1e3 / LAUNCHES)
            row.append(sorted(ts[2:])[len(ts[2:]) // 2])
        kb = 64 * cols // cs * 4 / 1024
        print(f"| {name} | {ctas} | {kb:.0f} | " + " | ".join(f"{x:.2f}" for x in row)
              + f" | {'ok' if ok else 'WRONG'} |", flush=True)


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
