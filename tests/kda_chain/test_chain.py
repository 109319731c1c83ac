"""The chain on CPU: end-to-end against autograd through the naive recurrence (float64), the
dispatch record and its reasons, input validation, whole-call delegation, the intra fold logic."""

from __future__ import annotations

import pytest
import torch
from kda_chain import chunk_kda, dispatch_log, is_supported, reset_dispatch_log
from kda_chain import stages as S
from kda_cute import registry
from kda_cute.reference import naive_kda, rel_err

D = torch.float64
CUTE = tuple(s.name for s in registry.STAGES)


def _inputs(B=2, T=100, H=2, HV=4, K=16, V=8, dtype=D, seed=0, h0=True):
    gen = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)

    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K), beta=r(B, T, HV),
             A_log=r(HV), dt_bias=r(HV * K))
    x["initial_state"] = r(B, HV, K, V) if h0 else None
    return x


FLAGS = [
    dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True),
    dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
         allow_neg_eigval=True, lower_bound=-5.0),
    dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True),
]


@pytest.mark.parametrize("shape", [dict(T=100, H=2, HV=4), dict(T=64, H=2, HV=2), dict(T=130, H=1, HV=3)])
@pytest.mark.parametrize("flags", FLAGS, ids=["gate", "gate_lb_negeig", "pregate"])
def test_chain_matches_autograd_through_naive_recurrence(shape, flags):
    x = _inputs(**shape)
    if not flags.get("use_gate_in_kernel"):
        with torch.no_grad():  # a pre-computed log gate must be negative
            x["g"].copy_(-torch.nn.functional.softplus(x["g"]))
    kw = dict(initial_state=x["initial_state"], output_final_state=True, **flags)
    if flags.get("use_gate_in_kernel"):
        kw.update(A_log=x["A_log"], dt_bias=x["dt_bias"])
    leaves = [n for n in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
              if n in ("q", "k", "v", "g", "beta", "initial_state") or flags.get("use_gate_in_kernel")]
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(*x["v"].shape, generator=gen, dtype=D)
    dht = torch.randn(*x["initial_state"].shape, generator=gen, dtype=D)

    def run(fn):
        for n in leaves:
            x[n].grad = None
        o, ht = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
        ((o * do).sum() + (ht * dht).sum()).backward()
        return [o.detach(), ht.detach()] + [x[n].grad.clone() for n in leaves]

    ours = run(chunk_kda)
    want = run(naive_kda)
    for name, a, b in zip(["o", "ht"] + ["d" + n for n in leaves], ours, want, strict=True):
        assert rel_err(a, b) < 1e-9, (name, rel_err(a, b))


def test_cpu_dispatch_goes_to_reference_with_reasons(monkeypatch, caplog):
    from kda_cute._common import support

    monkeypatch.setattr(support, "_logged", set())  # log_once: fresh for this test
    caplog.set_level("INFO", logger="kda_chain")
    x = _inputs(T=64)
    reset_dispatch_log()
    o, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], use_gate_in_kernel=True, A_log=x["A_log"],
                     use_qk_l2norm_in_kernel=True)
    o.sum().backward()
    log = {c.stage: c for c in dispatch_log()}
    # bwd_chunk without its kernel runs as its separate stages (wy_dqkg, intra, ...), each on the reference
    runs = {stage: "split" if stage == "bwd_chunk" else "reference" for stage in CUTE}
    for stage in CUTE:
        assert log[stage].impl == runs[stage]
        assert "cute: " in log[stage].reason and "fla: no CUDA device" in log[stage].reason
    assert "dg_cumsum" in log, "without the CuTe intra the dg cumsum stage must run"
    assert log["gate_bwd"].reason == "fla: no CUDA device"  # a stage without a CuTe kernel
    # every fallback is also logged (once per reason), so it is never silent
    said = [r.getMessage() for r in caplog.records]
    for stage in (*CUTE, "gate_bwd"):
        how = "as separate stages" if runs.get(stage) == "split" else "reference"
        want = f"kda_chain: {stage} runs {how}: {log[stage].reason}"
        assert said.count(want) == 1, (want, said)


def test_force_fla_env_is_read_per_call(monkeypatch):
    x = _inputs(T=64)
    monkeypatch.setenv("KDA_FORCE_FLA", "intra")
    impl, reason = S.intra.choose(x["q"], x["k"], x["g"], x["beta"], *[None] * 6)
    assert reason.startswith("cute: forced to fla by KDA_FORCE_FLA")
    monkeypatch.delenv("KDA_FORCE_FLA")
    impl, reason = S.intra.choose(x["q"], x["k"], x["g"], x["beta"], *[None] * 6)
    assert "forced" not in reason


