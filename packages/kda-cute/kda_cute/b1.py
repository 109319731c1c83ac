"""b1: the forward state scan `fwd_h` on sm_90 (fla 0.6.0's `chunk_gated_delta_rule_fwd_h`).

Computes, per (b, hv), over chunks c of 64 tokens (gk in log2 units, gd = gk at the chunk's last
valid row):

    h[:, c]   = h_c                                   (bf16 checkpoint, [B, NT, HV, K, V])
    v_new_c   = u_c - w_c @ bf16(h_c)                  (fp32 accumulate, stored bf16)
    h_{c+1}   = exp2(gd_c)[:, None] * h_c + kg_c^T @ bf16(v_new_c)
    ht        = h_NT (fp32, when output_final_state)

exactly where fla casts (h and v_new to the input dtype before their dots, fp32 accumulation).

CTA decomposition: one warpgroup per (b, hv, 64-wide V tile), `nwg` of them per CTA sharing the
w / kg / gd tiles (grid (V / (64 nwg), HV, B)); w, kg, u and gk's last row arrive by TMA in a
`stages`-deep ring: a `full` mbarrier per stage (warp 0 issues the loads), an `empty` mbarrier
per stage with one arrive per consumer warp, which warp 0 waits on before it refills the stage.

Layouts: unlike fwd and dhu (the skeleton in `kda_cute._scan`, state [k, v] with both token
GEMMs reading smem), b1 holds the TRANSPOSED state h^T [64 v, 128 k] fp32 as the accumulator of an
m64n128 wgmma, so both per-chunk GEMMs take their A operand from registers:

    P^T      = bf16(h^T) @ w^T                      m64n64k16 x 8; B = w (t, k) K-major, smem
    v_new^T  = u^T - P^T                            in P's accumulator layout; u from (v, t) smem
    h^T     <- exp2(gd)[k] * h^T + bf16(v_new^T) @ kg   m64n128k16 x 4; B = kg (k, t) MN-major

An m64nN accumulator fragment holds, per 16 columns, exactly an m64k16 A fragment
(`S.acc_as_a`), so each GEMM's output feeds the next with no smem round trip and no barrier: the
serial path of a chunk is convert, wgmma, wait, subtract and convert, wgmma, wait. The
checkpoint's bf16 copy is written to smem under the second GEMM (it is the first GEMM's A, which
must not be read while that GEMM runs), v_new's after it; both leave by TMA store (v-major tiles:
fla's h layout [.., K, V] and v_new's [.., T, HV, V]), and thread 0 waits for their smem reads
under the next chunk's first GEMM, then a warpgroup named barrier frees the buffers. exp2(gd) is
a column scale of h^T: gk's row at the chunk's last token comes as a (128, 1) fp32 TMA box with
the stage, 32 exp2 per thread, under the first GEMM. Per chunk and warpgroup the GEMMs read 32 KB
of smem (w, kg) where the smem-operand design read 64 (h and v_new as B operands too, kg once per
64-row atom), and that design's three CTA barriers per chunk are gone.

Measured on the H200 (2026-12-01, fourth session; bench/results/logs/ab_b1_rs_2026-12-01{j,k},
check_scans_b1_rs_2026-12-01j, gpu_tests_b1_rs_2026-12-01k): outputs bitwise equal to the
smem-operand kernel's at the reference shape and at B2 T4096 in every variant timed;
check_scans ALL PASS (5 shapes, and S1/S2/S3 x WG2 at 4 incl. fp16, GVA tail, T = 64); the GPU
chain tests (gva, one_chunk, ragged_T, ref), the saved-activation test and the scan tests pass.
Reference shape, no initial state, same runs: 1.519 / 1.524 ms (2 stages x 2 warpgroups) against
the smem-operand kernel's 1.550 / 1.550 and fla's fwd_h 1.898 / 1.924 (1.25x / 1.26x; 1.22-1.24x
before). fla ran 3-4% slower than in the previous session (1.84), likely on autotune choices
made at a smaller shape (bench/NOTES.md); against 1.84 this is 1.21-1.25x. Fifth session, three
more runs (bench/results/scans_2026-12-01.md): 1.461-1.514 ms against fla's 1.855-1.910
(1.25-1.27x). The issue's 1.3x is NOT met.

Why it stops here (fifth session, ncu + bench/bandwidth.py): under ncu the kernel runs 1.42 ms at
3.80 TB/s of DRAM (78.9% of peak; 89-92% of what torch's copy reaches, 4.15-4.25 TB/s, while
write-only runs at 3.30-3.36 and b1 is 60% writes), and 35% of all warp stall samples sit on the
stage's `full` mbarrier wait: the loads are queued behind the DRAM, not issued late. Raising the
prefetch distance made it slower, and halving the L2 reads of w / kg (multicast) changed
nothing (below), so neither the pipeline nor L2 is the limit.

The walk is the limit (seventh session, bench/b1_ceiling.py, device time only): this kernel with
both GEMMs deleted takes the same time (1.43-1.44 ms vs 1.425-1.435), so no change to the math
can help. The same bytes move in 1.30 ms as a contiguous stream and in 1.35 as b1's tiles handed
to independent short programs, but b1's own walk (one (b, hv, V tile) chain of 128 chunks after
another) with the same tiles and no math took 1.454 ms at best in Triton: the order the scan
imposes, not the tile shapes, costs the 6-10%. Also bitwise equal and no faster: loading w / kg /
u one 1 KB swizzle atom per TMA copy so both halves of each 256 B row leave together (1.448 vs
1.435), and storing full chunks by st.global from every thread instead of TMA (1.450). Against
fla in the same run (1.789-1.811) that is 1.26x; the issue's 1.3x needs <= 1.39 ms.

Falsified (fifth session, all bitwise equal to this kernel, same runs as fla): cluster pairs of
CTAs sharing w / kg by TMA multicast (1.521 vs 1.514 ms); three stages with the refill of chunk
c - 1's stage moved under chunk c's first GEMM, chunk c + 2 two chunks in flight (1.531 vs
1.461); h / v_new store tiles double-buffered by chunk parity (1.483-1.490 vs 1.461-1.512), and
with v_new's smem write and both stores also deferred under the next chunk's first GEMM (equal;
3% faster at B2 T4096 only). Four stages x one warpgroup is 8% faster at B2 T4096 (128 CTAs,
under one wave; one run, not adopted).
Falsified earlier: four warpgroups per CTA (the whole V = 256 of a (b, hv) in one CTA, 2 stages, 224 KB,
ptxas at 128 registers; smem-operand kernel): 1.587 vs 1.529 ms for 3 x 2, and at B2 T4096 4.45
us per chunk against 2.55 with two warpgroups (lock-stepped warpgroups lengthen every chunk). A
producer warp beside the consumers (288 threads): ptxas sizes registers for whole warpgroups and
capped them at 168, spilling 464 B, so warp 0 refills after the empty barrier instead. Three
stages x two warpgroups in this kernel: 1.597-1.635 ms against 1.478-1.524 for two stages in
three runs (the smem-operand kernel preferred three; not understood).

Earlier, the smem-operand kernel (2026-11-30 / 12-01): 2 x 1 1.615 vs fla 1.955 (1.21x), two V
tiles per CTA 1.551 vs 1.903, 3 x 2 1.485 vs 1.841 (1.24x); at B2 T4096 0.252 -> 0.138 ms.
Alternatives considered then: mma.sync with ldmatrix (the state re-read through ldmatrix and
B-fragment shuffles every chunk), a 128-wide V tile in one warpgroup (128 fp32 state registers
per thread plus the token accumulators would spill).
"""

