"""The base interpreter: one CTA of a kernel run on the CPU, thread by thread.

Each thread is a Python generator interpreting the PTX as a scalar program; registers (a dict
per thread) hold raw bit patterns as Python ints, float32 math goes through numpy (`numerics`).
Warp collectives (shfl.sync, bar.warp.sync, mma.sync m16n8k8 tf32) and bar.sync are yield points
the scheduler (`CTA.run`) completes once every participant has arrived; a warp that reaches a
collective with fewer than 32 live lanes, or with lanes at different collectives, is an error
(`RuntimeError("... diverged ...")`), and so is a CTA in which nothing can progress ("deadlock").
`CTA.collective(kind, yields)` completes one warp's collective: a subclass that yields kinds of
its own from `other` handles them there and passes the rest to the base (`ext_wy.WyCTA`).

Memory: one emulated global memory (a bytearray, the caller's: `memory.global_memory` lays
tensors out in it) and a per-CTA shared memory (`smem_bytes`, zero-filled; the dynamic shared
memory symbol `__dynamic_shmem__0` is address 0). Kernel parameters are read by `ld.param` from
`params`, a dict (param name, byte offset of its 8-byte slot) -> int that the launcher fills in;
`symbols` maps other PTX names to values (a subclass's parameter addresses). Unset `%r`, `%rd`,
`%rs` registers read as 0xDEADBEEF (LLVM leaves some don't-care bytes undefined). `prefetch` has
no effect, but its address must lie in one of the `prefetch_ok` byte ranges (none by default).

Modelled: the integer, predicate, selection and branch opcodes, ld / st (param, global, shared;
vectors), float32 add / sub / mul / fma (round to nearest), min / max / neg / abs, setp.f32
(ordered, and unordered: leu etc. are true on NaN), neg .{bf16, f16, bf16x2, f16x2} (sign bits), the
bf16 / fp16 / tf32 conversions of `numerics`, prmt, dp2a, shfl.sync (bfly and idx), mma.sync m16n8k8
row.col f32.tf32.tf32.f32. Any other float-typed opcode of the integer families (add.bf16x2,
min.ftz.f32, setp.lt.f16, ...) raises NotImplementedError rather than running as integer arithmetic
on the bits. ex2.approx.ftz.f32 is modelled as exact exp2 with flush-to-zero (lg2.approx.ftz.f32 as exact
log2, div.rn.f32 / rcp.rn.f32 / sqrt.rn.f32 as IEEE; the hardware's ~2 ulp
error is not), the mma operands as tf32-truncated (their low 13 bits dropped) with a float64 sum
rounded once to float32 (the hardware's accumulation order is not modelled).
Not modelled: timing, caches, memory ordering between threads except at the collectives (a thread
runs until it yields, so a data race shows only if that order exposes it), bank conflicts,
out-of-range addresses beyond the emulated memories' ends (an IndexError), every opcode not
listed: `CTA.other` raises NotImplementedError for them, a subclass's hook (`HopperCTA`).
"""

import math
import re

import numpy as np

from .numerics import (
    F32,
    b2f,
    bf16_to_f32,
    f2b,
    f16_to_f32,
    f32_to_bf16,
    f32_to_f16,
    ftz,
    sext,
    tf32_rna,
)
from .program import Program

# float types: an opcode of the integer families (add, neg, min, setp, ...) with one of these
# suffixes is float arithmetic, modelled only where `CTA.thread` says so (never as integer math)
_FLOAT_TYPES = frozenset(("f16", "bf16", "f16x2", "bf16x2", "f32", "f64"))


