"""Run the scan kernels (b1, fwd, dhu; this checkout's and candidate packages) on the CPU: their
sm_90a PTX through the PTX interpreter ptxsim (tools/ptxsim, `ptxsim.kda`), against float64, and
the candidates against this checkout bit for bit. No GPU: checks a candidate's logic (indices,
buffers, barrier phases, waits) before a device minute is spent on it; not its speed, not every
race (threads run one at a time until they yield; TMA loads land at issue, TMA stores and wgmma
read their operands at their wait: see ptxsim.hopper).

    python bench/cpu_emulate.py --stage b1 [--alt DIR ...] [--shape B,T,H,HV,V,STAGES,WG ...]
    python bench/cpu_emulate.py --stage fwd --alt alt/fr/packages/kda-cute/kda_cute
    python bench/cpu_emulate.py --stage dhu --alt alt/dhu-rs/packages/kda-cute/kda_cute

This checkout's kernel always runs; each --alt is a candidate package: `mkdir -p alt/x && git
archive HEAD packages/kda-cute/kda_cute | tar -x -C alt/x && patch -p1 -d alt/x < X.patch` (the
candidate's diff). ~10 s per shape and package on one core.
"""

import argparse
import importlib
import os
import sys
import tempfile

import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp(prefix="kda-cute-dsl-"))  # not the checkout

from ab_stage import load_alt  # noqa: E402  (bench/, this script's directory)
from kda_cute import reference as ref  # noqa: E402
from kda_cute.reference import stages as rstages  # noqa: E402
from ptxsim import kda as emu  # noqa: E402

SHAPES = ["1,96,1,1,64,2,1", "1,200,1,2,128,2,2", "2,130,2,2,128,2,1"]


def load(path: str | None, n: int, stage: str):
    pkg = "kda_cute" if path is None else load_alt(path, n)
    return importlib.import_module(f"{pkg}.{stage}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", choices=("b1", "fwd", "dhu"), required=True)
    ap.add_argument("--alt", action="append", default=[])
    ap.add_argument("--shape", action="append", help="B,T,H,HV,V,STAGES,WARPGROUPS")
    a = ap.parse_args()
    pkgs = [None, *a.alt]
    mods = [load(p, i, a.stage) for i, p in enumerate(pkgs)]
    labels = ["main" if p is None else p for p in pkgs]
    ok = True
    for shp in a.shape or SHAPES:
        B, T, H, HV, V, st, wg = (int(x) for x in shp.split(","))
        kg, w, u, gk = emu.scan_inputs(B=B, T=T, H=H, HV=HV, V=V)
        outs = []
        if a.stage == "b1":
            want = rstages.fwd_h(kg.double(), w.double(), u.double(), gk.double(), None, False)[:2]
            for m in mods:
                outs.append(emu.emulate_b1(kg, w, u, gk, st, wg, mod=m))
        elif a.stage == "dhu":  # the reverse scan, on the same kg / w / gk
            _, qg, A = emu.q_and_aqk(B, T, HV, gk)
            qg = qg[:, :, ::HV // H].contiguous() if H != HV else qg
            do = emu.upstream_do(B, T, HV, V, torch.Generator().manual_seed(2))
            r = HV // H  # the reference takes qg / kg at the value heads (head hv reads hv // r)
            qg_v, kg_v = (x.double().repeat_interleave(r, 2) for x in (qg, kg))
            dh, _, dv2 = rstages.bwd_dhu(qg_v, kg_v, w.double(), gk.double(), None, None,
                                         do.double(), None, 0.088, A.double())
            want = (dh, dv2)
            for m in mods:
                outs.append(emu.emulate_dhu(qg, kg, w, gk, do, A, 0.088, st, wg, m))
        else:
            q, qg, A = emu.q_and_aqk(B, T, HV, gk)  # A's upper triangle: garbage the kernel masks
            want = rstages.fwd_scan(q.double(), None, kg.double(), w.double(), u.double(), gk.double(),
                                    A.double(), None, False, 0.088)[:1]
            for m in mods:
                outs.append((emu.emulate_fwd(qg, kg, w, u, gk, A, 0.088, st, wg, m),))
        for lab, out in zip(labels, outs, strict=True):
            errs = [ref.rel_err(x.double(), y) for x, y in zip(out, want, strict=True)]
            fin = all(torch.isfinite(x.float()).all().item() for x in out)
            good = fin and max(errs) < 5e-3
            ok &= good
            shown = ", ".join(f"{e:.2e}" for e in errs)
            print(f"{shp} {lab}: rel err vs float64 [{shown}] finite {fin}"
                  f"{'' if good else '  <-- FAIL'}")
        for lab, out in zip(labels[1:], outs[1:], strict=True):
            same = all(torch.equal(x.view(torch.int16), y.view(torch.int16))
                       for x, y in zip(out, outs[0], strict=True))
            print(f"{shp} {lab}: bitwise equal to {labels[0]}: {same}")
    print("ALL PASS" if ok else "SOME FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
