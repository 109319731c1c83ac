"""Whole-chain benchmarks: ours vs fla 0.6.0 (and attn-gym's fused KDA where it can run), fwd and
fwd+bwd, on the same inputs in the same run. Each round is timed with CUDA events (cuda_clock);
pytest-benchmark reports the median over rounds after warm-up rounds.

attn-gym 0.0.17 (`pip install attn-gym`, the bench extra) needs K == V == 128, HV == H and a
pre-computed per-token gate; it runs at its own two shapes (PEER_SHAPES) and skips elsewhere or
when it is not importable.
"""

from __future__ import annotations

import pytest
import torch
from conftest import KDA_FLAGS, SHAPES, make_inputs, selected_shapes
from cuda_clock import cuda_now

PEER_SHAPES = {
    "peer_big": dict(B=16, T=8192, H=16, HV=16, K=128, V=128),
    "peer_small": dict(B=1, T=4096, H=16, HV=16, K=128, V=128),
}
pytestmark = pytest.mark.benchmark(timer=cuda_now)


def _impl(name):
    if name == "ours":
        from kda_chain import chunk_kda
    else:
        from fla.ops.kda import chunk_kda
    return chunk_kda


def _step(fn, x, backward: bool):
    def run():
        for t in (x["q"], x["k"], x["v"], x["g"], x["beta"]):
            t.grad = None
        o, _ = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                  **KDA_FLAGS)
        if backward:
            o.backward(x["do"])
    return run


@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("impl", ["fla", "ours"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_chain(benchmark, request, shape, impl, mode):
    if shape not in selected_shapes(request.config):
        pytest.skip(f"shape {shape} not selected")
    x = make_inputs(**SHAPES[shape])
    x["do"] = torch.randn_like(x["v"])
    benchmark.extra_info.update(shape=shape, impl=impl, mode=mode, **SHAPES[shape])
    benchmark.group = f"chain {mode} {shape}"
    benchmark.pedantic(_step(_impl(impl), x, mode == "fwd_bwd"), rounds=10, warmup_rounds=2)


@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("impl", ["fla", "ours", "attn_gym"])
@pytest.mark.parametrize("shape", list(PEER_SHAPES))
def test_chain_vs_peer(benchmark, shape, impl, mode):
    s = PEER_SHAPES[shape]
    x = make_inputs(**s)
    x["do"] = torch.randn_like(x["v"])
    benchmark.extra_info.update(shape=shape, impl=impl, mode=mode, **s)
    benchmark.group = f"chain {mode} {shape}"
    if impl != "attn_gym":
        fn = _step(_impl(impl), x, mode == "fwd_bwd")
    else:
        ag = pytest.importorskip("attn_gym.linear", reason="attn-gym not installed (bench extra)")
        from fla.ops.kda.gate import fused_kda_gate

        # attn-gym takes the activated per-token gate: compute it once, outside the timing
        # (its gate is not part of what it fuses), and l2-normalized q, k likewise.
        with torch.no_grad():
            gate = fused_kda_gate(x["g"], x["A_log"], dt_bias=x["dt_bias"]).to(x["q"].dtype)
            qn = torch.nn.functional.normalize(x["q"].float(), dim=-1).to(x["q"].dtype)
            kn = torch.nn.functional.normalize(x["k"].float(), dim=-1).to(x["q"].dtype)
        leaves = [t.detach().requires_grad_(True) for t in (qn, kn, x["v"], gate, x["beta"])]

        def fn():
            for t in leaves:
                t.grad = None
            o, _ = ag.chunk_kda(*leaves)
            if mode == "fwd_bwd":
                o.backward(x["do"])
    benchmark.pedantic(fn, rounds=10, warmup_rounds=2)
