"""dhu: the backward state scan on sm_90 (fla 0.6.0's `chunk_gated_delta_rule_bwd_dhu` as
`chunk_kda_bwd` calls it: q = qg, k = kg, gk, h0, dht, scale), with the dv half of fla's
`chunk_kda_bwd_dAv` fused in: this kernel reads Aqk instead of dAv's dv.

Per (b, hv), newest chunk first (gk in log2 units, gd = gk at the chunk's last valid row):

    dh[:, c]  = dh_c                                      (bf16, [B, NT, HV, K, V])
    dv2_c     = tril(Aqk_c)^T @ do_c + kg_c @ bf16(dh_c)  (fp32 accumulate, stored in do's dtype)
    dh_{c-1}  = exp2(gd_c)[:, None] * dh_c + scale * qg_c^T @ do_c - w_c^T @ bf16(dv2_c)
    dh0       = dh_0 (fp32, only when h0 is given; fla's contract), dh_NT = dht or 0

fla rounds dAv's dv to bf16 before dhu adds kg @ dh; here both products share one fp32
accumulator (one rounding fewer).

CTA decomposition: `kda_cute._scan`'s skeleton: one warpgroup per (b, hv, 64-wide V tile), `nwg`
per CTA sharing the kg / qg / w / Aqk tiles, grid (V / (64 nwg), HV, B), chunks walked in reverse
through the same TMA ring; `variant()` picks nwg by grid.

The state dh [128 k, 64 v] fp32 is the accumulator of both state GEMMs: it is scaled by
exp2(gd) / scale, `qg^T @ do` accumulates into it, it is scaled by -scale, `w^T @ dv2`
accumulates into it, and it is negated: dh*e + scale*Q - W with two wgmma groups and no extra
register tile (sign flips are exact; the two fp32 scalings round like fla's separate products to
within an ulp). `kg @ dh` (K-major kg), `tril(Aqk)^T @ do` and `qg^T @ do` (MN-major Aqk^T, qg,
do) go out in one wgmma group; Aqk's strictly-upper triangle is zeroed in smem first (fla's
fwd_intra leaves it unwritten), under the barrier that publishes the bf16 dh.

Layouts: kg arrives token-major (T, K); qg and w feature-major (K, T); Aqk as (s, t) (A = Aqk^T,
MN-major); do (V, T). dh leaves by TMA store from the bf16 smem copy that is also the B operand of
`kg @ dh`; dv2 from the bf16 buffer that is the B operand of `w^T @ dv2`. smem per stage: kg, qg,
w 16 KB each, Aqk 8 KB, do 8 KB per V tile; per warpgroup the dh (16 KB) and dv2 (8 KB) buffers.

Packed sequences (`chunks`, int32 [2, N + 1]: each sequence's chunks on the one padded row [1,
T_pad, ...] of kda_chain.varlen, then the walk order: CTA row z takes sequence chunks[1, z]; h0 /
dht / dh0 [N, ...]). With the chunk table too (`table`, int32 [T_pad / 64, 2], compiled in: the
config's `table`) do is read straight from the packed row [1, T_raw <= T_pad, HV, V], so the chain
need not gather it onto the padded row (index_select + index_fill, 0.59 ms at 131072 tokens): padded
chunk j's row r < nv = table[j, 1] is do's row table[j, 0] + r. Its do tiles are TMA boxes at that
row (the coordinate tensor `cute.domain_offset` by it: any row); a chunk's nv and the packed row its
refill loads are read at the top of the iteration beside gk's row, so the refill's address waits on
no load. A box past a chunk's valid rows holds the next sequence's rows (or TMA's zero fill past
do's end): the partial chunk (only a sequence's last, the walk's first) sets its do tile's rows >=
nv to +0 in smem once the stage landed, before the fence + barrier that already publish the masked
Aqk to the wgmmas (no barrier of its own; a full chunk runs no pass of the loop), so they are exact
zeros in every product and no other sequence's value (NaN, Inf, -0) reaches it. (A predicated
cp.async of that chunk instead would add a second copy path and its wait to the ring.) Everything
else (qg, kg, w, gk, Aqk and every output) stays on the padded row; without the table the build is
the one before it byte for byte (PTX compared). Registers (ptxas 13.0, sm_90a, no spills): 156 / 171
without the table (one / two warpgroups, with dht / dh0), 158 / 174 with it. H200 2026-12-04, 16
sequences of 4890..10917 tokens (131072), H = HV = 16, V = 256: table build 1.775 ms (primed) vs the
padded build 1.885 plus the gather 0.586; bitwise equal outputs.

Constraints: bf16 / fp16; K = 128; V % 64 == 0; HV % H == 0; contiguous, aligned; packed: B = 1,
T_pad % 64 == 0, the table needs chunks and its contents are trusted (not read on the host);
h0 / dht / dh0 fp32 [B, HV, K, V]; Aqk [B, T, HV, 64] in do's dtype; at least GRID_FLOOR = 32
V tiles (B * HV * V / 64): below that not timed, fla runs.

Bytes per call, B16 T8192 H=HV=16 K128 V256 bf16 (no dht / dh0; each adds 0.034 GB):

    read    qg 0.537 GB, kg 0.537, w 0.537, do 1.074, Aqk 0.537 (once per CTA: two per
            (b, hv) at V256), gk rows 0.017                                         3.239 GB
    write   dh 2.147 GB, dv2 1.074                                                3.221 GB
    total   6.460 GB (the unfused kernel read dv instead: 6.997 GB, plus dAv's own 3.49 GB)

Why this design:
  * the smem-operand skeleton, not b1's register-A form: that form measured 1.885 vs 1.834 ms in
    the two-warpgroup build the reference shape runs (faster only with one warpgroup).
  * two warpgroups from 256 V tiles: 1.834 vs 2.147 ms at 1024 tiles; one below (B2 T4096
    V256: 0.158 vs 0.197 ms), where two would halve a grid under one wave of SMs.
  * L2 evict-first hints on the TMA traffic are 2-16% slower (measured on b1 and fwd): the other
    V half's CTA re-reads kg / w from L2.

Today (H200, 2026-12-02, bench/check_scans.py, 3 calls per sample, no h0): 1.876 ms vs fla's
bwd_dAv + bwd_dhu (what it replaces) 4.063 ms = 2.17x; B2 T4096 V256 0.168 vs 0.327 (1.95x); B1
T4096 V128 (32 V tiles) 0.158 vs 0.287 (1.81x). The unfused kernel took 1.834 ms at the
reference shape (against fla's bwd_dhu alone, 3.055).

History, falsified experiments and their logs: docs/perf/dhu.md.
"""