def test_fwd_prep_computes_qg_only_when_the_cute_fwd_is_planned(monkeypatch):
    """fwd_prep is asked for qg (kda_cute_fwd's input) only when fwd.plan_reason accepts the
    inputs and KDA_FORCE_FLA does not name fwd; the result is the same either way."""
    import kda_cute.fwd as F
    from kda_chain.stages import capture, cute_planned

    x = _inputs(T=64)

    def run():
        with capture() as calls:
            o, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"])
        args = dict((name, a) for name, a, _ in calls)
        return o.detach(), args["fwd_prep"][11], args["fwd"][1]

    o0, want0, qg0 = run()  # CPU: no device, no qg
    assert (want0, qg0) == (False, None)
    assert not cute_planned("fwd", x["q"], x["v"], x["initial_state"])
    monkeypatch.setattr(F, "plan_reason", lambda q, v, h0=None, chunks=None: None)
    assert cute_planned("fwd", x["q"], x["v"], x["initial_state"])
    o1, want1, qg1 = run()
    assert want1 is True and tuple(qg1.shape) == tuple(x["q"].shape[:2]) + (4, 16)
    assert torch.equal(o0, o1)  # the reference scan gates q itself
    monkeypatch.setenv("KDA_FORCE_FLA", "fwd")
    assert not cute_planned("fwd", x["q"], x["v"], x["initial_state"])
    assert run()[1:] == (False, None)


@pytest.mark.parametrize("gate_in", [False, True], ids=["pregate", "gate"])
def test_bwd_prep_reads_the_forwards_gk_without_the_gate_in_the_op(gate_in):
    """Without the gate in the op the forward keeps gk (as fla does) and bwd_prep takes that very
    tensor (kda_cute_bwd_prep then reads it: no gate, no cumsum, no gk written); with the gate in
    the op nothing is kept and bwd_prep recomputes gk from g."""
    from kda_chain.stages import capture

    x = _inputs(T=130, H=2, HV=4)
    kw = dict(initial_state=x["initial_state"], use_gate_in_kernel=gate_in)
    if gate_in:
        kw.update(A_log=x["A_log"])
    g = x["g"] if gate_in else -torch.nn.functional.softplus(x["g"]).detach().requires_grad_(True)
    with capture() as calls:
        o, _ = chunk_kda(x["q"], x["k"], x["v"], g, x["beta"], **kw)
        o.sum().backward()
    args = {name: (a, kwa) for name, a, kwa in calls}
    fwd_gk = args["fwd"][0][5]
    given = args["bwd_prep"][1].get("gk")
    if gate_in:
        assert given is None
    else:
        assert given is not None and torch.equal(given, fwd_gk)  # (the saved one: a contiguous copy
        # of the reference's strided view here, the kernel's own output on the GPU)


def _grads_and_stages(x, names, kw):
    """One fwd+bwd of chunk_kda on x (o.sum()) -> the gradients of `names`, the stages called."""
    for n in names:
        x[n].grad = None
    reset_dispatch_log()
    o, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    o.sum().backward()
    return [x[n].grad.clone() for n in names], [c.stage for c in dispatch_log()]


@pytest.mark.parametrize("gate", [dict(), dict(dt_bias=True, lower_bound=-5.0), None],
                         ids=["gate", "gate_bias_lb", "no_gate"])
