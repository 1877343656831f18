"""scripts/floors.py's byte counts (the per-kernel floors in the README and perf notes section 19), against the
arithmetic done by hand for bert-base's committed top-1 (64x64 tiles; 16-row attention programs over 128 keys)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import floors  # noqa: E402

from tuner.config import DecoderConfig  # noqa: E402
from tuner.kernels.attention import AttnConfig  # noqa: E402
from tuner.kernels.gemm import GemmConfig  # noqa: E402
from tuner.shapes import resolve  # noqa: E402

T64 = GemmConfig(block_m=64, block_n=64, block_k=128, num_stages=4, tma=1)


def test_gemm_bytes_by_hand():
    # QKV: A (128 x 768) once per 36 column tiles, B (2304 x 768) once per 2 row tiles, 2 bytes an element.
    assert floors.gemm_l2_bytes(128, 2304, 768, T64, residual=False) == (36 * 128 * 768 + 2 * 2304 * 768) * 2
    # FFN2 split in a cluster: no partials through L2, plus the residual rows.
    c = GemmConfig(block_m=64, block_n=64, split_k=4, cluster=1, tma=1)
    assert floors.gemm_l2_bytes(128, 768, 3072, c, residual=True) == (12 * 128 * 3072 + 2 * 768 * 3072
                                                                       + 128 * 768) * 2
    # Split by the Triton kernels: the reduction kernel reads every split's fp32 partial.
    c = GemmConfig(block_m=64, block_n=64, split_k=3)
    assert floors.gemm_l2_bytes(128, 768, 768, c, residual=False) == (12 * 128 * 768 + 2 * 768 * 768) * 2 \
        + 3 * 128 * 768 * 4
    # Fewer rows than a tile: A holds only the rows there are.
    assert floors.gemm_l2_bytes(32, 768, 256, T64, residual=False) == (12 * 32 * 256 + 1 * 768 * 256) * 2


def test_attention_bytes_by_hand():
    # 16-row programs, 128-key blocks: each of the 8 query tiles of a head loads its Q rows and one 128-key block of
    # K and V (causal, but the block holds every key up to its last row).
    a = AttnConfig(block_m=16, block_n=128)
    assert floors.attn_l2_bytes(1, 128, 12, a) == 12 * 8 * (16 + 2 * 128) * 64 * 2
    # 64-row programs over 64-key blocks: the first query tile's keys stop at 64.
    a = AttnConfig(block_m=64, block_n=64)
    assert floors.attn_l2_bytes(1, 128, 1, a) == ((64 + 2 * 64) + (64 + 2 * 128)) * 64 * 2


def test_layer_floors():
    shape = resolve("bert-base")
    d, f = shape.d_model, shape.ffn
    cfg = DecoderConfig(qkv=T64, out=T64, ffn1=T64, ffn2=T64)
    rows = floors.floors(shape, cfg, dram_bw=4e12, l2_bw=8e12)
    names = [r[0] for r in rows]
    assert [n for n in names if not n.startswith("norm")] == ["qkv", "attn", "out", "ffn1", "ffn2"]
    assert sum(r[1] for r in rows) == (3 * d * d + d * d + 2 * d * f) * 2  # the weight matrices, read once
    for _, w, b, fd, fl in rows:
        assert fd == pytest.approx(w / 4e12 * 1e6) and fl == pytest.approx(b / 8e12 * 1e6)
