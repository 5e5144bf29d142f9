"""MiniMax M3's text model in JAX over jax_m3sparse's NVFP4 paged cache.

Read it beside transformers' ``modeling_minimax_m3_vl.py``: the same weight names (the param
pytree's keys are the checkpoint's, ``self_attn.q_proj`` ...), the same order of operations
(``MiniMaxM3VLDecoderLayer``: norm, attention, residual, norm, MLP, residual). Per layer,
``layer_types`` picks full or sparse (indexer) attention and ``mlp_layer_types`` a dense MLP or
the mixture of experts (``moe.py``); runs of equal layers are stacked and scanned.

One jitted :func:`forward_step` runs a mixed batch (decode rows first, prefill chunks after,
SPEC §5.6) through every layer: K/V packed to NVFP4 in one 5-D ``uint8`` cache for all layers
(layout "LBHNC", ``[L, P, 2Hkv, N, 72]``), index keys in a bf16 key-only paged cache,
selection by :func:`jax_m3sparse.select.select_blocks`, attention by
:func:`jax_m3sparse.sparse_attention` (full-attention layers: every block selected). Only the
rows that sample get the final norm and ``lm_head``; they are sampled on the device
(``sampling.py``). The accuracy report's second stream (the same model over a dense-format
cache) is a wrapper around this step: ``compare.py``.
"""

from __future__ import annotations

import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_m3sparse as m3

from . import moe, sampling
from .attention import fuse_qkv, fused_width, project, select, split_qkv
from .config import MOE, SPARSE, ModelConfig
from .layers import gemma_rms_norm, linear, rotary_cos_sin
from .parallel import AXIS, is_shape, tp_size

KV_LAYOUT = "LBHNC"
K_SCALE = V_SCALE = 1.0   # NVFP4 global scales: K is RMS-normed, V of unit-ish size


# ----------------------------------------------------------------------------- parameters
def layer_shapes(cfg: ModelConfig, attn: str, mlp: str, fused: bool = True) -> dict:
    """One layer's weights (PyTorch ``[out, in]``; packed gate_up as ``[2, I, H]``). ``fused``
    (the served layout): the five attention input projections as one ``self_attn.qkv_proj
    [S, C, H]`` (attention.fuse_qkv); else the checkpoint's ``q_proj``, ``k_proj``, ``v_proj``
    and ``indexer.q_proj`` / ``indexer.k_proj``."""
    H, D = cfg.hidden_size, cfg.head_dim
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    self_attn = dict(q_proj=(Hq * D, H), k_proj=(Hkv * D, H), v_proj=(Hkv * D, H),
                     o_proj=(H, Hq * D), q_norm=(D,), k_norm=(D,))
    if attn == SPARSE:
        Di = cfg.index_head_dim
        self_attn["indexer"] = dict(q_proj=(cfg.index_n_heads * Di, H), k_proj=(Di, H),
                                    q_norm=(Di,), k_norm=(Di,))
    if fused:
        for name in ("q_proj", "k_proj", "v_proj"):
            del self_attn[name]
        for name in ("q_proj", "k_proj") if attn == SPARSE else ():
            del self_attn["indexer"][name]
        self_attn["qkv_proj"] = (cfg.cache_kv_heads, fused_width(cfg, attn == SPARSE), H)

    def swiglu(inter):
        return dict(gate_up_proj=(2, inter, H), down_proj=(H, inter))

    if mlp == MOE:
        E, I = cfg.num_local_experts, cfg.intermediate_size
        experts = {}   # bf16, or quantized leaves beside their scales (moe.expert_leaves)
        for name, shape in (("gate_up_proj", (E, 2, I, H)), ("down_proj", (E, H, I))):
            experts.update({k: v[0] for k, v in
                            moe.expert_leaves(cfg.expert_format, name, shape).items()})
        mlp_shapes = dict(gate=(E, H), e_score_correction_bias=(E,), experts=experts,
                          shared_experts=swiglu(cfg.shared_intermediate_size))
    else:
        mlp_shapes = swiglu(cfg.dense_intermediate_size)
    return dict(input_layernorm=(H,), self_attn=self_attn, post_attention_layernorm=(H,),
                mlp=mlp_shapes)