def test_fused_bwd_chunk_replaces_wy_intra_and_l2norm_bwd(monkeypatch, gate):
    """With a CuTe bwd_chunk the chain makes one stage call for wy_dqkg, intra, dg_cumsum, (l2norm
    in the op, HV == H) l2norm_bwd, passing the rstds, and (the gate in the op) gate_bwd, passing
    the raw gate, A_log, dt_bias and lower_bound; the gradients are the split path's. The 'CuTe'
    implementation here is the reference's bwd_chunk."""
    from kda_cute import reference as ref

    x = _inputs(T=128, H=2, HV=2)
    kw = dict(initial_state=x["initial_state"], use_qk_l2norm_in_kernel=True)
    names = ["q", "k", "v", "g", "beta"]
    if gate is None:  # a pre-computed log gate
        with torch.no_grad():
            x["g"].copy_(-torch.nn.functional.softplus(x["g"]))
    else:
        kw.update(use_gate_in_kernel=True, A_log=x["A_log"])
        names.append("A_log")
        if gate.get("dt_bias"):
            kw.update(dt_bias=x["dt_bias"], lower_bound=gate["lower_bound"])
            names.append("dt_bias")

    want, split = _grads_and_stages(x, names, kw)
    assert "bwd_wy_dqkg" in split and "intra" in split and split.count("l2norm_bwd") == 2
    assert split.count("gate_bwd") == (gate is not None)
    seen = {}

    def fake_cute(*args, **kwargs):
        seen.update(kwargs)
        return ref.bwd_chunk(*args, **kwargs)

    fake = S.Impl("cute", lambda *a, **k: None, fake_cute)
    monkeypatch.setattr(S.bwd_chunk, "impls", [fake, *S.bwd_chunk.impls[1:]])
    S.clear_gate_cache()
    got, stages = _grads_and_stages(x, names, kw)
    folded = {"emit_bf16", "q_rstd", "k_rstd"}
    if gate is not None:
        folded |= {"g", "A_log", "dt_bias", "lower_bound"}
        assert seen["A_log"] is x["A_log"] and seen["lower_bound"] == gate.get("lower_bound")
        assert (seen["dt_bias"] is None) == (not gate)
    assert set(seen) == folded and seen["emit_bf16"] is False  # float64
    for st in ("bwd_wy_dqkg", "intra", "dg_cumsum", "l2norm_bwd", "gate_bwd"):  # (bwd_dAv: dhu's dv)
        assert st not in stages, (st, stages)
    assert stages.count("bwd_chunk") == 1
    for n, a, b in zip(names, got, want, strict=True):
        assert rel_err(a, b) < 1e-12, n


def test_bwd_chunk_without_its_gate_part_runs_gate_bwd(monkeypatch):
    """A CuTe bwd_chunk that refuses the gate's arguments (but takes the call without them) still
    runs, without them; gate_bwd then runs as its own stage. Same gradients."""
    from kda_cute import reference as ref

    x = _inputs(T=128, H=2, HV=2)
    kw = dict(initial_state=x["initial_state"], use_gate_in_kernel=True, A_log=x["A_log"],
              dt_bias=x["dt_bias"])
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")

    want, _ = _grads_and_stages(x, names, kw)
    fake = S.Impl("cute", lambda *a, **k: "no gate" if k.get("A_log") is not None else None, ref.bwd_chunk)
    monkeypatch.setattr(S.bwd_chunk, "impls", [fake, *S.bwd_chunk.impls[1:]])
    S.clear_gate_cache()
    got, stages = _grads_and_stages(x, names, kw)
    assert stages.count("bwd_chunk") == 1 and stages.count("gate_bwd") == 1
    assert "bwd_wy_dqkg" not in stages and "intra" not in stages
    for n, a, b in zip(names, got, want, strict=True):
        assert rel_err(a, b) < 1e-12, n


@pytest.mark.parametrize("HV", [2, 4])
def test_cute_fwd_prep_takes_the_l2norm(monkeypatch, HV):
    """With the L2 norm in the op and a CuTe fwd_prep the chain hands fwd_prep the raw q, k with
    l2norm=True and calls no l2norm_fwd stage (HV == H and GVA); o, ht and every gradient are the
    unfused path's (l2norm_fwd twice, then fwd_prep), the backward reading the rstds fwd_prep
    returned. The 'CuTe' implementation here is the reference's fwd_prep (which honours l2norm)."""
    from kda_cute import reference as ref

    x = _inputs(T=128, H=2, HV=HV)
    kw = dict(use_gate_in_kernel=True, A_log=x["A_log"], initial_state=x["initial_state"],
              output_final_state=True, use_qk_l2norm_in_kernel=True)
    names = ("q", "k", "v", "g", "beta")

    def run():
        for n in names:
            x[n].grad = None
        reset_dispatch_log()
        o, ht = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
        (o.sum() + ht.sum()).backward()
        outs = [o.detach(), ht.detach()] + [x[n].grad.clone() for n in names]
        return outs, [c.stage for c in dispatch_log()]

    want, unfused = run()
    assert unfused.count("l2norm_fwd") == 2 and unfused.index("l2norm_fwd") < unfused.index("fwd_prep")
    seen = []

    def fake_cute(*args, **kwargs):
        seen.append((args, kwargs))
        return ref.fwd_prep(*args, **kwargs)

    fake = S.Impl("cute", lambda *a, **k: None, fake_cute)
    monkeypatch.setattr(S.fwd_prep, "impls", [fake, *S.fwd_prep.impls[1:]])
    S.clear_gate_cache()
    got, stages = run()
    assert "l2norm_fwd" not in stages and stages.count("fwd_prep") == 1, stages
    assert len(seen) == 1 and seen[0][1] == {"l2norm": True}
    assert torch.equal(seen[0][0][0], x["q"].detach()) and torch.equal(seen[0][0][1], x["k"].detach())
    for n, a, b in zip(("o", "ht", *names), got, want, strict=True):
        assert rel_err(a, b) < 1e-12, n


