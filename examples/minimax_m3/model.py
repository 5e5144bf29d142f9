"""MiniMax M3's text model in JAX over jax_m3sparse's NVFP4 paged cache.

Read it beside transformers' ``modeling_minimax_m3_vl.py``: the same weight names (the param
pytree's keys are the checkpoint's, ``self_attn.q_proj`` ...), the same order of operations
(``MiniMaxM3VLDecoderLayer``: norm, attention, residual, norm, MLP, residual). Per layer,
``layer_types`` picks full or sparse (indexer) attention and ``mlp_layer_types`` a dense MLP or
the mixture of experts (``moe.py``); runs of equal layers are stacked and scanned.

One jitted :func:`forward_step` runs a mixed batch (decode rows first, prefill chunks after,
SPEC §5.6) through every layer, as two streams in lockstep on the same tokens:

* the **served** stream: K/V packed to NVFP4 in one 5-D ``uint8`` cache for all layers
  (layout "LBHNC", ``[L, P, 2Hkv, N, 72]``), index keys in a bf16 key-only paged cache,
  selection by :func:`jax_m3sparse.select.select_blocks`, attention by
  :func:`jax_m3sparse.sparse_attention` (full-attention layers: every block selected);
* the **reference** stream (``compare=True``): the same model with a dense-format paged cache
  (``cfg.reference_dtype``: bf16, or float32 to match transformers' fp32 run) and plain-``jnp``
  attention, over the served stream's selections (``reference_selection="served"``: it
  measures what NVFP4 costs at equal selections) or its own index keys and selections
  (``"own"``: an independent twin of transformers' model, as the tests use it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_m3sparse as m3
from jax_m3sparse.sharding import replicate_kv_heads

from . import moe
from .attention import (gemma_rms_norm, paged_attention_jnp, qkv, rotary_cos_sin, select,
                        write_pages)
from .config import MOE, SPARSE, ModelConfig
from .parallel import is_shape

KV_LAYOUT = "LBHNC"
K_SCALE = V_SCALE = 1.0   # NVFP4 global scales: K is RMS-normed, V of unit-ish size


# ----------------------------------------------------------------------------- parameters
def layer_shapes(cfg: ModelConfig, attn: str, mlp: str) -> dict:
    """One layer's weights (PyTorch ``[out, in]``; packed gate_up as ``[2, I, H]``)."""
    H, D = cfg.hidden_size, cfg.head_dim
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    self_attn = dict(q_proj=(Hq * D, H), k_proj=(Hkv * D, H), v_proj=(Hkv * D, H),
                     o_proj=(H, Hq * D), q_norm=(D,), k_norm=(D,))
    if attn == SPARSE:
        Di = cfg.index_head_dim
        self_attn["indexer"] = dict(q_proj=(cfg.index_n_heads * Di, H), k_proj=(Di, H),
                                    q_norm=(Di,), k_norm=(Di,))

    def swiglu(inter):
        return dict(gate_up_proj=(2, inter, H), down_proj=(H, inter))

    if mlp == MOE:
        E, I = cfg.num_local_experts, cfg.intermediate_size
        mlp_shapes = dict(gate=(E, H), e_score_correction_bias=(E,),
                          experts=dict(gate_up_proj=(E, 2, I, H), down_proj=(E, H, I)),
                          shared_experts=swiglu(cfg.shared_intermediate_size))
    else:
        mlp_shapes = swiglu(cfg.dense_intermediate_size)
    return dict(input_layernorm=(H,), self_attn=self_attn, post_attention_layernorm=(H,),
                mlp=mlp_shapes)


def param_shapes(cfg: ModelConfig) -> dict:
    """The parameter pytree's shapes: ``segments[i]`` holds :meth:`ModelConfig.segments`' run i,
    each leaf stacked on a leading layer axis. No ``lm_head`` with tied embeddings."""
    stack = lambda n: (lambda s: (n, *s))
    shapes = dict(embed_tokens=(cfg.vocab_size, cfg.hidden_size), norm=(cfg.hidden_size,),
                  segments=[jax.tree_util.tree_map(stack(n), layer_shapes(cfg, a, m),
                                                   is_leaf=lambda x: isinstance(x, tuple))
                            for a, m, _, n in cfg.segments()])
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def init_params(cfg: ModelConfig, seed: int = 0, shardings=None) -> dict:
    """Seeded random float32 weights: matmuls N(0, 1/fan_in), norms N(0, 0.1) (Gemma's 1 + w),
    embeddings N(0, 1), router bias N(0, 0.1). ``shardings``: a matching pytree of
    ``NamedSharding`` (parallel.param_shardings) to place each leaf, else the default device."""
    rng = np.random.default_rng(seed)

    def make(path, shape):
        name = jax.tree_util.keystr(path)
        if "norm" in name or "bias" in name:
            std = 0.1
        elif "embed" in name:
            std = 1.0
        else:
            std = shape[-1] ** -0.5
        return rng.normal(0.0, std, shape).astype(np.float32)

    host = jax.tree_util.tree_map_with_path(make, param_shapes(cfg), is_leaf=is_shape)
    if shardings is None:
        return jax.tree_util.tree_map(jnp.asarray, host)
    return jax.tree_util.tree_map(jax.device_put, host, shardings)


