"""kda_cute_prep compiles for sm_90a without a GPU, its PTX computes fwd_intra's contract, and
is_supported gives reasons (CPU, CI).

The compiled PTX runs on CPU in ptxsim (tools/ptxsim: `ptxsim.kda_prep.emulate_prep`, 256
threads per CTA: tf32 and bf16 / fp16 mma.sync, ldmatrix, cp.async) and every output is checked
against the float64 reference (`kda_cute.reference.fwd_prep`: gate_chunk_cumsum + fwd_intra). The
yardstick is fla's own error: `_fla_casts` is fla's kda_gate_chunk_cumsum + chunk_kda_fwd_intra in
torch float32 with its roundings (gk in fp32, Aqk and Akk stored in the io dtype, w / u from the
io-dtype Akk and io-dtype operands, qg / kg rounded once); every output must stay within 2x of that
error."""

import pytest
import torch

pytest.importorskip("cutlass.cute")
P = pytest.importorskip("kda_cute.prep")
ref = pytest.importorskip("kda_cute.reference")
from ptxsim.kda_prep import emulate_prep, prep_inputs  # noqa: E402

pytestmark = pytest.mark.usefixtures("sm90a")

NAMES = ("gk", "w", "u", "qg", "kg", "Aqk", "Akk")
SCALE = 128**-0.5


