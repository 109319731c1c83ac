"""The backward composition (fla 0.6.0's recompute path). Stages, in order:

    bwd_prep                   kda_cute_bwd_prep: gk from the raw gate and w, u, qg, kg from the
                               saved Akk (fla: kda_gate_chunk_cumsum / chunk_local_cumsum +
                               recompute_w_u); without the gate in the op the forward's gk is
                               saved (as fla saves it) and read instead of recomputed; a packed
                               call's v, raw gate, beta read on their own row (`_Rows`)
    b1                         kda_cute_b1: re-scan h for every chunk and v_new (these two
                               skipped with disable_recompute: the forward kept them); on small
                               grids on a second stream, beside dhu (which does not read its outputs)
    dhu                        kda_cute_dhu: reverse scan -> dh per chunk, dh0, dv2, with bwd_dAv's
                               dv = tril(Aqk)^T do computed inside (the fused form: Aqk, no dv);
                               a packed call's do read on its own row (the chunk table: `_Do`)
    bwd_chunk                  kda_cute_bwd_chunk: everything below up to gva_sum in one kernel
                               (dq, dk, dv, db, dg with dg reverse-cumsummed; dq / dk in q's dtype
                               when HV == H, then also through l2norm_bwd with that flag: the
                               l2norm_bwd stage is skipped; with the gate in the op also gate_bwd:
                               dg the raw gate's, dA_log, ddt_bias, and the gate_bwd stage is
                               skipped); where it does not run ("split", with its reason):
      bwd_wy_dqkg              dq, dk, dv, db, dg, dAkk through the WY form and the states; with
                               the CuTe kernel also bwd_dAv's dAqk = scale tril(do v_new^T)
      bwd_dAv                  only where dhu or bwd_wy_dqkg is not the CuTe kernel
      intra                    kda_cute_intra: the intra-chunk gradients through Aqk and Akk;
                               with the CuTe kernel, fold_dg=True (dg comes out reverse-cumsummed,
                               so dg_cumsum is skipped) and, when HV == H, emit_bf16=True
      dg_cumsum                only when intra was not the CuTe kernel
    gate_bwd                   only with the gate in kernel, where bwd_chunk did not fold it
                               -> dg_raw, dA_log, ddt_bias
    l2norm_bwd                 only with that flag (where bwd_chunk did not fold it); with GVA it
                               takes dq, dk per value head and sums each group inside
    gva_sum                    GVA without l2norm_bwd: dq, dk summed over each group of HV // H
                               value heads, in fp32
    beta_sigmoid_bwd           only with that flag
"""

from __future__ import annotations

import contextlib

import torch
from kda_cute._common.support import sm_count_of
from kda_cute.scan_policy import v_tiles

from . import stages as S
from .forward import Flags, Saved

_HALF = (torch.bfloat16, torch.float16)


_SIDE: dict = {}  # device -> the second stream b1 runs on beside dhu (one per device, process-wide)


def _side_stream(do: torch.Tensor, v: torch.Tensor, chunks=None):
    """A second stream for b1 while the fused dhu runs on the current one, where the scans' grids
    leave most SMs idle (at most one 64-wide V tile per SM: B * HV * V / 64 <= SM count; both walk
    the chunks serially, so each alone is latency-bound there), else None. Not while a CUDA graph
    is being captured (the graph then holds the one-stream order; results are equal either way:
    the kernels are deterministic and independent)."""
    if do.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    B, _, HV, V = v.shape
    if chunks is not None:  # a packed call: the scans' grid has one row per sequence
        B = chunks.shape[1] - 1
    if v_tiles(B, HV, V) > sm_count_of(do):
        return None
    st = _SIDE.get(do.device)
    if st is None:
        st = _SIDE[do.device] = torch.cuda.Stream(device=do.device)
    return st


@contextlib.contextmanager
def _forked(side, main):
    """Run the block on `side` after the work so far on `main` (the current stream), then make
    `main` current again (no-op without a side). torch.cuda.stream(side) would ask for the current
    stream again: each ask costs ~4 us of host time on the H200 machine."""
    if side is None:
        yield
        return
    side.wait_stream(main)
    torch.cuda.set_stream(side)
    try:
        yield
    finally:
        torch.cuda.set_stream(main)


def _made_on(main, *made_there):
    """Once `main` has waited for the side stream: the tensors allocated there are marked used on
    `main` (the caching allocator then waits for its work before reusing their memory)."""
    for t in made_there:
        t.record_stream(main)


