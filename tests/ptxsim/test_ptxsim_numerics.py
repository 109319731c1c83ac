"""ptxsim's bit conversions against torch's (round to nearest even), the tf32 rounding's ties
away from zero, flush-to-zero, and the 128-byte TMA swizzle."""

import math
import struct

import pytest
import torch
from ptxsim.numerics import b2f, bf16_to_f32, f2b, f16_to_f32, f32_to_bf16, f32_to_f16, ftz, sext, tf32_rna
from ptxsim.tma import swizzle


def _f32(bits):
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _samples(n=4000, seed=0):
    """float32 values: random bit patterns (finite), and the halfway cases of bf16 and fp16."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64).tolist()
    vals = [_f32(b) for b in bits if (b >> 23) & 0xFF != 0xFF]
    for m in range(0, 1 << 7, 5):  # bf16: bit 15 set, lower bits zero (a tie), both parities of bit 16
        for e in (100, 127, 140):
            vals.append(_f32((e << 23) | (m << 16) | 0x8000))
            vals.append(-_f32((e << 23) | (m << 16) | 0x8000))
    for m in range(0, 1 << 10, 37):  # fp16 ties: 1 + (m + 1/2) * 2^-10
        vals.append(1.0 + (m + 0.5) * 2.0**-10)
        vals.append(-(2.0**-3) * (1.0 + (m + 0.5) * 2.0**-10))
    return vals


def test_bits_round_trip():
    for x in (0.0, -0.0, 1.0, -2.5, 3.4028234663852886e38, 2.0**-149, math.inf):
        assert b2f(f2b(x)) == x and math.copysign(1, b2f(f2b(x))) == math.copysign(1, x)
    assert f2b(1.0) == 0x3F800000 and f2b(-2.0) == 0xC0000000
    assert b2f(0x1_3F800000) == 1.0  # bits above 32 ignored


def test_bf16_is_round_to_nearest_even():
    vals = _samples()
    want = torch.tensor(vals, dtype=torch.float32).to(torch.bfloat16).view(torch.int16).tolist()
    got = [f32_to_bf16(x) for x in vals]
    assert got == [w & 0xFFFF for w in want]
    assert f32_to_bf16(1.0 + 2.0**-8) == 0x3F80  # a tie, rounded to the even (1.0)
    assert f32_to_bf16(1.0 + 3 * 2.0**-8) == 0x3F82  # a tie, rounded up to the even
    assert f32_to_bf16(math.nan) == 0x7FC0 and f32_to_bf16(-math.inf) == 0xFF80
    for h in (0x3F80, 0xBF82, 0x0001, 0x7F7F):
        assert f32_to_bf16(bf16_to_f32(h)) == h


def test_f16_is_round_to_nearest_even():
    vals = [x for x in _samples(seed=1) if abs(x) < 65504]
    want = torch.tensor(vals, dtype=torch.float32).to(torch.float16).view(torch.int16).tolist()
    assert [f32_to_f16(x) for x in vals] == [w & 0xFFFF for w in want]
    assert f32_to_f16(1.0 + 2.0**-11) == 0x3C00 and f32_to_f16(1.0 + 3 * 2.0**-11) == 0x3C02
    assert f16_to_f32(0x3C01) == 1.0 + 2.0**-10 and f16_to_f32(0x0001) == 2.0**-24


def test_tf32_rounds_to_nearest_ties_away():
    assert tf32_rna(1.0 + 2.0**-11) == f2b(1.0 + 2.0**-10)  # a tie: away from zero
    assert tf32_rna(-(1.0 + 2.0**-11)) == f2b(-(1.0 + 2.0**-10))
    assert tf32_rna(1.0 + 2.0**-12) == f2b(1.0)  # below the tie: down
    assert tf32_rna(1.0 + 3 * 2.0**-12) == f2b(1.0 + 2.0**-10)  # above: up
    assert tf32_rna(1.0 + 2.0**-10 + 2.0**-11) == f2b(1.0 + 2.0**-9)  # a tie from an odd: away, not even
    for x in _samples(500, seed=2):
        r = tf32_rna(x)
        assert r & 0x1FFF == 0
        if 2.0**-126 <= abs(x) < 3.4e38:  # normal, not rounding to inf: within half a tf32 ulp
            assert abs(b2f(r) - x) <= abs(x) * 2.0**-11
    assert tf32_rna(math.inf) == f2b(math.inf)


def test_ftz_and_sext():
    assert ftz(1e-40) == 0.0 and math.copysign(1, ftz(-1e-40)) == -1.0
    assert ftz(1.2e-38) != 0.0 and ftz(-3.0) == -3.0
    assert sext(0xFFFF, 16) == -1 and sext(0x7FFF, 16) == 0x7FFF and sext(0x1_0000_0005, 32) == 5


def test_swizzle_128():
    assert swizzle(128, 128) == 144  # row 1: chunk 0 <-> chunk 1
    assert swizzle(7 * 128 + 5 * 16 + 3, 128) == 7 * 128 + (5 ^ 7) * 16 + 3
    assert all(swizzle(a, 128) == a for a in range(128))  # row 0 unchanged
    assert swizzle(1024 + 128, 128) == 1024 + 144  # the pattern repeats every 1024 bytes
    atom = [swizzle(a, 128) for a in range(2048)]
    assert sorted(atom) == list(range(2048))  # a permutation of each atom
    assert all(swizzle(swizzle(a, 128), 128) == a for a in range(2048))  # an involution
    assert all(atom[a + 1] == atom[a] + 1 for a in range(2048) if a % 16 != 15)  # 16-byte chunks stay whole
    assert [swizzle(a, 0) for a in range(300)] == list(range(300))


@pytest.mark.parametrize("x", [0.1, -7.25, 65504.0, 2.0**-14])
def test_conversions_match_torch_on_values(x):
    t = torch.tensor([x], dtype=torch.float32)
    assert bf16_to_f32(f32_to_bf16(x)) == t.to(torch.bfloat16).float().item()
    assert f16_to_f32(f32_to_f16(x)) == t.to(torch.float16).float().item()
