"""Whole-chain benchmarks: ours vs fla 0.6.0 (and attn-gym's fused KDA where it can run), fwd and
fwd+bwd, on the same inputs in the same run. Each round is timed with CUDA events (cuda_clock);
pytest-benchmark reports the median over rounds after warm-up rounds.

Peers at their own shapes (PEER_SHAPES: K == V == 128, HV == H), each skipped when not importable:
- attn-gym 0.0.17 (`pip install attn-gym`, the bench extra): a pre-computed per-token gate;
- cuDNN-frontend 1.32.0's Hopper KDA (`cudnn.linear_attention`; on the device machine
  bench/gpu_suite.sh installs the kit's `.dev-p` wheels, ../shared/device/README.md): packed
  [B*T, H, 128] with int32 cu_seqlens, l2-normalized q / k, the fp32 natural-log gate and fp32
  beta after the sigmoid. Both peers' inputs are prepared once, outside the timing.
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
@pytest.mark.parametrize("impl", ["fla", "ours", "attn_gym", "cudnn"])
@pytest.mark.parametrize("shape", list(PEER_SHAPES))
def test_chain_vs_peer(benchmark, shape, impl, mode):
    s = PEER_SHAPES[shape]
    x = make_inputs(**s)
    x["do"] = torch.randn_like(x["v"])
    benchmark.extra_info.update(shape=shape, impl=impl, mode=mode, **s)
    benchmark.group = f"chain {mode} {shape}"
    if impl in ("fla", "ours"):
        fn = _step(_impl(impl), x, mode == "fwd_bwd")
    elif impl == "cudnn":
        fn = _cudnn_step(x, s, mode == "fwd_bwd")
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


def _cudnn_kda():
    """cuDNN-frontend's KDA, its NVRTC pointed at the CUDA 13 headers the device kit carries."""
    pytest.importorskip("cudnn.linear_attention.ops", reason="cuDNN-frontend 1.32 peer not installed")
    import os
    from pathlib import Path

    from cudnn.linear_attention.cake import compiler
    from cudnn.linear_attention.ops import kimi_delta_attention

    inc = Path(os.environ.get("KDA_PEER_INCLUDE", "/tmp/kda-peer/nvidia/cu13/include"))
    compiler.cuda_include_dirs = lambda: (inc, inc / "cccl")
    return kimi_delta_attention


def _cudnn_step(x, s, backward: bool):
    kda = _cudnn_kda()
    from fla.ops.kda.gate import fused_kda_gate

    B, T, H, K = x["q"].shape
    with torch.no_grad():  # its rules: normalized q / k, fp32 natural-log gate, fp32 beta
        gate = fused_kda_gate(x["g"], x["A_log"], dt_bias=x["dt_bias"]).float()
        qn = torch.nn.functional.normalize(x["q"].float(), dim=-1).to(x["q"].dtype)
        kn = torch.nn.functional.normalize(x["k"].float(), dim=-1).to(x["q"].dtype)
    leaves = [t.detach().reshape(B * T, H, -1).requires_grad_(True) for t in (qn, kn, x["v"], gate)]
    beta = x["beta"].detach().float().reshape(B * T, H).requires_grad_(True)
    cu = torch.arange(0, (B + 1) * T, T, device="cuda", dtype=torch.int32)
    do = x["do"].reshape(B * T, H, -1)

    def run():
        for t in (*leaves, beta):
            t.grad = None
        o, _ = kda(*leaves, beta, cu)
        if backward:
            o.backward(do)
    return run
