"""The README's API tour, runnable: pack two requests' K/V, decode, prefill, mixed batch, and
MiniMax M3's indexer selection.

    python examples/api_tour.py

Random data; every result is compared with the pure-JAX reference (`jax_m3sparse.reference`).
"""

import jax
import jax.numpy as jnp
import numpy as np

import jax_m3sparse as m3

N, D, HKV, HQ, K = 128, 128, 1, 16, 16          # block size, head dim, KV heads, query heads, top-k
spec = m3.KVCacheSpec(num_kv_heads=HKV, head_dim=D, block_size=N)
cache = m3.allocate_kv_cache(spec, num_pages=16, num_layers=4, layout="LBHNC")  # uint8, 5-D
rng = np.random.default_rng(0)

# Two requests of 300 and 1000 tokens. Request r's logical block b lives in page block_table[r, b];
# token p of request r goes to slot block_table[r, p // N] * N + p % N (SPEC §3.4).
seq_lens = np.array([300, 1000], np.int32)
block_table = np.full((2, 8), -1, np.int32)
block_table[0, :3] = [5, 0, 9]
block_table[1, :8] = [1, 2, 3, 4, 6, 7, 8, 10]
slot_mapping = np.concatenate([block_table[r, np.arange(n) // N] * N + np.arange(n) % N
                               for r, n in enumerate(seq_lens)]).astype(np.int32)
k = jnp.asarray(rng.standard_normal((len(slot_mapping), HKV, D)), jnp.bfloat16)
v = jnp.asarray(rng.standard_normal((len(slot_mapping), HKV, D)), jnp.bfloat16)


# Write K/V into layer 2 in place: the cache is donated, so no copy of it is made. A 5-D cache
# names its layout in every call (the shape cannot say whether it is [L, P, ...] or [P, L, ...]).
def write(cache, k, v, slot_mapping, layer):
    return m3.pack_kv_pages(cache, k, v, slot_mapping, k_scale=1.0, v_scale=1.0, layer=layer,
                            layout="LBHNC")


write = jax.jit(write, donate_argnums=0)
layer = jnp.int32(2)
cache = write(cache, k, v, slot_mapping, layer)

# Decode one token per request (the last one: seq_lens include it). topk_indices holds logical
# block ids per (KV head, token); −1 marks unused slots (SPEC §5.1).
q = jnp.asarray(rng.standard_normal((2, HQ, D)), jnp.bfloat16)
topk_indices = np.full((HKV, 2, K), -1, np.int32)
topk_indices[0, 0, :3] = [2, 0, 1]
topk_indices[0, 1, :4] = [7, 0, 3, 5]          # sparse: blocks 1, 2, 4, 6 are skipped
decode = jax.jit(lambda *a: m3.sparse_decode(*a, 1.0, 1.0, decode_query_len=1, layer=layer,
                                                  layout="LBHNC"))
out = decode(q, cache, topk_indices, block_table, seq_lens)
ref = m3.reference.sparse_decode(q, cache, topk_indices, block_table, seq_lens, 1.0, 1.0,
                                 layer=layer, layout="LBHNC")
print("decode", out.shape, out.dtype, "max |out - reference| =",
      float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)))))

# Prefill: the last 5 tokens of request 1 as a chunk. Positions come from cu_seqlens_q/context_lens.
cu_seqlens_q = np.array([0, 0, 5], np.int32)    # request 0 contributes no token to this chunk
context_lens = np.array([300, 995], np.int32)
req_id, abs_pos = m3.query_token_positions(cu_seqlens_q, context_lens, num_tokens=8)  # 3 padding
q_pre = jnp.asarray(rng.standard_normal((8, HQ, D)), jnp.bfloat16)
topk_pre = np.tile(topk_indices[:, 1:2], (1, 8, 1))
out_pre = m3.sparse_prefill(q_pre, cache, topk_pre, block_table, req_id, abs_pos, 1.0, 1.0,
                            layer=layer, layout="LBHNC")
print("prefill rows:", np.asarray(req_id), np.asarray(abs_pos),
      "padding rows are zeros:", bool(jnp.all(out_pre[5:] == 0)))

# MiniMax M3's indexer selection (SPEC §8) makes topk_indices. The index keys live in their own
# key-only paged cache, bf16 [L, P, N, Di] (same pages and block_table as K/V); write this step's
# keys first (a prefill chunk's tokens see its earlier keys), then select for the same chunk.
DI = 128
idx_k = jnp.asarray(rng.standard_normal((len(slot_mapping), DI)), jnp.bfloat16)
# in place (SPEC §8.1; a padding slot (-1) writes nothing)
idx_k_cache = m3.write_index_keys(m3.allocate_index_cache(16, 4, index_dim=DI), idx_k, slot_mapping,
                                  layer=layer)
print("index keys written as the reference writes them:", bool(jnp.all(
    idx_k_cache == m3.reference.write_index_keys(jnp.zeros((4, 16, N, DI), jnp.bfloat16), idx_k,
                                                 slot_mapping, layer))))
