"""pytest plugin (entry point `pytest11`, loaded automatically once kda-witness is installed).

- fixture `witness`: `witness(fn, *args, **kw)` profiles one call and returns `Results`;
  `witness.expect(results, kernels)` and `witness.record()` are the package's own.
- marker `@pytest.mark.witness(kernels=[...])` (default: the kernels the op registered, see
  `register_kernels`; kda_chain registers its CuTe kernels at import): the whole test
  call is profiled and the test fails unless every named kernel launched inside it, with
  `expect`'s message (which stages fell back, and why). Without a CUDA device the test is
  skipped: on CPU no kernel can launch, so the marker could only fail.

torch.profiler does not nest: a marked test cannot also call `witness(...)` (or any profiler)
inside; use one or the other.
"""

from __future__ import annotations

import pytest
import torch

from . import capture
from .expect import expect


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def _marked_kernels(item) -> tuple[str, ...] | None:
    """The marker's kernels; () for a bare marker (then `expect` takes the registered ones)."""
    marker = item.get_closest_marker("witness")
    if marker is None:
        return None
    kernels = marker.kwargs.get("kernels", marker.args[0] if marker.args else ())
    return (kernels,) if isinstance(kernels, str) else tuple(kernels)


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "witness(kernels): the test must launch these kernels (kda_witness plugin)"
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    if _marked_kernels(item) is not None and not _has_cuda():
        pytest.skip("kda_witness: no CUDA device, so no kernel can launch")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    kernels = _marked_kernels(item)
    if kernels is None:
        return (yield)
    with capture.record() as rec:
        result = yield
    expect(rec.results, kernels or None)
    return result


class Witness:
    """What the `witness` fixture hands a test."""

    def __call__(self, fn, *args, **kwargs):
        return capture.profile(fn, *args, **kwargs)

    expect = staticmethod(expect)
    record = staticmethod(capture.record)


@pytest.fixture
def witness() -> Witness:
    """Profile a callable: `res = witness(fn, *args)`; then `witness.expect(res, kernels)`."""
    return Witness()
