"""The host cost of a packed call's layout (kda_chain.varlen.packing) on the device machine, piece by
piece: the host table build, the pinned staging copy, the H2D copy, the whole `packing`, and the
device build a traced call uses. Median us of --reps calls, the GPU idle between calls (a sync
after each) and busy (a 2 ms sleep kernel queued before each: what a training step sees).

    python bench/check_packing.py [--total 131072] [--reps 200]
"""

from __future__ import annotations

import argparse
import time

import torch
from varlen import lengths


def median_us(fn, reps: int, busy: bool) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        if busy:
            torch.cuda._sleep(2_000_000)
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    ts.sort()
    return ts[len(ts) // 2] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--total", type=int, default=131072)
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    from kda_chain import varlen as VL

    lens = lengths(a.total)
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    counts = [-(-(b - a_) // VL.BT) for a_, b in zip(offs, offs[1:], strict=False)]
    NT = sum(counts)
    cu = torch.tensor(offs, dtype=torch.int32, device="cuda")
    host = VL._host_tables(offs, counts, NT)
    pinned = host.pin_memory()
    dev = torch.device("cuda")
    cases = {
        "host tables": lambda: VL._host_tables(offs, counts, NT),
        "pin_memory()": lambda: host.pin_memory(),
        "empty(pin_memory) + copy_": lambda: torch.empty_like(host, pin_memory=True).copy_(host),
        "H2D from pinned, non_blocking": lambda: pinned.to(dev, non_blocking=True),
        "cu_seqlens.clone()": lambda: cu.clone(),
        "packing (host)": lambda: VL.packing(cu, offs),
        "packing (device build)": lambda: VL.packing(cu, offs, host=False),
    }
    print(f"packing: {len(lens)} sequences, {a.total} tokens, {NT} chunks")
    for name, fn in cases.items():
        idle, busy = median_us(fn, a.reps, False), median_us(fn, a.reps, True)
        print(f"  {name:32s} idle {idle:8.1f} us   busy {busy:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
