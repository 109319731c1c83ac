"""kda_cute_bwd_prep: the backward's recompute of the forward's chunk factors on sm_90 (fla 0.6.0's
`kda_gate_chunk_cumsum` + `recompute_w_u_fwd`; the chain's stage `bwd_prep`).

Per chunk of BT = 64 tokens and value head hv, from the Akk the forward saved (kda_cute_prep's,
bf16 / fp16, zero above the diagonal):

    gk = cumsum(step gate) / ln 2 down the chunk      (the gate in the kernel, or g itself)
    w = Akk bf16(beta k exp2(g))    u = Akk bf16(beta v)    qg = q exp2(g)    kg = k exp2(gl - g)

bitwise what the forward's kda_cute_prep computed (same code, same roundings), so the backward
sees the forward's factors exactly, as fla's recompute does.

The kernel is kda_cute_prep's class compiled with `recompute=True` (kda_cute.prep's docstring has
the forward's layouts and phases), with a body of its own (`_recompute`) that keeps none of the
forward's q, k, g tiles: grid (T / 64, HV, B), 256 threads, 46 KB of smem (Akk's tile, a 2-stage
V ring, bf16(beta k E), the gate's row-group totals, beta) and 80 registers, so three CTAs share
an SM (the forward's body: 105 KB, two). Each thread owns the gate's rows 8 (t / 32) .. + 7 at
columns 4 (t % 32) .. + 3 and keeps their gk in registers (the forward's gate and cumsum code, or
the forward's gk by 16-byte loads); q, k come straight from global by 8-byte loads (four rows at a
time, the first four under the gate's barrier), kg and qg go out from registers; then the
forward's phase 4 (`_wu`: w and u on bf16 mma.sync with the Akk tile as the A operand). Akk and
the first two V tiles load by cp.async under the gate. Every value is the forward's expression in
its order, so w, u, qg, kg and gk equal the forward's bit for bit (the PTX interpreter checks
it). No Aqk, no L, no solve. This module is the stage's host side; the device code is in
kda_cute.prep's class (one class, two entry points, phase 4 shared), so the two cannot drift.

Bytes per call, B16 T8192 H=HV=16 K128 V256 bf16 (bf16 gate input, gate in the op):

    read    q, k 1.074 GB, g 0.537, v 1.074, beta 0.004, Akk 0.268             2.96 GB
    write   gk 1.074 GB, w, qg, kg 1.611, u 1.074                              3.76 GB
    total   6.72 GB: 1.68 ms at 4.0 TB/s (fla's gate cumsum + recompute_w_u: 0.42 + 1.80 ms)

Today (H100, 2026-12-08, commit f3677bd, bench/check_stage.py --stage bwd_prep, the chain's flags,
same run as fla): 3.128 ms vs fla's 2.792 at the reference shape (0.89x; 2.15 TB/s, DRAM 64%:
latency-bound, docs/perf/prep.md), 2.488 vs 2.399 at B16 T8192 H16 K=V=128 (0.96x), 0.185 vs 0.197
at B2 T4096 (1.06x); with the forward's gk given (fp32 log gate, no gate in the op, K=V=128): 2.236
ms against 2.801 recomputing it, fla's recompute_w_u alone 1.829 (its kernel runs nearer the
bandwidth). 1.005-1.08x the two-CTA body it replaced (H200 2026-12-03: 2.352 / 1.829 / 0.150 ms,
1.716 given gk). Every output's error vs float64 at or below fla's, bitwise repeatable.

With the forward's gk given (`gk=`: no gate in the op, where fla keeps gk for the backward too and
the chain does the same) each thread loads its rows of it into registers (16-byte loads, and gk's
last row for kg): no gate, no cumsum, no gk written (1.07 GB less at B16 T8192 H16 K128), the other
outputs bitwise the same (the forward wrote that gk); gk is returned as given.

Packed sequences (a chunk `table`, kda_chain.varlen's: the varlen build): v, beta and the raw gate
on fla's packed row [1, T_raw, ...] as the user gave them (beta after the op's sigmoid), read
through the table exactly as kda_cute_prep's varlen build reads them (a pad row's v and beta +0 in
smem, its gate the chain's pad value); q, k, Akk (and a given gk) on the padded row [1, 64 NT, ...]
where the forward wrote them; every output on the padded row, bitwise the plain build's on
pack_inputs' padded row. So the forward writes no padded copy of v, g or beta.

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


def _hard_reason(q, k, v, g, beta, A_log, dt_bias, Akk, use_gate_in_kernel, chunk_size, table=None,
                 lower_bound=None, gk=None) -> str | None:
    """kda_cute_prep's reasons, Akk's first (its shape, dtype and layout); with a table, the varlen
    build's (`_table_reason`) before them."""
    if chunk_size != BT:
        return f"chunk_size={chunk_size} (kernel built for {BT})"
    if table is not None:
        r = _table_reason(q, k, v, g, beta, Akk, table, gk, lower_bound, use_gate_in_kernel)
        if r:
            return r
    want = (*q.shape[:2], v.shape[2], BT)
    if tuple(Akk.shape) != want:
        return f"Akk shape {tuple(Akk.shape)} != {want}"
    if Akk.dtype != q.dtype:
        return f"Akk dtype {Akk.dtype} != q's {q.dtype}"
    return (_prep.call_reason(q, k, v, g, beta, A_log, dt_bias, use_gate_in_kernel, table)
            or _warp.layout_reason(("q", "Akk"), (q, Akk)))


