"""kda_cute_bwd_prep compiles for sm_90a without a GPU, its PTX computes bwd_prep's contract
(gate_chunk_cumsum + recompute_w_u from a saved Akk) and equals what kda_cute_prep's PTX gave the
forward bit for bit, and is_supported gives reasons (CPU, CI).

The PTX runs in the interpreter (ptxsim.kda_prep.emulate_bwd_prep); the yardstick is fla's own
error (fla's recompute_w_u in torch float32 with its roundings: w / u from the io-dtype Akk and
io-dtype operands, qg / kg rounded once)."""

import pytest
import torch

pytest.importorskip("cutlass.cute")
BP = pytest.importorskip("kda_cute.bwd_prep")
P = pytest.importorskip("kda_cute.prep")
ref = pytest.importorskip("kda_cute.reference")
from ptxsim.kda_prep import emulate_bwd_prep, emulate_prep, prep_inputs  # noqa: E402

pytestmark = pytest.mark.usefixtures("sm90a")

NAMES = ("gk", "w", "u", "qg", "kg")
SCALE = 128**-0.5


def _saved_akk(a):
    """The forward's Akk in the io dtype (the float64 solve rounded, as kda_cute_prep stores it)."""
    d = [t.double() if torch.is_tensor(t) else t for t in a]
    return ref.fwd_prep(*d, SCALE, 64)[-1].to(a[0].dtype).contiguous()


