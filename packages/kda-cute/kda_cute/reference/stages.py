"""fla 0.6.0's chunk_kda, one plain-torch function per stage contract (see ARCHITECTURE.md).

Each function takes and returns exactly what the corresponding fla function does (layouts, shapes,
output dtypes), so a CuTe kernel, fla's Triton kernel and this reference are interchangeable stage by
stage, and a kernel test compares its stage against the function here with the same arguments.

Conventions (fla's):
- q, k [B, T, H, K]; v, do [B, T, HV, V]; gk, w, qg, kg and every per-value-head K-tensor
  [B, T, HV, K]; beta [B, T, HV]; value head hv reads qk head hv // (HV // H).
- gk is the chunk-local cumsum of the natural-log gate divided by ln 2, so every decay factor is an
  exp2 of a difference of gk; decays only ever appear as exp2(gk_i - gk_j) with i >= j, exp2(gk_i)
  and exp2(gk_last - gk_i), all <= 1 (the gate is <= 0), and the masked (upper) entries are formed
  as exp2(-inf) = 0 so a strong gate never overflows.
- Chunks of BT = 64 tokens (BT read from an A-matrix's last dim where the stage has one). T need not
  be a multiple of BT: the last chunk is padded like fla's masked loads: q, k, v, beta, the
  A-matrices and the gradients with zeros, gk with its last row (so "gk at the chunk's last row"
  is the last real token's, as fla's `min(T, i_t * BT + BT) - 1`), and the padding is cut off again.
- A-matrices [B, T, HV, BT]: row t holds its chunk's row t % BT. Akk is (I + L)^-1 with
  L_ij = beta_i k_i.k_j exp2(gk_i - gk_j) (i > j): the WY inverse with beta folded in, so
  w = Akk (beta k exp2(gk)), u = Akk (beta v). Aqk_ij = scale q_i.k_j exp2(gk_i - gk_j) (i >= j).
- States h, dh [B, NT, HV, K, V]: h[:, c] is the state ENTERING chunk c (before its update);
  dh[:, c] is the gradient of the state LEAVING chunk c (dht for the last chunk).
- Gate gradients (dg) are w.r.t. the natural-log cumulative gate, per element; the reverse
  chunk-local cumsum (dg_cumsum) turns them into gradients of the per-step gate.

Precision: float64 inputs are computed and returned in float64. Otherwise everything is computed
in float32 and outputs take fla's dtypes: tensors fla allocates `like` an input keep that input's
dtype (bf16 in training), tensors fla allocates in float32 are float32 (gk, ht, dh0, dAqk, dAkk,
dq/dk/dg/db of the backward, rstd, the beta sigmoid). The docstring of each stage lists its dtypes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .naive import compute_dtype, naive_gate

RCP_LN2 = 1.0 / math.log(2.0)
# Upper bound on elements of one [.., BT, BT, K] decay tensor block (see _chunk_blocks).
_DECAY_BLOCK_ELEMS = 1 << 26


# ----------------------------------------------------------------------------------------------
# Chunk layout helpers
# ----------------------------------------------------------------------------------------------

def _num_chunks(T: int, BT: int) -> int:
    return (T + BT - 1) // BT


def _to_chunks(x: torch.Tensor, BT: int, dtype: torch.dtype, edge: bool = False) -> torch.Tensor:
    """[B, T, HV, *D] -> [B, NT, HV, BT, *D] in `dtype`, padding T up to NT * BT.

    Padding is zeros, or (edge=True, for gk) copies of the last row so the padded rows of the last
    chunk carry the last real token's cumulative gate.
    """
    x = x.to(dtype)
    B, T = x.shape[:2]
    pad = _num_chunks(T, BT) * BT - T
    if pad:
        fill = x[:, -1:].expand(B, pad, *x.shape[2:]) if edge else x.new_zeros(B, pad, *x.shape[2:])
        x = torch.cat([x, fill], dim=1)
    return x.reshape(B, -1, BT, *x.shape[2:]).movedim(2, 3)


def _from_chunks(x: torch.Tensor, T: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of _to_chunks: [B, NT, HV, BT, *D] -> [B, T, HV, *D] in `dtype`."""
    x = x.movedim(3, 2)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :T].to(dtype)


