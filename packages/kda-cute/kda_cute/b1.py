"""b1: the forward state scan `fwd_h` on sm_90 (fla 0.6.0's `chunk_gated_delta_rule_fwd_h`).

Per (b, hv), over chunks c of 64 tokens (gk in log2 units, gd = gk at the chunk's last valid row):

    h[:, c]   = h_c                                   (bf16 checkpoint, [B, NT, HV, K, V])
    v_new_c   = u_c - w_c @ bf16(h_c)                  (fp32 accumulate, stored bf16)
    h_{c+1}   = exp2(gd_c)[:, None] * h_c + kg_c^T @ bf16(v_new_c)
    ht        = h_NT (fp32, when output_final_state)

exactly where fla casts (h and v_new to the input dtype before their dots, fp32 accumulation).

CTA decomposition: one warpgroup per (b, hv, 64-wide V tile), `nwg` of them per CTA sharing the
w / kg / gd tiles (grid (V / (64 nwg), HV, B)); w, kg, u and gk's last row arrive by TMA in a
`stages`-deep ring: a `full` mbarrier per stage (warp 0 issues the loads), an `empty` mbarrier
per stage with one arrive per consumer warp. `variant()` picks (stages, nwg) by grid.

Layouts: the global views and the ring are `kda_cute._scan`'s. The state is held TRANSPOSED,
h^T [64 v, 128 k] fp32, as the accumulator of an m64n128 wgmma, so both GEMMs take A from
registers (`S.acc_as_a`: per 16 columns an m64nN accumulator fragment is an m64k16 A fragment):

    P^T      = bf16(h^T) @ w^T                          m64n64k16 x 8; B = w (t, k) K-major
    v_new^T  = u^T - P^T                                in P's accumulator layout; u (v, t)
    h^T     <- exp2(gd)[k] * h^T + bf16(v_new^T) @ kg   m64n128k16 x 4; B = kg (k, t) MN-major

smem: per stage w, kg 16 KB each, u 8 KB per V tile, gd's row 0.5 KB; per warpgroup an h (16 KB)
and a v_new (8 KB) store tile, leaving by TMA store in fla's v-major layouts. exp2(gd) is a
column scale of h^T, 32 exp2 per thread under the first GEMM.

Constraints: bf16 / fp16; K = 128; V % 64 == 0; HV % H == 0; contiguous, 16-byte-aligned
[B, T, heads, dim] tensors (no varlen); gk fp32; h0 / ht fp32 [B, HV, K, V].

Bytes per call, B16 T8192 H=HV=16 K128 V256 bf16 (no h0 / ht; each adds 0.034 GB):

    read    kg 0.537 GB, w 0.537, u 1.074, gk (last row of each chunk) 0.017     2.165 GB
    write   h 2.147 GB, v_new 1.074                                               3.221 GB
    total   5.386 GB, 60% writes: 3.78 TB/s at 1.425 ms

Why this design:
  * register-A GEMMs: no smem round trip and no CTA barrier between the two GEMMs, half the
    smem operand reads of the smem-operand design (bitwise equal; 1.519 vs 1.550 ms).
  * 2 stages x 2 warpgroups from 256 V tiles (1.478 ms vs 1.535-1.647 for the other builds at
    1024 tiles); one warpgroup with 4 stages while the grid is one wave (B2 T4096: 0.117 vs
    0.169 ms for 2 x 2).
  * it stops here: the kernel with both GEMMs deleted takes the same time (1.43-1.44 ms), and
    b1's walk over the same tiles with no math takes 1.454 ms in Triton (a contiguous stream of
    the same bytes 1.30): the scan's order, not the math or the pipeline, is the limit.

Today (H200, 2026-12-01, device time, no h0): 1.425 ms vs fla's fwd_h 1.789 ms = 1.26x
(stage benchmark, one call per round: 1.598 vs 2.047 ms, 1.28x).

History, falsified experiments and their logs: docs/perf/b1.md.
"""

from dataclasses import dataclass

import torch

from . import scan_policy as P
from ._common.cache import CallCache, alloc
from ._common.lazy import LazyModule
from ._common.support import device_reason

S = LazyModule("kda_cute._scan")  # the device half: imported (with the DSL) on the first build
_cache = CallCache("kda_cute_b1")


