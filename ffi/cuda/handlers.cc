// XLA FFI handlers of the CUDA backend (docs/ffi_targets.md): m3sparse_<op>_cuda.
// Every handler takes the stream as ffi::PlatformStream<cudaStream_t>, launches only kernels
// (no allocation, no synchronization, no host reads of device data), and is registered
// command-buffer compatible. Data scalars (k_scale, v_scale, layer) stay on the device.
#include <cuda_runtime.h>

#include <algorithm>
#include <initializer_list>
#include <string>

#include "m3sparse/ffi_checks.h"
#include "m3sparse_cuda.h"
#include "xla/ffi/api/ffi.h"

namespace m3sparse {
namespace cuda {

cudaError_t launch_query_token_positions(const int32_t* cu_seqlens_q, const int32_t* context_lens,
                                         int64_t num_requests, int32_t* query_req_id,
                                         int32_t* query_abs_pos, int64_t num_tokens,
                                         cudaStream_t stream);

namespace {

ffi::Error cuda_error(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("m3sparse (CUDA) ") + what + ": " +
                              cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

bool dtype_of(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::BF16: *out = DType::kBF16; return true;
    case ffi::DataType::F16: *out = DType::kF16; return true;
    case ffi::DataType::F32: *out = DType::kF32; return true;
    default: return false;
  }
}

// Shared by decode, prefill and full: shapes of q, cache, topk (null for full), block_table, out.
ffi::Error attention_params(const ffi::AnyBuffer& q, const ffi::AnyBuffer& kv_cache,
                            const ffi::Buffer<ffi::S32>* topk,
                            const ffi::Buffer<ffi::S32>& block_table, const ffi::AnyBuffer& out,
                            int64_t layout, AttentionParams* p) {
  auto qd = q.dimensions();
  if (qd.size() != 3) return invalid("q must be [T, Hq, D]");
  const int64_t T = qd[0], Hq = qd[1], D = qd[2];
  if (!dtype_of(q.element_type(), &p->dtype) || p->dtype == DType::kF32)
    return invalid("the CUDA kernels take q as bfloat16 or float16");
  if (out.element_type() != q.element_type() || out.element_count() != q.element_count())
    return invalid("out must have q's shape and dtype");
  ffi::Error e = decode_cache_geometry(kv_cache, layout, D, &p->geom);
  if (e.failure()) return e;
  int64_t Hkv = p->geom.num_slots / 2, K = 1;  // full: no top-k list
  if (topk != nullptr) {
    auto td = topk->dimensions();
    if (td.size() != 3 || td[1] != T) return invalid("topk_indices must be [Hkv, T, K]");
    Hkv = td[0];
    K = td[2];
  }
  if (p->geom.num_slots != 2 * Hkv) return invalid("kv_cache axis of head slots must be 2*Hkv");
  const char* why = attention_unsupported(Hq, Hkv, D, K, p->geom.block_size);
  if (why[0] != '\0') return invalid(why);
  auto bd = block_table.dimensions();
  if (bd.size() != 2) return invalid("block_table must be [R, M]");
  p->q = q.untyped_data();
  p->out = out.untyped_data();
  p->kv_cache = static_cast<const uint8_t*>(kv_cache.untyped_data());
  p->topk_indices = topk != nullptr ? topk->typed_data() : nullptr;
  p->block_table = block_table.typed_data();
  p->num_tokens = T;
  p->num_kv_heads = int32_t(Hkv);
  p->topk = int32_t(K);
  p->num_requests = int32_t(bd[0]);
  p->max_blocks = int32_t(bd[1]);
  p->group = int32_t(Hq / Hkv);
  return ffi::Error::Success();
}

ffi::Error SparseDecode(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv_cache,
                        ffi::Buffer<ffi::S32> topk, ffi::Buffer<ffi::S32> block_table,
                        ffi::Buffer<ffi::S32> seq_lens, ffi::BufferR0<ffi::F32> k_scale,
                        ffi::BufferR0<ffi::F32> v_scale, ffi::BufferR0<ffi::S32> layer,
                        ffi::Result<ffi::AnyBuffer> out, float scale, int64_t decode_query_len,
                        int64_t layout) {
  AttentionParams p = {};
  ffi::Error e = attention_params(q, kv_cache, &topk, block_table, *out, layout, &p);
  if (e.failure()) return e;
  if (decode_query_len < 1) return invalid("decode_query_len must be >= 1");
  if (int64_t(seq_lens.element_count()) != p.num_requests)
    return invalid("seq_lens must be [R] with R = block_table rows");
  if (p.num_tokens != int64_t(p.num_requests) * decode_query_len)
    return invalid("T must equal R * decode_query_len");
  p.seq_lens = seq_lens.typed_data();
  p.k_scale = k_scale.typed_data();
  p.v_scale = v_scale.typed_data();
  p.layer = layer.typed_data();
  p.decode_query_len = int32_t(decode_query_len);
  p.is_prefill = 0;
  p.scale = scale;
  return cuda_error(launch_sparse_attention(p, stream), "sparse_decode launch");
}

// Rows with their own request and position (SPEC §5.4; full_attention's too) and the scalars.
ffi::Error prefill_rows(const ffi::Buffer<ffi::S32>& query_req_id,
                        const ffi::Buffer<ffi::S32>& query_abs_pos,
                        const ffi::BufferR0<ffi::F32>& k_scale,
                        const ffi::BufferR0<ffi::F32>& v_scale,
                        const ffi::BufferR0<ffi::S32>& layer, float scale, AttentionParams* p) {
  if (int64_t(query_req_id.element_count()) != p->num_tokens ||
      int64_t(query_abs_pos.element_count()) != p->num_tokens)
    return invalid("query_req_id and query_abs_pos must be [T]");
  p->query_req_id = query_req_id.typed_data();
  p->query_abs_pos = query_abs_pos.typed_data();
  p->k_scale = k_scale.typed_data();
  p->v_scale = v_scale.typed_data();
  p->layer = layer.typed_data();
  p->decode_query_len = 1;
  p->is_prefill = 1;
  p->scale = scale;
  return ffi::Error::Success();
}

ffi::Error SparsePrefill(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv_cache,
                         ffi::Buffer<ffi::S32> topk, ffi::Buffer<ffi::S32> block_table,
                         ffi::Buffer<ffi::S32> query_req_id, ffi::Buffer<ffi::S32> query_abs_pos,
                         ffi::BufferR0<ffi::F32> k_scale, ffi::BufferR0<ffi::F32> v_scale,
                         ffi::BufferR0<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> out,
                         float scale, int64_t layout) {
  AttentionParams p = {};
  ffi::Error e = attention_params(q, kv_cache, &topk, block_table, *out, layout, &p);
  if (e.failure()) return e;
  e = prefill_rows(query_req_id, query_abs_pos, k_scale, v_scale, layer, scale, &p);
  if (e.failure()) return e;
  return cuda_error(launch_sparse_attention(p, stream), "sparse_prefill launch");
}

ffi::Error FullAttention(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv_cache,
                         ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> query_req_id,
                         ffi::Buffer<ffi::S32> query_abs_pos, ffi::BufferR0<ffi::F32> k_scale,
                         ffi::BufferR0<ffi::F32> v_scale, ffi::BufferR0<ffi::S32> layer,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> ws,
                         float scale, int64_t layout, int64_t part_blocks) {
  AttentionParams p = {};
  ffi::Error e = attention_params(q, kv_cache, nullptr, block_table, *out, layout, &p);
  if (e.failure()) return e;
  e = prefill_rows(query_req_id, query_abs_pos, k_scale, v_scale, layer, scale, &p);
  if (e.failure()) return e;
  p.full = 1;
  if (part_blocks < 1 || part_blocks > kMaxTopk) return invalid("part_blocks must be in [1, 64]");
  p.full_part = int32_t(part_blocks);
  // A workspace holding every row's parts (the lowering sizes it: jax_m3sparse/ops/full.py)
  // asks for one CTA per part and a merge; otherwise one CTA per row.
  const int64_t parts = full_parts_of(p.max_blocks, part_blocks);
  const int64_t need = p.num_tokens * p.num_kv_heads * parts * kStateFloats;
  if (need > 0 && int64_t(ws->element_count()) >= need) {
    p.full_parts = int32_t(parts);
    p.workspace = ws->typed_data();
  }
  return cuda_error(launch_sparse_attention(p, stream), "full_attention launch");
}

ffi::Error PackKvPages(cudaStream_t stream, ffi::AnyBuffer kv_cache, ffi::AnyBuffer key,
                       ffi::AnyBuffer value, ffi::Buffer<ffi::S32> slot_mapping,
                       ffi::BufferR0<ffi::F32> k_scale, ffi::BufferR0<ffi::F32> v_scale,
                       ffi::BufferR0<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> kv_out,
                       int64_t layout) {
  PackParams p = {};
  auto kd = key.dimensions();
  if (kd.size() != 3) return invalid("key must be [T, Hkv, D]");
  const int64_t T = kd[0], Hkv = kd[1], D = kd[2];
  if (!dtype_of(key.element_type(), &p.dtype)) return invalid("key must be f32, bf16 or f16");
  if (value.element_type() != key.element_type() || value.element_count() != key.element_count())
    return invalid("value must have key's shape and dtype");
  ffi::Error e = decode_cache_geometry(kv_cache, layout, D, &p.geom);
  if (e.failure()) return e;
  if (p.geom.num_slots != 2 * Hkv) return invalid("kv_cache axis of head slots must be 2*Hkv");
  if (int64_t(slot_mapping.element_count()) != T) return invalid("slot_mapping must be [T]");
  if (kv_out->size_bytes() != kv_cache.size_bytes()) return invalid("result must alias kv_cache");
  uint8_t* dst = static_cast<uint8_t*>(kv_out->untyped_data());
  if (dst != kv_cache.untyped_data()) {
    // Not donated: XLA gave a separate result buffer; start it from the operand.
    cudaError_t err = cudaMemcpyAsync(dst, kv_cache.untyped_data(), kv_cache.size_bytes(),
                                      cudaMemcpyDeviceToDevice, stream);
    if (err != cudaSuccess) return cuda_error(err, "pack_kv_pages copy");
  }
  p.kv_cache = dst;
  p.key = key.untyped_data();
  p.value = value.untyped_data();
  p.slot_mapping = slot_mapping.typed_data();
  p.k_scale = k_scale.typed_data();
  p.v_scale = v_scale.typed_data();
  p.layer = layer.typed_data();
  p.num_tokens = T;
  p.num_kv_heads = int32_t(Hkv);
  return cuda_error(launch_pack_kv_pages(p, stream), "pack_kv_pages launch");
}

ffi::Error QueryTokenPositions(cudaStream_t stream, ffi::Buffer<ffi::S32> cu_seqlens_q,
                               ffi::Buffer<ffi::S32> context_lens,
                               ffi::Result<ffi::Buffer<ffi::S32>> req_id,
                               ffi::Result<ffi::Buffer<ffi::S32>> abs_pos) {
  const int64_t R = context_lens.element_count();
  if (int64_t(cu_seqlens_q.element_count()) != R + 1) return invalid("cu_seqlens_q must be [R + 1]");
  if (abs_pos->element_count() != req_id->element_count())
    return invalid("query_req_id and query_abs_pos must have the same length");
  return cuda_error(launch_query_token_positions(cu_seqlens_q.typed_data(),
                                                 context_lens.typed_data(), R,
                                                 req_id->typed_data(), abs_pos->typed_data(),
                                                 int64_t(req_id->element_count()), stream),
                    "query_token_positions launch");
}

ffi::Error SelectBlocks(cudaStream_t stream, ffi::AnyBuffer idx_q, ffi::AnyBuffer idx_k_cache,
                        ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> query_req_id,
                        ffi::Buffer<ffi::S32> query_abs_pos, ffi::BufferR0<ffi::S32> layer,
                        ffi::Result<ffi::Buffer<ffi::S32>> topk, int64_t topk_blocks,
                        int64_t local_blocks) {
  SelectGeometry g;
  if (auto e = decode_select_geometry(idx_q, idx_k_cache, block_table, query_req_id,
                                      query_abs_pos, topk->dimensions(), topk_blocks,
                                      local_blocks, &g);
      e.failure())
    return e;
  const char* why = select_unsupported(g.index_dim, g.block_size, g.max_blocks);
  if (why[0] != '\0') return invalid(why);
  if (g.num_tokens * g.num_kv_heads > int64_t(0x3FFFFFFF))
    return invalid("select_blocks: T * Hkv must be below 2^30");
  SelectParams p = {};
  p.q_dtype = g.q_f32 ? DType::kF32 : DType::kBF16;
  p.key_fp8 = g.key_fp8 ? 1 : 0;
  p.idx_q = idx_q.untyped_data();
  p.idx_k = idx_k_cache.untyped_data();
  p.block_table = block_table.typed_data();
  p.query_req_id = query_req_id.typed_data();
  p.query_abs_pos = query_abs_pos.typed_data();
  p.layer = layer.typed_data();
  p.topk_indices = topk->typed_data();
  p.num_tokens = g.num_tokens;
  p.num_kv_heads = int32_t(g.num_kv_heads);
  p.head_dim = int32_t(g.index_dim);
  p.num_layers = g.num_layers;
  p.num_pages = g.num_pages;
  p.block_size = g.block_size;
  p.num_requests = int32_t(g.num_requests);
  p.max_blocks = int32_t(g.max_blocks);
  p.topk = topk_blocks;
  p.local_blocks = local_blocks;
  return cuda_error(launch_select_blocks(p, stream), "select_blocks launch");
}

ffi::Error GroupedMatmul(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                         ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer rhs_scale,
                         ffi::Buffer<ffi::S32> lhs_rows, ffi::Buffer<ffi::U8> lhs_scale,
                         ffi::Buffer<ffi::F32> row_scale, ffi::Buffer<ffi::F32> group_scale,
                         ffi::Result<ffi::AnyBuffer> out, int64_t gather, int64_t activation,
                         float alpha, float limit) {
  GroupedGeometry g;
  if (auto e = decode_grouped_geometry(lhs, rhs, group_sizes, rhs_scale, lhs_rows, lhs_scale,
                                       row_scale, group_scale, *out, gather, activation, &g);
      e.failure())
    return e;
  const bool quantized = g.weights != kGroupedBf16;
  const char* why = g.w8a8 ? grouped_matmul_w8a8_unsupported(g.k)
                           : grouped_matmul_unsupported(g.k, quantized);
  if (why[0] != '\0') return invalid(why);
  if (g.num_groups > 65534) return invalid("grouped_matmul: G must be below 65535");
  GroupedMatmulParams p = {};
  p.lhs = lhs.untyped_data();
  p.rhs = rhs.untyped_data();
  p.rhs_scale = quantized ? static_cast<const uint8_t*>(rhs_scale.untyped_data()) : nullptr;
  p.fp4 = g.weights == kGroupedNvfp4 ? 2 : g.weights == kGroupedMxfp4 ? 1 : 0;
  p.lhs_scale = g.w8a8 ? lhs_scale.typed_data() : nullptr;
  p.group_sizes = group_sizes.typed_data();
  p.out = out->untyped_data();
  p.out_bf16 = g.out_bf16;
  p.lhs_rows = gather ? lhs_rows.typed_data() : nullptr;
  p.lhs_count = g.lhs_count;
  p.row_scale = g.row_scaled ? row_scale.typed_data() : nullptr;
  p.group_scale = g.group_scaled ? group_scale.typed_data() : nullptr;
  p.act = int32_t(activation);
  p.alpha = alpha;
  p.limit = limit;
  p.m = g.m;
  p.n = g.n;
  p.k = g.k;
  p.num_groups = int32_t(g.num_groups);
  if (p.n == 0) return ffi::Error::Success();
  return cuda_error(launch_grouped_matmul(p, stream), "grouped_matmul launch");
}

ffi::Error DenseMatmul(cudaStream_t stream, ffi::Buffer<ffi::BF16> lhs,
                       ffi::Buffer<ffi::BF16> rhs, ffi::Result<ffi::AnyBuffer> out) {
  auto ld = lhs.dimensions(), rd = rhs.dimensions(), od = out->dimensions();
  if (ld.size() != 2 || rd.size() != 2 || rd[1] != ld[1] || od.size() != 2 || od[0] != ld[0] ||
      od[1] != rd[0])
    return invalid("dense_matmul: lhs [M, K], rhs [N, K], out [M, N]");
  const bool out_bf16 = out->element_type() == ffi::BF16;
  if (!out_bf16 && out->element_type() != ffi::F32)
    return invalid("dense_matmul: out must be float32 or bfloat16");
  const char* why = dense_matmul_unsupported(ld[1]);
  if (why[0] != '\0') return invalid(why);
  if ((ld[0] + 15) / 16 > 65535) return invalid("dense_matmul: M must be below 2^20");
  DenseMatmulParams p = {};
  p.lhs = reinterpret_cast<const __nv_bfloat16*>(lhs.typed_data());
  p.rhs = reinterpret_cast<const __nv_bfloat16*>(rhs.typed_data());
  p.out = out->untyped_data();
  p.out_bf16 = out_bf16;
  p.m = ld[0];
  p.n = rd[0];
  p.k = ld[1];
  return cuda_error(launch_dense_matmul(p, stream), "dense_matmul launch");
}

ffi::Error RouteExperts(cudaStream_t stream, ffi::Buffer<ffi::F32> scores,
                        ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::PRED> live,
                        ffi::Result<ffi::Buffer<ffi::F32>> weights,
                        ffi::Result<ffi::Buffer<ffi::S32>> experts,
                        ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                        ffi::Result<ffi::Buffer<ffi::S32>> sorted_tokens,
                        ffi::Result<ffi::Buffer<ffi::F32>> sorted_weights,
                        ffi::Result<ffi::Buffer<ffi::S32>> inverse, int64_t k,
                        int64_t renormalize) {
  auto sd = scores.dimensions();
  if (sd.size() != 2 || bias.dimensions().size() != 1 || bias.dimensions()[0] != sd[1] ||
      live.dimensions().size() != 1 || live.dimensions()[0] != sd[0])
    return invalid("route_experts: scores [T, E], bias [E], live [T]");
  const int64_t T = sd[0], E = sd[1];
  const char* why = route_unsupported(E, k);
  if (why[0] != '\0') return invalid(why);
  if (T * k >= (int64_t(1) << 31)) return invalid("route_experts: T·k must be below 2^31");
  auto is = [](auto& r, std::initializer_list<int64_t> dims) {
    auto d = r->dimensions();
    return std::equal(d.begin(), d.end(), dims.begin(), dims.end());
  };
  if (!is(weights, {T, k}) || !is(experts, {T, k}) || !is(group_sizes, {E}) ||
      !is(sorted_tokens, {T * k}) || !is(sorted_weights, {T * k}) || !is(inverse, {T, k}))
    return invalid("route_experts: results [T, k], [T, k], [E], [T·k], [T·k], [T, k]");
  RouteParams p = {};
  p.scores = scores.typed_data();
  p.bias = bias.typed_data();
  p.live = reinterpret_cast<const bool*>(live.typed_data());
  p.weights = weights->typed_data();
  p.experts = experts->typed_data();
  p.group_sizes = group_sizes->typed_data();
  p.sorted_tokens = sorted_tokens->typed_data();
  p.sorted_weights = sorted_weights->typed_data();
  p.inverse = inverse->typed_data();
  p.num_tokens = T;
  p.num_experts = int32_t(E);
  p.k = int32_t(k);
  p.renormalize = renormalize != 0;
  return cuda_error(launch_route_experts(p, stream), "route_experts launch");
}

}  // namespace
}  // namespace cuda
}  // namespace m3sparse

