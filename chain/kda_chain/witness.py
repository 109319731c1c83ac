"""`kda-witness` (also `python -m kda_chain.witness`): one fwd+bwd of our chunk_kda, proven and checked.

The chain's CLI on top of kda_witness (which knows only names: it cannot run the op itself).

At one shape it runs `kda_chain.chunk_kda` (the drop-in for fla 0.6.0's chunk_kda) forward and
backward, then prints
- the per-stage table from a profile of one warm call: stage, impl, kernels, ms, reason;
- fwd+bwd time: median of --reps calls after a warm-up (CUDA events on a GPU, wall clock on CPU),
  and the same for `fla.ops.kda.chunk_kda` when fla can run (CUDA);
- the relative error ||x - ref|| / ||ref|| of o, ht and every gradient against the float64
  reference `kda_cute.reference.chunk_kda_reference` (run on the same device), ours and fla's
  side by side.

`--packed N` makes it a packed call (fla's varlen layout): the B*T tokens on one row of N
sequences of seeded random lengths, `cu_seqlens` (and `cu_seqlens_cpu`) given, states per
sequence; the reference runs per sequence (`chunk_kda_reference_packed`), and --require-cute also
asks that the packed rows were read and written in place (`varlen_io` native).

Accuracy verdict: with fla, ours must be within 2x fla's error (+1e-6), the GPU tests' rule;
without fla, within a per-dtype bound (TOLERANCE). Exit status: 0 fine; 1 --require-cute and one
of the CuTe stages (kda_cute.registry: fwd, b1, dhu, intra today) fell back; 2 accuracy check
failed (or the float64 reference did not fit in memory).

On a CPU machine the chain can only take its reference implementations: the CLI says so, the
table has no kernels and its times are CPU wall time of the stage ranges.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from kda_cute import registry
from kda_cute.reference import chunk_kda_reference, chunk_kda_reference_packed, rel_err
from kda_witness import Results, WitnessError, expect, profile

from .api import chunk_kda
from .cli_args import at_least, check_output_file

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# GPU default: CHAIN.md's reference shape; CPU default: small enough for the float64 reference.
SHAPE_CPU = {"B": 1, "T": 128, "H": 2, "HV": 2, "K": 32, "V": 32, "dtype": "fp32"}
SHAPE_GPU = {"B": 16, "T": 8192, "H": 16, "HV": 16, "K": 128, "V": 256, "dtype": "bf16"}
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
CUTE_STAGES = tuple(s.name for s in registry.STAGES)
CUTE_KERNELS = registry.kernel_stages()
GRAD_NAMES = {"initial_state": "dh0"}
# Above this many B*T*HV*max(K, V) elements the float64 reference (a plain-torch, chunk-looped
# oracle) takes minutes and tens of GB: check accuracy on the first sequence, where every
# stage runs the same kernels at the same T and heads.
CHECK_FULL_LIMIT = 2**26
_T0 = time.perf_counter()


def progress(msg: str) -> None:
    """A timestamped progress line on stderr: first calls compile kernels and can take minutes."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


PER_TOKEN = ("q", "k", "v", "g", "beta", "do")  # the inputs and cotangents with a token mode
PER_STATE = ("initial_state", "dht")  # one per batch row (per sequence when packed)


