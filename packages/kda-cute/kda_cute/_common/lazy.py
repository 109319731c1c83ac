"""A module imported on first attribute access (the CuTe DSL takes seconds to import and is absent
on some CPU installs; importing a stage for its `is_supported` must not require it)."""

from __future__ import annotations

import importlib


class LazyModule:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        return getattr(importlib.import_module(self._name), attr)
