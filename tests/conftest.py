"""Test-wide setup: without a GPU the CuTe DSL compiles for sm_100 by default; our kernels are
sm_90a, so CPU runs (CI) compile for that. GPU tests live in tests/gpu/ and skip without CUDA."""

import os
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
# PTX kept for the tests that read it (`__ptx__`) is also written to the DSL's dump directory,
# which it reads once per process (default: the working directory then, i.e. the checkout; a
# test's chdir comes too late): send it to a temporary directory instead.
os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp(prefix="kda-cute-dsl-"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/") or item.get_closest_marker("gpu"):
            item.add_marker(skip)