def backward(do, dht, s: Saved, f: Flags):
    """-> dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 (fla's dtypes)."""
    if s.plan is not None:  # the forward's plan key stands for every saved tensor's signature
        plan = S.planned("bwd", do, dht, after=s.plan)
    else:
        saved = [t for n, t in vars(s).items() if n not in ("kept", "plan")]
        kept = () if s.kept is None else tuple(vars(s.kept).values())
        plan = S.planned("bwd", do, dht, *saved, *kept, f)
    with plan:
        return _backward(do, dht, s, f)


def _backward(do, dht, s: Saved, f: Flags):
    q, k = s.q, s.k
    ins = _Inputs(s, f)
    if s.kept is not None:  # disable_recompute: the forward kept these (and gk)
        gk, w, u, qg, kg, h, v_new = (s.gk, s.kept.w, s.kept.u, s.kept.qg, s.kept.kg, s.kept.h, s.kept.v_new)
    else:  # gk and the WY factors again from the raw gate and the saved Akk (one kernel)
        gk, w, u, qg, kg = _recompute(ins, s, f)
    # bwd_dAv's two products live in the CuTe kernels that hold their operands: dv = tril(Aqk)^T do
    # in dhu's reverse scan, dAqk = scale tril(do v_new^T) in wy_dqkg's V walk. Where either stage
    # is not the CuTe kernel, bwd_dAv runs (with that stage's reason in the record).
    dos = _Rows(do, s.packing)
    dhu_in = (qg, kg, w, gk, s.initial_state, dht)
    impl, reason, dhu_do, dhu_kw = _dhu_choice(dhu_in, dos, s, f)
    fused = impl.name == "cute"
    # the fused dhu needs nothing of b1's: on small grids the two serial scans overlap (`_side_stream`)
    side = _side_stream(do, s.v, s.chunks) if fused and s.kept is None else None
    main = None if side is None else torch.cuda.current_stream(side.device)
    dAqk = None
    try:
        if s.kept is None:
            with _forked(side, main):
                h, v_new, _ = S.b1(kg, w, u, gk, s.initial_state, False, chunks=s.chunks)
        if fused:
            dh, dh0, dv = S.dhu.run(impl, reason, *dhu_in, dhu_do, None, f.scale, s.Aqk, chunks=s.chunks,
                                    **dhu_kw)
        else:
            dAqk, dv = S.bwd_dAv(q, k, v_new, dhu_do, s.Aqk, f.scale)
            dh, dh0, dv = S.dhu.run(impl, reason, *dhu_in, dhu_do, dv, f.scale, chunks=s.chunks)
    finally:  # joined before b1's inputs can be freed (below, or by an exception's unwinding)
        if side is not None:
            main.wait_stream(side)
    if side is not None:
        _made_on(main, h, v_new)
    del qg, kg, w, u, dhu_in, dhu_do  # (the argument tuples hold references too)
    # (v, beta, do: `_chunk_parallel`'s, on the row the stage that runs reads)
    wy_in = [q, k, None, v_new, gk, None, s.Akk, h, None, dh, dv, f.scale]
    del h, dh, v_new, dv  # (wy_in's references go as soon as their stage is done)
    return _chunk_parallel(wy_in, dos, ins, dh0, dAqk, s, f)


class _Rows:
    """A tensor the backward reads on a packed call's own row [1, total_T, ...] (`rows`) where the
    CuTe kernel takes the chunk table: do (kda_cute_dhu, kda_cute_bwd_chunk) and, saved so by the
    native prep, v, the raw gate and beta (kda_cute_bwd_prep, kda_cute_bwd_chunk); a stage that
    does not gets one copy on the padded row (`padded`: gathered once, its pad rows `fill`,
    recorded with the first such stage's reason). Without a packing (p None) the tensor is the
    padded row's already (or None)."""

    __slots__ = ("rows", "p", "fill", "_padded")

    def __init__(self, x, p, fill: float = 0.0):
        self.rows, self.p, self.fill = x, p, fill
        self._padded = x if p is None or x is None else None

    def padded(self, why: str | None):
        if self._padded is None:
            from .varlen import to_padded

            with S.varlen_io("gather", why):
                self._padded = to_padded(self.rows, self.p, self.fill)
        return self._padded


class _Inputs:
    """The saved v, raw gate, beta as `_Rows`: on the packed row where the forward's native prep
    left them there (`Saved.packed_in`; the raw gate's pad rows then take the chain's pad gate),
    else the padded row's."""

    __slots__ = ("v", "g", "beta")

    def __init__(self, s: Saved, f: Flags):
        p = s.packing if s.packed_in else None
        fill = 0.0
        if p is not None and s.g is not None:
            from .varlen import gate_fill

            fill, dtype = gate_fill(s.g.dtype, f.use_gate_in_kernel, f.lower_bound)
            assert dtype is None, "the native prep takes no raw gate that changes dtype on the padded row"
        self.v, self.g, self.beta = _Rows(s.v, p), _Rows(s.g, p, fill), _Rows(s.beta, p)

    def padded(self, why: str | None):
        """v, g, beta on the padded row (each gathered once where packed)."""
        return self.v.padded(why), self.g.padded(why), self.beta.padded(why)


