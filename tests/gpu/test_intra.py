"""GPU correctness of kda_cute.intra.bwd_intra (fla 0.6.0's chunk_kda_bwd_intra contract).

Ours and fla's errors against the float64 reference, side by side: ours must be within 2x fla's.
Outputs are poisoned (NaN-filled before the launch) and must come back finite; fold_dg equals
fla's chunk_local_cumsum(reverse) of fla's dg; emit_bf16 equals the cast; runs are bitwise
deterministic. Skips cleanly without CUDA, the CuTe DSL or fla."""

import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("cutlass.cute")
pytest.importorskip("fla")
intra = pytest.importorskip("kda_cute.intra")
from kda_cute import reference as ref  # noqa: E402
from kda_cute.reference import rel_err  # noqa: E402
from kda_cute.registry import device_reason  # noqa: E402

if device_reason(torch.empty(1, device="cuda")) is not None:
    pytest.skip(device_reason(torch.empty(1, device="cuda")), allow_module_level=True)


def make_inputs(B, T, H, HV, K, dtype=torch.bfloat16, gmin=-0.5, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, generator=gen, device="cuda")

    q = torch.nn.functional.normalize(rn(B, T, H, K), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(rn(B, T, H, K), dim=-1).to(dtype)
    step = gmin * torch.rand(B, T, HV, K, generator=gen, device="cuda")
    g = (step.view(B, T // 64, 64, HV, K).cumsum(2).view(B, T, HV, K) / math.log(2.0)).contiguous()
    beta = torch.sigmoid(rn(B, T, HV)).to(dtype)
    dA = (rn(B, T, HV, 64), rn(B, T, HV, 64))
    return q, k, g, beta, *dA, rn(B, T, HV, K), rn(B, T, HV, K), rn(B, T, HV), rn(B, T, HV, K)


@pytest.fixture
def poisoned(monkeypatch):
    orig = intra.alloc

    def alloc(shape, dtype, like):
        return orig(shape, dtype, like).fill_(float("nan"))

    monkeypatch.setattr(intra, "alloc", alloc)


CASES = [  # HV = 16: fla's autotune for that key is seeded on the GPU machine
    ("ref-like", 1, 512, 16, 16, 128, torch.bfloat16, -0.5),
    ("T64", 1, 64, 16, 16, 128, torch.bfloat16, -0.5),
    ("gva", 1, 256, 8, 16, 128, torch.bfloat16, -0.5),
    ("fp16", 1, 256, 16, 16, 128, torch.float16, -0.5),
    ("strong-gate", 1, 256, 16, 16, 128, torch.bfloat16, -5.0),
    ("k64", 1, 256, 16, 16, 64, torch.bfloat16, -0.5),
    ("k64-gva-strong", 1, 256, 8, 16, 64, torch.bfloat16, -5.0),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bwd_intra_matches_float64_within_2x_fla(case, poisoned):
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra
    from fla.ops.utils import chunk_local_cumsum

    _, B, T, H, HV, K, dtype, gmin = case
    args = make_inputs(B, T, H, HV, K, dtype, gmin)
    ours = intra.bwd_intra(*args)
    fla = chunk_kda_bwd_intra(*args, chunk_size=64)
    r = ref.bwd_intra(*[t.double() for t in args])
    for name, o, f, e in zip(("dq", "dk", "db", "dg"), ours, fla, r, strict=True):
        assert torch.isfinite(o).all(), f"{name}: unwritten (NaN) or non-finite entries"
        eo, ef = rel_err(o, e), rel_err(f, e)
        assert eo <= 2 * ef + 1e-6, f"{name}: ours {eo:.3e} vs fla {ef:.3e}"
    folded = intra.bwd_intra(*args, fold_dg=True)
    for i in range(3):
        assert torch.equal(folded[i], ours[i])
    fla_fold = chunk_local_cumsum(fla[3], chunk_size=64, reverse=True)
    r_fold = ref.dg_cumsum(r[3], 64)
    assert torch.isfinite(folded[3]).all()
    assert rel_err(folded[3], r_fold) <= 2 * rel_err(fla_fold, r_fold) + 1e-6
    assert rel_err(folded[3], fla_fold) < 1e-3
    again = intra.bwd_intra(*args)
    assert all(torch.equal(a, b) for a, b in zip(ours, again, strict=True)), "two runs differ"
    if HV == H and K == 128 and dtype == torch.bfloat16:  # other dtypes: one compile each
        e16 = intra.bwd_intra(*args, emit_bf16=True)
        assert e16[0].dtype == dtype and e16[1].dtype == dtype
        assert torch.equal(e16[0], ours[0].to(dtype)) and torch.equal(e16[1], ours[1].to(dtype))
        assert torch.equal(e16[2], ours[2]) and torch.equal(e16[3], ours[3])


def test_is_supported_on_gpu():
    args = make_inputs(1, 128, 2, 2, 128)
    assert intra.is_supported(*args) in (None,) or "CTAs" in intra.is_supported(*args)
    bad = list(args)
    bad[2] = bad[2][..., :96].contiguous()
    assert intra.is_supported(*bad) is not None