def param_shapes(cfg: ModelConfig, fused: bool = True) -> dict:
    """The parameter pytree's shapes: ``segments[i]`` holds :meth:`ModelConfig.segments`' run i,
    each leaf stacked on a leading layer axis. No ``lm_head`` with tied embeddings. ``fused``:
    the served layout (:func:`layer_shapes`), else the checkpoint's."""
    stack = lambda n: (lambda s: (n, *s))
    shapes = dict(embed_tokens=(cfg.vocab_size, cfg.hidden_size), norm=(cfg.hidden_size,),
                  segments=[jax.tree_util.tree_map(stack(n), layer_shapes(cfg, a, m, fused),
                                                   is_leaf=lambda x: isinstance(x, tuple))
                            for a, m, _, n in cfg.segments()])
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def param_dtypes(cfg: ModelConfig, dtype, fused: bool = True) -> dict:
    """Each leaf's dtype, a pytree like :func:`param_shapes`: ``dtype``, except the routed
    experts' leaves under a quantized ``cfg.expert_format`` (moe.expert_leaves: MXFP8
    ``float8_e4m3fn`` + ``uint8`` exponents, packed FP4 ``uint8`` + ``uint8`` / ``float8_e4m3fn``
    scales, NVFP4's ``float32`` scale_2 — jax_m3sparse.grouped_matmul's operands)."""
    def one(path, shape):
        names = [getattr(k, "key", None) for k in path]
        if cfg.quantized_experts and "experts" in names:
            return moe.expert_leaf_dtype(cfg.expert_format, names[-1])
        return jnp.dtype(dtype)
    return jax.tree_util.tree_map_with_path(one, param_shapes(cfg, fused), is_leaf=is_shape)


def init_params(cfg: ModelConfig, seed: int = 0, shardings=None, dtype=None,
                cache_bytes: int = 0) -> dict:
    """Seeded random weights made on the device(s): matmuls N(0, 1/fan_in), norms N(0, 0.1)
    (Gemma's 1 + w), embeddings N(0, 1), router bias N(0, 0.1).

    With ``jax.random`` on the device(s), in ``dtype`` (default float32 on the CPU, bfloat16
    elsewhere), by jitted calls whose ``out_shardings`` are the leaves' shardings (each device
    draws its own shard of a big leaf): leaves over 256 MiB one by one (a key per leaf path;
    stacked ones one layer at a time into a donated buffer, a key per layer), the small ones as
    slices of one draw. No host copy; the values do not depend on ``shardings``. MXFP8 experts
    (``cfg.expert_format``): the same model's draw, each expert leaf (or layer of one)
    quantized on its devices as it is made (moe.quantize_expert) — the bf16 random model
    rounded, never held whole in both forms.

    Args:
      shardings: a matching pytree of ``NamedSharding`` (parallel.param_shardings), else the
        default device.
      cache_bytes: bytes per device the caller will add (caches), counted in the size check.

    Raises:
      MemoryError (before anything is allocated): the weights (+ ``cache_bytes``) do not fit the
        devices' memory (plan.check_fits names the numbers).
    """
    import dataclasses  # noqa: PLC0415
    from . import plan  # noqa: PLC0415 (plan imports this module)
    dtype = jnp.dtype(dtype or (jnp.float32 if _cpu() else jnp.bfloat16))
    plan.check_fits(cfg, dtype, shardings, cache_bytes=cache_bytes)
    mx = cfg.quantized_experts
    base = dataclasses.replace(cfg, expert_format="bf16") if mx else cfg   # what is drawn
    # drawn in the checkpoint's layout (the same values at any tp), fused at the end
    drawn_shardings = checkpoint_shardings(shardings, cfg)
    where = ({jax.tree_util.keystr(p): sh for p, sh in
              jax.tree_util.tree_leaves_with_path(drawn_shardings)} if shardings is not None else {})
    paths, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(base, fused=False),
                                                          is_leaf=is_shape)
    root = jax.random.key(seed)
    specs = [(jax.random.fold_in(root, zlib.crc32(jax.tree_util.keystr(path).encode())),
              shape, _init_std(path, shape), where.get(jax.tree_util.keystr(path)),
              shape[0] if getattr(path[0], "key", None) == "segments" else None)
             for path, shape in paths]
    # quantized expert leaves: their leaves' shardings (moe.expert_leaves' order)
    leaf_key = lambda p, n: jax.tree_util.keystr(   # noqa: E731 (a sibling leaf's path)
        (*p[:-1], jax.tree_util.DictKey(n)))
    quant = [tuple(where.get(leaf_key(p, n)) for n in
                   moe.expert_leaf_names(cfg.expert_format, p[-1].key))
             if mx and _is_expert_weight(p) else None for p, _ in paths]
    big = [math.prod(sp[1]) * dtype.itemsize > _ONE_CALL_BYTES for sp in specs]
    small = tuple(sp[1:4] for sp, b in zip(specs, big) if not b)
    drawn = iter(_draw_small(small, dtype)(jax.random.fold_in(root, 0)))
    leaves = []
    for (path, _), sp, b, q in zip(paths, specs, big, quant):
        if q is None:
            leaves.append(_big_leaf(*sp, dtype) if b else next(drawn))
        else:
            how = (q, cfg.expert_format, path[-1].key)
            leaves.append(_big_quantized_leaf(*sp, *how, dtype) if b else _quantize(next(drawn), *how))
    params = treedef.unflatten(leaves)
    for seg in params["segments"] if mx else ():
        ex = seg["mlp"].get("experts", {})
        for name in ("gate_up_proj", "down_proj"):
            if name in ex:
                ex.update(zip(moe.expert_leaf_names(cfg.expert_format, name), ex[name]))
    return fuse_projections(params, cfg, shardings)