def test_intra_fold_dg_path_skips_dg_cumsum(monkeypatch):
    """With a CuTe intra the chain asks for fold_dg and drops dg_cumsum; the result is the same.
    The 'CuTe' implementation here is the reference's bwd_intra (which honours fold_dg)."""
    from kda_cute import reference as ref

    x = _inputs(T=128, H=2, HV=2)
    kw = dict(use_gate_in_kernel=True, A_log=x["A_log"], initial_state=x["initial_state"])
    o, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    o.sum().backward()
    want = [x[n].grad.clone() for n in ("q", "k", "g", "beta")]

    seen = {}

    def fake_cute(*args, **kwargs):
        seen.update(kwargs)
        return ref.bwd_intra(*args, **kwargs)

    fake = S.Impl("cute", lambda *a, **k: None, fake_cute)
    monkeypatch.setattr(S.intra, "impls", [fake, *S.intra.impls[1:]])
    for n in ("q", "k", "g", "beta"):
        x[n].grad = None
    reset_dispatch_log()
    o, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    o.sum().backward()
    stages = [c.stage for c in dispatch_log()]
    assert seen == {"fold_dg": True, "emit_bf16": False}  # float64 inputs: no bf16 emission
    assert "dg_cumsum" not in stages
    for n, w in zip(("q", "k", "g", "beta"), want, strict=True):
        assert rel_err(x[n].grad, w) < 1e-12, n


@pytest.mark.parametrize("fused", [("dhu", "bwd_wy_dqkg"), ("dhu",), ("bwd_wy_dqkg",)])
def test_dAv_folds_into_cute_dhu_and_wy_dqkg(fused, monkeypatch):
    """With CuTe dhu and wy_dqkg the chain passes Aqk to dhu (dv = tril(Aqk)^T do inside) and asks
    wy_dqkg for dAqk: bwd_dAv does not run. With only one of them CuTe, bwd_dAv runs once for what
    the other lacks. The 'CuTe' implementations are the reference's (which honour both forms);
    every gradient equals the unfused chain's."""
    from kda_cute import reference as ref

    x = _inputs(T=200, H=2, HV=4)  # ragged T, GVA
    kw = dict(use_gate_in_kernel=True, A_log=x["A_log"], initial_state=x["initial_state"],
              output_final_state=True)
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def grads():
        for n in names:
            x[n].grad = None
        o, ht = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
        (o.sum() + ht.sum()).backward()
        return [x[n].grad.clone() for n in names]

    want = grads()
    seen = {}

    def fake(stage, fn):
        def call(*args, **kwargs):
            seen[stage] = (args[7] is None and args[-1] is not None) if stage == "dhu" else kwargs
            return fn(*args, **kwargs)
        # (a ragged T runs as packed sequences: like a kernel without a packed build, the stand-in
        # passes over the chunk table's form, and the chain asks again on the padded row)
        return S.Impl("cute", lambda *a, **k: "no chunk table here" if "table" in k else None, call)

    for st, fn in (("dhu", ref.bwd_dhu), ("bwd_wy_dqkg", ref.bwd_wy_dqkg)):
        if st in fused:
            monkeypatch.setattr(S.STAGES[st], "impls", [fake(st, fn), *S.STAGES[st].impls[1:]])
            S.STAGES[st].decided.clear()
    reset_dispatch_log()
    got = grads()
    stages = [c.stage for c in dispatch_log()]
    assert stages.count("bwd_dAv") == (0 if len(fused) == 2 else 1), stages
    if "dhu" in fused:
        assert seen["dhu"] is True  # dv None, Aqk given
    if "bwd_wy_dqkg" in fused:
        assert seen["bwd_wy_dqkg"] == ({"want_dAqk": True} if "dhu" in fused else {})
    for n, a, b in zip(names, got, want, strict=True):
        assert rel_err(a, b) < 1e-12, n


