"""The Ampere-style warp opcodes kda_cute_wy_dqkg uses, on top of the base `CTA`.

`WyCTA` is a `CTA` that also runs:
  * mma.sync.aligned.m16n8k16.row.col.f32.{bf16.bf16, f16.f16}.f32 (a warp collective; operands
    exact, the 16 products and the accumulator summed in float64 and rounded once to float32, as
    the base's tf32 mma: the hardware's accumulation order is not modelled);
  * ldmatrix.sync.aligned.m8n8.{x1, x2, x4}[.trans].shared.b16 (a warp collective: lane 8 i + r
    gives the address of row r of matrix i; lane l receives (row l / 4, columns 2 (l % 4), + 1)
    of each matrix, or of its transpose with .trans);
  * cp.async.{ca, cg}.shared.global [dst], [src], cp-size[, src-size] with commit_group /
    wait_group / wait_all: the destination is poisoned (0xFF bytes: NaN in every float format)
    at issue and the data lands when a wait_group of the issuing thread retires its group (the
    latest the hardware may), so a read before the wait, or a copy into a buffer still being
    read, shows as NaN; a thread that exits with copies in flight is an error;
  * the packed cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32 (first source in the upper half).
16-bit float negation (sign bits) is the base's, as is the NotImplementedError for any other
16-bit float arithmetic (add.bf16x2, fma.rn.bf16, ...).

`wy_program(ptx)` parses the PTX and renames the mma and ldmatrix opcodes to private ones
(`ptxsim.*`) so the base interpreter hands them to `WyCTA.other` rather than to its own handlers
(the base `mma` is the tf32 m16n8k8 and cannot tell the formats apart by its operands).

The scheduler is the base's (`CTA.run`: CTA-wide bar.sync, shfl.sync (bfly, idx), bar.warp.sync)
with these collectives added through `WyCTA.collective`, each completed once all 32 lanes of the
warp reached it; `WyCTA.run` then checks that no cp.async copy is left in flight. Not
modelled: named barriers, TMA / mbarriers (see `hopper`), timing, bank conflicts, the
cp.async L2 prefetch / cache hints, ldmatrix .b8 / m16n16 shapes, stmatrix.
"""

import numpy as np

from .cta import CTA, mma_m16n8
from .numerics import b2f, bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16
from .program import Program

MMA16 = "ptxsim.mma16"
LDSM = "ptxsim.ldsm"


def wy_program(ptx: str) -> Program:
    """Parse `ptx` (its first .entry) and give the opcodes `WyCTA` models their private names."""
    prog = Program(ptx)
    out = []
    for pred, op, args in prog.instrs:
        if op.startswith("mma.sync.aligned.m16n8k16.row.col.f32."):
            kind = op.split(".")[-3]  # bf16 / f16 (A's type)
            assert op.endswith(f".{kind}.{kind}.f32"), op
            op = f"{MMA16}.{kind}"
        elif op.startswith("ldmatrix.sync.aligned.m8n8."):
            parts = op.split(".")
            assert parts[-1] == "b16" and parts[-2] == "shared", op
            op = f"{LDSM}.{parts[4]}" + (".trans" if "trans" in parts else "")
        out.append((pred, op, args))
    prog.instrs = out
    return prog


def _half(kind):
    return bf16_to_f32 if kind == "bf16" else f16_to_f32


