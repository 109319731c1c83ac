"""The plain-torch reference (kda_cute.reference) against autograd through the token-by-token oracle.

Whole chain: `chunk_kda_reference` (explicit backward stages) vs `naive_kda` + torch.autograd, in
float64, relative error < 1e-9 on o, ht and every gradient, over the flag surface (GVA, initial and
final state, fused gate with/without dt_bias and with lower_bound, L2 norm, beta sigmoid,
allow_neg_eigval, strong gates, one chunk, T not a multiple of 64, chunk_size 32).
Stage units: fold_dg, emit_bf16, fwd_scan = fwd_h + fwd_o, bwd_dAv and bwd_dhu against autograd
through the forward stages they invert, and fla's output dtypes for bf16 inputs.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch.nn.functional as F
from kda_cute.reference import (
    RCP_LN2,
    beta_sigmoid_bwd,
    beta_sigmoid_fwd,
    bwd_dAv,
    bwd_dhu,
    bwd_intra,
    bwd_wy_dqkg,
    chunk_kda_reference,
    chunk_local_cumsum,
    dg_cumsum,
    fwd_h,
    fwd_intra,
    fwd_o,
    fwd_scan,
    gate_bwd,
    gate_chunk_cumsum,
    gva_sum,
    l2norm_bwd,
    l2norm_fwd,
    naive_gate,
    naive_kda,
    naive_recurrent_kda,
    recompute_w_u,
    rel_err,
)

F64 = torch.float64
TOL = 1e-9


def _make(B=2, T=200, H=2, HV=4, K=32, V=16, *, dtype=F64, h0=True, gate=False, dt_bias=True,
          A_log=True, l2=False, bsig=False, strong=False, seed=0):
    """Fresh random inputs. Without the in-op L2 norm, k is unit-norm (the delta rule's contract:
    beta |k|^2 <= 2 keeps I - beta k k^T a contraction); q is raw. The per-step gate is negative:
    -softplus(randn), or uniform down to -5 per step (strong); raw randn when the gate is fused."""
    gen = torch.Generator().manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, generator=gen, dtype=F64)

    q, k, v = rn(B, T, H, K), rn(B, T, H, K), rn(B, T, HV, V)
    if not l2:
        k = F.normalize(k, dim=-1)
    if gate:
        g = rn(B, T, HV, K)
    elif strong:
        g = -5.0 * torch.rand(B, T, HV, K, generator=gen, dtype=F64)
    else:
        g = -F.softplus(rn(B, T, HV, K))
    beta = rn(B, T, HV) if bsig else torch.rand(B, T, HV, generator=gen, dtype=F64)
    extra = {
        'initial_state': rn(B, HV, K, V) if h0 else None,
        'A_log': rn(HV) * 0.5 if gate and A_log else None,
        'dt_bias': rn(HV * K) if gate and dt_bias else None,
    }
    do, dht = rn(B, T, HV, V), rn(B, HV, K, V)
    cast = {'q': q, 'k': k, 'v': v, 'g': g, 'beta': beta}
    return {n: x.to(dtype) for n, x in cast.items()}, extra, do.to(dtype), dht


CASES = {
    # name: (shape kwargs, input kwargs, chunk_kda flags)
    'one_chunk_mha': ({'T': 64, 'H': 2, 'HV': 2, 'K': 16, 'V': 16}, {'h0': False}, {}),
    'gva_state': ({'T': 200, 'K': 32, 'V': 16}, {}, {}),
    'short_T37_nostate': ({'T': 37, 'K': 16, 'V': 32}, {'h0': False}, {}),
    'strong_gate': ({'T': 200, 'K': 16, 'V': 16}, {'strong': True}, {}),
    'gate_dt_bias': ({'T': 150, 'K': 32, 'V': 16}, {'gate': True}, {'use_gate_in_kernel': True}),
    'gate_no_dt_bias': ({'T': 100, 'K': 16, 'V': 32}, {'gate': True, 'dt_bias': False},
                        {'use_gate_in_kernel': True}),
    'gate_lower_bound': ({'T': 130, 'K': 16, 'V': 16}, {'gate': True},
                         {'use_gate_in_kernel': True, 'lower_bound': -5.0}),
    'gate_lower_bound_no_A_log': ({'T': 70, 'K': 16, 'V': 16}, {'gate': True, 'A_log': False},
                                  {'use_gate_in_kernel': True, 'lower_bound': -3.0}),
    'l2norm_sigmoid_neg_eigval': ({'T': 130, 'K': 32, 'V': 16}, {'l2': True, 'bsig': True},
                                  {'use_qk_l2norm_in_kernel': True, 'use_beta_sigmoid_in_kernel': True,
                                   'allow_neg_eigval': True}),
    'everything': ({'T': 129, 'K': 16, 'V': 32}, {'l2': True, 'bsig': True, 'gate': True},
                   {'use_qk_l2norm_in_kernel': True, 'use_beta_sigmoid_in_kernel': True,
                    'use_gate_in_kernel': True}),
    'chunk32': ({'T': 100, 'K': 16, 'V': 16}, {}, {'chunk_size': 32}),
}


@pytest.mark.parametrize('name', list(CASES))
def test_chain_matches_autograd_through_recurrence(name):
    shape, inputs, flags = CASES[name]
    flags = dict(flags)
    chunk_size = flags.pop('chunk_size', 64)
    t, extra, do, dht = _make(**shape, **inputs)
    leaves = {n: x.clone().requires_grad_() for n, x in {**t, **extra}.items() if x is not None}
    names = list(leaves)

    def run(fn, **kw):
        args = {n: leaves.get(n) for n in ('initial_state', 'A_log', 'dt_bias')}
        o, ht = fn(leaves['q'], leaves['k'], leaves['v'], leaves['g'], leaves['beta'],
                   output_final_state=True, **args, **flags, **kw)
        grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), [leaves[n] for n in names])
        return o, ht, dict(zip(names, grads, strict=True))

    o_ref, ht_ref, g_ref = run(naive_kda)
    o, ht, g = run(chunk_kda_reference, chunk_size=chunk_size)
    assert o.dtype == F64 and ht.dtype == F64
    errs = {'o': rel_err(o, o_ref), 'ht': rel_err(ht, ht_ref)}
    errs.update({f'd{n}': rel_err(g[n], g_ref[n]) for n in names})
    assert max(errs.values()) < TOL, errs


def test_chain_without_final_state_and_bf16_smoke():
    """output_final_state=False gives ht None and dh0 from do alone; the bf16/fp32 path runs, returns
    fla's dtypes and stays close to float64."""
    t, extra, do, _ = _make(T=96, K=16, V=16)
    h0 = extra['initial_state'].clone().requires_grad_()
    leaves = {n: x.clone().requires_grad_() for n, x in t.items()}
    o, ht = chunk_kda_reference(*leaves.values(), initial_state=h0)
    assert ht is None
    grads = torch.autograd.grad((o * do).sum(), [*leaves.values(), h0])
    o_ref, _ = naive_kda(*leaves.values(), initial_state=h0)
    grads_ref = torch.autograd.grad((o_ref * do).sum(), [*leaves.values(), h0])
    assert rel_err(o, o_ref) < TOL
    assert all(rel_err(a, b) < TOL for a, b in zip(grads, grads_ref, strict=True))

    lo = {n: x.detach().to(torch.bfloat16).requires_grad_() for n, x in t.items()}
    h0f = extra['initial_state'].float().requires_grad_()
    o16, ht16 = chunk_kda_reference(*lo.values(), initial_state=h0f, output_final_state=True)
    assert o16.dtype == torch.bfloat16 and ht16.dtype == torch.float32
    g16 = torch.autograd.grad((o16.float() * do.float()).sum(), [*lo.values(), h0f])
    assert [x.dtype for x in g16] == [torch.bfloat16] * 5 + [torch.float32]
    assert rel_err(o16, o_ref) < 2e-2
    assert all(rel_err(a, b) < 5e-2 for a, b in zip(g16, grads_ref, strict=True))


def _load_fla_naive():
    """fla's kda/naive.py loaded from its file alone: importing the fla package pulls in Triton and
    takes tens of seconds on CPU, the naive module itself needs only torch and einops."""
    spec = importlib.util.find_spec('fla')
    if spec is None or not spec.submodule_search_locations:
        pytest.skip('fla-core not installed')
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / 'ops' / 'kda' / 'naive.py'
    pytest.importorskip('einops')
    mod_spec = importlib.util.spec_from_file_location('_fla_kda_naive', path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def test_naive_matches_fla_naive():
    """Our oracle agrees with fla's own naive_recurrent_kda (which computes in float32)."""
    fla_naive = _load_fla_naive()
    t, extra, _, _ = _make(T=50, K=16, V=16)
    o, ht = naive_recurrent_kda(*t.values(), initial_state=extra['initial_state'], output_final_state=True)
    o2, ht2 = fla_naive.naive_recurrent_kda(*t.values(), initial_state=extra['initial_state'],
                                            output_final_state=True)
    assert rel_err(o2, o) < 1e-5 and rel_err(ht2, ht) < 1e-5


# ------------------------------------------------------------------------------------------------
# Stage units
# ------------------------------------------------------------------------------------------------

def _stage_inputs(dtype=F64, T=150, **kw):
    """Run the forward and backward stages once (as the chain does) and hand back every tensor."""
    t, extra, do, dht = _make(T=T, dtype=dtype, **kw)
    q, k, v, g, beta = t.values()
    h0 = extra['initial_state'].to(F64 if dtype == F64 else torch.float32)
    scale = q.shape[-1] ** -0.5
    gk = gate_chunk_cumsum(g, None, None, None, 64, False)
    w, u, qg, kg, Aqk, Akk = fwd_intra(q, k, v, gk, beta, scale, 64, want_qg=True)
    h, v_new, ht = fwd_h(kg, w, u, gk, h0, True)
    dAqk, dv = bwd_dAv(v_new, do, Aqk, scale)
    dh, dh0, dv2 = bwd_dhu(qg, kg, w, gk, h0, dht.to(h0.dtype), do, dv, scale)
    dq, dk, dv3, db, dg, dAkk = bwd_wy_dqkg(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv2, scale)
    return {
        'q': q, 'k': k, 'v': v, 'g': g, 'beta': beta, 'h0': h0, 'scale': scale, 'gk': gk,
        'w': w, 'u': u, 'qg': qg, 'kg': kg, 'Aqk': Aqk, 'Akk': Akk, 'h': h, 'v_new': v_new, 'ht': ht,
        'do': do, 'dht': dht, 'dAqk': dAqk, 'dv': dv, 'dh': dh, 'dh0': dh0, 'dv2': dv2,
        'dq': dq, 'dk': dk, 'dv3': dv3, 'db': db, 'dg': dg, 'dAkk': dAkk,
    }


def test_fold_dg_is_dg_cumsum_of_unfolded():
    s = _stage_inputs()
    args = [s[n] for n in ('q', 'k', 'gk', 'beta', 'dAqk', 'dAkk', 'dq', 'dk', 'db', 'dg')]
    dq, dk, db, dg = bwd_intra(*args)
    dq2, dk2, db2, dg2 = bwd_intra(*args, fold_dg=True)
    assert torch.equal(dq, dq2) and torch.equal(dk, dk2) and torch.equal(db, db2)
    assert rel_err(dg2, dg_cumsum(dg, 64)) < 1e-14


def test_emit_bf16_is_the_cast():
    s = _stage_inputs(dtype=torch.bfloat16, HV=2)
    args = [s[n] for n in ('q', 'k', 'gk', 'beta', 'dAqk', 'dAkk', 'dq', 'dk', 'db', 'dg')]
    dq, dk, db, dg = bwd_intra(*args)
    dq16, dk16, db16, dg16 = bwd_intra(*args, emit_bf16=True)
    assert dq.dtype == torch.float32 and dq16.dtype == torch.bfloat16 and dk16.dtype == torch.bfloat16
    assert torch.equal(dq16, dq.to(torch.bfloat16)) and torch.equal(dk16, dk.to(torch.bfloat16))
    assert torch.equal(db, db16) and torch.equal(dg, dg16)


@pytest.mark.parametrize('T', [64, 150])
def test_fwd_scan_is_fwd_h_plus_fwd_o(T):
    s = _stage_inputs(T=T)
    o = fwd_o(s['q'], s['v_new'], s['gk'], s['Aqk'], s['h'], s['scale'])
    o2, ht2 = fwd_scan(s['q'], s['qg'], s['kg'], s['w'], s['u'], s['gk'], s['Aqk'], s['h0'], True, s['scale'])
    assert rel_err(o2, o) < 1e-14 and rel_err(ht2, s['ht']) < 1e-14
    args = (s['kg'], s['w'], s['u'], s['gk'], s['Aqk'])
    assert fwd_scan(s['q'], s['qg'], *args, None, False, s['scale'])[1] is None
    # the oracle gates q itself: qg (the kernel's input) is not read
    assert torch.equal(fwd_scan(s['q'], None, *args, s['h0'], True, s['scale'])[0], o2)


def test_fwd_intra_returns_qg_only_when_asked():
    """fla's chunk_kda_fwd_intra stores qg only with disable_recompute; the reference follows."""
    s = _stage_inputs()
    got = fwd_intra(s['q'], s['k'], s['v'], s['gk'], s['beta'], s['scale'], 64)
    assert got[2] is None
    for a, b in zip(got[:2] + got[3:], (s['w'], s['u'], s['kg'], s['Aqk'], s['Akk']), strict=True):
        assert torch.equal(a, b)
    assert rel_err(s['qg'], s['q'].repeat_interleave(2, 2) * torch.exp2(s['gk'])) < 1e-14


def test_recompute_w_u_matches_fwd_intra():
    s = _stage_inputs()
    w, u, qg, kg = recompute_w_u(s['q'], s['k'], s['v'], s['beta'], s['Akk'], s['gk'])
    for a, b in ((w, s['w']), (u, s['u']), (qg, s['qg']), (kg, s['kg'])):
        assert rel_err(a, b) < 1e-14


@pytest.mark.parametrize("gate_in", [False, True])
def test_bwd_prep_recomputes_fwd_prep(gate_in):
    """The backward's bwd_prep, from fwd_prep's own Akk and the raw gate, gives back fwd_prep's gk,
    w, u, qg, kg (float64: to rounding), with the gate in the op and without."""
    from kda_cute.reference import bwd_prep, fwd_prep

    gen = torch.Generator().manual_seed(7)
    B, T, H, HV, K, V = 1, 100, 1, 2, 16, 8
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    g = torch.randn(B, T, HV, K, generator=gen, dtype=torch.float64)
    if not gate_in:
        g = -g.abs()
    beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    A_log, dt_bias = torch.tensor([0.1, 1.5], dtype=torch.float64), torch.randn(HV * K, dtype=torch.float64)
    a = (q, k, v, g, beta, A_log, dt_bias)
    gk, w, u, qg, kg, _, Akk = fwd_prep(*a, None, gate_in, 0.25, 64, want_qg=True)
    for x, y in zip(bwd_prep(*a, Akk, None, gate_in, 64), (gk, w, u, qg, kg), strict=True):
        assert rel_err(x, y) < 1e-13


def test_dAv_and_dhu_are_autograd_of_the_forward_scan():
    """bwd_dAv's dAqk is scale x the gradient of tril(Aqk); bwd_dhu's dv2 is the gradient of u and
    dh0 that of h0, under the loss <o, do> + <ht, dht> with o, ht from fwd_h + fwd_o."""
    s = _stage_inputs()
    Aqk, u, h0 = (s[n].clone().requires_grad_() for n in ('Aqk', 'u', 'h0'))
    h, v_new, ht = fwd_h(s['kg'], s['w'], u, s['gk'], h0, True)
    o = fwd_o(s['q'], v_new, s['gk'], Aqk, h, s['scale'])
    dA_ref, du_ref, dh0_ref = torch.autograd.grad((o * s['do']).sum() + (ht * s['dht']).sum(), [Aqk, u, h0])
    assert rel_err(s['dAqk'], s['scale'] * dA_ref) < 1e-13
    assert rel_err(s['dv2'], du_ref) < 1e-13
    assert rel_err(s['dh0'], dh0_ref) < 1e-13
    # dh[:, -1] is dht; dh0 is None without an initial state
    assert torch.equal(s['dh'][:, -1], s['dht'])
    assert bwd_dhu(s['qg'], s['kg'], s['w'], s['gk'], None, None, s['do'], s['dv'], s['scale'])[1] is None


def test_small_stages_against_autograd():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 70, 4, 16, generator=gen, dtype=F64, requires_grad=True)
    dy = torch.randn(2, 70, 4, 16, generator=gen, dtype=F64)
    # chunk-local cumsum, forward and reverse
    c = chunk_local_cumsum(x, 64, scale=0.5)
    assert torch.allclose(c[:, :64], 0.5 * x[:, :64].cumsum(1))
    assert torch.allclose(c[:, 64:], 0.5 * x[:, 64:].cumsum(1))
    r = chunk_local_cumsum(x, 64, reverse=True)
    assert torch.allclose(r[:, :64], x[:, :64].flip(1).cumsum(1).flip(1))
    # l2 norm
    y, rstd = l2norm_fwd(x)
    (dx_ref,) = torch.autograd.grad(x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6), x, dy)
    assert rel_err(l2norm_bwd(y, rstd, dy), dx_ref) < 1e-13
    # beta sigmoid, scale 2
    b = x[..., 0]
    (db_ref,) = torch.autograd.grad(2 * torch.sigmoid(b), x, dy[..., 0])
    assert rel_err(beta_sigmoid_fwd(b, 2.0), 2 * torch.sigmoid(b)) < 1e-15
    assert rel_err(beta_sigmoid_bwd(b, dy[..., 0], 2.0), db_ref[..., 0]) < 1e-14
    # gate, every variant
    A_log = torch.randn(4, generator=gen, dtype=F64, requires_grad=True)
    bias = torch.randn(64, generator=gen, dtype=F64, requires_grad=True)
    for a, bb, lb in ((A_log, bias, None), (A_log, None, None), (A_log, bias, -5.0), (None, bias, -2.0)):
        leaves = [t for t in (x, a, bb) if t is not None]
        ref = torch.autograd.grad(naive_gate(x, a, bb, lb), leaves, dy)
        got = [t for t in gate_bwd(x.detach(), a, bb, dy, lb) if t is not None]
        assert all(rel_err(p, r) < 1e-13 for p, r in zip(got, ref, strict=True))
    # GVA sum: groups of consecutive value heads
    assert torch.equal(gva_sum(x, 4), x)
    assert rel_err(gva_sum(x, 2), x.view(2, 70, 2, 2, 16).sum(3)) < 1e-15


def test_stage_dtypes_for_bf16_inputs():
    """Every stage returns fla 0.6.0's dtypes: input-like tensors keep bf16, accumulators are fp32."""
    bf, f32 = torch.bfloat16, torch.float32
    s = _stage_inputs(dtype=bf, T=100)
    expect = {
        'gk': f32, 'w': bf, 'u': bf, 'qg': bf, 'kg': bf, 'Aqk': bf, 'Akk': bf, 'h': bf, 'v_new': bf,
        'ht': f32, 'dAqk': f32, 'dv': bf, 'dh': bf, 'dh0': f32, 'dv2': bf, 'dq': f32, 'dk': f32,
        'dv3': bf, 'db': f32, 'dg': f32, 'dAkk': f32,
    }
    assert {n: s[n].dtype for n in expect} == expect
    o = fwd_o(s['q'], s['v_new'], s['gk'], s['Aqk'], s['h'], s['scale'])
    o2, ht2 = fwd_scan(s['q'], s['qg'], s['kg'], s['w'], s['u'], s['gk'], s['Aqk'], s['h0'], True, s['scale'])
    assert (o.dtype, o2.dtype, ht2.dtype) == (bf, bf, f32)
    w, u, qg, kg = recompute_w_u(s['q'], s['k'], s['v'], s['beta'], s['Akk'], s['gk'])
    assert (w.dtype, u.dtype, qg.dtype, kg.dtype) == (bf, bf, bf, bf)
    args = [s[n] for n in ('q', 'k', 'gk', 'beta', 'dAqk', 'dAkk', 'dq', 'dk', 'db', 'dg')]
    assert [x.dtype for x in bwd_intra(*args)] == [f32] * 4
    assert [x.dtype for x in bwd_intra(*args, fold_dg=True, emit_bf16=True)] == [bf, bf, f32, f32]
    assert gva_sum(s['dq'], 2).dtype == f32 and dg_cumsum(s['dg'], 64).dtype == f32
    y, rstd = l2norm_fwd(s['q'])
    assert (y.dtype, rstd.dtype, l2norm_bwd(y, rstd, s['dq'][:, :, :2]).dtype) == (bf, f32, bf)
    assert beta_sigmoid_fwd(s['beta']).dtype == f32 and beta_sigmoid_bwd(s['beta'], s['db']).dtype == bf
    A_log, bias = torch.zeros(4), torch.zeros(4 * 32, dtype=bf)
    assert gate_chunk_cumsum(s['g'], A_log, bias, None, 64, True).dtype == f32
    dg, dA, dbias = gate_bwd(s['g'], A_log, bias, s['dg'], None)
    assert (dg.dtype, dA.dtype, dbias.dtype) == (bf, f32, bf)


