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
    """Where each token goes: `index` (int64 [total_T], its row in the padded layout), `source`
    (int64 [T_pad], each padded row's token, 0 for a pad row), `pad` (int64, the pad rows),
    `chunks` (int32 [N + 1] chunk offsets), all on the device; `T_pad`, the padded length."""

    index: torch.Tensor
    source: torch.Tensor
    pad: torch.Tensor
    chunks: torch.Tensor
    T_pad: int

    @property
    def N(self) -> int:
        return self.chunks.numel() - 1


def _runs(starts: torch.Tensor, lens: torch.Tensor, total: int) -> torch.Tensor:
    """The concatenated ranges [starts[n], starts[n] + lens[n]) (int64, on their device; `total` =
    sum(lens) from the host, so no sync)."""
    n = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens, output_size=total)
    first = torch.cumsum(lens, 0) - lens  # each run's position in the output
    return torch.arange(total, device=lens.device) - first[n] + starts[n]


def packing(cu_seqlens: torch.Tensor, offsets: list[int]) -> Packing:
    """The padded layout of sequences with token offsets `cu_seqlens` (N + 1, on the device) whose
    host copy is `offsets` (only its per-sequence chunk counts are used on the host)."""
    dev = cu_seqlens.device
    counts = [-(-(b - a) // BT) for a, b in zip(offsets, offsets[1:], strict=False)]
    T, N, T_pad = offsets[-1], len(counts), BT * sum(counts)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    chunks = torch.zeros(N + 1, dtype=torch.int32, device=dev)
    torch.cumsum((lens + BT - 1) // BT, 0, out=chunks[1:])
    starts = chunks[:-1].to(torch.int64) * BT
    index = _runs(starts, lens, T)
    source = torch.zeros(T_pad, dtype=torch.int64, device=dev)
    source[index] = torch.arange(T, device=dev)
    pad = _runs(starts + lens, chunks[1:] * BT - starts - lens, T_pad - T)
    return Packing(index, source, pad, chunks, T_pad)


def _gather(x: torch.Tensor, rows: torch.Tensor, pad=None, fill: float = 0.0) -> torch.Tensor:
    """x [1, R, ...] -> [1, len(rows), ...], row i = x[0, rows[i]] (then the `pad` rows = fill).
    Every copy here is this gather: index_select's row gather runs at copy speed, where
    index_copy_ (and autograd's index_select backward, an atomic index_add) ran ~3x slower
    (5.6 ms of a 28.7 ms step at 131072 tokens, H200)."""
    out = x.reshape(x.shape[1], -1).index_select(0, rows)
    if pad is not None and pad.numel():
        out.index_fill_(0, pad, fill)
    return out.view(1, rows.numel(), *x.shape[2:])


class _Pack(torch.autograd.Function):
    """x [1, T, ...] -> the padded row [1, T_pad, ...]; its gradient gathers the rows back."""

    @staticmethod
    def forward(ctx, x, p: Packing, fill: float):
        ctx.p = p
        return _gather(x, p.source, p.pad, fill)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.p.index), None, None


class _Unpack(torch.autograd.Function):
    """The padded row [1, T_pad, ...] -> [1, T, ...] (pad rows dropped); its gradient is a pack
    with zeros in the pad rows."""

    @staticmethod
    def forward(ctx, y, p: Packing):
        ctx.p = p
        return _gather(y, p.index)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.p.source, ctx.p.pad, 0.0), None


def pack(x: torch.Tensor, p: Packing, fill: float = 0.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [1, total_T, ...] -> [1, T_pad, ...] (pad rows = `fill`; in `dtype` if given), differentiable."""
    x = x if dtype is None else x.to(dtype)
    return _Pack.apply(x, p, fill)


def unpack(y: torch.Tensor, p: Packing) -> torch.Tensor:
    """y [1, T_pad, ...] -> [1, total_T, ...] (the pad rows dropped), differentiable."""
    return _Unpack.apply(y, p)


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
