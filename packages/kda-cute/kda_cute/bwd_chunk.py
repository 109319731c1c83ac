"""kda_cute_bwd_chunk: the whole chunk-parallel backward after the two scans on sm_90, one kernel
(fla 0.6.0's `chunk_kda_bwd_wy_dqkg_fused` + `chunk_kda_bwd_dAv`'s dA + `chunk_kda_bwd_intra` +
the reverse `chunk_local_cumsum` of dg, and with the gate in the op `kda_gate_bwd`; the chain's
stage `bwd_chunk`).

Per chunk of BT = 64 tokens and value head hv, from the scans' h, dh, v_new, dv and the recomputed
factors (gk, Akk), every gradient of the chunk-parallel backward:

    the WY / state part (kda_cute.wy_dqkg's contract, with want_dAqk): dq, dk, dv2, db, dg,
        dAkk = the gradient through Akk, dAqk = scale tril(do v_new^T)
    the intra-chunk part (kda_cute.intra's contract, fold_dg): dq, dk, db, dg += the terms
        through Aqk and Akk; dg reverse-cumsummed within the chunk; dq / dk in q's dtype with
        emit_bf16 (HV == H), else fp32 (the chain sums them over the GVA group)
    with q_rstd, k_rstd (use_qk_l2norm_in_kernel, HV == H): dq, dk through the L2 norm's backward
        (fla's l2norm_bwd: dx = dy r - y (dy . y) r, y the normalized q / k this kernel reads), so
        they are the gradients of the raw q / k, in q's dtype; the walk leaves them in smem (fp32)
        and a row pass (4 rows per warp) finishes them
    with g, A_log (and dt_bias, lower_bound: use_gate_in_kernel): dg through fla's gate backward
        (kda_gate_bwd; x = g + dt_bias, the raw gate): softplus form dg = -exp(A) dg sigmoid(x),
        dA += dg (-exp(A) softplus(x)); lower_bound form s = sigmoid(exp(A) x), dg = dg lb s (1 - s)
        exp(A), dA += dg x; ddt_bias += dg. The walk leaves the folded dg in smem (fp32), a row pass
        (4 rows per warp, g's rows read as vectors) writes dg in g's dtype and each CTA its chunk's
        fp32 partials dA_log [B, NT, HV], ddt_bias [B, NT, HV, K] (warps reduced in a fixed order
        through the walk's dead dAqk tile: no atomics, bitwise repeatable); the host sums them over
        (B, NT) with torch as fla sums its per-block ones (dA_log in A_log's dtype and shape,
        ddt_bias [HV * K] in dt_bias's)
    with a chunk `table` and T_raw (varlen: packed sequences, kda_chain.varlen; B == 1): do, the
        user's output gradient, v, beta and the raw gate on the packed row [1, T_raw, ...] as the
        user gave them (beta after the op's sigmoid); the other inputs on the padded row [1, T,
        ...] as without a table (every sequence starting on a chunk, its last chunk filled with
        pad rows; the rstds too; T comes from v_new); the five outputs dq, dk, dv2, db, dg on the
        packed row [1, T_raw, ...]. table int32 [T / 64, 2], per chunk c of the padded row
        table[c, 0] the packed row of its first row and table[c, 1] its valid rows nv (1..64): its
        row r < nv is packed row table[c, 0] + r, for the packed inputs' loads and for the
        gradients' stores. Rows r >= nv are neither loaded nor stored (they are the next
        sequence's, another CTA's, or past the end): do's, v's and beta's pad rows are zeros in
        the kernel, the raw gate's the chain's pad gate (its load clamped to row nv - 1, then
        replaced: `_warp.gate_pad_value`), so no value there, NaN / Inf / -0 among them, reaches a
        gradient; the pad rows' gradients are never stored, so the chain gathers nothing in and
        no gradient back. The arithmetic is the padded build's on pack_inputs' padded row: each
        packed row bit for bit its padded row's. The gate's partials stay per padded chunk. A
        kernel of its own (wy_dqkg's `_Varlen`): the build without a table is unchanged
    with a table and qk_padded=True (GVA with the L2 norm in the op: the chain's l2norm_bwd runs
        after this kernel on the padded row, on the padded normalized q / k and rstds): dq, dk on
        the padded row [1, T, HV, K] exactly as without the table (all 64 rows of every chunk,
        pad rows included), dv2, db, dg on the packed row as above; not with q_rstd (the L2 norm's
        backward inside), a compile-time field of the varlen build (part of the compile key)

The kernel is kda_cute_wy_dqkg's class compiled with `fused=True` (kda_cute.wy_dqkg's docstring
has its CTA decomposition: 512 threads, the V walk in 64-wide tiles on bf16 mma.sync, the
epilogue's GEMMs), whose epilogue hands dq, dk, dg, dAqk, dAkk (fp32) and db to the intra walk
(kda_cute._intra_walk: a thread per key column, here 4 groups of 128 threads, one 16-row block
each) through smem instead of global memory. One region of 146.5 KB holds the V ring during the
walk over V, then the epilogue's tiles, then the walk's operands (wy_dqkg.R_*: the offsets); q, k
(rows padded to 136 elements, the walk's layout) and gk (136 floats) are loaded once and serve
both parts. ~219 KB of smem, one CTA per SM.

Bytes per call, B16 T8192 H=HV=16 K128 V256 bf16 (emit_bf16):

    read    q, k 1.074 GB, gk 1.074, v, v_new, do, dv 4.295, h, dh 4.295, Akk 0.268   11.01 GB
    write   dq, dk 1.074 GB, dg 1.074, dv2 1.074, db 0.008                              3.23 GB
    total   14.24 GB: 3.56 ms at 4.0 TB/s (kda_cute_wy_dqkg + kda_cute_intra: 16.39 + 8.61 GB)

    with the gate (g bf16): read + g 0.537 GB, write dg in bf16 0.537 instead of fp32 1.074, the
    partials 0.017: the same 14.26 GB

What it removes: the fp32 dq, dk, dg, dAqk, dAkk that went out of wy_dqkg and back into intra
(10.7 GB of traffic at that shape), with the rstds the two l2norm_bwd passes, and with the gate
fla's kda_gate_bwd (its g, fp32 dg in, dg out: 2.15 GB): four launches.

Today (H200, 2026-12-03, commit b73b5ef, bench/check_stage.py --stage bwd_chunk, the chain's flags:
gate + l2norm in the op, same run): 7.92 ms at the reference shape against our previous
kda_cute_wy_dqkg + kda_cute_intra + 2 x kda_cute_l2norm_bwd + fla's kda_gate_bwd 9.92 (1.25x) and
fla's kernels 30.29 (3.82x); 6.72 vs 8.63 / 27.53 at B16 T8192 H16 K=V=128, 0.541 vs 0.720 / 1.884
at B2 T4096. The row passes' global operands (rstds, raw gate) are prefetched into L2 before the
walk and loaded all at once after it (they had been one DRAM round trip per row: 8.51 -> 7.92 ms).
Not bandwidth-bound (1.8 TB/s of its 14.24 GB): one CTA per SM runs the V walk, the epilogue and
the intra walk one after another with nothing beside them (Nsight Compute: 36% / 16% / 27% of the
stall samples). Every output's error vs float64 within 2x of fla's (dA_log up to 1.5x, the others
at or below), bitwise repeatable (bench/results/bwd_chunk.md, docs/perf/bwd_chunk.md).

Constraints: kda_cute_wy_dqkg's (K = 128, V % 64 == 0, T % 64 == 0, HV % H == 0, dtypes, contiguous
and 16-byte aligned). This module is the stage's host side; the device code is wy_dqkg's class and
the shared intra walk, so neither part can drift from its standalone kernel.

Validated on CPU by the PTX interpreter (tests/kda_cute/test_bwd_chunk_compile.py) against
float64 and against the two standalone kernels' PTX (the gate build: against the build without it
followed by the gate's backward in fp32); the varlen build against the build without a table
(tests/kda_cute/test_bwd_chunk_varlen.py: the varlen build on a packed do, v, beta and raw gate
whose rows no chunk reads, between and around the sequences, are NaN / Inf, the padded build on
pack_inputs' padded rows; bit for bit at every packed row, nothing stored outside them). The gate build is
not timed on its own on the H200 yet (the figures above are the chain's flags, with it); the
varlen build ran there through the chain (tests/gpu/test_varlen_gpu.py, 2026-12-04, do still on
the padded row then: every gradient within 2x fla's error, packed sequences bitwise
independent), not timed on its own.
"""

