"""pack_kv_pages: quantize new K/V tokens to NVFP4 and write them into the cache, in place."""

from __future__ import annotations

import jax.numpy as jnp

from jax_m3sparse import _checks, reference
from jax_m3sparse._primitives import HeadAxes, define_primitive, i64


def _abstract_eval(kv_cache, key, value, slot_mapping, k_scale, v_scale, layer, *, layout):
    return kv_cache.update(weak_type=False)


pack_kv_pages_p = define_primitive(
    "pack_kv_pages",
    abstract_eval=_abstract_eval,
    reference=reference.pack_impl,
    attributes=lambda layout: {"layout": i64(layout)},
    operand_output_aliases={0: 0},
    # KV heads: cache head slots (2h, 2h+1), q/out and key/value axis 1, topk axis 0.
    head_axes=HeadAxes(operands=(-3, -2, -2, None, None, None, None), results=(0,), cache=0),
)


def pack_kv_pages(kv_cache, key, value, slot_mapping, k_scale, v_scale, *, layer=None,
                  layout=None):
    """Quantizes ``key``/``value`` to NVFP4 and writes them at ``slot_mapping``, in place.

    Semantics: SPEC §2.2 (bit-exact quantization), §3.2 (page map), §3.3 (layers),
    §3.4 (slots). The result aliases ``kv_cache`` (``input_output_aliases``): donate the
    cache (``jax.jit(..., donate_argnums=...)``) and no copy of it is made.

    Args:
      kv_cache: ``uint8[P, 2Hkv, N, C]`` (one layer) or 5-D ``[L, P, 2Hkv, N, C]`` ("LBHNC")
        / ``[P, L, 2Hkv, N, C]`` ("BLHNC"); C = D/2 + D/16 bytes (72 for D = 128).
      key, value: ``[T, Hkv, D]`` float32/bfloat16/float16, the same dtype.
      slot_mapping: ``int32[T]``, ``page · N + offset`` per token. A slot < 0 (padding) or
        ≥ P·N writes nothing.
      k_scale, v_scale: fp32 scalars g (dequantization multipliers; may be traced). A
        non-finite or non-positive g writes NaN groups (scale byte 0x7F, codes 0).
      layer: int32 scalar (may be traced, e.g. in ``lax.scan``); required iff the cache
        is 5-D. A jax.Array layer outside ``[0, L)`` writes nothing (SPEC §3.3); a static
        one (Python / NumPy int) there is a ValueError.
      layout: "LBHNC" or "BLHNC", required for a 5-D cache (ValueError without it: the shape
        cannot say which); ignored for a 4-D one.

    Returns:
      The cache with every written token's 64 data + 8 scale bytes per head slot updated;
      every other byte unchanged.

    Raises:
      ValueError / TypeError at trace time for wrong ranks, shapes, dtypes, a missing or
      superfluous ``layer``, a static ``layer`` outside ``[0, L)``, or an unknown ``layout``;
      the message names the argument, the expected and the actual value.
    """
    kv_cache, key, value, slot_mapping = _checks.index_arrays(
        kv_cache=kv_cache, key=key, value=value, slot_mapping=slot_mapping)
    layer_op, code, _, _, num_slots, _, head_dim = _checks.cache_geometry(kv_cache, layer, layout)
    _checks.rank(key, "key", 3, "[T, Hkv, D]")
    _checks.dtype(key, "key", _checks.FLOAT_DTYPES)
    if value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError(f"value must match key ({key.dtype}{list(key.shape)}), "
                         f"got {value.dtype}{list(value.shape)}")
    _checks.dim("key", "Hkv (kv_cache head slots / 2)", num_slots // 2, key.shape[1])
    _checks.dim("key", "D (from the kv_cache row width)", head_dim, key.shape[2])
    _checks.rank(slot_mapping, "slot_mapping", 1, "[T]")
    _checks.dtype(slot_mapping, "slot_mapping", (jnp.int32,))
    _checks.dim("slot_mapping", "length (T of key)", key.shape[0], slot_mapping.shape[0])
    return pack_kv_pages_p.bind(kv_cache, key, value, slot_mapping,
                                _checks.scalar(k_scale, "k_scale", jnp.float32),
                                _checks.scalar(v_scale, "v_scale", jnp.float32),
                                layer_op, layout=code)


def unpack_kv_pages(kv_cache, page_ids, k_scale, v_scale, *, layer=None, layout=None):
    """Dequantizes whole pages of a cache (for debugging, oracles, inspecting a cache).

    Args:
      kv_cache: as in :func:`pack_kv_pages`.
      page_ids: ``int32[n]`` page indices; ids outside ``[0, P)`` give zeros.
      k_scale, v_scale: fp32 global scales g.
      layer: int32 scalar, required iff the cache is 5-D (outside ``[0, L)``: zeros for a
        jax.Array, ValueError for a static int).
      layout: "LBHNC" or "BLHNC", required for a 5-D cache (ValueError without it); None
        for a 4-D one.

    Returns:
      ``(key, value)``, float32 ``[n, Hkv, N, D]`` each: every token slot of the pages,
      whatever was written there (SPEC §2.1, §3.2).

    Raises:
      ValueError / TypeError at trace time, as :func:`pack_kv_pages`.
    """
    kv_cache, page_ids = _checks.index_arrays(kv_cache=kv_cache, page_ids=page_ids)
    _checks.cache_geometry(kv_cache, layer, layout)
    _checks.rank(page_ids, "page_ids", 1, "[n]")
    _checks.dtype(page_ids, "page_ids", (jnp.int32,))
    return reference.unpack_kv_pages(kv_cache, page_ids,
                                     _checks.scalar(k_scale, "k_scale", jnp.float32),
                                     _checks.scalar(v_scale, "v_scale", jnp.float32),
                                     layer=layer, layout=layout)
