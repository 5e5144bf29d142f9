"""MiniMax M3's indexer block selection in pure JAX: which 128-token blocks each token attends.

The indexer gives every KV head one index query ``idx_q`` per token and every token one shared
index key ``idx_k`` (stored in its own key-only paged cache, same pages and block table as the
NVFP4 K/V cache). A block's score for (KV head g, token t) is the maximum over the block's
tokens p ≤ pos(t) of ``idx_q[t, g] · idx_k[p]`` in fp32; the token's own (local) block and the
``local_blocks − 1`` blocks before it are always selected, then the best-scoring earlier blocks,
``min(topk_blocks, pos // N + 1)`` ids in all, −1 in the unused tail (transformers'
``MiniMaxM3VLIndexer``; M3 has ``index_local_blocks`` = 1). The result is the ``topk_indices`` operand of
:func:`jax_m3sparse.sparse_attention` (SPEC §5.1).

Everything here is plain ``jax.numpy``: jit-, vmap- and scan-compatible on any backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_TOKEN_CHUNK = 64  # tokens scored per lax.map step: bounds the [Hkv, chunk, P, N] score block


def indexer_block_scores(idx_q, idx_k_cache, block_table, query_req_id, query_abs_pos):
    """Per (KV head, token, logical block): max over the block's visible tokens of idx_q·idx_k.

    Each token is scored against the whole page pool with one matmul, then its request's
    pages are gathered through ``block_table``: O(T · P · N · Di) FLOPs, matmul-friendly and
    cheap when the pool holds a few hundred pages (a per-token gather of the request's keys
    would move O(T · max_blocks · N · Di) bytes instead).

    Args:
      idx_q: ``[T, Hkv, Di]`` float, the index queries (already normed and RoPE'd).
      idx_k_cache: ``[P, N, Di]`` float (bf16 in MiniMax M3), the key-only paged cache of one
        layer; page p holds the index keys of the tokens whose K/V live in page p.
      block_table: ``int32[R, M]`` page of each logical block per request (entries outside
        ``[0, P)`` score −inf).
      query_req_id: ``int32[T]`` request row of each token, −1 for padding (all −inf).
      query_abs_pos: ``int32[T]`` absolute position of each token.

    Returns:
      ``float32[Hkv, T, M]``: the block scores; −inf where the block has no token p ≤ pos,
      its page is invalid, or the token is padding.
    """
    idx_q, idx_k_cache = jnp.asarray(idx_q), jnp.asarray(idx_k_cache)
    block_table = jnp.asarray(block_table, jnp.int32)   # a numpy table can't be indexed by tracers
    query_req_id = jnp.asarray(query_req_id, jnp.int32)
    query_abs_pos = jnp.asarray(query_abs_pos, jnp.int32)
    T, Hkv, Di = idx_q.shape
    P, N, _ = idx_k_cache.shape
    R, M = block_table.shape
    chunk = min(_TOKEN_CHUNK, max(T, 1))
    n = -(-T // chunk)
    pad = n * chunk - T
    q = jnp.pad(idx_q.astype(jnp.float32), ((0, pad), (0, 0), (0, 0))).reshape(n, chunk, Hkv, Di)
    req = jnp.pad(query_req_id, (0, pad), constant_values=-1).reshape(n, chunk)
    pos = jnp.pad(query_abs_pos, (0, pad), constant_values=-1).reshape(n, chunk)
    keys = idx_k_cache.astype(jnp.float32).reshape(P * N, Di)
    key_pos = jnp.arange(M)[:, None] * N + jnp.arange(N)                  # [M, N] logical

    def score_chunk(xs):
        qc, rc, pc = xs                                                  # [c, Hkv, Di], [c], [c]
        s = jnp.einsum("chd,kd->hck", qc, keys, precision="highest").reshape(Hkv, chunk, P, N)
        pages = block_table[jnp.clip(rc, 0, R - 1)]                      # [c, M]
        ok_page = (pages >= 0) & (pages < P) & (rc >= 0)[:, None]
        s = s[:, jnp.arange(chunk)[:, None], jnp.clip(pages, 0, P - 1)]  # [Hkv, c, M, N]
        visible = ok_page[:, :, None] & (key_pos[None] <= pc[:, None, None])
        return jnp.max(jnp.where(visible[None], s, -jnp.inf), axis=-1)  # [Hkv, c, M]

    out = jax.lax.map(score_chunk, (q, req, pos))                        # [n, Hkv, c, M]
    return jnp.moveaxis(out, 0, 1).reshape(Hkv, n * chunk, M)[:, :T]


def top_blocks(block_scores, query_abs_pos, *, topk_blocks=16, block_size=128, local_blocks=1):
    """Top-k logical blocks per (KV head, token) from block scores, local blocks first.

    Args:
      block_scores: ``float32[Hkv, T, M]`` (from :func:`indexer_block_scores`).
      query_abs_pos: ``int32[T]``; a negative position (padding) selects nothing.
      topk_blocks: static K (16 in MiniMax M3).
      block_size: static N (128).
      local_blocks: static; blocks ``pos // N − j`` for ``0 ≤ j < local_blocks`` (those ≥ 0)
        are always kept.

    Returns:
      ``int32[Hkv, T, K]``: the local blocks (``pos // N`` and the ``local_blocks − 1``
      before it, in unspecified order), then the highest-scoring earlier
      blocks in descending score order (ties: lower id first); ``min(K, pos // N + 1)`` ids
      when every earlier block has a finite score, −1 in the rest.
    """
    Hkv, T, M = block_scores.shape
    pos = jnp.asarray(query_abs_pos, jnp.int32)
    local = jnp.where(pos >= 0, pos // block_size, -1)                  # [T]
    b = jnp.arange(M)
    s = jnp.where(b[None, None, :] <= local[None, :, None], block_scores, -jnp.inf)
    near = (b[None, :] <= local[:, None]) & (b[None, :] > local[:, None] - local_blocks)
    s = jnp.where(near[None], jnp.inf, s)                                # always keep local
    k = min(topk_blocks, M)
    vals, ids = jax.lax.top_k(s, k)
    ids = jnp.where(vals > -jnp.inf, ids, -1).astype(jnp.int32)
    return jnp.pad(ids, ((0, 0), (0, 0), (0, topk_blocks - k)), constant_values=-1)


def select_blocks(idx_q, idx_k_cache, block_table, query_req_id, query_abs_pos, *,
                  topk_blocks=16, local_blocks=1):
    """MiniMax M3's indexer selection: ``topk_indices`` for :func:`sparse_attention`.

    For KV head g and token t (request ``query_req_id[t]``, position ``pos = query_abs_pos[t]``)
    block b scores ``max_{p in block b, p <= pos} idx_q[t, g] · idx_k[p]`` (fp32); the local
    block ``pos // N`` (and the ``local_blocks − 1`` before it) is always selected, then the
    best earlier blocks, ``min(topk_blocks, pos // N + 1)`` ids in all, −1 after them. Write this step's index keys into
    ``idx_k_cache`` before calling (the local block's scores include the token itself).

    Args:
      idx_q: ``[T, Hkv, Di]`` float: one index head per KV head (normed, RoPE'd).
      idx_k_cache: ``[P, N, Di]`` float (bf16): one layer's key-only paged index cache,
        addressed by the same ``block_table`` / slots as the K/V cache.
      block_table: ``int32[R, M]`` pages of each request's logical blocks.
      query_req_id: ``int32[T]`` row of ``block_table`` per token; −1 marks padding.
      query_abs_pos: ``int32[T]`` absolute position per token (−1 for padding).
      topk_blocks: static K.
      local_blocks: static, ≥ 1: blocks always kept, the token's own and those before it.

    Returns:
      ``int32[Hkv, T, K]`` logical block ids (SPEC §5.1); padding tokens get all −1.

    Raises:
      ValueError at trace time when shapes disagree.
    """
    idx_q, idx_k_cache = jnp.asarray(idx_q), jnp.asarray(idx_k_cache)
    block_table = jnp.asarray(block_table, jnp.int32)
    query_req_id = jnp.asarray(query_req_id, jnp.int32)
    query_abs_pos = jnp.asarray(query_abs_pos, jnp.int32)
    if local_blocks < 1:
        raise ValueError(f"local_blocks must be >= 1 (the token's own block), got {local_blocks}")
    if idx_q.ndim != 3 or idx_k_cache.ndim != 3 or idx_q.shape[2] != idx_k_cache.shape[2]:
        raise ValueError(f"idx_q [T, Hkv, Di] and idx_k_cache [P, N, Di] disagree: "
                         f"{idx_q.shape}, {idx_k_cache.shape}")
    T = idx_q.shape[0]
    if block_table.ndim != 2 or query_req_id.shape != (T,) or query_abs_pos.shape != (T,):
        raise ValueError(f"need block_table [R, M], query_req_id [T], query_abs_pos [T] with "
                         f"T = {T}; got {block_table.shape}, {query_req_id.shape}, "
                         f"{query_abs_pos.shape}")
    scores = indexer_block_scores(idx_q, idx_k_cache, block_table, query_req_id, query_abs_pos)
    pos = jnp.where(query_req_id >= 0, query_abs_pos, -1)
    return top_blocks(scores, pos, topk_blocks=topk_blocks, block_size=idx_k_cache.shape[1],
                      local_blocks=local_blocks)
