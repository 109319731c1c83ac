"""`chunk_kda`: fla 0.6.0's signature and results, on our stage chain.

Bad input fails here, with the argument named, before any kernel runs. Flags the chain does not
implement (cp_context, safe_gate, state_v_first, chunk_size != 64, return_intermediate_states,
use_graph) send the WHOLE call to fla, logged once and recorded as the range
`kda::chunk_kda::fla::<reason>` so the witness shows it; where fla cannot run (no CUDA, float64
inputs, fla not importable), such a call raises rather than silently doing something else.

A packed call (cu_seqlens) runs the chain on a row padded to whole chunks per sequence
(`kda_chain.varlen`), in the range `kda::chunk_kda::packed`; so does a dense call whose T is not a
multiple of 64, its B rows as B packed sequences (`_ragged`, the range `kda::chunk_kda::ragged`).
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch
from kda_cute import registry
from kda_witness import stage_range

from . import op, varlen
from . import stages as S
from .autograd import EmptyKDAFunction
from .forward import Flags

log = logging.getLogger("kda_chain")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _delegated_reason(*, chunk_size, safe_gate, state_v_first, cp_context, use_graph,
                      return_intermediate_states) -> str | None:
    for on, why in (
        (cp_context is not None, "context parallel not implemented"),
        (safe_gate, "safe_gate not implemented"),
        (state_v_first, "state_v_first not implemented"),
        (use_graph, "use_graph not implemented"),
        (return_intermediate_states, "return_intermediate_states not implemented"),
        (chunk_size != 64, f"chunk_size {chunk_size} not implemented (64 only)"),
    ):
        if on:
            return why
    return None


def _check(cond: bool, msg) -> None:
    """ValueError("chunk_kda: <msg>") unless `cond`; `msg` a string or a function making it (the
    f-strings are built only on failure: building them all cost ~50 us per call)."""
    if not cond:
        raise ValueError(f"chunk_kda: {msg() if callable(msg) else msg}")


def _check_cu_seqlens(cu, B, T, dev) -> None:
    """fla's varlen layout: B == 1, cu_seqlens 1-D int32 / int64 on q's device, N + 1 >= 2 offsets
    from 0 to T, non-decreasing. The values are read only on the CPU (on a GPU that is a host sync,
    which fla does not make either)."""
    _check(isinstance(cu, torch.Tensor),
           lambda: f"cu_seqlens must be a torch.Tensor, got {type(cu).__name__}")
    _check(cu.dim() == 1 and cu.numel() >= 2,
           lambda: f"cu_seqlens must be 1-D with N + 1 >= 2 offsets, got shape {list(cu.shape)}")
    _check(cu.dtype in (torch.int32, torch.int64),
           lambda: f"cu_seqlens must be int32 or int64, got {cu.dtype}")
    _check(cu.device == dev, lambda: f"cu_seqlens is on {cu.device} but q is on {dev}")
    _check(B == 1, lambda: "with cu_seqlens the sequences are packed along T: q must be [1, total_T, H, K], "
           f"got B={B}")
    if cu.device.type == "cpu":
        _check_offsets(cu.tolist(), T)


def _check_offsets(offs, T) -> None:
    _check(offs[0] == 0 and offs[-1] == T,
           lambda: f"cu_seqlens must run from 0 to total_T={T}, got {offs[0]} .. {offs[-1]}")
    _check(all(a <= b for a, b in zip(offs, offs[1:], strict=False)), "cu_seqlens must be non-decreasing")


def validate(q, k, v, g, beta, initial_state, A_log, dt_bias, use_gate_in_kernel, lower_bound,
             use_beta_sigmoid_in_kernel, allow_neg_eigval, cu_seqlens=None) -> None:
    """Every check fla makes, plus device/dtype/stride checks fla leaves to a crash."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            _check(False, f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATS:
            _check(False, f"{name} has dtype {t.dtype}; expected a floating dtype")
    _check(q.dim() == 4, lambda: f"q must be [B, T, H, K], got shape {list(q.shape)}")
    _check(k.shape == q.shape,
           lambda: f"q and k must have the same shape, got q={list(q.shape)} k={list(k.shape)}")
    B, T, H, K = q.shape
    _check(v.dim() == 4 and v.shape[:2] == (B, T),
           lambda: f"v must be [B, T, HV, V] with B={B} T={T}, got {list(v.shape)}")
    HV = v.shape[2]
    _check(HV % H == 0, lambda: f"HV={HV} (v.shape[2]) must be a multiple of H={H} (q.shape[2])")
    _check(K <= 256, lambda: f"key head dim K={K} > 256 is not supported (fla's limit)")
    _check(tuple(g.shape) == (B, T, HV, K), lambda: f"g must have shape {[B, T, HV, K]}, got {list(g.shape)}")
    _check(tuple(beta.shape) == (B, T, HV),
           lambda: f"beta must have shape {[B, T, HV]}, got {list(beta.shape)}")
    dev = q.device
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
                    ("A_log", A_log), ("dt_bias", dt_bias)):
        if t is not None and t.device != dev:
            _check(False, f"{name} is on {t.device} but q is on {dev}")
    _check(k.dtype == q.dtype, lambda: f"k dtype {k.dtype} differs from q dtype {q.dtype}")
    _check(v.dtype == q.dtype, lambda: f"v dtype {v.dtype} differs from q dtype {q.dtype}")
    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, B, T, dev)
    if initial_state is not None:
        V = v.shape[3]
        N = B if cu_seqlens is None else len(cu_seqlens) - 1  # varlen: one state per sequence
        _check(tuple(initial_state.shape) == (N, HV, K, V),
               lambda: f"initial_state must have shape {[N, HV, K, V]}, got {list(initial_state.shape)}")
        ok = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
        _check(initial_state.dtype in ok,
               lambda: f"initial_state must be float32 (float64 only with float64 inputs, the reference's "
               f"precision), got {initial_state.dtype}")
    if cu_seqlens is None and 0 < T < H:
        warnings.warn(
            f"chunk_kda: q has T={T} < H={H} (shape {list(q.shape)}): inputs are [B, T, H, K] "
            "(sequence before heads); head-first [B, H, T, K] tensors give wrong results. "
            "Transpose them with .transpose(1, 2) if that is what they are.", stacklevel=3)
    if use_gate_in_kernel:
        _check(A_log is not None or lower_bound is not None,
               "A_log must be given when use_gate_in_kernel=True and lower_bound is not set")
        if A_log is not None:
            _check(A_log.numel() == HV,
                   lambda: f"A_log must have HV={HV} elements, got shape {list(A_log.shape)}")
        if dt_bias is not None:
            _check(dt_bias.numel() == HV * K,
                   lambda: f"dt_bias must have HV*K={HV * K} elements, got {list(dt_bias.shape)}")
    if allow_neg_eigval:
        _check(use_beta_sigmoid_in_kernel, "allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs,
):
    """Drop-in for `fla.ops.kda.chunk_kda` (0.6.0): same arguments, same returns (o, final_state).

    A_log, dt_bias and chunk_size come through **kwargs as in fla.
    """
    if "transpose_state_layout" in kwargs:  # fla 0.6.0's deprecated name for state_v_first
        if state_v_first:
            raise ValueError("chunk_kda: pass state_v_first or transpose_state_layout, not both")
        warnings.warn("chunk_kda: transpose_state_layout is deprecated; use state_v_first",
                      DeprecationWarning, stacklevel=2)
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    A_log = kwargs.get("A_log") if use_gate_in_kernel else None
    dt_bias = kwargs.get("dt_bias") if use_gate_in_kernel else None
    chunk_size = kwargs.get("chunk_size", 64)
    unknown = set(kwargs) - {"A_log", "dt_bias", "chunk_size"}
    if unknown:
        raise TypeError(f"chunk_kda: unexpected keyword arguments {sorted(unknown)}")
    validate(q, k, v, g, beta, initial_state, A_log, dt_bias, use_gate_in_kernel, lower_bound,
             use_beta_sigmoid_in_kernel, allow_neg_eigval, cu_seqlens)

    reason = _delegated_reason(
        chunk_size=chunk_size, safe_gate=safe_gate, state_v_first=state_v_first,
        cp_context=cp_context, use_graph=use_graph, return_intermediate_states=return_intermediate_states)
    if reason is not None:
        no_fla = S.fla_gate(q)
        if no_fla is not None:
            raise NotImplementedError(f"chunk_kda: {reason}, and fla cannot run here ({no_fla})")
        registry.log_once(f"kda_chain: whole call to fla: {reason}", logger=log)
        S.dispatch_log().append(S.Choice("chunk_kda", "fla", reason))
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        with stage_range("chunk_kda", "fla", reason):
            return fla_chunk_kda(
                q, k, v, g, beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
                disable_recompute=disable_recompute, return_intermediate_states=return_intermediate_states,
                state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                cp_context=cp_context, use_graph=use_graph, max_num_seqs=max_num_seqs, **kwargs)

    args = (scale, output_final_state, chunk_size, use_qk_l2norm_in_kernel, use_gate_in_kernel,
            use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, disable_recompute)
    if cu_seqlens is not None:
        offs = [int(x) for x in (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).tolist()]
        _check(len(offs) == cu_seqlens.shape[0],
               lambda: f"cu_seqlens_cpu has {len(offs)} offsets, cu_seqlens {cu_seqlens.shape[0]}")
        _check_offsets(offs, q.shape[1])
        with _routed("packed"):
            return _packed(cu_seqlens, offs, q, k, v, g, beta, A_log, dt_bias, initial_state, *args)
    if q.shape[1] % chunk_size and op._eager(q):  # (traced: the dense custom ops, any T, symbolic too)
        return _ragged(q, k, v, g, beta, A_log, dt_bias, initial_state, *args)
    return _dense(q, k, v, g, beta, A_log, dt_bias, initial_state, *args)