# ----------------------------------------------------------------------------- caches
def allocate_caches(cfg: ModelConfig, num_pages: int, compare: bool) -> dict:
    """All caches of the step, one pytree (donated to every step).

    kv: ``uint8[L, P, 2Hkv', N, 72]`` NVFP4 K/V of every layer (layout "LBHNC"), Hkv' =
      ``cfg.cache_kv_heads`` (KV heads replicated for tensor parallel past Hkv).
    idx: ``bf16[L_sparse, P, N, Di]`` the index keys of the sparse-attention layers.
    ref_k, ref_v: ``[L, P, Hkv, N, D]``, ref_idx: ``[L_sparse, P, N, Di]`` in
      ``cfg.reference_dtype``: the reference stream's own caches.
    """
    spec = m3.KVCacheSpec(cfg.cache_kv_heads, cfg.head_dim, cfg.block_size)
    idx_shape = (max(len(cfg.sparse_layers), 1), num_pages, cfg.block_size, cfg.index_head_dim)
    caches = dict(kv=m3.allocate_kv_cache(spec, num_pages, cfg.num_layers, KV_LAYOUT),
                  idx=jnp.zeros(idx_shape, jnp.bfloat16))
    if compare:
        ref = jnp.dtype(cfg.reference_dtype)
        shape = (cfg.num_layers, num_pages, cfg.num_key_value_heads, cfg.block_size, cfg.head_dim)
        caches.update(ref_k=jnp.zeros(shape, ref), ref_v=jnp.zeros(shape, ref),
                      ref_idx=jnp.zeros(idx_shape, ref))
    return caches


# ----------------------------------------------------------------------------- step metadata
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
    """The GPU kernels serve K = 16 only (SPEC §1): elsewhere full layers use the jnp reference."""
    return jax.default_backend() == "cpu"


def _agreement_sums(a, b, valid):
    """[4] sums over valid rows: (a·b, a·a, b·b, |a−b|²) for cosine and relative Frobenius."""
    a = jnp.where(valid[:, None], a.reshape(a.shape[0], -1).astype(jnp.float32), 0.0)
    b = jnp.where(valid[:, None], b.reshape(b.shape[0], -1).astype(jnp.float32), 0.0)
    return jnp.stack([jnp.sum(a * b), jnp.sum(a * a), jnp.sum(b * b), jnp.sum((a - b) ** 2)])


def _same_sets(a, b, live):
    """[2]: (token, head) pairs whose selected block sets are equal, and live pairs."""
    same = jnp.all(jnp.sort(a, axis=-1) == jnp.sort(b, axis=-1), axis=-1) & live[None]
    return jnp.stack([jnp.sum(same), jnp.sum(jnp.broadcast_to(live[None], same.shape))])


