"""kda_cute_intra: KDA's intra-chunk backward on sm_90 (fla 0.6.0's `chunk_kda_bwd_intra`).

Per chunk of BT = 64 tokens, value head hv, key column d (D_rs = exp2(g_r - g_s), r >= s, g the
log2 chunk-local cumsum of the gate):

    row side     dq2_r = sum_{s<=r} dAqk_rs k_s D_rs        dk2_r = sum_{s<=r} dAkk_rs k_s D_rs
    column side  dkt_s = sum_{r>=s} (dAqk_rs q_r + dAkk_rs beta_r k_r) D_rs
    dq = dq_in + dq2      dk = dk_in + beta dk2 + dkt      db = db_in + sum_d dk2 k
    dg = dg_in + q dq2 + (beta dk2 - dkt) k      (fold_dg: reverse-cumsummed within the chunk)

CTA decomposition: one CTA per (chunk, hv, b), grid (T/64, HV, B), 256 threads, two CTAs per SM.
A thread owns one key column d; the 256 / K thread groups split the chunk's four 16-row blocks
(K = 128: 2 groups of 2 blocks; K = 64: 4 of 1). Per block i (rows r0 = 16 i ..):
  * cross sums (sources s < r0, targets r > r0 + 15) on tf32 mma.sync m16n8k8 per warp over its
    32 columns, anchored at the block's first / last row so every exp2 argument is <= 0 whatever
    the gate (a positive exponent overflows fp32 with gates near -5 per step); B operands (kg,
    qb, kbb) computed into registers from smem, rounded to tf32 by one integer add (fla's tl.dot
    precision); C tiles reach the column-per-thread registers through a per-warp 8 x 33 stage;
  * the 16 x 16 diagonal block in SIMT, one exp2 per (r, s, d) shared by both sides, rows walked
    last to first: row r is final when reached, so its outputs leave at once, and the walk is the
    running suffix sum fold_dg needs (group totals cross groups through smem at the end);
  * db: a warp butterfly per row + a smem table.

Layouts: global q, k [B, T, H, K] (io dtype), g, dq/dk/dg in and out [B, T, HV, K] fp32 (dq / dk
out in q's dtype with emit_bf16), dAqk / dAkk [B, T, HV, 64] fp32, beta / db [B, T, HV]. smem
holds the chunk's q, k, g, dAqk, dAkk, beta once, row-major as in gmem, rows padded (dA 68, g 132,
q / k 136 elements) so fragment loads are conflict-free or 2-way: ~112 KB per CTA. The mma tile's
column n is the warp's column pi(n) = 4 c(n % 8) + n / 8, c(x) = x / 2 + 4 (x % 2), so a lane's
four B columns are adjacent (one 16-byte g load, one 8-byte q / k load). Incoming grads are read
and outputs written from registers through one column pointer per tensor at an immediate row
stride (H, HV compile-time; B, T dynamic); each block's incoming rows are prefetched into L2.

Constraints: K in (64, 128); T % 64 == 0; HV % H == 0; q / k bf16 or fp16; beta bf16 / fp16 /
fp32; the rest fp32; contiguous, 16-byte aligned; a grid of >= 2 x SM count CTAs (`CTAS_PER_SM`).

Bytes per call, B16 T8192 H=HV=16 K128 bf16 (fold_dg; beta bf16):

    read    q 0.537 GB, k 0.537, g 1.074, dAqk 0.537, dAkk 0.537,
            dq / dk / dg in 3.221, beta + db in 0.013                             6.456 GB
    write   dq / dk 2.147 (1.074 with emit_bf16), dg 1.074, db 0.008              3.230 GB
    total   9.69 GB (8.61 with emit_bf16): 2.58 TB/s at 3.758 ms

Why this design: bf16 wgmma cannot carry k exp2(..) within 2x of fla's tf32 error, and a
mid-block anchor (fla's safe_gate form) overflows with strong gates; tf32 mma beat SIMT fp32
FFMAs for the cross sums (4.150 vs 4.757 ms fold_dg). The column-per-thread map keeps a column's
16 g / k values in registers for the whole block. Nsight Compute (fold_dg): the diagonal walks
~57% of stall samples, DRAM at 52% of peak, 16 warps per SM: latency-bound; the per-block L2
prefetch took 4.078 -> 3.954 ms. Errors vs float64 2.5-4x below fla's; validated on CPU by a PTX
interpreter (tests/kda_cute/test_intra_compile.py).

Today (H200, 2026-12-01, 3 calls per sample): fold_dg 3.758-3.837 ms = 4.04-4.08x fla's intra +
dg cumsum (15.3-15.5 ms); the stage benchmark (the chain's call, fold_dg + emit_bf16, one call per
round) 3.660 vs 15.652 ms = 4.28x.

The per-column walk (everything after the loads) is kda_cute._intra_walk, the same device code
kda_cute_bwd_chunk runs on wy_dqkg's outputs in smem; with that kernel in the chain this one runs
only where bwd_chunk does not (its "split" fallback: KDA_FORCE_FLA=bwd_chunk, or fla's wy_dqkg).

History, falsified experiments and their logs: docs/perf/intra.md.
"""

