"""Soak: many fwd+bwd calls of chunk_kda with fresh tensors whose shape changes every call (GPU).

Per call: B in {1, 2}, T drawn from 64..8192 (ragged included), (H, HV) in {(16, 16), (8, 16)},
K = V = 128, bf16, the witness CLI's inputs and flags (gate + l2norm in the op, h0 and ht).
Checks, and prints every --every calls (a progress line with the figures):

  - every output and gradient finite;
  - a (B, T, heads) seen before, with the same seed, gives the result of its first call
    (compared by fp64 fingerprints: plain and position-weighted sums of every tensor);
  - GPU memory allocated / reserved and host RSS flat once every shape was met once (the first
    round), the call caches' compiled-kernel counts no higher than the distinct kernel configs,
    the view-level entries and the dispatch log bounded;
  - at the end, a fresh process (`--replay`) computes every distinct shape once and must give
    the same fingerprints as this process's first call of it (no state carried in a process
    changes a result: caches, autotune, the allocator's reuse).

Writes soak.json (the curves and each shape's fingerprint) and soak.png (memory and RSS against
the call) under --out.

    python bench/soak.py [--calls 1000] [--every 100] [--out /tmp/soak]
    python bench/soak.py --replay /tmp/soak/soak.json      (what the soak runs at its end)
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from kda_chain import chunk_kda, dispatch_log


def _caches():
    """Every CuTe stage's call cache (kda_cute.registry), by stage."""
    from kda_cute import registry

    return {rec.name: rec.load()._cache for rec in registry.STAGES}


def step(B, T, H, HV, seed):
    """One fwd+bwd on fresh random inputs, the witness CLI's (kda_chain.witness: gate, l2norm, h0,
    ht; K = V = 128 bf16): o, ht and every gradient."""
    from kda_chain import witness

    a = witness.parse_args(["--B", str(B), "--T", str(T), "--H", str(H), "--HV", str(HV), "--K", "128",
                            "--V", "128", "--dtype", "bf16", "--seed", str(seed)])
    x, flags, cot = witness.make_inputs(a, "cuda")
    return list(witness.fwd_bwd(chunk_kda, x, flags, cot).values())


def fingerprint(ts) -> list[float]:
    """Per tensor: the fp64 sum and the sum weighted by position (a torch reduction over the same
    shape is deterministic: equal fingerprints for equal tensors; a changed element shows). One
    host sync for all of them."""
    sums = []
    for t in ts:
        f = t.double().flatten()
        w = torch.arange(1, f.numel() + 1, device=f.device, dtype=torch.float64).remainder_(1021)
        sums += [f.sum(), (f * w).sum()]
    return torch.stack(sums).tolist()


def _seed(key) -> int:
    # a seed per shape, the same in every process (hash() of a tuple of ints is not salted)
    return hash(key) % 2**31


