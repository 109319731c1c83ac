"""kda_cute_intra compiles for sm_90a without a GPU, and is_supported gives reasons (CPU, CI).

The compiled PTX is run on CPU by ptxsim (tools/ptxsim: `ptxsim.kda.emulate_intra`, every CTA)
and checked against the float64 reference."""

import re

import pytest
import torch

pytest.importorskip("cutlass.cute")
intra = pytest.importorskip("kda_cute.intra")
from ptxsim.kda import emulate_intra  # noqa: E402


def _args(B=1, T=128, H=2, HV=2, K=128, dtype=torch.bfloat16):
    q = torch.randn(B, T, H, K).to(dtype)
    k = torch.randn(B, T, H, K).to(dtype)
    g = -torch.rand(B, T, HV, K)
    beta = torch.rand(B, T, HV).to(dtype)
    dA = [torch.randn(B, T, HV, 64) for _ in range(2)]
    dq, dk, dg = (torch.randn(B, T, HV, K) for _ in range(3))
    db = torch.randn(B, T, HV)
    return [q, k, g, beta, dA[0], dA[1], dq, dk, db, dg]


# tf32's unit roundoff (10 explicit mantissa bits): the cross sums' operands are rounded to it, so
# relative errors of ~1e-4 are expected (fla's tl.dot does the same); a wrong kernel is off by O(1).
TF32_EPS = 2.0**-11


def test_compiles_for_sm90a_and_the_ptx_computes_the_contract(monkeypatch, ptx):
    """The sm_90a PTX of the kernel (tf32 mma.sync cross sums), fold_dg on, executed by a PTX
    interpreter on CPU: dq, dk, db, dg match the float64 reference to tf32 accuracy; every
    output written."""
    ref = pytest.importorskip("kda_cute.reference")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    torch.manual_seed(0)
    a = _args(B=1, T=64, H=1, HV=1, K=128)
    a[2] = (-0.7 * torch.rand(1, 64, 1, 128)).cumsum(1) / 0.6931471805599453
    text = ptx(intra.compile_for(*a, fold_dg=True, emit_bf16=False, keep_ptx=True))
    assert "kda_cute_intra" in text and "sm_90a" in text
    assert "ex2.approx" in text  # the exp2 fast path
    body = text.split(".entry", 1)[1]
    assert ".local" not in body, "register arrays fell to local memory"
    assert "ld.global.v4" in body or "ld.global.nc.v4" in body, "16-byte loads expected"
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in text
    # mma operands are rounded (half a tf32 ulp added to the bits), not truncated
    assert re.search(r"add\.s32\s+%r\d+, %r\d+, 4096;", text)
    assert re.search(r"prefetch(\.global)?\.L2", text)  # the walk's incoming rows
    got = emulate_intra(text, a)
    want = ref.bwd_intra(*[t.double() for t in a], fold_dg=True)
    for name, x, w in zip(("dq", "dk", "db", "dg"), got, want, strict=True):
        assert torch.isfinite(x).all(), f"{name}: unwritten (NaN) entries"
        assert ref.rel_err(x, w) < TF32_EPS, (name, ref.rel_err(x, w))


def test_emit_bf16_ptx_writes_the_cast_of_the_fp32_result(monkeypatch, ptx):
    """emit_bf16 (the chain's build when HV == H): its PTX, run by the interpreter, writes dq and
    dk equal bit for bit to the bf16 cast of the fp32 build's dq and dk, and the same db, dg."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    torch.manual_seed(2)
    a = _args(B=1, T=64, H=1, HV=1, K=128)
    a[2] = (-0.7 * torch.rand(1, 64, 1, 128)).cumsum(1) / 0.6931471805599453
    f32 = emulate_intra(ptx(intra.compile_for(*a, fold_dg=True, keep_ptx=True)), a)
    text = ptx(intra.compile_for(*a, fold_dg=True, emit_bf16=True, keep_ptx=True))
    got = emulate_intra(text, a, emit_bf16=True)
    for name, x, w in zip(("dq", "dk"), got[:2], f32[:2], strict=True):
        assert x.dtype == torch.bfloat16, name
        assert torch.equal(x, w.to(torch.bfloat16)), name
    for name, x, w in zip(("db", "dg"), got[2:], f32[2:], strict=True):
        assert torch.equal(x, w), name


def test_k64_gva_strong_gate_fp16(monkeypatch, ptx):
    """K = 64 (four thread groups), GVA, fp16 q / k, gates near -5 per step: the PTX runs in the
    interpreter and matches float64 to tf32 accuracy."""
    K = 64
    ref = pytest.importorskip("kda_cute.reference")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    torch.manual_seed(1)
    a = _args(B=1, T=64, H=1, HV=2 if K == 64 else 1, K=K, dtype=torch.float16)
    a[2] = (-5.0 * torch.rand(*a[2].shape)).cumsum(1) / 0.6931471805599453
    text = ptx(intra.compile_for(*a, fold_dg=True, keep_ptx=True))
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in text
    # mma operands are rounded (half a tf32 ulp added to the bits), not truncated
    assert re.search(r"add\.s32\s+%r\d+, %r\d+, 4096;", text)
    assert re.search(r"prefetch(\.global)?\.L2", text)  # the walk's incoming rows
    got = emulate_intra(text, a)
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

