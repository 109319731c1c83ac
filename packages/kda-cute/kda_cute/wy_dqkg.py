"""kda_cute_wy_dqkg: the WY / state-gradient backward on sm_90 (fla 0.6.0's
`chunk_kda_bwd_wy_dqkg_fused`, the chain's stage `bwd_wy_dqkg`).

Per chunk of BT = 64 tokens and value head hv (A = Akk, E = exp2(gk), gn = gk at the chunk's last
row, h / dh the chunk's states, all sums over V in 64-wide tiles):

    dq   = scale (do h^T) E              dk' = (v_new dh^T) exp2(gn - gk)
    dw   = -bf16(dv h^T)                 dA  = dv v^T + dw bf16(k E)^T
    dvb  = A^T dv:  dv2 = dvb beta,      db  = sum_v dvb v + sum_k dkb k E,   dkb = A^T dw
    dk   = dk' + dkb E beta              dg  = q dq - k dk' + k E dkb beta
                                              + [last row] (exp2(gn) sum_v h dh + sum_t k dk')
    dAkk = -(A^T bf16(bf16(strict(dA) beta_j) A^T)), strictly lower
    dAqk = scale tril(do v_new^T), lower with the diagonal (want_dAqk: fla's chunk_kda_bwd_dAv dA)

with fla's casts: every GEMM takes io-dtype (bf16 / fp16) operands into fp32 accumulators
(mma.sync m16n8k16); dw, k E, the masked dA and the middle product of dAkk are rounded to the
io dtype before their GEMMs, as fla's `.to(b_A.dtype)`.

CTA decomposition: one CTA per (chunk, hv, b), grid (T / 64, HV, B), 512 threads = 16 warps in
a 4 (rows) x 4 (columns) grid of one tiled mma (64 x 64 x 16 per step), one CTA per SM (the
accumulators dq, dk, dw [64 x 128] and dA [64 x 64] fp32 stay in registers: 56 per thread, 64
with dAqk's [64 x 64]).
The CTA owns the whole K and walks V in 64-wide tiles: per tile, do, v_new, dv, v (64 x 64) and
h, dh (128 x 64) arrive by cp.async in a 2-stage ring (the next tile's loads fly under this
tile's GEMMs); q, k, gk (for the epilogue) and Akk are loaded once, up front. Per tile:

    dq += do h^T    dk += v_new dh^T    dw += dv h^T    dA += dv v^T     (h's fragments shared)
    [dAqk += do v_new^T]                                                  (do's fragments shared)
    dvb = A^T dv  -> dv2 stored, db partials;  sum_v h dh per key column (SIMT)

dv2 leaves through an 8 KB smem staging tile (16-byte coalesced stores after the tile's barrier).
Epilogue: [dAqk scaled, masked, out: its registers freed first]; dq out; dw and k E (io dtype) to
smem; dA += dw (kE)^T, dkb = A^T dw (two more smem GEMMs); dk, dg out (the last row after a column
reduction of k dk' across the 4 row warps); dA masked x beta_j to smem, X = dA A^T, Y = A^T X,
dAkk = -Y strictly lower. The fp32 outputs leave from the C fragments as 8-byte column pairs
(st.global.v2), every smem access of the epilogue is a pair or wider. ptxas 13.0: 128 registers
(the 512-thread cap), 8-16 bytes spilled (want_dAqk: 44 at V = 256, none at V = 128; each spilled
once per CTA, the V walk being unrolled).

fused=True (the kernel `kda_cute_bwd_chunk`, host side kda_cute.bwd_chunk): the same V walk and
epilogue, but dq, dk, dg, dAqk, dAkk (fp32) and db go to smem, and the intra walk
(kda_cute._intra_walk: 4 groups of 128 threads, a thread per key column, one 16-row block per
group) runs on them in the same CTA, writing the final dq, dk, db and folded dg. Its smem is one
146.5 KB region (the R_* offsets below: the ring, then the epilogue's tiles, then the walk's
operands; two extra barriers where a tile takes a dead one's place) plus q, k in the walk's
padded rows and gk: ~219 KB. With l2norm / the gate (kda_cute.bwd_chunk's docstring) the walk
leaves dq, dk / dg in their smem tiles and row passes (`_l2norm_rows`, `_gate_rows`: a warp per 4
rows, a lane per 4 columns) finish them after one more barrier (their global operands, the rstds
and the raw gate, pulled into L2 before the walk and loaded at once before that barrier:
`_row_prefetch`, `_row_loads`); the gate's per-warp partials take the dead dAqk tile (R_AQ: 8.3 KB
of its 17 KB). The fused class (`_Fused`) takes five more tensors (the gate's); the standalone
kernel's PTX is unchanged. varlen=True (`_Varlen`, a 24th tensor: the chunk table) stores the
five outputs at the packed row's rows (kda_cute.bwd_chunk's docstring): every global store site
of dq, dk, dv2, db, dg (the dv2 staging tile's in the V walk, the walk's column stores and db, the
row passes') takes the table's base row and the predicate r < nv; so do the loads of do and v in
the V ring (the packed row's [1, T_raw, HV, V]: `_warp.rows_async`, a pad row's pieces zeros in
smem, never loaded), beta's (a pad row's 0) and the raw gate's in the gate's row pass (rows
clamped to nv - 1, then a pad row's values the chain's pad gate g_fill); the other inputs and the
rstds stay on the padded row (ptxas 13.0, before v, beta and the gate moved: 128 registers, 16-80
bytes spilled across the builds; not re-measured since). qk_padded=True (with
varlen, not with l2norm) keeps dq, dk on the padded row as without the table (the walk's column
stores of them at padded row 64c + r, all 64 rows, unpredicated: the intra walk's `qk_all`);
dv2, db, dg still go through the table. With that kernel in the chain, kda_cute_wy_dqkg itself
runs only in bwd_chunk's "split" fallback.

Layouts: global as fla (q, k [B, T, H, K]; v-like [B, T, HV, V]; gk and the K outputs [B, T, HV,
K]; Akk / dAkk / dAqk [B, T, HV, 64], row = token; h, dh [B, NT, HV, K, V], K-major rows of V).
smem tiles of 16-bit elements are 64-column rows with the 128-byte swizzle (Swizzle<3,3,3>), read
by ldmatrix (.trans for the operands whose M / N mode is the contiguous one: A^T, dv^T, dw^T,
X^T); gk fp32 rows padded to 136 floats. smem: 2 stages x 64 KB + Akk 8 + q, k 32 + gk 34 + dv2
staging 8 + tables 4 = 214 KB; the epilogue's dw, k E, dA, X tiles (48 KB) reuse the ring.

Bytes per call, B16 T8192 H=HV=16 K128 V256 bf16:

    read    q, k 1.074 GB, gk 1.074, v, v_new, do, dv 4.295, h, dh 4.295, Akk 0.268   11.01 GB
    write   dq, dk, dg 3.221 GB, dv2 1.074, dAkk 0.537, db 0.008                        4.84 GB
            [want_dAqk: dAqk 0.537 GB                                                  5.38 GB]
    total   15.85 GB: 3.96 ms at 4.0 TB/s (fla's kernel takes 12.4 ms there)
            [want_dAqk: 16.39 GB, 4.10 ms]

Today (H200, 2026-12-01, bench/check_wy_dqkg.py, now check_stage.py): 4.619 ms vs fla's 12.558 at
the reference shape (2.72x, 3.43 TB/s), 3.697 vs 10.210 at B16 T8192 H16 K=V=128 (2.76x), 0.278
vs 0.738 at B2 T4096 (2.65x); every output's error vs float64 equal to fla's
(bench/results/wy_dqkg.md).

Constraints: K = 128; V % 64 == 0; T % 64 == 0 (a ragged last chunk is refused); HV % H == 0;
q, k, v, v_new, Akk, h, do, dh, dv one dtype (bf16 or fp16); beta bf16 / fp16 / fp32; gk fp32;
contiguous, 16-byte aligned; no varlen (only the fused kernel's varlen build, above), no
state_v_first. `scale` and `want_dAqk` (and the fused fields, `varlen` among them) are part of
the compile key.

Validated on CPU by the PTX interpreter (tests/kda_cute/test_wy_dqkg_compile.py, ptxsim.kda_wy)
and on the H200 against float64 and fla (bench/check_stage.py, tests/gpu/test_chain_gpu.py).
History and measurements: docs/perf/wy_dqkg.md.
"""

import functools
from dataclasses import dataclass

import torch

from . import _warp
from ._common.cache import CallCache, alloc, interned
from ._common.lazy import cutlass_dtype
from ._common.support import compile_arch
from ._intra_walk import walk_class
from ._warp import BT, BV, DT, LN2, LOG2E

