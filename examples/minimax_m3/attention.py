"""M3 attention pieces in JAX: q/k/v, the lightning indexer, paged caches.

transformers' ``MiniMaxM3VLAttention`` / ``MiniMaxM3VLIndexer``, written against a paged
cache: K/V of every layer in the NVFP4 cache (``model.py``), the indexer's keys in their own
key-only paged cache (norms and rotary: ``layers.py``). ``paged_attention_jnp`` is the
baseline stream's attention over a dense-format paged cache (``compare.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_m3sparse import select_blocks
from jax_m3sparse.sharding import replicate_kv_heads

from .layers import apply_rotary, gemma_rms_norm, linear


def qkv(p, h, cos, sin, cfg):
    """Gemma-normed, RoPE'd q ``[T, Hq, D]``, k ``[T, Hkv, D]``; raw v ``[T, Hkv, D]`` (fp32)."""
    T, D = h.shape[0], cfg.head_dim
    q = linear(h, p["q_proj"]).reshape(T, cfg.num_attention_heads, D)
    k = linear(h, p["k_proj"]).reshape(T, cfg.num_key_value_heads, D)
    v = linear(h, p["v_proj"]).reshape(T, cfg.num_key_value_heads, D)
    q = apply_rotary(gemma_rms_norm(q, p["q_norm"], cfg.rms_norm_eps), cos, sin)
    k = apply_rotary(gemma_rms_norm(k, p["k_norm"], cfg.rms_norm_eps), cos, sin)
    return q, k, v


def indexer(p, h, cos, sin, cfg):
    """``MiniMaxM3VLIndexer``'s projections: index queries ``[T, index_n_heads, Di]`` and one
    shared index key per token ``[T, Di]``, Gemma-normed, RoPE'd with ``cos[..., :Di]`` (as
    transformers does)."""
    T, Di = h.shape[0], cfg.index_head_dim
    iq = linear(h, p["q_proj"]).reshape(T, cfg.index_n_heads, Di)
    ik = linear(h, p["k_proj"]).reshape(T, 1, Di)
    c, s = cos[:, :Di], sin[:, :Di]
    iq = apply_rotary(gemma_rms_norm(iq, p["q_norm"], cfg.rms_norm_eps), c, s)
    ik = apply_rotary(gemma_rms_norm(ik, p["k_norm"], cfg.rms_norm_eps), c, s)
    return iq, ik[:, 0]


def select(p, h, cos, sin, cfg, idx_cache, layer, slots, block_table, req, pos):
    """The indexer's block selection on sparse layer ``layer`` of ``idx_cache [L_sparse, P, N,
    Di]``: writes this step's index keys into that layer first (a token's own block scores
    itself), then ``topk_indices int32[Hkv', T, K]`` for the cache's stored KV heads (Hkv' =
    Hkv · kv_replicas; jax_m3sparse.select_blocks: local blocks, then the best earlier ones).
    The index queries are replicated like the KV heads before selecting, so under tensor
    parallel each device selects for its own head only (select_blocks partitions over heads).
    The whole cache goes in and out (in place when donated): no per-layer copy of the pool.
    Returns ``(topk, idx_cache)``."""
    iq, ik = indexer(p, h, cos, sin, cfg)
    idx_cache = write_layer_pages(idx_cache, layer, ik, slots, cfg.block_size)
    iq = replicate_kv_heads(iq, cfg.kv_replicas)
    topk = select_blocks(iq, idx_cache, block_table, req, pos, topk_blocks=cfg.index_topk_blocks,
                         local_blocks=cfg.index_local_blocks, layer=layer)
    return topk, idx_cache


