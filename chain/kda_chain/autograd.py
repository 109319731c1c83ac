"""Autograd pieces outside the custom ops (kda_chain.op): the device guard both directions run
under (Triton and the CuTe launches use the current device), and T = 0's empty answer.
"""

from __future__ import annotations

import contextlib

import torch


def device_guard(t: torch.Tensor):
    """`t`'s CUDA device made current for the block; nothing to do (no guard's host cost) when it
    already is, or for a tensor not on CUDA."""
    dev = t.device
    if dev.type != "cuda" or dev.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(dev)


class EmptyKDAFunction(torch.autograd.Function):
    """T = 0, as fla 0.6.0 answers it on CUDA (its kernels launch empty grids, its state kernel
    copies h0 out): o empty [B, 0, HV, V] in q's dtype; ht = h0 as a fresh fp32 tensor (zeros
    without h0; float64 with float64 inputs, the reference's precision) when asked, else None.
    Backward: empty gradients for the token inputs, zeros for A_log / dt_bias, dh0 = dht (zeros
    without dht)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, output_final_state: bool):
        B, _, HV, V = v.shape
        K = q.shape[-1]
        ctx.like = [None if t is None else (t.shape, t.dtype)
                    for t in (q, k, v, g, beta, A_log, dt_bias, initial_state)]
        o = v.new_empty((B, 0, HV, V), dtype=q.dtype)
        if not output_final_state:
            return o, None
        st = torch.float64 if q.dtype == torch.float64 else torch.float32
        if initial_state is not None:
            return o, initial_state.to(st, copy=True)
        return o, v.new_zeros((B, HV, K, V), dtype=st)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        grads = [None if sd is None else torch.zeros(sd[0], dtype=sd[1], device=do.device) for sd in ctx.like]
        if grads[7] is not None and dht is not None:
            grads[7] = dht.to(grads[7].dtype)
        return (*grads, None)
