"""Split an Nsight Compute SASS table at the kernel's barriers: where a kernel's time goes by phase.

`bash bench/gpu_suite.sh ncu` brings back `ncu_sass.csv.xz` (`ncu --page source --csv --print-source
sass`): one row per SASS instruction with its stall samples. This cuts the instruction stream at
every BAR (a CTA-wide barrier ends a phase in our kernels), sums each interval's samples and
executed instructions, names its top opcodes and stall reasons, and with `--hot A B` lists the
interval's hottest instructions. With several kernels in one file, `--kernel N` picks the N-th.

    python bench/ncu_phases.py ncu_sass.csv.xz [--kernel 0] [--min 0.5] [--hot 4493 5478]

(docs/perf/bwd_chunk.md and prep.md, 2026-12-03: the splits that found the row passes' serial
loads and the L2 norm's serial rows.)
"""

from __future__ import annotations

import argparse
import collections
import csv
import lzma


def kernels(path: str) -> list[tuple[list[str], list[list[str]]]]:
    """[(header, rows)] per kernel of the table (each kernel starts with a "Kernel Name" line)."""
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        lines = list(csv.reader(f))
    out, cur = [], None
    for row in lines:
        if row and row[0] == "Kernel Name":
            cur = None
            continue
        if row and row[0] == "Address":
            cur = (row, [])
            out.append(cur)
        elif cur is not None and row:
            cur[1].append(row)
    return out


def _op(src: str) -> str:
    parts = src.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0].split(".")[0] if parts else ""


def phases(header, rows, min_pct: float) -> None:
    ix = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(int(r[ix["# Samples"]] or 0) for r in rows) or 1
    start, samples, inst = 0, 0, 0
    mix, why = collections.Counter(), collections.Counter()
    print(f"{len(rows)} instructions, {total} stall samples")
    for i, r in enumerate(rows):
        s, n, op = int(r[ix["# Samples"]] or 0), int(r[ix["Instructions Executed"]] or 0), _op(r[1])
        samples, inst = samples + s, inst + n
        mix[op] += n
        for c in stalls:
            if r[ix[c]] not in ("", "0"):
                why[c[6:]] += int(r[ix[c]])
        if op == "BAR" or i == len(rows) - 1:
            if 100 * samples / total >= min_pct:
                ops = ", ".join(f"{o} {c / 1e6:.1f}M" for o, c in mix.most_common(5))
                st = ", ".join(f"{o} {100 * c / max(1, samples):.0f}%" for o, c in why.most_common(3))
                print(f"[{start:5d}-{i:5d}] {100 * samples / total:5.1f}% of samples, {inst / 1e6:7.1f}M inst"
                      f" | {ops} | {st}")
            start, samples, inst = i + 1, 0, 0
            mix, why = collections.Counter(), collections.Counter()


def hot(header, rows, a: int, b: int, top: int = 20) -> None:
    ix = {h: i for i, h in enumerate(header)}
    total = sum(int(r[ix["# Samples"]] or 0) for r in rows) or 1
    span = range(a, min(b, len(rows)))
    pick = sorted(((int(rows[i][ix["# Samples"]] or 0), i) for i in span), reverse=True)
    for s, i in pick[:top]:
        r = rows[i]
        print(f"{i:5d} {100 * s / total:5.2f}%  long_sb {r[ix['stall_long_sb']]:>6}  short_sb "
              f"{r[ix['stall_short_sb']]:>6} | {r[1].strip()}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("table")
    ap.add_argument("--kernel", type=int, default=0)
    ap.add_argument("--min", type=float, default=0.5, help="hide intervals under this % of the samples")
    ap.add_argument("--hot", type=int, nargs=2, metavar=("FROM", "TO"))
    a = ap.parse_args()
    header, rows = kernels(a.table)[a.kernel]
    phases(header, rows, a.min)
    if a.hot:
        hot(header, rows, *a.hot)


if __name__ == "__main__":
    main()
