"""FP4 weights for :func:`jax_m3sparse.grouped_matmul` (SPEC §9.3): E2M1 elements packed two per
byte (element 2i in the low nibble) with one scale per group of inputs —

* **MXFP4** (OCP Microscaling; ``amd/MiniMax-M3-MXFP4``): one E8M0 exponent per 32 inputs,
  ``w = e2m1 · 2^(e − 127)``;
* **NVFP4** (``nvidia/MiniMax-M3-NVFP4``'s routed experts): one E4M3 scale per 16 inputs,
  ``w = e2m1 · scale``; the checkpoint's per-tensor ``weight_scale_2`` multiplies the product
  afterwards (a scalar per expert: the caller's, see grouped_matmul).

:func:`fp4_dequantize` is the weight every backend multiplies, bit for bit; :func:`mxfp4_quantize`
makes MXFP4 weights (NVFP4 ones: :func:`jax_m3sparse.nvfp4_quantize`).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_m3sparse.mxfp8 import _FP32_NORMAL_MIN, _blocks, _exponent_factors, _scaled
from jax_m3sparse.nvfp4 import E2M1_MAX, E2M1_VALUES, e2m1_codes

MX_BLOCK = 32              # inputs per E8M0 exponent (MXFP4)
NV_BLOCK = 16              # inputs per E4M3 scale (NVFP4)


def fp4_block(data, scales):
    """Inputs per scale of packed FP4 ``data [..., K/2]`` with ``scales [..., K/B]``: 32 for
    uint8 (E8M0, MXFP4) scales, 16 for float8_e4m3fn (NVFP4) ones.

    Raises:
      TypeError / ValueError: another dtype, or shapes that disagree.
    """
    if data.dtype != jnp.uint8:
        raise TypeError(f"packed FP4 data must be uint8 (two E2M1 codes per byte), got {data.dtype}")
    if scales.dtype == jnp.uint8:
        block, what = MX_BLOCK, "uint8 E8M0 exponents (MXFP4)"
    elif scales.dtype == jnp.float8_e4m3fn:
        block, what = NV_BLOCK, "float8_e4m3fn scales (NVFP4)"
    else:
        raise TypeError(f"FP4 scales must be uint8 (E8M0, MXFP4) or float8_e4m3fn (NVFP4), got "
                        f"{scales.dtype}")
    K = 2 * data.shape[-1] if data.ndim else 0
    if data.ndim == 0 or K % block or scales.shape != (*data.shape[:-1], K // block):
        raise ValueError(f"packed FP4 data [..., K/2] and {what} [..., K/{block}] disagree "
                         f"(the leading dims must be equal, K/{block} = "
                         f"{K // block if data.ndim else '?'}): data.shape {data.shape}, "
                         f"scales.shape {scales.shape}")
    return block


def fp4_dequantize(data, scales, dtype=jnp.bfloat16):
    """The weights of packed FP4 ``data`` (SPEC §9.3): ``e2m1 · 2^(e − 127)`` per 32 inputs
    for uint8 E8M0 ``scales`` (MXFP4), ``e2m1 · scale`` per 16 for float8_e4m3fn ``scales``
    (NVFP4, without its per-tensor ``weight_scale_2``).

    MXFP4 products below fp32's smallest normal (2^-126) are ±0, as for MXFP8 (SPEC §9.1); an
    exponent of 255 is NaN. NVFP4 products are exact (at most 6 significant bits, inside bf16's
    normal range); a NaN scale (0x7F / 0xFF) gives NaN. Either rounds to bf16 exactly.

    Args:
      data: ``uint8[..., K/2]``, element 2i in the low nibble of byte i (bit 3 the sign).
      scales: ``uint8[..., K/32]`` or ``float8_e4m3fn[..., K/16]``.
      dtype: result dtype (default bfloat16, what grouped_matmul multiplies).

    Returns:
      ``dtype[..., K]``.

    Raises:
      TypeError / ValueError at trace time: wrong dtypes or shapes that disagree.
    """
    data, scales = jnp.asarray(data), jnp.asarray(scales)
    block = fp4_block(data, scales)
    table = jnp.asarray(E2M1_VALUES)
    values = jnp.stack([table[data & 15], table[data >> 4]], axis=-1)
    values = values.reshape(*data.shape[:-1], 2 * data.shape[-1])
    if block == NV_BLOCK:
        x = values * jnp.repeat(scales.astype(jnp.float32), block, axis=-1)
        return x.astype(dtype)
    hi, lo = (jnp.repeat(f, block, axis=-1) for f in _exponent_factors(scales))
    x = (values * hi) * lo
    x = jnp.where(jnp.abs(x) < jnp.float32(_FP32_NORMAL_MIN), jnp.copysign(0.0, x), x)
    return x.astype(dtype)


def mxfp4_quantize(x):
    """MXFP4 of ``x`` along its last axis: per block of 32, the smallest exponent that keeps the
    block in E2M1's range, ``e = clamp(ceil(log2(max|x| / 6)) + 127, 0, 254)`` with the ratio in
    fp32 (127 for an all-zero block; the rule :func:`jax_m3sparse.mxfp8_quantize` uses, so no
    element clips), and the elements ``x / 2^(e − 127)`` rounded to E2M1 (to nearest even),
    saturating at ±6, packed two per byte. A NaN makes its block's codes 0 and its exponent 255
    (NaN); ±inf saturates at ±6 with e = 127.

    Args:
      x: ``float32 / bfloat16 / float16[..., K]``, K a multiple of 32.

    Returns:
      ``(uint8[..., K/2], uint8[..., K/32])`` for :func:`fp4_dequantize` and
      :func:`jax_m3sparse.grouped_matmul`.

    Raises:
      TypeError / ValueError at trace time: a non-float ``x`` or K not a multiple of 32.
    """
    x, blocks = _blocks(x)
    nan = jnp.any(jnp.isnan(blocks), axis=-1)
    amax = jnp.max(jnp.where(jnp.isinf(blocks), 0, jnp.abs(blocks)), axis=-1)
    amax = jnp.where(jnp.any(jnp.isinf(blocks), axis=-1), 0, amax)
    e, y = _scaled(blocks, amax, E2M1_MAX)
    codes = jnp.where(nan[..., None], 0, e2m1_codes(y)).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    data = (codes[..., 0] | (codes[..., 1] << 4)).astype(jnp.uint8)
    return data, jnp.where(nan, 255, e).astype(jnp.uint8)
