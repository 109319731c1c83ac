"""Launch harnesses of the KDA kernels (kda_cute's intra, b1, fwd, dhu) for the interpreter.

What a GPU launch would set up, done by hand for each kernel: the arguments in its order (data
pointers with their dynamic shapes and strides in the parameter slots, tensor maps described as
`tma.TensorMap`s for the TMA kernels: the host encodes those at launch, which a CPU cannot),
NaN-poisoned outputs in an emulated global memory, every CTA of the grid, and the outputs read
back. Each `emulate_*` compiles the kernel through `kda_cute.<stage>.compile_for(...)` (sm_90a:
set CUTE_DSL_ARCH) and interprets its PTX; kda_cute is imported inside the functions, so
`import ptxsim.kda` needs no CuTe DSL. Also the inputs the PTX tests and bench/cpu_emulate.py
share (`scan_inputs`, `q_and_aqk`, `upstream_do`).

The scans' checks, as the interpreter runs them, are of logic (indices, buffers, barrier phases,
the accumulator-to-A view, the waits), with operand reads as late as the hardware may make them
(see `hopper`): removing b1's store read wait before its named barrier gives h a 1.4 relative
error here. The scans also run packed (`chunks`: the int32 [2, N + 1] chunk table, offsets then walk order,
one CTA per (V tile, head, sequence), operands [1, T, ...]); their fp32 states (h0 / ht, dht / dh0) are
[B, ...] or with a table [N, ...] (the batch stride is static, so only their pointers and row
counts go in the params). Not modelled: tensor maps of layouts other than the ones below; the
intra kernel's launch beyond `ntid` = 256 (its block) and one CTA per (chunk, value head, batch).
"""

import torch

from .cta import CTA
from .hopper import run_grid
from .memory import global_memory, readback
from .program import InlineAsmProgram, Program, named_barriers
from .tma import TensorMap, param_address

ST4 = (True, False, True, False)  # static extents of a (feature, T, heads, B) view


def ptx_text(compiled) -> str:
    """The PTX kept on a compiled kernel (`keep_ptx`), as text; "" when the build kept none."""
    text = compiled.__ptx__
    if not isinstance(text, str):
        text = text.decode() if text is not None else ""
    return text


