"""Plain-torch reference of fla 0.6.0's chunk_kda: every stage contract, the composed chain, the oracle.

- `naive`: the token-by-token recurrence (`naive_recurrent_kda`), differentiable by autograd, and
  `naive_kda` with fla's in-op extras (L2 norm, fused gate, beta sigmoid): the ground truth.
- `stages`: one function per stage of ARCHITECTURE.md, same names, arguments, layouts and output
  dtypes as the CuTe kernels and fla's functions; float64 in gives float64 out.
- `chain`: the stages composed in fla's order, forward and backward, as an autograd Function
  (`chunk_kda_reference`), and once per sequence for a packed call (`chunk_kda_reference_packed`).

`rel_err` is the one error measure the reference and kernel tests share.
"""

import torch

from .chain import (
    ChunkKDAReferenceFunction,
    KDASaved,
    chunk_kda_reference,
    chunk_kda_reference_bwd,
    chunk_kda_reference_fwd,
    chunk_kda_reference_packed,
)
from .naive import (
    compute_dtype,
    naive_gate,
    naive_kda,
    naive_kda_varlen,
    naive_l2norm,
    naive_recurrent_kda,
)
from .stages import (
    RCP_LN2,
    beta_sigmoid_bwd,
    beta_sigmoid_fwd,
    bwd_chunk,
    bwd_dAv,
    bwd_dhu,
    bwd_intra,
    bwd_prep,
    bwd_wy_dqkg,
    chunk_local_cumsum,
    dg_cumsum,
    fwd_h,
    fwd_intra,
    fwd_o,
    fwd_prep,
    fwd_scan,
    gate_bwd,
    gate_chunk_cumsum,
    gva_sum,
    l2norm_bwd,
    l2norm_fwd,
    recompute_w_u,
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius, in float64); 0 when both are zero, inf when only b is."""
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    den = b.norm().item()
    num = (a - b).norm().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float('inf')
    return num / den


__all__ = [
    'RCP_LN2', 'ChunkKDAReferenceFunction', 'KDASaved', 'beta_sigmoid_bwd', 'beta_sigmoid_fwd',
    'bwd_chunk', 'bwd_dAv', 'bwd_dhu', 'bwd_intra', 'bwd_prep', 'bwd_wy_dqkg', 'chunk_kda_reference',
    'chunk_kda_reference_bwd', 'chunk_kda_reference_packed',
    'chunk_kda_reference_fwd', 'chunk_local_cumsum', 'compute_dtype', 'dg_cumsum', 'fwd_h',
    'fwd_intra', 'fwd_o', 'fwd_prep', 'fwd_scan', 'gate_bwd', 'gate_chunk_cumsum', 'gva_sum', 'l2norm_bwd',
    'l2norm_fwd', 'naive_gate', 'naive_kda', 'naive_kda_varlen', 'naive_l2norm', 'naive_recurrent_kda',
    'recompute_w_u',
    'rel_err',
]