import torch

from ._common.cache import CallCache, alloc
from ._common.support import compile_arch, device_reason, sm_count_of


class _LazyScan:
    """`kda_cute._scan` on first use: it imports the CuTe DSL (seconds, and absent on some CPU
    installs), which importing a stage module for its is_supported must not require. The tile
    constants answer without the import."""

    BT, KD, BV, THREADS = 64, 128, 64, 128

    def __getattr__(self, name):
        from . import _scan

        return getattr(_scan, name)


S = _LazyScan()
# The compiled variant, by grid (H200, no initial state, 3 calls per sample). Fourth session
# (bench/results/logs/ab_b1_sweep_2026-12-01l_H200.log): at B16 T8192 H16 V256 (1024 V tiles)
# 2 stages x 2 warpgroups 1.478 ms against 1.535 (3 x 1), 1.547 (4 x 1), 1.597 (3 x 2), 1.647
# (2 x 1). Two warpgroups share each w / kg tile (half the smem fills and L2 reads); at 240
# registers a two-warpgroup CTA is alone on its SM either way. Fifth session
# (logs/ab_variants_2026-12-01q_H200.log, with ab_b1_early_2026-12-01n for B2): at B4 T4096
# (256 tiles) 2 x 2 0.207 ms against 0.210 (4 x 1), 0.212 (3 x 1), 0.236 (2 x 1): two warpgroups
# pay once their 128 CTAs about fill the 132 SMs; at B2 T4096 (128 tiles) 4 x 1 0.117 against
# 0.122 (3 x 1), 0.128 (2 x 1), 0.169 (2 x 2, 64 CTAs): with one CTA per SM in one wave the deeper
# ring wins (two runs). Between 128 and 256 tiles (2 x 1, two CTAs per SM) not measured.
WIDE_FROM_TILES = 256
# the H200's and H100 SXM's SM count: the variant rule's default where no device is asked (CPU)
DEFAULT_SMS = 132


