"""The whole chunk_kda forward and backward composed from the reference stages, in fla 0.6.0's order.

`chunk_kda_reference` is a drop-in for fla's `chunk_kda` (equal-length batches: no cu_seqlens, no
safe_gate, no context parallelism, state in [K, V] layout) built as a torch.autograd.Function whose
backward runs the explicit backward stages, not autograd through the forward ones. Comparing it
against autograd through `naive_recurrent_kda` therefore checks every stage contract end to end; and
a chain that swaps one stage for a kernel can be checked against it stage by stage.

Forward (fla: ChunkKDAFunction.forward / chunk_kda_fwd):
    l2norm_fwd(q), l2norm_fwd(k)            when use_qk_l2norm_in_kernel
    beta_sigmoid_fwd(beta)                  when use_beta_sigmoid_in_kernel (x2 with allow_neg_eigval)
    gate_chunk_cumsum -> fwd_intra -> fwd_scan (= fwd_h + fwd_o)
Backward (fla's recompute path, chunk_kda_bwd):
    [gate_chunk_cumsum again when the gate is fused] -> recompute_w_u -> fwd_h -> bwd_dAv -> bwd_dhu
    -> bwd_wy_dqkg -> bwd_intra -> gva_sum -> dg_cumsum -> gate_bwd -> l2norm_bwd -> beta_sigmoid_bwd

`chunk_kda_reference_fwd` returns (o, ht, saved) and `chunk_kda_reference_bwd(saved, do, dht)`
returns every input gradient; the autograd Function is a thin wrapper over the two, so a chain can
also drive them directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .stages import (
    beta_sigmoid_bwd,
    beta_sigmoid_fwd,
    bwd_dAv,
    bwd_dhu,
    bwd_intra,
    bwd_wy_dqkg,
    dg_cumsum,
    fwd_h,
    fwd_intra,
    fwd_scan,
    gate_bwd,
    gate_chunk_cumsum,
    gva_sum,
    l2norm_bwd,
    l2norm_fwd,
    recompute_w_u,
)


@dataclass
class KDASaved:
    """What the forward keeps for the backward (fla's save_for_backward, recompute path).

    q and k are the L2-normalised ones when use_qk_l2norm_in_kernel (their rstd kept alongside),
    beta is the post-sigmoid one (beta_raw the input). gk is kept only when the gate is not fused;
    with a fused gate the backward recomputes it from g_raw, as fla does."""
    q: torch.Tensor
    q_rstd: torch.Tensor | None
    k: torch.Tensor
    k_rstd: torch.Tensor | None
    v: torch.Tensor
    g_raw: torch.Tensor
    gk: torch.Tensor | None
    beta_raw: torch.Tensor
    beta: torch.Tensor
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    Aqk: torch.Tensor
    Akk: torch.Tensor
    initial_state: torch.Tensor | None
    scale: float
    use_qk_l2norm_in_kernel: bool
    use_gate_in_kernel: bool
    use_beta_sigmoid_in_kernel: bool
    allow_neg_eigval: bool
    lower_bound: float | None
    chunk_size: int


def chunk_kda_reference_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None, KDASaved]:
    """The forward stages in fla's order. Returns (o in q.dtype, ht float32 or None, saved)."""
    q_rstd = k_rstd = None
    if use_qk_l2norm_in_kernel:
        q, q_rstd = l2norm_fwd(q)
        k, k_rstd = l2norm_fwd(k)
    beta_raw = beta
    if use_beta_sigmoid_in_kernel:
        beta = beta_sigmoid_fwd(beta_raw, 2.0 if allow_neg_eigval else 1.0)
    gk = gate_chunk_cumsum(g, A_log, dt_bias, lower_bound, chunk_size, use_gate_in_kernel)
    w, u, _, kg, Aqk, Akk = fwd_intra(q, k, v, gk, beta, scale, chunk_size)
    o, ht = fwd_scan(q, None, kg, w, u, gk, Aqk, initial_state, output_final_state, scale)
    saved = KDASaved(
        q=q, q_rstd=q_rstd, k=k, k_rstd=k_rstd, v=v, g_raw=g,
        gk=None if use_gate_in_kernel else gk, beta_raw=beta_raw, beta=beta,
        A_log=A_log, dt_bias=dt_bias, Aqk=Aqk, Akk=Akk, initial_state=initial_state, scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, chunk_size=chunk_size,
    )
    return o.to(q.dtype), ht, saved


def chunk_kda_reference_bwd(
    s: KDASaved,
    do: torch.Tensor,
    dht: torch.Tensor | None,
) -> tuple[torch.Tensor | None, ...]:
    """The backward stages in fla's order.

    Returns (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0): dq/dk in the input q/k dtype, dv in v's,
    dg in g's (the raw g when the gate is fused), dbeta in the raw beta's, dA_log / ddt_bias in their
    parameters' dtypes (None when not fused or not given), dh0 float32 (None without initial_state)."""
    BT = s.chunk_size
    H = s.q.shape[2]
    gk = s.gk
    if s.use_gate_in_kernel:
        gk = gate_chunk_cumsum(s.g_raw, s.A_log, s.dt_bias, s.lower_bound, BT, True)
    w, u, qg, kg = recompute_w_u(s.q, s.k, s.v, s.beta, s.Akk, gk)
    h, v_new, _ = fwd_h(kg, w, u, gk, s.initial_state, False, BT)
    dAqk, dv = bwd_dAv(v_new, do, s.Aqk, s.scale)
    dh, dh0, dv = bwd_dhu(qg, kg, w, gk, s.initial_state, dht, do, dv, s.scale, chunk_size=BT)
    dq, dk, dv, db, dg, dAkk = bwd_wy_dqkg(s.q, s.k, s.v, v_new, gk, s.beta, s.Akk, h, do, dh, dv, s.scale)
    dq, dk, db, dg = bwd_intra(s.q, s.k, gk, s.beta, dAqk, dAkk, dq, dk, db, dg)
    dq, dk = gva_sum(dq, H), gva_sum(dk, H)
    dg = dg_cumsum(dg, BT)
    dA_log = ddt_bias = None
    if s.use_gate_in_kernel:
        dg, dA_log, ddt_bias = gate_bwd(s.g_raw, s.A_log, s.dt_bias, dg, s.lower_bound)
    if s.use_qk_l2norm_in_kernel:
        dq = l2norm_bwd(s.q, s.q_rstd, dq)
        dk = l2norm_bwd(s.k, s.k_rstd, dk)
    if s.use_beta_sigmoid_in_kernel:
        db = beta_sigmoid_bwd(s.beta_raw, db, 2.0 if s.allow_neg_eigval else 1.0)
    return (dq.to(s.q.dtype), dk.to(s.k.dtype), dv.to(s.v.dtype), dg.to(s.g_raw.dtype),
            db.to(s.beta_raw.dtype), dA_log, ddt_bias, dh0)


class ChunkKDAReferenceFunction(torch.autograd.Function):
    """autograd wrapper: forward = chunk_kda_reference_fwd, backward = chunk_kda_reference_bwd."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state,
                use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                allow_neg_eigval, lower_bound, chunk_size):
        o, ht, saved = chunk_kda_reference_fwd(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, A_log,
            dt_bias, chunk_size,
        )
        ctx.saved = saved
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        dq, dk, dv, dg, db, dA_log, ddt_bias, dh0 = chunk_kda_reference_bwd(ctx.saved, do, dht)
        return dq, dk, dv, dg, db, dA_log, ddt_bias, dh0, None, None, None, None, None, None, None, None


def chunk_kda_reference(
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
    lower_bound: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla 0.6.0 chunk_kda's math, differentiable through the explicit backward stages.

    q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K] (the per-step log gate, or its raw input with
    use_gate_in_kernel); beta [B,T,HV] (raw logits with use_beta_sigmoid_in_kernel);
    initial_state [B,HV,K,V]; A_log [HV]; dt_bias [HV*K]. Returns (o [B,T,HV,V] in q.dtype,
    ht [B,HV,K,V] float32 or None). Raises ValueError on the flag combinations fla rejects."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True.")
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        raise ValueError("A_log must be given when use_gate_in_kernel=True and lower_bound is not set.")
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    if chunk_size not in (32, 64):
        raise ValueError(f"chunk_size must be 32 or 64, got {chunk_size}.")
    H, K = q.shape[2], q.shape[3]
    HV = v.shape[2]
    if HV % H:
        raise ValueError(f"HV={HV} must be a multiple of H={H}.")
    if scale is None:
        scale = K ** -0.5
    return ChunkKDAReferenceFunction.apply(
        q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        lower_bound, chunk_size,
    )


def chunk_kda_reference_packed(q, k, v, g, beta, cu_seqlens: list[int], initial_state=None,
                               output_final_state: bool = False, **flags):
    """`chunk_kda_reference` of a packed call (fla's varlen layout: [1, total_T, ...], N + 1 token
    offsets `cu_seqlens` as a host list, states [N, HV, K, V]): the chain once per sequence from its
    own initial state, o concatenated, ht stacked (differentiable). A sequence of length 0 passes
    its state through (zeros without initial_state)."""
    outs, hts = [], []
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    for n in range(len(cu_seqlens) - 1):
        a, b = cu_seqlens[n], cu_seqlens[n + 1]
        h0 = None if initial_state is None else initial_state[n:n + 1]
        if a == b:
            outs.append(v[:, :0].to(q.dtype))
            st = torch.float64 if q.dtype == torch.float64 else torch.float32  # (ht's dtype, as fla's)
            hts.append(v.new_zeros(1, HV, K, V, dtype=st) if h0 is None else h0.to(st) * 1)
            continue
        o, ht = chunk_kda_reference(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                    initial_state=h0, output_final_state=True, **flags)
        outs.append(o)
        hts.append(ht)
    return torch.cat(outs, 1), (torch.cat(hts, 0) if output_final_state else None)
