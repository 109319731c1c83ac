"""Test-wide setup: without a GPU the CuTe DSL compiles for sm_100 by default; our kernels are
sm_90a, so CPU runs (CI) compile for that. GPU tests live in tests/gpu/ and skip without CUDA."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/") or item.get_closest_marker("gpu"):
            item.add_marker(skip)
