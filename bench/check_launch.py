"""Where the chain's time goes at small shapes: host (enqueue) time against device time, per launch.

Why it exists (H200, 2026-11-30): at B2 T4096 H16 K=V=128 our fwd+bwd took 5.73 ms against
fla's 4.36 although every CuTe stage it ran was faster there. What it found (2026-12-01,
docs/perf/method.md, host time at small shapes): both chains are host-bound at that shape (60-250 us
of host time per launch on the device machine), and ours also paid a profiler range per stage
with no profiler running; after that fix ours is 4.04 ms against fla's 4.51. It measures, in one
process, side by side with fla:

  per kernel (intra with fold_dg, b1, dhu; fla's intra + cumsum, fwd_h, bwd_dhu):
    device ms      CUDA events around one call, median (bench/cuda_clock.median_ms)
    host us/call   perf_counter around N back-to-back calls, no sync inside: the enqueue cost
    compiled us    (ours) the compiled CuTe function alone on its cached views: the DSL's share
  per chain (ours, fla), fwd+bwd:
    host ms        perf_counter around one fwd+bwd, no sync: when this exceeds the device time
                   the GPU idles between launches and the step is host-bound
    device ms      CUDA events around the same

    python bench/check_launch.py [--B 2 --T 4096 --H 16 --V 128] [--n 200] [--profile]

`--profile`: sync call sites and cProfile of the chain step (ours, fla) instead.
"""

from __future__ import annotations

import argparse
import time

import check_intra as ci  # bench/ (this script's directory)
import check_scans as cs
import kda_cute.b1 as b1
import kda_cute.dhu as dhu
import kda_cute.intra as intra
import torch
from cuda_clock import median_ms


