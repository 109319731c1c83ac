"""GPU check and timing of one chunk-parallel CuTe stage against fla 0.6.0's, on the real
arguments of a chain call:

    bwd_wy_dqkg   kda_cute.wy_dqkg (kernel kda_cute_wy_dqkg) vs chunk_kda_bwd_wy_dqkg_fused
    fwd_prep      kda_cute.prep (kernel kda_cute_prep) vs kda_gate_chunk_cumsum + chunk_kda_fwd_intra
                  (with the chain's l2norm=True: fla's l2norm_fwd of the raw q, k first, and the
                  normalized q, k and their rstds checked too)
    bwd_prep      kda_cute.bwd_prep (kernel kda_cute_bwd_prep) vs kda_gate_chunk_cumsum + recompute_w_u
    bwd_chunk     kda_cute.bwd_chunk (kernel kda_cute_bwd_chunk) vs wy_dqkg + bwd_dAv + bwd_intra +
                  the dg cumsum (+ l2norm_bwd, + kda_gate_bwd), with the chain's flags and arguments
                  (emit_bf16, the rstds where HV == H, the raw gate, A_log, dt_bias, lower_bound);
                  timed also against our previous path (wy_dqkg, intra, l2norm_bwd, fla's gate_bwd);
                  dA_log / ddt_bias (sums over the batch) checked on a batch-0 call of their own

Per shape: one fwd+bwd of kda_chain.chunk_kda (gate + l2norm in the op; A_log up to log 16, so
gates reach ~-10 per step) runs under `kda_chain.stages.capture()`; the stage's arguments are
replayed through ours and fla's, our outputs poisoned with NaN first; every output is compared
with the float64 reference (`kda_cute.reference` on float64 copies, batch 0): ours must be
within 2x fla's relative error (+1e-6), and bitwise equal on a second call. fla leaves Aqk's
upper triangle unwritten (its consumers mask it): Aqk is compared on and below the diagonal.
Timing: CUDA events, median (bench/cuda_clock), ours and fla in one run.

    python bench/check_stage.py --stage fwd_prep [bwd_prep ...] [--no-time] [--quick] [--alt DIR ...]

`--alt DIR` (a copy of the package from another commit: `git archive C packages/kda-cute/kda_cute
| tar -x -C alt/C`) times that copy's module on the same arguments in the same run, ours first and
again after it, so an A/B of two builds reads from one process.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from cuda_clock import median_ms
from poison import poisoned_outputs


def stage_args(calls, stage) -> tuple:
    """The stage's captured arguments; bwd_wy_dqkg takes bwd_chunk's (the same contract arguments:
    with the fused kernel the chain no longer calls bwd_wy_dqkg itself)."""
    if stage == "bwd_wy_dqkg" and stage not in calls:
        return calls["bwd_chunk"]
    return calls[stage]


def stage_kwargs(calls, stage) -> dict:
    """The captured keyword arguments that are the contract's (not the CuTe-only flags), e.g.
    bwd_chunk's q_rstd / k_rstd with the L2 norm in the op."""
    kw = calls.get((stage, "kw"), {})
    return {k: v for k, v in kw.items() if isinstance(v, torch.Tensor) or k == "lower_bound"}


_PER_HEAD = ("dA_log", "ddt_bias")  # sums over the batch: checked on a batch-0 call of their own


def _batch0(calls, stage) -> dict:
    """`calls` with the stage's [B, ...] tensors (3-D and up) cut to batch 0 (contiguous views)."""
    def cut(a):
        return a[:1] if isinstance(a, torch.Tensor) and a.dim() >= 3 else a

    kw = calls.get((stage, "kw"), {})
    return {**calls, stage: tuple(cut(a) for a in stage_args(calls, stage)),
            (stage, "kw"): {k: cut(v) for k, v in kw.items()}}


def cute_flags(calls, stage) -> dict:
    """The CuTe-only flags as the chain passed them (captured), else the check's own."""
    kw = calls.get((stage, "kw"), {})
    return {k: kw.get(k, v) for k, v in CHECKS[stage].flags}


def _fla_dAqk(calls) -> tuple:
    """The dAqk fla's bwd_dAv computes for the intra stage, on a chain call's captured arguments
    (wy_dqkg's, and fwd's Aqk): what kda_cute_wy_dqkg's want_dAqk output replaces."""
    from kda_chain import stages as S

    q, k, _, v_new, _, _, _, _, do, _, _, scale = stage_args(calls, "bwd_wy_dqkg")
    return (S._fla_bwd_dAv(q, k, v_new, do, calls["fwd"][6], scale)[0],)


