"""query_token_positions: per prefill token, its request and absolute position (SPEC §4)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.core import ShapedArray

from jax_m3sparse import _checks, reference
from jax_m3sparse._primitives import define_primitive


def _abstract_eval(cu_seqlens_q, context_lens, *, num_tokens):
    out = ShapedArray((num_tokens,), jnp.int32)
    return out, out


query_token_positions_p = define_primitive(
    "query_token_positions",
    abstract_eval=_abstract_eval,
    reference=reference.positions_impl,
    attributes=lambda num_tokens: {},
    multiple_results=True,
)


def query_token_positions(cu_seqlens_q, context_lens, num_tokens):
    """Maps each of ``num_tokens`` (padded) prefill tokens to its request and position.

    Args:
      cu_seqlens_q: ``int32[R + 1]``, non-decreasing, ``cu[0] = 0``: request r owns tokens
        ``[cu[r], cu[r+1])``.
      context_lens: ``int32[R]``, tokens already in the cache before this chunk.
      num_tokens: static int ≥ ``cu[R]``, the padded token count. With a traced (or jax.Array)
        ``cu_seqlens_q`` whose ``cu[R]`` exceeds it, the tokens from ``num_tokens`` on are cut
        (the result above, for ``j < num_tokens``); ``check_inputs(cu_seqlens_q=...,
        num_tokens=...)`` reports it (SPEC §7).

    Returns:
      ``(query_req_id, query_abs_pos)``, ``int32[num_tokens]`` each (SPEC §4):
      ``query_req_id[j]`` = the r with ``cu[r] ≤ j < cu[r+1]`` (zero-length requests own no
      token), −1 for ``j ≥ cu[R]``; ``query_abs_pos[j] = context_lens[r] + j − cu[r]``,
      −1 where the id is −1. For a non-monotonic ``cu_seqlens_q`` the id is the count of
      ``r ≥ 1`` with ``cu[r] ≤ j`` (a defined, memory-safe result; ``check_inputs`` reports it).

    Raises:
      ValueError / TypeError at trace time for wrong ranks, lengths or dtypes, a
      non-integer / negative ``num_tokens``, or a static (Python / NumPy) ``cu_seqlens_q``
      whose ``cu[R]`` exceeds ``num_tokens``.
    """
    static_cu = _checks.static_values(cu_seqlens_q)
    cu, ctx = _checks.index_arrays(cu_seqlens_q=cu_seqlens_q, context_lens=context_lens)
    num_tokens = _checks.static_int(num_tokens, "num_tokens", 0)
    _checks.rank(cu, "cu_seqlens_q", 1, "[R + 1]")
    _checks.rank(ctx, "context_lens", 1, "[R]")
    _checks.dtype(cu, "cu_seqlens_q", (jnp.int32,))
    _checks.dtype(ctx, "context_lens", (jnp.int32,))
    _checks.dim("cu_seqlens_q", "length (R + 1 for context_lens [R])", ctx.shape[0] + 1, cu.shape[0])
    if static_cu is not None and int(static_cu[-1]) > num_tokens:
        raise ValueError(f"num_tokens must be >= cu_seqlens_q[R] = {int(static_cu[-1])} (the "
                         f"tokens the requests own), got {num_tokens}: the last "
                         f"{int(static_cu[-1]) - num_tokens} would be cut")
    return tuple(query_token_positions_p.bind(cu, ctx, num_tokens=num_tokens))
