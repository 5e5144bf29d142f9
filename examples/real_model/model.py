"""A Llama decoder (SmolLM2) over jax_m3sparse's paged caches: the step the M3 Engine drives.

:func:`forward_step` and :func:`allocate_caches` implement the M3 example's engine interface
(``minimax_m3.engine.ModelStep``), so that its continuous-batching
:class:`minimax_m3.engine.Engine` schedules this model unchanged (``Engine(params, cfg, ecfg,
model=real_model.model)``, ``compare=False``). One jitted call runs a mixed batch (decode rows
first, prefill chunks after, SPEC §5.6) through all layers in one ``lax.scan`` with a traced
``layer`` index into the 5-D caches.

The K/V path is chosen by ``LlamaConfig.kv_format`` and ``topk_blocks`` (the study's "paths"):

* ``nvfp4``: one 5-D NVFP4 cache ``uint8[L, P, 2Hkv, N, C]`` (layout "LBHNC"), written by
  :func:`jax_m3sparse.pack_kv_pages` each step and read by :func:`jax_m3sparse.sparse_attention`;
  per-layer global scales ``params["kv_scale"] [L, 2]`` (data, calibrated: see
  :func:`calibrated_kv_scales`).
* ``bf16``: bf16 paged K and V ``[L, P, Hkv, N, D]``, plain-jnp paged attention (the M3
  example's baseline-stream attention, ``paged_attention_jnp``): the unquantized baseline.
  ``f32``: the same in float32 (no K/V rounding at all: the independent check's path).
* ``topk_blocks = 0`` attends every block; ``K > 0`` selects K blocks of 128 tokens per
  (KV head, token) with :func:`select_by_attention` (SmolLM2 has no trained indexer).

Reused from the M3 example (not copied): RoPE, the bf16 paged attention and the per-token
(request, position) rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_m3sparse as m3
from jax_m3sparse import select_blocks
from minimax_m3 import sampling
from minimax_m3.attention import paged_attention_jnp
from minimax_m3.layers import rope
from minimax_m3.model import batch_rows

KV_LAYOUT = "LBHNC"
DENSE_FORMATS = {"bf16": jnp.bfloat16, "f32": jnp.float32}   # plain paged caches
FP4_MAX, E4M3_MAX = 6.0, 448.0


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A Llama-architecture decoder (defaults: SmolLM2-135M) and the K/V path it runs."""

    vocab_size: int = 49152
    hidden_size: int = 576
    num_layers: int = 30
    num_heads: int = 9               # Hq
    num_kv_heads: int = 3            # Hkv (G = 3)
    head_dim: int = 64               # D
    intermediate_size: int = 1536
    rope_theta: float = 1e5
    rms_eps: float = 1e-5
    max_context: int = 8192
    block_size: int = 128            # N
    kv_format: str = "nvfp4"         # "nvfp4", "bf16" or "f32"
    topk_blocks: int = 0             # K; 0 = dense (every block)

    def __post_init__(self):
        if self.kv_format not in ("nvfp4", *DENSE_FORMATS):
            raise ValueError(f"kv_format must be nvfp4, bf16 or f32 (got {self.kv_format!r})")
        if self.topk_blocks < 0:
            raise ValueError(f"topk_blocks must be >= 0 (got {self.topk_blocks})")
        reason = m3.spec.unsupported_reason(self.num_heads, self.num_kv_heads, self.head_dim,
                                            max(self.topk_blocks, 1), self.block_size)
        if reason:
            raise ValueError(reason)

    @property
    def path(self) -> str:
        return f"{self.kv_format}-" + (f"top{self.topk_blocks}" if self.topk_blocks else "dense")

    def with_path(self, path: str) -> "LlamaConfig":
        """``"nvfp4-top16"`` -> kv_format nvfp4, 16 blocks; ``"bf16-dense"`` -> every block."""
        fmt, _, sel = path.partition("-")
        if sel == "dense":
            k = 0
        elif sel.startswith("top") and sel[3:].isdigit() and int(sel[3:]) > 0:
            k = int(sel[3:])
        else:
            raise ValueError(f"path {path!r}: expected '<nvfp4|bf16|f32>-<dense|topK>'")
        return dataclasses.replace(self, kv_format=fmt, topk_blocks=k)


# ----------------------------------------------------------------------------- parameters
def device_params(params: dict, kv_scale=None) -> dict:
    """numpy params (``gguf_model.load``) -> jnp float32, plus ``kv_scale [L, 2]`` (K, V
    NVFP4 dequantization global scales per layer; default 1.0)."""
    out = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), params)
    L = params["layers"]["ln1"].shape[0]
    out["kv_scale"] = jnp.asarray(np.ones((L, 2)) if kv_scale is None else kv_scale, jnp.float32)
    return out