def _recompute(ins: _Inputs, s: Saved, f: Flags):
    """The bwd_prep stage -> gk, w, u, qg, kg: a packed call's v, raw gate, beta read on the packed
    row where kda_cute_bwd_prep takes the chunk table, else on the padded row (gathered, with the
    reason)."""
    kw = {} if s.gk is None else dict(gk=s.gk)  # (the forward's gk: no gate in the op)
    tail = (s.A_log, s.dt_bias, s.Akk, f.lower_bound, f.use_gate_in_kernel, f.chunk_size)
    why = None
    if ins.v.p is not None:
        args = (s.q, s.k, ins.v.rows, ins.g.rows, ins.beta.rows, *tail)
        table = dict(table=ins.v.p.table)
        impl, reason = S.bwd_prep.choose(*args, **kw, **table)
        if impl.name == "cute":
            S.varlen_rows("native")
            return S.bwd_prep.run(impl, reason, *args, **kw, **table)
        why = f"bwd_prep: {reason}"
    return S.bwd_prep(s.q, s.k, *ins.padded(why), *tail, **kw)


def _dhu_choice(dhu_in: tuple, dos: _Rows, s: Saved, f: Flags):
    """-> (impl, reason, do, keywords) of the dhu stage, asked in its fused form (Aqk, no dv): a
    packed call's do on its own row where the CuTe kernel takes the chunk table, else the padded
    row's (the choice then as for any call)."""
    why = None
    if dos.p is not None:
        kw = dict(table=dos.p.table)
        impl, reason = S.dhu.choose(*dhu_in, dos.rows, None, f.scale, s.Aqk, chunks=s.chunks, **kw)
        if impl.name == "cute":
            S.varlen_rows("native")
            return impl, reason, dos.rows, kw
        why = f"dhu: {reason}"
    do = dos.padded(why)
    impl, reason = S.dhu.choose(*dhu_in, do, None, f.scale, s.Aqk, chunks=s.chunks)
    return impl, reason, do, {}


def _chunk_parallel(wy_in: list, dos: _Rows, ins: _Inputs, dh0, dAqk, s: Saved, f: Flags):
    """Everything after the two scans, from bwd_chunk's inputs `wy_in` (emptied as soon as their
    stage is done; its v, beta, do, slots 2, 5, 8, from `ins` and `dos`: a packed call's own row
    where the kernel writes the packed gradients, else the padded row's): bwd_chunk (or its
    stages), gva_sum, the gate, l2norm and beta sigmoid backwards -> the backward's outputs."""
    q, k = wy_in[:2]
    H, HV = q.shape[2], s.v.shape[2]
    emit_bf16 = HV == H and q.dtype in _HALF
    kw = dict(emit_bf16=emit_bf16)
    if f.use_qk_l2norm_in_kernel and HV == H:  # the L2 norm's backward too, inside
        kw.update(q_rstd=s.q_rstd, k_rstd=s.k_rstd)
    gate_kw = {}
    if f.use_gate_in_kernel and s.A_log is not None:  # fla's gate backward of dg too, inside
        gate_kw = dict(g=ins.g.rows, A_log=s.A_log, dt_bias=s.dt_bias, lower_bound=f.lower_bound)
    p = s.packing
    impl = None
    if p is not None and ins.v.p is not None:  # the packed row in and out (bwd_chunk's chunk table)
        packed_kw, why = _packed_outputs(f, HV == H, gate_kw, p)
        if packed_kw is not None:  # (the kernel's varlen build reads do, v, beta, g on the packed row)
            wy_in[2], wy_in[5], wy_in[8] = ins.v.rows, ins.beta.rows, dos.rows
            impl, reason = S.bwd_chunk.choose(*wy_in, **kw, **gate_kw, **packed_kw)
            if impl.name == "cute":
                kw.update(packed_kw)
            else:
                why = f"bwd_chunk: {reason}"
    elif p is not None:
        why = "the forward's inputs are on the padded row (kda_cute_prep's native build did not run)"
    if "table" not in kw:
        why = why if p is not None else None
        v, g, beta = ins.padded(why)
        wy_in[2], wy_in[5], wy_in[8] = v, beta, dos.padded(why)
        if gate_kw:
            gate_kw["g"] = g
        impl, reason = S.bwd_chunk.choose(*wy_in, **kw, **gate_kw)
    if impl.name != "cute" and gate_kw:  # the kernel may still take the call without the gate's part
        alt = S.bwd_chunk.choose(*wy_in, **kw)
        if alt[0].name == "cute":
            (impl, reason), gate_kw = alt, {}
    if p is not None and "table" in kw:  # (the record: the gradients written packed ...)
        S.varlen_rows("native")
    elif p is not None:  # (... or gathered at the end)
        S.varlen_rows("gather", why)
    l2norm_done = gate_done = False
    dA_log = ddt_bias = None
    if impl.name == "cute":  # wy_dqkg, dAqk, intra, the dg fold (l2norm_bwd, gate_bwd) in one kernel
        dq, dk, dv, db, dg, dA_log, ddt_bias = S.bwd_chunk.run(impl, reason, *wy_in, **kw, **gate_kw)
        l2norm_done, gate_done = "q_rstd" in kw, bool(gate_kw)
        wy_in.clear()
    else:
        with S.bwd_chunk.split(reason):
            dq, dk, dv, db, dg = _wy_then_intra(wy_in, dAqk, s, f, emit_bf16)
    del dAqk  # (bwd_dAv's, where dhu was not the CuTe kernel)

    if f.use_gate_in_kernel and not gate_done:  # (dg on the padded row here: bwd_chunk wrote no table)
        dg, dA_log, ddt_bias = S.gate_bwd(ins.g.padded("gate_bwd: after bwd_chunk, on the padded row"),
                                          s.A_log, s.dt_bias, dg, f.lower_bound)
    if f.use_qk_l2norm_in_kernel and not l2norm_done:  # (GVA: each stage sums the group inside)
        dq = S.l2norm_bwd(q, s.q_rstd, dq)
        dk = S.l2norm_bwd(k, s.k_rstd, dk)
    elif HV > H:
        dq = S.gva_sum(dq, H)
        dk = S.gva_sum(dk, H)
    if p is not None:  # a packed call: the gradients on the packed row (`varlen.to_packed`)
        from .varlen import to_packed

        dq, dk, dv, dg, db = (to_packed(x, p) for x in (dq, dk, dv, dg, db))
    if f.use_beta_sigmoid_in_kernel:  # (beta_raw: the packed row's with a Packing)
        db = S.beta_sigmoid_bwd(s.beta_raw, db, f.beta_scale)
    return dq, dk, dv, dg, db, dA_log, ddt_bias, dh0


