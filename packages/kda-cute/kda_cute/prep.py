"""kda_cute_prep: the forward's chunk-parallel stage on sm_90 (fla 0.6.0's `kda_gate_chunk_cumsum`
and `chunk_kda_fwd_intra`: the gate and its chunk-local cumsum, token-parallel intra, inter +
solve_tril, recompute_w_u; the chain's stage `fwd_prep`), and with `l2norm` (compiled in) fla's
`l2norm_fwd` of q and k first.

With l2norm, q and k are the raw ones: each row's rstd = 1 / sqrt(sum x^2 + 1e-6) (fp32) and
x <- io(x rstd), kda_cute_l2norm_fwd's arithmetic in its order (bitwise its output); everything
below reads those rounded normalized rows (bitwise l2norm_fwd, then this kernel without the flag),
and q, k normalized [B, T, H, K] (io) and q_rstd, k_rstd [B, T, H] (fp32) go out, for fwd_scan and
the backward. With GVA every CTA of a group normalizes its smem copy; only hv % (HV / H) == 0
writes them.

Per chunk of BT = 64 tokens and value head hv: the step gate (fla's forms: -exp(A_log)
softplus(g + dt_bias); lower_bound sigmoid(exp(A_log) (g + dt_bias)); or g itself) and
gk = cumsum / ln 2 down the chunk (fp32, an output); then, with rows r >= s, D_rs = exp2(gk_r -
gk_s) per key column, gl = gk at the chunk's last row:

    Aqk_rs = scale sum_d q_r k_s D_rs          (r >= s; zero above the diagonal)
    L_rs   = beta_r sum_d k_r k_s D_rs          (r > s)
    Akk    = (I + L)^-1                          (unit lower triangular; zero above)
    w = bf16(Akk) bf16(beta k exp2(g))        u = bf16(Akk) bf16(beta v)
    kg = k exp2(gl - g)                       qg = q exp2(g)   (only with want_qg)

Packed sequences (`varlen`, compiled in; a chunk table given): q, k, v, g, beta are fla's packed
row [1, T_raw, ...] (cu_seqlens), read in place (kda_cute_bwd_prep's build: v, g, beta; its q, k are
the forward's on the padded row), and every output is on the chain's padded row
[1, T_pad = 64 NT, ...] (kda_chain.varlen: each sequence starts on a chunk boundary, its last chunk
filled with no-op pad rows), bitwise what the plain build computes on pack_inputs' padded row.
table int32 [NT, 2]: chunk c (padded rows 64c ..) starts at raw row table[c, 0] and has nv =
table[c, 1] valid rows (1 .. 64); padded row 64c + r < 64c + nv is raw row table[c, 0] + r, the
rest pad rows. Grid (NT, HV, 1). The pad rows, and OOB safety:
  - q, k, v tiles: a pad row's 16-byte pieces are never loaded (no cp.async issued: its address may
    lie past the raw row or in the next sequence); the thread stores zeros there in smem instead,
    before the barrier that ends the copy's wait, so every reader (the L2 norm: a zero row
    normalizes to 0, rstd = 1 / sqrt(1e-6), as on the padded row; Aqk, L, kg, qg, k E; beta v) sees
    the padded row's zeros. Predication, not a clamped load, because these tiles would otherwise
    need a second pass to zero the clamped rows.
  - g: row r loads raw row table[c, 0] + min(r, nv - 1) (a row of its own sequence: the gate's row
    loads stay unconditional, one per row issued back to back) and a pad row's values are then
    replaced by the chain's pad gate (`gate_pad_value`: 0 for a given log gate; -1e30 in g's
    dtype, -inf for fp16 in the softplus form), so the step gate is the padded path's to the bit
    (0, or -0 in the gate forms) and gk stays flat after the last valid row.
  - beta: a pad row's is 0 (not loaded).
The backward's kernels read v, the raw gate and beta on the raw row themselves (kda_cute_bwd_prep,
kda_cute_bwd_chunk), so the only extra outputs are q, k on the padded row, q_p, k_p [1, T_pad, H, K]:
with l2norm the normalized q, k themselves, else copies (pad rows 0) from smem beside kg, by the GVA
group's first CTA, bitwise pack_inputs' q, k. An fp16 g in the lower_bound form is refused (its pad
overflows fp16; the chain gives such g in fp32). The table's contents are trusted.

CTA decomposition: one CTA per (chunk, hv, b), grid (T / 64, HV, B), 256 threads (8 warps), two
CTAs per SM (~105 KB of smem each: one CTA's load and solve latencies hide under the other's
arithmetic). Phases, each ended by a barrier:
  0. cp.async q, k; under them the gate: a warp per 8-row group, a lane per 4 key columns; each
     thread loads its 8 rows' raw gate values as one vector per row (8 bytes bf16 / fp16, 16 fp32;
     a warp's load is one whole row), computes the step gate and its running sum down its 8 rows
     (registers), and stores the group's totals to smem; after the barrier it adds the totals of
     the groups above it (in group order), scales by 1 / ln 2 and writes the g tile and gk
     (16-byte rows); with l2norm, in the same barrier interval (after the gate's join: its
     registers are dead), each warp normalizes q and k rows wid, wid + 8, .. in place (a lane per
     4 columns, a 5-step butterfly; 8-byte smem and global rows); after the next barrier kg and
     qg out.
  1. A and L, every exp2 argument <= 0 for any gate <= 0 (g falls along the chunk): warps 0-5 the
     six 16 x 16 blocks below the diagonal blocks, one per warp, as tf32 mma.sync m16n8k8 (fla's
     tl.dot precision), operands computed into registers anchored at the source block's last
     row: q_r exp2(g_r - g_a), k_s exp2(g_a - g_s); warps 6-7 the diagonal blocks' three
     anchored quadrants (rows 8-15 x sources 0-7 at row 7, 4-7 x 0-3 at 3, 12-15 x 8-11 at 11)
     packed into one 16 x 16 tf32 product per block; warps 0-4 the 160 pairs of the sixteen 4 x 4
     blocks on the diagonal in SIMT fp32, one exp2 per (r, s, d). L (fp32) and the scaled Aqk
     (io) to smem; Aqk out (16-byte rows, zero above the diagonal).
  2. The solve, SIMT fp32 in smem: each diagonal block's inverse by forward substitution (a
     thread per column), then the blocks below, one band at a time:
     X_ij = -X_ii sum_{t=j}^{i-1} L_it X_tj.
  3. Akk out; bf16(X) (the A operand) and bf16(beta k exp2(g)) (w's B operand) to smem; the
     first two 64-wide V tiles' cp.async issued (into g's storage, dead now).
  4. w = bf16(X) bf16(beta k E) (two 64-column tiles), then u = bf16(X) bf16(beta v) per V tile
     (beta v in place in the ring; the next tile's cp.async flies under this tile's mma), on
     bf16 mma.sync m16n8k16, a 4 x 2 warp grid over each 64 x 64 tile, operands by ldmatrix;
     out from the C fragments as bf16 pairs.

Layouts: global as fla (q, k [B, T, H, K]; v, u [B, T, HV, V]; g, gk, w, qg, kg [B, T, HV, K];
Aqk, Akk [B, T, HV, 64]; beta [B, T, HV]; A_log [HV], dt_bias [HV * K], fp32 views made on the
host). smem: q, k rows padded to 136 elements, g to 132 floats, L / X to 68 floats (16-byte rows
for the vector reads, conflict-light SIMT columns): 105 KB. Four buffers take a second role once
their first is dead: q's holds bf16(beta k E), g's the V ring (128-byte swizzled 64-column rows,
as bf16(X) in L's), X's the Aqk staging before it; L's second half holds the gate's row-group
totals in phase 0.

Bytes per call, B16 T8192 H=HV=16 K128 V256 bf16 (bf16 gate input, want_qg):

    read    q, k 1.074 GB, g 0.537, v 1.074, beta 0.004                         2.69 GB
    write   gk 1.074 GB, w, qg, kg 1.611, u 1.074, Aqk, Akk 0.537              4.30 GB
    total   6.99 GB: 1.75 ms at 4.0 TB/s
    l2norm  + write q, k normalized 1.074 GB, rstds 0.017: 8.08 GB, 2.02 ms (it replaces two
            kda_cute_l2norm_fwd launches: read q, k 1.074 + write 1.091 GB; one read of q, k saved)
    varlen  nothing more with l2norm (q_p, k_p are its outputs), + write q_p, k_p 1.074 GB without;
            the reads unchanged (pad rows: none). It replaces the chain's pack_inputs gathers (read
            and write every input: 5.38 GB); the pad rows' outputs (< 64 per sequence) as on the
            padded row. (Until 2026-12-06 it also wrote v, the raw gate and beta on the padded row
            for the backward: + 1.615 GB, +0.73 ms at the reference shape on the H100.)

Constraints: K = 128; V % 64 == 0; T % 64 == 0 (a ragged last chunk is refused; varlen: the
padded row's T, the raw T any); HV % H == 0; q, k, v one dtype (bf16 or fp16); g fp32 / bf16 /
fp16; beta bf16 / fp16 / fp32; contiguous, 16-byte aligned (the table too); varlen: B = 1, the
table int32 [NT, 2], no fp16 g in the lower_bound form; with the gate in the kernel an A_log of HV
elements (dt_bias optional, HV * K). `scale`, `want_qg`, `l2norm`, `varlen`, the gate form and
lower_bound are part of the compile key. Registers (ptxas 13.0, -arch=sm_90a, V256): 108 without
l2norm, 116 with; varlen 122 and 125 (bf16 gate in the op; all <= 128: two CTAs per SM stay), no
spills (varlen: measured with the padded copies of v, g, beta, which it no longer writes); smem
unchanged (the normalization is in place). The plain builds' PTX is the same with and without the
varlen code (only the trailing stand-in parameter is new).

Today (H200, 2026-12-02, bench/check_stage.py --stage fwd_prep): 3.559 ms vs fla's gate cumsum +
fwd_intra 5.405 at the reference shape (1.52x; 2.0x over the byte floor above), 3.162 vs 5.058 at
B16 T8192 H16 K=V=128 (1.60x), 0.231 vs 0.397 at B2 T4096 (1.72x);
every output's error vs float64 equal to fla's, bitwise repeatable (bench/results/prep.md).
All without l2norm. With it (2026-12-03, commit eaaf32d, the chain's flags; the normalization 4 rows
per warp at a time): 3.995 ms vs fla's 2 x l2norm_fwd + gate cumsum + fwd_intra 5.864 at the
reference shape (1.47x), 3.480 vs 5.596 at K=V=128, 0.267 vs 0.707 at B2 T4096; 3.914 ms in the
witness.

Validated on CPU by the PTX interpreter (tests/kda_cute/test_prep_compile.py, ptxsim.kda_prep)
against float64 and fla's roundings (with l2norm: bitwise kda_cute_l2norm_fwd, then the kernel
without it; varlen, tests/kda_cute/test_prep_varlen.py: bitwise the plain build on the padded row,
every global access inside the tensors), and on the H200 against float64 and fla
(bench/check_stage.py, the chain's GPU tests; varlen: tests/gpu/test_varlen_gpu.py through the
chain, bf16 with the softplus gate, 2026-12-04). History and what next: docs/perf/prep.md.
"""

