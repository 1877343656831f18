"""What a hand-off between the CTAs of one persistent kernel costs by itself, beside a kernel boundary
(scripts/flag_bench.cu; docs/perf-notes.md section 43.5).

A persistent layer (perf notes sections 6 and 18) replaces each kernel boundary by flags: a CTA waits for the CTAs whose output
it reads, reads it, and releases its own. Here P co-resident CTAs run a chain of phases that do nothing else: wait,
read a block another CTA wrote (256 B or 16 KB of fp32, through L2), add one, write, release. Per-tile flags (one
producer a CTA), a join over a group of 12 CTAs (a bert-base row's 768 columns in 64-column tiles) and over all P (a
grid barrier), and NCCL's low-latency protocol (LL: no flags, each 8-byte word carries its data and its phase);
beside them, in the same process, boundary_bench's chain of kernels under PDL (the same reads). A phase's cost is
the slope over the hops (72 against 8 in one launch), so the launch itself cancels.

usage: python3 scripts/flag_bench.py [--reps 15]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
from pathlib import Path

import torch

from tuner.kernels import _nvcc

SOURCE = Path(__file__).with_name("flag_bench.cu")
HOPS = (8, 72)


def _lib():
    lib = _nvcc.build(SOURCE, {"FB": 1}, "flag_bench")
    lib.flag_chain_run.argtypes = _nvcc.c_argtypes(SOURCE.read_text(), "flag_chain_run")
    return lib


def per_phase(lib, programs: int, words: int, group: int, reps: int) -> tuple[float, float, bool]:
    """us a phase (median of `reps` slopes), their spread (IQR / 2), and whether the checked run's every element
    holds its hop count. group 0: the LL chain (8-byte words of data and phase)."""
    slots = torch.zeros((HOPS[1] + 1) * programs * words, dtype=torch.int64 if group == 0 else torch.float32,
                        device="cuda")
    flags = torch.zeros((HOPS[1] + 1) * programs, dtype=torch.int32, device="cuda")
    us, err = ctypes.c_float(), ctypes.create_string_buffer(256)
    smem = 120 * 1024  # one CTA an SM: every CTA resident at once, as the spin waits need

    def run(hops):
        if group == 0:
            slots.zero_()  # (the LL words carry their phase: a slot must not hold an earlier run's)
        rc = lib.flag_chain_run(slots.data_ptr(), flags.data_ptr(), programs, hops, words, group, smem,
                                ctypes.byref(us), err)
        assert rc == 0, (rc, err.value)
        return us.value

    slopes = []
    for _ in range(reps + 1):
        t0, t1 = run(HOPS[0]), run(HOPS[1])
        slopes.append((t1 - t0) / (HOPS[1] - HOPS[0]))
    slopes = sorted(slopes[1:])  # (the first builds and warms)
    torch.cuda.synchronize()
    last = slots.view(HOPS[1] + 1, -1)[HOPS[1]]
    if group == 0:
        data = (last & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
        ok = bool((data == HOPS[1]).all()) and bool(((last >> 32) == HOPS[1]).all())
    else:
        ok = bool((last == HOPS[1]).all())
    q = len(slopes) // 4
    return statistics.median(slopes), (slopes[-1 - q] - slopes[q]) / 2, ok


def main() -> None:
    import boundary_bench
    from tuner.timing import capture, time_replay

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    dev = torch.cuda.get_device_properties(0)
    lib = _lib()
    print(f"## {dev.name}, {dev.multi_processor_count} SMs, torch {torch.__version__}; us a phase (flags) or a hop "
          f"(kernels, 64 a graph), medians")
    print("| programs | bytes read | per-tile flag | join of 12 | join of all | LL words | kernel, PDL at entry | "
          "PDL at exit |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for programs in (72, 96, 132):
        for words in (64, 4096):
            cells = []
            for group in (1, 12, programs, 0):
                t, spread, ok = per_phase(lib, programs, words, group, a.reps)
                cells.append(f"{t:.3f} ± {spread:.3f}" + ("" if ok else " (CHECK FAILED)"))
            bufs = tuple(torch.zeros(programs * words, device="cuda") for _ in range(2))
            for early in (True, False):
                g = capture(lambda: boundary_bench.chain(bufs, 64, programs, words, pdl=True, early=early))
                t = time_replay(g.replay, 64, reps=30)
                cells.append(f"{t.median_us:.3f} ± {t.spread_us:.3f}")
            print(f"| {programs} | {words * 4} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
