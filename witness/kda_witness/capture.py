"""Run code under torch.profiler and turn the trace into `Results`.

    res = profile(fn, *args, **kwargs)         # fn's return value is res.value
    @profiled
    def step(...): ...                         # step(...) now returns Results
    with record() as rec: ...                  # rec.results after the block

CPU activity always, CUDA activity when a CUDA device is available; the device is synchronized
before the profiler stops so every launched kernel is in the trace. The trace goes through an
exported Chrome trace (read back by `kda_witness.trace`), so a live profile and a saved trace are
attributed by the same code.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Iterator

import torch
from torch.profiler import ProfilerActivity
from torch.profiler import profile as _torch_profile

from .results import Results


def activities() -> list[ProfilerActivity]:
    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    return acts


class Recording:
    """Filled in when the `record()` block exits."""

    results: Results | None = None


@contextlib.contextmanager
def record() -> Iterator[Recording]:
    rec = Recording()
    with _torch_profile(activities=activities()) as prof:
        try:
            yield rec
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        rec.results = Results.from_chrome_trace(path)


def profile(fn, *args, **kwargs) -> Results:
    """Call fn(*args, **kwargs) under the profiler; its return value is `.value`."""
    with record() as rec:
        value = fn(*args, **kwargs)
    rec.results.value = value
    return rec.results


def profiled(fn):
    """Decorator: calling the function profiles it and returns `Results` (its value in `.value`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> Results:
        return profile(fn, *args, **kwargs)

    return wrapper
