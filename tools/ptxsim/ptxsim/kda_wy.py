"""The launch harness of kda_cute_wy_dqkg (kda_cute.wy_dqkg) for the interpreter, and its inputs.

`emulate_wy_dqkg(text, args)` runs the kernel's PTX `text` on every CTA of its grid (T / 64, HV,
B), 512 threads each, through `ext_wy.WyCTA` (mma.sync m16n8k16, ldmatrix, cp.async), over one
emulated global memory holding the eleven inputs and the seven output slots, NaN-poisoned first;
it returns dq, dk, dv2, db, dg, dAkk (and dAqk with `want_dAqk`) read back, and without
`want_dAqk` asserts the dAqk slot (a poisoned buffer of its own here) stayed unwritten. Each
tensor parameter is the DSL's 24-byte slot: data pointer, the dynamic (B, T) (or (B, NT) for h /
dh) as two int32, the batch stride.
`wy_inputs(...)` makes random inputs of the contract's shapes and dtypes (never zeros: gates a
chunk-local log2 cumsum of negative steps, Akk unit lower triangular plus noise as the WY
inverse is, beta in (0, 1)). kda_cute is imported inside the functions only.
`emulate_bwd_chunk` runs kda_cute_bwd_chunk the same way, its varlen build (a chunk table) with
each packed-row output and the packed-row do between poisoned guard rows (`_run_guarded`).
"""

import torch

from .ext_wy import WyCTA, wy_program
from .launch import run_grid
from .memory import global_memory, readback

GUARD = 64  # rows of poison either side of a varlen build's packed-row outputs

THREADS = 512


