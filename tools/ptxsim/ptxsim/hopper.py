"""The Hopper extension of the base CTA: TMA, mbarriers, elect.sync, named barriers, wgmma.

`HopperCTA` interprets what sm_90a's warp-specialized pipelines use on top of `CTA`'s opcodes:
TMA tiles (cp.async.bulk.tensor with the 128-byte swizzle: loads complete an mbarrier's
transaction count, stores are committed and waited for by bulk groups), mbarriers (init, arrive,
arrive.expect_tx, try_wait.parity as a spin that yields), elect.sync (lane 0 of the full warp),
named barriers (bar.sync id, count: run `program.named_barriers` on the program first), the
packed cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32, and warpgroup MMAs (wgmma.mma_async m64nNk16, bf16
or fp16 into f32, A from registers or from a shared-memory descriptor, B from a descriptor, K- or
MN-major, 128-byte swizzle, run as a 128-thread collective). Tensor maps are described by the
launcher (`tma.TensorMap`, keyed by `tma.param_address(i)` of their kernel parameter).

When things happen: TMA loads run at issue (the earliest: a refill that lands on a stage still in
use corrupts it). TMA stores read their shared-memory source, and wgmma groups their registers
and shared memory, only when a wait_group lets them complete (the latest the hardware may), so an
operand overwritten before its wait gives wrong output. A CTA that exits with TMA stores not
waited for fails. So this checks a kernel's logic (indices, buffers, barrier phases, the
accumulator-to-A fragment view, the waits), not every possible race: threads still run one at a
time until they yield, and loads never arrive late.

Not modelled: clusters (multicast, distributed shared memory, cluster barriers), TMA reductions,
bulk prefetches and im2col, the 32- and 64-byte swizzles, wgmma with tf32 / fp8 / integer inputs,
its scale-a / scale-b negation operands, setmaxnreg (an error, as any unknown opcode), fences
(no-ops), mbarrier phase overflow and try_wait time limits. The scheduler (`HopperCTA.run`)
resolves elect, shfl.sync (idx mode only), named barriers, wgmma waits and mbarrier spins; the
base CTA's mma.sync, bar.warp.sync and CTA-wide bar (without `named_barriers`) are not resolved
there (a deadlock), and a plain prefetch fails its bounds check. `run_grid` runs every CTA of a
grid one after another on one emulated global memory.
"""

import re

import numpy as np

from .cta import CTA
from .numerics import b2f, bf16_to_f32, f2b, f16_to_f32, f32_to_bf16, f32_to_f16
from .program import NBAR
from .tma import param_address, swizzle


class HopperCTA(CTA):
    """A CTA with the Hopper opcodes; `tmas` maps a tensor-map parameter's address to its TensorMap."""

    def __init__(self, prog, gmem, params, ctaid, ntid, tmas, smem_bytes=232 * 1024):
        super().__init__(prog, gmem, params, ctaid, ntid=ntid, smem_bytes=smem_bytes)
        self.tmas = tmas  # param value -> TensorMap
        for i, (name, _size) in enumerate(prog.params):
            self.symbols[name] = param_address(i)
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
            self.store("shared", swizzle(dst + off, tma.swizzle), tma.elem, v)
            nbytes += tma.elem
        return nbytes

    def _tma_store(self, tma, src, coords):
        for off, ga in tma.cells(coords):
            if ga is not None:
                v = self.load("shared", swizzle(src + off, tma.swizzle), tma.elem)
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
                B[k, j] = conv(self.load("shared", swizzle(a, 128), 2))
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
                conv = f16_to_f32 if f16 else bf16_to_f32
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
                D[r0 + 8 * (e // 2), 8 * jj + 2 * q + e % 2] = b2f(v)
        B = self._b_tile(desc, n, trans, conv)
        out = (A @ B + (D if scale_d else 0)).astype(np.float32)
        res = []
        for t in range(128):
            w, lane = t // 32, t % 32
            g, q = lane // 4, lane % 4
            r0 = 16 * w + g
            res.append([f2b(out[r0 + 8 * ((i % 4) // 2), 8 * (i // 4) + 2 * q + i % 2])
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
        if op == NBAR:
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
            hi = f32_to_bf16(b2f(val(args[1])))
            lo = f32_to_bf16(b2f(val(args[2])))
            R[args[0]] = (hi << 16) | lo
            return
        if op == "cvt.rn.f16x2.f32":
            hi = f32_to_f16(b2f(val(args[1])))
            lo = f32_to_f16(b2f(val(args[2])))
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



def run_grid(prog, gmem, params, tmas, grid, ntid, cta=HopperCTA):
    """Every CTA of `grid` (x, y, z), x fastest, one after another, on the same global memory."""
    for bz in range(grid[2]):
        for hy in range(grid[1]):
            for bx in range(grid[0]):
                cta(prog, gmem, params, (bx, hy, bz), ntid, tmas).run()
