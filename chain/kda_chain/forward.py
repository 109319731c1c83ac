"""The forward composition. Stages, in order (each one dispatched through `stages`):

    beta_sigmoid_fwd           only with use_beta_sigmoid_in_kernel (x2 with allow_neg_eigval)
    l2norm_fwd (q, k)          only with use_qk_l2norm_in_kernel, and only where fwd_prep does not
                               run its CuTe kernel (which then takes the raw q, k with l2norm=True
                               and returns them normalized, with their rstds: two launches and one
                               read of q, k fewer)
    fwd_prep                   kda_cute_prep: the gate (in kernel, or the given log-gate) -> gk, its
                               log2 chunk cumsum, and w, u, qg, kg, Aqk, Akk per chunk (fla:
                               kda_gate_chunk_cumsum + chunk_kda_fwd_intra); qg (q * exp2(gk), what
                               kda_cute_fwd reads instead of q) only when that kernel could run
                               (`stages.cute_planned("fwd", ...)`), else None
    fwd                        kda_cute_fwd: the state scan fused with the readout -> o, ht
                               (fla: chunk_gated_delta_rule_fwd_h + chunk_gla_fwd_o_gk, from q)

    b1                         only with disable_recompute: kda_cute_b1's h (bf16 per chunk) and
                               v_new, kept for the backward (fwd does not store them)

What is saved for backward is what fla 0.6.0 saves: q, k (after l2norm) with their rstd, v, the
raw g, beta (raw and activated), A_log, dt_bias, Aqk, Akk, initial_state, and gk when the gate is
not in the kernel (the backward's bwd_prep then reads it instead of recomputing it: no gate, no
cumsum, no gk written); with the gate in the kernel bwd_prep recomputes gk from g.
With disable_recompute, as fla: also gk and w, u, qg, kg, h, v_new (`Kept`), so the backward
skips bwd_prep and b1.

A packed call given its `Packing` (kda_chain.varlen) passes the packed inputs [1, total_T, ...]
themselves: kda_cute_prep reads them through the packing's chunk table and writes, beside its own
outputs, q and k on the padded row (normalized with the L2 norm in the op, else copies); v, the raw
gate and the activated beta are saved on the packed row as they came (`Saved.packed_in`: the
backward's kernels read them there, a stage that does not gathers them), so nothing is gathered in;
where its CuTe kernel does not take the call the inputs are gathered onto the padded row first
(`kda::varlen_io::gather` with the reason) and the chain runs as for a padded call. kda_cute_fwd
writes o on the packed row through the same table (`_scan_out`); where it does not take the call,
o comes out on the padded row and is gathered (recorded likewise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import stages as S


@dataclass(frozen=True)
class Flags:
    scale: float
    chunk_size: int
    output_final_state: bool
    use_qk_l2norm_in_kernel: bool
    use_gate_in_kernel: bool
    use_beta_sigmoid_in_kernel: bool
    allow_neg_eigval: bool
    lower_bound: float | None
    disable_recompute: bool = False

    @property
    def beta_scale(self) -> float:
        return 2.0 if self.allow_neg_eigval else 1.0


@dataclass
class Kept:
    """What disable_recompute keeps from the forward for the backward (fla's set): w, u, qg, kg
    [B, T, HV, K / V] in the io dtype, h [B, NT, HV, K, V] (the state entering each chunk, io
    dtype), v_new [B, T, HV, V]."""

    w: torch.Tensor
    u: torch.Tensor
    qg: torch.Tensor
    kg: torch.Tensor
    h: torch.Tensor
    v_new: torch.Tensor


@dataclass
class Saved:
    q: torch.Tensor
    q_rstd: torch.Tensor | None
    k: torch.Tensor
    k_rstd: torch.Tensor | None
    v: torch.Tensor
    gk: torch.Tensor | None
    g: torch.Tensor | None  # None only on a packed call's rows without the gate in the op
    beta_raw: torch.Tensor
    beta: torch.Tensor
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    Aqk: torch.Tensor
    Akk: torch.Tensor
    initial_state: torch.Tensor | None
    kept: Kept | None = None
    chunks: torch.Tensor | None = None  # a packed call's chunk table (kda_chain.varlen), for the scans
    plan: tuple | None = None  # the forward's plan key (`stages.planned`), where this call kept it
    # a packed call given its Packing (module doc): every saved tensor is on the padded row but
    # beta_raw (the packed row's); the backward writes the gradients on the packed row
    packing: object | None = None
    packed_in: bool = False  # with the packing: v, g, beta on the packed row too (the native prep)


def forward(q, k, v, g, beta, A_log, dt_bias, initial_state, f: Flags, chunks=None, packing=None):
    """-> o (q's dtype), ht (fp32 or None), Saved. chunks: a packed call's chunk table (the
    inputs on kda_chain.varlen's padded row): the scans walk each sequence; states [N, ...].
    packing: a packed call's kda_chain.varlen.Packing with the inputs on the packed row (module
    doc; chunks is then its chunk table); o comes out on the packed row where kda_cute_fwd writes
    it there (`_scan_out`), else on the padded row."""
    table = None if packing is None else packing.table
    with S.planned("fwd", q, k, v, g, beta, A_log, dt_bias, initial_state, chunks, table, f) as key:
        o, ht, saved = _forward(q, k, v, g, beta, A_log, dt_bias, initial_state, f, chunks, packing)
    saved.plan = key
    saved.packing = packing
    return o, ht, saved


def _padded_form(x: torch.Tensor, T_pad: int) -> torch.Tensor:
    """A [1, T_pad, ...] stand-in of x's dtype and device (a stride-0 view of its first row), for
    the questions asked of the padded row's shapes before it exists (`cute_planned`)."""
    return x[:, :1].expand(1, T_pad, *x.shape[2:])


def _native_prep(q, k, prep_in, f: Flags, packing):
    """kda_cute_prep on the packed inputs through the chunk table -> ((gk, w, u, qg, kg, Aqk, Akk,
    q, k on the padded row, v, g (None without the gate in the op), beta on the packed row,
    q_rstd, k_rstd), None), or (None, the reason) where the kernel does not take the call (the
    caller gathers the inputs then)."""
    l2 = f.use_qk_l2norm_in_kernel
    impl, reason = S.fwd_prep.choose(q, k, *prep_in, l2norm=l2, table=packing.table)
    if impl.name != "cute":
        return None, f"fwd_prep: {reason}"
    S.varlen_rows("native")
    out = S.fwd_prep.run(impl, reason, q, k, *prep_in, l2norm=l2, table=packing.table)
    rstd = out[9:11] if l2 else (None, None)
    v, g, beta = prep_in[:3]
    return (*out[:7], *out[-2:], v, g if f.use_gate_in_kernel else None, beta, *rstd), None


def _scan_out(fwd_in: tuple, chunks, packing):
    """The fwd stage -> o, ht. A packed call's o goes straight onto the packed row where
    kda_cute_fwd takes the chunk table (each chunk's valid rows stored at its first packed token);
    elsewhere o stays on the padded row and `varlen.Native` gathers it (recorded with the reason)."""
    if packing is None:
        return S.fwd(*fwd_in, chunks=chunks)
    kw = dict(chunks=chunks, table=packing.table, T_raw=packing.T)
    impl, reason = S.fwd.choose(*fwd_in, **kw)
    if impl.name == "cute":
        S.varlen_rows("native")
        return S.fwd.run(impl, reason, *fwd_in, **kw)
    S.varlen_rows("gather", f"fwd: {reason}")
    return S.fwd(*fwd_in, chunks=chunks)


def _forward(q, k, v, g, beta, A_log, dt_bias, initial_state, f: Flags, chunks, packing=None):
    q_rstd = k_rstd = None
    beta_raw = beta
    if f.use_beta_sigmoid_in_kernel:
        beta = S.beta_sigmoid_fwd(beta_raw, f.beta_scale)
    qs, vs = (q, v) if packing is None else (_padded_form(q, packing.T_pad), _padded_form(v, packing.T_pad))
    want_qg = f.disable_recompute or S.cute_planned("fwd", qs, vs, initial_state, chunks)  # (q's shape only)

    def prep_in(v, g, beta):
        return (v, g, beta, A_log, dt_bias, f.lower_bound, f.use_gate_in_kernel, f.scale, f.chunk_size,
                want_qg)

    native = why = None
    if packing is not None:
        native, why = _native_prep(q, k, prep_in(v, g, beta), f, packing)
    if native is not None:
        # (g None without the gate in the op: the backward then reads gk, never g; bwd_prep takes
        # g=None with gk given)
        gk, w, u, qg, kg, Aqk, Akk, q, k, v, g, beta, q_rstd, k_rstd = native
    else:
        if packing is not None:  # the CuTe prep passed the call over: the inputs onto the padded row
            from .varlen import pad_inputs

            with S.varlen_io("gather", why):
                q, k, v, g, beta = pad_inputs(q, k, v, g, beta, packing, lower_bound=f.lower_bound,
                                              use_gate_in_kernel=f.use_gate_in_kernel)
        pin = prep_in(v, g, beta)
        if f.use_qk_l2norm_in_kernel:
            impl, reason = S.fwd_prep.choose(q, k, *pin, l2norm=True)
            if impl.name == "cute":  # the L2 norm inside kda_cute_prep: no l2norm_fwd launches
                gk, w, u, qg, kg, Aqk, Akk, q, k, q_rstd, k_rstd = S.fwd_prep.run(impl, reason, q, k, *pin,
                                                                                 l2norm=True)
            else:
                q, q_rstd = S.l2norm_fwd(q)
                k, k_rstd = S.l2norm_fwd(k)
                gk, w, u, qg, kg, Aqk, Akk = S.fwd_prep.run(impl, reason, q, k, *pin)
        else:
            gk, w, u, qg, kg, Aqk, Akk = S.fwd_prep(q, k, *pin)
    fwd_in = (q, qg, kg, w, u, gk, Aqk, initial_state, f.output_final_state, f.scale)
    o, ht = _scan_out(fwd_in, chunks, packing)
    kept = None
    if f.disable_recompute:  # the states for the backward: fwd keeps none (b1: 1.4 ms at the ref shape)
        h, v_new, _ = S.b1(kg, w, u, gk, initial_state, False, chunks=chunks)
        kept = Kept(w, u, qg, kg, h, v_new)
    keep_gk = kept is not None or not f.use_gate_in_kernel  # fla's rule (its memory, no more)
    saved = Saved(q, q_rstd, k, k_rstd, v, gk if keep_gk else None, g, beta_raw,
                  beta, A_log, dt_bias, Aqk, Akk, initial_state, kept, chunks, packed_in=native is not None)
    return (o if o.dtype == q.dtype else o.to(q.dtype)), ht, saved
