"""MiniMax M3's attention stack in JAX over jax_m3sparse's NVFP4 paged cache.

One jitted :func:`forward_step` runs a mixed batch (decode rows first, prefill chunks after,
SPEC §5.6) through every layer. Two streams run in lockstep on the same tokens:

* the **served** stream: K/V packed to NVFP4 in one 5-D ``uint8`` cache for all layers
  (layout "LBHNC", ``[L, P, 2Hkv, N, 72]``), the indexer's ``idx_k`` in a bf16 key-only paged
  cache ``[L_sparse, P, N, Di]``, block selection by :func:`jax_m3sparse.select.select_blocks`,
  attention by :func:`jax_m3sparse.sparse_attention`;
* the **reference** stream (``compare=True``): the same weights, a bf16 paged K/V cache
  ``[L, P, Hkv, N, D]`` and plain-``jnp`` attention over the *served stream's* selections.
  Its logits and per-layer attention outputs measure what NVFP4 costs.

Dense layers (the first ``num_dense_layers``) use the same NVFP4 cache and kernel with every
block selected (K = max_blocks; on GPU backends, whose kernels serve K = 16 only, the library's
pure-jnp reference of the same call); the sparse layers run under one ``lax.scan`` with a traced
``layer`` index into the 5-D cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_m3sparse as m3
from jax_m3sparse.select import select_blocks
from jax_m3sparse.sharding import replicate_kv_heads

from .config import ModelConfig

KV_LAYOUT = "LBHNC"
K_SCALE = V_SCALE = 1.0   # NVFP4 global scales: K is RMS-normed, V of unit-ish size


# ----------------------------------------------------------------------------- parameters
def _layer_shapes(cfg: ModelConfig, sparse: bool) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's weights (matmul weights are [in, out])."""
    H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = dict(ln1=(H,), wq=(H, cfg.num_heads * D), wk=(H, cfg.num_kv_heads * D),
                  wv=(H, cfg.num_kv_heads * D), q_norm=(D,), k_norm=(D,),
                  wo=(cfg.num_heads * D, H), ln2=(H,), w_gate=(H, I), w_up=(H, I),
                  w_down=(I, H))
    if sparse:
        Di = cfg.index_head_dim
        shapes.update(w_iq=(H, cfg.num_kv_heads * Di), w_ik=(H, Di), iq_norm=(Di,),
                      ik_norm=(Di,))
    return shapes


def param_shapes(cfg: ModelConfig) -> dict:
    """The parameter pytree's shapes: layer groups are stacked on a leading layer axis."""
    shapes = dict(embed=(cfg.vocab_size, cfg.hidden_size), final_norm=(cfg.hidden_size,),
                  lm_head=(cfg.hidden_size, cfg.vocab_size))
    for group, n, sparse in (("dense", cfg.num_dense_layers, False),
                             ("sparse", cfg.num_sparse_layers, True)):
        if n:
            shapes[group] = {k: (n, *s) for k, s in _layer_shapes(cfg, sparse).items()}
    return shapes


