"""The gfx950 pack kernel's arithmetic recipe is bit-exact (SPEC §2.2), checked without a GPU.

ffi/flydsl/pack_kv_pages.py quantizes with integer/float steps that differ in form from
ffi/include/m3sparse/nvfp4.h (E4M3 rounding by adding to the fp32 bits, the E2M1 code as a sum of
threshold tests, max by compare-and-select). This file replays exactly those steps in numpy fp32
(IEEE, round to nearest even, denormals kept, as the kernel's descriptors set) and compares them,
byte for byte, with a direct port of nvfp4.h and with jax_m3sparse.nvfp4.nvfp4_quantize:
exhaustively for the E4M3 rounding, and on random and adversarial groups for the whole step.
The kernel itself runs against the CPU backend in test_device.py where a gfx950 is present.
"""

from __future__ import annotations

import numpy as np
import pytest

f32 = np.float32
u32 = np.uint32


# ---- the kernel's recipe (ffi/flydsl/pack_kv_pages.py), in numpy fp32 ------------------------
def kernel_inverse_scale(g):
    g = f32(g)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        r = f32(1.0) / g
    ok = (g >= f32(2.0 ** -126)) and (g <= f32(2.0 ** 126))
    return r if ok else f32(np.nan)


def kernel_e4m3_round(v):
    """v: fp32 array in [2^-9, 448] -> (byte, value), as pack_kv_pages.e4m3_round."""
    bits = v.view(u32)
    keep_odd = (bits >> u32(20)) & u32(1)
    rounded = (bits + (keep_odd + u32(0x7FFFF))) & u32(0xFFF00000)
    normal_byte = (((rounded >> u32(23)) - u32(120)) << u32(3)) | ((rounded >> u32(20)) & u32(7))
    normal_value = rounded.view(f32)
    q = np.rint(v * f32(512.0)).astype(f32)
    sub_byte = q.astype(u32)
    sub_value = q * f32(2.0 ** -9)
    is_sub = v < f32(2.0 ** -6)
    return np.where(is_sub, sub_byte, normal_byte), np.where(is_sub, sub_value, normal_value).astype(f32)


def kernel_e2m1(y):
    a = np.abs(y)
    m = ((a > 0.25).astype(u32) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
         + (a > 5.0)).astype(u32)
    negative = (y.view(u32) >> u32(31)) != 0
    return np.where(negative & (m != 0), m | u32(8), m)


def kernel_quantize(x, g):
    """x: fp32 [n, 16] groups -> (data uint8 [n, 8], scale uint8 [n])."""
    r = kernel_inverse_scale(g)
    amax = np.zeros(x.shape[0], f32)
    for i in range(16):                       # compare-and-select: NaNs never win
        ai = np.abs(x[:, i])
        amax = np.where(ai > amax, ai, amax)
    nan_group = np.isnan(x).any(axis=1) | np.isnan(r)
    with np.errstate(over="ignore", invalid="ignore"):
        s = (amax / f32(6.0)) * r
        s = np.where(s > f32(2.0 ** -9), s, f32(2.0 ** -9)).astype(f32)
        s = np.where(s < f32(448.0), s, f32(448.0)).astype(f32)
        sf_byte, sf_value = kernel_e4m3_round(s)
        y = (x * r) / sf_value[:, None]
    codes = kernel_e2m1(y.astype(f32))
    data = (codes[:, 0::2] | (codes[:, 1::2] << u32(4))).astype(np.uint8)
    data[nan_group] = 0
    scale = np.where(nan_group, u32(0x7F), sf_byte).astype(np.uint8)
    return data, scale


# ---- a direct port of ffi/include/m3sparse/nvfp4.h ---------------------------------------------
def header_e4m3_from_clamped(v):
    bits = v.view(u32)
    exp = (bits >> u32(23)).astype(np.int64) - 127
    sub = np.rint(v * f32(512.0)).astype(np.int64)
    mant = bits & u32(0x7FFFFF)
    keep = (mant >> u32(20)).astype(np.int64)
    rest = mant & u32(0xFFFFF)
    keep = keep + ((rest > 0x80000) | ((rest == 0x80000) & ((keep & 1) == 1)))
    exp_field = exp + 7
    carry = keep == 8
    keep = np.where(carry, 0, keep)
    exp_field = np.where(carry, exp_field + 1, exp_field)
    return np.where(exp < -6, sub, (exp_field << 3) | keep).astype(np.uint8)


def header_e4m3_to_float(b):
    b = b.astype(np.int64)
    exp = (b >> 3) & 15
    man = b & 7
    value = np.where(exp == 0, man * 2.0 ** -9, (1 + man / 8.0) * 2.0 ** (exp - 7))
    return np.where((exp == 15) & (man == 7), np.nan, value).astype(f32)


def header_e2m1(y):
    a = np.abs(y)
    m = np.select([a <= 0.25, a < 0.75, a <= 1.25, a < 1.75, a <= 2.5, a < 3.5, a <= 5.0],
                  [0, 1, 2, 3, 4, 5, 6], 7).astype(np.uint8)
    sign = np.signbit(y) & (m != 0)
    return np.where(sign, m | 8, m).astype(np.uint8)


def header_quantize(x, g):
    g = f32(g)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        r = f32(1.0) / g
    if not (g > 0 and np.isfinite(g) and np.isfinite(r)):
        r = f32(np.nan)
    nan = np.isnan(x).any(axis=1) | np.isnan(r)
    amax = np.fmax.reduce(np.abs(x), axis=1, initial=f32(0.0)).astype(f32)
    with np.errstate(over="ignore", invalid="ignore"):
        s = ((amax / f32(6.0)) * r).astype(f32)
        clamped = np.fmin(np.fmax(s, f32(2.0 ** -9)), f32(448.0)).astype(f32)
        sf = header_e4m3_from_clamped(np.where(np.isnan(clamped), f32(1.0), clamped).astype(f32))
        y = ((x * r) / header_e4m3_to_float(sf)[:, None]).astype(f32)
    codes = header_e2m1(y)
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    data[nan] = 0
    return data, np.where(nan, 0x7F, sf).astype(np.uint8)


# ---- tests --------------------------------------------------------------------------------------
def test_e4m3_rounding_exhaustive():
    """Every fp32 in [2^-9, 448]: the kernel's bit trick == nvfp4.h's e4m3_from_clamped."""
    lo = int(np.array(2.0 ** -9, f32).view(u32))
    hi = int(np.array(448.0, f32).view(u32))
    step = 1 << 22
    for start in range(lo, hi + 1, step):
        bits = np.arange(start, min(start + step, hi + 1), dtype=u32)
        v = bits.view(f32)
        byte, value = kernel_e4m3_round(v)
        expect = header_e4m3_from_clamped(v)
        assert np.array_equal(byte.astype(np.uint8), expect), start
        assert np.array_equal(value, header_e4m3_to_float(expect)), start


def adversarial_groups(rng):
    groups = []
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], f32)
    groups.append(np.concatenate([ties, -ties]))                     # amax 6 -> sf 1, y = x: ties
    groups.append(np.array([-0.0] * 15 + [6.0], f32))                # -0 stored as +0
    groups.append(np.array([-1e-30] * 15 + [6.0], f32))              # tiny negatives -> +0
    groups.append(np.zeros(16, f32))                                 # all zero: floor scale
    g = rng.standard_normal(16).astype(f32); g[3] = np.nan; groups.append(g)   # NaN group
    g = rng.standard_normal(16).astype(f32); g[5] = np.inf; groups.append(g)   # +Inf saturates
    g = rng.standard_normal(16).astype(f32); g[0] = -np.inf; groups.append(g)  # -Inf saturates
    groups.append(np.full(16, 3e38, f32))                            # x·r overflows to Inf
    groups.append((np.arange(16, dtype=f32) + 1) * f32(2.0 ** -140))  # fp32 denormals
    groups.append(np.full(16, 1e6, f32))                             # s clamps at 448
    for e in range(-20, 20):                                         # every E4M3 binade
        groups.append((rng.uniform(-1, 1, 16) * 2.0 ** e).astype(f32))
    return np.stack(groups)


@pytest.mark.parametrize("g", [1.0, 0.5, 3.0, 1 / 2688, 7.3e-5, 1e-30, 2.0 ** -126, 1e30, 0.0, -1.0,
                               np.inf, np.nan, 1e-45])
def test_group_quantization_matches_header(rng, g):
    x = np.concatenate([adversarial_groups(rng),
                        rng.standard_normal((4096, 16)).astype(f32) * f32(rng.uniform(0.01, 50)),
                        (rng.standard_t(2, (2048, 16)) * 30).astype(f32)])
    d1, s1 = kernel_quantize(x, g)
    d2, s2 = header_quantize(x, g)
    assert np.array_equal(s1, s2)
    assert np.array_equal(d1, d2)


@pytest.mark.parametrize("g", [1.0, 1 / 2688, 0.37, 0.0, np.inf])
def test_group_quantization_matches_jax_reference(rng, g):
    nvfp4 = pytest.importorskip("jax_m3sparse.nvfp4")
    x = np.concatenate([adversarial_groups(rng), rng.standard_normal((2048, 16)).astype(f32) * 4])
    d1, s1 = kernel_quantize(x, g)
    data, scales = nvfp4.nvfp4_quantize(x.reshape(-1, 16), np.float32(g))
    assert np.array_equal(s1, np.asarray(scales).view(np.uint8).reshape(-1))
    assert np.array_equal(d1, np.asarray(data).reshape(-1, 8))