def _routed(impl: str):
    """The record of a call's route (`chunk_kda` `packed` / `ragged`, no reason: not a fallback):
    the dispatch log and the profiler range around the block; nothing while torch.compile traces
    (the custom ops inside are the graph's nodes; a range object is not traceable)."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    S.dispatch_log().append(S.Choice("chunk_kda", impl, None))
    return stage_range("chunk_kda", impl, None)


def _ragged(q, k, v, g, beta, A_log, dt_bias, initial_state, *args):
    """A [B, T, ...] call whose T is not a multiple of the chunk: its B rows as B packed sequences
    of T tokens each (the rows [1, B T, ...] are views of contiguous inputs; offsets 0, T, .., B T
    known on the host: no sync), so the CuTe kernels' packed builds take it where the dense builds
    refuse a ragged last chunk (before this, every stage but the L2 norm went to fla). o and the
    gradients come back as [B, T, ...] views; the states are per row, [B, HV, K, V], as for the
    dense call. Recorded as the range `kda::chunk_kda::ragged` (a routing, not a fallback). What
    it costs beyond fla's layout: the saved q, k, Aqk, Akk (and gk without the gate in the op)
    are on the padded row, 64 - T % 64 rows more per sequence (README, "Ragged T")."""
    B, T = q.shape[:2]
    offs = list(range(0, B * T + 1, T))
    cu = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=q.device)
    rows = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
    with _routed("ragged"):
        o, ht = _packed(cu, offs, *rows, A_log, dt_bias, initial_state, *args, share=False)
    return o.view(B, T, *o.shape[2:]), ht


def _dense(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state, chunk_size,
           use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
           lower_bound, disable_recompute=False, chunks=None):
    """The chain on validated [B, T, ...] inputs (with `chunks`, a packed call's padded row:
    `_packed`). disable_recompute: the forward keeps w, u, qg, kg, h, v_new (and gk) for the
    backward, as fla's: more memory, no recompute."""
    if q.shape[1] == 0:  # fla's answer at T = 0, without launching anything
        if chunks is not None:  # (every packed sequence empty: their states pass through)
            B = chunks.shape[1] - 1
            q, k, v, g, beta = (t.expand(B, *t.shape[1:]) for t in (q, k, v, g, beta))
        return EmptyKDAFunction.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, output_final_state)
    flags = _flags(q, scale, output_final_state, chunk_size, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                   use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, disable_recompute)
    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    return op.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, flags, chunks)


