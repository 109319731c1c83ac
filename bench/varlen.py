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


def _fresh_cu(fn, x, do, cu, cu_cpu, **kw):
    """_step with new cu_seqlens tensors every call (what a data loader gives each step): the
    chain's layout is then built each call, not shared (kda_chain.varlen.packing_of)."""
    def run():
        _step(fn, x, do, cu_seqlens=cu.clone(), cu_seqlens_cpu=cu_cpu.clone(), **kw)()
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


def diagnose(name: str, fn) -> dict:
    """Where a step's time goes beyond its kernels: the median from an idle GPU (host work before
    the first launch counted) against primed (device time only), the host time of one call (until
    its last launch returns), the synchronizing calls (torch's sync debug mode), and the CUDA
    runtime calls that can stall the stream (allocations, frees, syncs, copies) in one call; the
    profiled call's idle gaps (`gaps`) and its host hot spots (`host_hot`). Returns the profiled
    call's device time per kernel name (ms), for `kernel_diff`."""
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
    per_kernel = gaps(prof)
    launch_times(fn)
    host_hot(fn)
    return per_kernel


def launch_times(fn, calls: int = 5) -> None:
    """When, into one call on the host (median of `calls`, ms from the call's start), each CuTe
    launch of the chain is issued and returns, and when the call returns: the host lead before the
    first kernel of substance, and where host time goes between launches (no profiler running)."""
    import time

    from kda_chain import stages as S

    marks: list = []
    orig = S._Plan.launch

    def launch(self, name, mod, args, kwargs):
        marks.append((name, time.perf_counter()))
        try:
            return orig(self, name, mod, args, kwargs)
        finally:
            marks.append(("/" + name, time.perf_counter()))

    from kda_chain import varlen as VL

    def marked(name, f):  # f with a mark when it starts and one when it returns
        def g(*a, **k):
            marks.append((name, time.perf_counter()))
            try:
                return f(*a, **k)
            finally:
                marks.append(("/" + name, time.perf_counter()))
        return g

    # inside the layout's build: the host tables, the pinned staging copy, the H2D copy
    pack, tables = VL.packing, VL._host_tables
    pin, to = torch.Tensor.pin_memory, torch.Tensor.to
    inside = []

    def packing(*a, **k):
        inside.append(1)
        try:
            return marked("packing", pack)(*a, **k)
        finally:
            inside.clear()

    def only_inside(name, f):
        def g(*a, **k):
            return marked(name, f)(*a, **k) if inside else f(*a, **k)
        return g

    S._Plan.launch, VL.packing, VL._host_tables = launch, packing, marked("host_tables", tables)
    torch.Tensor.pin_memory, torch.Tensor.to = only_inside("pin", pin), only_inside("h2d", to)
    rows = []
    try:
        for _ in range(calls):
            torch.cuda.synchronize()
            marks.clear()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            rows.append([(n, (t - t0) * 1e3) for n, t in marks] + [("end", (t1 - t0) * 1e3)])
            torch.cuda.synchronize()
    finally:
        S._Plan.launch, VL.packing, VL._host_tables = orig, pack, tables
        torch.Tensor.pin_memory, torch.Tensor.to = pin, to
    n = min(len(r) for r in rows)
    med = [(rows[0][i][0], sorted(r[i][1] for r in rows)[len(rows) // 2]) for i in range(n)]
    print("    host marks (ms into the call): " + ", ".join(f"{w} {t:.3f}" for w, t in med))


def host_hot(fn, calls: int = 3, n: int = 10) -> None:
    """cProfile of `calls` calls of fn: the n functions with the most own time, us per call (the
    host path where it runs for real: launches, the caching allocator, autograd)."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(pr).stats
    rows = sorted(((tt, nc, f"{fn_[0].rsplit('/', 1)[-1]}:{fn_[1]}:{fn_[2]}") for fn_, (_, nc, tt, _, _)
                   in st.items()), reverse=True)[:n]
    print("    host own time: " + "; ".join(f"{1e6 * tt / calls:.0f} us {nc // calls}x {w[:60]}"
                                            for tt, nc, w in rows))


def kernel_diff(a: dict, b: dict, floor_ms: float = 0.03) -> None:
    """The kernels whose time differs by more than floor_ms between two calls' profiles (b - a)."""
    d = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in set(a) | set(b)}
    big = sorted((k for k in d if abs(d[k]) > floor_ms), key=lambda k: -abs(d[k]))
    print(f"    kernels packed - dense: total {sum(d.values()):+.3f} ms; "
          + "; ".join(f"{d[k]:+.3f} {k[:50]}" for k in big))


def gaps(prof, n: int = 6, floor_us: float = 20.0) -> dict:
    """The GPU's idle time inside one profiled call: the n largest gaps between consecutive device
    events (kernels, copies, memsets), each with the event after it and the runtime call that
    launched that event (how long after the gap opened the host issued it: a gap the host fills
    late is host-bound; one whose launch came early is a device-side wait), and the n slowest
    runtime calls (a blocking copy or allocation shows there). Returns device ms per event name."""
    import os
    import tempfile

    from kda_witness.trace import load_events

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        ev = [e for e in load_events(path)[1] if e.get("ph") == "X"]
    dev = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    launch = {e["args"].get("correlation"): e for e in ev if e.get("cat") == "cuda_runtime"}
    if not dev:
        return {}
    span = dev[-1]["ts"] + dev[-1]["dur"] - dev[0]["ts"]
    busy = sum(e["dur"] for e in dev)
    rows, end, prev = [], dev[0]["ts"] + dev[0]["dur"], dev[0]["name"]
    for e in dev[1:]:
        if e["ts"] - end > floor_us:
            r = launch.get(e["args"].get("correlation"))
            lag = "" if r is None else f", launched {r['ts'] - end:+.0f} us after it opened by {r['name']}"
            rows.append((e["ts"] - end, f"{e['name'][:50]} (after {prev[:40]}){lag}"))
        end, prev = max(end, e["ts"] + e["dur"]), e["name"]
    idle = sum(g for g, _ in rows)
    cpu = [e for e in ev if e.get("cat") in ("cpu_op", "python_function")]
    t0 = min((e["ts"] for e in cpu), default=dev[0]["ts"])
    lead = f"first device event {dev[0]['ts'] - t0:.0f} us into the call, "
    big = next((e for e in dev if e["dur"] > 100), dev[0])
    lead += f"first > 100 us kernel at {big['ts'] - dev[0]['ts']:.0f} us ({big['name'][:40]}); "
    print(f"    {lead}device span {span / 1e3:.3f} ms, busy {busy / 1e3:.3f}, gaps > {floor_us:.0f} us "
          f"{idle / 1e3:.3f} ms in {len(rows)}")
    for g, what in sorted(rows, reverse=True)[:n]:
        print(f"    gap {g:8.0f} us before {what}")
    slow = sorted((e for e in ev if e.get("cat") == "cuda_runtime"), key=lambda e: -e["dur"])[:n]
    print("    slowest runtime calls: " + ", ".join(f"{e['name']} {e['dur']:.0f} us" for e in slow))
    per: dict = {}
    for e in dev:
        per[e["name"]] = per.get(e["name"], 0.0) + e["dur"] / 1e3
    return per


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
            ("ref ours packed, new cu_seqlens", _fresh_cu(ours_kda, xp, dop, cu, cu_cpu, **kw)),
            ("peer ours dense B16", _step(ours_kda, dense, ydo)),
            ("peer ours packed", _step(ours_kda, yp, ydop, **ppk))]
    if a.diagnose:
        ks = [diagnose(name, fn) for name, fn in runs]
        kernel_diff(ks[0], ks[1])
        kernel_diff(ks[3], ks[4])
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
             ("ref fla packed", _step(fla_kda, xp, dop, **pk))]
    print("fwd+bwd; ref: H16 K128 V256, gate + l2norm in op; peer: H16 K=V=128 on cuDNN's inputs")

    def timed(name, fn):
        res[name] = median_ms(fn, warmup=2, reps=a.reps)
        print(f"  {name:28s} {res[name]:9.3f} ms", flush=True)
        save()

    for name, fn in runs:
        timed(name, fn)
        if a.profile and name in ("ref ours dense B16", "ref ours packed"):
            top_kernels(fn)
    for who, fn in (("ours", _step(ours_kda, xp, dop, **pk)), ("fla", _step(fla_kda, xp, dop, **pk))):
        res[f"ref peak MB {who} packed"] = peak_mb(fn)
        print(f"  ref peak MB {who} packed {res[f'ref peak MB {who} packed']:9.0f}", flush=True)
        save()
    r = res
    print(f"ref: packed / dense: ours {r['ref ours packed'] / r['ref ours dense B16']:.3f}, "
          f"fla {r['ref fla packed'] / r['ref fla dense B16']:.3f}; over fla: "
          f"packed {r['ref fla packed'] / r['ref ours packed']:.2f}x, "
          f"dense {r['ref fla dense B16'] / r['ref ours dense B16']:.2f}x")
    peer = f"peer: packed / dense (ours) {r['peer ours packed'] / r['peer ours dense B16']:.3f}"
    if "peer cudnn packed" in r:
        peer += f"; cudnn / ours {r['peer cudnn packed'] / r['peer ours packed']:.2f}x"
    print(peer, flush=True)
    # last: fla's packed peer shape may autotune for minutes on a fresh machine
    timed("peer fla packed", _step(fla_kda, yp, ydop, **ppk))
    print(f"peer: fla / ours {r['peer fla packed'] / r['peer ours packed']:.2f}x")


if __name__ == "__main__":
    main()
