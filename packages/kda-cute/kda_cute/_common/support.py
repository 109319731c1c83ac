"""Can a CuTe stage run this call, and if not, exactly why?

Every stage's `is_supported(...)` returns None (yes) or a reason string (no). The reason is the
important half: a silent fallback reads as a correct 1.00x result, and the question a user asks
first is "did the kernels actually run?". The chain records the reason in the profiler range it
opens for the stage, which is where the witness reads it back.

Probes that import the DSL or touch the driver are cached (the DSL import costs seconds).
No stage logic lives here.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from functools import cache

import torch

log = logging.getLogger("kda_cute")

_logged: set[str] = set()


def log_once(message: str, level: int = logging.INFO, logger: logging.Logger = log) -> None:
    """Log `message` the first time this process sees it (a fallback, once per distinct reason)."""
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


@cache
def has_cute() -> bool:
    """Is the CuTe DSL importable (with its CUDA bindings)?"""
    try:
        import cuda.bindings.driver  # noqa: F401
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as e:  # environment-dependent
        log_once(f"kda_cute: CuTe DSL not importable: {type(e).__name__}: {e}", logging.WARNING)
        return False
    return True


@cache
def _device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@cache
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# The device a meta tensor stands for while `probing(device)` is active: `is_supported` asks the
# stages' gates on meta tensors (shapes without memory) for a call that would run on `device`.
_probe_device: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar(
    "probe_device", default=None)


@contextlib.contextmanager
def probing(device: torch.device):
    """Within the block, meta tensors answer `device_reason` / `sm_count_of` as if on `device`."""
    token = _probe_device.set(torch.device(device))
    try:
        yield
    finally:
        _probe_device.reset(token)


def device_of(t: torch.Tensor) -> torch.device:
    """`t`'s device, or the probed device for a meta tensor inside `probing`."""
    if t.device.type == "meta":
        probed = _probe_device.get()
        if probed is not None:
            return probed
    return t.device


def _index(dev: torch.device) -> int:
    return dev.index if dev.index is not None else torch.cuda.current_device()


def sm_count_of(t: torch.Tensor) -> int:
    """The SM count of the CUDA device `t` lives on (or stands for, see `probing`)."""
    return sm_count(_index(device_of(t)))


def device_reason(t: torch.Tensor) -> str | None:
    """Reason a CuTe sm_90 kernel cannot run on `t`'s device, or None."""
    dev = device_of(t)
    if dev.type != "cuda":
        return "no CUDA device" if not torch.cuda.is_available() else "tensors are not on CUDA"
    cap = _device_capability(_index(dev))
    if cap != (9, 0):
        return f"kernels are built for sm_90 (Hopper); this device is sm_{cap[0]}{cap[1]}"
    if not has_cute():
        return "CuTe DSL (nvidia-cutlass-dsl) not importable"
    return None


def compile_arch() -> str:
    """The arch the DSL compiles for. Without a GPU the DSL defaults to sm_100; CI sets sm_90a."""
    return os.environ.get("CUTE_DSL_ARCH", "sm_90a")
