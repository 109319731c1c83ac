"""The intra-chunk backward's per-column walk (kda_cute_intra's device code), shared by the two
kernels that run it: `kda_cute_intra` (its inputs loaded from global memory into smem) and
`kda_cute_bwd_chunk` (kda_cute.wy_dqkg's class with `fused=True`: the WY backward's outputs handed
over in smem, never written to global memory).

What it computes and how (the thread map, the anchored tf32 cross sums, the diagonal walk, the
fold) is in kda_cute.intra's module docstring. The caller provides, in smem: q, k (io dtype, row
stride `self.qs`), g (fp32, `self.gs`), dAqk, dAkk (fp32, `self.as_`), beta (fp32 [64]), the db
partials [64, K / 32] and the per-warp staging [warps, 8, 33] (fp32); and, per thread, the column
views of dq / dk / dg in (gmem or smem) and out (gmem, or dq / dk in place of their fp32 smem
inputs) at its column d = tidx % K, each out in its own dtype, db in and out as [64] views. The
kernel class supplies K, io_dtype, fold_dg, pf and the thread map
(ngrp groups of K threads, bpg 16-row blocks each, wpg warps per group).

`nv` (kda_cute_bwd_chunk's varlen build: the chunk's valid rows, dynamic): the outs in global
memory (db among them) are written, and the fold's fix-up re-reads them, only at rows < nv (the
caller's views start at the chunk's first packed row; the rows past nv belong to another chunk's
sequence or lie past the tensor's end). An out in smem is written at every row as without it.
`qk_all` (that build's qk_padded: dq, dk stay on the padded row) exempts the dq / dk outs: every
row written, as without nv; dg and db still take the predicate.
"""

import functools