def init_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Seeded random weights: matmuls N(0, 1/fan_in), norm weights N(0, 0.1) (Gemma's 1+w)."""
    shapes = param_shapes(cfg)
    rng = np.random.default_rng(seed)
    names = flat_names(shapes)
    arrays = {}
    for name, shape in names.items():
        base = name.rsplit(".", 1)[-1]
        if "norm" in base or base in ("ln1", "ln2"):
            a = rng.normal(0.0, 0.1, shape)
        elif base == "embed":
            a = rng.normal(0.0, 1.0, shape)
        else:
            a = rng.normal(0.0, shape[-2] ** -0.5, shape)
        arrays[name] = a.astype(np.float32)
    return unflatten(arrays, shapes)


def flat_names(tree, prefix="") -> dict:
    """{"sparse.wq": shape, ...} for a nested dict of shapes or arrays."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat_names(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def unflatten(flat: dict, like: dict) -> dict:
    """``{"sparse.wq": array, ...}`` -> the nested pytree shaped like ``like`` (jnp arrays)."""
    out = {}
    for k, v in like.items():
        out[k] = unflatten({n[len(k) + 1:]: a for n, a in flat.items() if n.startswith(k + ".")},
                            v) if isinstance(v, dict) else jnp.asarray(flat[k])
    return out


# ----------------------------------------------------------------------------- caches
def allocate_caches(cfg: ModelConfig, num_pages: int, compare: bool) -> dict:
    """All caches of the step, one pytree (donated to every step).

    kv: ``uint8[L, P, 2Hkv', N, 72]`` NVFP4 K/V of every layer (layout "LBHNC"), Hkv' =
      ``cfg.cache_kv_heads`` (KV heads replicated for tensor parallel past Hkv).
    idx: ``bf16[L_sparse, P, N, Di]`` the indexer's key-only cache of the sparse layers.
    ref_k, ref_v: ``bf16[L, P, Hkv, N, D]`` the reference stream's dense-format cache.
    """
    spec = m3.KVCacheSpec(cfg.cache_kv_heads, cfg.head_dim, cfg.block_size)
    caches = dict(
        kv=m3.allocate_kv_cache(spec, num_pages, cfg.num_layers, KV_LAYOUT),
        idx=jnp.zeros((max(cfg.num_sparse_layers, 1), num_pages, cfg.block_size,
                       cfg.index_head_dim), jnp.bfloat16))
    if compare:
        shape = (cfg.num_layers, num_pages, cfg.num_kv_heads, cfg.block_size, cfg.head_dim)
        caches.update(ref_k=jnp.zeros(shape, jnp.bfloat16), ref_v=jnp.zeros(shape, jnp.bfloat16))
    return caches


# ----------------------------------------------------------------------------- building blocks
def gemma_rms_norm(x, w, eps):
    """``x · rsqrt(mean(x²) + eps) · (1 + w)`` over the last axis, in fp32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def rope(x, pos, rope_dim, theta):
    """NeoX rotate-half RoPE on the first ``rope_dim`` dims of ``x [T, H, d]``; pos ``[T]``."""
    half = rope_dim // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    ang = pos.astype(jnp.float32)[:, None, None] * inv_freq                # [T, 1, half]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x1, x2, rest = x[..., :half], x[..., half:rope_dim], x[..., rope_dim:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def qkv(p, h, pos, cfg):
    """Per-head Gemma-normed, RoPE'd q ``[T, Hq, D]``, k ``[T, Hkv, D]``; raw v ``[T, Hkv, D]``."""
    T, D = h.shape[0], cfg.head_dim
    q = (h @ p["wq"]).reshape(T, cfg.num_heads, D)
    k = (h @ p["wk"]).reshape(T, cfg.num_kv_heads, D)
    v = (h @ p["wv"]).reshape(T, cfg.num_kv_heads, D)
    q = rope(gemma_rms_norm(q, p["q_norm"], cfg.rms_eps), pos, cfg.rope_dim, cfg.rope_theta)
    k = rope(gemma_rms_norm(k, p["k_norm"], cfg.rms_eps), pos, cfg.rope_dim, cfg.rope_theta)
    return q, k, v


def indexer(p, h, pos, cfg):
    """Index queries ``[T, Hkv, Di]`` (one head per KV head) and shared keys ``[T, Di]``."""
    T, Di = h.shape[0], cfg.index_head_dim
    iq = (h @ p["w_iq"]).reshape(T, cfg.num_kv_heads, Di)
    ik = (h @ p["w_ik"]).reshape(T, 1, Di)
    iq = rope(gemma_rms_norm(iq, p["iq_norm"], cfg.rms_eps), pos, cfg.rope_dim, cfg.rope_theta)
    ik = rope(gemma_rms_norm(ik, p["ik_norm"], cfg.rms_eps), pos, cfg.rope_dim, cfg.rope_theta)
    return iq, ik[:, 0]


def mlp(p, x, cfg):
    """Pre-norm dense SwiGLU with residual (M3 itself uses MoE here)."""
    h = gemma_rms_norm(x, p["ln2"], cfg.rms_eps)
    return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def write_pages(cache, values, slot_mapping, block_size):
    """Scatters ``values [T, ...]`` into a paged cache ``[P, N, ...]`` at slots (< 0: dropped)."""
    P = cache.shape[0]
    ok = slot_mapping >= 0
    page = jnp.where(ok, slot_mapping // block_size, P)                 # P: out of range, dropped
    return cache.at[page, slot_mapping % block_size].set(values.astype(cache.dtype), mode="drop")


def paged_attention_bf16(q, k_cache, v_cache, topk, block_table, req, pos, scale, chunk=32):
    """Plain-jnp attention over a bf16 paged cache with the masking of SPEC §5.2.

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


# ----------------------------------------------------------------------------- one step
def batch_rows(batch: dict, num_decode_requests: int, decode_query_len: int):
    """A step's mixed-batch metadata and per-row ``(request, position)`` (token_rows)."""
    T = batch["tokens"].shape[0]
    meta = m3.build_attention_metadata(batch["query_lens"], batch["context_lens"],
                                       batch["block_table"], num_decode_requests=num_decode_requests,
                                       num_tokens=T, decode_query_len=decode_query_len)
    return (meta, *token_rows(meta, T))


def token_rows(meta: m3.SparseAttentionMetadata, num_tokens: int):
    """(request row, absolute position) per token, ``int32[T]`` each; −1 for padding."""
    nd, dql = meta.num_decode_tokens, meta.decode_query_len
    t = jnp.arange(nd, dtype=jnp.int32)
    r = t // dql
    dpos = meta.seq_lens[r] - dql + t % dql if nd else t
    live = meta.seq_lens[r] > 0 if nd else t >= 0
    req = jnp.concatenate([jnp.where(live, r, -1), meta.query_req_id])
    pos = jnp.concatenate([jnp.where(live, dpos, -1), meta.query_abs_pos])
    return req[:num_tokens], pos[:num_tokens]


def _cpu() -> bool:
    """The GPU kernels serve K = 16 only (SPEC §1): elsewhere dense layers use the jnp reference."""
    return jax.default_backend() == "cpu"


def _agreement_sums(a, b, valid):
    """[4] sums over valid rows: (a·b, a·a, b·b, |a−b|²) for cosine and relative Frobenius."""
    a = jnp.where(valid[:, None], a.reshape(a.shape[0], -1).astype(jnp.float32), 0.0)
    b = jnp.where(valid[:, None], b.reshape(b.shape[0], -1).astype(jnp.float32), 0.0)
    return jnp.stack([jnp.sum(a * b), jnp.sum(a * a), jnp.sum(b * b), jnp.sum((a - b) ** 2)])


def _reference_layer(cfg, meta, p, layer, x_ref, caches, slots, req, pos, topk):
    """The reference stream's layer: bf16 K/V cache, plain-jnp attention, given selections."""
    T = x_ref.shape[0]
    h = gemma_rms_norm(x_ref, p["ln1"], cfg.rms_eps)
    q, k, v = qkv(p, h, pos, cfg)
    # The ref caches are [L, P, Hkv, N, D]; write_pages wants the slot axes (P, N) first.
    rk = write_pages(jnp.swapaxes(caches["ref_k"][layer], 1, 2), k, slots, cfg.block_size)
    rv = write_pages(jnp.swapaxes(caches["ref_v"][layer], 1, 2), v, slots, cfg.block_size)
    rk, rv = jnp.swapaxes(rk, 1, 2), jnp.swapaxes(rv, 1, 2)
    caches = dict(caches, ref_k=caches["ref_k"].at[layer].set(rk),
                  ref_v=caches["ref_v"].at[layer].set(rv))
    attn = paged_attention_bf16(q.astype(jnp.bfloat16), rk, rv, topk, meta.block_table, req, pos,
                                cfg.head_dim ** -0.5)
    x_ref = mlp(p, x_ref + attn.reshape(T, -1) @ p["wo"], cfg)
    return x_ref, caches, attn


def _layer(cfg, meta, batch, req, pos, compare, sparse, carry, xs):
    """One decoder layer on both streams. carry: (x, x_ref, caches); xs: (params, layer)."""
    x, x_ref, caches = carry
    p, layer = xs
    T = x.shape[0]
    slots = batch["slot_mapping"]
    scale = cfg.head_dim ** -0.5
    h = gemma_rms_norm(x, p["ln1"], cfg.rms_eps)
    q, k, v = qkv(p, h, pos, cfg)
    # Write this step's K/V before anything reads the cache (the serving path's order).
    # At TP > Hkv each KV head is stored kv_replicas times (each device owns whole heads).
    rep = functools.partial(replicate_kv_heads, replicas=cfg.kv_replicas)
    kv = m3.pack_kv_pages(caches["kv"], rep(k.astype(jnp.bfloat16)), rep(v.astype(jnp.bfloat16)),
                          slots, K_SCALE, V_SCALE, layer=layer, layout=KV_LAYOUT)
    caches = dict(caches, kv=kv)
    M = meta.block_table.shape[1]
    if sparse:
        iq, ik = indexer(p, h, pos, cfg)
        li = layer - cfg.num_dense_layers
        idx_l = write_pages(caches["idx"][li], ik, slots, cfg.block_size)
        caches["idx"] = caches["idx"].at[li].set(idx_l)
        topk = select_blocks(iq, idx_l, meta.block_table, req, pos, topk_blocks=cfg.topk_blocks)
    else:  # dense: every block (invalid / future ones are skipped by the kernel)
        topk = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), (cfg.num_kv_heads, T, M))
    attend = m3.sparse_attention if sparse or _cpu() else m3.reference.sparse_attention
    attn = attend(q.astype(jnp.bfloat16), kv, rep(topk, axis=0), meta, K_SCALE, V_SCALE,
                  scale=scale, layer=layer, layout=KV_LAYOUT)
    x = mlp(p, x + attn.astype(jnp.float32).reshape(T, -1) @ p["wo"], cfg)

    # Token-block pairs attended vs visible (pos // N + 1 per live token): how much is skipped.
    live = req >= 0
    blocks = jnp.stack([jnp.sum(jnp.where(live[None, :, None], topk >= 0, False)),
                        cfg.num_kv_heads * jnp.sum(jnp.where(live, pos // cfg.block_size + 1, 0))])
    stats = jnp.zeros((2, 4), jnp.float32)
    if compare:
        x_ref, caches, attn_r = _reference_layer(cfg, meta, p, layer, x_ref, caches, slots, req,
                                                 pos, topk)
        is_dec = jnp.arange(T) < meta.num_decode_tokens
        stats = jnp.stack([_agreement_sums(attn, attn_r, live & is_dec),
                           _agreement_sums(attn, attn_r, live & ~is_dec)])
    return (x, x_ref, caches), (stats, blocks)


@functools.partial(jax.jit, static_argnames=("cfg", "num_decode_requests", "decode_query_len",
                                             "compare"), donate_argnames=("caches",))
def forward_step(params, caches, batch, *, cfg: ModelConfig, num_decode_requests: int,
                 decode_query_len: int, compare: bool):
    """One engine step: writes this step's tokens into the caches and returns logits.

    Args:
      params: from :func:`init_params` / ``load_checkpoint``.
      caches: from :func:`allocate_caches` (donated: updated in place).
      batch: dict of int32 arrays: ``tokens [T]``, ``slot_mapping [T]`` (−1 for padding),
        ``query_lens [R]``, ``context_lens [R]``, ``block_table [R, M]`` with the
        ``num_decode_requests`` decode requests first (each ``decode_query_len`` rows;
        query_len 0 = padded), then prefill chunks (SPEC §5.6).
      cfg, num_decode_requests, decode_query_len, compare: static.

    Returns:
      ``(caches, out)``: out has ``logits [T, V]`` fp32 of the served stream, their greedy
      tokens ``greedy int32[T]`` (sampling happens in the step), ``blocks
      [L, 2]`` (token-block pairs selected, blocks visible; dense layers select all) and, with
      ``compare``, ``ref_logits [T, V]`` and ``attn_stats [L, 2, 4]`` (per layer; decode rows,
      prefill rows; sums a·b, a·a, b·b, |a−b|² of served vs reference attention outputs).
    """
    meta, req, pos = batch_rows(batch, num_decode_requests, decode_query_len)
    x = params["embed"][batch["tokens"]]
    carry = (x, x, caches)
    all_stats, all_blocks = [], []
    for group, sparse, first in (("dense", False, 0), ("sparse", True, cfg.num_dense_layers)):
        if group not in params:
            continue
        n = params[group]["ln1"].shape[0]
        body = functools.partial(_layer, cfg, meta, batch, req, pos, compare, sparse)
        carry, (stats, blocks) = jax.lax.scan(body, carry, (params[group],
                                                            first + jnp.arange(n, dtype=jnp.int32)))
        all_stats.append(stats)
        all_blocks.append(blocks)
    x, x_ref, caches = carry

    def logits_of(h):
        return gemma_rms_norm(h, params["final_norm"], cfg.rms_eps) @ params["lm_head"]

    logits = logits_of(x)
    out = dict(logits=logits, greedy=jnp.argmax(logits, axis=-1).astype(jnp.int32),
               blocks=jnp.concatenate(all_blocks))
    if compare:
        out.update(ref_logits=logits_of(x_ref), attn_stats=jnp.concatenate(all_stats))
    return caches, out
