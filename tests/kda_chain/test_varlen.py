"""Packed sequences (cu_seqlens) through the chain on CPU: the padded row (kda_chain.varlen, the
reference stages) against the token recurrence run per sequence
(`kda_cute.reference.naive_kda_varlen`, the oracle), float64.

On a GPU the same path runs the CuTe kernels (tests/gpu/test_varlen_gpu.py); these tests pin the
contract: chunks restart at every sequence start, no state crosses a boundary, initial / final
states per sequence, any length (1, 63, 64, 65, 0), pad rows that are exact no-ops in every gate
and beta form."""

from __future__ import annotations

import pytest
import torch
from kda_chain import chunk_kda, dispatch_log, reset_dispatch_log
from kda_cute.reference import naive_kda_varlen, rel_err

D = torch.float64
LENS = [1, 63, 64, 65, 0, 130, 7]
FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def _inputs(lens, H=2, HV=4, K=16, V=8, seed=0, h0=True):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def r(*s, sc=1.0):
        return (torch.randn(*s, generator=gen, dtype=D) * sc).requires_grad_(True)

    x = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, HV, V), g=r(1, T, HV, K), beta=r(1, T, HV),
             A_log=r(HV, sc=0.5), dt_bias=r(HV * K, sc=0.1))
    x["h0"] = r(len(lens), HV, K, V) if h0 else None
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return x, cu


def _run(fn, x, cu):
    o, ht = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, initial_state=x["h0"],
               output_final_state=True, A_log=x["A_log"], dt_bias=x["dt_bias"], **FLAGS)
    return o, ht


def _grads(x, o, ht, seed=1):
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=D)
    dht = torch.randn(ht.shape, generator=gen, dtype=D)
    loss = (o * do).sum() + (ht * dht).sum()
    names = [n for n, t in x.items() if t is not None]
    return dict(zip(names, torch.autograd.grad(loss, [x[n] for n in names]), strict=True))


@pytest.mark.parametrize("h0", [True, False])
def test_chain_varlen_matches_the_recurrence_per_sequence(h0):
    """GVA (HV = 2H), V != K, gate / l2norm / beta sigmoid in the op, lengths 1, 63, 64, 65, 0,
    130, 7: o, ht and every gradient (q, k, v, g, beta, A_log, dt_bias, h0) equal the oracle's to
    float64 rounding."""
    x, cu = _inputs(LENS, h0=h0)
    reset_dispatch_log()
    o, ht = _run(chunk_kda, x, cu)
    assert any(c.stage == "chunk_kda" and c.impl == "packed" for c in dispatch_log())
    wo, wht = _run(naive_kda_varlen, x, cu)
    assert o.shape == wo.shape and ht.shape == (len(LENS), 4, 16, 8)
    assert rel_err(o, wo) < 1e-10 and rel_err(ht, wht) < 1e-10
    got, want = _grads(x, o, ht), _grads(x, wo, wht)
    for name in want:
        assert rel_err(got[name], want[name]) < 1e-9, name


def test_sequences_do_not_influence_each_other():
    """Changing every input of sequence 2 (and its initial state) leaves the other sequences'
    outputs, final states and input gradients bit for bit as they were."""
    x, cu = _inputs(LENS)
    o1, ht1 = _run(chunk_kda, x, cu)
    g1 = _grads(x, o1, ht1)
    a, b = int(cu[2]), int(cu[3])
    y = {n: (t.detach().clone() if t is not None else None) for n, t in x.items()}
    for n in ("q", "k", "v", "g", "beta"):
        y[n][:, a:b] = torch.randn_like(y[n][:, a:b])
    y["h0"][2] = torch.randn_like(y["h0"][2])
    y = {n: (t.requires_grad_(True) if t is not None else None) for n, t in y.items()}
    o2, ht2 = _run(chunk_kda, y, cu)
    g2 = _grads(y, o2, ht2)
    keep = torch.ones(o1.shape[1], dtype=torch.bool)
    keep[a:b] = False
    assert torch.equal(o1[:, keep], o2[:, keep]) and not torch.equal(o1[:, ~keep], o2[:, ~keep])
    others = [n for n in range(len(LENS)) if n != 2]
    assert torch.equal(ht1[others], ht2[others])
    for n in ("q", "k", "v", "g", "beta"):
        assert torch.equal(g1[n][:, keep], g2[n][:, keep]), n
    assert torch.equal(g1["h0"][others], g2["h0"][others])