def checkpoint_shardings(shardings, cfg: ModelConfig):
    """The shardings of the checkpoint layout (``param_shapes(cfg, fused=False)``) on the mesh
    of ``shardings`` (the served layout's); None for None."""
    if shardings is None:
        return None
    from .parallel import param_shardings  # noqa: PLC0415
    mesh = jax.tree_util.tree_leaves(shardings)[0].mesh
    return param_shardings(param_shapes(cfg, fused=False), cfg, mesh)


def fuse_projections(params: dict, cfg: ModelConfig, shardings=None) -> dict:
    """Checkpoint-layout params -> the served layout: each segment's attention input
    projections fused into ``self_attn.qkv_proj`` (attention.fuse_qkv) on their devices, one
    segment at a time, the separate weights deleted (the caller must not use them again).
    ``shardings``: the served layout's (parallel.param_shardings), else the default device."""
    segments = []
    for i, seg in enumerate(params["segments"]):
        sa = dict(seg["self_attn"])
        sparse = "indexer" in sa
        ix = dict(sa.get("indexer", {}))
        parts = [sa.pop(n) for n in ("q_proj", "k_proj", "v_proj")]
        parts += [ix.pop(n) for n in ("q_proj", "k_proj")] if sparse else []
        where = (shardings["segments"][i]["self_attn"]["qkv_proj"] if shardings is not None
                 else None)
        sa["qkv_proj"] = _fuse_fn(cfg, where)(*parts)
        for w in parts:
            if isinstance(w, jax.Array):
                w.delete()
        if sparse:
            sa["indexer"] = ix
        segments.append({**seg, "self_attn": sa})
    return {**params, "segments": segments}


@functools.lru_cache(maxsize=None)
def _fuse_fn(cfg, sharding):
    return jax.jit(lambda *w: fuse_qkv(*w, cfg=cfg), out_shardings=sharding)


