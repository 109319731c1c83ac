"""Packed sequences (cu_seqlens): ours against fla 0.6.0 and cuDNN-frontend's packed KDA, and against
the same number of tokens at fixed length, fwd+bwd, side by side in one process.

Lengths: drawn uniformly from 1..8192 (seeded) until they fill `--total` tokens (the last one cut
to fit), so most sequences end in a partial chunk. Two setups, each timed with CUDA events
(median of `--reps` after warm-up; bench/cuda_clock.median_ms):

  ref    H16 K128 V256 bf16, gate + l2norm in the op (the reference shape's flags): packed ours
         and fla; fixed length B16 T8192 (same total) ours and fla
  peer   H16 K=V=128 on cuDNN's inputs (l2-normalized q / k, the fp32 log gate, fp32 beta): packed
         ours, fla and cuDNN; fixed length B16 T8192 ours

and the peak memory of one packed fwd+bwd (ours, fla). Prints a table, writes --json.

    python bench/varlen.py [--total 131072] [--reps 10] [--json $OUT/varlen.json] [--profile] [--diagnose]
"""

from __future__ import annotations

import argparse
import json

import peers
import torch
from conftest import KDA_FLAGS, make_inputs
from cuda_clock import median_ms


def lengths(total: int, seed: int = 0, top: int = 8192) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    while sum(out) < total:
        out.append(int(torch.randint(1, top + 1, (1,), generator=gen)))
    out[-1] -= sum(out) - total
    return [n for n in out if n > 0]


def _flat(x: dict, B: int, T: int) -> dict:
    """[B, T, ...] leaves as one packed row [1, B*T, ...] (fresh leaves)."""
    return {n: (t.detach().reshape(1, B * T, *t.shape[2:]).requires_grad_(True) if t.dim() > 1 else t)
            for n, t in x.items()}


def _step(fn, x, do, **kw):
    leaves = [x[n] for n in ("q", "k", "v", "g", "beta") if x[n].requires_grad]

    def run():
        for t in leaves:
            t.grad = None
        o, _ = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
        o.backward(do)
    return run


