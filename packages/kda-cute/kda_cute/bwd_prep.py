"""kda_cute_bwd_prep: the backward's recompute of the forward's chunk factors on sm_90 (fla 0.6.0's
`kda_gate_chunk_cumsum` + `recompute_w_u_fwd`; the chain's stage `bwd_prep`).

Per chunk of BT = 64 tokens and value head hv, from the Akk the forward saved (kda_cute_prep's,
bf16 / fp16, zero above the diagonal):

    gk = cumsum(step gate) / ln 2 down the chunk      (the gate in the kernel, or g itself)
    w = Akk bf16(beta k exp2(g))    u = Akk bf16(beta v)    qg = q exp2(g)    kg = k exp2(gl - g)

bitwise what the forward's kda_cute_prep computed (same code, same roundings), so the backward
sees the forward's factors exactly, as fla's recompute does.

The kernel is kda_cute_prep's class compiled with `recompute=True` (kda_cute.prep's docstring has
the CTA decomposition, layouts and phases): phase 0 (q, k and Akk by cp.async, under them the gate
and its cumsum; gk, kg, qg out), then phases 3-4 without the solve (bf16(beta k E) over q, w and u
on bf16 mma.sync with the Akk tile as the A operand). No Aqk, no L, no X: about a third of the
forward kernel's instructions. This module is the stage's host side; the device code is shared
with kda_cute_prep by construction (one class, two entry points), so the two cannot drift.

Bytes per call, B16 T8192 H=HV=16 K128 V256 bf16 (bf16 gate input, gate in the op):

    read    q, k 1.074 GB, g 0.537, v 1.074, beta 0.004, Akk 0.268             2.96 GB
    write   gk 1.074 GB, w, qg, kg 1.611, u 1.074                              3.76 GB
    total   6.72 GB: 1.68 ms at 4.0 TB/s (fla's gate cumsum + recompute_w_u: 0.42 + 1.80 ms)

Today (H200, 2026-12-03, commit fecee71, bench/check_stage.py --stage bwd_prep, the chain's flags):
2.352 ms vs fla's 2.116 at the reference shape (0.90x, 2.9 TB/s: phase 0 waits on its loads,
docs/perf/prep.md), 1.829 vs 1.815 at B16 T8192 H16 K=V=128 (0.99x), 0.150 vs 0.193 at B2 T4096
(1.29x); with the forward's gk given (fp32 log gate, no gate in the op, K=V=128): 1.716 ms against
1.892 recomputing it, fla's recompute_w_u alone 1.394 (faster: its kernel runs nearer the
bandwidth). Every output's error vs float64 at or below fla's, bitwise repeatable.

With the forward's gk given (`gk=`: no gate in the op, where fla keeps gk for the backward too and
the chain does the same) phase 0 reads it into the g tile by cp.async with q, k and Akk: no gate,
no cumsum, no gk written (1.07 GB less at B16 T8192 H16 K128), the other outputs bitwise the same
(the forward wrote that gk); gk is returned as given.

Constraints: kda_cute_prep's (K = 128, V % 64 == 0, T % 64 == 0, HV % H == 0, dtypes, contiguous
and 16-byte aligned), and Akk [B, T, HV, 64] in q's dtype.

Validated on CPU by the PTX interpreter (tests/kda_cute/test_bwd_prep_compile.py) against float64.
"""

from __future__ import annotations

import torch

from . import _warp
from . import prep as _prep
from ._common.cache import CallCache, alloc

BT = _prep.BT
THREADS = _prep.THREADS
_cache = CallCache("kda_cute_bwd_prep")


def _hard_reason(q, k, v, g, beta, A_log, dt_bias, Akk, use_gate_in_kernel, chunk_size) -> str | None:
    """kda_cute_prep's reasons, Akk's first (its shape, dtype and layout)."""
    want = (*v.shape[:3], BT)
    if tuple(Akk.shape) != want:
        return f"Akk shape {tuple(Akk.shape)} != {want}"
    if Akk.dtype != q.dtype:
        return f"Akk dtype {Akk.dtype} != q's {q.dtype}"
    return (_prep._hard_reason(q, k, v, g, beta, A_log, dt_bias, use_gate_in_kernel, chunk_size)
            or _warp.layout_reason(("q", "Akk"), (q, Akk)))


def _gk_reason(g, gk, use_gate_in_kernel) -> str | None:
    """The given gk's reasons (None when not given)."""
    if gk is None:
        return None
    if use_gate_in_kernel:
        return "gk is given only without the gate in the op (it is then the forward's)"
    if tuple(gk.shape) != tuple(g.shape) or gk.dtype != torch.float32:
        return f"gk must be [B,T,HV,K] = {tuple(g.shape)} fp32; got {tuple(gk.shape)} {gk.dtype}"
    return _warp.layout_reason(("g", "gk"), (g, gk))


