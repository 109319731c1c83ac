"""Data-parallel training: the 2-layer KDA model under DistributedDataParallel, N ranks.

kda_chain.model.TinyKDALM (embedding, two KDA layers with gate / l2norm / beta sigmoid in the op,
LM head), built from one seed on every rank (DDP then broadcasts rank 0's weights anyway), AdamW.
On GPUs: NCCL, each rank on cuda:LOCAL_RANK, per rank B4 T2048 H8 HV16 K=V=128, d 1024, vocab
32000, bf16 autocast, 200 steps. On CPU (--cpu): gloo, B2 T128 H2 HV4 K16 V16 d 32 vocab 64,
float32, 5 steps, the chain on its plain-torch reference stages. Each rank trains on its own shard
of a deterministic token stream (seeded by seed, step and rank; kda_chain.ddp.token_shard).

Printed by rank 0: every rank's step time (a whole step: forward, backward with DDP's all-reduce,
AdamW; CUDA events on GPU, perf_counter on CPU; median over the steps after the warm-up), the loss
curve (the mean over the ranks, i.e. the global batch's loss, every k-th step), with --op both
ours against fla from the same init, and with --witness one profiled step per rank: the kda_witness
table (on GPU each rank must show the CuTe kernels, else exit 1). --out FILE: a JSON of the
config, per-rank step times and losses.

    torchrun --nproc_per_node=2 bench/ddp_train.py [--steps 200] [--op ours|fla|both] [--witness]
    torchrun --nproc_per_node=2 bench/ddp_train.py --cpu [--steps 5] [--out /tmp/ddp.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
from kda_chain import ddp
from kda_chain.cli_args import at_least, check_output_file


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (x > 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return x


def parse_args(argv=None) -> argparse.Namespace:
    gpu, cpu = ddp.Config.gpu(), ddp.Config.cpu()
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] + " Run it under torchrun (a plain python run is 1 rank).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--cpu", action="store_true",
                   help="gloo on CPU at the small shape, the chain's reference stages (default: NCCL on "
                   "GPUs)")
    p.add_argument("--steps", type=at_least(1), default=None,
                   help="training steps (default 200 on GPU, 5 on CPU)")
    p.add_argument("--warmup", type=at_least(0), default=None,
                   help="untimed first steps, fewer than --steps (default 10 on GPU, 1 on CPU)")
    names = {"B": "sequences per rank", "T": "tokens per sequence", "H": "q/k heads",
             "HV": "v heads (a multiple of H)", "K": "key head dim (<= 256)", "V": "value head dim",
             "d": "model width", "vocab": "vocabulary size", "layers": "KDA layers"}
    for dim, what in names.items():
        g, c = getattr(gpu, dim), getattr(cpu, dim)
        both = f"default {g}" if g == c else f"default {g} on GPU, {c} on CPU"
        p.add_argument(f"--{dim}", type=at_least(1), default=None, help=f"{what} ({both})")
    p.add_argument("--dtype", choices=list(ddp.DTYPES), default="float32",
                   help="parameter dtype (default float32; float64 is for CPU checks)")
    p.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast of the forward (default on on GPU; CUDA only)")
    p.add_argument("--op", choices=["ours", "fla", "both"], default="ours",
                   help="ours: kda_chain.chunk_kda; fla: fla.ops.kda.chunk_kda (CUDA only); both: ours, then "
                   "fla from the same init on the same tokens (default ours)")
    p.add_argument("--seed", type=int, default=0, help="model init and token stream seed (default 0)")
    p.add_argument("--lr", type=_positive_float, default=3e-4, help="AdamW learning rate (default 3e-4)")
    p.add_argument("--every", type=at_least(1), default=None,
                   help="print every k-th step's loss (default: about 12 points on the curve)")
    p.add_argument("--witness", action="store_true",
                   help="after training, profile one step per rank with kda_witness and print each table "
                   "(ours; on GPU exit 1 unless every rank ran the CuTe kernels)")
    p.add_argument("--out", metavar="FILE", help="rank 0 writes a JSON of config, step times, losses here")
    a = p.parse_args(argv)

    a.device = "cpu" if a.cpu else "cuda"
    base = cpu if a.cpu else gpu
    for dim in names:
        if getattr(a, dim) is None:
            setattr(a, dim, getattr(base, dim))
    if a.steps is None:
        a.steps = 5 if a.cpu else 200
    if a.warmup is None:
        a.warmup = min(1 if a.cpu else 10, a.steps - 1)
    if a.warmup >= a.steps:
        p.error(f"--warmup {a.warmup} must be below --steps {a.steps} (no step would be timed)")
    if a.autocast is None:
        a.autocast = not a.cpu
    if a.HV % a.H:
        p.error(f"--HV {a.HV} must be a multiple of --H {a.H}")
    if a.K > 256:
        p.error(f"--K {a.K}: key head dims above 256 are not supported (fla's limit)")
    if a.cpu:
        if a.autocast:
            p.error("--autocast is bf16 autocast on CUDA only; --cpu runs without it")
        if a.op != "ours":
            p.error(f"--op {a.op} needs CUDA (fla's kernels are Triton); with --cpu only --op ours runs")
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device here: pass --cpu for the gloo run on CPU")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local_world > torch.cuda.device_count():
            p.error(f"{local_world} ranks on this node but {torch.cuda.device_count()} CUDA devices")
    if a.witness and a.op == "fla":
        p.error("--witness profiles ours (kda_chain.chunk_kda): use --op ours or --op both")
    if a.every is None:
        a.every = max(1, a.steps // 12)
    if a.out:
        check_output_file(p, "--out", a.out)
    return a


def run(model, opt, batches, cfg: ddp.Config, warmup: int, cuda: bool) -> tuple[list[float], float]:
    """Train on batches; (this rank's losses, median step ms over the steps after warm-up)."""
    losses, marks = [], []
    for tokens in batches:
        if cuda:
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            losses.append(ddp.train_step(model, opt, tokens, cfg))
            t1.record()
            marks.append((t0, t1))
        else:
            t0 = time.perf_counter()
            losses.append(ddp.train_step(model, opt, tokens, cfg))
            marks.append((t0, time.perf_counter()))
    if cuda:
        torch.cuda.synchronize()
        ms = [a.elapsed_time(b) for a, b in marks]
    else:
        ms = [(b - a) * 1e3 for a, b in marks]
    return [x.item() for x in losses], statistics.median(ms[warmup:])


def gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    cuda = a.device == "cuda"
    shape = {k: getattr(a, k) for k in ("B", "T", "H", "HV", "K", "V", "d", "vocab", "layers")}
    cfg = ddp.Config(**shape, dtype=a.dtype, autocast=a.autocast, seed=a.seed, lr=a.lr, device=a.device)
    rank, world, dev = ddp.init_process_group(a.device)
    try:
        return train(a, cfg, rank, world, dev, cuda)
    finally:
        ddp.teardown()


def train(a, cfg: ddp.Config, rank: int, world: int, dev: torch.device, cuda: bool) -> int:
    def say(*msg):
        if rank == 0:
            print(*msg, flush=True)

    backend = dist.get_backend()
    where = torch.cuda.get_device_name(dev) if cuda else f"CPU ({platform.processor() or platform.machine()})"
    say(f"ddp_train: {world} rank{'s' * (world != 1)}, {backend} on {where}; per rank {cfg.shape()}; "
        f"global batch {world * cfg.B} x {cfg.T} tokens; {a.steps} steps ({a.warmup} warm-up), "
        f"AdamW lr {cfg.lr}")
    if not cuda:
        say("  CPU: the chain runs its plain-torch reference stages (no kernels); times are wall clock")
    batches = [ddp.token_shard(cfg, step, rank, dev) for step in range(a.steps)]
    ops = ["ours", "fla"] if a.op == "both" else [a.op]
    report = dict(config=cfg.asdict(), world=world, backend=backend, device=where, steps=a.steps,
                  warmup=a.warmup, torch=torch.__version__, runs={})
    status, clock = 0, "CUDA events" if cuda else "perf_counter"
    for op in ops:
        c = cfg.replace(op=op)
        model = ddp.wrap(ddp.build_model(c, dev), dev)
        opt = ddp.make_optimizer(model, c)
        say(f"{op}: training" + (" (the first steps compile the CuTe and Triton kernels)" if cuda else ""))
        losses, ms = run(model, opt, batches, c, a.warmup, cuda)
        every_ms, every_loss = gather(ms), gather(losses)
        mean = [statistics.fmean(step) for step in zip(*every_loss, strict=True)]
        per_rank = ", ".join(f"rank {r} {t:.3f} ms" for r, t in enumerate(every_ms))
        say(f"{op}: step time ({clock}, median of {a.steps - a.warmup} after {a.warmup} warm-up): "
            f"{per_rank}; "
            f"{world * cfg.B * cfg.T / (max(every_ms) / 1e3):,.0f} tokens/s over all ranks")
        curve = " ".join(f"{i}:{x:.4f}" for i, x in enumerate(mean) if i % a.every == 0 or i == len(mean) - 1)
        say(f"{op}: loss (mean over the ranks = the global batch's), every {a.every}: {curve}")
        if not all(math.isfinite(x) for r in every_loss for x in r):
            say(f"{op}: FAIL: a non-finite loss")
            status = 1
        report["runs"][op] = dict(step_ms=every_ms, losses=every_loss, mean_loss=mean)
        if a.witness and op == "ours":
            status = max(status, witness(model, opt, c, rank, world, a.steps, dev, cuda, say, report))
        del model, opt
    if len(ops) == 2:
        o, f = report["runs"]["ours"], report["runs"]["fla"]
        diff = max(abs(x - y) for x, y in zip(o["mean_loss"], f["mean_loss"], strict=True))
        say(f"fla/ours step time = {max(f['step_ms']) / max(o['step_ms']):.3f}x (slowest rank each); "
            f"largest |loss difference| over the curve {diff:.2e} (bf16 noise, not a trend, is 'equal')")
        report["loss_max_abs_diff"] = diff
    if a.out and rank == 0:
        with open(a.out, "w") as fh:
            json.dump(report, fh, indent=1)
        say(f"wrote {a.out}")
    return status


def witness(model, opt, cfg, rank, world, step, dev, cuda, say, report) -> int:
    """Profile one more training step per rank; rank 0 prints every rank's table."""
    import kda_witness as kw
    from kda_chain.witness import cute_problem

    tokens = ddp.token_shard(cfg, step, rank, dev)  # the step after the stream
    res = kw.profile(ddp.train_step, model, opt, tokens, cfg)
    problem = cute_problem(res) if cuda else None
    tables = gather((res.table(), problem))
    bad = []
    for r, (table, prob) in enumerate(tables):
        say(f"\nwitness, rank {r} (one training step: forward, backward with the all-reduce, AdamW):")
        say(table)
        if cuda:
            say(f"rank {r}: CuTe kernels: " + ("ok" if prob is None else f"MISSING\n{prob}"))
            if prob is not None:
                bad.append(r)
    report["witness"] = [dict(rank=r, table=t, cute_problem=p) for r, (t, p) in enumerate(tables)]
    if bad:
        say(f"witness: FAIL: ranks {bad} did not run every CuTe kernel")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
