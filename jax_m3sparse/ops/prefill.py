"""sparse_prefill: attention of (chunked) prefill tokens over their selected blocks (SPEC §5.4)."""

from __future__ import annotations

import jax.numpy as jnp

from jax_m3sparse import _checks, reference
from jax_m3sparse._primitives import HeadAxes, define_primitive, f32, i64
from jax_m3sparse.ops._attention_common import check_attention, platform_reason


def _abstract_eval(q, kv_cache, topk, block_table, query_req_id, query_abs_pos, k_scale, v_scale,
                   layer, *, scale, layout):
    return q.update(weak_type=False)


sparse_prefill_p = define_primitive(
    "sparse_prefill",
    abstract_eval=_abstract_eval,
    reference=reference.prefill_impl,
    attributes=lambda scale, layout: {"scale": f32(scale), "layout": i64(layout)},
    platform_reason=platform_reason,
    # KV heads: cache head slots (2h, 2h+1), q/out and key/value axis 1, topk axis 0.
    head_axes=HeadAxes(operands=(-2, -3, 0, None, None, None, None, None, None), results=(0,), cache=1),
)


def sparse_prefill(q, kv_cache, topk_indices, block_table, query_req_id, query_abs_pos, k_scale,
                   v_scale, *, scale=None, layer=None, layout=None):
    """Sparse attention of prefill tokens over their selected 128-token blocks (SPEC §5.4).

    Token t belongs to request ``query_req_id[t]`` (< 0 or ≥ R: padding, zero output) at position
    ``query_abs_pos[t]`` (both from :func:`query_token_positions`), and attends the keys of
    its selected blocks at positions ≤ its own (SPEC §5.2, §5.5).

    Args:
      q: ``[T, Hq, D]`` float32/bfloat16/float16 (the cuda kernels: bfloat16/float16).
      kv_cache: ``uint8`` NVFP4 cache, 4-D or 5-D (see :func:`pack_kv_pages`). Only read.
      topk_indices: ``int32[Hkv, T, K]`` logical block ids per (KV head, token); KV head
        first: a ``[T, Hkv, K]`` array has the same shape when T == Hkv and the shapes
        cannot tell.
      block_table: ``int32[R, max_blocks]``; rows indexed by ``query_req_id``.
      query_req_id, query_abs_pos: ``int32[T]``.
      k_scale, v_scale: fp32 scalar global scales (operands, may be traced).
      scale: static softmax scale, default ``D ** -0.5``.
      layer: int32 scalar, required iff the cache is 5-D; outside ``[0, L)`` as
        :func:`sparse_decode` (a jax.Array: zeros; a static int: ValueError).
      layout: "LBHNC" or "BLHNC", required for a 5-D cache (ValueError without it); None
        for a 4-D one.

    Returns:
      ``[T, Hq, D]`` in q's dtype (SPEC §5.5); rows with no attended key are exact zeros.
      Inference-only: differentiating through it raises NotImplementedError (SPEC §7).

    Raises:
      ValueError / TypeError at trace time, as :func:`sparse_decode`.
    """
    q, kv_cache, topk_indices, block_table, query_req_id, query_abs_pos = _checks.index_arrays(
        q=q, kv_cache=kv_cache, topk_indices=topk_indices, block_table=block_table,
        query_req_id=query_req_id, query_abs_pos=query_abs_pos)
    layer_op, code, scale = check_attention(q, kv_cache, topk_indices, block_table, layer, layout,
                                            scale)
    for name, x in (("query_req_id", query_req_id), ("query_abs_pos", query_abs_pos)):
        _checks.rank(x, name, 1, "[T]")
        _checks.dtype(x, name, (jnp.int32,))
        _checks.dim(name, "length (T of q)", q.shape[0], x.shape[0])
    return sparse_prefill_p.bind(q, kv_cache, topk_indices, block_table, query_req_id,
                                 query_abs_pos, _checks.scalar(k_scale, "k_scale", jnp.float32),
                                 _checks.scalar(v_scale, "v_scale", jnp.float32), layer_op,
                                 scale=scale, layout=code)
