"""kda_cute_l2norm_fwd: q / k's L2 norm on sm_90 (fla 0.6.0's `l2norm_fwd`, the chain's stage
`l2norm_fwd` with use_qk_l2norm_in_kernel).

Per row x of K values (one (token, head)): rstd = 1 / sqrt(sum x^2 + 1e-6) in fp32 (IEEE sqrt and
division), y = x rstd in x's dtype; both out (the backward reads y and rstd).

CTA decomposition: 256 threads = 8 warps, one token per warp, the warp walking the token's H heads
(H static: the row stride is an immediate); a lane holds K / 32 adjacent values, the sum is a
5-step butterfly. Grid (ceil(T / 8), B): a ragged T is a predicate, any T runs.

Why a kernel of ours: at the shapes people train at the chain is host-bound (bench/check_launch.py),
and fla's Triton launch costs ~80-100 us of host time per call against ~20-40 for a CuTe launch
on the TVM-FFI path; the device time is a copy's (read x, write y: 2 x 0.537 GB for q at the
reference shape B16 T8192 H16 K128 bf16, 0.27 ms at 4 TB/s).

Today (H200, 2026-12-02, the witness at that shape): 0.597 ms for q and k together against fla's
0.514 (0.86x: 3.6 TB/s; 8-byte loads per lane, docs/perf/l2norm.md has the next step).

Constraints: x [B, T, H, K] bf16 / fp16, K % 32 == 0 and K <= 256, contiguous, 16-byte aligned.
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
TOK = THREADS // 32  # tokens per CTA: one per warp
EPS = 1e-6  # fla's l2norm eps
_cache = CallCache("kda_cute_l2norm_fwd")


def _build_kernel_class():
    """Defined lazily so importing this module does not import the DSL (seconds)."""
    import cutlass
    import cutlass.cute as cute

    f32 = cutlass.Float32

    class _Kernel:
        def __init__(self, io_dtype, H: int, K: int):
            self.io_dtype = io_dtype
            self.H = H
            self.K = K

        @cute.jit
        def __call__(self, mX: cute.Tensor, mY: cute.Tensor, mR: cute.Tensor, stream):
            B = cute.size(mX, mode=[0])
            T = cute.size(mX, mode=[1])
            self.kda_cute_l2norm_fwd(mX, mY, mR).launch(grid=((T + TOK - 1) // TOK, B, 1),
                                                         block=[THREADS, 1, 1], stream=stream)

        @cute.kernel
        def kda_cute_l2norm_fwd(self, mX: cute.Tensor, mY: cute.Tensor, mR: cute.Tensor):
            KP = self.K // 32
            tidx, _, _ = cute.arch.thread_idx()
            bx, b, _ = cute.arch.block_idx()
            lane = tidx % 32
            t = bx * TOK + tidx // 32
            if t < cute.size(mX, mode=[1]):
                for h in cutlass.range_constexpr(self.H):
                    x = cute.local_tile(mX[b, t, h, None], (KP,), (lane,)).load().to(f32)
                    ss = f32(0.0)
                    for i in cutlass.range_constexpr(KP):
                        ss = ss + x[i] * x[i]
                    for off in (16, 8, 4, 2, 1):
                        ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=off)
                    r = 1.0 / cute.math.sqrt(ss + EPS)
                    cute.local_tile(mY[b, t, h, None], (KP,), (lane,)).store((x * r).to(self.io_dtype))
                    if lane == 0:
                        mR[b, t, h] = r

    return _Kernel


_kernel_class = functools.cache(_build_kernel_class)


# ----------------------------------------------------------------------------------- host side
@dataclass(frozen=True)
class L2Config:
    io_dtype: str
    H: int
    K: int
    arch: str


def _reason(x) -> str | None:
    return _warp.row_reason("x", x) or _warp.layout_reason(("x",), (x,))


def is_supported(x) -> str | None:
    """None when `l2norm_fwd` runs the CuTe kernel on x, else the reason it would not."""
    return _reason(x)


def _config(x) -> L2Config:
    return L2Config(DT[x.dtype], x.shape[2], x.shape[3], compile_arch())


def _outputs(x):
    return alloc(x.shape, x.dtype, x), alloc(x.shape[:3], torch.float32, x)


def _build(views, stream, cfg: L2Config, options: str = ""):
    import cutlass.cute as cute

    kern = _kernel_class()(cutlass_dtype(cfg.io_dtype), cfg.H, cfg.K)
    return cute.compile(kern, *views, stream, options=options)


def compile_for(x, keep_ptx=False):
    """Trace and compile for x without launching (the CPU compile test uses it)."""
    cfg = _config(x)
    return _warp.compile_only(lambda views, stream, opts: _build(views, stream, cfg, opts),
                              (x, *_outputs(x)), keep_ptx)


def l2norm_fwd(x):
    """-> (y, rstd): fla's l2norm_fwd. Raises ValueError on a call the kernel cannot compute."""
    reason = _reason(x)
    if reason is not None:
        raise ValueError(f"kda_cute.l2norm_fwd.l2norm_fwd: unsupported call: {reason}")
    return launch(x)


def launch(x):
    """`l2norm_fwd` without its checks: for a caller whose `is_supported` just said None."""
    y, rstd = _outputs(x)
    cfg = _config(x)
    _warp.launch(_cache, cfg, (x, y, rstd), lambda views, stream, opts: _build(views, stream, cfg, opts))
    return y, rstd
