"""select_blocks: MiniMax M3's indexer block selection, the ``topk_indices`` of the sparse
layers (SPEC §8)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.core import ShapedArray

from jax_m3sparse import _checks, reference
from jax_m3sparse._partitioning import HeadAxes, ResultAxis
from jax_m3sparse._primitives import define_primitive, i64

_Q_DTYPES = (jnp.float32, jnp.bfloat16)


def _abstract_eval(idx_q, idx_k_cache, block_table, query_req_id, query_abs_pos, layer, *,
                   topk_blocks, local_blocks):
    T, Hkv, _ = idx_q.shape
    return ShapedArray((Hkv, T, topk_blocks), jnp.int32)


def _platform_reason(platform, idx_q, idx_k_cache, *_, **__):
    """Why ``platform``'s kernel cannot serve these shapes (raised when lowering), or None."""
    di, n = idx_q.shape[2], idx_k_cache.shape[-2]
    if platform == "rocm" and (di, n) != (128, 128):
        return ("the rocm (gfx950) select_blocks kernel serves only MiniMax M3's index geometry, "
                f"Di = 128 and N = 128; got Di = {di}, N = {n}.")
    return None


select_blocks_p = define_primitive(
    "select_blocks",
    abstract_eval=_abstract_eval,
    reference=reference.select_impl,
    platform_reason=_platform_reason,
    attributes=lambda topk_blocks, local_blocks: {
        "topk_blocks": i64(topk_blocks), "local_blocks": i64(local_blocks)},
    # KV heads: idx_q axis 1 decides, the result's axis 0 follows; the index-key cache and
    # the index arrays are replicated (every head reads every key of its request).
    head_axes=HeadAxes(operands=(1, None, None, None, None, None), results=(ResultAxis(0),),
                       cache=0, per_head=1),
)


def select_blocks(idx_q, idx_k_cache, block_table, query_req_id, query_abs_pos, *,
                  topk_blocks=16, local_blocks=1, layer=None):
    """MiniMax M3's indexer selection: ``topk_indices`` for :func:`sparse_attention` (SPEC §8).

    For KV head g and token t (request ``r = query_req_id[t]``, position
    ``pos = query_abs_pos[t]``), block b ≤ min(pos // N, M − 1) scores the max over its keys at
    positions ≤ pos of ``idx_q[t, g] · idx_k`` (fp32; a NaN dot product counts as −inf; a
    block whose page is outside ``[0, P)`` scores −inf and is never read). The row lists the
    local blocks ``pos // N − local_blocks < b ≤ pos // N`` first in ascending id (whatever
    their pages), then the other blocks with a finite score, best first (ties: lower id), at
    most ``topk_blocks`` ids, −1 after them. Write this step's index keys into
    ``idx_k_cache`` first: a prefill chunk's token sees the keys of the chunk's earlier tokens,
    in blocks that need not be local (:func:`write_index_keys`). A row's result
    depends only on its own q, its request's keys and its position: bit-identical in any batch,
    for any pool size or page placement (on one backend; backends may differ in the last bits
    of near-equal scores, SPEC §8 step 6).

    Args:
      idx_q: ``[T, Hkv, Di]`` float32 or bfloat16: one index query per token and KV head
        (normed, RoPE'd).
      idx_k_cache: ``[P, N, Di]`` or ``[L, P, N, Di]`` bfloat16 or float8_e4m3fn: the key-only
        paged index cache (same pages and ``block_table`` as the K/V cache). Only read. An FP8
        cache holds keys divided by one positive global scale (the selection does not change;
        SPEC §8 step 5).
      block_table: ``int32[R, M]`` page of each logical block per request.
      query_req_id: ``int32[T]`` row of ``block_table`` per token; outside ``[0, R)`` marks
        padding (the row is all −1).
      query_abs_pos: ``int32[T]`` absolute position per token; negative marks padding.
      topk_blocks: static K ≥ 1 (16 in MiniMax M3).
      local_blocks: static, 1 ≤ local_blocks ≤ topk_blocks (M3's ``index_local_blocks`` = 1).
      layer: int32 scalar, required iff the cache is 4-D. A jax.Array (may be traced)
        outside ``[0, L)`` gives all −1; a static one (Python / NumPy int) there is a
        ValueError.

    Returns:
      ``int32[Hkv, T, K]`` logical block ids (SPEC §5.1). Note the layout: KV head first; a
      ``[T, Hkv, K]`` array has the same shape when T == Hkv, and the shapes cannot tell.
      Inference-only (SPEC §7).

    Raises:
      ValueError / TypeError at trace time for wrong ranks, shapes or dtypes (naming the
      argument, expected and actual), ``topk_blocks`` or ``local_blocks`` below 1,
      ``local_blocks`` above ``topk_blocks``, a
      ``layer`` given for a 3-D cache or missing for a 4-D one, a static ``layer`` outside
      ``[0, L)``.
    """
    idx_q, idx_k_cache, block_table, query_req_id, query_abs_pos = _checks.index_arrays(
        idx_q=idx_q, idx_k_cache=idx_k_cache, block_table=block_table, query_req_id=query_req_id,
        query_abs_pos=query_abs_pos)
    K = _checks.static_int(topk_blocks, "topk_blocks", 1)
    local = _checks.static_int(local_blocks, "local_blocks", 1)
    if local > K:
        raise ValueError(f"local_blocks must be <= topk_blocks = {K} (every local block is "
                         f"selected, SPEC §8), got {local}")
    _checks.rank(idx_q, "idx_q", 3, "[T, Hkv, Di]")
    _checks.dtype(idx_q, "idx_q", _Q_DTYPES)
    T, _, Di = idx_q.shape
    layer_op = _checks.index_cache(idx_k_cache, layer, Di, "idx_q")
    _checks.rank(block_table, "block_table", 2, "[R, M]")
    for name, x in (("block_table", block_table), ("query_req_id", query_req_id),
                    ("query_abs_pos", query_abs_pos)):
        _checks.dtype(x, name, (jnp.int32,))
    for name, x in (("query_req_id", query_req_id), ("query_abs_pos", query_abs_pos)):
        _checks.rank(x, name, 1, "[T]")
        _checks.dim(name, "length (T of idx_q)", T, x.shape[0])
    return select_blocks_p.bind(idx_q, idx_k_cache, block_table, query_req_id, query_abs_pos,
                                layer_op, topk_blocks=K, local_blocks=local)
