"""pack_kv_pages / unpack_kv_pages: page map, layers, slots, donation, errors (SPEC §3, §7)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_m3sparse as m3
from jax_m3sparse import reference

import oracle

IMPLS = {"native": m3.pack_kv_pages, "reference": reference.pack_kv_pages}


def random_cache(rng, shape):
    return jnp.asarray(rng.integers(0, 256, shape, dtype=np.uint8))


def kv(rng, T, Hkv, D=128, dtype=jnp.bfloat16):
    return (jnp.asarray(rng.standard_normal((T, Hkv, D)), dtype),
            jnp.asarray(rng.standard_normal((T, Hkv, D)) * 3, dtype))


def test_golden_page_map():
    """Hand-placed bytes of SPEC §3.2: token t's data at t·64, its scales at 8192 + t·8."""
    spec = m3.KVCacheSpec(num_kv_heads=2)
    assert (spec.num_head_slots, spec.full_dim, spec.page_bytes) == (4, 72, 4 * 9216)
    assert m3.spec.tile_offsets(5) == (320, 8232)
    assert spec.page_offset(3, 2, num_pages=10, num_layers=4) == (2 * 10 + 3) * 4 * 9216
    assert spec.page_offset(3, 2, num_pages=10, num_layers=4, layout="BLHNC") == (3 * 4 + 2) * 4 * 9216
    flat = np.arange(4 * 10 * 4 * 128 * 72, dtype=np.int64).reshape(10, 4, 4, 128, 72)  # BLHNC
    assert flat[3, 2].ravel()[0] == spec.page_offset(3, 2, num_pages=10, num_layers=4,
                                                       layout="BLHNC")
    key = np.zeros((1, 2, 128), np.float32)
    key[0, 1, :16] = 6.0          # KV head 1: scale 1.0 (0x38), codes 7 (0x77 per byte)
    value = np.zeros((1, 2, 128), np.float32)
    value[0, 0, 16:32] = -3.0     # KV head 0, V: group 1, scale 0.5 (0x30), codes −6 → 0xF
    slot = 3 * 128 + 5            # page 3, token 5
    cache = m3.allocate_kv_cache(spec, 4)
    for name, fn in IMPLS.items():
        out = np.asarray(fn(cache, key, value, jnp.array([slot], jnp.int32), 1.0, 1.0))
        want = np.zeros_like(out)
        want[3, :, :, 64:] = 0x08          # every group of zeros: scale 2^-9 (byte 0x01)... see below
        want[3, :, :, 64:] = 0
        flat = want[3].reshape(4, -1)
        flat[:, 8192 + 5 * 8:8192 + 6 * 8] = 0x01     # all-zero groups: scale clamps to 2^-9
        flat[2, 5 * 64:5 * 64 + 8] = 0x77              # K of head 1 = slot 2
        flat[2, 8192 + 5 * 8] = 0x38
        flat[1, 5 * 64 + 8:5 * 64 + 16] = 0xFF         # V of head 0 = slot 1
        flat[1, 8192 + 5 * 8 + 1] = 0x30
        np.testing.assert_array_equal(out, want, err_msg=name)


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC", None])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_random_cache_matches_oracle(rng, impl, layout):
    """Whole-cache before/after: written slots match the oracle, every other byte is kept;
    slot −1 and slots ≥ P·N write nothing."""
    Hkv, P, L = 2, 5, 3
    spec = m3.KVCacheSpec(Hkv)
    shape = spec.cache_shape(P, None if layout is None else L, layout or "LBHNC")
    cache = random_cache(rng, shape)
    T = 40
    key, value = kv(rng, T, Hkv)
    slots = rng.choice(P * 128, T, replace=False).astype(np.int32)
    slots[:3] = [-1, P * 128, 2**31 - 1]
    layer = None if layout is None else 2
    kw = {} if layout is None else dict(layer=layer, layout=layout)
    out = jax.jit(lambda *a: IMPLS[impl](*a, **kw))(cache, key, value, slots, 0.75, 0.85)
    want = oracle.pack(np.asarray(cache), np.asarray(key, np.float32), np.asarray(value, np.float32),
                       slots, 0.75, 0.85, layer or 0, layout or "LBHNC")
    np.testing.assert_array_equal(np.asarray(out), want)


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_traced_layer_in_scan(rng, layout):
    Hkv, P, L, T = 1, 3, 4, 20
    cache = random_cache(rng, m3.KVCacheSpec(Hkv).cache_shape(P, L, layout))
    keys = jnp.asarray(rng.standard_normal((L, T, Hkv, 128)), jnp.float32)
    slots = jnp.asarray(rng.choice(P * 128, T, replace=False), jnp.int32)

    def body(c, xs):
        layer, k = xs
        return m3.pack_kv_pages(c, k, -k, slots, 1.0, 1.0, layer=layer, layout=layout), None

    out, _ = jax.jit(lambda c: jax.lax.scan(body, c, (jnp.arange(L), keys)), donate_argnums=0)(
        jnp.array(cache))
    want = np.asarray(cache)
    for layer in range(L):
        want = oracle.pack(want, np.asarray(keys[layer]), -np.asarray(keys[layer]), slots, 1.0, 1.0,
                           layer, layout)
    np.testing.assert_array_equal(np.asarray(out), want)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_layer_out_of_range_writes_nothing(rng, impl):
    cache = random_cache(rng, m3.KVCacheSpec(1).cache_shape(2, 2))
    key, value = kv(rng, 4, 1)
    for layer in (-1, 2, 1000):  # a jax.Array (may be traced); a static int raises (test_attention)
        out = IMPLS[impl](cache, key, value, jnp.arange(4, dtype=jnp.int32), 1.0, 1.0,
                          layer=jnp.int32(layer), layout="LBHNC")
        np.testing.assert_array_equal(np.asarray(out), np.asarray(cache))


