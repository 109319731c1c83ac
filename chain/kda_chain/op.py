"""`chunk_kda` as two torch.library custom ops, so torch.compile and torch.export see one opaque
node per direction instead of a graph break:

    kda::chunk_kda_fwd   forward.py  -> o, ht, and what the backward needs (fla's saved set; with
                         disable_recompute also gk, w, u, qg, kg, h, v_new, as fla keeps them)
    kda::chunk_kda_bwd   backward.py -> dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0

with fake (meta) implementations that give every output's shape and dtype from the inputs alone,
and the autograd formula registered on the forward op. A custom op may not return None nor an
alias of an input: an absent output (ht without output_final_state, rstd without l2norm, ...) is
an empty placeholder tensor, and a saved tensor that is an input (q without l2norm, beta without
the in-op sigmoid) is taken from the inputs, not returned.

Output dtypes are fla 0.6.0's (what its kernels allocate): o, the normalized q / k and Aqk / Akk
in q's dtype, rstd / gk / the activated beta in fp32 (fp64 for fp64 inputs, the reference's
precision). The real implementation checks its results against them (`_expect`), so a stage that
ever returned another dtype fails loudly instead of disagreeing with the compiled graph.

An eager call (no tracing, no dispatch mode) runs the same two bodies and autograd formula through
a plain autograd.Function (`_Eager`) instead: the custom-op dispatch costs host time per call that
a host-bound step pays in full.
"""

from __future__ import annotations

import functools
from dataclasses import fields

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .autograd import device_guard
from .backward import backward
from .forward import Flags, Kept, Saved, forward

_EMPTY = (0,)


def _f32(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(_EMPTY)


def _none(like: Tensor) -> None:
    return None


def _fwd_meta(q, k, v, g, beta, initial_state, chunks, output_final_state, l2norm, gate, beta_sigmoid, keep):
    """(shape, dtype) of each output of kda::chunk_kda_fwd, None for an empty placeholder. keep:
    disable_recompute (gk and the forward's w, u, qg, kg, h, v_new are outputs too). chunks: a
    packed call's chunk table (kda_chain.varlen, [2, N + 1]): N states, else B."""
    B, T, H, K = q.shape
    N = B if chunks is None else chunks.shape[1] - 1
    HV, V = v.shape[2], v.shape[3]
    NT = -(-T // 64)
    f32 = _f32(q)
    kept = [((B, T, HV, K), k.dtype), ((B, T, HV, V), v.dtype), ((B, T, HV, K), k.dtype),
            ((B, T, HV, K), k.dtype), ((B, NT, HV, K, V), k.dtype), ((B, T, HV, V), v.dtype)]
    return [
        ((B, T, HV, V), q.dtype),  # o
        ((N, HV, K, V), f32) if output_final_state else None,  # ht: fp32 (float64 for float64 q)
        ((B, T, H, K), q.dtype) if l2norm else None,  # q, l2-normalized
        ((B, T, H), f32) if l2norm else None,  # q_rstd
        ((B, T, H, K), k.dtype) if l2norm else None,  # k, l2-normalized
        ((B, T, H), f32) if l2norm else None,  # k_rstd
        ((B, T, HV, K), f32) if keep or not gate else None,  # gk (else bwd_prep recomputes it from g)
        ((B, T, HV), f32) if beta_sigmoid else None,  # beta after the sigmoid
        ((B, T, HV, 64), k.dtype),  # Aqk
        ((B, T, HV, 64), k.dtype),  # Akk
        *(kept if keep else [None] * len(kept)),  # w, u, qg, kg, h, v_new
    ]


_KEPT = tuple(fld.name for fld in fields(Kept))  # w, u, qg, kg, h, v_new: _fwd_meta's order
_FWD_NAMES = ("o", "ht", "q", "q_rstd", "k", "k_rstd", "gk", "beta", "Aqk", "Akk", *_KEPT)


def _expect(name: str, t: Tensor, meta) -> Tensor:
    """`t` as declared (contiguous, the fake's layout: a no-op for the kernels' outputs, a copy
    for a reference stage's strided view), or a loud error when shape or dtype differ."""
    shape, dtype = meta
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise RuntimeError(f"kda::chunk_kda: {name} came out {tuple(t.shape)} {t.dtype}, the op declares "
                           f"{tuple(shape)} {dtype} (fake and real would disagree)")
    return t.contiguous()


def _fwd_body(q, k, v, g, beta, A_log, dt_bias, initial_state, chunks, scale, output_final_state,
              use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
              lower_bound, disable_recompute, absent=_empty, plans=None) -> list[Tensor]:
    """kda::chunk_kda_fwd's implementation (also the eager path's forward: `_Eager`, whose absent
    outputs are None rather than placeholder tensors: `absent`, and which keeps the forward's plan
    key for its backward: appended to `plans`)."""
    f = Flags(scale, 64, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
              use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, disable_recompute)
    with device_guard(q):
        o, ht, s = forward(q, k, v, g, beta, A_log, dt_bias, initial_state, f, chunks)
    if plans is not None:
        plans.append(s.plan)
    kept = [None] * len(_KEPT) if s.kept is None else [getattr(s.kept, n) for n in _KEPT]
    got = [o, ht, s.q, s.q_rstd, s.k, s.k_rstd, s.gk, s.beta if use_beta_sigmoid_in_kernel else None,
           s.Aqk, s.Akk, *kept]
    metas = _fwd_meta(q, k, v, g, beta, initial_state, chunks, output_final_state, use_qk_l2norm_in_kernel,
                      use_gate_in_kernel, use_beta_sigmoid_in_kernel, disable_recompute)
    return [absent(q) if m is None else _expect(n, t, m)
            for n, t, m in zip(_FWD_NAMES, got, metas, strict=True)]


@torch.library.custom_op("kda::chunk_kda_fwd", mutates_args=())
def chunk_kda_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None, dt_bias: Tensor | None,
    initial_state: Tensor | None, chunks: Tensor | None, scale: float, output_final_state: bool,
    use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool, lower_bound: float | None, disable_recompute: bool,
) -> list[Tensor]:
    return _fwd_body(q, k, v, g, beta, A_log, dt_bias, initial_state, chunks, scale, output_final_state,
                     use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                     allow_neg_eigval, lower_bound, disable_recompute)


@chunk_kda_fwd.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, chunks, scale, output_final_state,
      use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
      disable_recompute):
    metas = _fwd_meta(q, k, v, g, beta, initial_state, chunks, output_final_state, use_qk_l2norm_in_kernel,
                      use_gate_in_kernel, use_beta_sigmoid_in_kernel, disable_recompute)
    return [_empty(q) if m is None else q.new_empty(m[0], dtype=m[1]) for m in metas]


