"""What a user gets for input at the edges (CPU, the reference chain): each case here failed or
was silently wrong before it was handled (README, "Bad input")."""

from __future__ import annotations

import pytest
import torch
from kda_chain import chunk_kda
from kda_chain.witness import main as witness_main

D = torch.float64


def _x(B=1, T=64, H=2, HV=2, K=16, V=8, dtype=D, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)

    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K),
                beta=r(B, T, HV).sigmoid(), A_log=r(HV), dt_bias=r(HV * K), h0=r(B, HV, K, V))


def _call(x, **kw):
    return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], use_gate_in_kernel=True, A_log=x["A_log"],
                     dt_bias=x["dt_bias"], use_qk_l2norm_in_kernel=True, **kw)


@pytest.mark.parametrize("qdt", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_h0", [True, False])
def test_T0_returns_fla_s_empty_result(with_h0, qdt):
    """fla 0.6.0 on CUDA (H200, 2026-12-01): o empty, ht a fresh fp32 copy of h0 (zeros without;
    float64 with float64 inputs, the reference's precision); backward: dh0 = dht, empty token
    gradients."""
    x = _x(T=0, dtype=qdt)
    h0 = x["h0"] if with_h0 else None
    o, ht = _call(x, initial_state=h0, output_final_state=True)
    assert o.shape == (1, 0, 2, 8) and o.dtype == x["q"].dtype
    assert ht.dtype == qdt and ht.shape == (1, 2, 16, 8)
    if with_h0:
        assert torch.equal(ht, h0.detach()) and ht.data_ptr() != h0.data_ptr()
    else:
        assert not ht.any()
    dht = torch.randn_like(ht)
    leaves = [x[n] for n in ("q", "k", "v", "g", "A_log", "dt_bias")] + ([h0] if with_h0 else [])
    grads = torch.autograd.grad([o, ht], leaves, [torch.zeros_like(o), dht])
    assert all(gr.shape == t.shape for gr, t in zip(grads, leaves, strict=True))
    if with_h0:
        assert torch.equal(grads[-1], dht.to(h0.dtype))
    o2, ht2 = _call(x, initial_state=h0)
    assert ht2 is None and o2.shape[1] == 0


def test_head_first_layout_warns():
    """[B, H, T, K] passed where [B, T, H, K] is expected: fla 0.6.0 is silent and the answer is
    wrong; we warn when T < H, the shape of that mistake."""
    x = _x(T=4, H=16, HV=16)  # [B, T=4, H=16]: looks like head-first [B, H=4, T=16]
    with pytest.warns(UserWarning, match="head-first"):
        _call(x)


def test_no_head_first_warning_for_ordinary_shapes(recwarn):
    _call(_x(T=64, H=2))
    assert not [w for w in recwarn if "head-first" in str(w.message)]


def test_infinite_raw_gate_gives_nan_like_fla():
    """g = +inf with use_gate_in_kernel: the log decay is -inf and exp2(-inf - -inf) is NaN, in fla
    on CUDA (checked on the H200, 2026-12-01, rows p = 0, 10, 63) as in ours. Defined behaviour:
    the (b, hv) that holds the inf is NaN from its chunk on; every other head stays finite."""
    x = _x(B=2, T=128, HV=2)
    with torch.no_grad():
        x["g"][1, 70, 0, 3] = float("inf")
    o, ht = _call(x, initial_state=x["h0"], output_final_state=True)
    assert torch.isnan(o[1, 70:, 0]).any() and torch.isnan(ht[1, 0]).any()
    assert torch.isfinite(o[0]).all() and torch.isfinite(o[1, :, 1]).all() and torch.isfinite(o[1, :64]).all()
    assert torch.isfinite(ht[0]).all() and torch.isfinite(ht[1, 1]).all()


@pytest.mark.parametrize("qdt", [torch.float32, torch.bfloat16])
def test_float64_initial_state_needs_float64_inputs(qdt):
    x = _x(dtype=qdt)
    with pytest.raises(ValueError, match="initial_state must be float32.*got torch.float64"):
        _call(x, initial_state=x["h0"].detach().double())


@pytest.mark.parametrize("h0dt", [None, torch.float32, torch.float64])
def test_float64_final_state_is_float64(h0dt):
    """float64 inputs (the reference's precision) give a float64 final state, with a float32, a
    float64 or no initial state (the op once declared float32 without one: the call raised)."""
    x = _x(T=64)
    h0 = None if h0dt is None else x["h0"].detach().to(h0dt)
    _, ht = _call(x, initial_state=h0, output_final_state=True)
    assert ht.dtype == torch.float64 and ht.shape == (1, 2, 16, 8)


def test_varlen_initial_state_has_one_state_per_sequence():
    """With cu_seqlens the state batch is the sequence count (fla's rule), not q's batch of 1."""
    x = _x(B=1, T=64)
    cu = torch.tensor([0, 20, 64])
    h0 = torch.randn(2, 2, 16, 8, dtype=D)
    o, ht = _call(x, initial_state=h0, cu_seqlens=cu, output_final_state=True)
    assert o.shape == (1, 64, 2, 8) and ht.shape == (2, 2, 16, 8)
    with pytest.raises(ValueError, match=r"initial_state must have shape \[2, 2, 16, 8\]"):
        _call(x, initial_state=h0[:1], cu_seqlens=cu)


@pytest.mark.parametrize("cu, B, needle", [
    (torch.tensor([0, 20, 64]), 2, "must be \\[1, total_T, H, K\\], got B=2"),
    (torch.tensor([1, 20, 64]), 1, "from 0 to total_T=64, got 1 .. 64"),
    (torch.tensor([0, 20, 63]), 1, "from 0 to total_T=64, got 0 .. 63"),
    (torch.tensor([0, 30, 20, 64]), 1, "non-decreasing"),
    (torch.tensor([0.0, 64.0]), 1, "int32 or int64"),
    (torch.tensor([[0, 64]]), 1, "1-D with N \\+ 1 >= 2 offsets"),
    (torch.tensor([0]), 1, "1-D with N \\+ 1 >= 2 offsets"),
])
def test_bad_cu_seqlens_fail_in_one_line(cu, B, needle):
    x = _x(B=B, T=64)
    with pytest.raises(ValueError, match=needle):
        _call(x, cu_seqlens=cu)


def test_varlen_with_another_unimplemented_flag_still_needs_fla():
    x = _x(B=1, T=64)
    with pytest.raises(NotImplementedError, match="safe_gate.*fla cannot run here"):
        _call(x, cu_seqlens=torch.tensor([0, 64]), safe_gate=True)


def test_transpose_state_layout_is_fla_s_deprecated_state_v_first():
    x = _x()
    with pytest.warns(DeprecationWarning, match="state_v_first"), \
            pytest.raises(NotImplementedError, match="state_v_first"):
        _call(x, transpose_state_layout=True)
    with pytest.raises(ValueError, match="not both"):
        _call(x, transpose_state_layout=True, state_v_first=True)


@pytest.mark.parametrize("argv, needle", [
    (["--T", "0"], "--T: must be >= 1, got 0"),
    (["--B", "-1"], "--B: must be >= 1, got -1"),
    (["--H", "2", "--HV", "3"], "--HV 3 must be a multiple of --H 2"),
    (["--reps", "0"], "--reps: must be >= 1, got 0"),
    (["--trace", "/missing/dir/t.json"], "directory /missing/dir does not exist"),
])
def test_witness_cli_rejects_bad_arguments_in_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        witness_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1] and "Traceback" not in "\n".join(err)


def test_witness_cli_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        witness_main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for needle in ("(default 5)", "(default 0)", "(default on this CPU: 128)", "(default: none)"):
        assert needle in out, needle