def unfuse_projections(params: dict, cfg: ModelConfig) -> dict:
    """The inverse of :func:`fuse_projections`, on the host (numpy): the checkpoint layout of
    served ``params`` (checkpoint.save_checkpoint writes it)."""
    segments = []
    for seg, (attn, _, _, _) in zip(params["segments"], cfg.segments()):
        sa = dict(seg["self_attn"])
        parts = split_qkv(np.asarray(sa.pop("qkv_proj")), cfg, attn == SPARSE)
        sa.update(q_proj=parts["q_proj"], k_proj=parts["k_proj"], v_proj=parts["v_proj"])
        if attn == SPARSE:
            sa["indexer"] = dict(sa["indexer"], q_proj=parts["index_q_proj"],
                                 k_proj=parts["index_k_proj"])
        segments.append({**seg, "self_attn": sa})
    return {**params, "segments": segments}


def _is_expert_weight(path) -> bool:
    names = [getattr(k, "key", None) for k in path]
    return "experts" in names and names[-1] in ("gate_up_proj", "down_proj")


@functools.lru_cache(maxsize=None)
def _quantize_fn(shardings, fmt, name):
    return jax.jit(lambda w: moe.quantize_expert(w, fmt, name), out_shardings=shardings)


def _quantize(w, shardings, fmt, name):
    """A small expert leaf's quantized leaves (moe.quantize_expert), on their devices; the
    bf16 / fp32 draw freed."""
    out = _quantize_fn(shardings, fmt, name)(w)
    w.delete()
    return out


def _big_quantized_leaf(key, shape, std, sharding, layers, shardings, fmt, name, dtype):
    """A big expert leaf drawn as :func:`_big_leaf` draws it, quantized as it is made: layer j
    (or the whole leaf) into donated buffers of its quantized leaves."""
    if layers is None:
        return _quantize(_draw_small(((shape, std, sharding),), dtype)(key)[0], shardings, fmt,
                         name)
    bufs = tuple(_zeros(s, dt, sh) for (s, dt), sh in
                 zip(moe.expert_leaves(fmt, name, shape).values(), shardings))
    put = _quantized_layer_setter(shape, dtype, std, shardings, fmt, name)
    for j in range(layers):
        bufs = put(bufs, key, jnp.int32(j))
    return bufs


@functools.lru_cache(maxsize=None)
def _quantized_layer_setter(shape, dtype, std, shardings, fmt, name):
    """jitted ``(bufs, key, j) -> bufs with layer j set`` (donated: in place)."""
    def put(bufs, key, j):
        w = _normal(jax.random.fold_in(key, j), shape[1:], dtype, std)
        return tuple(b.at[j].set(q) for b, q in zip(bufs, moe.quantize_expert(w, fmt, name)))
    return jax.jit(put, donate_argnums=0, out_shardings=shardings)


_ONE_CALL_BYTES = 256 << 20   # leaves above this get their own calls (stacked: per layer)


def _init_std(path, shape) -> float:
    name = jax.tree_util.keystr(path)
    if "norm" in name or "bias" in name:
        return 0.1
    return 1.0 if "embed" in name else shape[-1] ** -0.5


@functools.lru_cache(maxsize=None)
def _draw_small(specs, dtype):
    """jitted ``key -> leaves`` for the small leaves ((shape, std, sharding) each): slices of
    one flat draw (one RNG op, a fast compile), each placed by its sharding."""
    sizes = [math.prod(shape) for shape, _, _ in specs]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)

    def draw(key):
        flat = jax.random.normal(key, (int(offsets[-1]),), dtype)
        return tuple((flat[o:o + n].reshape(shape) * jnp.asarray(std, dtype)).astype(dtype)
                     for o, n, (shape, std, _) in zip(offsets, sizes, specs))
    return jax.jit(draw, out_shardings=tuple(sp[2] for sp in specs))


def _big_leaf(key, shape, std, sharding, layers, dtype):
    """A leaf with its own jitted call(s); layer j of a stacked one from ``fold_in(key, j)``,
    written into a donated buffer one layer at a time."""
    if layers is None:
        return _draw_small(((shape, std, sharding),), dtype)(key)[0]
    buf = _zeros(shape, dtype, sharding)
    put = _layer_setter(shape, dtype, std, sharding)
    for j in range(layers):
        buf = put(buf, key, jnp.int32(j))
    return buf