def _contiguous(*tensors):
    """Each tensor contiguous (itself when it is; None stays None)."""
    return tuple(None if t is None else t.contiguous() for t in tensors)


def _flags(q, scale, output_final_state, chunk_size, use_qk_l2norm_in_kernel, use_gate_in_kernel,
           use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, disable_recompute=False) -> Flags:
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return Flags(scale=float(scale), chunk_size=chunk_size, output_final_state=output_final_state,
                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                 use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                 lower_bound=lower_bound, disable_recompute=bool(disable_recompute))


def _packed(cu_seqlens, offs, q, k, v, g, beta, A_log, dt_bias, initial_state, *args, share=True):
    """A packed call ([1, total_T, ...], offsets cu_seqlens, states [N, ...]) on the padded row of
    `kda_chain.varlen`, one chain call with the chunk table. Eager: `varlen.Native` (the CuTe
    kernels read the packed inputs and do, write o and the packed gradients: nothing gathered where
    they all take the call); traced: the inputs packed, the custom ops, o unpacked (all differentiable).
    offs: the offsets on the host (the caller's: from cu_seqlens_cpu, else one read of cu_seqlens,
    a host sync on a GPU as fla's without cu_seqlens_cpu; checked). share: keep the layout while
    the caller's cu_seqlens lives (`varlen.packing_of`; not for `_ragged`'s own offsets)."""
    eager = op._eager(q)
    build = varlen.packing_of if share else varlen.packing
    p = build(cu_seqlens, offs, host=eager)
    if p.T_pad == q.shape[1]:  # every sequence whole chunks: the row is already the padded layout
        S.varlen_rows("native")  # (in place: nothing to gather)
        o, ht = _dense(q, k, v, g, beta, A_log, dt_bias, initial_state, *args, chunks=p.chunks)
        return o[:1], ht  # (every sequence empty: _dense answered per sequence, o [N, 0, ...])
    if eager:  # the packed row read and written in place (varlen.Native)
        f = _flags(q, *args)
        q, k, v, g, beta, h0 = _contiguous(q, k, v, g, beta, initial_state)
        o, ht = varlen.Native.apply(q, k, v, g, beta, A_log, dt_bias, h0, f, p)
        return o, (ht if f.output_final_state else None)
    gate, sig, lower_bound = args[4], args[5], args[7]
    packed = varlen.pack_inputs(q, k, v, g, beta, p, use_gate_in_kernel=gate, use_beta_sigmoid_in_kernel=sig,
                                lower_bound=lower_bound)
    o, ht = _dense(*packed, A_log, dt_bias, initial_state, *args, chunks=p.chunks)
    return varlen.unpack(o, p), ht