# ------------------------------------------------------------------------------------------------
# Each stage against fla's own function on the GPU (skipped without CUDA or fla)
# ------------------------------------------------------------------------------------------------

def _lower_rows(A: torch.Tensor) -> torch.Tensor:
    """A-matrix [B, T, HV, BT] with entries above each row's diagonal zeroed (fla leaves Aqk's
    unwritten there)."""
    BT = A.shape[-1]
    row = torch.arange(A.shape[1], device=A.device) % BT
    keep = torch.arange(BT, device=A.device)[None, :] <= row[:, None]
    return torch.where(keep[None, :, None, :], A, torch.zeros((), dtype=A.dtype, device=A.device))


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_stages_match_fla(dtype):
    """Each reference stage, fed the same inputs as fla's function for that stage (fla's own outputs
    of the stages before), gives fla's values (to fla's tf32/bf16 rounding) and fla's dtypes."""
    if not torch.cuda.is_available():
        pytest.skip('needs CUDA')
    pytest.importorskip('fla')
    from fla.modules.norm.l2norm import l2norm_bwd as f_l2b
    from fla.modules.norm.l2norm import l2norm_fwd as f_l2f
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.common.gate import fused_beta_sigmoid_bwd, fused_beta_sigmoid_fwd
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv, chunk_kda_bwd_wy_dqkg_fused
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra, chunk_kda_fwd_intra
    from fla.ops.kda.gate import kda_gate_bwd, kda_gate_chunk_cumsum
    from fla.ops.kda.wy_fast import recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum as f_cumsum

    B, T, H, HV, K, V = 2, 200, 2, 4, 64, 64
    dev = 'cuda'
    gen = torch.Generator(device=dev).manual_seed(0)

    def r(*s, dt=dtype, scale=1.0):
        return (torch.randn(s, generator=gen, device=dev) * scale).to(dt)

    q_raw, k_raw, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
    g_raw, beta_raw = r(B, T, HV, K), r(B, T, HV)
    A_log = torch.log(torch.empty(HV, device=dev).uniform_(1, 16, generator=gen))
    dt_bias = r(HV * K, dt=torch.float32, scale=0.1)
    h0, dht = r(B, HV, K, V, dt=torch.float32, scale=0.1), r(B, HV, K, V, dt=torch.float32)
    do = r(B, T, HV, V)
    scale = K ** -0.5
    errs, dtypes = {}, {}

    def check(name, ours, theirs):
        ours = ours if isinstance(ours, tuple) else (ours,)
        theirs = theirs if isinstance(theirs, tuple) else (theirs,)
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            key = f'{name}[{i}]'
            if b is None:
                assert a is None, key
                continue
            dtypes[key] = (a.dtype, b.dtype)
            errs[key] = rel_err(a, b)

    q, q_rstd = f_l2f(q_raw)
    k, _ = f_l2f(k_raw)
    check('l2norm_fwd', l2norm_fwd(q_raw), (q, q_rstd))
    beta = fused_beta_sigmoid_fwd(beta_raw, 2.0)
    check('beta_sigmoid_fwd', beta_sigmoid_fwd(beta_raw, 2.0), beta)
    beta = beta / 2  # keep the delta rule's |1 - beta| <= 1 for the rest
    gk = kda_gate_chunk_cumsum(g_raw, A_log, 64, scale=RCP_LN2, dt_bias=dt_bias)
    check('gate_chunk_cumsum', gate_chunk_cumsum(g_raw, A_log, dt_bias, None, 64, True), gk)
    gk_lb = kda_gate_chunk_cumsum(g_raw, A_log, 64, scale=RCP_LN2, dt_bias=dt_bias, lower_bound=-5.0)
    check('gate_chunk_cumsum_lb', gate_chunk_cumsum(g_raw, A_log, dt_bias, -5.0, 64, True), gk_lb)
    gplain = -F.softplus(g_raw.float())
    check('chunk_local_cumsum', chunk_local_cumsum(gplain, 64, scale=RCP_LN2),
          f_cumsum(gplain, 64, scale=RCP_LN2))

    fi = chunk_kda_fwd_intra(q=q, k=k, v=v, gk=gk, beta=beta, scale=scale, chunk_size=64,
                             disable_recompute=True)
    ours = fwd_intra(q, k, v, gk, beta, scale, 64, want_qg=True)
    check('fwd_intra', ours[:4] + (_lower_rows(ours[4]), ours[5]), fi[:4] + (_lower_rows(fi[4]), fi[5]))
    w, u, qg, kg, Aqk, Akk = fi
    check('recompute_w_u', recompute_w_u(q, k, v, beta, Akk, gk),
          recompute_w_u_fwd(k=k, v=v, beta=beta, A=Akk, gk=gk, q=q))
    h, v_new, ht = chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=gk, initial_state=h0,
                                                output_final_state=True)
    check('fwd_h', fwd_h(kg, w, u, gk, h0, True), (h, v_new, ht))
    o = chunk_gla_fwd_o_gk(q=q, v=v_new, g=gk, A=Aqk, h=h, scale=scale)
    check('fwd_o', fwd_o(q, v_new, gk, Aqk, h, scale), o)
    check('fwd_scan', fwd_scan(q, qg, kg, w, u, gk, Aqk, h0, True, scale), (o, ht))

    dAqk, dv = chunk_kda_bwd_dAv(q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale)
    check('bwd_dAv', bwd_dAv(v_new, do, Aqk, scale), (dAqk, dv))
    dh, dh0, dv2 = chunk_gated_delta_rule_bwd_dhu(q=qg, k=kg, w=w, do=do, dv=dv, gk=gk, h0=h0, dht=dht,
                                                  scale=scale)
    check('bwd_dhu', bwd_dhu(qg, kg, w, gk, h0, dht, do, dv, scale), (dh, dh0, dv2))
    wy = chunk_kda_bwd_wy_dqkg_fused(q=q, k=k, v=v, v_new=v_new, g=gk, beta=beta, A=Akk, h=h, do=do, dh=dh,
                                     dv=dv2, scale=scale)
    check('bwd_wy_dqkg', bwd_wy_dqkg(q, k, v, v_new, gk, beta, Akk, h, do, dh, dv2, scale), wy)
    dq, dk, _, db, dg, dAkk = wy
    intra = chunk_kda_bwd_intra(q=q, k=k, g=gk, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg)
    check('bwd_intra', bwd_intra(q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg), intra)
    dq, dk, db, dg = intra
    check('gva_sum', gva_sum(dq, H), dq.view(B, T, H, HV // H, K).sum(3))
    dgc = f_cumsum(dg, 64, reverse=True)
    check('dg_cumsum', dg_cumsum(dg, 64), dgc)
    for lb in (None, -5.0):
        check(f'gate_bwd_lb{lb}', gate_bwd(g_raw, A_log, dt_bias, dgc, lb),
              kda_gate_bwd(g_raw, A_log, dt_bias, dgc, lb))
    dq_h = dq.view(B, T, H, HV // H, K).sum(3)
    check('l2norm_bwd', l2norm_bwd(q, q_rstd, dq_h), f_l2b(q, q_rstd, dq_h))
    check('beta_sigmoid_bwd', beta_sigmoid_bwd(beta_raw, db, 2.0), fused_beta_sigmoid_bwd(beta_raw, db, 2.0))

    for key, err in errs.items():
        print(f'{key:26s} {err:.2e}  {dtypes[key][0]} / {dtypes[key][1]}')
    assert all(a == b for a, b in dtypes.values()), {k: d for k, d in dtypes.items() if d[0] != d[1]}
    tol = 1e-2 if dtype == torch.float32 else 3e-2
    assert all(e < tol for e in errs.values()), {k: e for k, e in errs.items() if not e < tol}


def test_packed_chain_reference_is_the_recurrence_per_sequence():
    """chunk_kda_reference_packed (the chunked chain once per sequence: the GPU tests' and the
    witness's packed oracle) against the token recurrence over the packed row (naive_kda_varlen),
    with a zero-length sequence, the gate and beta sigmoid in the op, initial and final states."""
    from kda_cute.reference import chunk_kda_reference_packed, naive_kda_varlen

    gen = torch.Generator().manual_seed(3)
    D = torch.float64
    lens = [5, 0, 70, 3, 64]
    T, H, HV, K, V = sum(lens), 1, 2, 16, 8
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=D)

    args = (r(1, T, H, K), r(1, T, H, K), r(1, T, HV, V), r(1, T, HV, K), r(1, T, HV))
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 A_log=r(HV) * 0.5, dt_bias=r(HV * K) * 0.1, output_final_state=True)
    h0 = r(len(lens), HV, K, V)
    o, ht = chunk_kda_reference_packed(*args, cu, initial_state=h0, **flags)
    o_n, ht_n = naive_kda_varlen(*args, torch.tensor(cu), initial_state=h0, **flags)
    assert rel_err(o, o_n) < 1e-10 and rel_err(ht, ht_n) < 1e-10
    assert torch.equal(ht[1], h0[1])