@functools.lru_cache(maxsize=None)
def _zeros_fn(shape, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _zeros(shape, dtype, sharding):
    return _zeros_fn(shape, dtype, sharding)()


def _normal(key, shape, dtype, std):
    return (jax.random.normal(key, shape, dtype) * jnp.asarray(std, dtype)).astype(dtype)


@functools.lru_cache(maxsize=None)
def _layer_setter(shape, dtype, std, sharding):
    """jitted ``(buf, key, j) -> buf.at[j].set(layer j)``, ``buf`` donated (in place)."""
    def put(buf, key, j):
        return buf.at[j].set(_normal(jax.random.fold_in(key, j), shape[1:], dtype, std))
    return jax.jit(put, donate_argnums=0, out_shardings=sharding)


# ----------------------------------------------------------------------------- caches
# ----------------------------------------------------------------------------- caches
def allocate_caches(cfg: ModelConfig, num_pages: int) -> dict:
    """All caches of the step, one pytree (donated to every step).

    kv: ``uint8[L, P, 2Hkv', N, 72]`` NVFP4 K/V of every layer (layout "LBHNC"), Hkv' =
      ``cfg.cache_kv_heads`` (KV heads replicated for tensor parallel past Hkv).
    idx: ``bf16[L_sparse, P, N, Di]`` the index keys of the sparse-attention layers.
    """
    spec = m3.KVCacheSpec(cfg.cache_kv_heads, cfg.head_dim, cfg.block_size)
    return dict(kv=m3.allocate_kv_cache(spec, num_pages, cfg.num_layers, KV_LAYOUT),
                idx=jnp.zeros(index_cache_shape(cfg, num_pages), cfg.index_cache_dtype))


def index_cache_shape(cfg: ModelConfig, num_pages: int) -> tuple[int, ...]:
    """``[L_sparse, P, N, Di]`` (at least one layer, so that the pytree never changes)."""
    return (max(len(cfg.sparse_layers), 1), num_pages, cfg.block_size, cfg.index_head_dim)


# ----------------------------------------------------------------------------- step metadata
def batch_rows(batch: dict, num_decode_requests: int, decode_query_len: int):
    """A step's mixed-batch metadata and per-row ``(request, position)``, ``int32[T]`` each
    (``SparseAttentionMetadata.token_rows``), with −1 as the request of every padding row."""
    T = batch["tokens"].shape[0]
    meta = m3.build_attention_metadata(batch["query_lens"], batch["context_lens"],
                                       batch["block_table"], num_decode_requests=num_decode_requests,
                                       num_tokens=T, decode_query_len=decode_query_len)
    req, pos = meta.token_rows()
    return meta, jnp.where(pos >= 0, req, -1), pos


def _cpu() -> bool:
    """On the CPU the example computes in float32 (its kernels' fp32 paths)."""
    return jax.default_backend() == "cpu"


# ----------------------------------------------------------------------------- one layer
class _Step:
    """What every layer of one step shares: config, metadata, rows, rotary tables, and which
    per-layer arrays to collect (``collect``: names among "hidden", "topk", "attn").
    ``block_stats``: count each sparse layer's attended blocks (:meth:`blocks`)."""

    def __init__(self, cfg, meta, batch, req, pos, collect=(), block_stats=True):
        self.cfg, self.meta, self.req, self.pos = cfg, meta, req, pos
        # made once, outside the layer scan: inside it XLA computes it again on every layer
        self.live = req >= 0
        self.block_stats = block_stats
        self.slots = batch["slot_mapping"]
        self.collect = frozenset(collect)
        self.cos, self.sin = rotary_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta)

    @property
    def all_blocks(self):
        """Every block, as a top-k list: the baseline stream's full layers (compare.py); made
        in the trace that asks (a step object outlives one trace)."""
        return m3.reference.all_blocks(self.cfg.num_key_value_heads, self.pos.shape[0],
                                       self.meta.block_table.shape[1])

    def served_attention(self, p, h, caches, layer, li, sparse):
        """The NVFP4 path's attention output ``[T, Hq·D]`` (fp32), caches, and the indexer's
        topk on sparse layers (None on full ones: every block up to the position, SPEC §5.7)."""
        cfg = self.cfg
        # k, v, iq per stored KV head (at TP > Hkv each KV head kv_replicas times: each device
        # owns whole heads). Write this step's K/V before anything reads the cache.
        q, k, v, iq, ik = project(p, h, self.cos, self.sin, cfg)
        kv = m3.pack_kv_pages(caches["kv"], k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                              self.slots, K_SCALE, V_SCALE, layer=layer, layout=KV_LAYOUT)
        kw = dict(scale=cfg.head_dim ** -0.5, layer=layer, layout=KV_LAYOUT)
        if sparse:
            # the index queries in bf16, as the attention's q: the selection's q·k products
            # then take one bf16 MMA pass instead of three (an fp32 q's hi + mid + lo parts)
            topk, idx = select(iq.astype(jnp.bfloat16), ik, cfg, caches["idx"], li, self.slots,
                               self.meta.block_table, self.req, self.pos)
            caches = dict(caches, kv=kv, idx=idx)
            attn = m3.sparse_attention(q.astype(jnp.bfloat16), kv, topk, self.meta, K_SCALE,
                                       V_SCALE, **kw)
            topk = topk[::cfg.kv_replicas]
        else:
            caches, topk = dict(caches, kv=kv), None
            attn = m3.full_attention(q.astype(jnp.bfloat16), kv, self.meta.block_table, self.req,
                                     self.pos, K_SCALE, V_SCALE, **kw)
        return attn.astype(jnp.float32).reshape(h.shape[0], -1), caches, topk

    def layer(self, attn_kind, mlp_kind, carry, xs):
        """One served layer. carry (x, caches); xs (params, global layer index, index-cache
        row). ys: ``attended`` on sparse layers (:meth:`blocks`) and what ``collect`` names."""
        x, caches = carry
        p, layer, li = xs
        sparse = attn_kind == SPARSE

        def attention(pa, h):
            attn, c, topk = self.served_attention(pa, h, caches, layer, li, sparse)
            return attn, (c, topk)

        x, attn, (caches, topk) = decoder_layer(p, x, attention, self.cfg, mlp_kind == MOE,
                                                self.live)
        return (x, caches), self.outputs(x, attn, topk, sparse)

    def outputs(self, x, attn, topk, sparse) -> dict:
        """A layer's ys: ``attended`` on sparse layers (token-block pairs selected by live
        tokens; :meth:`blocks` adds what does not change between layers after the scan) and
        the collected arrays (``topk`` on sparse layers only). Not ``topk`` itself: XLA then
        writes it by a second select_blocks call into the stacked output. Without
        ``block_stats`` no ``attended``: its reduction and write are two launches per layer."""
        ys = {}
        if sparse and self.block_stats:
            ys["attended"] = jnp.sum(jnp.where(self.live[None, :, None], topk >= 0, False))
        for name, value in (("hidden", x), ("attn", attn), ("topk", topk)):
            if name in self.collect and (sparse or name != "topk"):
                ys[name] = value
        return ys

    def blocks(self, attended) -> jax.Array:
        """``int32[L, 2]``: per layer, the token-block pairs attended and visible (pos // N + 1
        per live token and KV head; full layers attend all of them); ``attended [L_sparse]``
        the sparse layers' in order."""
        cfg, live = self.cfg, self.live
        visible = cfg.num_key_value_heads * jnp.sum(jnp.where(live, self.pos // cfg.block_size + 1,
                                                             0)).astype(jnp.int32)
        per_layer = jnp.full(cfg.num_layers, visible)
        if attended is not None:
            per_layer = per_layer.at[np.asarray(cfg.sparse_layers)].set(attended)
        return jnp.stack([per_layer, jnp.full(cfg.num_layers, visible)], axis=1)


