"""dense_matmul: a linear layer's product for the few rows of a decode step, each weight read
once at the copy rate, each row's result independent of the others (SPEC §11)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.core import ShapedArray

from jax_m3sparse import _checks, reference
from jax_m3sparse._primitives import define_primitive


def _abstract_eval(lhs, rhs, *, out_dtype):
    return ShapedArray((lhs.shape[0], rhs.shape[0]), out_dtype)


def _platform_reason(platform, lhs, rhs, **_):
    """Why ``platform``'s kernel cannot serve these shapes (raised when lowering), or None."""
    if platform == "cuda" and (lhs.shape[1] % 64 or lhs.shape[1] == 0):
        return (f"the CUDA dense_matmul kernel needs K (lhs.shape[1]) % 64 == 0 (chunks of 64 "
                f"k); got K = {lhs.shape[1]}")
    return None


# CUDA only: CPU and rocm lower to the reference (XLA's dot).
dense_matmul_p = define_primitive(
    "dense_matmul",
    abstract_eval=_abstract_eval,
    reference=reference.dense_matmul_impl,
    platform_reason=_platform_reason,
    attributes=lambda out_dtype: {},          # out's dtype is its own
    native_platforms=("cuda",),
)


def dense_matmul(lhs, rhs, *, out_dtype=jnp.float32):
    """``out = lhs · rhsᵀ`` with fp32 sums: a linear layer (``rhs`` in PyTorch's ``[out, in]``
    orientation), for the few rows of a decode step (SPEC §11).

    On CUDA a weight-streaming kernel: every weight element is read once per 16 rows, K is
    split over 4 to 16 warps per 16 output features (their number set by the weight's shape)
    and their partial sums are added in a fixed order, so a row's result is the same bits
    whatever the other rows are or how many there are (cuBLAS picks its algorithm, and so its
    summation order, by shape). It is for small M (a decode step's rows); at prefill sizes a
    GEMM library wins, and at decode sizes it beats XLA's cuBLAS call on some of MiniMax M3's
    projections and not yet on others (docs/perf-log/m3-step-kernels.md). Elsewhere XLA's
    dot (``preferred_element_type=float32``).

    Args:
      lhs: ``bfloat16[M, K]``, the rows.
      rhs: ``bfloat16[N, K]``, the weight.
      out_dtype: ``float32`` (default) or ``bfloat16`` (each fp32 result rounded to nearest
        even once, as it is stored).

    Returns:
      ``[M, N]`` of ``out_dtype``. Inference-only (SPEC §7).

    Raises:
      ValueError / TypeError at trace time for wrong ranks or dtypes, mismatched K, another
      ``out_dtype``; ValueError when lowering for CUDA with K % 64 != 0.
    """
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    _checks.rank(lhs, "dense_matmul's lhs", 2, "[M, K]")
    _checks.rank(rhs, "dense_matmul's rhs", 2, "[N, K]")
    _checks.dtype(lhs, "dense_matmul's lhs", (jnp.bfloat16,))
    _checks.dtype(rhs, "dense_matmul's rhs", (jnp.bfloat16,))
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"dense_matmul: lhs [M, K] and rhs [N, K] must share K: lhs.shape {lhs.shape}, "
                         f"rhs.shape {rhs.shape}")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"dense_matmul: out_dtype must be float32 or bfloat16, got {out_dtype}")
    return dense_matmul_p.bind(lhs, rhs, out_dtype=out_dtype)
