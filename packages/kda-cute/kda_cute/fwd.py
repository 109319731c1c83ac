"""fwd: the forward state scan fused with its readout on sm_90 (fla 0.6.0's
`chunk_gated_delta_rule_fwd_h` + `chunk_gla_fwd_o_gk`, h never written per chunk).

Per (b, hv), over chunks c of 64 tokens (gk in log2 units, gd = gk at the chunk's last valid row):

    v_new_c = u_c - w_c @ bf16(h_c)
    o_c     = scale * (qg_c @ bf16(h_c)) + tril(Aqk_c) @ bf16(v_new_c),   qg = bf16(q * exp2(gk))
    h_{c+1} = exp2(gd_c)[:, None] * h_c + kg_c^T @ bf16(v_new_c)
    ht      = h_NT (fp32, when output_final_state)

with fla's casts (qg, h, v_new, Aqk in the input dtype for the dots, fp32 accumulation, o in the
input dtype). Aqk's strictly-upper triangle is masked in smem (fla's intra leaves it unwritten).

CTA decomposition: b1's (see `kda_cute.b1`): one warpgroup per (b, hv, 64-wide V tile), `nwg`
per CTA sharing the w / qg / kg / Aqk / gd tiles, grid (V / (64 nwg), HV, B), a TMA ring of
`stages` with full / empty mbarriers; `variant()` picks (stages, nwg) by grid.

Layouts: the state is h^T [v, k] fp32, the accumulator of an m64n128 wgmma; every GEMM takes A
from registers:

    P^T, O^T = bf16(h^T) @ w^T, bf16(h^T) @ qg^T      one wgmma group, B = w, qg (t, k) K-major
    v_new^T  = u^T - P^T
    o^T      = scale O^T + bf16(v_new^T) @ tril(Aqk)^T  B = Aqk (t, s) K-major, masked in smem
    h^T     <- exp2(gd)[k] h^T + bf16(v_new^T) @ kg      B = kg (k, t) MN-major

qg arrives ready-gated by TMA with w, kg, u, Aqk and gk's last row (fla's fwd_intra writes it,
`disable_recompute`: the chain's fwd_intra(want_qg=True)), one value head per row, so GVA needs
no q-head ratio here. smem per stage: w, qg, kg 16 KB each, Aqk 8, u 8 per V tile; o leaves by
TMA store from two 8 KB buffers per warpgroup (chunk parity). One CTA barrier per chunk (the
shared Aqk mask). No per-chunk state leaves the CTA; q stays in the contract but is not read.

Packed sequences: `chunks` (b1's: int32 [2, N + 1], chunk offsets on the padded row [1, T_pad, ...]
and the walk order, one CTA per (V tile, head, sequence)) writes o [1, T_pad, HV, V] on the padded
row. With the chunk table too (`table` int32 [T_pad / 64, 2], kda_chain.varlen's: per padded chunk j
its first packed token and its nv valid rows; `T_raw` the packed row's tokens), the `packed_o` build
writes o [1, T_raw, HV, V] straight onto the packed row: row r < nv of chunk j at table[j, 0] + r,
no other row (pad rows never, nor a row of another sequence). A full chunk leaves by the same TMA
store at the packed row offset (a domain offset of the store's coordinates; TMA takes any row); a
partial one (a sequence's last) by predicated 16-byte stores of the warpgroup's threads from the
same smem buffer after the same barrier (a 64-row box would overwrite the next sequence's first rows
while another CTA writes them), then an empty bulk group so the parity wait still counts chunks
(`_scan.store_packed`). The table row is read at the chunk's start, under its GEMMs. Without a table
the kernel's parameters and PTX are the padded-row build's, byte for byte.

Constraints: b1's (bf16 / fp16, K = 128, V % 64 == 0, HV % H == 0, contiguous, aligned; packed
only through `chunks`, B = 1), plus qg [B, T, HV, 128] and Aqk [B, T, HV, 64] (chunk 64) in u's
dtype; `table` needs `chunks` and an int T_raw in 1..T_pad (its contents are trusted).

Bytes per call, B16 T8192 H=HV=16 K128 V256 bf16 (no h0 / ht; each adds 0.034 GB):

    read    qg 0.537 GB, kg 0.537, w 0.537, u 1.074, Aqk 0.268, gk rows 0.017    2.970 GB
    write   o 1.074 GB                                                            1.074 GB
    total   4.044 GB: 2.58 TB/s at 1.566 ms

Why this design:
  * qg from fla's fwd_intra, not q gated in the kernel: the in-kernel gating sat in the serial
    per-chunk loop (that design ran 3.864 ms vs fla's 3.894, 1.01x); storing qg costs fwd_intra
    ~0.33 ms of the ~1.9 ms this kernel saves.
  * register-A form with two o buffers: 1.569 ms vs the smem-operand kernel's 1.927 (bitwise
    equal); the second o buffer alone is 1.626 -> 1.569.
  * 2 stages x 2 warpgroups from 256 V tiles (1.569-1.582 ms vs 1.815-1.862 for x 1 at 1024
    tiles); 2 x 1 below (B2 T4096: 0.155 vs 0.222 ms for 2 x 2).

Today (H200, 2026-12-01, 3 calls per sample, no h0): 1.566 ms vs fla's fwd_h + fwd_o 3.836 ms
= 2.45x (stage benchmark, one call per round: 1.610 vs 3.876 ms, 2.41x).

History, falsified experiments and their logs: docs/perf/fwd.md.
"""