def decoder_layer(p, x, attention, cfg, is_moe, live=None):
    """``MiniMaxM3VLDecoderLayer`` on ``x float32[T, H]``: norm, ``attention(p["self_attn"],
    h) -> (attn [T, Hq·D], extra)``, ``o_proj``, residual, norm, MLP, residual. Returns
    ``(x, attn, extra)``. ``live bool[T]``: the rows that are tokens (padding rows are routed
    to no expert, moe.sparse_moe); None: every row."""
    h = gemma_rms_norm(x, p["input_layernorm"], cfg.rms_norm_eps)
    attn, extra = attention(p["self_attn"], h)
    x, h = mlp_input(p, x, attn, cfg)
    return x + moe.mlp(p["mlp"], h, cfg, is_moe, live), attn, extra


def mlp_input(p, x, attn, cfg):
    """A layer's residual after attention, ``x + o_proj(attn)``, and the MLP's input (the
    post-attention norm of it): ``(x, h)``, both ``[T, H]``."""
    x = x + linear(attn, p["self_attn"]["o_proj"], cfg)
    return x, gemma_rms_norm(x, p["post_attention_layernorm"], cfg.rms_norm_eps)


def scan_layers(params, cfg, layer_fn, carry):
    """Every layer in order, one ``lax.scan`` per run of equal layers (``cfg.segments()``):
    ``layer_fn(attn_kind, mlp_kind, carry, (p, layer, sparse_row)) -> (carry, ys)``. Returns
    ``(carry, ys)`` with each ys key concatenated over the layers that have it."""
    sparse_rank = np.cumsum([t == SPARSE for t in cfg.layer_types]) - 1
    outs = []
    for p, (attn_kind, mlp_kind, first, n) in zip(params["segments"], cfg.segments()):
        layers = np.arange(first, first + n)
        xs = (p, jnp.asarray(layers, jnp.int32),
              jnp.asarray(np.maximum(sparse_rank[layers], 0), jnp.int32))
        carry, ys = jax.lax.scan(functools.partial(layer_fn, attn_kind, mlp_kind), carry, xs)
        outs.append(ys)
    keys = dict.fromkeys(k for o in outs for k in o)
    return carry, {k: jnp.concatenate([o[k] for o in outs if k in o]) for k in keys}