def test_one_sequence_is_the_dense_call():
    """cu_seqlens = [0, T] gives exactly the dense call's o and ht."""
    x, cu = _inputs([130])
    o, ht = _run(chunk_kda, x, cu)
    od, htd = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                        output_final_state=True, A_log=x["A_log"], dt_bias=x["dt_bias"], **FLAGS)
    assert torch.equal(o, od) and torch.equal(ht, htd)


@pytest.mark.parametrize("flags", [
    dict(use_gate_in_kernel=True, lower_bound=-5.0),  # the sigmoid form: padding must stay 0, no NaN
    dict(use_qk_l2norm_in_kernel=True),  # g is the log gate itself (padded with 0), beta as given
    dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
         disable_recompute=True),
])
def test_packed_flag_forms_match_the_recurrence(flags):
    """The pad rows are no-op tokens in every gate / beta form: lower_bound's sigmoid gate, a given
    log gate, beta with and without the sigmoid, disable_recompute (the forward's kept states on
    the padded row): o, ht and every gradient equal the oracle's, all finite."""
    x, cu = _inputs(LENS)
    if not flags.get("use_gate_in_kernel"):
        with torch.no_grad():
            x["g"] = (-torch.nn.functional.softplus(x["g"])).requires_grad_(True)
    kw = dict(cu_seqlens=cu, initial_state=x["h0"], output_final_state=True, **flags)
    if flags.get("use_gate_in_kernel"):
        kw.update(A_log=x["A_log"], dt_bias=x["dt_bias"])
    else:
        x["A_log"] = x["dt_bias"] = None
    o, ht = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    naive = {n: v for n, v in kw.items() if n != "disable_recompute"}
    wo, wht = naive_kda_varlen(x["q"], x["k"], x["v"], x["g"], x["beta"], **naive)
    assert rel_err(o, wo) < 1e-10 and rel_err(ht, wht) < 1e-10
    got, want = _grads(x, o, ht), _grads(x, wo, wht)
    for name in want:
        assert torch.isfinite(got[name]).all(), name
        assert rel_err(got[name], want[name]) < 1e-9, name


def test_packing_layout():
    """Each sequence starts on a chunk boundary of the padded row, its tokens in order; the chunk
    table counts whole chunks (an empty sequence has none); pad rows hold the fill value and
    unpack(pack(x)) is x."""
    from kda_chain import varlen

    lens = [1, 0, 64, 65, 3]
    offs = [0, *torch.tensor(lens).cumsum(0).tolist()]
    p = varlen.packing(torch.tensor(offs, dtype=torch.int32), offs)
    assert p.chunks.tolist() == [[0, 1, 1, 2, 4, 5], [3, 0, 2, 4, 1, 0]]  # offsets; longest first
    assert p.T_pad == 5 * 64
    assert p.index[:2].tolist() == [0, 64] and p.index[-3:].tolist() == [256, 257, 258]
    assert sorted(p.index.tolist() + p.pad.tolist()) == list(range(320))  # every row exactly once
    x = torch.randn(1, sum(lens), 2, 3, requires_grad=True)
    y = varlen.pack(x, p, -7.0)
    assert y.shape == (1, 320, 2, 3) and (y[:, 1:64] == -7.0).all() and torch.equal(varlen.unpack(y, p), x)
    gy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, gy)
    assert torch.equal(gx, varlen.unpack(gy, p))  # the pack's gradient gathers the real rows
    yl = y.detach().requires_grad_(True)
    (gyl,) = torch.autograd.grad(varlen.unpack(yl, p), yl, x.detach())
    assert torch.equal(gyl, varlen.pack(x.detach(), p, 0.0))  # the unpack's: zeros in the pad rows


def test_cu_seqlens_cpu_gives_the_same_call():
    """cu_seqlens_cpu (the host copy that spares the sync) gives bitwise the same result; one that
    disagrees in length is refused."""
    x, cu = _inputs(LENS, h0=False)
    o1, _ = _run(chunk_kda, x, cu)
    o2, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, cu_seqlens_cpu=cu.long(),
                      A_log=x["A_log"], dt_bias=x["dt_bias"], **FLAGS)
    assert torch.equal(o1, o2)
    with pytest.raises(ValueError, match="cu_seqlens_cpu"):
        chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, cu_seqlens_cpu=cu[:-1].long(),
                  A_log=x["A_log"], dt_bias=x["dt_bias"], **FLAGS)


