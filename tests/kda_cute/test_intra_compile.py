"""kda_cute_intra compiles for sm_90a without a GPU, and is_supported gives reasons (CPU, CI)."""

import re
import struct

import numpy as np
import pytest
import torch

pytest.importorskip("cutlass.cute")
intra = pytest.importorskip("kda_cute.intra")


def _args(B=1, T=128, H=2, HV=2, K=128, dtype=torch.bfloat16):
    q = torch.randn(B, T, H, K).to(dtype)
    k = torch.randn(B, T, H, K).to(dtype)
    g = -torch.rand(B, T, HV, K)
    beta = torch.rand(B, T, HV).to(dtype)
    dA = [torch.randn(B, T, HV, 64) for _ in range(2)]
    dq, dk, dg = (torch.randn(B, T, HV, K) for _ in range(3))
    db = torch.randn(B, T, HV)
    return [q, k, g, beta, dA[0], dA[1], dq, dk, db, dg]


def _ptx(compiled):
    text = compiled.__ptx__
    if not isinstance(text, str):
        text = text.decode() if text is not None else ""
    if not text:
        pytest.skip("this DSL build keeps no PTX on the compiled object")
    return text


def _emulate_ptx(text, args, emit_bf16=False):
    """Run the compiled kernel's PTX on CPU (the interpreter below), every CTA, and return
    dq, dk, db, dg read back from the emulated global memory (outputs NaN-poisoned first)."""
    B, T, _, _ = args[0].shape
    HV = args[2].shape[2]
    prog = _Program(text)
    outs = intra._outputs(args[0], args[2], args[3], emit_bf16, "cpu")
    for t in outs:
        t.fill_(float("nan"))
    tensors = [*args, *outs]
    gmem, bases = _gmem(tensors)
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

    for bz in range(B):
        for hy in range(HV):
            for tx in range(T // 64):
                _CTA(prog, gmem, params, (tx, hy, bz), prefetch_ok=chunk_rows(tx, hy, bz)).run()
    return [_readback(gmem, t, base) for t, base in zip(outs, bases[10:], strict=True)]


def _gmem(tensors):
    """The tensors laid out in one emulated global memory: (bytearray, base address of each)."""
    gmem = bytearray(4096 + sum((t.numel() * t.element_size() + 4095) // 4096 * 4096 for t in tensors))
    bases, off = [], 4096
    for t in tensors:
        nb = t.numel() * t.element_size()
        bases.append(off)
        gmem[off:off + nb] = t.contiguous().view(torch.uint8).numpy().tobytes()
        off += (nb + 4095) // 4096 * 4096
    return gmem, bases


def _readback(gmem, t, base):
    """Tensor t's bytes back out of the emulated global memory."""
    raw = bytearray(gmem[base:base + t.numel() * t.element_size()])
    return torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype).view(t.shape).clone()


# tf32's unit roundoff (10 explicit mantissa bits): the cross sums' operands are rounded to it, so
# relative errors of ~1e-4 are expected (fla's tl.dot does the same); a wrong kernel is off by O(1).
TF32_EPS = 2.0**-11


def test_compiles_for_sm90a_and_the_ptx_computes_the_contract(monkeypatch):
    """The sm_90a PTX of the kernel (tf32 mma.sync cross sums), fold_dg on, executed by a PTX
    interpreter on CPU: dq, dk, db, dg match the float64 reference to tf32 accuracy; every
    output written."""
    ref = pytest.importorskip("kda_cute.reference")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    torch.manual_seed(0)
    a = _args(B=1, T=64, H=1, HV=1, K=128)
    a[2] = (-0.7 * torch.rand(1, 64, 1, 128)).cumsum(1) / 0.6931471805599453
    text = _ptx(intra.compile_for(*a, fold_dg=True, emit_bf16=False, keep_ptx=True))
    assert "kda_cute_intra" in text and "sm_90a" in text
    assert "ex2.approx" in text  # the exp2 fast path
    body = text.split(".entry", 1)[1]
    assert ".local" not in body, "register arrays fell to local memory"
    assert "ld.global.v4" in body or "ld.global.nc.v4" in body, "16-byte loads expected"
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in text
    # mma operands are rounded (half a tf32 ulp added to the bits), not truncated
    assert re.search(r"add\.s32\s+%r\d+, %r\d+, 4096;", text)
    assert re.search(r"prefetch(\.global)?\.L2", text)  # the walk's incoming rows
    got = _emulate_ptx(text, a)
    want = ref.bwd_intra(*[t.double() for t in a], fold_dg=True)
    for name, x, w in zip(("dq", "dk", "db", "dg"), got, want, strict=True):
        assert torch.isfinite(x).all(), f"{name}: unwritten (NaN) entries"
        assert ref.rel_err(x, w) < TF32_EPS, (name, ref.rel_err(x, w))


def test_emit_bf16_ptx_writes_the_cast_of_the_fp32_result(monkeypatch):
    """emit_bf16 (the chain's build when HV == H): its PTX, run by the interpreter, writes dq and
    dk equal bit for bit to the bf16 cast of the fp32 build's dq and dk, and the same db, dg."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    torch.manual_seed(2)
    a = _args(B=1, T=64, H=1, HV=1, K=128)
    a[2] = (-0.7 * torch.rand(1, 64, 1, 128)).cumsum(1) / 0.6931471805599453
    f32 = _emulate_ptx(_ptx(intra.compile_for(*a, fold_dg=True, keep_ptx=True)), a)
    text = _ptx(intra.compile_for(*a, fold_dg=True, emit_bf16=True, keep_ptx=True))
    got = _emulate_ptx(text, a, emit_bf16=True)
    for name, x, w in zip(("dq", "dk"), got[:2], f32[:2], strict=True):
        assert x.dtype == torch.bfloat16, name
        assert torch.equal(x, w.to(torch.bfloat16)), name
    for name, x, w in zip(("db", "dg"), got[2:], f32[2:], strict=True):
        assert torch.equal(x, w), name


def test_k64_gva_strong_gate_fp16(monkeypatch):
    """K = 64 (four thread groups), GVA, fp16 q / k, gates near -5 per step: the PTX runs in the
    interpreter and matches float64 to tf32 accuracy."""
    K = 64
    ref = pytest.importorskip("kda_cute.reference")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    torch.manual_seed(1)
    a = _args(B=1, T=64, H=1, HV=2 if K == 64 else 1, K=K, dtype=torch.float16)
    a[2] = (-5.0 * torch.rand(*a[2].shape)).cumsum(1) / 0.6931471805599453
    text = _ptx(intra.compile_for(*a, fold_dg=True, keep_ptx=True))
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in text
    # mma operands are rounded (half a tf32 ulp added to the bits), not truncated
    assert re.search(r"add\.s32\s+%r\d+, %r\d+, 4096;", text)
    assert re.search(r"prefetch(\.global)?\.L2", text)  # the walk's incoming rows
    got = _emulate_ptx(text, a)
    want = ref.bwd_intra(*[t.double() for t in a], fold_dg=True)
    for name, x, w in zip(("dq", "dk", "db", "dg"), got, want, strict=True):
        assert torch.isfinite(x).all(), f"{name}: unwritten (NaN) entries"
        assert ref.rel_err(x, w) < TF32_EPS, (name, ref.rel_err(x, w))


def test_is_supported_reasons_on_cpu():
    assert "CUDA" in intra.is_supported(*_args())  # no GPU here (or tensors on CPU)


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda a: a.__setitem__(0, a[0].float()), "dtype"),
        (lambda a: a.__setitem__(2, a[2][:, :, :, :64].contiguous()), "gk"),
        (lambda a: a.__setitem__(4, a[4][..., :32].contiguous()), "chunk"),
        (lambda a: a.__setitem__(9, a[9].transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
        (lambda a: a.__setitem__(6, a[6].double()), "float32"),
    ],
)
def test_is_supported_rejects(mutate, needle):
    a = _args()
    mutate(a)
    r = intra.is_supported(*a)
    assert r is not None and needle in r, r


def test_unsupported_shapes():
    assert "K=96" in intra.is_supported(*_args(K=96))
    assert "multiple of the chunk" in intra.is_supported(*_args(T=100))
    assert "HV=3" in intra.is_supported(*_args(H=2, HV=3))
    with pytest.raises(ValueError, match="K=96"):
        intra.bwd_intra(*_args(K=96))


def _emulate(q, k, g, beta, dAqk, dAkk, dq, dk, db, dg, fold_dg=False, dtype=torch.float64):
    """The kernel's exact decomposition in torch, vectorized over (chunk, head, column): per
    16-row block, the cross row side anchored at the block's first row, the cross column side
    anchored at its last row, the diagonal walked from the last row down with one exp2 per
    (r, s), the fold as the same descending running sum. Checks the algebra, not the DSL code."""
    B, T, H, K = q.shape
    HV = g.shape[2]
    G = HV // H

    def ch(x):  # [B, T, HV, X] -> [B*NT*HV... as (N, 64, X)]
        return x.to(dtype).view(B, T // 64, 64, HV, -1).permute(0, 1, 3, 2, 4).reshape(-1, 64, x.shape[-1])

    qq, kk = (ch(x.repeat_interleave(G, dim=2)) for x in (q, k))
    gg, aq, ak = ch(g), ch(dAqk), ch(dAkk)
    bb = ch(beta.unsqueeze(-1))[..., 0]
    dqi, dki, dgi, dbi = ch(dq), ch(dk), ch(dg), ch(db.unsqueeze(-1))[..., 0]
    N = gg.shape[0]
    oq, ok, og = (torch.zeros(N, 64, K, dtype=dtype) for _ in range(3))
    odb = dbi.clone()
    for i in range(4):
        r0 = 16 * i
        accq = torch.zeros(N, 16, K, dtype=dtype)
        acck = torch.zeros(N, 16, K, dtype=dtype)
        dkt = torch.zeros(N, 16, K, dtype=dtype)
        ga = gg[:, r0]
        if i > 0:
            kg = kk[:, :r0] * torch.exp2(ga[:, None] - gg[:, :r0])
            accq = torch.einsum("nrs,nsd->nrd", aq[:, r0:r0 + 16, :r0], kg)
            acck = torch.einsum("nrs,nsd->nrd", ak[:, r0:r0 + 16, :r0], kg)
            e = torch.exp2(gg[:, r0:r0 + 16] - ga[:, None])
            accq, acck = accq * e, acck * e
        gn = gg[:, r0 + 15]
        if i < 3:
            e = torch.exp2(gg[:, r0 + 16:] - gn[:, None])
            qb = qq[:, r0 + 16:] * e
            kbb = bb[:, r0 + 16:, None] * kk[:, r0 + 16:] * e
            dkt = (torch.einsum("nrs,nrd->nsd", aq[:, r0 + 16:, r0:r0 + 16], qb)
                   + torch.einsum("nrs,nrd->nsd", ak[:, r0 + 16:, r0:r0 + 16], kbb))
            dkt = dkt * torch.exp2(gn[:, None] - gg[:, r0:r0 + 16])
        for r in reversed(range(16)):
            row = r0 + r
            for s in range(r + 1):
                e = torch.exp2(gg[:, row] - gg[:, r0 + s]) if s < r else 1.0
                a1, a2 = aq[:, row, r0 + s, None], ak[:, row, r0 + s, None]
                t = kk[:, r0 + s] * e
                accq[:, r] += a1 * t
                acck[:, r] += a2 * t
                dkt[:, s] += (a1 * qq[:, row] + a2 * bb[:, row, None] * kk[:, row]) * e
            dk2 = acck[:, r] * bb[:, row, None]
            oq[:, row] = accq[:, r] + dqi[:, row]
            ok[:, row] = dk2 + dkt[:, r] + dki[:, row]
            og[:, row] = qq[:, row] * accq[:, r] + (dk2 - dkt[:, r]) * kk[:, row] + dgi[:, row]
            odb[:, row] += (acck[:, r] * kk[:, row]).sum(-1)
    if fold_dg:
        og = og.flip(1).cumsum(1).flip(1)

    def un(x):
        return x.reshape(B, T // 64, HV, 64, -1).permute(0, 1, 3, 2, 4).reshape(B, T, HV, -1)

    return un(oq), un(ok), un(odb.unsqueeze(-1))[..., 0], un(og)


@pytest.mark.parametrize("gmin", [-0.5, -5.0])
@pytest.mark.parametrize("H, HV, K", [(2, 2, 128), (1, 2, 64)])
def test_decomposition_matches_float64_reference(gmin, H, HV, K):
    """The factorized cross sums + descending diagonal + fold equal the contract; in float32
    they stay finite with gates of -5 per step (every exp2 argument <= 0)."""
    ref = pytest.importorskip("kda_cute.reference")
    torch.manual_seed(0)
    B, T = 1, 128
    a = _args(B, T, H, HV, K)
    step = gmin * torch.rand(B, T, HV, K)
    a[2] = step.view(B, T // 64, 64, HV, K).cumsum(2).view(B, T, HV, K) / 0.6931471805599453
    want = ref.bwd_intra(*[t.double() for t in a], fold_dg=True)
    got = _emulate(*a, fold_dg=True)
    for w, x in zip(want, got, strict=True):
        assert ref.rel_err(x, w) < 1e-12
    got32 = _emulate(*a, fold_dg=True, dtype=torch.float32)
    for w, x in zip(want, got32, strict=True):
        assert torch.isfinite(x).all() and ref.rel_err(x, w) < 1e-5


# --------------------------------------------------------------------------------------------
# A PTX interpreter for the opcodes kda_cute_intra's PTX uses, enough to run one CTA on CPU.
# Threads are Python generators interpreting the PTX as scalar programs; warp collectives
# (shfl.sync, bar.warp.sync, mma.sync m16n8k8 tf32) and bar.sync are yield points completed
# once every participant arrives. Registers hold raw bit patterns; f32 math through numpy.
# ex2.approx is modelled as exact exp2 (flush-to-zero), the mma operands as tf32-truncated.
# --------------------------------------------------------------------------------------------
F32 = np.float32


def f2b(x):
    return struct.unpack("<I", struct.pack("<f", float(x)))[0]


def b2f(b):
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def ftz(x):
    x = F32(x)
    if x != 0 and abs(x) < F32(1.1754943508222875e-38):
        return F32(0.0) * np.sign(x)
    return x


def bf16_to_f32(h):
    return b2f((h & 0xFFFF) << 16)


def f32_to_bf16(x):  # round to nearest even
    b = f2b(x)
    if (b & 0x7F800000) == 0x7F800000 and (b & 0x7FFFFF):
        return 0x7FC0
    lsb = (b >> 16) & 1
    b = b + 0x7FFF + lsb
    return (b >> 16) & 0xFFFF


def f16_to_f32(h):
    return float(np.frombuffer(struct.pack("<H", h & 0xFFFF), dtype=np.float16)[0])


def f32_to_f16(x):
    return struct.unpack("<H", np.float16(F32(x)).tobytes())[0]


def tf32_rna(x):
    b = f2b(x)
    if (b & 0x7F800000) == 0x7F800000:
        return b
    b = (b + 0x1000) & 0xFFFFE000
    return b & 0xFFFFFFFF


def sext(v, bits):
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >> (bits - 1) else v


class _Program:
    def __init__(self, ptx: str):
        body = ptx[ptx.index(".entry"):]
        self.params = re.findall(r"\.param\s+\.align\s+\d+\s+\.b8\s+(\w+)\[(\d+)\]", body)
        body = body[body.index("{") + 1:]
        lines = []
        for raw in body.split("\n"):
            line = raw.split("//")[0].strip()
            if not line or line.startswith(".reg") or line.startswith(".pragma") or line == "}":
                continue
            lines.append(line)
        text = " ".join(lines)
        self.instrs = []
        self.labels = {}
        for stmt in text.split(";"):
            stmt = stmt.strip()
            while True:
                m = re.match(r"^(\$?[\w$]+):\s*(.*)$", stmt)
                if not m:
                    break
                self.labels[m.group(1)] = len(self.instrs)
                stmt = m.group(2).strip()
            if not stmt or stmt.startswith(".pragma"):
                continue
            self.instrs.append(self.parse(stmt))

    @staticmethod
    def parse(stmt):
        pred = None
        m = re.match(r"^@(!?)(%?\w+)\s+(.*)$", stmt)
        if m:
            pred = (m.group(1) == "!", m.group(2))
            stmt = m.group(3)
        parts = stmt.split(None, 1)
        op = parts[0]
        args = []
        if len(parts) > 1:
            s = parts[1]
            depth = 0
            cur = ""
            for ch in s:
                if ch in "{[":
                    depth += 1
                elif ch in "}]":
                    depth -= 1
                if ch == "," and depth == 0:
                    args.append(cur.strip())
                    cur = ""
                else:
                    cur += ch
            if cur.strip():
                args.append(cur.strip())
        return (pred, op, args)


class _CTA:
    def __init__(self, prog: _Program, gmem: bytearray, params: dict, ctaid, ntid=256, smem_bytes=240 * 1024,
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
                kind = kinds.pop()
                if kind == "shfl":
                    vals = [state[t][1] for t in lanes]
                    outs = []
                    for i, t in enumerate(lanes):
                        _, _, mode, b, c = state[t]
                        if mode == "bfly":
                            j = i ^ b
                        elif mode == "idx":
                            j = b
                        else:
                            raise NotImplementedError(mode)
                        outs.append(vals[j] if j < 32 else vals[i])
                    for i, t in enumerate(lanes):
                        state[t] = self.resume(threads, t, outs[i], alive)
                elif kind == "wsync":
                    for t in lanes:
                        state[t] = self.resume(threads, t, None, alive)
                elif kind == "mma":
                    res = self.mma([state[t][1] for t in lanes])
                    for i, t in enumerate(lanes):
                        state[t] = self.resume(threads, t, res[i], alive)
                else:
                    raise NotImplementedError(kind)
                progressed = True
            if not progressed and not all((not alive[t]) or state[t][0] == "bar" for t in range(self.ntid)):
                raise RuntimeError("deadlock")

    def resume(self, threads, t, val, alive):
        try:
            return threads[t].send(val)
        except StopIteration:
            alive[t] = False
            return None

    @staticmethod
    def mma(frags):
        # m16n8k8 tf32: a (4 regs), b (2), c (4); row.col
        A = np.zeros((16, 8))
        Bm = np.zeros((8, 8))
        C = np.zeros((16, 8))

        def tf(b):
            return b2f(b & 0xFFFFE000)

        for lane, (a, b, c) in enumerate(frags):
            g, t = lane // 4, lane % 4
            A[g, t], A[g + 8, t], A[g, t + 4], A[g + 8, t + 4] = (tf(x) for x in a)
            Bm[t, g], Bm[t + 4, g] = tf(b[0]), tf(b[1])
            C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1] = (b2f(x) for x in c)
        D = (A @ Bm + C).astype(np.float32)
        out = []
        for lane in range(32):
            g, t = lane // 4, lane % 4
            out.append([f2b(D[g, 2 * t]), f2b(D[g, 2 * t + 1]),
                        f2b(D[g + 8, 2 * t]), f2b(D[g + 8, 2 * t + 1])])
        return out

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
                bits = int(re.sub(r"\D", "", typ))
                if typ.startswith("f"):
                    a_, b_ = fv(args[1]), fv(args[2])
                else:
                    a_, b_ = val(args[1]) & ((1 << bits) - 1), val(args[2]) & ((1 << bits) - 1)
                    if typ.startswith("s"):
                        a_, b_ = sext(a_, bits), sext(b_, bits)
                R[args[0]] = {"eq": a_ == b_, "ne": a_ != b_, "lt": a_ < b_, "le": a_ <= b_, "gt": a_ > b_,
                              "ge": a_ >= b_}[cmp]
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
        """Opcodes beyond intra's (a subclass's hook; a generator so it may yield collectives)."""
        raise NotImplementedError(f"{op} {args}")
        yield