def calibrated_kv_scales(kv_amax, headroom: float = 4.0) -> np.ndarray:
    """Per-layer NVFP4 global scales from K/V amax seen on calibration text: ``g = headroom ·
    amax / (6 · 448)``, so block scales (E4M3) of values up to ``headroom ×`` the calibrated
    amax stay representable; small blocks only lose range below 2^-6 of the scale grid, where
    their values hardly matter. ``kv_amax [L, 2]`` -> ``float32 [L, 2]``."""
    amax = np.maximum(np.asarray(kv_amax, np.float64), 1e-6)
    return (headroom * amax / (FP4_MAX * E4M3_MAX)).astype(np.float32)


# ----------------------------------------------------------------------------- caches
def allocate_caches(cfg: LlamaConfig, num_pages: int) -> dict:
    """The step's caches (donated every step).

    nvfp4: ``kv uint8[L, P, 2Hkv, N, C]`` (layout "LBHNC"), plus with selection ``keys
    bf16[L, P, Hkv, N, D]``, the key-only cache the selection scores (as the M3 indexer keeps
    its index keys in bf16). bf16 / f32: ``k``, ``v`` ``[L, P, Hkv, N, D]`` in that dtype (k
    also serves the selection).
    """
    shape = (cfg.num_layers, num_pages, cfg.num_kv_heads, cfg.block_size, cfg.head_dim)
    if cfg.kv_format in DENSE_FORMATS:
        dtype = DENSE_FORMATS[cfg.kv_format]
        return dict(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
    spec = m3.KVCacheSpec(cfg.num_kv_heads, cfg.head_dim, cfg.block_size)
    caches = dict(kv=m3.allocate_kv_cache(spec, num_pages, cfg.num_layers, KV_LAYOUT))
    if cfg.topk_blocks:
        caches["keys"] = jnp.zeros(shape, jnp.bfloat16)
    return caches


def _write_layer(cache, layer, values, slots, block_size):
    """Writes ``values [T, Hkv, D]`` at ``slots`` (< 0: dropped) into layer ``layer`` of
    ``cache [L, P, Hkv, N, D]`` with one scatter into the whole (scan-carried) cache, which XLA
    updates in place (slicing out the layer and setting it back copies it every layer);
    returns (cache, that layer ``[P, Hkv, N, D]``)."""
    P = cache.shape[1]
    page = jnp.where(slots >= 0, slots // block_size, P)                # P: out of range, dropped
    cache = cache.at[layer, page, :, slots % block_size].set(values.astype(cache.dtype),
                                                              mode="drop")
    return cache, cache[layer]


# ----------------------------------------------------------------------------- layers
def rms_norm(x, w, eps):
    """Llama RMSNorm ``x · rsqrt(mean(x²) + eps) · w`` over the last axis, in fp32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def select_by_attention(q, key_cache, block_table, query_req_id, query_abs_pos, *,
                        topk_blocks, block_size=128):
    """Block selection without a trained indexer: the model's own attention scores.

    For KV head g, the index query is the mean of its G query heads ``q̄ = mean_h q[t, h]``
    (h in g's group; RoPE'd, so ``q̄·k`` is the mean of the heads' attention logits) and the
    index key is the key itself. Block b scores ``max_{p in b, p <= pos} q̄·k[p]``; the token's
    own block is always kept, then the best earlier blocks: exactly the rule and tie order of
    :func:`jax_m3sparse.select_blocks`, with one key cache per KV head.

    Args:
      q: ``[T, Hq, D]`` float, RoPE'd queries. key_cache: ``[P, Hkv, N, D]`` this layer's keys
      (bf16), this step's keys already written. block_table ``int32[R, M]``; query_req_id,
      query_abs_pos ``int32[T]`` (−1: padding). topk_blocks: static K.

    Returns:
      ``int32[Hkv, T, K]`` logical block ids, −1 in unused slots (SPEC §5.1).
    """
    T, Hq, D = q.shape
    Hkv = key_cache.shape[1]
    iq = jnp.mean(q.astype(jnp.float32).reshape(T, Hkv, Hq // Hkv, D), axis=2)   # [T, Hkv, D]
    # One native selection per KV head (each head has its own key cache here).
    return jnp.concatenate([
        select_blocks(iq[:, g:g + 1], key_cache[:, g], block_table, query_req_id, query_abs_pos,
                      topk_blocks=topk_blocks) for g in range(Hkv)])              # [Hkv, T, K]


def _layer(cfg: LlamaConfig, meta, slots, req, pos, carry, xs):
    """One decoder layer. carry: (x [T, H], caches); xs: (layer params, layer, kv_scale [2])."""
    x, caches = carry
    p, layer, kv_scale = xs
    T, Hq, Hkv, D, N = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.block_size
    h = rms_norm(x, p["ln1"], cfg.rms_eps)
    q = rope((h @ p["wq"]).reshape(T, Hq, D), pos, D, cfg.rope_theta)
    k = rope((h @ p["wk"]).reshape(T, Hkv, D), pos, D, cfg.rope_theta)
    v = (h @ p["wv"]).reshape(T, Hkv, D)
    k16, v16, q16 = (a.astype(jnp.bfloat16) for a in (k, v, q))
    # Write this step's K/V (and selection keys) before anything reads the cache.
    if cfg.kv_format in DENSE_FORMATS:
        ck, keys = _write_layer(caches["k"], layer, k, slots, N)    # cast to the cache dtype
        cv, vals = _write_layer(caches["v"], layer, v, slots, N)
        caches = dict(caches, k=ck, v=cv)
    else:
        kv = m3.pack_kv_pages(caches["kv"], k16, v16, slots, kv_scale[0], kv_scale[1],
                              layer=layer, layout=KV_LAYOUT)
        caches = dict(caches, kv=kv)
        if cfg.topk_blocks:
            ck, keys = _write_layer(caches["keys"], layer, k16, slots, N)
            caches["keys"] = ck
    M = meta.block_table.shape[1]
    if cfg.topk_blocks:
        topk = select_by_attention(q, keys, meta.block_table, req, pos,
                                   topk_blocks=cfg.topk_blocks, block_size=N)
    else:   # dense: every block (invalid / future ones are masked)
        topk = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), (Hkv, T, M))
    scale = D ** -0.5
    if cfg.kv_format in DENSE_FORMATS:   # q stays fp32 here (the function computes in fp32)
        attn = paged_attention_jnp(q, keys, vals, topk, meta.block_table, req, pos, scale)
    else:   # the GPU kernels serve D = 128, G = 16 only: elsewhere the library's reference
        attend = (m3.sparse_attention if jax.default_backend() == "cpu"
                  else m3.reference.sparse_attention)
        attn = attend(q16, caches["kv"], topk, meta, kv_scale[0], kv_scale[1], scale=scale,
                      layer=layer, layout=KV_LAYOUT)
    x = x + attn.astype(jnp.float32).reshape(T, Hq * D) @ p["wo"]
    h = rms_norm(x, p["ln2"], cfg.rms_eps)
    x = x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]

    live = req >= 0
    attended = (topk >= 0) & (topk <= (pos // N)[None, :, None])     # dense lists future ones
    blocks = jnp.stack([jnp.sum(jnp.where(live[None, :, None], attended, False)),
                        Hkv * jnp.sum(jnp.where(live, pos // N + 1, 0))])
    amax = jnp.stack([jnp.max(jnp.where(live[:, None, None], jnp.abs(a), 0.0)) for a in (k, v)])
    return (x, caches), (blocks, amax)


@functools.partial(jax.jit, static_argnames=("cfg", "num_decode_requests", "decode_query_len",
                                             "num_logprobs", "return_logits"),
                   donate_argnames=("caches",))
def forward_step(params, caches, batch, *, cfg: LlamaConfig, num_decode_requests: int,
                 decode_query_len: int, num_logprobs: int = 0, return_logits: bool = False):
    """One engine step (``minimax_m3.engine.ModelStep``).

    Args:
      params: :func:`device_params`. caches: :func:`allocate_caches` (donated).
      batch: the Engine's arrays ``tokens [T]``, ``slot_mapping [T]``, ``query_lens [R]``,
        ``context_lens [R]``, ``block_table [R, M]`` (decode requests first) and the sampling
        arrays (``minimax_m3.sampling.batch_arrays``, ``[S]``).
      num_logprobs, return_logits: static, as ``minimax_m3.model.forward_step``'s.

    Returns:
      ``(caches, out)``: ``tokens int32[S]`` sampled on the device (and logprobs / logits of
      the sampled rows when asked), ``blocks [L, 2]`` (token-block pairs attended, visible),
      ``kv_amax [L, 2]`` (max |K|, |V| over this step's live tokens) and, for the perplexity
      study, every row's ``row_logits [T, V]`` fp32 and ``row_lse [T]`` (log-sum-exp).
    """
    meta, req, pos = batch_rows(batch, num_decode_requests, decode_query_len)
    x = params["embed"][batch["tokens"]]
    body = functools.partial(_layer, cfg, meta, batch["slot_mapping"], req, pos)
    L = cfg.num_layers
    (x, caches), (blocks, amax) = jax.lax.scan(
        body, (x, caches), (params["layers"], jnp.arange(L, dtype=jnp.int32), params["kv_scale"]))
    logits = rms_norm(x, params["final_norm"], cfg.rms_eps) @ params["embed"].T   # tied head
    rows = jnp.clip(batch["sample_rows"], 0, logits.shape[0] - 1)
    out = sampling.sample_rows_out(logits[rows], batch, pos, num_logprobs=num_logprobs,
                                   return_logits=return_logits)
    return caches, dict(out, row_logits=logits, row_lse=jax.nn.logsumexp(logits, axis=-1),
                        blocks=blocks, kv_amax=amax)