def peak_mb(fn) -> float:
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def top_kernels(fn, n: int = 25) -> None:
    """One call of fn under torch.profiler: its n largest CUDA kernels by total time, one compact
    line each (ms, launches, name), and the sum of all."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.device_time_total / 1e3, e.count, e.key) for e in prof.key_averages()
            if e.device_time_total > 0]
    rows.sort(reverse=True)
    print(f"    all kernels {sum(r[0] for r in rows):.3f} ms")
    for ms, count, key in rows[:n]:
        print(f"    {ms:8.3f} ms {count:3d}x  {key[:90]}")


def diagnose(name: str, fn) -> None:
    """Where a step's time goes beyond its kernels: the median from an idle GPU (host work before
    the first launch counted) against primed (device time only), the host time of one call (until
    its last launch returns), the synchronizing calls (torch's sync debug mode), and the CUDA
    runtime calls that can stall the stream (allocations, frees, syncs, copies) in one call."""
    import time
    import warnings

    from torch.profiler import ProfilerActivity, profile

    idle, primed = median_ms(fn, warmup=2, reps=8), median_ms(fn, warmup=1, reps=8, primed=True)
    host = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message).splitlines()[0][:80] for w in caught if "synchroniz" in str(w.message)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    stalls = ("Malloc", "Free", "ynchronize", "Memcpy")
    api = {e.key: e.count for e in prof.key_averages()
           if e.key.startswith("cuda") and any(w in e.key for w in stalls)}
    print(f"  {name}: idle {idle:.3f} ms, primed {primed:.3f}, host {sorted(host)[2]:.3f}; "
          f"{len(syncs)} syncs {syncs[:3]}; runtime {api}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--total", type=int, default=131072)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    ap.add_argument("--profile", action="store_true", help="also print ours' top kernels, dense and packed")
    ap.add_argument("--diagnose", action="store_true",
                    help="only ours, dense and packed: idle vs primed, host time, syncs, runtime calls")
    a = ap.parse_args()
    from fla.ops.kda import chunk_kda as fla_kda
    from kda_chain import chunk_kda as ours_kda

    lens = lengths(a.total)
    offs = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    cu, cu_cpu = offs.cuda(), offs.long()
    B, T = 16, a.total // 16
    print(f"varlen: {len(lens)} sequences, {a.total} tokens (min {min(lens)}, max {max(lens)}, "
          f"{sum(n % 64 != 0 for n in lens)} ending in a partial chunk)")
    res: dict = {"lengths": lens}

    def save():
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)

    # ref: the reference shape's flags, the raw gate through the op
    x = make_inputs(B=B, T=T, H=16, HV=16, K=128, V=256)
    do = torch.randn_like(x["v"])
    xp, dop = _flat(x, B, T), do.reshape(1, B * T, 16, 256)
    kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], **KDA_FLAGS)
    pk = dict(cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, **kw)
    # peer: cuDNN's inputs at K = V = 128
    from test_chain import _peer_inputs

    y = make_inputs(B=B, T=T, H=16, HV=16, K=128, V=128)
    dense = dict(zip(("q", "k", "v", "g", "beta"), _peer_inputs(y), strict=True))
    ydo = torch.randn_like(y["v"])
    yp, ydop = _flat(dense, B, T), ydo.reshape(1, B * T, 16, 128)
    ppk = dict(cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    # ours and cuDNN first, fla last (its varlen kernels autotune on a fresh machine: minutes)
    runs = [("ref ours dense B16", _step(ours_kda, x, do, **kw)),
            ("ref ours packed", _step(ours_kda, xp, dop, **pk)),
            ("peer ours dense B16", _step(ours_kda, dense, ydo)),
            ("peer ours packed", _step(ours_kda, yp, ydop, **ppk))]
    if a.diagnose:
        for name, fn in runs:
            diagnose(name, fn)
        return
    kda = peers.cudnn_kda()
    if kda is not None:
        flat = [yp[n].detach().reshape(a.total, 16, -1).requires_grad_(True) for n in ("q", "k", "v", "g")]
        fb = yp["beta"].detach().reshape(a.total, 16).requires_grad_(True)
        fdo = ydop.reshape(a.total, 16, 128)

        def cudnn():
            for t_ in (*flat, fb):
                t_.grad = None
            o, _ = kda(*flat, fb, cu)
            o.backward(fdo)
        runs.append(("peer cudnn packed", cudnn))
    runs += [("ref fla dense B16", _step(fla_kda, x, do, **kw)),
             ("ref fla packed", _step(fla_kda, xp, dop, **pk)),
             ("peer fla packed", _step(fla_kda, yp, ydop, **ppk))]
    print("fwd+bwd; ref: H16 K128 V256, gate + l2norm in op; peer: H16 K=V=128 on cuDNN's inputs")
    for name, fn in runs:
        res[name] = median_ms(fn, warmup=2, reps=a.reps)
        print(f"  {name:28s} {res[name]:9.3f} ms", flush=True)
        save()
        if a.profile and name in ("ref ours dense B16", "ref ours packed"):
            top_kernels(fn)
    for who, fn in (("ours", _step(ours_kda, xp, dop, **pk)), ("fla", _step(fla_kda, xp, dop, **pk))):
        res[f"ref peak MB {who} packed"] = peak_mb(fn)
        print(f"  ref peak MB {who} packed {res[f'ref peak MB {who} packed']:9.0f}", flush=True)
        save()
    r = res
    print(f"ref: packed / dense (ours) {r['ref ours packed'] / r['ref ours dense B16']:.3f}; over fla: "
          f"packed {r['ref fla packed'] / r['ref ours packed']:.2f}x, "
          f"dense {r['ref fla dense B16'] / r['ref ours dense B16']:.2f}x")
    peer = f"peer: packed / dense (ours) {r['peer ours packed'] / r['peer ours dense B16']:.3f}; "
    peer += f"fla / ours {r['peer fla packed'] / r['peer ours packed']:.2f}x"
    if "peer cudnn packed" in r:
        peer += f"; cudnn / ours {r['peer cudnn packed'] / r['peer ours packed']:.2f}x"
    print(peer)


if __name__ == "__main__":
    main()
