"""One record per CuTe stage (kda_cute.registry) is the source of the chain's table, the witness's
expectation and is_supported: these tests fail when the two sides drift apart."""

import kda_witness
import pytest
import torch
from kda_chain import STAGES, is_supported
from kda_cute import registry


def _chain_cute_stages() -> set[str]:
    """The stages whose implementations include a CuTe kernel, read from the chain's table."""
    return {name for name, st in STAGES.items() if any(i.name == "cute" for i in st.impls)}


def test_witness_expects_exactly_the_chains_cute_stages():
    """A CuTe stage in the chain that the witness does not expect could fall back while
    `--require-cute` passes: the expectation must name every one, with its kernels."""
    expected = kda_witness.expected_kernels()
    gone = registry.replaced()  # computed inside another stage's kernel (bwd_chunk's, fwd_prep's)
    assert gone == {"bwd_wy_dqkg", "intra", "l2norm_bwd", "gate_bwd", "l2norm_fwd"}
    assert set(expected.values()) == _chain_cute_stages() - gone
    for rec in registry.STAGES:
        for k in rec.kernels:
            assert expected.get(k) == (None if rec.name in gone else rec.name), (k, rec.name, expected)


def test_every_record_has_a_module_with_the_contract():
    for rec in registry.STAGES:
        mod = rec.load()
        assert mod is not None, rec.module_name
        for fn in (rec.contract, "launch", "is_supported"):
            assert callable(getattr(mod, fn, None)), (rec.module_name, fn)


@pytest.mark.parametrize("rec", registry.STAGES, ids=lambda r: r.name)
def test_probe_arguments_bind_to_the_contract(rec):
    """`is_supported`'s probe passes exactly the positional arguments of the contract."""
    import inspect

    from kda_cute import reference

    d = registry.Dims(2, 128, 2, 4, 128, 256)
    args = rec.probe(d)
    inspect.signature(getattr(reference, rec.contract)).bind(*args, **{f: False for f in rec.flags})
    assert all(a.device.type == "meta" for a in args if isinstance(a, torch.Tensor))


def test_is_supported_allocates_nothing_and_takes_meta_tensors():
    """The answer comes from meta tensors standing for q's device: a meta q is not 'not on CUDA'
    because of the probe, and no storage is allocated whatever the shape (B16 T65536 here)."""
    q = torch.empty(16, 65536, 16, 128, device="meta", dtype=torch.bfloat16)
    v = torch.empty(16, 65536, 16, 256, device="meta", dtype=torch.bfloat16)
    r = is_supported(q, v)
    assert set(r) == {s.name for s in registry.STAGES}
    assert all(reason for reason in r.values())  # a meta device runs no kernel, and says why


def test_registered_kernel_names_must_be_distinguishable():
    with pytest.raises(ValueError, match="substring"):
        kda_witness.register_kernels({"kda_cute_b1": "b1", "kda_cute_b1x": "b1x"})
    assert kda_witness.expected_kernels() == registry.chain_kernels()  # unchanged by the refusal


def test_gate_decisions_are_cached_per_call_signature(monkeypatch):
    """A stage asks its gates once per signature (shapes, strides, dtypes, device, alignment,
    scalars, KDA_FORCE_FLA): the second call with equal signatures asks nothing; a new shape,
    a strided view or the switch asks again."""
    from kda_chain import stages as S

    asked = []
    st = S.Stage("probe", [S.Impl("cute", lambda *a, **k: asked.append(a[0].shape) or "no", lambda *a: "c"),
                           S.Impl("reference", S._always, lambda *a: "r")])
    x = torch.zeros(4, 8)
    assert st(x, 1.0) == "r" and st(torch.ones(4, 8), 1.0) == "r"
    assert len(asked) == 1
    st(torch.zeros(4, 9), 1.0)
    st(torch.zeros(8, 4).t(), 1.0)  # same shape, other strides
    st(x, 2.0)
    assert len(asked) == 4
    monkeypatch.setenv("KDA_FORCE_FLA", "probe")
    st(x, 1.0)
    assert len(asked) == 5
