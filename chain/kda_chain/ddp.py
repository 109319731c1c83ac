"""Data-parallel training of `kda_chain.model.TinyKDALM` under DistributedDataParallel: the pieces
bench/ddp_train.py (the CLI: timing, printing, JSON) and tests/kda_chain/test_ddp.py share.

    cfg = Config.gpu()                       # or Config.cpu(dtype="float64"), or Config(...)
    rank, world, device = init_process_group(cfg.device)      # env (torchrun) or explicit args
    model = wrap(build_model(cfg, device), device)            # same seed on every rank; DDP
    opt = make_optimizer(model, device)                       # broadcasts rank 0's weights anyway
    loss = train_step(model, opt, token_shard(cfg, step, rank, device), cfg)
    teardown()

NCCL on CUDA (each rank on cuda:LOCAL_RANK), gloo on CPU, where the chain runs its plain-torch
reference stages. Each rank reads its own shard of a deterministic token stream (seeded by seed,
step and rank), so a single process on the ranks' shards concatenated (`global_batch`) computes
the same mean loss, and the same gradients, as DDP's all-reduced average over the ranks.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .model import TinyKDALM

DTYPES = {"float32": torch.float32, "float64": torch.float64}
OPS = ("ours", "fla")


@dataclass(frozen=True)
class Config:
    """One rank's batch (B sequences of T tokens) and the model; JSON-able (`asdict`)."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    d: int
    vocab: int
    layers: int = 2
    dtype: str = "float32"      # the parameters' dtype (a key of DTYPES)
    autocast: bool = False      # bf16 autocast of the forward (CUDA only)
    op: str = "ours"            # "ours": kda_chain.chunk_kda; "fla": fla.ops.kda.chunk_kda (CUDA only)
    seed: int = 0               # model init; the token stream is seeded by (seed, step, rank)
    lr: float = 3e-4
    device: str = "cuda"        # "cuda" (NCCL) or "cpu" (gloo)

    @classmethod
    def gpu(cls, **kw) -> Config:
        """The train-step benchmark's model: B4 T2048 per rank, H8 HV16 K=V=128, d 1024, bf16 autocast."""
        return cls(**{**dict(B=4, T=2048, H=8, HV=16, K=128, V=128, d=1024, vocab=32000, autocast=True,
                             device="cuda"), **kw})

    @classmethod
    def cpu(cls, **kw) -> Config:
        """A small shape the reference chain runs in about a second per step on CPU."""
        return cls(**{**dict(B=2, T=128, H=2, HV=4, K=16, V=16, d=32, vocab=64, autocast=False,
                             device="cpu"), **kw})

    def replace(self, **kw) -> Config:
        return dataclasses.replace(self, **kw)

    def asdict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def shape(self) -> str:
        return (f"B{self.B} T{self.T} H{self.H} HV{self.HV} K{self.K} V{self.V} d{self.d} "
                f"vocab{self.vocab}, {self.layers} layers, {self.dtype}"
                + (" + bf16 autocast" if self.autocast else ""))


def resolve_op(name: str) -> Callable:
    if name == "ours":
        from . import chunk_kda

        return chunk_kda
    if name == "fla":
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        return fla_chunk_kda
    raise ValueError(f"op must be one of {OPS}, got {name!r}")


# --- process group -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(device: str, rank: int | None = None, world: int | None = None,
                       init_method: str | None = None,
                       timeout_s: float = 600.0) -> tuple[int, int, torch.device]:
    """Join the default process group: NCCL for device "cuda", gloo for "cpu". Returns (rank, world,
    this rank's device). Without rank/world/init_method they come from torchrun's environment
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); a plain `python` run is a world of 1.
    """
    if rank is None or world is None:
        if "RANK" not in os.environ:  # not under torchrun: one process
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(_free_port()))
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("init_process_group: device 'cuda' but no CUDA device is available")
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"init_process_group: LOCAL_RANK {local_rank} but only "
                               f"{torch.cuda.device_count()} CUDA devices")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        backend = "nccl"
    elif device == "cpu":
        dev, backend = torch.device("cpu"), "gloo"
    else:
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    # device_id (torch >= 2.3) binds the NCCL communicator to this rank's GPU at once
    takes_device = "device_id" in inspect.signature(dist.init_process_group).parameters
    kw = dict(device_id=dev) if backend == "nccl" and takes_device else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return rank, world, dev


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# --- model, data, one step -----------------------------------------------------------------------


