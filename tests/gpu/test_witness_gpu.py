"""The witness on the GPU: the chain must launch the CuTe kernels, proven from a profiler trace.

The marker (kda_witness's pytest plugin) profiles the test and fails with each stage that fell
back and its reason. On the device machine, where nothing is installed, load the plugin with
`-p kda_witness.pytest_plugin` (bench/gpu_suite.sh does).
"""

import pytest
import torch
from kda_cute import registry


def _fwd_bwd(B, T, H, HV, K, V, dtype=torch.bfloat16):
    from kda_chain import chunk_kda

    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*s, dt=dtype):
        return torch.randn(s, generator=g, device="cuda").to(dt).requires_grad_(True)

    q, k, v, gate, beta = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V), r(B, T, HV, K), r(B, T, HV)
    A_log = torch.zeros(HV, device="cuda")
    o, _ = chunk_kda(q, k, v, gate, beta.sigmoid(), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                     A_log=A_log)
    o.backward(torch.randn_like(o))
    torch.cuda.synchronize()


@pytest.mark.witness(kernels=["kda_cute_bwd_chunk"])
def test_chain_launches_the_fused_backward_kernel():
    _fwd_bwd(B=2, T=1024, H=16, HV=16, K=128, V=128)


@pytest.mark.witness(kernels=list(registry.chain_kernels()))
def test_chain_launches_every_cute_kernel():
    """At 256 V tiles every stage with a CuTe kernel takes it (dhu's floor is 32 tiles)."""
    _fwd_bwd(B=4, T=2048, H=16, HV=16, K=128, V=256)


def test_fallback_carries_its_measured_reason(monkeypatch):
    """Every fallback names why: below dhu's grid floor the chain runs fla's dhu (with fla's dAv
    for its dv) and the trace says so, while the other three stages stay on their CuTe kernels.
    The floor is raised to 128 V tiles here (64 at this shape): the measured one, 32, sits below
    every shape the device kit seeds fla's autotune for."""
    from kda_chain import stages as S
    from kda_cute import dhu
    from kda_witness import profile

    monkeypatch.setattr(dhu, "GRID_FLOOR", 128)
    S.clear_gate_cache()
    try:
        res = profile(lambda: _fwd_bwd(B=2, T=1024, H=16, HV=16, K=128, V=128))
    finally:
        S.clear_gate_cache()
    rows = res.stage("dhu")
    assert rows and all(r.impl == "fla" for r in rows)
    assert all("below the measured floor" in (r.reason or "") for r in rows), [r.reason for r in rows]
    for st in ("fwd", "b1", "bwd_chunk"):
        assert all(r.impl == "cute" for r in res.stage(st)), (st, [(r.impl, r.reason) for r in res.stage(st)])
