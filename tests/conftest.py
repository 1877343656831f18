"""Without a CUDA GPU every kernel runs in the Triton interpreter. TRITON_INTERPRET is read when a
kernel is decorated, so it is set here, before any test imports a kernel module."""

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if HAS_GPU else "cpu"


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run through the device tool (pytest -m gpu)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE
