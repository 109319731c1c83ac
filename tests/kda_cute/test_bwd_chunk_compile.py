"""kda_cute_bwd_chunk compiles for sm_90a without a GPU, its PTX equals the two kernels it fuses,
and is_supported gives reasons (CPU, CI).

The fused kernel is kda_cute_wy_dqkg's class with the intra walk after its epilogue (the hand-over
in smem instead of global memory). The interpreter (tools/ptxsim: `ptxsim.kda_wy.emulate_bwd_chunk`)
runs its PTX, and the same inputs go through the two standalone kernels' PTX (kda_cute_wy_dqkg with
want_dAqk, then kda_cute_intra with fold_dg): dq, dk, dv2, db must be bit for bit theirs, dg equal
but for the fold's summation order (4 groups of one 16-row block here against 2 of two there).
Both standalone kernels are checked against float64 and fla's error in their own tests
(test_wy_dqkg_compile.py, test_intra_compile.py); here each output is also checked against the
float64 reference of the whole contract (`kda_cute.reference.bwd_chunk`). The gate build (A_log:
fla's kda_gate_bwd inside) is checked against the build without it (its other outputs bit for bit)
and, with float64 as the yardstick, against that build's dg put through the gate's backward in fp32
(what fla's gate kernel would compute from it)."""

import pytest
import torch

pytest.importorskip("cutlass.cute")
C = pytest.importorskip("kda_cute.bwd_chunk")
ref = pytest.importorskip("kda_cute.reference")
from kda_cute import intra, wy_dqkg  # noqa: E402
from ptxsim.kda import emulate_intra  # noqa: E402
from ptxsim.kda_wy import emulate_bwd_chunk, emulate_wy_dqkg, wy_inputs  # noqa: E402

pytestmark = pytest.mark.usefixtures("sm90a")

NAMES = ("dq", "dk", "dv2", "db", "dg")
SCALE = 128**-0.5


def _two_kernels(ptx, a, scale, ctas):
    """The standalone kernels' PTX on the same inputs: wy_dqkg (want_dAqk), then intra (fold_dg)."""
    wy = emulate_wy_dqkg(ptx(wy_dqkg.compile_for(*a, scale, want_dAqk=True, keep_ptx=True)), a, ctas=ctas,
                         want_dAqk=True)
    dq, dk, dv2, db, dg, dAkk, dAqk = wy
    ia = [a[0], a[1], a[4], a[5], dAqk, dAkk, dq, dk, db, dg]
    dq, dk, db, dg = emulate_intra(ptx(intra.compile_for(*ia, fold_dg=True, keep_ptx=True)), ia, ctas=ctas)
    return dq, dk, dv2, db, dg


def _rows(x, ctas):
    return torch.stack([x[b, 64 * tx:64 * tx + 64, hv] for tx, hv, b in ctas])


@pytest.mark.parametrize(
    "kw, scale, ctas",
    [
        (dict(B=1, T=64, H=1, HV=1, V=128, seed=0), SCALE, [(0, 0, 0)]),
        # V = 256: four V tiles, the 2-stage ring refilled twice before the hand-over
        (dict(B=1, T=64, H=1, HV=1, V=256, seed=4), SCALE, [(0, 0, 0)]),
        # fp16, fp32 beta, gates near -2 per step, GVA: the second chunk / value head / batch's CTA
        (dict(B=2, T=128, H=1, HV=2, V=64, dtype=torch.float16, beta_dtype=torch.float32, gmin=-2.0, seed=5),
         0.25, [(1, 1, 1)]),
    ],
    ids=["bf16-V128", "bf16-V256", "fp16-gva-strong"],
)
def test_ptx_equals_wy_dqkg_then_intra(ptx, kw, scale, ctas):
    a = wy_inputs(**kw)
    text = ptx(C.compile_for(*a, scale, keep_ptx=True))
    entry = text.split(".entry", 1)[1]
    assert "kda_cute_bwd_chunk" in entry.split("(", 1)[0] and "sm_90a" in text
    assert ".local" not in entry, "register arrays fell to local memory"
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in entry  # the walk's cross sums
    assert "mma.sync.aligned.m16n8k16.row.col.f32." in entry  # the WY part
    assert "prefetch" not in entry  # the walk's inputs are in smem
    got = emulate_bwd_chunk(text, a, ctas=ctas)
    two = _two_kernels(ptx, a, scale, ctas)
    want = ref.bwd_chunk(*[t.double() for t in a], scale)[:5]  # (no gate: dA_log, ddt_bias None)
    for name, x, y, w in zip(NAMES, got, two, want, strict=True):
        x, y, w = _rows(x, ctas), _rows(y, ctas), _rows(w, ctas)
        assert torch.isfinite(x).all(), f"{name}: unwritten (NaN) entries"
        if name == "dg":
            assert ref.rel_err(x.double(), y.double()) < 1e-6, name
        else:
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"{name}: not the two kernels'"
        e, e2 = ref.rel_err(x, w), ref.rel_err(y, w)
        print(f"{name}: rel err vs float64 {e:.3e} (two kernels {e2:.3e})")
        assert e <= 1.01 * e2 + 1e-7, (name, e, e2)


def test_emit_bf16_writes_the_cast_of_the_fp32_result(ptx):
    """emit_bf16 (the chain's build when HV == H): dq, dk bit for bit the bf16 cast of the fp32
    build's; dv2, db, dg the same."""
    a = wy_inputs(B=1, T=64, H=1, HV=1, V=64, seed=7)
    f32 = emulate_bwd_chunk(ptx(C.compile_for(*a, SCALE, keep_ptx=True)), a)
    b16 = emulate_bwd_chunk(ptx(C.compile_for(*a, SCALE, emit_bf16=True, keep_ptx=True)), a, emit_bf16=True)
    for name, x, y in zip(NAMES, b16, f32, strict=True):
        if name in ("dq", "dk"):
            assert x.dtype == torch.bfloat16 and torch.equal(x, y.to(torch.bfloat16)), name
        else:
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name


def test_is_supported_reasons_on_cpu():
    a = wy_inputs(B=1, T=64, H=1, HV=2, V=64)
    assert "CUDA" in C.is_supported(*a, SCALE)


def test_unsupported_call_raises():
    a = wy_inputs(T=96)
    assert "multiple of the chunk" in C.is_supported(*a, SCALE)
    with pytest.raises(ValueError, match="unsupported call"):
        C.bwd_chunk(*a, SCALE)


def test_l2norm_build_is_the_l2norm_backward_of_dq_dk(ptx):
    """With q_rstd, k_rstd (use_qk_l2norm_in_kernel, HV == H) dq, dk leave through fla's l2norm_bwd
    (dx = dy r - y (dy . y) r, y the normalized q / k the kernel reads): against float64, within 2x
    of the error of the two-stage path it replaces (the emit_bf16 build's dq / dk, then l2norm_bwd
    in fp32); dv2, db, dg bit for bit the build without it."""
    a = wy_inputs(B=1, T=64, H=1, HV=1, V=64, seed=3)
    g = torch.Generator().manual_seed(9)
    rstd = [torch.rand(1, 64, 1, generator=g) + 0.5 for _ in range(2)]
    for i in (0, 1):  # the normalized q, k the chain passes with the flag
        x = a[i].float()
        a[i] = (x / x.norm(dim=-1, keepdim=True)).to(a[i].dtype)
    got = emulate_bwd_chunk(ptx(C.compile_for(*a, SCALE, q_rstd=rstd[0], k_rstd=rstd[1], keep_ptx=True)), a,
                            rstd=tuple(rstd))
    b16 = emulate_bwd_chunk(ptx(C.compile_for(*a, SCALE, emit_bf16=True, keep_ptx=True)), a, emit_bf16=True)
    want = ref.bwd_chunk(*[t.double() for t in a], SCALE, q_rstd=rstd[0].double(), k_rstd=rstd[1].double())
    for i, name in enumerate(("dq", "dk")):
        x = got[i]
        assert x.dtype == a[0].dtype and torch.isfinite(x).all(), name
        two = ref.l2norm_bwd(a[i].float(), rstd[i], b16[i].float()).to(a[0].dtype)
        e, e2 = ref.rel_err(x, want[i]), ref.rel_err(two, want[i])
        print(f"{name}: rel err vs float64 {e:.3e} (emit_bf16 + l2norm_bwd {e2:.3e})")
        assert e <= 2 * e2 + 1e-7, (name, e, e2)
    for name, x, y in zip(NAMES[2:], got[2:], b16[2:], strict=True):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name


def test_is_supported_l2norm_reasons():
    a = wy_inputs(B=1, T=64, H=1, HV=2, V=64)
    r = torch.ones(1, 64, 1)
    assert "HV == H" in C._rstd_reason(a[0], a[2], r, r)
    assert "together" in C._rstd_reason(a[0], a[2], r, None)
    a = wy_inputs(B=1, T=64, H=1, HV=1, V=64)
    assert "float32" in C._rstd_reason(a[0], a[2], r.double(), r)
    assert C._rstd_reason(a[0], a[2], r, r) == "no CUDA device"  # the shapes pass; then the layout check


# ---------------------------------------------------------------------------- the gate's backward
_BASE: dict = {}


def _gate_set(ptx, dtype):
    """Inputs (q, k normalized, so the l2norm build may take them) and the build without the gate
    on them: its fp32 dg is what fla's gate kernel would read (the path the gate build replaces).
    bf16: B1 T128 (two chunks: the partials' chunk index); fp16: B1 T64."""
    if dtype not in _BASE:
        T, seed = (128, 21) if dtype == torch.bfloat16 else (64, 22)
        a = wy_inputs(B=1, T=T, H=1, HV=1, V=64, dtype=dtype, seed=seed)
        for i in (0, 1):
            x = a[i].float()
            a[i] = (x / x.norm(dim=-1, keepdim=True)).to(dtype)
        _BASE[dtype] = (a, emulate_bwd_chunk(ptx(C.compile_for(*a, SCALE, keep_ptx=True)), a))
    return _BASE[dtype]


def _raw_gate(shape, dtype, seed):
    """A raw gate spread wide: entries past fla's softplus threshold (20) and, where the dtype holds
    it, the no-op token's -1e30 (kda_chain.varlen's padding)."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(*shape, generator=gen) * 3
    g[0, :4, 0, :8] = 25.0
    if dtype != torch.float16:
        g[0, 5, 0, :] = -1e30
    return g.to(dtype), gen


@pytest.mark.parametrize(
    "io, g_dtype, form, bias, l2norm",
    [
        (torch.bfloat16, torch.bfloat16, "softplus", True, False),
        (torch.bfloat16, torch.bfloat16, "lower_bound", False, False),
        (torch.float16, torch.float16, "lower_bound", True, True),
        (torch.float16, torch.float32, "softplus", False, False),
    ],
    ids=["bf16-softplus-bias", "bf16-lb", "fp16-lb-bias-l2norm", "fp16-g32-softplus"],
)
def test_gate_build_is_the_gate_backward_of_dg(ptx, io, g_dtype, form, bias, l2norm):
    """With A_log (use_gate_in_kernel) the folded dg goes through fla's kda_gate_bwd in the kernel:
    dg_raw in g's dtype, the per-chunk dA_log / ddt_bias partials summed on the host. Against
    float64, each within 1.25x (+1e-6) of the error of the path it replaces (the build without the
    gate, then the gate's backward in fp32 on its dg, as fla's kernel); dv2, db (and dq, dk without
    l2norm) bit for bit the build without it."""
    a, base = _gate_set(ptx, io)
    B, T, HV, K = a[4].shape
    g, gen = _raw_gate((B, T, HV, K), g_dtype, 5)
    A_log = torch.rand(HV, generator=gen) * 2 - 0.5
    dt_bias = torch.randn(HV * K, generator=gen) * 0.5 if bias else None
    lb = -5.0 if form == "lower_bound" else None
    gate = dict(g=g, A_log=A_log, dt_bias=dt_bias, lower_bound=lb)
    kw, rstd = {}, None
    if l2norm:
        r = torch.Generator().manual_seed(9)
        rstd = tuple(torch.rand(B, T, 1, generator=r) + 0.5 for _ in range(2))
        kw = dict(q_rstd=rstd[0], k_rstd=rstd[1])
    text = ptx(C.compile_for(*a, SCALE, **kw, **gate, keep_ptx=True))
    assert ".local" not in text.split(".entry", 1)[1], "register arrays fell to local memory"
    got = emulate_bwd_chunk(text, a, rstd=rstd, gate=gate)
    for i, name in enumerate(NAMES[:4]):
        if l2norm and name in ("dq", "dk"):
            continue
        same = torch.equal(got[i].view(torch.uint8), base[i].view(torch.uint8))
        assert same, f"{name}: not the build's without the gate"
    dg, dAp, dbp = got[4:]
    assert dg.dtype == g_dtype and torch.isfinite(dg).all()
    assert torch.isfinite(dAp).all() and (dbp is None) == (dt_bias is None)
    assert dbp is None or torch.isfinite(dbp).all()
    dA_log, ddt = C._reduce(dAp, dbp, A_log, dt_bias)
    assert dA_log.shape == A_log.shape and dA_log.dtype == A_log.dtype
    d64 = [t.double() for t in a]
    r64 = {} if rstd is None else dict(q_rstd=rstd[0].double(), k_rstd=rstd[1].double())
    want = ref.bwd_chunk(*d64, SCALE, **r64, g=g.double(), A_log=A_log.double(),
                         dt_bias=None if dt_bias is None else dt_bias.double(), lower_bound=lb)
    two = ref.gate_bwd(g, A_log, dt_bias, base[4], lb)  # fp32: the unfused dg, then fla's gate kernel
    assert want[6] is None if dt_bias is None else ddt.shape == want[6].shape == (HV * K,)
    for name, x, y, w in zip(("dg", "dA_log", "ddt_bias"), (dg, dA_log, ddt), two, want[4:], strict=True):
        if w is None:
            assert x is None and y is None, name
            continue
        e, e2 = ref.rel_err(x, w), ref.rel_err(y, w)
        print(f"{form} {name}: rel err vs float64 {e:.3e} (unfused + fp32 gate {e2:.3e})")
        assert e <= 1.25 * e2 + 1e-6, (name, e, e2)


def test_is_supported_gate_reasons():
    a = wy_inputs(B=1, T=64, H=1, HV=2, V=64)
    gk = a[4]
    g = torch.zeros_like(gk, dtype=torch.bfloat16)
    A = torch.zeros(2)
    assert C._gate_reason(gk, None, None, None) is None
    assert "A_log" in C._gate_reason(gk, g, None, None)
    assert "raw gate" in C._gate_reason(gk, None, A, None)
    assert "[B,T,HV,K]" in C._gate_reason(gk, g[:, :32], A, None)
    assert "dtype" in C._gate_reason(gk, g.double(), A, None)
    assert "A_log must be 2" in C._gate_reason(gk, g, torch.zeros(3), None)
    assert "dt_bias must be" in C._gate_reason(gk, g, A, torch.zeros(7))
    assert "not contiguous" in C._gate_reason(gk, g.transpose(2, 3).contiguous().transpose(2, 3), A, None)
    assert C._gate_reason(gk, g, A, torch.zeros(256)) == "no CUDA device"  # the shapes pass