def _g_or_gk(g, gk):
    """g, or where it is None the given gk in its place: with gk given the kernel never reads g (a
    packed call's chain has no padded copy of a given log gate, only gk)."""
    if g is None and gk is None:
        raise ValueError("kda_cute.bwd_prep: g may be None only with gk given")
    return gk if g is None else g


def is_supported(q, k, v, g, beta, A_log, dt_bias, Akk, lower_bound, use_gate_in_kernel,
                 chunk_size=BT, gk=None) -> str | None:
    """None when `bwd_prep` runs the CuTe kernel on these arguments, else the reason it would not.
    g may be None when gk is given (`_g_or_gk`)."""
    if g is None and gk is None:
        return "g is None and no gk is given"
    g = _g_or_gk(g, gk)
    return (_hard_reason(q, k, v, g, beta, A_log, dt_bias, Akk, use_gate_in_kernel, chunk_size)
            or _gk_reason(g, gk, use_gate_in_kernel))


def _config(q, v, g, beta, dt_bias, lower_bound, use_gate_in_kernel, gk_in=False) -> _prep.PrepConfig:
    # the scale is Aqk's only: not compiled in
    return _prep._config(q, v, g, beta, dt_bias, lower_bound, use_gate_in_kernel, 1.0, True, recompute=True,
                         gk_in=gk_in)


def _outputs(q, v, gk=None):
    """gk (fp32; the given one as it is), then w, u, qg, kg in q's dtype: fresh."""
    B, T, HV, V = v.shape
    K = q.shape[3]
    return (alloc((B, T, HV, K), torch.float32, q) if gk is None else gk, alloc((B, T, HV, K), q.dtype, q),
            alloc((B, T, HV, V), q.dtype, q), alloc((B, T, HV, K), q.dtype, q),
            alloc((B, T, HV, K), q.dtype, q))


def _kernel_args(q, k, v, g, beta, A_log, dt_bias, Akk, cfg, outs):
    """kda_cute_prep's tensors (`_prep._kernel_args`): Akk in its Akk slot (read) and in the Aqk
    slot (a stand-in of the right shape, never written)."""
    gk, w, u, qg, kg = outs
    return _prep._kernel_args(q, k, v, g, beta, A_log, dt_bias, cfg, (gk, w, u, qg, kg, Akk, Akk))


def compile_for(q, k, v, g, beta, A_log, dt_bias, Akk, lower_bound, use_gate_in_kernel, keep_ptx=False,
                gk=None):
    """Trace and compile for these arguments without launching (the CPU compile test uses it)."""
    g = _g_or_gk(g, gk)
    cfg = _config(q, v, g, beta, dt_bias, lower_bound, use_gate_in_kernel, gk is not None)
    args = _kernel_args(q, k, v, g, beta, A_log, dt_bias, Akk, cfg, _outputs(q, v, gk))
    return _warp.compile_only(lambda views, stream, opts: _prep._build(views, stream, cfg, opts), args,
                              keep_ptx)


def bwd_prep(q, k, v, g, beta, A_log, dt_bias, Akk, lower_bound, use_gate_in_kernel, chunk_size=BT, gk=None):
    """fla's gate cumsum + recompute_w_u (chunk 64) in one kernel -> (gk, w, u, qg, kg), fresh
    outputs (gk: the given one, where given). Raises ValueError on a call the kernel cannot compute."""
    reason = is_supported(q, k, v, g, beta, A_log, dt_bias, Akk, lower_bound, use_gate_in_kernel, chunk_size,
                          gk)
    if reason is not None:
        raise ValueError(f"kda_cute.bwd_prep.bwd_prep: unsupported call: {reason}")
    return launch(q, k, v, g, beta, A_log, dt_bias, Akk, lower_bound, use_gate_in_kernel, chunk_size, gk)


def launch(q, k, v, g, beta, A_log, dt_bias, Akk, lower_bound, use_gate_in_kernel, chunk_size=BT, gk=None):
    """`bwd_prep` without its checks: for a caller whose `is_supported` just said None."""
    g = _g_or_gk(g, gk)
    outs = _outputs(q, v, gk)
    cfg = _config(q, v, g, beta, dt_bias, lower_bound, use_gate_in_kernel, gk is not None)
    args = _kernel_args(q, k, v, g, beta, A_log, dt_bias, Akk, cfg, outs)
    _warp.launch(_cache, cfg, args, lambda views, stream, opts: _prep._build(views, stream, cfg, opts))
    return outs