def test_whole_chunk_sequences_are_not_copied():
    """Sequences of whole chunks (and empty ones) are already the padded layout: no pack / unpack
    copy (o comes straight from the chain's op), the record says the rows were used in place (what
    `kda-witness --packed --require-cute` asks), and the result is still the oracle's."""
    x, cu = _inputs([64, 0, 128])
    reset_dispatch_log()
    o, ht = _run(chunk_kda, x, cu)
    assert "Unpack" not in type(o.grad_fn).__name__ and "Native" not in type(o.grad_fn).__name__
    assert [(c.impl, c.reason) for c in dispatch_log() if c.stage == "varlen_io"] == [("native", None)]
    wo, wht = _run(naive_kda_varlen, x, cu)
    assert rel_err(o, wo) < 1e-10 and rel_err(ht, wht) < 1e-10


def test_all_sequences_empty():
    """Every sequence empty (total T = 0): o [1, 0, HV, V], ht = h0 per sequence, dh0 = dht."""
    x, cu = _inputs([0, 0, 0])
    o, ht = _run(chunk_kda, x, cu)
    assert o.shape == (1, 0, 4, 8) and torch.equal(ht, x["h0"])
    dht = torch.randn_like(ht)
    (dh0,) = torch.autograd.grad((ht * dht).sum(), [x["h0"]])
    assert torch.equal(dh0, dht)


def test_the_chunk_table_maps_each_chunk_to_its_first_token_and_valid_rows():
    from kda_chain import varlen

    lens = [1, 63, 64, 65, 0, 130, 7]
    offs = [0, *torch.tensor(lens).cumsum(0).tolist()]
    p = varlen.packing(torch.tensor(offs, dtype=torch.int32), offs)
    want = []
    for n, L in enumerate(lens):
        for c in range(0, L, 64):
            want.append([offs[n] + c, min(64, L - c)])
    assert p.table.dtype == torch.int32 and p.table.is_contiguous()
    assert p.table.tolist() == want
    assert p.T == sum(lens) and p.T_pad == 64 * len(want)


@pytest.mark.parametrize("lens", [[1, 63, 64, 65, 0, 130, 7], [0, 0, 5], [128, 64], [0]])
def test_the_host_and_device_builds_of_the_tables_agree(lens):
    """The tables an eager call builds on the host (copied over once) are the ones a traced or
    captured call builds on the device from cu_seqlens (`host=False`), and both agree with the
    gather rows: chunk j's first token is the token of padded row 64 j, its valid rows are the
    non-pad rows of that chunk."""
    from kda_chain import varlen

    offs = [0, *torch.tensor(lens).cumsum(0).tolist()]
    cu = torch.tensor(offs, dtype=torch.int32)
    a, b = varlen.packing(cu, offs), varlen.packing(cu, offs, host=False)
    assert a.T == b.T == sum(lens) and a.T_pad == b.T_pad and a.N == len(lens)
    for t in (a.chunks, a.table, b.chunks, b.table):
        assert t.dtype == torch.int32 and t.is_contiguous() and t.data_ptr() % 16 == 0
    assert torch.equal(a.chunks, b.chunks) and torch.equal(a.table, b.table)
    if a.T_pad:
        valid = torch.ones(a.T_pad, dtype=torch.int32)
        valid[a.pad] = 0
        assert torch.equal(a.table[:, 0], a.source.view(-1, 64)[:, 0].int())
        assert torch.equal(a.table[:, 1], valid.view(-1, 64).sum(1, dtype=torch.int32))


