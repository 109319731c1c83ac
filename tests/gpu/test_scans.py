"""GPU correctness of the sm_90 scans (kda_cute_b1 / kda_cute_fwd / kda_cute_dhu) against fla 0.6.0
and the float64 reference: every output within 2x fla's error (plus a 1e-6 floor), finite after
NaN-poisoned allocation, bitwise repeatable. Inputs are realistic: kg, w, u, Aqk and qg come from
fla's own intra (disable_recompute: the store of qg the chain asks for) on l2-normed q, k and
negative gates; the oracle is `kda_cute.reference` on float64 copies (fwd_scan gates q itself).
The same checks, with timing and the kernels' variants, are bench/check_scans.py. Skips without
CUDA."""

import contextlib

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("fla")
pytest.importorskip("cutlass.cute")
import kda_cute.b1 as b1  # noqa: E402
import kda_cute.dhu as dhu  # noqa: E402
import kda_cute.fwd as fwd  # noqa: E402
from kda_chain.testing import fla_dhu, scan_inputs  # noqa: E402
from kda_cute import reference as ref  # noqa: E402
from kda_cute.reference import rel_err  # noqa: E402

MODS = {"b1": b1, "fwd": fwd, "dhu": dhu}
OUTPUTS = {"b1": ("h", "v_new", "ht"), "fwd": ("o", "ht"), "dhu": ("dh", "dh0", "dv2")}

SHAPES = {  # B, T, H, HV, V, dtype, with h0 / dht
    "h0_dht": (2, 256, 16, 16, 128, torch.bfloat16, True),
    "one_chunk": (1, 64, 16, 16, 256, torch.bfloat16, False),
    "gva_tail": (2, 200, 8, 16, 128, torch.bfloat16, True),
    "fp16": (2, 256, 16, 16, 128, torch.float16, True),
}


def ours(stage, d):
    if stage == "b1":
        return b1.fwd_h(d["kg"], d["w"], d["u"], d["gk"], d["h0"], True)
    if stage == "fwd":
        return fwd.fwd_scan(d["q"], d["qg"], d["kg"], d["w"], d["u"], d["gk"], d["Aqk"], d["h0"], True,
                            d["scale"])
    return dhu.bwd_dhu(d["qg"], d["kg"], d["w"], d["gk"], d["h0"], d["dht"], d["do"], None, d["scale"],
                       d["Aqk"])


def fla(stage, d):
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk

    if stage == "dhu":  # fla's bwd_dAv (its dv) + bwd_dhu: what the fused kernel replaces
        return fla_dhu(d)
    h, v_new, ht = chunk_gated_delta_rule_fwd_h(k=d["kg"], w=d["w"], u=d["u"], gk=d["gk"],
                                                initial_state=d["h0"], output_final_state=True)
    if stage == "b1":
        return h, v_new, ht
    return chunk_gla_fwd_o_gk(q=d["q"], v=v_new, g=d["gk"], A=d["Aqk"], h=h, scale=d["scale"]), ht


def reference(stage, d):
    """The float64 oracle on float64 copies of the inputs."""
    x = {k: (v.double() if torch.is_tensor(v) else v) for k, v in d.items()}
    if stage == "b1":
        return ref.fwd_h(x["kg"], x["w"], x["u"], x["gk"], x["h0"], True)
    if stage == "fwd":  # the oracle gates q itself (qg None)
        return ref.fwd_scan(x["q"], None, x["kg"], x["w"], x["u"], x["gk"], x["Aqk"], x["h0"], True,
                            x["scale"])
    return ref.bwd_dhu(x["qg"], x["kg"], x["w"], x["gk"], x["h0"], x["dht"], x["do"], None, x["scale"],
                       x["Aqk"])


@pytest.fixture(scope="module")
def inputs():
    """Each shape's inputs, made once (fla's intra) and shared by the three stages."""
    cache = {}

    def get(name):
        if name not in cache:
            B, T, H, HV, V, dt, h0 = SHAPES[name]
            cache[name] = scan_inputs(B, T, H, HV, V, dt, h0=h0)
            torch.cuda.synchronize()
        return cache[name]

    yield get
    cache.clear()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _no_floor(monkeypatch):
    """The small shapes here lie under a scan's measured grid floor (where it has one)."""
    for m in MODS.values():
        if hasattr(m, "GRID_FLOOR"):
            monkeypatch.setattr(m, "GRID_FLOOR", 0)


@contextlib.contextmanager
def poisoned(stage):
    """Within: that stage's fresh outputs (every alloc) start as NaN."""
    mod = MODS[stage]
    orig = mod.alloc

    def alloc(shape, dtype, like):
        return orig(shape, dtype, like).fill_(float("nan"))

    mod.alloc = alloc
    try:
        yield
    finally:
        mod.alloc = orig


@pytest.mark.parametrize("stage", list(MODS))
@pytest.mark.parametrize("name", list(SHAPES))
def test_scans_match_fla_error(name, stage, inputs):
    d = inputs(name)
    with poisoned(stage):
        o = ours(stage, d)
        torch.cuda.synchronize()
    o2 = ours(stage, d)
    f = fla(stage, d)
    torch.cuda.synchronize()
    r = reference(stage, d)
    bad = []
    for lab, x, y, want in zip(OUTPUTS[stage], o, f, r, strict=True):
        if x is None or y is None:
            if (x is None) != (y is None):
                bad.append(f"{lab}: None in {'ours' if x is None else 'fla'} only")
            continue
        eo, ef = rel_err(x, want), rel_err(y, want)
        if not bool(torch.isfinite(x).all()):
            bad.append(f"{lab}: not finite (NaN poison left or overflow)")
        if not eo <= 2 * ef + 1e-6:
            bad.append(f"{lab}: rel err vs float64 {eo:.2e}, fla's {ef:.2e}")
    for lab, x, y in zip(OUTPUTS[stage], o, o2, strict=True):
        if not ((x is None and y is None) or torch.equal(x, y)):
            bad.append(f"{lab}: two runs differ")
    assert not bad, f"{stage} {name}: " + "; ".join(bad)
