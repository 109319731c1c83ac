"""Train-step benchmark: a 2-layer KDA language model trained with ours and with fla (GPU).

The model (kda_chain.model.TinyKDALM: embedding, two KDA layers with gate / l2norm / beta sigmoid
in the op, LM head) at B4 T2048 H8 HV16 K=V=128, d 1024, vocab 32000, bf16 autocast, AdamW. Both
runs start from the same weights and see the same batches; printed: step time (CUDA events
around a whole step: forward, backward, optimizer), median over the timed steps, the ratio, and
the two loss curves' largest difference (bf16 noise, not a trend, is what "equal" means here).
cuDNN's KDA needs H == HV, so it cannot run this model's GVA heads.

    python bench/train_step.py [--steps 60] [--warmup 5] [--compile]
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from kda_chain import chunk_kda
from kda_chain.model import TinyKDALM


def run(model, batches, warmup: int, compile_: bool, fullgraph: bool = True):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    loss_fn = torch.compile(model.loss, fullgraph=fullgraph) if compile_ else model.loss
    losses, times = [], []
    for i, tokens in enumerate(batches):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        b.record()
        losses.append(loss.detach())
        if i >= warmup:
            times.append((a, b))
    torch.cuda.synchronize()
    return [x.item() for x in losses], statistics.median(a.elapsed_time(b) for a, b in times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the loss (ours fullgraph=True; fla with its graph breaks)")
    a = ap.parse_args()
    from fla.ops.kda import chunk_kda as fla_kda

    torch.manual_seed(0)
    vocab = 32000
    base = TinyKDALM(vocab=vocab, d=1024, layers=2, H=8, HV=16, K=128, V=128, op=chunk_kda).cuda()
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, vocab, (a.B, a.T + 1), device="cuda", generator=g) for _ in range(a.steps)]
    results = {}
    for name, op in (("ours", chunk_kda), ("fla", fla_kda)):
        model = copy.deepcopy(base)
        for layer in model.layers:
            layer.op = op
        # fla's chunk_kda is wrapped in torch.compiler.disable: fullgraph would refuse it, so fla's
        # model compiles with a graph break per KDA call (ours is a custom op: one graph)
        results[name] = run(model, batches, a.warmup, a.compile, fullgraph=name == "ours")
        print(f"{name}: step {results[name][1]:.3f} ms (median of {a.steps - a.warmup})", flush=True)
    (lo, to), (lf, tf) = results["ours"], results["fla"]
    diff = max(abs(x - y) for x, y in zip(lo, lf, strict=True))
    print(
        f"B{a.B} T{a.T} H8 HV16 K=V=128, 2 layers, bf16 autocast, AdamW{', compiled' if a.compile else ''}: "
        f"ours {to:.3f} ms, fla {tf:.3f} ms per step, fla/ours = {tf / to:.3f}x; loss {lo[0]:.4f} -> "
        f"{lo[-1]:.4f} (fla {lf[0]:.4f} -> {lf[-1]:.4f}), largest |difference| {diff:.2e}",
        flush=True,
    )
    print("losses ours:", " ".join(f"{x:.4f}" for x in lo[:: max(1, len(lo) // 12)]))
    print("losses fla: ", " ".join(f"{x:.4f}" for x in lf[:: max(1, len(lf) // 12)]))
    return 0 if diff < 5e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
