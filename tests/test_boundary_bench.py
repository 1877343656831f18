"""scripts/boundary_bench.py's chain: each hop reads what its predecessor wrote, so the last buffer counts the hops
(in the interpreter here; on the GPU the script checks the same under PDL with the earliest trigger)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import boundary_bench  # noqa: E402


def test_the_chain_counts_its_hops(device):
    for hops in (1, 4, 7):
        bufs = tuple(torch.zeros(3 * 64, device=device) for _ in range(2))
        boundary_bench.chain(bufs, hops, programs=3, block=64)
        assert torch.equal(bufs[hops % 2], torch.full_like(bufs[0], hops))
        assert torch.equal(bufs[(hops + 1) % 2], torch.full_like(bufs[0], hops - 1))