def _bwd_body(do, dht, q, q_rstd, k, k_rstd, v, gk, g, beta_raw, beta, A_log, dt_bias, Aqk, Akk,
              initial_state, chunks, w, u, qg, kg, h, v_new, scale, use_qk_l2norm_in_kernel,
              use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
              absent=_empty, plan=None) -> list[Tensor]:
    """kda::chunk_kda_bwd's implementation (also the eager path's backward: `_Eager`, `absent` as
    in `_fwd_body`, `plan` the forward's plan key)."""
    keep = w is not None
    f = Flags(scale, 64, dht is not None, use_qk_l2norm_in_kernel, use_gate_in_kernel,
              use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, keep)
    kept = Kept(w, u, qg, kg, h, v_new) if keep else None
    s = Saved(q, q_rstd, k, k_rstd, v, gk, g, beta_raw, beta, A_log, dt_bias, Aqk, Akk, initial_state, kept,
              chunks, plan)
    with device_guard(do):
        grads = backward(do.contiguous(), None if dht is None else dht.contiguous(), s, f)
    # each gradient in its input's dtype (fla's rule), contiguous; absent ones as `absent(do)`
    likes = (q, k, v, g, beta_raw, A_log, dt_bias, initial_state)
    return [absent(do) if gr is None or t is None else _as(gr, t.dtype)
            for gr, t in zip(grads, likes, strict=True)]


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """`t` in `dtype`, contiguous; itself when it already is (no dispatch: ~8 us of host time per
    gradient on the H200 machine)."""
    if t.dtype == dtype and t.is_contiguous():
        return t
    return t.to(dtype).contiguous()


@torch.library.custom_op("kda::chunk_kda_bwd", mutates_args=())
def chunk_kda_bwd(
    do: Tensor, dht: Tensor | None, q: Tensor, q_rstd: Tensor | None, k: Tensor, k_rstd: Tensor | None,
    v: Tensor, gk: Tensor | None, g: Tensor, beta_raw: Tensor, beta: Tensor, A_log: Tensor | None,
    dt_bias: Tensor | None, Aqk: Tensor, Akk: Tensor, initial_state: Tensor | None, chunks: Tensor | None,
    w: Tensor | None,
    u: Tensor | None, qg: Tensor | None, kg: Tensor | None, h: Tensor | None, v_new: Tensor | None,
    scale: float, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool, lower_bound: float | None,
) -> list[Tensor]:
    return _bwd_body(do, dht, q, q_rstd, k, k_rstd, v, gk, g, beta_raw, beta, A_log, dt_bias, Aqk, Akk,
                     initial_state, chunks, w, u, qg, kg, h, v_new, scale, use_qk_l2norm_in_kernel,
                     use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound)


@chunk_kda_bwd.register_fake
def _(do, dht, q, q_rstd, k, k_rstd, v, gk, g, beta_raw, beta, A_log, dt_bias, Aqk, Akk, initial_state,
      chunks, w, u, qg, kg, h, v_new, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
      use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound):
    gate = use_gate_in_kernel
    likes = (q, k, v, g, beta_raw, A_log if gate else None, dt_bias if gate else None, initial_state)
    return [_empty(do) if t is None else torch.empty_like(t) for t in likes]


