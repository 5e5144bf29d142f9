"""Trace-time checks shared by the attention primitives (decode, prefill)."""

from __future__ import annotations

import jax.numpy as jnp

from jax_m3sparse import _checks
from jax_m3sparse.spec import unsupported_reason


def check_attention(q, kv_cache, topk_indices, block_table, layer, layout, scale):
    """Validates the operands decode, prefill and full attention (``topk_indices`` None) share;
    returns (layer operand, layout code, softmax scale as float)."""
    layer_op, code, _, _, num_slots, block_size, head_dim = _checks.cache_geometry(
        kv_cache, layer, layout)
    _checks.rank(q, "q", 3, "[T, Hq, D]")
    _checks.dtype(q, "q", _checks.FLOAT_DTYPES)
    _checks.dim("q", "D (from the kv_cache row width)", head_dim, q.shape[2])
    if topk_indices is not None:
        _checks.rank(topk_indices, "topk_indices", 3, "[Hkv, T, K]")
        _checks.dtype(topk_indices, "topk_indices", (jnp.int32,))
        hkv, t = num_slots // 2, q.shape[0]
        if topk_indices.shape[:2] == (t, hkv) and t != hkv:
            raise ValueError(f"topk_indices: shape {tuple(topk_indices.shape)} is [T, Hkv, K]; "
                             f"the ops take [Hkv, T, K] (select_blocks' output): transpose it "
                             f"with jnp.swapaxes(topk_indices, 0, 1)")
        _checks.dim("topk_indices [Hkv, T, K]", "dim 0 (Hkv = kv_cache head slots / 2)",
                    hkv, topk_indices.shape[0])
        _checks.dim("topk_indices [Hkv, T, K]", "dim 1 (T of q)", q.shape[0],
                    topk_indices.shape[1])
    _checks.rank(block_table, "block_table", 2, "[R, max_blocks]")
    _checks.dtype(block_table, "block_table", (jnp.int32,))
    num_kv_heads = num_slots // 2
    topk_blocks = None if topk_indices is None else topk_indices.shape[2]  # full: no K
    reason = unsupported_reason(q.shape[1], num_kv_heads, head_dim, topk_blocks, block_size)
    if reason:
        raise ValueError(reason)
    scale = head_dim ** -0.5 if scale is None else scale
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a static Python float, got {type(scale).__name__}")
    return layer_op, code, float(scale)


def platform_reason(platform, q, kv_cache, topk_indices, *_, **__):
    """unsupported_reason for the platform being lowered for, from the operands' avals
    (plus the CUDA kernels' dtype limit: they take bf16/f16 q). ``topk_indices`` None: full
    attention (no K)."""
    topk_blocks = None if topk_indices is None else topk_indices.shape[2]
    reason = unsupported_reason(q.shape[1], kv_cache.shape[-3] // 2, q.shape[2], topk_blocks,
                                kv_cache.shape[-2], platform)
    if reason is None and platform == "cuda" and q.dtype == jnp.float32:
        reason = ("the cuda (sm_90) kernels take q in bfloat16 or float16, got float32: cast q "
                  "(the products are computed in bf16/fp16 anyway).")
    return reason