THREADS = 512
STAGES = 2
SUPPORTED_K = (128,)
GPAD = 8  # gk smem row padding (floats): conflict-free pair reads at mma C positions
QPAD = 8  # fused: q, k rows (16-bit elements), the intra walk's layout
APAD = 4  # fused: dAqk / dAkk rows (floats), conflict-free tf32 A-fragment reads in the walk
# fused: the region that holds the V ring, then the epilogue's tiles, then the walk's operands
# (byte offsets; every swizzled tile 1024-aligned). Walk: dq, dk, dg in (fp32 [64, 128]) at
# 0 / 32K / 64K, dAqk / dAkk (fp32 [64, 68]) at 96K / 113K, the per-warp staging at 130K.
# Ring: do, v_new, dv, v (2 x 8 KB each) at 0-64K, h, dh (2 x 16 KB) at 64K-128K, Akk at 130K,
# the dv2 staging tile at 138K. Epilogue: dw, bf16(k E) at 32K / 48K (dk's slot: written after
# their GEMMs), the masked dA and X at 113K / 121K (dAkk's slot: written after their GEMMs).
R_DQ, R_DK, R_DG, R_AQ, R_AK, R_ST = 0, 32768, 65536, 98304, 115712, 133120
R_DO, R_VN, R_DV, R_V, R_H, R_DH, R_A, R_O = 0, 16384, 32768, 49152, 65536, 98304, 133120, 141312
R_DW, R_KG, R_DAM, R_X = 32768, 49152, 115712, 123904
R_BYTES = R_ST + THREADS // 32 * 8 * 33 * 4  # 150016

_cache = CallCache("kda_cute_wy_dqkg")


class KdaWyDqkg:
    """See the module docstring. io: the 16-bit operand dtype; beta_dtype: beta's."""

    def __init__(self, io_dtype, beta_dtype, K: int, V: int, gsize: int, scale: float, want_dAqk: bool,
                 fused: bool = False, l2norm: bool = False, gate: str = "none", gate_bias: bool = False,
                 lower_bound: float = 0.0, varlen: bool = False, qk_padded: bool = False,
                 g_fill: float = 0.0):
        self.io_dtype = io_dtype
        self.beta_dtype = beta_dtype
        self.K = K
        self.V = V
        self.NV = V // BV
        self.gsize = gsize
        self.scale = float(scale)
        self.fused = fused  # kda_cute_bwd_chunk: the intra walk follows in the same CTA
        self.l2norm = l2norm  # fused: dq, dk through q / k's L2 norm backward before they leave
        self.want_dAqk = want_dAqk or fused
        # fused: fla's gate backward (kda_gate_bwd) of the folded dg before it leaves (_warp.GATES)
        self.gate = gate
        self.gate_bias = gate_bias  # with a dt_bias (its partial gradient out per chunk)
        self.lower_bound = float(lower_bound)
        # fused: the outputs on the packed row through the chunk table (kda_cute.bwd_chunk's docstring)
        self.varlen = varlen
        # varlen: dq, dk on the padded row all the same (the l2norm_bwd after the kernel needs them there)
        self.qk_padded = qk_padded
        # varlen, with the gate: a pad row's raw gate (exact in g's dtype: the chain's pad value)
        self.g_fill = float(g_fill)
        # the intra walk's parameters (kda_cute._intra_walk): 4 groups of K threads, one 16-row
        # block each; its smem operands in this kernel's strides
        self.fold_dg = True
        self.pf = 2
        self.ngrp = THREADS // K
        self.bpg = BT // 16 // self.ngrp
        self.wpg = K // 32
        self.qs = K + QPAD
        self.gs = K + GPAD
        self.as_ = BT + APAD


