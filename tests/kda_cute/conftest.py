"""Fixtures the kernel compile tests share: the sm_90a target for a CPU compile, and the PTX of a
compiled kernel (the test skips on a DSL build that keeps none)."""

import pytest


@pytest.fixture
def sm90a(monkeypatch):
    """Compile for sm_90a (without a GPU the DSL's default target is sm_100)."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")


@pytest.fixture
def ptx():
    """ptx(compiled) -> the kernel's PTX text, or a skip."""
    from ptxsim.kda import ptx_text

    def get(compiled):
        text = ptx_text(compiled)
        if not text:
            pytest.skip("this DSL build keeps no PTX on the compiled object")
        return text

    return get
