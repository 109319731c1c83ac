"""Which kernels ran inside which `kda::` range: attribution on Chrome-trace events.

Everything here works on the events of a torch.profiler Chrome trace (dicts with name, ph, ts,
dur, cat, pid, tid, args; ts and dur in microseconds), so the logic is the same for a live
profile (`capture.profile` exports its trace and reads it back) and for a saved or hand-written
trace, and it is testable without a GPU.

Attribution of one kernel (cat "kernel"): the first rule with evidence for it decides.
1. correlation: the launch call (cat "cuda_runtime"/"cuda_driver", e.g. cudaLaunchKernel or
   cuLaunchKernelEx) with the same `args.correlation` ran on some CPU thread; the kernel belongs
   to the innermost `kda::` range (cat "user_annotation") on that thread containing the launch.
   Exact even though kernels run later than they are launched, and for the autograd thread.
2. external id: kineto tags a kernel with the `args["External id"]` of the CPU op (or range) that
   was open when it was launched; the kernel belongs to the innermost range containing that op's
   start on its thread. For traces that lost the launch event.
3. GPU range: kineto also projects each annotation onto the device timeline (cat
   "gpu_user_annotation", spanning the range's kernels); the kernel belongs to the innermost one
   on its device containing it in time. For traces without launch events.
4. otherwise the kernel is outside every kda range (stage None).

Stage rows come from the ranges themselves (the CPU ones; the GPU projections only where a trace
has no CPU range of that name), so a stage that launched nothing, or a CPU-only profile, still
shows its impl and reason. Row time is the sum of its kernels' device time when the trace has
kernels, else the CPU duration of its ranges.
"""

from __future__ import annotations

import bisect
import json
import os
from collections import defaultdict
from dataclasses import dataclass

from .ranges import expected_kernels, parse_stage_range

KERNEL_CAT = "kernel"
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
CPU_RANGE_CAT = "user_annotation"
HOST_OP_CATS = ("cpu_op", "user_annotation")
GPU_RANGE_CAT = "gpu_user_annotation"
_EPS_US = 1e-3  # float rounding of exported timestamps


@dataclass(frozen=True)
class Range:
    """One occurrence of a `kda::` range on a CPU thread or a device."""

    name: str
    stage: str
    impl: str
    reason: str | None
    ts: float
    dur: float
    pid: object
    tid: object
    on_gpu: bool

    @property
    def key(self) -> tuple[str, str, str | None]:
        return self.stage, self.impl, self.reason

    def contains(self, t: float) -> bool:
        return self.ts - _EPS_US <= t <= self.ts + self.dur + _EPS_US


@dataclass(frozen=True)
class Launch:
    """One kernel execution and the range it was attributed to (None: outside every range)."""

    name: str
    ts: float
    dur: float
    range: Range | None


@dataclass(frozen=True)
class StageRow:
    """All calls of one stage with one (impl, reason): what the chain chose and what it cost."""

    stage: str
    impl: str
    reason: str | None
    calls: int
    kernels: tuple[tuple[str, int, float], ...]  # (full kernel name, launches, device ms)
    device_ms: float
    cpu_ms: float

    @property
    def fell_back(self) -> bool:
        return self.reason is not None

    @property
    def launches(self) -> int:
        return sum(n for _, n, _ in self.kernels)


@dataclass(frozen=True)
class KernelRow:
    """One kernel name within one range key (stage None: launched outside every kda range)."""

    name: str
    stage: str | None
    impl: str | None
    reason: str | None
    count: int
    device_ms: float


def load_events(source) -> tuple[dict, list[dict]]:
    """(trace dict, its events) from a path, a trace dict, or a bare list of events."""
    if isinstance(source, (str, os.PathLike)):
        with open(source) as f:
            source = json.load(f)
    if isinstance(source, list):
        source = {"traceEvents": source}
    return source, list(source.get("traceEvents", []))


def _complete(events: list[dict], cats) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in cats and "dur" in e]


def _ranges(events: list[dict], cat: str) -> list[Range]:
    out = []
    for e in _complete(events, (cat,)):
        parsed = parse_stage_range(str(e.get("name", "")))
        if parsed is not None:
            out.append(
                Range(e["name"], *parsed, float(e["ts"]), float(e["dur"]), e.get("pid"), e.get("tid"),
                      cat == GPU_RANGE_CAT)
            )
    return out


