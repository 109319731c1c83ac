"""kda_cute_wy_dqkg compiles for sm_90a without a GPU, its PTX computes the contract, and
is_supported gives reasons (CPU, CI).

The compiled PTX runs on CPU in ptxsim (tools/ptxsim: `ptxsim.kda_wy.emulate_wy_dqkg`, 512
threads per CTA, mma.sync / ldmatrix / cp.async from `ptxsim.ext_wy`) and every output is checked
against the float64 reference (`kda_cute.reference.bwd_wy_dqkg`). The yardstick for the error is
fla's own: `_fla_casts` is fla's kernel in torch (its operand roundings to the io dtype before
each tl.dot, fp32 accumulation), and the kernel must stay within 2x of that error for every
output (it rounds at the same points, so the ratio is ~1)."""

import pytest
import torch

pytest.importorskip("cutlass.cute")
W = pytest.importorskip("kda_cute.wy_dqkg")
ref = pytest.importorskip("kda_cute.reference")
from ptxsim.kda_wy import emulate_wy_dqkg, wy_inputs  # noqa: E402

pytestmark = pytest.mark.usefixtures("sm90a")

NAMES = ("dq", "dk", "dv2", "db", "dg", "dAkk")
SCALE = 128**-0.5


def _fla_casts(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv, scale):
    """fla 0.6.0's chunk_kda_bwd_kernel_wy_dqkg_fused in torch, float32 with its roundings: every
    tl.dot takes io-dtype operands (bf16(dw), bf16(k E), bf16 of the masked dA and of dA A^T), the
    rest in fp32. T % 64 == 0. Returns the contract's six outputs."""
    io = q.dtype
    B, T, H, K = q.shape
    HV = v.shape[2]
    NT = T // 64

    def ch(x):  # [B, T, HV, X] -> [B, NT, HV, 64, X] float32
        return x.float().view(B, NT, 64, x.shape[2], -1).transpose(2, 3)

    def un(x):
        return x.transpose(2, 3).reshape(B, T, HV, -1)

    def rd(x):  # round to the io dtype
        return x.to(io).float()

    qc, kc = (ch(x.repeat_interleave(HV // H, dim=2)) for x in (q, k))
    vc, vnc, doc, dvc, gc, Ac = ch(v), ch(v_new), ch(do), ch(dv), ch(gk), ch(Akk)
    bc = ch(beta.unsqueeze(-1).float())
    hc, dhc = h.float(), dh.float()  # [B, NT, HV, K, V]
    gn = gc[..., -1:, :]
    E = torch.exp2(gc)
    AT = Ac.transpose(-1, -2)
    dq = (doc @ hc.transpose(-1, -2)) * E * scale
    dkp = (vnc @ dhc.transpose(-1, -2)) * torch.exp2(gn - gc)
    dw = -rd(dvc @ hc.transpose(-1, -2))
    kg = kc * E
    dA = dvc @ vc.transpose(-1, -2) + dw @ rd(kg).transpose(-1, -2)
    dvb = AT @ dvc
    dkb = AT @ dw
    db = (dvb * vc).sum(-1) + (dkb * kg).sum(-1)
    dgk = rd(hc * dhc).sum(-1) * torch.exp2(gn[..., 0, :]) + (kc * dkp).sum(-2)
    last = torch.zeros(64, 1)
    last[-1] = 1.0
    dg = qc * dq - kc * dkp + last * dgk.unsqueeze(-2) + kg * dkb * bc
    dk = dkp + dkb * E * bc
    strict = torch.tril(torch.ones(64, 64), -1)
    m = rd(dA * strict * bc.transpose(-1, -2))
    dAkk = -(AT @ rd(m @ AT)) * strict
    return (un(dq), un(dk), un(dvb * bc).to(v.dtype), un(db.unsqueeze(-1))[..., 0], un(dg), un(dAkk))


def _check(got, args, scale, rows=None):
    """Every output finite (the poison overwritten) and within 2x of fla's error vs float64 (on the
    chunks `rows` = [(b, t0, hv)] only, when given)."""
    want = ref.bwd_wy_dqkg(*[t.double() for t in args], scale)
    fla = _fla_casts(*args, scale)

    def sel(x):
        if rows is None:
            return x
        return torch.stack([x[b, t0:t0 + 64, hv] for b, t0, hv in rows])

    errs = {}
    for name, x, w, f in zip(NAMES, got, want, fla, strict=True):
        x, w, f = sel(x), sel(w), sel(f)
        assert torch.isfinite(x).all(), f"{name}: unwritten (NaN) entries"
        e, ef = ref.rel_err(x, w), ref.rel_err(f, w)
        errs[name] = (e, ef)
        assert e <= 2.0 * ef + 1e-6, (name, e, ef)
    return errs


def test_compiles_for_sm90a_and_the_ptx_computes_the_contract(ptx):
    """bf16, V = 256 (four V tiles: the 2-stage ring refilled twice), one CTA: the PTX (bf16
    mma.sync, ldmatrix, cp.async; no local-memory arrays) run by the interpreter matches float64
    within 2x of fla's error on every output."""
    a = wy_inputs(B=1, T=64, H=1, HV=1, V=256, seed=0)
    text = ptx(W.compile_for(*a, SCALE, keep_ptx=True))
    assert ".entry" in text and "kda_cute_wy_dqkg" in text.split(".entry", 1)[1].split("(", 1)[0]
    assert "sm_90a" in text
    body = text.split(".entry", 1)[1]
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in body
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in body
    assert "cp.async.cg.shared.global" in body
    assert ".local" not in body, "register arrays fell to local memory"
    _check(emulate_wy_dqkg(text, a), a, SCALE)


def test_gva_batch_and_chunk_indexing(ptx):
    """B2 T128 H1 HV2 V64 with bf16 beta: the CTA of the second chunk, second value head, second
    batch (q / k read at head hv // 2, h / dh at chunk 1) and the first CTA, against float64."""
    a = wy_inputs(B=2, T=128, H=1, HV=2, V=64, seed=1)
    text = ptx(W.compile_for(*a, SCALE, keep_ptx=True))
    got = emulate_wy_dqkg(text, a, ctas=[(1, 1, 1), (0, 0, 0)])
    _check(got, a, SCALE, rows=[(1, 64, 1), (0, 0, 0)])


def test_fp16_fp32_beta_strong_gate(ptx):
    """fp16 operands, fp32 beta, gates near -2 per step (exp2 arguments stay <= 0), V = 64."""
    a = wy_inputs(B=1, T=64, H=1, HV=1, V=64, dtype=torch.float16, beta_dtype=torch.float32, gmin=-2.0,
                  seed=2)
    text = ptx(W.compile_for(*a, 0.25, keep_ptx=True))
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in text
    _check(emulate_wy_dqkg(text, a), a, 0.25)


def _fla_dAqk(v_new, do, scale):
    """fla 0.6.0's chunk_kda_bwd_dAv dA in torch: tl.dot of the io-dtype do and v_new into fp32,
    x scale, lower with the diagonal, per chunk of 64. T % 64 == 0. [B, T, HV, 64] float32."""
    B, T, HV, V = do.shape

    def ch(x):  # [B, T, HV, V] -> [B, NT, HV, 64, V] float32
        return x.float().view(B, T // 64, 64, HV, V).transpose(2, 3)

    dA = (scale * (ch(do) @ ch(v_new).transpose(-1, -2))).tril()
    return dA.transpose(2, 3).reshape(B, T, HV, 64)


@pytest.mark.parametrize(
    "kw, scale, ctas",
    [
        # bf16, V = 192: three V tiles (the ring refilled once), one CTA
        (dict(B=1, T=64, H=1, HV=1, V=192, seed=4), SCALE, None),
        # fp16, fp32 beta, GVA: the second chunk / value head / batch's CTA and the first
        (dict(B=2, T=128, H=1, HV=2, V=64, dtype=torch.float16, beta_dtype=torch.float32, seed=5), 0.25,
         [(1, 1, 1), (0, 0, 0)]),
    ],
    ids=["bf16-V192", "fp16-gva"],
)
def test_want_dAqk_adds_dAv_dA_and_leaves_the_rest_bitwise(ptx, kw, scale, ctas):
    """want_dAqk: the seventh output is fla's chunk_kda_bwd_dAv dA = scale tril(do v_new^T) (fp32,
    poisoned first): within 2x of fla's error vs float64 (`bwd_dAv`), exactly zero above the
    diagonal; the six other outputs are bitwise those of the want_dAqk=False kernel (which never
    writes dAqk's slot: the harness checks)."""
    a = wy_inputs(**kw)
    on = ptx(W.compile_for(*a, scale, want_dAqk=True, keep_ptx=True))
    off = ptx(W.compile_for(*a, scale, keep_ptx=True))
    assert on != off and ".local" not in on.split(".entry", 1)[1], "register arrays fell to local memory"
    got = emulate_wy_dqkg(on, a, ctas=ctas, want_dAqk=True)
    base = emulate_wy_dqkg(off, a, ctas=ctas)
    assert len(got) == 7 and len(base) == 6
    rows = None if ctas is None else [(b, 64 * tx, hy) for tx, hy, b in ctas]
    _check(base, a, scale, rows)
    for name, x, y in zip(NAMES, got[:6], base, strict=True):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"{name} changed by want_dAqk"

    v_new, do = a[3], a[8]
    Aqk = torch.zeros(*do.shape[:3], 64, dtype=do.dtype)  # bwd_dAv's dv term only
    want = ref.bwd_dAv(*[t.double() for t in (v_new, do, Aqk)], scale)[0]
    fla = _fla_dAqk(v_new, do, scale)
    chunks = rows or [(b, t0, hv) for b in range(do.shape[0]) for t0 in range(0, do.shape[1], 64)
                      for hv in range(do.shape[2])]
    x, w, f = (torch.stack([t[b, t0:t0 + 64, hv] for b, t0, hv in chunks]) for t in (got[6], want, fla))
    assert torch.isfinite(x).all(), "dAqk: unwritten (NaN) entries"
    upper = torch.triu(torch.ones(64, 64, dtype=torch.bool), 1)
    assert (x[:, upper] == 0).all(), "dAqk: nonzero above the diagonal"
    assert (x[:, ~upper] != 0).all()
    e, ef = ref.rel_err(x, w), ref.rel_err(f, w)
    print(f"dAqk rel err vs float64: ours {e:.3e}, fla {ef:.3e}, ratio {e / ef:.3f}")
    assert e <= 2.0 * ef + 1e-9, (e, ef)


def test_fla_cast_model_is_the_contract():
    """The yardstick itself: in float64 the fla-cast model equals the reference (so its float32
    error is rounding only), and in float32 its error sits at the bf16 level."""
    a = wy_inputs(B=1, T=128, H=1, HV=2, V=128, seed=3)
    want = ref.bwd_wy_dqkg(*[t.double() for t in a], SCALE)
    errs = _check(_fla_casts(*a, SCALE), a, SCALE)
    for name, (e, _) in errs.items():
        assert e < 2**-6, (name, e)
    assert all(torch.isfinite(w).all() for w in want)


def _small(**kw):
    return wy_inputs(B=1, T=64, H=1, HV=2, V=64, **kw)


def test_is_supported_reasons_on_cpu():
    a = _small()
    assert "CUDA" in W.is_supported(*a, SCALE)  # no GPU here (or tensors on CPU)


def test_unsupported_call_raises():
    """The shared checks (kda_cute._warp, tests/kda_cute/test_warp.py) gate the kernel: a call
    they refuse is a reason from is_supported and a ValueError from the contract function."""
    a = wy_inputs(T=96)
    assert "multiple of the chunk" in W.is_supported(*a, SCALE)
    with pytest.raises(ValueError, match="unsupported call"):
        W.bwd_wy_dqkg(*a, SCALE)


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda a: a.__setitem__(7, a[7].float()), "h dtype"),
        (lambda a: a.__setitem__(6, a[6][..., :32].contiguous()), "chunk"),
        (lambda a: a.__setitem__(9, a[9][:, :, :, :64].contiguous()), "dh must be"),
        (lambda a: a.__setitem__(3, a[3][..., :32].contiguous()), "v_new must be"),
    ],
)
def test_is_supported_rejects(mutate, needle):
    """wy_dqkg's own operands (v_new, Akk, h, dh): shapes and dtypes."""
    a = _small()
    mutate(a)
    r = W.is_supported(*a, SCALE)
    assert r is not None and needle in r, r
