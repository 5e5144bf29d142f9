"""MXFP8 weights (SPEC §9.1): fp8 e4m3 elements with one E8M0 exponent per 32 along the
contracted axis — the format of ``MiniMaxAI/MiniMax-M3-MXFP8`` (OCP Microscaling v1.0).

:func:`mxfp8_dequantize` is the value every backend's :func:`jax_m3sparse.grouped_matmul` uses
for MXFP8 weights, bit for bit; :func:`mxfp8_quantize` makes such weights from bf16 / fp32 ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 32                 # elements per E8M0 exponent
E4M3_MAX = 448.0
SCALE_NAN = 255            # E8M0 0xFF reads as NaN
_FP32_NORMAL_MIN = 2.0 ** -126


def _exponent_factors(scales):
    """``2^(e − 127)`` as two fp32 factors whose product it is, each normal (e = 0's 2^-127 is
    a subnormal, which runtimes that flush subnormals would read as 0): (2^-64, 2^-63) for
    e = 0, (NaN, 1) for e = 255, else (2^(e − 127), 1)."""
    e = scales.astype(jnp.uint32)
    hi = jax.lax.bitcast_convert_type(e << 23, jnp.float32)
    hi = jnp.where(e == 0, jnp.float32(2.0 ** -64), hi)
    hi = jnp.where(e == SCALE_NAN, jnp.float32(jnp.nan), hi)
    lo = jnp.where(e == 0, jnp.float32(2.0 ** -63), jnp.float32(1.0))
    return hi, lo


def mxfp8_dequantize(data, scales, dtype=jnp.bfloat16):
    """``w = fp8 · 2^(e − 127)`` per block of 32 along the last axis (SPEC §9.1).

    The product is exact in fp32 except where it falls below fp32's smallest normal, 2^-126:
    such values are ±0 (the kernels multiply with flush-to-zero), so the result is the same on
    every backend. Rounded to ``dtype`` at the end (bf16 holds every normal product exactly).

    Args:
      data: ``float8_e4m3fn[..., K]``.
      scales: ``uint8[..., K/32]``, E8M0 exponents (the checkpoints' ``weight_scale_inv``);
        255 is NaN.
      dtype: result dtype (default bfloat16, what grouped_matmul multiplies).

    Returns:
      ``dtype[..., K]``.

    Raises:
      TypeError / ValueError at trace time: wrong dtypes, K not a multiple of 32, or shapes
      that disagree.
    """
    data, scales = jnp.asarray(data), jnp.asarray(scales)
    if data.dtype != jnp.float8_e4m3fn:
        raise TypeError(f"data must be float8_e4m3fn, got {data.dtype}")
    if scales.dtype != jnp.uint8:
        raise TypeError(f"scales must be uint8 (E8M0 exponents), got {scales.dtype}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got {jnp.dtype(dtype)}")
    K = data.shape[-1] if data.ndim else 0
    if data.ndim == 0 or K % BLOCK or scales.shape != (*data.shape[:-1], K // BLOCK):
        raise ValueError(f"data [..., K] (K % {BLOCK} == 0) and scales [..., K/{BLOCK}] "
                         f"disagree: {data.shape} vs {scales.shape}")
    hi, lo = _exponent_factors(scales)
    hi, lo = (jnp.repeat(f, BLOCK, axis=-1) for f in (hi, lo))
    x = (data.astype(jnp.float32) * hi) * lo
    x = jnp.where(jnp.abs(x) < jnp.float32(_FP32_NORMAL_MIN), jnp.copysign(0.0, x), x)
    return x.astype(dtype)


def mxfp8_quantize(x):
    """MXFP8 of ``x`` along its last axis: per block of 32, the smallest exponent that keeps the
    block in fp8's range, ``e = clamp(ceil(log2(max|x| / 448)) + 127, 0, 254)`` with the ratio
    in fp32 (127 for an all-zero block; the scale NVIDIA ModelOpt's MXFP8 export chooses:
    OCP's floor(log2(max|x|)) − 8 would clip the block's largest elements at 448), and the
    elements ``x / 2^(e − 127)`` rounded to fp8 e4m3 (to nearest even), saturating at ±448.
    Non-finite input: a NaN element stays NaN; a block holding a NaN or ±inf gets e = 127
    (its finite elements then saturate at ±448); blocks whose largest element is within 2^-9
    of fp32's range (e would exceed 254) saturate likewise.

    Args:
      x: ``float32 / bfloat16 / float16[..., K]``, K a multiple of 32.

    Returns:
      ``(float8_e4m3fn[..., K], uint8[..., K/32])`` for :func:`mxfp8_dequantize` and
      :func:`jax_m3sparse.grouped_matmul`.

    Raises:
      TypeError / ValueError at trace time: a non-float ``x`` or K not a multiple of 32.
    """
    x, blocks = _blocks(x)
    e, y = _scaled(blocks, jnp.max(jnp.abs(blocks), axis=-1), E4M3_MAX)
    y = jnp.clip(y, -E4M3_MAX, E4M3_MAX)
    return y.astype(jnp.float8_e4m3fn).reshape(x.shape), e


def _blocks(x):
    """``(x, its fp32 blocks [..., K/32, 32])``, ``x`` checked: a float array, K % 32 == 0."""
    x = jnp.asarray(x)
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.ndim == 0 or x.shape[-1] % BLOCK:
        raise ValueError(f"x's last axis must be a multiple of {BLOCK}, got shape {x.shape}")
    return x, x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _scaled(blocks, amax, elem_max):
    """``(e, blocks / 2^(e − 127))``: each block's E8M0 exponent (uint8) by the shared rule
    e = clamp(ceil(log2(amax / elem_max)) + 127, 0, 254), 127 where amax is 0, and the block
    divided by it (the element format's largest value ``elem_max``: 448 for E4M3, 6 for E2M1)."""
    # frexp: r = m · 2^p with m in [0.5, 1): ceil(log2(r)) is p − 1 when m == 0.5, else p.
    m, p = jnp.frexp(jnp.where(amax > 0, amax, elem_max) / jnp.float32(elem_max))
    e = jnp.clip(jnp.where(m == 0.5, p - 1, p) + 127, 0, 254)
    e = jnp.where(amax > 0, e, 127).astype(jnp.uint8)
    hi, lo = _exponent_factors(e)
    return e, (blocks / hi[..., None]) / lo[..., None]
