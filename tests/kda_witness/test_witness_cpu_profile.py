"""A live CPU profile: stage ranges opened around torch ops attribute by their CPU time."""

import pytest
import torch
from kda_witness import WitnessError, expect, profile, profiled, record, stage_range


def _fake_chain(x):
    with stage_range("gate", "reference", "fla: no CUDA device"):
        g = torch.nn.functional.logsigmoid(x)
    with stage_range("intra", "reference", "cute: no CUDA device"):
        y = g @ g.T
        with stage_range("dg_cumsum", "reference"):
            y = y.cumsum(0)
    with stage_range("intra", "reference", "cute: no CUDA device"):
        y = y @ g
    return y.sum()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only report")
def test_cpu_profile_rows():
    x = torch.randn(128, 128)
    res = profile(_fake_chain, x)
    assert torch.equal(res.value, _fake_chain(x))
    rows = res.rows()
    assert [(r["stage"], r["impl"], r["calls"], r["reason"]) for r in rows] == [
        ("gate", "reference", 1, "fla: no CUDA device"),
        ("intra", "reference", 2, "cute: no CUDA device"),
        ("dg_cumsum", "reference", 1, None),
    ]
    assert not res.has_kernels and res.time_source == "cpu"
    assert all(r["ms"] > 0 and r["kernels"] == "" for r in rows)
    intra, cumsum = res.stages[1], res.stages[2]
    assert intra.cpu_ms > cumsum.cpu_ms  # nested: intra's time includes dg_cumsum's
    assert res.total_ms == pytest.approx(res.stages[0].cpu_ms + intra.cpu_ms, rel=1e-6)
    assert "NO CUDA kernels were recorded" in res.table()
    with pytest.raises(WitnessError) as e:
        expect(res, ["kda_cute_intra"])
    assert "intra -> reference: cute: no CUDA device (2 calls)" in str(e.value)
    assert "no CUDA kernels were recorded" in str(e.value)


def test_decorator_record_and_backward():
    @profiled
    def step(x):
        return _fake_chain(x)

    res = step(torch.randn(32, 32))
    assert isinstance(res.value, torch.Tensor) and len(res.stages) == 3

    class Fn(torch.autograd.Function):  # ranges in backward (the chain's autograd.Function)
        @staticmethod
        def forward(ctx, x):
            with stage_range("fwd", "reference"):
                return x * 2

        @staticmethod
        def backward(ctx, dy):
            with stage_range("dhu", "reference", "cute: no CUDA device"):
                return dy * 2

    x = torch.randn(64, requires_grad=True)
    with record() as rec:
        Fn.apply(x).sum().backward()
    got = [(r.stage, r.reason) for r in rec.results.stages]
    assert got == [("fwd", None), ("dhu", "cute: no CUDA device")]


def test_no_ranges_says_so():
    res = profile(torch.randn, 8)
    assert res.stages == [] and "no kda:: ranges" in res.table()
    with pytest.raises(WitnessError, match="no kda:: ranges at all"):
        expect(res)
