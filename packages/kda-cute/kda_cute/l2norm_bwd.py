"""kda_cute_l2norm_bwd: the backward of q / k's L2 norm on sm_90 (fla 0.6.0's `l2norm_bwd`, the
chain's stage `l2norm_bwd` with use_qk_l2norm_in_kernel).

Per row (one (token, head)), from the forward's y and rstd and the incoming dy (y's dtype or fp32):
dx = rstd (dy - (dy . y) y), the dot in fp32, dx in y's dtype. With GVA (dy [B, T, HV, K] fp32,
HV = G H: the chunk-parallel backward's dq / dk per value head) the row's dy is first summed over its
group of G value heads h G .. h G + G - 1 in fp32, in head order (the stage gva_sum, folded in: its
fp32 [B, T, H, K] round trip and two launches per call are gone).

CTA decomposition: 256 threads = 8 warps, one token per warp, the warp walking the token's H heads
(H static: the row stride is an immediate); a lane holds K / 32 adjacent values, the sum is a
5-step butterfly. Grid (ceil(T / 8), B): a ragged T is a predicate, any T runs.

Why a kernel of ours: as kda_cute_l2norm_fwd's (host time per launch at the shapes people train
at); the device time is a copy's and a half (read y, dy, write dx). Today (H200, 2026-12-02, the
witness at B16 T8192 H16 K128 bf16): 0.762 ms for q and k together against fla's 0.730 (0.96x).

Constraints: y [B, T, H, K] bf16 / fp16, K % 32 == 0 and K <= 256, rstd [B, T, H] fp32, dy y's
shape in y's dtype or fp32, or [B, T, G H, K] fp32; contiguous, 16-byte aligned.
Validated on CPU by the PTX interpreter (tests/kda_cute/test_l2norm_compile.py) against float64.
"""

import functools
from dataclasses import dataclass

import torch

from . import _warp
from ._common.cache import CallCache, alloc
from ._common.lazy import cutlass_dtype
from ._common.support import compile_arch
from ._warp import DT

THREADS = 256
MAX_GROUP = 8  # GVA value heads summed per row (unrolled loads: more would be a loop's job)
TOK = THREADS // 32  # tokens per CTA: one per warp
_cache = CallCache("kda_cute_l2norm_bwd")


def _build_kernel_class():
    """Defined lazily so importing this module does not import the DSL (seconds)."""
    import cutlass
    import cutlass.cute as cute

    f32 = cutlass.Float32

    class _Kernel:
        def __init__(self, io_dtype, H: int, K: int, G: int):
            self.io_dtype = io_dtype
            self.H = H
            self.K = K
            self.G = G

        @cute.jit
        def __call__(self, mY: cute.Tensor, mR: cute.Tensor, mDy: cute.Tensor, mDx: cute.Tensor, stream):
            B = cute.size(mY, mode=[0])
            T = cute.size(mY, mode=[1])
            self.kda_cute_l2norm_bwd(mY, mR, mDy, mDx).launch(grid=((T + TOK - 1) // TOK, B, 1),
                                                               block=[THREADS, 1, 1], stream=stream)

        @cute.kernel
        def kda_cute_l2norm_bwd(self, mY: cute.Tensor, mR: cute.Tensor, mDy: cute.Tensor, mDx: cute.Tensor):
            KP = self.K // 32
            tidx, _, _ = cute.arch.thread_idx()
            bx, b, _ = cute.arch.block_idx()
            lane = tidx % 32
            t = bx * TOK + tidx // 32
            if t < cute.size(mY, mode=[1]):
                for h in cutlass.range_constexpr(self.H):
                    y = cute.local_tile(mY[b, t, h, None], (KP,), (lane,)).load().to(f32)
                    hv = h * self.G
                    dy = cute.local_tile(mDy[b, t, hv, None], (KP,), (lane,)).load().to(f32)
                    for j in cutlass.range_constexpr(1, self.G):  # GVA: the group's value heads
                        dy = dy + cute.local_tile(mDy[b, t, hv + j, None], (KP,), (lane,)).load().to(f32)
                    dot = f32(0.0)
                    for i in cutlass.range_constexpr(KP):
                        dot = dot + dy[i] * y[i]
                    for off in (16, 8, 4, 2, 1):
                        dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=off)
                    r = f32(mR[b, t, h])
                    dx = dy * r - y * (dot * r)
                    cute.local_tile(mDx[b, t, h, None], (KP,), (lane,)).store(dx.to(self.io_dtype))

    return _Kernel