import functools
from dataclasses import dataclass

import torch

from . import _warp
from ._common.cache import CallCache, alloc, interned
from ._common.lazy import cutlass_dtype
from ._common.support import compile_arch
from ._warp import BT, BV, DT, LN2, LOG2E

BC = 16  # diagonal block
THREADS = 256
STAGES = 2
SUPPORTED_K = (128,)
QPAD = 8  # q, k smem row padding (elements): 16-byte rows, rows 16 bytes apart in the banks
GPAD = 4  # g rows (floats)
XPAD = 4  # L, X rows (floats)
APAD = 8  # Aqk staging rows (elements)
RG = 8  # the gate's rows per thread (phase 0): a row group per warp
NRG = BT // RG  # row groups
CG = THREADS // NRG  # 4-column groups: a lane each
EPS = 1e-6  # the L2 norm's (fla's l2norm eps; kda_cute.l2norm_fwd's)

_cache = CallCache("kda_cute_prep")




class KdaPrep:
    """See the module docstring. io: q / k / v dtype; beta_dtype: beta's; gate: one of _warp.GATES
    (g the step log gate, or fla's gate's input: see _gate_rows)."""

    def __init__(self, io_dtype, beta_dtype, K: int, V: int, gsize: int, scale: float, want_qg: bool,
                 gate: str, has_bias: bool, lower_bound: float, recompute: bool = False,
                 l2norm: bool = False, gk_in: bool = False, varlen: bool = False, g_fill: float = 0.0):
        self.recompute = recompute  # kda_cute_bwd_prep: Akk read, not solved (module kda_cute.bwd_prep)
        self.ctas_per_sm = 3 if recompute else 2  # the recompute's 46 KB and <= 80 registers allow three
        # bwd_prep with the forward's gk given (no gate in the op: fla keeps gk then): gk loaded into
        # registers (`_recompute`); no gate, no cumsum, no gk written
        self.gk_in = gk_in and recompute
        self.l2norm = l2norm and not recompute  # q, k read raw and L2-normalized in phase 0 (fwd only)
        self.io_dtype = io_dtype
        self.beta_dtype = beta_dtype
        self.K = K
        self.V = V
        self.NV = V // BV
        self.gsize = gsize
        self.scale = float(scale)
        self.want_qg = want_qg
        self.gate = gate
        self.has_bias = has_bias
        self.lower_bound = float(lower_bound)
        # packed sequences: v, g, beta (and in the forward q, k) read on the raw row through the
        # chunk table, every output on the padded row; g_fill: a pad row's raw gate (exact in g's
        # dtype: the chain's pad, so its step gate is the padded path's, bitwise)
        self.varlen = varlen
        # the forward's q, k on the raw row too (the recompute reads them on the padded row: the
        # forward's normalized q, k, or its copies of them, `copy_qk`)
        self.qk_raw = varlen and not recompute
        self.copy_qk = self.qk_raw and not self.l2norm  # the forward's padded copies of q, k
        self.g_fill = float(g_fill)


