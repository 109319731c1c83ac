"""Data-parallel training on CPU (kda_chain.ddp, what bench/ddp_train.py runs): 2 gloo ranks,
fresh processes, train TinyKDALM through the reference chain in float64. After one step (forward, backward,
DDP's all-reduce) the gradients are bitwise identical on both ranks and equal, to float64 rounding,
to one process's gradients of the mean loss over both shards concatenated; the parameters after an
AdamW step are bitwise identical too. Without the all-reduce (DDP's no_sync) the ranks' gradients
differ (each saw its own shard), so the identity checks can fail.

The ranks start from multiprocessing's forkserver (a fresh interpreter, no threads and no state
inherited from pytest, like "spawn"), preloaded with torch._dynamo and kda_chain: spawned ranks
each pay ~25 s of imports on 2 cores at their first chunk_kda call (torch.library's custom-op path
imports torch._dynamo), forked ones from the preloaded server well under a second."""

from __future__ import annotations

import multiprocessing.forkserver
import time

import pytest
import torch
import torch.multiprocessing as mp
from kda_chain import ddp

WORLD = 2
CFG = ddp.Config.cpu(B=1, T=64, dtype="float64")  # per rank; one 64-token chunk per sequence
DEADLINE_S = 240  # the ranks' two fwd+bwd take ~1 s; kill them past this
PRELOAD = ["torch._dynamo", "kda_chain", "kda_chain.ddp", "kda_chain.forward", "kda_chain.backward",
           "kda_cute.reference"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()  # imports PRELOAD while this process computes:
    single = ddp.single_process_grads(CFG, WORLD)  # one process on both shards concatenated
    ctx = mp.start_processes(ddp.grads_worker, args=(WORLD, CFG, f"file://{out}/store", str(out)),
                             nprocs=WORLD, join=False, start_method="forkserver")
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=1):  # raises ProcessRaisedException if a rank failed
            if time.monotonic() > deadline:
                pytest.fail(f"the {WORLD} DDP ranks did not finish in {DEADLINE_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    return single, ranks


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def test_every_parameter_has_a_gradient(runs):
    single, ranks = runs
    names = {n for n, _ in ddp.build_model(CFG, "cpu").named_parameters()}
    assert set(single[1]) == names
    for r in ranks:
        assert set(r["synced"]) == names and set(r["local"]) == names
        assert all(g.dtype == torch.float64 for g in r["synced"].values())


def test_ddp_grads_bitwise_identical_across_ranks(runs):
    _, (r0, r1) = runs
    for name, g in r0["synced"].items():
        assert torch.equal(g, r1["synced"][name]), name


def test_ddp_grads_equal_single_process_on_concatenated_batch(runs):
    (loss, single), ranks = runs
    # DDP averages the ranks' gradients: of the mean of the ranks' mean losses = the mean loss over
    # the concatenated batch (equal token counts per rank)
    mean_loss = sum(r["loss"] for r in ranks) / WORLD
    torch.testing.assert_close(mean_loss, loss, rtol=1e-12, atol=0)
    for name, want in single.items():
        got = ranks[0]["synced"][name]
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14, msg=lambda m, n=name: f"{n}: {m}")


def test_without_allreduce_the_ranks_differ(runs):
    """The checks above can fail: each rank's own gradients (no_sync) differ from the other rank's
    and from the synced ones; their mean is the synced gradient."""
    _, (r0, r1) = runs
    assert not torch.equal(r0["local_loss"], r1["local_loss"])
    torch.testing.assert_close(r0["local_loss"], r0["loss"], rtol=0, atol=0)  # same shard, same model
    differ = [n for n, g in r0["local"].items() if _rel(g, r1["local"][n]) > 1e-3]
    assert len(differ) == len(r0["local"]), sorted(set(r0["local"]) - set(differ))
    for name, g in r0["synced"].items():
        assert _rel(r0["local"][name], g) > 1e-4, name
        torch.testing.assert_close((r0["local"][name] + r1["local"][name]) / 2, g, rtol=1e-10, atol=1e-14)


def test_params_bitwise_identical_after_an_adamw_step(runs):
    _, (r0, r1) = runs
    init = dict(ddp.build_model(CFG, "cpu").named_parameters())
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name
        assert not torch.equal(p, init[name].detach()), f"{name} did not move"


def test_token_shards_are_deterministic_and_distinct():
    a = ddp.token_shard(CFG, step=3, rank=1)
    assert a.shape == (CFG.B, CFG.T + 1) and a.dtype == torch.int64
    assert torch.equal(a, ddp.token_shard(CFG, step=3, rank=1))
    assert not torch.equal(a, ddp.token_shard(CFG, step=3, rank=0))
    assert not torch.equal(a, ddp.token_shard(CFG, step=4, rank=1))
    assert not torch.equal(a, ddp.token_shard(CFG.replace(seed=1), step=3, rank=1))
    g = ddp.global_batch(CFG, step=3, world=2)
    assert torch.equal(g[CFG.B:], a)


def test_build_model_is_seeded():
    m0, m1 = ddp.build_model(CFG, "cpu"), ddp.build_model(CFG, "cpu")
    m2 = ddp.build_model(CFG.replace(seed=1), "cpu")
    p0, p1, p2 = (dict(m.named_parameters()) for m in (m0, m1, m2))
    assert all(torch.equal(p0[n], p1[n]) for n in p0)
    assert not torch.equal(p0["head.weight"], p2["head.weight"])