idx_q = jnp.asarray(rng.standard_normal((8, HKV, DI)), jnp.bfloat16)   # [T, Hkv, Di]
topk_sel = m3.select_blocks(idx_q, idx_k_cache, block_table, req_id, abs_pos, topk_blocks=4,
                            layer=layer)                              # int32 [Hkv, T, 4]
ref_sel = m3.reference.select_blocks(idx_q, idx_k_cache, block_table, req_id, abs_pos,
                                     topk_blocks=4, layer=layer)
print("token 995 selects blocks", np.asarray(topk_sel[0, 0]), "(its own block 7 first);",
      "selection equals the reference:", bool(jnp.all(topk_sel == ref_sel)))
# Decode rows need a request and position too: request r's one row is (r, seq_lens[r] − 1).
# Inside jit, as a server's step calls it, the selection feeds sparse_decode directly.
@jax.jit
def select_and_decode(q, idx_q, cache, idx_k_cache, block_table, seq_lens):
    rows = jnp.arange(seq_lens.shape[0], dtype=jnp.int32)
    topk = m3.select_blocks(idx_q, idx_k_cache, block_table, rows, seq_lens - 1, topk_blocks=K,
                            layer=layer)                          # int32 [Hkv, R, K]
    return topk, m3.sparse_decode(q, cache, topk, block_table, seq_lens, 1.0, 1.0,
                                  decode_query_len=1, layer=layer, layout="LBHNC")


topk_dec, out_dec = select_and_decode(q, idx_q[:2], cache, idx_k_cache, block_table, seq_lens)
print("decode row 1 (token 999) selects", np.asarray(topk_dec[0, 1, :8]), "... equals the reference:",
      bool(jnp.all(topk_dec == m3.reference.select_blocks(
          idx_q[:2], idx_k_cache, block_table, np.arange(2, dtype=np.int32), seq_lens - 1,
          topk_blocks=K, layer=layer))))
out_sel = m3.sparse_prefill(q_pre, cache, topk_sel, block_table, req_id, abs_pos, 1.0, 1.0,
                            layer=layer, layout="LBHNC")
print("prefill over the selected blocks", out_sel.shape, "padding rows select nothing:",
      bool(jnp.all(topk_sel[:, 5:] == -1)))

# A serving engine's mixed batch: decode requests first, then prefill chunks, in one call.
meta = m3.build_attention_metadata(np.array([1, 5], np.int32), np.array([299, 995], np.int32),
                                   block_table, num_decode_requests=1, num_tokens=8)
req_all, pos_all = meta.token_rows()          # every row's request and position (select_blocks)
print("mixed batch rows: requests", np.asarray(req_all), "positions", np.asarray(pos_all))
q_mix = jnp.concatenate([q[:1], q_pre[:7]])
topk_mix = np.concatenate([topk_indices[:, :1], topk_pre[:, :7]], axis=1)
out_mix = m3.sparse_attention(q_mix, cache, topk_mix, meta, 1.0, 1.0, layer=layer, layout="LBHNC")
print("mixed batch", out_mix.shape, "decode row equals sparse_decode:",
      bool(jnp.allclose(out_mix[0], out[0])))

# M3's full-attention layers: every key up to each row's position (SPEC §5.7), no top-k list;
# the same as sparse attention with every block of the table selected.
out_full = m3.full_attention(q_mix, cache, block_table, req_all, pos_all, 1.0, 1.0, layer=layer,
                             layout="LBHNC")
every = np.broadcast_to(np.arange(block_table.shape[1], dtype=np.int32), topk_mix.shape[:2]
                        + (block_table.shape[1],))
print("full attention", out_full.shape, "equals every block selected:",
      bool(jnp.allclose(out_full, m3.sparse_attention(q_mix, cache, every, meta, 1.0, 1.0,
                                                      layer=layer, layout="LBHNC"))))

# What a platform's kernels serve, and the pages back as floats.
print("gfx950 serves this geometry:", m3.unsupported_reason(HQ, HKV, D, K, N, "rocm") is None)
keys, values = m3.unpack_kv_pages(cache, jnp.array([5], jnp.int32), 1.0, 1.0, layer=layer,
                               layout="LBHNC")
print("page 5 dequantized:", keys.shape, "rel. error vs bf16 K (NVFP4 on Gaussian data: ~0.09):",
      float(jnp.linalg.norm(keys[0, 0] - k[:128, 0]) / jnp.linalg.norm(k[:128, 0].astype(jnp.float32))))

