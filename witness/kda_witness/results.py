"""`Results`: what one profile proves, as stage rows, kernel rows, a text table and a trace.

Built from a Chrome trace (`Results.from_chrome_trace(path | dict | events)`) or by
`kda_witness.profile`. Rows are plain dicts (`rows()`, `kernel_rows()`). `ms` is device time (sum
of the row's kernel durations) when the trace holds CUDA kernels, else the CPU wall time of the
row's ranges; `time_source` says which, and the table says plainly when no kernels were recorded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .trace import (
    KernelRow,
    Range,
    StageRow,
    attribute,
    load_events,
    outermost_cpu_ms,
    short_kernel_name,
    summarize,
)

OUTSIDE = "(outside kda ranges)"


@dataclass
class Results:
    trace: dict
    stages: list[StageRow]
    kernels: list[KernelRow]  # every kernel name per range key; stage None = outside kda ranges
    ranges: list[Range]
    value: Any = field(default=None, repr=False)  # what the profiled callable returned

    @classmethod
    def from_chrome_trace(cls, source, value: Any = None) -> Results:
        trace, events = load_events(source)
        ranges, launches = attribute(events)
        stages, kernels = summarize(ranges, launches)
        return cls(trace, stages, kernels, ranges, value)

    # --- questions -----------------------------------------------------------------------------

    @property
    def has_kernels(self) -> bool:
        """Did the trace record any CUDA kernel at all (False on a CPU-only profile)?"""
        return bool(self.kernels)

    @property
    def time_source(self) -> str:
        return "device" if self.has_kernels else "cpu"

    def launched(self, pattern: str) -> list[KernelRow]:
        """Kernel rows whose name contains `pattern`."""
        return [k for k in self.kernels if pattern in k.name]

    def stage(self, name: str) -> list[StageRow]:
        return [r for r in self.stages if r.stage == name]

    def fallbacks(self) -> list[StageRow]:
        """Stage rows whose impl was not the stage's first choice, with the recorded reason."""
        return [r for r in self.stages if r.fell_back]

    @property
    def outside(self) -> list[KernelRow]:
        return [k for k in self.kernels if k.stage is None]

    def row_ms(self, row: StageRow) -> float:
        return row.device_ms if self.has_kernels else row.cpu_ms

    @property
    def total_ms(self) -> float:
        """Time inside kda ranges: kernel device time, or outermost CPU range time."""
        if self.has_kernels:
            return sum(k.device_ms for k in self.kernels if k.stage is not None)
        return outermost_cpu_ms(self.ranges)

    # --- output --------------------------------------------------------------------------------

    def rows(self) -> list[dict]:
        return [
            {
                "stage": r.stage,
                "impl": r.impl,
                "calls": r.calls,
                "kernels": ", ".join(f"{n}x{c}" if c > 1 else n for n, c, _ in r.kernels),
                "launches": r.launches,
                "ms": self.row_ms(r),
                "device_ms": r.device_ms,
                "cpu_ms": r.cpu_ms,
                "reason": r.reason,
                "time_source": self.time_source,
            }
            for r in self.stages
        ]

    def kernel_rows(self) -> list[dict]:
        return [
            {"kernel": k.name, "stage": k.stage, "impl": k.impl, "count": k.count,
             "device_ms": k.device_ms, "reason": k.reason}
            for k in self.kernels
        ]

    def export_chrome_trace(self, path) -> None:
        """Write the trace (open it in chrome://tracing or ui.perfetto.dev)."""
        with open(path, "w") as f:
            json.dump(self.trace, f)

    def table(self) -> str:
        def kernels_cell(kernels) -> str:
            if not kernels:
                return "-"
            return ", ".join(f"{short_kernel_name(n)}" + (f" x{c}" if c > 1 else "") for n, c, _ in kernels)

        head = ("stage", "impl", "calls", "kernels", "ms", "reason")
        body = [
            (r.stage, r.impl, str(r.calls), kernels_cell(r.kernels), f"{self.row_ms(r):.3f}", r.reason or "")
            for r in self.stages
        ]
        outside = self.outside
        if outside:
            body.append((OUTSIDE, "", "", kernels_cell([(k.name, k.count, k.device_ms) for k in outside]),
                         f"{sum(k.device_ms for k in outside):.3f}", ""))
        body.append(("total (kda ranges)", "", "", "", f"{self.total_ms:.3f}", ""))
        widths = [max(len(row[i]) for row in (head, *body)) for i in range(len(head) - 1)]

        def line(row) -> str:
            return "  ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1]

        if self.has_kernels:
            n = sum(k.count for k in self.kernels)
            title = (f"kda_witness: {n} CUDA kernel launches ({len({k.name for k in self.kernels})} "
                     f"distinct) in {sum(r.calls for r in self.stages)} stage calls; ms = device time")
        else:
            title = (f"kda_witness: NO CUDA kernels were recorded (CPU-only profile); "
                     f"{sum(r.calls for r in self.stages)} stage calls; ms = CPU wall time of each range")
        if not self.stages:
            title += "\n  (no kda:: ranges in this trace: did the code run through kda_chain?)"
        rule = "-" * len(line(head).rstrip())
        return "\n".join([title, line(head).rstrip(), rule, *(line(r).rstrip() for r in body)])

    def __str__(self) -> str:
        return self.table()
