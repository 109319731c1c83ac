"""Shared structure of the three sm_90 state-scan kernels (b1 = fwd_h, fwd = fwd_h + fwd_o, dhu).

dhu uses the skeleton below. b1 and fwd keep the TMA ring, the views and the tile shapes but
hold the state transposed, with every token GEMM taking A from registers (`make_rs_mma`,
`acc_as_a`; bitwise equal to this skeleton and faster: b1 2% at the reference shape, fwd 19%
with its double-buffered o stores). dhu stays on it: in the register-A form it was 3% slower in
the two-warpgroup build the reference shape runs (1.885 vs 1.834 ms, H200 2026-12-01). The skeleton:

  * one warpgroup (128 threads) per (b, hv, 64-wide V tile); a CTA holds `nwg` of them (grid (V
    / (64 nwg), HV, B); packed sequences: (V / (64 nwg), HV, N), each CTA walking its sequence's
    chunks of the one padded row from the chunk table, `Cta`); each stage's `variant()` picks it
    by grid (2 from 256 V tiles, where the grid still fills the SMs; 1 below). nwg = 2 (V % 128
    == 0) puts two V tiles of one (b, hv) in a CTA so they share every V-independent operand
    tile (w, kg, qg, Aqk and gk's row) in smem: half the L2->SM traffic and smem for those. Each
    warpgroup keeps its own state, bf16 state / output buffers and TMA stores (issued by its
    thread 0); warp 0 of the CTA issues every load (a TMA copy elects its lane over the whole
    warp: issued from one thread, the first launch hung);
  * the state S (h or dh) is [K=128, 64] fp32, the accumulator of a warpgroup MMA (`mma_kv`:
    M = 128 state rows, N = 64, reduction over the 64 tokens of a chunk), so the update
    `S = exp2(gd) * S + X^T Y` is a row scale of the accumulator followed by wgmma into it;
  * the bf16 copy of S that fla casts for its `w @ h` style dots is written to smem in exactly
    the swizzled MN-major B-operand layout the token GEMM (`mma_tt`: M = 64 tokens, N = 64,
    reduction over K = 128) reads, and the same buffer is the source of the TMA bulk store of
    the per-chunk checkpoint (h / dh): one smem write serves both;
  * per-chunk operand tiles arrive by TMA into a `stages`-deep ring, one mbarrier per stage
    (warp 0 refills stage c % stages with chunk c + stages once every thread is done with it).
    The ring is hand-written (`prologue`, `issue_chunk`, `release`, `refill`), not
    `cutlass.pipeline.PipelineTmaAsync`: the refactor that gathered it here had to keep every
    PTX byte-identical, and a producer warp of its own (that pipeline's usual shape) measured
    slower in b1 (ptxas capped registers at 168 and spilled; docs/perf/b1.md). A port to
    cutlass.pipeline is a kernel change to measure on the GPU, not yet done;
  * per-chunk bf16 outputs (v_new, o, dv2) are staged in smem and leave by TMA store; TMA clips
    the rows past T of the last partial chunk, and its zero-filled loads make them contribute 0.

Global views (the mode order every TMA tile and smem layout is written against):
    row view  (T, X, heads, B)      token-major operand tiles (A K-major: w, kg, qg, Aqk)
    col view  (X, T, heads, B)      feature-major tiles (A/B MN-major: kg^T, w^T, qg^T, u, do, dv,
                                    and the v_new / o / dv2 stores)
    state     (V, K, HV, NT, B)     per-chunk h / dh checkpoints (V contiguous, fla's layout)
    fp32 state (K, V, HV, B)        h0 / ht / dht / dh0 (read/written once per CTA)

Per chunk, one warpgroup (skeleton): S -> bf16 smem; exp2(gd) row -> smem; fence + barrier;
leader TMA-stores the checkpoint; wait the stage's mbarrier; wgmma group 1 (token GEMMs on the
bf16 state); epilogue in the accumulator layout -> bf16 smem; fence + barrier; wgmma group 2
(state GEMM into S); leader waits the bulk-store reads; barrier; warp 0 refills the stage.

Shared memory per CTA (bf16, KB; stages x operand tiles + per-warpgroup buffers):
    b1   nwg1: 40.5 S + 24      nwg2: 64.5 S + 48     (w, kg 16 each; u 8 per V tile; gd row 0.5)
    fwd  nwg1: 64 S + 32        nwg2: 88 S + 64       (+ qg 16, Aqk 8; o buffers 2 x 8)
    dhu  nwg1: 64 S + 24        nwg2: 80 S + 48       (kg, qg, w 16 each; do, dv 8 per V tile)
Registers (ptxas, sm_90a, no local memory): fwd / dhu 168-212 per thread; b1 227 (one
warpgroup) / 240 (two: one CTA per SM by registers as well as smem).

Bytes per call at B16 T8192 H=HV=16 K128 V256 bf16 (each kernel's docstring has the table):
b1 5.386 GB (3.78 TB/s at 1.425 ms), fwd 4.044 GB (2.58 TB/s at 1.566), dhu 6.997 GB (3.82
TB/s at 1.834); a torch copy reaches 4.15-4.25 TB/s on the H200. Correct against float64 within
fla's own error (bench/check_scans.py, tests/kda_cute/test_scan_ptx.py on CPU).

History: docs/perf/scans.md (and docs/perf/{b1,fwd,dhu}.md).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

from .scan_policy import BT, BV, KD, THREADS  # noqa: F401  (the kernels read them as S.BT ...)

_K = warpgroup.OperandMajorMode.K
_MN = warpgroup.OperandMajorMode.MN


# ----------------------------------------------------------------------------------------- host
def make_mma(dtype, a_k_major: bool, b_k_major: bool):
    """One-warpgroup wgmma, 64 x 64 x 16 atom, fp32 accumulate."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype,
        dtype,
        _K if a_k_major else _MN,
        _K if b_k_major else _MN,
        cutlass.Float32,
        (1, 1, 1),
        tiler_mn=(64, 64),
    )


