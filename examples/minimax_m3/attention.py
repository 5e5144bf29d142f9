"""M3 attention pieces in JAX: q/k/v, the lightning indexer, paged caches.

transformers' ``MiniMaxM3VLAttention`` / ``MiniMaxM3VLIndexer``, their five input projections
in one fused weight (below), written against a paged cache: K/V of every layer in the NVFP4
cache (``model.py``), the indexer's keys in their own key-only paged cache (norms and rotary:
``layers.py``). ``paged_attention_jnp`` is the baseline stream's attention over a
dense-format paged cache (``compare.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from jax_m3sparse import select_blocks, write_index_keys
from jax_m3sparse.sharding import replicate_kv_heads

from .layers import apply_rotary, gemma_rms_norm, linear
from .parallel import AXIS, tp_size


# ----------------------------------------------------------------------------- projections
# The served layout stores q_proj, k_proj, v_proj and (sparse layers) the indexer's q_proj and
# k_proj as ONE weight ``self_attn.qkv_proj [S, C, H]``, grouped by stored KV head (S = Hkv ·
# kv_replicas, the cache's heads): group j holds the G' = Hq / S query heads that attend KV head
# j // kv_replicas, that head's k and v rows, its index-query head and the index key (every
# group its own copy). One GEMM per layer instead of five (XLA's dot merger would otherwise
# concatenate the five weights every layer: a copy of all of them), and under tensor parallel
# the groups split over devices, so each device reads only the KV / index heads it serves.
def fused_width(cfg, sparse: bool) -> int:
    """C, the rows of one group: G'·D query rows, D key rows, D value rows (+ Di index-query
    rows and Di index-key rows on sparse layers)."""
    g = cfg.num_attention_heads // cfg.cache_kv_heads
    return (g + 2) * cfg.head_dim + (2 * cfg.index_head_dim if sparse else 0)


def fuse_qkv(q, k, v, iq=None, ik=None, *, cfg):
    """The ``qkv_proj [..., S, C, H]`` of checkpoint-layout weights (PyTorch ``[..., out,
    H]``; leading axes, e.g. layers, kept): ``q_proj``, ``k_proj``, ``v_proj`` and on sparse
    layers the indexer's ``q_proj`` / ``k_proj``."""
    lead, H = q.shape[:-2], q.shape[-1]
    S, rep, D, Di = cfg.cache_kv_heads, cfg.kv_replicas, cfg.head_dim, cfg.index_head_dim
    per_head = lambda w, n: replicate_kv_heads(   # noqa: E731 (stored head j = head j // rep)
        w.reshape(*lead, cfg.num_key_value_heads, n, H), rep, axis=-3)
    parts = [q.reshape(*lead, S, -1, H), per_head(k, D), per_head(v, D)]
    if iq is not None:
        parts += [per_head(iq, Di), jnp.broadcast_to(ik.reshape(*lead, 1, Di, H), (*lead, S, Di, H))]
    return jnp.concatenate(parts, axis=-2)


def split_qkv(w, cfg, sparse: bool) -> dict:
    """The inverse of :func:`fuse_qkv` (numpy or jax arrays): ``{"q_proj", "k_proj",
    "v_proj"}`` (+ ``"index_q_proj"``, ``"index_k_proj"`` when ``sparse``), ``[..., out, H]``."""
    lead, H = w.shape[:-3], w.shape[-1]
    rep, D, Di = cfg.kv_replicas, cfg.head_dim, cfg.index_head_dim
    gd = fused_width(cfg, False) - 2 * D
    heads = lambda a, b: w[..., ::rep, a:b, :].reshape(*lead, -1, H)   # noqa: E731 (one copy)
    out = dict(q_proj=w[..., :gd, :].reshape(*lead, -1, H), k_proj=heads(gd, gd + D),
               v_proj=heads(gd + D, gd + 2 * D))
    if sparse:
        out["index_q_proj"] = heads(gd + 2 * D, gd + 2 * D + Di)
        out["index_k_proj"] = w[..., 0, gd + 2 * D + Di:, :]
    return out