def first_sequence(x: dict, cot: dict) -> tuple[dict, dict]:
    """The B=1 slice of inputs and cotangents (A_log, dt_bias have no batch mode)."""
    per_batch = {*PER_TOKEN, *PER_STATE}
    return ({n: t[:1] if n in per_batch else t for n, t in x.items()},
            {n: t[:1] for n, t in cot.items()})


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kda-witness",
        description="Run one fwd+bwd of kda_chain.chunk_kda, show which kernels ran and why, time it "
        "against fla, and check it against the float64 reference.",
    )
    on = "GPU" if torch.cuda.is_available() else "CPU"
    defaults = SHAPE_GPU if on == "GPU" else SHAPE_CPU
    names = {"B": "batch", "T": "sequence length", "H": "q/k heads", "HV": "v heads (a multiple of H)",
             "K": "key head dim", "V": "value head dim"}
    for dim, what in names.items():
        p.add_argument(f"--{dim}", type=at_least(1), default=None,
                       help=f"{what} (default on this {on}: {defaults[dim]})")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help=f"q/k/v dtype (default on this {on}: {defaults['dtype']})")
    flag = argparse.BooleanOptionalAction
    p.add_argument("--gate-in-kernel", action=flag, default=True,
                   help="use_gate_in_kernel: g is raw, with A_log and dt_bias (default on)")
    p.add_argument("--l2norm", action=flag, default=True, help="use_qk_l2norm_in_kernel (default on)")
    p.add_argument("--initial-state", action=flag, default=True, help="pass h0 (default on)")
    p.add_argument("--final-state", action=flag, default=True, help="output_final_state (default on)")
    p.add_argument("--disable-recompute", action=flag, default=False,
                   help="disable_recompute: the forward keeps w, u, h for the backward (default off)")
    p.add_argument("--reps", type=at_least(1), default=5,
                   help="timed calls after one warm-up, median reported (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--packed", type=at_least(1), default=None, metavar="N",
                   help="a packed call: the B*T tokens as one row of N sequences of seeded random "
                   "lengths, with cu_seqlens (default: off)")
    p.add_argument("--require-cute", action="store_true",
                   help=f"exit 1 if any of the stages {', '.join(CUTE_STAGES)} did not run its CuTe kernel")
    p.add_argument("--trace", metavar="FILE",
                   help="write the profiled call's Chrome trace here (default: none)")
    p.add_argument("--check-full", action="store_true",
                   help="check accuracy on the whole batch even at large shapes (default: above "
                   f"{CHECK_FULL_LIMIT:.0e} B*T*HV*max(K,V) elements, on the first sequence only)")
    args = p.parse_args(argv)
    for key, val in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    if args.HV % args.H:
        p.error(f"--HV {args.HV} must be a multiple of --H {args.H}")
    if args.packed is not None and args.packed > args.B * args.T:
        p.error(f"--packed {args.packed}: more sequences than the B*T = {args.B * args.T} tokens")
    if args.trace:
        check_output_file(p, "--trace", args.trace)
    args.dtype = DTYPES[args.dtype]
    return args


def make_inputs(a: argparse.Namespace, device: str) -> tuple[dict, dict, dict]:
    """(leaf tensors, chunk_kda flags, cotangents do/dht). Leaves are differentiated."""
    gen = torch.Generator(device=device).manual_seed(a.seed)

    def rnd(*shape, dtype=a.dtype, scale=1.0):
        return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)

    q, k = rnd(a.B, a.T, a.H, a.K), rnd(a.B, a.T, a.H, a.K)
    if not a.l2norm:  # the op expects unit-norm q, k when it does not normalize itself
        q, k = (torch.nn.functional.normalize(x.float(), dim=-1).to(a.dtype) for x in (q, k))
    x = {"q": q, "k": k, "v": rnd(a.B, a.T, a.HV, a.V)}
    if a.gate_in_kernel:
        x["g"] = rnd(a.B, a.T, a.HV, a.K)
        x["A_log"] = torch.log(torch.empty(a.HV, device=device).uniform_(1, 16, generator=gen))
        x["dt_bias"] = rnd(a.HV * a.K, dtype=torch.float32, scale=0.1)
    else:  # a per-step log decay, <= 0
        x["g"] = torch.nn.functional.logsigmoid(rnd(a.B, a.T, a.HV, a.K, dtype=torch.float32)).to(a.dtype)
    x["beta"] = torch.sigmoid(rnd(a.B, a.T, a.HV, dtype=torch.float32)).to(a.dtype)
    if a.initial_state:
        x["initial_state"] = rnd(a.B, a.HV, a.K, a.V, dtype=torch.float32, scale=0.1)
    flags = {"use_qk_l2norm_in_kernel": a.l2norm, "use_gate_in_kernel": a.gate_in_kernel,
             "output_final_state": a.final_state, "disable_recompute": a.disable_recompute}
    cot = {"do": rnd(a.B, a.T, a.HV, a.V)}
    if a.final_state:
        cot["dht"] = rnd(a.B, a.HV, a.K, a.V, dtype=torch.float32)
    if a.packed:
        return _packed(a, x, flags, cot, device)
    return x, flags, cot