# A mixture of experts' routed experts: (token, expert) pairs sorted by expert, one grouped
# matmul per projection; each expert's weights are read once (on CUDA), unrouted ones never.
E, TOPK, H, I = 8, 2, 64, 32
x = jnp.asarray(rng.standard_normal((5, H)), jnp.bfloat16)
# The routing (SPEC §10): each token's top-k experts of scores + bias, weights renormalised, the
# pairs grouped by expert (stable); the same as numpy's stable argsort of the chosen experts.
scores = jnp.asarray(rng.uniform(size=(5, E)), jnp.float32)                 # router probabilities
r = m3.route_experts(scores, TOPK, bias=jnp.zeros(E, jnp.float32))
chosen = np.asarray(r.experts)                                              # [T, k], best first
order = np.argsort(chosen.reshape(-1), kind="stable")
sizes = r.group_sizes
print("route_experts: experts", chosen.tolist(), "| grouped as argsort would:",
      bool(np.array_equal(np.asarray(r.sorted_tokens), order // TOPK)), "| weights sum to 1:",
      bool(jnp.allclose(r.weights.sum(1), 1.0)))
w_up = jnp.asarray(rng.standard_normal((E, I, H)) * H ** -0.5, jnp.bfloat16)   # [E, out, in]
# lhs_rows: each sorted pair's token, read in place (the same bits as passing x[order // TOPK])
up = m3.grouped_matmul(x, w_up, sizes, lhs_rows=jnp.asarray(order // TOPK, jnp.int32))  # f32 [T·k, I]
print("grouped matmul", up.shape, "row 0 is token", order[0] // TOPK, "through expert",
      chosen.reshape(-1)[order[0]], ":", bool(jnp.allclose(
          up[0], x[order[0] // TOPK].astype(jnp.float32) @ w_up[0].astype(jnp.float32).T,
          rtol=1e-5, atol=1e-4)), "| equals the call on the sorted copy:",
      bool(jnp.array_equal(up, m3.grouped_matmul(x[order // TOPK], w_up, sizes))))
# MXFP8 weights (SPEC §9.1): fp8 e4m3 + an E8M0 exponent per 32 inputs, read as they are; the
# call equals the bf16 call on the dequantized weights.
w8, w8_scale = m3.mxfp8_quantize(w_up)
up8 = m3.grouped_matmul(x, w8, sizes, w8_scale, lhs_rows=jnp.asarray(order // TOPK, jnp.int32))
print("MXFP8 grouped matmul equals the bf16 call on mxfp8_dequantize:", bool(jnp.array_equal(
    up8, m3.grouped_matmul(x[order // TOPK], m3.mxfp8_dequantize(w8, w8_scale), sizes))))
# FP4 weights (SPEC §9.3): two E2M1 codes per byte with an E8M0 exponent per 32 inputs (MXFP4),
# or an E4M3 scale per 16 (NVFP4: nvfp4_quantize(w, weight_scale_2) per expert, and
# group_scale=weight_scale_2 [E] in the call).
w4, w4_scale = m3.mxfp4_quantize(w_up)                         # uint8 [E, I, H/2], [E, I, H/32]
up4 = m3.grouped_matmul(x, w4, sizes, w4_scale, lhs_rows=jnp.asarray(order // TOPK, jnp.int32))
print("MXFP4 grouped matmul equals the bf16 call on fp4_dequantize:", bool(jnp.array_equal(
    up4, m3.grouped_matmul(x[order // TOPK], m3.fp4_dequantize(w4, w4_scale), sizes))))
# The epilogue (SPEC §9 item 6): gate_up [E, 2I, H] (gate rows, then up rows) → the SwiGLU of
# each row times its routing weight, [T·k, I]: the [T·k, 2I] product never reaches memory.
w_gate_up = jnp.asarray(rng.standard_normal((E, 2 * I, H)) * H ** -0.5, jnp.bfloat16)
pair_rows = jnp.asarray(order // TOPK, jnp.int32)
h = m3.grouped_matmul(x, w_gate_up, sizes, lhs_rows=pair_rows, activation="swiglu",
                      row_scale=r.sorted_weights)
gu = m3.grouped_matmul(x, w_gate_up, sizes, lhs_rows=pair_rows)
print("grouped matmul with a SwiGLU epilogue", h.shape, "equals silu(gate) · up · weight:",
      bool(jnp.allclose(h, jax.nn.silu(gu[:, :I]) * gu[:, I:] * r.sorted_weights[:, None],
                        rtol=1e-6, atol=1e-6)))

# A decode step's dense projection (SPEC §11): rows bf16 [T, in] · w bf16 [out, in]ᵀ, fp32 sums
# (on CUDA a weight-streaming kernel whose rows' bits do not depend on the batch; here XLA's dot).
w_o = jnp.asarray(rng.standard_normal((96, H)) * H ** -0.5, jnp.bfloat16)      # [out, in]
o = jax.jit(m3.dense_matmul)(x, w_o)                                           # float32 [5, 96]
print("dense_matmul", o.shape, "within fp32 rounding of numpy:", bool(np.allclose(
    np.asarray(o), np.asarray(x, np.float32) @ np.asarray(w_o, np.float32).T, rtol=1e-5,
    atol=1e-5)))
