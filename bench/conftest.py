"""Benchmarks run on a GPU only (CUDA events); without one every benchmark skips.

    uv run pytest bench --benchmark-autosave                  # save a run under .benchmarks/
    uv run pytest bench --benchmark-compare --benchmark-compare-fail=median:10%
                                                              # fail on a >10% median regression
    uv run python bench/chart.py .benchmarks/<machine>/<run>.json   # table + PNG chart

Shapes: `--bench-shapes ref,small` (default both). ref = B16 T8192 H=HV=16 K128 V256 bf16 (the
shape fla's numbers in CHAIN.md are quoted at); small = B2 T4096 H=HV=16 K128 V128 bf16; ragged =
B2 T4000 (small's heads, a ragged last chunk: the rows run as packed sequences, api._ragged; not
in the default set: `--bench-shapes ragged`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

SHAPES = {
    "ref": dict(B=16, T=8192, H=16, HV=16, K=128, V=256),
    "small": dict(B=2, T=4096, H=16, HV=16, K=128, V=128),
    "ragged": dict(B=2, T=4000, H=16, HV=16, K=128, V=128),
}


def pytest_addoption(parser):
    parser.addoption("--bench-shapes", default="ref,small", help="comma list of: " + ",".join(SHAPES))


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="benchmarks need a CUDA device")
        for item in items:
            item.add_marker(skip)


def selected_shapes(config) -> list[str]:
    return [s for s in config.getoption("--bench-shapes").split(",") if s]


def make_inputs(B, T, H, HV, K, V, dtype=torch.bfloat16, seed=0, requires_grad=True):
    """Random training-like inputs: the raw gate goes through the in-kernel gate (A_log, dt_bias)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape, dt=dtype):
        return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dt)

    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K),
             beta=r(B, T, HV).sigmoid().to(dtype))
    for t in x.values():
        t.requires_grad_(requires_grad)
    x["A_log"] = torch.log(torch.empty(HV, device="cuda").uniform_(1, 16, generator=gen))
    x["dt_bias"] = r(HV * K, dt=torch.float32) * 0.1
    return x


KDA_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
