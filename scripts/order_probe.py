"""Does a layer stack's time depend on what ran before it in the process? (perf notes, section 26.)

usage: python3 scripts/order_probe.py [--hot] SHAPE BEST_JSON|hp [STEP ...]
--hot: every layer the same weights (they stay in L2); hp: the hand-picked config (tuner.bench.hand_picked).
steps: eager (torch eager layers captured and timed), compile (torch.compile's), profile (CUPTI records of the
stack: scripts/timeline.py's kernel_records), restack (the same config built again on new buffers and timed),
sleep (5 s idle), streams (8 new CUDA streams, kept), alloc (1 GiB allocated and kept), graph (a trivial CUDA graph
captured on a new side stream, as tuner.timing.capture does, and dropped), graph1 (the same on one reused side stream),
free0 (256 MiB allocated and dropped), free (the same, then torch.cuda.empty_cache: memory back to the driver),
tc (a torch.compile stack built and kept: timed beside the stack after every later step).
PROBE_NO_EMPTY_CACHE=1: torch.cuda.empty_cache does nothing (torch.cuda.graph calls it before each capture).
The stack is built and timed three times before the first step and again after each, as the tuner times it
(cold weights: time_replay, median of 30 replays).
"""

import os
import sys
import time

import torch

from tuner.baselines import TorchStack
from tuner.bench import hand_picked
from tuner.device import DeviceInfo
from tuner.export import load_config
from tuner.layer import DecoderStack, random_stack_weights, stack_depth
from tuner.shapes import resolve
from tuner.timing import kernel_records, time_replay


def main():
    if os.environ.get("PROBE_NO_EMPTY_CACHE") == "1":
        torch.cuda.empty_cache = lambda: None
    hot = "--hot" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--hot"]
    shape = resolve(args[0])
    cfg = hand_picked(shape) if args[1] == "hp" else load_config(args[1], shape=shape)
    steps = args[2:]
    dev = DeviceInfo.from_torch()
    n = stack_depth(shape, 2, dev.l2_bytes)
    weights = random_stack_weights(shape, 1 if hot else n, torch.float16, "cuda", 0) * (n if hot else 1)
    st = DecoderStack(shape, cfg, n_layers=n, dtype=torch.float16, weights=weights)
    st.capture()
    st.check(1)

    def three(tag):
        ts = [time_replay(st.replay, n, reps=30, warmup=5).median_us for _ in range(3)]
        line = " / ".join(f"{t:.2f}" for t in ts)
        if tc:
            line += f"; torch.compile {tc[0].time(30, 5).median_us:.2f}"
        print(f"## {shape.name} stack {tag}: {line} us/layer", flush=True)

    keep, keep_stream, tc = [], torch.cuda.Stream(), []
    three("first")
    for step in steps:
        if step in ("eager", "compile"):
            ts = TorchStack(shape, weights, torch.float16, compiled=step == "compile")
            print(f"## {step}: {ts.time(30, 5).median_us:.2f} us/layer")
            del ts
        elif step == "profile":
            kernel_records(st.replay, 5)
        elif step == "restack":
            other = DecoderStack(shape, cfg, n_layers=n, dtype=torch.float16, weights=weights)
            other.capture()
            print(f"## restack: {time_replay(other.replay, n, reps=30, warmup=5).median_us:.2f} us/layer")
            del other
        elif step in ("free0", "free"):
            torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # (dropped at once)
            if step == "free":
                torch.cuda.empty_cache()
        elif step == "tc":
            tc.append(TorchStack(shape, weights, torch.float16, compiled=True))
        elif step == "streams":
            keep.extend(torch.cuda.Stream() for _ in range(8))
        elif step == "alloc":
            keep.append(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))
        elif step in ("graph", "graph1"):
            a = torch.zeros(1024, device="cuda")
            s = keep_stream if step == "graph1" else torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                a.add_(1)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                a.add_(1)
            g.replay()
            torch.cuda.synchronize()
            del g, a
        elif step == "sleep":
            torch.cuda.synchronize()
            time.sleep(5)
        else:
            raise SystemExit(f"order_probe: unknown step {step!r}")
        three(f"after {step}")


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