@pytest.mark.parametrize("gate", [True, False])
def test_disable_recompute_keeps_the_forward_and_skips_the_recompute(gate):
    """disable_recompute (fla's flag): the forward keeps w, u, qg, kg, h, v_new (b1 runs there,
    once) and gk; the backward runs no bwd_prep (gate cumsum + recompute_w_u) or b1; every output and gradient
    equals the recompute path's (float64 reference stages: to rounding)."""
    x = _inputs(T=200, H=2, HV=4)  # ragged T, GVA
    kw = dict(use_gate_in_kernel=gate, A_log=x["A_log"], initial_state=x["initial_state"],
              output_final_state=True)
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def run(**extra):
        for n in names:
            x[n].grad = None
        reset_dispatch_log()
        o, ht = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw, **extra)
        (o.sum() + ht.sum()).backward()
        outs = [o.detach(), ht.detach(), *(x[n].grad.clone() for n in names)]
        return outs, [c.stage for c in dispatch_log()]

    want, stages0 = run()
    got, stages1 = run(disable_recompute=True)
    assert "bwd_prep" in stages0 and "bwd_prep" not in stages1
    assert stages1.count("b1") == 1
    assert stages1.index("b1") < stages1.index("dhu")  # in the forward, before the backward's scans
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-12


def test_backward_frees_the_scans_outputs_before_intra(monkeypatch):
    """Memory: by the time intra runs, the backward holds none of b1's h, v_new, dhu's dh, dv2 or
    bwd_prep's w, kg, qg (at the reference shape ~8 GB; the argument tuples once kept them)."""
    import weakref

    from kda_cute import reference as ref

    x = _inputs(T=128, H=2, HV=2)
    refs = {}

    def recording(stage, fn, names):
        def call(*a, **k):
            out = fn(*a, **k)
            for n, t in zip(names, out, strict=False):
                if n and t is not None:
                    refs[n] = weakref.ref(t)
            return out
        return S.Impl("cute", lambda *a, **k: None, call)

    def intra_checks(*a, **k):
        alive = [n for n, r in refs.items() if r() is not None]
        assert not alive, f"still held when intra runs: {alive}"
        return ref.bwd_intra(*a, **k)

    fakes = {"bwd_prep": (ref.bwd_prep, ("", "w", "u", "qg", "kg")), "b1": (ref.fwd_h, ("h", "v_new")),
             "dhu": (ref.bwd_dhu, ("dh", "", "dv2"))}  # dh0 is a result: kept
    for st, (fn, names) in fakes.items():
        monkeypatch.setattr(S.STAGES[st], "impls", [recording(st, fn, names), *S.STAGES[st].impls[1:]])
    checker = S.Impl("cute", lambda *a, **k: None, intra_checks)
    monkeypatch.setattr(S.intra, "impls", [checker, *S.intra.impls[1:]])
    for st in (*fakes, "intra"):
        S.STAGES[st].decided.clear()
    o, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"])
    refs.clear()  # the forward's b1 does not run here (no disable_recompute); start with the backward
    o.sum().backward()
    assert {"h", "v_new", "dh", "dv2", "w", "kg", "qg"} <= set(refs)  # recorded in the backward


@pytest.mark.parametrize("mutate, match", [
    (lambda x: x.update(k=x["k"][:, :, :1]), "q and k must have the same shape"),
    (lambda x: x.update(v=x["v"][:, :, :3]), "must be a multiple of H"),
    (lambda x: x.update(g=x["g"][..., :8]), "g must have shape"),
    (lambda x: x.update(beta=x["beta"][:, :50]), "beta must have shape"),
    (lambda x: x.update(v=x["v"].float()), "v dtype"),
    (lambda x: x.update(q=x["q"].long(), k=x["k"].long()), "floating dtype"),
    (lambda x: x.update(initial_state=x["initial_state"][:1]), "initial_state must have shape"),
    (lambda x: x.update(initial_state=x["initial_state"].half()), "initial_state must be float32"),
])
def test_bad_input_fails_before_any_stage(mutate, match):
    x = _inputs(T=64)
    mutate(x)
    reset_dispatch_log()
    with pytest.raises(ValueError, match=match):
        chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"])
    assert list(dispatch_log()) == []


def test_gate_in_kernel_needs_A_log_and_neg_eigval_needs_sigmoid():
    x = _inputs(T=64)
    with pytest.raises(ValueError, match="A_log must be given"):
        chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], allow_neg_eigval=True)
    with pytest.raises(TypeError, match="unexpected keyword"):
        chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_sz=64)


