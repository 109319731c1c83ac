"""Launching a DSL kernel's PTX on the interpreter: tensors in, a grid of CTAs, outputs back.

`run_grid(prog, tensors, ctas, cta_cls, ntid)` lays `tensors` (the kernel's tensor parameters in
order, outputs included and already poisoned by the caller) out in one emulated global memory,
fills each parameter's 24-byte slot as the DSL passes a view with its batch and time modes
dynamic (data pointer; the two dynamic extents as two int32; the batch stride), runs every CTA
(ctaid (x, y, z)) through `cta_cls`, and returns every tensor read back. `prefetch_ok(cta, bases)`,
when given, names the byte ranges that CTA's L2 prefetches may address (none otherwise).
"""

from .memory import global_memory, readback


def run_grid(prog, tensors, ctas, cta_cls, ntid, prefetch_ok=None):
    assert len(prog.params) == len(tensors), (len(prog.params), len(tensors))
    gmem, bases = global_memory(tensors)
    params = {}
    for (name, _size), t, base in zip(prog.params, tensors, bases, strict=True):
        params[(name, 0)] = base
        params[(name, 8)] = (t.shape[1] << 32) | t.shape[0]
        params[(name, 16)] = t.stride(0)
    for cta in ctas:
        ok = () if prefetch_ok is None else prefetch_ok(cta, bases)
        cta_cls(prog, gmem, params, cta, ntid=ntid, prefetch_ok=ok).run()
    return [readback(gmem, t, base) for t, base in zip(tensors, bases, strict=True)]