def _fla_casts(q, k, v, g, beta, A_log, dt_bias, lower_bound, gate_in, scale):
    """fla 0.6.0's gate cumsum + chunk_kda_fwd_intra in torch float32 with its roundings; T % 64 == 0."""
    gk = ref.gate_chunk_cumsum(g.float(), A_log, dt_bias, lower_bound, 64, gate_in)
    io = q.dtype
    B, T, H, K = q.shape
    HV = v.shape[2]
    NT = T // 64

    def ch(x):  # [B, T, HV, X] -> [B, NT, HV, 64, X] float32
        return x.float().view(B, NT, 64, x.shape[2], -1).transpose(2, 3)

    def un(x):
        return x.transpose(2, 3).reshape(B, T, HV, -1).to(io)

    def rd(x):
        return x.to(io).float()

    qc, kc = (ch(x.repeat_interleave(HV // H, dim=2)) for x in (q, k))
    vc, gc, bc = ch(v), ch(gk), ch(beta.unsqueeze(-1).float())
    low = torch.tril(torch.ones(64, 64))
    diff = gc.unsqueeze(-2) - gc.unsqueeze(-3)  # [.., r, s, K]: g_r - g_s
    D = torch.exp2(diff.masked_fill(low.unsqueeze(-1) == 0, float("-inf")))  # 0 above: no inf * 0
    aqk = torch.einsum("...rk,...sk,...rsk->...rs", qc, kc, D) * scale * low
    L = torch.einsum("...rk,...sk,...rsk->...rs", kc, kc, D) * bc * torch.tril(torch.ones(64, 64), -1)
    eye = torch.eye(64)
    akk = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    E = torch.exp2(gc)
    w = rd(akk) @ rd(kc * bc * E)
    u = rd(akk) @ rd(vc * bc)
    qg = qc * E
    kg = kc * torch.exp2(gc[..., -1:, :] - gc)
    return gk, un(w), un(u), un(qg), un(kg), un(aqk), un(akk)


def _check(got, args, scale, rows=None):
    """Every output finite (the poison overwritten), zero above the diagonal for Aqk / Akk, and
    within 2x of fla's error vs float64 (on the chunks `rows` = [(b, t0, hv)] only, when given)."""
    want = ref.fwd_prep(*[t.double() if torch.is_tensor(t) else t for t in args], scale, 64, want_qg=True)
    fla = _fla_casts(*args, scale)

    def sel(x):
        if rows is None:
            return x
        return torch.stack([x[b, t0:t0 + 64, hv] for b, t0, hv in rows])

    errs = {}
    for name, x, w, f in zip(NAMES, got, want, fla, strict=True):
        if x is None:
            continue
        x, w, f = sel(x), sel(w), sel(f)
        assert torch.isfinite(x).all(), f"{name}: unwritten (NaN) entries"
        e, ef = ref.rel_err(x, w), ref.rel_err(f, w)
        errs[name] = (e, ef)
        assert e <= 2.0 * ef + 1e-6, (name, e, ef)
    return errs


def test_compiles_for_sm90a_and_the_ptx_computes_the_contract(ptx):
    """bf16, V = 192 (three V tiles: the 2-stage ring refilled once), one CTA, want_qg: the PTX
    (tf32 and bf16 mma.sync, ldmatrix, cp.async; no local-memory arrays) run by the interpreter
    matches float64 within 2x of fla's error on every output."""
    a = prep_inputs(B=1, T=64, H=1, HV=1, V=192, seed=0)
    text = ptx(P.compile_for(*a, SCALE, want_qg=True, keep_ptx=True))
    assert ".entry" in text and "kda_cute_prep" in text.split(".entry", 1)[1].split("(", 1)[0]
    body = text.split(".entry", 1)[1]
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in body
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in body
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in body
    assert "cp.async.cg.shared.global" in body
    assert ".local" not in body, "register arrays fell to local memory"
    got = emulate_prep(text, a, want_qg=True)
    errs = _check(got, a, SCALE)
    for name in ("Aqk", "Akk"):
        x = got[NAMES.index(name)].float().view(64, 64)
        assert (x.triu(1) == 0).all(), f"{name} not zero above the diagonal"
    assert errs.keys() == set(NAMES)


def test_gva_batch_and_chunk_indexing_without_qg(ptx):
    """B2 T128 H1 HV2 V64, bf16 beta, want_qg off (qg not written, not returned): the CTA of the
    second chunk, second value head, second batch (q / k read at head hv // 2) against float64."""
    a = prep_inputs(B=2, T=128, H=1, HV=2, V=64, seed=1)
    text = ptx(P.compile_for(*a, SCALE, want_qg=False, keep_ptx=True))
    got = emulate_prep(text, a, want_qg=False, ctas=[(1, 1, 1)])
    assert torch.isnan(got[3].float()).all(), "qg written without want_qg"
    _check((*got[:3], None, *got[4:]), a, SCALE, rows=[(1, 64, 1)])


def test_fp16_fp32_beta_strong_gate(ptx):
    """fp16, fp32 beta, gates down to -5 per step in natural log (exp2 arguments stay <= 0 and
    the diagonal blocks' decays underflow to zero without NaN), V = 64."""
    a = prep_inputs(B=1, T=64, H=1, HV=1, V=64, dtype=torch.float16, beta_dtype=torch.float32, gmin=-5.0,
                    seed=2)
    text = ptx(P.compile_for(*a, 0.25, want_qg=True, keep_ptx=True))
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in text
    _check(emulate_prep(text, a, want_qg=True), a, 0.25)


def test_fla_cast_model_is_the_contract():
    """The yardstick itself: its float32 error sits at the io-dtype level on every output."""
    a = prep_inputs(B=1, T=128, H=1, HV=2, V=128, seed=3)
    errs = _check(_fla_casts(*a, SCALE), a, SCALE)
    for name, (e, _) in errs.items():
        assert e < 2**-6, (name, e)


def test_is_supported_reasons_on_cpu():
    a = prep_inputs()
    assert "CUDA" in P.is_supported(*a, SCALE)  # no GPU here (or tensors on CPU)


def test_unsupported_call_raises():
    """The shared checks (kda_cute._warp, tests/kda_cute/test_warp.py) gate the kernel: a call
    they refuse is a reason from is_supported and a ValueError from the contract function."""
    a = prep_inputs(K=64)
    assert "K=64" in P.is_supported(*a, SCALE)
    with pytest.raises(ValueError, match="unsupported call: K=64"):
        P.fwd_prep(*a, SCALE)


def test_chunk_size_other_than_64_is_refused():
    a = prep_inputs()
    assert "chunk_size=32" in P.is_supported(*a, SCALE, chunk_size=32)


def test_gate_in_kernel_needs_its_parameters():
    q, k, v, g, beta, A_log, dt_bias, lb, gate_in = prep_inputs(HV=2, gate="softplus")
    assert "needs A_log of 2 elements" in P._hard_reason(q, k, v, g, beta, None, dt_bias, gate_in, 64)
    assert "dt_bias must have HV*K=256" in P._hard_reason(q, k, v, g, beta, A_log, dt_bias[:8], gate_in, 64)
    assert "gk must be float32 / bfloat16 / float16" in P._hard_reason(q, k, v, g.double(), beta, A_log,
                                                                        dt_bias, gate_in, 64)


@pytest.mark.parametrize("gate, g_dtype", [("softplus", torch.bfloat16), ("lower_bound", torch.float32)])
def test_gate_in_kernel(ptx, gate, g_dtype):
    """use_gate_in_kernel: the kernel computes fla's gate from the raw g (-exp(A_log) softplus(g +
    dt_bias), or lower_bound sigmoid(exp(A_log) (g + dt_bias))) and its chunk-local cumsum; HV = 2
    with A_log = log 1, log 16 (strong gates on the second head: ~-16 per step), bf16 and fp32 g.
    gk and every other output within 2x of fla's error (its gate in fp32, then the cumsum)."""
    a = prep_inputs(B=1, T=64, H=1, HV=2, V=64, seed=6, gate=gate, g_dtype=g_dtype, gmin=-5.0)
    text = ptx(P.compile_for(*a, SCALE, want_qg=True, keep_ptx=True))
    _check(emulate_prep(text, a, want_qg=True), a, SCALE)


def _bits(x):
    return x.view(torch.int32) if x.dtype == torch.float32 else x.view(torch.int16)


L2_NAMES = ("q_n", "k_n", "q_rstd", "k_rstd")


@pytest.mark.parametrize("dtype, T, H, HV, gate, ctas", [
    (torch.bfloat16, 64, 1, 2, "softplus", [[(0, 1, 0)], [(0, 0, 0)]]),  # GVA, the gate in the kernel
    (torch.float16, 128, 2, 2, "none", [[(1, 1, 0)]]),  # a given gate, the second chunk of head 1
], ids=["bf16_gva_gate", "fp16_given_gate"])
def test_l2norm_in_the_kernel(ptx, dtype, T, H, HV, gate, ctas):
    """l2norm=True: the kernel reads raw q, k (norms far from 1), L2-normalizes them in smem and
    writes them out with their rstds: bitwise kda_cute_l2norm_fwd's PTX on the same q, k (and
    within one io ulp of the float64 reference, the rstds within fp32 rounding), on the emulated
    CTAs' rows only (the rest stays NaN); every other output bitwise what the kernel without the
    flag gives on those normalized q, k. GVA (HV = 2H): the group's second CTA, run alone, writes
    none of the four (only hv % (HV // H) == 0 does)."""
    from kda_cute import l2norm_fwd as L2
    from ptxsim.kda_l2norm import emulate_l2norm_fwd

    a = prep_inputs(B=1, T=T, H=H, HV=HV, V=64, dtype=dtype, seed=7, gate=gate,
                    g_dtype=torch.bfloat16 if gate != "none" else torch.float32,
                    beta_dtype=torch.float32 if dtype == torch.float16 else None)
    gen = torch.Generator().manual_seed(8)
    a[0] = (3.0 * torch.randn(a[0].shape, generator=gen)).to(dtype)
    a[1] = (0.2 * torch.randn(a[1].shape, generator=gen)).to(dtype)
    text = ptx(P.compile_for(*a, SCALE, want_qg=True, keep_ptx=True, l2norm=True))
    assert ".local" not in text.split(".entry", 1)[1], "register arrays fell to local memory"
    runs = [emulate_prep(text, a, want_qg=True, ctas=c, l2norm=True) for c in ctas]
    if HV > H:  # the second CTA of the group, run alone: no q, k, rstd written
        assert all(torch.isnan(x.float()).all() for x in runs[0][7:]), "a GVA group's second CTA wrote q / k"
    got = runs[0]
    for r in runs[1:]:  # the union of the runs (every output NaN where its CTA did not run)
        got = [torch.where(torch.isnan(x.float()), y, x) for x, y in zip(got, r, strict=True)]

    l2_text = ptx(L2.compile_for(a[0], keep_ptx=True))
    (qn, qr), (kn, kr) = emulate_l2norm_fwd(l2_text, a[0]), emulate_l2norm_fwd(l2_text, a[1])
    (wq, wqr), (wk, wkr) = ref.l2norm_fwd(a[0].double()), ref.l2norm_fwd(a[1].double())
    rows = sorted({(b, tx * 64, hv // (HV // H)) for c in ctas for tx, hv, b in c})
    written = torch.zeros(1, T, H, dtype=torch.bool)
    for b, t0, h in rows:
        written[b, t0:t0 + 64, h] = True
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    for name, x, want, w64 in zip(L2_NAMES, got[7:], (qn, kn, qr, kr), (wq, wk, wqr, wkr), strict=True):
        assert torch.isnan(x.float()[~written]).all(), f"{name} written outside the CTAs' rows"
        x, want, w64 = x[written], want[written], w64[written]
        assert torch.equal(x, want), f"{name} differs from kda_cute_l2norm_fwd's"
        if x.dtype == torch.float32:
            assert ((x.double() - w64).abs() <= 1e-5 * w64.abs()).all(), name
        else:
            w = w64.to(dtype).double()
            assert ((x.double() - w).abs() <= ulp * w.abs()).all(), f"{name}: beyond one ulp"

    b = list(a)
    b[0], b[1] = qn, kn
    plain = ptx(P.compile_for(*b, SCALE, want_qg=True, keep_ptx=True))
    want = [None] * 7
    for c in ctas:
        r = emulate_prep(plain, b, want_qg=True, ctas=c)
        want = list(r) if want[0] is None else [torch.where(torch.isnan(x.float()), y, x)
                                                for x, y in zip(want, r, strict=True)]
    for name, x, w in zip(NAMES, got[:7], want, strict=True):
        assert torch.equal(_bits(x), _bits(w)), f"{name} differs from prep on the normalized q, k"


def test_l2norm_contract_on_the_reference():
    """fwd_prep(..., l2norm=True) on raw q, k is l2norm_fwd of each, then fwd_prep: its seven, then
    q, k normalized and their rstds (the reference, as the chain's stage table calls it)."""
    a = prep_inputs(B=1, T=128, H=1, HV=2, V=64, seed=9, gate="softplus")
    d = [t.double() if torch.is_tensor(t) else t for t in a]
    gen = torch.Generator().manual_seed(10)
    d[0], d[1] = 2 * torch.randn(d[0].shape, generator=gen, dtype=torch.float64), d[1] * 3
    got = ref.fwd_prep(*d, SCALE, 64, want_qg=True, l2norm=True)
    (qn, qr), (kn, kr) = ref.l2norm_fwd(d[0]), ref.l2norm_fwd(d[1])
    want = (*ref.fwd_prep(qn, kn, *d[2:], SCALE, 64, want_qg=True), qn, kn, qr, kr)
    assert len(got) == 11
    for x, w in zip(got, want, strict=True):
        assert torch.equal(x, w)
    assert P.is_supported(*a, SCALE, l2norm=True) == P.is_supported(*a, SCALE)