def _packed_outputs(f: Flags, same_heads: bool, gate_kw: dict, p) -> tuple[dict | None, str | None]:
    """kda_cute_bwd_chunk's keywords that write a packed call's gradients on the packed row, or
    (None, why not): every stage after the kernel must take them there. gate_bwd must be folded
    (it reads the raw gate on the padded row); l2norm_bwd with GVA runs after the kernel on the
    padded normalized q, k, so there dq, dk stay on the padded row (`qk_padded`) and only they are
    gathered after it."""
    if f.use_gate_in_kernel and not gate_kw:
        return None, "gate_bwd runs after bwd_chunk here"
    kw = dict(table=p.table, T_raw=p.T)
    if f.use_qk_l2norm_in_kernel and not same_heads:
        kw["qk_padded"] = True
    return kw, None


def _wy_then_intra(wy_in: list, dAqk, s: Saved, f: Flags, emit_bf16):
    """The chunk-parallel backward as two stages where kda_cute_bwd_chunk does not run:
    bwd_wy_dqkg (with bwd_dAv's dA, or after bwd_dAv), then intra. Empties
    `wy_in` (h, dh, v_new freed) before intra allocates."""
    q, k, v_new, gk, beta, do = (wy_in[i] for i in (0, 1, 3, 4, 5, 8))
    if dAqk is None:
        impl, reason = S.bwd_wy_dqkg.choose(*wy_in, want_dAqk=True)
        if impl.name == "cute":
            dq, dk, dv, db, dg, dAkk, dAqk = S.bwd_wy_dqkg.run(impl, reason, *wy_in, want_dAqk=True)
        else:
            dq, dk, dv, db, dg, dAkk = S.bwd_wy_dqkg.run(impl, reason, *wy_in)
            dAqk, _ = S.bwd_dAv(q, k, v_new, do, s.Aqk, f.scale)
    else:
        dq, dk, dv, db, dg, dAkk = S.bwd_wy_dqkg(*wy_in)
    wy_in.clear()
    del v_new

    args = (q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg)
    flags = dict(fold_dg=True, emit_bf16=emit_bf16)
    impl, reason = S.intra.choose(*args, **flags)
    if impl.name == "cute":
        dq, dk, db, dg = S.intra.run(impl, reason, *args, **flags)
    else:
        dq, dk, db, dg = S.intra.run(impl, reason, *args)
        dg = S.dg_cumsum(dg, f.chunk_size)
    return dq, dk, dv, db, dg