def build_model(cfg: Config, device: torch.device | str) -> TinyKDALM:
    """The model from cfg's seed alone (built on CPU, then moved): the same weights on every rank."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = TinyKDALM(vocab=cfg.vocab, d=cfg.d, layers=cfg.layers, H=cfg.H, HV=cfg.HV, K=cfg.K,
                          V=cfg.V, op=resolve_op(cfg.op))
    return model.to(device=device, dtype=cfg.torch_dtype)


def wrap(model: nn.Module, device: torch.device | str) -> DistributedDataParallel:
    """DDP around model; the constructor broadcasts rank 0's parameters to every rank."""
    device = torch.device(device)
    if device.type == "cuda":
        return DistributedDataParallel(model, device_ids=[device.index], output_device=device.index)
    return DistributedDataParallel(model)


def make_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=cfg.device == "cuda")


def token_shard(cfg: Config, step: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Rank `rank`'s tokens [B, T + 1] (int64) at step `step`: drawn on CPU from a generator seeded
    by (seed, step, rank), so any process, on any device, gets the same shard."""
    gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) * 65_537 + rank)
    return torch.randint(0, cfg.vocab, (cfg.B, cfg.T + 1), generator=gen).to(device)


def global_batch(cfg: Config, step: int, world: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Every rank's shard at `step`, concatenated in rank order: [world * B, T + 1]."""
    return torch.cat([token_shard(cfg, step, r, device) for r in range(world)])


def lm_loss(model: nn.Module, tokens: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Next-token cross-entropy through model's forward (DDP's, so its reducer is armed for the
    backward), logits at least float32: TinyKDALM.loss's formula, but float64 stays float64."""
    dev = tokens.device.type
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=cfg.autocast and dev == "cuda"):
        logits = model(tokens[:, :-1])
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def forward_backward(model: nn.Module, tokens: torch.Tensor, cfg: Config, sync: bool = True) -> torch.Tensor:
    """Loss and its backward; under DDP the backward all-reduces (averages) the gradients over the
    ranks, unless sync=False (DDP's no_sync: this rank's own gradients only)."""
    no_sync = isinstance(model, DistributedDataParallel) and not sync
    if no_sync:
        with model.no_sync():
            loss = lm_loss(model, tokens, cfg)
            loss.backward()
    else:
        loss = lm_loss(model, tokens, cfg)
        loss.backward()
    return loss.detach()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor,
               cfg: Config) -> torch.Tensor:
    """One training step: forward, backward (with DDP's all-reduce), AdamW step, zero_grad. Returns
    this rank's loss (detached, not synchronized)."""
    loss = forward_backward(model, tokens, cfg)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def named_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    model = model.module if isinstance(model, DistributedDataParallel) else model
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def named_params(model: nn.Module) -> dict[str, torch.Tensor]:
    model = model.module if isinstance(model, DistributedDataParallel) else model
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def grads_after_one_step(rank: int, world: int, cfg: Config, device: torch.device | str,
                         sync: bool = True, step: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """In an initialized process group: a fresh DDP model, one forward + backward on this rank's
    shard at `step`; returns (loss, gradients by parameter name). sync=False skips the all-reduce."""
    if (rank, world) != (dist.get_rank(), dist.get_world_size()):
        raise ValueError(f"grads_after_one_step: rank {rank} of {world}, but the process group has rank "
                         f"{dist.get_rank()} of {dist.get_world_size()}")
    model = wrap(build_model(cfg, device), device)
    loss = forward_backward(model, token_shard(cfg, step, rank, device), cfg, sync=sync)
    return loss, named_grads(model)


def single_process_grads(cfg: Config, world: int, device: torch.device | str = "cpu",
                         step: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """What DDP over `world` ranks should produce, without DDP: the same model, one forward +
    backward of the mean loss over the ranks' shards concatenated."""
    model = build_model(cfg, device)
    loss = forward_backward(model, global_batch(cfg, step, world, device), cfg)
    return loss, named_grads(model)


def grads_worker(rank: int, world: int, cfg: Config, init_method: str, out_dir: str) -> None:
    """A spawned rank (torch.multiprocessing.spawn(grads_worker, (world, cfg, init_method, out_dir),
    nprocs=world)): joins the group, then saves to out_dir/rank{rank}.pt this rank's local gradients
    (no all-reduce), its DDP gradients after one step, its losses, and its parameters after one
    AdamW step on those gradients."""
    torch.set_num_threads(1)
    _, _, dev = init_process_group(cfg.device, rank=rank, world=world, init_method=init_method)
    try:
        local_loss, local = grads_after_one_step(rank, world, cfg, dev, sync=False)
        model = wrap(build_model(cfg, dev), dev)
        loss = forward_backward(model, token_shard(cfg, 0, rank, dev), cfg)
        synced = named_grads(model)
        opt = make_optimizer(model, cfg)
        opt.step()
        out = dict(local_loss=local_loss, local=local, loss=loss, synced=synced, params=named_params(model))
        torch.save({k: _to_cpu(v) for k, v in out.items()}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        teardown()


def _to_cpu(x):
    if isinstance(x, dict):
        return {k: v.cpu() for k, v in x.items()}
    return x.cpu()
