"""NVFP4 quantization is bit-exact to SPEC §2.2, on every path (jnp, CPU FFI pack)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_m3sparse as m3
from jax_m3sparse import reference

import oracle

D = 32


def quantize_all_paths(x, g):
    """(data, scale bytes) from nvfp4_quantize and from packing through the FFI and reference."""
    x = jnp.asarray(x)
    d, s = jax.jit(m3.nvfp4_quantize)(x, g)
    results = [(np.asarray(d), np.asarray(jax.lax.bitcast_convert_type(s, jnp.uint8)))]
    T = x.shape[0]
    cache = m3.allocate_kv_cache(m3.KVCacheSpec(1, D), -(-T // 128))
    kv = x.reshape(T, 1, D)
    for fn in (m3.pack_kv_pages, reference.pack_kv_pages):
        c = np.asarray(jax.jit(fn)(cache, kv, kv, jnp.arange(T, dtype=jnp.int32), g, 1.0))
        tiles = c[:, 0].reshape(-1, 128 * (D // 2 + D // 16))
        data = tiles[:, :128 * D // 2].reshape(-1, D // 2)[:T]
        sc = tiles[:, 128 * D // 2:].reshape(-1, D // 16)[:T]
        results.append((data, sc))
    return results


def assert_bit_exact(x, g):
    want_d, want_s = oracle.quantize(np.asarray(x), g)
    for path, (d, s) in zip(("nvfp4_quantize", "pack (native)", "pack (reference)"),
                            quantize_all_paths(x, g)):
        np.testing.assert_array_equal(s, want_s, err_msg=f"{path}: scale bytes")
        np.testing.assert_array_equal(d, want_d, err_msg=f"{path}: data bytes")


magnitudes = st.floats(min_value=float(np.float32(1e-30)), max_value=float(np.float32(1e30)), width=32)
values = st.builds(lambda m, s: m * s, magnitudes, st.sampled_from([1.0, -1.0])) | st.just(0.0)


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.lists(values, min_size=D, max_size=D), min_size=1, max_size=4),
       g=st.sampled_from([1.0, 0.75, None]))
def test_hypothesis_magnitudes(rows, g):
    x = np.array(rows, np.float32)
    if g is None:  # the calibrated convention g = amax / (6 · 448)
        g = float(np.float32(np.abs(x).max() / (6 * 448))) or 1.0
    assert_bit_exact(x, g)


def test_every_tie_and_saturation():
    # amax 6 and g 1 give the scale exactly 1, so y = x: every E2M1 tie of SPEC §2.2.
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32)
    group_ties = np.concatenate([ties, -ties])
    # amax 6.3 gives s = 1.05, which rounds to the scale 1.0, so y = ±6.3 saturates to ±6.
    group_sat = np.array([6.3, -6.3] + [0.1] * 14, np.float32)
    x = np.concatenate([group_ties, group_sat])[None]
    assert_bit_exact(np.concatenate([x, -x]), 1.0)
    d, s = oracle.quantize(x, 1.0)
    codes = np.stack([d & 15, d >> 4], -1).reshape(-1)
    # The oracle itself: 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4, 6→6; −0.25 → +0.
    assert list(codes[:16]) == [0, 2, 2, 4, 4, 6, 6, 7, 0, 10, 10, 12, 12, 14, 14, 15]
    assert list(codes[16:18]) == [7, 15] and list(s[0]) == [0x38, 0x38]


def test_zeros_negative_zero_nan_inf():
    x = np.zeros((4, D), np.float32)
    x[1] = -0.0
    x[2, 3] = np.nan                       # NaN group: scale 0x7F, codes 0
    x[3, :16] = 1.0
    x[3, 5] = np.inf                       # ±Inf saturates: scale 448, element ±6
    x[3, 16:] = -np.inf
    assert_bit_exact(x, 1.0)
    d, s = oracle.quantize(x, 1.0)
    assert (d[1] == 0).all() and s[2, 0] == 0x7F and s[2, 1] != 0x7F
    assert s[3, 0] == np.array(448, np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_inputs(rng, dtype):
    x = (rng.standard_normal((64, D)) * rng.choice([1e-3, 1, 50], (64, 1))).astype(dtype)
    assert_bit_exact(x, 1.0)
    assert_bit_exact(x, 0.75)


@pytest.mark.parametrize("g", [0.0, -1.0, np.inf, np.nan])
def test_invalid_global_scale_gives_nan_groups(rng, g):
    x = rng.standard_normal((3, D)).astype(np.float32)
    assert_bit_exact(x, g)
    for d, s in quantize_all_paths(x, g):
        assert (s == 0x7F).all() and (d == 0).all()


def test_e4m3_rounding_agrees_with_torch(rng):
    """A second, independent E4M3 rounding (torch) for the block scales."""
    torch = pytest.importorskip("torch")
    amax = np.exp(rng.uniform(-12, 8, 4096)).astype(np.float32)
    x = np.zeros((4096, D), np.float32)
    x[:, 0] = amax
    _, s = jax.jit(m3.nvfp4_quantize)(x, 1.0)
    want = torch.from_numpy(np.clip(amax / np.float32(6), 2.0 ** -9, 448)).to(torch.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(s, jnp.uint8))[:, 0],
                                  want.view(torch.uint8).numpy())


def test_dequantize_round_trip(rng):
    x = rng.standard_normal((8, 64)).astype(np.float32)
    d, s = m3.nvfp4_quantize(x, 0.5)
    got = np.asarray(m3.nvfp4_dequantize(d, s, 0.5))
    want = oracle.dequantize(np.asarray(d), np.asarray(jax.lax.bitcast_convert_type(s, jnp.uint8)), 0.5)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    cos, rel = oracle.metrics(got, x)
    assert rel < 0.15 and cos > 0.99


def test_quantize_errors():
    with pytest.raises(ValueError, match=r"D % 16 == 0, got shape \(2, 20\)"):
        m3.nvfp4_quantize(jnp.zeros((2, 20)), 1.0)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16, got int32"):
        m3.nvfp4_quantize(jnp.zeros((2, 32), jnp.int32), 1.0)