import functools
from dataclasses import dataclass

import torch

from . import _warp
from ._common.cache import CallCache, alloc
from ._common.lazy import cutlass_dtype
from ._common.support import compile_arch, sm_count_of
from ._intra_walk import walk_class
from ._warp import DT

BT = 64  # chunk
BC = 16  # diagonal block
NBLK = BT // BC
THREADS = 256
SUPPORTED_K = (64, 128)

# Grid gate: below one full wave (2 CTAs x SM count, 264 on the H200) fla runs. Faster at every
# grid timed (1024 CTAs: 0.238 vs fla 0.677 ms); below 1024 not timed. docs/perf/intra.md.
CTAS_PER_SM = 2

_cache = CallCache("intra")


class KdaIntraBwd:
    """See the module docstring. io_dtype: q/k dtype; beta_dtype: beta's dtype."""

    def __init__(self, io_dtype, beta_dtype, K: int, gsize: int, fold_dg: bool, pf: int = 2):
        self.pf = pf  # rows of incoming dq/dk/dg prefetched ahead of the diagonal walk
        # smem row strides (elements), padded: conflict-free / 2-way mma fragment loads
        self.as_ = BT + 4  # dA rows (fp32)
        self.gs = K + 4  # g rows (fp32)
        self.qs = K + 8  # q, k rows (16-bit: 16 bytes keep the rows 16B-aligned)
        self.io_dtype = io_dtype
        self.beta_dtype = beta_dtype
        self.K = K
        self.gsize = gsize
        self.fold_dg = fold_dg  # (emit_bf16 is the outputs' dtype: the walk writes each in its own)
        self.ngrp = THREADS // K  # thread groups, one column per thread
        self.bpg = NBLK // self.ngrp  # 16-row blocks per group
        self.wpg = K // 32  # warps per group


