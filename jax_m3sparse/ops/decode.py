"""sparse_decode: attention of decode tokens over their selected blocks (SPEC §5.3)."""

from __future__ import annotations

import jax.numpy as jnp

from jax_m3sparse import _checks, reference
from jax_m3sparse._primitives import HeadAxes, define_primitive, f32, i64
from jax_m3sparse.ops._attention_common import check_attention, platform_reason


def _abstract_eval(q, kv_cache, topk, block_table, seq_lens, k_scale, v_scale, layer, *,
                   scale, decode_query_len, layout):
    return q.update(weak_type=False)


sparse_decode_p = define_primitive(
    "sparse_decode",
    abstract_eval=_abstract_eval,
    reference=reference.decode_impl,
    attributes=lambda scale, decode_query_len, layout: {
        "scale": f32(scale), "decode_query_len": i64(decode_query_len), "layout": i64(layout)},
    platform_reason=platform_reason,
    # KV heads: cache head slots (2h, 2h+1), q/out and key/value axis 1, topk axis 0.
    head_axes=HeadAxes(operands=(-2, -3, 0, None, None, None, None, None), results=(0,), cache=1),
)


def sparse_decode(q, kv_cache, topk_indices, block_table, seq_lens, k_scale, v_scale, *,
                  scale=None, decode_query_len=1, layer=None, layout=None):
    """Sparse attention of decode tokens over their selected 128-token blocks.

    Row t belongs to request ``r = t // decode_query_len`` at position
    ``seq_lens[r] − decode_query_len + t % decode_query_len`` (SPEC §5.3); it attends the
    keys of its selected blocks at positions ≤ its own (SPEC §5.2) with softmax scale
    ``scale`` (SPEC §5.5). Query head h reads KV head ``h // (Hq / Hkv)``.

    Args:
      q: ``[T, Hq, D]`` float32/bfloat16/float16 (the cuda kernels: bfloat16/float16),
        ``T = R · decode_query_len``.
      kv_cache: ``uint8`` NVFP4 cache, 4-D or 5-D (see :func:`pack_kv_pages`). Only read.
      topk_indices: ``int32[Hkv, T, K]`` logical block ids (indices into the request's
        ``block_table`` row); −1 / out-of-range / future blocks are skipped. KV head
        first: a ``[T, Hkv, K]`` array has the same shape when T == Hkv and the shapes
        cannot tell.
      block_table: ``int32[R, max_blocks]`` page of each logical block; entries outside
        ``[0, P)`` are skipped.
      seq_lens: ``int32[R]`` tokens of each request including this step's; 0 marks a padded
        request (its rows output zeros).
      k_scale, v_scale: fp32 scalar global scales (operands, may be traced).
      scale: static softmax scale, default ``D ** -0.5``.
      decode_query_len: static, 1 + speculative tokens per request.
      layer: int32 scalar, required iff the cache is 5-D. A jax.Array (may be traced)
        outside ``[0, L)`` gives zeros (SPEC §3.3); a static one (Python / NumPy int) there
        is a ValueError.
      layout: "LBHNC" or "BLHNC", required for a 5-D cache (ValueError without it); None
        for a 4-D one.

    Returns:
      ``[T, Hq, D]`` in q's dtype (SPEC §5.5); rows with no attended key are exact zeros.
      Inference-only: differentiating through it raises NotImplementedError (SPEC §7).

    Raises:
      ValueError / TypeError at trace time for wrong shapes, dtypes or geometry (naming the
      argument, expected and actual), for a static ``layer`` outside ``[0, L)``, and
      ValueError with ``unsupported_reason``'s sentence
      when lowering for a platform whose kernels cannot serve the geometry.
    """
    q, kv_cache, topk_indices, block_table, seq_lens = _checks.index_arrays(
        q=q, kv_cache=kv_cache, topk_indices=topk_indices, block_table=block_table,
        seq_lens=seq_lens)
    layer_op, code, scale = check_attention(q, kv_cache, topk_indices, block_table, layer, layout,
                                            scale)
    dql = _checks.static_int(decode_query_len, "decode_query_len", 1)
    _checks.rank(seq_lens, "seq_lens", 1, "[R]")
    _checks.dtype(seq_lens, "seq_lens", (jnp.int32,))
    _checks.dim("seq_lens", "length (R of block_table)", block_table.shape[0], seq_lens.shape[0])
    _checks.dim("q", "T (R · decode_query_len)", seq_lens.shape[0] * dql, q.shape[0])
    return sparse_decode_p.bind(q, kv_cache, topk_indices, block_table, seq_lens,
                                _checks.scalar(k_scale, "k_scale", jnp.float32),
                                _checks.scalar(v_scale, "v_scale", jnp.float32), layer_op,
                                scale=scale, decode_query_len=dql, layout=code)