_FLAG_NAMES = ("scale", "output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
               "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "lower_bound", "disable_recompute")


def _setup_context(ctx, inputs, output, returned=True):
    """`returned`: the intermediates in `output` are the forward's outputs (the custom op's), else
    only o and ht are (`_Eager`: the rest is saved as intermediates)."""
    q, k, v, g, beta, A_log, dt_bias, initial_state, chunks, *flags = inputs
    f = dict(zip(_FLAG_NAMES, flags, strict=True))
    _, _, qn, q_rstd, kn, k_rstd, gk, beta_act, Aqk, Akk, *kept = output
    # the saved intermediates are outputs only to reach the backward: no gradient flows to them,
    # and none is materialized (zeros of every one of them: 0.49 ms and GBs at the reference shape)
    if returned:
        ctx.mark_non_differentiable(*(t for t in (qn, q_rstd, kn, k_rstd, gk, beta_act, Aqk, Akk, *kept)
                                      if t is not None))
    ctx.set_materialize_grads(False)
    l2, sig, keep = f["use_qk_l2norm_in_kernel"], f["use_beta_sigmoid_in_kernel"], f["disable_recompute"]
    ctx.save_for_backward(qn if l2 else q, q_rstd if l2 else None, kn if l2 else k, k_rstd if l2 else None, v,
                          None if f["use_gate_in_kernel"] and not keep else gk, g, beta,
                          beta_act if sig else beta, A_log, dt_bias, Aqk, Akk, initial_state, chunks,
                          *(kept if keep else [None] * len(kept)))
    ctx.flags = f
    ctx.has_ht = f["output_final_state"]
    ctx.o_shape, ctx.o_dtype = output[0].shape, output[0].dtype
    ctx.needs = [A_log is not None, dt_bias is not None, initial_state is not None]


def _backward(ctx, grads, bwd=None):
    """The registered autograd formula; `bwd`: the backward's implementation (the custom op, or its
    body on the eager path)."""
    do, dht = grads[0], grads[1]
    f = ctx.flags
    dht = dht if ctx.has_ht else None
    if do is None:  # o unused by the loss (only ht is): its gradient is zero
        do = torch.zeros(ctx.o_shape, dtype=ctx.o_dtype, device=ctx.saved_tensors[0].device)
    saved = ctx.saved_tensors  # the chunk table or None; with disable_recompute w, u, qg, kg, h, v_new too
    bwd = bwd or torch.ops.kda.chunk_kda_bwd
    out = bwd(do, dht, *saved, f["scale"], f["use_qk_l2norm_in_kernel"], f["use_gate_in_kernel"],
              f["use_beta_sigmoid_in_kernel"], f["allow_neg_eigval"], f["lower_bound"])
    dq, dk, dv, dg, db, dA_log, ddt_bias, dh0 = out
    has_a, has_d, has_h = ctx.needs
    gate = f["use_gate_in_kernel"]
    return (dq, dk, dv, dg, db, dA_log if gate and has_a else None, ddt_bias if gate and has_d else None,
            dh0 if has_h else None, None, *([None] * len(_FLAG_NAMES)))


chunk_kda_fwd.register_autograd(_backward, setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """The same two bodies and autograd formula as the custom ops, without the custom-op dispatch
    (schema defaults, pytree flattening, the alias check): what an eager call pays per step. With
    it the host time outside the stages of one fwd+bwd went 1.77 -> 1.06 ms on the device machine
    (bench/check_launch.py --profile, B2 T4096, 2026-12-02), at a shape where the step is
    host-bound. Its outputs are o and ht only: the intermediates the backward needs are saved as
    such (autograd's per-output bookkeeping for up to 14 more tensors is skipped). Results are the
    bodies' own, so both paths are bitwise equal (tests/kda_chain/test_op.py)."""

    @staticmethod
    def forward(ctx, *inputs):
        plans = []
        out = _fwd_body(*inputs, absent=_none, plans=plans)
        _setup_context(ctx, inputs, out, returned=False)
        ctx.plan = plans[0]
        return out[0], out[1]

    @staticmethod
    def backward(ctx, *grads):
        return _backward(ctx, grads, functools.partial(_bwd_body, absent=_none, plan=ctx.plan))


def _eager(q: Tensor) -> bool:
    """Eager autograd can take the call: not under torch.compile / export tracing, no dispatch mode
    (FakeTensorMode, functionalization, ...) that needs the op's schema and fake implementation."""
    return (not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and q.device.type != "meta")


def apply(q, k, v, g, beta, A_log, dt_bias, initial_state, f: Flags,
          chunks=None) -> tuple[Tensor, Tensor | None]:
    """The chain's fwd (+ registered bwd): (o, ht or None). Through the custom ops when traced, the
    same bodies through `_Eager` otherwise. chunks: a packed call's chunk table (kda_chain.varlen)."""
    args = (q, k, v, g, beta, A_log, dt_bias, initial_state, chunks, f.scale, f.output_final_state,
            f.use_qk_l2norm_in_kernel, f.use_gate_in_kernel, f.use_beta_sigmoid_in_kernel,
            f.allow_neg_eigval, f.lower_bound, f.disable_recompute)
    out = _Eager.apply(*args) if _eager(q) else torch.ops.kda.chunk_kda_fwd(*args)
    return out[0], (out[1] if f.output_final_state else None)
