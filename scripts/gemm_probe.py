"""How fast one GEMM of a layer runs alone: our kernel under several tiles against cuBLAS (torch).

usage: python3 scripts/gemm_probe.py SHAPE [CONFIG.json] [NAME:field=value,... ...]
For each GEMM of SHAPE (M = batch*seq rows): R launches of the same GEMM back to back in one CUDA graph,
no PDL, weights either hot (one copy, stays in L2) or cold (copies rotating through more than L2). Per
variant: the kernel's duration as CUPTI reports it (median over launches), and the bytes each program
moves through its SM (A and B tiles) divided by that duration. Variants: the GEMM's config from CONFIG
(a best.json; else the hand-picked tiles), the same with other stages, tiles, split-K or without TMA, and
torch.nn.functional.linear; with NAME:field=value,... arguments (e.g. w256:block_n=256,num_warps=4), only the config
and those variants of it, and torch.
"""

import statistics
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F

from tuner.bench import hand_picked
from tuner.device import DeviceInfo
from tuner.export import load_config
from tuner.kernels.gemm import GemmProblem, check, fit, grid, linear, workspace_numel
from tuner.shapes import resolve
from tuner.timing import capture, kernel_records


def durations(fn, n_launch, reps=5):
    """Per launch of fn's GEMM (n_launch per call): the summed CUPTI duration (us) of the kernels it runs
    (a split-K reduction or torch's GELU kernel included), median over reps graph replays; and their names."""
    g = capture(fn)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()

    def replay():
        g.replay()
        torch.cuda.synchronize()

    ks = kernel_records(replay, reps)
    per = len(ks) // reps
    sums = [sum(end - start for _, start, end in ks[r * per:(r + 1) * per]) / n_launch for r in range(reps)]
    names = sorted({name[:20] for name, _, _ in ks})
    return statistics.median(sums), "+".join(names)


def main():
    shape = resolve(sys.argv[1])
    cfg = load_config(sys.argv[2], shape=shape) if len(sys.argv) > 2 else hand_picked(shape)
    extra = [a.split(":", 1) for a in sys.argv[3:]]
    dev = DeviceInfo.from_torch()
    m, d, f = shape.batch * shape.seq, shape.d_model, shape.ffn
    gemms = {"qkv": (3 * d, d, None), "out": (d, d, None), "ffn1": (f, d, "gelu"), "ffn2": (d, f, None)}
    torch.manual_seed(0)
    print(f"# {dev.name}, torch {torch.__version__}, shape {shape.name} (M={m})")
    print("| gemm | variant | weights | grid | us (CUPTI) | KB/program | KB/us per program |")
    print("|---|---|---|---:|---:|---:|---:|")
    for g, (n, k, act) in gemms.items():
        base = replace(getattr(cfg, g), overlap_ratio=-1.0, prefetch_ratio=-1.0)
        variants = {"tuned": base, "6 stages": replace(base, num_stages=6),
                    "bk64 8 stages": replace(base, block_k=64, num_stages=8),
                    "bn32": replace(base, block_n=32), "bn128": replace(base, block_n=128),
                    "bm128": replace(base, block_m=128, num_warps=8), "bm32": replace(base, block_m=32),
                    "split-K 2": replace(base, split_k=2 * base.split_k), "no TMA": replace(base, tma=0),
                    # for long K (weights far beyond L2): more bytes in flight a program, more programs
                    "split-K 4": replace(base, split_k=4 * base.split_k),
                    "bk256 3 stages": replace(base, block_k=256, num_stages=3),
                    "bm64 bn128": replace(base, block_m=64, block_n=128),
                    "cluster split 2": replace(base, block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=6,
                                               split_k=2, cluster=2, tma=1),
                    "cluster split 4": replace(base, block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=6,
                                               split_k=4, cluster=2, tma=1)}
        if extra:  # (DecoderConfig.edited parses the edits, as scripts/timeline.py's variants)
            variants = {"tuned": base, **{name: getattr(replace(cfg, **{g: base}).edited(
                [f"{g}.{e}" for e in edits.split(",")]), g) for name, edits in extra}}
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        copies = max(1, int(3 * dev.l2_bytes // (n * k * 2)) + 1)
        ws_cold = [torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02 for _ in range(copies)]
        b = torch.zeros(n, device="cuda", dtype=torch.float16)
        out = torch.empty(m, n, device="cuda", dtype=torch.float16)
        R = 20
        for wname, wl in (("hot", ws_cold[:1]), ("cold", ws_cold)):
            rows = []
            for vname, c in variants.items():
                c = fit(c, GemmProblem(m, n, k))
                bad = check(c, GemmProblem(m, n, k), dev)
                if bad:
                    rows.append(f"| {g} | {vname} | {wname} | - | invalid: {bad} | | |")
                    continue
                numel = workspace_numel(c, m, n)
                ws_buf = torch.empty(numel, device="cuda", dtype=torch.float32) if numel else None

                def run(c=c, wl=wl):
                    for i in range(R):
                        linear(x, wl[i % len(wl)], b, config=c, activation=act, out=out, workspace=ws_buf)
                try:
                    us, _ = durations(run, R)
                except Exception as e:  # a config the compiler rejects: say so, go on
                    rows.append(f"| {g} | {vname} | {wname} | - | failed: {str(e).splitlines()[0][:80]} | | |")
                    continue
                tiles, splits = grid(c, m, n)
                progs = tiles * splits
                kb = (c.block_m + c.block_n) * (k // c.split_k) * 2 / 1024
                tag = f"{c.block_m}x{c.block_n}x{c.block_k}/{c.num_stages}s/sk{c.split_k}" + ("/tma" if c.tma else "")
                rows.append(f"| {g} | {vname} {tag} | {wname} | {progs} | {us:.2f} | {kb:.0f} | {kb / us:.0f} |")

            def run_torch(wl=wl):
                for i in range(R):
                    y = F.linear(x, wl[i % len(wl)], b)
                    if act == "gelu":
                        y = F.gelu(y)
            us, kname = durations(run_torch, R)
            rows.append(f"| {g} | torch ({kname[:24]}) | {wname} | - | {us:.2f} | | |")
            print("\n".join(rows), flush=True)


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
