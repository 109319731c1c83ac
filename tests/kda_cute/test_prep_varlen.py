"""kda_cute_prep's varlen build (a chunk table: packed sequences read straight from the raw row) on
CPU: its PTX, run by the interpreter, gives bitwise what the plain build gives on the chain's
padded row (kda_chain.varlen.pack_inputs), and its padded copies of q, k are bitwise pack_inputs'
tensors; kda_cute_bwd_prep's varlen build (v, g, beta on the raw row, q, k, Akk the forward's on
the padded row) gives bitwise the forward's gk, w, u, qg, kg; every global access stays inside the
tensors (ptxsim.kda_prep's `_InBoundsCTA`: no pad row is read past the raw row). Also both
kernels' varlen reasons."""

import pytest
import torch

pytest.importorskip("cutlass.cute")
P = pytest.importorskip("kda_cute.prep")
BP = pytest.importorskip("kda_cute.bwd_prep")
VL = pytest.importorskip("kda_chain.varlen")
from kda_cute import _warp  # noqa: E402
from ptxsim.kda_prep import emulate_bwd_prep, emulate_prep, prep_inputs  # noqa: E402

pytestmark = pytest.mark.usefixtures("sm90a")

SCALE = 128**-0.5
NAMES = ("gk", "w", "u", "qg", "kg", "Aqk", "Akk")
L2_NAMES = ("q_n", "k_n", "q_rstd", "k_rstd")
LENS = (1, 63, 64, 65, 3)  # T_raw = 196: a length-1 sequence, one of exactly 64, one of 65


def _packing(lens):
    """(packing, table) of sequences of these lengths: table[c] = (raw row of chunk c's first row,
    its valid rows), from the padded layout's `source` and `pad` rows."""
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    p = VL.packing(torch.tensor(offsets, dtype=torch.int32), offsets)
    pad = torch.zeros(p.T_pad, dtype=torch.bool)
    pad[p.pad] = True
    table = torch.stack([p.source.view(-1, 64)[:, 0], 64 - pad.view(-1, 64).sum(1)], 1).to(torch.int32)
    chain = getattr(p, "table", None)  # the chain's own, where it builds one
    assert chain is None or torch.equal(chain, table)
    return p, table.contiguous()


def _bits(x):
    return x.contiguous().view(torch.uint8)


def _same(name, got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype)
    assert torch.equal(_bits(got), _bits(want)), f"{name} differs bitwise"


def _run(ptx, a, l2norm, lens=LENS):
    """The varlen build on the raw row `a` against the plain build on pack_inputs' padded row."""
    p, table = _packing(lens)
    assert "CUDA" in P.is_supported(*a, SCALE, l2norm=l2norm, table=table)  # only the device is missing
    q, k, v, g, beta, A_log, dt_bias, lb, gate_in = a
    packed = VL.pack_inputs(q, k, v, g, beta, p, use_gate_in_kernel=gate_in, use_beta_sigmoid_in_kernel=False,
                            lower_bound=lb)
    b = [*packed, A_log, dt_bias, lb, gate_in]
    text = ptx(P.compile_for(*a, SCALE, want_qg=True, keep_ptx=True, l2norm=l2norm, table=table))
    assert ".local" not in text.split(".entry", 1)[1], "register arrays fell to local memory"
    got = emulate_prep(text, a, want_qg=True, l2norm=l2norm, table=table)
    plain = ptx(P.compile_for(*b, SCALE, want_qg=True, keep_ptx=True, l2norm=l2norm))
    want = emulate_prep(plain, b, want_qg=True, l2norm=l2norm)
    n = len(want)
    for name, x, w in zip(NAMES + (L2_NAMES if l2norm else ()), got[:n], want, strict=True):
        assert torch.isfinite(x.float()).all(), f"{name}: unwritten (NaN) entries"
        _same(name, x, w)
    qp, kp = got[n:]
    if l2norm:  # the padded copies of q, k are the normalized ones
        assert qp is got[7] and kp is got[8]
    else:
        _same("q_p", qp, packed[0])
        _same("k_p", kp, packed[1])
    _backward(ptx, a, got, qp, kp, table)
    return table


