"""GPU check and timing of the three sm_90 scans (kda_cute.b1 / fwd / dhu) against fla 0.6.0.

Correctness, per shape: every output of ours and of fla against the float64 reference
(`kda_cute.reference.fwd_h / fwd_scan / bwd_dhu` on float64 copies), side by side; ours must be
within 2x fla's error (plus a tiny floor). Fresh outputs are NaN-poisoned before each launch and
must come back finite; two runs must be bitwise identical. Inputs are realistic: kg, w, u, Aqk
and qg (ours fwd and dhu read it) come from fla's own intra (disable_recompute: the store of qg the
chain asks for) on l2-normed q, k and negative gates. fla's fwd_o and the float64 reference read q.
Timing: CUDA events, warm, median, each sample INNER calls back to back (host launch work
overlaps the GPU as in a training step; cuda_clock.median_ms; one call per sample until
2026-12-01 added ~0.05-0.1 ms of host time to both sides): ours vs fla's fwd_h, fwd_h + fwd_o,
bwd_dAv + bwd_dhu (dhu computes bwd_dAv's dv = tril(Aqk)^T do itself) at B16 T8192 H16 K128 V256
and a small shape. The table is printed last.

    python bench/check_scans.py [--quick] [--no-time] [--no-check] [--no-wg2] [--stage b1|fwd|dhu]

bench/gpu_suite.sh runs one process per stage: a scan that hangs on the GPU (a lost mbarrier
phase) then costs only its own step's time limit, and the other two still report.
"""

import argparse
import faulthandler
import sys
import time

import kda_cute.b1 as b1
import kda_cute.dhu as dhu
import kda_cute.fwd as fwd
import torch
from cuda_clock import median_ms  # bench/ (this script's directory)
from kda_chain.testing import fla_dhu, scan_inputs  # fla_dhu: fla's bwd_dAv + bwd_dhu, what dhu replaces
from kda_cute import reference as ref
from kda_cute.reference import rel_err
from poison import poisoned_outputs  # bench/

INNER = 3  # calls per timing sample
MODS = (b1, fwd, dhu)
ONLY: set = {"b1", "fwd", "dhu"}  # --stage narrows it
_T0 = time.perf_counter()


def say(msg):
    """Timestamped progress: on a hang, the last line and the stack dump say where."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


make_inputs = scan_inputs  # kda_chain.testing; ab_stage, check_launch, ncu_profile call it by this name


# ------------------------------------------------------------------------------------- the calls
# `mod`: the kernel module to call (bench/ab_stage.py passes a candidate package's copy)
def ours_b1(d, var=None, mod=b1):
    kw = {} if var is None else {"stages": var[0], "warpgroups": var[1]}
    return mod.fwd_h(d["kg"], d["w"], d["u"], d["gk"], d["h0"], True, **kw)


def fla_b1(d):
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

    return chunk_gated_delta_rule_fwd_h(
        k=d["kg"], w=d["w"], u=d["u"], gk=d["gk"], initial_state=d["h0"], output_final_state=True
    )


def ours_fwd(d, var=None, mod=fwd):
    kw = {} if var is None else {"stages": var[0], "warpgroups": var[1]}
    return mod.fwd_scan(
        d["q"], d["qg"], d["kg"], d["w"], d["u"], d["gk"], d["Aqk"], d["h0"], True, d["scale"], **kw
    )


def fla_fwd(d):
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk

    h, v_new, ht = fla_b1(d)
    o = chunk_gla_fwd_o_gk(q=d["q"], v=v_new, g=d["gk"], A=d["Aqk"], h=h, scale=d["scale"])
    return o, ht


def ours_dhu(d, var=None, mod=dhu):
    kw = {} if var is None else {"stages": var[0], "warpgroups": var[1]}
    return mod.bwd_dhu(
        d["qg"], d["kg"], d["w"], d["gk"], d["h0"], d["dht"], d["do"], None, d["scale"], d["Aqk"], **kw
    )


def poisoned(fn, *a, **kw):
    with poisoned_outputs(*MODS):
        return fn(*a, **kw)


def _sub(d, nb):
    return {k: (v[:nb].double() if torch.is_tensor(v) else v) for k, v in d.items()}


def _cmp(label, ours_t, fla_t, ref_t, nb):
    if ref_t is None:
        return True, f"{label} -"
    eo, ef = rel_err(ours_t[:nb], ref_t), rel_err(fla_t[:nb], ref_t)
    good = eo <= 2 * ef + 1e-6 and bool(torch.isfinite(ours_t).all())
    return good, f"{label} {eo:.2e}/{ef:.2e}{'' if good else ' FAIL'}"


def _stages(only):
    """The stages to run: --stage's choice, narrowed to `only` when given."""
    return ONLY if only is None else ONLY & only


