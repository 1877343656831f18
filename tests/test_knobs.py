"""The knob arithmetic every kernel shares (DESIGN: trigger after floor((n-1)*o) iterations, prefetch
ceil(p*n) K tiles; negative: off)."""

import pytest

from tuner.kernels._common import prefetch_count, ratio_error, trigger_index


@pytest.mark.parametrize("n, o, want", [(6, -1.0, -1), (6, 0.0, 0), (6, 0.2, 1), (6, 0.5, 2), (6, 1.0, 5),
                                        (1, 0.0, 0), (1, 1.0, 0), (24, 0.4, 9)])
def test_trigger_index(n, o, want):
    # 0: the GEMMs trigger right after gdc_wait, the norm, attention and split-K reduction before it.
    assert trigger_index(n, o) == want


@pytest.mark.parametrize("n, p, want", [(6, -1.0, 0), (6, 0.0, 0), (6, 0.01, 1), (6, 0.5, 3), (6, 1.0, 6),
                                        (12, 0.2, 3)])
def test_prefetch_count(n, p, want):
    assert prefetch_count(n, p) == want


def test_ratio_error():
    assert ratio_error("overlap_ratio", -1.0) is None and ratio_error("overlap_ratio", 1.0) is None
    assert "must be negative (off) or in [0, 1]" in ratio_error("overlap_ratio", 1.2)
    assert ratio_error("prefetch_ratio", float("nan")) is not None
