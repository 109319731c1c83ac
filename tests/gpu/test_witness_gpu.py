"""The witness on the GPU: the chain must launch the CuTe kernels, proven from a profiler trace.

The marker (kda_witness's pytest plugin) profiles the test and fails with each stage that fell
back and its reason. On the device machine, where nothing is installed, load the plugin with
`-p kda_witness.pytest_plugin` (bench/gpu_suite.sh does).
"""

import pytest
import torch


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


@pytest.mark.witness(kernels=["kda_cute_intra"])
def test_chain_launches_the_intra_kernel():
    _fwd_bwd(B=2, T=1024, H=16, HV=16, K=128, V=128)


@pytest.mark.witness(kernels=["kda_cute_b1", "kda_cute_dhu", "kda_cute_intra"])
def test_chain_launches_the_backward_cute_kernels():
    """The three kernels the chain picks at this shape; fwd stays fla (measured slower)."""
    _fwd_bwd(B=4, T=2048, H=16, HV=16, K=128, V=256)


def test_fwd_fallback_carries_its_measured_reason():
    """Every fallback names why: the forward scan runs fla because kda_cute_fwd measured slower."""
    import kda_cute.fwd as F
    from kda_witness import profile

    if F.SLOWER_THAN_FLA is None:
        pytest.skip("kda_cute_fwd is offered (SLOWER_THAN_FLA dropped)")
    res = profile(lambda: _fwd_bwd(B=2, T=1024, H=16, HV=16, K=128, V=128))
    rows = res.stage("fwd")
    assert rows and all(r.impl == "fla" for r in rows)
    assert all("measured no faster than fla" in (r.reason or "") for r in rows), [r.reason for r in rows]