@pytest.mark.parametrize("kw, why", [
    (dict(cu_seqlens=torch.tensor([0, 64]), safe_gate=True), "safe_gate"),  # cu_seqlens alone: test_varlen.py
    (dict(safe_gate=True), "safe_gate"),
    (dict(state_v_first=True), "state_v_first"),
    (dict(chunk_size=32), "chunk_size 32"),
])
def test_unimplemented_flags_go_to_fla_and_say_so(kw, why):
    x = _inputs(B=1, T=64)
    with pytest.raises(NotImplementedError, match=why):
        chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)


def test_is_supported_names_a_reason_per_cute_stage():
    q = torch.empty(2, 128, 4, 128, dtype=torch.bfloat16)
    v = torch.empty(2, 128, 4, 256, dtype=torch.bfloat16)
    r = is_supported(q, v)
    assert set(r) == set(CUTE)
    assert all(reason and "cute: " in reason for reason in r.values())
    assert "chunk_size 32" in is_supported(q, v, chunk_size=32)["intra"]


@pytest.mark.parametrize("stage", CUTE)
def test_gated_cute_call_goes_to_launch_with_the_contract_signature(stage, monkeypatch):
    """After its gate says yes, a CuTe stage calls the module's `launch` (the contract function
    without the checks the gate just made), which takes exactly the contract's parameters."""
    import importlib
    import inspect

    mod = importlib.import_module(registry.BY_NAME[stage].module_name)
    name = registry.BY_NAME[stage].contract
    contract = getattr(mod, name)
    assert inspect.signature(mod.launch).parameters.keys() == inspect.signature(contract).parameters.keys()
    seen = []
    monkeypatch.setattr(mod, "launch", lambda *a, **k: seen.append((a, k)) or "launched")
    monkeypatch.setattr(mod, name, lambda *a, **k: pytest.fail("re-checked"))
    assert S.CUTE_STAGES[stage].impls[0].fn(1, 2, x=3) == "launched" and seen == [((1, 2), {"x": 3})]


def test_fla_adapters_bind_to_fla_signatures(monkeypatch):
    """Each fla adapter's call must bind to the real fla 0.6.0 function's signature (the kernels
    themselves need CUDA; this catches a renamed or misspelled argument on CPU)."""
    import importlib
    import inspect

    pytest.importorskip("fla")
    bound = []

    def fake(path, name):
        sig = inspect.signature(getattr(importlib.import_module(path), name))

        def call(*args, **kwargs):
            sig.bind(*args, **kwargs)
            bound.append(name)
            n = {"chunk_gated_delta_rule_fwd_h": 3, "l2norm_fwd": 2}.get(name, 6)
            return (torch.zeros(1),) * n

        return call

    monkeypatch.setattr(S, "_fla", fake)
    t = torch.zeros(1)
    calls = [
        lambda: S._fla_gate_chunk_cumsum(t, t, t, None, 64, True),
        lambda: S._fla_gate_chunk_cumsum(t, None, None, None, 64, False),
        lambda: S._fla_fwd_intra(t, t, t, t, t, 0.1, 64),
        lambda: S._fla_fwd_intra(t, t, t, t, t, 0.1, 64, True),
        lambda: S._fla_fwd_prep(t, t, t, t, t, t, t, None, True, 0.1, 64, True, l2norm=True),
        lambda: S._fla_fwd_scan(t, t, t, t, t, t, t, None, True, 0.1),
        lambda: S._fla_recompute_w_u(t, t, t, t, t, t),
        lambda: S._fla_bwd_dAv(t, t, t, t, t, 0.1),
        lambda: S._fla_bwd_dhu(t, t, t, t, None, None, t, t, 0.1),
        lambda: S._fla_bwd_wy_dqkg(t, t, t, t, t, t, t, t, t, t, t, 0.1),
        lambda: S._fla_bwd_intra(t, t, t, t, t, t, t, t, t, t),
        lambda: S._fla_dg_cumsum(t, 64),
        lambda: S._fla_l2norm_fwd(t),
        lambda: S._fla_l2norm_bwd(t, t, t),
        lambda: S._fla_beta_sigmoid_fwd(t, 1.0),
        lambda: S._fla_beta_sigmoid_bwd(t, t, 1.0),
        lambda: S._fla_gate_bwd(t, t, t, t, None),
    ]
    for c in calls:
        c()
    assert len(bound) == 21  # fwd_scan binds two fla functions, fwd_prep with l2norm four