def variant(B: int, HV: int, V: int, sms: int = P.DEFAULT_SMS) -> tuple[int, int]:
    """(stages, warpgroups) for this grid: two warpgroups from P.WIDE_FROM_TILES V tiles (2 x 2
    1.478 ms vs 1.535 for 3 x 1 at 1024 tiles, 0.207 vs 0.210 for 4 x 1 at 256, H200 2026-12-01);
    below, one, with 4 stages while every CTA has an SM to itself in one wave (tiles <= sms;
    186 KB of smem), else 2 (two CTAs per SM). docs/perf/b1.md."""
    if P.wide_grid(B, HV, V):
        return (2, 2)
    return (4, 1) if P.v_tiles(B, HV, V) <= sms else (2, 1)


@dataclass(frozen=True, kw_only=True)
class B1Config(P.ScanConfig):
    """Everything the compiled b1 depends on: the call cache's compile key."""

    has_h0: bool
    store_ht: bool


class _B1(P.Build):
    def _layouts(self):
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
        self.tiles = dict(sW=self.l_w, sKg=self.l_kg, sU=self.l_u, sH=self.l_h, sV=self.l_v)


def _b1_kernel(cfg):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import warpgroup

    class K:
        def operands(self, kg, w, u, gk, h0, h, v_new, ht, chunks):
            # the kernel's arguments: its TMA operands (in its order), then the others
            tmas = (
                S.tma_load(S.row_view(w), cfg.l_w, (S.BT, S.KD)),
                S.tma_load(S.col_view(kg), cfg.l_kg, (S.KD, S.BT)),
                S.tma_load(S.col_view(u), cfg.l_u, (S.BV, S.BT)),
                S.tma_load(S.col_view(gk), cfg.l_g, (S.KD, 1)),
                S.tma_store(S.state_view(h), cfg.l_h, (S.BV, S.KD)),
                S.tma_store(S.col_view(v_new), cfg.l_v, (S.BV, S.BT)),
            )
            return tmas, (S.col_view(gk), S.fp32_state_view(h0), S.fp32_state_view(ht), chunks)

        @cute.kernel
        def kda_cute_b1(self, tmas, mGk, mH0, mHt, mChunks):
            w, kg, u, g, h, v = S.pairs(tmas)
            nst, nwg = cfg.stages, cfg.nwg
            cta = S.Cta(cfg, mGk, mChunks)
            tid, wg, wtid, bv, hv, b, vt = cta.tid, cta.wg, cta.wtid, cta.bv, cta.hv, cta.b, cta.vt
            hk, T, NT, c0, full, empty = cta.hk, cta.T, cta.NT, cta.c0, cta.mbar, cta.empty
            sW, sKg, sU, sH, sV = cta.tiles
            sGd = cta.sGd
            sH, sV = sH[None, None, wg], sV[None, None, wg]

            loads = [
                S.load(w, sW, (S.BT, S.KD), (None, 0, hv, b)),
                S.load(kg, sKg, (S.KD, S.BT), (0, None, hk, b)),
                S.load(g, sGd, (S.KD, 1), (0, None, hv, b), "row"),
            ]
            for i in cutlass.range_constexpr(nwg):
                loads.append(S.load(u, sU, (S.BV, S.BT), (bv * nwg + i, None, hv, b), nwg, i))
            S.prologue(full, nst, cfg.tx_bytes, loads, c0, 1, NT, tid, T, empty, 4 * nwg)  # 1 arrive / warp

            st_h = S.store(h, sH, (S.BV, S.KD), (vt, 0, hv, None, b))
            st_v = S.store(v, sV, (S.BV, S.BT), (vt, None, hv, b))
            hs = S.StateT(cfg, cta)  # h^T (v, k) and its GEMMs, A from registers
            mma_p, mma_s, thr_p, thr_s = hs.mma_p, hs.mma_s, hs.thr_p, hs.thr_s
            tBw, tBk = hs.b_p(sW), hs.b_s(sKg)
            (accP,) = hs.accumulators(1)  # (w h)^T (v, t)
            acc, cS = hs.acc, hs.cS
            tSsH = thr_s.partition_C(sH)
            tPsV = thr_p.partition_C(sV)
            hs.start(cta, mH0, mHt)
            bar = 1 + wg

            for c in cutlass.range(NT, unroll=1):
                s, hb = S.begin_chunk(hs, c, full)
                # (v_new)^T = u^T - bf16(h)^T @ w^T, A from registers
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
                vb = S.cast(accP, cfg.dtype)
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
                    S.store_chunk(st_h, c0 + c)
                    S.store_chunk(st_v, c0 + c)
                S.refill(full, empty, s, c, nst, NT, cfg.tx_bytes, loads, T, tid, c0)

            S.finish(acc, hs.tSgHt if cfg.store_ht else None, wtid)

    k = K()
    return k.operands, k.kda_cute_b1


