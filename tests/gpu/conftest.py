"""GPU tests: each test's device memory is given back before the next one starts.

A failing test's traceback (pytest keeps it as sys.last_traceback for post-mortem debugging)
holds the failing frame and every tensor in it. After one float64 reference ran out of memory,
that kept ~70 GiB alive and every later test failed with OutOfMemoryError too, hiding what they
would have shown. So after each test: drop the traceback, collect, and empty the caching allocator.
"""

import gc
import sys

import pytest
import torch


@pytest.fixture(autouse=True)
def _give_back_gpu_memory():
    yield
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