def _build_kernel_class():
    """Defined lazily so importing this module does not import the DSL (seconds)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass._mlir.dialects import arith
    from cutlass.cute.nvgpu import warp
    from cutlass.cutlass_dsl import T

    f32 = cutlass.Float32

    def _exp2(x):
        return cute.math.exp2(x, fastmath=True)

    def _tf32(x):
        """x rounded to tf32 (nearest, ties away) as its bit pattern: the mma reads the top 19
        bits, so adding half a tf32 ulp rounds (fla's tl.dot converts with cvt.rna)."""
        return cutlass.Int32(arith.bitcast(T.i32(), f32(x).ir_value())) + 0x1000

    def _diag_slot(d0, m, first):
        """(token row, anchor row) of slot m (0-15) of a diagonal block's anchored 16 x 16
        product (block rows d0 .. d0 + 15). A operand (first = 8): slots 0-7 rows 8-15 (anchor 7),
        8-11 rows 4-7 (anchor 3), 12-15 rows 12-15 (anchor 11). B operand (first = 0): slots 0-7
        sources 0-7 (anchor 7), 8-11 sources 0-3 (anchor 3), 12-15 sources 8-11 (anchor 11)."""
        hi = m // 8
        qd = (m // 4) % 2
        row = d0 + (1 - hi) * (first + m) + hi * (m - 8 + first // 2 + 4 * qd)
        return row, d0 + (1 - hi) * 7 + hi * (3 + 8 * qd)

    def _slot_rows(coords, base, sl, diag, first):
        """Each operand register's (token row, anchor row), fixed over the K walk: base + slot and
        the block's anchor sl, or `_diag_slot`'s on a diagonal block (first: 8 for A, 0 for B)."""
        n = cute.size(coords)
        rows = cute.make_rmem_tensor(cute.make_layout(n), cutlass.Int32)
        anc = cute.make_rmem_tensor(cute.make_layout(n), cutlass.Int32)
        for ei in range(n):  # a plain function, traced inline: Python loops unroll
            m, _ = coords[ei]
            rows[ei] = base + m
            anc[ei] = sl
            if diag:
                rows[ei], anc[ei] = _diag_slot(base, m, first)
        return rows, anc

    def _diag_pair(m, n):
        """1 where slot pair (m, n) of `_diag_slot` is one of its three quadrants' pairs, else 0."""
        hm, hn = m // 8, n // 8
        qm, qn = (m // 4) % 2, (n // 4) % 2
        same_half = 1 - (hm + hn - 2 * hm * hn)
        same_quad = 1 - (qm + qn - 2 * qm * qn)
        return same_half * ((1 - hm) + hm * same_quad)

    def _st8(io, tidx):
        """16-byte stores of 8 x 16-bit values (smem / gmem rows of a (rows, 64 or K) tile): the
        tiled copy and this thread's slice."""
        st8 = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), io, num_bits_per_copy=128),
            cute.make_layout((THREADS // 8, 8), stride=(8, 1)),
            cute.make_layout((1, 8)),
        )
        return st8, st8.get_slice(tidx)

    class _Kernel(KdaPrep):
        @cute.jit
        def __call__(
            self,
            mQ: cute.Tensor,  # [B, T, H, K] io
            mK: cute.Tensor,
            mV: cute.Tensor,  # [B, T, HV, V] io
            mG: cute.Tensor,  # [B, T, HV, K] the raw gate (f32 / bf16 / fp16)
            mBeta: cute.Tensor,  # [B, T, HV]
            mAlog: cute.Tensor,  # [1, HV] f32 (with a gate in the kernel; else a stand-in, unread)
            mBias: cute.Tensor,  # [HV, K] f32 (with has_bias; else a stand-in, unread)
            mW: cute.Tensor,  # outputs: [B, T, HV, K] io
            mU: cute.Tensor,  # [B, T, HV, V] io
            mQg: cute.Tensor,  # [B, T, HV, K] io (kg's storage when not want_qg: never written)
            mKg: cute.Tensor,  # [B, T, HV, K] io
            mAqk: cute.Tensor,  # [B, T, HV, BT] io (recompute: a stand-in, never written)
            mAkk: cute.Tensor,  # [B, T, HV, BT] io (recompute: the input)
            mGk: cute.Tensor,  # [B, T, HV, K] f32
            mQn: cute.Tensor,  # with l2norm: [B, T, H, K] io, q normalized (else q: a stand-in, unwritten)
            mKn: cute.Tensor,  # with l2norm: [B, T, H, K] io, k normalized (else k)
            mQr: cute.Tensor,  # with l2norm: [B, T, H] f32, q's rstd (else a stand-in, unread)
            mKr: cute.Tensor,  # with l2norm: [B, T, H] f32, k's rstd
            mTable: cute.Tensor,  # varlen: [NT, 2] int32, the chunk table (else a stand-in, unread)
            stream,
        ):
            B = cute.size(mG, mode=[0])
            NT = cute.size(mG, mode=[1]) // BT
            if cutlass.const_expr(self.varlen):  # the inputs are the raw row: one CTA per table chunk
                NT = cute.size(mTable, mode=[0])
            HV = cute.size(mG, mode=[2])
            args = (mQ, mK, mV, mG, mBeta, mAlog, mBias, mW, mU, mQg, mKg, mAqk, mAkk, mGk,
                    mQn, mKn, mQr, mKr, mTable)
            if cutlass.const_expr(self.recompute):
                kernel = self.kda_cute_bwd_prep(*args)
            else:
                kernel = self.kda_cute_prep(*args)
            kernel.launch(grid=(NT, HV, B), block=[THREADS, 1, 1], min_blocks_per_mp=self.ctas_per_sm,
                          preferred_smem_carveout=100, stream=stream)

        @cute.jit
        def _tf32_block(self, sQ2, sK2, sG2, sBeta, sAqk, sL, p, lane, diag: cutlass.Constexpr):
            """One 16 x 16 block of Aqk and L on one warp, tf32 mma m16n8k8 over K, each operand
            row anchored at a row between its pair so both exponents are <= 0.

            Below the diagonal (diag False): block (i, j), i > j, p -> (1,0) (2,0) (2,1) (3,0)
            (3,1) (3,2), every slot anchored at block j's last row.
            On the diagonal (diag True, block p): three quadrants in one 16 x 16 product, the
            slots mapped by `_diag_slot`: rows 8-15 x sources 0-7 (anchor 7), rows 4-7 x sources
            0-3 (anchor 3), rows 12-15 x sources 8-11 (anchor 11); only those pairs are stored (the
            four 4 x 4 blocks on the diagonal are `_diag_exact`'s)."""
            K = self.K
            io = self.io_dtype
            r0 = p * BC
            s0 = p * BC
            sl = p * BC
            if cutlass.const_expr(not diag):
                bi = 1 + (p + 5) // 6 + (p + 3) // 6  # 1 2 2 3 3 3
                bj = p - (bi * (bi - 1)) // 2  # 0 0 1 0 1 2
                r0 = bi * BC
                s0 = bj * BC
                sl = s0 + BC - 1
            tmma = cute.make_tiled_mma(warp.MmaTF32Op((16, 8, 8)))
            thr = tmma.get_slice(lane)
            cA = thr.partition_A(cute.make_identity_tensor((BC, 8)))  # (m, k) per register
            cB = thr.partition_B(cute.make_identity_tensor((BC, 8)))  # (n, k)
            cC = thr.partition_C(cute.make_identity_tensor((BC, BC)))  # (m, n)
            rowA, ancA = _slot_rows(cA, r0, sl, diag, 8)
            rowB, ancB = _slot_rows(cB, s0, sl, diag, 0)
            fAq = cute.make_rmem_tensor(cA.shape, cutlass.TFloat32)
            fAk = cute.make_rmem_tensor(cA.shape, cutlass.TFloat32)
            fB = cute.make_rmem_tensor(cB.shape, cutlass.TFloat32)
            fAqi = cute.recast_tensor(fAq, cutlass.Int32)
            fAki = cute.recast_tensor(fAk, cutlass.Int32)
            fBi = cute.recast_tensor(fB, cutlass.Int32)
            accq = cute.make_rmem_tensor(cC.shape, f32)
            acck = cute.make_rmem_tensor(cC.shape, f32)
            accq.fill(0.0)
            acck.fill(0.0)
            # The K columns of each 8-wide step are permuted alike in A and B (the sum over K does
            # not change): the mma's logical columns t and t + 4 (a thread's two values of a row,
            # t = lane % 4) read the adjacent physical columns 2t, 2t + 1, so each (row, operand)
            # pair is one 4- / 8-byte LDS instead of two scalar ones (the phase was MIO-bound:
            # three scalar LDS per tf32 element). A's values are the mma's a0-a3: (g, t), (g + 8, t),
            # (g, t + 4), (g + 8, t + 4), so value ei takes half ei // 2 of its pair; B's b0, b1:
            # (t, g), (t + 4, g) for each of the two 8-column mmas, half ei % 2. The two loads of
            # one pair are the same address (CSE'd).
            for k0 in cutlass.range(0, K, 8, unroll=2):
                c2 = k0 // 2
                for ei in cutlass.range_constexpr(cute.size(cA)):
                    _, ka = cA[ei]
                    hf = ei // 2
                    kp = c2 + ka % 4
                    ra = rowA[ei]
                    gv = sG2[ra, kp, None].load()
                    ga = sG2[ancA[ei], kp, None].load()
                    qv = sQ2[ra, kp, None].load()
                    kv = sK2[ra, kp, None].load()
                    e = _exp2(gv[hf] - ga[hf])
                    fAqi[ei] = _tf32(f32(qv[hf]) * e)
                    fAki[ei] = _tf32(f32(kv[hf]) * e)
                for ei in cutlass.range_constexpr(cute.size(cB)):
                    _, kb = cB[ei]
                    kp = c2 + kb % 4
                    rb = rowB[ei]
                    gv = sG2[rb, kp, None].load()
                    ga = sG2[ancB[ei], kp, None].load()
                    kv = sK2[rb, kp, None].load()
                    hf = ei % 2
                    fBi[ei] = _tf32(f32(kv[hf]) * _exp2(ga[hf] - gv[hf]))
                cute.gemm(tmma, accq, fAq, fB, accq)
                cute.gemm(tmma, acck, fAk, fB, acck)
            for ei in cutlass.range_constexpr(cute.size(cC)):
                mc, nc = cC[ei]
                r = r0 + mc
                sc = s0 + nc
                keep = cutlass.Int32(1)
                if cutlass.const_expr(diag):
                    r, _ = _diag_slot(r0, mc, 8)
                    sc, _ = _diag_slot(s0, nc, 0)
                    keep = _diag_pair(mc, nc)
                if keep == 1:
                    sAqk[r, sc] = io(accq[ei] * self.scale)
                    sL[r, sc] = acck[ei] * sBeta[r]

        @cute.jit
        def _diag_exact(self, sQ4, sK4, sG4, sBeta, sAqk, sL, t):
            """The sixteen 4 x 4 blocks on the diagonal (the 40 pairs r >= s per 16-row block that
            no anchor separates), SIMT fp32, one exp2 per (r, s, d): thread t < 160 owns one pair,
            block t / 40, 4-row quad (t / 10) % 4, pair t % 10 -> (i, j), i >= j, in the quad."""
            io = self.io_dtype
            blk = t // 40
            quad = (t // 10) % 4
            pr = t % 10
            i = (pr + 9) // 10 + (pr + 7) // 10 + (pr + 4) // 10  # 0 1 1 2 2 2 3 3 3 3
            j = pr - (i * (i + 1)) // 2
            rr = blk * BC + quad * 4 + i
            ss = blk * BC + quad * 4 + j
            aq = cute.make_rmem_tensor(cute.make_layout(4), f32)
            ak = cute.make_rmem_tensor(cute.make_layout(4), f32)
            aq.fill(0.0)
            ak.fill(0.0)
            for c4 in cutlass.range(self.K // 4, unroll=2):
                qv = sQ4[rr, c4, None].load().to(f32)
                kv = sK4[rr, c4, None].load().to(f32)
                gv = sG4[rr, c4, None].load()
                ks = sK4[ss, c4, None].load().to(f32)
                gs = sG4[ss, c4, None].load()
                for x in cutlass.range_constexpr(4):
                    kx = ks[x] * _exp2(gv[x] - gs[x])
                    aq[x] = aq[x] + qv[x] * kx
                    ak[x] = ak[x] + kv[x] * kx
            sAqk[rr, ss] = io(((aq[0] + aq[1]) + (aq[2] + aq[3])) * self.scale)
            sL[rr, ss] = ((ak[0] + ak[1]) + (ak[2] + ak[3])) * sBeta[rr]

        @cute.jit
        def _gate_rows(self, mG, mAlog, mBias, sTot4, run, b, hv, row0, t, raw0, nv,
                       every: cutlass.Constexpr):
            """Columns 4 (t % 32) .. + 3 and rows RG (t / 32) .. + RG - 1 of the chunk (RG = 8: a warp
            per row group, a lane per 4 columns, so each of the thread's row loads is one 8-byte
            (bf16 / fp16) or 16-byte (fp32) vector and a warp's load is one whole row): the step
            gate in fp32 (fla's kda_gate_chunk_cumsum: softplus: -exp(A_log) softplus(g + dt_bias);
            lower_bound: lower_bound sigmoid(exp(A_log) (g + dt_bias)); none: g itself) and its
            running sum down the thread's rows -> run[i, x] (registers); the group's totals -> sTot4
            (groups 0 .. NRG - 2; with `every` the last one's too, for the recompute's gl). varlen:
            row r reads raw row raw0 + min(r, nv - 1) (always a row of the chunk's own sequence: no
            load leaves the row); a pad row r >= nv then takes the chain's pad gate `g_fill` in g's
            dtype (so its step gate is the padded path's bitwise: 0, or -0 in the gate forms)."""
            cg = t % CG
            rg = t // CG
            rowv = cute.make_layout((self.K // 4, 4), stride=(4, 1))
            ea = f32(1.0)
            bias = cute.make_rmem_tensor(cute.make_layout(4), f32)
            bias.fill(0.0)
            if cutlass.const_expr(self.gate != "none"):
                ea = _exp2(f32(mAlog[0, hv]) * LOG2E)
                if cutlass.const_expr(self.has_bias):
                    for x in cutlass.range_constexpr(4):
                        bias[x] = f32(mBias[hv, 4 * cg + x])
            raw = []  # every row's load issued before the first use
            for i in cutlass.range_constexpr(RG):
                if cutlass.const_expr(self.varlen):
                    srow = raw0 + cutlass.min(rg * RG + i, nv - 1)
                    src = cute.make_tensor(mG[b, srow, hv, None].iterator, rowv)
                else:
                    src = cute.make_tensor(mG[b, row0 + rg * RG + i, hv, None].iterator, rowv)
                raw.append(src[cg, None].load())
            if cutlass.const_expr(self.varlen):
                for i in cutlass.range_constexpr(RG):
                    r = rg * RG + i
                    fr = cute.make_rmem_tensor(cute.make_layout(4), mG.element_type)
                    fr.store(raw[i])
                    if r >= nv:  # warp-uniform
                        fr.fill(self.g_fill)
                    raw[i] = fr.load()
            for x in cutlass.range_constexpr(4):
                acc = f32(0.0)
                for i in cutlass.range_constexpr(RG):
                    y = f32(raw[i][x])
                    if cutlass.const_expr(self.gate == "softplus"):
                        y = y + bias[x]
                        sp = y  # softplus(y) = y from 20 on (fla's threshold)
                        if y < 20.0:
                            sp = cute.math.log2(1.0 + _exp2(y * LOG2E), fastmath=True) * LN2
                        y = -ea * sp
                    if cutlass.const_expr(self.gate == "lower_bound"):
                        y = self.lower_bound / (1.0 + _exp2(-(ea * (y + bias[x])) * LOG2E))
                    acc = acc + y
                    run[i, x] = acc
            if cutlass.const_expr(every):
                sTot4[rg, cg, None].store(run[RG - 1, None].load())
            elif rg < NRG - 1:
                sTot4[rg, cg, None].store(run[RG - 1, None].load())

        @cute.jit
        def _gate_join(self, sG4, sTot4, run, mGk, b, hv, row0, t):
            """gk = (the thread's running sums plus the totals of the row groups above it, added in
            group order 0, 1, ..) / ln 2 (fla's RCP_LN2 scale after the cumsum): into sG (the log2
            cumsum the phases below read; sG4 None: into `run` in place, the recompute keeps it in
            registers) and out to gk (16-byte rows), for the scan and the backward."""
            cg = t % CG
            rg = t // CG
            rowv = cute.make_layout((self.K // 4, 4), stride=(4, 1))
            off = cute.make_rmem_tensor(cute.make_layout(4), f32)
            off.fill(0.0)
            for j in cutlass.range_constexpr(NRG - 1):
                if j < rg:  # warp-uniform
                    tv = sTot4[j, cg, None].load()
                    for x in cutlass.range_constexpr(4):
                        off[x] = off[x] + tv[x]
            gv = cute.make_rmem_tensor(cute.make_layout(4), f32)
            for i in cutlass.range_constexpr(RG):
                r = rg * RG + i
                for x in cutlass.range_constexpr(4):
                    gv[x] = (run[i, x] + off[x]) * (1.0 / LN2)
                vec = gv.load()
                if cutlass.const_expr(sG4 is None):
                    run[i, None].store(vec)
                else:
                    sG4[r, cg, None].store(vec)
                cute.make_tensor(mGk[b, row0 + r, hv, None].iterator, rowv)[cg, None].store(vec)

        @cute.jit
        def _gate_last(self, sTot4, gl, t):
            """gl = gk at the chunk's last row for the thread's 4 columns, from all NRG row groups'
            totals: (the last group's total + the others' summed in group order) / ln 2, the very
            operations by which `_gate_join` gives the last group's threads that row (bitwise)."""
            cg = t % CG
            off = cute.make_rmem_tensor(cute.make_layout(4), f32)
            off.fill(0.0)
            for j in cutlass.range_constexpr(NRG - 1):
                tv = sTot4[j, cg, None].load()
                for x in cutlass.range_constexpr(4):
                    off[x] = off[x] + tv[x]
            tl = sTot4[NRG - 1, cg, None].load()
            for x in cutlass.range_constexpr(4):
                gl[x] = (tl[x] + off[x]) * (1.0 / LN2)

        @cute.jit
        def _l2norm_rows(self, sX, mY, mR, b, h, row0, wid, lane, writer):
            """Rows wid, wid + 8, .. of the chunk's q (or k) tile in smem L2-normalized in place, with
            kda_cute_l2norm_fwd's arithmetic in its order (bitwise its output): a lane per K / 32
            adjacent columns, the squares summed in the lane, then a 5-step butterfly; rstd = 1 /
            sqrt(sum + 1e-6) in fp32 (IEEE sqrt and division), x <- io(x rstd). With `writer` (the
            first CTA of the GVA group) the rows go out to mY and the rstds to mR. NB rows at a time:
            their loads, sums and butterflies interleave (a row's in-place store would otherwise
            keep the next row's load behind it: one row's latency chain after another)."""
            KP = self.K // 32
            NB = 4  # rows in flight per warp
            sXp = cute.make_tensor(sX.iterator, cute.make_layout((BT, 32, KP), stride=(self.K + QPAD, KP, 1)))
            rowv = cute.make_layout((32, KP), stride=(KP, 1))
            for i0 in cutlass.range_constexpr(0, BT // 8, NB):
                rows = [wid + 8 * (i0 + u) for u in range(NB)]
                xs = [sXp[r, lane, None].load().to(f32) for r in rows]
                sums = []
                for x in xs:
                    ss = f32(0.0)
                    for j in cutlass.range_constexpr(KP):
                        ss = ss + x[j] * x[j]
                    sums.append(ss)
                for off in (16, 8, 4, 2, 1):
                    sums = [ss + cute.arch.shuffle_sync_bfly(ss, offset=off) for ss in sums]
                for r, x, ss in zip(rows, xs, sums, strict=True):
                    rs = 1.0 / cute.math.sqrt(ss + EPS)
                    y = (x * rs).to(self.io_dtype)
                    sXp[r, lane, None].store(y)
                    if writer:
                        cute.make_tensor(mY[b, row0 + r, h, None].iterator, rowv)[lane, None].store(y)
                        if lane == 0:
                            mR[b, row0 + r, h] = rs

        @cute.jit
        def _invert_diagonal(self, sL, sX, t):
            """Column t % 16 of diagonal block t / 16 of X = (I + L)^-1 by forward substitution
            (x above the column stays zero)."""
            db = (t // BC) * BC
            c = t % BC
            xc = cute.make_rmem_tensor(cute.make_layout(BC), f32)
            for m in cutlass.range_constexpr(BC):
                xc[m] = f32(0.0)
                if m == c:
                    xc[m] = f32(1.0)
            for m in cutlass.range_constexpr(1, BC):
                acc = f32(0.0)
                for t2 in cutlass.range_constexpr(m):
                    acc = acc + sL[db + m, db + t2] * xc[t2]
                if m > c:
                    xc[m] = -acc
            for m in cutlass.range_constexpr(BC):
                sX[db + m, db + c] = xc[m]

        @cute.jit
        def _band_sum(self, sL, sX, sT, lev: cutlass.Constexpr, bk: cutlass.Constexpr, e):
            """T = sum_{t=j}^{i-1} L_it X_tj for block (i, j) = (lev + bk, bk), element e."""
            i0 = (lev + bk) * BC
            j0 = bk * BC
            em = e // BC
            en = e % BC
            acc = f32(0.0)
            for u in cutlass.range_constexpr(j0, i0):
                acc = acc + sL[i0 + em, u] * sX[u, j0 + en]
            sT[bk, em, en] = acc

        @cute.jit
        def _band_solve(self, sX, sT, lev: cutlass.Constexpr, bk: cutlass.Constexpr, e):
            """X_ij = -X_ii T for block (i, j) = (lev + bk, bk), element e."""
            i0 = (lev + bk) * BC
            j0 = bk * BC
            em = e // BC
            en = e % BC
            acc = f32(0.0)
            for u in cutlass.range_constexpr(BC):
                acc = acc + sX[i0 + em, i0 + u] * sT[bk, u, en]
            sX[i0 + em, j0 + en] = -acc

        @cute.kernel
        def kda_cute_prep(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor,
                          mBeta: cute.Tensor, mAlog: cute.Tensor, mBias: cute.Tensor, mW: cute.Tensor,
                          mU: cute.Tensor, mQg: cute.Tensor, mKg: cute.Tensor, mAqk: cute.Tensor,
                          mAkk: cute.Tensor, mGk: cute.Tensor, mQn: cute.Tensor, mKn: cute.Tensor,
                          mQr: cute.Tensor, mKr: cute.Tensor, mTable: cute.Tensor):
            self._body(mQ, mK, mV, mG, mBeta, mAlog, mBias, mW, mU, mQg, mKg, mAqk, mAkk, mGk, mQn, mKn, mQr,
                       mKr, mTable)

        @cute.kernel
        def kda_cute_bwd_prep(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor,
                              mBeta: cute.Tensor, mAlog: cute.Tensor, mBias: cute.Tensor, mW: cute.Tensor,
                              mU: cute.Tensor, mQg: cute.Tensor, mKg: cute.Tensor, mAqk: cute.Tensor,
                              mAkk: cute.Tensor, mGk: cute.Tensor, mQn: cute.Tensor, mKn: cute.Tensor,
                              mQr: cute.Tensor, mKr: cute.Tensor, mTable: cute.Tensor):
            """The backward's recompute (kda_cute.bwd_prep): `_recompute` (the Aqk, normalized q, k and
            rstd slots are stand-ins, untouched; varlen: v, g, beta on the raw row)."""
            self._recompute(mQ, mK, mV, mG, mBeta, mAlog, mBias, mW, mU, mQg, mKg, mAkk, mGk, mTable)

        @cute.jit
        def _body(self, mQ, mK, mV, mG, mBeta, mAlog, mBias, mW, mU, mQg, mKg, mAqk, mAkk, mGk, mQn, mKn,
                  mQr, mKr, mTable):
            K = self.K
            NV = self.NV
            io = self.io_dtype
            mQ, mK, mV, mW, mU, mQg, mKg, mAqk, mAkk = (
                _warp.gmem(t) for t in (mQ, mK, mV, mW, mU, mQg, mKg, mAqk, mAkk))
            mG, mGk = _warp.gmem(mG), _warp.gmem(mGk)  # the gate's vector rows (16-byte aligned)
            if cutlass.const_expr(self.l2norm or self.copy_qk):
                mQn, mKn = _warp.gmem(mQn), _warp.gmem(mKn)
            tidx, _, _ = cute.arch.thread_idx()
            t_idx, hv, b = cute.arch.block_idx()
            h = hv // self.gsize
            row0 = t_idx * BT  # the chunk's first row of the outputs (varlen: the padded row)
            raw0 = row0  # ... and of the inputs (varlen: the raw row's, from the table)
            nv = BT  # the chunk's valid rows (varlen: from the table; rows >= nv are pad rows)
            if cutlass.const_expr(self.varlen):
                raw0 = mTable[t_idx, 0]
                nv = mTable[t_idx, 1]
            lane = tidx % 32
            wid = tidx // 32

            # ---------------- global tiles
            gQ = cute.local_tile(mQ[b, None, h, None], (BT, K), (t_idx, 0))
            gK = cute.local_tile(mK[b, None, h, None], (BT, K), (t_idx, 0))
            gV = cute.local_tile(mV[b, None, hv, None], (BT, BV), (t_idx, None))
            gW = cute.local_tile(mW[b, None, hv, None], (BT, BV), (t_idx, None))  # K in 64-wide tiles
            gU = cute.local_tile(mU[b, None, hv, None], (BT, BV), (t_idx, None))
            gQg = cute.local_tile(mQg[b, None, hv, None], (BT, K), (t_idx, 0))
            gKg = cute.local_tile(mKg[b, None, hv, None], (BT, K), (t_idx, 0))
            gAqk = cute.local_tile(mAqk[b, None, hv, None], (BT, BT), (t_idx, 0))
            gAkk = cute.local_tile(mAkk[b, None, hv, None], (BT, BT), (t_idx, 0))
            if cutlass.const_expr(self.varlen):  # the raw rows raw0 .. (those >= nv never read)
                at = (raw0, 0)
                if cutlass.const_expr(self.qk_raw):
                    gQ = cute.local_tile(cute.domain_offset(at, mQ[b, None, h, None]), (BT, K), (0, 0))
                    gK = cute.local_tile(cute.domain_offset(at, mK[b, None, h, None]), (BT, K), (0, 0))
                gV = cute.local_tile(cute.domain_offset(at, mV[b, None, hv, None]), (BT, BV), (0, None))

            # ---------------- shared memory (104 KB: two CTAs per SM). Four buffers take a
            # second role once their first is dead: q -> bf16(beta k E) (phase 3), g -> the V
            # ring (phase 4), L -> bf16(X) (phase 3), X <- the Aqk staging (phase 1).
            smem = cutlass.memory.SmemAllocator()
            atom = _warp.swizzle_atom()
            l64 = cute.tile_to_shape(atom, (BT, BT), (0, 1))
            l64s = cute.tile_to_shape(atom, (BT, BV, STAGES), (0, 1, 2))
            lk = cute.tile_to_shape(atom, (BT, K), (0, 1))
            QS = K + QPAD
            GS = K + GPAD
            XS = BT + XPAD
            AS = BT + APAD
            sQ = smem.allocate_tensor(io, cute.make_layout((BT, K), stride=(QS, 1)), 1024)
            sK = smem.allocate_tensor(io, cute.make_layout((BT, K), stride=(QS, 1)), 16)
            sG = smem.allocate_tensor(f32, cute.make_layout((BT, K), stride=(GS, 1)), 1024)
            sL = smem.allocate_tensor(f32, cute.make_layout((BT, BT), stride=(XS, 1)), 1024)
            sX = smem.allocate_tensor(f32, cute.make_layout((BT, BT), stride=(XS, 1)), 1024)
            sT = smem.allocate_tensor(f32, cute.make_layout((3, BC, BC), stride=(BC * BC, BC, 1)), 16)
            sBeta = smem.allocate_tensor(f32, cute.make_layout(BT), 16)
            sKE = cute.make_tensor(sQ.iterator, lk)  # bf16(beta k exp2(g)): w's B operand
            # the gate's row-group totals (phase 0) in L's second half: L is first written in phase 1
            sTot4 = cute.make_tensor(sL.iterator + BT * BT // 2,
                                     cute.make_layout((NRG - 1, K // 4, 4), stride=(K, 4, 1)))
            # the V ring, over g (dead in phase 4)
            sV = cute.make_tensor(cute.recast_ptr(sG.iterator, dtype=io), l64s)
            sAb = cute.make_tensor(cute.recast_ptr(sL.iterator, dtype=io), l64)  # bf16(X): A operand
            sAqk = cute.make_tensor(cute.recast_ptr(sX.iterator, dtype=io),
                                    cute.make_layout((BT, BT), stride=(AS, 1)))
            # vector views along the contiguous mode: 8 x 16-bit / 4 x fp32 = 16 bytes
            sQ8 = cute.make_tensor(sQ.iterator, cute.make_layout((BT, K // 8, 8), stride=(QS, 8, 1)))
            sK8 = cute.make_tensor(sK.iterator, cute.make_layout((BT, K // 8, 8), stride=(QS, 8, 1)))
            sQ4 = cute.make_tensor(sQ.iterator, cute.make_layout((BT, K // 4, 4), stride=(QS, 4, 1)))
            sK4 = cute.make_tensor(sK.iterator, cute.make_layout((BT, K // 4, 4), stride=(QS, 4, 1)))
            sG4 = cute.make_tensor(sG.iterator, cute.make_layout((BT, K // 4, 4), stride=(GS, 4, 1)))
            sQ2 = cute.make_tensor(sQ.iterator, cute.make_layout((BT, K // 2, 2), stride=(QS, 2, 1)))
            sK2 = cute.make_tensor(sK.iterator, cute.make_layout((BT, K // 2, 2), stride=(QS, 2, 1)))
            sG2 = cute.make_tensor(sG.iterator, cute.make_layout((BT, K // 2, 2), stride=(GS, 2, 1)))
            sX4 = cute.make_tensor(sX.iterator, cute.make_layout((BT, BT // 4, 4), stride=(XS, 4, 1)))
            sAqk8 = cute.make_tensor(sAqk.iterator, cute.make_layout((BT, BT // 8, 8), stride=(AS, 8, 1)))

            # ---------------- phase 0: cp.async q, k (16 bytes per thread per copy); under them
            # the gate and its chunk-local cumsum (fla's gate_chunk_cumsum) into sG and out as gk
            cp_io, tio, tVg, tVs, cVio = self._v_copies(tidx, gV, sV)

            if cutlass.const_expr(self.qk_raw):
                cQK = tio.partition_S(cute.make_identity_tensor((BT, K)))
                _warp.rows_async(cp_io, tio.partition_S(gQ), tio.partition_D(sQ), cQK, nv)
                _warp.rows_async(cp_io, tio.partition_S(gK), tio.partition_D(sK), cQK, nv)
            else:
                cute.copy(cp_io, tio.partition_S(gQ), tio.partition_D(sQ))
                cute.copy(cp_io, tio.partition_S(gK), tio.partition_D(sK))
            cute.arch.cp_async_commit_group()
            groups = []  # the V ring's cp.async groups in issue order (counted at trace time)
            self._beta_rows(mBeta, sBeta, b, hv, row0, raw0, nv, tidx)
            grun = cute.make_rmem_tensor(cute.make_layout((RG, 4), stride=(4, 1)), f32)
            self._gate_rows(mG, mAlog, mBias, sTot4, grun, b, hv, row0, tidx, raw0, nv, False)
            cute.arch.cp_async_wait_group(0)  # q, k
            cute.arch.sync_threads()
            self._gate_join(sG4, sTot4, grun, mGk, b, hv, row0, tidx)
            if cutlass.const_expr(self.l2norm):  # q, k normalized in place (before any reader: the barrier)
                writer = hv % self.gsize == 0  # one CTA of a GVA group writes q, k and the rstds
                self._l2norm_rows(sQ, mQn, mQr, b, h, row0, wid, lane, writer)
                self._l2norm_rows(sK, mKn, mKr, b, h, row0, wid, lane, writer)
            cute.arch.sync_threads()

            st8, t8 = _st8(io, tidx)

            # kg, qg out: 8 columns per thread per step
            cK = t8.partition_D(cute.make_identity_tensor((BT, K)))
            tKg = t8.partition_D(gKg)
            tQg = t8.partition_D(gQg)
            copy_qk = self.copy_qk  # q, k's padded copies (with l2norm: q, k normalized)
            if cutlass.const_expr(copy_qk):
                writer = hv % self.gsize == 0  # one CTA of a GVA group, as the normalized q, k
                tQp = t8.partition_D(cute.local_tile(mQn[b, None, h, None], (BT, K), (t_idx, 0)))
                tKp = t8.partition_D(cute.local_tile(mKn[b, None, h, None], (BT, K), (t_idx, 0)))
            for m in cutlass.range_constexpr(cute.size(cK, mode=[1])):
                for n in cutlass.range_constexpr(cute.size(cK, mode=[2])):
                    r, d0 = cK[0, m, n]
                    c8 = d0 // 8
                    kv = sK8[r, c8, None].load().to(f32)
                    qv = sQ8[r, c8, None].load().to(f32)
                    rkg = cute.make_fragment_like(tKg[None, m, n])
                    rqg = cute.make_fragment_like(tQg[None, m, n])
                    for hlf in cutlass.range_constexpr(2):
                        gv = sG4[r, 2 * c8 + hlf, None].load()
                        gl = sG4[BT - 1, 2 * c8 + hlf, None].load()
                        for i in cutlass.range_constexpr(4):
                            j8 = 4 * hlf + i
                            rkg[j8] = io(kv[j8] * _exp2(gl[i] - gv[i]))
                            rqg[j8] = io(qv[j8] * _exp2(gv[i]))
                    cute.copy(st8, rkg, tKg[None, m, n])
                    if cutlass.const_expr(self.want_qg):
                        cute.copy(st8, rqg, tQg[None, m, n])
                    if cutlass.const_expr(copy_qk):
                        if writer:
                            rqp = cute.make_fragment_like(tQp[None, m, n])
                            rqp.store(sQ8[r, c8, None].load())
                            cute.copy(st8, rqp, tQp[None, m, n])
                            rkp = cute.make_fragment_like(tKp[None, m, n])
                            rkp.store(sK8[r, c8, None].load())
                            cute.copy(st8, rkp, tKp[None, m, n])

            # ---------------- phase 1: Aqk (staged in sX's storage) and L. Warps 0-5: a block
            # below the diagonal each, then (warps 0-4) the 160 pairs of the 4 x 4 diagonal blocks;
            # warps 6-7: the anchored quadrants of two diagonal blocks each.
            if wid < 6:
                self._tf32_block(sQ2, sK2, sG2, sBeta, sAqk, sL, wid, lane, False)
                if tidx < 160:
                    self._diag_exact(sQ4, sK4, sG4, sBeta, sAqk, sL, tidx)
            else:
                for jd in cutlass.range_constexpr(2):
                    self._tf32_block(sQ2, sK2, sG2, sBeta, sAqk, sL, 2 * (wid - 6) + jd, lane, True)
            cute.arch.sync_threads()
            cA64 = t8.partition_D(cute.make_identity_tensor((BT, BT)))
            tAqk = t8.partition_D(gAqk)
            for m in cutlass.range_constexpr(cute.size(cA64, mode=[1])):
                r, s0 = cA64[0, m, 0]
                rqk = cute.make_fragment_like(tAqk[None, m, 0])
                aqv = sAqk8[r, s0 // 8, None].load()
                for j8 in cutlass.range_constexpr(8):
                    ai = f32(aqv[j8])
                    aqs = f32(0.0)
                    if s0 + j8 <= r:
                        aqs = ai
                    rqk[j8] = io(aqs)
                cute.copy(st8, rqk, tAqk[None, m, 0])
            cute.arch.sync_threads()  # the staging is read: X may overwrite it

            # ---------------- phase 2: X = (I + L)^-1
            if tidx < BT:
                self._invert_diagonal(sL, sX, tidx)
            cute.arch.sync_threads()
            for lev in cutlass.range_constexpr(1, BT // BC):
                for bk in cutlass.range_constexpr(BT // BC - lev):  # blocks (lev + bk, bk)
                    self._band_sum(sL, sX, sT, lev, bk, tidx)
                cute.arch.sync_threads()
                for bk in cutlass.range_constexpr(BT // BC - lev):
                    self._band_solve(sX, sT, lev, bk, tidx)
                cute.arch.sync_threads()

            # ---------------- phase 3: Akk out, bf16(X) over L, bf16(beta k E) over q
            tAkk = t8.partition_D(gAkk)
            tAb = t8.partition_D(sAb)
            for m in cutlass.range_constexpr(cute.size(cA64, mode=[1])):
                r, s0 = cA64[0, m, 0]
                rkk = cute.make_fragment_like(tAkk[None, m, 0])
                for hlf in cutlass.range_constexpr(2):
                    xv = sX4[r, s0 // 4 + hlf, None].load()
                    for i in cutlass.range_constexpr(4):
                        xi = f32(xv[i])
                        xs = f32(0.0)
                        if s0 + 4 * hlf + i <= r:
                            xs = xi
                        rkk[4 * hlf + i] = io(xs)
                cute.copy(st8, rkk, tAkk[None, m, 0])
                cute.copy(st8, rkk, tAb[None, m, 0])
            tKE = t8.partition_D(sKE)
            for m in cutlass.range_constexpr(cute.size(cK, mode=[1])):
                for n in cutlass.range_constexpr(cute.size(cK, mode=[2])):
                    r, d0 = cK[0, m, n]
                    c8 = d0 // 8
                    kv = sK8[r, c8, None].load().to(f32)
                    br = sBeta[r]
                    rke = cute.make_fragment_like(tKE[None, m, n])
                    for hlf in cutlass.range_constexpr(2):
                        gv = sG4[r, 2 * c8 + hlf, None].load()
                        for i in cutlass.range_constexpr(4):
                            rke[4 * hlf + i] = io(kv[4 * hlf + i] * br * _exp2(gv[i]))
                    cute.copy(st8, rke, tKE[None, m, n])
            cute.arch.sync_threads()  # g is dead: its storage takes the V ring
            for iv in cutlass.range_constexpr(min(STAGES, NV)):
                self._load_v(cp_io, tVg, tVs, cVio, nv, iv, iv, groups)
            self._wu(tidx, st8, t8, sAb, sKE, sV, sBeta, gW, gU, cp_io, tVg, tVs, cVio, nv, groups)

        @cute.jit
        def _v_copies(self, tidx, gV, sV):
            """The 16-byte cp.async copy of 16-bit tiles, this thread's slice, its partition of the V
            tiles (global, ring) and, varlen, of their identity (which rows are pad rows)."""
            cp_io, _ = _warp.cp_async_copies(self.io_dtype, THREADS)
            tio = cp_io.get_slice(tidx)
            cVio = None
            if cutlass.const_expr(self.varlen):
                cVio = tio.partition_S(cute.make_identity_tensor((BT, BV)))
            return cp_io, tio, tio.partition_S(gV), tio.partition_D(sV), cVio

        @cute.jit
        def _load_v(self, cp_io, tVg, tVs, cVio, nv, iv, st, groups):
            """V tile iv into ring stage st by cp.async, one commit group (its index appended to
            `groups`, counted at trace time); varlen: its pad rows +0, never loaded."""
            if cutlass.const_expr(self.varlen):
                _warp.rows_async(cp_io, tVg[None, None, None, iv], tVs[None, None, None, st], cVio, nv)
            else:
                cute.copy(cp_io, tVg[None, None, None, iv], tVs[None, None, None, st])
            cute.arch.cp_async_commit_group()
            groups.append(iv)

        @cute.jit
        def _beta_rows(self, mBeta, sBeta, b, hv, row0, raw0, nv, t):
            """The chunk's beta (fp32) into sBeta, a thread per row; varlen: a pad row's is 0."""
            if cutlass.const_expr(self.varlen):
                if t < BT:
                    bt = self.beta_dtype(0.0)
                    if t < nv:
                        bt = mBeta[b, raw0 + t, hv]
                    sBeta[t] = f32(bt)
            elif t < BT:
                sBeta[t] = f32(mBeta[b, row0 + t, hv])

        @cute.jit
        def _wu(self, tidx, st8, t8, sAb, sKE, sV, sBeta, gW, gU, cp_io, tVg, tVs, cVio, nv, groups):
            """Phase 4 of both kernels: w = bf16(X) bf16(beta k E) (sKE, two 64-column tiles), then
            u = bf16(X) bf16(beta v) per 64-wide V tile of the ring (beta v in place, fla's rounding
            point; tile iv + STAGES's cp.async issued once its stage is free), on bf16 mma.sync
            m16n8k16, a 4 x 2 warp grid over each 64 x 64 tile, operands by ldmatrix, out from the C
            fragments as bf16 pairs. bf16(X) is in sAb; the ring's first tiles are in flight, their
            commit groups in `groups`."""
            K = self.K
            NV = self.NV
            io = self.io_dtype
            tiled_mma = cute.make_tiled_mma(
                warp.MmaF16BF16Op(io, f32, (16, 8, 16)), (4, 2, 1), permutation_mnk=(64, 64, 16)
            )
            thr = tiled_mma.get_slice(tidx)
            ld_n, ld_t = _warp.ldmatrix_atoms(io)
            tcAn = cute.make_tiled_copy_A(ld_n, tiled_mma)
            tcBt = cute.make_tiled_copy_B(ld_t, tiled_mma)
            cpAn = tcAn.get_slice(tidx)
            cpBt = tcBt.get_slice(tidx)
            st32 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), io, num_bits_per_copy=32)
            st_c16 = cute.make_tiled_copy_C(st32, tiled_mma)
            tsc16 = st_c16.get_slice(tidx)
            rAb = thr.make_fragment_A(thr.partition_A(sAb))
            vAb = cpAn.retile(rAb)
            pAb = cpAn.partition_S(sAb)
            tr64 = cute.make_layout((BV, BT), stride=(BT, 1))  # [col, s] of an (s, col) tile
            rBT = thr.make_fragment_B(thr.partition_B(cute.composition(sV[None, None, 0], tr64)))
            vBT = cpBt.retile(rBT)
            cV = t8.partition_D(cute.make_identity_tensor((BT, BV)))
            tVb = t8.partition_D(sV)  # (8 values, m, 1, stage)

            for c in cutlass.range_constexpr(K // BV):
                sKEc = cute.local_tile(sKE, (BT, BV), (0, c))
                self._tile_mma(tiled_mma, thr, tcAn, tcBt, cpBt, pAb, vAb, rAb, vBT, rBT,
                               cute.composition(sKEc, tr64), st_c16, tsc16, gW[None, None, c])
            for iv in cutlass.range_constexpr(NV):
                st = iv % STAGES
                cute.arch.cp_async_wait_group(len(groups) - 1 - groups.index(iv))
                cute.arch.sync_threads()
                # bf16(beta v) in place (fla's rounding point)
                for m in cutlass.range_constexpr(cute.size(cV, mode=[1])):
                    rv = cute.make_fragment_like(tVb[None, m, 0, st])
                    cute.copy(st8, tVb[None, m, 0, st], rv)
                    vb = rv.load().to(f32)
                    rv.store((vb * sBeta[cV[0, m, 0][0]]).to(io))
                    cute.copy(st8, rv, tVb[None, m, 0, st])
                cute.arch.sync_threads()
                self._tile_mma(tiled_mma, thr, tcAn, tcBt, cpBt, pAb, vAb, rAb, vBT, rBT,
                               cute.composition(sV[None, None, st], tr64), st_c16, tsc16, gU[None, None, iv])
                if cutlass.const_expr(iv + STAGES < NV):
                    cute.arch.sync_threads()  # every warp is done reading stage st
                    self._load_v(cp_io, tVg, tVs, cVio, nv, iv + STAGES, st, groups)

        @cute.jit
        def _qk_rows(self, mQ, mK, b, h, row0, rg, cg, i0: cutlass.Constexpr):
            """The recompute's q, k elements of rows 8 rg + i0 .. + 3 at columns 4 cg .. + 3: one
            8-byte load each (a warp's load is one whole row), issued together -> (q's, k's)."""
            rowv = cute.make_layout((self.K // 4, 4), stride=(4, 1))
            qs = []
            ks = []
            for i in cutlass.range_constexpr(RG // 2):
                r = rg * RG + i0 + i
                qs.append(cute.make_tensor(mQ[b, row0 + r, h, None].iterator, rowv)[cg, None].load())
                ks.append(cute.make_tensor(mK[b, row0 + r, h, None].iterator, rowv)[cg, None].load())
            return qs, ks

        @cute.jit
        def _recompute(self, mQ, mK, mV, mG, mBeta, mAlog, mBias, mW, mU, mQg, mKg, mAkk, mGk, mTable):
            """kda_cute_bwd_prep's body (module kda_cute.bwd_prep): phase 0's gate without the q, k, g
            tiles, then the forward's phase 4 (`_wu`) on the saved Akk. 46 KB of smem (Akk's tile,
            the V ring, bf16(beta k E), the gate's totals, beta), three CTAs per SM.

            Each thread owns the gate's rows 8 (t / 32) .. + 7 at columns 4 (t % 32) .. + 3 (the
            forward's phase-0 map) and keeps its gk there in registers: the gate and cumsum of
            `_gate_rows` / `_gate_join` (every group's total to smem, so gl = gk at the last row
            comes from `_gate_last` by the same additions), or the forward's gk by 16-byte loads
            (gk_in). Its q, k elements come by 8-byte loads straight from global, four rows at a
            time; kg, qg go out from registers (8-byte stores, a warp's one whole row) and
            bf16(beta k E) into its own padded tile: every value is computed by the forward's
            expression in its order, so w, u, qg, kg (and gk) are the forward's bit for bit."""
            K = self.K
            NV = self.NV
            io = self.io_dtype
            mQ, mK, mV, mW, mU, mQg, mKg, mAkk = (_warp.gmem(t) for t in (mQ, mK, mV, mW, mU, mQg, mKg, mAkk))
            mG, mGk = _warp.gmem(mG), _warp.gmem(mGk)
            tidx, _, _ = cute.arch.thread_idx()
            t_idx, hv, b = cute.arch.block_idx()
            h = hv // self.gsize
            row0 = t_idx * BT  # the chunk's first row on q's row (varlen: the padded row)
            raw0 = row0  # ... and of v, g, beta (varlen: the raw row's, from the table)
            nv = BT  # the chunk's valid rows (varlen: rows >= nv are pad rows)
            if cutlass.const_expr(self.varlen):
                raw0 = mTable[t_idx, 0]
                nv = mTable[t_idx, 1]
            cg = tidx % CG
            rg = tidx // CG

            gV = cute.local_tile(mV[b, None, hv, None], (BT, BV), (t_idx, None))
            if cutlass.const_expr(self.varlen):
                gV = cute.local_tile(cute.domain_offset((raw0, 0), mV[b, None, hv, None]), (BT, BV),
                                     (0, None))
            gW = cute.local_tile(mW[b, None, hv, None], (BT, BV), (t_idx, None))
            gU = cute.local_tile(mU[b, None, hv, None], (BT, BV), (t_idx, None))
            gAkk = cute.local_tile(mAkk[b, None, hv, None], (BT, BT), (t_idx, 0))

            # ---------------- shared memory (46 KB)
            smem = cutlass.memory.SmemAllocator()
            atom = _warp.swizzle_atom()
            KS = K + QPAD
            bAb = smem.allocate_tensor(io, cute.make_layout(BT * BT), 1024)
            bV = smem.allocate_tensor(io, cute.make_layout(BT * BV * STAGES), 1024)
            sKE = smem.allocate_tensor(io, cute.make_layout((BT, K), stride=(KS, 1)), 16)
            sTot4 = smem.allocate_tensor(f32, cute.make_layout((NRG, K // 4, 4), stride=(K, 4, 1)), 16)
            sBeta = smem.allocate_tensor(f32, cute.make_layout(BT), 16)
            sAb = cute.make_tensor(bAb.iterator, cute.tile_to_shape(atom, (BT, BT), (0, 1)))  # Akk: A operand
            sV = cute.make_tensor(bV.iterator, cute.tile_to_shape(atom, (BT, BV, STAGES), (0, 1, 2)))
            sKE4 = cute.make_tensor(sKE.iterator, cute.make_layout((BT, K // 4, 4), stride=(KS, 4, 1)))

            # ---------------- Akk and the ring's first V tiles by cp.async, under the gate
            cp_io, tio, tVg, tVs, cVio = self._v_copies(tidx, gV, sV)
            cute.copy(cp_io, tio.partition_S(gAkk), tio.partition_D(sAb))
            cute.arch.cp_async_commit_group()
            groups = []
            for iv in cutlass.range_constexpr(min(STAGES, NV)):
                self._load_v(cp_io, tVg, tVs, cVio, nv, iv, iv, groups)
            self._beta_rows(mBeta, sBeta, b, hv, row0, raw0, nv, tidx)
            rowv = cute.make_layout((K // 4, 4), stride=(4, 1))  # a row as 4-column vectors
            g = cute.make_rmem_tensor(cute.make_layout((RG, 4), stride=(4, 1)), f32)
            gl = cute.make_rmem_tensor(cute.make_layout(4), f32)
            if cutlass.const_expr(self.gk_in):
                for i in cutlass.range_constexpr(RG):
                    src = cute.make_tensor(mGk[b, row0 + rg * RG + i, hv, None].iterator, rowv)
                    g[i, None].store(src[cg, None].load())
                gl.store(cute.make_tensor(mGk[b, row0 + BT - 1, hv, None].iterator, rowv)[cg, None].load())
            else:
                self._gate_rows(mG, mAlog, mBias, sTot4, g, b, hv, row0, tidx, raw0, nv, True)
            # the thread's q, k elements, four rows at a time: the first four rows' loads issued
            # before the barrier (they fly under it and the gate's join), the next four's once
            # those are consumed (all eight at once spill: 80-140 bytes at the 80 registers that
            # three CTAs per SM allow)
            qs, ks = self._qk_rows(mQ, mK, b, h, row0, rg, cg, 0)
            cute.arch.sync_threads()  # the gate's totals and beta
            if cutlass.const_expr(not self.gk_in):
                self._gate_join(None, sTot4, g, mGk, b, hv, row0, tidx)
                self._gate_last(sTot4, gl, tidx)

            # ---------------- kg, qg out, bf16(beta k E) to smem
            for half in cutlass.range_constexpr(2):
                if cutlass.const_expr(half == 1):
                    qs, ks = self._qk_rows(mQ, mK, b, h, row0, rg, cg, RG // 2)
                for i in cutlass.range_constexpr(RG // 2):
                    ii = half * (RG // 2) + i
                    r = rg * RG + ii
                    qv = qs[i].to(f32)
                    kv = ks[i].to(f32)
                    br = sBeta[r]
                    rqg = cute.make_rmem_tensor(cute.make_layout(4), io)
                    rkg = cute.make_rmem_tensor(cute.make_layout(4), io)
                    rke = cute.make_rmem_tensor(cute.make_layout(4), io)
                    for x in cutlass.range_constexpr(4):
                        rkg[x] = io(kv[x] * _exp2(gl[x] - g[ii, x]))
                        rqg[x] = io(qv[x] * _exp2(g[ii, x]))
                        rke[x] = io(kv[x] * br * _exp2(g[ii, x]))
                    cute.make_tensor(mQg[b, row0 + r, hv, None].iterator, rowv)[cg, None].store(rqg.load())
                    cute.make_tensor(mKg[b, row0 + r, hv, None].iterator, rowv)[cg, None].store(rkg.load())
                    sKE4[r, cg, None].store(rke.load())
            cute.arch.cp_async_wait_group(len(groups))  # Akk (the V tiles may still fly)
            cute.arch.sync_threads()
            st8, t8 = _st8(io, tidx)
            self._wu(tidx, st8, t8, sAb, sKE, sV, sBeta, gW, gU, cp_io, tVg, tVs, cVio, nv, groups)

        @cute.jit
        def _tile_mma(self, tiled_mma, thr, tcAn, tcBt, cpBt, pAb, vAb, rAb, vBT, rBT, sBT, st_c16,
                      tsc16, gOut):
            """gOut (64 x 64, io) = bf16(X) (64 x 64) @ the (s, col) smem tile whose transposed
            view is sBT, on bf16 mma.sync; out from the C fragments as bf16 pairs."""
            pBT = cpBt.partition_S(sBT)
            acc = cute.make_rmem_tensor(thr.partition_shape_C((BT, BV)), f32)
            acc.fill(0.0)
            for kb in cutlass.range_constexpr(BT // 16):
                cute.copy(tcAn, pAb[None, None, kb], vAb[None, None, kb])
                cute.copy(tcBt, pBT[None, None, kb], vBT[None, None, kb])
                cute.gemm(tiled_mma, acc, rAb[None, None, kb], rBT[None, None, kb], acc)
            ro = cute.make_fragment_like(acc, self.io_dtype)
            ro.store(acc.load().to(self.io_dtype))
            cute.copy(st_c16, tsc16.retile(ro), tsc16.partition_D(gOut))


    return _Kernel


_kernel_class = functools.cache(_build_kernel_class)  # built (with the DSL import) on first use


# ----------------------------------------------------------------------------------- host side
_NAMES = ("q", "k", "v", "g", "beta")
def _table_reason(q, k, v, g, beta, table, lower_bound, use_gate_in_kernel) -> str | None:
    """varlen's own reasons: the chunk table int32 [NT, 2], contiguous, on the inputs' device; one
    packed row (B = 1) with one raw T for the five inputs; not an fp16 g in the lower_bound form."""
    r = _warp.table_reason(table, q.device)
    if r:
        return r
    if q.dim() != 4 or q.shape[0] != 1:
        return f"varlen needs the packed row q [1, T, H, K]; got {tuple(q.shape)}"
    if any(x.dim() < 2 or x.shape[:2] != q.shape[:2] for x in (k, v, g, beta)):
        return "q, k, v, g, beta must share one packed row [1, T, ...]"
    return lower_bound_fp16_reason(g, lower_bound, use_gate_in_kernel)


def _padded_shape(x, T: int):
    """x's shape with T rows and no storage (meta): the extent checks of a varlen call, whose raw T
    need not be a multiple of the chunk, run on the padded row."""
    return torch.empty((x.shape[0], T, *x.shape[2:]), device="meta")


def _hard_reason(q, k, v, g, beta, A_log, dt_bias, use_gate_in_kernel, chunk_size, table=None,
                 lower_bound=None) -> str | None:
    """Why the kernel cannot compute this call at all (shape, dtype, layout), or None. With a
    table (varlen), the extents are checked on the padded row (T = 64 NT), the rest on the raw one."""
    if chunk_size != BT:
        return f"chunk_size={chunk_size} (kernel built for {BT})"
    if table is not None:
        r = _table_reason(q, k, v, g, beta, table, lower_bound, use_gate_in_kernel)
        if r:
            return r
    return call_reason(q, k, v, g, beta, A_log, dt_bias, use_gate_in_kernel, table)


def call_reason(q, k, v, g, beta, A_log, dt_bias, use_gate_in_kernel, table=None) -> str | None:
    """The checks after the chunk size and a table's own (kda_cute_bwd_prep shares them): extents
    (with a table, every tensor's on the padded row T = 64 NT), dtypes, the gate's parameters,
    layouts (the table's too)."""
    ext = (q, k, v, g, beta)
    if table is not None:
        ext = tuple(_padded_shape(x, BT * table.shape[0]) for x in ext)
    r = (_warp.extent_reason(*ext, SUPPORTED_K)
         or _warp.dtype_reason(q, (("k", k), ("v", v)), g, beta, _warp.G_DTYPES))
    if r:
        return r
    HV, K = g.shape[2], g.shape[3]
    if use_gate_in_kernel and (A_log is None or A_log.numel() != HV):
        return f"the gate in the kernel needs A_log of {HV} elements"
    if use_gate_in_kernel and dt_bias is not None and dt_bias.numel() != HV * K:
        return f"dt_bias must have HV*K={HV * K} elements"
    if table is not None:
        return _warp.layout_reason((*_NAMES, "table"), (q, k, v, g, beta, table))
    return _warp.layout_reason(_NAMES, (q, k, v, g, beta))


def lower_bound_fp16_reason(g, lower_bound, use_gate_in_kernel) -> str | None:
    """varlen's refusal of an fp16 g in the lower_bound form (its pad gate overflows fp16)."""
    if use_gate_in_kernel and lower_bound is not None and g.dtype == torch.float16:
        return "varlen with an fp16 g in the lower_bound form (its pad gate overflows fp16: give g in fp32)"
    return None


def is_supported(q, k, v, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel, scale, chunk_size=BT,
                 want_qg=False, l2norm=False, table=None) -> str | None:
    """None when `fwd_prep` runs the CuTe kernel on these arguments, else the reason it would not
    (l2norm changes nothing: the L2 norm takes every q, k the kernel takes). `table`: varlen's chunk
    table (module docstring); its contents are trusted, not read (that would sync the host)."""
    return _hard_reason(q, k, v, g, beta, A_log, dt_bias, use_gate_in_kernel, chunk_size, table, lower_bound)


@dataclass(frozen=True)
class PrepConfig:
    """Everything the compiled kernel depends on: the call cache's compile key. H and HV are
    static extents of the views (row strides become immediates); B and T are dynamic."""

    io_dtype: str  # "bf16" / "fp16"
    beta_dtype: str  # "bf16" / "fp16" / "fp32"
    g_dtype: str  # "fp32" / "bf16" / "fp16"
    K: int
    V: int
    H: int
    HV: int
    scale: float
    want_qg: bool
    gate: str  # _warp.GATES
    has_bias: bool
    lower_bound: float
    arch: str
    recompute: bool = False  # kda_cute_bwd_prep (kda_cute.bwd_prep)
    l2norm: bool = False  # q, k given raw: L2-normalized in the kernel, written out with their rstds (fwd)
    gk_in: bool = False  # bwd_prep: the forward's gk read (no gate in the op), not recomputed
    varlen: bool = False  # the raw packed row read through the chunk table (fwd: q, k's padded copies out)


_new_config = interned(PrepConfig)


def _config(q, v, g, beta, dt_bias, lower_bound, use_gate_in_kernel, scale, want_qg, l2norm=False,
            recompute=False, gk_in=False, varlen=False) -> PrepConfig:
    gate = _warp.gate_form(use_gate_in_kernel, lower_bound)
    return _new_config(DT[q.dtype], DT[beta.dtype], DT[g.dtype], q.shape[3], v.shape[3], q.shape[2],
                       v.shape[2], float(scale), bool(want_qg), gate, gate != "none" and dt_bias is not None,
                       float(lower_bound or 0.0), compile_arch(), bool(recompute), bool(l2norm), bool(gk_in),
                       bool(varlen))


def _outputs(q, v, want_qg, l2norm=False, T=None):
    """gk (fp32), then w, u, qg (None unless want_qg), kg, Aqk, Akk in q's dtype, and with l2norm
    q, k normalized (q's dtype, [B, T, H, K]) and their rstds ([B, T, H] fp32): fresh, on T rows
    (default v's; varlen: the padded row's)."""
    B, T_in, HV, V = v.shape
    T = T_in if T is None else T
    H, K = q.shape[2], q.shape[3]
    io = q.dtype
    l2 = ()
    if l2norm:
        l2 = (alloc((B, T, H, K), io, q), alloc((B, T, H, K), io, q),
              alloc((B, T, H), torch.float32, q), alloc((B, T, H), torch.float32, q))
    return (
        alloc((B, T, HV, K), torch.float32, q),  # gk
        alloc((B, T, HV, K), io, q),  # w
        alloc((B, T, HV, V), io, q),  # u
        alloc((B, T, HV, K), io, q) if want_qg else None,  # qg
        alloc((B, T, HV, K), io, q),  # kg
        alloc((B, T, HV, BT), io, q),  # Aqk
        alloc((B, T, HV, BT), io, q),  # Akk
        *l2,  # q, k normalized, q_rstd, k_rstd
    )


def _copies(q, T, outs, l2norm):
    """varlen's padded copies of q, k [1, T, H, K] (T the padded row's), what the backward reads
    (v, g, beta it reads on the raw row): with l2norm the normalized outputs themselves, else
    fresh copies."""
    H, K = q.shape[2], q.shape[3]
    if l2norm:
        return tuple(outs[7:9])
    return alloc((1, T, H, K), q.dtype, q), alloc((1, T, H, K), q.dtype, q)


def _kernel_args(q, k, v, g, beta, A_log, dt_bias, cfg: PrepConfig, outs, table=None, copies=None):
    """The kernel's nineteen tensors. A_log [1, HV] and dt_bias [HV, K] in fp32 (a view when they
    are already); where the kernel does not read them, gk's storage stands in (2-D, fp32). Without
    want_qg kg's storage stands in for qg (never written). `outs`: `_outputs`' (seven, or eleven
    with l2norm); without the L2 norm's four, q and k stand in for the normalized q, k (the
    forward's varlen build: `copies`, q_p and k_p, go there) and gk's storage for the rstds (never
    touched). The last: the chunk table (varlen), else gk's storage (never touched)."""
    gk, w, u, qg, kg, aqk, akk = outs[:7]
    stand_in = gk.view(-1, gk.shape[-1])
    a, bias = _warp.gate_views(A_log if cfg.gate != "none" else None, dt_bias if cfg.has_bias else None,
                               cfg.HV, cfg.K)
    a = stand_in if a is None else a
    bias = stand_in if bias is None else bias
    qk = (q, k) if copies is None else copies
    l2 = tuple(outs[7:]) if cfg.l2norm else (*qk, stand_in, stand_in)
    return (q, k, v, g, beta, a, bias, w, u, kg if qg is None else qg, kg, aqk, akk, gk, *l2,
            stand_in if table is None else table)


def _build(views, stream, cfg: PrepConfig, options: str = ""):
    import cutlass.cute as cute

    kern = _kernel_class()(
        cutlass_dtype(cfg.io_dtype), cutlass_dtype(cfg.beta_dtype), cfg.K, cfg.V, cfg.HV // cfg.H, cfg.scale,
        cfg.want_qg, cfg.gate, cfg.has_bias, cfg.lower_bound, cfg.recompute, cfg.l2norm, cfg.gk_in,
        cfg.varlen, _warp.gate_pad_value(cfg.g_dtype, cfg.gate != "none"),
    )
    return cute.compile(kern, *views, stream, options=options)


def _plan(q, k, v, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel, scale, want_qg, l2norm, table):
    """(config, kernel arguments, result) of one call: fresh outputs, and with a table the padded
    copies of q, k after them."""
    T = None if table is None else BT * table.shape[0]
    outs = _outputs(q, v, want_qg, l2norm, T)
    copies = None if table is None else _copies(q, T, outs, l2norm)
    cfg = _config(q, v, g, beta, dt_bias, lower_bound, use_gate_in_kernel, scale, want_qg, l2norm,
                  varlen=table is not None)
    args = _kernel_args(q, k, v, g, beta, A_log, dt_bias, cfg, outs, table, copies)
    return cfg, args, (outs if copies is None else (*outs, *copies))


def compile_for(q, k, v, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel, scale, want_qg=True,
                keep_ptx=False, l2norm=False, table=None):
    """Trace and compile for these arguments without launching (the CPU compile test uses it)."""
    cfg, args, _ = _plan(q, k, v, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel, scale, want_qg,
                         l2norm, table)
    return _warp.compile_only(lambda views, stream, opts: _build(views, stream, cfg, opts), args, keep_ptx)


def fwd_prep(q, k, v, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel, scale, chunk_size=BT,
             want_qg=False, l2norm=False, table=None):
    """fla's gate_chunk_cumsum + chunk_kda_fwd_intra (chunk 64) in one kernel -> (gk, w, u, qg or
    None, kg, Aqk, Akk), fresh outputs; with l2norm, q and k are the raw ones: fla's l2norm_fwd of
    both first, in the kernel, and its outputs follow (q, k normalized, q_rstd, k_rstd). With a
    chunk `table` (varlen: q, k, v, g, beta the packed row [1, T_raw, ...]) every output is on the
    padded row [1, 64 NT, ...] and q, k's padded copies follow (q_p, k_p: with l2norm the normalized
    q, k themselves; module docstring). Raises ValueError on a call the kernel cannot compute."""
    reason = _hard_reason(q, k, v, g, beta, A_log, dt_bias, use_gate_in_kernel, chunk_size, table,
                          lower_bound)
    if reason is not None:
        raise ValueError(f"kda_cute.prep.fwd_prep: unsupported call: {reason}")
    return launch(q, k, v, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel, scale, chunk_size,
                  want_qg, l2norm, table)


def launch(q, k, v, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel, scale, chunk_size=BT,
           want_qg=False, l2norm=False, table=None):
    """`fwd_prep` without its checks: for a caller whose `is_supported` just said None."""
    cfg, args, result = _plan(q, k, v, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel, scale,
                              want_qg, l2norm, table)
    _warp.launch(_cache, cfg, args, lambda views, stream, opts: _build(views, stream, cfg, opts))
    return result
