"""Tensor maps (the TMA's view of a global tensor) as the host would have encoded them.

A kernel receives each tensor map as a 128-byte `.param` (`cuTensorMapEncodeTiled` on the host
at launch, which a CPU run cannot do). The interpreter does not decode those bytes: `HopperCTA`
gives the i-th kernel parameter the fake address `param_address(i)` (what `mov.u64 %rd, param`
yields), and the launcher passes a dict {param_address(i): TensorMap(...)} describing the map of
parameter i itself: base address, extents and byte strides in coordinate order (innermost first),
box, element size, swizzle. `TensorMap.cells(coords)` walks one box; `swizzle(addr, 128)` is the
128-byte swizzle of a shared-memory byte address (16-byte chunk index XOR the 128-byte row index
mod 8, i.e. CU_TENSOR_MAP_SWIZZLE_128B within 1024-byte-aligned atoms).

Modelled: tiled maps of any rank, out-of-bounds cells (read as zero, not written), the DSL's
dropping of static size-1 modes, no swizzle and the 128-byte swizzle. Not modelled: the 32- and
64-byte swizzles, interleave, im2col, element strides, L2 promotion and OOB fill with NaN.
"""

import numpy as np

PARAM_BASE = 0x7F00_0000_0000  # fake addresses of kernel params (tensor maps)


def param_address(i: int) -> int:
    """The address the interpreter gives kernel parameter i (HopperCTA's `symbols`)."""
    return PARAM_BASE + 0x1000 * i


class TensorMap:
    """One tensor map: a global tensor seen in coordinate order (innermost first)."""

    def __init__(self, base, dims, strides, box, elem, swizzle, static):
        self.base, self.dims, self.strides, self.box, self.elem, self.swizzle = (
            base, dims, strides, box, elem, swizzle)
        self.static = static  # per mode: an extent the compiler knows (the rest are dynamic)

    def cells(self, coords):
        """Each cell of the box at `coords`, innermost mode fastest: (its byte offset in the dense
        shared-memory box, before swizzling; its gmem byte address, or None when out of bounds).
        The DSL drops a tensor map's static size-1 modes (a size-1 head mode: no coordinate for
        it); so does this."""
        keep = [not (st and d == 1) for st, d in zip(self.static, self.dims, strict=True)]
        if sum(keep) != len(self.dims) and sum(keep) == len(coords):
            pick = [i for i, k in enumerate(keep) if k]
        else:
            pick = list(range(len(self.dims)))
        dims = [self.dims[i] for i in pick]
        strides = [self.strides[i] for i in pick]
        box = [self.box[i] for i in pick]
        n = int(np.prod(box))
        for lin in range(n):
            idx, r = [], lin
            for b in box:
                idx.append(r % b)
                r //= b
            g = [c + i for c, i in zip(coords, idx, strict=True)]
            inb = all(0 <= x < d for x, d in zip(g, dims, strict=True))
            ga = self.base + sum(x * s for x, s in zip(g, strides, strict=True)) if inb else None
            yield lin * self.elem, ga


def swizzle(addr: int, mode: int) -> int:
    """A shared-memory byte address under the map's swizzle (128: bits 4-6 ^= bits 7-9)."""
    if mode == 128:
        return addr ^ (((addr >> 7) & 7) << 4)
    return addr

