"""kda_cute_l2norm_fwd / kda_cute_l2norm_bwd compile for sm_90a without a GPU, their PTX computes
fla's l2norm_fwd / l2norm_bwd against float64 within 2x of fla's own error (fla's kernel in torch
float32: fp32 sums, one rounding of the output), on every CTA of a ragged grid (T not a multiple
of the 8 tokens a CTA takes), and is_supported gives reasons (CPU, CI)."""

import pytest
import torch

pytest.importorskip("cutlass.cute")
F = pytest.importorskip("kda_cute.l2norm_fwd")
Bw = pytest.importorskip("kda_cute.l2norm_bwd")
ref = pytest.importorskip("kda_cute.reference")
from ptxsim.kda_l2norm import emulate_l2norm_bwd, emulate_l2norm_fwd  # noqa: E402

pytestmark = pytest.mark.usefixtures("sm90a")


def _x(B, T, H, K, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(B, T, H, K, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype, K", [(torch.bfloat16, 128), (torch.float16, 64)])
def test_fwd_ptx_computes_the_contract(ptx, dtype, K):
    x = _x(2, 11, 3, K, dtype, seed=0, scale=3.0)
    y, rstd = emulate_l2norm_fwd(ptx(F.compile_for(x, keep_ptx=True)), x)
    wy, wr = ref.l2norm_fwd(x.double())
    fy, fr = ref.l2norm_fwd(x.float())  # fla's precision: fp32, y rounded once
    assert torch.isfinite(y.float()).all() and torch.isfinite(rstd).all(), "unwritten rows"
    assert ref.rel_err(y, wy) <= 2 * ref.rel_err(fy.to(dtype), wy) + 1e-7
    assert ref.rel_err(rstd, wr) <= 2 * ref.rel_err(fr, wr) + 1e-7


@pytest.mark.parametrize("dy_dtype, G", [(torch.bfloat16, 1), (torch.float32, 1), (torch.float32, 2),
                                         (torch.float32, 3)])
def test_bwd_ptx_computes_the_contract(ptx, dy_dtype, G):
    """dy in y's dtype (bwd_chunk's emit_bf16), in fp32, and in fp32 per value head (GVA: G value
    heads per row head, the group summed inside as gva_sum would)."""
    x = _x(1, 13, 2, 128, torch.bfloat16, seed=1)
    y, rstd = ref.l2norm_fwd(x)
    dy = _x(1, 13, 2 * G, 128, dy_dtype, seed=2)
    dx = emulate_l2norm_bwd(ptx(Bw.compile_for(y, rstd, dy, keep_ptx=True)), y, rstd, dy)
    want = ref.l2norm_bwd(y.double(), rstd.double(), dy.double())
    fla = ref.l2norm_bwd(y.float(), rstd, dy.float()).to(y.dtype)
    assert torch.isfinite(dx.float()).all(), "unwritten rows"
    assert ref.rel_err(dx, want) <= 2 * ref.rel_err(fla, want) + 1e-7
    if G > 1:  # the same as summing first: gva_sum (fp32, head order) then the kernel's G = 1 form
        assert ref.rel_err(dx, ref.l2norm_bwd(y.float(), rstd, ref.gva_sum(dy, 2)).to(y.dtype)) < 4e-3


def test_reasons():
    x = _x(1, 4, 1, 128, torch.bfloat16, seed=0)
    assert "CUDA" in F.is_supported(x)
    assert "K=48" in F.is_supported(x[..., :48].contiguous())
    assert "bf16 or fp16" in F.is_supported(x.float())
    assert "not contiguous" in F.is_supported(_x(1, 4, 2, 128, torch.bfloat16, seed=0).transpose(1, 2))
    y, r = ref.l2norm_fwd(x)
    assert "rstd must be" in Bw.is_supported(y, r.double(), y)
    assert "dy must be" in Bw.is_supported(y, r, y.half())
    assert "dy must be" in Bw.is_supported(y, r, torch.cat([y, y], 2))  # GVA form in fp32 only
    assert "at most 8" in Bw.is_supported(y, r, torch.zeros(1, 4, 9, 128))
    with pytest.raises(ValueError, match="unsupported call: K=48"):
        F.l2norm_fwd(x[..., :48].contiguous())