from __future__ import annotations

import inspect

import torch

from . import _warp
from . import wy_dqkg as _wy
from ._common.cache import CallCache, alloc

BT = _wy.BT
_cache = CallCache("kda_cute_bwd_chunk")


def _rstd_reason(q, v, q_rstd, k_rstd) -> str | None:
    if (q_rstd is None) != (k_rstd is None):
        return "q_rstd and k_rstd go together"
    if q_rstd is None:
        return None
    if v.shape[2] != q.shape[2]:
        return f"the L2 norm's backward inside needs HV == H (got HV={v.shape[2]}, H={q.shape[2]})"
    return (_warp.rstd_reason("q_rstd", q_rstd, q) or _warp.rstd_reason("k_rstd", k_rstd, q)
            or _warp.layout_reason(("q_rstd", "k_rstd"), (q_rstd, k_rstd)))


def _gate_reason(gk, g, A_log, dt_bias, T_raw=None) -> str | None:
    """The gate's backward inside (A_log given): g the raw gate [B, T, HV, K] (varlen: the packed
    row's [1, T_raw, HV, K]; fp32 / bf16 / fp16, contiguous, 16-byte aligned), A_log of HV
    elements, dt_bias (optional) of HV * K; or why not."""
    if A_log is None:
        return None if g is None and dt_bias is None else "the gate's backward inside needs A_log"
    if g is None:
        return "the gate's backward inside needs the raw gate g"
    HV, K = gk.shape[2], gk.shape[3]
    want = tuple(gk.shape) if T_raw is None else (1, T_raw, HV, K)
    if tuple(g.shape) != want:
        return f"g must be [B,T,HV,K] = {want}; got {tuple(g.shape)}"
    if g.dtype not in _warp.G_DTYPES:
        return f"g dtype {g.dtype} (fp32 / bf16 / fp16 expected)"
    if A_log.numel() != HV or not A_log.is_floating_point():
        return f"A_log must be {HV} floats (one per value head); got {tuple(A_log.shape)} {A_log.dtype}"
    if dt_bias is not None and (dt_bias.numel() != HV * K or not dt_bias.is_floating_point()):
        return f"dt_bias must be HV*K={HV * K} floats; got {tuple(dt_bias.shape)} {dt_bias.dtype}"
    others = (A_log,) if dt_bias is None else (A_log, dt_bias)
    if any(t.device != g.device for t in others):
        return "A_log / dt_bias on another device than g"
    return _warp.layout_reason(("g", "gk"), (g, gk))