def mma_tt(dtype):
    """(M = 64 tokens, N = 64 v) over K: A token-major rows (K-major), B the state / v tile (MN-major)."""
    return make_mma(dtype, True, False)


def mma_kv(dtype):
    """(M = 128 state rows, N = 64 v) over the chunk's tokens: A = X^T (MN-major), B MN-major."""
    return make_mma(dtype, False, False)


def make_rs_mma(dtype, b_k_major: bool, n: int):
    """One-warpgroup wgmma with A from registers (M = 64, N = n): A is an earlier accumulator
    converted in place (`acc_as_a`), so no smem round trip and no barrier sits between two
    chained GEMMs."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype,
        dtype,
        _K,
        _K if b_k_major else _MN,
        cutlass.Float32,
        (1, 1, 1),
        tiler_mn=(64, n),
        a_source=warpgroup.OperandSource.RMEM,
    )


def acc_as_a(frag: cute.Tensor) -> cute.Tensor:
    """A (M = 64, N) wgmma accumulator fragment (in the operand dtype) viewed as the register A
    operand of a wgmma with K = N: the C layout ((2, 2, N/8), 1, 1) holds, per 16-column block,
    exactly the ((2, 2, 2)) values an m64k16 A fragment wants, so the view only regroups the
    N/8 mode as (2, N/16) and moves N/16 to the k-block mode: ((2, 2, 2), 1, N/16)."""
    lay = frag.layout
    d = cute.logical_divide(lay, ((None, None, 2), None, None))
    shape = ((d.shape[0][0], d.shape[0][1], d.shape[0][2][0]), d.shape[1], d.shape[0][2][1])
    stride = ((d.stride[0][0], d.stride[0][1], d.stride[0][2][0]), d.stride[1], d.stride[0][2][1])
    return cute.make_tensor(frag.iterator, cute.make_layout(shape, stride=stride))


def smem_layout(dtype, rows: int, cols: int, k_major: bool, stages: int):
    """Swizzled operand layout (rows = M or N, cols = reduction, stages); 128B swizzle."""
    major = cols if k_major else rows
    assert (major * dtype.width) % 1024 == 0
    kind = warpgroup.SmemLayoutAtomKind.K_SW128 if k_major else warpgroup.SmemLayoutAtomKind.MN_SW128
    atom = warpgroup.make_smem_layout_atom(kind, dtype)
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2) if k_major else (1, 0, 2))


def one_stage(layout_staged):
    return cute.slice_(layout_staged, (None, None, 0))


def row_view(t: cute.Tensor) -> cute.Tensor:
    """[B, T, heads, X] -> (T, X, heads, B)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))