from dataclasses import dataclass

import torch

from . import scan_policy as P
from ._common.cache import CallCache, alloc
from ._common.lazy import LazyModule
from ._common.support import device_reason

S = LazyModule("kda_cute._scan")  # the device half: imported (with the DSL) on the first build
_cache = CallCache("kda_cute_fwd")


def variant(B: int, HV: int, V: int) -> tuple[int, int]:
    """(stages, warpgroups) for this grid: two warpgroups from P.WIDE_FROM_TILES V tiles (2 x 2
    1.569 ms vs 1.815-1.862 for one at 1024 tiles, 0.224 vs 0.262 at 256; at 128 2 x 1 0.155 vs
    0.222, H200 2026-12-01). docs/perf/fwd.md."""
    return (2, 2) if P.wide_grid(B, HV, V) else (2, 1)


@dataclass(frozen=True, kw_only=True)
class FwdConfig(P.ScanConfig):
    """Everything the compiled fwd depends on: the call cache's compile key."""

    has_h0: bool
    store_ht: bool
    scale: float
    # o straight onto the packed row through the o table (a build of its own: without it the
    # kernel's parameters and PTX are those of the padded-row build)
    packed_o: bool = False


class _Fwd(P.Build):
    def _layouts(self):
        import cutlass.cute as cute

        dt, st, nwg = self.dtype, self.stages, self.nwg
        self.l_w = S.smem_layout(dt, S.BT, S.KD, True, st)  # w (t, k): B K-major, shared
        self.l_q = S.smem_layout(dt, S.BT, S.KD, True, st)  # qg (t, k): B K-major, shared
        self.l_kg = S.smem_layout(dt, S.KD, S.BT, False, st)  # kg (k, t): B MN-major, shared
        self.l_u = S.smem_layout(dt, S.BV, S.BT, False, st * nwg)  # u (v, t) per (stage, warpgroup)
        self.l_a = S.smem_layout(dt, S.BT, S.BT, True, st)  # Aqk (t, s): B K-major, shared
        self.l_g = cute.make_layout((S.KD, 1, st))  # gk's row at the chunk's last token, fp32
        self.l_o = S.smem_layout(dt, S.BV, S.BT, False, 2 * nwg)  # o (v, t), slot parity * nwg + wg
        self.tx_bytes = sum(S.tile_bytes(dt, lay) for lay in (self.l_w, self.l_q, self.l_kg, self.l_a))
        self.tx_bytes += nwg * S.tile_bytes(dt, self.l_u) + S.KD * 4
        self.tiles = dict(sW=self.l_w, sQ=self.l_q, sKg=self.l_kg, sU=self.l_u, sA=self.l_a, sO=self.l_o)


