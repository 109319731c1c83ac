"""The chain's host path on a CPU, kernels stubbed: what one fwd+bwd costs in Python and torch
before any GPU work, measured where no GPU is (issue #20's host-time target).

Every stage takes its CuTe implementation exactly as on the H200 (the gates, the plans, each kernel
module's `launch` or its recorded replay: configs, fresh outputs, the call cache), except that each
compiled kernel is a no-op on the TVM-FFI path and the device checks answer as for an H200
(kda_chain.testing.stub_device). Outputs stay uninitialized; nothing here checks numbers. What it
leaves out against the device machine: the TVM-FFI call itself (~5-25 us per launch there:
bench/check_tvm_ffi.py), the CUDA caching allocator (torch.empty: ~4.7 us there,
bench/check_launch.py --profile), autograd's device thread.

    python bench/check_host.py [--B 2 --T 256 --H 16 --V 128] [--steps 300] [--profile] [--packed N]

The shape changes nothing but the CPU reductions' size: T is small so torch's CPU ops stay cheap.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import torch  # noqa: E402


def make_step(B, T, H, V, K=128, packed=0):
    """One fwd+bwd at [B, T, H, ...]; packed=N: the same B * T tokens as one packed row of N
    sequences of ragged lengths (cu_seqlens and cu_seqlens_cpu given: no sync)."""
    from kda_chain import chunk_kda

    g = torch.Generator().manual_seed(0)
    if packed:
        B, T = 1, B * T

    def r(*s):
        return torch.randn(s, generator=g).to(torch.bfloat16).requires_grad_(True)

    q, k, v, gate, beta = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), r(B, T, H, K), r(B, T, H)
    A_log = torch.zeros(H)
    do = torch.randn(B, T, H, V).to(torch.bfloat16)
    leaves = (q, k, v, gate, beta)
    kw = {}
    if packed:  # N - 1 cuts at odd places, so most sequences end in a partial chunk
        cuts = sorted({1 + (i * 7919) % (T - 1) for i in range(1, packed)})
        cu = torch.tensor([0, *cuts, T], dtype=torch.int32)
        kw = dict(cu_seqlens=cu, cu_seqlens_cpu=cu.long())

    def step():
        for t in leaves:  # as an optimizer's zero_grad(set_to_none=True): no accumulation kernels
            t.grad = None
        o, _ = chunk_kda(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                         A_log=A_log, **kw)
        o.backward(do)

    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--profile", action="store_true", help="cProfile the steps, by own time")
    ap.add_argument("--packed", type=int, default=0, help="N: the tokens as one packed row of N sequences")
    a = ap.parse_args()
    from kda_chain import stages as S
    from kda_chain.testing import stub_device

    stub_device()

    step = make_step(a.B, a.T, a.H, a.V, packed=a.packed)
    S.reset_dispatch_log()
    step()
    ran = sorted({f"{c.stage}:{c.impl}" for c in S.dispatch_log()})
    print("stages:", " ".join(ran))
    for _ in range(20):
        step()
    ts = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    what = f"{a.packed} sequences packed" if a.packed else f"B{a.B}"
    print(f"host us per fwd+bwd ({what} T{a.T} H{a.H} V{a.V}, kernels stubbed): median "
          f"{ts[len(ts) // 2] * 1e6:.0f}, p10 {ts[len(ts) // 10] * 1e6:.0f}")
    if a.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.steps):
            step()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(40)


if __name__ == "__main__":
    main()