# ----------------------------------------------------------------------------- vocabulary
# Under a "tp" mesh the embedding table and lm_head are split over the vocabulary
# (parallel.leaf_spec): each device holds V/tp rows and neither is ever gathered.
def embed(params, tokens, cfg):
    """``float32[T, H]`` embeddings of ``tokens int32[T]``. Vocab-parallel under a "tp" mesh:
    each device looks up the ids in its rows (zeros elsewhere) and one ``psum`` of ``[T, H]``
    (in the table's dtype: exactly one device contributes each row) assembles them."""
    table = params["embed_tokens"]
    tp = tp_size()
    if tp == 1:
        return table[tokens].astype(jnp.float32)

    def local(tab, ids):
        i = ids - jax.lax.axis_index(AXIS) * tab.shape[0]
        ok = (i >= 0) & (i < tab.shape[0])
        rows = jnp.where(ok[:, None], tab[jnp.clip(i, 0, tab.shape[0] - 1)], 0)
        return jax.lax.psum(rows, AXIS)

    return jax.shard_map(local, in_specs=(P(AXIS, None), P()), out_specs=P(),
                         check_vma=False)(table, tokens).astype(jnp.float32)


def logits_of(params, h, cfg):
    """Final Gemma norm, then ``lm_head`` (the embedding matrix when tied): ``h [S, H]`` ->
    ``float32[S, V]``. Vocab-parallel under a "tp" mesh: each device computes its ``[S, V/tp]``
    slice and one all-gather of the ``S`` rows' logits (never of the weight) joins them, so
    that sampling sees whole rows (exact top-p, and the same tokens at any tp)."""
    head = params["embed_tokens"] if cfg.tie_word_embeddings else params["lm_head"]
    S = h.shape[0]
    # rows padded to a multiple of 8: a one-row product (a prefill chunk's last token) is
    # otherwise an fp32 GEMV on XLA's GPU backend, which first converts the whole bf16 head to
    # fp32 (M3 at TP 8: 219 + 147 µs instead of ~75); the padding rows are sliced off
    x = gemma_rms_norm(jnp.pad(h, ((0, -S % 8), (0, 0))), params["norm"], cfg.rms_norm_eps)
    if tp_size() == 1:
        return linear(x, head, cfg)[:S]
    local = lambda w, x_: jax.lax.all_gather(linear(x_, w, cfg)[:S], AXIS, axis=1, tiled=True)
    return jax.shard_map(local, in_specs=(P(AXIS, None), P()), out_specs=P(),
                         check_vma=False)(head, x)


