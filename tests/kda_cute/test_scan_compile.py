"""The three sm_90 scans (kda_cute_b1 / kda_cute_fwd / kda_cute_dhu) compile for sm_90a without a
GPU, and their is_supported gives reasons (CPU, CI)."""

import pytest
import torch

pytest.importorskip("cutlass.cute")
b1 = pytest.importorskip("kda_cute.b1")
fwd = pytest.importorskip("kda_cute.fwd")
dhu = pytest.importorskip("kda_cute.dhu")


def _t(B=1, T=200, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16):
    return dict(
        q=torch.randn(B, T, H, K).to(dtype),
        qg=torch.randn(B, T, HV, K).to(dtype),
        kg=torch.randn(B, T, HV, K).to(dtype),
        w=torch.randn(B, T, HV, K).to(dtype),
        u=torch.randn(B, T, HV, V).to(dtype),
        gk=-torch.rand(B, T, HV, K),
        Aqk=torch.randn(B, T, HV, 64).to(dtype),
        h0=torch.randn(B, HV, K, V),
        do=torch.randn(B, T, HV, V).to(dtype),
        dv=torch.randn(B, T, HV, V).to(dtype),
    )


def _ptx(compiled):
    text = getattr(compiled, "__ptx__", None)
    if text is not None and not isinstance(text, str):
        text = text.decode()
    return text or ""


def _check(compiled, name):
    text = _ptx(compiled)
    if not text:
        return  # this DSL build keeps no PTX on the compiled object
    assert name in text and "sm_90a" in text
    assert "wgmma" in text, "warpgroup MMAs expected"
    assert "cp.async.bulk.tensor" in text, "TMA expected"
    assert ".local" not in text.split(".entry", 1)[1], "registers fell to local memory"


@pytest.fixture(autouse=True)
def _sm90(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("CUTE_DSL_KEEP", "ptx")
    monkeypatch.chdir(tmp_path)


def test_b1_compiles():
    d = _t()
    _check(b1.compile_for(d["kg"], d["w"], d["u"], d["gk"], d["h0"], True), "kda_cute_b1")


def test_fwd_compiles_gva():
    d = _t()
    _check(
        fwd.compile_for(d["q"], d["kg"], d["w"], d["u"], d["gk"], d["Aqk"], None, False, 0.088),
        "kda_cute_fwd",
    )


def test_dhu_compiles_fp16():
    d = _t(dtype=torch.float16)
    _check(
        dhu.compile_for(d["qg"], d["kg"], d["w"], d["gk"], d["h0"], d["h0"], d["do"], d["dv"], 0.088),
        "kda_cute_dhu",
    )


def test_two_warpgroup_variants_compile():
    d = _t(V=256)
    _check(b1.compile_for(d["kg"], d["w"], d["u"], d["gk"], None, False, warpgroups=2), "kda_cute_b1")
    _check(
        fwd.compile_for(d["q"], d["kg"], d["w"], d["u"], d["gk"], d["Aqk"], d["h0"], True, 0.1, warpgroups=2),
        "kda_cute_fwd",
    )
    _check(
        dhu.compile_for(
            d["qg"], d["kg"], d["w"], d["gk"], None, None, d["do"], d["dv"], 0.1, stages=1, warpgroups=2
        ),
        "kda_cute_dhu",
    )


def test_lazy_scan_constants_match():
    from kda_cute import _scan

    for name in ("BT", "KD", "BV", "THREADS"):
        assert getattr(b1._LazyScan, name) == getattr(_scan, name)


def test_is_supported_needs_cuda_on_cpu():
    d = _t()
    assert "CUDA" in b1.is_supported(d["kg"], d["w"], d["u"], d["gk"], None, False)
    assert "CUDA" in fwd.is_supported(d["q"], d["kg"], d["w"], d["u"], d["gk"], d["Aqk"], None, False, 0.1)
    assert "CUDA" in dhu.is_supported(d["qg"], d["kg"], d["w"], d["gk"], None, None, d["do"], d["dv"], 0.1)


def test_static_reasons(monkeypatch):
    monkeypatch.setattr(dhu, "GRID_FLOOR", 0)  # a tiny grid here; the floor has its own test
    d = _t()
    assert b1.static_reason(d["kg"], d["w"], d["u"], d["gk"]) is None
    assert fwd.static_reason(d["q"], d["kg"], d["w"], d["u"], d["gk"], d["Aqk"]) is None
    assert dhu.static_reason(d["qg"], d["kg"], d["w"], d["gk"], None, None, d["do"], d["dv"]) is None
    e = _t(K=64)
    assert "K=64" in b1.static_reason(e["kg"], e["w"], e["u"], e["gk"])
    e = _t(V=96)
    assert "V=96" in fwd.static_reason(e["q"], e["kg"], e["w"], e["u"], e["gk"], e["Aqk"])
    assert "dtype" in b1.static_reason(d["kg"].float(), d["w"].float(), d["u"].float(), d["gk"])
    assert "fp32" in b1.static_reason(d["kg"], d["w"], d["u"], d["gk"].bfloat16())
    nc = d["w"].transpose(1, 2).contiguous().transpose(1, 2)
    assert "contiguous" in b1.static_reason(d["kg"], nc, d["u"], d["gk"])
    assert "chunk 64" in fwd.static_reason(
        d["q"], d["kg"], d["w"], d["u"], d["gk"], d["Aqk"][..., :32].contiguous()
    )
    assert "HV % H" in dhu.static_reason(
        d["qg"][:, :, :3].contiguous(), d["kg"], d["w"], d["gk"], None, None, d["do"], d["dv"]
    )
    assert "initial_state" in b1.static_reason(d["kg"], d["w"], d["u"], d["gk"], d["h0"].double())
    assert "dht" in dhu.static_reason(
        d["qg"], d["kg"], d["w"], d["gk"], None, d["h0"][:, :2].contiguous(), d["do"], d["dv"]
    )


def test_chain_offers_b1_and_dhu_but_not_the_slower_fwd(monkeypatch):
    """On a GPU that passes every other check, b1 and dhu are offered; fwd answers its measured
    reason (no faster than fla on the H200), so the chain keeps fla's forward."""
    d = _t()
    monkeypatch.setattr(dhu, "GRID_FLOOR", 0)  # a tiny grid here; the floor has its own test
    for mod in (b1, fwd, dhu):
        monkeypatch.setattr(mod, "device_reason", lambda t: None)
    assert b1.is_supported(d["kg"], d["w"], d["u"], d["gk"], None, False) is None
    assert dhu.is_supported(d["qg"], d["kg"], d["w"], d["gk"], None, None, d["do"], d["dv"], 0.1) is None
    r = fwd.is_supported(d["q"], d["kg"], d["w"], d["u"], d["gk"], d["Aqk"], None, False, 0.1)
    assert r == fwd.SLOWER_THAN_FLA and "measured" in r


def test_dhu_small_grid_goes_to_fla():
    """Below dhu's measured floor (64 V tiles: fla was faster on the H200) the gate says so."""
    d = _t()
    B, T, HV, V = d["do"].shape
    r = dhu.static_reason(d["qg"], d["kg"], d["w"], d["gk"], None, None, d["do"], d["dv"])
    tiles = B * HV * (V // 64)
    assert (r is not None and "below the measured floor" in r) == (tiles < dhu.GRID_FLOOR), (tiles, r)