from dataclasses import dataclass

import torch

from . import scan_policy as P
from ._common.cache import CallCache, alloc
from ._common.lazy import LazyModule
from ._common.support import device_reason

S = LazyModule("kda_cute._scan")  # the device half: imported (with the DSL) on the first build
_cache = CallCache("kda_cute_dhu")
STAGES = 2
# 64-wide V tiles (B * HV * V/64) below which fla runs. Against what the kernel replaces (fla's
# bwd_dAv + bwd_dhu) ours is faster at the smallest grid timed: 32 tiles (B1 T4096 H16 V128) 0.158
# vs 0.287 ms (H200 2026-12-02); below 32 not timed. (Unfused, against fla's bwd_dhu alone, it
# lost at 64 tiles: 0.258 vs 0.236, 2026-12-01.)
GRID_FLOOR = 32


def variant(B: int, HV: int, V: int) -> tuple[int, int]:
    """(stages, warpgroups) for this grid, b1's rule: two warpgroups from P.WIDE_FROM_TILES V
    tiles (1024 tiles: 1.834 vs 2.147 ms), one below (128 tiles: 0.158 vs 0.197; fla 0.224;
    H200 2026-12-01). docs/perf/dhu.md."""
    return (STAGES, 2) if P.wide_grid(B, HV, V) else (STAGES, 1)


