"""kda_cute_bwd_chunk's varlen build (a chunk table: packed sequences) reads do, v, beta and the
raw gate on the packed row and writes its gradients there, bit for bit the padded-row build's at
the corresponding rows, and nothing else (CPU).

Packed sequences of lengths 1, 63, 64, 65, 3 (T_raw = 196, six chunks on the padded row, T_pad =
384; chunk valid rows 1, 63, 64, 64, 1, 3). The inputs are random on every padded row, the pad rows
included (the kernel never stores a pad row's gradient, which is what is tested; the chain's pad
rows are no-op tokens besides), except do, v, beta and the raw gate: the padded build takes them
with the chain's pad rows (zeros; the raw gate's pad value), the varlen build the same rows on the
packed row, its rows no chunk reads NaN / +-Inf (a load of one would reach every valid row's dk
through dAqk). The
interpreter (ptxsim.kda_wy.emulate_bwd_chunk) runs the varlen build's PTX with each packed-row
output, and do, between poisoned guard rows (the outputs' asserted unchanged; do's poison before
row 0 and past T_raw) and its CTAs in descending chunk order, so a store past a chunk's valid rows
(into the next sequence's rows) would land after that chunk's own stores and show; then the build
without the table on the padded inputs. Two packed rows: the chain's, sequences back to back
(a chunk's pad rows over the next sequence's valid rows, finite and not zero, or past the end);
and a gapped one (`gapped`: GAP poisoned rows before, between and after the sequences, which no
chunk reads or writes). Checked: (1) every packed row of a chunk that ran equals, bit for bit, the
padded build's output at its padded row; (2) every other packed row is still poisoned, and with
every chunk run (the emit_bf16 build) no sequence row is. Builds: emit_bf16, l2norm, the gate
(softplus, dt_bias; its per-chunk partials bit for bit too), fp32 dq / dk with GVA; and with
qk_padded (dq, dk on the padded row: each CTA's 64 padded rows bit for bit the padded build's,
every other padded row still poisoned; dv2, db, dg as above): fp32 GVA, the gate with GVA. The
host's reasons for the table, qk_padded and do's shape.
"""
import pytest
import torch

pytest.importorskip("cutlass.cute")
C = pytest.importorskip("kda_cute.bwd_chunk")
from kda_chain.varlen import packing  # noqa: E402
from kda_cute import _warp  # noqa: E402
from ptxsim.kda_wy import emulate_bwd_chunk, wy_inputs  # noqa: E402

pytestmark = pytest.mark.usefixtures("sm90a")

NAMES = ("dq", "dk", "dv2", "db", "dg")
SCALE = 128**-0.5
LENS = (1, 63, 64, 65, 3)


def _layout():
    """(the Packing, the chunk table int32 [NT, 2], T_raw) of LENS."""
    off = [0]
    for n in LENS:
        off.append(off[-1] + n)
    p = packing(torch.tensor(off, dtype=torch.int32), off)
    pad = torch.zeros(p.T_pad, dtype=torch.int32)
    pad[p.pad] = 1
    table = torch.stack([p.source.view(-1, 64)[:, 0].to(torch.int32),
                         64 - pad.view(-1, 64).sum(1, dtype=torch.int32)], 1).contiguous()
    return p, table, off[-1]


P, TABLE, T_RAW = _layout()
GAP = 2  # the gapped packed row's poisoned rows before, between and after the sequences