def write_layer_pages(cache, layer, values, slot_mapping, block_size):
    """Scatters ``values [T, ...]`` into layer ``layer`` of ``cache [L, P, N, ...]`` at slots
    (< 0: dropped) with one scatter on the whole buffer, so XLA updates it in place."""
    P = cache.shape[1]
    ok = slot_mapping >= 0
    page = jnp.where(ok, slot_mapping // block_size, P)                 # P: out of range, dropped
    if cache.dtype == jnp.float8_e4m3fn:     # E4M3 has no Inf: saturate instead of NaN
        values = jnp.clip(values.astype(jnp.float32), -448.0, 448.0)
    return cache.at[layer, page, slot_mapping % block_size].set(values.astype(cache.dtype),
                                                                mode="drop")


def write_pages(cache, values, slot_mapping, block_size):
    """Scatters ``values [T, ...]`` into a paged cache ``[P, N, ...]`` at slots (< 0: dropped)."""
    P = cache.shape[0]
    ok = slot_mapping >= 0
    page = jnp.where(ok, slot_mapping // block_size, P)                 # P: out of range, dropped
    return cache.at[page, slot_mapping % block_size].set(values.astype(cache.dtype), mode="drop")


def paged_attention_jnp(q, k_cache, v_cache, topk, block_table, req, pos, scale, chunk=32):
    """Plain-jnp attention over a dense-format (bf16 or fp32) paged cache, SPEC §5.2 masking.

    q ``[T, Hq, D]``; k_cache, v_cache ``[P, Hkv, N, D]``; topk ``int32[Hkv, T, K]`` (no
    duplicate ids); block_table ``[R, M]``; req, pos ``int32[T]``. Returns fp32 ``[T, Hq, D]``
    (zeros for rows with no key).

    Tokens go in chunks. A chunk whose tokens all belong to one request (most prefill chunks)
    walks that request's pages up to its last position, four blocks at a time, with an online
    softmax (GEMMs, unselected blocks masked); other chunks (decode rows, request boundaries)
    gather each token's selected pages.
    """
    topk, block_table, req, pos = map(jnp.asarray, (topk, block_table, req, pos))
    T, Hq, D = q.shape
    P, Hkv, N, _ = k_cache.shape
    R, M = block_table.shape
    K, G = topk.shape[-1], Hq // Hkv
    B = 4                                   # blocks per step of the one-request path
    Mp = -(-M // B) * B
    chunk = max(min(chunk, T), 1)
    n = -(-T // chunk)
    pad = n * chunk - T
    qs = jnp.pad(q.astype(jnp.float32), ((0, pad), (0, 0), (0, 0))).reshape(n, chunk, Hkv, G, D)
    ts = jnp.moveaxis(jnp.pad(topk, ((0, 0), (0, pad), (0, 0)), constant_values=-1)
                      .reshape(Hkv, n, chunk, K), 1, 0)
    rs = jnp.pad(req, (0, pad), constant_values=-1).reshape(n, chunk)
    ps = jnp.pad(pos, (0, pad), constant_values=-1).reshape(n, chunk)

    def softmax_pv(z, mask, v):
        """z, mask [Hkv, c, G|1, S]; v [Hkv, c|1, S, D] -> [c, Hq, D]."""
        z = jnp.where(mask, z * scale, -jnp.inf)
        mx = jnp.max(z, axis=-1, keepdims=True)
        e = jnp.where(mask, jnp.exp(z - jnp.where(jnp.isfinite(mx), mx, 0.0)), 0.0)
        o = jnp.einsum("gcis,gcsd->cgid", e, jnp.broadcast_to(v, (Hkv, chunk, *v.shape[2:])))
        den = jnp.moveaxis(jnp.sum(e, axis=-1, keepdims=True), 0, 1)
        return (o / jnp.maximum(den, 1e-30)).reshape(chunk, Hq, D)

    def one_request(xs):  # every live token of the chunk belongs to request max(rc)
        qc, tc, rc, pc = xs
        pages = jnp.pad(block_table[jnp.clip(jnp.max(rc), 0, R - 1)], (0, Mp - M),
                        constant_values=-1)                            # [Mp]
        sel = jnp.any(tc[..., None] == jnp.arange(Mp), axis=-2)         # [Hkv, c, Mp]
        sel = sel & ((pages >= 0) & (pages < P)) & (rc >= 0)[None, :, None]

        def blocks(i, carry):  # online softmax over blocks [i·B, i·B + B)
            m, l, acc = carry
            pg = jnp.clip(jax.lax.dynamic_slice(pages, (i * B,), (B,)), 0, P - 1)
            k = jnp.moveaxis(k_cache[pg], 1, 0).reshape(Hkv, B * N, D).astype(jnp.float32)
            v = jnp.moveaxis(v_cache[pg], 1, 0).reshape(Hkv, B * N, D).astype(jnp.float32)
            s_ = jax.lax.dynamic_slice(sel, (0, 0, i * B), (Hkv, chunk, B))
            mask = (jnp.repeat(s_, N, axis=-1)
                    & (i * B * N + jnp.arange(B * N) <= pc[None, :, None]))[:, :, None]
            z = jnp.where(mask, jnp.einsum("cgid,gsd->gcis", qc, k) * scale, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(z, axis=-1, keepdims=True))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.where(mask, jnp.exp(z - m_safe), 0.0)
            corr = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
            return (m_new, l * corr + jnp.sum(p, axis=-1, keepdims=True),
                    acc * corr + jnp.einsum("gcis,gsd->gcid", p, v))

        init = (jnp.full((Hkv, chunk, G, 1), -jnp.inf), jnp.zeros((Hkv, chunk, G, 1)),
                jnp.zeros((Hkv, chunk, G, D)))
        # Only the blocks up to the chunk's last position: cost follows the context length.
        steps = (jnp.clip(jnp.max(pc), 0, Mp * N - 1) // N) // B + 1
        _, l, acc = jax.lax.fori_loop(0, steps, blocks, init)
        return jnp.moveaxis(acc / jnp.maximum(l, 1e-30), 0, 1).reshape(chunk, Hq, D)

    def per_token(xs):    # gather each token's selected pages
        qc, tc, rc, pc = xs                                            # tc [Hkv, c, K]
        vis = pc + 1
        page = block_table[jnp.clip(rc, 0, R - 1)[None, :, None], jnp.clip(tc, 0, M - 1)]
        slot_ok = ((rc >= 0)[None, :, None] & (tc >= 0) & (tc < M) & (tc * N < vis[None, :, None])
                   & (page >= 0) & (page < P))
        key_pos = tc[..., None] * N + jnp.arange(N)                   # [Hkv, c, K, N]
        mask = (slot_ok[..., None] & (key_pos < vis[None, :, None, None]))
        pc_ = jnp.clip(page, 0, P - 1)
        heads = jnp.arange(Hkv)[:, None, None]
        k = k_cache[pc_, heads].astype(jnp.float32).reshape(Hkv, chunk, K * N, D)
        v = v_cache[pc_, heads].astype(jnp.float32).reshape(Hkv, chunk, K * N, D)
        z = jnp.einsum("cgid,gcsd->gcis", qc, k)
        return softmax_pv(z, mask.reshape(Hkv, chunk, 1, K * N), v)

    def one_chunk(xs):
        rc = xs[2]
        same = jnp.all((rc == jnp.max(rc)) | (rc < 0))
        return jax.lax.cond(same, one_request, per_token, xs)

    return jax.lax.map(one_chunk, (qs, ts, rs, ps)).reshape(n * chunk, Hq, D)[:T]