def test_blhnc_cache_over_2gib(rng):
    """64-bit page offsets: a BLHNC cache of > 2³¹ bytes written near its end."""
    spec = m3.KVCacheSpec(1)
    P, L = 58500, 2
    cache = m3.allocate_kv_cache(spec, P, L, "BLHNC")
    assert cache.size > 2**31
    key, value = kv(rng, 3, 1)
    slots = jnp.array([(P - 1) * 128 + 127, (P - 2) * 128, 5], jnp.int32)
    pack = jax.jit(lambda c, k, v, s: m3.pack_kv_pages(c, k, v, s, 0.5, 2.0, layer=1, layout="BLHNC"),
                   donate_argnums=0)
    cache = pack(cache, key, value, slots)
    pages = jnp.array([P - 1, P - 2, 0], jnp.int32)
    # jitted: eager ops would copy the 2.2 GB cache (6.6 GB peak instead of 2.3 GB)
    unpack = jax.jit(lambda c, p, layer: m3.unpack_kv_pages(c, p, 0.5, 2.0, layer=layer, layout="BLHNC"))
    k_got, v_got = unpack(cache, pages, 1)
    for i, (page, tok) in enumerate(((P - 1, 127), (P - 2, 0), (0, 5))):
        kd, ks = oracle.quantize(np.asarray(key[i], np.float32), 0.5)
        np.testing.assert_array_equal(np.asarray(k_got[i, :, tok]), oracle.dequantize(kd, ks, 0.5))
        vd, vs = oracle.quantize(np.asarray(value[i], np.float32), 2.0)
        np.testing.assert_array_equal(np.asarray(v_got[i, :, tok]), oracle.dequantize(vd, vs, 2.0))
    # Layer 0 of the last page was not touched.
    k0, _ = unpack(cache, pages[:1], 0)
    assert not np.asarray(k0).any()


def test_donation_aliases_without_copy(rng):
    cache = random_cache(rng, m3.KVCacheSpec(2).cache_shape(64))
    key, value = kv(rng, 8, 2)
    slots = jnp.arange(8, dtype=jnp.int32) * 3
    fn = lambda c, k, v, s: m3.pack_kv_pages(c, k, v, s, 1.0, 1.0)
    expected = jax.jit(fn)(cache, key, value, slots)
    donated = jax.jit(fn, donate_argnums=0)
    hlo = donated.lower(cache, key, value, slots).compile().as_text()
    assert "input_output_alias" in hlo and "output_to_operand_aliasing" in hlo
    assert " copy(" not in hlo and "copy-start" not in hlo
    out = donated(jnp.array(cache), key, value, slots)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


def test_unpack_matches_oracle_and_zero_for_bad_pages(rng):
    cache = random_cache(rng, m3.KVCacheSpec(2).cache_shape(3))
    k, v = m3.unpack_kv_pages(cache, jnp.array([2, 0, -1, 3], jnp.int32), 0.75, 1.5)
    c = np.asarray(cache)
    for i, page in enumerate((2, 0)):
        for h in range(2):
            for side, got, g in ((0, k, 0.75), (1, v, 1.5)):
                tb = c[page, 2 * h + side].reshape(-1)
                want = oracle.dequantize(tb[:8192].reshape(128, 64), tb[8192:].reshape(128, 8), g)
                np.testing.assert_array_equal(np.asarray(got[i, h]), want.astype(np.float32))
    assert not np.asarray(k[2:]).any() and not np.asarray(v[2:]).any()