def _gapped():
    """TABLE, T_RAW with GAP rows before each sequence and after the last on the packed row."""
    seq = [i for i, n in enumerate(LENS) for _ in range((n + 63) // 64)]  # each chunk's sequence
    table = TABLE.clone()
    table[:, 0] += GAP * (torch.tensor(seq, dtype=torch.int32) + 1)
    return table, T_RAW + GAP * (len(LENS) + 1)


TABLE_G, T_RAW_G = _gapped()


def _source(table, T_raw):
    """Each packed row's padded row (-1: no chunk's row, a gap) under `table`."""
    src = torch.full((T_raw,), -1, dtype=torch.long)
    for c, (r0, nv) in enumerate(table.tolist()):
        src[r0:r0 + nv] = torch.arange(64 * c, 64 * c + nv)
    return src


def _poison(shape, dtype):
    """NaN, +Inf, -Inf in turn along the elements."""
    n = torch.Size(shape).numel()
    vals = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)
    return vals.repeat(n // 3 + 1)[:n].view(shape)


def _pair(x, table, T_raw, fill=0.0):
    """(the padded x: `x` with its pad rows `fill`, as the chain's pack_inputs leaves them; the
    packed x [1, T_raw, ...]: the same valid rows, its gap rows poisoned)."""
    src = _source(table, T_raw)
    on = src >= 0
    pad = torch.full_like(x, fill)
    pad[0, src[on]] = x[0, src[on]]
    packed = _poison((1, T_raw, *x.shape[2:]), x.dtype)
    packed[0, on] = pad[0, src[on]]
    return pad, packed


def _check(ptx, a, ctas, qk_padded=False, gapped=False, **kw):
    """The varlen build on the packed do against the padded build on the padded do (`_do_pair`;
    the other inputs `a`; CTAs `ctas`, None: all): bit for bit at every packed row of a chunk that
    ran, poison elsewhere (qk_padded: dq, dk at every padded row of a chunk that ran); `gapped`:
    the packed row with poisoned gaps (TABLE_G). -> the two builds' results."""
    table, T_raw = (TABLE_G, T_RAW_G) if gapped else (TABLE, T_RAW)
    emit = kw.pop("emit_bf16", False)
    a, av = list(a), list(a)
    for i in (2, 5, 8):  # v, beta, do
        a[i], av[i] = _pair(a[i], table, T_raw)
    if "gate" in kw:  # the raw gate: the chain's pad value in its pad rows
        gate, gv = dict(kw["gate"]), dict(kw["gate"])
        gate["g"], gv["g"] = _pair(gate["g"], table, T_raw, _warp.gate_pad_value(gate["g"].dtype, True))
        kw["gate"] = gate
    ckw = {"q_rstd": kw["rstd"][0], "k_rstd": kw["rstd"][1]} if "rstd" in kw else {}
    ckw.update(kw.get("gate", {}))
    ckv = {**ckw, **({"g": gv["g"]} if "gate" in kw else {})}
    kwv = {**kw, **({"gate": gv} if "gate" in kw else {})}
    vl = dict(table=table, T_raw=T_raw, **({"qk_padded": True} if qk_padded else {}))
    text = ptx(C.compile_for(*av, SCALE, emit_bf16=emit, **ckv, keep_ptx=True, **vl))
    assert "Varlen" in text.split(".entry", 1)[1].split("(", 1)[0]
    assert ".local" not in text.split(".entry", 1)[1], "register arrays fell to local memory"
    got = emulate_bwd_chunk(text, av, emit_bf16=emit, ctas=ctas, **vl, **kwv)
    base = emulate_bwd_chunk(ptx(C.compile_for(*a, SCALE, emit_bf16=emit, **ckw, keep_ptx=True)), a,
                             emit_bf16=emit, ctas=ctas, **kw)
    HV = a[2].shape[2]
    run = torch.zeros(T_raw, HV, dtype=torch.bool)  # (packed row, hv) some CTA that ran owns
    runp = torch.zeros(P.T_pad, HV, dtype=torch.bool)  # (padded row, hv) the same
    for tx, hv, _ in ctas or [(c, h, 0) for c in range(table.shape[0]) for h in range(HV)]:
        r0, nv = table[tx].tolist()
        run[r0:r0 + nv, hv] = True
        runp[tx * 64:tx * 64 + 64, hv] = True
    assert run.any()
    src = _source(table, T_raw).clamp(min=0)  # (a gap row's 0: never an owned row)
    for name, x, y in zip(NAMES, got[:5], base[:5], strict=True):
        padded = qk_padded and name in ("dq", "dk")
        R = P.T_pad if padded else T_raw
        assert x.shape[:3] == (1, R, HV) and x.dtype == y.dtype, name
        own = runp if padded else run
        want = y[0] if padded else y[0, src]  # the padded build's rows (gathered to the packed row)
        x = x[0]
        same = (x.view(torch.uint8) == want.view(torch.uint8)).reshape(R, HV, -1).all(-1)
        nan = torch.isnan(x.float()).reshape(R, HV, -1).all(-1)
        assert same[own].all(), f"{name}: not the padded build's at {(~same & own).nonzero()[:4].tolist()}"
        stray = (~nan & ~own).nonzero()[:4].tolist()
        assert nan[~own].all(), f"{name}: written at rows no CTA that ran owns: {stray}"
        assert not nan[own].any(), name
    return got, base


def _inputs(HV=1, H=1, dtype=torch.bfloat16, seed=0, normalized=False):
    a = wy_inputs(B=1, T=P.T_pad, H=H, HV=HV, V=64, dtype=dtype, seed=seed)
    if normalized:  # the normalized q, k the chain passes with use_qk_l2norm_in_kernel
        for i in (0, 1):
            x = a[i].float()
            a[i] = (x / x.norm(dim=-1, keepdim=True)).to(dtype)
    return a


def test_table_matches_the_packing():
    assert TABLE.tolist() == [[0, 1], [1, 63], [64, 64], [128, 64], [192, 1], [193, 3]]
    assert T_RAW == 196 and P.T_pad == 384


def test_emit_bf16_every_chunk(ptx):
    """The chain's build (HV == H, emit_bf16) over every chunk, on the gapped packed row (do
    poisoned before, between and after the sequences): every sequence row written, by its chunk
    only, bit for bit; the gaps never."""
    got, _ = _check(ptx, _inputs(seed=1), None, emit_bf16=True, gapped=True)
    assert got[0].dtype == torch.bfloat16
    seq = _source(TABLE_G, T_RAW_G) >= 0
    for name, x in zip(NAMES, got, strict=True):
        assert not torch.isnan(x[0, seq].float()).any(), f"{name}: a packed row left unwritten"


def test_l2norm_build(ptx):
    """The l2norm row pass: reads the rstds on the padded row, writes dq, dk on the packed row.
    Chunks 5 (the last: 3 valid rows, 61 past the tensor's end: do's guard rows) and 1 (63
    valid: its pad row is packed row 64, chunk 2's)."""
    a = _inputs(seed=2, normalized=True)
    g = torch.Generator().manual_seed(9)
    rstd = tuple(torch.rand(1, P.T_pad, 1, generator=g) + 0.5 for _ in range(2))
    _check(ptx, a, [(5, 0, 0), (1, 0, 0)], rstd=rstd)


def _gate(a):
    """The softplus gate's g (bf16), A_log, dt_bias for inputs `a`."""
    gen = torch.Generator().manual_seed(5)
    B, T, HV, K = a[4].shape
    g = (torch.randn(B, T, HV, K, generator=gen) * 3).to(torch.bfloat16)
    A_log = torch.rand(HV, generator=gen) * 2 - 0.5
    return dict(g=g, A_log=A_log, dt_bias=torch.randn(HV * K, generator=gen) * 0.5)


def _check_gate(ptx, a, ctas, **kw):
    """_check on the softplus gate build, and its per-chunk partials bit for bit."""
    got, base = _check(ptx, a, ctas, gate=_gate(a), **kw)
    assert got[4].dtype == torch.bfloat16
    for name, x, y in zip(("dA_log", "ddt_bias"), got[5:], base[5:], strict=True):
        for tx, hv, b in ctas:
            x1, y1 = x[b, tx, hv:hv + 1], y[b, tx, hv:hv + 1]
            assert torch.isfinite(x1).all() and torch.equal(x1.view(torch.uint8), y1.view(torch.uint8)), name
    return got


def test_gate_build(ptx):
    """The gate row pass (softplus, dt_bias): reads the raw gate on the padded row, writes dg on
    the packed row; the per-chunk dA_log / ddt_bias partials stay per padded chunk, bit for bit.
    The gapped packed row: chunks 5 (3 valid rows, then the last gap) and 1 (63 valid, then the
    gap before sequence 2)."""
    _check_gate(ptx, _inputs(seed=3, normalized=True), [(5, 0, 0), (1, 0, 0)], gapped=True)


def test_fp32_gva(ptx):
    """dq, dk in fp32 (GVA: HV = 2H, no emit_bf16), fp16: chunks 4 (one valid row: the 65th of
    its sequence), 3 (all 64) and 0 (one valid row, 63 pad rows over the next sequence's)."""
    a = _inputs(HV=2, H=1, dtype=torch.float16, seed=4)
    got, _ = _check(ptx, a, [(4, 0, 0), (3, 1, 0), (0, 1, 0)])
    assert got[0].dtype == torch.float32


def test_qk_padded_fp32_gva(ptx):
    """qk_padded (GVA, fp32 dq / dk per value head, fp16): dq, dk [1, T_pad, HV, K] at every
    padded row of chunks 5 (3 valid rows) and 1 (63 valid), pad rows included (do's: zeros, the
    padded build's); dv2, db, dg packed. The gapped packed row."""
    a = _inputs(HV=2, H=1, dtype=torch.float16, seed=6)
    got, _ = _check(ptx, a, [(5, 1, 0), (1, 0, 0)], qk_padded=True, gapped=True)
    assert got[0].dtype == torch.float32 and got[0].shape == (1, P.T_pad, 2, 128)
    assert got[2].shape[1] == T_RAW_G


def test_qk_padded_gate_gva(ptx):
    """qk_padded with the gate in the op (softplus, dt_bias; GVA HV = 2H, bf16): dq, dk on the
    padded row, dg in g's dtype on the packed row, the partials bit for bit. Chunks 0 (1 valid
    row, 63 pad rows over the next sequence's) and 5 (3 valid: 61 past the packed row's end)."""
    got = _check_gate(ptx, _inputs(HV=2, H=1, seed=7), [(0, 1, 0), (5, 0, 0)], qk_padded=True)
    assert got[0].shape == (1, P.T_pad, 2, 128) and got[4].shape == (1, T_RAW, 2, 128)


def test_qk_padded_outputs_and_reasons(monkeypatch):
    """qk_padded's allocation (dq, dk padded, the rest packed), its compile key and its reasons
    (is_supported with the device check stubbed: no GPU here)."""
    a = wy_inputs(B=1, T=P.T_pad, H=1, HV=2, V=64)
    for i in (2, 5, 8):  # v, beta, do on the packed row
        a[i] = a[i][:, :T_RAW].contiguous()
    cfg, outs, _, _ = C._prepare(*a, SCALE, table=TABLE, T_raw=T_RAW, qk_padded=True)
    assert [tuple(t.shape[:2]) for t in outs] == [(1, P.T_pad)] * 2 + [(1, T_RAW)] * 3
    assert cfg.varlen and cfg.qk_padded
    assert cfg != C._prepare(*a, SCALE, table=TABLE, T_raw=T_RAW)[0]  # part of the compile key
    assert not C._prepare(*a, SCALE, qk_padded=True)[0].qk_padded  # only with varlen
    monkeypatch.setattr(C._wy, "_hard_reason", lambda *args, **kw: None)
    assert C.is_supported(*a, SCALE, table=TABLE, T_raw=T_RAW, qk_padded=True) is None
    assert "goes with a chunk table" in C.is_supported(*a, SCALE, qk_padded=True)
    rstd = torch.rand(1, P.T_pad, 1) + 0.5  # (the rstds' own check wants a GPU: the table's reason)
    assert C._table_reason(a[3], TABLE, T_RAW, False, rstd) is None
    r = C._table_reason(a[3], TABLE, T_RAW, True, rstd)
    assert "not with q_rstd" in r and "\n" not in r
    with pytest.raises(ValueError, match="unsupported call: qk_padded"):
        C.bwd_chunk(*a, SCALE, qk_padded=True)


def test_table_reasons():
    v = wy_inputs(B=1, T=P.T_pad, H=1, HV=1, V=64)[2]
    R = C._table_reason
    assert R(v, None, None) is None
    assert R(v, TABLE, T_RAW) is None
    assert "goes with a chunk table" in R(v, None, T_RAW)
    assert "T_raw" in R(v, TABLE, None)
    assert "B == 1" in R(wy_inputs(B=2, T=64, H=1, HV=1, V=64)[2], TABLE[:1], 10)
    assert "int32" in R(v, TABLE.long(), T_RAW)
    assert "[NT, 2]" in R(v, TABLE[:5], T_RAW)
    assert "contiguous" in R(v, TABLE.t().contiguous().t(), T_RAW)
    assert "T_raw must be" in R(v, TABLE, P.T_pad + 1)
    a = wy_inputs(B=1, T=P.T_pad, H=1, HV=1, V=64)
    with pytest.raises(ValueError, match="unsupported call"):
        C.bwd_chunk(*a, SCALE, table=TABLE)


def test_packed_row_reasons(monkeypatch):
    """With a table do and v must be the packed row's [1, T_raw, HV, V] (v_new's dtype, contiguous)
    and beta [1, T_raw, HV]: one-line reasons for the padded ones and other wrong ones; without a
    table the padded ones, as before (is_supported with wy_dqkg's checks stubbed where they would
    want a GPU)."""
    a = wy_inputs(B=1, T=P.T_pad, H=1, HV=2, V=64)
    padded = a[8]
    packed = padded[:, :T_RAW].contiguous()
    no_table = C.is_supported(*a[:8], packed, *a[9:], SCALE)  # wy_dqkg's do shape check, first
    assert "do must be [B,T,HV,V]" in no_table
    b = list(a)
    for i in (2, 5, 8):
        b[i] = a[i][:, :T_RAW].contiguous()
    assert "v must be [B,T,HV,V]" in C.is_supported(*b, SCALE)  # packed v without a table
    monkeypatch.setattr(C._wy, "_hard_reason", lambda *args, **kw: None)
    vl = dict(table=TABLE, T_raw=T_RAW)

    def reason(i, x):
        c = list(b)
        c[i] = x
        return C.is_supported(*c, SCALE, **vl)

    assert reason(8, packed) is None
    for i, name in ((8, "do"), (2, "v")):
        bad = {
            "the padded row": a[i],
            "HV": b[i][:, :, :1].contiguous(),
            "V": b[i][..., :32].contiguous(),
            "rows": b[i][:, :-1].contiguous(),
            "3-d": b[i][0],
        }
        for what, x in bad.items():
            r = reason(i, x)
            want = f"{name} must be on the packed row [1,T_raw,HV,V] = (1, 196, 2, 64)"
            assert r is not None and want in r, what
            assert "\n" not in r, what
        assert "dtype" in reason(i, b[i].half())
        strided = torch.empty(1, 64, T_RAW, 2, dtype=b[i].dtype).permute(0, 2, 3, 1)
        assert reason(i, strided) == f"{name} is not contiguous"
    r = reason(5, a[5])
    assert r is not None and "beta must be on the packed row [1,T_raw,HV] = (1, 196, 2)" in r
    with pytest.raises(ValueError, match="unsupported call: with a chunk table do must be on the packed row"):
        C.bwd_chunk(*b[:8], padded, *b[9:], SCALE, **vl)