def wide_grid(B: int, HV: int, V: int, from_tiles: int) -> bool:
    """Two warpgroups (two V tiles) per CTA: V pairs up and the grid has >= from_tiles tiles."""
    return V % (2 * S.BV) == 0 and B * HV * (V // S.BV) >= from_tiles


def variant(B: int, HV: int, V: int, sms: int = DEFAULT_SMS) -> tuple[int, int]:
    """(stages, warpgroups) for this grid (see WIDE_FROM_TILES): two warpgroups from
    WIDE_FROM_TILES V tiles; below, one, with 4 stages while every CTA has an SM to itself in
    one wave (tiles <= sms; 186 KB of smem), else 2 (two CTAs per SM)."""
    if wide_grid(B, HV, V, WIDE_FROM_TILES):
        return (2, 2)
    return (4, 1) if B * HV * (V // S.BV) <= sms else (2, 1)


def sms_of(t: torch.Tensor) -> int:
    """The SM count of `t`'s GPU (DEFAULT_SMS for a CPU tensor: compile-only builds)."""
    return sm_count_of(t) if t.is_cuda else DEFAULT_SMS

# 64-wide V tiles (B * HV * V/64) below which fla runs. None measured yet: at 128 tiles
# (B2 T4096 H16 V256) ours is already 1.59x faster than fla (bench/results/scans_2026-11-30.md).
GRID_FLOOR = 0
_cache = CallCache("kda_cute_b1")
_DT = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _cutlass_dtype(dt):
    import cutlass

    return cutlass.BFloat16 if dt == torch.bfloat16 else cutlass.Float16


class _B1:
    def __init__(
        self, dtype, V: int, HV: int, ratio_k: int, has_h0: bool, store_ht: bool, stages: int, nwg: int = 1
    ):
        self.dtype, self.V, self.HV, self.ratio_k = dtype, V, HV, ratio_k
        self.has_h0, self.store_ht, self.stages, self.nwg = has_h0, store_ht, stages, nwg

    def _layouts(self, with_struct=False):
        import cutlass
        import cutlass.cute as cute

        dt, st, nwg = self.dtype, self.stages, self.nwg
        self.l_w = S.smem_layout(dt, S.BT, S.KD, True, st)  # (t, k): B K-major of P^T, shared
        self.l_kg = S.smem_layout(dt, S.KD, S.BT, False, st)  # (k, t): B MN-major of the update, shared
        self.l_u = S.smem_layout(dt, S.BV, S.BT, False, st * nwg)  # (v, t) per (stage, warpgroup)
        self.l_g = cute.make_layout((S.KD, 1, st))  # gk's row at the chunk's last token, fp32
        self.l_h = S.smem_layout(dt, S.BV, S.KD, False, nwg)  # (v, k): the checkpoint's store tile
        self.l_v = S.smem_layout(dt, S.BV, S.BT, False, nwg)  # (v, t): v_new's store tile
        self.tx_bytes = (
            S.tile_bytes(dt, self.l_w)
            + S.tile_bytes(dt, self.l_kg)
            + nwg * S.tile_bytes(dt, self.l_u)
            + S.KD * 4
        )
        if not with_struct:
            return

        @cute.struct
        class Storage:
            mbar: cute.struct.MemRange[cutlass.Int64, st]  # full: the stage's loads landed
            empty: cute.struct.MemRange[cutlass.Int64, st]
            sG: cute.struct.MemRange[cutlass.Float32, S.KD]  # (S.Cta's; unused here)
            sGd: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, S.KD * st], 128]
            sW: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.l_w)], 1024]
            sKg: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.l_kg)], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.l_u)], 1024]
            sH: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.l_h)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.l_v)], 1024]

        self.storage = Storage

    def compile_fn(self):
        import cutlass.cute as cute

        this = self

        @cute.jit
        def run(kg, w, u, gk, h0, h, v_new, ht, stream):
            this._layouts(with_struct=True)
            atom_w, tma_w = S.tma_load(S.row_view(w), this.l_w, (S.BT, S.KD))
            atom_kg, tma_kg = S.tma_load(S.col_view(kg), this.l_kg, (S.KD, S.BT))
            atom_u, tma_u = S.tma_load(S.col_view(u), this.l_u, (S.BV, S.BT))
            atom_g, tma_g = S.tma_load(S.col_view(gk), this.l_g, (S.KD, 1))
            atom_h, tma_h = S.tma_store(S.state_view(h), this.l_h, (S.BV, S.KD))
            atom_v, tma_v = S.tma_store(S.col_view(v_new), this.l_v, (S.BV, S.BT))
            B = cute.size(u, mode=[0])
            this.kda_cute_b1(
                atom_w,
                tma_w,
                atom_kg,
                tma_kg,
                atom_u,
                tma_u,
                atom_g,
                tma_g,
                atom_h,
                tma_h,
                atom_v,
                tma_v,
                S.col_view(gk),
                S.fp32_state_view(h0),
                S.fp32_state_view(ht),
            ).launch(
                grid=(this.V // (S.BV * this.nwg), this.HV, B),
                block=[S.THREADS * this.nwg, 1, 1],
                stream=stream,
            )

        return run

    @property
    def kda_cute_b1(self):
        return _b1_kernel(self)


def _b1_kernel(cfg):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import warpgroup

    class K:
        @cute.kernel
        def kda_cute_b1(
            self,
            atom_w,
            tma_w,
            atom_kg,
            tma_kg,
            atom_u,
            tma_u,
            atom_g,
            tma_g,
            atom_h,
            tma_h,
            atom_v,
            tma_v,
            mGk,
            mH0,
            mHt,
        ):
            nst, nwg = cfg.stages, cfg.nwg
            cfg._layouts()
            cta = S.Cta(cfg, mGk)
            tid, wg, wtid, bv, hv, b, vt = cta.tid, cta.wg, cta.wtid, cta.bv, cta.hv, cta.b, cta.vt
            hk, T, NT, st = cta.hk, cta.T, cta.NT, cta.st
            full = cta.mbar
            empty = st.empty.data_ptr()
            sW = S.smem_tensor(st.sW, cfg.l_w)
            sKg = S.smem_tensor(st.sKg, cfg.l_kg)
            sU = S.smem_tensor(st.sU, cfg.l_u)
            sGd = st.sGd.get_tensor(cfg.l_g)
            sH = S.smem_tensor(st.sH, cfg.l_h)[None, None, wg]
            sV = S.smem_tensor(st.sV, cfg.l_v)[None, None, wg]

            tWs, tWg = S.tma_part(atom_w, sW, cute.local_tile(tma_w, (S.BT, S.KD), (None, 0, hv, b)))
            tKs, tKg = S.tma_part(atom_kg, sKg, cute.local_tile(tma_kg, (S.KD, S.BT), (0, None, hk, b)))
            tGs, tGg = S.tma_part(atom_g, sGd, cute.local_tile(tma_g, (S.KD, 1), (0, None, hv, b)))
            loads = [(atom_w, tWg, tWs), (atom_kg, tKg, tKs), (atom_g, tGg, tGs, "row")]
            for i in cutlass.range_constexpr(nwg):
                tUs, tUg = S.tma_part(
                    atom_u, sU, cute.local_tile(tma_u, (S.BV, S.BT), (bv * nwg + i, None, hv, b))
                )
                loads.append((atom_u, tUg, tUs, nwg, i))
            if tid == 0:
                for i in cutlass.range_constexpr(nst):
                    cute.arch.mbarrier_init(empty + i, 4 * nwg)  # one arrive per warp
            S.prologue(full, nst, cfg.tx_bytes, loads, 0, 1, NT, tid, T)

            tHs, tHg = S.tma_part(atom_h, sH, cute.local_tile(tma_h, (S.BV, S.KD), (vt, 0, hv, None, b)))
            tVs, tVg = S.tma_part(atom_v, sV, cute.local_tile(tma_v, (S.BV, S.BT), (vt, None, hv, b)))
            # built in the kernel (wgmma with A from registers: `S.make_rs_mma`)
            mma_p = S.make_rs_mma(cfg.dtype, True, S.BT)  # (v, t) over k
            mma_s = S.make_rs_mma(cfg.dtype, False, S.KD)  # (v, k) over t
            thr_p = mma_p.get_slice(wtid)
            thr_s = mma_s.get_slice(wtid)
            tBw = mma_p.make_fragment_B(thr_p.partition_B(sW))
            tBk = mma_s.make_fragment_B(thr_s.partition_B(sKg))
            cS = thr_s.partition_C(cute.make_identity_tensor((S.BV, S.KD)))
            acc = cute.make_rmem_tensor(cS.shape, cutlass.Float32)  # h^T (v, k)
            accP = cute.make_rmem_tensor(
                thr_p.partition_C(cute.make_identity_tensor((S.BV, S.BT))).shape, cutlass.Float32
            )  # (w h)^T (v, t)
            tSsH = thr_s.partition_C(sH)
            tPsV = thr_p.partition_C(sV)
            gH0 = S.transposed(cute.local_tile(mH0, (S.KD, S.BV), (0, vt, hv, b)))
            # (partitioned before the loop: the gemms set the MMA's ACCUMULATE field inside it)
            tSgHt = thr_s.partition_C(S.transposed(cute.local_tile(mHt, (S.KD, S.BV), (0, vt, hv, b))))
            if cutlass.const_expr(cfg.has_h0):
                cute.autovec_copy(thr_s.partition_C(gH0), acc)
            else:
                acc.fill(0.0)
            bar = 1 + wg

            for c in cutlass.range(NT, unroll=1):
                s = c % nst
                hb = cute.make_rmem_tensor_like(acc, cfg.dtype)
                hb.store(acc.load().to(cfg.dtype))
                cute.arch.mbarrier_wait(full + s, (c // nst) % 2)
                # (v_new)^T = u^T - bf16(h)^T @ w^T, A from registers
                warpgroup.fence()
                S.gemm(mma_p, accP, S.acc_as_a(hb), tBw, None, s, False)
                warpgroup.commit_group()
                # under it: h *= exp2(gd) (a column scale of h^T), u into registers, and the
                # last chunk's stores done reading sH / sV
                S.decay_cols(acc, cS, sGd, s)
                ub = cute.make_rmem_tensor_like(accP, cfg.dtype)
                cute.autovec_copy(thr_p.partition_C(sU[None, None, s * nwg + wg]), ub)
                if wtid == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.barrier(barrier_id=bar, number_of_threads=S.THREADS)
                warpgroup.wait_group(0)
                accP.store(ub.load().to(cutlass.Float32) - accP.load())
                vb = cute.make_rmem_tensor_like(accP, cfg.dtype)
                vb.store(accP.load().to(cfg.dtype))
                # h = exp2(gd) h + kg^T bf16(v_new), as h^T += bf16(v_new)^T @ kg
                warpgroup.fence()
                S.gemm(mma_s, acc, S.acc_as_a(vb), tBk, None, s, True)
                warpgroup.commit_group()
                cute.autovec_copy(hb, tSsH)  # the checkpoint, under the update
                warpgroup.wait_group(0)
                S.release(empty, s)
                cute.autovec_copy(vb, tPsV)
                S.sync_smem_for_async_wg(bar)
                if wtid == 0:
                    S.store_chunk(atom_h, tHs, tHg, c)
                    S.store_chunk(atom_v, tVs, tVg, c)
                S.refill(full, empty, s, c, nst, NT, cfg.tx_bytes, loads, T, tid)

            if cutlass.const_expr(cfg.store_ht):
                cute.autovec_copy(acc, tSgHt)
            if wtid == 0:
                cute.arch.cp_async_bulk_wait_group(0)

    return K().kda_cute_b1


# ------------------------------------------------------------------------------------ host side
def is_supported(kg, w, u, gk, initial_state=None, output_final_state=False) -> str | None:
    return device_reason(u) or static_reason(kg, w, u, gk, initial_state)


def static_reason(kg, w, u, gk, initial_state=None) -> str | None:
    """Shape / dtype / layout checks and the grid floor (no device needed; the compile test uses this)."""
    return operand_reason(kg, w, u, gk, initial_state) or floor_reason(u.shape, GRID_FLOOR)


def extent_reason(K: int, V: int, T: int) -> str | None:
    """The extents every scan is built for: K = 128, V in 64-wide tiles, T >= 1."""
    if K != S.KD:
        return f"K={K} (only K=128)"
    if V % S.BV:
        return f"V={V} (V % 64 != 0)"
    if T < 1:
        return "T=0"
    return None


def floor_reason(shape_bthv, floor: int) -> str | None:
    """The measured grid floor of a scan: `shape_bthv` is a [B, T, HV, V] output's shape."""
    B, _, HV, V = shape_bthv
    tiles = B * HV * (V // S.BV)
    if tiles < floor:
        return f"{tiles} V tiles (B*HV*V/64) below the measured floor {floor} (fla is faster)"
    return None


def operand_reason(kg, w, u, gk, initial_state=None) -> str | None:
    """The operand checks b1 shares with fwd (everything of static_reason but b1's floor)."""
    if u.dtype not in _DT:
        return f"dtype {u.dtype} (bf16/fp16 only)"
    if kg.dtype != u.dtype or w.dtype != u.dtype:
        return "kg, w, u must share one dtype"
    if gk.dtype != torch.float32:
        return f"gk must be fp32 (got {gk.dtype})"
    if u.dim() != 4 or kg.dim() != 4 or w.dim() != 4 or gk.dim() != 4:
        return "expected [B, T, heads, dim] tensors (varlen / cu_seqlens not supported)"
    B, T, HV, V = u.shape
    K = kg.shape[-1]
    r = extent_reason(K, V, T)
    if r:
        return r
    if tuple(w.shape) != (B, T, HV, K) or tuple(gk.shape) != (B, T, HV, K):
        return "w / gk must be [B, T, HV, K]"
    if kg.shape[0] != B or kg.shape[1] != T or HV % kg.shape[2]:
        return "kg must be [B, T, H, K] with HV % H == 0"
    for name, t in (("kg", kg), ("w", w), ("u", u), ("gk", gk)):
        if not t.is_contiguous():
            return f"{name} is not contiguous"
        if t.data_ptr() % 16:
            return f"{name} is not 16-byte aligned"
    return state_reason("initial_state", initial_state, B, HV, K, V)


def state_reason(name: str, t, B: int, HV: int, K: int, V: int) -> str | None:
    """An optional fp32 [B, HV, K, V] state (h0, ht's gradient): None when absent or usable."""
    if t is None:
        return None
    if t.dtype != torch.float32 or tuple(t.shape) != (B, HV, K, V):
        return f"{name} must be fp32 [B, HV, K, V]"
    if not t.is_contiguous() or t.data_ptr() % 16:
        return f"{name} not contiguous / aligned"
    return None


def _compile_key(kg, u, initial_state, output_final_state, stages, nwg):
    return (
        nwg,
        _DT[u.dtype],
        u.shape[-1],
        u.shape[2],
        u.shape[2] // kg.shape[2],
        initial_state is not None,
        bool(output_final_state),
        stages,
        compile_arch(),
    )


def _plan(kg, w, u, gk, initial_state, output_final_state, stages, warpgroups):
    B, T, HV, V = u.shape
    stages, nwg = S.pick_build(variant(B, HV, V, sms_of(u)), stages, warpgroups, V)
    K = kg.shape[-1]
    NT = (T + S.BT - 1) // S.BT
    dev = u.device
    h = alloc((B, NT, HV, K, V), u.dtype, dev)
    v_new = alloc(u.shape, u.dtype, dev)
    ht = alloc((B, HV, K, V), torch.float32, dev) if output_final_state else None
    dummy = _dummy(dev)
    key = _compile_key(kg, u, initial_state, output_final_state, stages, nwg)
    h0 = initial_state if initial_state is not None else dummy
    args = (kg, w, u, gk, h0, h, v_new, ht if ht is not None else dummy)
    dyn = (
        (0, 1),
        (0, 1),
        (0, 1),
        (0, 1),
        (0,) if initial_state is not None else (),
        (0, 1),
        (0, 1),
        (0,) if ht is not None else (),
    )
    cfg = _B1(
        _cutlass_dtype(u.dtype),
        V,
        HV,
        HV // kg.shape[2],
        initial_state is not None,
        bool(output_final_state),
        stages,
        nwg,
    )
    return (h, v_new, ht), key, args, dyn, cfg


def compile_for(
    kg, w, u, gk, initial_state=None, output_final_state=False, *, stages=None, warpgroups=None
):
    """Compile without launching (CPU tests); returns the compiled object."""
    _, _, args, dyn, cfg = _plan(kg, w, u, gk, initial_state, output_final_state, stages, warpgroups)
    return S.compile_only(cfg, args, dyn)


def fwd_h(
    kg, w, u, gk, initial_state=None, output_final_state=False, *, stages=None, warpgroups=None
):
    """fla's `chunk_gated_delta_rule_fwd_h(k=kg, w, u, gk=gk, ...)` -> (h, v_new, ht); raises
    ValueError on a call the kernel cannot compute (shape, dtype, layout, device).

    `stages` (TMA ring depth) and `warpgroups` (1: one 64-wide V tile per CTA; 2: two V tiles
    sharing the w / kg tiles, needs V % 128 == 0, else 1) select the compiled variant, by
    default `variant(B, HV, V, SMs)`."""
    r = operand_reason(kg, w, u, gk, initial_state) or device_reason(u)
    if r is not None:
        raise ValueError(f"kda_cute.b1.fwd_h: unsupported call: {r}")
    return launch(kg, w, u, gk, initial_state, output_final_state, stages=stages, warpgroups=warpgroups)


def launch(kg, w, u, gk, initial_state=None, output_final_state=False, *, stages=None, warpgroups=None):
    """`fwd_h` without its checks: for a caller whose `is_supported` just said None (the chain's
    gate), so a host-bound step does not pay for them twice."""
    outs, key, args, dyn, cfg = _plan(kg, w, u, gk, initial_state, output_final_state, stages, warpgroups)
    S.run_cached(_cache, cfg, key, args, dyn)
    return outs


_dummies: dict = {}


def _dummy(dev):
    """A tiny fp32 [1, 1, 128, 64] placeholder for an absent h0 / ht (never touched)."""
    d = _dummies.get(dev)
    if d is None:
        d = _dummies[dev] = torch.zeros((1, 1, S.KD, S.BV), dtype=torch.float32, device=dev)
    return d