def _packed(a: argparse.Namespace, x: dict, flags: dict, cot: dict, device: str) -> tuple[dict, dict, dict]:
    """`make_inputs`' tensors as one packed row of a.packed sequences (lengths: N - 1 distinct cut
    points of the B*T tokens, seeded), states [N, ...], cu_seqlens on the device and the host."""
    N, total = a.packed, a.B * a.T
    cuts = torch.randperm(total - 1, generator=torch.Generator().manual_seed(a.seed))[:N - 1] + 1
    offs = torch.tensor([0, *sorted(cuts.tolist()), total], dtype=torch.int32)

    def row(n, t):
        if n in PER_TOKEN:
            return t.reshape(1, total, *t.shape[2:])
        if n in PER_STATE:  # one state per sequence
            return torch.cat([t] * -(-N // a.B))[:N].contiguous()
        return t

    flags = dict(flags, cu_seqlens=offs.to(device), cu_seqlens_cpu=offs.long())
    return ({n: row(n, t) for n, t in x.items()}, flags, {n: row(n, t) for n, t in cot.items()})


def _reference(flags: dict):
    """The float64 oracle for these chunk_kda flags: the chain, or per sequence for a packed call."""
    if "cu_seqlens" not in flags:
        return chunk_kda_reference, flags
    rest = {n: f for n, f in flags.items() if n not in ("cu_seqlens", "cu_seqlens_cpu")}
    offs = flags["cu_seqlens_cpu"].tolist()

    def packed(q, k, v, g, beta, **kw):
        return chunk_kda_reference_packed(q, k, v, g, beta, offs, **kw)

    return packed, rest


def first_packed(x: dict, flags: dict, cot: dict) -> tuple[dict, dict, dict]:
    """A packed call's first sequence as a packed call of its own."""
    L = int(flags["cu_seqlens_cpu"][1])
    offs = torch.tensor([0, L], dtype=torch.int32)
    one = {n: (t[:, :L] if n in PER_TOKEN else t[:1] if n in PER_STATE else t)
           for n, t in {**x, **cot}.items()}
    flags = dict(flags, cu_seqlens=offs.to(flags["cu_seqlens"].device), cu_seqlens_cpu=offs.long())
    return ({n: one[n] for n in x}, flags, {n: one[n] for n in cot})


def fwd_bwd(fn, x: dict, flags: dict, cot: dict, dtype: torch.dtype | None = None) -> dict:
    """One forward and backward; returns o, ht and d<leaf> for every leaf, detached."""
    leaves = {n: (t.to(dtype) if dtype else t).detach().requires_grad_(True) for n, t in x.items()}
    tensors = dict(leaves)
    q, k, v, g, beta = (tensors.pop(n) for n in ("q", "k", "v", "g", "beta"))
    o, ht = fn(q, k, v, g, beta, **tensors, **flags)
    outs, grads = [o], [cot["do"].to(o.dtype)]
    if ht is not None:
        outs.append(ht)
        grads.append(cot["dht"].to(ht.dtype))
    dx = torch.autograd.grad(outs, list(leaves.values()), grads, allow_unused=True)
    res = {"o": o.detach()}
    if ht is not None:
        res["ht"] = ht.detach()
    res.update({GRAD_NAMES.get(n, "d" + n): d for n, d in zip(leaves, dx, strict=True)})
    return res


def median_ms(fn, reps: int, cuda: bool) -> float:
    fn()  # warm-up: JIT compile, autotune, allocator
    times = []
    for _ in range(max(reps, 1)):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    a = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    shape = f"B{a.B} T{a.T} H{a.H} HV{a.HV} K{a.K} V{a.V} {str(a.dtype).removeprefix('torch.')}"
    if a.packed:
        shape += f" packed as {a.packed} sequences on one row"
    print(f"kda-witness: chunk_kda fwd+bwd at {shape}; gate_in_kernel={a.gate_in_kernel} "
          f"l2norm={a.l2norm} initial_state={a.initial_state} final_state={a.final_state} "
          f"disable_recompute={a.disable_recompute}")
    if cuda:
        major, minor = torch.cuda.get_device_capability()
        print(f"device: {torch.cuda.get_device_name()} (sm_{major}{minor})")
    else:
        print("device: CPU only. No CUDA device: the chain runs its plain-torch reference implementations "
              "(kda_cute.reference), no kernels launch, and times are CPU wall time.")

    x, flags, cot = make_inputs(a, device)

    # ours: the timing (its warm-up compiles), then one profiled warm call for the stage table
    if cuda:
        progress("ours: warm-up (compiles the CuTe kernels and fla's Triton kernels on a fresh machine), "
                 f"then {a.reps} timed calls")
    else:
        progress(f"ours: warm-up, then {a.reps} timed calls (the plain-torch reference stages; nothing "
                 "compiles on CPU)")
    ours_ms = median_ms(lambda: fwd_bwd(chunk_kda, x, flags, cot), a.reps, cuda)
    progress("ours: one profiled call for the stage table")
    prof = profile(fwd_bwd, chunk_kda, x, flags, cot)
    ours = prof.value
    print()
    print(prof.table())
    if a.trace:
        prof.export_chrome_trace(a.trace)
        print(f"trace written to {a.trace}")

    fla, fla_ms, fla_note = None, None, "fla: not run (needs CUDA)"
    if cuda:
        try:
            from fla.ops.kda import chunk_kda as fla_kda

            progress("fla: warm-up and timed calls")
            fla = fwd_bwd(fla_kda, x, flags, cot)
            fla_ms = median_ms(lambda: fwd_bwd(fla_kda, x, flags, cot), a.reps, cuda)
            fla_note = None
        except Exception as e:  # noqa: BLE001  fla missing, or refusing this shape
            fla_note = f"fla: failed: {type(e).__name__}: {e}"
    clock = "CUDA events" if cuda else "wall clock"
    print()
    print(f"fwd+bwd, median of {a.reps} after a warm-up ({clock}):")
    print(f"  ours (kda_chain.chunk_kda)  {ours_ms:10.3f} ms")
    if fla_ms is not None:
        print(f"  fla  (fla.ops.kda)          {fla_ms:10.3f} ms   ours/fla = {ours_ms / fla_ms:.3f}x")
    else:
        print(f"  {fla_note}")

    where = "the whole batch"
    big = a.B * a.T * a.HV * max(a.K, a.V) > CHECK_FULL_LIMIT
    if not a.check_full and (a.B > 1 or a.packed) and big:
        where = "the first sequence (B=1; --check-full for all)"
        if a.packed:
            x, flags, cot = first_packed(x, flags, cot)
        else:
            x, cot = first_sequence(x, cot)
        ours = fwd_bwd(chunk_kda, x, flags, cot)
        if fla is not None:
            fla = fwd_bwd(fla_kda, x, flags, cot)
    if cuda:  # the reference below is the memory peak at large shapes
        torch.cuda.empty_cache()
    progress(f"float64 reference on {where}")
    # (disable_recompute has no effect on the result)
    ref_fn, ref_flags = _reference({n: f for n, f in flags.items() if n != "disable_recompute"})
    try:
        ref = fwd_bwd(ref_fn, x, ref_flags, cot, dtype=torch.float64)
    except torch.OutOfMemoryError:
        print(f"\nthe float64 reference ran out of {device} memory at this shape: accuracy NOT checked")
        return 2
    print()
    print(f"relative error vs the float64 reference on {device}, {where} (||x - ref|| / ||ref||):")
    print(f"  {'':8}{'ours':>11}{'fla':>11}  verdict")
    bad = []
    for name, want in ref.items():
        if want is None:
            continue
        got = ours.get(name)
        e_ours = rel_err(got, want) if got is not None else float("inf")
        e_fla = rel_err(fla[name], want) if fla is not None and fla.get(name) is not None else None
        bound = 2 * e_fla + 1e-6 if e_fla is not None else TOLERANCE[a.dtype]
        ok = e_ours <= bound
        if not ok:
            bad.append(name)
        fla_cell = f"{e_fla:11.2e}" if e_fla is not None else f"{'-':>11}"
        print(f"  {name:8}{e_ours:11.2e}{fla_cell}  {'ok' if ok else 'FAIL'} (bound {bound:.1e})")
    del ref

    status = 0
    if bad:
        print(f"\naccuracy: FAIL for {', '.join(bad)}")
        status = 2
    if a.require_cute:
        problem = cute_problem(prof, packed=bool(a.packed))
        if problem:
            print(f"\n--require-cute: FAIL\n{problem}")
            return 1
        print(f"\n--require-cute: ok, {', '.join(CUTE_STAGES)} ran their CuTe kernels")
    return status


def cute_problem(res: Results, packed: bool = False) -> str | None:
    """Why the CuTe stages did not all run their kernels, or None. A stage another can compute in
    its one kernel (registry `replaces`: bwd_chunk's bwd_wy_dqkg, intra, l2norm_bwd, gate_bwd; fwd_prep's
    l2norm_fwd) is not expected once that one ran its kernel; called anyway, it must run its own.
    packed: a packed call, whose rows must also have been read and written in place (`varlen_io`)."""
    ran = {s for s in CUTE_STAGES if any(r.impl == "cute" for r in res.stage(s))}
    gone = {s for s in registry.replaced(ran) if not res.stage(s)}
    lines = []
    if packed:
        rows = res.stage("varlen_io")
        if not rows:
            lines.append("  varlen_io: no packed-row record (was the call packed?)")
        lines += [f"  varlen_io -> {r.impl}: {r.reason} ({r.calls} calls)" for r in rows
                  if r.impl != "native"]
    for stage in CUTE_STAGES:
        rows = res.stage(stage)
        if not rows and stage not in gone:
            lines.append(f"  stage {stage}: never called")
        for r in rows:
            if r.impl != "cute":
                calls = f"{r.calls} call{'s' * (r.calls != 1)}"
                lines.append(f"  stage {stage} -> {r.impl}: {r.reason} ({calls})")
    try:
        expect(res, tuple(k for k, st in CUTE_KERNELS.items() if st not in gone))
    except WitnessError as e:
        lines.append(str(e))
    return "\n".join(lines) or None


if __name__ == "__main__":
    sys.exit(main())