def _fla_fwd_prep(*args, l2norm=False) -> tuple:
    """fla's kernels for fwd_prep's contract; with l2norm (the chain's raw q, k) its l2norm_fwd of
    both first, the normalized q, k and their rstds returned after the seven."""
    from kda_chain import stages as S

    return S._fla_fwd_prep(*args, l2norm=l2norm)


def _fla_bwd_chunk(*args, emit_bf16=False, **kw) -> tuple:
    """fla's kernels for bwd_chunk's contract (its l2norm_bwd too with the rstds), dq / dk rounded
    to q's dtype where ours emits them in it."""
    from kda_chain import stages as S

    dq, dk, dv2, db, dg, dA_log, ddt_bias = S._fla_bwd_chunk(*args, **kw)
    if emit_bf16:
        dq, dk = dq.to(args[0].dtype), dk.to(args[0].dtype)
    return dq, dk, dv2, db, dg, dA_log, ddt_bias


def _split_bwd_chunk(*args, emit_bf16=False, q_rstd=None, k_rstd=None, g=None, A_log=None, dt_bias=None,
                     lower_bound=None) -> tuple:
    """Our previous path for bwd_chunk's contract: kda_cute_wy_dqkg, kda_cute_intra, with the
    rstds kda_cute_l2norm_bwd twice, with A_log fla's kda_gate_bwd."""
    from kda_chain import stages as S
    from kda_cute import intra, l2norm_bwd, wy_dqkg

    q, k, _, _, gk, beta = args[:6]
    dq, dk, dv2, db, dg, dAkk, dAqk = wy_dqkg.bwd_wy_dqkg(*args, want_dAqk=True)
    dq, dk, db, dg = intra.bwd_intra(q, k, gk, beta, dAqk, dAkk, dq, dk, db, dg, fold_dg=True,
                                     emit_bf16=emit_bf16 or q_rstd is not None)
    if q_rstd is not None:
        dq, dk = l2norm_bwd.l2norm_bwd(q, q_rstd, dq), l2norm_bwd.l2norm_bwd(k, k_rstd, dk)
    dA_log = ddt_bias = None
    if A_log is not None:
        dg, dA_log, ddt_bias = S._fla_gate_bwd(g, A_log, dt_bias, dg, lower_bound)
    return dq, dk, dv2, db, dg, dA_log, ddt_bias


@dataclass(frozen=True)
class StageCheck:
    module: str  # kda_cute.<module>
    contract: str  # the function in that module and in kda_cute.reference
    fla: str | Callable  # its fla adapter in kda_chain.stages (by name), or a function of (args,
    # the chain's flags and keyword tensors)
    names: tuple[str, ...]
    flags: tuple[tuple[str, object], ...] = ()  # the keyword flags the chain passes the CuTe kernel
    fla_extra: Callable | None = None  # calls -> the outputs those flags add, as fla computes them
    ours_before: Callable | None = None  # the stage's previous CuTe path, timed beside it


CHECKS = {
    # with want_dAqk, as the chain calls it: fla's side is its wy_dqkg + its bwd_dAv's dAqk
    "bwd_wy_dqkg": StageCheck("wy_dqkg", "bwd_wy_dqkg", "_fla_bwd_wy_dqkg",
                              ("dq", "dk", "dv2", "db", "dg", "dAkk", "dAqk"), (("want_dAqk", True),),
                              _fla_dAqk),
    # l2norm as the chain passed it (captured): the last four outputs only with it
    "fwd_prep": StageCheck("prep", "fwd_prep", _fla_fwd_prep,
                           ("gk", "w", "u", "qg", "kg", "Aqk", "Akk", "q_n", "k_n", "q_rstd", "k_rstd"),
                           (("l2norm", False),)),
    "bwd_prep": StageCheck("bwd_prep", "bwd_prep", "_fla_bwd_prep", ("gk", "w", "u", "qg", "kg")),
    "bwd_chunk": StageCheck("bwd_chunk", "bwd_chunk", _fla_bwd_chunk,
                            ("dq", "dk", "dv2", "db", "dg", "dA_log", "ddt_bias"), (("emit_bf16", True),),
                            ours_before=_split_bwd_chunk),
}


