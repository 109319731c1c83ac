"""The autograd Function: forward.py on the way in, backward.py on the way back.

Saved tensors go through `save_for_backward` (so autograd's version checks apply); the rest of
`Saved` rides on ctx. Gradients come back in the dtypes fla 0.6.0 returns: each input's own.
"""

from __future__ import annotations

import dataclasses

import torch

from .backward import backward
from .forward import Flags, Saved, forward

_TENSOR_FIELDS = [f.name for f in dataclasses.fields(Saved)]


class ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, flags: Flags):
        o, ht, saved = forward(q, k, v, g, beta, A_log, dt_bias, initial_state, flags)
        ctx.save_for_backward(*(getattr(saved, n) for n in _TENSOR_FIELDS))
        ctx.flags = flags
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
        if ht is not None:
            return o, ht
        return o, None

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        saved = Saved(*ctx.saved_tensors)
        dq, dk, dv, dg, db, dA_log, ddt_bias, dh0 = backward(do.contiguous(), dht, saved, ctx.flags)
        tq, tk, tv, tg, tb = ctx.dtypes
        return (dq.to(tq), dk.to(tk), dv.to(tv), dg.to(tg), db.to(tb), dA_log, ddt_bias, dh0, None)
