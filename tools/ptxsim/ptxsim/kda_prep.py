"""The launch harness of kda_cute_prep (kda_cute.prep, the forward's intra-chunk factors) for the
interpreter, and its inputs.

`emulate_prep(text, args, want_qg)` runs the kernel's PTX `text` on the CTAs of its grid (T / 64,
HV, B), `kda_cute.prep.THREADS` threads each, through `ext_wy.WyCTA` (tf32 mma.sync m16n8k8, bf16 /
fp16 m16n8k16, ldmatrix, cp.async) over one emulated global memory holding the inputs and the seven
outputs, NaN-poisoned first; it returns gk, w, u, qg, kg, Aqk, Akk (without want_qg, qg is the qg
slot's own poisoned buffer: the kernel must leave it untouched). `prep_inputs(...)` makes random
inputs of the contract's shapes and dtypes (never zeros: negative step gates or a gate's input,
beta in (0, 1)). kda_cute is imported inside the functions only.
"""

import torch

from .ext_wy import WyCTA, wy_program
from .launch import run_grid


def _poisoned_grid(outs, v, ctas):
    """NaN into every output (None skipped); `ctas`, or every (chunk, hv, b) CTA of v's grid."""
    for t in outs:
        if t is not None:
            t.fill_(float("nan"))
    if ctas is not None:
        return ctas
    B, T, HV, _ = v.shape
    return [(tx, hy, bz) for bz in range(B) for hy in range(HV) for tx in range(T // 64)]


def emulate_prep(text, args, want_qg=True, ctas=None, l2norm=False):
    """Run kda_cute_prep's PTX on CPU for `args` = (q, k, v, g, beta, A_log, dt_bias, lower_bound,
    use_gate_in_kernel) (`prep_inputs`' list; the scale is compiled in): (gk, w, u, qg, kg, Aqk,
    Akk), and with l2norm (a kernel compiled with it, q and k raw) also q, k normalized, q_rstd,
    k_rstd. `ctas`: the (chunk, hv, b) CTAs to run (default every one); other chunks' outputs stay
    NaN. Without l2norm the kernel's q_n / k_n slots (q, k stand in) must come back unchanged."""
    from kda_cute import prep

    q, k, v, g, beta, A_log, dt_bias, lower_bound, gate_in = args
    outs = prep._outputs(q, v, want_qg, l2norm)
    ctas = _poisoned_grid(outs, v, ctas)
    cfg = prep._config(q, v, g, beta, dt_bias, lower_bound, gate_in, 1.0, want_qg, l2norm)
    tensors = list(prep._kernel_args(q, k, v, g, beta, A_log, dt_bias, cfg, outs))
    if not want_qg:  # the launch passes kg's storage there; here a poisoned buffer of its own
        tensors[9] = torch.full_like(outs[4], float("nan"))
    got = run_grid(wy_program(text), tensors, ctas, WyCTA, prep.THREADS)
    w, u, qg, kg, aqk, akk, gk = got[7:14]
    if not l2norm:
        assert torch.equal(got[14], q) and torch.equal(got[15], k), "q / k stand-ins written"
        return gk, w, u, qg, kg, aqk, akk
    return (gk, w, u, qg, kg, aqk, akk, *got[14:18])


def prep_inputs(B=1, T=64, H=1, HV=1, K=128, V=64, dtype=torch.bfloat16, beta_dtype=None, gmin=-0.3, seed=0,
                gate="none", g_dtype=torch.float32):
    """fwd_prep's arguments but the scale (q, k, v, g, beta, A_log, dt_bias, lower_bound,
    use_gate_in_kernel) at these extents, random and nonzero; q, k l2-normalized as the chain gives
    them. gate "none": g the step log gate in (gmin, 0); "softplus": g the gate's input (N(0, 1)),
    A_log from log 1 to log 16 over the heads, a dt_bias; "lower_bound": the same with lower_bound
    gmin (the step gate in (gmin, 0))."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, generator=gen).to(dtype)
    beta = torch.rand(B, T, HV, generator=gen).to(beta_dtype or dtype)
    if gate == "none":
        g = (gmin * torch.rand(B, T, HV, K, generator=gen)).to(g_dtype)
        return [q, k, v, g, beta, None, None, None, False]
    g = torch.randn(B, T, HV, K, generator=gen).to(g_dtype)
    A_log = torch.log(torch.linspace(1.0, 16.0, HV)) if HV > 1 else torch.tensor([0.7])
    dt_bias = 0.5 * torch.randn(HV * K, generator=gen)
    return [q, k, v, g, beta, A_log, dt_bias, gmin if gate == "lower_bound" else None, True]


def emulate_bwd_prep(text, args, Akk, ctas=None, gk=None):
    """Run kda_cute_bwd_prep's PTX (kda_cute.bwd_prep) on CPU for `args` (`prep_inputs`' list) and
    the saved `Akk`: (gk, w, u, qg, kg), NaN-poisoned first; `ctas` as for `emulate_prep`. `gk`: the
    forward's, for the build that reads it (a copy goes in; it must come back unchanged)."""
    from kda_cute import bwd_prep

    q, k, v, g, beta, A_log, dt_bias, lower_bound, gate_in = args
    outs = bwd_prep._outputs(q, v)
    ctas = _poisoned_grid(outs, v, ctas)
    if gk is not None:
        outs = (gk.clone(), *outs[1:])
    cfg = bwd_prep._config(q, v, g, beta, dt_bias, lower_bound, gate_in, gk is not None)
    tensors = list(bwd_prep._kernel_args(q, k, v, g, beta, A_log, dt_bias, Akk, cfg, outs))
    tensors[11] = torch.full_like(Akk, float("nan"))  # the Aqk stand-in: must stay untouched
    got = run_grid(wy_program(text), tensors, ctas, WyCTA, bwd_prep.THREADS)
    assert torch.isnan(got[11]).all(), "kda_cute_bwd_prep wrote its Aqk stand-in"
    if gk is not None:
        assert torch.equal(got[13].view(torch.int32), gk.view(torch.int32)), "the given gk was written"
    w, u, qg, kg = got[7:11]
    return got[13], w, u, qg, kg