def chain_calls(B, T, H, HV, V, dtype=torch.bfloat16, seed=0, gate="softplus") -> dict[str, tuple]:
    """One fwd+bwd of the chain (every CuTe kernel launched once): each stage's arguments. gate:
    "softplus" (the gate in the op, fla's default form, with a dt_bias), "lower_bound" (the gate in
    the op with lower_bound=-5), "none" (an fp32 per-step log gate, cuDNN's input)."""
    from kda_chain import chunk_kda
    from kda_chain.stages import capture

    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s, dt=dtype, scale=1.0):
        return (torch.randn(s, generator=g, device="cuda") * scale).to(dt).requires_grad_(True)

    q, k, v, raw, beta = r(B, T, H, 128), r(B, T, H, 128), r(B, T, HV, V), r(B, T, HV, 128), r(B, T, HV)
    A_log = torch.log(torch.linspace(1.0, 16.0, HV, device="cuda"))
    kw = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=r(HV * 128, dt=torch.float32, scale=0.1))
    if gate == "lower_bound":
        kw["lower_bound"] = -5.0
    if gate == "none":  # a negative log gate, -softplus(x) / 4 (fp32)
        raw = (-torch.nn.functional.softplus(raw.detach().float()) / 4).requires_grad_(True)
        kw = {}
    with capture() as calls:
        o, _ = chunk_kda(q, k, v, raw, beta.sigmoid(), use_qk_l2norm_in_kernel=True, **kw)
        o.backward(torch.randn_like(o))
    torch.cuda.synchronize()
    out: dict = {name: a for name, a, _ in calls}
    out.update({(name, "kw"): kw for name, _, kw in calls})  # keyword arguments (tensors among them)
    return out


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _lower(x):
    """x [B, T, HV, 64] with each chunk's entries above the diagonal zeroed."""
    B, T, HV, BT = x.shape
    row = torch.arange(T, device=x.device) % BT
    keep = (torch.arange(BT, device=x.device)[None, :] <= row[:, None])[None, :, None, :]
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))  # NaN there too


def ours_fla(stage, calls):
    """(ours, fla's, ours' module) on the stage's captured arguments (`calls`: chain_calls')."""
    c = CHECKS[stage]
    args = stage_args(calls, stage)
    mod = importlib.import_module(f"kda_cute.{c.module}")
    from kda_chain import stages as S

    kw, flags = stage_kwargs(calls, stage), cute_flags(calls, stage)

    def fla():
        if isinstance(c.fla, str):
            out = getattr(S, c.fla)(*args, **kw)
        else:
            out = c.fla(*args, **flags, **kw)
        return out if c.fla_extra is None else (*out, *c.fla_extra(calls))

    return (lambda: getattr(mod, c.contract)(*args, **flags, **kw)), fla, mod


def check(stage, name, calls) -> bool:
    from kda_cute import reference as ref

    c = CHECKS[stage]
    args = stage_args(calls, stage)
    run_ours, run_fla, mod = ours_fla(stage, calls)
    with poisoned_outputs(mod):
        ours = run_ours()
    fla = run_fla()
    # batch 0 of the [B, T, ...] tensors (A_log, dt_bias are per head: whole)
    def first(a):
        return (a[:1] if a.dim() >= 3 else a).double() if isinstance(a, torch.Tensor) else a

    b0 = [first(a) for a in args]
    kw0 = {k: first(v) for k, v in stage_kwargs(calls, stage).items()}
    want = getattr(ref, c.contract)(*b0, **cute_flags(calls, stage), **kw0)
    ok = True
    cells = []
    ran0 = None  # (ours, fla's) on batch 0, for the per-head sums
    for n, o, f, w in zip(c.names[:len(want)], ours, fla, want, strict=True):  # (fwd_prep: 7 or 11)
        if o is None or f is None:
            if (o is None) != (f is None):
                ok = False
                cells.append(f"{n} {'missing' if o is None else 'extra'} FAIL")
            continue
        finite = bool(torch.isfinite(o).all())  # every batch: the poison must be overwritten
        if n in _PER_HEAD and args[0].shape[0] > 1:  # a sum over the batch: ours / fla's on batch 0 alone
            if ran0 is None:
                r0, f0, _ = ours_fla(stage, _batch0(calls, stage))
                ran0 = (r0(), f0())
            o, f = ran0[0][c.names.index(n)], ran0[1][c.names.index(n)]
        elif n not in _PER_HEAD:
            o, f = o[:1], f[:1]
        if n == "Aqk":
            f = _lower(f)
        eo, ef = rel(o, w), rel(f, w)
        good = finite and eo <= 2 * ef + 1e-6
        ok &= good
        cells.append(f"{n} {eo:.2e}/{ef:.2e}{'' if good else ' FAIL'}")
    print(f"{'PASS' if ok else 'FAIL'} {name}: ours/fla rel err vs float64: " + ", ".join(cells), flush=True)
    again = run_ours()
    same = all(a is None or torch.equal(a, b) for a, b in zip(ours, again, strict=True))
    print(f"  bitwise repeatable: {same}", flush=True)
    return ok and same


