"""Per-stage benchmarks: every implementation of every stage on the same inputs, in one run.

The inputs are the real arguments of a real chain call: one forward+backward of `chunk_kda` at
the shape runs under `kda_chain.stages.capture()`, which records each stage call's arguments.
Each implementation whose gate accepts those arguments is then timed on them (CUDA events,
median of rounds). The reference (plain torch) is timed on the small shape only.

Every stage is compared as the chain calls it: a CuTe kernel with the flags the chain passes it
(kda_cute.registry's `flags`: intra's fold_dg, and emit_bf16 when HV == H), the others without
them; where fold_dg folded a later stage in (dg_cumsum), fla's and the reference's time includes it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import KDA_FLAGS, SHAPES, make_inputs, selected_shapes
from cuda_clock import cuda_now
from kda_chain import STAGES
from kda_cute import registry

pytestmark = pytest.mark.benchmark(timer=cuda_now)

STAGE_NAMES = list(STAGES)  # a stage a configuration does not call is skipped
_captured: dict[str, dict] = {}


def captured(shape: str) -> dict:
    """stage -> (args, kwargs) of its first call in one fwd+bwd at `shape` (cached per session)."""
    if shape not in _captured:
        from kda_chain import chunk_kda
        from kda_chain.stages import capture

        x = make_inputs(**SHAPES[shape])
        with capture() as calls:
            o, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],
                             dt_bias=x["dt_bias"], **KDA_FLAGS)
            o.backward(torch.randn_like(o))
        first: dict = {}
        for name, args, kwargs in calls:
            first.setdefault(name, (args, kwargs))
        _captured.clear()  # one shape's activations at a time
        _captured[shape] = first
    return _captured[shape]


@pytest.mark.parametrize("impl", ["cute", "fla", "reference"])
@pytest.mark.parametrize("stage", STAGE_NAMES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_stage(benchmark, request, shape, stage, impl):
    if shape not in selected_shapes(request.config):
        pytest.skip(f"shape {shape} not selected")
    if impl == "reference" and shape != "small":
        pytest.skip("the reference is timed on the small shape only")
    calls = captured(shape)
    if stage not in calls:
        pytest.skip(f"{stage} did not run in this configuration")
    args, kwargs = calls[stage]
    st = STAGES[stage]
    chosen = [i for i in st.impls if i.name == impl]
    if not chosen:
        pytest.skip(f"{stage} has no {impl} implementation")
    rec = registry.BY_NAME.get(stage)
    folds_dg = bool(kwargs.get("fold_dg"))
    if rec is not None and impl != "cute":  # the CuTe-only flags
        kwargs = {k: v for k, v in kwargs.items() if k not in rec.flags}
    reason = chosen[0].gate(*args, **kwargs)
    if reason is not None:
        pytest.skip(f"{stage}/{impl}: {reason}")
    fn = chosen[0].fn
    if folds_dg and impl != "cute":
        from kda_chain.stages import dg_cumsum

        cumsum = next(i.fn for i in dg_cumsum.impls if i.name == impl)

        def run():
            return cumsum(fn(*args, **kwargs)[3], 64)
    else:
        def run():
            return fn(*args, **kwargs)
    benchmark.group = f"stage {stage} {shape}"
    benchmark.extra_info.update(shape=shape, stage=stage, impl=impl, **SHAPES[shape])
    benchmark.pedantic(run, rounds=20, warmup_rounds=3)