def replay(path: Path) -> int:
    """Recompute each shape of a soak's soak.json once in this (fresh) process and compare with
    the fingerprints the soak recorded at that shape's first call: 0 when all equal."""
    rec = json.loads(path.read_text())["fingerprints"]
    bad = 0
    t0 = time.perf_counter()
    for key, want in rec:
        B, T, H, HV = key
        got = fingerprint(step(B, T, H, HV, seed=_seed(tuple(key))))
        if got != want:
            bad += 1
            print(f"replay: B{B} T{T} H{H} HV{HV} differs from the soak's first call", flush=True)
    print(f"replay: {len(rec)} shapes in a fresh process in {time.perf_counter() - t0:.1f} s, "
          f"{bad} differ", flush=True)
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="/tmp/soak")
    ap.add_argument("--replay", type=Path, default=None, help="a soak.json to recompute in this process")
    a = ap.parse_args()
    if a.replay is not None:
        return replay(a.replay)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(a.seed)
    Ts = [64, 65, 127, 500, 1000, 2048, 3000, 4096, 8192]
    shapes = [(rnd.choice([1, 2]), rnd.choice(Ts), rnd.choice([(16, 16), (8, 16)])) for _ in range(a.calls)]
    distinct = len(set(shapes))
    first_round = max(i for i, s in enumerate(shapes) if s not in shapes[:i]) + 1
    print(
        f"soak: {a.calls} calls, {distinct} distinct shapes, all met once by call {first_round}", flush=True
    )
    seen: dict = {}
    curve = {"alloc_mb": [], "reserved_mb": [], "rss_mb": [], "ms": []}
    bad = []
    t_start = time.perf_counter()
    for i, (B, T, (H, HV)) in enumerate(shapes):
        t0 = time.perf_counter()
        res = step(B, T, H, HV, seed=_seed((B, T, H, HV)))
        if not all(torch.isfinite(t).all() for t in res):
            bad.append(f"call {i}: non-finite output at B{B} T{T} H{H} HV{HV}")
        key = (B, T, H, HV)
        fp = fingerprint(res)
        if key not in seen:
            seen[key] = fp
        elif fp != seen[key]:
            bad.append(f"call {i}: B{B} T{T} H{H} HV{HV} differs from its first call")
        del res
        torch.cuda.synchronize()
        curve["ms"].append((time.perf_counter() - t0) * 1e3)
        curve["alloc_mb"].append(torch.cuda.memory_allocated() / 2**20)
        curve["reserved_mb"].append(torch.cuda.memory_reserved() / 2**20)
        curve["rss_mb"].append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        if (i + 1) % a.every == 0 or i + 1 == a.calls:
            gc.collect()
            c = {n: (cc.compiles, len(cc.entries)) for n, cc in _caches().items()}
            print(
                f"[{time.perf_counter() - t_start:7.1f}s] call {i + 1}: alloc {curve['alloc_mb'][-1]:.1f} MB "
                f"reserved {curve['reserved_mb'][-1]:.0f} MB rss {curve['rss_mb'][-1]:.0f} MB; "
                f"(compiles, views) {c}; dispatch log {len(dispatch_log())}; problems {len(bad)}",
                flush=True,
            )
    after = slice(first_round, None)
    growth = (
        {n: max(v[after]) - max(v[:first_round]) for n, v in curve.items() if n != "ms"}
        if first_round < a.calls
        else {}
    )
    print(f"growth after the first round (max after - max before, MB): {growth}", flush=True)
    if growth.get("alloc_mb", 0) > 1 or growth.get("reserved_mb", 0) > 64 or growth.get("rss_mb", 0) > 256:
        bad.append(f"memory grew after every shape was met: {growth}")
    if len(dispatch_log()) > dispatch_log().maxlen:
        bad.append("dispatch log unbounded")
    record = {"shapes": shapes, "curve": curve, "growth": growth, "problems": bad,
              "fingerprints": [[list(k), fp] for k, fp in seen.items()]}
    (out / "soak.json").write_text(json.dumps(record))
    print("soak: recomputing every shape in a fresh process", flush=True)
    if subprocess.run([sys.executable, __file__, "--replay", str(out / "soak.json")]).returncode:
        bad.append("a fresh process gives a different result for some shape (see replay above)")
        (out / "soak.json").write_text(json.dumps(record))  # with the replay's verdict
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.2))
        for n in ("alloc_mb", "reserved_mb", "rss_mb"):
            ax.plot(curve[n], label=n)
        ax.axvline(first_round, color="gray", ls=":", label="every shape met")
        ax.set_xlabel("call")
        ax.set_ylabel("MB")
        ax.set_title(f"chunk_kda soak: {a.calls} fwd+bwd, {distinct} shapes (H200)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "soak.png", dpi=110)
    except ImportError:
        print("matplotlib not importable: no soak.png", flush=True)
    for b in bad[:20]:
        print("PROBLEM", b, flush=True)
    print("soak: OK" if not bad else f"soak: FAIL ({len(bad)} problems)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