def _build_kernel_class():
    """Defined lazily so importing this module does not import the DSL (seconds)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import warp

    f32 = cutlass.Float32

    def _exp2(x):
        return cute.math.exp2(x, fastmath=True)

    def _mn_view(acc):
        """A C fragment ((2, 2), M, N) as a (rows, cols) view: ((2, M), (2, N))."""
        lay = cute.make_layout(acc.layout.shape)
        mn = cute.make_layout(
            ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
            stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])),
        )
        return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))

    class _Kernel(KdaWyDqkg, walk_class()):
        @cute.jit
        def __call__(
            self,
            mQ: cute.Tensor,  # [B, T, H, K] io
            mK: cute.Tensor,
            mV: cute.Tensor,  # [B, T, HV, V] io
            mVn: cute.Tensor,
            mG: cute.Tensor,  # [B, T, HV, K] f32
            mBeta: cute.Tensor,  # [B, T, HV]
            mA: cute.Tensor,  # [B, T, HV, BT] io
            mH: cute.Tensor,  # [B, NT, HV, K, V] io
            mDo: cute.Tensor,  # [B, T, HV, V] io
            mDh: cute.Tensor,  # [B, NT, HV, K, V] io
            mDv: cute.Tensor,  # [B, T, HV, V] io
            mDq: cute.Tensor,  # outputs: [B, T, HV, K] f32
            mDk: cute.Tensor,
            mDv2: cute.Tensor,  # [B, T, HV, V] io
            mDb: cute.Tensor,  # [B, T, HV] f32
            mDg: cute.Tensor,  # [B, T, HV, K] f32
            mDA: cute.Tensor,  # [B, T, HV, BT] f32
            mDAq: cute.Tensor,  # [B, T, HV, BT] f32 (dAkk's storage when not want_dAqk: never written)
            stream,
        ):
            B = cute.size(mG, mode=[0])
            T = cute.size(mG, mode=[1])
            HV = cute.size(mG, mode=[2])
            kernel = self.kda_cute_wy_dqkg(
                mQ, mK, mV, mVn, mG, mBeta, mA, mH, mDo, mDh, mDv, mDq, mDk, mDv2, mDb, mDg, mDA, mDAq
            )
            kernel.launch(grid=(T // BT, HV, B), block=[THREADS, 1, 1], min_blocks_per_mp=1,
                          preferred_smem_carveout=100, stream=stream)

        @cute.kernel
        def kda_cute_wy_dqkg(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mVn: cute.Tensor,
                             mG: cute.Tensor, mBeta: cute.Tensor, mA: cute.Tensor, mH: cute.Tensor,
                             mDo: cute.Tensor, mDh: cute.Tensor, mDv: cute.Tensor, mDq: cute.Tensor,
                             mDk: cute.Tensor, mDv2: cute.Tensor, mDb: cute.Tensor, mDg: cute.Tensor,
                             mDA: cute.Tensor, mDAq: cute.Tensor):
            # (the fused kernel's gate tensors: dAqk's slot stands in, never read)
            self._body(mQ, mK, mV, mVn, mG, mBeta, mA, mH, mDo, mDh, mDv, mDq, mDk, mDv2, mDb, mDg, mDA, mDAq,
                       mDAq, mDAq, mDAq, mDAq, mDAq)

        @cute.kernel
        def kda_cute_bwd_chunk(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mVn: cute.Tensor,
                               mG: cute.Tensor, mBeta: cute.Tensor, mA: cute.Tensor, mH: cute.Tensor,
                               mDo: cute.Tensor, mDh: cute.Tensor, mDv: cute.Tensor, mDq: cute.Tensor,
                               mDk: cute.Tensor, mDv2: cute.Tensor, mDb: cute.Tensor, mDg: cute.Tensor,
                               mQr: cute.Tensor, mKr: cute.Tensor, mGr: cute.Tensor, mAlog: cute.Tensor,
                               mBias: cute.Tensor, mDAp: cute.Tensor, mDbp: cute.Tensor):
            """fused: dq, dk (io with emit_bf16 or l2norm, else fp32), dv2, db, dg folded; no dAkk /
            dAqk leave the CTA. mQr, mKr: q / k's rstd [B, T, H] fp32 with l2norm (else stand-ins,
            never read); they take the dAkk / dAqk slots of the body. With the gate: mGr the raw
            gate [B, T, HV, K] (g's dtype), mAlog [1, HV] and mBias [HV, K] fp32, mDg dg_raw (g's
            dtype), mDAp [B, NT, HV] and mDbp [B, NT, HV, K] the chunk's fp32 partials of dA_log and
            ddt_bias (stand-ins where not read / written)."""
            self._body(mQ, mK, mV, mVn, mG, mBeta, mA, mH, mDo, mDh, mDv, mDq, mDk, mDv2, mDb, mDg, mQr, mKr,
                       mGr, mAlog, mBias, mDAp, mDbp)

        @cute.jit
        def _row_prefetch(self, mQr, mKr, mGr, b, h, hv, row0, tidx, grow):
            """The row passes' global operands pulled into L2 before the intra walk, so their loads
            (issued after it, `_row_loads`) wait on L2, not DRAM: the rstds (threads 0-127, a row
            each) and the raw gate's 128-byte lines (the next 128-256 threads, a line each).
            grow(r): the raw gate's row of chunk row r (varlen: on the packed row)."""
            base = 0
            if cutlass.const_expr(self.l2norm):
                base = 2 * BT
                for which, m in ((0, _warp.gmem(mQr)), (1, _warp.gmem(mKr))):
                    if tidx // BT == which:
                        r = row0 + tidx % BT
                        cute.arch.prefetch((m[b, r, None].iterator + h).llvm_ptr, cache_level="L2")
            if cutlass.const_expr(self.gate != "none"):
                mG = _warp.gmem(mGr)
                per_line = 128 * 8 // mG.element_type.width  # elements of a 128-byte line
                lines = self.K // per_line  # per row
                i = tidx - base
                if i >= 0:
                    if i < BT * lines:
                        src = mG[b, grow(i // lines), hv, None].iterator + (i % lines) * per_line
                        cute.arch.prefetch(src.llvm_ptr, cache_level="L2")

        @cute.jit
        def _row_loads(self, mQr, mKr, mGr, mAlog, mBias, b, h, hv, row0, tidx, grow, nv=None):
            """Every global operand of this warp's row passes, issued at once (one round trip, not
            one per row): the q / k rstds of its 4 rows, the raw gate's 4 row segments (a lane's
            4 columns; grow(r) the gate's row of chunk row r, and with nv (varlen) a pad row r >= nv
            takes the chain's pad gate g_fill in g's dtype: the padded build's value, bitwise),
            exp(A_log[hv]) and the lane's 4 dt_bias values. -> (rq, rk, raw, ea, bias), None where
            not used."""
            K = self.K
            lane = tidx % 32
            RW = BT // (THREADS // 32)
            rows = [row0 + (tidx // 32) * RW + i for i in range(RW)]
            rq = rk = raw = ea = bias = None
            if cutlass.const_expr(self.l2norm):
                rq = [f32(mQr[b, r, h]) for r in rows]
                rk = [f32(mKr[b, r, h]) for r in rows]
            if cutlass.const_expr(self.gate != "none"):
                mG = _warp.gmem(mGr)
                rowv = cute.make_layout((K // 4, 4), stride=(4, 1))
                lr = [(tidx // 32) * RW + i for i in range(RW)]  # the chunk rows
                raw = [cute.make_tensor(mG[b, grow(r), hv, None].iterator, rowv)[lane, None].load()
                       for r in lr]
                if cutlass.const_expr(nv is not None):
                    for i in cutlass.range_constexpr(RW):
                        fr = cute.make_rmem_tensor(cute.make_layout(4), mG.element_type)
                        fr.store(raw[i])
                        if lr[i] >= nv:  # warp-uniform
                            fr.fill(self.g_fill)
                        raw[i] = fr.load()
                ea = _exp2(f32(mAlog[0, hv]) * LOG2E)
                bias = cute.make_rmem_tensor(cute.make_layout(4), f32)
                bias.fill(0.0)
                if cutlass.const_expr(self.gate_bias):
                    for x in cutlass.range_constexpr(4):
                        bias[x] = f32(mBias[hv, 4 * lane + x])
            return rq, rk, raw, ea, bias

        @cute.jit
        def _l2norm_rows(self, sX, sY, rs, mO, b, h, hv, orow0, tidx, nv=None):
            """q / k's L2-norm backward (fla's l2norm_bwd) of the chunk's rows, 4 per warp, a lane
            per 4 columns: dx = dy r - y (dy . y) r from dy (sX, fp32) and y (sY, the normalized
            q / k the kernel used), r the rstds the forward saved (`_row_loads`: one per row of the
            warp's); out in the io dtype at mO's rows orow0.. (varlen: the packed row's, only the
            nv valid ones)."""
            K = self.K
            lane = tidx % 32
            wid = tidx // 32
            RW = BT // (THREADS // 32)  # rows per warp
            sX4 = cute.make_tensor(sX.iterator, cute.make_layout((BT, K // 4, 4), stride=(K, 4, 1)))
            sY4 = cute.make_tensor(sY.iterator, cute.make_layout((BT, K // 4, 4), stride=(self.qs, 4, 1)))
            held = []  # varlen: the rows' outputs, stored after the loop (`_held_out`)
            for i in cutlass.range_constexpr(RW):
                r = wid * RW + i
                dy = sX4[r, lane, None].load()
                y = sY4[r, lane, None].load().to(f32)
                dot = f32(0.0)
                for j in cutlass.range_constexpr(4):
                    dot = dot + dy[j] * y[j]
                for off in (16, 8, 4, 2, 1):
                    dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=off)
                dx = dy * rs[i] - y * (dot * rs[i])
                if cutlass.const_expr(nv is None):
                    cute.local_tile(mO[b, orow0 + r, hv, None], (4,), (lane,)).store(dx.to(self.io_dtype))
                else:
                    held.append(dx.to(self.io_dtype))
            if cutlass.const_expr(nv is not None):
                self._held_out(held, mO, b, hv, orow0, nv, wid * RW, lane)

        @cute.jit
        def _held_out(self, held, mO, b, hv, orow0, nv, rw0, lane):
            """varlen: a row pass's outputs (`held`: this lane's 4 columns of rows rw0.., in registers)
            stored at the packed row's rows orow0 + rw0.., only those below nv. Stored after the
            rows' arithmetic, not between its rows: a branch there changes ptxas' / LLVM's fma
            contraction of the rows' sums (the gate's dA partials came out an ulp off the padded
            build's), so the varlen build would no longer be its padded build bit for bit."""
            for i in cutlass.range_constexpr(len(held)):
                if rw0 + i < nv:
                    cute.local_tile(mO[b, orow0 + rw0 + i, hv, None], (4,), (lane,)).store(held[i])

        @cute.jit
        def _gate_rows(self, sDy, raw, ea, bias, mO, mDAp, mDbp, sRed, sRedA, b, hv, t_idx, orow0, tidx,
                       nv=None):
            """fla's kda_gate_bwd of the chunk's rows, 4 per warp, a lane per 4 columns: from dy (the
            folded dg, sDy fp32) and the raw gate g (`_row_loads`: raw, ea = exp(A), bias), x = g +
            dt_bias, A = A_log[hv]:
                softplus:     dg = -exp(A) (dy sigmoid(x)),  dA += dy (-exp(A) softplus(x))
                lower_bound:  s = sigmoid(exp(A) x),  dg = dy (lb s (1 - s)) exp(A),  dA += dg x
            (fla's softplus: x above 20, else ln(1 + e^x)); dg out in g's dtype at mO's rows orow0..
            (varlen: the packed row's, only the nv valid ones; the partials cover all 64). The chunk's dA and
            (with a dt_bias) per-column sum of dg: per thread, per warp (shuffles / smem), then the
            16 warps in order -> mDAp[b, t, hv], mDbp[b, t, hv, :] (no atomics: the host sums them)."""
            K = self.K
            lane = tidx % 32
            wid = tidx // 32
            NW = THREADS // 32
            RW = BT // NW  # rows per warp
            sY4 = cute.make_tensor(sDy.iterator, cute.make_layout((BT, K // 4, 4), stride=(K, 4, 1)))
            dbs = cute.make_rmem_tensor(cute.make_layout(4), f32)
            dbs.fill(0.0)
            dgr = cute.make_rmem_tensor(cute.make_layout(4), f32)
            da = f32(0.0)
            held = []  # varlen: the rows' outputs, stored after the loop
            for i in cutlass.range_constexpr(RW):
                r = wid * RW + i
                dy = sY4[r, lane, None].load()
                for x in cutlass.range_constexpr(4):
                    xv = f32(raw[i][x]) + bias[x]
                    d = dy[x]
                    if cutlass.const_expr(self.gate == "softplus"):
                        sig = 1.0 / (1.0 + _exp2(-xv * LOG2E))
                        dgr[x] = -ea * (d * sig)
                        sp = xv  # fla's softplus: x itself above 20
                        if xv <= 20.0:
                            sp = cute.math.log2(1.0 + _exp2(xv * LOG2E), fastmath=True) * LN2
                        da = da + d * (-ea * sp)
                    else:
                        s = 1.0 / (1.0 + _exp2(-(ea * xv) * LOG2E))
                        dgx = d * (self.lower_bound * (s * (1.0 - s))) * ea
                        dgr[x] = dgx
                        da = da + dgx * xv
                    dbs[x] = dbs[x] + dgr[x]
                out = dgr.load().to(mO.element_type)
                if cutlass.const_expr(nv is None):
                    cute.local_tile(mO[b, orow0 + r, hv, None], (4,), (lane,)).store(out)
                else:
                    held.append(out)
            if cutlass.const_expr(nv is not None):  # the stores after the rows' arithmetic (`_held_out`)
                self._held_out(held, mO, b, hv, orow0, nv, wid * RW, lane)
            for off in (16, 8, 4, 2, 1):
                da = da + cute.arch.shuffle_sync_bfly(da, offset=off)
            if lane == 0:
                sRedA[wid] = da
            if cutlass.const_expr(self.gate_bias):
                sRed4 = cute.make_tensor(sRed.iterator, cute.make_layout((NW, K // 4, 4), stride=(K, 4, 1)))
                sRed4[wid, lane, None].store(dbs.load())
            cute.arch.sync_threads()
            if cutlass.const_expr(self.gate_bias):
                if tidx < K:
                    tb = sRed[0, tidx]
                    for w in cutlass.range_constexpr(1, NW):
                        tb = tb + sRed[w, tidx]
                    mDbp[b, t_idx, hv, tidx] = tb
            if tidx == K:
                ta = sRedA[0]
                for w in cutlass.range_constexpr(1, NW):
                    ta = ta + sRedA[w]
                mDAp[b, t_idx, hv] = ta

        @cute.jit
        def _body(
            self,
            mQ: cute.Tensor,
            mK: cute.Tensor,
            mV: cute.Tensor,
            mVn: cute.Tensor,
            mG: cute.Tensor,
            mBeta: cute.Tensor,
            mA: cute.Tensor,
            mH: cute.Tensor,
            mDo: cute.Tensor,
            mDh: cute.Tensor,
            mDv: cute.Tensor,
            mDq: cute.Tensor,
            mDk: cute.Tensor,
            mDv2: cute.Tensor,
            mDb: cute.Tensor,
            mDg: cute.Tensor,
            mDA: cute.Tensor,
            mDAq: cute.Tensor,
            mGr: cute.Tensor,
            mAlog: cute.Tensor,
            mBias: cute.Tensor,
            mDAp: cute.Tensor,
            mDbp: cute.Tensor,
            mTab=None,
        ):
            K = self.K
            NV = self.NV
            io = self.io_dtype
            mQ, mK, mV, mVn, mG, mA, mH, mDo, mDh, mDv, mDq, mDk, mDv2, mDg, mDA = (
                _warp.gmem(t) for t in (mQ, mK, mV, mVn, mG, mA, mH, mDo, mDh, mDv, mDq, mDk, mDv2, mDg, mDA))
            fused = self.fused
            tidx, _, _ = cute.arch.thread_idx()
            t_idx, hv, b = cute.arch.block_idx()
            h = hv // self.gsize
            row0 = t_idx * BT
            orow0, nv = row0, None  # the outputs' first row; the chunk's valid rows (None: all 64)
            if cutlass.const_expr(self.varlen):  # the packed row's, from the chunk table
                orow0 = mTab[t_idx, 0]
                nv = mTab[t_idx, 1]
            lane = tidx % 32
            wid = tidx // 32
            wm = wid % 4  # the tiled mma's warp grid: (4 row warps, 4 column warps), M first
            wn = wid // 4

            # ---------------- global tiles
            gQ = cute.local_tile(mQ[b, None, h, None], (BT, K), (t_idx, 0))
            gK = cute.local_tile(mK[b, None, h, None], (BT, K), (t_idx, 0))
            gG = cute.local_tile(mG[b, None, hv, None], (BT, K), (t_idx, 0))
            gA = cute.local_tile(mA[b, None, hv, None], (BT, BT), (t_idx, 0))
            gV = cute.local_tile(mV[b, None, hv, None], (BT, BV), (t_idx, None))
            gVn = cute.local_tile(mVn[b, None, hv, None], (BT, BV), (t_idx, None))
            if cutlass.const_expr(self.varlen):  # do and v on the packed row too: rows >= nv never loaded
                gDo = cute.local_tile(cute.domain_offset((orow0, 0), mDo[b, None, hv, None]), (BT, BV),
                                      (0, None))
                gV = cute.local_tile(cute.domain_offset((orow0, 0), mV[b, None, hv, None]), (BT, BV),
                                     (0, None))
            else:
                gDo = cute.local_tile(mDo[b, None, hv, None], (BT, BV), (t_idx, None))
            gDv = cute.local_tile(mDv[b, None, hv, None], (BT, BV), (t_idx, None))
            if cutlass.const_expr(self.varlen):
                mDv2r = cute.domain_offset((orow0, 0), mDv2[b, None, hv, None])  # from the packed row's
                gDv2 = cute.local_tile(mDv2r, (BT, BV), (0, None))
            else:
                gDv2 = cute.local_tile(mDv2[b, None, hv, None], (BT, BV), (t_idx, None))
            gH = cute.local_tile(mH[b, t_idx, hv, None, None], (K, BV), (0, None))
            gDh = cute.local_tile(mDh[b, t_idx, hv, None, None], (K, BV), (0, None))
            if cutlass.const_expr(not fused):
                gDq = cute.local_tile(mDq[b, None, hv, None], (BT, K), (t_idx, 0))
                gDk = cute.local_tile(mDk[b, None, hv, None], (BT, K), (t_idx, 0))
                gDg = cute.local_tile(mDg[b, None, hv, None], (BT, K), (t_idx, 0))
                gDA = cute.local_tile(mDA[b, None, hv, None], (BT, BT), (t_idx, 0))
                if cutlass.const_expr(self.want_dAqk):
                    gDAq = cute.local_tile(_warp.gmem(mDAq)[b, None, hv, None], (BT, BT), (t_idx, 0))

            # ---------------- shared memory
            smem = cutlass.memory.SmemAllocator()
            atom = _warp.swizzle_atom()
            l64 = cute.tile_to_shape(atom, (BT, BV), (0, 1))
            l64s = cute.tile_to_shape(atom, (BT, BV, STAGES), (0, 1, 2))
            lks = cute.tile_to_shape(atom, (K, BV, STAGES), (0, 1, 2))
            lk = cute.tile_to_shape(atom, (BT, K), (0, 1))
            GS = K + GPAD
            if cutlass.const_expr(fused):  # one region: the ring, the epilogue's tiles, the walk's
                reg = smem.allocate_tensor(f32, cute.make_layout(R_BYTES // 4), 1024).iterator

                def at(off, dtype, layout):
                    return cute.make_tensor(cute.recast_ptr(reg + off // 4, dtype=dtype), layout)

                sDo, sVn, sDv, sV = (at(o, io, l64s) for o in (R_DO, R_VN, R_DV, R_V))
                sH, sDh = at(R_H, io, lks), at(R_DH, io, lks)
                sA, sO = at(R_A, io, l64), at(R_O, io, l64)
                sDW, sKG = at(R_DW, io, lk), at(R_KG, io, lk)
                sDAm, sX = at(R_DAM, io, l64), at(R_X, io, l64)
                lqk = cute.make_layout((BT, K), stride=(self.qs, 1))
                sQ = smem.allocate_tensor(io, lqk, 16)
                sK = smem.allocate_tensor(io, lqk, 16)
                lin = cute.make_layout((BT, K), stride=(K, 1))
                sDqS, sDkS, sDgS = (at(o, f32, lin) for o in (R_DQ, R_DK, R_DG))
                lda = cute.make_layout((BT, BT), stride=(self.as_, 1))
                sAqS, sAkS = at(R_AQ, f32, lda), at(R_AK, f32, lda)
                sStage = at(R_ST, f32, cute.make_layout((THREADS // 32, 8, 32), stride=(8 * 33, 33, 1)))
                sDbi = smem.allocate_tensor(f32, cute.make_layout(BT), 16)
            else:
                sDo = smem.allocate_tensor(io, l64s, 1024)
                sVn = smem.allocate_tensor(io, l64s, 1024)
                sDv = smem.allocate_tensor(io, l64s, 1024)
                sV = smem.allocate_tensor(io, l64s, 1024)
                sH = smem.allocate_tensor(io, lks, 1024)
                sDh = smem.allocate_tensor(io, lks, 1024)
                sA = smem.allocate_tensor(io, l64, 1024)
                sQ = smem.allocate_tensor(io, lk, 1024)
                sK = smem.allocate_tensor(io, lk, 1024)
                sO = smem.allocate_tensor(io, l64, 1024)  # dv2 tile, staged for 16-byte stores
                # epilogue tiles over the ring (free once the V walk is done)
                sDW = cute.make_tensor(sH.iterator, lk)  # dw (io), 16 KB
                sKG = cute.make_tensor(sDh.iterator, lk)  # bf16(k E), 16 KB
                sDAm = cute.make_tensor(sDo.iterator, l64)  # bf16(strict(dA) beta_j)
                sX = cute.make_tensor(sVn.iterator, l64)  # bf16(dA A^T)
            sG = smem.allocate_tensor(f32, cute.make_layout((BT, K), stride=(GS, 1)), 16)
            sBeta = smem.allocate_tensor(f32, cute.make_layout(BT), 16)
            sDbp = smem.allocate_tensor(f32, cute.make_layout((BT, 4), stride=(4, 1)), 16)
            sCol = smem.allocate_tensor(f32, cute.make_layout((4, K), stride=(K, 1)), 16)
            sHd = smem.allocate_tensor(f32, cute.make_layout(K), 16)

            # transposed views (M / N the contiguous mode): [i, j] = A[j, i] etc.
            tr64 = cute.make_layout((BT, BT), stride=(BT, 1))
            sAT = cute.composition(sA, tr64)
            sXT = cute.composition(sX, tr64)
            sDWT = cute.composition(sDW, cute.make_layout((K, BT), stride=(BT, 1)))

            # ---------------- cp.async tiled copies (16 bytes per thread per copy)
            cp_io, cp_f32 = _warp.cp_async_copies(io, THREADS)
            # smem -> gmem (dv2) and rmem -> gmem (fp32 C fragments, column pairs) stores
            st_io = cute.make_tiled_copy_tv(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), io, num_bits_per_copy=128),
                cute.make_layout((THREADS // 8, 8), stride=(8, 1)),
                cute.make_layout((1, 8)),
            )
            tso = st_io.get_slice(tidx)
            tOs = tso.partition_S(sO)
            tOg = tso.partition_D(gDv2)
            rOst = cute.make_fragment_like(tOs)
            tio = cp_io.get_slice(tidx)
            tf = cp_f32.get_slice(tidx)
            tVg, tVs = tio.partition_S(gV), tio.partition_D(sV)
            tVng, tVns = tio.partition_S(gVn), tio.partition_D(sVn)
            tDog, tDos = tio.partition_S(gDo), tio.partition_D(sDo)
            tDvg, tDvs = tio.partition_S(gDv), tio.partition_D(sDv)
            tHg, tHs = tio.partition_S(gH), tio.partition_D(sH)
            tDhg, tDhs = tio.partition_S(gDh), tio.partition_D(sDh)

            if cutlass.const_expr(self.varlen):
                cDo = tio.partition_S(cute.make_identity_tensor((BT, BV)))  # do's pieces' (row, column)

            def load_tile(iv, st):
                if cutlass.const_expr(self.varlen):
                    _warp.rows_async(cp_io, tDog[None, None, None, iv], tDos[None, None, None, st], cDo, nv)
                else:
                    cute.copy(cp_io, tDog[None, None, None, iv], tDos[None, None, None, st])
                cute.copy(cp_io, tHg[None, None, None, iv], tHs[None, None, None, st])
                cute.copy(cp_io, tVng[None, None, None, iv], tVns[None, None, None, st])
                cute.copy(cp_io, tDhg[None, None, None, iv], tDhs[None, None, None, st])
                cute.copy(cp_io, tDvg[None, None, None, iv], tDvs[None, None, None, st])
                if cutlass.const_expr(self.varlen):
                    _warp.rows_async(cp_io, tVg[None, None, None, iv], tVs[None, None, None, st], cDo, nv)
                else:
                    cute.copy(cp_io, tVg[None, None, None, iv], tVs[None, None, None, st])

            # prologue: group 0 = Akk + tile 0, group 1 = tile 1, then q, k, gk (epilogue only)
            groups = []
            cute.copy(cp_io, tio.partition_S(gA), tio.partition_D(sA))
            load_tile(0, 0)
            cute.arch.cp_async_commit_group()
            groups.append(0)
            if cutlass.const_expr(NV > 1):
                load_tile(1, 1)
                cute.arch.cp_async_commit_group()
                groups.append(1)
            cute.copy(cp_io, tio.partition_S(gQ), tio.partition_D(sQ))
            cute.copy(cp_io, tio.partition_S(gK), tio.partition_D(sK))
            cute.copy(cp_f32, tf.partition_S(gG), tf.partition_D(sG))
            cute.arch.cp_async_commit_group()
            groups.append("qkg")
            if cutlass.const_expr(self.varlen):  # beta on the packed row: a pad row's 0
                if tidx < BT:
                    bt = self.beta_dtype(0.0)
                    if tidx < nv:
                        bt = mBeta[b, orow0 + tidx, hv]
                    sBeta[tidx] = f32(bt)
            elif tidx < BT:
                sBeta[tidx] = f32(mBeta[b, row0 + tidx, hv])

            # ---------------- the tiled mma and its fragments
            tiled_mma = cute.make_tiled_mma(
                warp.MmaF16BF16Op(io, f32, (16, 8, 16)), (4, 4, 1), permutation_mnk=(64, 64, 16)
            )
            thr = tiled_mma.get_slice(tidx)
            ld_n, ld_t = _warp.ldmatrix_atoms(io)
            # ldmatrix copies of the mma operands (n: K-contiguous smem, t: M / N-contiguous)
            tcAn = cute.make_tiled_copy_A(ld_n, tiled_mma)
            tcAt = cute.make_tiled_copy_A(ld_t, tiled_mma)
            tcBn = cute.make_tiled_copy_B(ld_n, tiled_mma)
            tcBt = cute.make_tiled_copy_B(ld_t, tiled_mma)
            cpAn, cpAt, cpBn, cpBt = (c.get_slice(tidx) for c in (tcAn, tcAt, tcBn, tcBt))
            # C-fragment copies: fp32 column pairs (8 bytes), io pairs (4 bytes)
            uni = cute.nvgpu.CopyUniversalOp()
            st_c = cute.make_tiled_copy_C(cute.make_copy_atom(uni, f32, num_bits_per_copy=64), tiled_mma)
            tsc = st_c.get_slice(tidx)
            st_c16 = cute.make_tiled_copy_C(cute.make_copy_atom(uni, io, num_bits_per_copy=32), tiled_mma)
            tsc16 = st_c16.get_slice(tidx)
            tOsC = tsc16.partition_D(sO)
            # sum_v h dh: thread (key row hk, 16 of the tile's 64 columns), 16-byte smem reads
            ld_hd = cute.make_tiled_copy_tv(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), io, num_bits_per_copy=128),
                cute.make_layout((K, 4), stride=(4, 1)),
                cute.make_layout((1, 8)),
            )
            thd = ld_hd.get_slice(tidx)

            # register fragments (one stage's views; each stage's smem partition below)
            rDo = thr.make_fragment_A(thr.partition_A(sDo[None, None, 0]))
            rVn = thr.make_fragment_A(thr.partition_A(sVn[None, None, 0]))
            rDv = thr.make_fragment_A(thr.partition_A(sDv[None, None, 0]))
            rAT = thr.make_fragment_A(thr.partition_A(sAT))
            rH = thr.make_fragment_B(thr.partition_B(sH[None, None, 0]))
            rDh = thr.make_fragment_B(thr.partition_B(sDh[None, None, 0]))
            rV = thr.make_fragment_B(thr.partition_B(sV[None, None, 0]))
            rDvT = thr.make_fragment_B(thr.partition_B(cute.composition(sDv[None, None, 0], tr64)))
            vDo, vVn, vDv = cpAn.retile(rDo), cpAn.retile(rVn), cpAn.retile(rDv)
            vAT = cpAt.retile(rAT)
            vH, vDh, vV = cpBn.retile(rH), cpBn.retile(rDh), cpBn.retile(rV)
            vDvT = cpBt.retile(rDvT)
            if cutlass.const_expr(self.want_dAqk):  # v_new as the B operand (N = s, K = v) of do v_new^T
                rVnB = thr.make_fragment_B(thr.partition_B(sVn[None, None, 0]))
                vVnB = cpBn.retile(rVnB)

            acc_q = cute.make_rmem_tensor(thr.partition_shape_C((BT, K)), f32)
            acc_k = cute.make_rmem_tensor(thr.partition_shape_C((BT, K)), f32)
            acc_w = cute.make_rmem_tensor(thr.partition_shape_C((BT, K)), f32)
            acc_a = cute.make_rmem_tensor(thr.partition_shape_C((BT, BT)), f32)
            acc_q.fill(0.0)
            acc_k.fill(0.0)
            acc_w.fill(0.0)
            acc_a.fill(0.0)
            if cutlass.const_expr(self.want_dAqk):
                acc_aq = cute.make_rmem_tensor(thr.partition_shape_C((BT, BT)), f32)
                acc_aq.fill(0.0)
            cC64 = thr.partition_C(cute.make_identity_tensor((BT, BT)))
            cCk = thr.partition_C(cute.make_identity_tensor((BT, K)))
            mn64 = _mn_view(cC64)
            db_row = cute.make_rmem_tensor(cute.make_layout(cute.size(mn64, mode=[0])), f32)
            db_row.fill(0.0)

            # sum_v h dh per key column: thread (column hk = tidx / 4, 16 values of the tile's 64)
            hk = tidx // 4
            hq = tidx % 4
            hd = f32(0.0)

            pA_T = cpAt.partition_S(sAT)
            for iv in cutlass.range_constexpr(NV):
                st = iv % STAGES
                pos = groups.index(iv)
                cute.arch.cp_async_wait_group(len(groups) - 1 - pos)
                cute.arch.sync_threads()
                pDo = cpAn.partition_S(sDo[None, None, st])
                pVn = cpAn.partition_S(sVn[None, None, st])
                pDv = cpAn.partition_S(sDv[None, None, st])
                pH = cpBn.partition_S(sH[None, None, st])
                pDh = cpBn.partition_S(sDh[None, None, st])
                pV = cpBn.partition_S(sV[None, None, st])
                pDvT = cpBt.partition_S(cute.composition(sDv[None, None, st], tr64))
                if cutlass.const_expr(self.want_dAqk):
                    pVnB = cpBn.partition_S(sVn[None, None, st])
                for kb in cutlass.range_constexpr(BV // 16):
                    cute.copy(tcAn, pDo[None, None, kb], vDo[None, None, kb])
                    if cutlass.const_expr(self.want_dAqk):  # do's fragment serves dAqk and dq
                        cute.copy(tcBn, pVnB[None, None, kb], vVnB[None, None, kb])
                        cute.gemm(tiled_mma, acc_aq, rDo[None, None, kb], rVnB[None, None, kb], acc_aq)
                    cute.copy(tcBn, pH[None, None, kb], vH[None, None, kb])
                    cute.gemm(tiled_mma, acc_q, rDo[None, None, kb], rH[None, None, kb], acc_q)
                    cute.copy(tcAn, pDv[None, None, kb], vDv[None, None, kb])
                    cute.gemm(tiled_mma, acc_w, rDv[None, None, kb], rH[None, None, kb], acc_w)
                    cute.copy(tcBn, pV[None, None, kb], vV[None, None, kb])
                    cute.gemm(tiled_mma, acc_a, rDv[None, None, kb], rV[None, None, kb], acc_a)
                    cute.copy(tcAn, pVn[None, None, kb], vVn[None, None, kb])
                    cute.copy(tcBn, pDh[None, None, kb], vDh[None, None, kb])
                    cute.gemm(tiled_mma, acc_k, rVn[None, None, kb], rDh[None, None, kb], acc_k)
                # dvb = A^T dv (64 x 64 of this tile): dv2 = dvb beta, db += sum_v dvb v
                acc_v = cute.make_rmem_tensor(thr.partition_shape_C((BT, BV)), f32)
                acc_v.fill(0.0)
                for kb in cutlass.range_constexpr(BT // 16):
                    cute.copy(tcAt, pA_T[None, None, kb], vAT[None, None, kb])
                    cute.copy(tcBt, pDvT[None, None, kb], vDvT[None, None, kb])
                    cute.gemm(tiled_mma, acc_v, rAT[None, None, kb], rDvT[None, None, kb], acc_v)
                av = _mn_view(acc_v)
                sVst = sV[None, None, st]
                for r in cutlass.range_constexpr(cute.size(av, mode=[0])):
                    i = mn64[r, 0][0]
                    br = sBeta[i]
                    s = f32(0.0)
                    for c in cutlass.range_constexpr(cute.size(av, mode=[1])):
                        j = mn64[r, c][1]
                        x = av[r, c]
                        s = s + x * f32(sVst[i, j])
                        av[r, c] = x * br
                    db_row[r] = db_row[r] + s
                # dv2 = dvb beta: to the staging tile (bf16 pairs), out after the barrier below
                rO = cute.make_fragment_like(acc_v, io)
                rO.store(acc_v.load().to(io))
                cute.copy(st_c16, tsc16.retile(rO), tOsC)
                # h . dh over this tile's 16 columns of key row hk
                rh = cute.make_fragment_like(thd.partition_S(sH[None, None, st]))
                rdh = cute.make_fragment_like(rh)
                cute.copy(ld_hd, thd.partition_S(sH[None, None, st]), rh)
                cute.copy(ld_hd, thd.partition_S(sDh[None, None, st]), rdh)
                prod = rh.load().to(f32) * rdh.load().to(f32)
                hd = hd + prod.reduce(cute.ReductionOp.ADD, f32(0.0), 0)
                cute.arch.sync_threads()  # every warp is done with stage st and wrote sO
                if cutlass.const_expr(iv + STAGES < NV):
                    load_tile(iv + STAGES, st)
                    cute.arch.cp_async_commit_group()
                    groups.append(iv + STAGES)
                cute.copy(st_io, tOs, rOst)
                if cutlass.const_expr(self.varlen):
                    if tidx // (BV // 8) < nv:  # st_io: a row per 8 threads
                        cute.copy(st_io, rOst, tOg[None, None, None, iv])
                else:
                    cute.copy(st_io, rOst, tOg[None, None, None, iv])

            # ---------------- epilogue
            # dAqk = scale tril(do v_new^T) out first: its 8 floats are free for the rest
            if cutlass.const_expr(self.want_dAqk):
                maq = _mn_view(acc_aq)
                for r in cutlass.range_constexpr(cute.size(maq, mode=[0])):
                    for c in cutlass.range_constexpr(cute.size(maq, mode=[1])):
                        i, j = mn64[r, c]
                        y = f32(0.0)
                        if i >= j:
                            y = maq[r, c] * self.scale
                        maq[r, c] = y
                if cutlass.const_expr(fused):
                    cute.copy(st_c, tsc.retile(acc_aq), tsc.partition_D(sAqS))
                else:
                    cute.copy(st_c, tsc.retile(acc_aq), tsc.partition_D(gDAq))
            cute.arch.cp_async_wait_group(0)
            hd = hd + cute.arch.shuffle_sync_bfly(hd, offset=1)
            hd = hd + cute.arch.shuffle_sync_bfly(hd, offset=2)
            if hq == 0:
                sHd[hk] = hd
            cute.arch.sync_threads()  # q, k, gk, sHd visible; the ring is free

            mc = _mn_view(cCk)
            NR = cute.size(mc, mode=[0])
            NC = cute.size(mc, mode=[1])
            scale = self.scale

            def frag_f32(src):  # a (BT, K) fp32 smem view at this thread's C positions (pairs)
                r = cute.make_fragment_like(acc_q)
                cute.copy(st_c, tsc.partition_S(src), tsc.retile(r))
                return r

            def frag_io(src):  # the same of a 16-bit tile (bf16 pairs as 32-bit loads)
                r = cute.make_fragment_like(acc_q, io)
                cute.copy(st_c16, tsc16.partition_S(src), tsc16.retile(r))
                return r

            def to_smem_io(x, dst):  # fp32 TensorSSA at the C positions -> io dtype smem (pairs)
                r = cute.make_fragment_like(acc_q, io)
                r.store(x.to(io))
                cute.copy(st_c16, tsc16.retile(r), tsc16.partition_D(dst))

            sGn = cute.make_tensor(sG.iterator + (BT - 1) * GS, cute.make_layout((BT, K), stride=(0, 1)))
            to_smem_io(-acc_w.load(), sDW)  # dw = -bf16(dv h^T)
            gv = frag_f32(sG).load()
            e = _exp2(gv)
            kf = frag_io(sK).load().to(f32)
            to_smem_io(kf * e, sKG)  # bf16(k E)
            dq = acc_q.load() * e * scale
            acc_q.store(dq)
            if cutlass.const_expr(fused):
                cute.copy(st_c, tsc.retile(acc_q), tsc.partition_D(sDqS))
            else:
                cute.copy(st_c, tsc.retile(acc_q), tsc.partition_D(gDq))
            dkp = acc_k.load() * _exp2(frag_f32(sGn).load() - gv)
            acc_k.store(dkp)
            kdk = kf * dkp
            acc_w.store(kdk)
            acc_q.store(frag_io(sQ).load().to(f32) * dq - kdk)  # dg's first two terms
            # column sums of k dk' over the chunk: own rows, the warp's 8 row groups, the 4 row warps
            mw = _mn_view(acc_w)
            for c in cutlass.range_constexpr(NC):
                v = mw[0, c]
                for r in cutlass.range_constexpr(1, NR):
                    v = v + mw[r, c]
                v = v + cute.arch.shuffle_sync_bfly(v, offset=4)
                v = v + cute.arch.shuffle_sync_bfly(v, offset=8)
                v = v + cute.arch.shuffle_sync_bfly(v, offset=16)
                if lane < 4:
                    sCol[wm, mc[0, c][1]] = v
            cute.arch.sync_threads()

            # dA += dw (kE)^T over K; dkb = A^T dw
            pDW = cpAn.partition_S(sDW)
            rDW = thr.make_fragment_A(thr.partition_A(sDW))
            vDW = cpAn.retile(rDW)
            pKG = cpBn.partition_S(sKG)
            rKG = thr.make_fragment_B(thr.partition_B(sKG))
            vKG = cpBn.retile(rKG)
            for kb in cutlass.range_constexpr(K // 16):
                cute.copy(tcAn, pDW[None, None, kb], vDW[None, None, kb])
                cute.copy(tcBn, pKG[None, None, kb], vKG[None, None, kb])
                cute.gemm(tiled_mma, acc_a, rDW[None, None, kb], rKG[None, None, kb], acc_a)
            acc_b = acc_w  # dw's registers are free (dw is in smem)
            acc_b.fill(0.0)
            pDWT = cpBt.partition_S(sDWT)
            rDWT = thr.make_fragment_B(thr.partition_B(sDWT))
            vDWT = cpBt.retile(rDWT)
            for kb in cutlass.range_constexpr(BT // 16):
                cute.copy(tcAt, pA_T[None, None, kb], vAT[None, None, kb])
                cute.copy(tcBt, pDWT[None, None, kb], vDWT[None, None, kb])
                cute.gemm(tiled_mma, acc_b, rAT[None, None, kb], rDWT[None, None, kb], acc_b)

            gv = frag_f32(sG).load()
            e = _exp2(gv)
            kE = frag_io(sK).load().to(f32) * e
            rb = cute.make_fragment_like(acc_q)
            mrb = _mn_view(rb)
            for r in cutlass.range_constexpr(NR):
                br = sBeta[mc[r, 0][0]]
                for c in cutlass.range_constexpr(NC):
                    mrb[r, c] = br
            bv = rb.load()
            dkb = acc_b.load()
            acc_k.store(acc_k.load() + dkb * (e * bv))
            if cutlass.const_expr(fused):
                cute.arch.sync_threads()  # every warp is past the GEMMs on dw, k E (dk's slot)
                cute.copy(st_c, tsc.retile(acc_k), tsc.partition_D(sDkS))
            else:
                cute.copy(st_c, tsc.retile(acc_k), tsc.partition_D(gDk))
            acc_q.store(acc_q.load() + kE * dkb * bv)
            acc_b.store(dkb * kE)
            mq = _mn_view(acc_q)
            mb = _mn_view(acc_b)
            for r in cutlass.range_constexpr(NR):
                t = mc[r, 0][0]
                s = mb[r, 0]
                for c in cutlass.range_constexpr(1, NC):
                    s = s + mb[r, c]
                db_row[r] = db_row[r] + s
                if t == BT - 1:  # the chunk's last row: the gate-gradient carry
                    for c in cutlass.range_constexpr(NC):
                        kk = mc[r, c][1]
                        gn = sG[BT - 1, kk]
                        mq[r, c] = (mq[r, c] + sHd[kk] * _exp2(gn) + sCol[0, kk] + sCol[1, kk] + sCol[2, kk]
                                    + sCol[3, kk])
            if cutlass.const_expr(fused):
                cute.copy(st_c, tsc.retile(acc_q), tsc.partition_D(sDgS))
            else:
                cute.copy(st_c, tsc.retile(acc_q), tsc.partition_D(gDg))
            # db: the quad's 4 lanes, then the 4 column warps through smem
            for r in cutlass.range_constexpr(NR):
                v = db_row[r]
                v = v + cute.arch.shuffle_sync_bfly(v, offset=1)
                v = v + cute.arch.shuffle_sync_bfly(v, offset=2)
                if lane % 4 == 0:
                    sDbp[mc[r, 0][0], wn] = v

            # dAkk: dA masked (i > j) x beta_j -> io; X = dA A^T; Y = A^T X; -Y strictly lower
            ma = _mn_view(acc_a)
            for r in cutlass.range_constexpr(cute.size(ma, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(ma, mode=[1])):
                    i, j = mn64[r, c]
                    x = f32(0.0)
                    if i > j:
                        x = ma[r, c] * sBeta[j]
                    ma[r, c] = x
            r16 = cute.make_fragment_like(acc_a, io)
            r16.store(acc_a.load().to(io))
            cute.copy(st_c16, tsc16.retile(r16), tsc16.partition_D(sDAm))
            cute.arch.sync_threads()
            if tidx < BT:
                dbt = sDbp[tidx, 0] + sDbp[tidx, 1] + sDbp[tidx, 2] + sDbp[tidx, 3]
                if cutlass.const_expr(fused):
                    sDbi[tidx] = dbt
                else:
                    mDb[b, row0 + tidx, hv] = dbt
            acc_a.fill(0.0)
            pDAm = cpAn.partition_S(sDAm)
            rDAm = thr.make_fragment_A(thr.partition_A(sDAm))
            vDAm = cpAn.retile(rDAm)
            pAn = cpBn.partition_S(sA)
            rAn = thr.make_fragment_B(thr.partition_B(sA))
            vAn = cpBn.retile(rAn)
            for kb in cutlass.range_constexpr(BT // 16):
                cute.copy(tcAn, pDAm[None, None, kb], vDAm[None, None, kb])
                cute.copy(tcBn, pAn[None, None, kb], vAn[None, None, kb])
                cute.gemm(tiled_mma, acc_a, rDAm[None, None, kb], rAn[None, None, kb], acc_a)
            r16.store(acc_a.load().to(io))
            cute.copy(st_c16, tsc16.retile(r16), tsc16.partition_D(sX))
            cute.arch.sync_threads()
            acc_a.fill(0.0)
            pXT = cpBt.partition_S(sXT)
            rXT = thr.make_fragment_B(thr.partition_B(sXT))
            vXT = cpBt.retile(rXT)
            for kb in cutlass.range_constexpr(BT // 16):
                cute.copy(tcAt, pA_T[None, None, kb], vAT[None, None, kb])
                cute.copy(tcBt, pXT[None, None, kb], vXT[None, None, kb])
                cute.gemm(tiled_mma, acc_a, rAT[None, None, kb], rXT[None, None, kb], acc_a)
            for r in cutlass.range_constexpr(cute.size(ma, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(ma, mode=[1])):
                    i, j = mn64[r, c]
                    y = f32(0.0)
                    if i > j:
                        y = -ma[r, c]
                    ma[r, c] = y
            if cutlass.const_expr(fused):
                cute.arch.sync_threads()  # every warp is past the GEMM on X (dAkk's slot)
                cute.copy(st_c, tsc.retile(acc_a), tsc.partition_D(sAkS))
                cute.arch.sync_threads()  # the walk's operands in place
                # ---------------- the intra walk (kda_cute._intra_walk) over the staged tiles
                d = tidx % K
                scol = cute.make_layout(BT, stride=K)
                ins = [cute.make_tensor(t.iterator + d, scol) for t in (sDqS, sDkS, sDgS)]
                gcol = cute.make_layout(BT, stride=cute.size(mG, mode=[2]) * K)
                qrow0 = orow0  # dq, dk's first row
                if cutlass.const_expr(self.qk_padded):  # varlen: the padded row's all the same
                    qrow0 = row0
                outs = [cute.make_tensor(m[b, r0, hv, None].iterator + d, gcol)
                        for m, r0 in ((mDq, qrow0), (mDk, qrow0), (mDg, orow0))]
                if cutlass.const_expr(self.l2norm):  # dq, dk stay in smem (fp32, in place) for the rows
                    outs[0], outs[1] = ins[0], ins[1]
                gate = self.gate != "none"
                if cutlass.const_expr(gate):  # the folded dg too, for the gate's rows
                    outs[2] = ins[2]
                if cutlass.const_expr(self.varlen):
                    gDb = cute.local_tile(cute.domain_offset((orow0,), mDb[b, None, hv]), (BT,), (0,))
                else:
                    gDb = cute.local_tile(mDb[b, None, hv], (BT,), (t_idx,))
                rows = self.l2norm or gate  # (mDA, mDAq: the rstds)

                def grow(r):  # the raw gate's row of chunk row r (varlen: the packed row's, clamped)
                    if cutlass.const_expr(self.varlen):
                        return orow0 + cutlass.min(r, nv - 1)
                    return row0 + r

                if cutlass.const_expr(rows):
                    self._row_prefetch(mDA, mDAq, mGr, b, h, hv, row0, tidx, grow)
                self.intra_walk(tidx, sQ, sK, sG, sAqS, sAkS, sBeta, sDbp, sStage, *ins, *outs, sDbi, gDb, 0,
                                nv=nv, qk_all=self.qk_padded)
                if cutlass.const_expr(rows):  # the loads fly while the barrier waits for the last warp
                    rq, rk, raw, ea, bias = self._row_loads(mDA, mDAq, mGr, mAlog, mBias, b, h, hv, row0,
                                                            tidx, grow, nv)
                    cute.arch.sync_threads()  # every column of dq, dk, dg is final; dAqk's slot is dead
                if cutlass.const_expr(self.l2norm):
                    self._l2norm_rows(sDqS, sQ, rq, mDq, b, h, hv, orow0, tidx, nv)
                    self._l2norm_rows(sDkS, sK, rk, mDk, b, h, hv, orow0, tidx, nv)
                if cutlass.const_expr(gate):  # the per-warp partials in dAqk's dead slot
                    NW = THREADS // 32
                    sRed = at(R_AQ, f32, cute.make_layout((NW, K), stride=(K, 1)))
                    sRedA = at(R_AQ + NW * K * 4, f32, cute.make_layout(NW))
                    self._gate_rows(sDgS, raw, ea, bias, mDg, mDAp, mDbp, sRed, sRedA, b, hv, t_idx, orow0,
                                    tidx, nv)
            else:
                cute.copy(st_c, tsc.retile(acc_a), tsc.partition_D(gDA))

    class _Fused(_Kernel):
        """fused=True (kda_cute_bwd_chunk): the body's 18 tensors and the gate's five."""

        @cute.jit
        def __call__(
            self,
            mQ: cute.Tensor,
            mK: cute.Tensor,
            mV: cute.Tensor,
            mVn: cute.Tensor,
            mG: cute.Tensor,
            mBeta: cute.Tensor,
            mA: cute.Tensor,
            mH: cute.Tensor,
            mDo: cute.Tensor,
            mDh: cute.Tensor,
            mDv: cute.Tensor,
            mDq: cute.Tensor,
            mDk: cute.Tensor,
            mDv2: cute.Tensor,
            mDb: cute.Tensor,
            mDg: cute.Tensor,  # dg folded (fp32), or with the gate dg_raw in g's dtype
            mQr: cute.Tensor,  # q_rstd, k_rstd [B, T, H] fp32 (l2norm), else stand-ins
            mKr: cute.Tensor,
            mGr: cute.Tensor,  # the gate's (kda_cute_bwd_chunk's docstring), else stand-ins
            mAlog: cute.Tensor,
            mBias: cute.Tensor,
            mDAp: cute.Tensor,
            mDbp: cute.Tensor,
            stream,
        ):
            B = cute.size(mG, mode=[0])
            T = cute.size(mG, mode=[1])
            HV = cute.size(mG, mode=[2])
            kernel = self.kda_cute_bwd_chunk(mQ, mK, mV, mVn, mG, mBeta, mA, mH, mDo, mDh, mDv, mDq, mDk,
                                             mDv2, mDb, mDg, mQr, mKr, mGr, mAlog, mBias, mDAp, mDbp)
            kernel.launch(grid=(T // BT, HV, B), block=[THREADS, 1, 1], min_blocks_per_mp=1,
                          preferred_smem_carveout=100, stream=stream)

    class _Varlen(_Fused):
        """fused=True, varlen=True (kda_cute_bwd_chunk on packed sequences): the fused kernel's 23
        tensors (do on the packed row) and the chunk table mTab, int32 [NT, 2] (kda_cute.bwd_chunk's
        docstring); B == 1, the grid the padded row's chunks. A kernel of its own, so the others'
        PTX is unchanged. qk_padded (a field of the class, not a kernel of its own): dq, dk
        [1, T, HV, K] on the padded row."""

        @cute.jit
        def __call__(
            self,
            mQ: cute.Tensor,
            mK: cute.Tensor,
            mV: cute.Tensor,
            mVn: cute.Tensor,
            mG: cute.Tensor,
            mBeta: cute.Tensor,
            mA: cute.Tensor,
            mH: cute.Tensor,
            mDo: cute.Tensor,  # on the packed row [1, T_raw, HV, V] (the other inputs: the padded row's)
            mDh: cute.Tensor,
            mDv: cute.Tensor,
            mDq: cute.Tensor,  # the five outputs on the packed row: [1, T_raw, ...] (qk_padded: dq, dk
            # on the padded row [1, T, ...])
            mDk: cute.Tensor,
            mDv2: cute.Tensor,
            mDb: cute.Tensor,
            mDg: cute.Tensor,
            mQr: cute.Tensor,
            mKr: cute.Tensor,
            mGr: cute.Tensor,
            mAlog: cute.Tensor,
            mBias: cute.Tensor,
            mDAp: cute.Tensor,
            mDbp: cute.Tensor,
            mTab: cute.Tensor,  # [NT, 2] int32: each chunk's first packed row, its valid rows
            stream,
        ):
            T = cute.size(mG, mode=[1])
            HV = cute.size(mG, mode=[2])
            kernel = self.kda_cute_bwd_chunk(mQ, mK, mV, mVn, mG, mBeta, mA, mH, mDo, mDh, mDv, mDq, mDk,
                                             mDv2, mDb, mDg, mQr, mKr, mGr, mAlog, mBias, mDAp, mDbp, mTab)
            kernel.launch(grid=(T // BT, HV, 1), block=[THREADS, 1, 1], min_blocks_per_mp=1,
                          preferred_smem_carveout=100, stream=stream)

        @cute.kernel
        def kda_cute_bwd_chunk(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mVn: cute.Tensor,
                               mG: cute.Tensor, mBeta: cute.Tensor, mA: cute.Tensor, mH: cute.Tensor,
                               mDo: cute.Tensor, mDh: cute.Tensor, mDv: cute.Tensor, mDq: cute.Tensor,
                               mDk: cute.Tensor, mDv2: cute.Tensor, mDb: cute.Tensor, mDg: cute.Tensor,
                               mQr: cute.Tensor, mKr: cute.Tensor, mGr: cute.Tensor, mAlog: cute.Tensor,
                               mBias: cute.Tensor, mDAp: cute.Tensor, mDbp: cute.Tensor, mTab: cute.Tensor):
            """The fused kernel (its docstring above) reading do at the packed row's rows mTab[c, 0]..
            (only the mTab[c, 1] valid ones: the pad rows are zeros in smem, `_warp.rows_async`), its
            other inputs on the padded row, and writing dq, dk, dv2, db, dg at the packed row's
            valid rows (the rstds and the raw gate are padded-row inputs; the partials per padded
            chunk, as without it); qk_padded: dq, dk at the padded row's 64 rows, as without it."""
            self._body(mQ, mK, mV, mVn, mG, mBeta, mA, mH, mDo, mDh, mDv, mDq, mDk, mDv2, mDb, mDg, mQr, mKr,
                       mGr, mAlog, mBias, mDAp, mDbp, mTab)

    return _Kernel, _Fused, _Varlen


_kernel_class = functools.cache(_build_kernel_class)  # built (with the DSL import) on first use


# ----------------------------------------------------------------------------------- host side
_NAMES = ("q", "k", "v", "v_new", "gk", "beta", "Akk", "h", "do", "dh", "dv")


def _hard_reason(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, packed=False) -> str | None:
    """Why the kernel cannot compute this call at all (shape, dtype, layout), or None. packed
    (kda_cute_bwd_chunk's varlen build): v, beta, do are on the packed row [1, T_raw, ...], so
    their extents are checked as the padded row's (v_new's rows) and their rows, do whole, by
    kda_cute.bwd_chunk."""
    ext_v, ext_b = v, beta
    if packed:
        ext_v, ext_b = (torch.empty((*v_new.shape[:2], *x.shape[2:]), device="meta") for x in (v, beta))
    r = _warp.extent_reason(q, k, ext_v, gk, ext_b, SUPPORTED_K)
    if r is not None:
        return r
    B, T, HV, V = ext_v.shape
    K = q.shape[3]
    NT = T // BT
    for name, t in (("v_new", v_new), ("dv", dv)) + (() if packed else (("do", do),)):
        if t.shape != ext_v.shape:
            return f"{name} must be [B,T,HV,V] = {tuple(ext_v.shape)}; got {tuple(t.shape)}"
    if Akk.shape != (B, T, HV, BT):
        return f"Akk must be [B,T,HV,{BT}] (chunk {BT}); got {tuple(Akk.shape)}"
    for name, t in (("h", h), ("dh", dh)):
        if t.shape != (B, NT, HV, K, V):
            return f"{name} must be [B,NT,HV,K,V] = {(B, NT, HV, K, V)}; got {tuple(t.shape)}"
    same = (("k", k), ("v", v), ("v_new", v_new), ("Akk", Akk), ("h", h), ("do", do), ("dh", dh), ("dv", dv))
    return _warp.dtype_reason(q, same, gk, beta) or _warp.layout_reason(
        _NAMES, (q, k, v, v_new, gk, beta, Akk, h, do, dh, dv))


def is_supported(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, want_dAqk=False) -> str | None:
    """None when `bwd_wy_dqkg` runs the CuTe kernel on these arguments, else the reason it would not."""
    return _hard_reason(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv)


@dataclass(frozen=True)
class WyDqkgConfig:
    """Everything the compiled kernel depends on: the call cache's compile key. H and HV are
    static extents of the views (row strides become immediates); B and T are dynamic."""

    io_dtype: str  # "bf16" / "fp16"
    beta_dtype: str  # "bf16" / "fp16" / "fp32"
    K: int
    V: int
    H: int
    HV: int
    scale: float
    want_dAqk: bool
    arch: str
    fused: bool = False  # kda_cute_bwd_chunk (kda_cute.bwd_chunk): the intra walk in the same CTA
    emit_bf16: bool = False  # fused: dq, dk out in the io dtype (the outputs' dtype: host side only)
    l2norm: bool = False  # fused: dq, dk through q / k's L2-norm backward (io dtype)
    gate: str = "none"  # fused: fla's gate backward of dg inside (_warp.GATES), dg out in g's dtype
    gate_bias: bool = False  # fused, with the gate: a dt_bias (its gradient's partials out)
    lower_bound: float = 0.0  # the "lower_bound" gate's constant
    g_dtype: str = ""  # fused, with the gate: the raw gate's dtype ("fp32" / "bf16" / "fp16")
    varlen: bool = False  # fused: the outputs on the packed row through the chunk table (B == 1)
    qk_padded: bool = False  # varlen: dq, dk on the padded row all the same (not with l2norm)


_new_config = interned(WyDqkgConfig)


def _config(q, v, beta, scale, want_dAqk, **fused) -> WyDqkgConfig:
    """The config for these operands; `fused`: kda_cute.bwd_chunk's fields (fused=True, ...)."""
    return _new_config(DT[q.dtype], DT[beta.dtype], q.shape[3], v.shape[3], q.shape[2], v.shape[2],
                       float(scale), bool(want_dAqk), compile_arch(), **fused)


def _outputs(q, v, want_dAqk):
    """dq, dk, dv2, db, dg, dAkk, then dAqk with want_dAqk: fresh."""
    B, T, HV, V = v.shape
    K = q.shape[3]
    outs = (
        alloc((B, T, HV, K), torch.float32, q),  # dq
        alloc((B, T, HV, K), torch.float32, q),  # dk
        alloc((B, T, HV, V), v.dtype, q),  # dv2
        alloc((B, T, HV), torch.float32, q),  # db
        alloc((B, T, HV, K), torch.float32, q),  # dg
        alloc((B, T, HV, BT), torch.float32, q),  # dAkk
    )
    if want_dAqk:
        outs += (alloc((B, T, HV, BT), torch.float32, q),)  # dAqk
    return outs


def _kernel_args(inputs, outs):
    """The kernel's eighteen tensors: the eleven inputs, dq, dk, dv2, db, dg, dAkk (the contract's
    order), dAqk; without want_dAqk dAkk's storage (outs[-1]) stands in for dAqk (never written)."""
    return (*inputs, *outs[:6], outs[-1])


def _build(views, stream, cfg: WyDqkgConfig, options: str = ""):
    import cutlass.cute as cute

    if cfg.varlen and not cfg.fused:
        raise ValueError("kda_cute_wy_dqkg: varlen is a build of the fused kernel (kda_cute_bwd_chunk) only")
    kern = _kernel_class()[int(cfg.fused) + int(cfg.varlen)](
        cutlass_dtype(cfg.io_dtype), cutlass_dtype(cfg.beta_dtype), cfg.K, cfg.V, cfg.HV // cfg.H, cfg.scale,
        cfg.want_dAqk, cfg.fused, cfg.l2norm, cfg.gate, cfg.gate_bias, cfg.lower_bound, cfg.varlen,
        cfg.qk_padded, _warp.gate_pad_value(cfg.g_dtype, cfg.gate != "none") if cfg.varlen else 0.0,
    )
    return cute.compile(kern, *views, stream, options=options)


def compile_for(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, want_dAqk=False, keep_ptx=False):
    """Trace and compile for these arguments without launching (the CPU compile test uses it)."""
    cfg = _config(q, v, beta, scale, want_dAqk)
    args = _kernel_args((q, k, v, v_new, gk, beta, Akk, h, do, dh, dv), _outputs(q, v, want_dAqk))
    return _warp.compile_only(lambda views, stream, opts: _build(views, stream, cfg, opts), args, keep_ptx)


def bwd_wy_dqkg(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, want_dAqk=False):
    """fla's chunk_kda_bwd_wy_dqkg_fused (chunk 64) -> (dq, dk, dv2, db, dg, dAkk), and with
    want_dAqk also chunk_kda_bwd_dAv's dA (fp32) as a seventh output; fresh outputs."""
    reason = _hard_reason(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv)
    if reason is not None:
        raise ValueError(f"kda_cute.wy_dqkg.bwd_wy_dqkg: unsupported call: {reason}")
    return launch(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, want_dAqk)


def launch(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, want_dAqk=False):
    """`bwd_wy_dqkg` without its checks: for a caller whose `is_supported` just said None (the
    chain's gate), so a host-bound step does not pay for them twice."""
    outs = _outputs(q, v, want_dAqk)
    args = _kernel_args((q, k, v, v_new, gk, beta, Akk, h, do, dh, dv), outs)
    cfg = _config(q, v, beta, scale, want_dAqk)
    _warp.launch(_cache, cfg, args, lambda views, stream, opts: _build(views, stream, cfg, opts))
    return outs