def emulate_intra(text, args, emit_bf16=False, ctas=None):
    """Run kda_cute_intra's PTX `text` on CPU, every CTA (or the (chunk, hv, b) CTAs `ctas`), for
    `args` (bwd_intra's ten tensors: q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg), and return dq, dk,
    db, dg read back from the emulated global memory (outputs NaN-poisoned first). Every L2
    prefetch must stay in its CTA's chunk rows."""
    from kda_cute import intra

    B, T, _, _ = args[0].shape
    HV = args[2].shape[2]
    prog = Program(text)
    outs = intra._outputs(args[0], args[2], args[3], emit_bf16)
    for t in outs:
        t.fill_(float("nan"))
    tensors = [*args, *outs]
    gmem, bases = global_memory(tensors)
    params = {}
    for (name, _size), t, base in zip(prog.params, tensors, bases, strict=True):
        params[(name, 0)] = base  # a tensor argument: data pointer, dynamic (B, T), B stride
        params[(name, 8)] = (T << 32) | B
        params[(name, 16)] = t.stride(0)
    gsize = HV // args[0].shape[2]

    def chunk_rows(tx, hy, bz):
        """Byte ranges of this CTA's chunk rows in q, k, g, dAqk, dAkk, dq, dk, dg: the only
        lines its L2 prefetches may touch."""
        out = []
        for i in (0, 1, 2, 4, 5, 6, 7, 9):
            t = tensors[i]
            head = hy // gsize if i < 2 else hy
            row = t.shape[3] * t.element_size()
            for r in range(tx * 64, tx * 64 + 64):
                lo = bases[i] + ((bz * T + r) * t.shape[2] + head) * row
                out.append((lo, lo + row))
        return out

    if ctas is None:
        ctas = [(tx, hy, bz) for bz in range(B) for hy in range(HV) for tx in range(T // 64)]
    for tx, hy, bz in ctas:
        CTA(prog, gmem, params, (tx, hy, bz), ntid=256, prefetch_ok=chunk_rows(tx, hy, bz)).run()
    return [readback(gmem, t, base) for t, base in zip(outs, bases[10:], strict=True)]


# ------------------------------------------------------------------------------- the three scans
def token_map(base, t, box_inner, swizzle=128, rows=64):
    """The tensor map of a [B, T, heads, X] tensor seen as (X, T, heads, B), box (inner, rows)."""
    B, T, Hh, X = t.shape
    e = t.element_size()
    return TensorMap(base, (X, T, Hh, B), (e, Hh * X * e, X * e, T * Hh * X * e), (box_inner, rows, 1, 1), e,
                     swizzle, ST4)


def state_map(base, t):
    """The tensor map of per-chunk states [B, NT, HV, K, V] seen as (V, K, HV, NT, B), box (64, 128):
    the h / dh stores."""
    B, NT, HV, K, V = t.shape
    e = t.element_size()
    return TensorMap(base, (V, K, HV, NT, B), (e, V * e, K * V * e, HV * K * V * e, NT * HV * K * V * e),
                     (64, 128, 1, 1, 1), e, 128, (True, True, True, False, False))


def state_params(prog, first, gk_base, T, B, HV, K, dummy_base, states=None, table=None):
    """The scans' tensor params after their tensor maps: mG (pointer, T and B as int32, B's
    stride), the two fp32 states (pointer, row count: `states` = ((base, rows), (base, rows)),
    default a dummy of 0 rows), then the chunk table (`table` = (base, 2 (N + 1)), flat; None: a
    fixed-length build, whose placeholder table is never read)."""
    names = [n for n, _ in prog.params]
    params = {(names[first], 0): gk_base, (names[first], 8): T | (B << 32), (names[first], 16): T * HV * K}
    for i, (base, rows) in zip((first + 1, first + 2), states or ((dummy_base, 0),) * 2, strict=True):
        params[(names[i], 0)] = base
        params[(names[i], 8)] = rows
    if table is not None:
        params[(names[first + 3], 0)], params[(names[first + 3], 8)] = table
    return params


def _layout(u, chunks):
    """(B, T, HV, V, NT, the grid's z = the state rows): B, or N sequences with a chunk table
    (then the operands are one packed row of whole chunks)."""
    B, T, HV, V = u.shape
    if chunks is not None:
        assert chunks.dtype == torch.int32 and B == 1 and T % 64 == 0
    return B, T, HV, V, (T + 63) // 64, B if chunks is None else chunks.shape[1] - 1


def _table(chunks):
    """The chunk-table kwarg of compile_for (none for a fixed-length call, so a candidate module
    from before the table still compiles) and the table laid out in gmem (a dummy without one)."""
    if chunks is None:
        return {}, torch.zeros(2, dtype=torch.int32)
    return {"chunks": chunks}, chunks.contiguous().view(-1)


def emulate_b1(kg, w, u, gk, stages, nwg, mod=None, h0=None, chunks=None):
    """Compile b1 for these CPU tensors (sm_90a), run its PTX on every CTA, return (h, v_new),
    and ht when h0 is given (then both states are real [rows, HV, K, V] tensors). `chunks`: the
    packed form (operands [1, T, ...], h0 / ht [N, ...], grid z = N). `mod`: the b1 module to
    compile (default kda_cute.b1; a candidate package's copy)."""
    if mod is None:
        from kda_cute import b1 as mod
    B, T, HV, V, NT, Z = _layout(u, chunks)
    K = kg.shape[3]
    state = h0 is not None
    kw, table = _table(chunks)
    text = ptx_text(mod.compile_for(kg, w, u, gk, h0, state, **kw, stages=stages, warpgroups=nwg))
    assert text, "no PTX on the compiled object"
    prog = named_barriers(InlineAsmProgram(text))
    h = torch.full((B, NT, HV, K, V), float("nan"), dtype=u.dtype)
    v_new = torch.full_like(u, float("nan"))
    ht = torch.full((Z, HV, K, V), float("nan"))
    dummy = torch.zeros(1, 1, 128, 64)
    h0t = h0 if state else dummy
    gmem, (bkg, bw, bu, bg, bd, bh, bv, b0, bt, bc) = global_memory(
        [kg, w, u, gk, dummy, h, v_new, h0t, ht, table])
    tmas = {  # kernel args: (atom, tma) pairs for w, kg, u, gd, then the h and v_new stores
        param_address(0): token_map(bw, w, 64),
        param_address(2): token_map(bkg, kg, 64),
        param_address(4): token_map(bu, u, 64),
        param_address(6): token_map(bg, gk, 128, swizzle=0, rows=1),
        param_address(8): state_map(bh, h),
        param_address(10): token_map(bv, v_new, 64),
    }
    states = ((b0, Z), (bt, Z)) if state else None
    ctab = None if chunks is None else (bc, 2 * (Z + 1))
    params = state_params(prog, 12, bg, T, B, HV, K, bd, states, ctab)
    run_grid(prog, gmem, params, tmas, (V // (64 * nwg), HV, Z), 128 * nwg)
    out = (readback(gmem, h, bh), readback(gmem, v_new, bv))
    return (*out, readback(gmem, ht, bt)) if state else out


def emulate_fwd(qg, kg, w, u, gk, Aqk, scale, stages, nwg, mod=None, h0=None, chunks=None, table=None,
                T_raw=None, guard=0):
    """Compile fwd, run its PTX on every CTA, return o, and ht when `h0` is given ([rows, HV, K,
    V]; `chunks`: packed, as emulate_b1's). Either form: the smem-operand kernel (tensor maps w,
    qg, kg, u, Aqk, then the o store) or the register-A one (gk's last row by TMA too, before
    the o store). `table`, `T_raw` (with chunks): the packed-o build, o [1, T_raw, HV, V] written
    through the chunk table (its pointer and [1, T_raw] shape again after the chunk table, then the
    table's); `guard` NaN rows laid out before and after o and returned with it (o [1, guard +
    T_raw + guard, HV, V]), so a store outside o's rows shows."""
    if mod is None:
        from kda_cute import fwd as mod
    B, T, HV, V, _, Z = _layout(u, chunks)
    K = kg.shape[3]
    state = h0 is not None
    kw, ctab = _table(chunks)
    if table is not None:
        kw.update(table=table, T_raw=T_raw)
    text = ptx_text(mod.compile_for(None, qg, kg, w, u, gk, Aqk, h0, state, scale, **kw, stages=stages,
                                    warpgroups=nwg))
    assert text, "no PTX on the compiled object"
    prog = named_barriers(InlineAsmProgram(text))
    rows = T if table is None else T_raw
    o_buf = torch.full((B, guard + rows + guard, HV, V), float("nan"), dtype=u.dtype)
    o = o_buf[:, guard:guard + rows]
    ht = torch.full((Z, HV, K, V), float("nan"))
    dummy = torch.zeros(1, 1, 128, 64)
    otab = table if table is not None else torch.zeros(2, dtype=torch.int32)
    gmem, (bq, bkg, bw, bu, bg, ba, bd, bob, b0, bt, bc, bot) = global_memory(
        [qg, kg, w, u, gk, Aqk, dummy, o_buf, h0 if state else dummy, ht, ctab, otab])
    bo = bob + guard * HV * V * u.element_size()
    tmas = {
        param_address(0): token_map(bw, w, 64),
        param_address(2): token_map(bq, qg, 64),
        param_address(4): token_map(bkg, kg, 64),
        param_address(6): token_map(bu, u, 64),
        param_address(8): token_map(ba, Aqk, 64),
    }
    n_maps = sum(1 for _, size in prog.params if size == "128")
    if n_maps == 7:  # register-A form
        tmas[param_address(10)] = token_map(bg, gk, 128, swizzle=0, rows=1)
    tmas[param_address(2 * n_maps - 2)] = token_map(bo, o, 64)
    states = ((b0, Z), (bt, Z)) if state else None
    params = state_params(prog, 2 * n_maps, bg, T, B, HV, K, bd, states,
                          None if chunks is None else (bc, 2 * (Z + 1)))
    if table is not None:  # o as a plain tensor (pointer, T_raw and B as int32, B's stride), the table
        names = [n for n, _ in prog.params]
        po, pt = names[2 * n_maps + 4], names[2 * n_maps + 5]
        params.update({(po, 0): bo, (po, 8): T_raw | (1 << 32), (po, 16): T_raw * HV * V,
                       (pt, 0): bot, (pt, 8): table.shape[0]})
    run_grid(prog, gmem, params, tmas, (V // (64 * nwg), HV, Z), 128 * nwg)
    o = readback(gmem, o_buf, bob) if guard else readback(gmem, o, bo)
    return (o, readback(gmem, ht, bt)) if state else o


def emulate_dhu(qg, kg, w, gk, do, Aqk, scale, stages, nwg, mod=None, dht=None, chunks=None, table=None):
    """dhu (the fused form: dv = tril(Aqk)^T do inside): tensor maps kg, qg, w, Aqk, do, then the
    dh and dv2 stores. Returns (dh, dv2), and dh0 when `dht` is given (then an h0 is passed too, so
    dh0 is written; both [rows, HV, K, V]). `chunks`: packed, as emulate_b1's (dht / dh0 [N, ...]).
    `table` (with chunks): the padded row's chunk table (int32 [T_pad / 64, 2]); do is then the
    packed row [1, T_raw, HV, V] (its tensor map of T_raw rows: TMA zero-fills past them), every
    other operand and dh, dv2 on the padded row of qg's T_pad; the table is the kernel's parameter
    after the chunks'."""
    if mod is None:
        from kda_cute import dhu as mod
    rows = do if table is None else torch.empty((1, qg.shape[1], *do.shape[2:]), device="meta")
    B, T, HV, V, NT, Z = _layout(rows, chunks)
    K = qg.shape[3]
    state = dht is not None
    h0 = torch.zeros(Z, HV, K, V) if state else None
    kw, ctab = _table(chunks)
    if table is not None:
        kw["table"] = table
    text = ptx_text(mod.compile_for(qg, kg, w, gk, h0, dht, do, None, scale, Aqk, **kw, stages=stages,
                                    warpgroups=nwg))
    assert text, "no PTX on the compiled object"
    prog = named_barriers(InlineAsmProgram(text))
    dh = torch.full((B, NT, HV, K, V), float("nan"), dtype=do.dtype)
    dv2 = torch.full((B, T, HV, V), float("nan"), dtype=do.dtype)
    dh0 = torch.full((Z, HV, K, V), float("nan"))
    dummy = torch.zeros(1, 1, 128, 64)
    gmem, (bq, bkg, bw, bg, bdo, ba, bd, bh, bv, bt, b0, bc, btab) = global_memory(
        [qg, kg, w, gk, do, Aqk, dummy, dh, dv2, dht if state else dummy, dh0, ctab,
         table if table is not None else torch.zeros(2, dtype=torch.int32)])
    tmas = {
        param_address(0): token_map(bkg, kg, 64),
        param_address(2): token_map(bq, qg, 64),
        param_address(4): token_map(bw, w, 64),
        param_address(6): token_map(ba, Aqk, 64),
        param_address(8): token_map(bdo, do, 64),
    }
    n_maps = sum(1 for _, size in prog.params if size == "128")
    tmas[param_address(2 * n_maps - 4)] = state_map(bh, dh)
    tmas[param_address(2 * n_maps - 2)] = token_map(bv, dv2, 64)
    states = ((bt, Z), (b0, Z)) if state else None  # dht, dh0
    params = state_params(prog, 2 * n_maps, bg, T, B, HV, K, bd, states,
                          None if chunks is None else (bc, 2 * (Z + 1)))
    if table is not None:  # (pointer, the dynamic NT)
        name = prog.params[2 * n_maps + 4][0]
        params[(name, 0)], params[(name, 8)] = btab, table.shape[0]
    run_grid(prog, gmem, params, tmas, (V // (64 * nwg), HV, Z), 128 * nwg)
    out = (readback(gmem, dh, bh), readback(gmem, dv2, bv))
    return (*out, readback(gmem, dh0, b0)) if state else out


# ------------------------------------------------------------------ inputs (tests, bench) share
def scan_inputs(B=1, T=96, H=1, HV=1, V=64, dtype=torch.bfloat16, seed=0):
    """kg, w, u, gk for the scans (K = 128): small random operands, gk a chunk-local cumsum of
    negative steps in log2 units, as the chain feeds it."""
    g = torch.Generator().manual_seed(seed)
    K = 128
    kg = (torch.randn(B, T, H, K, generator=g) * 0.1).to(dtype)
    w = (torch.randn(B, T, HV, K, generator=g) * 0.1).to(dtype)
    u = torch.randn(B, T, HV, V, generator=g).to(dtype)
    step = -0.3 * torch.rand(B, T, HV, K, generator=g)
    # chunk-local cumsum in log2 units, as the chain feeds it
    gk = torch.cat([c.cumsum(1) for c in step.split(64, dim=1)], 1) / 0.6931471805599453
    return kg, w, u, gk.contiguous()



def q_and_aqk(B, T, HV, gk, seed=1):
    """q gated into qg as fwd_intra stores it, and an Aqk whose upper triangle is garbage (the
    kernel must mask it)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, T, HV, 128, generator=g) * 0.1).to(torch.bfloat16)
    qg = (q.float() * torch.exp2(gk)).to(torch.bfloat16)
    Aqk = torch.randn(B, T, HV, 64, generator=g).to(torch.bfloat16)
    return q, qg, Aqk


def upstream_do(B, T, HV, V, g):
    """dhu's upstream gradient do (bf16, [B, T, HV, V]) from generator g."""
    return torch.randn(B, T, HV, V, generator=g).to(torch.bfloat16)

