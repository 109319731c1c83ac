"""Launch each CuTe kernel once at the reference shape, for Nsight Compute (hardware counters).

    ncu --clock-control none -k regex:kda_cute --set full -o $OUT/prof python bench/ncu_profile.py
    ncu -i $OUT/prof.ncu-rep --page details > $OUT/ncu_details.txt

Every kernel is launched exactly once (its first launch includes the compile on the host, which
ncu does not count), so each ncu result is one kernel. `--stage` picks a subset; `--fla` also
launches fla's kernels for the same stages (filter them in with ncu's -k); `--no-h0` drops the
scans' initial and final state. `--stage chain` is one fwd+bwd of the chain (gate + l2norm in
the op), which launches every CuTe kernel once, kda_cute_prep and kda_cute_wy_dqkg included (with
`--fla`, fla's fwd_prep (gate cumsum + fwd_intra) and wy_dqkg then run once on that call's captured
arguments).
`bash bench/gpu_suite.sh ncu` runs it under ncu (NCU_STAGE, NCU_K: e.g. chain, kda_cute_prep).
"""

import argparse

import check_intra as ci
import check_scans as cs
import check_stage as cst
import torch

B, T, H, HV = 16, 8192, 16, 16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", action="append", choices=("intra", "intra_bf16", "b1", "dhu", "fwd", "chain"))
    ap.add_argument("--fla", action="store_true")
    ap.add_argument("--no-h0", action="store_true", help="scans: no initial / final state")
    a = ap.parse_args()
    stages = a.stage or ["intra", "intra_bf16", "b1", "dhu", "fwd"]
    if any(s.startswith("intra") for s in stages):
        args = ci.make_inputs(B, T, H, HV, 128)
        if "intra" in stages:
            ci.ours(args, fold=True)
        if "intra_bf16" in stages:
            ci.ours(args, fold=True, emit=True)
        if a.fla:
            ci.fla_intra(args, fold=True)
        del args
        torch.cuda.synchronize()
    if any(s in stages for s in ("b1", "dhu", "fwd")):
        d = cs.make_inputs(B, T, H, HV, 256, h0=not a.no_h0)
        for st in ("b1", "dhu", "fwd"):
            if st in stages:
                getattr(cs, f"ours_{st}")(d)
                if a.fla and st != "fwd":
                    getattr(cs, f"fla_{st}")(d)
    if "chain" in stages:
        calls = cst.chain_calls(B, T, H, HV, 256)  # every CuTe kernel once
        if a.fla:
            for st in ("fwd_prep", "bwd_wy_dqkg"):
                cst.ours_fla(st, calls)[1]()
        del calls
    torch.cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
