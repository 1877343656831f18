"""How fast one SM takes in data through the TMA unit, by load shape, issuing threads (warps x lanes) and loads an
mbarrier, alone and with every SM loading (scripts/tma_bench.cu; docs/perf-notes.md, section 19). L2-resident data
(a 12 MB tensor, read once before). usage: python3 scripts/tma_bench.py; from Python also issue_cost(), scaling(),
hotspot(), multicast(), burst() and l2_to_sm_bytes_per_s(); `python3 scripts/tma_bench.py burst` runs burst() alone, `... burst-apart` the launch in clusters apart from
the sharing of A."""

import ctypes
import sys
from pathlib import Path

import torch

from tuner.kernels import _nvcc

KINDS = {0: "2-D box", 1: "3-D box", 2: "1-D bulk"}
SOURCE = Path(__file__).with_name("tma_bench.cu")


def _setup():
    """The benchmark library (every entry point's argtypes from the source), a [2048, 3072] fp16 tensor (12 MB: it
    stays in L2 once read), an error buffer."""
    lib = _nvcc.build(SOURCE, {"TB": 2}, "tma_bench")
    for fn in ("tma_ingest", "tma_ingest_mc", "tma_issue_cost", "tma_ingest_burst"):
        getattr(lib, fn).argtypes = _nvcc.c_argtypes(SOURCE.read_text(), fn)
    return lib, torch.randn(2048, 3072, device="cuda").half(), ctypes.create_string_buffer(256)


def _ingest(lib, t, err, kind, rows, loads, slots, warps, lanes, group, shared, ctas, threads, runs=2):
    """tma_ingest `runs` times (the first reads the tensor into L2); the last run's [issuers, 3] int64: cycles first
    issue -> last arrival, cycles of the first slots' issues, %globaltimer ns of the same span."""
    out = torch.zeros(3 * ctas * warps * lanes, dtype=torch.int64, device="cuda")
    for _ in range(runs):
        rc = lib.tma_ingest(t.data_ptr(), kind, rows, loads, slots, warps, lanes, group, shared, ctas, threads,
                            out.data_ptr(), err)
        assert rc == 0, (rc, err.value)
    return out.view(-1, 3)


def main():
    lib, t, err = _setup()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # (kind, rows, warps, lanes, group, slots, threads)
    cases = [(0, 64, 1, 1, 1, 4, 32), (0, 64, 1, 1, 1, 4, 128), (0, 64, 1, 1, 1, 8, 32)]
    cases += [(0, 64, 1, lanes, 1, 4, 32) for lanes in (2, 4, 8)]
    cases += [(0, 64, 1, 1, group, 4, 32) for group in (2, 4)]
    cases += [(0, 64, warps, 1, 1, 4, 32 * warps) for warps in (2, 4, 8)]
    cases += [(0, 128, 1, lanes, 1, 4, 32) for lanes in (1, 2, 4)]
    cases += [(1, 192, 1, lanes, 1, 2, 32) for lanes in (1, 2, 4)]
    cases += [(2, 128, 1, lanes, 1, 4, 32) for lanes in (1, 4)]
    for ctas in (1, sms):
        for kind, rows, warps, lanes, group, slots, threads in cases:
            if warps * lanes * slots * group * rows * 128 > 200 * 1024:
                continue
            loads = 96
            o = _ingest(lib, t, err, kind, rows, loads, slots, warps, lanes, group, 0, ctas, threads).double()
            cyc, issue, ns = o[:, 0], o[:, 1], o[:, 2]
            per_sm = loads * warps * lanes * rows * 128 / cyc.view(ctas, warps * lanes).max(1).values
            ghz = (cyc / ns.clamp(min=1)).median().item()
            print(f"ctas {ctas:3d} {KINDS[kind]:8s} {rows * 128 // 1024:3d} KB  {warps} warp(s) x {lanes} lane(s), "
                  f"{group} a barrier, {slots} slots, {threads:3d} threads: {per_sm.median().item():6.1f} B/cycle/SM, "
                  f"{cyc.median().item() / loads:6.1f} cycles a load an issuer, first {slots} slots issued in "
                  f"{issue.median().item():5.0f} cycles; {ghz:.2f} cycles/ns", flush=True)


