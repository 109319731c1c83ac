"""The three sm_90 scans (kda_cute_b1 / kda_cute_fwd / kda_cute_dhu) compile for sm_90a without a
GPU, and their is_supported gives reasons (CPU, CI)."""

import pytest
import torch

pytest.importorskip("cutlass.cute")
b1 = pytest.importorskip("kda_cute.b1")
fwd = pytest.importorskip("kda_cute.fwd")
dhu = pytest.importorskip("kda_cute.dhu")
from kda_chain.varlen import chunks_words  # noqa: E402


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


def _dhu_args(d):
    """bwd_dhu's qg .. dv (no states; dv None: the kernel's fused form takes Aqk after the scale)."""
    return d["qg"], d["kg"], d["w"], d["gk"], None, None, d["do"], None


def _ptx(compiled):
    text = getattr(compiled, "__ptx__", None)
    if text is not None and not isinstance(text, str):
        text = text.decode()
    return text or ""


def _check(compiled, name):
    text = _ptx(compiled)
    assert text, "no PTX on the compiled object (compile_only keeps it: --keep-ptx)"
    assert name in text and "sm_90a" in text
    assert "wgmma" in text, "warpgroup MMAs expected"
    assert "cp.async.bulk.tensor" in text, "TMA expected"
    assert ".local" not in text.split(".entry", 1)[1], "registers fell to local memory"


