"""What a kernel boundary costs by itself: a chain of kernels that do (almost) nothing, replayed from one CUDA graph.

Each hop's programs wait for their predecessor (``griddepcontrol.wait`` under PDL; plain stream order without it),
read the block their predecessor's program of the same index wrote, add one and write it to the other buffer. The
hop's own work is one load and one store, so the time a hop adds is the boundary: the predecessor's drain, the
release of the wait (or the launch without PDL), and the first dependent load. A layer of k kernels pays k of these
before any of its loops or epilogues; docs/perf-notes.md section 32 compares them with the layer's kernels.

usage: python3 scripts/boundary_bench.py [--hops 64] [--reps 30]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from tuner.kernels._common import launch_mode, pdl_trigger, pdl_wait


@triton.jit
def _hop(src, dst, BLOCK: tl.constexpr, LOAD: tl.constexpr, EARLY: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    if EARLY:  # the successor may launch at once (overlap ratio 0)
        pdl_trigger(0, 0, USE_PDL)
    pdl_wait(USE_PDL)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if LOAD:
        v = tl.load(src + offs) + 1.0
    else:
        v = tl.full((BLOCK,), 1.0, tl.float32)
    tl.store(dst + offs, v)


def chain(bufs: tuple[torch.Tensor, torch.Tensor], hops: int, programs: int, block: int, *, load: bool = True,
          pdl: bool = True, early: bool = True) -> None:
    """``hops`` launches, each reading the other's output (a, b, a, ...): after it, with ``load``, every element of
    the last buffer written holds its start value + ``hops`` if (and only if) every hop read its predecessor's."""
    use_pdl = pdl and launch_mode(bufs[0]).pdl
    for i in range(hops):
        src, dst = bufs[i % 2], bufs[(i + 1) % 2]
        _hop[(programs,)](src, dst, BLOCK=block, LOAD=load, EARLY=early, USE_PDL=use_pdl,
                          num_warps=4, launch_pdl=use_pdl)


def main() -> None:
    from tuner.timing import capture, time_replay

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hops", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    dev = torch.cuda.get_device_properties(0)
    print(f"## {dev.name}, {dev.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}; "
          f"{a.hops} hops a graph, median of {a.reps} replays (IQR/2), us a hop")
    print("| programs | bytes a program | load | PDL | trigger | us a hop |")
    print("|---:|---:|---|---|---|---:|")
    # (load, PDL, trigger at entry): no dependency at all; stream order; PDL triggered at exit; PDL at entry
    variants = [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]
    for programs in (1, 24, 72, 96, 132):
        for block in (64, 4096):  # 256 B or 16 KB of fp32 a program
            bufs = tuple(torch.zeros(programs * block, device="cuda") for _ in range(2))
            for load, pdl, early in variants:
                if not load and block != 64:
                    continue
                fn = lambda: chain(bufs, a.hops, programs, block, load=load, pdl=pdl, early=early)  # noqa: E731
                g = capture(fn)
                t = time_replay(g.replay, a.hops, reps=a.reps)
                print(f"| {programs} | {block * 4} | {'yes' if load else 'no'} | {'yes' if pdl else 'no'} | "
                      f"{('at entry' if early else 'at exit') if pdl else '-'} | {t.median_us:.3f} ± {t.spread_us:.3f} |")
    # Correctness of the chain under PDL with the earliest trigger: a racing hop would read a stale block.
    for programs in (132, 264):
        bufs = tuple(torch.zeros(programs * 4096, device="cuda") for _ in range(2))
        g = capture(lambda: chain(bufs, a.hops, programs, 4096, pdl=True, early=True))
        for b in bufs:  # (the replays above continued from each other's values; this one starts from zero)
            b.zero_()
        g.replay()
        torch.cuda.synchronize()
        last = bufs[a.hops % 2]
        ok = bool((last == a.hops).all())
        print(f"## chain check, {programs} programs, PDL, trigger at entry: every element {a.hops}: {ok}")
        assert ok, "a hop read its predecessor's block before it was written"


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
