"""The launch harness of kda_cute_prep (kda_cute.prep, the forward's intra-chunk factors) for the
interpreter, and its inputs.

`emulate_prep(text, args, want_qg)` runs the kernel's PTX `text` on the CTAs of its grid (T / 64,
HV, B), `kda_cute.prep.THREADS` threads each, through `ext_wy.WyCTA` (tf32 mma.sync m16n8k8, bf16 /
fp16 m16n8k16, ldmatrix, cp.async) over one emulated global memory holding the five inputs and the
six outputs, NaN-poisoned first; it returns w, u, qg, kg, Aqk, Akk (without want_qg, qg is the qg
slot's own poisoned buffer: the kernel must leave it untouched). `prep_inputs(...)` makes random
inputs of the contract's shapes and dtypes (never zeros: gates a chunk-local log2 cumsum of negative
steps, beta in (0, 1)). kda_cute is imported inside the functions only.
"""

import torch

from .ext_wy import WyCTA, wy_program
from .launch import run_grid


def emulate_prep(text, args, want_qg=True, ctas=None):
    """Run kda_cute_prep's PTX on CPU for `args` = (q, k, v, gk, beta): (w, u, qg, kg, Aqk, Akk).
    `ctas`: the (chunk, hv, b) CTAs to run (default every one); other chunks' outputs stay NaN."""
    from kda_cute import prep

    q, k, v, gk, beta = args
    B, T, HV, _ = v.shape
    outs = prep._outputs(q, v, want_qg, "cpu")
    for t in outs:
        if t is not None:
            t.fill_(float("nan"))
    if ctas is None:
        ctas = [(tx, hy, bz) for bz in range(B) for hy in range(HV) for tx in range(T // 64)]
    tensors = list(prep._kernel_args(q, k, v, gk, beta, outs))
    if not want_qg:  # the launch passes kg's storage there; here a poisoned buffer of its own
        tensors[7] = torch.full_like(outs[3], float("nan"))
    got = run_grid(wy_program(text), tensors, ctas, WyCTA, prep.THREADS)
    w, u, qg, kg, aqk, akk = got[5:]
    return w, u, qg, kg, aqk, akk


def prep_inputs(B=1, T=64, H=1, HV=1, K=128, V=64, dtype=torch.bfloat16, beta_dtype=None, gmin=-0.3, seed=0):
    """fwd_intra's tensor arguments (q, k, v, gk, beta) at these extents, random and nonzero; q, k
    l2-normalized as the chain gives them; gk a chunk-local cumsum of steps in (gmin, 0), log2."""
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, generator=g).to(dtype)
    step = gmin * torch.rand(B, T, HV, K, generator=g)
    gk = torch.cat([c.cumsum(1) for c in step.split(64, dim=1)], 1) / 0.6931471805599453
    beta = torch.rand(B, T, HV, generator=g).to(beta_dtype or dtype)
    return [q, k, v, gk.contiguous(), beta]
