"""kda_cute_bwd_chunk: the whole chunk-parallel backward after the two scans on sm_90, one kernel
(fla 0.6.0's `chunk_kda_bwd_wy_dqkg_fused` + `chunk_kda_bwd_dAv`'s dA + `chunk_kda_bwd_intra` +
the reverse `chunk_local_cumsum` of dg; the chain's stage `bwd_chunk`).

Per chunk of BT = 64 tokens and value head hv, from the scans' h, dh, v_new, dv and the recomputed
factors (gk, Akk), every gradient of the chunk-parallel backward:

    the WY / state part (kda_cute.wy_dqkg's contract, with want_dAqk): dq, dk, dv2, db, dg,
        dAkk = the gradient through Akk, dAqk = scale tril(do v_new^T)
    the intra-chunk part (kda_cute.intra's contract, fold_dg): dq, dk, db, dg += the terms
        through Aqk and Akk; dg reverse-cumsummed within the chunk; dq / dk in q's dtype with
        emit_bf16 (HV == H), else fp32 (the chain sums them over the GVA group)
    with q_rstd, k_rstd (use_qk_l2norm_in_kernel, HV == H): dq, dk through the L2 norm's backward
        (fla's l2norm_bwd: dx = dy r - y (dy . y) r, y the normalized q / k this kernel reads), so
        they are the gradients of the raw q / k, in q's dtype; the walk leaves them in smem (fp32)
        and a row pass (4 rows per warp) finishes them

The kernel is kda_cute_wy_dqkg's class compiled with `fused=True` (kda_cute.wy_dqkg's docstring
has its CTA decomposition: 512 threads, the V walk in 64-wide tiles on bf16 mma.sync, the
epilogue's GEMMs), whose epilogue hands dq, dk, dg, dAqk, dAkk (fp32) and db to the intra walk
(kda_cute._intra_walk: a thread per key column, here 4 groups of 128 threads, one 16-row block
each) through smem instead of global memory. One region of 146.5 KB holds the V ring during the
walk over V, then the epilogue's tiles, then the walk's operands (wy_dqkg.R_*: the offsets); q, k
(rows padded to 136 elements, the walk's layout) and gk (136 floats) are loaded once and serve
both parts. ~219 KB of smem, one CTA per SM.

Bytes per call, B16 T8192 H=HV=16 K128 V256 bf16 (emit_bf16):

    read    q, k 1.074 GB, gk 1.074, v, v_new, do, dv 4.295, h, dh 4.295, Akk 0.268   11.01 GB
    write   dq, dk 1.074 GB, dg 1.074, dv2 1.074, db 0.008                              3.23 GB
    total   14.24 GB: 3.56 ms at 4.0 TB/s (kda_cute_wy_dqkg + kda_cute_intra: 16.39 + 8.61 GB)

What it removes: the fp32 dq, dk, dg, dAqk, dAkk that went out of wy_dqkg and back into intra
(10.7 GB of traffic at that shape), and with the rstds the two l2norm_bwd passes: three launches.

Today (H200, 2026-12-02, bench/check_stage.py --stage bwd_chunk, the chain's flags, same run):
7.954 ms at the reference shape (with l2norm_bwd) against our previous kda_cute_wy_dqkg +
kda_cute_intra + 2 x kda_cute_l2norm_bwd 9.264 (1.16x) and fla's kernels 29.937 (3.76x); 1.79 TB/s
of its 14.24 GB: not bandwidth-bound (one CTA per SM: the walk's latency has nothing beside it);
6.701 vs 7.973 / 27.234 at B16 T8192 H16 K=V=128 (1.19x / 4.06x), 0.466 vs 0.564 / 1.798 at B2
T4096 (1.21x / 3.86x). Every output's error vs float64 at or below fla's (dg 3.85e-4 vs 4.60e-4 at
the reference shape), bitwise repeatable (bench/results/bwd_chunk.md, docs/perf/bwd_chunk.md).

Constraints: kda_cute_wy_dqkg's (K = 128, V % 64 == 0, T % 64 == 0, HV % H == 0, dtypes, contiguous
and 16-byte aligned). This module is the stage's host side; the device code is wy_dqkg's class and
the shared intra walk, so neither part can drift from its standalone kernel.

Validated on CPU by the PTX interpreter (tests/kda_cute/test_bwd_chunk_compile.py) against
float64 and against the two standalone kernels' PTX.
"""

from __future__ import annotations

import dataclasses

import torch

