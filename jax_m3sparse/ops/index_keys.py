"""write_index_keys: this step's index keys into the key-only paged index cache, in place."""

from __future__ import annotations

import jax.numpy as jnp

from jax_m3sparse import _checks, reference
from jax_m3sparse._primitives import define_primitive


def _abstract_eval(idx_k_cache, keys, slot_mapping, layer):
    return idx_k_cache.update(weak_type=False)


# CPU: an FFI handler writing the keys' rows where they go (XLA's CPU scatter into a bf16
# buffer converted the whole cache to f32 and back: O(pool) per layer). GPUs lower to the
# reference, whose scatter XLA runs in place there.
write_index_keys_p = define_primitive(
    "write_index_keys",
    abstract_eval=_abstract_eval,
    reference=reference.write_index_keys_impl,
    attributes=lambda: {},
    operand_output_aliases={0: 0},
    native_platforms=("cpu",),
)


def write_index_keys(idx_k_cache, keys, slot_mapping, *, layer=None):
    """Writes one index key per token into the key-only paged index cache, in place (SPEC §8.1).

    Token t's key goes to page ``slot_mapping[t] // N``, offset ``slot_mapping[t] % N`` (the
    K/V cache's slots, SPEC §3.4), of layer ``layer``, converted to the cache's dtype: bfloat16
    rounded to nearest even; float8_e4m3fn clamped to ±448 first (E4M3 has no infinity), then
    rounded to nearest even (NaN stays NaN). Write before :func:`select_blocks` of the same
    layer: a token's own block scores its own key. The result aliases ``idx_k_cache``
    (``input_output_aliases``): donate the cache and no copy of it is made.

    Args:
      idx_k_cache: ``[P, N, Di]`` or ``[L, P, N, Di]``, bfloat16 or float8_e4m3fn.
      keys: ``[T, Di]`` float32 or bfloat16 (normed, RoPE'd; an FP8 cache's keys already
        divided by its global scale, SPEC §8 step 5).
      slot_mapping: ``int32[T]``; a slot < 0 (padding) or ≥ P·N writes nothing.
      layer: int32 scalar (may be traced), required iff the cache is 4-D; a jax.Array layer
        outside ``[0, L)`` writes nothing, a static one there is a ValueError.

    Returns:
      The cache with every written token's Di values replaced; every other byte unchanged.
      Two tokens with one slot leave one of their keys there (which one is unspecified).

    Raises:
      ValueError / TypeError at trace time for wrong ranks, shapes or dtypes, a missing or
      superfluous ``layer``, a static ``layer`` outside ``[0, L)``.
    """
    idx_k_cache, keys, slot_mapping = _checks.index_arrays(
        idx_k_cache=idx_k_cache, keys=keys, slot_mapping=slot_mapping)
    _checks.rank(keys, "keys", 2, "[T, Di]")
    _checks.dtype(keys, "keys", (jnp.float32, jnp.bfloat16))
    layer_op = _checks.index_cache(idx_k_cache, layer, keys.shape[1], "keys")
    _checks.rank(slot_mapping, "slot_mapping", 1, "[T]")
    _checks.dtype(slot_mapping, "slot_mapping", (jnp.int32,))
    _checks.dim("slot_mapping", "length (T of keys)", keys.shape[0], slot_mapping.shape[0])
    cache4 = idx_k_cache if idx_k_cache.ndim == 4 else idx_k_cache[None]
    out = write_index_keys_p.bind(cache4, keys, slot_mapping, layer_op)
    return out if idx_k_cache.ndim == 4 else out[0]