@dataclass(frozen=True, kw_only=True)
class DhuConfig(P.ScanConfig):
    """Everything the compiled dhu depends on: the call cache's compile key."""

    ratio_q: int  # HV // qg's heads
    has_dh0: bool
    has_dht: bool
    scale: float
    # do read from the packed row through the padded row's chunk table (module docstring); off,
    # the build is today's byte for byte (the table's code is all under const_expr)
    table: bool = False


class _Dhu(P.Build):
    def _layouts(self):
        dt, st, nwg = self.dtype, self.stages, self.nwg
        self.l_kg = S.smem_layout(dt, S.BT, S.KD, True, st)  # kg (t, k) A K-major, shared by the warpgroups
        self.l_q = S.smem_layout(dt, S.KD, S.BT, False, st)  # qg^T (k, t) A MN-major, shared
        self.l_w = S.smem_layout(dt, S.KD, S.BT, False, st)  # w^T (k, t) A MN-major, shared
        self.l_a = S.smem_layout(dt, S.BT, S.BT, False, st)  # Aqk^T (s, r) A MN-major, shared
        self.l_do = S.smem_layout(dt, S.BV, S.BT, False, st * nwg)  # do (v, t) B MN-major, per warpgroup
        self.l_h = S.smem_layout(dt, S.BV, S.KD, False, nwg)
        self.l_v = S.smem_layout(dt, S.BV, S.BT, False, nwg)
        self.tx_bytes = sum(S.tile_bytes(dt, lay) for lay in (self.l_kg, self.l_q, self.l_w, self.l_a))
        self.tx_bytes += nwg * S.tile_bytes(dt, self.l_do)
        self.tiles = dict(
            sKg=self.l_kg, sQ=self.l_q, sW=self.l_w, sA=self.l_a, sDo=self.l_do, sH=self.l_h, sV=self.l_v
        )