from . import _warp
from . import wy_dqkg as _wy
from ._common.cache import CallCache, alloc

BT = _wy.BT
_cache = CallCache("kda_cute_bwd_chunk")


def _rstd_reason(q, v, q_rstd, k_rstd) -> str | None:
    if (q_rstd is None) != (k_rstd is None):
        return "q_rstd and k_rstd go together"
    if q_rstd is None:
        return None
    if v.shape[2] != q.shape[2]:
        return f"the L2 norm's backward inside needs HV == H (got HV={v.shape[2]}, H={q.shape[2]})"
    return (_warp.rstd_reason("q_rstd", q_rstd, q) or _warp.rstd_reason("k_rstd", k_rstd, q)
            or _warp.layout_reason(("q_rstd", "k_rstd"), (q_rstd, k_rstd)))


def is_supported(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, emit_bf16=False, q_rstd=None,
                 k_rstd=None) -> str | None:
    """None when `bwd_chunk` runs the CuTe kernel on these arguments, else the reason it would not."""
    return (_wy._hard_reason(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv)
            or _rstd_reason(q, v, q_rstd, k_rstd))


def _config(q, v, beta, scale, emit_bf16, l2norm) -> _wy.WyDqkgConfig:
    return dataclasses.replace(_wy._config(q, v, beta, scale, True), fused=True, emit_bf16=bool(emit_bf16),
                               l2norm=bool(l2norm))


def _outputs(q, v, emit_bf16, device, l2norm=False):
    """dq, dk (q's dtype with emit_bf16 or l2norm, else fp32), dv2, db, dg: fresh."""
    B, T, HV, V = v.shape
    K = q.shape[3]
    qk = q.dtype if emit_bf16 or l2norm else torch.float32
    return (
        alloc((B, T, HV, K), qk, device),  # dq
        alloc((B, T, HV, K), qk, device),  # dk
        alloc((B, T, HV, V), v.dtype, device),  # dv2
        alloc((B, T, HV), torch.float32, device),  # db
        alloc((B, T, HV, K), torch.float32, device),  # dg
    )


def _kernel_args(inputs, outs, q_rstd=None, k_rstd=None):
    """The class's eighteen tensors: the eleven inputs, dq, dk, dv2, db, dg, then q_rstd, k_rstd in
    the dAkk / dAqk slots (without them dg's storage stands in: never read)."""
    if q_rstd is None:
        q_rstd = k_rstd = outs[4]
    return (*inputs, *outs, q_rstd, k_rstd)


def compile_for(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, emit_bf16=False, q_rstd=None,
                k_rstd=None, keep_ptx=False):
    """Trace and compile for these arguments without launching (the CPU compile test uses it)."""
    l2 = q_rstd is not None
    cfg = _config(q, v, beta, scale, emit_bf16, l2)
    outs = _outputs(q, v, emit_bf16, q.device, l2)
    args = _kernel_args((q, k, v, v_new, gk, beta, Akk, h, do, dh, dv), outs, q_rstd, k_rstd)
    build = lambda views, stream, opts: _wy._build(views, stream, cfg, opts)  # noqa: E731
    return _warp.compile_only(build, args, keep_ptx)


def bwd_chunk(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, emit_bf16=False, q_rstd=None, k_rstd=None):
    """wy_dqkg (want_dAqk) then intra (fold_dg) in one kernel -> (dq, dk, dv2, db, dg); with q_rstd,
    k_rstd also l2norm_bwd of dq, dk. Fresh outputs."""
    reason = is_supported(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, emit_bf16, q_rstd, k_rstd)
    if reason is not None:
        raise ValueError(f"kda_cute.bwd_chunk.bwd_chunk: unsupported call: {reason}")
    return launch(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, emit_bf16, q_rstd, k_rstd)


def launch(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale, emit_bf16=False, q_rstd=None, k_rstd=None):
    """`bwd_chunk` without its checks: for a caller whose `is_supported` just said None (the
    chain's gate), so a host-bound step does not pay for them twice."""
    l2 = q_rstd is not None
    outs = _outputs(q, v, emit_bf16, q.device, l2)
    args = _kernel_args((q, k, v, v_new, gk, beta, Akk, h, do, dh, dv), outs, q_rstd, k_rstd)
    cfg = _config(q, v, beta, scale, emit_bf16, l2)
    _warp.launch(_cache, cfg, args, lambda views, stream, opts: _wy._build(views, stream, cfg, opts))
    return outs
