"""kda_cute._warp's host checks, shared by the chunk-parallel kernels (prep, wy_dqkg): each reason
on a call that has exactly that defect, None on a good one (CPU, CI)."""

import pytest
import torch
from kda_cute import _warp

B, T, H, HV, K, V = 1, 128, 2, 4, 128, 64


def _good():
    bf = torch.bfloat16
    return dict(q=torch.zeros(B, T, H, K, dtype=bf), k=torch.zeros(B, T, H, K, dtype=bf),
                v=torch.zeros(B, T, HV, V, dtype=bf), gk=torch.zeros(B, T, HV, K),
                beta=torch.zeros(B, T, HV, dtype=bf))


def _extent(x):
    return _warp.extent_reason(x["q"], x["k"], x["v"], x["gk"], x["beta"], (128,))


def test_good_call_has_no_extent_or_dtype_reason():
    x = _good()
    assert _extent(x) is None
    assert _warp.dtype_reason(x["q"], (("k", x["k"]), ("v", x["v"])), x["gk"], x["beta"]) is None


@pytest.mark.parametrize("name, shape, needle", [
    ("q", (B, T, H, 64), "q/k must be [B,T,H,K] of one shape"),
    ("v", (B, T + 64, HV, V), "v must be [B,T,HV,V]"),
    ("v", (B, T, 3, V), "HV=3 not a multiple of H=2"),
    ("v", (B, T, HV, 96), "V=96 not a multiple of 64"),
    ("gk", (B, T, HV, 64), "gk must be [B,T,HV,K]"),
    ("beta", (B, T, 1), "beta must be [B,T,HV]"),
])
def test_extent_reasons(name, shape, needle):
    x = _good()
    x[name] = torch.zeros(shape, dtype=x[name].dtype)
    r = _extent(x)
    assert r is not None and needle in r, r


def test_k_and_ragged_t_reasons():
    x = _good()
    x["q"] = x["k"] = torch.zeros(B, T, H, 64, dtype=torch.bfloat16)
    x["gk"] = torch.zeros(B, T, HV, 64)
    assert "K=64 (kernel built for K in (128,))" in _extent(x)
    y = {n: t[:, :100] for n, t in _good().items()}
    assert "T=100 not a multiple of the chunk 64" in _extent(y)


@pytest.mark.parametrize("name, dtype, needle", [
    ("q", torch.float32, "q dtype torch.float32 (bf16 or fp16 expected)"),
    ("k", torch.float16, "k dtype torch.float16 != q's torch.bfloat16"),
    ("gk", torch.bfloat16, "gk must be float32"),
    ("beta", torch.float64, "beta dtype torch.float64"),
])
def test_dtype_reasons(name, dtype, needle):
    x = _good()
    x[name] = x[name].to(dtype)
    r = _warp.dtype_reason(x["q"], (("k", x["k"]), ("v", x["v"])), x["gk"], x["beta"])
    assert r is not None and needle in r, r


def test_layout_reasons():
    x = _good()
    names = tuple(x)
    x["v"] = x["v"].transpose(1, 2).contiguous().transpose(1, 2)
    assert _warp.layout_reason(names, tuple(x.values())) == "v is not contiguous"
    x = _good()
    x["gk"] = torch.zeros(B * T * HV * K + 1)[1:].view(B, T, HV, K)
    assert _warp.layout_reason(names, tuple(x.values())) == "gk is not 16-byte aligned"
    assert "CUDA" in _warp.layout_reason(names, tuple(_good().values()))  # CPU tensors
