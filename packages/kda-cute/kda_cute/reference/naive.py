"""Token-by-token KDA in plain torch: the autograd oracle every chunked stage is checked against.

`naive_recurrent_kda` runs the recurrence one token at a time, exactly as written in the math,

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t

with g in natural-log units (per step, not cumulated). It uses only differentiable torch ops and no
in-place writes, so `torch.autograd` through it gives the exact gradients of every input (q, k, v, g,
beta, initial_state). Nothing here knows about chunks, log2 space or fla's stage split: that is the
point of an oracle.

`naive_kda` adds fla's in-op extras in front of it (q/k L2 norm, the fused gate, beta sigmoid), so a
test can compare `chunk_kda`'s full flag surface, including dA_log and ddt_bias, against autograd.
`naive_l2norm` and `naive_gate` are the differentiable forms of those extras; the explicit stages in
`stages.py` reuse them for their forward values so the formula lives in one place.

Precision: float64 inputs compute in float64; anything else computes in float32. `o` comes back in
v's dtype (as fla), the final state in the compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(*xs: torch.Tensor | None) -> torch.dtype:
    """float64 if any given tensor is float64, else float32: the precision rule of the reference."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The KDA recurrence, one token at a time; differentiable by autograd.

    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (natural-log per-step decay); beta [B, T, HV];
    initial_state [B, HV, K, V]. Value head hv reads qk head hv // (HV // H) (GVA).
    Returns (o [B, T, HV, V] in v.dtype, final state [B, HV, K, V] or None).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    group = HV // H
    if scale is None:
        scale = K ** -0.5
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    q = q.to(dt).repeat_interleave(group, dim=2) * scale
    k = k.to(dt).repeat_interleave(group, dim=2)
    v, g, beta = v.to(dt), g.to(dt), beta.to(dt)

    S = q.new_zeros(B, HV, K, V)
    if initial_state is not None:
        S = S + initial_state.to(dt)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        k_t = k[:, t]
        residual = v[:, t] - torch.einsum('bhk,bhkv->bhv', k_t, S)
        S = S + torch.einsum('bhk,bhv->bhkv', beta[:, t, :, None] * k_t, residual)
        outs.append(torch.einsum('bhk,bhkv->bhv', q[:, t], S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, HV, V)
    return o.to(v.dtype), (S if output_final_state else None)


def naive_l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's L2 norm over the last dim: x / sqrt(sum(x^2) + eps) (eps inside the root, as fla)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def naive_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
) -> torch.Tensor:
    """fla's fused KDA gate, natural-log per-step decay, computed in g's dtype.

    lower_bound None: -exp(A_log[hv]) * softplus(g + dt_bias[hv, :]).
    lower_bound set:  lower_bound * sigmoid(exp(A_log[hv]) * (g + dt_bias[hv, :])), with exp(A_log) taken
    as 1 when A_log is None (fla's kda_gate_chunk_cumsum applies it whenever lower_bound is given).
    g [B, T, HV, K]; A_log [HV]; dt_bias [HV * K].
    """
    HV, K = g.shape[-2:]
    x = g if dt_bias is None else g + dt_bias.to(g.dtype).view(HV, K)
    if lower_bound is None:
        return -A_log.to(g.dtype).exp().view(HV, 1) * F.softplus(x)
    if A_log is not None:
        x = A_log.to(g.dtype).exp().view(HV, 1) * x
    return lower_bound * torch.sigmoid(x)


def naive_kda(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunk_kda`'s whole flag surface as differentiable torch around `naive_recurrent_kda`.

    Same arguments as `chunk_kda_reference` (minus chunk_size). Autograd through this gives the
    oracle gradients of q, k, v, g (raw, when the gate is fused), beta (raw, when the sigmoid is
    fused), A_log, dt_bias and initial_state. o comes back in q's dtype, as fla's chunk_kda.
    """
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    qc, kc, gc, bc = q.to(dt), k.to(dt), g.to(dt), beta.to(dt)
    if use_qk_l2norm_in_kernel:
        qc, kc = naive_l2norm(qc), naive_l2norm(kc)
    if use_gate_in_kernel:
        gc = naive_gate(gc, A_log, dt_bias, lower_bound)
    if use_beta_sigmoid_in_kernel:
        bc = torch.sigmoid(bc) * (2.0 if allow_neg_eigval else 1.0)
    o, ht = naive_recurrent_kda(qc, kc, v.to(dt), gc, bc, scale, initial_state, output_final_state)
    return o.to(q.dtype), ht


def naive_kda_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    **flags,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`naive_kda` over packed sequences (fla's varlen layout): q, k, v, g, beta are [1, total_T,
    ...] and sequence n is rows cu_seqlens[n] : cu_seqlens[n + 1]; initial_state [N, HV, K, V].
    Each sequence runs alone from its own state (nothing crosses a boundary); returns o
    [1, total_T, HV, V] and ht [N, HV, K, V] (or None). `flags`: naive_kda's in-op extras."""
    offs = [int(x) for x in cu_seqlens.tolist()]
    outs, hts = [], []
    for n in range(len(offs) - 1):
        a, b = offs[n], offs[n + 1]
        h0 = None if initial_state is None else initial_state[n:n + 1]
        o, ht = naive_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale, h0,
                          output_final_state, **flags)
        outs.append(o)
        hts.append(ht)
    return torch.cat(outs, 1), (torch.cat(hts, 0) if output_final_state else None)