def mma_m16n8(A, Bm, cs):
    """D = A Bm + C of an mma.sync m16n8 with a float32 accumulator: A (16 x k) and Bm (k x 8) the
    operands as float64, `cs` each lane's four C registers; the float64 sum is rounded once to
    float32. Returns each lane's four D registers (lane 4 g + t holds rows g, g + 8, columns 2 t,
    2 t + 1)."""
    C = np.zeros((16, 8))
    for lane, c in enumerate(cs):
        g, t = lane // 4, lane % 4
        C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1] = (b2f(x) for x in c)
    D = (A @ Bm + C).astype(np.float32)
    out = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        out.append([f2b(D[g, 2 * t]), f2b(D[g, 2 * t + 1]),
                    f2b(D[g + 8, 2 * t]), f2b(D[g + 8, 2 * t + 1])])
    return out


class CTA:
    """One CTA (block `ctaid`, `ntid` threads along x) of `prog` over the global memory `gmem`;
    `run()` interprets every thread to its exit."""

    def __init__(self, prog: Program, gmem: bytearray, params: dict, ctaid, ntid=256, smem_bytes=240 * 1024,
                 prefetch_ok=()):
        self.prefetch_ok = prefetch_ok  # byte ranges a prefetch may address
        self.p = prog
        self.g = gmem
        self.s = bytearray(smem_bytes)
        self.params = params  # (param name, byte offset) -> int
        self.ctaid = ctaid
        self.ntid = ntid
        self.symbols = {}  # PTX names that stand for a value (a subclass's kernel-param addresses)

    # ---- memory
    def mem(self, space):
        return self.s if space == "shared" else self.g

    def load(self, space, addr, nbytes):
        m = self.mem(space)
        addr &= 0xFFFFFFFF if space == "shared" else 0xFFFFFFFFFFFFFFFF
        if addr + nbytes > len(m):
            raise IndexError(f"{space} load out of range: {addr:#x}")
        return int.from_bytes(m[addr:addr + nbytes], "little")

    def store(self, space, addr, nbytes, val):
        m = self.mem(space)
        addr &= 0xFFFFFFFF if space == "shared" else 0xFFFFFFFFFFFFFFFF
        if addr + nbytes > len(m):
            raise IndexError(f"{space} store out of range: {addr:#x}")
        m[addr:addr + nbytes] = (val & ((1 << (8 * nbytes)) - 1)).to_bytes(nbytes, "little")

    def run(self):
        threads = [self.thread(t) for t in range(self.ntid)]
        state = [None] * self.ntid  # pending yield per thread
        alive = [True] * self.ntid
        # prime
        for t in range(self.ntid):
            state[t] = next(threads[t], None)
            if state[t] is None:
                alive[t] = False
        steps = 0
        while any(alive):
            steps += 1
            if steps > 10_000_000:
                raise RuntimeError("no progress")
            progressed = False
            # CTA barrier: all alive threads at bar
            if all((not alive[t]) or state[t][0] == "bar" for t in range(self.ntid)):
                for t in range(self.ntid):
                    if alive[t]:
                        state[t] = self.resume(threads, t, None, alive)
                continue
            for w in range(self.ntid // 32):
                lanes = range(32 * w, 32 * w + 32)
                live = [t for t in lanes if alive[t]]
                if not live:
                    continue
                kinds = {state[t][0] for t in live}
                if kinds == {"bar"}:
                    continue
                if len(kinds) != 1 or len(live) != 32:
                    raise RuntimeError(f"warp {w} diverged at a collective: {kinds}, {len(live)} live")
                outs = self.collective(kinds.pop(), [state[t] for t in lanes])
                for i, t in enumerate(lanes):
                    state[t] = self.resume(threads, t, outs[i], alive)
                progressed = True
            if not progressed and not all((not alive[t]) or state[t][0] == "bar" for t in range(self.ntid)):
                raise RuntimeError("deadlock")

    def resume(self, threads, t, val, alive):
        try:
            return threads[t].send(val)
        except StopIteration:
            alive[t] = False
            return None

    def collective(self, kind, yields):
        """Complete a warp collective: `yields` is what each of the warp's 32 lanes yielded (all of
        the one `kind`); returns what each lane's yield receives. A subclass handles its own kinds
        here and passes the rest on to this."""
        if kind == "shfl":
            vals = [y[1] for y in yields]
            outs = []
            for i, (_, _, mode, b, _c) in enumerate(yields):
                if mode == "bfly":
                    j = i ^ b
                elif mode == "idx":
                    j = b
                else:
                    raise NotImplementedError(mode)
                outs.append(vals[j] if j < 32 else vals[i])
            return outs
        if kind == "wsync":
            return [None] * 32
        if kind == "mma":
            return self.mma([y[1] for y in yields])
        raise NotImplementedError(kind)

    @staticmethod
    def mma(frags):
        # m16n8k8 tf32: a (4 regs), b (2), c (4); row.col
        A = np.zeros((16, 8))
        Bm = np.zeros((8, 8))

        def tf(b):
            return b2f(b & 0xFFFFE000)

        for lane, (a, b, _c) in enumerate(frags):
            g, t = lane // 4, lane % 4
            A[g, t], A[g + 8, t], A[g, t + 4], A[g + 8, t + 4] = (tf(x) for x in a)
            Bm[t, g], Bm[t + 4, g] = tf(b[0]), tf(b[1])
        return mma_m16n8(A, Bm, [c for _, _, c in frags])

    # ---- one thread
    def thread(self, tid):
        R = {}
        P = self.p
        instrs = P.instrs
        pc = 0
        n = len(instrs)

        def val(a):
            if a.startswith("%"):
                if a in R:
                    return R[a]
                if a == "%tid.x":
                    return tid
                if a in ("%tid.y", "%tid.z"):
                    return 0
                if a.startswith("%ctaid."):
                    return self.ctaid["xyz".index(a[-1])]
                if re.match(r"^%(r|rd|rs)\d+$", a):
                    return 0xDEADBEEF  # undef (LLVM leaves some don't-care bytes undefined)
                raise KeyError(a)
            if a.startswith("0f"):
                return int(a[2:], 16)
            if a.startswith("0d"):
                return int(a[2:], 16)
            if a.startswith("0x") or a.startswith("0X"):
                return int(a.rstrip("U"), 16)
            if a == "__dynamic_shmem__0":
                return 0
            if a in self.symbols:
                return self.symbols[a]
            return int(a.rstrip("U"))

        def addr(a):
            inner = a.strip("[]").strip()
            m = re.match(r"^([%\w]+)\s*(\+\s*-?\s*\d+|-\s*\d+)?$", inner)
            base = m.group(1)
            off = int(m.group(2).replace(" ", "").replace("+", "")) if m.group(2) else 0
            if base in R:
                return R[base] + off
            if base == "__dynamic_shmem__0":
                return off
            return ("param", base, off)

        def fv(a):
            return F32(b2f(val(a)))

        while pc < n:
            pred, op, args = instrs[pc]
            pc += 1
            if pred is not None:
                neg, pr = pred
                pv = R[pr]
                if neg:
                    pv = not pv
                if not pv:
                    continue
            parts = op.split(".")
            base = parts[0]
            if base == "ld" or base == "st":
                space = parts[1]
                if space == "param":  # 8-byte slots; a vector load ({B, T} as v2.u32) splits them
                    _, pname, off = addr(args[1])
                    nb = int(re.sub(r"\D", "", parts[-1])) // 8
                    for i, r in enumerate(x.strip() for x in args[0].strip("{}").split(",")):
                        o = off + i * nb
                        slot = self.params[(pname, o - o % 8)] >> (8 * (o % 8))
                        R[r] = slot & ((1 << (8 * nb)) - 1) if nb < 8 else slot
                    continue
                typ = parts[-1]
                nbytes = int(re.sub(r"\D", "", typ)) // 8
                if base == "ld":
                    ad = addr(args[1])
                    regs = [r.strip() for r in args[0].strip("{}").split(",")]
                    for i, r in enumerate(regs):
                        R[r] = self.load(space, ad + i * nbytes, nbytes)
                else:
                    ad = addr(args[0])
                    regs = [r.strip() for r in args[1].strip("{}").split(",")]
                    for i, r in enumerate(regs):
                        self.store(space, ad + i * nbytes, nbytes, val(r))
                continue
            if base == "mov":
                a1 = args[1]
                if a1.startswith("{"):
                    regs = [r.strip() for r in a1.strip("{}").split(",")]
                    w = 16 if regs[0].startswith("%rs") else 32
                    v = 0
                    for i, r in enumerate(regs):
                        v |= (val(r) & ((1 << w) - 1)) << (w * i)
                    R[args[0]] = v
                elif args[0].startswith("{"):
                    regs = [r.strip() for r in args[0].strip("{}").split(",")]
                    w = 16 if regs[0].startswith("%rs") else 32
                    v = val(a1)
                    for i, r in enumerate(regs):
                        R[r] = (v >> (w * i)) & ((1 << w) - 1)
                else:
                    R[args[0]] = val(a1)
            elif op == "not.pred":
                R[args[0]] = not R[args[1]]
            elif op in ("and.pred", "or.pred", "xor.pred"):
                x, y = bool(R[args[1]]), bool(R[args[2]])
                R[args[0]] = {"and": x and y, "or": x or y, "xor": x != y}[parts[0]]
            elif op in ("neg.f32", "abs.f32"):  # sign bit only (not the integer ops below)
                x = val(args[1]) & 0xFFFFFFFF
                R[args[0]] = x ^ 0x80000000 if op == "neg.f32" else x & 0x7FFFFFFF
            elif op in ("max.f32", "min.f32"):
                a_, b_ = fv(args[1]), fv(args[2])
                R[args[0]] = f2b(max(a_, b_) if op == "max.f32" else min(a_, b_))
            elif base == "cvta":
                R[args[0]] = val(args[1])
            elif op == "fma.rn.f32":
                x = np.float64(fv(args[1])) * np.float64(fv(args[2])) + np.float64(fv(args[3]))
                R[args[0]] = f2b(F32(x))
            elif op == "mul.f32" or op == "mul.rn.f32":
                R[args[0]] = f2b(fv(args[1]) * fv(args[2]))
            elif op == "add.f32" or op == "add.rn.f32":
                R[args[0]] = f2b(fv(args[1]) + fv(args[2]))
            elif op == "sub.f32" or op == "sub.rn.f32":
                R[args[0]] = f2b(fv(args[1]) - fv(args[2]))
            elif op == "ex2.approx.ftz.f32":
                x = ftz(fv(args[1]))
                with np.errstate(over="ignore", under="ignore"):
                    R[args[0]] = f2b(ftz(F32(np.exp2(np.float64(x)))))
            elif op == "lg2.approx.ftz.f32":  # as exact log2 (the hardware's ~2^-22 relative error)
                x = ftz(fv(args[1]))
                with np.errstate(divide="ignore", invalid="ignore"):
                    R[args[0]] = f2b(F32(np.log2(np.float64(x))))
            elif op in ("sqrt.rn.f32", "sqrt.approx.f32", "sqrt.approx.ftz.f32"):  # as IEEE sqrt
                with np.errstate(invalid="ignore"):
                    R[args[0]] = f2b(F32(np.sqrt(np.float64(fv(args[1])))))
            elif op == "rcp.rn.f32":  # IEEE reciprocal
                with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                    R[args[0]] = f2b(F32(1.0) / F32(fv(args[1])))
            elif op == "div.rn.f32":  # IEEE round-to-nearest division
                with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                    R[args[0]] = f2b(F32(fv(args[1])) / F32(fv(args[2])))
            elif op == "cvt.f32.bf16":
                R[args[0]] = f2b(bf16_to_f32(val(args[1])))
            elif op == "cvt.f32.f16":
                R[args[0]] = f2b(f16_to_f32(val(args[1])))
            elif op == "cvt.rn.bf16.f32":
                R[args[0]] = f32_to_bf16(b2f(val(args[1])))
            elif op == "cvt.rn.f16.f32":
                R[args[0]] = f32_to_f16(b2f(val(args[1])))
            elif op == "cvt.rna.tf32.f32":
                R[args[0]] = tf32_rna(b2f(val(args[1])))
            elif op in ("cvt.u64.u32",):
                R[args[0]] = val(args[1]) & 0xFFFFFFFF
            elif op == "cvt.s64.s32":
                R[args[0]] = sext(val(args[1]), 32) & 0xFFFFFFFFFFFFFFFF
            elif op == "cvt.u16.u32" or op == "cvt.u32.u16":
                R[args[0]] = val(args[1]) & 0xFFFF
            elif op == "cvt.u32.u64":
                R[args[0]] = val(args[1]) & 0xFFFFFFFF
            elif base in ("add", "sub", "mul", "mad", "shl", "shr", "and", "or", "xor", "not", "min", "max",
                          "div", "rem", "neg"):
                typ = parts[-1]
                if typ in _FLOAT_TYPES:  # float arithmetic the cases above do not cover: not integer
                    if op in ("neg.bf16", "neg.f16"):  # the sign bit
                        R[args[0]] = (val(args[1]) ^ 0x8000) & 0xFFFF
                    elif op in ("neg.bf16x2", "neg.f16x2"):  # the sign bit of both halves
                        R[args[0]] = (val(args[1]) ^ 0x80008000) & 0xFFFFFFFF
                    else:
                        raise NotImplementedError(f"{op} {args}")
                    continue
                bits = int(re.sub(r"\D", "", typ))
                signed = typ.startswith("s")
                mask = (1 << bits) - 1

                def iv(a, signed=signed, bits=bits):
                    v = val(a) & ((1 << bits) - 1)
                    return sext(v, bits) if signed else v

                if base == "mul" and parts[1] == "wide":
                    r = iv(args[1]) * iv(args[2])
                    R[args[0]] = r & ((1 << (2 * bits)) - 1)
                    continue
                if base == "mad" and parts[1] == "lo":
                    r = iv(args[1]) * iv(args[2]) + iv(args[3])
                elif base == "mad" and parts[1] == "wide":
                    r = iv(args[1]) * iv(args[2]) + (val(args[3]) & ((1 << (2 * bits)) - 1))
                    R[args[0]] = r & ((1 << (2 * bits)) - 1)
                    continue
                elif base == "mul":
                    if parts[1] == "hi":
                        r = (iv(args[1]) * iv(args[2])) >> bits
                    else:
                        r = iv(args[1]) * iv(args[2])
                elif base == "add":
                    r = iv(args[1]) + iv(args[2])
                elif base == "sub":
                    r = iv(args[1]) - iv(args[2])
                elif base == "shl":
                    r = iv(args[1]) << (val(args[2]) & 0xFFFFFFFF)
                elif base == "shr":
                    sh = val(args[2]) & 0xFFFFFFFF
                    r = iv(args[1]) >> min(sh, bits)
                elif base == "and":
                    r = val(args[1]) & val(args[2])
                elif base == "or":
                    r = val(args[1]) | val(args[2])
                elif base == "xor":
                    r = val(args[1]) ^ val(args[2])
                elif base == "not":
                    r = ~val(args[1])
                elif base == "neg":
                    r = -iv(args[1])
                elif base == "min":
                    r = min(iv(args[1]), iv(args[2]))
                elif base == "max":
                    r = max(iv(args[1]), iv(args[2]))
                elif base == "div":
                    a_, b_ = iv(args[1]), iv(args[2])
                    r = int(a_ / b_) if signed else a_ // b_
                elif base == "rem":
                    a_, b_ = iv(args[1]), iv(args[2])
                    r = a_ - int(a_ / b_) * b_ if signed else a_ % b_
                R[args[0]] = r & mask
            elif base == "setp":
                cmp, typ = parts[1], parts[2]
                if typ in _FLOAT_TYPES and typ != "f32":
                    raise NotImplementedError(f"{op} {args}")
                bits = int(re.sub(r"\D", "", typ))
                if typ == "f32":
                    a_, b_ = fv(args[1]), fv(args[2])
                else:
                    a_, b_ = val(args[1]) & ((1 << bits) - 1), val(args[2]) & ((1 << bits) - 1)
                    if typ.startswith("s"):
                        a_, b_ = sext(a_, bits), sext(b_, bits)
                ordered = {"eq": a_ == b_, "ne": a_ != b_, "lt": a_ < b_, "le": a_ <= b_, "gt": a_ > b_,
                           "ge": a_ >= b_}
                if cmp in ordered:
                    R[args[0]] = ordered[cmp]
                elif cmp[:-1] in ordered and cmp.endswith("u") and typ == "f32":
                    # unordered float compare (equ, neu, ltu, leu, gtu, geu): true if either is NaN
                    R[args[0]] = math.isnan(a_) or math.isnan(b_) or ordered[cmp[:-1]]
                else:
                    raise NotImplementedError(f"{op} {args}")
            elif base == "selp":
                R[args[0]] = val(args[1]) if R[args[3]] else val(args[2])
            elif base == "bra":
                pc = P.labels[args[0]]
            elif base == "ret" or base == "exit":
                return
            elif op == "prmt.b32":
                a_, b_, c_ = val(args[1]) & 0xFFFFFFFF, val(args[2]) & 0xFFFFFFFF, val(args[3]) & 0xFFFF
                src = a_.to_bytes(4, "little") + b_.to_bytes(4, "little")
                out = 0
                for i in range(4):
                    sel = (c_ >> (4 * i)) & 0xF
                    byte = src[sel & 7]
                    if sel & 8:
                        byte = 0xFF if byte & 0x80 else 0
                    out |= byte << (8 * i)
                R[args[0]] = out
            elif op == "dp2a.lo.u32.u32":
                a_, b_, c_ = val(args[1]) & 0xFFFFFFFF, val(args[2]) & 0xFFFFFFFF, val(args[3]) & 0xFFFFFFFF
                r = c_ + (a_ & 0xFFFF) * (b_ & 0xFF) + (a_ >> 16) * ((b_ >> 8) & 0xFF)
                R[args[0]] = r & 0xFFFFFFFF
            elif base == "shfl":
                mode = parts[2]
                v = val(args[1])
                got = yield ("shfl", v, mode, val(args[2]), val(args[3]))
                R[args[0]] = got
            elif base == "bar" and parts[1] == "warp":
                yield ("wsync",)
            elif base == "bar" or base == "barrier":
                yield ("bar",)
            elif base == "prefetch":  # a cache hint: no effect on the result, but in bounds
                ad = addr(args[0])
                assert any(lo <= ad < hi for lo, hi in self.prefetch_ok), f"prefetch off the chunk: {ad:#x}"
            elif base == "mma":
                d = [r.strip() for r in args[0].strip("{}").split(",")]
                a = [val(r.strip()) for r in args[1].strip("{}").split(",")]
                b = [val(r.strip()) for r in args[2].strip("{}").split(",")]
                c = [val(r.strip()) for r in args[3].strip("{}").split(",")]
                res = yield ("mma", (a, b, c))
                for r, v in zip(d, res, strict=True):
                    R[r] = v
            else:
                yield from self.other(op, parts, args, R, val, addr, tid)

    def other(self, op, parts, args, R, val, addr, tid):
        """Opcodes beyond the base set (a subclass's hook; a generator so it may yield collectives)."""
        raise NotImplementedError(f"{op} {args}")
        yield
