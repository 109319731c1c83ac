"""A small KDA language model: what the train-step benchmark, the torch.compile tests and the DDP
script train, with either chunk_kda (ours or fla's) plugged in.

    model = TinyKDALM(vocab=8192, d=1024, layers=2, H=8, HV=16, K=128, V=128, op=chunk_kda)
    loss = model.loss(tokens)          # tokens [B, T + 1] int64: next-token cross-entropy

Each layer: RMS-normed input, q / k / v / gate / beta projections, chunk_kda with the gate,
l2norm and beta sigmoid in the op (fla's KDA layer flags), an output projection and a residual.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class KDALayer(nn.Module):
    def __init__(self, d: int, H: int, HV: int, K: int, V: int, op: Callable):
        super().__init__()
        self.H, self.HV, self.K, self.V, self.op = H, HV, K, V, op
        self.norm = nn.RMSNorm(d)
        self.proj = nn.Linear(d, 2 * H * K + HV * (V + K + 1), bias=False)
        self.out = nn.Linear(HV * V, d, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 16.0, HV)))
        self.dt_bias = nn.Parameter(torch.zeros(HV * K))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H, HV, K, V = self.H, self.HV, self.K, self.V
        q, k, v, g, beta = self.proj(self.norm(x)).split([H * K, H * K, HV * V, HV * K, HV], dim=-1)
        o, _ = self.op(q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, HV, V),
                       g.reshape(B, T, HV, K), beta.reshape(B, T, HV), use_qk_l2norm_in_kernel=True,
                       use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=self.A_log,
                       dt_bias=self.dt_bias)
        return x + self.out(o.reshape(B, T, HV * V))


class TinyKDALM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, H: int, HV: int, K: int, V: int, op: Callable):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(KDALayer(d, H, HV, K, V, op) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
