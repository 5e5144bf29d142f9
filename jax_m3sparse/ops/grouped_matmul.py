"""grouped_matmul: one matmul per group of consecutive rows — the routed experts of a mixture of
experts, each expert's weights read once (SPEC §9)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.core import ShapedArray

from jax_m3sparse import _checks, reference
from jax_m3sparse._primitives import define_primitive


def _abstract_eval(lhs, rhs, group_sizes):
    return ShapedArray((lhs.shape[0], rhs.shape[1]), jnp.float32)


def _platform_reason(platform, lhs, *_):
    """Why ``platform``'s kernel cannot serve these shapes (raised when lowering), or None."""
    if platform == "cuda" and lhs.shape[1] % 8:
        return (f"the CUDA grouped_matmul kernel needs K (lhs.shape[1]) % 8 == 0 (16-byte rows); "
                f"got K = {lhs.shape[1]}")
    return None


# CUDA only: CPU and rocm lower to the reference (XLA's ragged_dot).
grouped_matmul_p = define_primitive(
    "grouped_matmul",
    abstract_eval=_abstract_eval,
    reference=reference.grouped_matmul_impl,
    platform_reason=_platform_reason,
    attributes=lambda: {},
    native_platforms=("cuda",),
)


def grouped_matmul(lhs, rhs, group_sizes):
    """``out[i] = lhs[i] · rhs[g]ᵀ`` for the rows i of group g, in fp32 (SPEC §9).

    The rows of ``lhs`` are grouped in order: group 0 is the first ``group_sizes[0]`` rows,
    group 1 the next ``group_sizes[1]``, and so on (XLA's ``ragged_dot`` convention, with
    ``rhs`` in PyTorch's ``[out, in]`` orientation per group). A mixture of experts sorts its
    (token, expert) pairs by expert and calls this once per projection: each routed expert's
    weights are read once, unrouted experts not at all (on CUDA; elsewhere XLA's ``ragged_dot``).

    Args:
      lhs: ``bfloat16[M, K]``, the rows sorted by group.
      rhs: ``bfloat16[G, N, K]``, one ``[N, K]`` matrix per group.
      group_sizes: ``int32[G]`` rows per group. Data, not static: a negative size counts as 0,
        rows past M are dropped, and rows after the last group are 0 in the result.

    Returns:
      ``float32[M, N]``. Each element is a fixed-order fp32 sum over K: a row's result depends
      only on its own row and its group's matrix, never on the other rows or groups.
      Inference-only (SPEC §7).

    Raises:
      ValueError / TypeError at trace time for wrong ranks, dtypes or mismatched K / G; on CUDA
      when K % 8 != 0.
    """
    lhs, rhs, group_sizes = map(jnp.asarray, (lhs, rhs, group_sizes))
    _checks.rank(lhs, "lhs", 2, "[M, K]")
    _checks.rank(rhs, "rhs", 3, "[G, N, K]")
    _checks.rank(group_sizes, "group_sizes", 1, "[G]")
    _checks.dtype(lhs, "lhs", (jnp.bfloat16,))
    _checks.dtype(rhs, "rhs", (jnp.bfloat16,))
    _checks.dtype(group_sizes, "group_sizes", (jnp.int32,))
    if lhs.shape[1] != rhs.shape[2]:
        raise ValueError(f"lhs [M, K] and rhs [G, N, K] must share K: lhs.shape {lhs.shape}, "
                         f"rhs.shape {rhs.shape}")
    _checks.dim("group_sizes", "length (G of rhs)", rhs.shape[0], group_sizes.shape[0])
    return grouped_matmul_p.bind(lhs, rhs, group_sizes)