class _Innermost:
    """Innermost range containing a time, per timeline (a CPU thread, or a device)."""

    def __init__(self, ranges: list[Range], timeline):
        self._by = defaultdict(list)
        for r in sorted(ranges, key=lambda r: (r.ts, -r.dur)):
            self._by[timeline(r)].append(r)
        self._starts = {k: [r.ts for r in v] for k, v in self._by.items()}

    def find(self, line, t: float) -> Range | None:
        rs = self._by.get(line)
        if not rs:
            return None
        # Ranges on one timeline nest, so the latest-starting one containing t is the innermost.
        i = bisect.bisect_right(self._starts[line], t + _EPS_US)
        for r in reversed(rs[:i]):
            if r.contains(t):
                return r
        return None


def attribute(events: list[dict]) -> tuple[list[Range], list[Launch]]:
    """The kda ranges (CPU first, then GPU projections) and every kernel with its range."""
    cpu = _ranges(events, CPU_RANGE_CAT)
    gpu = _ranges(events, GPU_RANGE_CAT)
    by_thread = _Innermost(cpu, lambda r: (r.pid, r.tid))
    by_device = _Innermost(gpu, lambda r: r.pid)
    launch_at = {}
    for e in _complete(events, LAUNCH_CATS):
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            launch_at[corr] = ((e.get("pid"), e.get("tid")), float(e["ts"]))
    op_at = {}
    for e in _complete(events, HOST_OP_CATS):
        ext = (e.get("args") or {}).get("External id")
        if ext is not None:
            op_at.setdefault(ext, ((e.get("pid"), e.get("tid")), float(e["ts"])))
    launches = []
    for e in _complete(events, (KERNEL_CAT,)):
        ts, dur = float(e["ts"]), float(e["dur"])
        args = e.get("args") or {}
        # The first rule with evidence decides, even when it says "outside every range".
        if args.get("correlation") in launch_at:
            where = by_thread.find(*launch_at[args["correlation"]])
        elif args.get("External id") in op_at:
            where = by_thread.find(*op_at[args["External id"]])
        else:
            where = by_device.find(e.get("pid"), ts)
        launches.append(Launch(str(e.get("name", "")), ts, dur, where))
    return cpu + gpu, launches


def short_kernel_name(name: str, width: int = 48) -> str:
    """The registered kernel's own name if it is one (`register_kernels`), else the name cut to `width`."""
    for kernel in expected_kernels():
        if kernel in name:
            return kernel
    return name if len(name) <= width else name[: width - 3] + "..."


def summarize(ranges: list[Range], launches: list[Launch]) -> tuple[list[StageRow], list[KernelRow]]:
    """Stage rows in order of first appearance, and kernel rows (per name and range key)."""
    cpu_keys = {r.key for r in ranges if not r.on_gpu}
    calls: dict[tuple, int] = defaultdict(int)
    cpu_us: dict[tuple, float] = defaultdict(float)
    first: dict[tuple, float] = {}
    for r in ranges:
        if r.on_gpu and r.key in cpu_keys:
            continue
        calls[r.key] += 1
        if not r.on_gpu:
            cpu_us[r.key] += r.dur
        first[r.key] = min(first.get(r.key, r.ts), r.ts)

    per_kernel: dict[tuple, list] = {}
    for ln in launches:
        rkey = ln.range.key if ln.range is not None else (None, None, None)
        if ln.range is not None and rkey not in first:
            calls[rkey] += 1
            first[rkey] = ln.range.ts
        acc = per_kernel.setdefault((rkey, ln.name), [0, 0.0, ln.ts])
        acc[0] += 1
        acc[1] += ln.dur

    kernels_of: dict[tuple, list] = defaultdict(list)
    kernel_rows = []
    for (rkey, name), (n, us, _) in sorted(per_kernel.items(), key=lambda kv: kv[1][2]):
        kernels_of[rkey].append((name, n, us / 1e3))
        kernel_rows.append(KernelRow(name, *rkey, n, us / 1e3))

    stage_rows = [
        StageRow(*key, calls[key], tuple(kernels_of[key]), sum((ms for _, _, ms in kernels_of[key]), 0.0),
                 cpu_us[key] / 1e3)
        for key in sorted(first, key=first.get)
    ]
    return stage_rows, kernel_rows


def outermost_cpu_ms(ranges: list[Range]) -> float:
    """CPU time inside kda ranges, nested ranges counted once."""
    total = 0.0
    by_thread = defaultdict(list)
    for r in ranges:
        if not r.on_gpu:
            by_thread[(r.pid, r.tid)].append(r)
    for rs in by_thread.values():
        end = float("-inf")
        for r in sorted(rs, key=lambda r: (r.ts, -r.dur)):
            if r.ts >= end - _EPS_US:
                total += r.dur
                end = r.ts + r.dur
    return total / 1e3


__all__ = [
    "KernelRow",
    "Launch",
    "Range",
    "StageRow",
    "attribute",
    "load_events",
    "outermost_cpu_ms",
    "short_kernel_name",
    "summarize",
]