def _expand_heads(x: torch.Tensor, HV: int) -> torch.Tensor:
    """qk-head tensor [B, T, H, ...] -> value heads [B, T, HV, ...] (hv reads hv // (HV // H))."""
    return x.repeat_interleave(HV // x.shape[2], dim=2)


def _valid(T: int, BT: int, device) -> torch.Tensor:
    """[NT, BT] bool: which chunk rows are real tokens."""
    return (torch.arange(_num_chunks(T, BT) * BT, device=device) < T).view(-1, BT)


def _last_row(T: int, BT: int, device) -> torch.Tensor:
    """[NT, BT] bool: the last real token of each chunk (where the chunk-level gate gradient lands)."""
    NT = _num_chunks(T, BT)
    last = torch.clamp(T - torch.arange(NT, device=device) * BT, max=BT) - 1
    return torch.arange(BT, device=device)[None, :] == last[:, None]


def _tri(BT: int, device, strict: bool) -> torch.Tensor:
    """[BT, BT] lower-triangular bool mask (i > j if strict, else i >= j)."""
    i = torch.arange(BT, device=device)
    return (i[:, None] > i[None, :]) if strict else (i[:, None] >= i[None, :])


def _chunk_blocks(x: torch.Tensor):
    """Slices over the chunk dim of x [B, NT, HV, BT, K] so one [.., BT, BT, K] decay block stays
    below _DECAY_BLOCK_ELEMS elements: the reference then runs at training shapes without needing
    B*NT*HV*BT*BT*K memory at once."""
    B, NT, HV, BT, K = x.shape
    step = max(1, _DECAY_BLOCK_ELEMS // max(1, B * HV * BT * BT * K))
    for c in range(0, NT, step):
        yield slice(c, min(NT, c + step))


def _decay(G: torch.Tensor) -> torch.Tensor:
    """G [..., BT, K] (log2 cumsum) -> D [..., BT, BT, K], D_ijk = exp2(G_ik - G_jk) for i >= j, else 0.

    The upper entries are exp2(-inf): never a positive exponent, so no overflow for strong gates."""
    BT = G.shape[-2]
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)
    keep = _tri(BT, G.device, strict=False)[:, :, None]
    return torch.exp2(diff.masked_fill(~keep, float('-inf')))


# ----------------------------------------------------------------------------------------------
# Small elementwise stages
# ----------------------------------------------------------------------------------------------

def chunk_local_cumsum(
    x: torch.Tensor,
    chunk_size: int,
    reverse: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Cumsum of x [B, T, H(, K)] along T restarting every chunk_size tokens (reverse: from the chunk's
    end), times scale if given. Returns float32 (float64 for float64 x), as fla's output_dtype default."""
    dt = compute_dtype(x)
    B, T = x.shape[:2]
    NT = _num_chunks(T, chunk_size)
    xc = x.to(dt)
    pad = NT * chunk_size - T
    if pad:
        xc = torch.cat([xc, xc.new_zeros(B, pad, *x.shape[2:])], dim=1)
    xc = xc.reshape(B, NT, chunk_size, *x.shape[2:])
    if reverse:
        out = xc.flip(2).cumsum(2).flip(2)
    else:
        out = xc.cumsum(2)
    if scale is not None:
        out = out * scale
    return out.reshape(B, NT * chunk_size, *x.shape[2:])[:, :T]


def gate_chunk_cumsum(
    g: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    chunk_size: int,
    use_gate_in_kernel: bool,
) -> torch.Tensor:
    """gk [B, T, HV, K] float32: chunk-local cumsum of the per-step natural-log gate, divided by ln 2.

    With use_gate_in_kernel the per-step gate is first computed from the raw g (see naive_gate:
    -exp(A_log) softplus(g + dt_bias), or lower_bound * sigmoid(exp(A_log) (g + dt_bias)) when
    lower_bound is set); otherwise g already is the per-step gate.
    (fla: kda_gate_chunk_cumsum / chunk_local_cumsum with scale=RCP_LN2.)"""
    if use_gate_in_kernel:
        g = naive_gate(g.to(compute_dtype(g)), A_log, dt_bias, lower_bound)
    return chunk_local_cumsum(g, chunk_size, reverse=False, scale=RCP_LN2)


def dg_cumsum(dg: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Reverse chunk-local cumsum of dg [B, T, HV, K]: gradient of the cumulative gate -> gradient of
    the per-step gate. float32 (float64 for float64)."""
    return chunk_local_cumsum(dg, chunk_size, reverse=True)


def gva_sum(x: torch.Tensor, H: int) -> torch.Tensor:
    """Sum a value-head gradient [B, T, HV, K] over each GVA group down to qk heads [B, T, H, K], in
    float32 (float64 for float64). With HV == H there is nothing to sum and x comes back unchanged."""
    B, T, HV, K = x.shape
    if HV == H:
        return x
    return x.to(compute_dtype(x)).view(B, T, H, HV // H, K).sum(3)


def l2norm_fwd(x: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x * rstd with rstd = 1 / sqrt(sum(x^2) + eps) over the last dim.
    Returns (y in x.dtype, rstd [...] float32 (float64 for float64))."""
    xf = x.to(compute_dtype(x))
    rstd = torch.rsqrt((xf * xf).sum(-1) + eps)
    return (xf * rstd.unsqueeze(-1)).to(x.dtype), rstd


def l2norm_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dx = rstd * (dy - (dy . y) y), the L2-norm backward from its output y and rstd. Returns y.dtype.
    dy [B, T, G H, K] (GVA: a gradient per value head) is first summed over each group (gva_sum)."""
    dt = compute_dtype(y, rstd, dy)
    dy = gva_sum(dy, y.shape[2])
    yf, dyf, r = y.to(dt), dy.to(dt), rstd.to(dt).unsqueeze(-1)
    dx = dyf * r - (dyf * yf).sum(-1, keepdim=True) * yf * r
    return dx.to(y.dtype)


def beta_sigmoid_fwd(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """beta = scale * sigmoid(x) (scale 2 with allow_neg_eigval). float32 (float64 for float64)."""
    return scale * torch.sigmoid(x.to(compute_dtype(x)))


def beta_sigmoid_bwd(x: torch.Tensor, dy: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """d(scale * sigmoid(x)) / dx applied to dy. Returns x.dtype."""
    s = torch.sigmoid(x.to(compute_dtype(x, dy)))
    return (dy.to(s.dtype) * scale * s * (1.0 - s)).to(x.dtype)


def gate_bwd(
    g: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dyg: torch.Tensor,
    lower_bound: float | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Backward of the fused gate (naive_gate) given dyg, the gradient of the per-step gate.

    Returns (dg in g.dtype, dA_log [HV] in A_log.dtype or None, ddt_bias [HV * K] in dt_bias.dtype or
    None). (fla: kda_gate_bwd.)"""
    HV, K = g.shape[-2:]
    dt = compute_dtype(g, dyg)
    x = g.to(dt)
    if dt_bias is not None:
        x = x + dt_bias.to(dt).view(HV, K)
    dy = dyg.to(dt)
    dA = None
    if lower_bound is None:
        a = -A_log.to(dt).exp().view(HV, 1)
        dx = a * dy * torch.sigmoid(x)
        dA = (dy * a * F.softplus(x)).sum(-1).flatten(0, -2).sum(0)
    else:
        a = A_log.to(dt).exp().view(HV, 1) if A_log is not None else 1.0
        s = torch.sigmoid(a * x)
        dx = dy * lower_bound * s * (1.0 - s) * a
        if A_log is not None:
            dA = (dx * x).sum(-1).flatten(0, -2).sum(0)
    dbias = dx.flatten(0, -3).sum(0).reshape(HV * K) if dt_bias is not None else None
    return (
        dx.to(g.dtype),
        dA.to(A_log.dtype) if dA is not None else None,
        dbias.to(dt_bias.dtype) if dbias is not None else None,
    )


# ----------------------------------------------------------------------------------------------
# Forward stages
# ----------------------------------------------------------------------------------------------

def _w_u_qg_kg(qc, kc, vc, bc, Ac, Gc, valid):
    """Chunked core of recompute_w_u: w = A (beta k exp2(G)), u = A (beta v), qg = q exp2(G),
    kg = k exp2(G_last - G) (zero on padded rows). All args chunked [B, NT, HV, BT, *]."""
    E = torch.exp2(Gc)
    bcol = bc.unsqueeze(-1)
    w = Ac @ (bcol * kc * E)
    u = Ac @ (bcol * vc)
    qg = qc * E
    kg = kc * torch.exp2(Gc[..., -1:, :] - Gc) * valid[None, :, None, :, None]
    return w, u, qg, kg


def fwd_prep(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    use_gate_in_kernel: bool,
    scale: float,
    chunk_size: int = 64,
    want_qg: bool = False,
    l2norm: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """The forward's chunk-parallel stage: gate_chunk_cumsum then fwd_intra (kda_cute_prep does
    both in one kernel). g is the raw gate (the per-step log gate, or the gate's input with
    use_gate_in_kernel). Returns gk (gate_chunk_cumsum's), then fwd_intra's w, u, qg, kg, Aqk, Akk.
    With l2norm, q and k are raw: l2norm_fwd of each first (fwd_intra reads the normalized ones),
    and its outputs follow: q, k normalized (their dtype), q_rstd, k_rstd."""
    l2 = ()
    if l2norm:
        (q, q_rstd), (k, k_rstd) = l2norm_fwd(q), l2norm_fwd(k)
        l2 = (q, k, q_rstd, k_rstd)
    gk = gate_chunk_cumsum(g, A_log, dt_bias, lower_bound, chunk_size, use_gate_in_kernel)
    return (gk, *fwd_intra(q, k, v, gk, beta, scale, chunk_size, want_qg), *l2)


def fwd_intra(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    chunk_size: int = 64,
    want_qg: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """The intra-chunk factors (fla: chunk_kda_fwd_intra, `disable_recompute=want_qg`).

    Returns w [B,T,HV,K] (k.dtype), u [B,T,HV,V] (v.dtype), qg, kg [B,T,HV,K] (k.dtype),
    Aqk, Akk [B,T,HV,BT] (k.dtype). qg = q exp2(gk) at the value heads is returned only with
    want_qg (None otherwise), as fla stores it only then. Aqk is lower-triangular including the
    diagonal and scaled; Akk = (I + L)^-1 (unit lower-triangular),
    L_ij = beta_i k_i.k_j exp2(gk_i - gk_j), i > j. Entries above the diagonal are zero (fla
    leaves Aqk's unwritten; consumers mask them)."""
    T, HV = k.shape[1], v.shape[2]
    BT = chunk_size
    dt = compute_dtype(q, k, v, gk, beta)
    qc = _to_chunks(_expand_heads(q, HV), BT, dt)
    kc = _to_chunks(_expand_heads(k, HV), BT, dt)
    Gc = _to_chunks(gk, BT, dt, edge=True)
    bc = _to_chunks(beta, BT, dt)
    Aqk = qc.new_zeros(*qc.shape[:-1], BT)
    L = torch.zeros_like(Aqk)
    for s in _chunk_blocks(kc):
        D = _decay(Gc[:, s])
        Aqk[:, s] = torch.einsum('...ik,...jk,...ijk->...ij', qc[:, s], kc[:, s], D) * scale
        L[:, s] = torch.einsum('...ik,...jk,...ijk->...ij', kc[:, s], kc[:, s], D)
    L = (L * bc.unsqueeze(-1)).tril(-1)
    eye = torch.eye(BT, dtype=dt, device=L.device)
    Akk = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    valid = _valid(T, BT, k.device)
    w, u, qg, kg = _w_u_qg_kg(qc, kc, _to_chunks(v, BT, dt), bc, Akk, Gc, valid)
    return (
        _from_chunks(w, T, k.dtype), _from_chunks(u, T, v.dtype),
        _from_chunks(qg, T, k.dtype) if want_qg else None, _from_chunks(kg, T, k.dtype),
        _from_chunks(Aqk, T, k.dtype), _from_chunks(Akk, T, k.dtype),
    )


def recompute_w_u(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    Akk: torch.Tensor,
    gk: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w, u, qg, kg from a stored Akk (fla: recompute_w_u_fwd with q given). BT = Akk.shape[-1].
    Returns w, qg, kg [B,T,HV,K] in k.dtype and u [B,T,HV,V] in v.dtype. Akk is used as given (not
    re-masked), like fla."""
    T, HV = k.shape[1], v.shape[2]
    BT = Akk.shape[-1]
    dt = compute_dtype(q, k, v, beta, Akk, gk)
    w, u, qg, kg = _w_u_qg_kg(
        _to_chunks(_expand_heads(q, HV), BT, dt), _to_chunks(_expand_heads(k, HV), BT, dt),
        _to_chunks(v, BT, dt), _to_chunks(beta, BT, dt), _to_chunks(Akk, BT, dt),
        _to_chunks(gk, BT, dt, edge=True), _valid(T, BT, k.device),
    )
    return (_from_chunks(w, T, k.dtype), _from_chunks(u, T, v.dtype),
            _from_chunks(qg, T, k.dtype), _from_chunks(kg, T, k.dtype))


def bwd_prep(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    Akk: torch.Tensor,
    lower_bound: float | None,
    use_gate_in_kernel: bool,
    chunk_size: int = 64,
    gk: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The backward's recompute of the forward's chunk factors from the saved Akk: gate_chunk_cumsum
    then recompute_w_u (kda_cute_bwd_prep does both in one kernel). g is the raw gate, as for
    fwd_prep; gk, where given (the forward's: no gate in the op), is taken as is. Returns gk, w, u,
    qg, kg."""
    if gk is None:
        gk = gate_chunk_cumsum(g, A_log, dt_bias, lower_bound, chunk_size, use_gate_in_kernel)
    return (gk, *recompute_w_u(q, k, v, beta, Akk, gk))


def _scan(kg, w, u, gk, initial_state, BT, dt, q=None, Aqk=None, scale=None, store_h=True):
    """The chunk state scan shared by fwd_h and fwd_scan, on chunked tensors.

    S = h0; per chunk c: v_new = u - w S; (o = scale qg S + tril(Aqk) v_new when q is given);
    S <- exp2(gk_last) * S + kg^T v_new. Returns (h list or None, v_new, o or None, final S)."""
    B, NT, HV = u.shape[:3]
    K, V = w.shape[-1], u.shape[-1]
    S = w.new_zeros(B, HV, K, V)
    if initial_state is not None:
        S = S + initial_state.to(dt)
    hs, vnew, outs = [], [], []
    for c in range(NT):
        if store_h:
            hs.append(S)
        vn = u[:, c] - w[:, c] @ S
        vnew.append(vn)
        if q is not None:
            qg = q[:, c] * torch.exp2(gk[:, c])
            outs.append(scale * (qg @ S) + Aqk[:, c].tril() @ vn)
        S = torch.exp2(gk[:, c, :, -1, :]).unsqueeze(-1) * S + kg[:, c].transpose(-1, -2) @ vn
    return (torch.stack(hs, 1) if store_h else None, torch.stack(vnew, 1),
            torch.stack(outs, 1) if q is not None else None, S)


def _sequences(chunks: torch.Tensor, BT: int):
    """A chunk table's sequences: (n, first token, end token) of each, on the packed row (each
    sequence padded to whole chunks: kda_chain.varlen's layout; row 0 of its [2, N + 1] table, the
    chunk offsets: the walk order in row 1 changes nothing here). Reads the table on the host."""
    offs = [int(c) * BT for c in chunks[0].tolist()]
    return [(n, offs[n], offs[n + 1]) for n in range(len(offs) - 1)]


def _state_row(state: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if state is None else state[n:n + 1]


def _passed_state(state: torch.Tensor | None, n: int, like: torch.Tensor, K: int) -> torch.Tensor:
    """An empty sequence's final state (or its initial state's gradient): its state row unchanged,
    zeros without one ([1, HV, K, V], fp32; float64 for float64 `like`)."""
    if state is not None:
        return state[n:n + 1].clone()
    dt = torch.float64 if like.dtype == torch.float64 else torch.float32
    return like.new_zeros(1, like.shape[2], K, like.shape[3], dtype=dt)


def _cat(parts: list, like: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The sequences' pieces along the packed row (an empty piece list: `like` cut to size 0)."""
    return torch.cat(parts, dim) if parts else like.narrow(dim, 0, 0)


def fwd_h(
    kg: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    gk: torch.Tensor,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    chunk_size: int = 64,
    chunks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The chunk state scan (fla: chunk_gated_delta_rule_fwd_h with gk).

    Returns h [B,NT,HV,K,V] in kg.dtype (h[:, c] = state entering chunk c), v_new = u - w h
    [B,T,HV,V] in u.dtype, ht [B,HV,K,V] float32 or None. `chunks` (int32 [2, N + 1]: the
    chunk offsets of packed sequences on a [1, T] row, then the walk order: the CuTe scans'
    table): one scan per sequence, each from its own initial_state row; ht [N, HV, K, V]."""
    if chunks is not None:
        hs, vs, hts = [], [], []
        for n, a, b in _sequences(chunks, chunk_size):
            if a == b:  # an empty sequence: its state passes through
                hts.append(_passed_state(initial_state, n, u, kg.shape[-1]))
                continue
            h0 = _state_row(initial_state, n)
            h, v, ht = fwd_h(kg[:, a:b], w[:, a:b], u[:, a:b], gk[:, a:b], h0, True, chunk_size)
            hs, vs, hts = hs + [h], vs + [v], hts + [ht]
        h_like = kg.new_empty(1, 0, u.shape[2], kg.shape[-1], u.shape[-1])
        return _cat(hs, h_like), _cat(vs, u), (torch.cat(hts) if output_final_state else None)
    T, BT = u.shape[1], chunk_size
    dt = compute_dtype(kg, w, u, gk, initial_state)
    h, vnew, _, S = _scan(
        _to_chunks(kg, BT, dt), _to_chunks(w, BT, dt), _to_chunks(u, BT, dt),
        _to_chunks(gk, BT, dt, edge=True), initial_state, BT, dt,
    )
    return h.to(kg.dtype), _from_chunks(vnew, T, u.dtype), (S if output_final_state else None)


def fwd_o(
    q: torch.Tensor,
    v_new: torch.Tensor,
    gk: torch.Tensor,
    Aqk: torch.Tensor,
    h: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """o = scale (q exp2(gk)) h_c + tril(Aqk) v_new per chunk (fla: chunk_gla_fwd_o_gk).
    q at qk heads [B,T,H,K]; Aqk's upper triangle is masked here. Returns o [B,T,HV,V] in v_new.dtype."""
    T, HV = v_new.shape[1], v_new.shape[2]
    BT = Aqk.shape[-1]
    dt = compute_dtype(q, v_new, gk, Aqk, h)
    qg = _to_chunks(_expand_heads(q, HV), BT, dt) * torch.exp2(_to_chunks(gk, BT, dt, edge=True))
    o = scale * (qg @ h.to(dt)) + _to_chunks(Aqk, BT, dt).tril() @ _to_chunks(v_new, BT, dt)
    return _from_chunks(o, T, v_new.dtype)


def fwd_scan(
    q: torch.Tensor,
    qg: torch.Tensor | None,
    kg: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    gk: torch.Tensor,
    Aqk: torch.Tensor,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    scale: float,
    chunks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fwd_h and fwd_o fused: the readout happens inside the scan, h is never stored.
    qg (fwd_intra's, or None) is ignored: the oracle gates q with gk itself, in the compute dtype.
    Returns o [B,T,HV,V] in u.dtype and ht [B,HV,K,V] float32 or None. `chunks`: as fwd_h's."""
    if chunks is not None:
        os_, hts = [], []
        for n, a, b in _sequences(chunks, Aqk.shape[-1]):
            if a == b:
                hts.append(_passed_state(initial_state, n, u, kg.shape[-1]))
                continue
            h0 = _state_row(initial_state, n)
            o, ht = fwd_scan(q[:, a:b], None, kg[:, a:b], w[:, a:b], u[:, a:b], gk[:, a:b], Aqk[:, a:b], h0,
                             True, scale)
            os_, hts = os_ + [o], hts + [ht]
        return _cat(os_, u), (torch.cat(hts) if output_final_state else None)
    T, HV = u.shape[1], u.shape[2]
    BT = Aqk.shape[-1]
    dt = compute_dtype(q, kg, w, u, gk, Aqk, initial_state)
    _, _, o, S = _scan(
        _to_chunks(kg, BT, dt), _to_chunks(w, BT, dt), _to_chunks(u, BT, dt),
        _to_chunks(gk, BT, dt, edge=True), initial_state, BT, dt,
        q=_to_chunks(_expand_heads(q, HV), BT, dt), Aqk=_to_chunks(Aqk, BT, dt), scale=scale,
        store_h=False,
    )
    return _from_chunks(o, T, u.dtype), (S if output_final_state else None)


# ----------------------------------------------------------------------------------------------
# Backward stages
# ----------------------------------------------------------------------------------------------

def bwd_dAv(
    v_new: torch.Tensor,
    do: torch.Tensor,
    Aqk: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients through o's intra-chunk term tril(Aqk) v_new (fla: chunk_kda_bwd_dAv).

    dAqk = scale * tril(do v_new^T) [B,T,HV,BT] float32: the gradient of the UNSCALED score
    q_i.k_j exp2(..), which is what bwd_intra consumes. dv = tril(Aqk)^T do [B,T,HV,V] in do.dtype."""
    T, BT = do.shape[1], Aqk.shape[-1]
    dt = compute_dtype(v_new, do, Aqk)
    doc = _to_chunks(do, BT, dt)
    dA = scale * (doc @ _to_chunks(v_new, BT, dt).transpose(-1, -2)).tril()
    dv = _to_chunks(Aqk, BT, dt).tril().transpose(-1, -2) @ doc
    return _from_chunks(dA, T, dt), _from_chunks(dv, T, do.dtype)


def bwd_dhu(
    qg: torch.Tensor,
    kg: torch.Tensor,
    w: torch.Tensor,
    gk: torch.Tensor,
    h0: torch.Tensor | None,
    dht: torch.Tensor | None,
    do: torch.Tensor,
    dv: torch.Tensor | None,
    scale: float,
    Aqk: torch.Tensor | None = None,
    chunk_size: int = 64,
    chunks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The reverse state scan (fla: chunk_gated_delta_rule_bwd_dhu with gk).

    dS = dht (or 0); for c from last to first: dh[:, c] = dS; dv2_c = kg_c dS + dv_c;
    dS <- exp2(gk_last) * dS + scale qg_c^T do_c - w_c^T dv2_c. dh0 = final dS.
    With Aqk (the fused form, kda_cute_dhu's): dv_c = tril(Aqk_c)^T do_c (bwd_dAv's dv, computed
    here; plus the given dv if any). Returns dh [B,NT,HV,K,V] in qg.dtype, dh0 [B,HV,K,V] float32
    (None when h0 is None), dv2 [B,T,HV,V] in dv.dtype, do's without dv (the total gradient of
    v_new). `chunks`: as fwd_h's (one reverse scan per sequence from its dht row; dh0 [N, ...])."""
    if chunks is not None:
        dhs, dv2s, dh0s = [], [], []
        V = do.shape[-1]
        for n, a, b in _sequences(chunks, chunk_size):
            if a == b:
                dh0s.append(_passed_state(dht, n, do, qg.shape[-1]))
                continue
            rows = slice(a, b)
            # (a non-None h0 asks for dh0: bwd_dhu reads h0 for that alone)
            dh, dh0, dv2 = bwd_dhu(qg[:, rows], kg[:, rows], w[:, rows], gk[:, rows], do.new_zeros(1),
                                   _state_row(dht, n), do[:, rows], None if dv is None else dv[:, rows],
                                   scale,
                                   None if Aqk is None else Aqk[:, rows], chunk_size)
            dhs, dv2s, dh0s = dhs + [dh], dv2s + [dv2], dh0s + [dh0]
        dh_like = qg.new_empty(1, 0, do.shape[2], qg.shape[-1], V)
        return _cat(dhs, dh_like), (torch.cat(dh0s) if h0 is not None else None), _cat(dv2s, do)
    B, T, HV, K = qg.shape
    V, BT = do.shape[-1], chunk_size
    dt = compute_dtype(qg, kg, w, gk, h0, dht, do, dv, Aqk)
    qgc, kgc, wc = (_to_chunks(x, BT, dt) for x in (qg, kg, w))
    Gc = _to_chunks(gk, BT, dt, edge=True)
    doc = _to_chunks(do, BT, dt)
    dvc = 0 if dv is None else _to_chunks(dv, BT, dt)
    if Aqk is not None:
        dvc = dvc + _to_chunks(Aqk, BT, dt).tril().transpose(-1, -2) @ doc
    dS = qg.new_zeros(B, HV, K, V, dtype=dt)
    if dht is not None:
        dS = dS + dht.to(dt)
    dhs, dv2s = [], []
    for c in reversed(range(doc.shape[1])):
        dhs.append(dS)
        dv2 = kgc[:, c] @ dS + dvc[:, c]
        dv2s.append(dv2)
        dS = (torch.exp2(Gc[:, c, :, -1, :]).unsqueeze(-1) * dS
              + scale * qgc[:, c].transpose(-1, -2) @ doc[:, c] - wc[:, c].transpose(-1, -2) @ dv2)
    dh = torch.stack(dhs[::-1], 1).to(qg.dtype)
    dv2 = _from_chunks(torch.stack(dv2s[::-1], 1), T, (do if dv is None else dv).dtype)
    return dh, (dS if h0 is not None else None), dv2


def bwd_wy_dqkg(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    v_new: torch.Tensor,
    gk: torch.Tensor,
    beta: torch.Tensor,
    Akk: torch.Tensor,
    h: torch.Tensor,
    do: torch.Tensor,
    dh: torch.Tensor,
    dv: torch.Tensor,
    scale: float,
    want_dAqk: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Gradients through the inter-chunk terms and the WY representation
    (fla: chunk_kda_bwd_wy_dqkg_fused). dv is dhu's dv2, the total gradient of v_new. With
    want_dAqk also bwd_dAv's dAqk = scale tril(do v_new^T) (kda_cute_wy_dqkg's fused form: the
    kernel holds do and v_new already), as a seventh output.

    Per chunk, with E = exp2(gk), gn = gk at the chunk's last real row, A = Akk:
      dq   = scale (do h^T) E                        (through o's inter term qg h)
      dk'  = (v_new dh^T) exp2(gn - gk)              (through kg in the state update)
      dw   = -dv h^T;   dA = (dv v^T + dw (k E)^T) * beta_j      (gradient of A)
      dv_out = (A^T dv) beta;   dkb = A^T dw;   db = sum_v (A^T dv) v + sum_k dkb k E
      dk   = dk' + dkb E beta
      dg   = q dq - k dk' + [last row] (sum_v h dh exp2(gn) + sum_t k dk') + k E dkb beta
      dAkk = -(A^T strict_lower(dA) A^T), strictly lower: the gradient of L in Akk = (I + L)^-1.
    Returns dq, dk [B,T,HV,K] float32 (at VALUE heads; gva_sum reduces them), dv [B,T,HV,V] in
    v.dtype, db [B,T,HV] float32, dg [B,T,HV,K] float32 (w.r.t. the natural-log cumulative gate,
    not yet reverse-cumsummed), dAkk [B,T,HV,BT] float32."""
    T, HV = v.shape[1], v.shape[2]
    BT = Akk.shape[-1]
    dt = compute_dtype(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv)
    qc = _to_chunks(_expand_heads(q, HV), BT, dt)
    kc = _to_chunks(_expand_heads(k, HV), BT, dt)
    vc, vnc, doc, dvc = (_to_chunks(x, BT, dt) for x in (v, v_new, do, dv))
    Gc = _to_chunks(gk, BT, dt, edge=True)
    bc = _to_chunks(beta, BT, dt).unsqueeze(-1)
    A = _to_chunks(Akk, BT, dt)
    hT, dhT = h.to(dt).transpose(-1, -2), dh.to(dt).transpose(-1, -2)
    valid = _valid(T, BT, q.device)[None, :, None, :]
    last = _last_row(T, BT, q.device)[None, :, None, :, None]
    gn = Gc[..., -1:, :]

    E = torch.exp2(Gc)
    dq = scale * (doc @ hT) * E
    dkp = (vnc @ dhT) * torch.exp2(gn - Gc) * valid.unsqueeze(-1)
    dw = -(dvc @ hT)
    kE = kc * E
    dA = (dvc @ vc.transpose(-1, -2) + dw @ kE.transpose(-1, -2)) * bc.transpose(-1, -2)
    AT = A.transpose(-1, -2)
    dvb = AT @ dvc
    dkb = AT @ dw
    db = (dvb * vc).sum(-1) + (dkb * kE).sum(-1)
    dgn = (h.to(dt) * dh.to(dt)).sum(-1) * torch.exp2(gn.squeeze(-2)) + (kc * dkp).sum(-2)
    dg = qc * dq - kc * dkp + last * dgn.unsqueeze(-2) + kE * dkb * bc
    dk = dkp + dkb * E * bc
    strict = _tri(BT, q.device, strict=True) & valid.unsqueeze(-1) & valid.unsqueeze(-2)
    dAkk = -(AT @ (dA * strict) @ AT) * strict
    outs = (_from_chunks(dq, T, dt), _from_chunks(dk, T, dt), _from_chunks(dvb * bc, T, v.dtype),
            _from_chunks(db, T, dt), _from_chunks(dg, T, dt), _from_chunks(dAkk, T, dt))
    if want_dAqk:
        outs += (_from_chunks(scale * (doc @ vnc.transpose(-1, -2)).tril(), T, dt),)
    return outs


def bwd_intra(
    q: torch.Tensor,
    k: torch.Tensor,
    gk: torch.Tensor,
    beta: torch.Tensor,
    dAqk: torch.Tensor,
    dAkk: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    db: torch.Tensor,
    dg: torch.Tensor,
    fold_dg: bool = False,
    emit_bf16: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients through the intra-chunk matrices (fla: chunk_kda_bwd_intra, safe_gate off).

    With D_ij = exp2(gk_i - gk_j) (i >= j) and dAqk, dAkk read on and below the diagonal (as fla):
      row side:    dq2_i = sum_j dAqk_ij k_j D_ij;   dk2_i = sum_j dAkk_ij k_j D_ij
      column side: dkt_j = sum_i (dAqk_ij q_i + dAkk_ij beta_i k_i) D_ij
      dq += dq2;  dk += beta dk2 + dkt;  db += sum_k dk2 k;  dg += q dq2 + (beta dk2 - dkt) k
    (dAqk is the gradient of the unscaled score, so no scale appears; dAkk that of L, whose rows
    carry beta.) The incoming dq, dk, db, dg (bwd_wy_dqkg's) are added.

    Returns dq, dk [B,T,HV,K] in dq's / dk's dtype (q.dtype when emit_bf16: the cast a fused
    epilogue does, meant for HV == H where no fp32 GVA sum follows), db [B,T,HV] float32,
    dg [B,T,HV,K] float32: per element, or with fold_dg already reverse-cumsummed within each chunk
    (= dg_cumsum of the unfolded dg)."""
    T, HV = gk.shape[1], gk.shape[2]
    BT = dAqk.shape[-1]
    dt = compute_dtype(q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg)
    qc = _to_chunks(_expand_heads(q, HV), BT, dt)
    kc = _to_chunks(_expand_heads(k, HV), BT, dt)
    Gc = _to_chunks(gk, BT, dt, edge=True)
    bc = _to_chunks(beta, BT, dt).unsqueeze(-1)
    lower = _tri(BT, q.device, strict=False)
    dAq = _to_chunks(dAqk, BT, dt) * lower
    dAk = _to_chunks(dAkk, BT, dt) * lower
    dq2, dk2, dkt = torch.zeros_like(qc), torch.zeros_like(qc), torch.zeros_like(qc)
    for s in _chunk_blocks(kc):
        D = _decay(Gc[:, s])
        dq2[:, s] = torch.einsum('...ij,...jk,...ijk->...ik', dAq[:, s], kc[:, s], D)
        dk2[:, s] = torch.einsum('...ij,...jk,...ijk->...ik', dAk[:, s], kc[:, s], D)
        dkt[:, s] = (torch.einsum('...ij,...ik,...ijk->...jk', dAq[:, s], qc[:, s], D)
                     + torch.einsum('...ij,...ik,...ijk->...jk', dAk[:, s], bc[:, s] * kc[:, s], D))
    db_out = _from_chunks((dk2 * kc).sum(-1), T, dt) + db.to(dt)
    dk2 = dk2 * bc
    dg_out = _from_chunks(qc * dq2 + (dk2 - dkt) * kc, T, dt) + dg.to(dt)
    dq_out = _from_chunks(dq2, T, dt) + dq.to(dt)
    dk_out = _from_chunks(dk2 + dkt, T, dt) + dk.to(dt)
    if fold_dg:
        dg_out = dg_cumsum(dg_out, BT)
    dq_dtype, dk_dtype = (q.dtype, q.dtype) if emit_bf16 else (dq.dtype, dk.dtype)
    return dq_out.to(dq_dtype), dk_out.to(dk_dtype), db_out, dg_out


def bwd_chunk(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale: float, emit_bf16: bool = False,
              q_rstd: torch.Tensor | None = None,
              k_rstd: torch.Tensor | None = None,
              g: torch.Tensor | None = None,
              A_log: torch.Tensor | None = None,
              dt_bias: torch.Tensor | None = None,
              lower_bound: float | None = None) -> tuple[torch.Tensor | None, ...]:
    """The whole chunk-parallel backward after the scans (kda_cute_bwd_chunk does it in one
    kernel; the tensors as bwd_wy_dqkg's): bwd_wy_dqkg, bwd_dAv's dA, then bwd_intra with fold_dg,
    with q_rstd, k_rstd l2norm_bwd of dq, dk (q, k being the normalized ones), and with A_log (the
    gate in the op; g the raw gate) gate_bwd of dg. Returns dq, dk (q's dtype with emit_bf16 or the
    rstds, else the compute dtype), dv2, db, dg (reverse-cumsummed within each chunk; with A_log
    the raw gate's gradient in g's dtype), dA_log, ddt_bias (gate_bwd's; None without A_log)."""
    dq, dk, dv2, db, dg, dAkk = bwd_wy_dqkg(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale)
    dAqk = bwd_dAv(v_new, do, torch.zeros_like(Akk), scale)[0]
    dq, dk, db, dg = bwd_intra(q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg, fold_dg=True,
                               emit_bf16=emit_bf16 and q_rstd is None)
    if q_rstd is not None:
        dq, dk = l2norm_bwd(q, q_rstd, dq), l2norm_bwd(k, k_rstd, dk)
    dA_log = ddt_bias = None
    if A_log is not None:
        dg, dA_log, ddt_bias = gate_bwd(g, A_log, dt_bias, dg, lower_bound)
    return dq, dk, dv2, db, dg, dA_log, ddt_bias