def _build_kernel_class():
    """Defined lazily so importing this module does not import the DSL (seconds)."""
    import cutlass
    import cutlass.cute as cute

    f32 = cutlass.Float32

    class _Kernel(KdaIntraBwd, walk_class()):
        @cute.jit
        def __call__(
            self,
            mQ: cute.Tensor,  # [B, T, H, K] io
            mK: cute.Tensor,  # [B, T, H, K] io
            mG: cute.Tensor,  # [B, T, HV, K] f32
            mBeta: cute.Tensor,  # [B, T, HV]
            mAq: cute.Tensor,  # [B, T, HV, BT] f32
            mAk: cute.Tensor,  # [B, T, HV, BT] f32
            mDqi: cute.Tensor,  # [B, T, HV, K] f32
            mDki: cute.Tensor,
            mDbi: cute.Tensor,  # [B, T, HV] f32
            mDgi: cute.Tensor,
            mDq: cute.Tensor,  # outputs
            mDk: cute.Tensor,
            mDb: cute.Tensor,
            mDg: cute.Tensor,
            stream,
        ):
            B = cute.size(mG, mode=[0])
            T = cute.size(mG, mode=[1])
            HV = cute.size(mG, mode=[2])
            # min_blocks_per_mp=2: two CTAs (16 warps) per SM is the design point; the carveout
            # is given so the compile does not query a device (CPU compiles for CI).
            kernel = self.kda_cute_intra(
                mQ, mK, mG, mBeta, mAq, mAk, mDqi, mDki, mDbi, mDgi, mDq, mDk, mDb, mDg
            )
            kernel.launch(
                grid=(T // BT, HV, B), block=[THREADS, 1, 1], min_blocks_per_mp=2,
                preferred_smem_carveout=100, stream=stream
            )

        @cute.kernel
        def kda_cute_intra(
            self,
            mQ: cute.Tensor,
            mK: cute.Tensor,
            mG: cute.Tensor,
            mBeta: cute.Tensor,
            mAq: cute.Tensor,
            mAk: cute.Tensor,
            mDqi: cute.Tensor,
            mDki: cute.Tensor,
            mDbi: cute.Tensor,
            mDgi: cute.Tensor,
            mDq: cute.Tensor,
            mDk: cute.Tensor,
            mDb: cute.Tensor,
            mDg: cute.Tensor,
        ):
            K = self.K
            io = self.io_dtype
            tidx, _, _ = cute.arch.thread_idx()
            t_idx, hv, b = cute.arch.block_idx()
            h = hv // self.gsize
            row0 = t_idx * BT

            # ---------------- shared memory ----------------
            smem = cutlass.memory.SmemAllocator()
            QS, GS, AS = self.qs, self.gs, self.as_
            sQ = smem.allocate_tensor(io, cute.make_layout((BT, K), stride=(QS, 1)), 16)
            sK = smem.allocate_tensor(io, cute.make_layout((BT, K), stride=(QS, 1)), 16)
            sG = smem.allocate_tensor(f32, cute.make_layout((BT, K), stride=(GS, 1)), 16)
            sAq = smem.allocate_tensor(f32, cute.make_layout((BT, BT), stride=(AS, 1)), 16)
            sAk = smem.allocate_tensor(f32, cute.make_layout((BT, BT), stride=(AS, 1)), 16)
            sBeta = smem.allocate_tensor(f32, cute.make_layout(BT), 16)
            sDbp = smem.allocate_tensor(f32, cute.make_layout((BT, self.wpg), stride=(self.wpg, 1)), 16)
            # per-warp staging of an 8 x 32 half of an mma C tile (row stride 33: the
            # fragment writes are <= 2-way conflicted, the column reads conflict-free).
            # The fold's group totals reuse it (they are written after the last staging
            # read, behind the final barrier): two CTAs per SM need every KB here
            # (~112 KB dynamic + 1 KB static + 1 KB reserved, x2 <= 228 KB).
            NW = THREADS // 32
            sStage = smem.allocate_tensor(
                f32, cute.make_layout((NW, 8, 32), stride=(8 * 33, 33, 1)), 16
            )
            # 4-wide views along the contiguous mode (one LDS.128 / 16-byte copy each)
            v4 = cute.make_layout((BT, BT // 4, 4), stride=(AS, 4, 1))
            sAq4 = cute.make_tensor(sAq.iterator, v4)
            sAk4 = cute.make_tensor(sAk.iterator, v4)

            # ---------------- cooperative loads: 16-byte vectors, all issued before storing
            VI = 8 if cutlass.const_expr(io.width == 16) else 4
            nq = BT * K // VI // THREADS
            ng = BT * K // 4 // THREADS
            na = BT * BT // 4 // THREADS
            rowv_io = cute.make_layout((K // VI, VI), stride=(VI, 1))
            rowv_g = cute.make_layout((K // 4, 4), stride=(4, 1))
            rowv_a = cute.make_layout((BT // 4, 4), stride=(4, 1))
            sQv = cute.make_tensor(sQ.iterator, cute.make_layout((BT, K // VI, VI), stride=(QS, VI, 1)))
            sKv = cute.make_tensor(sK.iterator, cute.make_layout((BT, K // VI, VI), stride=(QS, VI, 1)))
            sGv = cute.make_tensor(sG.iterator, cute.make_layout((BT, K // 4, 4), stride=(GS, 4, 1)))
            vq = []
            vk = []
            for it in cutlass.range_constexpr(nq):
                idx = it * THREADS + tidx
                r = idx // (K // VI)
                c = idx % (K // VI)
                srcq = cute.make_tensor(mQ[b, row0 + r, h, None].iterator, rowv_io)
                srck = cute.make_tensor(mK[b, row0 + r, h, None].iterator, rowv_io)
                vq.append(srcq[c, None].load())
                vk.append(srck[c, None].load())
            vg = []
            for it in cutlass.range_constexpr(ng):
                idx = it * THREADS + tidx
                r = idx // (K // 4)
                c = idx % (K // 4)
                src = cute.make_tensor(mG[b, row0 + r, hv, None].iterator, rowv_g)
                vg.append(src[c, None].load())
            vaq = []
            vak = []
            for it in cutlass.range_constexpr(na):
                idx = it * THREADS + tidx
                r = idx // (BT // 4)
                c = idx % (BT // 4)
                srca = cute.make_tensor(mAq[b, row0 + r, hv, None].iterator, rowv_a)
                srcb = cute.make_tensor(mAk[b, row0 + r, hv, None].iterator, rowv_a)
                vaq.append(srca[c, None].load())
                vak.append(srcb[c, None].load())
            for it in cutlass.range_constexpr(nq):
                idx = it * THREADS + tidx
                r = idx // (K // VI)
                c = idx % (K // VI)
                sQv[r, c, None].store(vq[it])
                sKv[r, c, None].store(vk[it])
            for it in cutlass.range_constexpr(ng):
                idx = it * THREADS + tidx
                r = idx // (K // 4)
                c = idx % (K // 4)
                sGv[r, c, None].store(vg[it])
            for it in cutlass.range_constexpr(na):
                idx = it * THREADS + tidx
                r = idx // (BT // 4)
                c = idx % (BT // 4)
                sAq4[r, c, None].store(vaq[it])
                sAk4[r, c, None].store(vak[it])
            if tidx < BT:
                sBeta[tidx] = f32(mBeta[b, row0 + tidx, hv])
            cute.arch.sync_threads()

            # ---------------- per-thread column work (kda_cute._intra_walk) ----------------
            # this thread's column d of each [B, T, HV, K] tensor in this chunk: one pointer per
            # tensor, rows at a static stride (HV * K), so every per-row access is an immediate
            # offset from it (no per-access 64-bit index arithmetic)
            d = tidx % K
            RS = cute.size(mG, mode=[2]) * K  # row stride of the [B, T, HV, K] tensors (static)
            colv = cute.make_layout(BT, stride=RS)
            cols = [cute.make_tensor(m[b, row0, hv, None].iterator + d, colv)
                    for m in (mDqi, mDki, mDgi, mDq, mDk, mDg)]
            gDbi = cute.local_tile(mDbi[b, None, hv], (BT,), (t_idx,))
            gDb = cute.local_tile(mDb[b, None, hv], (BT,), (t_idx,))
            self.intra_walk(tidx, sQ, sK, sG, sAq, sAk, sBeta, sDbp, sStage, *cols, gDbi, gDb, RS)

    return _Kernel


_kernel_class = functools.cache(_build_kernel_class)  # built (with the DSL import) on first use


# ----------------------------------------------------------------------------------- host side
def _hard_reason(q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg) -> str | None:
    """Why the kernel cannot compute this call at all (shape, dtype, layout), or None."""
    if q.dim() != 4 or k.shape != q.shape:
        return f"q/k must be [B,T,H,K] of one shape; got {tuple(q.shape)} / {tuple(k.shape)}"
    B, T, H, K = q.shape
    if gk.dim() != 4 or gk.shape[0] != B or gk.shape[1] != T or gk.shape[3] != K:
        return f"gk must be [B,T,HV,K]; got {tuple(gk.shape)}"
    HV = gk.shape[2]
    if HV % H:
        return f"HV={HV} not a multiple of H={H}"
    if K not in SUPPORTED_K:
        return f"K={K} (kernel built for K in {SUPPORTED_K})"
    if T % BT:
        return f"T={T} not a multiple of the chunk {BT}"
    if dAqk.shape != (B, T, HV, BT) or dAkk.shape != (B, T, HV, BT):
        return f"dAqk/dAkk must be [B,T,HV,{BT}] (chunk {BT}); got {tuple(dAqk.shape)}"
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype:
        return f"q/k dtype {q.dtype}/{k.dtype} (bf16 or fp16 expected)"
    if beta.shape != (B, T, HV) or beta.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"beta must be [B,T,HV] bf16/fp16/fp32; got {tuple(beta.shape)} {beta.dtype}"
    for name, t in (("gk", gk), ("dAqk", dAqk), ("dAkk", dAkk), ("dq", dq), ("dk", dk), ("dg", dg)):
        if t.dtype != torch.float32:
            return f"{name} must be float32; got {t.dtype}"
        if t.shape != (B, T, HV, K) and name in ("gk", "dq", "dk", "dg"):
            return f"{name} must be [B,T,HV,K]; got {tuple(t.shape)}"
    if db.shape != (B, T, HV) or db.dtype != torch.float32:
        return f"db must be [B,T,HV] float32; got {tuple(db.shape)} {db.dtype}"
    return _warp.layout_reason(("q", "k", "gk", "beta", "dAqk", "dAkk", "dq", "dk", "db", "dg"),
                               (q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg))


def is_supported(q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg, fold_dg=False, emit_bf16=False) -> str | None:
    """None when `bwd_intra` runs the CuTe kernel on these arguments, else the reason it would not."""
    reason = _hard_reason(q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg)
    if reason is not None:
        return reason
    B, T, H, K = q.shape
    HV = gk.shape[2]
    ctas = B * (T // BT) * HV
    gate = CTAS_PER_SM * sm_count_of(q)
    if ctas < gate:
        return f"grid of {ctas} CTAs < {gate}: too small to fill the GPU (fla is faster)"
    return None


# Rows of incoming grads loaded ahead of the diagonal walk, fp32 out / emit_bf16 (`pf=` overrides:
# check_intra.py --sweep). H200 2026-12-01: pf 1/2/3 3.815/3.920/3.869 ms, bf16 3.809/3.744/3.717.
PREFETCH = {False: 1, True: 2}
# Registers per thread: two 256-thread CTAs per SM (the design point) need <= 128.
MAXREG = 128


@dataclass(frozen=True)
class IntraConfig:
    """Everything the compiled intra depends on: the call cache's compile key. H and HV are
    static extents of the views (row strides become immediates); B and T are dynamic."""

    io_dtype: str  # q / k: "bf16" / "fp16"
    beta_dtype: str  # "bf16" / "fp16" / "fp32"
    K: int
    H: int
    HV: int
    fold_dg: bool
    emit_bf16: bool
    pf: int
    arch: str


def _config(q, gk, beta, fold_dg, emit_bf16, pf) -> IntraConfig:
    emit_bf16 = bool(emit_bf16)
    return IntraConfig(DT[q.dtype], DT[beta.dtype], q.shape[3], q.shape[2], gk.shape[2], bool(fold_dg),
                       emit_bf16, PREFETCH[emit_bf16] if pf is None else int(pf), compile_arch())


def compile_for(q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg, fold_dg=False, emit_bf16=False, keep_ptx=False,
                *, pf=None):
    """Trace and compile for these arguments without launching (the CPU compile test uses it)."""
    import cuda.bindings.driver as cuda

    from ._common.cache import cute_view

    outs = _outputs(q, gk, beta, emit_bf16)
    args = (q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg, *outs)
    views = [cute_view(t, (0, 1)) for t in args]
    return _build(views, cuda.CUstream(0), _config(q, gk, beta, fold_dg, emit_bf16, pf),
                  "--keep-ptx" if keep_ptx else "")


def _build(views, stream, cfg: IntraConfig, options: str = ""):
    import cutlass.cute as cute

    kern = _kernel_class()(
        cutlass_dtype(cfg.io_dtype), cutlass_dtype(cfg.beta_dtype), cfg.K, cfg.HV // cfg.H, cfg.fold_dg,
        cfg.pf,
    )
    opts = f"--ptxas-options --maxrregcount={MAXREG} {options}".strip()
    return cute.compile(kern, *views, stream, options=opts)


def _outputs(q, gk, beta, emit_bf16):
    B, T, HV, K = gk.shape
    qk_dt = q.dtype if emit_bf16 else torch.float32
    return (
        alloc((B, T, HV, K), qk_dt, q),
        alloc((B, T, HV, K), qk_dt, q),
        alloc((B, T, HV), torch.float32, q),
        alloc((B, T, HV, K), torch.float32, q),
    )


def bwd_intra(q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg, fold_dg=False, emit_bf16=False, *, pf=None):
    """fla's chunk_kda_bwd_intra (chunk 64, safe_gate off) -> (dq, dk, db, dg), fresh outputs.

    fold_dg: dg comes back reverse-cumsummed within each 64-chunk (chunk_local_cumsum reverse).
    emit_bf16: dq/dk in q's dtype (the cast of the fp32 result; for HV == H).
    pf: rows prefetched ahead of the diagonal walk (default PREFETCH; a tuning sweep's knob)."""
    reason = _hard_reason(q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg)
    if reason is not None:
        raise ValueError(f"kda_cute.intra.bwd_intra: unsupported call: {reason}")
    return launch(q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg, fold_dg, emit_bf16, pf=pf)


def launch(q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg, fold_dg=False, emit_bf16=False, *, pf=None):
    """`bwd_intra` without its checks: for a caller whose `is_supported` just said None (the
    chain's gate), so a host-bound step does not pay for them twice."""
    outs = _outputs(q, gk, beta, emit_bf16)
    args = (q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg, *outs)
    cfg = _config(q, gk, beta, fold_dg, emit_bf16, pf)
    _cache.launch(cfg, args, ((0, 1),) * len(args),
                  lambda views, stream, opts: _build(views, stream, cfg, opts))
    return outs