# ----------------------------------------------------------------------------- the step
BATCH_KEYS = ("tokens", "slot_mapping", "query_lens", "context_lens", "block_table",
              "sample_rows")


@functools.partial(jax.jit, static_argnames=("cfg", "num_decode_requests", "decode_query_len",
                                             "num_logprobs", "return_logits", "collect",
                                             "block_stats"),
                   donate_argnames=("caches",))
def forward_step(params, caches, batch, *, cfg: ModelConfig, num_decode_requests: int,
                 decode_query_len: int, num_logprobs: int = 0, return_logits: bool = False,
                 collect: tuple[str, ...] = (), block_stats: bool = True):
    """One engine step: writes this step's tokens into the caches and samples the rows that
    sample (the engine's model interface, ``engine.ModelStep``).

    Args:
      params: from :func:`init_params` / ``checkpoint.load_params``.
      caches: from :func:`allocate_caches` (donated: updated in place).
      batch: ``tokens int32[T]``, ``slot_mapping int32[T]`` (−1 for padding), ``query_lens
        int32[R]``, ``context_lens int32[R]``, ``block_table int32[R, M]`` with the
        ``num_decode_requests`` decode requests first (each ``decode_query_len`` rows;
        query_len 0 = padded), then prefill chunks (SPEC §5.6); and the sampling arrays of
        ``sampling.batch_arrays``: ``sample_rows int32[S]`` (required: the token rows that
        sample, −1 = none) and, optional, ``temperature``, ``top_k``, ``top_p``, ``seed``
        ``[S]`` (absent: all greedy).
      cfg, num_decode_requests, decode_query_len: static.
      num_logprobs: static N; > 0 adds ``logprob [S]``, ``top_logprobs [S, N]``, ``top_ids
        [S, N]`` (sampling.logprobs).
      return_logits: static; adds ``logits float32[S, V]`` of the sampled rows.
      collect: static names of per-layer arrays to return: ``hidden [L + 1, T, H]``
        (embeddings first), ``attn [L, T, Hq·D]`` (attention outputs, fp32), ``topk
        [L_sparse, Hkv, T, K]`` (the sparse layers' selections).
      block_stats: static; False leaves out ``blocks`` (a server that reports no sparsity
        saves a reduction and a write per sparse layer: BENCHMARKS.md §1).

    Returns:
      ``(caches, out)``: ``tokens int32[S]`` (−1 where ``sample_rows`` is −1) and, with
      ``block_stats``, ``blocks [L, 2]`` (token-block pairs selected, blocks visible), plus
      what the options add.

    Raises:
      KeyError at trace time naming the arrays ``batch`` lacks.
    """
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise KeyError(f"forward_step: batch lacks {missing} (it needs {list(BATCH_KEYS)}; "
                       f"sampling.batch_arrays(sample_rows) makes sample_rows)")
    meta, req, pos = batch_rows(batch, num_decode_requests, decode_query_len)
    step = _Step(cfg, meta, batch, req, pos, collect, block_stats)
    x0 = embed(params, batch["tokens"], cfg)
    (x, caches), ys = scan_layers(params, cfg, step.layer, (x0, caches))
    rows = batch["sample_rows"]
    logits = logits_of(params, x[jnp.clip(rows, 0, x.shape[0] - 1)], cfg)
    out = sampling.sample_rows_out(logits, batch, pos, num_logprobs=num_logprobs,
                                   return_logits=return_logits)
    if block_stats:
        out["blocks"] = step.blocks(ys.get("attended"))
    if "hidden" in collect:
        out["hidden"] = jnp.concatenate([x0[None], ys["hidden"]])
    out.update((k, ys.get(k)) for k in ("attn", "topk") if k in collect)
    return caches, out