# ------------------------------------------------------------------------------------ host side
def is_supported(kg, w, u, gk, initial_state=None, output_final_state=False, chunks=None) -> str | None:
    """None when `fwd_h` runs the kernel on these arguments, else the reason (no DSL import)."""
    return device_reason(u) or static_reason(kg, w, u, gk, initial_state, chunks)


def static_reason(kg, w, u, gk, initial_state=None, chunks=None) -> str | None:
    """Shape / dtype / layout checks (no device needed; the compile tests use this)."""
    return P.operand_reason(kg, w, u, gk, initial_state, chunks)


def _plan(kg, w, u, gk, initial_state, output_final_state, chunks, stages, warpgroups):
    B, T, HV, V = u.shape
    N = P.seqs(u, chunks)
    stages, nwg = P.pick_build(variant(N, HV, V, P.sms_of(u)), stages, warpgroups, V)
    K = kg.shape[-1]
    NT = (T + P.BT - 1) // P.BT
    dev = u.device
    h = alloc((B, NT, HV, K, V), u.dtype, u)
    v_new = alloc(u.shape, u.dtype, u)
    ht = alloc((N, HV, K, V), torch.float32, u) if output_final_state else None
    dummy = P.dummy(dev)
    h0 = initial_state if initial_state is not None else dummy
    table, table_dyn = P.chunk_args(chunks, dev)
    args = (kg, w, u, gk, h0, h, v_new, ht if ht is not None else dummy, table)
    dyn = (
        (0, 1),
        (0, 1),
        (0, 1),
        (0, 1),
        (0,) if initial_state is not None else (),
        (0, 1),
        (0, 1),
        (0,) if ht is not None else (),
        table_dyn,
    )
    cfg = B1Config.of(u, kg, stages, nwg, chunks, has_h0=initial_state is not None,
                      store_ht=bool(output_final_state))
    return (h, v_new, ht), args, dyn, cfg


def compile_for(
    kg, w, u, gk, initial_state=None, output_final_state=False, chunks=None, *, stages=None, warpgroups=None
):
    """Compile without launching (CPU tests); returns the compiled object."""
    _, args, dyn, cfg = _plan(kg, w, u, gk, initial_state, output_final_state, chunks, stages, warpgroups)
    return S.compile_only(_B1, _b1_kernel, cfg, args, dyn)


def fwd_h(
    kg, w, u, gk, initial_state=None, output_final_state=False, chunks=None, *, stages=None, warpgroups=None
):
    """fla's `chunk_gated_delta_rule_fwd_h(k=kg, w, u, gk=gk, ...)` -> (h, v_new, ht); raises
    ValueError on a call the kernel cannot compute (shape, dtype, layout, device).

    `chunks`: packed sequences (fla's cu_seqlens on a layout padded to whole chunks per
    sequence): int32 [2, N + 1], the chunk offsets and the walk order (`scan_policy.chunks_reason`);
    the operands are [1, T, ...], h0 / ht [N, ...].

    `stages` (TMA ring depth) and `warpgroups` (1: one 64-wide V tile per CTA; 2: two V tiles
    sharing the w / kg tiles, needs V % 128 == 0, else 1) select the compiled variant, by
    default `variant(B, HV, V, SMs)`."""
    r = static_reason(kg, w, u, gk, initial_state, chunks) or device_reason(u)
    if r is not None:
        raise ValueError(f"kda_cute.b1.fwd_h: unsupported call: {r}")
    return launch(kg, w, u, gk, initial_state, output_final_state, chunks, stages=stages,
                  warpgroups=warpgroups)


def launch(kg, w, u, gk, initial_state=None, output_final_state=False, chunks=None, *, stages=None,
           warpgroups=None):
    """`fwd_h` without its checks: for a caller whose `is_supported` just said None (the chain's
    gate), so a host-bound step does not pay for them twice."""
    outs, args, dyn, cfg = _plan(kg, w, u, gk, initial_state, output_final_state, chunks, stages, warpgroups)
    S.run_cached(_cache, _B1, _b1_kernel, cfg, args, dyn)
    return outs