@pytest.mark.parametrize("gva, gate", [(False, True), (True, True), (False, False)])
def test_packed_rows_go_native_through_the_cute_kernels(monkeypatch, gva, gate):
    """On the chain's CuTe path (kernels stubbed: kda_chain.testing.stub_device), an eager packed
    call hands every kernel that touches the packed row the chunk table: kda_cute_prep the packed
    inputs, kda_cute_fwd the packed o, kda_cute_bwd_prep the packed v, raw gate and beta,
    kda_cute_dhu and kda_cute_bwd_chunk the packed do, and kda_cute_bwd_chunk v, the raw gate, beta
    and the packed gradients: nothing is gathered, the record says `varlen_io native` for each of
    the five, and every gradient comes out on the packed row in its input's form. With
    GVA and the L2 norm in the op (l2norm_bwd runs after bwd_chunk, on the padded row) dq and dk
    stay there (`qk_padded`) and are the only tensors gathered. Without the gate in the op (no
    padded copy of g: bwd_prep takes g=None beside the forward's gk) every backward launch is
    recorded for replay."""
    pytest.importorskip("cutlass.cute")
    from kda_chain import stages as S
    from kda_chain import varlen
    from kda_chain.testing import stub_device

    stub_device(monkeypatch.setattr)
    S.clear_gate_cache()
    gathers, tables = [], []
    real = varlen._gather
    monkeypatch.setattr(varlen, "_gather",
                        lambda x, *a, **k: gathers.append(tuple(x.shape)) or real(x, *a, **k))
    for name in ("prep", "fwd", "bwd_prep", "dhu", "bwd_chunk"):
        mod = __import__(f"kda_cute.{name}", fromlist=["launch"])
        launch = mod.launch_raw if name == "bwd_chunk" else mod.launch
        monkeypatch.setattr(mod, launch.__name__, lambda *a, _f=launch, _n=name, **k:
                            tables.append((_n, k.get("table") is not None, k.get("qk_padded", False)))
                            or _f(*a, **k))
    gen = torch.Generator().manual_seed(0)
    lens = [1, 63, 64, 65, 200]
    H, HV, K, V = 16, (32 if gva else 16), 128, 128
    T = sum(lens)

    def r(*s, dt=torch.bfloat16):
        return torch.randn(*s, generator=gen).to(dt).requires_grad_(True)

    x = [r(1, T, H, K), r(1, T, H, K), r(1, T, HV, V), r(1, T, HV, K), r(1, T, HV)]
    A_log, dt_bias = r(HV, dt=torch.float32), r(HV * K, dt=torch.float32)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    reset_dispatch_log()
    kw = dict(A_log=A_log, dt_bias=dt_bias, **FLAGS) if gate else dict(use_qk_l2norm_in_kernel=True)
    o, ht = chunk_kda(*x, cu_seqlens=cu, cu_seqlens_cpu=cu, output_final_state=True, **kw)
    (o.float().sum() + ht.sum()).backward()
    io = [(c.impl, c.reason) for c in dispatch_log() if c.stage == "varlen_io"]
    assert o.shape == (1, T, HV, V) and ht.shape == (len(lens), HV, K, V)
    for t in x:
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype
    if gate:
        assert A_log.grad.shape == A_log.shape and dt_bias.grad.shape == dt_bias.shape
    else:
        (bwd_plan,) = [ls for _, ls in S._plans.values() if any(n == "bwd_prep" for n, _, _ in ls)]
        assert all(rp is not None for _, _, rp in bwd_plan), bwd_plan
    T_pad = 64 * sum(-(-n // 64) for n in lens)
    assert io == [("native", None)] * 5, io
    assert tables == [("prep", True, False), ("fwd", True, False), ("bwd_prep", True, False),
                      ("dhu", True, False), ("bwd_chunk", True, gva)], tables
    qk = [(1, T_pad, H, K)] * 2 if gva else []  # dq, dk after l2norm_bwd's group sum
    assert gathers == qk, "nothing gathered (but dq, dk with GVA and the L2 norm)"


def test_the_packing_is_kept_while_its_cu_seqlens_lives():
    """An eager call's layout is built once per cu_seqlens tensor (the layers of one step share it,
    as fla shares its chunk indices): the same tensor unchanged gives the same Packing; new host
    offsets, an in-place change (its version) or a traced build give a fresh one; the entry goes
    with the tensor."""
    import gc

    from kda_chain import varlen

    offs = [0, 5, 70, 200]
    cu = torch.tensor(offs, dtype=torch.int32)
    a = varlen.packing_of(cu, offs)
    assert varlen.packing_of(cu, offs) is a
    assert varlen.packing_of(cu, [0, 6, 70, 200]) is not a  # other host offsets: rebuilt (and kept)
    b = varlen.packing_of(cu, offs)
    assert b is not a and varlen.packing_of(cu, offs) is b
    cu.add_(0)  # an in-place write bumps the version
    c = varlen.packing_of(cu, offs)
    assert c is not b and torch.equal(c.table, b.table)
    assert varlen.packing_of(cu, offs, host=False) is not c  # a traced call's build is never kept
    other = cu.clone()
    assert varlen.packing_of(other, offs) is not c
    n = len(varlen._BY_CU)
    del cu, other
    gc.collect()
    assert len(varlen._BY_CU) == n - 2


@pytest.mark.parametrize("T, h0", [(100, True), (1, True), (130, False)])
def test_ragged_T_runs_its_rows_as_packed_sequences(T, h0):
    """A dense [B, T, ...] call with T % 64 != 0 runs as B packed sequences of T tokens
    (api._ragged: recorded `chunk_kda ragged`, then the packed path): o [B, T, HV, V], ht
    [B, HV, K, V] and every gradient (in its input's shape) equal the token recurrence's on the
    dense inputs to float64 rounding (GVA, gate / l2norm / beta sigmoid in the op)."""
    from kda_cute.reference import naive_kda

    B, H, HV, K, V = 3, 2, 4, 16, 8
    gen = torch.Generator().manual_seed(T)

    def r(*s, sc=1.0):
        return (torch.randn(*s, generator=gen, dtype=D) * sc).requires_grad_(True)

    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K), beta=r(B, T, HV),
             A_log=r(HV, sc=0.5), dt_bias=r(HV * K, sc=0.1), h0=r(B, HV, K, V) if h0 else None)

    def run(fn):
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                  A_log=x["A_log"], dt_bias=x["dt_bias"], **FLAGS)

    reset_dispatch_log()
    o, ht = run(chunk_kda)
    impls = {(c.stage, c.impl) for c in dispatch_log()}
    assert ("chunk_kda", "ragged") in impls and ("chunk_kda", "packed") not in impls, impls
    wo, wht = run(naive_kda)
    assert o.shape == (B, T, HV, V) and ht.shape == (B, HV, K, V)
    assert rel_err(o, wo) < 1e-10 and rel_err(ht, wht) < 1e-10
    got, want = _grads(x, o, ht), _grads(x, wo, wht)
    for name in want:
        assert got[name].shape == x[name].shape, name
        assert rel_err(got[name], want[name]) < 1e-9, name


