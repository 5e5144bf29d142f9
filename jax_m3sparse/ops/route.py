"""route_experts: a mixture of experts' routing in one op — each token's top-k experts and
weights, and the (token, expert) pairs grouped by expert for :func:`grouped_matmul` (SPEC §10)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.core import ShapedArray

from jax_m3sparse import _checks, reference
from jax_m3sparse._primitives import define_primitive, i64

MAX_EXPERTS_CUDA = 512   # the CUDA kernel's per-warp expert counters live in shared memory
MAX_K_CUDA = 8           # its per-lane top-k lists are 8 long
MAX_EXPERTS_ROCM = 4096  # the gfx950 grouping kernel's per-bucket counters live in LDS
MAX_K_ROCM = 8           # its choice kernel unrolls 8 rounds


class ExpertRouting(NamedTuple):
    """What :func:`route_experts` returns (T tokens, E experts, top k; SPEC §10).

    Attributes:
      weights: ``float32[T, k]``, each chosen expert's weight (its score, renormalized).
      experts: ``int32[T, k]``, the chosen experts, best first.
      group_sizes: ``int32[E]``, the live pairs routed to each expert (grouped_matmul's sizes).
      sorted_tokens: ``int32[T·k]``, the token of each pair in grouped order (grouped_matmul's
        ``lhs_rows``): expert 0's pairs by token, then expert 1's, ..., then the pairs of
        tokens that are not live.
      sorted_weights: ``float32[T·k]``, the weight of each pair in grouped order.
      inverse: ``int32[T, k]``, where pair (t, j) sits in grouped order: the combine reads a
        token's k outputs at ``out[inverse[t]]``.
    """
    weights: jax.Array
    experts: jax.Array
    group_sizes: jax.Array
    sorted_tokens: jax.Array
    sorted_weights: jax.Array
    inverse: jax.Array


# jax.export serializes a function's output tree: a returned ExpertRouting must be registered.
jax.export.register_namedtuple_serialization(ExpertRouting,
                                             serialized_name="jax_m3sparse.ExpertRouting")


def _abstract_eval(scores, bias, live, *, k, renormalize):
    T, E = scores.shape
    f32, i32 = jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)
    return (ShapedArray((T, k), f32), ShapedArray((T, k), i32), ShapedArray((E,), i32),
            ShapedArray((T * k,), i32), ShapedArray((T * k,), f32), ShapedArray((T, k), i32))


def _platform_reason(platform, scores, *_, k, **__):
    """Why ``platform``'s kernel cannot serve these shapes (raised when lowering), or None."""
    E = scores.shape[1]
    if platform == "cuda" and (E > MAX_EXPERTS_CUDA or k > MAX_K_CUDA):
        return (f"the CUDA route_experts kernel takes E <= {MAX_EXPERTS_CUDA} experts and "
                f"k <= {MAX_K_CUDA}; got E = {E}, k = {k}")
    return None


def _rocm_reference(platform, scores, *_, k, **__):
    """Calls the gfx950 kernels (ffi/flydsl/route_experts.py) do not serve, lowered to the
    reference on rocm: more than MAX_EXPERTS_ROCM experts or k > MAX_K_ROCM."""
    return platform == "rocm" and (scores.shape[1] > MAX_EXPERTS_ROCM or k > MAX_K_ROCM)


# CUDA: one launch at decode sizes (two for long prefill chunks) in place of XLA's top-k,
# argsort, scatters and gathers; rocm (gfx950): two launches (the choice, the grouping). The
# CPU lowers to the reference.
route_experts_p = define_primitive(
    "route_experts",
    abstract_eval=_abstract_eval,
    reference=reference.route_experts_impl,
    platform_reason=_platform_reason,
    reference_when=_rocm_reference,
    attributes=lambda k, renormalize: {"k": i64(k), "renormalize": i64(renormalize)},
    multiple_results=True,
    native_platforms=("cuda", "rocm"),
)


def route_experts(scores, k, *, bias=None, live=None, renormalize=True) -> ExpertRouting:
    """Routes each token to its top-k experts and groups the (token, expert) pairs by expert
    (SPEC §10): the routing of a mixture of experts in one op, ready for :func:`grouped_matmul`.

    Token t chooses the k experts of largest ``scores[t] + bias`` (a NaN counts as −inf, −0 as
    +0, ties go to the lower expert id), best first; each chosen expert's weight is its score
    (``bias`` only chooses, as DeepSeek-V3's and MiniMax M3's auxiliary-loss-free routers do),
    divided by the sum of the k chosen scores (added in choice order) when ``renormalize``.
    The pairs (t, j) of live tokens are then grouped by expert — stable: within an expert by
    token — and the pairs of tokens that are not live (padding rows) come last, in no group: a
    grouped GEMM reads no expert's weights for them.

    Kernels: CUDA (one launch up to 128 tokens; E ≤ 512, k ≤ 8) and gfx950 (a choice and a
    grouping launch; E ≤ 4096, k ≤ 8, the reference beyond); the CPU runs the reference.

    Args:
      scores: ``float32[T, E]``, the router's probabilities (M3: the sigmoid of its logits).
      k: static int in ``[1, E]``.
      bias: ``float32[E]`` or None (zeros): added to the scores for the choice only.
      live: ``bool[T]`` or None (all live): the rows that are tokens.
      renormalize: static bool; False keeps the chosen scores as the weights.

    Returns:
      :class:`ExpertRouting` (weights, experts, group_sizes, sorted_tokens, sorted_weights,
      inverse). A token's fields depend on its own scores only, never on the batch; the same
      bits on every backend.

    Raises:
      ValueError / TypeError at trace time for wrong ranks, shapes, dtypes, or k outside
      ``[1, E]``; ValueError when lowering for CUDA with E > 512 or k > 8.
    """
    scores = jnp.asarray(scores)
    _checks.rank(scores, "scores", 2, "[T, E]")
    _checks.dtype(scores, "scores", (jnp.float32,))
    T, E = scores.shape
    k = _checks.static_int(k, "k", 1)
    if k > E:
        raise ValueError(f"k must be <= E (scores.shape[1] = {E}), got {k}")
    bias = jnp.zeros(E, jnp.float32) if bias is None else jnp.asarray(bias)
    _checks.rank(bias, "bias", 1, "[E]")
    _checks.dtype(bias, "bias", (jnp.float32,))
    _checks.dim("bias", "length (E of scores)", E, bias.shape[0])
    live = jnp.ones(T, bool) if live is None else jnp.asarray(live)
    _checks.rank(live, "live", 1, "[T]")
    _checks.dtype(live, "live", (jnp.bool_,))
    _checks.dim("live", "length (T of scores)", T, live.shape[0])
    return ExpertRouting(*route_experts_p.bind(scores, bias, live, k=k,
                                               renormalize=bool(renormalize)))
