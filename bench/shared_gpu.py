"""Two processes sharing one GPU, as when debugging DDP on one device: each compiles its own CuTe
kernels at the same time as the other (and fla's Triton kernels, unless a cache was restored),
then runs the same
shapes in the opposite order, several rounds; neither may disturb the other's results.

Per process (a `--worker`): fwd+bwd of chunk_kda on the witness CLI's inputs (bench/soak.py's
`step`: gate, l2norm, h0, ht; K = V = 128 bf16) at SHAPES, fingerprinted (soak's fp64 sums of o,
ht and every gradient); the rounds of one process must agree with each other; which
implementation every stage ran is recorded. The parent then runs one more process alone and
requires all three to give identical fingerprints for every shape, and the CuTe stages to have
run their kernels in both concurrent processes wherever they did in the lone one.

    python bench/shared_gpu.py [--rounds 3] [--out /tmp/shared]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SHAPES = [(1, 1024, 16, 16), (2, 2048, 8, 16), (4, 4096, 16, 16), (2, 512, 16, 16)]


def worker(out: Path, reverse: bool, rounds: int) -> int:
    from kda_chain import dispatch_log
    from soak import _seed, fingerprint, step

    order = SHAPES[::-1] if reverse else SHAPES
    fps: dict[str, list[float]] = {}
    problems = []
    t0 = time.perf_counter()
    for r in range(rounds):
        for key in order:
            fp = fingerprint(step(*key, seed=_seed(key)))
            if fps.setdefault(str(key), fp) != fp:
                problems.append(f"round {r}: {key} differs from this process's first call")
    impls: dict[str, set] = {}
    for c in dispatch_log():
        impls.setdefault(c.stage, set()).add(c.impl)
    out.write_text(json.dumps({"fingerprints": fps, "impls": {k: sorted(v) for k, v in impls.items()},
                               "problems": problems, "seconds": time.perf_counter() - t0}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("/tmp/shared"))
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--reverse", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        return worker(a.worker, a.reverse, a.rounds)
    a.out.mkdir(parents=True, exist_ok=True)
    me = [sys.executable, __file__, "--rounds", str(a.rounds)]
    files = [a.out / "proc0.json", a.out / "proc1.json", a.out / "alone.json"]
    t0 = time.perf_counter()
    procs = [subprocess.Popen([*me, "--worker", str(files[i]), *(["--reverse"] if i else [])])
             for i in range(2)]
    rcs = [p.wait() for p in procs]
    print(f"shared_gpu: two concurrent processes done in {time.perf_counter() - t0:.1f} s, rc {rcs}",
          flush=True)
    rcs.append(subprocess.run([*me, "--worker", str(files[2])]).returncode)
    if any(rcs):
        print(f"shared_gpu: FAIL (a process exited {rcs})", flush=True)
        return 1
    res = [json.loads(f.read_text()) for f in files]
    bad = [f"proc{i}: {p}" for i, r in enumerate(res) for p in r["problems"]]
    for key in map(str, SHAPES):
        got = [r["fingerprints"][key] for r in res]
        if not (got[0] == got[1] == got[2]):
            bad.append(f"{key}: the concurrent processes and the lone one differ")
    alone = res[2]["impls"]
    for stage, impls in alone.items():
        for i in range(2):
            if res[i]["impls"].get(stage) != impls:
                bad.append(f"proc{i}: stage {stage} ran {res[i]['impls'].get(stage)}, alone {impls}")
    cute = sorted(s for s, v in alone.items() if "cute" in v)
    print(f"shared_gpu: {len(SHAPES)} shapes x {a.rounds} rounds per process; CuTe stages run: {cute}",
          flush=True)
    for b in bad:
        print("PROBLEM", b, flush=True)
    print("shared_gpu: OK" if not bad else f"shared_gpu: FAIL ({len(bad)} problems)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