# ----------------------------------------------------------------------------- one layer
class _Step:
    """What every layer of one step shares: config, metadata, rows, rotary tables."""

    def __init__(self, cfg, meta, batch, req, pos, compare, collect):
        self.cfg, self.meta, self.req, self.pos = cfg, meta, req, pos
        self.slots = batch["slot_mapping"]
        self.compare, self.collect = compare, collect
        self.cos, self.sin = rotary_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta)
        self.all_blocks = jnp.broadcast_to(jnp.arange(meta.block_table.shape[1], dtype=jnp.int32),
                                           (cfg.num_key_value_heads, pos.shape[0],
                                            meta.block_table.shape[1]))

    def selection(self, p, h, idx_cache, sparse):
        """(topk, idx_cache): the indexer's on sparse layers, every block on full ones."""
        if not sparse:
            return self.all_blocks, idx_cache
        return select(p["indexer"], h, self.cos, self.sin, self.cfg, idx_cache, self.slots,
                      self.meta.block_table, self.req, self.pos)

    def served_attention(self, p, h, caches, layer, li, sparse, given=None):
        """The NVFP4 stream's attention output ``[T, Hq·D]`` (fp32), caches, topk."""
        cfg = self.cfg
        q, k, v = qkv(p, h, self.cos, self.sin, cfg)
        # Write this step's K/V before anything reads the cache (the serving path's order).
        # At TP > Hkv each KV head is stored kv_replicas times (each device owns whole heads).
        rep = functools.partial(replicate_kv_heads, replicas=cfg.kv_replicas)
        kv = m3.pack_kv_pages(caches["kv"], rep(k.astype(jnp.bfloat16)),
                              rep(v.astype(jnp.bfloat16)), self.slots, K_SCALE, V_SCALE,
                              layer=layer, layout=KV_LAYOUT)
        topk, idx_l = self.selection(p, h, caches["idx"][li], sparse)
        caches = dict(caches, kv=kv, idx=caches["idx"].at[li].set(idx_l) if sparse else caches["idx"])
        attend = m3.sparse_attention if sparse or _cpu() else m3.reference.sparse_attention
        attn = attend(q.astype(jnp.bfloat16), kv, rep(topk, axis=0), self.meta, K_SCALE, V_SCALE,
                      scale=cfg.head_dim ** -0.5, layer=layer, layout=KV_LAYOUT)
        return attn.astype(jnp.float32).reshape(h.shape[0], -1), caches, topk

    def reference_attention(self, p, h, caches, layer, li, sparse, given=None):
        """The reference stream's: dense-format paged cache, plain jnp; the served stream's
        selection ``given``, or its own (``cfg.reference_selection == "own"``)."""
        cfg = self.cfg
        q, k, v = qkv(p, h, self.cos, self.sin, cfg)
        # The ref caches are [L, P, Hkv, N, D]; write_pages wants the slot axes (P, N) first.
        put = lambda c, x: jnp.swapaxes(write_pages(jnp.swapaxes(c[layer], 1, 2), x, self.slots,
                                                    cfg.block_size), 1, 2)
        rk, rv = put(caches["ref_k"], k), put(caches["ref_v"], v)
        caches = dict(caches, ref_k=caches["ref_k"].at[layer].set(rk),
                      ref_v=caches["ref_v"].at[layer].set(rv))
        topk = given
        if sparse and cfg.reference_selection == "own":
            topk, idx_l = self.selection(p, h, caches["ref_idx"][li], sparse)
            caches["ref_idx"] = caches["ref_idx"].at[li].set(idx_l)
        attn = paged_attention_jnp(q.astype(rk.dtype), rk, rv, topk, self.meta.block_table,
                                   self.req, self.pos, cfg.head_dim ** -0.5)
        return attn.reshape(h.shape[0], -1), caches, topk

    def layer(self, attn_kind, mlp_kind, carry, xs):
        """``MiniMaxM3VLDecoderLayer`` on both streams. carry (x, x_ref, caches); xs (params,
        global layer index, index-cache row)."""
        x, x_ref, caches = carry
        p, layer, li = xs
        cfg, sparse, is_moe = self.cfg, attn_kind == SPARSE, mlp_kind == MOE

        def block(x, attention, caches, given=None):
            h = gemma_rms_norm(x, p["input_layernorm"], cfg.rms_norm_eps)
            attn, caches, topk = attention(p["self_attn"], h, caches, layer, li, sparse, given)
            x = x + moe.linear(attn, p["self_attn"]["o_proj"])
            h = gemma_rms_norm(x, p["post_attention_layernorm"], cfg.rms_norm_eps)
            return x + moe.mlp(p["mlp"], h, cfg, is_moe), caches, attn, topk

        x, caches, attn, topk = block(x, self.served_attention, caches)
        live = self.req >= 0
        # Token-block pairs attended vs visible (pos // N + 1 per live token).
        ys = dict(blocks=jnp.stack([
            jnp.sum(jnp.where(live[None, :, None], topk >= 0, False)),
            cfg.num_key_value_heads * jnp.sum(jnp.where(live, self.pos // cfg.block_size + 1, 0))]))
        if self.compare:
            x_ref, caches, attn_r, topk_r = block(x_ref, self.reference_attention, caches, topk)
            is_dec = jnp.arange(x.shape[0]) < self.meta.num_decode_tokens
            ys.update(attn_stats=jnp.stack([_agreement_sums(attn, attn_r, live & is_dec),
                                            _agreement_sums(attn, attn_r, live & ~is_dec)]),
                      same_blocks=_same_sets(topk, topk_r, live) if sparse
                      else jnp.zeros(2, jnp.int32))
            if self.collect:
                ys.update(ref_hidden=x_ref, ref_topk=topk_r if sparse else None)
        if self.collect:
            ys.update(hidden=x, topk=topk if sparse else None)
        return (x, x_ref, caches), ys


def logits_of(params, h, cfg):
    """Final Gemma norm, then ``lm_head`` (the embedding matrix when tied)."""
    head = params["embed_tokens"] if cfg.tie_word_embeddings else params["lm_head"]
    return moe.linear(gemma_rms_norm(h, params["norm"], cfg.rms_norm_eps), head)


@functools.partial(jax.jit, static_argnames=("cfg", "num_decode_requests", "decode_query_len",
                                             "compare", "collect"), donate_argnames=("caches",))
def forward_step(params, caches, batch, *, cfg: ModelConfig, num_decode_requests: int,
                 decode_query_len: int, compare: bool, collect: bool = False):
    """One engine step: writes this step's tokens into the caches and returns logits.

    Args:
      params: from :func:`init_params` / ``checkpoint.load_params``.
      caches: from :func:`allocate_caches` (donated: updated in place).
      batch: dict of int32 arrays: ``tokens [T]``, ``slot_mapping [T]`` (−1 for padding),
        ``query_lens [R]``, ``context_lens [R]``, ``block_table [R, M]`` with the
        ``num_decode_requests`` decode requests first (each ``decode_query_len`` rows;
        query_len 0 = padded), then prefill chunks (SPEC §5.6).
      cfg, num_decode_requests, decode_query_len, compare, collect: static.

    Returns:
      ``(caches, out)``: out has ``logits [T, V]`` fp32 of the served stream and their greedy
      tokens ``greedy int32[T]``, ``blocks [L, 2]`` (token-block pairs selected, blocks
      visible); with ``compare`` also ``ref_logits``, ``ref_greedy``, ``attn_stats [L, 2, 4]``
      (per layer; decode rows, prefill rows; sums a·b, a·a, b·b, |a−b|² of served vs
      reference attention outputs) and ``same_blocks [L, 2]`` ((token, KV head) pairs whose
      served and reference selections are the same set, live pairs; zeros on full layers);
      with ``collect`` the per-layer hidden states ``hidden [L + 1, T, H]`` (embeddings first;
      ``ref_hidden`` likewise) and the sparse layers' selections ``topk [L_sparse, Hkv, T, K]``
      (``ref_topk``).
    """
    meta, req, pos = batch_rows(batch, num_decode_requests, decode_query_len)
    step = _Step(cfg, meta, batch, req, pos, compare, collect)
    x0 = params["embed_tokens"][batch["tokens"]].astype(jnp.float32)
    carry, outs = (x0, x0, caches), []
    sparse_rank = np.cumsum([t == SPARSE for t in cfg.layer_types]) - 1
    for p, (attn_kind, mlp_kind, first, n) in zip(params["segments"], cfg.segments()):
        layers = np.arange(first, first + n)
        xs = (p, jnp.asarray(layers, jnp.int32),
              jnp.asarray(np.maximum(sparse_rank[layers], 0), jnp.int32))
        carry, ys = jax.lax.scan(functools.partial(step.layer, attn_kind, mlp_kind), carry, xs)
        outs.append(ys)
    x, x_ref, caches = carry
    cat = lambda key: jnp.concatenate([o[key] for o in outs if o.get(key) is not None])
    logits = logits_of(params, x, cfg)
    out = dict(logits=logits, greedy=jnp.argmax(logits, axis=-1).astype(jnp.int32),
               blocks=cat("blocks"))
    if compare:
        ref_logits = logits_of(params, x_ref, cfg)
        out.update(ref_logits=ref_logits, ref_greedy=jnp.argmax(ref_logits, -1).astype(jnp.int32),
                   attn_stats=cat("attn_stats"), same_blocks=cat("same_blocks"))
    if collect:
        out.update(hidden=jnp.concatenate([x0[None], cat("hidden")]),
                   topk=cat("topk") if cfg.sparse_layers else None)
        if compare:
            out.update(ref_hidden=jnp.concatenate([x0[None], cat("ref_hidden")]),
                       ref_topk=cat("ref_topk") if cfg.sparse_layers else None)
    return caches, out