def emulate_wy_dqkg(text, args, ctas=None, want_dAqk=False):
    """Run kda_cute_wy_dqkg's PTX on CPU for `args` = (q, k, v, v_new, gk, beta, Akk, h, do, dh,
    dv): returns (dq, dk, dv2, db, dg, dAkk), and dAqk with `want_dAqk` (the PTX compiled with
    it). `ctas`: the (chunk, hv, b) CTAs to run (default every one of the grid); the other
    chunks' outputs stay NaN."""
    from kda_cute import wy_dqkg

    q, v = args[0], args[2]
    B, T, HV, _ = v.shape
    prog = wy_program(text)
    outs = wy_dqkg._outputs(q, v, want_dAqk)
    for t in outs:
        t.fill_(float("nan"))
    if ctas is None:
        ctas = [(tx, hy, bz) for bz in range(B) for hy in range(HV) for tx in range(T // 64)]
    tensors = list(wy_dqkg._kernel_args(args, outs))
    if not want_dAqk:  # the launch passes dAkk's storage there; here a poisoned buffer of its own
        tensors[-1] = torch.full_like(outs[5], float("nan"))
    got = run_grid(prog, tensors, ctas, WyCTA, THREADS)[len(args):]
    if not want_dAqk:
        assert torch.isnan(got[-1]).all(), "dAqk's slot written without want_dAqk"
        return got[:6]
    return got


def wy_inputs(B=1, T=64, H=1, HV=1, K=128, V=64, dtype=torch.bfloat16, beta_dtype=None, gmin=-0.3, seed=0):
    """The eleven tensor arguments of bwd_wy_dqkg (q, k, v, v_new, gk, beta, Akk, h, do, dh, dv)
    at these extents, random and nonzero; gk a chunk-local cumsum of steps in (gmin, 0), log2."""
    g = torch.Generator().manual_seed(seed)

    def r(*s, sc=1.0):
        return torch.randn(*s, generator=g) * sc

    NT = (T + 63) // 64
    q = r(B, T, H, K, sc=K**-0.5 * 4).to(dtype)
    k = r(B, T, H, K, sc=K**-0.5 * 4).to(dtype)
    v = r(B, T, HV, V).to(dtype)
    v_new = r(B, T, HV, V).to(dtype)
    step = gmin * torch.rand(B, T, HV, K, generator=g)
    gk = torch.cat([c.cumsum(1) for c in step.split(64, dim=1)], 1) / 0.6931471805599453
    beta = torch.rand(B, T, HV, generator=g).to(beta_dtype or dtype)
    tri = torch.tril(torch.ones(64, 64), -1)
    A = torch.eye(64) + r(B, NT, HV, 64, 64, sc=0.2) * tri
    Akk = A.permute(0, 1, 3, 2, 4).reshape(B, NT * 64, HV, 64)[:, :T].contiguous().to(dtype)
    h = r(B, NT, HV, K, V, sc=0.3).to(dtype)
    dh = r(B, NT, HV, K, V, sc=0.3).to(dtype)
    do = r(B, T, HV, V).to(dtype)
    dv = r(B, T, HV, V).to(dtype)
    return [q, k, v, v_new, gk.contiguous(), beta, Akk, h, do, dh, dv]


def _poison(t, rows):
    """[1, rows, ...] of t's dtype: NaN, +Inf, -Inf in turn along the elements (any of them read
    into the arithmetic shows in every result it reaches)."""
    n = rows * t[0, 0].numel()
    vals = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=t.dtype)
    return vals.repeat((n + 2) // 3)[:n].view(1, rows, *t.shape[2:])


def _run_guarded(prog, tensors, guarded, ctas, prefetch_ok):
    """run_grid, but each tensor at an index of `guarded` ([1, R, ...]: a poisoned output, or the
    packed-row do) lies in memory between GUARD poisoned rows on either side (`_poison`; the kernel
    gets the pointer to its row 0 and its own extents); asserts every guard row's bytes came back
    unchanged (nothing written outside). A load from a guard row shows in the results it reaches."""
    laid = list(tensors)
    for i in guarded:
        t = tensors[i]
        pad = _poison(t, GUARD)
        laid[i] = torch.cat([pad, t, pad], 1)
    gmem, bases = global_memory(laid)
    params = {}
    for i, ((name, _size), t, base) in enumerate(zip(prog.params, tensors, bases, strict=True)):
        off = GUARD * t[0, 0].numel() * t.element_size() if i in guarded else 0
        params[(name, 0)] = base + off
        params[(name, 8)] = (t.shape[1] << 32) | t.shape[0]
        params[(name, 16)] = t.stride(0)
    for cta in ctas:
        WyCTA(prog, gmem, params, cta, ntid=THREADS, prefetch_ok=prefetch_ok(cta, bases)).run()
    got = [readback(gmem, t, base) for t, base in zip(laid, bases, strict=True)]
    for i in guarded:
        before, after = laid[i].view(torch.uint8), got[i].view(torch.uint8)
        R = tensors[i].shape[1]
        for lo, hi in ((0, GUARD), (GUARD + R, R + 2 * GUARD)):
            assert torch.equal(before[:, lo:hi], after[:, lo:hi]), f"tensor {i}: written outside its rows"
        got[i] = got[i][:, GUARD:GUARD + R].contiguous()
    return got


def emulate_bwd_chunk(text, args, emit_bf16=False, ctas=None, rstd=None, gate=None, table=None, T_raw=None,
                      qk_padded=False):
    """Run kda_cute_bwd_chunk's PTX (kda_cute.bwd_chunk: wy_dqkg's class with fused=True) on CPU
    for the same eleven `args` (and `rstd` = (q_rstd, k_rstd) for the l2norm build; `gate` = dict
    of bwd_chunk's g, A_log, dt_bias, lower_bound for the gate build): returns (dq, dk, dv2, db,
    dg), NaN-poisoned first, and with the gate also the per-chunk partials (dA_log [B, NT, HV],
    ddt_bias [B, NT, HV, K] or None) as the kernel wrote them. `ctas` as in emulate_wy_dqkg.
    With a chunk `table` (and T_raw: the varlen build, its PTX compiled with them) the five
    outputs are the packed row's [1, T_raw, ...], each laid between poisoned guard rows that must
    come back unchanged; its CTAs run by default in descending chunk order, so that a store past a
    chunk's valid rows (into the next sequence's) would land after that chunk's own and show. Its
    do (args[8]), v (args[2]), beta (args[5]) and with the gate the raw gate are the packed row's
    [1, T_raw, ...] too, each laid between poisoned guard rows (NaN / Inf: a load past the packed
    row's ends would show in the gradients); the padded row's extents are v_new's (args[3]).
    qk_padded (its PTX compiled with it too): dq, dk the padded row's [1, T, HV, K], between
    guard rows as well."""
    from kda_cute import bwd_chunk

    B, T, HV, _ = args[3].shape  # (v_new: the padded row's)
    prog = wy_program(text)
    gate = gate or {}
    _, outs, parts, tensors = bwd_chunk._prepare(*args[:11], 1.0, emit_bf16, *(rstd or (None, None)),
                                                 **gate, table=table, T_raw=T_raw, qk_padded=qk_padded)
    for t in (*outs, *(parts or ())):
        if t is not None:
            t.fill_(float("nan"))
    if ctas is None:
        ctas = [(tx, hy, bz) for bz in range(B) for hy in range(HV) for tx in range(T // 64)]
        if table is not None:
            ctas.sort(key=lambda c: -c[0])
    H = args[0].shape[2]

    def rows_of(tx, hy, bz, bases):
        """Byte ranges of this CTA's chunk rows in the tensors its row passes read (q_rstd, k_rstd
        [B, T, H] at head hy // G; the raw gate [B, T, HV, K] at hy): the only lines its L2
        prefetches may touch."""
        out = []
        for i, on in ((16, rstd is not None), (17, rstd is not None), (18, bool(gate))):
            if not on:
                continue
            t = tensors[i]
            heads = t.shape[2]
            head = hy // (HV // H) if heads == H and i < 18 else hy
            row = (t.shape[3] if t.dim() == 4 else 1) * t.element_size()
            rows, base = range(tx * 64, tx * 64 + 64), bases[i]
            if table is not None and i == 18:  # the raw gate: the packed row's, past its guard rows
                r0, nv = table[tx].tolist()
                rows, base = range(r0, r0 + nv), base + GUARD * t[0, 0].numel() * t.element_size()
            for r in rows:
                lo = base + ((bz * t.shape[1] + r) * heads + head) * row
                out.append((lo, lo + row))
        return out

    n = len(args)
    ok = lambda c, bases: rows_of(*c, bases)  # noqa: E731
    if table is None:
        got = run_grid(prog, list(tensors), ctas, WyCTA, THREADS, prefetch_ok=ok)
    else:
        packed_in = (2, 5, 8, *((18,) if gate else ()))  # v, beta, do, the raw gate
        got = _run_guarded(prog, tensors, (*packed_in, *range(n, n + 5)), ctas, ok)
    if parts is None:
        return got[n:n + 5]
    dbias = got[n + 11] if gate.get("dt_bias") is not None else None
    return (*got[n:n + 5], got[n + 10], dbias)
