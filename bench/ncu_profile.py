"""Launch each CuTe kernel once at the reference shape, for Nsight Compute (hardware counters).

    ncu --clock-control none -k regex:kda_cute --set full -o $OUT/prof python bench/ncu_profile.py
    ncu -i $OUT/prof.ncu-rep --page details > $OUT/ncu_details.txt

Every kernel is launched exactly once (its first launch includes the compile on the host, which
ncu does not count), so each ncu result is one kernel. `--stage` picks a subset; `--fla` also
launches fla's kernels for the same stages (filter them in with ncu's -k).
"""

import argparse

import check_intra as ci
import check_scans as cs
import torch
from kda_cute import b1, dhu, fwd, intra

B, T, H, HV = 16, 8192, 16, 16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", action="append", choices=("intra", "intra_bf16", "b1", "dhu", "fwd"))
    ap.add_argument("--fla", action="store_true")
    a = ap.parse_args()
    stages = a.stage or ["intra", "intra_bf16", "b1", "dhu", "fwd"]
    if any(s.startswith("intra") for s in stages):
        args = ci.make_inputs(B, T, H, HV, 128)
        if "intra" in stages:
            intra.bwd_intra(*args, fold_dg=True)
        if "intra_bf16" in stages:
            intra.bwd_intra(*args, fold_dg=True, emit_bf16=True)
        if a.fla:
            ci.fla_intra(args, fold=True)
        del args
        torch.cuda.synchronize()
    if any(s in stages for s in ("b1", "dhu", "fwd")):
        d = cs.make_inputs(B, T, H, HV, 256)
        if "b1" in stages:
            b1.fwd_h(d["kg"], d["w"], d["u"], d["gk"], d["h0"], True)
            if a.fla:
                cs.fla_b1(d)
        if "dhu" in stages:
            dhu.bwd_dhu(d["qg"], d["kg"], d["w"], d["gk"], d["h0"], d["dht"], d["do"], d["dv"], d["scale"])
            if a.fla:
                cs.fla_dhu(d)
        if "fwd" in stages:
            fwd.fwd_scan(d["q"], d["qg"], d["kg"], d["w"], d["u"], d["gk"], d["Aqk"], d["h0"], True,
                         d["scale"])
    torch.cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
