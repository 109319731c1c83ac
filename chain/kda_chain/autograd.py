"""The autograd Function: forward.py on the way in, backward.py on the way back.

Saved tensors go through `save_for_backward` (so autograd's version checks apply); the rest of
`Saved` rides on ctx. Gradients come back in the dtypes fla 0.6.0 returns: each input's own.
As in fla, both directions run under the inputs' CUDA device (Triton and the CuTe launches use
the current device) and with autocast's custom_fwd/custom_bwd semantics.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from .backward import backward
from .forward import Flags, Saved, forward

_TENSOR_FIELDS = [f.name for f in dataclasses.fields(Saved)]


def device_guard(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


class ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, flags: Flags):
        with device_guard(q):
            o, ht, saved = forward(q, k, v, g, beta, A_log, dt_bias, initial_state, flags)
        ctx.save_for_backward(*(getattr(saved, n) for n in _TENSOR_FIELDS))
        ctx.flags = flags
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
        if ht is not None:
            return o, ht
        return o, None

    @staticmethod
    @torch.autograd.function.once_differentiable
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, do, dht):
        saved = Saved(*ctx.saved_tensors)
        if dht is not None:
            dht = dht.contiguous()
        with device_guard(do):
            dq, dk, dv, dg, db, dA_log, ddt_bias, dh0 = backward(do.contiguous(), dht, saved, ctx.flags)
        tq, tk, tv, tg, tb = ctx.dtypes
        return (dq.to(tq), dk.to(tk), dv.to(tv), dg.to(tg), db.to(tb), dA_log, ddt_bias, dh0, None)


class EmptyKDAFunction(torch.autograd.Function):
    """T = 0, as fla 0.6.0 answers it on CUDA (its kernels launch empty grids, its state kernel
    copies h0 out): o empty [B, 0, HV, V] in q's dtype; ht = h0 as a fresh fp32 tensor (zeros
    without h0) when asked, else None. Backward: empty gradients for the token inputs, zeros for
    A_log / dt_bias, dh0 = dht (zeros without dht)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, output_final_state: bool):
        B, _, HV, V = v.shape
        K = q.shape[-1]
        ctx.like = [None if t is None else (t.shape, t.dtype)
                    for t in (q, k, v, g, beta, A_log, dt_bias, initial_state)]
        o = v.new_empty((B, 0, HV, V), dtype=q.dtype)
        if not output_final_state:
            return o, None
        if initial_state is not None:
            return o, initial_state.float().clone()
        return o, v.new_zeros((B, HV, K, V), dtype=torch.float32)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        grads = [None if sd is None else torch.zeros(sd[0], dtype=sd[1], device=do.device) for sd in ctx.like]
        if grads[7] is not None and dht is not None:
            grads[7] = dht.to(grads[7].dtype)
        return (*grads, None)