def check_shape(name, B, T, H, HV, V, dtype, h0, ref_batches=None, var=None, only=None):
    say(f"{name}: inputs (fla intra)")
    d = make_inputs(B, T, H, HV, V, dtype, h0=h0)
    torch.cuda.synchronize()
    nb = B if ref_batches is None else ref_batches
    d64 = _sub(d, nb)
    ok_all = True
    for stage, o_fn, f_fn, r_fn, labels in (
        (
            "b1",
            ours_b1,
            fla_b1,
            lambda: ref.fwd_h(d64["kg"], d64["w"], d64["u"], d64["gk"], d64["h0"], True),
            ("h", "v_new", "ht"),
        ),
        (
            "fwd",
            ours_fwd,
            fla_fwd,
            lambda: ref.fwd_scan(  # the oracle gates q itself (qg None)
                d64["q"], None, d64["kg"], d64["w"], d64["u"], d64["gk"], d64["Aqk"], d64["h0"], True,
                d["scale"],
            ),
            ("o", "ht"),
        ),
        (
            "dhu",
            ours_dhu,
            fla_dhu,
            lambda: ref.bwd_dhu(
                d64["qg"],
                d64["kg"],
                d64["w"],
                d64["gk"],
                d64["h0"],
                d64["dht"],
                d64["do"],
                None,
                d["scale"],
                d64["Aqk"],
            ),
            ("dh", "dh0", "dv2"),
        ),
    ):
        if stage not in _stages(only):
            continue
        try:
            say(f"{stage} {name}: ours (compile + launch)")
            o = poisoned(o_fn, d, var)
            torch.cuda.synchronize()
            say(f"{stage} {name}: ours synced; repeat, fla, float64")
            o2 = o_fn(d, var)
            f = f_fn(d)
            torch.cuda.synchronize()
            r = r_fn()
            ok, cells = True, []
            for i, lab in enumerate(labels):
                if o[i] is None or f[i] is None:
                    same_none = (o[i] is None) == (f[i] is None)
                    ok &= same_none
                    cells.append(f"{lab} none{'' if same_none else ' FAIL'}")
                    continue
                g, c = _cmp(lab, o[i], f[i], r[i], nb)
                ok &= g
                cells.append(c)
            det = all((a is None and b is None) or torch.equal(a, b) for a, b in zip(o, o2, strict=True))
            ok &= det
            cells.append("det ok" if det else "det FAIL")
            vs = "" if var is None else f" S{var[0]}xWG{var[1]}"
            print(
                f"{'PASS' if ok else 'FAIL'} {stage:<4}{vs} {name:<36} (ours/fla rel err vs f64) "
                + " | ".join(cells),
                flush=True,
            )
            del o, o2, f, r
        except Exception as e:  # one call must tell everything
            ok = False
            print(f"ERROR {stage} {name}: {type(e).__name__}: {e}", flush=True)
        ok_all &= ok
    torch.cuda.empty_cache()
    return ok_all