_kernel_class = functools.cache(_build_kernel_class)


# ----------------------------------------------------------------------------------- host side
def _reason(y, rstd, dy) -> str | None:
    r = _warp.row_reason("y", y)
    if r is not None:
        return r
    r = _warp.rstd_reason("rstd", rstd, y)
    if r is not None:
        return r
    G = _group(y, dy)
    if G is None or dy.dtype not in ((y.dtype, torch.float32) if G == 1 else (torch.float32,)):
        return (f"dy must be y's shape in y's dtype or float32, or [B, T, G*H, K] float32; got "
                f"{tuple(dy.shape)} {dy.dtype}")
    if G > MAX_GROUP:
        return f"GVA group of {G} value heads (the kernel sums at most {MAX_GROUP})"
    return _warp.layout_reason(("y", "rstd", "dy"), (y, rstd, dy))


def _group(y, dy) -> int | None:
    """G: value heads per row head in dy (1 without GVA), None when dy's shape is not y's or its GVA
    form."""
    B, T, H, K = y.shape
    if dy.dim() != 4 or (dy.shape[0], dy.shape[1], dy.shape[3]) != (B, T, K) or dy.shape[2] % H:
        return None
    return dy.shape[2] // H


def is_supported(y, rstd, dy) -> str | None:
    """None when `l2norm_bwd` runs the CuTe kernel on these arguments, else the reason it would not."""
    return _reason(y, rstd, dy)


@dataclass(frozen=True)
class L2BwdConfig:
    io_dtype: str
    dy_dtype: str
    H: int
    K: int
    G: int
    arch: str


def _config(y, dy) -> L2BwdConfig:
    return L2BwdConfig(DT[y.dtype], DT[dy.dtype], y.shape[2], y.shape[3], dy.shape[2] // y.shape[2],
                       compile_arch())


def _build(views, stream, cfg: L2BwdConfig, options: str = ""):
    import cutlass.cute as cute

    kern = _kernel_class()(cutlass_dtype(cfg.io_dtype), cfg.H, cfg.K, cfg.G)
    return cute.compile(kern, *views, stream, options=options)


def compile_for(y, rstd, dy, keep_ptx=False):
    """Trace and compile for these arguments without launching (the CPU compile test uses it)."""
    cfg = _config(y, dy)
    dx = alloc(y.shape, y.dtype, y)
    return _warp.compile_only(lambda views, stream, opts: _build(views, stream, cfg, opts),
                              (y, rstd, dy, dx), keep_ptx)


def l2norm_bwd(y, rstd, dy):
    """-> dx: fla's l2norm_bwd (of gva_sum(dy) for dy's GVA form). Raises ValueError on a call the
    kernel cannot compute."""
    reason = _reason(y, rstd, dy)
    if reason is not None:
        raise ValueError(f"kda_cute.l2norm_bwd.l2norm_bwd: unsupported call: {reason}")
    return launch(y, rstd, dy)


def launch(y, rstd, dy):
    """`l2norm_bwd` without its checks: for a caller whose `is_supported` just said None."""
    dx = alloc(y.shape, y.dtype, y)
    cfg = _config(y, dy)
    _warp.launch(_cache, cfg, (y, rstd, dy, dx), lambda views, stream, opts: _build(views, stream, cfg, opts))
    return dx
