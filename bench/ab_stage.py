"""A/B timing of one CuTe stage: this checkout's kda_cute against candidate copies of the package
(other branches, exported to directories), and fla, in one process on one GPU.

A candidate is loaded as its own package (`kda_cute_alt0`, ...; the modules import each other
relatively), so main and candidates share the inputs, the clocks and the GPU's state. Rounds are
interleaved (main, alt0, .., fla, main, ..) and each round is a CUDA-event median, so a drift in
clocks hits every contender alike. Each candidate's outputs are compared with main's (max |diff|
relative to max |main|): a candidate that changes the result by more than rounding is reported.

    python bench/ab_stage.py --stage b1 --alt alt/b1_next/packages/kda-cute/kda_cute [--alt ...]

Export a branch's package first: `mkdir -p alt/X && git archive BRANCH packages/kda-cute/kda_cute
| tar -x -C alt/X` (alt/ is untracked scratch: delete it afterwards).
"""

import argparse
import importlib
import importlib.util
import pathlib
import statistics
import sys

import torch
from cuda_clock import median_ms

# (B, T, H, HV) at K128 V256: ref 1024 V tiles of 64, mid 256, small 128 (under one wave of 132 SMs)
SHAPES = {"ref": (16, 8192, 16, 16), "mid": (4, 4096, 16, 16), "small": (2, 4096, 16, 16)}


def load_alt(path: str, n: int):
    path = pathlib.Path(path).resolve()
    name = f"kda_cute_alt{n}"
    spec = importlib.util.spec_from_file_location(
        name, path / "__init__.py", submodule_search_locations=[str(path)]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return name


def make_inputs(stage: str, shape: str, h0: bool = True):
    """(the stage's inputs, fla's call on them)."""
    B, T, H, HV = SHAPES[shape]
    if stage == "intra":
        import check_intra as ci

        args = ci.make_inputs(B, T, H, HV, 128)
        return args, lambda: ci.fla_intra(args, fold=True)
    import check_scans as cs

    d = cs.make_inputs(B, T, H, HV, 256, h0=h0)
    return d, {"b1": lambda: cs.fla_b1(d), "dhu": lambda: cs.fla_dhu(d), "fwd": lambda: cs.fla_fwd(d)}[stage]


def stage_fns(stage: str, pkg: str, args, tag: str, variants=()):
    """{label: call} of one package's kernel on these inputs (check_intra / check_scans' calls);
    scans: also each (stages, warpgroups) variant, labelled `tag:stage@SxWG`."""
    mod = importlib.import_module(f"{pkg}.{stage}")
    if stage == "intra":
        return {f"{tag}:fold": lambda: mod.bwd_intra(*args, fold_dg=True),
                f"{tag}:fold+bf16": lambda: mod.bwd_intra(*args, fold_dg=True, emit_bf16=True)}
    import check_scans as cs

    call = {"b1": cs.ours_b1, "dhu": cs.ours_dhu, "fwd": cs.ours_fwd}[stage]
    fns = {f"{tag}:{stage}": lambda: call(args, mod=mod)}
    for v in variants:
        fns[f"{tag}:{stage}@S{v[0]}xWG{v[1]}"] = lambda v=v: call(args, var=v, mod=mod)
    return fns


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)] if isinstance(out, (tuple, list)) else []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", choices=("intra", "b1", "dhu", "fwd"), required=True)
    ap.add_argument("--alt", action="append", default=[], help="a candidate kda_cute package directory")
    ap.add_argument("--shape", choices=sorted(SHAPES), action="append")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-h0", action="store_true", help="scans: no initial / final state")
    ap.add_argument("--inner", type=int, default=1, help="calls back to back per sample (cuda_clock)")
    ap.add_argument("--primed", action="store_true",
                    help="device time only: a sleep kernel before each sample (cuda_clock)")
    ap.add_argument("--var", action="append", default=[], metavar="S,W",
                    help="scans: also time each package's (stages, warpgroups) variant S,W (repeatable)")
    a = ap.parse_args()
    variants = [tuple(int(x) for x in v.split(",")) for v in a.var]
    pkgs = {"main": "kda_cute"}
    for i, p in enumerate(a.alt):
        pkgs[f"alt{i}"] = load_alt(p, i)
        print(f"alt{i} = {p}")
    # the reference shape first: fla's autotune key has no B or T, so its first call in a process
    # picks the configs every later shape of the same key runs with (2026-12-01: fla's fwd_h took
    # 2.43 ms at the reference shape after a small-shape first call, 1.84-1.92 otherwise)
    for shape in sorted(a.shape or ["ref"], key=lambda s: s != "ref"):
        args, fla = make_inputs(a.stage, shape, h0=not a.no_h0)
        fns = {}
        for tag, pkg in pkgs.items():
            fns.update(stage_fns(a.stage, pkg, args, tag, variants))
        fns["fla"] = fla
        # equality of each candidate's outputs with main's
        ref_out = {k.split(":", 1)[1]: _flat(f()) for k, f in fns.items()
                   if k.startswith("main:") and "@" not in k}
        for k, f in list(fns.items()):
            if (k.startswith("main:") and "@" not in k) or k == "fla":
                continue
            try:  # a variant a candidate cannot build (smem over the limit) drops out, not the run
                out = _flat(f())
            except Exception as e:  # noqa: BLE001
                print(f"{shape} {k}: dropped: {str(e).strip().splitlines()[0][:160]}")
                del fns[k]
                continue
            base = ref_out[k.split(":", 1)[1].split("@")[0]]
            rel = max(((o.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30)).item()
                      for o, r in zip(out, base, strict=True))
            print(f"{shape} {k}: max rel diff vs main {rel:.3e}{'  <-- CHANGED' if rel > 1e-3 else ''}")
        times = {k: [] for k in fns}
        for _ in range(a.rounds):
            for k, f in fns.items():
                times[k].append(median_ms(f, warmup=3, reps=a.reps, inner=a.inner, primed=a.primed))
        fla_ms = statistics.median(times["fla"])
        print(f"\n{a.stage} {shape} B,T,H,HV={SHAPES[shape]}: median of {a.rounds} rounds"
              f" x {a.reps} samples of {a.inner} calls{', primed' if a.primed else ''} (ms)")
        for k, ts in times.items():
            m = statistics.median(ts)
            print(f"  {k:<24} {m:8.3f}  (rounds {min(ts):.3f}..{max(ts):.3f})  fla/this {fla_ms / m:5.2f}x")
        del fns, args, fla
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
