"""chunk_kda as torch.library custom ops (kda::chunk_kda_fwd / kda::chunk_kda_bwd) on CPU: the
fake implementations agree with the real ones (shapes, dtypes) in every flag combination, GVA and
the final state, disable_recompute's kept tensors; opcheck's registration tests pass;
torch.compile(fullgraph=True) of a model that calls chunk_kda compiles with no graph break and
matches eager; an eager call skips the custom-op dispatch and gives the same bits."""

from __future__ import annotations

import pytest
import torch
from kda_chain import chunk_kda
from kda_chain import op as kop
from kda_chain.forward import Flags
from kda_chain.varlen import chunks_words

CASES = {  # name: (B, T, H, HV, K, V, dtype, flags)
    "gate_l2norm_h0": (1, 64, 1, 2, 16, 8, torch.float64,
                       dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, output_final_state=True)),
    "pregate_sigmoid": (2, 80, 2, 2, 16, 8, torch.float32,
                        dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)),
    "gva_lower_bound": (1, 64, 1, 3, 16, 16, torch.float32,
                        dict(use_gate_in_kernel=True, lower_bound=-5.0, output_final_state=True)),
    "disable_recompute_gva": (2, 100, 1, 2, 16, 8, torch.float32,
                              dict(use_gate_in_kernel=True, output_final_state=True, disable_recompute=True)),
    # a packed call's padded row (kda_chain.varlen): three sequences of 1, 0 and 2 chunks, states [3, ...]
    "packed_chunks": (1, 192, 1, 2, 16, 8, torch.float32,
                      dict(use_gate_in_kernel=True, output_final_state=True, chunks=[1, 0, 2])),
}


def _inputs(B, T, H, HV, K, V, dtype, flags, seed=0, h0=True):
    gen = torch.Generator().manual_seed(seed)

    def r(*s, dt=dtype):
        return torch.randn(*s, generator=gen, dtype=torch.float64).to(dt)

    g = r(B, T, HV, K)
    if not flags.get("use_gate_in_kernel"):
        g = torch.nn.functional.logsigmoid(g)
    beta = r(B, T, HV) if flags.get("use_beta_sigmoid_in_kernel") else r(B, T, HV).sigmoid()
    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=g, beta=beta)
    if flags.get("use_gate_in_kernel"):
        x.update(A_log=r(HV, dt=torch.float32), dt_bias=r(HV * K, dt=torch.float32))
    N = B
    if "chunks" in flags:
        x["chunks"] = torch.tensor(chunks_words(flags["chunks"]), dtype=torch.int32).view(2, -1)
        N = len(flags["chunks"])
    if h0:
        x["initial_state"] = r(N, HV, K, V, dt=torch.float32 if dtype != torch.float64 else dtype)
    return x


def _op_args(x, flags):
    names = ("output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
             "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "disable_recompute")
    on = {n: flags.get(n, False) for n in names}
    f = Flags(scale=x["q"].shape[-1] ** -0.5, chunk_size=64, lower_bound=flags.get("lower_bound"), **on)
    tensors = (*(x[n] for n in ("q", "k", "v", "g", "beta")),
               *(x.get(n) for n in ("A_log", "dt_bias", "initial_state", "chunks")))
    return (*tensors, f.scale, f.output_final_state, f.use_qk_l2norm_in_kernel, f.use_gate_in_kernel,
            f.use_beta_sigmoid_in_kernel, f.allow_neg_eigval, f.lower_bound, f.disable_recompute)


@pytest.mark.parametrize("case", list(CASES))
def test_fake_matches_real(case):
    B, T, H, HV, K, V, dt, flags = CASES[case]
    x = _inputs(B, T, H, HV, K, V, dt, flags)
    args = _op_args(x, flags)
    real = kop.chunk_kda_fwd(*args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.ops.kda.chunk_kda_fwd(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                               for a in args])
    assert [(tuple(t.shape), t.dtype) for t in fake] == [(tuple(t.shape), t.dtype) for t in real]


@pytest.mark.parametrize("case", list(CASES))
def test_opcheck(case):
    B, T, H, HV, K, V, dt, flags = CASES[case]
    x = _inputs(B, T, H, HV, K, V, dt, flags)
    for t in x.values():
        if t.is_floating_point():
            t.requires_grad_(True)
    torch.library.opcheck(torch.ops.kda.chunk_kda_fwd, _op_args(x, flags),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("T", [64, 100])  # 100: a ragged T (traced: the dense custom ops)
def test_torch_compile_fullgraph_matches_eager(T):
    from kda_chain.model import TinyKDALM

    torch.manual_seed(0)
    model = TinyKDALM(vocab=64, d=32, layers=2, H=2, HV=4, K=16, V=16, op=chunk_kda)
    tokens = torch.randint(0, 64, (2, T + 1))
    ref = model.loss(tokens)
    ref.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model.loss, fullgraph=True, backend="aot_eager")
    got = compiled(tokens)
    got.backward()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for p, w in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-6)


def test_saved_outputs_take_no_gradient():
    """The saved intermediates leave the op only to reach its backward: they are marked
    non-differentiable, so autograd materializes no zero gradient for them (at the reference
    shape that was 0.49 ms of fills and GBs); a loss on ht alone still differentiates."""
    B, T, H, HV, K, V, dt, flags = CASES["gate_l2norm_h0"]
    x = _inputs(B, T, H, HV, K, V, dt, flags)
    for t in x.values():
        t.requires_grad_(True)
    out = torch.ops.kda.chunk_kda_fwd(*_op_args(x, flags))
    assert out[0].requires_grad and out[1].requires_grad
    assert not any(t.requires_grad for t in out[2:])
    dq, dk = torch.autograd.grad(out[1].sum(), [x["q"], x["k"]])  # ht depends on k, not on q
    assert not dq.any() and torch.isfinite(dk).all() and dk.abs().sum() > 0


# (whole chunks: an eager ragged T takes the packed route, api._ragged, a traced one the dense ops)
@pytest.mark.parametrize("case", ["gate_l2norm_h0", "gva_lower_bound"])
def test_eager_path_equals_the_custom_op(case, monkeypatch):
    """An eager call goes through `_Eager` (no custom-op dispatch), a traced one through the ops:
    the same bodies, so outputs and every gradient are bitwise equal."""
    B, T, H, HV, K, V, dt, flags = CASES[case]

    def run():
        x = _inputs(B, T, H, HV, K, V, dt, flags)
        for t in x.values():
            t.requires_grad_(True)
        o, ht = chunk_kda(**x, **flags)
        (o.sum() + ht.sum()).backward()
        return o.grad_fn, [o, ht, *(t.grad for t in x.values())]

    fn_eager, eager = run()
    monkeypatch.setattr(kop, "_eager", lambda q: False)
    fn_op, op = run()
    assert type(fn_eager).__name__ == "_EagerBackward" and type(fn_op).__name__ != "_EagerBackward"
    for a, b in zip(eager, op, strict=True):
        assert torch.equal(a, b)