def timing(stage, name, calls, alts=()):
    run_ours, run_fla, _ = ours_fla(stage, calls)
    t_ours = median_ms(run_ours, inner=3)
    args, kw = stage_args(calls, stage), {**cute_flags(calls, stage), **stage_kwargs(calls, stage)}
    for pkg, path in alts:  # the candidates between two timings of ours (the clocks' drift shows)
        alt = getattr(importlib.import_module(f"{pkg}.{CHECKS[stage].module}"), CHECKS[stage].contract)
        t_alt = median_ms(lambda alt=alt: alt(*args, **kw), inner=3)
        t_again = median_ms(run_ours, inner=3)
        print(f"TIME {stage} {name}: ours {t_ours:.3f} / {t_again:.3f} ms, {path} {t_alt:.3f} ms "
              f"({t_alt / min(t_ours, t_again):.3f}x ours)", flush=True)
    if kw.get("gk") is not None:  # bwd_prep given the forward's gk (no gate in the op): vs recomputing it
        mod = importlib.import_module(f"kda_cute.{CHECKS[stage].module}")
        rest = {n: v for n, v in kw.items() if n != "gk"}
        t_re = median_ms(lambda: getattr(mod, CHECKS[stage].contract)(*args, **rest), inner=3)
        print(f"TIME {stage} {name}: ours given gk {t_ours:.3f} ms, recomputing gk {t_re:.3f} ms "
              f"({t_re / t_ours:.3f}x)", flush=True)
    t_fla = median_ms(run_fla, inner=3)
    before = CHECKS[stage].ours_before
    extra = ""
    if before is not None:
        t_b = median_ms(lambda: before(*args, **kw), inner=3)
        extra = f", ours before {t_b:.3f} ms ({t_b / t_ours:.2f}x)"
    print(
        f"TIME {stage} {name}: ours {t_ours:.3f} ms, fla {t_fla:.3f} ms, fla/ours {t_fla / t_ours:.2f}x"
        + extra,
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", choices=sorted(CHECKS), required=True, nargs="+",
                    help="one or more stages, checked on the same chain calls (one compile of each kernel)")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--alt", action="append", default=[], help="a package copy to time beside ours")
    a = ap.parse_args()
    from ab_stage import load_alt

    alts = [(load_alt(p, i), p) for i, p in enumerate(a.alt)]
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    ok = True
    checks = [
        ("B1 T1024 H16 V256", (1, 1024, 16, 16, 256), "softplus"),
        ("B1 T512 H8 HV16 V128 (GVA, gate with lower_bound)", (1, 512, 8, 16, 128), "lower_bound"),
        ("B2 T64 H16 V128 (T=64, fp32 log gate given)", (2, 64, 16, 16, 128), "none"),
    ]
    for name, shape, gate in checks[:1] if a.quick else checks:
        try:
            calls = chain_calls(*shape, gate=gate)
            for st in a.stage:
                ok &= check(st, name, calls)
        except Exception as e:  # report and go on: one call must tell everything
            ok = False
            print(f"ERROR {name}: {type(e).__name__}: {e}", flush=True)
    if not a.no_time:
        for name, shape in (
            ("B16 T8192 H16 K128 V256 (reference)", (16, 8192, 16, 16, 256)),
            ("B16 T8192 H16 K=V=128 (cuDNN's)", (16, 8192, 16, 16, 128)),
            ("B2 T4096 H16 K=V=128", (2, 4096, 16, 16, 128)),
            ("B16 T8192 H16 K=V=128, fp32 log gate (no gate in the op)", (16, 8192, 16, 16, 128, "none")),
        ):
            try:
                calls = chain_calls(*shape[:5], gate=shape[5] if len(shape) > 5 else "softplus")
                for st in a.stage:
                    if "reference" in name:
                        ok &= check(st, name + " [batch 0 vs float64]", calls)
                    timing(st, name, calls, alts)
                del calls
                torch.cuda.empty_cache()
            except Exception as e:
                ok = False
                print(f"ERROR timing {name}: {type(e).__name__}: {e}", flush=True)
    print("ALL PASS" if ok else "SOME FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
