"""The launch harness of kda_cute_prep (kda_cute.prep, the forward's intra-chunk factors) for the
interpreter, and its inputs.

`emulate_prep(text, args, want_qg)` runs the kernel's PTX `text` on the CTAs of its grid (T / 64,
HV, B), `kda_cute.prep.THREADS` threads each, through `ext_wy.WyCTA` (tf32 mma.sync m16n8k8, bf16 /
fp16 m16n8k16, ldmatrix, cp.async) over one emulated global memory holding the inputs and the seven
outputs, NaN-poisoned first; it returns gk, w, u, qg, kg, Aqk, Akk (without want_qg, qg is the qg
slot's own poisoned buffer: the kernel must leave it untouched). With a chunk table it runs the
varlen build (the packed row in, the padded row out, plus the inputs' padded copies), every global
access checked to stay inside the tensors. `prep_inputs(...)` makes random
inputs of the contract's shapes and dtypes (never zeros: negative step gates or a gate's input,
beta in (0, 1)). kda_cute is imported inside the functions only.
"""

import torch

from .ext_wy import WyCTA, wy_program
from .launch import run_grid
from .memory import global_memory


def _poisoned_grid(outs, v, ctas, table=None):
    """NaN into every output (None skipped); `ctas`, or every (chunk, hv, b) CTA of the grid: v's
    (T / 64, HV, B), or with a chunk table (varlen) (NT, HV, 1)."""
    for t in outs:
        if t is not None:
            t.fill_(float("nan"))
    if ctas is not None:
        return ctas
    B, T, HV, _ = v.shape
    if table is not None:
        return [(tx, hy, 0) for hy in range(HV) for tx in range(table.shape[0])]
    return [(tx, hy, bz) for bz in range(B) for hy in range(HV) for tx in range(T // 64)]


def _bits(x):
    return x.contiguous().view(torch.uint8)


class _InBoundsCTA(WyCTA):
    """WyCTA whose every global access (ld / st, a cp.async's source bytes) must lie inside one of
    `ranges`, the tensors' own bytes [base, base + nbytes) (the emulated memory pads each tensor to
    4 KiB: a read past a tensor's end would otherwise go unseen)."""

    ranges = ()

    def _inside(self, addr, nbytes):
        if not any(lo <= addr and addr + nbytes <= hi for lo, hi in self.ranges):
            raise IndexError(f"global access outside every tensor: {addr:#x} + {nbytes}")

    def load(self, space, addr, nbytes):
        if space != "shared":
            self._inside(addr, nbytes)
        return super().load(space, addr, nbytes)

    def store(self, space, addr, nbytes, val):
        if space != "shared":
            self._inside(addr, nbytes)
        return super().store(space, addr, nbytes, val)

    def _cp_land(self, group):
        for _, src, _, srcbytes in group:
            if srcbytes:
                self._inside(src, srcbytes)
        return super()._cp_land(group)


def emulate_prep(text, args, want_qg=True, ctas=None, l2norm=False, table=None):
    """Run kda_cute_prep's PTX on CPU for `args` = (q, k, v, g, beta, A_log, dt_bias, lower_bound,
    use_gate_in_kernel) (`prep_inputs`' list; the scale is compiled in): (gk, w, u, qg, kg, Aqk,
    Akk), and with l2norm (a kernel compiled with it, q and k raw) also q, k normalized, q_rstd,
    k_rstd. `ctas`: the (chunk, hv, b) CTAs to run (default every one); other chunks' outputs stay
    NaN. Without l2norm the kernel's q_n / k_n slots (q, k stand in) must come back unchanged, and
    so must every input and every other stand-in.

    `table` (the varlen build: args the packed row [1, T_raw, ...], table int32 [NT, 2]): the
    outputs on the padded row [1, 64 NT, ...], then q, k's padded copies q_p, k_p (with l2norm the
    normalized q, k themselves), all NaN-poisoned first; every global access must stay inside the
    tensors' own bytes (`_InBoundsCTA`)."""
    from kda_cute import prep

    q, k, v, g, beta, A_log, dt_bias, lower_bound, gate_in = args
    cfg, tensors, result = prep._plan(q, k, v, g, beta, A_log, dt_bias, lower_bound, gate_in, 1.0, want_qg,
                                      l2norm, table)
    ctas = _poisoned_grid(result, v, ctas, table)
    tensors = list(tensors)
    if not want_qg:  # the launch passes kg's storage there; here a poisoned buffer of its own
        tensors[9] = torch.full_like(result[4], float("nan"))
    # slots the kernel must leave as they are: the inputs, and the stand-ins of this build
    keep = [0, 1, 2, 3, 4, 5, 6]
    if not l2norm and table is None:
        keep += [14, 15]
    if not l2norm:
        keep += [16, 17]
    keep += [18]
    got = run_grid(wy_program(text), tensors, ctas, _cta_class(tensors, table), prep.THREADS)
    for i in keep:
        assert torch.equal(_bits(got[i]), _bits(tensors[i])), f"kernel argument {i} (read-only) was written"
    w, u, qg, kg, aqk, akk, gk = got[7:14]
    outs = (gk, w, u, qg, kg, aqk, akk, *(got[14:18] if l2norm else ()))
    if table is None:
        return outs
    return (*outs, *got[14:16])


def _cta_class(tensors, table):
    """WyCTA, or with a chunk table `_InBoundsCTA` over the tensors' own bytes."""
    if table is None:
        return WyCTA
    _, bases = global_memory(tensors)
    ranges = tuple((b, b + t.numel() * t.element_size()) for t, b in zip(tensors, bases, strict=True))
    return type("PrepCTA", (_InBoundsCTA,), {"ranges": ranges})


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


def emulate_bwd_prep(text, args, Akk, ctas=None, gk=None, table=None):
    """Run kda_cute_bwd_prep's PTX (kda_cute.bwd_prep) on CPU for `args` (`prep_inputs`' list) and
    the saved `Akk`: (gk, w, u, qg, kg), NaN-poisoned first; `ctas` as for `emulate_prep`. `gk`: the
    forward's, for the build that reads it (a copy goes in; it must come back unchanged). `table`
    (the varlen build: v, g, beta on the packed row, q, k, Akk on the padded one): every global
    access must stay inside the tensors' own bytes."""
    from kda_cute import bwd_prep

    q, k, v, g, beta, A_log, dt_bias, lower_bound, gate_in = args
    g_ = gk if g is None else g
    outs = bwd_prep._outputs(q, v)
    ctas = _poisoned_grid(outs, outs[2], ctas, table)  # (u: the padded row's extents)
    if gk is not None:
        outs = (gk.clone(), *outs[1:])
    cfg = bwd_prep._config(q, v, g_, beta, dt_bias, lower_bound, gate_in, gk is not None, table is not None)
    tensors = list(bwd_prep._kernel_args(q, k, v, g_, beta, A_log, dt_bias, Akk, cfg, outs, table))
    tensors[11] = torch.full_like(Akk, float("nan"))  # the Aqk stand-in: must stay untouched
    got = run_grid(wy_program(text), tensors, ctas, _cta_class(tensors, table), bwd_prep.THREADS)
    assert torch.isnan(got[11]).all(), "kda_cute_bwd_prep wrote its Aqk stand-in"
    if gk is not None:
        assert torch.equal(got[13].view(torch.int32), gk.view(torch.int32)), "the given gk was written"
    w, u, qg, kg = got[7:11]
    return got[13], w, u, qg, kg