def test_backward_on_another_thread_is_recorded_and_captured():
    """On CUDA, autograd runs the backward on its own thread: the dispatch log and `capture`
    must still see those stages (a thread-local record lost them on the H200)."""
    import threading

    from kda_chain.stages import capture

    x = _inputs(T=64)
    for n in ("q", "k", "v", "g", "beta"):
        x[n].requires_grad_(True)
    reset_dispatch_log()
    with capture() as calls:
        o, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"])
        t = threading.Thread(target=lambda: o.sum().backward())
        t.start()
        t.join()
    logged = {c.stage for c in dispatch_log()}
    captured = {name for name, _, _ in calls}
    for st in ("b1", "dhu", "intra"):
        assert st in logged and st in captured, (st, logged, captured)


def test_dispatch_log_is_bounded():
    """A training run calls the chain forever: the record keeps only the newest LOG_SIZE choices."""
    from kda_chain import stages as S

    st = S.Stage("probe", [S.Impl("reference", S._always, lambda: None)])
    S.reset_dispatch_log()
    for _ in range(S.LOG_SIZE + 10):
        st()
    log = S.dispatch_log()
    assert len(log) == S.LOG_SIZE and all(c.stage == "probe" for c in log)
    S.reset_dispatch_log()


def test_plan_replays_every_decision_and_notices_a_changed_stage(monkeypatch):
    """A chain call's decisions are recorded per top-level signature and replayed on the next
    call with no per-stage signature (`_signature` is not called at all); a stage whose
    implementations changed since is asked again (its new first implementation runs) and the
    stale plan is recorded anew; a changed KDA_FORCE_FLA is a new signature."""
    x = _inputs(T=64)
    kw = dict(use_gate_in_kernel=True, A_log=x["A_log"], initial_state=x["initial_state"])

    def step():
        reset_dispatch_log()
        o, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
        o.sum().backward()
        return [(c.stage, c.impl, c.reason) for c in dispatch_log()], o.detach()

    S.clear_gate_cache()
    first, o1 = step()
    real_signature = S._signature
    asked = []
    monkeypatch.setattr(S, "_signature", lambda *a: asked.append(a) or real_signature(*a))
    again, o2 = step()
    assert again == first and torch.equal(o1, o2)
    assert len(asked) == 2, "one signature per direction (fwd, bwd), none per stage"
    assert [a[0][0] for a in asked] == ["fwd", "bwd"] and len(asked[1][0]) == 3, \
        "the backward's plan: the forward's key and do / dht only, not every saved tensor"

    seen = []

    def fake_cute(*args, **kwargs):
        seen.append(kwargs)
        return S.ref.bwd_intra(*args, **kwargs)

    monkeypatch.setattr(S.intra, "impls", [S.Impl("cute", S._always, fake_cute), *S.intra.impls[1:]])
    asked.clear()
    changed, _ = step()
    assert seen and ("intra", "cute", None) in changed and "dg_cumsum" not in [c[0] for c in changed]
    assert len(asked) > 2  # the backward's stages from intra on asked their gates again
    step()  # the stale plan was dropped: this call records anew ...
    asked.clear()
    assert step()[0] == changed and len(asked) == 2  # ... and this one replays it

    assert not any("forced" in (reason or "") for _, _, reason in changed)
    monkeypatch.setenv("KDA_FORCE_FLA", "dhu")
    forced, _ = step()
    assert any(st == "dhu" and "forced to fla" in reason for st, _, reason in forced)


