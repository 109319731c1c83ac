"""The three scans' sm_90a PTX (kda_cute_b1, kda_cute_fwd, kda_cute_dhu), run on CPU by a PTX
interpreter, compute their contracts against float64 (CI, no GPU).

The interpreter of `test_intra_compile` (one Python generator per thread) is extended here with
what the scans use: TMA tiles (cp.async.bulk.tensor with 128-byte swizzle, loads completing an
mbarrier's transaction count, stores), mbarriers (init, arrive, expect_tx, try_wait.parity as a
spin that yields), elect.sync, named barriers, and warpgroup MMAs (wgmma.mma_async m64nNk16, A
from registers or from a shared-memory descriptor, B from a descriptor, K- or MN-major, run as
a 128-thread collective). The tensor maps are built on the host at launch, which a CPU cannot do,
so the test describes each one itself (tensor, coordinate order, box, swizzle) from the kernel's
argument order. TMA loads run at issue (the earliest: a refill that lands on a stage still in
use corrupts it). TMA stores read their shared-memory source, and wgmma groups their registers
and shared memory, only when a wait_group lets them complete (the latest the hardware may), so
an operand overwritten before its wait gives wrong output (removing b1's store read wait before
the named barrier: h 1.4 relative error). So this checks the kernel's logic (indices, buffers,
barrier phases, the accumulator-to-A view, the waits), not every possible race.
"""

import re

import numpy as np
import pytest
import torch

pytest.importorskip("cutlass.cute")
b1 = pytest.importorskip("kda_cute.b1")
fwd = pytest.importorskip("kda_cute.fwd")
dhu = pytest.importorskip("kda_cute.dhu")
ti = pytest.importorskip("test_intra_compile")  # the base interpreter (same folder)
from kda_cute import reference as ref  # noqa: E402
from kda_cute.reference import stages as rstages  # noqa: E402

PARAM_BASE = 0x7F00_0000_0000  # fake addresses of kernel params (tensor maps)


class _ScanProgram(ti._Program):
    """The base parser, after two rewrites of the DSL's inline-asm blocks: braces dropped and
    their local labels (LAB_WAIT, DONE: one pair per block) made unique per block."""

    def __init__(self, ptx: str):
        head, body = ptx.split(".entry", 1)
        out, blk = [], 0
        opened = False
        for raw in body.split("\n"):
            line = raw.split("//")[0].strip()
            if line == "{":
                if opened:
                    blk += 1
                    continue
                opened = True  # the function body's own brace
            elif line == "}":
                continue
            elif blk:
                line = re.sub(r"\b(LAB_WAIT|DONE)\b", lambda m, b=blk: f"{m.group(1)}_{b}", line)
            out.append(line)
        super().__init__(head + ".entry" + "\n".join(out) + "\n}")


class _Tma:
    """One tensor map: a global tensor seen in coordinate order (innermost first)."""

    def __init__(self, base, dims, strides, box, elem, swizzle, static):
        self.base, self.dims, self.strides, self.box, self.elem, self.swizzle = (
            base, dims, strides, box, elem, swizzle)
        self.static = static  # per mode: an extent the compiler knows (the rest are B, T, NT)

    def cells(self, coords):
        """(smem byte offset in the box, gmem byte address or None when out of bounds). The DSL
        drops a tensor map's static size-1 modes (one head: no head coordinate); so does this."""
        keep = [not (st and d == 1) for st, d in zip(self.static, self.dims, strict=True)]
        if sum(keep) != len(self.dims) and sum(keep) == len(coords):
            pick = [i for i, k in enumerate(keep) if k]
        else:
            pick = list(range(len(self.dims)))
        dims = [self.dims[i] for i in pick]
        strides = [self.strides[i] for i in pick]
        box = [self.box[i] for i in pick]
        n = int(np.prod(box))
        for lin in range(n):
            idx, r = [], lin
            for b in box:
                idx.append(r % b)
                r //= b
            g = [c + i for c, i in zip(coords, idx, strict=True)]
            inb = all(0 <= x < d for x, d in zip(g, dims, strict=True))
            ga = self.base + sum(x * s for x, s in zip(g, strides, strict=True)) if inb else None
            yield lin * self.elem, ga


def _swz(addr: int, swizzle: int) -> int:
    if swizzle == 128:
        return addr ^ (((addr >> 7) & 7) << 4)
    return addr


