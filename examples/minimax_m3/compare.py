"""The accuracy comparison: the served step and a baseline stream, as a wrapper around the step.

The **baseline** stream is the same model over dense-format paged caches
(``cfg.baseline_dtype``: bf16, or float32 to match transformers' fp32 run) with plain-``jnp``
attention (``attention.paged_attention_jnp``), over the served step's block selections
(``cfg.baseline_selection == "served"``: it measures what NVFP4 costs at equal selections) or
its own index keys and selections (``"own"``: an independent twin of transformers' model, as
the tests use it). Its weights, tokens and sampling parameters are the served step's; its
routing is its own.

:func:`forward_step` runs the served step (``model.forward_step``, asked to collect each
layer's attention output and selections), then :func:`baseline_step` over the baseline's own
caches, and reduces the comparison on the device. It has the served step's interface
(``engine.ModelStep``) and the caches of both (:func:`allocate_caches`), so the engine drives
it in place of the model when ``EngineConfig.compare`` is set.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import jax_m3sparse as m3

from . import model, sampling
from .attention import paged_attention_jnp, project, write_pages
from .config import MOE, SPARSE, ModelConfig

PREFIX = "baseline_"     # the baseline's caches in the step's (flat) cache dict


def allocate_caches(cfg: ModelConfig, num_pages: int) -> dict:
    """The served step's caches (``model.allocate_caches``) and the baseline's, in
    ``cfg.baseline_dtype``: ``baseline_k``, ``baseline_v [L, P, Hkv, N, D]``, ``baseline_idx
    [L_sparse, P, N, Di]``."""
    dtype = jnp.dtype(cfg.baseline_dtype)
    shape = (cfg.num_layers, num_pages, cfg.num_key_value_heads, cfg.block_size, cfg.head_dim)
    return dict(model.allocate_caches(cfg, num_pages),
                **{PREFIX + "k": jnp.zeros(shape, dtype), PREFIX + "v": jnp.zeros(shape, dtype),
                   PREFIX + "idx": jnp.zeros(model.index_cache_shape(cfg, num_pages), dtype)})


def agreement_sums(a, b, valid):
    """``[4]`` sums over the ``valid`` rows of ``a``, ``b [T, ...]``: (a·b, a·a, b·b, |a−b|²),
    for the cosine and the relative Frobenius error |a−b| / |b|."""
    a = jnp.where(valid[:, None], a.reshape(a.shape[0], -1).astype(jnp.float32), 0.0)
    b = jnp.where(valid[:, None], b.reshape(b.shape[0], -1).astype(jnp.float32), 0.0)
    return jnp.stack([jnp.sum(a * b), jnp.sum(a * a), jnp.sum(b * b), jnp.sum((a - b) ** 2)])


def same_sets(a, b, live):
    """``int32[2]``: (token, head) pairs of ``a``, ``b [Hkv, T, K]`` whose selected block sets
    are equal, and live pairs."""
    same = jnp.all(jnp.sort(a, axis=-1) == jnp.sort(b, axis=-1), axis=-1) & live[None]
    return jnp.stack([jnp.sum(same), jnp.sum(jnp.broadcast_to(live[None], same.shape))])


def _own_selection(step, iq, ik, idx_cache):
    """The baseline's own selection ``(topk [Hkv, T, K], idx_cache)`` for index queries ``iq
    [T, Hkv, Di]`` and keys ``ik [T, Di]``: the keys written into its ``[P, N, Di]`` cache in
    the baseline's dtype, then the library's plain-jnp ``select_blocks``
    (jax_m3sparse.reference: any float dtype; the served step's primitive takes bf16 or FP8
    keys)."""
    cfg = step.cfg
    idx_cache = write_pages(idx_cache, ik, step.slots, cfg.block_size)
    topk = m3.reference.select_blocks(iq, idx_cache, step.meta.block_table, step.req, step.pos,
                                      topk_blocks=cfg.index_topk_blocks,
                                      local_blocks=cfg.index_local_blocks)
    return topk, idx_cache


def _attention(step, p, h, caches, layer, li, sparse, given):
    """The baseline's attention ``[T, Hq·D]`` (fp32): writes K/V (and, with its own selection,
    index keys) into its dense caches first, then attends over ``given`` (the served step's
    selection) or its own. Returns ``(attn, (caches, topk))``."""
    cfg = step.cfg
    q, k, v, iq, ik = project(p, h, step.cos, step.sin, cfg)
    k, v = k[:, ::cfg.kv_replicas], v[:, ::cfg.kv_replicas]     # one copy of each KV head
    # The caches are [L, P, Hkv, N, D]; write_pages wants the slot axes (P, N) first.
    put = lambda c, x: jnp.swapaxes(write_pages(jnp.swapaxes(c[layer], 1, 2), x, step.slots,
                                                cfg.block_size), 1, 2)
    k_l, v_l = put(caches["k"], k), put(caches["v"], v)
    caches = dict(caches, k=caches["k"].at[layer].set(k_l), v=caches["v"].at[layer].set(v_l))
    topk = given
    if sparse and cfg.baseline_selection == "own":
        topk, idx_l = _own_selection(step, iq[:, ::cfg.kv_replicas], ik, caches["idx"][li])
        caches["idx"] = caches["idx"].at[li].set(idx_l)
    attn = paged_attention_jnp(q.astype(k_l.dtype), k_l, v_l, topk, step.meta.block_table,
                               step.req, step.pos, cfg.head_dim ** -0.5)
    return attn.reshape(h.shape[0], -1), (caches, topk)


def baseline_step(params, caches, batch, served, *, cfg, num_decode_requests, decode_query_len,
                  collect=()):
    """The baseline stream over one step, compared layer by layer with the served one.

    Args:
      caches: ``k``, ``v``, ``idx`` (:func:`allocate_caches`' baseline part, unprefixed).
      served: the served step's out with ``attn [L, T, Hq·D]`` and ``topk [L_sparse, Hkv, T,
        K]`` (model.forward_step's ``collect``; topk None without sparse layers).
      collect: as model.forward_step's ("hidden", "topk").

    Returns:
      ``(caches, out)``: ``tokens int32[S]`` and ``logits float32[S, V]`` of the sampled rows
      (same sampling arrays and keys as the served step), ``attn_stats [L, 2, 4]`` (per layer;
      decode rows, prefill rows; :func:`agreement_sums` of served vs baseline attention
      outputs), ``same_blocks [L, 2]`` (:func:`same_sets` of the two selections; zeros on full
      layers), and what ``collect`` names.
    """
    meta, req, pos = model.batch_rows(batch, num_decode_requests, decode_query_len)
    step = model._Step(cfg, meta, batch, req, pos, collect)
    live = req >= 0
    is_dec = jnp.arange(req.shape[0]) < meta.num_decode_tokens

    def layer(attn_kind, mlp_kind, carry, xs):
        x, caches = carry
        p, layer_, li = xs
        sparse = attn_kind == SPARSE
        served_topk = served["topk"][li] if sparse else step.all_blocks
        given = served_topk if cfg.baseline_selection == "served" else step.all_blocks
        x, attn, (caches, topk) = model.decoder_layer(
            p, x, lambda pa, h: _attention(step, pa, h, caches, layer_, li, sparse, given), cfg,
            mlp_kind == MOE)
        served_attn = served["attn"][layer_]
        ys = step.outputs(x, attn, topk, sparse)
        ys.update(attn_stats=jnp.stack([agreement_sums(served_attn, attn, live & is_dec),
                                        agreement_sums(served_attn, attn, live & ~is_dec)]),
                  same_blocks=same_sets(served_topk, topk, live) if sparse
                  else jnp.zeros(2, jnp.int32))
        return (x, caches), ys

    x0 = model.embed(params, batch["tokens"], cfg)
    (x, caches), ys = model.scan_layers(params, cfg, layer, (x0, caches))
    rows = batch["sample_rows"]
    logits = model.logits_of(params, x[jnp.clip(rows, 0, x.shape[0] - 1)], cfg)
    out = dict(sampling.sample_rows_out(logits, batch, pos, return_logits=True),
               attn_stats=ys["attn_stats"], same_blocks=ys["same_blocks"])
    if "hidden" in collect:
        out["hidden"] = jnp.concatenate([x0[None], ys["hidden"]])
    if "topk" in collect:
        out["topk"] = ys.get("topk")
    return caches, out


@functools.partial(jax.jit, static_argnames=("cfg", "num_decode_requests", "decode_query_len",
                                             "num_logprobs", "return_logits", "collect"),
                   donate_argnames=("caches",))
def forward_step(params, caches, batch, *, cfg: ModelConfig, num_decode_requests: int,
                 decode_query_len: int, num_logprobs: int = 0, return_logits: bool = True,
                 collect: tuple[str, ...] = ()):
    """The served step and the baseline stream (``engine.ModelStep``'s interface).

    Args: as ``model.forward_step``; caches from :func:`allocate_caches`. ``return_logits``
    is ignored: the logits of the sampled rows are always returned (the report compares them).

    Returns:
      ``(caches, out)``: the served step's out (``tokens [S]``, ``blocks [L, 2]``, ``logits [S,
      V]``, logprobs when asked, what ``collect`` names), plus ``baseline_tokens [S]``,
      ``baseline_logits [S, V]``, ``attn_stats [L, 2, 4]``, ``same_blocks [L, 2]``
      (:func:`baseline_step`) and, with ``collect``, ``baseline_hidden`` / ``baseline_topk``.
    """
    del return_logits
    base_caches = {k[len(PREFIX):]: v for k, v in caches.items() if k.startswith(PREFIX)}
    served_caches = {k: v for k, v in caches.items() if not k.startswith(PREFIX)}
    kw = dict(cfg=cfg, num_decode_requests=num_decode_requests, decode_query_len=decode_query_len)
    served_caches, out = model.forward_step(params, served_caches, batch, **kw,
                                            num_logprobs=num_logprobs, return_logits=True,
                                            collect=tuple(sorted({"attn", "topk", *collect})))
    base_caches, base = baseline_step(params, base_caches, batch, out, **kw, collect=collect)
    for name in ("attn", "topk"):
        if name not in collect:
            out.pop(name, None)
    out.update(baseline_tokens=base.pop("tokens"), baseline_logits=base.pop("logits"),
               attn_stats=base.pop("attn_stats"), same_blocks=base.pop("same_blocks"))
    out.update((PREFIX + k, v) for k, v in base.items())
    return dict(served_caches, **{PREFIX + k: v for k, v in base_caches.items()}), out
