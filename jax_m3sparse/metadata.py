"""Mixed-batch metadata (SPEC §5.6): decode requests first, prefill requests after."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_m3sparse import _checks, reference
from jax_m3sparse.ops.positions import query_token_positions


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SparseAttentionMetadata:
    """Everything :func:`jax_m3sparse.sparse_attention` needs besides q, cache and top-k.

    A pytree: the arrays are leaves, ``num_decode_tokens`` and ``decode_query_len`` are
    static (part of the tree structure), so a jitted step recompiles only when they change.

    Fields:
      block_table: ``int32[R, max_blocks]``, decode requests first.
      seq_lens: ``int32[R_dec]``, tokens of each decode request including this step's
        (0 for a padded decode request).
      query_req_id, query_abs_pos: ``int32[T − num_decode_tokens]``, per prefill token
        (request index into ``block_table``; −1 for padding), SPEC §4.
      num_decode_tokens: static, ``R_dec · decode_query_len``.
      decode_query_len: static, 1 + speculative tokens.
    """

    block_table: jax.Array
    seq_lens: jax.Array
    query_req_id: jax.Array
    query_abs_pos: jax.Array
    num_decode_tokens: int = dataclasses.field(metadata=dict(static=True))
    decode_query_len: int = dataclasses.field(default=1, metadata=dict(static=True))

    def token_rows(self):
        """``(query_req_id, query_abs_pos)`` of every row, ``int32[T]`` each: the decode rows'
        (request ``t // decode_query_len``, position ``seq_lens[r] − decode_query_len +
        t % decode_query_len``; −1 where that is negative, SPEC §5.3) then the prefill tokens'
        (SPEC §4). What :func:`jax_m3sparse.select_blocks` takes for the mixed batch."""
        req, pos = reference.decode_rows(self.seq_lens, self.num_decode_tokens,
                                         self.decode_query_len)
        return (jnp.concatenate([req, self.query_req_id]),
                jnp.concatenate([pos, self.query_abs_pos]))


def build_attention_metadata(query_lens, context_lens, block_table, *, num_decode_requests,
                             num_tokens, decode_query_len=1):
    """Builds :class:`SparseAttentionMetadata` from engine-style per-request inputs.

    Args:
      query_lens: ``int32[R]`` new tokens per request this step. The first
        ``num_decode_requests`` are decode requests: each has ``decode_query_len`` rows;
        a query_len of 0 marks a padded decode request (seq_len 0, rows attend nothing).
        The rest are prefill chunks laid out after the decode rows, in order.
      context_lens: ``int32[R]`` tokens already in the cache before this step.
      block_table: ``int32[R, max_blocks]``.
      num_decode_requests: static int R_dec.
      num_tokens: static int, the padded total of rows (decode rows + prefill tokens + padding),
        at least ``num_decode_requests · decode_query_len + Σ query_lens[num_decode_requests:]``.
        With a traced (or jax.Array) ``query_lens`` whose prefill chunks do not fit, the
        tokens past ``num_tokens`` are cut (SPEC §4's result for the rows there are);
        ``check_inputs(cu_seqlens_q=..., num_tokens=...)`` reports it (SPEC §7).
      decode_query_len: static int ≥ 1.

    Returns:
      The metadata; prefill tokens past the last request get ``query_req_id = −1``.

    Raises:
      ValueError / TypeError at trace time for wrong shapes or static values, among them a
      static (Python / NumPy) ``query_lens`` whose rows do not fit in ``num_tokens``.
    """
    static_q = _checks.static_values(query_lens)
    query_lens, context_lens, block_table = _checks.index_arrays(
        query_lens=query_lens, context_lens=context_lens, block_table=block_table)
    r_dec = _checks.static_int(num_decode_requests, "num_decode_requests", 0)
    num_tokens = _checks.static_int(num_tokens, "num_tokens", 0)
    dql = _checks.static_int(decode_query_len, "decode_query_len", 1)
    R = query_lens.shape[0]
    if query_lens.shape != (R,) or context_lens.shape != (R,) or block_table.shape[:1] != (R,):
        raise ValueError(f"query_lens [R], context_lens [R], block_table [R, M] disagree: "
                         f"{query_lens.shape}, {context_lens.shape}, {block_table.shape}")
    if not 0 <= r_dec <= R or dql < 1 or num_tokens < r_dec * dql:
        raise ValueError(f"need 0 <= num_decode_requests ({r_dec}) <= R ({R}), decode_query_len "
                         f"({dql}) >= 1 and num_tokens ({num_tokens}) >= R_dec·decode_query_len")
    if static_q is not None:
        need = r_dec * dql + int(static_q[r_dec:].sum())
        if num_tokens < need:
            raise ValueError(f"num_tokens must be >= {need} (R_dec·decode_query_len = "
                             f"{r_dec * dql} decode rows + {need - r_dec * dql} prefill tokens "
                             f"of query_lens), got {num_tokens}: the prefill chunks would be cut")
    query_lens = query_lens.astype(jnp.int32)
    context_lens = context_lens.astype(jnp.int32)
    dec_q = query_lens[:r_dec]
    seq_lens = jnp.where(dec_q > 0, context_lens[:r_dec] + dql, 0)
    pre_q = query_lens[r_dec:]
    cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(pre_q, dtype=jnp.int32)])
    req, pos = query_token_positions(cu, context_lens[r_dec:], num_tokens - r_dec * dql)
    req = jnp.where(req >= 0, req + r_dec, -1)
    return SparseAttentionMetadata(block_table.astype(jnp.int32), seq_lens, req, pos,
                                   num_decode_tokens=r_dec * dql, decode_query_len=dql)

