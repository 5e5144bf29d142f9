"""The building blocks more than one part of the model uses: projections, norms, rotary.

transformers' ``nn.Linear`` (no bias), ``MiniMaxM3VLRMSNorm`` (Gemma style: scale ``1 + w``),
``MiniMaxM3VLRotaryEmbedding`` and ``apply_rotary_pos_emb``, in JAX. Weights keep PyTorch's
``[out, in]`` orientation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

import jax_m3sparse

from . import parallel


def linear(x, w, cfg=None):
    """``x @ w.T`` for a PyTorch-layout weight ``[out, in]``, in the weight's dtype with fp32
    accumulation (bf16 checkpoints stay bf16; fp32 ones compute in fp32).

    On GPUs, bf16 products of at most ``cfg.dense_matmul_rows`` rows (16 by default: a small
    decode step's) whose input width is a multiple of 64 (the kernel's chunk) go through :func:`jax_m3sparse.dense_matmul`, a weight-streaming kernel
    that gives each row the same bits whatever the batch and needs no padding of 4 rows to 8;
    from 64 rows up XLA's cuBLAS GEMMs are faster (BENCHMARKS.md §1.3 has both figures).
    Not where jit splits the weight over "tp" (the kernel has no sharding rule: its operands
    would be gathered); inside the MLPs' ``shard_map`` it runs on each device's slice."""
    x = x.astype(w.dtype)
    rows = math.prod(x.shape[:-1])
    if (cfg is not None and 0 < rows <= cfg.dense_matmul_rows and w.dtype == jnp.bfloat16
            and w.shape[-1] % 64 == 0 and jax.default_backend() not in ("cpu",)
            and not parallel.tp_partitioned()):
        out = jax_m3sparse.dense_matmul(x.reshape(rows, w.shape[-1]), w)
        return out.reshape(*x.shape[:-1], w.shape[0])
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32)


def gemma_rms_norm(x, w, eps):
    """``x · rsqrt(mean(x²) + eps) · (1 + w)`` over the last axis, in fp32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w.astype(jnp.float32))


def rotary_cos_sin(pos, rotary_dim, theta):
    """cos, sin ``float32[T, rotary_dim]`` for positions ``pos [T]`` (transformers'
    ``MiniMaxM3VLRotaryEmbedding``: the frequencies twice, rotate-half order)."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)
    freqs = pos.astype(jnp.float32)[:, None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rotary(x, cos, sin):
    """Rotate-half RoPE on the first ``cos.shape[-1]`` dims of ``x [T, H, d]``; the rest pass."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([rot * cos[:, None] + rotated * sin[:, None], rest], axis=-1)


def rope(x, pos, rope_dim, theta):
    """RoPE on the first ``rope_dim`` dims of ``x [T, H, d]`` at positions ``pos [T]``."""
    return apply_rotary(x, *rotary_cos_sin(pos, rope_dim, theta))