def test_a_recorded_plan_replays_every_cute_launch_with_fresh_outputs(monkeypatch):
    """On the chain's CuTe path (kernels stubbed: kda_chain.testing.stub_device), the first call of
    a signature records each CuTe launch; the next call replays all six without any module's
    `launch` (bwd_chunk's torch `finish` still runs: dA_log comes out), every output and gradient
    of the same shape, dtype and strides as the recorded call's, fresh (no storage shared)."""
    pytest.importorskip("cutlass.cute")
    from kda_chain.testing import stub_device

    stub_device(monkeypatch.setattr)
    S.clear_gate_cache()
    gen = torch.Generator().manual_seed(0)

    def r(*s, dt=torch.bfloat16):
        return torch.randn(*s, generator=gen).to(dt).requires_grad_(True)

    B, T, H, K, V = 1, 128, 16, 128, 128  # (16 heads: dhu's grid floor, 32 V tiles)
    leaves = [r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), r(B, T, H, K), r(B, T, H)]
    A_log = r(H, dt=torch.float32)

    def step():
        for t in (*leaves, A_log):
            t.grad = None
        reset_dispatch_log()
        o, ht = chunk_kda(*leaves, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                          output_final_state=True)
        (o.float().sum() + ht.sum()).backward()
        return [o, ht, *(t.grad for t in (*leaves, A_log))], [(c.stage, c.impl) for c in dispatch_log()]

    launched = []
    for rec in registry.STAGES:
        mod = rec.load()
        real = mod.launch
        monkeypatch.setattr(mod, "launch", lambda *a, _n=rec.name, _f=real, **k: launched.append(_n) or
                            _f(*a, **k))
    first, ran = step()
    assert {st for st, impl in ran if impl == "cute"} == {"fwd_prep", "fwd", "bwd_prep", "b1", "dhu",
                                                          "bwd_chunk"}, ran
    assert launched == ["fwd_prep", "fwd", "bwd_prep", "b1", "dhu"], "recorded (bwd_chunk: its launch_raw)"
    launched.clear()
    plans = [launches for _, launches in S._plans.values()]
    assert [[n for n, _, _ in p] for p in plans] == [["fwd_prep", "fwd"],
                                                     ["bwd_prep", "b1", "dhu", "bwd_chunk"]]
    assert all(rp is not None for p in plans for _, _, rp in p), plans
    again, ran2 = step()
    assert ran2 == ran and launched == [], "the replayed call ran no module's launch"
    for a, b in zip(first, again, strict=True):
        assert a is not None and (a.shape, a.dtype, a.stride()) == (b.shape, b.dtype, b.stride())
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr(), "outputs are fresh"
    with torch.inference_mode():  # inference tensors (no version counters): recorded as not replayable
        x = [t.detach().clone() for t in leaves]
        o, _ = chunk_kda(*x, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log.detach())
        o2, _ = chunk_kda(*x, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log.detach())
    assert o2.shape == o.shape and launched == ["fwd_prep", "fwd"] * 2


def test_a_replayed_launch_passes_each_kernel_what_the_module_would(monkeypatch):
    """Every compiled call of a replayed chain call gets, argument by argument, the tensor the
    module's own launch gives it on the same inputs (the same user tensor or view of it, at the
    same pointer, shape and strides; a fresh output of the same form), with A_log and dt_bias as
    slices of one parameter buffer; a call with q is k is never replayed for a later q, k pair."""
    pytest.importorskip("cutlass.cute")
    from kda_chain.testing import stub_device
    from kda_cute._common import cache as call_cache

    stub_device(monkeypatch.setattr)
    got = []
    monkeypatch.setattr(call_cache.CallCache, "_compile_tvm_ffi",
                        lambda self, ckey, args, dyn, build: self.compiled.setdefault(ckey, _kernel_spy(got)))
    for rec in registry.STAGES:  # (stand-in kernels of earlier tests: compile the spy instead)
        rec.load()._cache.clear()
    gen = torch.Generator().manual_seed(1)
    B, T, H, K, V = 1, 128, 16, 128, 128

    def r(*s, dt=torch.bfloat16):
        return torch.randn(*s, generator=gen).to(dt).requires_grad_(True)

    q, k, v, g, beta = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), r(B, T, H, K), r(B, T, H)
    params = torch.randn(H + H * K + 4, generator=gen)  # one flat buffer (FSDP-like)
    flat = params[4:4 + H], params[4 + H:]
    apart = tuple(t.clone() for t in flat)  # the same signature, two storages

    def step(kk=k, gate=flat):
        got.clear()
        o, _ = chunk_kda(q, kk, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                         A_log=gate[0], dt_bias=gate[1])
        o.float().sum().backward()
        user = [q, k, v, g, beta, *gate]
        return [[_provenance(t, user) for t in call] for call in got]

    S.clear_gate_cache()
    recorded = step()  # records: the modules' own launches
    replayed = step()
    assert len(recorded) == 6 and replayed == recorded
    replayed = step(gate=apart)  # replays the plan recorded on the flat buffer
    S.clear_gate_cache()
    assert replayed == step(gate=apart), "dt_bias's view must come from dt_bias, not A_log's storage"
    S.clear_gate_cache()
    step(q)  # q is k: this plan's fwd_prep launch is not replayable ...
    assert step() == recorded  # ... so a later call of that key with a distinct k gets k, not q


def _kernel_spy(got):
    def kernel(*tensors):
        got.append(tensors)

    return kernel


def _provenance(t, user):
    """Where a kernel argument comes from: (user tensor index, offset, shape, stride) for a user
    tensor's storage, else ("fresh", shape, stride, dtype)."""
    for i, u in enumerate(user):
        if t.untyped_storage().data_ptr() == u.untyped_storage().data_ptr():
            return (i, t.storage_offset() - u.storage_offset(), tuple(t.shape), t.stride())
    return ("fresh", tuple(t.shape), t.stride(), t.dtype)