def _dhu_kernel(cfg):
    import cutlass
    import cutlass.cute as cute

    class K:
        def operands(self, qg, kg, w, gk, dht, do, aqk, dh, dh0, dv2, *tail):
            # the kernel's arguments: its TMA operands (in its order), then the others. `tail`:
            # (chunks,), or with the table build (table, chunks) (chunks last: compile_fn's grid z),
            # which reach the kernel as its mChunks argument (chunks, table), so the kernel without
            # the table keeps its parameters (and PTX)
            chunks = tail[-1] if not cfg.table else (tail[1], tail[0])
            tmas = (
                S.tma_load(S.row_view(kg), cfg.l_kg, (S.BT, S.KD)),
                S.tma_load(S.col_view(qg), cfg.l_q, (S.KD, S.BT)),
                S.tma_load(S.col_view(w), cfg.l_w, (S.KD, S.BT)),
                S.tma_load(S.col_view(aqk), cfg.l_a, (S.BT, S.BT)),
                S.tma_load(S.col_view(do), cfg.l_do, (S.BV, S.BT)),
                S.tma_store(S.state_view(dh), cfg.l_h, (S.BV, S.KD)),
                S.tma_store(S.col_view(dv2), cfg.l_v, (S.BV, S.BT)),
            )
            mmas = (S.mma_tt(cfg.dtype), S.mma_kv(cfg.dtype))
            return tmas, (S.col_view(gk), S.fp32_state_view(dht), S.fp32_state_view(dh0), chunks, *mmas)

        @cute.kernel
        def kda_cute_dhu(self, tmas, mGk, mDht, mDh0, mChunks, mma_tt: cute.TiledMma,
                         mma_kv: cute.TiledMma):
            kg, q, w, a, do, h, v = S.pairs(tmas)
            nst, nwg = cfg.stages, cfg.nwg
            if cutlass.const_expr(cfg.table):
                mChunks, mTable = mChunks
            cta = S.Cta(cfg, mGk, mChunks)
            tid, wg, wtid, bv, hv, b, vt = cta.tid, cta.wg, cta.wtid, cta.bv, cta.hv, cta.b, cta.vt
            hk, hq, T, NT, c0, mbar, sG = cta.hk, cta.hq, cta.T, cta.NT, cta.c0, cta.mbar, cta.sG
            seq = cta.seq
            sKg, sQ, sW, sA, sDo, sH, sV = cta.tiles
            sH, sV = sH[None, None, wg], sV[None, None, wg]

            loads = [
                S.load(kg, sKg, (S.BT, S.KD), (None, 0, hk, b)),
                S.load(q, sQ, (S.KD, S.BT), (0, None, hq, b)),
                S.load(w, sW, (S.KD, S.BT), (0, None, hv, b)),
                S.load(a, sA, (S.BT, S.BT), (0, None, hv, b)),
            ]
            st_h = S.store(h, sH, (S.BV, S.KD), (vt, 0, hv, None, b))
            st_v = S.store(v, sV, (S.BV, S.BT), (vt, None, hv, b))
            if cutlass.const_expr(not cfg.table):
                for i in cutlass.range_constexpr(nwg):
                    vti = bv * nwg + i
                    loads.append(S.load(do, sDo, (S.BV, S.BT), (vti, None, hv, b), nwg, i))
            S.prologue(mbar, nst, cfg.tx_bytes, loads, c0 + NT - 1, -1, NT, tid)
            if cutlass.const_expr(cfg.table):  # do's tiles of the first chunks (the stages' expect_tx
                if tid < 32:  # counted them already), warp 0 whole as issue_chunk
                    for i in cutlass.range_constexpr(nst):
                        if i < NT:
                            _load_do(do, sDo, mbar, i, mTable[c0 + NT - 1 - i, 0], bv, hv, nwg)

            thr_tt = mma_tt.get_slice(wtid)
            thr_kv = mma_kv.get_slice(wtid)
            tAk = mma_tt.make_fragment_A(thr_tt.partition_A(sKg))
            tBh = mma_tt.make_fragment_B(thr_tt.partition_B(sH))
            tAq = mma_kv.make_fragment_A(thr_kv.partition_A(sQ))
            tAw = mma_kv.make_fragment_A(thr_kv.partition_A(sW))
            tAa = mma_kv.make_fragment_A(thr_kv.partition_A(sA))  # the (64, 64) tile: one M block
            tBdo = mma_kv.make_fragment_B(thr_kv.partition_B(sDo))
            tBv = mma_kv.make_fragment_B(thr_kv.partition_B(sV))
            cS = thr_kv.partition_C(cute.make_identity_tensor((S.KD, S.BV)))
            cP = thr_tt.partition_C(cute.make_identity_tensor((S.BT, S.BV)))
            acc = cute.make_rmem_tensor(cS.shape, cutlass.Float32)
            accP = cute.make_rmem_tensor(cP.shape, cutlass.Float32)
            tSsH = thr_kv.partition_C(S.transposed(sH))
            tPsV = thr_tt.partition_C(S.transposed(sV))

            tSgDh0 = thr_kv.partition_C(cute.local_tile(mDh0, (S.KD, S.BV), (0, vt, hv, seq)))
            gDht = cute.local_tile(mDht, (S.KD, S.BV), (0, vt, hv, seq))
            if cutlass.const_expr(cfg.has_dht):
                cute.autovec_copy(thr_kv.partition_C(gDht), acc)
            else:
                acc.fill(0.0)

            for j in cutlass.range(NT, unroll=1):
                c = c0 + NT - 1 - j  # (the chunk's index in the row: see S.Cta)
                s = j % nst
                phase = (j // nst) % 2
                last = cutlass.min((c + 1) * S.BT, T) - 1
                if cutlass.const_expr(cfg.table):
                    # read at the chunk's start, beside gk's row, so their latencies overlap: the
                    # chunk's valid rows, and the packed row of the chunk the refill loads (c - nst:
                    # the walk is newest first; clamped to a chunk of the table where none is)
                    nv = mTable[c, 1]
                    row_next = mTable[cutlass.max(c - nst, c0), 0]
                S.load_row_scale(sG, mGk[None, last, hv, b], tid)
                S.frag_to_smem(acc, tSsH, cfg.dtype)
                cute.arch.mbarrier_wait(mbar + s, phase)
                # Aqk's strictly-upper triangle (s > r) zeroed: fla's fwd_intra leaves it unwritten
                S.mask_upper(S.transposed(sA[None, None, s]), tid, S.THREADS * nwg)
                if cutlass.const_expr(cfg.table):  # a partial chunk's rows >= nv: other rows of do
                    _zero_rows(sDo[None, None, s * nwg + wg], nv, wtid)
                S.sync_smem_for_async()
                if wtid == 0:
                    S.store_chunk(st_h, c)
                # P = kg @ bf16(dh) + tril(Aqk)^T @ do ; X = dh * exp2(gd) / scale + qg^T @ do
                # (one wgmma group; the C layouts of mma_tt and mma_kv are the same m64n64 one)
                S.scale_rows(acc, cS, sG, cutlass.Float32(1.0 / cfg.scale))
                cute.nvgpu.warpgroup.fence()
                S.gemm(mma_tt, accP, tAk, tBh, s, None, False)
                S.gemm(mma_kv, accP, tAa, tBdo, s, s * nwg + wg, True)
                S.gemm(mma_kv, acc, tAq, tBdo, s, s * nwg + wg, True)
                S.wgmma_wait()
                S.frag_to_smem(accP, tPsV, cfg.dtype)
                S.sync_smem_for_async()
                if wtid == 0:
                    S.store_chunk(st_v, c)
                # dh = -( -scale * X + w^T @ bf16(dv2) )
                acc.store(acc.load() * (-cfg.scale))
                cute.nvgpu.warpgroup.fence()
                S.gemm(mma_kv, acc, tAw, tBv, s, None, True)
                S.wgmma_wait()
                acc.store(-acc.load())
                if wtid == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.sync_threads()
                if tid < 32:  # warp 0 whole: see S.issue_chunk
                    if j + nst < NT:
                        S.issue_chunk(mbar, s, cfg.tx_bytes, loads, c0 + NT - 1 - (j + nst))
                        if cutlass.const_expr(cfg.table):
                            _load_do(do, sDo, mbar, s, row_next, bv, hv, nwg)

            S.finish(acc, tSgDh0 if cfg.has_dh0 else None, wtid)

    @cute.jit
    def _load_do(do, sDo, mbar, s, row0, bv, hv, nwg: cutlass.Constexpr):
        """(warp 0 whole; see S.issue_chunk) the table build's TMA loads of do's tiles of one
        chunk into stage s (one per warpgroup's V tile), from packed row `row0`: the TMA
        coordinates offset by row0 (cute.domain_offset; any row, not a multiple of 64). The box
        runs 64 rows from there: a partial chunk's rows past its valid ones are the next
        sequence's (`_zero_rows` clears them) or past do's end (TMA zero-fills those). The stage's
        expect_tx is issue_chunk's: the box's full bytes arrive either way."""
        gdo = cute.domain_offset((0, row0, 0, 0), do[1])
        for i in cutlass.range_constexpr(nwg):
            ts, tg = S.tma_part(do[0], sDo, cute.local_tile(gdo, (S.BV, S.BT), (bv * nwg + i, None, hv, 0)))
            cute.copy(do[0], tg[None, 0], ts[None, s * nwg + i], tma_bar_ptr=mbar + s)

    @cute.jit
    def _zero_rows(sDo, nv, wtid):
        """A warpgroup's do tile (v, t) in smem: token rows t >= nv set to +0 (a generic-proxy
        write: the caller's sync_smem_for_async publishes it to the wgmmas). Only a sequence's
        last chunk has nv < 64 (the walk's first), so full chunks skip the loop; 64 v per row,
        two rows per pass of the 128 threads."""
        for t in cutlass.range(nv + wtid // S.BV, S.BT, S.THREADS // S.BV, unroll=1):
            sDo[wtid % S.BV, t] = sDo.element_type(0.0)

    k = K()
    return k.operands, k.kda_cute_dhu


# ------------------------------------------------------------------------------------ host side
def is_supported(qg, kg, w, gk, h0, dht, do, dv, scale=None, Aqk=None, chunks=None, *,
                 table=None) -> str | None:
    return device_reason(do) or static_reason(qg, kg, w, gk, h0, dht, do, dv, Aqk, chunks, table=table)


def static_reason(qg, kg, w, gk, h0, dht, do, dv, Aqk=None, chunks=None, *, table=None) -> str | None:
    """Shape / dtype / layout checks and the grid floor (no device needed)."""
    r = hard_reason(qg, kg, w, gk, h0, dht, do, dv, Aqk, chunks, table=table)
    if r:
        return r
    B, T, HV, V = do.shape
    return P.floor_reason((P.seqs(do, chunks), T, HV, V), GRID_FLOOR)


def _table_reason(qg, do, chunks, table) -> str | None:
    """The table build's own reasons: qg the padded row [1, T_pad, ...], do the packed row [1,
    T_raw, HV, V], then fwd's packed-row checks (`P.packed_row_reason`: chunks given, the chunk
    table int32 [T_pad / 64, 2], contiguous, on the operands' device, 1 <= T_raw <= T_pad) and the
    table 16-byte aligned. The table's contents are trusted, not read (that would sync the host)."""
    if qg.dim() != 4 or qg.shape[0] != 1 or qg.shape[1] % P.BT:
        return f"with a table qg is the padded row [1, T_pad, H, K], T_pad % 64 == 0; got {tuple(qg.shape)}"
    if do.dim() != 4 or do.shape[0] != 1:
        return f"with a table do is the packed row [1, T_raw, HV, V]; got {tuple(do.shape)}"
    r = P.packed_row_reason(table, do.shape[1], qg, chunks)
    if r:
        return r
    return "table not 16-byte aligned" if table.data_ptr() % 16 else None


def hard_reason(qg, kg, w, gk, h0, dht, do, dv, Aqk=None, chunks=None, *, table=None) -> str | None:
    """What the kernel cannot compute at all (shape / dtype / layout). With `table` every
    operand but do is on the padded row (T = qg's), do on the packed row."""
    if Aqk is None or dv is not None:
        return "the kernel takes Aqk and no dv (it computes dv = tril(Aqk)^T do itself)"
    if table is not None:
        r = _table_reason(qg, do, chunks, table)
        if r:
            return r
    if do.dtype not in P.DTYPES:
        return f"dtype {do.dtype} (bf16/fp16 only)"
    if any(t.dtype != do.dtype for t in (qg, kg, w, Aqk)):
        return "qg, kg, w, do, Aqk must share one dtype"
    if gk.dtype != torch.float32:
        return f"gk must be fp32 (got {gk.dtype})"
    if any(t.dim() != 4 for t in (qg, kg, w, gk, do, Aqk)):
        return "expected [B, T, heads, dim] tensors (varlen / cu_seqlens not supported)"
    B, T, HV, V = do.shape
    if table is not None:
        T = qg.shape[1]
    K = w.shape[-1]
    r = P.extent_reason(K, V, T)
    if r:
        return r
    if (
        tuple(Aqk.shape) != (B, T, HV, P.BT)
        or tuple(w.shape) != (B, T, HV, K)
        or tuple(gk.shape) != (B, T, HV, K)
    ):
        return "Aqk [B, T, HV, 64] / w / gk shapes do not match do"
    for name, t in (("qg", qg), ("kg", kg)):
        if t.shape[0] != B or t.shape[1] != T or t.shape[3] != K or HV % t.shape[2]:
            return f"{name} must be [B, T, H, 128] with HV % H == 0"
    for name, t in (("qg", qg), ("kg", kg), ("w", w), ("gk", gk), ("do", do), ("Aqk", Aqk)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            return f"{name} not contiguous / aligned"
    r = P.chunks_reason(chunks, do if table is None else Aqk)  # (with a table: the padded row's T)
    if r:
        return r
    for name, t in (("h0", h0), ("dht", dht)):
        r = P.state_reason(name, t, P.seqs(do, chunks), HV, K, V)
        if r:
            return r
    return None


def _plan(qg, kg, w, gk, h0, dht, do, Aqk, scale, chunks, stages, warpgroups, table):
    B, _, HV, V = do.shape
    T = qg.shape[1]  # (with a table the padded row's; do is the packed row)
    N = P.seqs(do, chunks)
    stages, nwg = P.pick_build(variant(N, HV, V), stages, warpgroups, V)
    K = w.shape[-1]
    if scale is None:
        scale = K**-0.5
    NT = (T + P.BT - 1) // P.BT
    dev = do.device
    dh = alloc((B, NT, HV, K, V), qg.dtype, do)
    dh0 = alloc((N, HV, K, V), torch.float32, do) if h0 is not None else None
    dv2 = alloc((B, T, HV, V), do.dtype, do)
    dummy = P.dummy(dev)
    ctab, ctab_dyn = P.chunk_args(chunks, dev)
    args = (
        qg,
        kg,
        w,
        gk,
        dht if dht is not None else dummy,
        do,
        Aqk,
        dh,
        dh0 if dh0 is not None else dummy,
        dv2,
        *(() if table is None else (table,)),  # (the table build's; chunks stay last: compile_fn)
        ctab,
    )
    dyn = ((0, 1),) * 4 + (
        (0,) if dht is not None else (),
        (0, 1),
        (0, 1),
        (0, 1),
        (0,) if dh0 is not None else (),
        (0, 1),
        *(() if table is None else ((0,),)),
        ctab_dyn,
    )
    cfg = DhuConfig.of(do, kg, stages, nwg, chunks, ratio_q=HV // qg.shape[2], has_dh0=dh0 is not None,
                       has_dht=dht is not None, scale=float(scale), table=table is not None)
    return (dh, dh0, dv2), args, dyn, cfg


def compile_for(qg, kg, w, gk, h0, dht, do, dv, scale=None, Aqk=None, chunks=None, *, stages=None,
                warpgroups=None, table=None):
    """Compile without launching (CPU tests); returns the compiled object."""
    _, args, dyn, cfg = _plan(qg, kg, w, gk, h0, dht, do, Aqk, scale, chunks, stages, warpgroups, table)
    return S.compile_only(_Dhu, _dhu_kernel, cfg, args, dyn)


def bwd_dhu(qg, kg, w, gk, h0, dht, do, dv, scale=None, Aqk=None, chunks=None, *, stages=None,
            warpgroups=None, table=None):
    """-> (dh [B, NT, HV, K, V] in qg's dtype, dh0 fp32 or None (None when h0 is None), dv2 in do's
    dtype). The contract's fused form only: dv None, Aqk given (dv2 = tril(Aqk)^T do + kg dh).
    `chunks`: packed sequences, as in b1.fwd_h (dht / dh0 [N, ...]). `stages` / `warpgroups`: the
    compiled variant (see b1.fwd_h). `table` (with `chunks`, B = 1): do is the packed row [1, T_raw,
    HV, V], read through the padded row's chunk table (kda_chain.varlen: int32 [T_pad / 64, 2]),
    every other operand and the outputs on the padded row [1, T_pad, ...] (module docstring).
    Raises ValueError on a call the kernel cannot compute (shape, dtype, layout, device)."""
    r = hard_reason(qg, kg, w, gk, h0, dht, do, dv, Aqk, chunks, table=table) or device_reason(do)
    if r is not None:
        raise ValueError(f"kda_cute.dhu.bwd_dhu: unsupported call: {r}")
    return launch(qg, kg, w, gk, h0, dht, do, dv, scale, Aqk, chunks, stages=stages, warpgroups=warpgroups,
                  table=table)


def launch(qg, kg, w, gk, h0, dht, do, dv, scale=None, Aqk=None, chunks=None, *, stages=None,
           warpgroups=None, table=None):
    """`bwd_dhu` without its checks: for a caller whose `is_supported` just said None (the
    chain's gate), so a host-bound step does not pay for them twice."""
    outs, args, dyn, cfg = _plan(qg, kg, w, gk, h0, dht, do, Aqk, scale, chunks, stages, warpgroups, table)
    S.run_cached(_cache, _Dhu, _dhu_kernel, cfg, args, dyn)
    return outs
