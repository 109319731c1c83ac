"""Host tensors in and out of the emulated global memory (one bytearray, as `CTA` reads it).

`global_memory(tensors)` lays the tensors out back to back in their contiguous layout, each at
a 4 KiB-aligned base (the first at 4096; the page below it is zeros, so a null pointer reads
zeros rather than faulting); it returns the bytearray and each tensor's base address (the value a
launcher passes as its data pointer). `readback(gmem, t, base)` is tensor
`t`'s shape and dtype filled from the bytes at `base`. Not modelled: strided (non-contiguous)
device layouts, alignments beyond 4 KiB, memory shared between CTAs other than by this one array.
"""

import torch


def global_memory(tensors):
    """The tensors laid out in one emulated global memory: (bytearray, base address of each)."""
    gmem = bytearray(4096 + sum((t.numel() * t.element_size() + 4095) // 4096 * 4096 for t in tensors))
    bases, off = [], 4096
    for t in tensors:
        nb = t.numel() * t.element_size()
        bases.append(off)
        gmem[off:off + nb] = t.contiguous().view(torch.uint8).numpy().tobytes()
        off += (nb + 4095) // 4096 * 4096
    return gmem, bases


def readback(gmem, t, base):
    """Tensor t's bytes back out of the emulated global memory (a new tensor, t's shape and dtype)."""
    raw = bytearray(gmem[base:base + t.numel() * t.element_size()])
    return torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype).view(t.shape).clone()
