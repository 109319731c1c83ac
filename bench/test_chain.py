"""Whole-chain benchmarks: ours vs fla 0.6.0 (and attn-gym's fused KDA where it can run), fwd and
fwd+bwd, on the same inputs in the same run. Each round is timed with CUDA events (cuda_clock);
pytest-benchmark reports the median over rounds after warm-up rounds.

Peers at their own shapes (PEER_SHAPES: K == V == 128, HV == H), each skipped when not importable:
- attn-gym 0.0.17 (`pip install attn-gym`, the bench extra): a pre-computed per-token gate;
- cuDNN-frontend 1.32.0's Hopper KDA (`cudnn.linear_attention`; on the device machine
  bench/gpu_suite.sh installs the kit's `.dev-p` wheels, ../shared/device/README.md): packed
  [B*T, H, 128] with int32 cu_seqlens, l2-normalized q / k, the fp32 natural-log gate and fp32
  beta after the sigmoid.
At the peer shapes fla and ours take the same prepared inputs (no l2norm / gate / sigmoid in the
op), prepared once outside the timing, so the four rows compare the same work.
"""

from __future__ import annotations

import peers
import pytest
import torch
from conftest import KDA_FLAGS, SHAPES, make_inputs, selected_shapes
from cuda_clock import cuda_now

PEER_SHAPES = {
    "peer_big": dict(B=16, T=8192, H=16, HV=16, K=128, V=128),
    "peer_small": dict(B=1, T=4096, H=16, HV=16, K=128, V=128),
    "peer_b2": dict(B=2, T=4096, H=16, HV=16, K=128, V=128),
    "peer_b4": dict(B=4, T=4096, H=16, HV=16, K=128, V=128),
    "peer_long": dict(B=1, T=65536, H=16, HV=16, K=128, V=128),
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


def _peer_inputs(x):
    """The inputs every peer takes, prepared once outside the timing: q / k l2-normalized (their
    dtype), the activated per-token natural-log gate (fp32) and beta (fp32), as leaves."""
    from fla.ops.kda.gate import fused_kda_gate

    with torch.no_grad():
        gate = fused_kda_gate(x["g"], x["A_log"], dt_bias=x["dt_bias"]).float()
        qn = torch.nn.functional.normalize(x["q"].float(), dim=-1).to(x["q"].dtype)
        kn = torch.nn.functional.normalize(x["k"].float(), dim=-1).to(x["q"].dtype)
    return [t.detach().requires_grad_(True) for t in (qn, kn, x["v"], gate, x["beta"].float())]


def _leaves_step(fn, leaves, do, backward: bool, **flags):
    def run():
        for t in leaves:
            t.grad = None
        o, _ = fn(*leaves, **flags)
        if backward:
            o.backward(do)
    return run


@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("impl", ["fla", "ours", "attn_gym", "cudnn"])
@pytest.mark.parametrize("shape", list(PEER_SHAPES))
def test_chain_vs_peer(benchmark, shape, impl, mode):
    """Every impl on the peers' inputs (_peer_inputs): no l2norm, gate or sigmoid in the op."""
    s = PEER_SHAPES[shape]
    x = make_inputs(**s)
    do = torch.randn_like(x["v"])
    benchmark.extra_info.update(shape=shape, impl=impl, mode=mode, **s)
    benchmark.group = f"chain {mode} {shape}"
    leaves = _peer_inputs(x)
    bwd = mode == "fwd_bwd"
    if impl in ("fla", "ours"):
        fn = _leaves_step(_impl(impl), leaves, do, bwd)
    elif impl == "cudnn":
        fn = _cudnn_step(leaves, do, bwd)
    else:
        ag = pytest.importorskip("attn_gym.linear", reason="attn-gym not installed (bench extra)")
        q, k, v, gate, beta = leaves
        ag_leaves = [q, k, v, gate.to(q.dtype).detach().requires_grad_(True), beta.to(q.dtype).detach()
                     .requires_grad_(True)]
        fn = _leaves_step(ag.chunk_kda, ag_leaves, do, bwd)
    benchmark.pedantic(fn, rounds=10, warmup_rounds=2)


def _cudnn_kda():
    kda = peers.cudnn_kda()
    if kda is None:
        pytest.skip("cuDNN-frontend 1.32 peer not installed")
    return kda


def _cudnn_step(leaves, do, backward: bool):
    """cuDNN's packed layout: [B*T, H, D] views of the same leaves, int32 cu_seqlens."""
    kda = _cudnn_kda()
    q, k, v, gate, beta = leaves
    B, T, H, K = q.shape
    packed = [t.detach().reshape(B * T, H, -1).requires_grad_(True) for t in (q, k, v, gate)]
    pbeta = beta.detach().reshape(B * T, H).requires_grad_(True)
    cu = torch.arange(0, (B + 1) * T, T, device="cuda", dtype=torch.int32)
    pdo = do.reshape(B * T, H, -1)

    def run():
        for t in (*packed, pbeta):
            t.grad = None
        o, _ = kda(*packed, pbeta, cu)
        if backward:
            o.backward(pdo)
    return run