def _table_reason(q, k, v, g, beta, Akk, table, gk, lower_bound, use_gate_in_kernel) -> str | None:
    """The varlen build's own reasons: the chunk table int32 [NT, 2] on the inputs' device; q, k,
    Akk (and a given gk) on the padded row [1, 64 NT, ...]; v, beta and the raw gate on one packed
    row [1, T_raw, ...]; not an fp16 g in the lower_bound form."""
    r = _warp.table_reason(table, q.device)
    if r:
        return r
    T = BT * table.shape[0]
    if q.dim() != 4 or tuple(q.shape[:2]) != (1, T):
        return f"varlen needs q on the padded row [1, {T}, H, K]; got {tuple(q.shape)}"
    if any(x.dim() < 2 or x.shape[:2] != q.shape[:2] for x in (k, Akk) + (() if gk is None else (gk,))):
        return f"q, k, Akk{'' if gk is None else ', gk'} must share the padded row [1, {T}, ...]"
    raw = (v, beta) if gk is not None else (v, g, beta)
    if any(x.dim() < 2 or x.shape[0] != 1 or x.shape[1] != v.shape[1] for x in raw):
        return "v, g, beta must share one packed row [1, T_raw, ...]"
    return _prep.lower_bound_fp16_reason(g, lower_bound, use_gate_in_kernel)


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
                 chunk_size=BT, gk=None, table=None) -> str | None:
    """None when `bwd_prep` runs the CuTe kernel on these arguments, else the reason it would not.
    g may be None when gk is given (`_g_or_gk`). `table`: the varlen build's chunk table (module
    docstring); its contents are trusted, not read."""
    if g is None and gk is None:
        return "g is None and no gk is given"
    g = _g_or_gk(g, gk)
    return (_hard_reason(q, k, v, g, beta, A_log, dt_bias, Akk, use_gate_in_kernel, chunk_size, table,
                         lower_bound, gk)
            or _gk_reason(g, gk, use_gate_in_kernel))


def _config(q, v, g, beta, dt_bias, lower_bound, use_gate_in_kernel, gk_in=False,
            varlen=False) -> _prep.PrepConfig:
    # the scale is Aqk's only: not compiled in
    return _prep._config(q, v, g, beta, dt_bias, lower_bound, use_gate_in_kernel, 1.0, True, recompute=True,
                         gk_in=gk_in, varlen=varlen)


def _outputs(q, v, gk=None):
    """gk (fp32; the given one as it is), then w, u, qg, kg in q's dtype, on q's rows (varlen: the
    padded row): fresh."""
    B, T = q.shape[:2]
    HV, V = v.shape[2:]
    K = q.shape[3]
    return (alloc((B, T, HV, K), torch.float32, q) if gk is None else gk, alloc((B, T, HV, K), q.dtype, q),
            alloc((B, T, HV, V), q.dtype, q), alloc((B, T, HV, K), q.dtype, q),
            alloc((B, T, HV, K), q.dtype, q))


def _kernel_args(q, k, v, g, beta, A_log, dt_bias, Akk, cfg, outs, table=None):
    """kda_cute_prep's tensors (`_prep._kernel_args`): Akk in its Akk slot (read) and in the Aqk
    slot (a stand-in of the right shape, never written); the table last (varlen)."""
    gk, w, u, qg, kg = outs
    return _prep._kernel_args(q, k, v, g, beta, A_log, dt_bias, cfg, (gk, w, u, qg, kg, Akk, Akk), table)


def _plan(q, k, v, g, beta, A_log, dt_bias, Akk, lower_bound, use_gate_in_kernel, gk, table):
    """(config, kernel arguments, outputs) of one call."""
    g = _g_or_gk(g, gk)
    outs = _outputs(q, v, gk)
    cfg = _config(q, v, g, beta, dt_bias, lower_bound, use_gate_in_kernel, gk is not None, table is not None)
    return cfg, _kernel_args(q, k, v, g, beta, A_log, dt_bias, Akk, cfg, outs, table), outs


def compile_for(q, k, v, g, beta, A_log, dt_bias, Akk, lower_bound, use_gate_in_kernel, keep_ptx=False,
                gk=None, table=None):
    """Trace and compile for these arguments without launching (the CPU compile test uses it)."""
    cfg, args, _ = _plan(q, k, v, g, beta, A_log, dt_bias, Akk, lower_bound, use_gate_in_kernel, gk, table)
    return _warp.compile_only(lambda views, stream, opts: _prep._build(views, stream, cfg, opts), args,
                              keep_ptx)


def bwd_prep(q, k, v, g, beta, A_log, dt_bias, Akk, lower_bound, use_gate_in_kernel, chunk_size=BT, gk=None,
             table=None):
    """fla's gate cumsum + recompute_w_u (chunk 64) in one kernel -> (gk, w, u, qg, kg), fresh
    outputs (gk: the given one, where given); with a chunk `table`, v, g, beta on the packed row
    (module docstring). Raises ValueError on a call the kernel cannot compute."""
    reason = is_supported(q, k, v, g, beta, A_log, dt_bias, Akk, lower_bound, use_gate_in_kernel, chunk_size,
                          gk, table)
    if reason is not None:
        raise ValueError(f"kda_cute.bwd_prep.bwd_prep: unsupported call: {reason}")
    return launch(q, k, v, g, beta, A_log, dt_bias, Akk, lower_bound, use_gate_in_kernel, chunk_size, gk,
                  table)


def launch(q, k, v, g, beta, A_log, dt_bias, Akk, lower_bound, use_gate_in_kernel, chunk_size=BT, gk=None,
           table=None):
    """`bwd_prep` without its checks: for a caller whose `is_supported` just said None."""
    cfg, args, outs = _plan(q, k, v, g, beta, A_log, dt_bias, Akk, lower_bound, use_gate_in_kernel, gk, table)
    _warp.launch(_cache, cfg, args, lambda views, stream, opts: _prep._build(views, stream, cfg, opts))
    return outs
