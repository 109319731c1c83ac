"""What the chunk-parallel warp-mma kernels (kda_cute.wy_dqkg, kda_cute.prep; kda_cute.intra its layout
check and dtype names; the per-row kernels kda_cute.l2norm_fwd / l2norm_bwd their checks) share:
their host checks and launch plumbing, and the device pieces of their kernels (cp.async copies, the
128-byte swizzle of 64-column 16-bit smem rows, ldmatrix atoms). One CTA per (chunk, hv, b); every
view's batch and time modes are dynamic, so one compile serves every B and T.

The device functions import the DSL: call them only while a kernel is being built.
"""

from __future__ import annotations

import functools

import torch

from ._common.cache import cute_view
from ._common.support import device_reason

IO = (torch.bfloat16, torch.float16)
DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
DYN = (0, 1)  # the dynamic modes of every view: batch, time


# ----------------------------------------------------------------------------------- host side
BT = 64  # the chunk
BV = 64  # the V tile
# fla's gate in the op: its forms (prep computes the gate, bwd_chunk its backward) and raw dtypes
GATES = ("none", "softplus", "lower_bound")
G_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def gate_form(use_gate: bool, lower_bound) -> str:
    """One of GATES: fla's gate in the op, by its flags."""
    return "none" if not use_gate else ("softplus" if lower_bound is None else "lower_bound")


GATE_PAD = -1e30  # a pad row's raw gate (the chain's kda_chain.varlen.GATE_PAD): its step gate is 0


def gate_pad_value(g_dtype, use_gate_in_kernel: bool) -> float:
    """A pad row's raw gate in g's dtype (a torch dtype or its DT name), as the chain's pack_inputs
    fills it (varlen builds: kda_cute_prep's gate rows, kda_cute_bwd_chunk's gate backward): 0 for
    a given log gate; with the gate in the op -1e30 as g's dtype rounds it (fp32 / bf16), -inf for
    fp16 (the softplus form: -1e30 overflows fp16; the lower_bound form is refused there)."""
    if not use_gate_in_kernel:
        return 0.0
    if isinstance(g_dtype, str):
        g_dtype = next(dt for dt, name in DT.items() if name == g_dtype)
    if g_dtype == torch.float16:
        return float("-inf")
    return float(torch.tensor(GATE_PAD, dtype=g_dtype))


