"""Turn a saved pytest-benchmark run into a Markdown table and a PNG bar chart, ours vs fla.

    uv run python bench/chart.py RUN.json [--out bench/results/NAME]   # writes NAME.md, NAME.png

Rows: per stage (test_stages) and per chain mode (test_chain), median ms per implementation and
the ratio fla / ours (> 1 means ours is faster). Runs anywhere (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> tuple[dict, dict]:
    """-> ({(group, shape): {impl: median_ms}}, machine/commit info)."""
    data = json.loads(path.read_text())
    rows: dict = defaultdict(dict)
    for b in data["benchmarks"]:
        info = b.get("extra_info", {})
        key = (info.get("stage") or f"chain {info.get('mode')}", info.get("shape"))
        rows[key][info.get("impl")] = b["stats"]["median"] * 1e3
    meta = {"datetime": data.get("datetime"), "commit": data.get("commit_info", {}).get("id"),
            "machine": data.get("machine_info", {}).get("node")}
    return rows, meta


def table(rows: dict, meta: dict, gpu: str) -> str:
    impls = sorted({i for r in rows.values() for i in r}, key=["cute", "ours", "fla", "attn_gym",
                                                               "reference"].index)
    out = [f"Run {meta['datetime']} commit {meta['commit']} GPU {gpu}. Median ms (CUDA events);"
           " ratio = fla / ours (> 1: ours faster).", "",
           "| stage | shape | " + " | ".join(impls) + " | fla/ours |",
           "|---|---|" + "---|" * (len(impls) + 1)]
    for (stage, shape), r in sorted(rows.items(), key=lambda kv: (kv[0][1] or "", kv[0][0])):
        ours = r.get("cute", r.get("ours"))
        ratio = f"{r['fla'] / ours:.2f}x" if ours and r.get("fla") else "-"
        cells = [f"{r[i]:.3f}" if i in r else "-" for i in impls]
        out.append(f"| {stage} | {shape} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(out) + "\n"


def chart(rows: dict, png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(rows, key=lambda k: (k[1] or "", k[0]))
    labels = [f"{s}\n{sh}" for s, sh in keys]
    fla = [rows[k].get("fla", 0) for k in keys]
    ours = [rows[k].get("cute", rows[k].get("ours", 0)) or 0 for k in keys]
    fig, ax = plt.subplots(figsize=(max(8, len(keys) * 0.7), 5))
    xs = range(len(keys))
    ax.bar([x - 0.2 for x in xs], fla, width=0.4, label="fla 0.6.0")
    ax.bar([x + 0.2 for x in xs], ours, width=0.4, label="ours (cute where built, else the chain)")
    ax.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("median ms")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--gpu", default="NVIDIA H200")
    a = ap.parse_args()
    rows, meta = load(a.run)
    out = a.out or Path("bench/results") / a.run.stem
    out.parent.mkdir(parents=True, exist_ok=True)
    md = table(rows, meta, a.gpu)
    out.with_suffix(".md").write_text(md)
    chart(rows, out.with_suffix(".png"), f"KDA per stage, {a.gpu}, {meta['datetime']}")
    print(md)


if __name__ == "__main__":
    main()