def l2_to_sm_bytes_per_s() -> float:
    """The chip's L2 -> SM rate: every SM loading L2-resident 24 KB boxes by TMA from 4 issuing lanes (the fastest
    shape of main() and scaling()); bytes over the slowest SM's %globaltimer span."""
    lib, t, err = _setup()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    loads, lanes, rows = 96, 4, 192
    rates = []
    for _ in range(5):
        ns = _ingest(lib, t, err, 1, rows, loads, 2, 1, lanes, 1, 0, sms, 32, runs=1)[:, 2].max().item()
        rates.append(sms * lanes * loads * rows * 128 / (ns * 1e-9))
    return sorted(rates)[len(rates) // 2]


def issue_cost():
    """Cycles one thread spends issuing each primitive of a producer loop (nothing to wait for)."""
    lib, t, err = _setup()
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    names = {0: "TMA load (one barrier for all)", 1: "expect_tx + TMA load", 2: "expect_tx", 3: "try_wait, phase done",
             4: "%globaltimer read", 5: "TMA load, runtime-division coordinates"}
    for mode, name in names.items():
        res = []
        for n in (1, 4, 16):
            cyc = []
            for _ in range(3):
                assert lib.tma_issue_cost(t.data_ptr(), mode, n, 64, out.data_ptr(), err) == 0, err.value
                cyc.append(out.item())
            res.append(f"{n:2d}: {min(cyc) / n:6.1f}")
        print(f"issue cost, {name:40s} cycles each ({', '.join(res)})", flush=True)


def scaling():
    """What each SM takes in when only some SMs load (the L2 -> SM cap shared among them): 4 issuing lanes."""
    lib, t, err = _setup()
    for kind, rows, slots in ((1, 192, 2), (0, 128, 3)):
        for ctas in (1, 24, 48, 72, 96, 132):
            loads, lanes = 96, 4
            o = _ingest(lib, t, err, kind, rows, loads, slots, 1, lanes, 1, 0, ctas, 32)
            cyc = o[:, 0].double().view(ctas, lanes).max(1).values
            per_sm = loads * lanes * rows * 128 / cyc
            total = per_sm.median().item() * ctas * 1.98e9 / 1e12
            print(f"scaling: {ctas:3d} SMs loading, {KINDS[kind]} {rows * 128 // 1024} KB x 4 lanes: "
                  f"{per_sm.median().item():6.1f} B/cycle/SM (min {per_sm.min().item():6.1f}), "
                  f"~{total:.1f} TB/s in all at 1.98 GHz", flush=True)


def hotspot():
    """Every SM reading the same boxes at the same time (a GEMM's A rows, read by all its column tiles) against
    boxes of their own: 4 issuers a CTA, `shared` of them on the common sequences."""
    lib, t, err = _setup()
    for kind, rows, slots in ((0, 64, 4), (0, 128, 3)):
        for ctas in (48, 96):
            for shared in (0, 2, 4):
                loads, lanes = 96, 4
                o = _ingest(lib, t, err, kind, rows, loads, slots, 1, lanes, 1, shared, ctas, 32)
                cyc = o[:, 0].double().view(ctas, lanes).max(1).values
                per_sm = loads * lanes * rows * 128 / cyc
                print(f"hotspot: {ctas:3d} SMs, {KINDS[kind]} {rows * 128 // 1024:2d} KB x 4 issuers, {shared} of them "
                      f"on sequences common to all SMs: {per_sm.median().item():6.1f} B/cycle/SM "
                      f"(min {per_sm.min().item():6.1f})", flush=True)


def multicast():
    """Clusters of 1, 2, 4 CTAs sharing every box by multicast: what each SM receives, and what L2 serves."""
    lib, t, err = _setup()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for rows in (64, 128):
        for slots in (4, 8):
            for csize in (1, 2, 4):
                for ctas in (csize, sms // csize * csize):
                    loads = 96
                    out = torch.zeros(ctas, dtype=torch.int64, device="cuda")
                    for _ in range(2):
                        rc = lib.tma_ingest_mc(t.data_ptr(), rows, loads, slots, csize, ctas, out.data_ptr(), err)
                        assert rc == 0, (rc, err.value)
                    recv = loads * rows * 128 / out.double()
                    print(f"multicast: {ctas:3d} CTAs in clusters of {csize}, {rows * 128 // 1024:2d} KB boxes, "
                          f"{slots} slots: each SM receives {recv.median().item():6.1f} B/cycle (min "
                          f"{recv.min().item():6.1f}), L2 serves {recv.median().item() / csize:6.1f} a SM", flush=True)


CLUSTERS = ((1, 0, 1), (2, 0, 2), (2, 1, 2), (4, 0, 4), (4, 1, 4))  # (cluster size, multicast, CTAs reading one A)
APART = ((1, 0, 1), (1, 0, 2), (1, 0, 4), (2, 0, 1), (2, 0, 2), (4, 0, 1), (4, 0, 4))  # the cluster and the sharing apart


def burst(ctas_list=(96, 128), kts=(1, 2, 4), runs=5, cases=CLUSTERS, lanes_list=(1, 4)):
    """A 64x64 GEMM program's K = 768 slice as one burst a CTA: 96 KB of A rows (the same in `group` consecutive
    CTAs) and 96 KB of its own B columns, every box issued at once (perf notes 43). Each case (cluster size,
    multicast, group): A loaded by every CTA (multicast 0) or once a cluster by multicast (1, group = cluster size);
    boxes of kt 8 KB tiles, 1 or 4 issuing lanes.
    Per case (the median of `runs` launches after one that reads the tensor into L2): what an SM takes in (B/cycle,
    median and slowest CTA), a CTA's burst in us (median, slowest), and over the chip's span (first start to last
    landing) the TB/s delivered into shared memory and served by L2."""
    lib, t, err = _setup()
    kb = 96
    for ctas in ctas_list:
        for kt in kts:
            n = kb // (8 * kt)
            for csize, mc, group in cases:
                for lanes in lanes_list:
                    out = torch.zeros(3 * ctas, dtype=torch.int64, device="cuda")
                    rows = []
                    for r in range(runs + 1):
                        rc = lib.tma_ingest_burst(t.data_ptr(), kt, n, n, csize, mc, group, lanes, ctas,
                                                  out.data_ptr(), err)
                        assert rc == 0, (rc, err.value)
                        o = out.view(-1, 3).double()
                        if r:
                            rows.append(o.clone())
                    recv = 2 * kb * 1024
                    served = kb * 1024 * (1 / csize if mc else 1) + kb * 1024
                    per = []
                    for o in rows:
                        cyc, g0, g1 = o[:, 0], o[:, 1], o[:, 2]
                        span = (g1.max() - g0.min()).item()
                        per.append(((recv / cyc).median().item(), (recv / cyc).min().item(),
                                    ((g1 - g0) / 1e3).median().item(), ((g1 - g0) / 1e3).max().item(),
                                    ctas * recv / span / 1e3, ctas * served / span / 1e3))
                    med = [sorted(x)[len(x) // 2] for x in zip(*per)]
                    who = "multicast" if mc else f"loaded by each, the same in {group}"
                    print(f"burst: {ctas:3d} CTAs, clusters of {csize}, A {who:28s}, {kt * 8:2d} KB boxes, {lanes} "
                          f"lane(s): {med[0]:6.1f} B/cycle/SM "
                          f"(slowest {med[1]:6.1f}); a CTA {med[2]:5.2f} us (slowest {med[3]:5.2f}); chip "
                          f"{med[4]:5.2f} TB/s into shared memory, L2 serves {med[5]:5.2f}", flush=True)


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    if sys.argv[1:] == ["burst"]:
        burst()
    elif sys.argv[1:] == ["burst-apart"]:
        burst(ctas_list=(96, 128), kts=(1, 4), cases=APART, lanes_list=(4,))
    else:
        main()
        multicast()
