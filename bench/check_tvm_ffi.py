"""Host cost of one CuTe launch: the call cache's path against the DSL's TVM-FFI call path (GPU).

Today every CuTe stage launches through `kda_cute._common.cache.CallCache`: descriptors built once
per shape by `from_dlpack`, then per call a pointer retarget of each descriptor and the compiled
function's own argument marshalling. The DSL's TVM-FFI path (`cute.compile(...,
options="--enable-tvm-ffi")`, apache-tvm-ffi) instead takes torch tensors directly and reads the
stream from torch's current stream. This times both for b1 (8 tensors) at a small shape, where a
step is host-bound, and checks the outputs are bitwise equal:

    host us/call    perf_counter around N back-to-back calls, no sync inside (the enqueue cost)
    device ms       CUDA events, median

    python bench/check_tvm_ffi.py [--B 2 --T 4096 --HV 16 --V 128] [--n 300]
"""

from __future__ import annotations

import argparse
import time

import kda_cute.b1 as b1
import torch
from check_launch import host_us  # bench/ (this script's directory)
from cuda_clock import median_ms


def tvm_ffi_b1(kg, w, u, gk):
    """b1 compiled for the TVM-FFI path: (compiled, args) where compiled(*args) launches."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack, make_fake_stream

    outs, args, dyn, cfg = b1._plan(kg, w, u, gk, None, False, None, None)

    def view(t, modes):
        t = t.detach()
        order = tuple(sorted(range(t.dim()), key=lambda i: (-t.stride(i), i)))
        ct = from_dlpack(t, assumed_align=16, enable_tvm_ffi=True)
        for m in modes:
            ct = ct.mark_compact_shape_dynamic(mode=m, stride_order=order)
        return ct

    views = [view(t, d) for t, d in zip(args, dyn, strict=True)]
    t0 = time.perf_counter()
    compiled = cute.compile(
        b1._B1(cfg).compile_fn(),
        *views,
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options="--enable-tvm-ffi",
    )
    print(f"tvm-ffi compile {time.perf_counter() - t0:.1f} s", flush=True)
    return compiled, outs, args


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--HV", type=int, default=16)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--n", type=int, default=300)
    a = ap.parse_args()
    B, T, HV, V, K = a.B, a.T, a.HV, a.V, 128
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*s, dt=torch.bfloat16, scale=1.0):
        return (torch.randn(s, generator=g, device="cuda") * scale).to(dt)

    kg, w, u = r(B, T, HV, K, scale=0.1), r(B, T, HV, K, scale=0.1), r(B, T, HV, V)
    gk = -torch.rand(B, T, HV, K, generator=g, device="cuda").cumsum(1).remainder(8.0)
    ours = lambda: b1.launch(kg, w, u, gk)  # noqa: E731
    h_ref, v_ref, _ = ours()
    compiled, (h, v_new, _), args = tvm_ffi_b1(kg, w, u, gk)
    tvm = lambda: compiled(*args)  # noqa: E731
    tvm()
    torch.cuda.synchronize()
    same = torch.equal(h, h_ref) and torch.equal(v_new, v_ref)
    print(f"b1 B{B} T{T} HV{HV} V{V}: outputs bitwise equal: {same}", flush=True)
    rows = [("call cache (today)", ours), ("tvm-ffi (compiled(*tensors))", tvm)]
    for name, fn in rows:
        print(
            f"  {name:32s} host {host_us(fn, a.n):7.1f} us/call   device {median_ms(fn):.4f} ms", flush=True
        )
    # the allocation and planning a launch also does (outputs fresh per call) on the TVM-FFI path
    alloc_and_call = lambda: compiled(*b1._plan(kg, w, u, gk, None, False, None, None)[1])  # noqa: E731
    print(
        f"  {'tvm-ffi + _plan (fresh outputs)':32s} host {host_us(alloc_and_call, a.n):7.1f} us/call",
        flush=True,
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