def _fla_casts(q, k, v, g, beta, A_log, dt_bias, lower_bound, gate_in, Akk):
    gk = ref.gate_chunk_cumsum(g.float(), A_log, dt_bias, lower_bound, 64, gate_in)
    io = q.dtype
    B, T, H, K = q.shape
    HV = v.shape[2]
    NT = T // 64

    def ch(x):
        return x.float().view(B, NT, 64, x.shape[2], -1).transpose(2, 3)

    def un(x):
        return x.transpose(2, 3).reshape(B, T, HV, -1).to(io)

    qc, kc = (ch(x.repeat_interleave(HV // H, dim=2)) for x in (q, k))
    vc, gc, bc, ac = ch(v), ch(gk), ch(beta.unsqueeze(-1).float()), ch(Akk)
    E = torch.exp2(gc)
    w = ac @ (kc * bc * E).to(io).float()
    u = ac @ (vc * bc).to(io).float()
    return gk, un(w), un(u), un(qc * E), un(kc * torch.exp2(gc[..., -1:, :] - gc))


def _check(got, a, Akk, rows=None):
    """Every output finite and within 2x of fla's error vs float64 (on the chunks `rows` =
    [(b, t0, hv)] only, when given)."""
    d = [t.double() if torch.is_tensor(t) else t for t in a]
    want = ref.bwd_prep(*d[:7], Akk.double(), d[7], d[8], 64)
    fla = _fla_casts(*a, Akk)

    def sel(x):
        return x if rows is None else torch.stack([x[b, t0:t0 + 64, hv] for b, t0, hv in rows])

    for name, x, w, f in zip(NAMES, got, want, fla, strict=True):
        x, w, f = sel(x), sel(w), sel(f)
        assert torch.isfinite(x).all(), f"{name}: unwritten (NaN) entries"
        e, ef = ref.rel_err(x, w), ref.rel_err(f, w)
        assert e <= 2.0 * ef + 1e-6, (name, e, ef)


def _bits(x):
    return x.view(torch.int32) if x.dtype == torch.float32 else x.view(torch.int16)


def test_compiles_and_the_ptx_computes_the_contract(ptx):
    """bf16, V = 192 (the V ring refilled), the gate in the kernel (softplus, bf16 input), one
    CTA: every output within 2x of fla's error vs float64; from the forward kernel's own Akk,
    every output equal bit for bit to what kda_cute_prep gave the forward."""
    a = prep_inputs(B=1, T=64, H=1, HV=1, V=192, seed=0, gate="softplus", g_dtype=torch.bfloat16)
    akk = _saved_akk(a)
    text = ptx(BP.compile_for(*a[:7], akk, *a[7:], keep_ptx=True))
    body = text.split(".entry", 1)[1]
    assert "kda_cute_bwd_prep" in body.split("(", 1)[0] and ".local" not in body
    assert "m16n8k8" not in body, "the solve's tf32 blocks were compiled in"
    _check(emulate_bwd_prep(text, a, akk), a, akk)
    fwd = emulate_prep(ptx(P.compile_for(*a, SCALE, want_qg=True, keep_ptx=True)), a, want_qg=True)
    for name, x, y in zip(NAMES, emulate_bwd_prep(text, a, fwd[6]), fwd[:5], strict=True):
        assert torch.equal(_bits(x), _bits(y)), name


def test_gva_batch_fp16_lower_bound(ptx):
    """fp16, fp32 beta, B2 T128 H1 HV2 V64, the lower_bound gate (fp32 g): the CTA of the second
    chunk, second value head, second batch (q / k read at head hv // 2)."""
    a = prep_inputs(B=2, T=128, H=1, HV=2, V=64, dtype=torch.float16, beta_dtype=torch.float32, seed=1,
                    gate="lower_bound", gmin=-5.0)
    akk = _saved_akk(a)
    text = ptx(BP.compile_for(*a[:7], akk, *a[7:], keep_ptx=True))
    _check(emulate_bwd_prep(text, a, akk, ctas=[(1, 1, 1)]), a, akk, rows=[(1, 64, 1)])


def test_the_forwards_gk_is_read_not_recomputed(ptx):
    """No gate in the op (fp32 step log gate, as the chain keeps gk then), GVA B1 T128 H1 HV2 V64:
    with the forward's gk given, the build that reads it (no gate, no cumsum, no gk store: gk
    comes back as it went in) gives w, u, qg, kg bit for bit what kda_cute_prep gave the forward."""
    a = prep_inputs(B=1, T=128, H=1, HV=2, V=64, seed=2, gate="none", gmin=-5.0)
    fwd = emulate_prep(ptx(P.compile_for(*a, SCALE, want_qg=True, keep_ptx=True)), a, want_qg=True)
    gk, akk = fwd[0], fwd[6]
    text = ptx(BP.compile_for(*a[:7], akk, *a[7:], keep_ptx=True, gk=gk))
    got = emulate_bwd_prep(text, a, akk, gk=gk)
    for name, x, y in zip(NAMES[1:], got[1:], fwd[1:5], strict=True):
        assert torch.equal(_bits(x), _bits(y)), name
    _check(got, a, akk)


def test_reasons_on_cpu():
    a = prep_inputs()
    akk = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16)
    assert "CUDA" in BP.is_supported(*a[:7], akk, *a[7:])
    assert "Akk shape" in BP._hard_reason(*a[:7], akk[:, :, :, :32], False, 64)
    assert "Akk dtype" in BP._hard_reason(*a[:7], akk.half(), False, 64)
    gk = torch.zeros(1, 64, 1, 128)
    assert "gk" not in (BP._gk_reason(a[3], gk, False) or "")  # (on CPU: only the device's reason)
    assert "only without the gate" in BP._gk_reason(a[3], gk, True)
    assert "fp32" in BP._gk_reason(a[3], gk.double(), False)
    assert "[B,T,HV,K]" in BP._gk_reason(a[3], gk[:, :32], False)
    with pytest.raises(ValueError, match="unsupported call: K=64"):
        BP.bwd_prep(*prep_inputs(K=64)[:7], akk, None, False)
    # g may be None beside a given gk (a packed call keeps no padded copy of a given log gate):
    # the same answers as with gk in g's place; without either, a reason
    q, k, v, _, beta, A_log, dt_bias = a[:7]
    assert BP.is_supported(q, k, v, None, beta, A_log, dt_bias, akk, None, False, gk=gk) == \
        BP.is_supported(q, k, v, gk, beta, A_log, dt_bias, akk, None, False, gk=gk)
    assert "no gk" in BP.is_supported(q, k, v, None, beta, A_log, dt_bias, akk, None, False)
    assert BP._g_or_gk(None, gk) is gk and BP._g_or_gk(a[3], gk) is a[3]
