"""Without a CUDA GPU every kernel runs in the Triton interpreter. TRITON_INTERPRET is read when a
kernel is decorated, so it is set here, before any test imports a kernel module."""

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if HAS_GPU else "cpu"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    # With pytest-xdist (`-n 2 --dist loadgroup`, the README's command) a file's tests run in one worker, so its
    # module fixtures are built once; with a GPU every test runs in one worker, so no two share the GPU and no
    # timing is measured beside another test. (Without xdist the marker means nothing.)
    skip = None if HAS_GPU else pytest.mark.skip(reason="needs a CUDA GPU: run through the device tool (pytest -m gpu)")
    for item in items:
        item.add_marker(pytest.mark.xdist_group("gpu" if HAS_GPU else item.path.name))
        if skip and item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE
