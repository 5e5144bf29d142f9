"""MXFP8 weights (SPEC §9.1): mxfp8_dequantize against an oracle that decodes the fp8 bits
itself (tests/support/oracle.py), every fp8 code and the E8M0 edge cases; mxfp8_quantize's
scale rule and error bound; trace-time errors."""

import jax.numpy as jnp
import numpy as np
import pytest

import jax_m3sparse as m3

import oracle


def test_dequantize_every_code_and_scale():
    """All 256 fp8 codes under exponents 0 (2^-127, products below 2^-126 flushed), 1, 100,
    127, 200, 254 and 255 (NaN)."""
    codes = np.arange(256, dtype=np.uint8).reshape(8, 32)
    for e in (0, 1, 100, 127, 200, 254, 255):
        data = jnp.asarray(codes).view(jnp.float8_e4m3fn)
        scale = jnp.full((8, 1), e, jnp.uint8)
        got = np.asarray(m3.mxfp8_dequantize(data, scale), np.float64)
        want = oracle.mxfp8_weights(codes, np.full((8, 1), e))
        np.testing.assert_array_equal(got, want, err_msg=f"e = {e}")
        real = ~np.isnan(want)   # and the signs of zeros
        assert np.array_equal(np.signbit(got[real]), np.signbit(want[real])), e


def test_quantize_scale_rule_and_bound(rng):
    """e = ceil(log2(amax / 448)) + 127 per block of 32: the block's largest element lands in
    (224, 448], nothing clips, and every element is within half an fp8 ulp (2^-4 relative)."""
    x = rng.normal(size=(16, 128)) * 2.0 ** rng.integers(-20, 20, (16, 4)).repeat(32, axis=1)
    data, scale = m3.mxfp8_quantize(jnp.asarray(x, jnp.float32))
    assert data.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.uint8 and scale.shape == (16, 4)
    amax = np.abs(np.asarray(x, np.float32)).reshape(16, 4, 32).max(-1)
    e = np.asarray(scale).astype(np.int64) - 127
    assert np.all(amax <= 448 * 2.0 ** e) and np.all(amax > 224 * 2.0 ** e)
    back = oracle.mxfp8_weights(data, scale)
    assert np.all(np.abs(back - x) <= 2.0 ** -4 * np.abs(x) + 2.0 ** (e.repeat(32, 1) - 9))


def test_quantize_zero_block_and_nan():
    x = np.zeros((2, 64), np.float32)
    x[1, 3] = np.nan
    data, scale = m3.mxfp8_quantize(jnp.asarray(x))
    assert int(scale[0, 0]) == 127 and not np.any(np.asarray(data[0], np.float32))
    assert np.isnan(np.asarray(data[1, 3], np.float32))


@pytest.mark.parametrize("data, scale, error, match", [
    (jnp.zeros((2, 32), jnp.bfloat16), jnp.zeros((2, 1), jnp.uint8), TypeError, "float8_e4m3fn"),
    (jnp.zeros((2, 32), jnp.float8_e4m3fn), jnp.zeros((2, 1), jnp.int8), TypeError, "uint8"),
    (jnp.zeros((2, 48), jnp.float8_e4m3fn), jnp.zeros((2, 1), jnp.uint8), ValueError, "disagree"),
    (jnp.zeros((2, 64), jnp.float8_e4m3fn), jnp.zeros((2, 1), jnp.uint8), ValueError, "disagree"),
])
def test_dequantize_errors(data, scale, error, match):
    with pytest.raises(error, match=match):
        m3.mxfp8_dequantize(data, scale)


def test_quantize_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        m3.mxfp8_quantize(jnp.zeros((2, 40)))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        m3.mxfp8_quantize(jnp.zeros((2, 32), jnp.int32))