def host_us(fn, n: int) -> float:
    """Enqueue time per call: n calls back to back, no sync inside the timed loop."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def compiled_us(cache, call, n: int) -> float:
    """The compiled CuTe function alone on the views its last call cached (the DLPack launch path;
    NaN on the TVM-FFI path, which caches no views: bench/check_tvm_ffi.py times its call). `call`
    runs first and its outputs are kept alive, so the cached pointers still point at live tensors
    while we relaunch."""
    from kda_cute._common.cache import current_stream, launch_path

    if launch_path() != "dlpack":
        return float("nan")

    keep = call()  # noqa: F841 - holds the outputs the cached views point at
    torch.cuda.synchronize()
    (view_key, (views, _)), = list(cache.entries.items())[-1:]
    fn = cache.compiled[view_key[0]]
    _, stream = current_stream(torch.device("cuda"))
    fn(*views, stream)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn(*views, stream)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def kernels(B, T, H, V, n):
    a = ci.make_inputs(B, T, H, H, 128)
    d = cs.make_inputs(B, T, H, H, V, h0=False)
    rows = [
        ("intra fold_dg", lambda: intra.bwd_intra(*a, fold_dg=True, emit_bf16=True), intra._cache,
         "fla intra + dg cumsum", lambda: ci.fla_intra(a, fold=True)),
        ("b1", lambda: cs.ours_b1(d), b1._cache, "fla fwd_h", lambda: cs.fla_b1(d)),
        ("dhu", lambda: cs.ours_dhu(d), dhu._cache, "fla dAv + bwd_dhu", lambda: cs.fla_dhu(d)),
    ]
    from kda_cute._common.cache import launch_path

    print(f"launch path: {launch_path()}")
    print(f"| B{B} T{T} H{H} V{V} | device ms | host us/call | compiled call us |")
    print("|---|---|---|---|")
    for name, ours, cache, fname, fla in rows:
        try:
            print(f"| {name} | {median_ms(ours):.3f} | {host_us(ours, n):.1f} | "
                  f"{compiled_us(cache, ours, n):.1f} |", flush=True)
            print(f"| {fname} | {median_ms(fla):.3f} | {host_us(fla, n):.1f} | - |", flush=True)
        except Exception as e:  # one call must tell everything
            print(f"| {name} | ERROR {type(e).__name__}: {e} | | |", flush=True)


def chains(B, T, H, V, reps=10):
    print(f"\n| fwd+bwd B{B} T{T} H{H} V{V} | host ms (no sync) | device ms |")
    print("|---|---|---|")
    for name, step in _chain_step(B, T, H, V).items():
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        hosts = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            hosts.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        hosts.sort()
        dev = median_ms(step)
        print(f"| {name} | {hosts[len(hosts) // 2]:.3f} | {dev:.3f} |", flush=True)


def _chain_step(B, T, H, V):
    """One fwd+bwd closure per implementation (ours, fla) on shared inputs."""
    from fla.ops.kda import chunk_kda as fla_kda
    from kda_chain import chunk_kda

    g = torch.Generator(device="cuda").manual_seed(1)

    def r(*s):
        return torch.randn(s, generator=g, device="cuda").to(torch.bfloat16).requires_grad_(True)

    q, k, v, gate = r(B, T, H, 128), r(B, T, H, 128), r(B, T, H, V), r(B, T, H, 128)
    beta = torch.rand(B, T, H, generator=g, device="cuda").to(torch.bfloat16).requires_grad_(True)
    A_log = torch.zeros(H, device="cuda")
    do = torch.randn(B, T, H, V, device="cuda").to(torch.bfloat16)
    leaves = (q, k, v, gate, beta)

    def step(fn):
        # the call alone: no op of the harness's own in the graph (beta is a leaf in (0, 1)), and the
        # leaves' gradients reset as an optimizer's zero_grad(set_to_none=True) does (accumulating
        # into them would add five kernels per step to both implementations; until 2026-12-02 it did)
        for t in leaves:
            t.grad = None
        o, _ = fn(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log)
        o.backward(do)

    return {"ours": lambda: step(chunk_kda), "fla": lambda: step(fla_kda)}


def stage_host_times(step, steps):
    """Host time per chain stage (choose = the gates, run = the implementation's call), summed over
    `steps` steps on every thread, against the whole step's host time: what is left over is the
    chain's own machinery (validation, autograd, contiguous, the dispatch record)."""
    from collections import defaultdict

    from kda_chain import stages as S

    acc = defaultdict(float)
    saved = {}
    for st in S.STAGES.values():
        saved[st.name] = (st.choose, st.run)

        def choose(*a, _st=st, _f=st.choose, **k):
            t0 = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                acc[(_st.name, "choose")] += time.perf_counter() - t0

        def run(impl, reason, *a, _st=st, _f=st.run, **k):
            t0 = time.perf_counter()
            try:
                return _f(impl, reason, *a, **k)
            finally:
                acc[(_st.name, impl.name)] += time.perf_counter() - t0

        st.choose, st.run = choose, run
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        total = time.perf_counter() - t0
        torch.cuda.synchronize()
    finally:
        for st in S.STAGES.values():
            st.choose, st.run = saved[st.name]
    print(f"\n### ours: host us per step, per stage ({steps} steps, no sync inside)", flush=True)
    print("| stage | impl | host us |\n|---|---|---|")
    for (name, what), t in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {what} | {t / steps * 1e6:.1f} |")
    inside = sum(acc.values())
    print(f"| (all stages) | | {inside / steps * 1e6:.1f} |\n| (whole step) | | {total / steps * 1e6:.1f} |",
          flush=True)


def host_parts(n=2000):
    """Host cost of the building blocks a chain call is made of, on this machine's CPU (us/call)."""
    x = torch.empty((2, 4096, 16, 128), dtype=torch.bfloat16, device="cuda")

    class Id(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *a):
            return a[0].new_empty(a[0].shape)

        @staticmethod
        def backward(ctx, g):
            return g, None, None, None, None

    leaf = x.clone().requires_grad_(True)
    rows = {
        "torch.empty cuda bf16 [2,4096,16,128]": lambda: torch.empty((2, 4096, 16, 128), dtype=torch.bfloat16,
                                                                     device="cuda"),
        "torch.empty(..., device=x.device)": lambda: torch.empty((2, 4096, 16, 128), dtype=torch.bfloat16,
                                                                 device=x.device),
        "x.new_empty(shape)": lambda: x.new_empty((2, 4096, 16, 128)),
        "torch.empty_like(x)": lambda: torch.empty_like(x),
        "x.contiguous() (already)": lambda: x.contiguous(),
        "x.view(2, 4096, 2048)": lambda: x.view(2, 4096, 2048),
        "x.data_ptr()": lambda: x.data_ptr(),
        "x.shape, x.stride(), x.dtype": lambda: (x.shape, x.stride(), x.dtype),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "autograd.Function fwd+bwd, 5 inputs": lambda: Id.apply(leaf, x, x, x, x).sum().backward(),
        "x.sum() (one launch)": lambda: x.sum(),
    }
    print("\n### host building blocks (us/call, this CPU)\n| what | us |\n|---|---|")
    for name, fn in rows.items():
        print(f"| {name} | {host_us(fn, n):.2f} |", flush=True)


def kernel_call_costs(step, n=100):
    """Host us of each compiled CuTe call alone, on the arguments a chain step gave it (the
    TVM-FFI call with its tensors: what no Python of ours can remove), against the stage's whole
    launch (a recorded plan's replay of the module's `launch`: fresh outputs and the call)."""
    from kda_chain import stages as S
    from kda_cute._common.cache import CallCache

    S.clear_gate_cache()  # this step records its plans: its launches go through the call caches
    seen = []
    orig = CallCache.launch

    def launch(self, compile_key, args, dyn_modes, build):
        orig(self, compile_key, args, dyn_modes, build)
        seen.append((self.name, self.compiled[(compile_key, args[0].device.index)], tuple(args)))

    CallCache.launch = launch
    try:
        step()
    finally:
        CallCache.launch = orig
    torch.cuda.synchronize()
    print("\n### the compiled call alone (TVM-FFI with torch tensors), host us/call\n"
          "| kernel | tensors | us |\n|---|---|---|")
    for name, fn, args in seen:
        print(f"| {name} | {len(args)} | {host_us(lambda fn=fn, args=args: fn(*args), n):.1f} |", flush=True)
    seen.clear()  # the tensors go with it


def host_profile(B, T, H, V, steps=10, pstats_dir=None):
    """Where our chain's host time goes: (1) every synchronizing CUDA call made during one step
    (torch's sync debug mode, warnings recorded on every thread), (2) cProfile of `steps` steps
    with the backward on the calling thread (autograd multithreading off), ours then fla."""
    import cProfile
    import io
    import pstats
    import warnings

    fns = _chain_step(B, T, H, V)
    for fn in fns.values():
        fn()
        fn()
    torch.cuda.synchronize()
    print(f"\n## host profile B{B} T{T} H{H} V{V}", flush=True)
    for name, fn in fns.items():
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        # the first set_sync_debug_mode of a process also warns that the mode is a prototype:
        # that notice is not a synchronizing call (it was counted as one until 2026-12-02)
        syncs = sorted({f"{w.filename}:{w.lineno}: {str(w.message)[:90]}" for w in ws
                        if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)})
        print(f"{name}: {len(syncs)} synchronizing call sites in one step", flush=True)
        for line in syncs[:20]:
            print("   ", line, flush=True)
    stage_host_times(fns["ours"], steps)
    kernel_call_costs(fns["ours"])
    torch.autograd.set_multithreading_enabled(False)
    try:
        for name, fn in fns.items():
            pr = cProfile.Profile()
            torch.cuda.synchronize()
            pr.enable()
            for _ in range(steps):
                fn()
            pr.disable()
            torch.cuda.synchronize()
            if pstats_dir:
                pr.dump_stats(f"{pstats_dir}/host_{name}_B{B}T{T}.pstats")
            for key in ("tottime", "cumulative"):
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats(key).print_stats(28)
                text = buf.getvalue()
                text = text[text.find("ncalls"):]
                print(f"\n### {name}: cProfile, {steps} steps, by {key}\n{text}", flush=True)
    finally:
        torch.autograd.set_multithreading_enabled(True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--n", type=int, default=200, help="calls per host-time loop")
    ap.add_argument("--profile", action="store_true", help="only the host profile of the chain")
    ap.add_argument("--pstats", metavar="DIR", help="with --profile: also dump each cProfile there")
    a = ap.parse_args()
    for m in cs.MODS:
        m.GRID_FLOOR = 0  # time dhu below its floor too: the floor is what this may move
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    if a.profile:
        host_parts()
        host_profile(a.B, a.T, a.H, a.V, pstats_dir=a.pstats)
        return
    kernels(a.B, a.T, a.H, a.V, a.n)
    chains(a.B, a.T, a.H, a.V)


if __name__ == "__main__":
    main()