def project(p, h, cos, sin, cfg):
    """``self_attn``'s projections of ``h [T, H]`` by the fused ``qkv_proj``, each Gemma-normed
    and RoPE'd as transformers does (``MiniMaxM3VLAttention``; ``MiniMaxM3VLIndexer`` with
    ``cos[..., :Di]``); v raw. All fp32. Returns ``(q [T, Hq, D], k [T, S, D], v [T, S, D], iq
    [T, S, Di] | None, ik [T, Di] | None)`` — k, v and the index queries per stored KV head (S =
    Hkv · kv_replicas, ready for the cache), the index key (one per token) only on sparse
    layers (``"indexer"`` in ``p``)."""
    T, D, Di = h.shape[0], cfg.head_dim, cfg.index_head_dim
    w = p["qkv_proj"]
    S, C, H = w.shape
    out = linear(h, w.reshape(S * C, H), cfg).reshape(T, S, C)
    g = cfg.num_attention_heads // S                              # query heads per group
    # a group's q heads and its k head lie side by side: one norm and one RoPE for all of them
    # (and for the index query and key below), fewer kernels than one per tensor
    qk = _norm_rope(out[..., :(g + 1) * D].reshape(T, S, g + 1, D),
                    _rows(p["q_norm"], g, p["k_norm"]), cos, sin, cfg.rms_norm_eps)
    q, k = qk[:, :, :g].reshape(T, cfg.num_attention_heads, D), qk[:, :, g]
    v = out[..., (g + 1) * D:(g + 2) * D]
    if "indexer" not in p:
        return q, k, v, None, None
    ix = p["indexer"]
    iqk = _norm_rope(out[..., (g + 2) * D:].reshape(T, S, 2, Di),
                     _rows(ix["q_norm"], 1, ix["k_norm"]), cos[:, :Di], sin[:, :Di],
                     cfg.rms_norm_eps)
    return q, k, v, iqk[:, :, 0], _one_copy(iqk[:, :, 1])


def _rows(q_norm, n, k_norm):
    """The norm weights of a group's rows: ``q_norm`` for its n query heads, then ``k_norm``."""
    return jnp.concatenate([jnp.broadcast_to(q_norm, (n, q_norm.shape[-1])), k_norm[None]])


def _norm_rope(x, w, cos, sin, eps):
    """Gemma RMS norm (per-row weights ``w [n, d]``) then RoPE of ``x [T, S, n, d]``."""
    T, S, n, d = x.shape
    x = gemma_rms_norm(x, w, eps).reshape(T, S * n, d)
    return apply_rotary(x, cos, sin).reshape(T, S, n, d)


def _one_copy(x):
    """``x [T, S, Di]`` (S equal copies, split over "tp" when it divides S) -> ``[T, Di]``: each
    device takes its own first copy, so the replicated index key needs no collective."""
    tp = tp_size()
    if tp == 1 or x.shape[1] % tp:       # one device, or qkv_proj replicated (parallel.py)
        return x[:, 0]
    return jax.shard_map(lambda a: a[:, 0], in_specs=P(None, AXIS, None), out_specs=P(),
                         check_vma=False)(x)


def select(iq, ik, cfg, idx_cache, layer, slots, block_table, req, pos):
    """The indexer's block selection on sparse layer ``layer`` of ``idx_cache [L_sparse, P, N,
    Di]``: writes this step's index keys ``ik [T, Di]`` into that layer first (a token's own
    block scores itself), then ``topk_indices int32[S, T, K]`` for the index queries ``iq [T,
    S, Di]`` of the cache's stored KV heads (jax_m3sparse.select_blocks: local blocks, then the
    best earlier ones). Under tensor parallel each device selects for its own heads only
    (select_blocks partitions over heads). The whole cache goes in and out (in place when
    donated): no per-layer copy of the pool. Returns ``(topk, idx_cache)``."""
    idx_cache = write_index_keys(idx_cache, ik, slots, layer=layer)
    topk = select_blocks(iq, idx_cache, block_table, req, pos, topk_blocks=cfg.index_topk_blocks,
                         local_blocks=cfg.index_local_blocks, layer=layer)
    return topk, idx_cache


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