def gate_param(t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A gate parameter (A_log, dt_bias) as the kernels read it: fp32 of `shape`, contiguous and
    16-byte aligned (every view is assumed so); a view when it already is one (the common case:
    one detach and one view, ~3 us of host time), a copy only when it is not (another dtype, a
    strided or unaligned slice of a packed parameter buffer)."""
    t = t.detach()
    if t.dtype != torch.float32:
        t = t.float()
    if not t.is_contiguous():
        t = t.contiguous()
    t = t.view(shape)
    return t if t.data_ptr() % 16 == 0 else t.clone()


def gate_views(A_log, dt_bias, HV: int, K: int):
    """The gate's parameters as the kernels read them: A_log [1, HV] and dt_bias [HV, K] in fp32
    (views when they already are), each None where not given."""
    a = None if A_log is None else gate_param(A_log, (1, HV))
    bias = None if dt_bias is None else gate_param(dt_bias, (HV, K))
    return a, bias


def extent_reason(q, k, v, gk, beta, supported_k) -> str | None:
    """q, k [B, T, H, K] with K in supported_k; v [B, T, HV, V], HV % H == 0, V % 64 == 0; T a
    whole number of chunks (a ragged last chunk is not implemented); gk [B, T, HV, K]; beta
    [B, T, HV]. The first reason not, or None."""
    if q.dim() != 4 or k.shape != q.shape:
        return f"q/k must be [B,T,H,K] of one shape; got {tuple(q.shape)} / {tuple(k.shape)}"
    B, T, H, K = q.shape
    if B * T == 0:
        return f"empty call (B={B}, T={T}): nothing to launch"
    if v.dim() != 4 or v.shape[:2] != (B, T):
        return f"v must be [B,T,HV,V]; got {tuple(v.shape)}"
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        return f"HV={HV} not a multiple of H={H}"
    if K not in supported_k:
        return f"K={K} (kernel built for K in {supported_k})"
    if V % BV:
        return f"V={V} not a multiple of {BV}"
    if T % BT:
        return f"T={T} not a multiple of the chunk {BT} (ragged last chunk not implemented)"
    if gk.shape != (B, T, HV, K):
        return f"gk must be [B,T,HV,K]; got {tuple(gk.shape)}"
    if beta.shape != (B, T, HV):
        return f"beta must be [B,T,HV]; got {tuple(beta.shape)}"
    return None


def dtype_reason(q, same, gk, beta, gk_dtypes=(torch.float32,)) -> str | None:
    """q in bf16 / fp16, the `same` ((name, tensor), ...) in q's dtype, gk (prep: the raw gate g)
    in gk_dtypes, beta bf16 / fp16 / fp32; or the first reason not."""
    if q.dtype not in IO:
        return f"q dtype {q.dtype} (bf16 or fp16 expected)"
    for name, t in same:
        if t.dtype != q.dtype:
            return f"{name} dtype {t.dtype} != q's {q.dtype}"
    if gk.dtype not in gk_dtypes:
        return f"gk must be {' / '.join(str(d).removeprefix('torch.') for d in gk_dtypes)}; got {gk.dtype}"
    if beta.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"beta dtype {beta.dtype} (bf16 / fp16 / fp32 expected)"
    return None


def row_reason(name: str, x) -> str | None:
    """x [B, T, H, K] in bf16 / fp16 with K % 32 == 0 and K <= 256, not empty (the per-row
    kernels: kda_cute.l2norm_fwd / l2norm_bwd, a warp per token); or the first reason not."""
    if x.dim() != 4:
        return f"{name} must be [B, T, H, K]; got {tuple(x.shape)}"
    if x.dtype not in IO:
        return f"{name} dtype {x.dtype} (bf16 or fp16 expected)"
    K = x.shape[3]
    if K % 32 or K > 256:
        return f"K={K} (kernel built for K % 32 == 0, K <= 256)"
    if x.numel() == 0:
        return "empty call: nothing to launch"
    return None


def rstd_reason(name: str, rstd, x) -> str | None:
    """rstd is the L2 norm's [B, T, H] fp32 rstd of x [B, T, H, K] (what l2norm_fwd saved; read by
    kda_cute.l2norm_bwd and kda_cute.bwd_chunk's L2-norm backward), or why not."""
    if tuple(rstd.shape) != tuple(x.shape[:3]) or rstd.dtype != torch.float32:
        return f"{name} must be {tuple(x.shape[:3])} float32; got {tuple(rstd.shape)} {rstd.dtype}"
    return None


def table_reason(table, device, NT: int | None = None) -> str | None:
    """A packed call's chunk table (kda_chain.varlen: int32 [NT, 2], per chunk of the padded row its
    first packed token and its valid rows; NT >= 1, or exactly NT where given), contiguous, on
    `device`; or why not. kda_cute.prep's and kda_cute.bwd_chunk's varlen builds read it."""
    if not isinstance(table, torch.Tensor) or table.dtype != torch.int32 or table.dim() != 2 \
            or table.shape[1] != 2 or table.shape[0] == 0 or NT not in (None, table.shape[0]):
        what = (f"{table.dtype} {tuple(table.shape)}" if isinstance(table, torch.Tensor)
                else type(table).__name__)
        want = "[NT, 2] with NT >= 1" if NT is None else f"[NT, 2] = {(NT, 2)}"
        return f"table must be int32 {want}; got {what}"
    if not table.is_contiguous():
        return "table is not contiguous"
    if table.device != device:
        return f"table on {table.device}, the inputs on {device}"
    return None


def layout_reason(names, tensors) -> str | None:
    """Every tensor contiguous, 16-byte aligned, on one device the kernel can use; or why not."""
    for name, t in zip(names, tensors, strict=True):
        if not t.is_contiguous():
            return f"{name} is not contiguous"
        if t.data_ptr() % 16:
            return f"{name} is not 16-byte aligned"
    if len({t.device for t in tensors}) != 1:
        return "tensors on different devices"
    return device_reason(tensors[0])


def compile_only(build, args, keep_ptx: bool):
    """`build(views, stream, options)` traced and compiled for `args` without a launch (CPU tests)."""
    import cuda.bindings.driver as cuda

    views = [cute_view(t, DYN) for t in args]
    return build(views, cuda.CUstream(0), "--keep-ptx" if keep_ptx else "")


def launch(cache, cfg, args, build) -> None:
    """One launch through the stage's call cache, compiled once per `cfg` (its frozen config)."""
    cache.launch(cfg, args, (DYN,) * len(args), build)


# ----------------------------------------------------------------------------------- device side
def gmem(t):
    """t (a DLPack view: generic address space) as a global-memory tensor (cp.async needs it)."""
    import cutlass.cute as cute

    ptr = cute.make_ptr(t.element_type, t.iterator.toint(), cute.AddressSpace.gmem, assumed_align=16)
    return cute.make_tensor(ptr, t.layout)


def swizzle_atom():
    """8 rows x 64 16-bit columns with the 128-byte swizzle (Swizzle<3,3,3>): ldmatrix reads of
    any 8 x 8 block are conflict-free; tile_to_shape it to the tile."""
    import cutlass.cute as cute

    return cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1)))


