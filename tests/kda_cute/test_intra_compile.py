"""kda_cute_intra compiles for sm_90a without a GPU, and is_supported gives reasons (CPU, CI)."""

import pytest
import torch

pytest.importorskip("cutlass.cute")
intra = pytest.importorskip("kda_cute.intra")


def _args(B=1, T=128, H=2, HV=2, K=128, dtype=torch.bfloat16):
    q = torch.randn(B, T, H, K).to(dtype)
    k = torch.randn(B, T, H, K).to(dtype)
    g = -torch.rand(B, T, HV, K)
    beta = torch.rand(B, T, HV).to(dtype)
    dA = [torch.randn(B, T, HV, 64) for _ in range(2)]
    dq, dk, dg = (torch.randn(B, T, HV, K) for _ in range(3))
    db = torch.randn(B, T, HV)
    return [q, k, g, beta, dA[0], dA[1], dq, dk, db, dg]


def test_compiles_for_sm90a_and_names_the_kernel(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.chdir(tmp_path)
    compiled = intra.compile_for(*_args(), fold_dg=True, emit_bf16=False, keep_ptx=True)
    text = compiled.__ptx__
    if not isinstance(text, str):
        text = text.decode() if text is not None else ""
    if not text:
        pytest.skip("this DSL build keeps no PTX on the compiled object")
    assert "kda_cute_intra" in text and "sm_90a" in text
    assert "ex2.approx" in text  # the exp2 fast path
    body = text.split(".entry", 1)[1]
    assert ".local" not in body, "register arrays fell to local memory"
    assert "ld.global.v4" in body or "ld.global.nc.v4" in body, "16-byte loads expected"


def test_is_supported_reasons_on_cpu():
    assert "CUDA" in intra.is_supported(*_args())  # no GPU here (or tensors on CPU)


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda a: a.__setitem__(0, a[0].float()), "dtype"),
        (lambda a: a.__setitem__(2, a[2][:, :, :, :64].contiguous()), "gk"),
        (lambda a: a.__setitem__(4, a[4][..., :32].contiguous()), "chunk"),
        (lambda a: a.__setitem__(9, a[9].transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
        (lambda a: a.__setitem__(6, a[6].double()), "float32"),
    ],
)
def test_is_supported_rejects(mutate, needle):
    a = _args()
    mutate(a)
    r = intra.is_supported(*a)
    assert r is not None and needle in r, r


def test_unsupported_shapes():
    assert "K=96" in intra.is_supported(*_args(K=96))
    assert "multiple of the chunk" in intra.is_supported(*_args(T=100))
    assert "HV=3" in intra.is_supported(*_args(H=2, HV=3))
    with pytest.raises(ValueError, match="K=96"):
        intra.bwd_intra(*_args(K=96))
