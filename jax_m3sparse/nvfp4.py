"""The NVFP4 format on the JAX side (SPEC §2), in plain ``jax.numpy``.

These functions are the reference semantics that every backend's packing matches
bit for bit; they also serve users who want NVFP4 tensors outside the cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
SCALE_FLOOR = 2.0 ** -9
SCALE_NAN = 0x7F

# E2M1 value of each 4-bit code (bit 3 = sign), SPEC §2.1.
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                       np.float32)
# Rounding thresholds of |y| between neighbouring magnitudes; `>` rounds ties down to the even
# code, `>=` rounds them up to it (0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4).
_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)

_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


GLOBAL_SCALE_MIN = 2.0 ** -126   # smallest normal fp32
GLOBAL_SCALE_MAX = 2.0 ** 126    # the largest g whose 1/g is still normal


def inverse_global_scale(global_scale):
    """r = 1/g for 2^-126 <= g <= 2^126, else NaN (SPEC §2.2 steps 1, 5; spec_decisions.md).

    Outside that range g or 1/g is subnormal, zero, infinite or NaN, and runtimes that flush
    subnormals to zero (XLA's CPU threads) would disagree with IEEE arithmetic: every group
    quantized with such a g is a NaN group instead, on every backend.
    """
    g = jnp.asarray(global_scale, jnp.float32)
    ok = (g >= jnp.float32(GLOBAL_SCALE_MIN)) & (g <= jnp.float32(GLOBAL_SCALE_MAX))
    return jnp.where(ok, jnp.float32(1.0) / jnp.where(ok, g, 1.0), jnp.float32(jnp.nan))


def e2m1_codes(y):
    """E2M1 code (uint8, 0..15) of fp32 ``y``: ties to even, saturating, −0 stored as +0."""
    a = jnp.abs(y)
    m = sum((a > t).astype(jnp.uint8) for t in _TIES_DOWN)
    m = m + sum((a >= t).astype(jnp.uint8) for t in _TIES_UP)
    negative = jnp.signbit(y) & (m > 0)
    return jnp.where(negative, m | 8, m).astype(jnp.uint8)


def _check_float(x, name):
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def nvfp4_quantize(x, global_scale):
    """Quantizes ``x`` to NVFP4, bit-exactly as SPEC §2.2.

    The K/V cache's format, and NVFP4 weights for :func:`jax_m3sparse.grouped_matmul` (SPEC
    §9.3): ``global_scale`` is then the tensor's ``weight_scale_2`` (ModelOpt: max|w| / (6 ·
    448)); for one per expert, ``jax.vmap(nvfp4_quantize)(w, scale_2)``.

    Args:
      x: float32/bfloat16/float16 ``[..., D]``, ``D % 16 == 0``.
      global_scale: g, the fp32 dequantization multiplier (scalar: Python float, or
        0-d array, may be traced). A g outside ``[2^-126, 2^126]`` (non-positive, NaN,
        ±Inf, subnormal, or so large that 1/g is subnormal) makes every group a NaN group
        (scale byte 0x7F, codes 0).

    Returns:
      ``(data, scales)``: ``uint8[..., D/2]`` (element 2j in the low nibble of byte j)
      and ``float8_e4m3fn[..., D/16]`` (one scale per 16 elements).

    Raises:
      TypeError: x is not a float array of a supported dtype.
      ValueError: x has rank 0 or D is not a multiple of 16.
    """
    x = jnp.asarray(x)
    _check_float(x, "x")
    if x.ndim < 1 or x.shape[-1] % GROUP:
        raise ValueError(f"x must be [..., D] with D % 16 == 0, got shape {x.shape}")
    r = inverse_global_scale(global_scale)
    groups = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    nan_group = jnp.any(jnp.isnan(groups), axis=-1) | jnp.isnan(r)
    amax = jnp.max(jnp.abs(groups), axis=-1)
    # XLA rewrites `a / broadcast(b)` and `a / constant` into multiplications by a
    # reciprocal, which is not bit-exact; the barriers keep true IEEE divisions.
    six = jax.lax.optimization_barrier(jnp.full(amax.shape, E2M1_MAX, jnp.float32))
    s = (amax / six) * r
    s = jnp.clip(jnp.where(nan_group, 1.0, s), SCALE_FLOOR, E4M3_MAX)
    sf = s.astype(jnp.float8_e4m3fn)
    divisor = jax.lax.optimization_barrier(
        jnp.broadcast_to(sf.astype(jnp.float32)[..., None], groups.shape))
    y = (groups * r) / divisor
    codes = jnp.where(nan_group[..., None], 0, e2m1_codes(y)).astype(jnp.uint8)
    codes = codes.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    data = codes[..., 0] | (codes[..., 1] << 4)
    scale_bytes = jnp.where(nan_group, jnp.uint8(SCALE_NAN), jax.lax.bitcast_convert_type(sf, jnp.uint8))
    return data, jax.lax.bitcast_convert_type(scale_bytes, jnp.float8_e4m3fn)


def nvfp4_dequantize(data, scales, global_scale, dtype=jnp.float32):
    """x̂ = e2m1(code) · e4m3(scale) · g (SPEC §2.1), the product of the first two exact.

    Args:
      data: ``uint8[..., D/2]``.
      scales: ``float8_e4m3fn[..., D/16]`` (or their ``uint8`` bytes).
      global_scale: g (fp32 scalar, may be traced).
      dtype: result dtype (the math is fp32).

    Returns:
      ``dtype[..., D]``.

    Raises:
      TypeError / ValueError: on wrong dtypes or mismatched shapes.
    """
    data = jnp.asarray(data)
    scales = jnp.asarray(scales)
    if data.dtype != jnp.uint8:
        raise TypeError(f"data must be uint8, got {data.dtype}")
    if scales.dtype == jnp.uint8:
        scales = jax.lax.bitcast_convert_type(scales, jnp.float8_e4m3fn)
    if scales.dtype != jnp.float8_e4m3fn:
        raise TypeError(f"scales must be float8_e4m3fn or uint8, got {scales.dtype}")
    D = data.shape[-1] * 2
    if data.shape[:-1] != scales.shape[:-1] or scales.shape[-1] * GROUP != D:
        raise ValueError(f"data [..., D/2] and scales [..., D/16] disagree: {data.shape} vs {scales.shape}")
    table = jnp.asarray(E2M1_VALUES)
    values = jnp.stack([table[data & 15], table[data >> 4]], axis=-1).reshape(*data.shape[:-1], D)
    per_elem = jnp.repeat(scales.astype(jnp.float32), GROUP, axis=-1)
    g = jnp.asarray(global_scale, jnp.float32)
    return ((values * per_elem) * g).astype(dtype)
