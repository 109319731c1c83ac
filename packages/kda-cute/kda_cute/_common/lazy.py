"""The CuTe DSL on first use: it takes seconds to import and is absent on some CPU installs, and
importing a stage for its `is_supported` must not require it."""

from __future__ import annotations

import importlib


class LazyModule:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):  # once per attribute: then it is an instance attribute (no import call)
        value = getattr(importlib.import_module(self._name), attr)
        setattr(self, attr, value)
        return value


def cutlass_dtype(name: str):
    """The cutlass numeric type of a config's dtype name ("bf16", "fp16", "fp32")."""
    import cutlass

    return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}[name]