namespace xffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_sparse_decode_cuda, m3sparse::cuda::SparseDecode,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()               // q
                                  .Arg<xffi::AnyBuffer>()               // kv_cache
                                  .Arg<xffi::Buffer<xffi::S32>>()       // topk_indices
                                  .Arg<xffi::Buffer<xffi::S32>>()       // block_table
                                  .Arg<xffi::Buffer<xffi::S32>>()       // seq_lens
                                  .Arg<xffi::BufferR0<xffi::F32>>()     // k_scale
                                  .Arg<xffi::BufferR0<xffi::F32>>()     // v_scale
                                  .Arg<xffi::BufferR0<xffi::S32>>()     // layer
                                  .Ret<xffi::AnyBuffer>()               // out
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("decode_query_len")
                                  .Attr<int64_t>("layout"),
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_sparse_prefill_cuda, m3sparse::cuda::SparsePrefill,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()               // q
                                  .Arg<xffi::AnyBuffer>()               // kv_cache
                                  .Arg<xffi::Buffer<xffi::S32>>()       // topk_indices
                                  .Arg<xffi::Buffer<xffi::S32>>()       // block_table
                                  .Arg<xffi::Buffer<xffi::S32>>()       // query_req_id
                                  .Arg<xffi::Buffer<xffi::S32>>()       // query_abs_pos
                                  .Arg<xffi::BufferR0<xffi::F32>>()     // k_scale
                                  .Arg<xffi::BufferR0<xffi::F32>>()     // v_scale
                                  .Arg<xffi::BufferR0<xffi::S32>>()     // layer
                                  .Ret<xffi::AnyBuffer>()               // out
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("layout"),
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_full_attention_cuda, m3sparse::cuda::FullAttention,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()               // q
                                  .Arg<xffi::AnyBuffer>()               // kv_cache
                                  .Arg<xffi::Buffer<xffi::S32>>()       // block_table
                                  .Arg<xffi::Buffer<xffi::S32>>()       // query_req_id
                                  .Arg<xffi::Buffer<xffi::S32>>()       // query_abs_pos
                                  .Arg<xffi::BufferR0<xffi::F32>>()     // k_scale
                                  .Arg<xffi::BufferR0<xffi::F32>>()     // v_scale
                                  .Arg<xffi::BufferR0<xffi::S32>>()     // layer
                                  .Ret<xffi::AnyBuffer>()               // out
                                  .Ret<xffi::Buffer<xffi::F32>>()       // workspace
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("layout")
                                  .Attr<int64_t>("part_blocks"),
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_pack_kv_pages_cuda, m3sparse::cuda::PackKvPages,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()               // kv_cache
                                  .Arg<xffi::AnyBuffer>()               // key
                                  .Arg<xffi::AnyBuffer>()               // value
                                  .Arg<xffi::Buffer<xffi::S32>>()       // slot_mapping
                                  .Arg<xffi::BufferR0<xffi::F32>>()     // k_scale
                                  .Arg<xffi::BufferR0<xffi::F32>>()     // v_scale
                                  .Arg<xffi::BufferR0<xffi::S32>>()     // layer
                                  .Ret<xffi::AnyBuffer>()               // kv_cache (aliased)
                                  .Attr<int64_t>("layout"),
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_query_token_positions_cuda,
                              m3sparse::cuda::QueryTokenPositions,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::Buffer<xffi::S32>>()       // cu_seqlens_q
                                  .Arg<xffi::Buffer<xffi::S32>>()       // context_lens
                                  .Ret<xffi::Buffer<xffi::S32>>()       // query_req_id
                                  .Ret<xffi::Buffer<xffi::S32>>(),      // query_abs_pos
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_select_blocks_cuda, m3sparse::cuda::SelectBlocks,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()               // idx_q
                                  .Arg<xffi::AnyBuffer>()               // idx_k_cache
                                  .Arg<xffi::Buffer<xffi::S32>>()       // block_table
                                  .Arg<xffi::Buffer<xffi::S32>>()       // query_req_id
                                  .Arg<xffi::Buffer<xffi::S32>>()       // query_abs_pos
                                  .Arg<xffi::BufferR0<xffi::S32>>()     // layer
                                  .Ret<xffi::Buffer<xffi::S32>>()       // topk_indices
                                  .Attr<int64_t>("topk_blocks")
                                  .Attr<int64_t>("local_blocks"),
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_grouped_matmul_cuda, m3sparse::cuda::GroupedMatmul,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()               // lhs (bf16 / fp8)
                                  .Arg<xffi::AnyBuffer>()               // rhs (bf16 / fp8 / u8 FP4)
                                  .Arg<xffi::Buffer<xffi::S32>>()       // group_sizes
                                  .Arg<xffi::AnyBuffer>()               // rhs_scale (u8 / e4m3)
                                  .Arg<xffi::Buffer<xffi::S32>>()       // lhs_rows
                                  .Arg<xffi::Buffer<xffi::U8>>()        // lhs_scale
                                  .Arg<xffi::Buffer<xffi::F32>>()       // row_scale [M] / [0]
                                  .Arg<xffi::Buffer<xffi::F32>>()       // group_scale [G] / [0]
                                  .Ret<xffi::AnyBuffer>()               // out (f32 / bf16)
                                  .Attr<int64_t>("gather")
                                  .Attr<int64_t>("activation")
                                  .Attr<float>("alpha")
                                  .Attr<float>("limit"),
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_dense_matmul_cuda, m3sparse::cuda::DenseMatmul,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::Buffer<xffi::BF16>>()      // lhs
                                  .Arg<xffi::Buffer<xffi::BF16>>()      // rhs
                                  .Ret<xffi::AnyBuffer>(),              // out (f32 / bf16)
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_route_experts_cuda, m3sparse::cuda::RouteExperts,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::Buffer<xffi::F32>>()       // scores
                                  .Arg<xffi::Buffer<xffi::F32>>()       // bias
                                  .Arg<xffi::Buffer<xffi::PRED>>()      // live
                                  .Ret<xffi::Buffer<xffi::F32>>()       // weights
                                  .Ret<xffi::Buffer<xffi::S32>>()       // experts
                                  .Ret<xffi::Buffer<xffi::S32>>()       // group_sizes
                                  .Ret<xffi::Buffer<xffi::S32>>()       // sorted_tokens
                                  .Ret<xffi::Buffer<xffi::F32>>()       // sorted_weights
                                  .Ret<xffi::Buffer<xffi::S32>>()       // inverse
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("renormalize"),
                              {xffi::Traits::kCmdBufferCompatible});