def _table_reason(v, table, T_raw, qk_padded=False, q_rstd=None) -> str | None:
    """The varlen build's chunk table (int32 [T / 64, 2], contiguous, on v's device) and packed
    length T_raw (B == 1), qk_padded (dq, dk on the padded row: with a table, without q_rstd), or
    why not; None without a table."""
    if table is None:
        if qk_padded:
            return "qk_padded (dq, dk on the padded row) goes with a chunk table"
        return None if T_raw is None else "T_raw goes with a chunk table"
    if qk_padded and q_rstd is not None:
        return ("qk_padded leaves dq, dk for an l2norm_bwd after the kernel: not with q_rstd "
                "(the L2 norm's backward inside)")
    B, T = v.shape[0], v.shape[1]
    if B != 1:
        return f"a chunk table (packed sequences) needs B == 1; got B={B}"
    if T_raw is None:
        return "a chunk table needs T_raw (the packed row's length)"
    if not isinstance(T_raw, int) or not 0 < T_raw <= T:
        return f"T_raw must be an int in 1..T={T}; got {T_raw!r}"
    return _warp.table_reason(table, v.device, T // BT)


def _rows_reason(v_new, v, beta, do, T_raw) -> str | None:
    """The varlen build's packed-row inputs: v and do [1, T_raw, HV, V] in v_new's dtype, beta
    [1, T_raw, HV], contiguous and 16-byte aligned on v_new's device (their dtypes and layouts
    otherwise are wy_dqkg's checks, their extents there the padded row's); or why not. After
    _table_reason: T_raw is a valid int here."""
    HV, V = v_new.shape[2], v_new.shape[3]
    for name, x, want, form in (("v", v, (1, T_raw, HV, V), "[1,T_raw,HV,V]"),
                                ("do", do, (1, T_raw, HV, V), "[1,T_raw,HV,V]"),
                                ("beta", beta, (1, T_raw, HV), "[1,T_raw,HV]")):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != want:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            return f"with a chunk table {name} must be on the packed row {form} = {want}; got {got}"
        if name != "beta" and x.dtype != v_new.dtype:
            return f"{name} dtype {x.dtype}, v_new's {v_new.dtype} (one io dtype)"
        if not x.is_contiguous():
            return f"{name} is not contiguous"
        if x.data_ptr() % 16:
            return f"{name} is not 16-byte aligned"
        if x.device != v_new.device:
            return f"{name} on {x.device}, the inputs on {v_new.device}"
    return None


def is_supported(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, emit_bf16=False, q_rstd=None,
                 k_rstd=None, g=None, A_log=None, dt_bias=None, lower_bound=None, table=None,
                 T_raw=None, qk_padded=False) -> str | None:
    """None when `bwd_chunk` runs the CuTe kernel on these arguments, else the reason it would not."""
    vl = table is not None
    # varlen: v, beta, do (and the raw gate) are on the packed row: v_new stands for the padded
    # row's extents, and they have their own checks after the table's (which validates T_raw)
    return (_wy._hard_reason(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, packed=vl)
            or _rstd_reason(q, v_new, q_rstd, k_rstd) or _table_reason(v_new, table, T_raw, qk_padded, q_rstd)
            or _gate_reason(gk, g, A_log, dt_bias, T_raw if vl else None)
            or (_rows_reason(v_new, v, beta, do, T_raw) if vl else None))


def _config(q, v, beta, scale, emit_bf16, l2norm, g=None, A_log=None, dt_bias=None,
            lower_bound=None, varlen=False, qk_padded=False) -> _wy.WyDqkgConfig:
    gate = _warp.gate_form(A_log is not None, lower_bound)
    on = gate != "none"
    return _wy._config(q, v, beta, scale, True, fused=True, emit_bf16=bool(emit_bf16), l2norm=bool(l2norm),
                       gate=gate, gate_bias=on and dt_bias is not None, lower_bound=float(lower_bound or 0.0),
                       g_dtype=_warp.DT[g.dtype] if on else "", varlen=bool(varlen),
                       qk_padded=bool(varlen and qk_padded))


def _outputs(q, v, emit_bf16, l2norm=False, g=None, T_raw=None, qk_padded=False):
    """dq, dk (q's dtype with emit_bf16 or l2norm, else fp32), dv2, db, dg (fp32; with the gate,
    g being given, g's dtype: dg_raw): fresh; [1, T_raw, ...] on the packed row when T_raw is
    given (varlen), else [B, T, ...]; qk_padded: dq, dk [B, T, ...] all the same."""
    B, T, HV, V = v.shape
    Bq, Tq = B, T
    if T_raw is not None:
        B, T = 1, T_raw
        if not qk_padded:
            Bq, Tq = B, T
    K = q.shape[3]
    qk = q.dtype if emit_bf16 or l2norm else torch.float32
    return (
        alloc((Bq, Tq, HV, K), qk, q),  # dq
        alloc((Bq, Tq, HV, K), qk, q),  # dk
        alloc((B, T, HV, V), v.dtype, q),  # dv2
        alloc((B, T, HV), torch.float32, q),  # db
        alloc((B, T, HV, K), torch.float32 if g is None else g.dtype, q),  # dg
    )


def _partials(v, K, dt_bias):
    """The gate's per-chunk partials: dA_log [B, NT, HV] and (with dt_bias) ddt_bias [B, NT, HV, K],
    fp32, every entry written by its CTA."""
    B, T, HV, _ = v.shape
    NT = T // BT
    dA = alloc((B, NT, HV), torch.float32, v)
    dbias = alloc((B, NT, HV, K), torch.float32, v) if dt_bias is not None else None
    return dA, dbias


def _kernel_args(inputs, outs, q_rstd=None, k_rstd=None, gate=None, table=None):
    """The class's 23 tensors: the eleven inputs, dq, dk, dv2, db, dg, then q_rstd, k_rstd in the
    dAkk / dAqk slots, then the gate's g, A_log [1, HV] fp32, dt_bias [HV, K] fp32, the dA_log and
    ddt_bias partials; `gate` = (g, A_log, dt_bias, dA partials, dbias partials) or None. Where a
    tensor is not given (no rstds, no gate, no dt_bias) dg's storage stands in: never read. With
    a chunk table (varlen) the table is a 24th (the varlen kernel's)."""
    dg = outs[4]
    if q_rstd is None:
        q_rstd = k_rstd = dg
    if gate is None:
        gt = (dg,) * 5
    else:
        g, A_log, dt_bias, dA, dbias = gate
        HV, K = g.shape[2], g.shape[3]
        a, bias = _warp.gate_views(A_log, dt_bias, HV, K)
        if bias is None:
            bias = dbias = dg
        gt = (g, a, bias, dA, dbias)
    return (*inputs, *outs, q_rstd, k_rstd, *gt, *(() if table is None else (table,)))


def _in(t, dtype):
    """The fp32 sum `t` in its parameter's dtype (no `.to` call when it already is)."""
    return t if t.dtype == dtype else t.to(dtype)


def _reduce(dA, dbias, A_log, dt_bias):
    """dA_log, ddt_bias from the per-chunk partials, summed with torch over (B, NT) as fla sums its
    per-block ones: dA_log shaped as A_log in its dtype, ddt_bias [HV * K] in dt_bias's."""
    HV = dA.shape[2]
    dA_log = _in(dA.view(-1, HV).sum(0).view(A_log.shape), A_log.dtype)
    ddt = None
    if dt_bias is not None:
        ddt = _in(dbias.view(-1, dbias.shape[2] * dbias.shape[3]).sum(0), dt_bias.dtype)
    return dA_log, ddt


def _prepare(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, emit_bf16=False, q_rstd=None,
             k_rstd=None, g=None, A_log=None, dt_bias=None, lower_bound=None, table=None, T_raw=None,
             qk_padded=False):
    """(config, the five outputs, the gate's partials or None, the kernel's tensors): fresh."""
    l2 = q_rstd is not None
    on = A_log is not None
    vl = table is not None
    cfg = _config(q, v, beta, scale, emit_bf16, l2, g, A_log, dt_bias, lower_bound, vl, qk_padded)
    # (v_new: the padded row's extents; varlen v is on the packed row)
    outs = _outputs(q, v_new, emit_bf16, l2, g if on else None, T_raw if vl else None, qk_padded)
    parts = _partials(v_new, q.shape[3], dt_bias) if on else None
    gate = (g, A_log, dt_bias, *parts) if on else None
    args = _kernel_args((q, k, v, v_new, gk, beta, Akk, h, do, dh, dv), outs, q_rstd, k_rstd, gate, table)
    return cfg, outs, parts, args


def compile_for(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, emit_bf16=False, q_rstd=None,
                k_rstd=None, g=None, A_log=None, dt_bias=None, lower_bound=None, keep_ptx=False, table=None,
                T_raw=None, qk_padded=False):
    """Trace and compile for these arguments without launching (the CPU compile test uses it)."""
    cfg, _, _, args = _prepare(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, emit_bf16, q_rstd, k_rstd,
                               g, A_log, dt_bias, lower_bound, table, T_raw, qk_padded)
    build = lambda views, stream, opts: _wy._build(views, stream, cfg, opts)  # noqa: E731
    return _warp.compile_only(build, args, keep_ptx)


def bwd_chunk(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, emit_bf16=False, q_rstd=None, k_rstd=None,
              g=None, A_log=None, dt_bias=None, lower_bound=None, table=None, T_raw=None, qk_padded=False):
    """wy_dqkg (want_dAqk) then intra (fold_dg) in one kernel -> (dq, dk, dv2, db, dg, dA_log,
    ddt_bias); with q_rstd, k_rstd also l2norm_bwd of dq, dk; with A_log (and the raw gate g) also
    fla's gate backward (dg then g's gradient, in g's dtype), else dA_log, ddt_bias None; with a
    chunk `table` (and T_raw) do and dq, dk, dv2, db, dg on the packed row [1, T_raw, ...] (the
    module docstring's varlen), with qk_padded dq, dk on the padded row [1, T, ...]. Fresh outputs."""
    reason = is_supported(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, emit_bf16, q_rstd, k_rstd,
                          g, A_log, dt_bias, lower_bound, table, T_raw, qk_padded)
    if reason is not None:
        raise ValueError(f"kda_cute.bwd_chunk.bwd_chunk: unsupported call: {reason}")
    return launch(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, emit_bf16, q_rstd, k_rstd,
                  g, A_log, dt_bias, lower_bound, table, T_raw, qk_padded)


def launch(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, emit_bf16=False, q_rstd=None, k_rstd=None,
           g=None, A_log=None, dt_bias=None, lower_bound=None, table=None, T_raw=None, qk_padded=False):
    """`bwd_chunk` without its checks: for a caller whose `is_supported` just said None (the
    chain's gate), so a host-bound step does not pay for them twice."""
    raw = launch_raw(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, emit_bf16, q_rstd, k_rstd, g, A_log,
                     dt_bias, lower_bound, table, T_raw, qk_padded)
    return finish(raw, A_log=A_log, dt_bias=dt_bias)


def launch_raw(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, emit_bf16=False, q_rstd=None,
               k_rstd=None, g=None, A_log=None, dt_bias=None, lower_bound=None, table=None, T_raw=None,
               qk_padded=False):
    """The kernel part of `launch` (what a recorded chain plan replays): (dq, dk, dv2, db, dg, the
    dA_log partials or None, the ddt_bias partials or None)."""
    cfg, outs, parts, args = _prepare(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, emit_bf16, q_rstd,
                                      k_rstd, g, A_log, dt_bias, lower_bound, table, T_raw, qk_padded)
    _warp.launch(_cache, cfg, args, lambda views, stream, opts: _wy._build(views, stream, cfg, opts))
    return (*outs, *(parts or (None, None)))


def finish(raw, *args, **kwargs):
    """`launch`'s result from `launch_raw`'s: the gate's partials summed (torch) into dA_log,
    ddt_bias. Takes `launch`'s arguments (only A_log and dt_bias are read)."""
    *outs, dA, dbias = raw
    if dA is None:
        return (*outs, None, None)
    A_log, dt_bias = (kwargs[n] if n in kwargs else (args[i] if i < len(args) else None)
                      for n, i in _GATE_PARAMS)
    return (*outs, *_reduce(dA, dbias, A_log, dt_bias))


_GATE_PARAMS = tuple((n, list(inspect.signature(launch).parameters).index(n)) for n in ("A_log", "dt_bias"))