def col_view(t: cute.Tensor) -> cute.Tensor:
    """[B, T, heads, X] -> (X, T, heads, B)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[3, 1, 2, 0]))


def state_view(t: cute.Tensor) -> cute.Tensor:
    """[B, NT, HV, K, V] -> (V, K, HV, NT, B)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[4, 3, 2, 1, 0]))


def fp32_state_view(t: cute.Tensor) -> cute.Tensor:
    """[B, HV, K, V] -> (K, V, HV, B)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0]))


def tma_load(view: cute.Tensor, layout_staged, tile):
    return cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), view, one_stage(layout_staged), tile
    )


def tma_store(view: cute.Tensor, layout_staged, tile):
    return cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileS2GOp(), view, one_stage(layout_staged), tile
    )


def tile_bytes(dtype, layout_staged) -> int:
    return cute.size_in_bytes(dtype, one_stage(layout_staged))


def storage(dtype, stages: int, tiles: dict, gd_rows=None):
    """A scan's smem struct: one `mbar` (full) per stage, `sG` (Cta's exp2(gd) row), then each
    `tiles` buffer (field name -> staged smem layout, in smem order, 1024-aligned for the 128B
    swizzle). With `gd_rows` (the register-A scans' fp32 gk rows, one per stage, by TMA) also an
    `empty` barrier per stage (see `release`) and those rows as `sGd`."""
    ring = cute.struct.MemRange[cutlass.Int64, stages]
    fields = {"mbar": ring} if gd_rows is None else {"mbar": ring, "empty": ring}
    fields["sG"] = cute.struct.MemRange[cutlass.Float32, KD]
    if gd_rows is not None:
        fields["sGd"] = cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(gd_rows)], 128]
    for name, lay in tiles.items():
        fields[name] = cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(lay)], 1024]
    return cute.struct(type("Storage", (), {"__annotations__": fields}))


def compile_fn(build, kernel):
    """The @cute.jit entry that `cute.compile` traces for a scan build, called with the stage's
    [B, ...] tensors and the stream. It lays out smem (`build._layouts()` sets the tile layouts,
    `tiles`: the smem buffers in order, and `l_g` in the register-A scans) and its `storage`;
    `kernel(build)`, the stage's kernel factory, gives (operands, kernel): `operands(*tensors)`
    -> (TMA operands, the kernel's other arguments). The kernel runs over the scan grid
    (V / (64 nwg), HV, B), `nwg` warpgroups a CTA; its first parameter takes the TMA operands,
    (atom, TMA tensor) pairs in its order, as one flat tuple that `pairs` splits again. Flat, the
    kernel's parameters, symbol and PTX are those of one parameter per atom / tensor; a tuple of
    pairs would rename the kernel (its symbol is built from each argument's str, and a pair's
    str holds its members' reprs)."""

    @cute.jit
    def run(*tensors_stream):
        tensors = tensors_stream[:-1]
        build._layouts()
        build.storage = storage(build.dtype, build.stages, build.tiles, getattr(build, "l_g", None))
        operands, kern = kernel(build)
        tmas, args = operands(*tensors)
        flat = tuple(x for op in tmas for x in op)
        # grid z: the batch, or with a chunk table (the last tensor, [2 (N + 1)]) its N sequences
        z = cute.size(tensors[-1], mode=[0]) // 2 - 1 if build.varlen else cute.size(tensors[0], mode=[0])
        kern(flat, *args).launch(
            grid=(build.V // (BV * build.nwg), build.HV, z),
            block=[THREADS * build.nwg, 1, 1],
            stream=tensors_stream[-1],
        )

    return run


# --------------------------------------------------------------------------------------- device
class Cta:
    """The coordinates and shared memory every scan kernel starts from (one place, so the three
    kernels cannot drift): thread `tid`, its warpgroup `wg` (= its 64-wide V tile within the
    CTA) and rank `wtid` in it, the block's (bv, hv, b), the V tile `vt`, the k / q heads `hk`,
    `hq` of GVA, T and the chunk count NT, the smem struct `st`, the mbarrier ring `mbar`, the
    exp2(gd) row `sG` and the `tiles` (`cfg.tiles`' buffers as swizzled tensors, in order); in
    the register-A scans (`cfg.l_g`) also the `empty` barriers and gk's rows `sGd`. Built while
    tracing a kernel (it lays out `cfg` first): `mG` is any (X, T, heads, B) view.

    The walk: `NT` chunks from chunk `c0` of batch row `b`, the fp32 states at row `seq`. Fixed
    length: b = seq = the block's z, c0 = 0. With a chunk table (`cfg.varlen`, `mChunks` int32
    [2 (N + 1)]: the chunk offsets, then the walk order): the block's z is the rank in the walk
    order, its sequence seq = mChunks[N + 1 + z] (the longest first: kda_chain.varlen.walk_order),
    its chunks [mChunks[seq], mChunks[seq + 1]) of the one packed row b = 0; every per-chunk load
    and store then indexes chunk c0 + c."""

    def __init__(self, cfg, mG, mChunks):
        cfg._layouts()
        self.tid, _, _ = cute.arch.thread_idx()
        self.wg = self.tid // THREADS
        self.wtid = self.tid % THREADS
        self.bv, self.hv, z = cute.arch.block_idx()
        self.vt = self.bv * cfg.nwg + self.wg
        self.hk = self.hv // cfg.ratio_k
        if hasattr(cfg, "ratio_q"):
            self.hq = self.hv // cfg.ratio_q
        self.T = cute.size(mG, mode=[1])
        self.seq = z
        if cfg.varlen:  # (plain Python: Cta is built while tracing, not a jit function)
            self.b = 0
            self.seq = mChunks[cute.size(mChunks) // 2 + z]
            self.c0 = mChunks[self.seq]
            self.NT = mChunks[self.seq + 1] - self.c0
        else:
            self.b = z
            self.c0 = 0
            self.NT = (self.T + BT - 1) // BT
        self.st = cutlass.memory.SmemAllocator().allocate(cfg.storage)
        self.mbar = self.st.mbar.data_ptr()
        self.sG = self.st.sG.get_tensor(cute.make_layout(KD))
        ring = getattr(cfg, "l_g", None) is not None  # the register-A scans' (`storage`'s gd_rows)
        if ring:
            self.empty = self.st.empty.data_ptr()
        self.tiles = [smem_tensor(getattr(self.st, n), lay) for n, lay in cfg.tiles.items()]
        if ring:
            self.sGd = self.st.sGd.get_tensor(cfg.l_g)


class StateT:
    """The register-A scans' (b1, fwd) state of one warpgroup: h^T (v, k) fp32 in `acc`, the
    accumulator of `mma_s` (M = 64 v, N = 128 k, over the chunk's tokens; `cS` its coordinates),
    and `mma_p` (M = 64 v, N = 64, over k) for the token GEMMs reading bf16(h^T) from registers
    (`acc_as_a`); `thr_p` / `thr_s` their slices for the thread. Built while tracing a kernel, in
    the order its steps are called: MMAs, B fragments (`b_p`, `b_s`), `accumulators`, `start`
    (the PTX follows that order)."""

    def __init__(self, cfg, cta):
        self.cfg = cfg
        self.mma_p = make_rs_mma(cfg.dtype, True, BT)  # (v, t) over k
        self.mma_s = make_rs_mma(cfg.dtype, False, KD)  # (v, k) over t
        self.thr_p = self.mma_p.get_slice(cta.wtid)
        self.thr_s = self.mma_s.get_slice(cta.wtid)

    def b_p(self, s_tensor):
        """`mma_p`'s B fragment of an smem tile (`b_s`: `mma_s`'s)."""
        return self.mma_p.make_fragment_B(self.thr_p.partition_B(s_tensor))

    def b_s(self, s_tensor):
        return self.mma_s.make_fragment_B(self.thr_s.partition_B(s_tensor))

    def accumulators(self, n_p: int):
        """h^T's `acc` (and `cS`), and `n_p` fp32 (v, t) accumulators of `mma_p` (returned)."""
        self.cS = self.thr_s.partition_C(cute.make_identity_tensor((BV, KD)))
        self.acc = cute.make_rmem_tensor(self.cS.shape, cutlass.Float32)
        shape_p = self.thr_p.partition_C(cute.make_identity_tensor((BV, BT))).shape
        return [cute.make_rmem_tensor(shape_p, cutlass.Float32) for _ in range(n_p)]

    def start(self, cta, mH0, mHt):
        """acc = h0's tile (or 0); ht's tile `tSgHt`, partitioned here before the loop (the
        gemms set the MMA's ACCUMULATE field inside it)."""
        tile = (0, cta.vt, cta.hv, cta.seq)
        gH0 = transposed(cute.local_tile(mH0, (KD, BV), tile))
        self.tSgHt = self.thr_s.partition_C(transposed(cute.local_tile(mHt, (KD, BV), tile)))
        if self.cfg.has_h0:
            cute.autovec_copy(self.thr_s.partition_C(gH0), self.acc)
        else:
            self.acc.fill(0.0)


def begin_chunk(hs: StateT, c, full):
    """Chunk c's stage s and bf16(h^T) (the A of its token GEMMs), once the stage's loads landed,
    fenced for the chunk's first wgmma group (a function, not a StateT method: the DSL's loops
    carry an object whose method they call)."""
    nst = hs.cfg.stages
    s = c % nst
    hb = cast(hs.acc, hs.cfg.dtype)
    cute.arch.mbarrier_wait(full + s, (c // nst) % 2)
    warpgroup.fence()
    return s, hb


def cast(frag, dtype):
    """A register copy of a fragment in `dtype`."""
    out = cute.make_rmem_tensor_like(frag, dtype)
    out.store(frag.load().to(dtype))
    return out


@cute.jit
def finish(acc, dst, wtid):
    """After the last chunk: the fp32 state to `dst` (a partition like `acc`'s; None: not kept),
    and the warpgroup's bulk stores waited for."""
    if cutlass.const_expr(dst is not None):
        cute.autovec_copy(acc, dst)
    if wtid == 0:
        cute.arch.cp_async_bulk_wait_group(0)


def smem_tensor(buf, layout_staged):
    """Tensor over a struct MemRange with the swizzle in the pointer (what wgmma descriptors want)."""
    return buf.get_tensor(layout_staged.outer, swizzle=layout_staged.inner)


def transposed(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes (keeps a trailing stage mode)."""
    r = cute.rank(t.layout)
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0] + list(range(2, r))))


def tma_part(atom, s_tensor, g_tiles):
    """TMA partition: smem (r, c[, stages]) and gmem (r, c, n) -> ((vals)[, stages]), ((vals), n)."""
    return cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(s_tensor, 0, 2), cute.group_modes(g_tiles, 0, 2)
    )


def pairs(flat):
    """The kernel's TMA operands, (atom, TMA tensor) pairs, from the flat tuple of `compile_fn`."""
    return [flat[i : i + 2] for i in range(0, len(flat), 2)]


def tile_part(op, s_tensor, tile, coord):
    """`tma_part` of a TMA operand `op` = (atom, tensor) over its `tile`-shaped tiles at `coord`."""
    return tma_part(op[0], s_tensor, cute.local_tile(op[1], tile, coord))


def load(op, s_tensor, tile, coord, *slot):
    """An `issue_chunk` load of operand `op` into `s_tensor`: (atom, gmem, smem, *slot)."""
    ts, tg = tile_part(op, s_tensor, tile, coord)
    return (op[0], tg, ts, *slot)


def store(op, s_tensor, tile, coord):
    """A `store_chunk` store of operand `op` from `s_tensor`: (atom, smem, gmem)."""
    ts, tg = tile_part(op, s_tensor, tile, coord)
    return (op[0], ts, tg)


def gemm(tiled_mma, acc, tA, tB, stage_a, stage_b, accumulate: bool):
    """acc (+)= A @ B over all k-blocks of the fragments; stage_x None for an unstaged operand."""
    nk = cute.size(tA, mode=[2])
    tiled_mma.set(warpgroup.Field.ACCUMULATE, accumulate)
    for kb in range(nk):
        a = tA[None, None, kb] if stage_a is None else tA[None, None, kb, stage_a]
        b = tB[None, None, kb] if stage_b is None else tB[None, None, kb, stage_b]
        cute.gemm(tiled_mma, acc, a, b, acc)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)


def frag_to_smem(frag, s_part, dtype):
    """fp32 accumulator fragment -> `dtype` into an smem partition of the same shape."""
    cute.autovec_copy(cast(frag, dtype), s_part)


def smem_to_frag_f32(s_part, like):
    tmp = cute.make_rmem_tensor_like(like, s_part.element_type)
    cute.autovec_copy(s_part, tmp)
    out = cute.make_rmem_tensor_like(like, cutlass.Float32)
    out.store(tmp.load().to(cutlass.Float32))
    return out


def sync_smem_for_async():
    """Generic-proxy smem writes -> visible to wgmma / TMA (async proxy), then CTA barrier."""
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.sync_threads()


def sync_smem_for_async_wg(bar: int):
    """`sync_smem_for_async` for one warpgroup: named barrier `bar` over its 128 threads."""
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=bar, number_of_threads=THREADS)


@cute.jit
def load_row_scale(s_g: cute.Tensor, g_row: cute.Tensor, tid: cutlass.Int32):
    """s_g[k] = exp2(g_row[k]) for k < 128, one element per thread of the first warpgroup
    (a coalesced 512 B read)."""
    if tid < KD:
        s_g[tid] = cute.arch.exp2(g_row[tid])


@cute.jit
def scale_rows(acc: cute.Tensor, coords: cute.Tensor, s_g: cute.Tensor, mul: cutlass.Float32):
    """acc[r, :] *= s_g[r] * mul (coords: identity partition giving each element's (row, col))."""
    for i in cutlass.range_constexpr(cute.size(acc)):
        acc[i] = acc[i] * (s_g[coords[i][0]] * mul)


def issue_chunk(mbar, s, nbytes: int, loads, n, T=None):
    """(all 32 lanes of warp 0) expect `nbytes` on barrier s and TMA-load chunk n of every load.

    The whole warp, not one thread: each TMA copy elects its issuing lane with `elect.sync` over
    the full warp mask, which is undefined with one lane active. Measured on the H200
    (2026-11-30): issued from `tid == 0` alone, the first launch of each of the three scans never finished.

    A load is (atom, gmem, smem) into smem stage s, or (atom, gmem, smem, mult, off) into smem
    stage s * mult + off (per-warpgroup tiles of one pipeline stage), or (atom, gmem, smem, "row"):
    a one-token tile indexed by token, loaded at chunk n's last valid token (T needed)."""
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(mbar + s, nbytes)
    for ld in loads:
        atom, tg, ts = ld[0], ld[1], ld[2]
        slot, idx = s, n
        if len(ld) == 4:
            idx = cutlass.min((n + 1) * BT, T) - 1
        elif len(ld) == 5:
            slot = s * ld[3] + ld[4]
        cute.copy(atom, tg[None, idx], ts[None, slot], tma_bar_ptr=mbar + s)


@cute.jit
def decay_cols(acc: cute.Tensor, coords: cute.Tensor, s_gd: cute.Tensor, s):
    """acc[:, k] *= exp2(gd[k]) for a transposed state h^T (v, k), the m64n128 accumulator of the
    register-A scans (b1): its C fragment's (2, 2, 16) is (column pair, row pair, column
    block), so one exp2 per column serves two elements. s_gd: the (128, 1, stages) fp32 rows of
    gk at each stage's last token; coords: the identity partition of acc."""
    for j in cutlass.range_constexpr(cute.size(acc) // 4):
        for c2 in cutlass.range_constexpr(2):
            i0 = c2 + 4 * j
            e = cute.arch.exp2(s_gd[coords[i0][1], 0, s])
            acc[i0] = acc[i0] * e
            acc[i0 + 2] = acc[i0 + 2] * e


def release(empty, s):
    """(every consumer warp, once its reads of stage s are done) one arrive on s's empty barrier."""
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive(empty + s)


@cute.jit
def refill(full, empty, s, c, nst: cutlass.Constexpr, NT, nbytes: cutlass.Constexpr, loads, T, tid, c0):
    """(warp 0 whole) once every consumer warp released chunk c's stage s, load chunk c + nst
    (of the walk from chunk c0: see Cta) into it (empty barriers: one arrive per warp, see
    `release`)."""
    if tid < 32:
        if c + nst < NT:
            cute.arch.mbarrier_wait(empty + s, (c // nst) % 2)
            issue_chunk(full, s, nbytes, loads, c0 + c + nst, T)


def store_chunk(st, n, ts=None):
    """(one thread) TMA-store `st` = (atom, smem, gmem) (a `store`; its smem, or `ts`) to chunk n
    and commit the bulk group."""
    atom, s, tg = st
    cute.copy(atom, s if ts is None else ts, tg[None, n])
    cute.arch.cp_async_bulk_commit_group()


@cute.jit
def prologue(
    mbar, nstages: cutlass.Constexpr, nbytes: cutlass.Constexpr, loads, first, step, NT, tid, T=None,
    empty=None, consumers: cutlass.Constexpr = 0,
):
    """Init one mbarrier per stage and put the first chunks in flight (chunk order first, first+step...);
    T: the sequence length, for a "row" load (see issue_chunk). With `empty` (the register-A
    scans' ring: `release`, `refill`), first its barriers, one per stage, of `consumers` arrivals."""
    if cutlass.const_expr(empty is not None):
        if tid == 0:
            for i in cutlass.range_constexpr(nstages):
                cute.arch.mbarrier_init(empty + i, consumers)
    if tid == 0:
        for i in cutlass.range_constexpr(nstages):
            cute.arch.mbarrier_init(mbar + i, 1)
        cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    if tid < 32:  # warp 0 whole (see issue_chunk)
        for i in cutlass.range_constexpr(nstages):
            if i < NT:
                issue_chunk(mbar, i, nbytes, loads, first + step * i, T)


def wgmma_wait():
    cute.nvgpu.warpgroup.commit_group()
    cute.nvgpu.warpgroup.wait_group(0)


@cute.jit
def mask_upper(sA: cute.Tensor, tid, nthreads: cutlass.Constexpr):
    """Zero the strictly-upper triangle of a (64, 64) smem tile (fla masks Aqk with i >= j)."""
    for i in cutlass.range_constexpr(BT * BT // nthreads):
        idx = i * nthreads + tid
        r = idx // BT
        col = idx % BT
        if col > r:
            sA[r, col] = sA.element_type(0.0)


def run_cached(cache, build, kernel, cfg, args, dyn):
    """Launch a scan through its call cache, keyed on its frozen config `cfg`; the first call of a
    config traces and compiles `build(cfg)` (the kernel module's builder class) with `kernel`
    (its kernel factory; see `compile_fn`)."""
    def compile_(views, stream, opts):
        return cute.compile(compile_fn(build(cfg), kernel), *views, stream, options=opts)

    cache.launch(cfg, args, dyn, compile_)


def compile_only(build, kernel, cfg, args, dyn):
    """Trace + compile a stage for its args without launching (CPU / CI: CUTE_DSL_ARCH=sm_90a);
    the PTX stays on the result (`__ptx__`) for the tests that read it."""
    import cuda.bindings.driver as cuda

    from ._common.cache import cute_view

    views = [cute_view(t, d) for t, d in zip(args, dyn, strict=True)]
    return cute.compile(compile_fn(build(cfg), kernel), *views, cuda.CUstream(0), options="--keep-ptx")


@cute.jit
def store_packed(o_tma, mO: cute.Tensor, s_tile: cute.Tensor, swizzle, row0, nv, vt, hv, wtid):
    """(one warpgroup, after the barrier over its smem tile) a chunk's (BV, BT) (v, t) tile of a
    col-view output [1, T_raw, heads, V] (TMA operand `o_tma`, plain tensor `mO`; `swizzle`: the
    tile's, its staged layout's `inner`) to the packed row's rows row0 .. row0 + nv (the chunk
    table's entry; rows >= nv are pad rows, never written). A full chunk (nv == BT) leaves as
    the padded-row build's does: one TMA store from thread 0, its box at row offset row0 (a
    domain offset of the TMA coordinates: any row). A partial one (a sequence's last) cannot: a
    64-row box would overwrite the next sequence's first rows while another CTA writes them, and
    TMA clips only at T_raw. Its valid rows go by 16-byte stores of every thread (8 threads a
    row, 4 passes of 16 rows), predicated on the row, straight from smem; thread 0 then commits
    an empty bulk group, so every chunk commits exactly one and the callers'
    cp_async_bulk_wait_group(1) still means 'the chunk before last'."""
    if nv == BT:
        if wtid == 0:
            g = cute.local_tile(cute.domain_offset((0, row0, 0, 0), o_tma[1]), (BV, BT), (vt, None, hv, 0))
            ts, tg = tma_part(o_tma[0], s_tile, g)
            store_chunk((o_tma[0], ts, tg), 0)
    else:
        dt = mO.element_type
        vec = 128 // dt.width  # elements of one 16-byte store
        per_row = BV // vec  # threads per row
        tiled = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dt, num_bits_per_copy=128),
            cute.make_layout((per_row, THREADS // per_row), stride=(1, per_row)),
            cute.make_layout((vec, 1)),
        )
        thr = tiled.get_slice(wtid)
        # the tile again from its address, 1024-aligned (its buffer's start): the caller's pointer,
        # offset by the chunk's parity at run time, has lost the alignment a 16-byte access needs
        base = cute.make_ptr(dt, s_tile.iterator.toint(), cute.AddressSpace.smem, assumed_align=1024,
                             swizzle_=swizzle)
        tS = thr.partition_S(cute.make_tensor(base, s_tile.layout))
        g = cute.local_tile(cute.domain_offset((0, row0, 0, 0), mO), (BV, BT), (vt, 0, hv, 0))
        tD = thr.partition_D(g)
        rows = THREADS // per_row  # rows per pass of the warpgroup
        for i in cutlass.range_constexpr(BT // rows):
            if wtid // per_row + rows * i < nv:
                cute.copy(tiled, tS[None, None, i], tD[None, None, i])
        if wtid == 0:
            cute.arch.cp_async_bulk_commit_group()
