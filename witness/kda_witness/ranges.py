"""The dispatch record's one format: profiler ranges named `kda::<stage>::<impl>[::<reason>]`.

The chain opens one such range around every stage call (`stage_range`), and the witness reads
them back from a trace (`parse_stage_range`). Both sides import this module, so the format lives
in exactly one place. `annotate` is the general tool underneath: a `torch.profiler`
record_function that works as a context manager and as a decorator, and is re-entrant (a fresh
record_function per entry, so a decorated function may recurse or run on several threads).

Names: stage and impl are identifiers without "::"; the reason is free text (the first
implementation's `is_supported` message, e.g. "cute: T % 64 != 0") and may itself contain "::",
so the parser splits at most three times. Line breaks in a reason become spaces: a trace viewer
shows one line.
"""

from __future__ import annotations

import contextlib
import threading

from torch._C._autograd import _profiler_enabled
from torch.profiler import record_function

PREFIX = "kda"
SEP = "::"


class annotate(contextlib.ContextDecorator):
    """Mark a region as a profiler range named `name` (a `user_annotation` event in the trace).

        with annotate("kda::intra::cute"): ...

        @annotate("my_step")
        def step(...): ...
    """

    def __init__(self, name: str):
        self.name = name
        self._open = threading.local()

    def _recreate_cm(self):
        # ContextDecorator reuses self for every decorated call; give each call its own range.
        return annotate(self.name)

    def __enter__(self):
        stack = self._open.__dict__.setdefault("stack", [])
        # No profiler, no range: a record_function costs ~15 us even then (measured on CPU,
        # torch 2.13), a dozen per chain step. The check reads the calling thread's profiler
        # state, which autograd hands to its device threads, so the backward's ranges still
        # reach a trace (tests/gpu/test_witness_gpu.py proves it on the GPU).
        rf = record_function(self.name) if _profiler_enabled() else None
        if rf is not None:
            rf.__enter__()
        stack.append(rf)
        return self

    def __exit__(self, *exc):
        rf = self._open.stack.pop()
        if rf is not None:
            rf.__exit__(*exc)
        return False


def range_name(stage: str, impl: str, reason: str | None = None) -> str:
    """`kda::<stage>::<impl>` or `kda::<stage>::<impl>::<reason>`."""
    for what, part in (("stage", stage), ("impl", impl)):
        if not part or SEP in part:
            raise ValueError(f"kda range {what} must be non-empty and contain no '::': {part!r}")
    name = f"{PREFIX}{SEP}{stage}{SEP}{impl}"
    if reason:
        name += SEP + " ".join(str(reason).split())
    return name


def stage_range(stage: str, impl: str, reason: str | None = None) -> annotate:
    """The range the chain opens around one stage call (see ARCHITECTURE.md, Dispatch record)."""
    return annotate(range_name(stage, impl, reason))


def parse_stage_range(name: str) -> tuple[str, str, str | None] | None:
    """(stage, impl, reason) from a range name, reason None when absent; None if not a kda range."""
    parts = name.split(SEP, 3)
    if len(parts) < 3 or parts[0] != PREFIX or not parts[1] or not parts[2]:
        return None
    return parts[1], parts[2], (parts[3] or None) if len(parts) == 4 else None


# The kernels a chain call is expected to launch, kernel name -> the stage it implements, as the
# op registers them (kda_chain does at import, from kda_cute.registry): the witness knows names
# only. A trace shows the DSL-decorated name (`kernel_cutlass_kda_cute_intra_...`), so these
# match as substrings; none may be a substring of another.
_expected: dict[str, str] = {}


def register_kernels(kernels: dict[str, str]) -> None:
    """Set the expected kernels (name -> stage): `expect`'s default, the short names in tables."""
    names = list(kernels)
    for a in names:
        for b in names:
            if a != b and a in b:
                raise ValueError(f"kernel name {a!r} is a substring of {b!r}: a trace could not tell them "
                                 "apart")
    _expected.clear()
    _expected.update(kernels)


def expected_kernels() -> dict[str, str]:
    """The registered kernels (name -> stage); empty until an op registers them."""
    return dict(_expected)