def _backward(ptx, a, fwd, qp, kp, table):
    """kda_cute_bwd_prep's varlen build as the chain calls it (v, beta, the raw gate on the raw row;
    q, k the forward's padded ones; the forward's Akk; without the gate in the op the forward's gk
    and no g): bitwise the forward's gk, w, u, qg, kg."""
    q, k, v, g, beta, A_log, dt_bias, lb, gate_in = a
    gk = None if gate_in else fwd[0]
    g = g if gate_in else None
    akk = fwd[6]
    text = ptx(BP.compile_for(qp, kp, v, g, beta, A_log, dt_bias, akk, lb, gate_in, keep_ptx=True, gk=gk,
                              table=table))
    got = emulate_bwd_prep(text, [qp, kp, v, g, beta, A_log, dt_bias, lb, gate_in], akk, gk=gk, table=table)
    for name, x, w in zip(NAMES[:5], got, fwd[:5], strict=True):
        _same(f"bwd_prep {name}", x, w)


def test_varlen_bf16_softplus_gate_l2norm(ptx):
    """bf16, a bf16 raw gate with the softplus gate in the op (pad -1e30 as bf16), l2norm, H = HV =
    1, chunks of 1, 63, 64, 64 + 1 and 3 valid rows (T_raw = 196, not a multiple of 64)."""
    a = prep_inputs(B=1, T=sum(LENS), H=1, HV=1, V=64, seed=11, gate="softplus", g_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(12)
    a[0] = (3.0 * torch.randn(a[0].shape, generator=gen)).to(torch.bfloat16)  # raw: norms far from 1
    a[1] = (0.2 * torch.randn(a[1].shape, generator=gen)).to(torch.bfloat16)
    table = _run(ptx, a, l2norm=True)
    assert table[:, 1].tolist() == [1, 63, 64, 64, 1, 3]


def test_varlen_fp16_fp32_beta_given_gate_gva(ptx):
    """fp16, fp32 beta, the log gate given (no gate in the op: g pads with 0, no g_p), no l2norm (q_p,
    k_p copies written by the GVA group's first CTA), H = 1, HV = 2, V = 128 (the V ring's two
    stages), sequences of 2, 64 and 1 rows."""
    a = prep_inputs(B=1, T=67, H=1, HV=2, V=128, dtype=torch.float16, beta_dtype=torch.float32, seed=13)
    _run(ptx, a, l2norm=False, lens=(2, 64, 1))


def test_varlen_gva_second_cta_and_the_bounds_check(ptx):
    """The GVA group's second CTA (hv = 1), run alone, writes its head's outputs but no q_p, k_p
    (hv % (HV // H) == 0 writes them); and the harness's bounds check fires on a table whose last
    chunk claims rows past the raw row (so the tests above would see such a read)."""
    lens = (2, 64, 1)
    a = prep_inputs(B=1, T=sum(lens), H=1, HV=2, V=64, dtype=torch.float16, seed=14)
    _, table = _packing(lens)
    text = ptx(P.compile_for(*a, SCALE, want_qg=True, keep_ptx=True, table=table))
    got = emulate_prep(text, a, want_qg=True, table=table, ctas=[(1, 1, 0)])
    qp, kp = got[7:]
    assert torch.isnan(qp.float()).all() and torch.isnan(kp.float()).all(), "the second CTA wrote q_p"
    assert torch.isfinite(got[2][0, 64:128, 1].float()).all() and torch.isnan(got[2][0, :, 0].float()).all()
    bad = table.clone()
    bad[-1, 1] = 64  # raw rows 66 .. 129 of a 67-row packed row
    with pytest.raises(IndexError, match="outside every tensor"):
        emulate_prep(text, a, want_qg=True, table=bad, ctas=[(2, 0, 0)])


# ---------------------------------------------------------------------------------- host checks
def _args(**kw):
    return prep_inputs(B=1, T=sum(LENS), **{"V": 64, **kw})


def test_varlen_reasons_on_cpu():
    a = _args()
    _, table = _packing(LENS)
    assert "not a multiple of the chunk" in P.is_supported(*a, SCALE)  # T_raw = 196 without a table
    assert "CUDA" in P.is_supported(*a, SCALE, table=table)  # with one: only the device is missing
    assert "table must be int32 [NT, 2]" in P.is_supported(*a, SCALE, table=table.long())
    assert "table must be int32 [NT, 2]" in P.is_supported(*a, SCALE, table=table[:, :1])
    assert "table must be int32 [NT, 2]" in P.is_supported(*a, SCALE, table=table[:0])
    assert "table is not contiguous" in P.is_supported(*a, SCALE, table=table.t().contiguous().t())
    assert "table on meta" in P.is_supported(*a, SCALE, table=table.to("meta"))
    b = prep_inputs(B=2, T=64, V=64)
    assert "needs the packed row" in P.is_supported(*b, SCALE, table=table)
    c = list(a)
    c[2] = c[2][:, :100]
    assert "one packed row" in P.is_supported(*c, SCALE, table=table)
    d = _args(V=32)
    assert "V=32 not a multiple of 64" in P.is_supported(*d, SCALE, table=table)  # extents still checked
    lb = _args(gate="lower_bound", g_dtype=torch.float16)
    assert "fp16 g in the lower_bound form" in P.is_supported(*lb, SCALE, table=table)
    sp = _args(gate="softplus", g_dtype=torch.float16)  # the softplus form pads fp16 with -inf
    assert "CUDA" in P.is_supported(*sp, SCALE, table=table)
    with pytest.raises(ValueError, match="unsupported call: table must be int32"):
        P.fwd_prep(*a, SCALE, table=table.long())


def test_gate_pad_value_is_the_chains():
    """A pad row's raw gate: pack_inputs' fill in g's dtype (0 for a given log gate), by dtype or name."""
    for dt in (torch.float32, torch.bfloat16):
        assert _warp.gate_pad_value(dt, True) == float(torch.tensor(VL.GATE_PAD, dtype=dt))
        assert _warp.gate_pad_value(_warp.DT[dt], True) == _warp.gate_pad_value(dt, True)
    assert _warp.gate_pad_value(torch.float16, True) == float("-inf")
    assert _warp.gate_pad_value(torch.bfloat16, False) == 0.0


def test_bwd_prep_varlen_reasons_on_cpu():
    """kda_cute_bwd_prep with a table: q, k, Akk (a given gk) on the padded row, v, g, beta on one
    raw row; one-line reasons otherwise (only the device missing where they are right)."""
    p, table = _packing(LENS)
    a = _args(gate="softplus", g_dtype=torch.bfloat16)
    q, k, v, g, beta, A_log, dt_bias, lb, gate_in = a
    qp, kp = (VL.pack(x, p) for x in (q, k))
    akk = torch.zeros(1, p.T_pad, 1, 64, dtype=q.dtype)

    def why(**kw):
        args = dict(q=qp, k=kp, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, Akk=akk, lower_bound=lb,
                    use_gate_in_kernel=gate_in, table=table)
        args.update(kw)
        r = BP.is_supported(**args)
        assert r is not None and "\n" not in r
        return r

    assert "CUDA" in why()
    assert "padded row [1, 384, H, K]" in why(q=q)
    assert "q, k, Akk must share the padded row" in why(k=k)
    assert "q, k, Akk must share the padded row" in why(Akk=akk[:, :64])
    assert "v, g, beta must share one packed row" in why(v=VL.pack(v, p))
    assert "v, g, beta must share one packed row" in why(beta=beta[:, :-1])
    assert "table must be int32" in why(table=table.long())
    gk = torch.zeros(1, p.T_pad, 1, 128)
    assert "CUDA" in why(g=None, gk=gk, A_log=None, dt_bias=None, use_gate_in_kernel=False)
    assert "q, k, Akk, gk must share" in why(g=None, gk=gk[:, :64], A_log=None, dt_bias=None,
                                            use_gate_in_kernel=False)
    lb16 = _args(gate="lower_bound", g_dtype=torch.float16)
    assert "fp16 g in the lower_bound form" in why(g=lb16[3], lower_bound=lb16[7])
