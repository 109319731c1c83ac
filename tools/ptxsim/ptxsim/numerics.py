"""Bit-level float helpers of the interpreter: registers hold raw bit patterns (Python ints), and
these convert them to and from numpy float32 values and the narrow formats.

Modelled: float32 <-> bits, flush-to-zero of float32 denormals, bf16 and fp16 <-> float32 with
round to nearest even (cvt.rn; NaN stays a quiet NaN), tf32 rounding to nearest with ties away
(cvt.rna.tf32.f32: half a tf32 ulp added to the bits, then truncated), sign extension.
Not modelled: other rounding modes (rz, rm, rp), saturation (.sat), fp8 and the packed
conversions beyond what the CTA classes build from these.
"""

import struct

import numpy as np

F32 = np.float32  # the type of every float32 value the interpreter computes with


def f2b(x):
    """A float as its float32 bit pattern (rounded to float32 first)."""
    return struct.unpack("<I", struct.pack("<f", float(x)))[0]


def b2f(b):
    """A 32-bit pattern (higher bits ignored) as the float32 value it holds, as a Python float."""
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def ftz(x):
    """x as float32, denormals flushed to a zero of the same sign (the .ftz modifier)."""
    x = F32(x)
    if x != 0 and abs(x) < F32(1.1754943508222875e-38):
        return F32(0.0) * np.sign(x)
    return x


def bf16_to_f32(h):
    """A bf16 bit pattern (the low 16 bits) as its (exact) float value."""
    return b2f((h & 0xFFFF) << 16)


def f32_to_bf16(x):
    """x (float32) as a bf16 bit pattern, rounded to nearest even (cvt.rn.bf16.f32); NaN -> 0x7FC0."""
    b = f2b(x)
    if (b & 0x7F800000) == 0x7F800000 and (b & 0x7FFFFF):
        return 0x7FC0
    lsb = (b >> 16) & 1
    b = b + 0x7FFF + lsb
    return (b >> 16) & 0xFFFF


def f16_to_f32(h):
    """An fp16 bit pattern (the low 16 bits) as its (exact) float value."""
    return float(np.frombuffer(struct.pack("<H", h & 0xFFFF), dtype=np.float16)[0])


def f32_to_f16(x):
    """x (float32) as an fp16 bit pattern, rounded to nearest even (cvt.rn.f16.f32)."""
    return struct.unpack("<H", np.float16(F32(x)).tobytes())[0]


def tf32_rna(x):
    """x as the 32-bit pattern of its tf32 rounding, to nearest, ties away from zero
    (cvt.rna.tf32.f32: the low 13 bits cleared); inf and NaN pass unchanged."""
    b = f2b(x)
    if (b & 0x7F800000) == 0x7F800000:
        return b
    b = (b + 0x1000) & 0xFFFFE000
    return b & 0xFFFFFFFF


def sext(v, bits):
    """The low `bits` bits of v read as a two's complement signed integer."""
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >> (bits - 1) else v