class WyCTA(CTA):
    """A CTA with the opcodes above (see the module docstring)."""

    def __init__(self, prog, gmem, params, ctaid, ntid=512, smem_bytes=228 * 1024, prefetch_ok=()):
        super().__init__(prog, gmem, params, ctaid, ntid=ntid, smem_bytes=smem_bytes, prefetch_ok=prefetch_ok)
        self.copies = {}  # thread -> [open group: [(dst, src, nbytes, srcbytes)], committed groups...]

    # ---- cp.async
    def _cp_land(self, group):
        for dst, src, nbytes, srcbytes in group:
            data = self.g[src:src + srcbytes] if srcbytes else b""
            if src + srcbytes > len(self.g):
                raise IndexError(f"cp.async source out of range: {src:#x}")
            self.s[dst:dst + nbytes] = bytes(data) + bytes(nbytes - srcbytes)

    def other(self, op, parts, args, R, val, addr, tid):
        if op.startswith(MMA16):
            kind = parts[-1]
            d = [r.strip() for r in args[0].strip("{}").split(",")]
            a = [val(r.strip()) for r in args[1].strip("{}").split(",")]
            b = [val(r.strip()) for r in args[2].strip("{}").split(",")]
            c = [val(r.strip()) for r in args[3].strip("{}").split(",")]
            res = yield ("mma16", (kind, a, b, c))
            for r, v in zip(d, res, strict=True):
                R[r] = v
        elif op.startswith(LDSM):
            n = int(parts[2][1:])
            trans = parts[-1] == "trans"
            d = [r.strip() for r in args[0].strip("{}").split(",")]
            assert len(d) == n, (op, args)
            res = yield ("ldsm", (n, trans, addr(args[1]) & 0xFFFFFFFF))
            for r, v in zip(d, res, strict=True):
                R[r] = v
        elif op in ("cvt.rn.bf16x2.f32", "cvt.rn.f16x2.f32"):
            cv = f32_to_bf16 if "bf16x2" in op else f32_to_f16
            hi, lo = cv(b2f(val(args[1]))), cv(b2f(val(args[2])))
            R[args[0]] = (hi << 16) | lo
        elif parts[0] == "cp" and parts[1] == "async":
            q = self.copies.setdefault(tid, [[]])
            if parts[2] in ("ca", "cg"):
                assert parts[3:5] == ["shared", "global"], op
                dst = addr(args[0]) & 0xFFFFFFFF
                src = addr(args[1])
                nbytes = val(args[2])
                srcbytes = val(args[3]) if len(args) > 3 else nbytes
                assert nbytes in (4, 8, 16) and 0 <= srcbytes <= nbytes, (op, args)
                assert dst % nbytes == 0 and src % nbytes == 0, f"cp.async misaligned: {dst:#x} {src:#x}"
                if dst + nbytes > len(self.s):
                    raise IndexError(f"cp.async destination out of range: {dst:#x}")
                self.s[dst:dst + nbytes] = b"\xff" * nbytes  # poison until the group lands
                q[0].append((dst, src, nbytes, srcbytes))
            elif parts[2] == "commit_group":
                q.append(q[0])
                q[0] = []
            elif parts[2] == "wait_group" or parts[2] == "wait_all":
                keep = val(args[0]) if parts[2] == "wait_group" else 0
                if parts[2] == "wait_all":  # also commits the open group
                    q.append(q[0])
                    q[0] = []
                while len(q) - 1 > keep:
                    self._cp_land(q.pop(1))
            else:
                raise NotImplementedError(f"{op} {args}")
        else:
            raise NotImplementedError(f"{op} {args}")
        return
        yield

    # ---- warp collectives
    def collective(self, kind, yields):
        if kind == "mma16":
            return self.mma16([y[1] for y in yields])
        if kind == "ldsm":
            return self.ldsm([y[1] for y in yields])
        return super().collective(kind, yields)

    @staticmethod
    def mma16(frags):
        kind = frags[0][0]
        h = _half(kind)
        A = np.zeros((16, 16))
        Bm = np.zeros((16, 8))
        for lane, (k2, a, b, _c) in enumerate(frags):
            assert k2 == kind
            g, t = lane // 4, lane % 4
            for i, (r, k0) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
                A[r, k0], A[r, k0 + 1] = h(a[i]), h(a[i] >> 16)
            for i, k0 in enumerate((2 * t, 2 * t + 8)):
                Bm[k0, g], Bm[k0 + 1, g] = h(b[i]), h(b[i] >> 16)
        return mma_m16n8(A, Bm, [f[3] for f in frags])

    def ldsm(self, reqs):
        n, trans = reqs[0][0], reqs[0][1]
        assert all(r[0] == n and r[1] == trans for r in reqs), "ldmatrix: lanes disagree on the shape"
        out = [[0] * n for _ in range(32)]
        for i in range(n):
            rows = [reqs[8 * i + r][2] for r in range(8)]
            for a in rows:
                assert a % 16 == 0, f"ldmatrix row address not 16-byte aligned: {a:#x}"
            M = [[self.load("shared", rows[r] + 2 * c, 2) for c in range(8)] for r in range(8)]
            for lane in range(32):
                r, c = lane // 4, 2 * (lane % 4)
                if trans:
                    lo, hi = M[c][r], M[c + 1][r]
                else:
                    lo, hi = M[r][c], M[r][c + 1]
                out[lane][i] = lo | (hi << 16)
        return out

    def run(self):
        super().run()
        for tid, q in self.copies.items():
            if q[0] or len(q) > 1:
                raise RuntimeError(f"thread {tid} exited with cp.async copies in flight")
