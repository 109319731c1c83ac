"""Helpers shared by the tests and the bench checks: realistic inputs of the CuTe scan stages on
CUDA (kg, w, u, Aqk and qg from fla's own intra (disable_recompute: the store of qg the chain asks
for) on l2-normed q, k and negative per-step gates; CUDA and fla needed), and the chain's CuTe path
on a CPU with its kernels stubbed (`stub_device`)."""

from __future__ import annotations

import math
import sys

import torch

RCP_LN2 = 1.0 / math.log(2.0)


def scan_inputs(B, T, H, HV, V, dtype=torch.bfloat16, gmin=-0.5, h0=True, seed=0, K=128) -> dict:
    """q, kg, w, u, gk, Aqk, qg, h0, do, dht (h0 / dht None without `h0`) and the scale. Aqk's
    upper triangle is what fla's intra leaves there (unwritten): a kernel reading it must mask."""
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.utils import chunk_local_cumsum

    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, generator=gen, device="cuda", dtype=torch.float32)

    q = torch.nn.functional.normalize(rn(B, T, H, K), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(rn(B, T, H, K), dim=-1).to(dtype)
    v = rn(B, T, HV, V).to(dtype)
    g = gmin * torch.rand(B, T, HV, K, generator=gen, device="cuda")
    gk = chunk_local_cumsum(g, scale=RCP_LN2, chunk_size=64)
    beta = torch.sigmoid(rn(B, T, HV)).to(dtype)
    scale = K**-0.5
    w, u, qg, kg, Aqk, _ = chunk_kda_fwd_intra(
        q=q, k=k, v=v, gk=gk, beta=beta, scale=scale, chunk_size=64, disable_recompute=True
    )
    h0t = rn(B, HV, K, V) * 0.1 if h0 else None
    do = rn(B, T, HV, V).to(dtype)
    dht = rn(B, HV, K, V) * 0.1 if h0 else None
    return dict(q=q, kg=kg, w=w, u=u, gk=gk, Aqk=Aqk, qg=qg, h0=h0t, do=do, dht=dht, scale=scale)


def fla_dhu(d: dict):
    """What kda_cute_dhu replaces, on `scan_inputs`: fla's bwd_dAv for dv = tril(Aqk)^T do (its dAqk,
    from a stand-in v_new, is dropped), then fla's bwd_dhu on that dv -> dh, dh0, dv2."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv

    _, dv = chunk_kda_bwd_dAv(q=d["q"], k=d["q"], v=d["u"], do=d["do"], A=d["Aqk"], scale=d["scale"])
    return chunk_gated_delta_rule_bwd_dhu(q=d["qg"], k=d["kg"], w=d["w"], do=d["do"], dv=dv, gk=d["gk"],
                                          h0=d["h0"], dht=d["dht"], scale=d["scale"])


def stub_device(setattr=setattr, sm_count: int = 132) -> None:
    """Every kda_cute / kda_chain module's device checks answer as for an sm_90 GPU with `sm_count`
    SMs, and each compiled kernel is a no-op on the TVM-FFI launch path (the call cache's own work
    runs): every stage takes its CuTe path, with its gates, plans, configs, fresh outputs and
    recorded launches, and no kernel computes (outputs stay uninitialized). `setattr`: a test's
    monkeypatch.setattr, to undo it."""
    from kda_cute import registry
    from kda_cute._common import cache, support

    for rec in registry.STAGES:
        rec.load()
    fake = {support.device_reason: lambda t: None, support.sm_count_of: lambda t: sm_count}
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(("kda_cute", "kda_chain")):
            continue
        for attr in ("device_reason", "sm_count_of"):
            fn = getattr(mod, attr, None)
            if fn in fake:
                setattr(mod, attr, fake[fn])

    def compile_noop(self, ckey, args, dyn_modes, build):
        self.compiled[ckey] = _noop_kernel
        self.path = "tvm-ffi"
        return _noop_kernel

    setattr(cache, "launch_path", lambda: "tvm-ffi")
    setattr(cache.CallCache, "_compile_tvm_ffi", compile_noop)


def _noop_kernel(*tensors) -> None:
    pass