def cp_async_copies(io, threads: int):
    """cp.async tiled copies of 16 bytes per thread: (16-bit tiles, 8 per thread in rows of 64;
    fp32 tiles, 4 per thread in rows of 128)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import cpasync

    g2s = cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL)
    cp_io = cute.make_tiled_copy_tv(
        cute.make_copy_atom(g2s, io, num_bits_per_copy=128),
        cute.make_layout((threads // 8, 8), stride=(8, 1)),
        cute.make_layout((1, 8)),
    )
    cp_f32 = cute.make_tiled_copy_tv(
        cute.make_copy_atom(g2s, cutlass.Float32, num_bits_per_copy=128),
        cute.make_layout((threads // 32, 32), stride=(32, 1)),
        cute.make_layout((1, 4)),
    )
    return cp_io, cp_f32


def ldmatrix_atoms(io):
    """(ldmatrix x4, ldmatrix x4 .trans) copy atoms for 16-bit mma operands: the first for an
    operand whose K mode is contiguous in smem, the second for one whose M / N mode is."""
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import warp

    ld_n = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), io)
    ld_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), io)
    return ld_n, ld_t


def rows_async(cp, tS, tD, cD, nv):
    """A packed row's tile by cp.async, its pad rows never loaded (varlen builds): the thread's
    16-byte pieces (tS -> tD, cp's partition of a (64, n) tile; cD the same partition of its
    identity) whose row is < nv go by cp.async; a pad row's pieces (their addresses lie in the next
    sequence or past the packed row's end, any value there, NaN / Inf among them, would reach the
    valid rows) get +0 in smem by a plain store instead: the padded build's zero pad rows bit for
    bit. The caller orders that store before any reader (the barrier that ends the copy's wait) and
    after the tile's last reader."""
    return _rows_async()(cp, tS, tD, cD, nv)


@functools.cache
def _rows_async():
    import cutlass
    import cutlass.cute as cute

    @cute.jit
    def rows_async(cp, tS, tD, cD, nv):
        for m in cutlass.range_constexpr(cute.size(tS, mode=[1])):
            for n in cutlass.range_constexpr(cute.size(tS, mode=[2])):
                if cD[0, m, n][0] < nv:
                    cute.copy(cp, tS[None, m, n], tD[None, m, n])
                else:
                    tD[None, m, n].fill(0.0)

    return rows_async