def _fwd_kernel(cfg):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import warpgroup

    class K:
        def operands(self, qg, kg, w, u, gk, aqk, h0, o, ht, *tables):
            # the kernel's arguments: its TMA operands (in its order), then the others. `tables`:
            # (chunks,), or with packed_o (the o table, chunks): chunks stays the last tensor, the
            # one compile_fn sizes the grid by. packed_o adds o as a plain tensor (a partial
            # chunk's row stores) and the o table as the kernel's last two arguments
            tmas = (
                S.tma_load(S.row_view(w), cfg.l_w, (S.BT, S.KD)),
                S.tma_load(S.row_view(qg), cfg.l_q, (S.BT, S.KD)),
                S.tma_load(S.col_view(kg), cfg.l_kg, (S.KD, S.BT)),
                S.tma_load(S.col_view(u), cfg.l_u, (S.BV, S.BT)),
                S.tma_load(S.row_view(aqk), cfg.l_a, (S.BT, S.BT)),
                S.tma_load(S.col_view(gk), cfg.l_g, (S.KD, 1)),
                S.tma_store(S.col_view(o), cfg.l_o, (S.BV, S.BT)),
            )
            rest = (S.col_view(gk), S.fp32_state_view(h0), S.fp32_state_view(ht), tables[-1])
            return tmas, rest + ((S.col_view(o), tables[0]) if cfg.packed_o else ())

        @cute.kernel
        def kda_cute_fwd(self, tmas, mGc, mH0, mHt, mChunks, mO=None, mTab=None):
            # mO, mTab: packed_o's (defaults, not passed without it: the padded-row build keeps
            # its parameter list, symbol and PTX)
            w, q, kg, u, a, g, o = S.pairs(tmas)
            nst, nwg = cfg.stages, cfg.nwg
            cta = S.Cta(cfg, mGc, mChunks)
            tid, wg, wtid, bv, hv, b, vt = cta.tid, cta.wg, cta.wtid, cta.bv, cta.hv, cta.b, cta.vt
            hk, T, NT, c0, full, empty = cta.hk, cta.T, cta.NT, cta.c0, cta.mbar, cta.empty
            sW, sQ, sKg, sU, sA, sO = cta.tiles
            sGd, sO = cta.sGd, sO[None, None, wg]

            loads = [
                S.load(w, sW, (S.BT, S.KD), (None, 0, hv, b)),
                S.load(q, sQ, (S.BT, S.KD), (None, 0, hv, b)),
                S.load(kg, sKg, (S.KD, S.BT), (0, None, hk, b)),
                S.load(a, sA, (S.BT, S.BT), (None, 0, hv, b)),
                S.load(g, sGd, (S.KD, 1), (0, None, hv, b), "row"),
            ]
            # o's two buffers (chunk parity) share one gmem partition; the smem one is the chunk's
            gOt = cute.local_tile(o[1], (S.BV, S.BT), (vt, None, hv, b))
            st_o = (o[0], None, S.tma_part(o[0], sO, gOt)[1])
            for i in cutlass.range_constexpr(nwg):
                loads.append(S.load(u, sU, (S.BV, S.BT), (bv * nwg + i, None, hv, b), nwg, i))
            S.prologue(full, nst, cfg.tx_bytes, loads, c0, 1, NT, tid, T, empty, 4 * nwg)  # 1 arrive / warp

            hs = S.StateT(cfg, cta)  # h^T (v, k) and its GEMMs (mma_p also for o, over s)
            mma_p, mma_s, thr_p = hs.mma_p, hs.mma_s, hs.thr_p
            tBw, tBq, tBa, tBk = hs.b_p(sW), hs.b_p(sQ), hs.b_p(sA), hs.b_s(sKg)
            accP, accO = hs.accumulators(2)  # (w h)^T, o^T (v, t)
            acc, cS = hs.acc, hs.cS
            hs.start(cta, mH0, mHt)
            bar = 1 + wg

            for c in cutlass.range(NT, unroll=1):
                if cutlass.const_expr(cfg.packed_o):  # read now: the load lands under the GEMMs
                    row0, nv = mTab[c0 + c, 0], mTab[c0 + c, 1]
                s, hb = S.begin_chunk(hs, c, full)
                # P^T = bf16(h)^T w^T, O^T = bf16(h)^T qg^T: one group, A from registers
                S.gemm(mma_p, accP, S.acc_as_a(hb), tBw, None, s, False)
                S.gemm(mma_p, accO, S.acc_as_a(hb), tBq, None, s, False)
                warpgroup.commit_group()
                # under it: h *= exp2(gd) (column scale of h^T), u into registers, Aqk's upper
                # triangle zeroed (the whole CTA shares the tile), the last o store done reading
                S.decay_cols(acc, cS, sGd, s)
                ub = cute.make_rmem_tensor_like(accP, cfg.dtype)
                cute.autovec_copy(thr_p.partition_C(sU[None, None, s * nwg + wg]), ub)
                S.mask_upper(sA[None, None, s], tid, S.THREADS * nwg)
                if wtid == 0:
                    cute.arch.cp_async_bulk_wait_group(1, read=True)  # this parity's: two chunks old
                S.sync_smem_for_async()
                warpgroup.wait_group(0)
                accP.store(ub.load().to(cutlass.Float32) - accP.load())
                vb = S.cast(accP, cfg.dtype)
                accO.store(accO.load() * cfg.scale)
                # o^T += bf16(v_new)^T tril(Aqk)^T ; h^T += bf16(v_new)^T kg
                warpgroup.fence()
                S.gemm(mma_p, accO, S.acc_as_a(vb), tBa, None, s, True)
                S.gemm(mma_s, acc, S.acc_as_a(vb), tBk, None, s, True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                S.release(empty, s)
                sOc = cute.make_tensor(sO.iterator + (c % 2) * (nwg * S.BV * S.BT), sO.layout)
                S.frag_to_smem(accO, thr_p.partition_C(sOc), cfg.dtype)
                S.sync_smem_for_async_wg(bar)
                if cutlass.const_expr(cfg.packed_o):  # full chunks by TMA, a partial one row by row
                    S.store_packed(o, mO, sOc, cfg.l_o.inner, row0, nv, vt, hv, wtid)
                elif wtid == 0:
                    S.store_chunk(st_o, c0 + c, S.tma_part(o[0], sOc, gOt)[0])
                S.refill(full, empty, s, c, nst, NT, cfg.tx_bytes, loads, T, tid, c0)

            S.finish(acc, hs.tSgHt if cfg.store_ht else None, wtid)

    k = K()
    return k.operands, k.kda_cute_fwd


# ------------------------------------------------------------------------------------ host side
def is_supported(
    q, qg, kg, w, u, gk, Aqk, initial_state=None, output_final_state=False, scale=None, chunks=None, *,
    table=None, T_raw=None,
) -> str | None:
    r = device_reason(u) or static_reason(q, qg, kg, w, u, gk, Aqk, initial_state, chunks, table=table,
                                          T_raw=T_raw)
    if qg is None:  # say why the chain did not ask fwd_intra for it (u has v's shape and dtype)
        why = plan_reason(q, u, initial_state, chunks)
        return f"{r}: {why}" if why and why != r else r
    return r


def static_reason(q, qg, kg, w, u, gk, Aqk, initial_state=None, chunks=None, *, table=None,
                  T_raw=None) -> str | None:
    """What the kernel cannot compute at all (shape / dtype / layout). q is not read by the
    kernel (qg replaces it), so it is not checked; qg must be what fwd_intra(want_qg=True) gives.
    `table`, `T_raw`: the packed o (`fwd_scan`), checked by P.packed_row_reason."""
    if qg is None:
        return "qg not computed by fwd_intra"
    r = P.operand_reason(kg, w, u, gk, initial_state, chunks)
    if r:
        return r
    B, T, HV, V = u.shape
    if qg.dtype != u.dtype or Aqk.dtype != u.dtype:
        return "qg, Aqk must share u's dtype"
    if tuple(qg.shape) != (B, T, HV, P.KD):
        return "qg must be [B, T, HV, 128] (one row per value head)"
    if tuple(Aqk.shape) != (B, T, HV, P.BT):
        return "Aqk must be [B, T, HV, 64] (chunk 64)"
    for name, t in (("qg", qg), ("Aqk", Aqk)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            return f"{name} not contiguous / aligned"
    return P.packed_row_reason(table, T_raw, u, chunks)


def plan_reason(q, v, initial_state=None, chunks=None) -> str | None:
    """Would this kernel take a chain call on q [B, T, H, K], v [B, T, HV, V]? From the chain's
    inputs alone, before fwd_intra runs: the chain asks fwd_intra for qg only when this is None.

    Makes the checks of is_supported that the inputs decide (device, dtype, K, V, T, heads,
    initial_state), so no qg is computed for a kernel the chain would not run. The
    intermediates (fresh, contiguous, the shapes fla's fwd_intra gives) are checked by
    is_supported when the stage is called."""
    r = device_reason(v)
    if r:
        return r
    if q.dim() != 4 or v.dim() != 4:
        return "expected [B, T, heads, dim] tensors (varlen / cu_seqlens not supported)"
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if v.dtype not in P.DTYPES:
        return f"dtype {v.dtype} (bf16/fp16 only)"
    if q.dtype != v.dtype:
        return "q, k, v must share one dtype"
    r = P.extent_reason(K, V, T)
    if r:
        return r
    if tuple(v.shape[:2]) != (B, T) or HV % H:
        return "v must be [B, T, HV, V] with HV % H == 0"
    return P.chunks_reason(chunks, v) or P.state_reason("initial_state", initial_state, P.seqs(v, chunks),
                                                        HV, K, V)


def _plan(qg, kg, w, u, gk, Aqk, initial_state, output_final_state, scale, chunks, stages, warpgroups,
          table=None, T_raw=None):
    B, T, HV, V = u.shape
    N = P.seqs(u, chunks)
    stages, nwg = P.pick_build(variant(N, HV, V), stages, warpgroups, V)
    K = kg.shape[-1]
    if scale is None:
        scale = K**-0.5
    dev = u.device
    packed = table is not None
    # packed: only the valid rows are written, so o is never the padded row's (rows of it unwritten)
    o = alloc((1, T_raw, HV, V) if packed else u.shape, u.dtype, u)
    ht = alloc((N, HV, K, V), torch.float32, u) if output_final_state else None
    dummy = P.dummy(dev)
    h0 = initial_state if initial_state is not None else dummy
    chunk_table, table_dyn = P.chunk_args(chunks, dev)
    args = (qg, kg, w, u, gk, Aqk, h0, o, ht if ht is not None else dummy)
    dyn = ((0, 1),) * 6 + ((0,) if initial_state is not None else (), (0, 1), (0,) if ht is not None else ())
    if packed:  # the o table before chunks (the kernel's operands), its chunk count dynamic
        args, dyn = args + (table,), dyn + ((0,),)
    args, dyn = args + (chunk_table,), dyn + (table_dyn,)
    cfg = FwdConfig.of(u, kg, stages, nwg, chunks, has_h0=initial_state is not None,
                       store_ht=bool(output_final_state), scale=float(scale), packed_o=packed)
    return (o, ht), args, dyn, cfg


def compile_for(
    q, qg, kg, w, u, gk, Aqk, initial_state=None, output_final_state=False, scale=None, chunks=None, *,
    stages=None, warpgroups=None, table=None, T_raw=None,
):
    """Compile without launching (CPU tests); returns the compiled object. q is not read."""
    _, args, dyn, cfg = _plan(
        qg, kg, w, u, gk, Aqk, initial_state, output_final_state, scale, chunks, stages, warpgroups,
        table, T_raw,
    )
    return S.compile_only(_Fwd, _fwd_kernel, cfg, args, dyn)


def fwd_scan(
    q, qg, kg, w, u, gk, Aqk, initial_state=None, output_final_state=False, scale=None, chunks=None, *,
    stages=None, warpgroups=None, table=None, T_raw=None,
):
    """fwd_h + fwd_o fused -> (o, ht). qg = bf16(q * exp2(gk)) [B, T, HV, K] in u's dtype, as
    fla's fwd_intra stores it with disable_recompute (the chain's fwd_intra(want_qg=True)); q is
    not read (it stays in the contract for fla and the reference). `chunks`: packed sequences, as
    in b1.fwd_h. `table` (with chunks), `T_raw`: o onto the packed row, [1, T_raw, HV, V], row r <
    table[j, 1] of padded chunk j at packed row table[j, 0] + r, no other row written (the
    module docstring). `stages` / `warpgroups`: the compiled variant, by default `variant(B, HV,
    V)`. Raises ValueError on a call the kernel cannot compute (shape, dtype, layout, device)."""
    r = static_reason(q, qg, kg, w, u, gk, Aqk, initial_state, chunks, table=table, T_raw=T_raw) \
        or device_reason(u)
    if r is not None:
        raise ValueError(f"kda_cute.fwd.fwd_scan: unsupported call: {r}")
    return launch(q, qg, kg, w, u, gk, Aqk, initial_state, output_final_state, scale, chunks,
                  stages=stages, warpgroups=warpgroups, table=table, T_raw=T_raw)


def launch(q, qg, kg, w, u, gk, Aqk, initial_state=None, output_final_state=False, scale=None, chunks=None,
           *, stages=None, warpgroups=None, table=None, T_raw=None):
    """`fwd_scan` without its checks: for a caller whose `is_supported` just said None (the
    chain's gate), so a host-bound step does not pay for them twice."""
    outs, args, dyn, cfg = _plan(
        qg, kg, w, u, gk, Aqk, initial_state, output_final_state, scale, chunks, stages, warpgroups,
        table, T_raw,
    )
    S.run_cached(_cache, _Fwd, _fwd_kernel, cfg, args, dyn)
    return outs