@pytest.fixture(autouse=True)
def _sm90(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("CUTE_DSL_KEEP", "ptx")


def test_b1_compiles():
    d = _t()
    _check(b1.compile_for(d["kg"], d["w"], d["u"], d["gk"], d["h0"], True), "kda_cute_b1")


def _fwd_args(d, kg_heads=None):
    kg = d["kg"] if kg_heads is None else d["kg"][:, :, :kg_heads].contiguous()
    return d["q"], d["qg"], kg, d["w"], d["u"], d["gk"], d["Aqk"]


@pytest.mark.parametrize(
    "nwg, state, dtype, kg_heads",
    [
        (1, False, torch.bfloat16, None),  # GVA: q has H=2 heads, qg / kg / w HV=4
        (1, True, torch.bfloat16, 2),  # kg at the qk heads too (ratio_k = 2)
        (2, True, torch.bfloat16, None),
        (2, False, torch.float16, 2),
        (1, True, torch.float16, None),
    ],
)
def test_fwd_compiles(nwg, state, dtype, kg_heads):
    """kda_cute_fwd reads qg (no in-kernel gating of q): 1 / 2 warpgroups, with / without h0 and
    ht, GVA, fp16. Its only exp2 are the per-chunk decay's: one per column of a thread's h^T
    fragment (`_scan.decay_cols`: 32 columns of 128), gk read for gd alone."""
    d = _t(V=256, dtype=dtype)
    h0 = d["h0"] if state else None
    c = fwd.compile_for(*_fwd_args(d, kg_heads), h0, state, 0.088, warpgroups=nwg)
    _check(c, "kda_cute_fwd")
    body = _ptx(c).split(".entry", 1)[-1]
    if body:
        assert body.count("ex2.approx") == 32, "q must arrive gated (qg): exp2 only for the gd columns"


def test_dhu_compiles_fp16():
    d = _t(dtype=torch.float16)
    _check(
        dhu.compile_for(d["qg"], d["kg"], d["w"], d["gk"], d["h0"], d["h0"], d["do"], None, 0.088, d["Aqk"]),
        "kda_cute_dhu",
    )


def test_two_warpgroup_variants_compile():
    d = _t(V=256)
    # b1's build at the reference shape (2 stages x 2 warpgroups) and its largest (3 x 2, 194 KB)
    for stages in (2, 3):
        b1_ref = b1.compile_for(d["kg"], d["w"], d["u"], d["gk"], None, False, stages=stages, warpgroups=2)
        _check(b1_ref, "kda_cute_b1")
    _check(fwd.compile_for(*_fwd_args(d), d["h0"], True, 0.1, warpgroups=2), "kda_cute_fwd")
    _check(
        dhu.compile_for(
            d["qg"], d["kg"], d["w"], d["gk"], None, None, d["do"], None, 0.1, d["Aqk"], stages=1,
            warpgroups=2
        ),
        "kda_cute_dhu",
    )


def _packed(V=128, lens_chunks=(1, 0, 3), dtype=torch.bfloat16):
    """Operands packed [1, T, ...] with a chunk table (sequences of 1, 0 and 3 chunks)."""
    chunks = torch.tensor(chunks_words(list(lens_chunks)), dtype=torch.int32).view(2, -1)
    d = _t(T=64 * sum(lens_chunks), V=V, dtype=dtype)
    d["h0"] = torch.randn(len(lens_chunks), d["u"].shape[2], 128, V)
    return d, chunks


@pytest.mark.parametrize("nwg", [1, 2])
def test_scans_compile_with_a_chunk_table(nwg):
    """Packed sequences (cu_seqlens, padded to whole chunks per sequence): each scan compiles with
    the chunk table, one CTA per (V tile, head, sequence), h0 / ht / dht / dh0 per sequence."""
    d, chunks = _packed(V=256)
    _check(b1.compile_for(d["kg"], d["w"], d["u"], d["gk"], d["h0"], True, chunks, warpgroups=nwg),
           "kda_cute_b1")
    _check(fwd.compile_for(*_fwd_args(d), d["h0"], True, 0.1, chunks, warpgroups=nwg), "kda_cute_fwd")
    _check(dhu.compile_for(d["qg"], d["kg"], d["w"], d["gk"], d["h0"], d["h0"], d["do"], None, 0.1, d["Aqk"],
                           chunks, warpgroups=nwg), "kda_cute_dhu")


def test_chunk_table_reasons():
    """A table that is not int32 [2, N + 1], or states that are not [N, ...], are refused with a reason."""
    d, chunks = _packed()
    args = (d["kg"], d["w"], d["u"], d["gk"])
    assert b1.static_reason(*args, d["h0"], chunks) is None
    assert "int32" in b1.static_reason(*args, None, chunks.long())
    assert "[2, N + 1]" in b1.static_reason(*args, None, chunks[0])  # the offsets alone
    assert "[B, HV, K, V]" in b1.static_reason(*args, d["h0"][:2], chunks)
    assert "packed" in b1.static_reason(*(t[:, :100] for t in args), None, chunks)


def test_host_side_imports_no_dsl():
    """A stage module's is_supported / variant / policy answer without the CuTe DSL (seconds to
    import, absent on some CPU installs): importing them must not import cutlass."""
    import subprocess
    import sys

    code = ("import sys, torch; import kda_cute.b1, kda_cute.fwd, kda_cute.dhu, kda_cute.intra, "
            "kda_cute.scan_policy, kda_cute.registry; "
            "b = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16); "
            "kda_cute.b1.static_reason(b, b, b, b.float()); kda_cute.b1.variant(16, 16, 256); "
            "print('cutlass' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out


def test_configs_are_frozen_compile_keys():
    """Each scan's config is the compile key itself: hashable, immutable, and two calls that differ
    in any field the kernel depends on give different keys (no stale kernel reused)."""
    import dataclasses

    d = _t()
    _, _, _, c1 = b1._plan(d["kg"], d["w"], d["u"], d["gk"], None, False, None, None, None)
    _, _, _, c2 = b1._plan(d["kg"], d["w"], d["u"], d["gk"], d["h0"], True, None, None, None)
    assert c1 != c2 and hash(c1) != hash(c2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c1.stages = 3
    _, _, _, f1 = fwd._plan(*_fwd_args(d)[1:], None, False, 0.1, None, None, None)
    _, _, _, f2 = fwd._plan(*_fwd_args(d)[1:], None, False, 0.2, None, None, None)
    assert f1 != f2  # the scale is compiled in
    one = torch.tensor(chunks_words([4]), dtype=torch.int32).view(2, -1)
    _, _, _, f3 = fwd._plan(*_fwd_args(d)[1:], None, False, 0.1, one, None, None)
    assert f3 != f1 and f3.varlen  # a chunk table is another build


def test_is_supported_needs_cuda_on_cpu():
    d = _t()
    assert "CUDA" in b1.is_supported(d["kg"], d["w"], d["u"], d["gk"], None, False)
    assert "CUDA" in fwd.is_supported(*_fwd_args(d), None, False, 0.1)
    assert "CUDA" in fwd.plan_reason(d["q"], d["u"])
    assert "CUDA" in dhu.is_supported(*_dhu_args(d), 0.1, d["Aqk"])


def test_static_reasons(monkeypatch):
    monkeypatch.setattr(dhu, "GRID_FLOOR", 0)  # a tiny grid here; the floor has its own test
    d = _t()
    assert b1.static_reason(d["kg"], d["w"], d["u"], d["gk"]) is None
    assert fwd.static_reason(*_fwd_args(d)) is None
    assert dhu.static_reason(d["qg"], d["kg"], d["w"], d["gk"], None, None, d["do"], None, d["Aqk"]) is None
    e = _t(K=64)
    assert "K=64" in b1.static_reason(e["kg"], e["w"], e["u"], e["gk"])
    e = _t(V=96)
    assert "V=96" in fwd.static_reason(*_fwd_args(e))
    assert "dtype" in b1.static_reason(d["kg"].float(), d["w"].float(), d["u"].float(), d["gk"])
    assert "fp32" in b1.static_reason(d["kg"], d["w"], d["u"], d["gk"].bfloat16())
    nc = d["w"].transpose(1, 2).contiguous().transpose(1, 2)
    assert "contiguous" in b1.static_reason(d["kg"], nc, d["u"], d["gk"])
    assert "chunk 64" in fwd.static_reason(*_fwd_args(d)[:-1], d["Aqk"][..., :32].contiguous())
    assert "HV % H" in dhu.static_reason(
        d["qg"][:, :, :3].contiguous(), d["kg"], d["w"], d["gk"], None, None, d["do"], None, d["Aqk"]
    )
    assert "initial_state" in b1.static_reason(d["kg"], d["w"], d["u"], d["gk"], d["h0"].double())
    assert "dht" in dhu.static_reason(
        d["qg"], d["kg"], d["w"], d["gk"], None, d["h0"][:, :2].contiguous(), d["do"], None, d["Aqk"]
    )
    # the fused form only: dv = tril(Aqk)^T do is the kernel's own (the chain's bwd_dAv is not run)
    assert "takes Aqk and no dv" in dhu.static_reason(d["qg"], d["kg"], d["w"], d["gk"], None, None, d["do"],
                                                      d["dv"])
    assert "Aqk [B, T, HV, 64]" in dhu.static_reason(d["qg"], d["kg"], d["w"], d["gk"], None, None, d["do"],
                                                     None, d["Aqk"][..., :32].contiguous())


def test_chain_offers_the_three_scans(monkeypatch):
    """On a GPU that passes every other check, b1, dhu and fwd are offered; fwd without qg (the
    chain asked fwd_intra for none) answers why."""
    d = _t()
    monkeypatch.setattr(dhu, "GRID_FLOOR", 0)  # a tiny grid here; the floor has its own test
    for mod in (b1, fwd, dhu):
        monkeypatch.setattr(mod, "device_reason", lambda t: None)
    assert b1.is_supported(d["kg"], d["w"], d["u"], d["gk"], None, False) is None
    assert dhu.is_supported(*_dhu_args(d), 0.1, d["Aqk"]) is None
    assert fwd.is_supported(*_fwd_args(d), None, False, 0.1) is None
    r = fwd.is_supported(d["q"], None, *_fwd_args(d)[2:], None, False, 0.1)
    assert r.startswith("qg not computed by fwd_intra")


@pytest.mark.parametrize("stage, narrow_one_wave", [("b1", (4, 1)), ("fwd", (2, 1)), ("dhu", (2, 1))])
def test_variant_by_grid(stage, narrow_one_wave):
    """Two warpgroups x 2 stages once the grid has WIDE_FROM_TILES V tiles (V % 128 == 0), else
    one warpgroup: b1 with 4 stages while the grid fits the SMs in one wave, 2 beyond; fwd, dhu 2."""
    mod = {"b1": b1, "fwd": fwd, "dhu": dhu}[stage]
    assert mod.variant(16, 16, 256) == (2, 2)  # the reference shape: 1024 V tiles
    assert mod.variant(4, 16, 256) == (2, 2)  # 256 tiles
    assert mod.variant(2, 16, 256) == narrow_one_wave  # 128 tiles
    assert mod.variant(64, 16, 64) == (2, 1)  # one V tile per head: no pair
    from kda_cute.scan_policy import WIDE_FROM_TILES as n

    assert mod.variant(n // 2, 1, 128) == (2, 2) and mod.variant(n // 2 - 1, 1, 128) == (2, 1)
    if stage == "b1":  # one wave is the device's SM count (132 on the H200 unless told)
        assert b1.variant(2, 16, 256, sms=114) == (2, 1) and b1.variant(1, 2, 256, sms=8) == (4, 1)


def _bad_qg(d):
    qg = d["qg"]
    return {
        "not computed": None,
        "[B, T, HV, 128]": d["q"],  # at the qk heads: not what fwd_intra stores
        "share u's dtype": qg.float(),
        "qg not contiguous": qg.transpose(1, 2).contiguous().transpose(1, 2),
    }


def test_fwd_static_reason_names_a_bad_qg():
    d = _t()
    for needle, qg in _bad_qg(d).items():
        a = list(_fwd_args(d))
        a[1] = qg
        r = fwd.static_reason(*a)
        assert r is not None and needle in r, (needle, r)


def test_fwd_plan_reason(monkeypatch):
    """plan_reason decides from the chain's inputs alone whether to ask fwd_intra for qg: it makes
    the checks static_reason would."""
    monkeypatch.setattr(fwd, "device_reason", lambda t: None)
    d = _t()
    assert fwd.plan_reason(d["q"], d["u"], d["h0"]) is None
    assert fwd.plan_reason(d["q"], d["u"]) is None
    assert fwd.is_supported(*_fwd_args(d), d["h0"], True, 0.1) is None
    for kw, needle in (
        (dict(K=64), "K=64"),
        (dict(V=96), "V=96"),
        (dict(dtype=torch.float32), "dtype"),
        (dict(H=3), "HV % H"),
    ):
        e = _t(**kw)
        r = fwd.plan_reason(e["q"], e["u"])
        assert r is not None and needle in r, (kw, r)
    assert "initial_state" in fwd.plan_reason(d["q"], d["u"], d["h0"].double())
    assert "dtype" in fwd.plan_reason(d["q"].half(), d["u"])


def test_dhu_small_grid_goes_to_fla():
    """Below dhu's measured floor (64 V tiles: fla was faster on the H200) the gate says so."""
    d = _t()
    B, T, HV, V = d["do"].shape
    r = dhu.static_reason(d["qg"], d["kg"], d["w"], d["gk"], None, None, d["do"], None, d["Aqk"])
    tiles = B * HV * (V // 64)
    assert (r is not None and "below the measured floor" in r) == (tiles < dhu.GRID_FLOOR), (tiles, r)


@pytest.mark.parametrize("bad, needle", [(None, "no CUDA device"), (dict(K=64), "K=64"),
                                         (dict(dtype=torch.float32), "dtype")])
def test_direct_calls_refuse_what_they_cannot_compute(bad, needle):
    """Called directly (not through the chain's gate), each scan raises a ValueError naming the
    reason instead of compiling or launching something wrong: shape / dtype first, then device
    (CPU tensors here)."""
    d = _t(**(bad or {}))
    calls = {
        "b1.fwd_h": lambda: b1.fwd_h(d["kg"], d["w"], d["u"], d["gk"], d["h0"], True),
        "fwd.fwd_scan": lambda: fwd.fwd_scan(*_fwd_args(d), d["h0"], True, 0.1),
        "dhu.bwd_dhu": lambda: dhu.bwd_dhu(d["qg"], d["kg"], d["w"], d["gk"], d["h0"], d["h0"], d["do"],
                                           None, 0.1, d["Aqk"]),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"kda_cute.{name}: unsupported call: .*{needle}"):
            call()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_acc_as_a_is_the_register_a_fragment(dtype):
    """b1's chained GEMMs rest on `_scan.acc_as_a`: an m64nN accumulator fragment, viewed as the
    register A operand of the next wgmma (K = N), must hold, thread by thread, exactly the
    (row, column) coordinates that wgmma's A partition expects. Checked on identity tensors for
    every thread of the warpgroup, both directions b1 uses (the state 64 x 128 into P^T's K = 128;
    P^T 64 x 64 into the update's K = 64)."""
    import cutlass
    import cutlass.cute as cute
    from kda_cute import _scan as S

    dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[dtype]
    seen = []

    @cute.jit
    def trace():
        for ncols, n_dst in ((128, 64), (64, 128)):
            src = S.make_rs_mma(dt, False, ncols)
            dst = S.make_rs_mma(dt, True, n_dst)
            ident = cute.make_identity_tensor((64, ncols))
            for t in cutlass.range_constexpr(S.THREADS):
                a = dst.get_slice(t).partition_A(ident)
                v = S.acc_as_a(src.get_slice(t).partition_C(ident))
                seen.append((ncols, t, str(a.iterator), str(v.iterator), str(a.layout), str(v.layout)))

    trace()
    assert len(seen) == 2 * S.THREADS
    for ncols, t, a_at, v_at, a_lay, v_lay in seen:
        assert (a_at, a_lay) == (v_at, v_lay), (ncols, t, a_at, v_at, a_lay, v_lay)
    # and the view really regroups: the raw accumulator layout is not the A layout
    assert seen[0][4].count("16@1") == 1
