"""sparse_attention: the mixed batch of a serving engine's forward (SPEC §5.6)."""

from __future__ import annotations

from jax_m3sparse.metadata import SparseAttentionMetadata
from jax_m3sparse.ops.decode import sparse_decode
from jax_m3sparse.ops.prefill import sparse_prefill
from jax_m3sparse.reference import run_mixed_batch


def sparse_attention(q, kv_cache, topk_indices, metadata: SparseAttentionMetadata, k_scale,
                     v_scale, *, scale=None, layer=None, layout=None):
    """Decode rows first, prefill rows after, in one call (SPEC §5.6).

    Args:
      q: ``[T, Hq, D]``; rows ``[0, metadata.num_decode_tokens)`` are decode rows
        (SPEC §5.3), the rest prefill tokens (SPEC §5.4).
      kv_cache, k_scale, v_scale, scale, layer, layout: as :func:`sparse_decode`.
      topk_indices: ``int32[Hkv, T, K]`` over all rows (KV head first; a ``[T, Hkv, K]``
        array has the same shape when T == Hkv, and the shapes cannot tell).
      metadata: from :func:`build_attention_metadata`.

    Returns:
      ``[T, Hq, D]`` in q's dtype: the concatenation of the decode and prefill results.

    Raises:
      ValueError / TypeError at trace time, as :func:`sparse_decode` / :func:`sparse_prefill`.
    """
    return run_mixed_batch(sparse_decode, sparse_prefill, q, kv_cache, topk_indices, metadata,
                           k_scale, v_scale, scale=scale, layer=layer, layout=layout)