class _ScanCTA(ti._CTA):
    def __init__(self, prog, gmem, params, ctaid, ntid, tmas):
        super().__init__(prog, gmem, params, ctaid, ntid=ntid, smem_bytes=232 * 1024)
        self.tmas = tmas  # param value -> _Tma
        for i, (name, _size) in enumerate(prog.params):
            self.symbols[name] = _P(i)
        self.mbar = {}  # smem address -> [count, pending, tx, phase]
        # TMA stores read their smem source as late as allowed: when the issuing thread's
        # cp.async.bulk.wait_group lets them complete, so a source overwritten before that wait
        # (a missing or misplaced wait) shows up as a wrong output
        self.stores = {}  # thread -> (open group, [committed groups, oldest first])
        self.mmas = {}  # the same for wgmma (per thread; a group runs as a warpgroup collective)

    # ---- mbarriers
    def _arrive(self, a, n=1, tx=0):
        m = self.mbar[a]
        m[2] += tx
        m[1] -= n
        self._maybe_flip(a)

    def _complete_tx(self, a, nbytes):
        m = self.mbar[a]
        m[2] -= nbytes
        self._maybe_flip(a)

    def _maybe_flip(self, a):
        m = self.mbar[a]
        if m[1] == 0 and m[2] == 0:
            m[3] += 1
            m[1] = m[0]

    # ---- TMA
    def _tma_load(self, tma, dst, coords):
        nbytes = 0
        for off, ga in tma.cells(coords):
            v = 0 if ga is None else self.load("global", ga, tma.elem)
            self.store("shared", _swz(dst + off, tma.swizzle), tma.elem, v)
            nbytes += tma.elem
        return nbytes

    def _tma_store(self, tma, src, coords):
        for off, ga in tma.cells(coords):
            if ga is not None:
                v = self.load("shared", _swz(src + off, tma.swizzle), tma.elem)
                self.store("global", ga, tma.elem, v)

    # ---- wgmma: D (64 x N) (+)= A (64 x 16, registers, bf16/fp16) @ B (16 x N, smem descriptor)
    def _b_tile(self, desc, n, trans, conv):
        start = (desc & 0x3FFF) << 4
        lbo = ((desc >> 16) & 0x3FFF) << 4
        sbo = ((desc >> 32) & 0x3FFF) << 4
        assert desc >> 62 == 1, "128-byte swizzle expected"
        B = np.zeros((16, n))
        for k in range(16):
            for j in range(n):
                if trans:  # MN-major: 64 N-elements per 128 B row, 8 k-rows per atom
                    a = start + (j // 64) * lbo + (k // 8) * sbo + (k % 8) * 128 + (j % 64) * 2
                else:  # K-major: a row of N index j holds its k elements
                    a = start + (j // 8) * sbo + (j % 8) * 128 + k * 2
                B[k, j] = conv(self.load("shared", _swz(a, 128), 2))
        return B

    def _complete_mmas(self, ts, keep: int):
        """Run this warpgroup's committed wgmma groups but the `keep` newest, oldest first,
        reading each thread's registers and shared memory now and writing D back."""
        done = [self.mmas.setdefault(t, ([], []))[1] for t in ts]
        while len(done[0]) > keep:
            groups = [d.pop(0) for d in done]
            for k in range(len(groups[0])):
                ins = [grp[k] for grp in groups]
                n, f16 = ins[0][7], ins[0][8]
                conv = ti.f16_to_f32 if f16 else ti.bf16_to_f32
                frags = []
                for R, a, d, desc, scale_d, trans, a_desc, _, _ in ins:
                    av = None if a is None else [R[r] for r in a]
                    dv = [R.get(r, 0xDEADBEEF) for r in d]
                    frags.append((av, dv, desc, scale_d, trans, a_desc))
                res = self.wgmma(frags, n, conv)
                for (R, _, d, *_rest), vals in zip(ins, res, strict=True):
                    for r, v in zip(d, vals, strict=True):
                        R[r] = v

    def wgmma(self, frags, n, conv):
        A = np.zeros((64, 16))
        D = np.zeros((64, n))
        desc, scale_d, trans, a_desc = frags[0][2], frags[0][3], frags[0][4], frags[0][5]
        if a_desc is not None:  # an A tile is addressed as a B tile of N = 64 (rows m for n)
            A = self._b_tile(a_desc[0], 64, a_desc[1], conv).T
        for t, (a, d, _, _, _, _) in enumerate(frags):
            w, lane = t // 32, t % 32
            g, q = lane // 4, lane % 4
            r0 = 16 * w + g
            slots = ((r0, 2 * q), (r0 + 8, 2 * q), (r0, 2 * q + 8), (r0 + 8, 2 * q + 8))
            for i, (rr, kk) in enumerate(slots if a is not None else ()):
                A[rr, kk] = conv(a[i] & 0xFFFF)
                A[rr, kk + 1] = conv(a[i] >> 16)
            for i, v in enumerate(d):
                jj, e = i // 4, i % 4
                D[r0 + 8 * (e // 2), 8 * jj + 2 * q + e % 2] = ti.b2f(v)
        B = self._b_tile(desc, n, trans, conv)
        out = (A @ B + (D if scale_d else 0)).astype(np.float32)
        res = []
        for t in range(128):
            w, lane = t // 32, t % 32
            g, q = lane // 4, lane % 4
            r0 = 16 * w + g
            res.append([ti.f2b(out[r0 + 8 * ((i % 4) // 2), 8 * (i // 4) + 2 * q + i % 2])
                        for i in range(n // 2)])
        return res

    # ---- the extra opcodes
    def other(self, op, parts, args, R, val, addr, tid):
        base = parts[0]
        if base == "fence":
            return
        if op.startswith("cp.async.bulk.commit"):
            open_, done = self.stores.setdefault(tid, ([], []))
            done.append(list(open_))
            open_.clear()
            return
        if op.startswith("cp.async.bulk.wait"):
            _, done = self.stores.setdefault(tid, ([], []))
            while len(done) > val(args[0]):
                for st in done.pop(0):
                    self._tma_store(*st)
            return
        if op == "kda.nbar":
            bid = val(args[0]) if args else 0
            cnt = val(args[1]) if len(args) > 1 else self.ntid
            yield ("nbar", bid, cnt)
            return
        if op == "elect.sync":
            r, p = args[0].split("|")
            got = yield ("elect",)
            R[r.strip()] = 0
            R[p.strip()] = got
            return
        if op == "cvt.rn.bf16x2.f32":
            hi = ti.f32_to_bf16(ti.b2f(val(args[1])))
            lo = ti.f32_to_bf16(ti.b2f(val(args[2])))
            R[args[0]] = (hi << 16) | lo
            return
        if op == "cvt.rn.f16x2.f32":
            hi = ti.f32_to_f16(ti.b2f(val(args[1])))
            lo = ti.f32_to_f16(ti.b2f(val(args[2])))
            R[args[0]] = (hi << 16) | lo
            return
        if base == "mbarrier":
            kind = parts[1]
            if kind == "init":
                c = val(args[1])
                self.mbar[addr(args[0])] = [c, c, 0, 0]
            elif kind == "arrive" and parts[2] == "expect_tx":
                self._arrive(addr(args[1]), 1, val(args[2]))
                R[args[0]] = 0
            elif kind == "arrive":
                self._arrive(addr(args[1]))
                R[args[0]] = 0
            elif kind == "try_wait":
                a, parity = addr(args[1]), val(args[2]) & 1
                while self.mbar[a][3] % 2 == parity:  # that phase has not completed yet
                    yield ("spin",)
                R[args[0]] = True
            else:
                raise NotImplementedError(op)
            return
        if op.startswith("cp.async.bulk.tensor"):
            if ".global.shared" in op:  # store: [tmap, {coords}], [src]
                inner = args[0].strip("[]")
                tm, coords = inner.split(",", 1)
                cs = [val(c.strip()) for c in coords.strip(" {}").split(",")]
                tma = self.tmas[val(tm.strip())]
                self.stores.setdefault(tid, ([], []))[0].append((tma, addr(args[1]), cs))
            else:  # load: [dst], [tmap, {coords}], [mbar](, policy)
                inner = args[1].strip("[]")
                tm, coords = inner.split(",", 1)
                cs = [val(c.strip()) for c in coords.strip(" {}").split(",")]
                n = self._tma_load(self.tmas[val(tm.strip())], addr(args[0]), cs)
                self._complete_tx(addr(args[2]), n)
            return
        if base == "wgmma":
            # issued into the thread's open group; executed, operands read then, when a
            # wait_group lets the group complete (the latest the hardware may read them)
            open_, done = self.mmas.setdefault(tid, ([], []))
            if parts[1] == "fence":
                return
            if parts[1] == "commit_group":
                done.append(list(open_))
                open_.clear()
                return
            if parts[1] == "wait_group":
                yield ("wgmma_wait", val(args[0]))
                return
            n = int(re.search(r"m64n(\d+)k16", op).group(1))
            d = [r.strip() for r in args[0].strip("{}").split(",")]
            scale_d = R[args[3]] if not args[3].isdigit() else bool(int(args[3]))
            f16 = op.endswith("f16.f16")
            if args[1].startswith("{"):  # A in registers: d, {a}, descB, p, sa, sb, tnspB
                a = [r.strip() for r in args[1].strip("{}").split(",")]
                open_.append((R, a, d, val(args[2]), scale_d, int(args[6]), None, n, f16))
            else:  # A in smem: d, descA, descB, p, sa, sb, tnspA, tnspB
                a_desc = (val(args[1]), int(args[6]))
                open_.append((R, None, d, val(args[2]), scale_d, int(args[7]), a_desc, n, f16))
            return
        raise NotImplementedError(f"{op} {args}")

    # ---- scheduler: a thread runs until it yields; collectives resolve once complete
    def run(self):
        threads = [self.thread(t) for t in range(self.ntid)]
        state = [None] * self.ntid
        alive = [True] * self.ntid
        for t in range(self.ntid):
            state[t] = self.resume(threads, t, None, alive)
        stall = 0
        while any(alive):
            progressed = False
            for w in range(self.ntid // 32):
                lanes = [t for t in range(32 * w, 32 * w + 32)]
                if not all(alive[t] for t in lanes):
                    continue
                kinds = {state[t][0] for t in lanes}
                if len(kinds) != 1:
                    continue
                kind = kinds.pop()
                if kind == "elect":
                    for i, t in enumerate(lanes):
                        state[t] = self.resume(threads, t, i == 0, alive)
                    progressed = True
                elif kind == "shfl":
                    vals = [state[t][1] for t in lanes]
                    for t in lanes:
                        _, _, mode, b, _c = state[t]
                        assert mode == "idx"
                        state[t] = self.resume(threads, t, vals[b % 32], alive)
                    progressed = True
            for g in range(self.ntid // 128):
                ts = list(range(128 * g, 128 * g + 128))
                if all(alive[t] and state[t][0] == "wgmma_wait" for t in ts):
                    self._complete_mmas(ts, state[ts[0]][1])
                    for t in ts:
                        state[t] = self.resume(threads, t, None, alive)
                    progressed = True
            # barriers (bar.sync id[, count]; id 0 without a count is the whole CTA)
            groups = {}
            for t in range(self.ntid):
                if alive[t] and state[t][0] == "nbar":
                    groups.setdefault(state[t][1], []).append(t)
            for ts in groups.values():
                if len(ts) == state[ts[0]][2]:
                    for t in ts:
                        state[t] = self.resume(threads, t, None, alive)
                    progressed = True
            for t in range(self.ntid):
                if alive[t] and state[t][0] == "spin":
                    before = self._snapshot()
                    state[t] = self.resume(threads, t, None, alive)
                    if state[t] is None or state[t][0] != "spin" or self._snapshot() != before:
                        progressed = True
            stall = 0 if progressed else stall + 1
            if stall > 2:
                raise RuntimeError("deadlock: " + str(sorted({s[0] for s in state if s})))
        pending = {t: (o, d) for t, (o, d) in self.stores.items() if o or any(d)}
        assert not pending, f"CTA {self.ctaid} exited with TMA stores not waited for: {sorted(pending)}"

    def _snapshot(self):
        return tuple((k, tuple(v)) for k, v in sorted(self.mbar.items()))


def _bar_patch(prog: _ScanProgram):
    """Every bar.sync becomes a private opcode (`other` yields it with its id and thread count):
    the base interpreter knows only CTA-wide barriers."""
    out = []
    for pred, op, args in prog.instrs:
        if op in ("bar.sync", "barrier.sync", "barrier.sync.aligned"):
            op = "kda.nbar"
        out.append((pred, op, args))
    prog.instrs = out
    return prog


ST4 = (True, False, True, False)  # static extents of a (feature, T, heads, B) view


def _tok(base, t, box_inner, swizzle=128, rows=64):
    """The tensor map of a [B, T, heads, X] tensor seen as (X, T, heads, B), box (inner, rows)."""
    B, T, Hh, X = t.shape
    e = t.element_size()
    return _Tma(base, (X, T, Hh, B), (e, Hh * X * e, X * e, T * Hh * X * e), (box_inner, rows, 1, 1), e,
                swizzle, ST4)


def _run(prog, gmem, params, tmas, grid, ntid):
    for bz in range(grid[2]):
        for hy in range(grid[1]):
            for bx in range(grid[0]):
                _ScanCTA(prog, gmem, params, (bx, hy, bz), ntid, tmas).run()


def _state_params(prog, first, gk_base, T, B, HV, K, dummy_base):
    """The scans' tensor params after their tensor maps: mG (pointer, T and B as int32, B's
    stride), then h0 / ht (pointers to a dummy: no state in these tests)."""
    names = [n for n, _ in prog.params]
    params = {(names[first], 0): gk_base, (names[first], 8): T | (B << 32), (names[first], 16): T * HV * K}
    for i in (first + 1, first + 2):
        params[(names[i], 0)] = dummy_base
        params[(names[i], 8)] = 0
    return params


def _emulate_b1(kg, w, u, gk, stages, nwg, mod=b1, h0=None):
    """Compile b1 for these CPU tensors (sm_90a), run its PTX on every CTA, return (h, v_new),
    and ht when h0 is given (then both states are real tensors; B = 1 only: their params'
    batch fields are not modelled)."""
    B, T, HV, V = u.shape
    K = kg.shape[3]
    NT = (T + 63) // 64
    state = h0 is not None
    assert not state or B == 1
    text = mod.compile_for(kg, w, u, gk, h0, state, stages=stages, warpgroups=nwg).__ptx__
    assert text, "no PTX on the compiled object"
    prog = _bar_patch(_ScanProgram(text))
    h = torch.full((B, NT, HV, K, V), float("nan"), dtype=u.dtype)
    v_new = torch.full_like(u, float("nan"))
    ht = torch.full((B, HV, K, V), float("nan"))
    dummy = torch.zeros(1, 1, 128, 64)
    h0t = h0 if state else dummy
    gmem, (bkg, bw, bu, bg, bd, bh, bv, b0, bt) = ti._gmem([kg, w, u, gk, dummy, h, v_new, h0t, ht])
    e = u.element_size()
    tmas = {  # kernel args: (atom, tma) pairs for w, kg, u, gd, then the h and v_new stores
        _P(0): _tok(bw, w, 64),
        _P(2): _tok(bkg, kg, 64),
        _P(4): _tok(bu, u, 64),
        _P(6): _tok(bg, gk, 128, swizzle=0, rows=1),
        _P(8): _Tma(bh, (V, K, HV, NT, B), (e, V * e, K * V * e, HV * K * V * e, NT * HV * K * V * e),
                    (64, 128, 1, 1, 1), e, 128, (True, True, True, False, False)),
        _P(10): _tok(bv, v_new, 64),
    }
    params = _state_params(prog, 12, bg, T, B, HV, K, bd)
    if state:
        names = [n for n, _ in prog.params]
        params[(names[13], 0)], params[(names[14], 0)] = b0, bt
    _run(prog, gmem, params, tmas, (V // (64 * nwg), HV, B), 128 * nwg)
    out = (ti._readback(gmem, h, bh), ti._readback(gmem, v_new, bv))
    return (*out, ti._readback(gmem, ht, bt)) if state else out


def _emulate_fwd(qg, kg, w, u, gk, Aqk, scale, stages, nwg, mod=None, h0=None):
    """Compile fwd, run its PTX on every CTA, return o, and ht when `h0` is given (B = 1 only:
    the state params' batch fields are not modelled). Either form: the smem-operand kernel
    (tensor maps w, qg, kg, u, Aqk, then the o store) or the register-A one (gk's last row by
    TMA too, before the o store)."""
    mod = mod or fwd
    B, T, HV, V = u.shape
    K = kg.shape[3]
    state = h0 is not None
    assert not state or B == 1
    text = mod.compile_for(None, qg, kg, w, u, gk, Aqk, h0, state, scale, stages=stages,
                           warpgroups=nwg).__ptx__
    assert text, "no PTX on the compiled object"
    prog = _bar_patch(_ScanProgram(text))
    o = torch.full_like(u, float("nan"))
    ht = torch.full((B, HV, K, V), float("nan"))
    dummy = torch.zeros(1, 1, 128, 64)
    gmem, (bq, bkg, bw, bu, bg, ba, bd, bo, b0, bt) = ti._gmem(
        [qg, kg, w, u, gk, Aqk, dummy, o, h0 if state else dummy, ht])
    tmas = {_P(0): _tok(bw, w, 64), _P(2): _tok(bq, qg, 64), _P(4): _tok(bkg, kg, 64),
            _P(6): _tok(bu, u, 64), _P(8): _tok(ba, Aqk, 64)}
    n_maps = sum(1 for _, size in prog.params if size == "128")
    if n_maps == 7:  # register-A form
        tmas[_P(10)] = _tok(bg, gk, 128, swizzle=0, rows=1)
    tmas[_P(2 * n_maps - 2)] = _tok(bo, o, 64)
    params = _state_params(prog, 2 * n_maps, bg, T, B, HV, K, bd)
    if state:
        names = [n for n, _ in prog.params]
        params[(names[2 * n_maps + 1], 0)], params[(names[2 * n_maps + 2], 0)] = b0, bt
    _run(prog, gmem, params, tmas, (V // (64 * nwg), HV, B), 128 * nwg)
    o = ti._readback(gmem, o, bo)
    return (o, ti._readback(gmem, ht, bt)) if state else o


def _emulate_dhu(qg, kg, w, gk, do, dv, scale, stages, nwg, mod=None, dht=None):
    """dhu: tensor maps kg, qg, w, do, dv, (in the register-A form: gk's last row,) then the dh
    and dv2 stores. Returns (dh, dv2), and dh0 when `dht` is given (then an h0 is passed too, so
    dh0 is written; B = 1 only: the state params' batch fields are not modelled)."""
    mod = mod or dhu
    B, T, HV, V = do.shape
    K = qg.shape[3]
    NT = (T + 63) // 64
    state = dht is not None
    assert not state or B == 1
    h0 = torch.zeros(B, HV, K, V) if state else None
    text = mod.compile_for(qg, kg, w, gk, h0, dht, do, dv, scale, stages=stages, warpgroups=nwg).__ptx__
    prog = _bar_patch(_ScanProgram(text))
    dh = torch.full((B, NT, HV, K, V), float("nan"), dtype=do.dtype)
    dv2 = torch.full_like(dv, float("nan"))
    dh0 = torch.full((B, HV, K, V), float("nan"))
    dummy = torch.zeros(1, 1, 128, 64)
    gmem, (bq, bkg, bw, bg, bdo, bdv, bd, bh, bv, bt, b0) = ti._gmem(
        [qg, kg, w, gk, do, dv, dummy, dh, dv2, dht if state else dummy, dh0])
    e = do.element_size()
    tmas = {
        _P(0): _tok(bkg, kg, 64), _P(2): _tok(bq, qg, 64), _P(4): _tok(bw, w, 64),
        _P(6): _tok(bdo, do, 64), _P(8): _tok(bdv, dv, 64),
    }
    n_maps = sum(1 for _, size in prog.params if size == "128")
    if n_maps == 8:  # register-A form
        tmas[_P(10)] = _tok(bg, gk, 128, swizzle=0, rows=1)
    tmas[_P(2 * n_maps - 4)] = _Tma(bh, (V, K, HV, NT, B),
                                    (e, V * e, K * V * e, HV * K * V * e, NT * HV * K * V * e),
                                    (64, 128, 1, 1, 1), e, 128, (True, True, True, False, False))
    tmas[_P(2 * n_maps - 2)] = _tok(bv, dv2, 64)
    params = _state_params(prog, 2 * n_maps, bg, T, B, HV, K, bd)  # then dht, dh0: bare pointers
    if state:
        names = [n for n, _ in prog.params]
        params[(names[2 * n_maps + 1], 0)], params[(names[2 * n_maps + 2], 0)] = bt, b0
    _run(prog, gmem, params, tmas, (V // (64 * nwg), HV, B), 128 * nwg)
    out = (ti._readback(gmem, dh, bh), ti._readback(gmem, dv2, bv))
    return (*out, ti._readback(gmem, dh0, b0)) if state else out


def _P(i):
    return PARAM_BASE + 0x1000 * i


def _inputs(B=1, T=96, H=1, HV=1, V=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    K = 128
    kg = (torch.randn(B, T, H, K, generator=g) * 0.1).to(dtype)
    w = (torch.randn(B, T, HV, K, generator=g) * 0.1).to(dtype)
    u = torch.randn(B, T, HV, V, generator=g).to(dtype)
    step = -0.3 * torch.rand(B, T, HV, K, generator=g)
    # chunk-local cumsum in log2 units, as the chain feeds it
    gk = torch.cat([c.cumsum(1) for c in step.split(64, dim=1)], 1) / 0.6931471805599453
    return kg, w, u, gk.contiguous()


@pytest.fixture
def sm90a(monkeypatch):
    """Compile for sm_90a (also on a GPU machine, whose default arch is its own)."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")


# (B, T, H, HV, V, stages, warpgroups): a full + a ragged chunk; GVA with two warpgroups and a
# four-chunk ragged T; one chunk at three stages; two sequences; the one-wave build (4 stages x 1
# warpgroup, `b1.variant` under one wave of SMs) over six ragged chunks, so the ring wraps. ~10 s
# each on one CPU core.
CASES = [
    (1, 96, 1, 1, 64, 2, 1),
    (1, 200, 1, 2, 128, 2, 2),
    (1, 64, 2, 2, 64, 3, 1),
    (2, 130, 1, 1, 128, 2, 2),
    (1, 330, 1, 1, 64, 4, 1),
]


@pytest.mark.parametrize("B, T, H, HV, V, stages, nwg", CASES)
def test_b1_ptx_computes_fwd_h(sm90a, B, T, H, HV, V, stages, nwg):
    """b1's sm_90a PTX, interpreted on CPU for every CTA: h and v_new match the float64
    reference to bf16 accuracy (measured 1.4e-3..2.7e-3; a wrong index, buffer or phase is O(1)
    off or leaves the NaN poison), every element written."""
    kg, w, u, gk = _inputs(B=B, T=T, H=H, HV=HV, V=V)
    h, v_new = _emulate_b1(kg, w, u, gk, stages, nwg)
    want_h, want_v, _ = rstages.fwd_h(kg.double(), w.double(), u.double(), gk.double(), None, False)
    _assert_matches((h, v_new), (want_h, want_v))


def _q_and_aqk(B, T, HV, gk, seed=1):
    """q gated into qg as fwd_intra stores it, and an Aqk whose upper triangle is garbage (the
    kernel must mask it)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, T, HV, 128, generator=g) * 0.1).to(torch.bfloat16)
    qg = (q.float() * torch.exp2(gk)).to(torch.bfloat16)
    Aqk = torch.randn(B, T, HV, 64, generator=g).to(torch.bfloat16)
    return q, qg, Aqk


def _do_dv(B, T, HV, V, g):
    """dhu's upstream gradients do, dv (bf16, [B, T, HV, V]) from generator g."""
    do = torch.randn(B, T, HV, V, generator=g).to(torch.bfloat16)
    dv = torch.randn(B, T, HV, V, generator=g).to(torch.bfloat16)
    return do, dv


def _assert_matches(got, want, tol=5e-3):
    """Every output finite (no NaN poison left) and within `tol` of its float64 reference."""
    for x, exp in zip(got, want, strict=True):
        assert torch.isfinite(x.float()).all()
        assert ref.rel_err(x.double(), exp) < tol, ref.rel_err(x.double(), exp)


@pytest.mark.parametrize("B, T, HV, V, stages, nwg", [(1, 96, 1, 64, 2, 1), (1, 200, 2, 128, 1, 2)])
def test_fwd_ptx_computes_fwd_scan(sm90a, B, T, HV, V, stages, nwg):
    """kda_cute_fwd's PTX (A operands from shared memory, both majors), interpreted: o matches
    float64 to bf16 accuracy (measured 2.0e-3 / 2.7e-3)."""
    kg, w, u, gk = _inputs(B=B, T=T, H=HV, HV=HV, V=V)
    q, qg, Aqk = _q_and_aqk(B, T, HV, gk)
    o = _emulate_fwd(qg, kg, w, u, gk, Aqk, 0.088, stages, nwg)
    want, _ = rstages.fwd_scan(q.double(), None, kg.double(), w.double(), u.double(), gk.double(),
                               Aqk.double(), None, False, 0.088)
    _assert_matches((o,), (want,))


@pytest.mark.parametrize("B, T, HV, V, stages, nwg", [(1, 96, 1, 64, 2, 1), (1, 200, 2, 128, 1, 2)])
def test_dhu_ptx_computes_bwd_dhu(sm90a, B, T, HV, V, stages, nwg):
    """kda_cute_dhu's PTX (the reverse scan), interpreted: dh and dv2 match float64 to bf16
    accuracy (measured 1.6e-3 / 2.7e-3)."""
    kg, w, u, gk = _inputs(B=B, T=T, H=HV, HV=HV, V=V)
    _, qg, _ = _q_and_aqk(B, T, HV, gk)
    do, dv = _do_dv(B, T, HV, V, torch.Generator().manual_seed(2))
    dh, dv2 = _emulate_dhu(qg, kg, w, gk, do, dv, 0.088, stages, nwg)
    want_dh, _, want_dv2 = rstages.bwd_dhu(qg.double(), kg.double(), w.double(), gk.double(), None, None,
                                           do.double(), dv.double(), 0.088)
    _assert_matches((dh, dv2), (want_dh, want_dv2))


@pytest.mark.parametrize("stages, nwg, V", [(2, 1, 64), (2, 2, 128)])
def test_fwd_ptx_with_initial_and_final_state(sm90a, stages, nwg, V):
    """fwd with h0 read and ht written (fp32, through ld / st.global): o and ht match float64
    (T = 96, one and two warpgroups)."""
    kg, w, u, gk = _inputs(B=1, T=96, H=1, HV=1, V=V)
    q, qg, Aqk = _q_and_aqk(1, 96, 1, gk)
    h0 = torch.randn(1, 1, 128, V, generator=torch.Generator().manual_seed(5)) * 0.1
    o, ht = _emulate_fwd(qg, kg, w, u, gk, Aqk, 0.088, stages, nwg, h0=h0)
    want = rstages.fwd_scan(q.double(), None, kg.double(), w.double(), u.double(), gk.double(),
                            Aqk.double(), h0.double(), True, 0.088)
    _assert_matches((o, ht), want)


@pytest.mark.parametrize("stages, nwg, V", [(2, 1, 64), (2, 2, 128)])
def test_dhu_ptx_with_dht_and_dh0(sm90a, stages, nwg, V):
    """dhu with dht read and dh0 written (fp32, through ld / st.global): dh, dv2 and dh0 match
    float64 (T = 96, one and two warpgroups)."""
    kg, w, u, gk = _inputs(B=1, T=96, H=1, HV=1, V=V)
    _, qg, _ = _q_and_aqk(1, 96, 1, gk)
    g = torch.Generator().manual_seed(4)
    do, dv = _do_dv(1, 96, 1, V, g)
    dht = torch.randn(1, 1, 128, V, generator=g) * 0.1
    dh, dv2, dh0 = _emulate_dhu(qg, kg, w, gk, do, dv, 0.088, stages, nwg, dht=dht)
    h0 = torch.zeros(1, 1, 128, V, dtype=torch.float64)
    want = rstages.bwd_dhu(qg.double(), kg.double(), w.double(), gk.double(), h0, dht.double(),
                           do.double(), dv.double(), 0.088)
    _assert_matches((dh, dh0, dv2), want)


@pytest.mark.parametrize("stages, nwg, V", [(2, 1, 64), (2, 2, 128)])
def test_b1_ptx_with_initial_and_final_state(sm90a, stages, nwg, V):
    """b1 with h0 read and ht written (fp32, through ld / st.global): h, v_new and ht match
    float64 (T = 96, one and two warpgroups)."""
    kg, w, u, gk = _inputs(B=1, T=96, H=1, HV=1, V=V)
    h0 = torch.randn(1, 1, 128, V, generator=torch.Generator().manual_seed(3)) * 0.1
    h, v_new, ht = _emulate_b1(kg, w, u, gk, stages, nwg, h0=h0)
    want = rstages.fwd_h(kg.double(), w.double(), u.double(), gk.double(), h0.double(), True)
    _assert_matches((h, v_new, ht), want)