def time_shape(B, T, H, HV, V, variants, dtype=torch.bfloat16, only=None):
    """Median ms of fla and of each variant (stages, warpgroups) of ours; rows printed as they come."""
    d = make_inputs(B, T, H, HV, V, dtype, h0=False)
    rows = []
    for stage, o_fn, f_fn in (
        ("b1", ours_b1, fla_b1),
        ("fwd", ours_fwd, fla_fwd),
        ("dhu", ours_dhu, fla_dhu),
    ):
        if stage not in _stages(only):
            continue
        try:
            tf = median_ms(lambda f_fn=f_fn: f_fn(d), inner=INNER)
            ts = {v: median_ms(lambda v=v, o_fn=o_fn: o_fn(d, v), inner=INNER) for v in variants}
            row = (f"B{B} T{T} H{H} HV{HV} V{V}", stage, B * HV * (V // 64), tf, ts)
            rows.append(row)
            print("timing", row, flush=True)
        except Exception as e:
            print(f"ERROR timing {stage} B{B} T{T}: {type(e).__name__}: {e}", flush=True)
    torch.cuda.empty_cache()
    return rows


def tune_fla_at_ref():
    """Call fla's scans once at the reference shape, with and without a state, before anything
    else: its autotune key has no B or T, so the first call of a process (here the T = 64 check)
    would pick the configs the reference-shape timing then runs with (2026-12-01: fla's fwd_h
    2.60 ms in such a timing, 1.84 when tuned at the reference shape)."""
    for h0 in (True, False):
        d = make_inputs(16, 8192, 16, 16, 256, h0=h0)
        for stage, f_fn in (("b1", fla_b1), ("fwd", fla_fwd), ("dhu", fla_dhu)):
            if stage in _stages(None):
                f_fn(d)
        del d
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def print_table(rows, variants):
    print()
    hdr = " | ".join(f"ours S{v[0]}xWG{v[1]} ms" for v in variants)
    print(f"| shape | stage | CTAs(64-wide V tiles) | fla ms | {hdr} | fla / best ours |")
    print("|---|---|---|---|" + "---|" * len(variants) + "---|")
    for shape, stage, ctas, tf, ts in rows:
        best = min(ts.values())
        cells = " | ".join(f"{ts[v]:.3f}" for v in variants)
        print(f"| {shape} | {stage} | {ctas} | {tf:.3f} | {cells} | {tf / best:.2f}x |", flush=True)


SHAPES = [
    ("B2 T256 H16 V128 bf16 h0/dht", 2, 256, 16, 16, 128, torch.bfloat16, True),
    ("B1 T64 H16 V256 bf16 (T=64) no h0", 1, 64, 16, 16, 256, torch.bfloat16, False),
    ("B2 T200 H8 HV16 V128 bf16 GVA tail h0", 2, 200, 8, 16, 128, torch.bfloat16, True),
    ("B2 T256 H16 V128 fp16 h0/dht", 2, 256, 16, 16, 128, torch.float16, True),
]
REF = ("B16 T8192 H16 V256 bf16 (ref b0)", 16, 8192, 16, 16, 256, torch.bfloat16, True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--quick", action="store_true", help="no reference-shape correctness, no 2-warpgroup phase"
    )
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-wg2", action="store_true", help="skip the 2-warpgroup variants")
    ap.add_argument("--stage", choices=sorted(ONLY), action="append", help="only this stage (repeatable)")
    ap.add_argument("--stack-every", type=float, default=45.0, help="dump Python stacks every S s (hangs)")
    a = ap.parse_args()
    faulthandler.dump_traceback_later(a.stack_every, repeat=True, file=sys.stdout)
    if a.stage:
        ONLY.intersection_update(a.stage)
    dhu.GRID_FLOOR = 0  # time and check the kernel itself at every grid (the chain's floor aside)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    ok = True
    if not a.no_time:
        tune_fla_at_ref()
    # phase 1: correctness of the default build per grid (`variant()`: at the reference shape fwd
    # and b1 run two warpgroups), then timing of the one-warpgroup builds
    if not a.no_check:
        shapes = SHAPES + ([] if a.quick else [REF])
        for name, B, T, H, HV, V, dt, h0 in shapes:
            ok &= check_shape(name, B, T, H, HV, V, dt, h0, ref_batches=1 if B >= 16 else None)
        print("ALL PASS (default variant)" if ok else "SOME FAIL (default variant)", flush=True)
    v1 = [(2, 1), (1, 1)]
    rows1 = []
    if not a.no_time:
        # the last: 32 V tiles (attn-gym's small peer shape), where no floor has been measured yet
        for B, T, H, HV, V in ((16, 8192, 16, 16, 256), (2, 4096, 16, 16, 256), (1, 4096, 16, 16, 128)):
            rows1 += time_shape(B, T, H, HV, V, v1)
        print_table(rows1, v1)
    # phase 2: two warpgroups per CTA (two V tiles sharing the operand tiles); after phase 1 so a
    # failure here cannot hide phase 1's results
    if a.quick or a.no_wg2:
        return
    ok2 = True
    if not a.no_check:
        for name, B, T, H, HV, V, dt, h0 in SHAPES:  # fp16 too: the wide builds run fp16 at large grids
            for var in ((2, 2), (1, 2)):
                ok2 &= check_shape(name, B, T, H, HV, V, dt, h0, var=var)
            # b1's three-stage build (it fits only b1's smem: 194 KB)
            ok2 &= check_shape(name, B, T, H, HV, V, dt, h0, var=(3, 2), only={"b1"})
        print("ALL PASS (2 warpgroups)" if ok2 else "SOME FAIL (2 warpgroups)", flush=True)
    if not a.no_time:
        v2 = [(2, 2), (1, 2)]
        rows2 = time_shape(16, 8192, 16, 16, 256, v2) + time_shape(2, 4096, 16, 16, 256, v2)
        v3 = [(3, 2)]
        rows3 = time_shape(16, 8192, 16, 16, 256, v3, only={"b1"}) + time_shape(
            2, 4096, 16, 16, 256, v3, only={"b1"})
        print_table(rows1, v1)
        print_table(rows2, v2)
        print_table(rows3, v3)


if __name__ == "__main__":
    main()