def test_ragged_T_goes_native_through_the_cute_kernels(monkeypatch):
    """On the chain's CuTe path (kernels stubbed), a dense bf16 call at B2 T1000 (a ragged last
    chunk, which every dense build refuses) runs all six CuTe kernels on its rows as packed
    sequences, each with the chunk table, nothing gathered, no CuTe stage passed over; the
    gradients come back in the inputs' shapes and dtypes."""
    pytest.importorskip("cutlass.cute")
    from kda_chain import stages as S
    from kda_chain import varlen
    from kda_chain.testing import stub_device

    stub_device(monkeypatch.setattr)
    S.clear_gate_cache()
    gathers = []
    real = varlen._gather
    monkeypatch.setattr(varlen, "_gather",
                        lambda x, *a, **k: gathers.append(tuple(x.shape)) or real(x, *a, **k))
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 2, 1000, 16, 128, 128

    def r(*s, dt=torch.bfloat16):
        return torch.randn(*s, generator=gen).to(dt).requires_grad_(True)

    x = [r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), r(B, T, H, K), r(B, T, H)]
    A_log, dt_bias = r(H, dt=torch.float32), r(H * K, dt=torch.float32)
    h0 = r(B, H, K, V, dt=torch.float32)
    reset_dispatch_log()
    o, ht = chunk_kda(*x, initial_state=h0, output_final_state=True, A_log=A_log, dt_bias=dt_bias, **FLAGS)
    (o.float().sum() + ht.sum()).backward()
    assert o.shape == (B, T, H, V) and ht.shape == (B, H, K, V)
    for t in (*x, A_log, dt_bias, h0):
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype
    ran = {(c.stage, c.impl, c.reason) for c in dispatch_log()}
    want = {(st, "cute", None) for st in ("fwd_prep", "fwd", "bwd_prep", "b1", "dhu", "bwd_chunk")}
    assert want <= ran, ran
    assert {c.impl for c in dispatch_log() if c.stage in S.CUTE_STAGES} == {"cute"}, ran
    assert [c.impl for c in dispatch_log() if c.stage == "varlen_io"] == ["native"] * 5
    assert gathers == [], "nothing gathered"


def test_ragged_T_output_can_be_changed_in_place():
    """o of a ragged-T call (gathered off the padded row here: the reference stages) is no view
    autograd forbids changing: an in-place op on it and a backward through it work, as on the
    dense path."""
    shapes = (("q", (2, 100, 1, 16)), ("k", (2, 100, 1, 16)), ("v", (2, 100, 1, 8)), ("beta", (2, 100, 1)))
    x = {n: torch.randn(*s, dtype=D).requires_grad_(True) for n, s in shapes}
    g = torch.nn.functional.logsigmoid(torch.randn(2, 100, 1, 16, dtype=D)).requires_grad_(True)
    o, _ = chunk_kda(x["q"], x["k"], x["v"], g, x["beta"].sigmoid(), use_qk_l2norm_in_kernel=True)
    o.mul_(2)
    o.sum().backward()
    assert all(t.grad is not None for t in (*x.values(), g))