def test_eval_shape_export_vmap(rng):
    cache = random_cache(rng, m3.KVCacheSpec(1).cache_shape(2))
    key, value = kv(rng, 4, 1)
    slots = jnp.array([1, 2, -1, 200], jnp.int32)
    fn = lambda c, k, v, s: m3.pack_kv_pages(c, k, v, s, 1.0, 1.0)
    shape = jax.eval_shape(fn, cache, key, value, slots)
    assert shape.shape == cache.shape and shape.dtype == jnp.uint8
    exported = jax.export.export(jax.jit(fn), disabled_checks=m3.export_disabled_checks())(
        cache, key, value, slots)
    again = jax.export.deserialize(exported.serialize())
    np.testing.assert_array_equal(np.asarray(again.call(cache, key, value, slots)),
                                  np.asarray(fn(cache, key, value, slots)))
    # vmap over independent problems sharing one (unbatched) starting cache.
    keys = jnp.stack([key, 2 * key])
    out = jax.vmap(fn, in_axes=(None, 0, None, None))(cache, keys, value, slots)
    for b in range(2):
        np.testing.assert_array_equal(np.asarray(out[b]), np.asarray(fn(cache, keys[b], value, slots)))


def test_trace_time_errors(rng):
    spec = m3.KVCacheSpec(2)
    c4 = m3.allocate_kv_cache(spec, 2)
    c5 = m3.allocate_kv_cache(spec, 2, 3)
    key, value = kv(rng, 4, 2)
    s = jnp.arange(4, dtype=jnp.int32)
    cases = [
        (ValueError, "key must have rank 3 .*got shape \\(4, 256\\)",
         lambda: m3.pack_kv_pages(c4, key.reshape(4, -1), value, s, 1.0, 1.0)),
        (TypeError, "key must be float32 or bfloat16 or float16, got int32",
         lambda: m3.pack_kv_pages(c4, key.astype(jnp.int32), value.astype(jnp.int32), s, 1.0, 1.0)),
        (ValueError, "key: D \\(from the kv_cache row width\\) must be 128, got 64",
         lambda: m3.pack_kv_pages(c4, key[..., :64], value[..., :64], s, 1.0, 1.0)),
        (ValueError, "layer is required for a 5-D kv_cache",
         lambda: m3.pack_kv_pages(c5, key, value, s, 1.0, 1.0)),
        (ValueError, "layout must be one of \\('LBHNC', 'BLHNC'\\), got 'HNC'",
         lambda: m3.pack_kv_pages(c5, key, value, s, 1.0, 1.0, layer=0, layout="HNC")),
        (TypeError, "slot_mapping must be int32, got int64|slot_mapping must be int32, got float32",
         lambda: m3.pack_kv_pages(c4, key, value, s.astype(jnp.float32), 1.0, 1.0)),
        (ValueError, "slot_mapping: length \\(T of key\\) must be 4, got 3",
         lambda: m3.pack_kv_pages(c4, key, value, s[:3], 1.0, 1.0)),
        (TypeError, "kv_cache must be uint8, got float32",
         lambda: m3.pack_kv_pages(c4.astype(jnp.float32), key, value, s, 1.0, 1.0)),
        (ValueError, "k_scale must be a scalar \\(shape \\(\\)\\), got shape \\(1,\\)",
         lambda: m3.pack_kv_pages(c4, key, value, s, jnp.ones(1), 1.0)),
        (TypeError, "layer must be an integer, got float32",
         lambda: m3.pack_kv_pages(c5, key, value, s, 1.0, 1.0, layer=1.7, layout="LBHNC")),
        (ValueError, "a 5-D kv_cache needs layout='LBHNC'",
         lambda: m3.pack_kv_pages(c5, key, value, s, 1.0, 1.0, layer=0)),
        (ValueError, "a 5-D kv_cache needs layout='LBHNC'",
         lambda: m3.unpack_kv_pages(c5, jnp.zeros(1, jnp.int32), 1.0, 1.0, layer=0)),
        (ValueError, "num_pages must be an integer >= 0, got -1",
         lambda: m3.allocate_kv_cache(spec, -1)),
        (ValueError, "num_layers must be an integer >= 1, got 0",
         lambda: m3.allocate_kv_cache(spec, 2, 0)),
        (TypeError, "layer must be an integer, got bool",
         lambda: m3.pack_kv_pages(c5, key, value, s, 1.0, 1.0, layer=True, layout="LBHNC")),
    ]
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()
