"""write_index_keys (SPEC §8.1): the CPU handler against a NumPy oracle written here (bf16 and
float8_e4m3fn rounding by ml_dtypes, saturation, NaN, padding slots, layers out of range) and
the jnp reference bit for bit; in place with donation (no copy of the cache in the compiled
program); trace-time errors; vmap and export."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_m3sparse as m3
from jax_m3sparse import reference

NATIVE = "cpu" in m3.native_platforms()
DTYPES = {"bf16": (jnp.bfloat16, ml_dtypes.bfloat16), "fp8": (jnp.float8_e4m3fn,
                                                              ml_dtypes.float8_e4m3fn)}


def oracle(cache, keys, slots, layer):
    """The SPEC rule, one token at a time in NumPy (later tokens overwrite earlier ones)."""
    out = np.array(cache)
    L, P, N, _ = out.shape
    if not 0 <= layer < L:
        return out
    x = np.asarray(keys, np.float32)
    if out.dtype == ml_dtypes.float8_e4m3fn:
        x = np.clip(x, -448, 448)
    for t, s in enumerate(np.asarray(slots)):
        if 0 <= s < P * N:
            out[layer, s // N, s % N] = x[t].astype(out.dtype)
    return out


def keys_with_edges(rng, T, Di):
    """Normal keys over a wide exponent range, plus E4M3 edge values: above 448, ties between
    fp8 values, subnormals, ±0, NaN, ±inf."""
    x = rng.normal(size=(T, Di)) * 2.0 ** rng.integers(-12, 10, size=(T, Di))
    edges = [500.0, -1e6, 464.0, 449.0, 2.0 ** -10, 3 * 2.0 ** -11, 2.0 ** -7 * 1.0625, -0.0,
             np.nan, np.inf, -np.inf, 1.0 + 2 ** -4, 1.0 + 3 * 2 ** -4]
    x[0, :len(edges)] = edges
    return jnp.asarray(x, jnp.float32)


@pytest.mark.skipif(not NATIVE, reason="the CPU module is not built")
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("key_dtype", [jnp.float32, jnp.bfloat16])
def test_matches_oracle_and_reference(rng, kind, key_dtype):
    jdt, npdt = DTYPES[kind]
    L, P, N, Di, T = 3, 5, 128, 64, 40
    cache = jnp.asarray(rng.normal(size=(L, P, N, Di)), jdt)
    keys = keys_with_edges(rng, T, Di).astype(key_dtype)
    slots = rng.integers(0, P * N, T).astype(np.int32)
    slots[3], slots[5], slots[7] = -1, P * N, -(2 ** 31)        # padding, past the pool
    slots = jnp.asarray(slots)
    for layer in (0, 2):
        got = jax.jit(lambda c, k, s, l: m3.write_index_keys(c, k, s, layer=l))(
            cache, keys, slots, jnp.int32(layer))
        want = oracle(np.asarray(cache).astype(npdt), keys, slots, layer)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8 if kind == "fp8" else
                                                           np.uint16),
                                      want.view(np.uint8 if kind == "fp8" else np.uint16))
        ref = reference.write_index_keys(cache, keys, slots, jnp.int32(layer))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


@pytest.mark.skipif(not NATIVE, reason="the CPU module is not built")
def test_layers_out_of_range_write_nothing_and_3d_cache(rng):
    cache = jnp.asarray(rng.normal(size=(2, 3, 128, 32)), jnp.bfloat16)
    keys = jnp.asarray(rng.normal(size=(4, 32)), jnp.float32)
    slots = jnp.asarray([0, 5, 200, 383], jnp.int32)
    f = jax.jit(lambda c, l: m3.write_index_keys(c, keys, slots, layer=l))
    for bad in (-1, 2, 7):
        np.testing.assert_array_equal(np.asarray(f(cache, jnp.int32(bad))), np.asarray(cache))
    one = m3.write_index_keys(cache[1], keys, slots)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(f(cache, jnp.int32(1)))[1])


@pytest.mark.skipif(not NATIVE, reason="the CPU module is not built")
def test_donation_aliases_without_copy(rng):
    """In place: the compiled program aliases the cache and copies none of it."""
    cache = jnp.asarray(rng.normal(size=(2, 64, 128, 128)), jnp.bfloat16)
    keys = jnp.asarray(rng.normal(size=(4, 128)), jnp.bfloat16)
    slots = jnp.asarray([1, 700, -1, 8000], jnp.int32)
    fn = lambda c, k, s: m3.write_index_keys(c, k, s, layer=jnp.int32(1))
    expected = np.asarray(jax.jit(fn)(cache, keys, slots))
    donated = jax.jit(fn, donate_argnums=0)
    hlo = donated.lower(cache, keys, slots).compile().as_text()
    assert "input_output_alias" in hlo and "output_to_operand_aliasing" in hlo
    assert " copy(" not in hlo and "copy-start" not in hlo and " convert(" not in hlo
    np.testing.assert_array_equal(np.asarray(donated(jnp.array(cache), keys, slots)), expected)


def test_errors():
    cache = jnp.zeros((2, 3, 128, 32), jnp.bfloat16)
    keys, slots = jnp.zeros((4, 32)), jnp.zeros(4, jnp.int32)
    cases = [
        (lambda: m3.write_index_keys(cache, keys, slots), ValueError, "layer is required"),
        (lambda: m3.write_index_keys(cache[0], keys, slots, layer=0), ValueError, "must be None"),
        (lambda: m3.write_index_keys(cache, keys, slots, layer=2), ValueError, r"in \[0, 2\)"),
        (lambda: m3.write_index_keys(cache, keys[:, :16], slots, layer=0), ValueError, r"keys has Di = 16 but idx_k_cache .* has Di = 32"),
        (lambda: m3.write_index_keys(cache, keys, slots[:3], layer=0), ValueError, "slot_mapping"),
        (lambda: m3.write_index_keys(cache.astype(jnp.float32), keys, slots, layer=0),
         (TypeError, ValueError), "idx_k_cache"),
        (lambda: m3.write_index_keys(cache, keys.astype(jnp.int32), slots, layer=0),
         (TypeError, ValueError), "keys"),
        (lambda: m3.write_index_keys(cache, keys[0], slots, layer=0), ValueError, "keys must have rank 2"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


def test_vmap_and_export(rng):
    cache = jnp.asarray(rng.normal(size=(2, 1, 2, 128, 16)), jnp.bfloat16)   # [B, L, P, N, Di]
    keys = jnp.asarray(rng.normal(size=(2, 3, 16)), jnp.float32)
    slots = jnp.asarray([[0, 1, 2], [255, -1, 7]], jnp.int32)
    got = jax.vmap(lambda c, k, s: m3.write_index_keys(c, k, s, layer=jnp.int32(0)))(
        cache, keys, slots)
    for b in range(2):
        np.testing.assert_array_equal(
            np.asarray(got[b]), np.asarray(reference.write_index_keys(cache[b], keys[b], slots[b], 0)))
    exp = jax.export.export(jax.jit(lambda c, k, s: m3.write_index_keys(c, k, s, layer=0)),
                            platforms=["cpu", "cuda"],
                            disabled_checks=m3.export_disabled_checks())(cache[0], keys[0], slots[0])
    assert exp.platforms == ("cpu", "cuda")
