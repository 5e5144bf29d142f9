"""Pure ``jax.numpy`` versions of every jax_m3sparse op (the oracles' JAX twin).

Same signatures as the public functions. They lower on any platform, are memory-safe
for any index values (gathers are clipped and masked, scatters drop out-of-range
writes), and mask with selects, so NaN bytes in unattended page tails never leak
(SPEC §5.2). The primitives fall back to these where no native kernel is built.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_m3sparse import nvfp4
from jax_m3sparse.mxfp4 import fp4_dequantize, mxfp4_quantize  # noqa: F401  (re-exported)
from jax_m3sparse.mxfp8 import mxfp8_dequantize, mxfp8_quantize  # noqa: F401  (re-exported)
from jax_m3sparse.nvfp4 import nvfp4_dequantize, nvfp4_quantize  # noqa: F401  (re-exported)
from jax_m3sparse.spec import layout_code

_TOKEN_CHUNK = 16  # tokens per step of the attention reference: bounds its memory


# ----------------------------------------------------------------------------- cache views
def tile_view(kv_cache, layout_code: int):
    """The cache as ``[L, P, 2Hkv, N·C]`` tiles (a free reshape/transpose of SPEC §3.3)."""
    tile_bytes = kv_cache.shape[-2] * kv_cache.shape[-1]     # explicit: the cache may be empty
    if kv_cache.ndim == 4:
        return kv_cache.reshape(1, kv_cache.shape[0], kv_cache.shape[1], tile_bytes)
    tiles = kv_cache.reshape(*kv_cache.shape[:3], tile_bytes)
    return tiles if layout_code == 0 else jnp.swapaxes(tiles, 0, 1)


def _split_tile(tiles, head_dim):
    """Bytes ``[..., N·C]`` -> (data ``[..., N, D/2]``, scales ``[..., N, D/16]``), SPEC §3.2."""
    data_bytes = tiles.shape[-1] * 8 // 9
    n = data_bytes // (head_dim // 2)
    data = tiles[..., :data_bytes].reshape(*tiles.shape[:-1], n, head_dim // 2)
    scales = tiles[..., data_bytes:].reshape(*tiles.shape[:-1], n, head_dim // 16)
    return data, scales


# ----------------------------------------------------------------------------- pack
def pack_impl(kv_cache, key, value, slot_mapping, k_scale, v_scale, layer, *, layout):
    """Primitive-level reference of pack_kv_pages (``layer`` an int32 operand, ``layout`` 0/1)."""
    T, Hkv, D = key.shape
    num_layers, num_pages, _, _ = tile_view(kv_cache, layout).shape
    N = kv_cache.shape[-2]
    kd, ks = nvfp4_quantize(key, k_scale)
    vd, vs = nvfp4_quantize(value, v_scale)
    data = jnp.stack([kd, vd], axis=2)                                   # [T, Hkv, 2, D/2]
    scales = jax.lax.bitcast_convert_type(jnp.stack([ks, vs], axis=2), jnp.uint8)
    values = jnp.concatenate([data, scales], axis=-1)                    # [T, Hkv, 2, C]

    slot = slot_mapping.astype(jnp.int32)
    ok = (slot >= 0) & (slot < num_pages * N)
    page = jnp.where(ok, slot // N, num_pages)            # num_pages: out of range, dropped
    offset = jnp.where(ok, slot % N, 0)
    layer = jnp.asarray(layer, jnp.int32)
    layer = jnp.where((layer >= 0) & (layer < num_layers), layer, num_layers)
    byte = jnp.concatenate([offset[:, None] * (D // 2) + jnp.arange(D // 2),
                            N * (D // 2) + offset[:, None] * (D // 16) + jnp.arange(D // 16)],
                           axis=-1)                                      # [T, C]
    head_slot = (2 * jnp.arange(Hkv)[:, None] + jnp.arange(2)[None, :])  # [Hkv, 2]
    idx_page = page[:, None, None, None]
    idx_slot = head_slot[None, :, :, None]
    idx_byte = byte[:, None, None, :]
    flat = kv_cache.reshape(*kv_cache.shape[:-2], N * kv_cache.shape[-1])
    if kv_cache.ndim == 4:
        idx_page = jnp.where(layer == 0, idx_page, num_pages)
        flat = flat.at[idx_page, idx_slot, idx_byte].set(values, mode="drop")
    elif layout == 0:
        flat = flat.at[layer, idx_page, idx_slot, idx_byte].set(values, mode="drop")
    else:
        flat = flat.at[idx_page, layer, idx_slot, idx_byte].set(values, mode="drop")
    return flat.reshape(kv_cache.shape)


def pack_kv_pages(kv_cache, key, value, slot_mapping, k_scale, v_scale, *, layer=None,
                  layout=None):
    """Reference of :func:`jax_m3sparse.pack_kv_pages` (SPEC §2.2, §3)."""
    layer = jnp.int32(0) if layer is None else jnp.asarray(layer, jnp.int32)
    kv_cache, key, value, slot_mapping = map(jnp.asarray, (kv_cache, key, value, slot_mapping))
    return pack_impl(kv_cache, key, value, slot_mapping, jnp.float32(k_scale),
                     jnp.float32(v_scale), layer, layout=layout_code(layout, kv_cache.ndim))


def unpack_kv_pages(kv_cache, page_ids, k_scale, v_scale, *, layer=None, layout=None):
    """Dequantizes whole pages: (key, value) float32 ``[n, Hkv, N, D]`` each.

    Page ids outside ``[0, P)`` and a layer outside ``[0, L)`` give zeros.
    """
    tiles = tile_view(kv_cache, layout_code(layout, kv_cache.ndim))
    num_layers, num_pages, num_slots = tiles.shape[:3]
    head_dim = kv_cache.shape[-1] * 16 // 9
    layer = jnp.int32(0) if layer is None else jnp.asarray(layer, jnp.int32)
    page_ids = jnp.asarray(page_ids, jnp.int32)
    if not num_layers * num_pages:                                       # nothing to read
        zeros = jnp.zeros((page_ids.shape[0], num_slots // 2, kv_cache.shape[-2], head_dim))
        return zeros, zeros
    ok = (page_ids >= 0) & (page_ids < num_pages) & (layer >= 0) & (layer < num_layers)
    picked = tiles[jnp.clip(layer, 0, num_layers - 1), jnp.clip(page_ids, 0, num_pages - 1)]
    picked = jnp.where(ok[:, None, None], picked, 0)                     # [n, 2Hkv, N·C]
    data, scales = _split_tile(picked, head_dim)
    k = nvfp4_dequantize(data[:, 0::2], scales[:, 0::2], k_scale)
    v = nvfp4_dequantize(data[:, 1::2], scales[:, 1::2], v_scale)
    return k, v


# ----------------------------------------------------------------------------- positions
def positions_impl(cu_seqlens_q, context_lens, *, num_tokens):
    """SPEC §4 with the count form of query_req_id (defined for any cu_seqlens_q)."""
    cu = jnp.asarray(cu_seqlens_q, jnp.int32)
    ctx = jnp.asarray(context_lens, jnp.int32)
    R = ctx.shape[0]
    j = jnp.arange(num_tokens, dtype=jnp.int32)
    r = jnp.sum(cu[None, 1:] <= j[:, None], axis=1, dtype=jnp.int32)
    valid = r < R
    rc = jnp.clip(r, 0, max(R - 1, 0))
    pos = ctx[rc] + (j - cu[rc]) if R else j
    return jnp.where(valid, r, -1), jnp.where(valid, pos, -1)


def query_token_positions(cu_seqlens_q, context_lens, num_tokens):
    """Reference of :func:`jax_m3sparse.query_token_positions` (SPEC §4)."""
    return positions_impl(cu_seqlens_q, context_lens, num_tokens=int(num_tokens))


# ----------------------------------------------------------------------------- attention
def _attend_chunk(q, tiles, topk, block_table, req, pos, k_scale, v_scale, layer, scale):
    """SPEC §5.2/§5.5 for a chunk of tokens: q [t, Hq, D], topk [Hkv, t, K]."""
    t, Hq, D = q.shape
    Hkv, _, K = topk.shape
    G = Hq // Hkv
    L, P, _, _ = tiles.shape
    R, M = block_table.shape
    N = tiles.shape[-1] * 8 // 9 // (D // 2)
    vis = jnp.where(pos < jnp.iinfo(jnp.int32).max, pos + 1, pos)        # [t]
    row_ok = (req >= 0) & (req < R) & (vis > 0) & (layer >= 0) & (layer < L)
    b = topk
    bc = jnp.clip(b, 0, M - 1)
    page = block_table[jnp.clip(req, 0, R - 1)[None, :, None], bc]       # [Hkv, t, K]
    slot_ok = (row_ok[None, :, None] & (b >= 0) & (b < M) & (bc * N < vis[None, :, None])
               & (page >= 0) & (page < P))
    key_pos = bc[..., None] * N + jnp.arange(N)                         # [Hkv, t, K, N]
    attended = slot_ok[..., None] & (key_pos < vis[None, :, None, None])

    heads = jnp.arange(Hkv)[:, None, None]
    lc = jnp.clip(layer, 0, L - 1)
    pc = jnp.clip(page, 0, P - 1)
    kd, ks = _split_tile(tiles[lc, pc, 2 * heads], D)                   # [Hkv, t, K, N, ·]
    vd, vs = _split_tile(tiles[lc, pc, 2 * heads + 1], D)
    k = nvfp4_dequantize(kd, ks, k_scale)
    v = nvfp4_dequantize(vd, vs, v_scale)
    v = jnp.where(attended[..., None], v, 0.0)

    qg = q.astype(jnp.float32).reshape(t, Hkv, G, D)
    z = jnp.einsum("tgid,gtknd->gtikn", qg, k, precision="highest") * jnp.float32(scale)
    z = z.reshape(Hkv, t, G, K * N)
    mask = attended.reshape(Hkv, t, 1, K * N)
    z = jnp.where(mask, z, -jnp.inf)
    m = jnp.max(z, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(z - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("gtix,gtxd->gtid", p, v.reshape(Hkv, t, K * N, D), precision="highest")
    # Exact zeros only where nothing was attended: a NaN in attended bytes stays visible.
    any_key = jnp.any(mask, axis=-1, keepdims=True)
    o = jnp.where(any_key, o / jnp.where(any_key, denom, 1.0), 0.0)
    return jnp.transpose(o, (1, 0, 2, 3)).reshape(t, Hq, D)


def attend_impl(q, kv_cache, topk, block_table, req, pos, k_scale, v_scale, layer, *, scale,
                layout):
    """Sparse attention of rows with known (request, position), in token chunks."""
    T = q.shape[0]
    tiles = tile_view(kv_cache, layout)
    if 0 in (T, *tiles.shape[:2], *block_table.shape):
        # No row, layer, page, request or block: nothing can be attended (SPEC §5.2).
        return jnp.zeros(q.shape, q.dtype)
    layer = jnp.asarray(layer, jnp.int32)
    chunk = min(_TOKEN_CHUNK, max(T, 1))
    n = -(-T // chunk)
    pad = n * chunk - T
    qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(n, chunk, *q.shape[1:])
    tp = jnp.pad(topk, ((0, 0), (0, pad), (0, 0))).reshape(topk.shape[0], n, chunk, topk.shape[2])
    rp = jnp.pad(req, (0, pad), constant_values=-1).reshape(n, chunk)
    pp = jnp.pad(pos, (0, pad), constant_values=-1).reshape(n, chunk)

    def step(xs):
        qc, tc, rc, pc = xs
        return _attend_chunk(qc, tiles, tc, block_table, rc, pc, k_scale, v_scale, layer, scale)

    out = jax.lax.map(step, (qp, jnp.moveaxis(tp, 1, 0), rp, pp))
    return out.reshape(n * chunk, *q.shape[1:])[:T].astype(q.dtype)


def decode_rows(seq_lens, num_tokens, decode_query_len):
    """(request, position) of each decode row (SPEC §5.3); −1 where the position is negative.

    ``seq_lens[r] − back`` with ``back = dql − t % dql`` in [1, dql] is only formed where it
    cannot wrap around in int32 (a seq_len near INT32_MIN must not become a huge position).
    """
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    r = t // decode_query_len
    back = decode_query_len - t % decode_query_len
    seq = jnp.asarray(seq_lens, jnp.int32)[r]
    return r, jnp.where(seq >= back, seq - back, -1)


def decode_impl(q, kv_cache, topk, block_table, seq_lens, k_scale, v_scale, layer, *, scale,
                decode_query_len, layout):
    req, pos = decode_rows(seq_lens, q.shape[0], decode_query_len)
    return attend_impl(q, kv_cache, topk, block_table, req, pos, k_scale, v_scale, layer,
                       scale=scale, layout=layout)


def prefill_impl(q, kv_cache, topk, block_table, query_req_id, query_abs_pos, k_scale, v_scale,
                 layer, *, scale, layout):
    return attend_impl(q, kv_cache, topk, block_table, query_req_id, query_abs_pos, k_scale,
                       v_scale, layer, scale=scale, layout=layout)


def sparse_decode(q, kv_cache, topk_indices, block_table, seq_lens, k_scale, v_scale, *,
                  scale=None, decode_query_len=1, layer=None, layout=None):
    """Reference of :func:`jax_m3sparse.sparse_decode` (SPEC §5.3)."""
    q, kv_cache, topk_indices, block_table, seq_lens = map(
        jnp.asarray, (q, kv_cache, topk_indices, block_table, seq_lens))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return decode_impl(q, kv_cache, topk_indices, block_table, seq_lens, jnp.float32(k_scale),
                       jnp.float32(v_scale), 0 if layer is None else layer, scale=scale,
                       decode_query_len=decode_query_len, layout=layout_code(layout, kv_cache.ndim))


def sparse_prefill(q, kv_cache, topk_indices, block_table, query_req_id, query_abs_pos, k_scale,
                   v_scale, *, scale=None, layer=None, layout=None):
    """Reference of :func:`jax_m3sparse.sparse_prefill` (SPEC §5.4)."""
    q, kv_cache, topk_indices, block_table, query_req_id, query_abs_pos = map(
        jnp.asarray, (q, kv_cache, topk_indices, block_table, query_req_id, query_abs_pos))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return prefill_impl(q, kv_cache, topk_indices, block_table, query_req_id, query_abs_pos,
                        jnp.float32(k_scale), jnp.float32(v_scale), 0 if layer is None else layer,
                        scale=scale, layout=layout_code(layout, kv_cache.ndim))


def all_blocks(num_kv_heads: int, num_tokens: int, max_blocks: int):
    """``int32[Hkv, T, M]``: every logical block for every row — full attention as a top-k list
    (SPEC §5.7)."""
    return jnp.broadcast_to(jnp.arange(max_blocks, dtype=jnp.int32),
                            (num_kv_heads, num_tokens, max_blocks))


def full_impl(q, kv_cache, block_table, query_req_id, query_abs_pos, k_scale, v_scale, layer, *,
              scale, layout, workspace_shape, part_blocks):
    """Full attention (SPEC §5.7): §5.4 with every block selected. Returns ``(out, workspace)``;
    the workspace (the CUDA kernel's, zeros here) is never read by callers; ``part_blocks``
    (the CUDA kernel's part size) plays no part here."""
    topk = all_blocks(kv_cache.shape[-3] // 2, q.shape[0], block_table.shape[1])
    out = attend_impl(q, kv_cache, topk, block_table, query_req_id, query_abs_pos, k_scale,
                      v_scale, layer, scale=scale, layout=layout)
    return out, jnp.zeros(workspace_shape, jnp.float32)


def full_attention(q, kv_cache, block_table, query_req_id, query_abs_pos, k_scale, v_scale, *,
                   scale=None, layer=None, layout=None):
    """Reference of :func:`jax_m3sparse.full_attention` (SPEC §5.7): sparse attention with every
    block selected, in fp32. The kernels round differently (bf16/fp16 products on GPUs, their own
    summation order): compare with a tolerance (SPEC §6), not bitwise."""
    q, kv_cache, block_table, query_req_id, query_abs_pos = map(
        jnp.asarray, (q, kv_cache, block_table, query_req_id, query_abs_pos))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    topk = all_blocks(kv_cache.shape[-3] // 2, q.shape[0], block_table.shape[1])  # slots: -3
    return attend_impl(q, kv_cache, topk, block_table, query_req_id, query_abs_pos,
                       jnp.float32(k_scale), jnp.float32(v_scale), 0 if layer is None else layer,
                       scale=scale, layout=layout_code(layout, kv_cache.ndim))


def sparse_attention(q, kv_cache, topk_indices, metadata, k_scale, v_scale, *, scale=None,
                     layer=None, layout=None):
    """Reference of :func:`jax_m3sparse.sparse_attention` (SPEC §5.6)."""
    return run_mixed_batch(sparse_decode, sparse_prefill, q, kv_cache, topk_indices, metadata,
                           k_scale, v_scale, scale=scale, layer=layer, layout=layout)


def run_mixed_batch(decode_fn, prefill_fn, q, kv_cache, topk_indices, metadata, k_scale, v_scale,
                    **kw):
    """Decode on the first ``num_decode_tokens`` rows, prefill on the rest (SPEC §5.6).

    Shared by :func:`jax_m3sparse.sparse_attention` (with the primitives) and
    :func:`sparse_attention` here (with the references). A batch with no row at all
    (T = 0, which an engine step can have) runs prefill on its zero rows.
    """
    nd = metadata.num_decode_tokens
    r_dec = nd // metadata.decode_query_len
    parts = []
    if nd:
        parts.append(decode_fn(q[:nd], kv_cache, topk_indices[:, :nd], metadata.block_table[:r_dec],
                               metadata.seq_lens, k_scale, v_scale,
                               decode_query_len=metadata.decode_query_len, **kw))
    if q.shape[0] > nd or not parts:
        parts.append(prefill_fn(q[nd:], kv_cache, topk_indices[:, nd:], metadata.block_table,
                                metadata.query_req_id, metadata.query_abs_pos, k_scale, v_scale,
                                **kw))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


# ----------------------------------------------------------------------------- select_blocks
# Elements of gathered keys per lax.map step of the selection reference (tokens × M·N·Di): at
# 2²⁴ fp32 elements (64 MB) a step holds 1 token at 128k context, 32 at 4k.
_SELECT_ELEMENTS = 1 << 24


def indexer_block_scores(idx_q, idx_k_cache, block_table, query_req_id, query_abs_pos, layer=0):
    """SPEC §8 step 3 per (KV head, token, logical block): the max over the block's visible keys
    of ``idx_q · idx_k`` (fp32, ``precision="highest"``; a NaN dot product counts as −inf).

    Each token gathers its own request's pages (``block_table`` row), tokens in chunks through
    ``lax.map``: O(T · M · N · Di) work and bounded memory, whatever the pool size P.

    Args:
      idx_q: ``[T, Hkv, Di]`` float32/bf16. idx_k_cache: ``[P, N, Di]`` or ``[L, P, N, Di]``
        (bf16, float8_e4m3fn, or any float). block_table: ``int32[R, M]``. query_req_id,
        query_abs_pos: ``int32[T]``. layer: int32 scalar (the 4-D cache's layer; 0 for 3-D).

    Returns:
      ``float32[Hkv, T, M]``: −inf where the block has no key p ≤ pos, its page is outside
      ``[0, P)``, the row is padding (SPEC §8 step 1) or every dot product is NaN.
    """
    idx_q, keys = jnp.asarray(idx_q), jnp.asarray(idx_k_cache)
    block_table = jnp.asarray(block_table, jnp.int32)
    req = jnp.asarray(query_req_id, jnp.int32)
    pos = jnp.asarray(query_abs_pos, jnp.int32)
    L, (P, N, Di) = (1 if keys.ndim == 3 else keys.shape[0]), keys.shape[-3:]
    T, Hkv, _ = idx_q.shape
    R, M = block_table.shape
    layer = jnp.asarray(layer, jnp.int32)
    if L == 0 or P == 0 or M == 0:                                      # nothing to score
        return jnp.full((Hkv, T, M), -jnp.inf, jnp.float32)
    live = (req >= 0) & (req < R) & (pos >= 0) & (layer >= 0) & (layer < L)   # SPEC §8 step 1
    chunk = max(1, min(T, _SELECT_ELEMENTS // max(1, M * N * Di)))
    n = -(-T // chunk)
    pad = n * chunk - T
    q = jnp.pad(idx_q.astype(jnp.float32), ((0, pad), (0, 0), (0, 0))).reshape(n, chunk, Hkv, Di)
    rq = jnp.pad(jnp.where(live, req, 0), (0, pad)).reshape(n, chunk)
    pc = jnp.pad(jnp.where(live, pos, -1), (0, pad), constant_values=-1).reshape(n, chunk)
    layer_c = jnp.clip(layer, 0, L - 1)
    gather = (lambda pages: keys[pages]) if keys.ndim == 3 else (lambda pages: keys[layer_c, pages])
    key_pos = jnp.arange(M)[:, None] * N + jnp.arange(N)                  # [M, N] logical

    def score_chunk(xs):
        qc, rc, pc = xs                                                  # [c, Hkv, Di], [c], [c]
        pages = block_table[rc]                                          # [c, M]
        ok_page = (pages >= 0) & (pages < P)
        k = gather(jnp.clip(pages, 0, P - 1)).astype(jnp.float32)       # [c, M, N, Di]
        s = jnp.einsum("chd,cmnd->hcmn", qc, k, precision="highest")
        visible = ok_page[:, :, None] & (key_pos[None] <= pc[:, None, None])
        s = jnp.where(visible[None] & ~jnp.isnan(s), s, -jnp.inf)
        return jnp.max(s, axis=-1)                                       # [Hkv, c, M]

    out = jax.lax.map(score_chunk, (q, rq, pc))                          # [n, Hkv, c, M]
    return jnp.moveaxis(out, 0, 1).reshape(Hkv, n * chunk, M)[:, :T]


def top_blocks(block_scores, query_abs_pos, *, topk_blocks=16, block_size=128, local_blocks=1):
    """SPEC §8 steps 2 and 4 from block scores: the local blocks first in ascending id, then
    the other candidates with a finite score, descending (ties to the lower id), −1 after.

    Args:
      block_scores: ``float32[Hkv, T, M]`` (from :func:`indexer_block_scores`).
      query_abs_pos: ``int32[T]``; a negative position (padding) selects nothing.
      topk_blocks: static K. block_size: static N. local_blocks: static, ≥ 1.

    Returns:
      ``int32[Hkv, T, K]``.
    """
    Hkv, T, M = block_scores.shape
    pos = jnp.asarray(query_abs_pos, jnp.int32)
    own = jnp.where(pos >= 0, pos // block_size, -1)                     # [T]
    b = jnp.arange(M)
    candidate = b[None, :] <= own[:, None]                              # b <= min(own, M - 1)
    local = candidate & (b[None, :] > own[:, None] - local_blocks)
    s = block_scores + 0.0                                               # −0 ranks as +0
    s = jnp.where(candidate[None] & jnp.isfinite(s), s, -jnp.inf)
    s = jnp.where(local[None], jnp.inf, s)     # lax.top_k puts equal values lower index first
    k = min(topk_blocks, M)
    vals, ids = jax.lax.top_k(s, k)
    ids = jnp.where(vals > -jnp.inf, ids, -1).astype(jnp.int32)
    return jnp.pad(ids, ((0, 0), (0, 0), (0, topk_blocks - k)), constant_values=-1)


def select_impl(idx_q, idx_k_cache, block_table, query_req_id, query_abs_pos, layer, *,
                topk_blocks, local_blocks):
    """Primitive-level reference of select_blocks (SPEC §8; ``layer`` an int32 operand)."""
    scores = indexer_block_scores(idx_q, idx_k_cache, block_table, query_req_id, query_abs_pos,
                                  layer)
    R = block_table.shape[0]
    L = idx_k_cache.shape[0] if idx_k_cache.ndim == 4 else 1
    live = ((query_req_id >= 0) & (query_req_id < R) & (layer >= 0) & (layer < L))
    return top_blocks(scores, jnp.where(live, query_abs_pos, -1), topk_blocks=topk_blocks,
                      block_size=idx_k_cache.shape[-2], local_blocks=local_blocks)


def select_blocks(idx_q, idx_k_cache, block_table, query_req_id, query_abs_pos, *,
                  topk_blocks=16, local_blocks=1, layer=None):
    """Reference of :func:`jax_m3sparse.select_blocks` (SPEC §8)."""
    idx_q, idx_k_cache, block_table, query_req_id, query_abs_pos = map(
        jnp.asarray, (idx_q, idx_k_cache, block_table, query_req_id, query_abs_pos))
    return select_impl(idx_q, idx_k_cache, block_table.astype(jnp.int32),
                       query_req_id.astype(jnp.int32), query_abs_pos.astype(jnp.int32),
                       jnp.asarray(0 if layer is None else layer, jnp.int32),
                       topk_blocks=int(topk_blocks), local_blocks=int(local_blocks))


def dense_matmul_impl(lhs, rhs, *, out_dtype=jnp.float32):
    """Primitive-level reference of dense_matmul (SPEC §11): XLA's dot of ``lhs [M, K]`` and
    ``rhs [N, K]`` with fp32 sums, cast to ``out_dtype``."""
    return jax.lax.dot_general(lhs, rhs, (([1], [1]), ([], [])),
                               preferred_element_type=jnp.float32).astype(out_dtype)


def dense_matmul(lhs, rhs, out_dtype=jnp.float32):
    """jax_m3sparse.dense_matmul in pure jnp (SPEC §11): XLA's dot, fp32 sums."""
    return dense_matmul_impl(jnp.asarray(lhs), jnp.asarray(rhs), out_dtype=jnp.dtype(out_dtype))


def grouped_matmul_impl(lhs, rhs, group_sizes, rhs_scale, lhs_rows=None, lhs_scale=None,
                        row_scale=None, group_scale=None, *, gather=False, out_dtype=jnp.float32,
                        activation=None, alpha=1.702, limit=7.0):
    """Primitive-level reference of grouped_matmul (SPEC §9): per group, every row multiplied
    by the group's matrix and *selected* for the group's rows (sizes made valid: negative
    counts as 0, rows past M dropped), rows no group covers 0; MXFP8 weights (``rhs`` fp8,
    ``rhs_scale`` [G, N, K/32]) and FP4 ones (uint8 ``rhs``, §9.3) dequantized to bf16 first. A select, not XLA's
    ``ragged_dot``: on the CPU that is a masked product over every group, where a NaN or inf in
    one group's weights (an unrouted expert's included) reached every row (0 · NaN).
    ``gather``: the product's rows are ``lhs[lhs_rows]``, zero rows for ids outside ``[0, T)``
    (SPEC §9 item 4); ``out_dtype`` bf16: the fp32 result rounded to nearest even (item 5).
    An MXFP8 ``lhs`` (fp8 with ``lhs_scale`` [T, K/32], §9.2) is dequantized to bf16 first too:
    the same products, summed in another order than the CUDA kernel's blocks. The epilogue
    (§9 item 6): ``group_scale`` [G] (or [0]) multiplies each group's rows, ``activation``
    "swiglu" / "swiglu_oai" joins the gate (first N/2 columns) and up halves, ``row_scale`` [M]
    (or [0]) multiplies each row; rows no group covers stay 0."""
    if lhs.dtype == jnp.float8_e4m3fn:
        lhs = mxfp8_dequantize(lhs, lhs_scale)
    if gather:
        T = lhs.shape[0]
        ok = (lhs_rows >= 0) & (lhs_rows < T)
        lhs = (jnp.where(ok[:, None], lhs[jnp.clip(lhs_rows, 0, T - 1)], 0).astype(lhs.dtype)
               if T else jnp.zeros((lhs_rows.shape[0], lhs.shape[1]), lhs.dtype))
    if rhs.dtype == jnp.float8_e4m3fn:
        rhs = mxfp8_dequantize(rhs, rhs_scale)
    elif rhs.dtype == jnp.uint8:
        rhs = fp4_dequantize(rhs, rhs_scale)
    M, N = lhs.shape[0], rhs.shape[1]
    ends = jnp.minimum(jnp.cumsum(jnp.clip(group_sizes, 0, M)), M)   # no overflow: G·M < 2^31
    starts = ends - jnp.diff(ends, prepend=0)
    rows = jnp.arange(M)

    scaled = group_scale is not None and group_scale.shape[0] > 0

    def one(out, g):
        y = jax.lax.dot_general(lhs, rhs[g], (([1], [1]), ([], [])),
                                preferred_element_type=jnp.float32)
        if scaled:
            y = y * group_scale[g]
        return jnp.where(((rows >= starts[g]) & (rows < ends[g]))[:, None], y, out), None

    out = jax.lax.scan(one, jnp.zeros((M, N), jnp.float32),
                       jnp.arange(rhs.shape[0], dtype=jnp.int32))[0]
    if activation is None and (row_scale is None or row_scale.shape[0] == 0):
        return out.astype(out_dtype)
    if activation is not None:
        out = swiglu(out[:, :N // 2], out[:, N // 2:], activation, alpha, limit)
    if row_scale is not None and row_scale.shape[0] > 0:
        out = out * row_scale[:, None]
    covered = rows < (ends[-1] if ends.shape[0] else 0)
    return jnp.where(covered[:, None], out, 0.0).astype(out_dtype)


def swiglu(gate, up, activation: str, alpha: float = 1.702, limit: float = 7.0):
    """The gated activations of SPEC §9 item 6, in the operands' dtype: "swiglu" ``silu(gate) ·
    up``; "swiglu_oai" (GPT-OSS's, MiniMax M3's ``swigluoai``) ``(clip(up, ±limit) + 1) · g ·
    sigmoid(alpha · g)`` with ``g = min(gate, limit)`` (NaN kept)."""
    if activation == "swiglu":
        return jax.nn.silu(gate) * up
    if activation == "swiglu_oai":
        g = jnp.minimum(gate, limit)
        return (jnp.clip(up, -limit, limit) + 1.0) * g * jax.nn.sigmoid(g * alpha)
    raise ValueError(f"activation must be None, 'swiglu' or 'swiglu_oai', got {activation!r}")


def grouped_matmul(lhs, rhs, group_sizes, rhs_scale=None, lhs_rows=None, out_dtype=jnp.float32,
                   lhs_scale=None, activation=None, row_scale=None, group_scale=None,
                   alpha=1.702, limit=7.0):
    """Reference of :func:`jax_m3sparse.grouped_matmul` (SPEC §9)."""
    rhs, lhs = jnp.asarray(rhs), jnp.asarray(lhs)
    scale = (jnp.zeros((*rhs.shape[:2], 0), jnp.uint8) if rhs_scale is None
             else jnp.asarray(rhs_scale))
    lhs_scale = (jnp.zeros((lhs.shape[0], 0), jnp.uint8) if lhs_scale is None
                 else jnp.asarray(lhs_scale))
    gather = lhs_rows is not None
    rows = jnp.asarray(lhs_rows if gather else np.zeros(0), jnp.int32)
    return grouped_matmul_impl(
        lhs, rhs, jnp.asarray(group_sizes, jnp.int32), scale, rows, lhs_scale,
        None if row_scale is None else jnp.asarray(row_scale, jnp.float32),
        None if group_scale is None else jnp.asarray(group_scale, jnp.float32),
        gather=gather, out_dtype=jnp.dtype(out_dtype), activation=activation, alpha=alpha,
        limit=limit)


def write_index_keys_impl(idx_k_cache, keys, slot_mapping, layer):
    """Primitive-level reference of write_index_keys (SPEC §8.1): one scatter into the whole
    ``[L, P, N, Di]`` cache (in place where XLA runs scatters in place: GPUs); slots outside
    ``[0, P·N)`` and a layer outside ``[0, L)`` write nothing; fp8 saturates at ±448."""
    L, P, N, _ = idx_k_cache.shape
    ok = (slot_mapping >= 0) & (slot_mapping < P * N) & (layer >= 0) & (layer < L)
    page = jnp.where(ok, slot_mapping // N, P)                   # P: out of range, dropped
    values = keys.astype(jnp.float32)
    if idx_k_cache.dtype == jnp.float8_e4m3fn:                   # E4M3 has no infinity
        values = jnp.clip(values, -448.0, 448.0)
    return idx_k_cache.at[jnp.clip(layer, 0, L - 1), page, slot_mapping % N].set(
        values.astype(idx_k_cache.dtype), mode="drop")


def write_index_keys(idx_k_cache, keys, slot_mapping, layer=None):
    """Reference of :func:`jax_m3sparse.write_index_keys` (SPEC §8.1)."""
    cache = jnp.asarray(idx_k_cache)
    cache4 = cache if cache.ndim == 4 else cache[None]
    out = write_index_keys_impl(cache4, jnp.asarray(keys), jnp.asarray(slot_mapping, jnp.int32),
                                jnp.asarray(0 if layer is None else layer, jnp.int32))
    return out if cache.ndim == 4 else out[0]


def route_experts_impl(scores, bias, live, *, k, renormalize=True):
    """Primitive-level reference of route_experts (SPEC §10): per token the k experts of largest
    ``scores + bias`` (NaN as −inf, −0 as +0; ties to the lower id), each weighted by its score
    (divided by the k scores' sum, added in order, when ``renormalize``); then the (token,
    expert) pairs of live tokens grouped by expert, stable (pair index t·k + j within a group),
    the pairs of tokens not live after every group, in pair order. Returns ``(weights [T, k],
    experts [T, k], group_sizes [E], sorted_tokens [T·k], sorted_weights [T·k], inverse [T,
    k])``."""
    T, E = scores.shape
    choice = scores + bias[None, :]
    choice = jnp.where(jnp.isnan(choice), -jnp.inf, choice) + 0.0       # + 0.0: −0 -> +0
    _, experts = jax.lax.top_k(choice, k)
    experts = experts.astype(jnp.int32)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if renormalize:
        total = weights[:, 0]
        for j in range(1, k):                                           # in order, as the kernels
            total = total + weights[:, j]
        # column by column: XLA rewrites a division by a broadcast into a multiplication by
        # the reciprocal (not correctly rounded); the kernels divide exactly
        weights = jnp.stack([weights[:, j] / total for j in range(k)], axis=1)
    bucket = jnp.where(live[:, None], experts, E).reshape(-1)           # E: no group, sorts last
    order = jnp.argsort(bucket, stable=True).astype(jnp.int32)
    n = T * k
    inverse = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    sizes = jnp.zeros(E + 1, jnp.int32).at[bucket].add(1)[:E]
    return (weights, experts, sizes, order // k, weights.reshape(-1)[order],
            inverse.reshape(T, k))


def route_experts(scores, k, *, bias=None, live=None, renormalize=True):
    """Reference of :func:`jax_m3sparse.route_experts` (SPEC §10): the same fields, as a
    tuple."""
    scores = jnp.asarray(scores, jnp.float32)
    T, E = scores.shape
    bias = jnp.zeros(E, jnp.float32) if bias is None else jnp.asarray(bias, jnp.float32)
    live = jnp.ones(T, bool) if live is None else jnp.asarray(live, bool)
    return route_experts_impl(scores, bias, live, k=int(k), renormalize=bool(renormalize))
