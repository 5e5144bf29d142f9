"""Serving on many devices: the ``PartitionSpec`` of every operand, and KV-head replication.

Every op partitions over the KV-head axis under plain ``jax.jit`` (``_partitioning.py``): shard
the cache's head-slot axis, the head axes of q / out / key / value and axis 0 of
``topk_indices`` over one mesh axis, replicate the rest (block_table, seq_lens, slot_mapping,
positions, scales, layer). Each device then runs the native kernel on its own KV heads and XLA
inserts no collective for the op; the cache result keeps its sharding and donation aliases it.

Tensor parallel past the KV-head count (MiniMax M3: 4 KV heads at TP 8) replicates each KV head
on ``tp / Hkv`` devices, as serving stacks do. Worked example, Hq = 64, Hkv = 4, TP = 8::

    r = kv_head_replicas(4, 8)                  # 2
    spec = KVCacheSpec(4 * r)                   # the global cache holds 8 KV heads (16 slots)
    k = replicate_kv_heads(k, r)                # [T, 4, D] -> [T, 8, D]: head j is old j // 2
    topk = replicate_kv_heads(topk, r, axis=0)  # [4, T, K] -> [8, T, K]
    # query head h (of 64) reads replicated head h // 8, which holds old head h // 16: the
    # same attention; each device holds 8 query heads and 1 KV head (G = 8).

With ``tp <= Hkv`` (``tp`` must divide Hkv) no replication is needed: each device holds
``Hkv / tp`` KV heads and all their query heads (G unchanged).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jax_m3sparse.spec import KVCacheSpec


def kv_head_replicas(num_kv_heads: int, tp: int) -> int:
    """How many devices hold each KV head at tensor parallelism ``tp``.

    Returns 1 when ``tp`` divides ``num_kv_heads``, ``tp // num_kv_heads`` when
    ``num_kv_heads`` divides ``tp``. Raises ValueError otherwise (no even split exists).
    """
    if num_kv_heads < 1 or tp < 1:
        raise ValueError(f"num_kv_heads and tp must be >= 1, got {num_kv_heads}, {tp}")
    if num_kv_heads % tp == 0:
        return 1
    if tp % num_kv_heads == 0:
        return tp // num_kv_heads
    raise ValueError(f"tp = {tp} must divide num_kv_heads = {num_kv_heads} or be a multiple "
                     "of it (each device holds whole KV heads: a K/V slot pair never splits)")


def tp_cache_spec(spec: KVCacheSpec, tp: int) -> KVCacheSpec:
    """The global cache geometry at tensor parallelism ``tp``: ``spec`` with each KV head
    replicated ``kv_head_replicas(spec.num_kv_heads, tp)`` times."""
    r = kv_head_replicas(spec.num_kv_heads, tp)
    return KVCacheSpec(spec.num_kv_heads * r, spec.head_dim, spec.block_size)


def replicate_kv_heads(x, replicas: int, axis: int = 1):
    """Repeats each KV head ``replicas`` times along ``axis`` (new head j is old head
    ``j // replicas``): ``key``/``value`` ``[T, Hkv, D]`` (axis 1) before
    :func:`~jax_m3sparse.pack_kv_pages`, ``topk_indices`` ``[Hkv, T, K]`` (axis 0) before
    attention. Identity for ``replicas == 1``."""
    return x if replicas == 1 else jnp.repeat(x, replicas, axis=axis)


def cache_spec(axis: str = "tp", ndim: int = 5) -> PartitionSpec:
    """``PartitionSpec`` of a 4-D ``[P, 2Hkv, N, C]`` or 5-D (LBHNC / BLHNC) cache: its
    head-slot axis over mesh axis ``axis``."""
    if ndim not in (4, 5):
        raise ValueError(f"a kv_cache is 4-D or 5-D, got ndim = {ndim}")
    return PartitionSpec(*([None] * (ndim - 4)), None, axis, None, None)


def head_specs(axis: str = "tp") -> dict[str, PartitionSpec]:
    """``PartitionSpec`` of every other operand, by its name in the API: ``q``/``out``/``key``/
    ``value`` over their head axis, ``topk_indices`` over axis 0, index metadata and scales
    replicated."""
    heads = PartitionSpec(None, axis, None)
    replicated = PartitionSpec()
    return dict(q=heads, out=heads, key=heads, value=heads,
                topk_indices=PartitionSpec(axis, None, None),
                **{name: replicated for name in (
                    "block_table", "seq_lens", "slot_mapping", "cu_seqlens_q", "context_lens",
                    "query_req_id", "query_abs_pos", "k_scale", "v_scale", "layer")})


def allocate_sharded_kv_cache(spec: KVCacheSpec, num_pages: int, mesh: jax.sharding.Mesh,
                              axis: str = "tp", num_layers: int | None = None,
                              layout: str = "LBHNC"):
    """A zeroed cache of ``spec.cache_shape(num_pages, num_layers, layout)``, created directly
    in its shards (no device ever holds the whole cache). ``spec`` is the global geometry
    (:func:`tp_cache_spec`)."""
    shape = spec.cache_shape(num_pages, num_layers, layout)
    sharding = NamedSharding(mesh, cache_spec(axis, len(shape)))
    return jax.jit(lambda: jnp.zeros(shape, jnp.uint8), out_shardings=sharding)()
