"""The launch harness of kda_cute_l2norm_fwd / kda_cute_l2norm_bwd (kda_cute.l2norm_fwd,
kda_cute.l2norm_bwd) for the interpreter: every CTA of the grid (ceil(T / 8), B), 256 threads, the
outputs NaN-poisoned first, through `ext_wy.WyCTA` (its packed bf16x2 / f16x2 conversions)."""

import torch

from .ext_wy import WyCTA, wy_program
from .launch import run_grid


def _ctas(x):
    B, T = x.shape[:2]
    return [(bx, b, 0) for b in range(B) for bx in range(-(-T // 8))]


def emulate_l2norm_fwd(text, x):
    """(y, rstd) of the kernel's PTX `text` on CPU for x [B, T, H, K]."""
    y = torch.full_like(x, float("nan"))
    rstd = torch.full(x.shape[:3], float("nan"), dtype=torch.float32)
    got = run_grid(wy_program(text), [x, y, rstd], _ctas(x), WyCTA, 256)
    return got[1], got[2]


def emulate_l2norm_bwd(text, y, rstd, dy):
    """dx of the kernel's PTX `text` on CPU."""
    dx = torch.full_like(y, float("nan"))
    return run_grid(wy_program(text), [y, rstd, dy, dx], _ctas(y), WyCTA, 256)[3]
