"""A pytest-benchmark timer that reads CUDA events instead of the host clock.

pytest-benchmark times a round as timer() after minus timer() before. `cuda_now` records an event,
waits for it, and returns the device time elapsed since the first event, accumulated pair by pair
in float64 (one event's elapsed_time against a fixed origin loses precision after minutes: it is
a float32 in ms). A round's time is therefore device time from "GPU idle, start" to "all of the
round's work done": kernels plus the launch gaps between them, which a user pays too.
"""

from __future__ import annotations

import torch

_state = {"last": None, "t": 0.0}


def cuda_now() -> float:
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    ev.synchronize()
    last = _state["last"]
    if last is not None:
        _state["t"] += last.elapsed_time(ev) / 1e3
    _state["last"] = ev
    return _state["t"]


# ~1 ms of GPU clock cycles: longer than any one call's host work (fla's launcher ~0.1 ms)
PRIME_CYCLES = 2_000_000


def median_ms(fn, *, warmup: int = 5, reps: int = 30, inner: int = 1, primed: bool = False) -> float:
    """Median device time of one fn() call, CUDA events around each sample, after warm-up.

    inner=1: a sample is one call from an idle GPU, so the call's host work before its first
    launch is counted (what a host-bound small step pays). inner=N: a sample is N calls back to
    back, divided by N; from the second call on, the host prepares while the GPU runs, as in a
    training step at large shapes, so the sample is the kernels' own time plus launch gaps.
    primed: a ~1 ms sleep kernel runs before the start event, so the host has queued the first
    call's launches before the clock starts: the sample is device time only (what a GPU-bound
    step pays; what a profiler's kernel durations add up to), on both sides of a comparison."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if primed:
            torch.cuda._sleep(PRIME_CYCLES)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    times.sort()
    return times[len(times) // 2]
