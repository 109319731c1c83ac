"""fwd: the forward state scan fused with its readout on sm_90 (fla 0.6.0's
`chunk_gated_delta_rule_fwd_h` + `chunk_gla_fwd_o_gk`, h never written per chunk).

Per (b, hv), over chunks c of 64 tokens (gk in log2 units, gd = gk at the chunk's last valid row):

    v_new_c = u_c - w_c @ bf16(h_c)
    o_c     = scale * (qg_c @ bf16(h_c)) + tril(Aqk_c) @ bf16(v_new_c),   qg = bf16(q * exp2(gk))
    h_{c+1} = exp2(gd_c)[:, None] * h_c + kg_c^T @ bf16(v_new_c)
    ht      = h_NT (fp32, when output_final_state)

with fla's casts (qg, h, v_new, Aqk in the input dtype for the dots, fp32 accumulation, o in the
input dtype). Aqk's strictly-upper triangle is masked in smem (fla's intra leaves it unwritten).

CTA decomposition: `kda_cute._scan` (one warpgroup per (b, hv, 64-wide V tile), state as the wgmma
accumulator of `kg^T @ v_new`, bf16 state in smem as the shared B operand of `w @ h` and `qg @ h`,
which are issued in one wgmma group). qg arrives ready-gated by TMA with w, kg, u, Aqk: fla's
fwd_intra writes it next to w, u, kg (`disable_recompute`, the chain's fwd_intra(want_qg=True)),
one value head per row block, so GVA needs no q-head ratio here. gk is read only for the
per-chunk decay row exp2(gd). o is staged in smem and leaves by TMA store. No per-chunk state
leaves the CTA. q stays in the contract (fla's fwd_o and the reference read it) but is not read.

Why qg and not q: the first design loaded q and gated it in place in smem (every thread read
fp32 gk rows from global, exp2, wrote smem back) after the stage's mbarrier wait and before the
first wgmma of the chunk could start: a gk round trip to global and 64 exp2 per thread sitting
in the serial per-chunk loop. fla's fwd_intra produces qg for almost nothing (it already writes
w, u, kg in that pass), so the gating now happens there, off the recurrence's critical path.

Measured on the H200 (2026-12-01, bench/results/scans_2026-12-01.md), this design: o and ht
within fla's error vs float64 at 5 shapes (ref b0, GVA ragged tail, fp16, T = 64, h0 + ht; also
with two warpgroups), bitwise repeatable. B16 T8192 H16 V256 bf16, same run: 1.687 ms (1 stage x
2 warpgroups) vs fla's fwd_h + fwd_o 4.011 ms = 2.38x (in a second table of the same run fla took
3.827: 2.27x); B2 T4096: 0.211 vs 0.412 ms (1.95x, 2 stages x 1 warpgroup). The extra qg store
costs fla's fwd_intra ~0.33 ms at the reference shape (witness: 4.885 vs 4.555 ms) of the
~1.9 ms this kernel saves (stage bench 1.92 vs 3.82); the chain's forward: 7.91 vs 9.37 ms.
`variant()` picks the build per grid.
The first design (q gated in the kernel, 2026-11-30): 3.864 vs 3.894 ms = 1.01x, so the gating
pass was most of the kernel's time. Left on the table: the upper-triangle mask of Aqk in smem per
chunk and three CTA barriers per chunk.

Alternatives considered: mma.sync with ldmatrix (the state in registers either way, but every
chunk would need the bf16 state re-read through ldmatrix and B-fragment shuffles; wgmma reads
it from the smem copy the checkpoint store needs anyway); a producer warp + empty barriers
(unneeded: the consumers are the only smem readers and a CTA barrier already orders them
before the refill); a 128-wide V tile in one warpgroup (128 fp32 state registers per thread
plus the token accumulators would spill).
"""

import torch

from ._common.cache import CallCache, alloc
from ._common.support import compile_arch, device_reason
from .b1 import (
    _DT,
    S,
    _cutlass_dtype,
    _dummy,
    extent_reason,
    floor_reason,
    operand_reason,
    state_reason,
    wide_grid,
)

# The compiled variant, by grid (measured on the H200, 2026-12-01, same run as fla, bench/results/
# scans_2026-12-01.md): at B16 T8192 H16 V256 (1024 V tiles) 1 stage x 2 warpgroups 1.687 ms
# against 1.896 (2 stages x 1), 2.025 (1 x 1), 2.356 (2 x 2: 2 stages of two warpgroups' tiles
# leave one CTA per SM); at B2 T4096 (128 tiles) 2 x 1 0.211 ms against 0.252 (1 x 1), where two
# warpgroups per CTA would leave half the SMs idle. Between the two grids it is not measured: two
# warpgroups once their CTAs fill the 132 SMs about four times over.
WIDE_FROM_TILES = 512
GRID_FLOOR = 0
_cache = CallCache("kda_cute_fwd")


