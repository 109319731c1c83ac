"""The op as training code uses it, on the GPU: torch.compile(fullgraph=True) with inductor, a
CUDA graph of a whole fwd+bwd replayed on new data, and a short soak of changing shapes.

Shapes keep H=HV=16 or H8 HV16 with K=V=128, whose fla autotune results the device kit seeds."""

from __future__ import annotations

import gc

import pytest
import torch
from kda_chain import chunk_kda, dispatch_log

pytestmark = pytest.mark.gpu


def _inputs(B, T, H, HV, K=128, V=128, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s, dt=dtype, scale=1.0):
        return (torch.randn(s, generator=g, device="cuda") * scale).to(dt)

    return dict(
        q=r(B, T, H, K),
        k=r(B, T, H, K),
        v=r(B, T, HV, V),
        g=r(B, T, HV, K),
        beta=r(B, T, HV),
        A_log=torch.log(torch.linspace(1.0, 16.0, HV, device="cuda")),
        dt_bias=r(HV * K, dt=torch.float32, scale=0.1),
        h0=r(B, HV, K, V, dt=torch.float32, scale=0.1),
    )


def _step(x, do, dht):
    """One fwd+bwd of chunk_kda on the leaves of `x`: (o, ht, grads...)."""
    leaves = [x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")]
    o, ht = chunk_kda(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        initial_state=x["h0"],
        output_final_state=True,
    )
    grads = torch.autograd.grad([o, ht], leaves, [do, dht])
    return (o, ht, *grads)


def test_torch_compile_fullgraph_inductor_matches_eager():
    """A 2-layer KDA model compiles with fullgraph=True (no graph break at chunk_kda: it is one
    custom op per direction) and its loss and gradients match eager."""
    from kda_chain.model import TinyKDALM

    torch.manual_seed(0)
    model = TinyKDALM(vocab=1024, d=256, layers=2, H=8, HV=16, K=128, V=128, op=chunk_kda).cuda()
    tokens = torch.randint(0, 1024, (2, 2049), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = model.loss(tokens)
    ref.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model.loss, fullgraph=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = compiled(tokens)
    got.backward()
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)
    for p, w in zip(model.parameters(), want, strict=True):
        err = (p.grad.float() - w.float()).norm() / w.float().norm().clamp_min(1e-12)
        assert err < 2e-2, err


def test_cuda_graph_replay_equals_eager():
    """Capture a whole fwd+bwd (static inputs), replay it on new data: every output and gradient
    equals an eager call on that data bit for bit."""
    x = {n: t.requires_grad_(True) for n, t in _inputs(2, 2048, 16, 16).items()}
    do = torch.randn(2, 2048, 16, 128, device="cuda", dtype=torch.bfloat16)
    dht = torch.randn(2, 16, 128, 128, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles, autotunes, fills the caches
        for _ in range(2):
            _step(x, do, dht)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _step(x, do, dht)
    new = _inputs(2, 2048, 16, 16, seed=1)
    with torch.no_grad():
        for n, t in x.items():
            t.copy_(new[n])
        do.copy_(torch.randn_like(do))
    graph.replay()
    torch.cuda.synchronize()
    eager = _step(x, do, dht)
    for i, (a, b) in enumerate(zip(static_out, eager, strict=True)):
        assert torch.equal(a, b), f"output {i} differs after replay"


def test_b1_beside_dhu_equals_one_stream(monkeypatch):
    """On a small grid (B1 T4096 H16 V128: 32 V tiles) the backward runs b1 on a second stream
    beside the fused dhu; every output and gradient equals the one-stream order bit for bit."""
    from kda_chain import backward as bwd

    x = {n: t.requires_grad_(True) for n, t in _inputs(1, 4096, 16, 16).items()}
    do = torch.randn(1, 4096, 16, 128, device="cuda", dtype=torch.bfloat16)
    dht = torch.randn(1, 16, 128, 128, device="cuda")
    used = []
    real = bwd._side_stream
    monkeypatch.setattr(bwd, "_side_stream", lambda *a: used.append(real(*a)) or used[-1])
    two = _step(x, do, dht)
    assert used and used[0] is not None, "the small grid should have taken the second stream"
    monkeypatch.setattr(bwd, "_side_stream", lambda *a: None)
    one = _step(x, do, dht)
    for i, (a, b) in enumerate(zip(two, one, strict=True)):
        assert torch.equal(a, b), f"output {i} differs between two streams and one"


def test_short_soak_is_flat_and_deterministic():
    """100 fwd+bwd calls whose T changes every call (B, heads among a few values): every result
    finite, memory back to its level after the first round of shapes, the dispatch log bounded,
    and a repeated input gives the same result as its first call (bench/soak.py: 1000 calls)."""
    import random

    rnd = random.Random(0)
    shapes = [
        (rnd.choice([1, 2]), rnd.choice([64, 100, 1000, 2048, 4096]), rnd.choice([(16, 16), (8, 16)]))
        for _ in range(100)
    ]
    first: dict = {}
    mem = []
    for i, (B, T, (H, HV)) in enumerate(shapes):
        x = {n: t.requires_grad_(True) for n, t in _inputs(B, T, H, HV, seed=T).items()}
        do = torch.ones(B, T, HV, 128, device="cuda", dtype=torch.bfloat16)
        dht = torch.ones(B, HV, 128, 128, device="cuda")
        out = [t.detach() for t in _step(x, do, dht)]
        assert all(torch.isfinite(t).all() for t in out), (i, B, T, H, HV)
        key = (B, T, H, HV)
        if key in first:
            assert all(torch.equal(a, b) for a, b in zip(out, first[key], strict=True)), key
        elif len(first) < 8:
            first[key] = out
        del x, do, dht, out
        gc.collect()
        torch.cuda.synchronize()
        mem.append(torch.cuda.memory_allocated())
    kept = sum(sum(t.numel() * t.element_size() for t in v) for v in first.values())
    assert max(mem[50:]) <= max(mem[:50]) + (1 << 20), (max(mem[:50]), max(mem[50:]), kept)
    assert len(dispatch_log()) <= dispatch_log().maxlen


def test_launch_pins_no_input():
    """The call cache's launch path (TVM-FFI on the device kit, else DLPack descriptors) keeps no
    reference to a call's tensors: the first call's inputs are freed when the caller drops them."""
    import weakref

    import kda_cute.b1 as b1
    from kda_cute._common.cache import launch_path

    B, T, HV, K, V = 1, 256, 16, 128, 128
    kg, w = (torch.randn(B, T, HV, K, device="cuda", dtype=torch.bfloat16) * 0.1 for _ in range(2))
    u = torch.randn(B, T, HV, V, device="cuda", dtype=torch.bfloat16)
    gk = -torch.rand(B, T, HV, K, device="cuda")
    refs = [weakref.ref(t) for t in (kg, w, u, gk)]
    outs = b1.fwd_h(kg, w, u, gk)
    del kg, w, u, gk, outs
    gc.collect()
    assert all(r() is None for r in refs), f"a tensor of the first call is still alive ({launch_path()} path)"