def is_supported(q: torch.Tensor, v: torch.Tensor | None = None, **flags) -> dict[str, str | None]:
    """Per CuTe stage, None if its kernel would run for inputs like these, else the reason.

    Answers from each stage's gate on meta tensors of the shapes a chain call passes (no memory is
    allocated), standing for tensors on q's device. q and v may be meta tensors themselves. A T
    that is not a multiple of 64 is asked as the padded row's whole chunks (`_ragged`: the call
    runs as B packed sequences; the kernels' packed builds take what their padded builds take).
    """
    B, T, H, K = q.shape
    T = -(-T // 64) * 64
    HV, V = (v.shape[2], v.shape[3]) if v is not None else (H, K)
    reason = _delegated_reason(
        chunk_size=flags.get("chunk_size", 64), safe_gate=flags.get("safe_gate", False),
        state_v_first=flags.get("state_v_first", False),
        cp_context=flags.get("cp_context"), use_graph=flags.get("use_graph", False),
        return_intermediate_states=flags.get("return_intermediate_states", False))
    if reason is not None:
        return {name: f"whole call to fla: {reason}" for name in S.CUTE_STAGES}
    dims = registry.Dims(B, T, H, HV, K, V, q.dtype)
    with registry.probing(q.device):
        return {rec.name: S.CUTE_STAGES[rec.name].choose(*rec.probe(dims))[1] for rec in registry.STAGES}


def warmup(B: int, T: int, H: int, K: int, V: int, HV: int | None = None, dtype=torch.bfloat16,
           device="cuda", **flags) -> dict[str, str | None]:
    """Compile (and autotune) everything one fwd+bwd at this shape uses; returns the stage choices.

    Runs one real forward+backward on random inputs: compiles every CuTe kernel the shape takes,
    fills fla's autotune cache for the stages fla runs. Time: seconds per CuTe kernel, minutes for
    a cold fla autotune.
    """
    HV = HV or H
    gen = torch.Generator(device="cpu").manual_seed(0)

    def r(*shape, dt=dtype):
        return torch.randn(shape, generator=gen).to(device=device, dtype=dt)

    q, k = r(B, T, H, K), r(B, T, H, K)
    v = r(B, T, HV, V)
    g = -torch.nn.functional.softplus(r(B, T, HV, K, dt=torch.float32))
    beta = torch.rand(B, T, HV, generator=gen).to(device=device, dtype=dtype)
    for t in (q, k, v, g, beta):
        t.requires_grad_(True)
    S.reset_dispatch_log()
    o, _ = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, **flags)
    o.backward(torch.randn_like(o))
    return {c.stage: c.impl for c in S.dispatch_log()}
