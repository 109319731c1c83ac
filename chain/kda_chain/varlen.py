"""Packed sequences (fla's `cu_seqlens`) on the chain: each sequence padded to whole chunks.

A packed call's tokens [1, total_T, ...] are copied into a row where every sequence starts on a
chunk boundary and its last chunk is filled with padding tokens that change nothing:

    q, k, v = 0, beta = 0 (or -inf before the in-op sigmoid), log gate = 0 (or, with the gate in
    the op, a raw gate of -1e30, whose softplus / sigmoid form is exactly 0)

so a padding row adds zero to every product, leaves gk at the sequence's last token (the chunk's
decay is the last valid token's) and its outputs are dropped again. On that row every
chunk-parallel stage (prep, wy_dqkg, intra, fla's gate / l2norm / cumsum stages) runs unchanged as
one batch row, and the three state scans (b1, fwd, dhu) walk each sequence's chunks from a chunk
table `chunks` (int32 [N + 1] chunk offsets; fla's own scans get `chunks * 64` as cu_seqlens):
one CTA per (V tile, head, sequence), states [N, HV, K, V]. The result is fla's: fla's varlen
chunks also restart at every sequence start.

Cost: the copies in and out (inputs, o, and in the backward do and the gradients), about 10% of a
step at the reference shape; the pad rows (< 64 per sequence). The row is built on the device
from `cu_seqlens`; only its length needs the offsets on the host: `cu_seqlens_cpu` when given,
else one `cu_seqlens.tolist()` (a host sync, as fla's own varlen path without cu_seqlens_cpu).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BT = 64
GATE_PAD = -1e30  # a raw gate whose step gate is exactly 0 in both of fla's forms (see module doc)


@dataclass(frozen=True)
class Packing:
    """Where each token goes: `index` (int64 [total_T], its row in the padded layout, on the
    device), `chunks` (int32 [N + 1] chunk offsets, on the device), `T_pad` (the padded length)."""

    index: torch.Tensor
    chunks: torch.Tensor
    T_pad: int

    @property
    def N(self) -> int:
        return self.chunks.numel() - 1


def packing(cu_seqlens: torch.Tensor, offsets: list[int]) -> Packing:
    """The padded layout of sequences with token offsets `cu_seqlens` (N + 1, on the device) whose
    host copy is `offsets` (only its per-sequence chunk counts are used on the host)."""
    dev = cu_seqlens.device
    counts = [-(-(b - a) // BT) for a, b in zip(offsets, offsets[1:], strict=False)]
    T, N = offsets[-1], len(counts)
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    chunks = torch.zeros(N + 1, dtype=torch.int32, device=dev)
    torch.cumsum((lens + BT - 1) // BT, 0, out=chunks[1:])
    seq = torch.repeat_interleave(torch.arange(N, device=dev), lens, output_size=T)
    index = torch.arange(T, device=dev) - cu[seq] + chunks[seq].to(torch.int64) * BT
    return Packing(index, chunks, BT * sum(counts))


def pack(x: torch.Tensor, p: Packing, fill: float = 0.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [1, total_T, ...] -> [1, T_pad, ...] (pad rows = `fill`; in `dtype` if given), differentiable."""
    x = x if dtype is None else x.to(dtype)
    out = x.new_full((1, p.T_pad, *x.shape[2:]), fill)
    return out.index_copy(1, p.index, x)


def unpack(y: torch.Tensor, p: Packing) -> torch.Tensor:
    """y [1, T_pad, ...] -> [1, total_T, ...] (the pad rows dropped), differentiable."""
    return y.index_select(1, p.index)


def pack_inputs(q, k, v, g, beta, p: Packing, *, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
                lower_bound) -> tuple:
    """q, k, v, g, beta on the padded row, each pad row a no-op token (module doc). -1e30 overflows
    fp16: a raw fp16 gate pads with -inf in the softplus form (softplus(-inf) = 0, its gradient
    0), and goes to fp32 in the lower_bound form (whose A_log gradient would be 0 * -inf)."""
    g_fill, g_dtype = 0.0, None
    if use_gate_in_kernel:
        g_fill = GATE_PAD
        if g.dtype == torch.float16:
            if lower_bound is None:
                g_fill = float("-inf")
            else:
                g_dtype = torch.float32
    b_fill = float("-inf") if use_beta_sigmoid_in_kernel else 0.0
    return (pack(q, p), pack(k, p), pack(v, p), pack(g, p, g_fill, g_dtype), pack(beta, p, b_fill))