def variant(B: int, HV: int, V: int) -> tuple[int, int]:
    """(stages, warpgroups) for this grid (see WIDE_FROM_TILES)."""
    return (1, 2) if wide_grid(B, HV, V, WIDE_FROM_TILES) else (2, 1)


class _Fwd:
    def __init__(self, dtype, V, HV, ratio_k, has_h0, store_ht, scale, stages, nwg=1):
        self.dtype, self.V, self.HV, self.ratio_k = dtype, V, HV, ratio_k
        self.has_h0, self.store_ht, self.scale, self.stages, self.nwg = has_h0, store_ht, scale, stages, nwg

    def _layouts(self, with_struct=False):
        import cutlass
        import cutlass.cute as cute

        dt, st, nwg = self.dtype, self.stages, self.nwg
        self.l_w = S.smem_layout(dt, S.BT, S.KD, True, st)  # w (t, k), shared by the warpgroups
        self.l_q = S.smem_layout(dt, S.BT, S.KD, True, st)  # qg (t, k), shared
        self.l_kg = S.smem_layout(dt, S.KD, S.BT, False, st)  # kg^T (k, t), shared
        self.l_u = S.smem_layout(dt, S.BV, S.BT, False, st * nwg)  # u (v, t) per (stage, warpgroup)
        self.l_a = S.smem_layout(dt, S.BT, S.BT, True, st)  # Aqk (t, s), shared
        self.l_h = S.smem_layout(dt, S.BV, S.KD, False, nwg)
        self.l_v = S.smem_layout(dt, S.BV, S.BT, False, nwg)
        self.l_o = S.smem_layout(dt, S.BV, S.BT, False, nwg)
        self.tx_bytes = sum(S.tile_bytes(dt, lay) for lay in (self.l_w, self.l_q, self.l_kg, self.l_a))
        self.tx_bytes += nwg * S.tile_bytes(dt, self.l_u)
        if not with_struct:
            return

        @cute.struct
        class Storage:
            mbar: cute.struct.MemRange[cutlass.Int64, st]
            sG: cute.struct.MemRange[cutlass.Float32, S.KD]
            sW: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.l_w)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.l_q)], 1024]
            sKg: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.l_kg)], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.l_u)], 1024]
            sA: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.l_a)], 1024]
            sH: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.l_h)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.l_v)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.l_o)], 1024]

        self.storage = Storage

    def compile_fn(self):
        import cutlass.cute as cute

        this = self

        @cute.jit
        def run(qg, kg, w, u, gk, aqk, h0, o, ht, stream):
            this._layouts(with_struct=True)
            atom_w, tma_w = S.tma_load(S.row_view(w), this.l_w, (S.BT, S.KD))
            atom_q, tma_q = S.tma_load(S.row_view(qg), this.l_q, (S.BT, S.KD))
            atom_kg, tma_kg = S.tma_load(S.col_view(kg), this.l_kg, (S.KD, S.BT))
            atom_u, tma_u = S.tma_load(S.col_view(u), this.l_u, (S.BV, S.BT))
            atom_a, tma_a = S.tma_load(S.row_view(aqk), this.l_a, (S.BT, S.BT))
            atom_o, tma_o = S.tma_store(S.col_view(o), this.l_o, (S.BV, S.BT))
            B = cute.size(u, mode=[0])
            this.kda_cute_fwd(
                atom_w,
                tma_w,
                atom_q,
                tma_q,
                atom_kg,
                tma_kg,
                atom_u,
                tma_u,
                atom_a,
                tma_a,
                atom_o,
                tma_o,
                S.col_view(gk),
                S.fp32_state_view(h0),
                S.fp32_state_view(ht),
                S.mma_tt(this.dtype),
                S.mma_kv(this.dtype),
            ).launch(
                grid=(this.V // (S.BV * this.nwg), this.HV, B),
                block=[S.THREADS * this.nwg, 1, 1],
                stream=stream,
            )

        return run

    @property
    def kda_cute_fwd(self):
        return _fwd_kernel(self)


def _fwd_kernel(cfg):
    import cutlass
    import cutlass.cute as cute

    class K:
        @cute.kernel
        def kda_cute_fwd(
            self,
            atom_w,
            tma_w,
            atom_q,
            tma_q,
            atom_kg,
            tma_kg,
            atom_u,
            tma_u,
            atom_a,
            tma_a,
            atom_o,
            tma_o,
            mGc,
            mH0,
            mHt,
            mma_tt: cute.TiledMma,
            mma_kv: cute.TiledMma,
        ):
            nst, nwg = cfg.stages, cfg.nwg
            cfg._layouts()
            cta = S.Cta(cfg, mGc)
            tid, wg, wtid, bv, hv, b, vt = cta.tid, cta.wg, cta.wtid, cta.bv, cta.hv, cta.b, cta.vt
            hk, T, NT, st, mbar, sG = cta.hk, cta.T, cta.NT, cta.st, cta.mbar, cta.sG
            sW = S.smem_tensor(st.sW, cfg.l_w)
            sQ = S.smem_tensor(st.sQ, cfg.l_q)
            sKg = S.smem_tensor(st.sKg, cfg.l_kg)
            sU = S.smem_tensor(st.sU, cfg.l_u)
            sA = S.smem_tensor(st.sA, cfg.l_a)
            sHall = S.smem_tensor(st.sH, cfg.l_h)
            sVall = S.smem_tensor(st.sV, cfg.l_v)
            sOall = S.smem_tensor(st.sO, cfg.l_o)
            sH = sHall[None, None, wg]
            sV = sVall[None, None, wg]
            sO = sOall[None, None, wg]

            tWs, tWg = S.tma_part(atom_w, sW, cute.local_tile(tma_w, (S.BT, S.KD), (None, 0, hv, b)))
            tQs, tQg = S.tma_part(atom_q, sQ, cute.local_tile(tma_q, (S.BT, S.KD), (None, 0, hv, b)))
            tKs, tKg = S.tma_part(atom_kg, sKg, cute.local_tile(tma_kg, (S.KD, S.BT), (0, None, hk, b)))
            tAs, tAg = S.tma_part(atom_a, sA, cute.local_tile(tma_a, (S.BT, S.BT), (None, 0, hv, b)))
            tOs, tOg = S.tma_part(atom_o, sO, cute.local_tile(tma_o, (S.BV, S.BT), (vt, None, hv, b)))

            loads = [
                (atom_w, tWg, tWs),
                (atom_q, tQg, tQs),
                (atom_kg, tKg, tKs),
                (atom_a, tAg, tAs),
            ]
            for i in cutlass.range_constexpr(nwg):
                tUs, tUg = S.tma_part(
                    atom_u, sU, cute.local_tile(tma_u, (S.BV, S.BT), (bv * nwg + i, None, hv, b))
                )
                loads.append((atom_u, tUg, tUs, nwg, i))
            S.prologue(mbar, nst, cfg.tx_bytes, loads, 0, 1, NT, tid)

            thr_tt = mma_tt.get_slice(wtid)
            thr_kv = mma_kv.get_slice(wtid)
            tAw = mma_tt.make_fragment_A(thr_tt.partition_A(sW))
            tAq = mma_tt.make_fragment_A(thr_tt.partition_A(sQ))
            tAa = mma_tt.make_fragment_A(thr_tt.partition_A(sA))
            tBh = mma_tt.make_fragment_B(thr_tt.partition_B(sH))
            tBv_t = mma_tt.make_fragment_B(thr_tt.partition_B(sV))
            tAk = mma_kv.make_fragment_A(thr_kv.partition_A(sKg))
            tBv = mma_kv.make_fragment_B(thr_kv.partition_B(sV))
            cS = thr_kv.partition_C(cute.make_identity_tensor((S.KD, S.BV)))
            cP = thr_tt.partition_C(cute.make_identity_tensor((S.BT, S.BV)))
            acc = cute.make_rmem_tensor(cS.shape, cutlass.Float32)
            accP = cute.make_rmem_tensor(cP.shape, cutlass.Float32)
            accO = cute.make_rmem_tensor(cP.shape, cutlass.Float32)
            tSsH = thr_kv.partition_C(S.transposed(sH))
            tPsV = thr_tt.partition_C(S.transposed(sV))
            tPsO = thr_tt.partition_C(S.transposed(sO))
            sU_tv = S.transposed(sU)

            tSgHt = thr_kv.partition_C(cute.local_tile(mHt, (S.KD, S.BV), (0, vt, hv, b)))
            gH0 = cute.local_tile(mH0, (S.KD, S.BV), (0, vt, hv, b))
            if cutlass.const_expr(cfg.has_h0):
                cute.autovec_copy(thr_kv.partition_C(gH0), acc)
            else:
                acc.fill(0.0)

            for c in cutlass.range(NT, unroll=1):
                s = c % nst
                phase = (c // nst) % 2
                last = cutlass.min((c + 1) * S.BT, T) - 1
                S.load_row_scale(sG, mGc[None, last, hv, b], tid)
                S.frag_to_smem(acc, tSsH, cfg.dtype)
                cute.arch.mbarrier_wait(mbar + s, phase)
                S.mask_upper(sA[None, None, s], tid, S.THREADS * nwg)
                S.sync_smem_for_async()
                # P = w @ bf16(h), O = qg @ bf16(h)   (one wgmma group)
                cute.nvgpu.warpgroup.fence()
                S.gemm(mma_tt, accP, tAw, tBh, s, None, False)
                S.gemm(mma_tt, accO, tAq, tBh, s, None, False)
                cute.nvgpu.warpgroup.commit_group()
                S.scale_rows(acc, cS, sG, cutlass.Float32(1.0))  # h *= exp2(gd), under the wgmma
                cute.nvgpu.warpgroup.wait_group(0)
                uf = S.smem_to_frag_f32(thr_tt.partition_C(sU_tv[None, None, s * nwg + wg]), accP)
                accP.store(uf.load() - accP.load())
                S.frag_to_smem(accP, tPsV, cfg.dtype)
                if wtid == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                S.sync_smem_for_async()
                # o = scale * O + tril(Aqk) @ v_new ; h = exp2(gd) * h + kg^T @ v_new
                accO.store(accO.load() * cfg.scale)
                cute.nvgpu.warpgroup.fence()
                S.gemm(mma_tt, accO, tAa, tBv_t, s, None, True)
                S.gemm(mma_kv, acc, tAk, tBv, s, None, True)
                S.wgmma_wait()
                S.frag_to_smem(accO, tPsO, cfg.dtype)
                S.sync_smem_for_async()
                if wtid == 0:
                    S.store_chunk(atom_o, tOs, tOg, c)
                if tid < 32:  # warp 0 whole: see S.issue_chunk
                    if c + nst < NT:
                        S.issue_chunk(mbar, s, cfg.tx_bytes, loads, c + nst)

            if cutlass.const_expr(cfg.store_ht):
                cute.autovec_copy(acc, tSgHt)
            if wtid == 0:
                cute.arch.cp_async_bulk_wait_group(0)

    return K().kda_cute_fwd


# ------------------------------------------------------------------------------------ host side
def is_supported(
    q, qg, kg, w, u, gk, Aqk, initial_state=None, output_final_state=False, scale=None
) -> str | None:
    r = device_reason(u) or static_reason(q, qg, kg, w, u, gk, Aqk, initial_state)
    if qg is None:  # say why the chain did not ask fwd_intra for it (u has v's shape and dtype)
        why = plan_reason(q, u, initial_state)
        return f"{r}: {why}" if why and why != r else r
    return r


def static_reason(q, qg, kg, w, u, gk, Aqk, initial_state=None) -> str | None:
    """Shape / dtype / layout checks and the grid floor (no device needed)."""
    return hard_reason(q, qg, kg, w, u, gk, Aqk, initial_state) or floor_reason(u.shape, GRID_FLOOR)


def hard_reason(q, qg, kg, w, u, gk, Aqk, initial_state=None) -> str | None:
    """What the kernel cannot compute at all (shape / dtype / layout). q is not read by the
    kernel (qg replaces it), so it is not checked; qg must be what fwd_intra(want_qg=True) gives."""
    if qg is None:
        return "qg not computed by fwd_intra"
    r = operand_reason(kg, w, u, gk, initial_state)
    if r:
        return r
    B, T, HV, V = u.shape
    if qg.dtype != u.dtype or Aqk.dtype != u.dtype:
        return "qg, Aqk must share u's dtype"
    if tuple(qg.shape) != (B, T, HV, S.KD):
        return "qg must be [B, T, HV, 128] (one row per value head)"
    if tuple(Aqk.shape) != (B, T, HV, S.BT):
        return "Aqk must be [B, T, HV, 64] (chunk 64)"
    for name, t in (("qg", qg), ("Aqk", Aqk)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            return f"{name} not contiguous / aligned"
    return None


def plan_reason(q, v, initial_state=None) -> str | None:
    """Would this kernel take a chain call on q [B, T, H, K], v [B, T, HV, V]? From the chain's
    inputs alone, before fwd_intra runs: the chain asks fwd_intra for qg only when this is None.

    Makes the checks of is_supported that the inputs decide (device, dtype, K, V, T, heads,
    initial_state, grid floor), so no qg is computed for a kernel the chain would not run. The
    intermediates (fresh, contiguous, the shapes fla's fwd_intra gives) are checked by
    is_supported when the stage is called."""
    r = device_reason(v)
    if r:
        return r
    if q.dim() != 4 or v.dim() != 4:
        return "expected [B, T, heads, dim] tensors (varlen / cu_seqlens not supported)"
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if v.dtype not in _DT:
        return f"dtype {v.dtype} (bf16/fp16 only)"
    if q.dtype != v.dtype:
        return "q, k, v must share one dtype"
    r = extent_reason(K, V, T)
    if r:
        return r
    if tuple(v.shape[:2]) != (B, T) or HV % H:
        return "v must be [B, T, HV, V] with HV % H == 0"
    return state_reason("initial_state", initial_state, B, HV, K, V) or floor_reason(v.shape, GRID_FLOOR)


def _plan(qg, kg, w, u, gk, Aqk, initial_state, output_final_state, scale, stages, warpgroups):
    B, T, HV, V = u.shape
    auto_stages, auto_wg = variant(B, HV, V)
    stages = auto_stages if stages is None else stages
    nwg = S.pick_warpgroups(V, auto_wg if warpgroups is None else warpgroups)
    K = kg.shape[-1]
    if scale is None:
        scale = K**-0.5
    dev = u.device
    o = alloc(u.shape, u.dtype, dev)
    ht = alloc((B, HV, K, V), torch.float32, dev) if output_final_state else None
    dummy = _dummy(dev)
    key = (
        nwg,
        _DT[u.dtype],
        V,
        HV,
        HV // kg.shape[2],
        initial_state is not None,
        bool(output_final_state),
        float(scale),
        stages,
        compile_arch(),
    )
    h0 = initial_state if initial_state is not None else dummy
    args = (qg, kg, w, u, gk, Aqk, h0, o, ht if ht is not None else dummy)
    dyn = ((0, 1),) * 6 + ((0,) if initial_state is not None else (), (0, 1), (0,) if ht is not None else ())
    cfg = _Fwd(
        _cutlass_dtype(u.dtype),
        V,
        HV,
        HV // kg.shape[2],
        initial_state is not None,
        bool(output_final_state),
        float(scale),
        stages,
        nwg,
    )
    return (o, ht), key, args, dyn, cfg


def compile_for(
    q,
    qg,
    kg,
    w,
    u,
    gk,
    Aqk,
    initial_state=None,
    output_final_state=False,
    scale=None,
    *,
    stages=None,
    warpgroups=None,
):
    """Compile without launching (CPU tests); returns the compiled object. q is not read."""
    _, _, args, dyn, cfg = _plan(
        qg, kg, w, u, gk, Aqk, initial_state, output_final_state, scale, stages, warpgroups
    )
    return S.compile_only(cfg, args, dyn)


def fwd_scan(
    q,
    qg,
    kg,
    w,
    u,
    gk,
    Aqk,
    initial_state=None,
    output_final_state=False,
    scale=None,
    *,
    stages=None,
    warpgroups=None,
):
    """fwd_h + fwd_o fused -> (o, ht). qg = bf16(q * exp2(gk)) [B, T, HV, K] in u's dtype, as
    fla's fwd_intra stores it with disable_recompute (the chain's fwd_intra(want_qg=True)); q is
    not read (it stays in the contract for fla and the reference). `stages` / `warpgroups`: the
    compiled variant, by default `variant(B, HV, V)`. Raises ValueError on a call the kernel
    cannot compute (shape, dtype, layout, device)."""
    r = hard_reason(q, qg, kg, w, u, gk, Aqk, initial_state) or device_reason(u)
    if r is not None:
        raise ValueError(f"kda_cute.fwd.fwd_scan: unsupported call: {r}")
    return launch(q, qg, kg, w, u, gk, Aqk, initial_state, output_final_state, scale, stages=stages,
                  warpgroups=warpgroups)


def launch(q, qg, kg, w, u, gk, Aqk, initial_state=None, output_final_state=False, scale=None, *,
           stages=None, warpgroups=None):
    """`fwd_scan` without its checks: for a caller whose `is_supported` just said None (the
    chain's gate), so a host-bound step does not pay for them twice."""
    outs, key, args, dyn, cfg = _plan(
        qg, kg, w, u, gk, Aqk, initial_state, output_final_state, scale, stages, warpgroups
    )
    S.run_cached(_cache, cfg, key, args, dyn)
    return outs