def _build_walk_class():
    """Defined lazily so importing this module does not import the DSL (seconds)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass._mlir.dialects import arith
    from cutlass.cute.nvgpu import warp
    from cutlass.cutlass_dsl import T

    f32 = cutlass.Float32
    BT = 64
    BC = 16

    def _exp2(x):
        return cute.math.exp2(x, fastmath=True)

    def _tf32_rna(x):
        """cvt.rna.tf32.f32 of a finite x as one integer add: the mma reads only the top 19 bits,
        so adding half a tf32 ulp to the bit pattern rounds to nearest, ties away (ptxas expands
        cvt.rna into FSETP + IADD + LOP3 on sm_90: the inf/NaN test and the mask are the saving)."""
        return cutlass.Int32(arith.bitcast(T.i32(), f32(x).ir_value())) + 0x1000

    def _as_f32(i):
        """The fp32 with bit pattern i (bf16 -> fp32 is the 16 bits moved to the top)."""
        return f32(arith.bitcast(T.f32(), cutlass.Int32(i).ir_value()))


    class IntraWalk:
        """Mixin of the walk's device methods (see the module docstring for what the host class
        must define)."""

        @cute.jit
        def _load_a(self, fA1i, fA2i, sA1, sA2, cA, m0, k0):
            """The two A fragments (dAqk, dAkk) of one 16 x 8 mma step: rows m0.., columns k0..
            of sA1 / sA2, rounded to tf32 (the column side passes the transposed views)."""
            for ei in cutlass.range_constexpr(cute.size(cA)):
                ma, ka = cA[ei]
                fA1i[ei] = _tf32_rna(sA1[m0 + ma, k0 + ka])
                fA2i[ei] = _tf32_rna(sA2[m0 + ma, k0 + ka])

        @cute.jit
        def _four(self, src, io: cutlass.Constexpr):
            """Four adjacent q / k values as fp32 (src: 4 x 16-bit, or bf16 pairs as 2 x i32)."""
            if cutlass.const_expr(io is cutlass.BFloat16):
                w = src.load()
                return [_as_f32(w[i // 2] << 16) if i % 2 == 0 else _as_f32(w[i // 2] & -65536)
                        for i in range(4)]
            v = src.load().to(f32)
            return [v[i] for i in range(4)]

        @cute.jit
        def _to_columns(self, pairs: cutlass.Constexpr, sStage, cC, wid, lane):
            """mma C fragments -> each thread's column (16 rows), through the warp's smem stage
            half a tile (8 rows) at a time; `pairs` = ((C fragment, 16-row column), ...)."""
            for hh in cutlass.range_constexpr(2):
                for src, dst in pairs:
                    for ei in cutlass.range_constexpr(cute.size(src)):
                        if cutlass.const_expr((ei // 2) % 2 == hh):
                            mc, _ = cC[ei]
                            # C register ei = e + 2 h + 4 j is tile column n = 2 (lane % 4) + e
                            # + 8 j, i.e. the warp's column pi(n) = 4 (lane % 4) + 16 e + j
                            col = 4 * (lane % 4) + 16 * (ei % 2) + ei // 4
                            sStage[wid, mc - 8 * hh, col] = src[ei]
                    cute.arch.sync_warp()
                    for i8 in cutlass.range_constexpr(8):
                        dst[8 * hh + i8] = sStage[wid, i8, lane]
                    cute.arch.sync_warp()


        @cute.jit
        def intra_walk(self, tidx, sQ, sK, sG, sAq, sAk, sBeta, sDbp, sStage, cDqi, cDki, cDgi, cDq, cDk,
                       cDg, gDbi, gDb, RS: cutlass.Constexpr, nv=None, qk_all: cutlass.Constexpr = False):
            """One CTA's walk over its chunk once the smem operands are in place (behind a barrier).
            RS: the row stride of the incoming column views in global memory (their rows are pulled
            into L2 ahead of the walk), or 0 when they live in smem. nv: the valid rows of a varlen
            chunk (module docstring), or None: every row; qk_all: dq, dk at every row even so."""
            K = self.K
            io = self.io_dtype
            QS, GS, AS = self.qs, self.gs, self.as_
            # 4-wide views along the contiguous mode (one LDS.128 each)
            v4 = cute.make_layout((BT, BT // 4, 4), stride=(AS, 4, 1))
            sAq4 = cute.make_tensor(sAq.iterator, v4)
            sAk4 = cute.make_tensor(sAk.iterator, v4)
            # dA transposed (the column side reads dA by columns: [s, r] = dA[r, s])
            vT = cute.make_layout((BT, BT), stride=(1, AS))
            sAqT = cute.make_tensor(sAq.iterator, vT)
            sAkT = cute.make_tensor(sAk.iterator, vT)
            sGv = cute.make_tensor(sG.iterator, cute.make_layout((BT, K // 4, 4), stride=(GS, 4, 1)))
            # 4-column views of q / k (8 bytes) for the mma B fragments; bf16 as 2 x i32 (unpacked
            # by a shift and a mask: the DSL's vector convert spends a PRMT + shift per odd lane)
            if cutlass.const_expr(io is cutlass.BFloat16):
                l4 = cute.make_layout((BT, K // 4, 2), stride=(QS // 2, 2, 1))
                sQ4 = cute.make_tensor(cute.recast_ptr(sQ.iterator, dtype=cutlass.Int32), l4)
                sK4 = cute.make_tensor(cute.recast_ptr(sK.iterator, dtype=cutlass.Int32), l4)
            else:
                l4 = cute.make_layout((BT, K // 4, 4), stride=(QS, 4, 1))
                sQ4 = cute.make_tensor(sQ.iterator, l4)
                sK4 = cute.make_tensor(sK.iterator, l4)
            sTot = cute.make_tensor(sStage.iterator, cute.make_layout((self.ngrp, K), stride=(K, 1)))
            # varlen: which outs are stored only at rows < nv (those not in smem)
            pq, pk, pg, pb = (nv is not None and t.memspace != cute.AddressSpace.smem
                              for t in (cDq, cDk, cDg, gDb))
            if cutlass.const_expr(qk_all):  # (qk_padded: dq, dk on the padded row, all 64 rows)
                pq = pk = False

            grp = tidx // K  # warp-uniform
            d = tidx % K
            wig = (tidx % K) // 32  # warp within the group
            lane = tidx % 32
            wid = tidx // 32
            d0 = wig * 32  # this warp's 32 columns
            tmma = cute.make_tiled_mma(warp.MmaTF32Op((16, 8, 8)))
            thr = tmma.get_slice(lane)
            cA = thr.partition_A(cute.make_identity_tensor((16, 8)))  # (m, k) per register
            cB = thr.partition_B(cute.make_identity_tensor((32, 8)))  # (n, k)
            cC = thr.partition_C(cute.make_identity_tensor((16, 32)))  # (m, n)
            fA1 = cute.make_rmem_tensor(cA.shape, cutlass.TFloat32)
            fA2 = cute.make_rmem_tensor(cA.shape, cutlass.TFloat32)
            fB1 = cute.make_rmem_tensor(cB.shape, cutlass.TFloat32)
            fB2 = cute.make_rmem_tensor(cB.shape, cutlass.TFloat32)
            fA1i = cute.recast_tensor(fA1, cutlass.Int32)
            fA2i = cute.recast_tensor(fA2, cutlass.Int32)
            fB1i = cute.recast_tensor(fB1, cutlass.Int32)
            fB2i = cute.recast_tensor(fB2, cutlass.Int32)
            acc1 = cute.make_rmem_tensor(cC.shape, f32)
            acc2 = cute.make_rmem_tensor(cC.shape, f32)
            # B fragment register ei = v + 2 j holds (k = lane % 4 + 4 v, n = lane / 4 + 8 j); tile
            # column n is the warp's column pi(n) (module docstring), so j = 0..3 are adjacent
            lq = lane // 4
            cb = (d0 + 4 * (lq // 2 + 4 * (lq % 2))) // 4  # this lane's B columns: 4 cb + j
            kq = lane % 4

            accq = cute.make_rmem_tensor(cute.make_layout(BC), f32)
            acck = cute.make_rmem_tensor(cute.make_layout(BC), f32)
            dkt = cute.make_rmem_tensor(cute.make_layout(BC), f32)
            gs = cute.make_rmem_tensor(cute.make_layout(BC), f32)
            ks = cute.make_rmem_tensor(cute.make_layout(BC), f32)
            run = f32(0.0)

            for bi in cutlass.range_constexpr(self.bpg):
                blk = grp * self.bpg + (self.bpg - 1 - bi)  # descending within the group
                r0 = blk * BC
                for s in cutlass.range_constexpr(BC):
                    gs[s] = sG[r0 + s, d]
                    ks[s] = f32(sK[r0 + s, d])
                    accq[s] = f32(0.0)
                    acck[s] = f32(0.0)
                    dkt[s] = f32(0.0)
                # incoming grads of the first rows the diagonal walk finalizes, issued now so
                # their latency hides under the cross sums (later rows: PF rows ahead)
                pf = {}
                for j in cutlass.range_constexpr(min(self.pf, BC)):
                    gp = r0 + BC - 1 - j
                    pf[BC - 1 - j] = (cDqi[gp], cDki[gp], cDgi[gp])
                # the block's other incoming rows are pulled into L2 now (the warp's 32 columns
                # of a row are one 128-byte line), so the walk's loads pf rows ahead hit L2
                if cutlass.const_expr(RS > 0):
                    for j in cutlass.range_constexpr(min(self.pf, BC), BC):
                        gp = r0 + BC - 1 - j
                        for col in (cDqi, cDki, cDgi):
                            cute.arch.prefetch((col.iterator + gp * RS).llvm_ptr, cache_level="L2")

                # -- cross row side: sources s < r0, anchored at the block's first row
                ga = gs[0]
                # (r, d) = sum_s dA[r0 + r, s] * kg[s, d] as a 16 x 32 x 8 tf32 mma step
                # per 8 sources, per warp (its 32 columns); A = dA rows, B = kg computed
                # at each fragment register's (n, k) coordinate
                gaB = sGv[r0, cb, None].load()
                acc1.fill(0.0)
                acc2.fill(0.0)
                for s8 in cutlass.range(0, r0, 8, unroll=1):
                    self._load_a(fA1i, fA2i, sAq, sAk, cA, r0, s8)
                    for v in cutlass.range_constexpr(2):
                        srow = s8 + kq + 4 * v
                        kv = self._four(sK4[srow, cb, None], io)
                        gv = sGv[srow, cb, None].load()
                        for j in cutlass.range_constexpr(4):
                            fB1i[v + 2 * j] = _tf32_rna(kv[j] * _exp2(gaB[j] - gv[j]))
                    cute.gemm(tmma, acc1, fA1, fB1, acc1)
                    cute.gemm(tmma, acc2, fA2, fB1, acc2)
                self._to_columns(((acc1, accq), (acc2, acck)), sStage, cC, wid, lane)
                for r in cutlass.range_constexpr(1, BC):
                    e = _exp2(gs[r] - ga)
                    accq[r] = accq[r] * e
                    acck[r] = acck[r] * e

                # -- cross column side: targets r > r0 + 15, anchored at the block's last row
                gn = gs[BC - 1]
                # (s, d) = sum_r dAq[r, r0 + s] qb[r, d] + dAk[r, r0 + s] kbb[r, d]: two
                # chained mma steps per 8 target rows; A = dA columns (transposed reads)
                gnB = sGv[r0 + BC - 1, cb, None].load()
                acc1.fill(0.0)
                for r8 in cutlass.range(r0 + BC, BT, 8, unroll=1):
                    self._load_a(fA1i, fA2i, sAqT, sAkT, cA, r0, r8)
                    for v in cutlass.range_constexpr(2):
                        rrow = r8 + kq + 4 * v
                        gv = sGv[rrow, cb, None].load()
                        qv = self._four(sQ4[rrow, cb, None], io)
                        kv = self._four(sK4[rrow, cb, None], io)
                        br = sBeta[rrow]
                        for j in cutlass.range_constexpr(4):
                            ex = _exp2(gv[j] - gnB[j])
                            fB1i[v + 2 * j] = _tf32_rna(qv[j] * ex)
                            fB2i[v + 2 * j] = _tf32_rna(br * kv[j] * ex)
                    cute.gemm(tmma, acc1, fA1, fB1, acc1)
                    cute.gemm(tmma, acc1, fA2, fB2, acc1)
                self._to_columns(((acc1, dkt),), sStage, cC, wid, lane)
                for s in cutlass.range_constexpr(BC - 1):
                    dkt[s] = dkt[s] * _exp2(gn - gs[s])

                # -- diagonal block, rows descending; row r is final once reached
                for rd in cutlass.range_constexpr(BC):
                    r = BC - 1 - rd
                    row = r0 + r
                    if cutlass.const_expr(self.pf > 0 and r - self.pf >= 0):
                        gp = row - self.pf
                        pf[r - self.pf] = (cDqi[gp], cDki[gp], cDgi[gp])
                    qr = f32(sQ[row, d])
                    br = sBeta[row]
                    kbr = br * ks[r]
                    gr = gs[r]
                    a_q = accq[r]
                    a_k = acck[r]
                    for c in cutlass.range_constexpr((r + 4) // 4):
                        aq = sAq4[row, r0 // 4 + c, None].load()
                        ak = sAk4[row, r0 // 4 + c, None].load()
                        for j in cutlass.range_constexpr(4):
                            s = 4 * c + j
                            if cutlass.const_expr(s <= r):
                                if cutlass.const_expr(s == r):
                                    t = ks[s]
                                    a_q = a_q + aq[j] * t
                                    a_k = a_k + ak[j] * t
                                    dkt[s] = dkt[s] + aq[j] * qr + ak[j] * kbr
                                else:
                                    e = _exp2(gr - gs[s])
                                    t = ks[s] * e
                                    a_q = a_q + aq[j] * t
                                    a_k = a_k + ak[j] * t
                                    dkt[s] = dkt[s] + (aq[j] * qr + ak[j] * kbr) * e
                    # row r's outputs
                    if cutlass.const_expr(self.pf > 0):
                        dqi, dki, dgi = pf.pop(r)
                    else:
                        dqi, dki, dgi = cDqi[row], cDki[row], cDgi[row]
                    dq_o = a_q + dqi
                    dk2 = a_k * br
                    dkt_r = dkt[r]
                    dk_o = dk2 + dkt_r + dki
                    dg_o = qr * a_q + (dk2 - dkt_r) * ks[r] + dgi
                    if cutlass.const_expr(pq):
                        if row < nv:
                            cDq[row] = dq_o.to(cDq.element_type)
                    else:
                        cDq[row] = dq_o.to(cDq.element_type)  # (io with emit_bf16, fp32 in smem or not)
                    if cutlass.const_expr(pk):
                        if row < nv:
                            cDk[row] = dk_o.to(cDk.element_type)
                    else:
                        cDk[row] = dk_o.to(cDk.element_type)
                    if cutlass.const_expr(self.fold_dg):
                        run = run + dg_o
                        dg_o = run  # final in the last group; the others add `add` below
                    if cutlass.const_expr(pg):
                        if row < nv:
                            cDg[row] = dg_o
                    else:
                        cDg[row] = dg_o
                    v = a_k * ks[r]
                    v = v + cute.arch.shuffle_sync_bfly(v, offset=16)
                    v = v + cute.arch.shuffle_sync_bfly(v, offset=8)
                    v = v + cute.arch.shuffle_sync_bfly(v, offset=4)
                    v = v + cute.arch.shuffle_sync_bfly(v, offset=2)
                    v = v + cute.arch.shuffle_sync_bfly(v, offset=1)
                    if lane == 0:
                        sDbp[row, wig] = v

            # db_in is loaded before the barriers so its latency hides behind the other group's
            # last rows instead of following the final barrier
            dbi = f32(0.0)
            if tidx < BT:
                dbi = gDbi[tidx]
            if cutlass.const_expr(self.fold_dg):
                # the fold's fix-up re-reads this thread's own dg stores (L2) rather than hold
                # them in 32 registers across the walk (that spilled: 392 B, +0.39 ms at the
                # reference shape, 2026-12-01); issued here, before the barriers, where the
                # walk's registers are free
                nfix = self.bpg * BC
                fix = cute.make_rmem_tensor(cute.make_layout(nfix), f32)
                if grp < self.ngrp - 1:
                    for i in cutlass.range_constexpr(nfix):
                        if cutlass.const_expr(pg):
                            if grp * nfix + i < nv:
                                fix[i] = cDg[grp * nfix + i]
                        else:
                            fix[i] = cDg[grp * nfix + i]
            if cutlass.const_expr(self.fold_dg):
                cute.arch.sync_threads()  # every warp is done staging before sTot overlays it
            if cutlass.const_expr(self.fold_dg):
                sTot[grp, d] = run
            cute.arch.sync_threads()
            if cutlass.const_expr(self.fold_dg):
                add = f32(0.0)
                for g2 in cutlass.range(grp + 1, self.ngrp, unroll=1):
                    add = add + sTot[g2, d]
                if grp < self.ngrp - 1:
                    for i in cutlass.range_constexpr(nfix):
                        if cutlass.const_expr(pg):
                            if grp * nfix + i < nv:
                                cDg[grp * nfix + i] = fix[i] + add
                        else:
                            cDg[grp * nfix + i] = fix[i] + add
            if tidx < BT:
                tot = dbi
                for w in cutlass.range_constexpr(self.wpg):
                    tot = tot + sDbp[tidx, w]
                if cutlass.const_expr(pb):
                    if tidx < nv:
                        gDb[tidx] = tot
                else:
                    gDb[tidx] = tot

    return IntraWalk


walk_class = functools.cache(_build_walk_class)  # built (with the DSL import) on first use
