// XLA FFI handlers of the ROCm (gfx950) backend: m3sparse_<op>_rocm, with exactly the operands,
// results and attributes of docs/ffi_targets.md. Each handler validates the buffers (shapes,
// dtypes, the gfx950 geometry D = 128, G = 16 or 8, K = 16, N = 128, 32-bit index limits), makes sure
// the device is a gfx950 with the kernel's module loaded (device.cc), and calls the FlyDSL
// entry point exported by ffi/flydsl/export.py on XLA's stream. Semantics: SPEC §2–§5, §7, §8.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "kernels.h"
#include "m3sparse/cache.h"
#include "m3sparse/ffi_checks.h"

namespace m3sparse::rocm {
namespace {

constexpr int64_t kHeadDim = 128;    // D
constexpr int64_t kGroup = 16;       // G query heads per KV head (the *_g8_* kernels serve G = 8)
constexpr int64_t kGroupTp8 = 8;     // MiniMax M3 at TP8
constexpr int64_t kTopk = 16;        // K selected blocks
constexpr int64_t kBlockSize = 128;  // N
constexpr int64_t kPackTokensPerGroup = 4;   // pack_kv_pages: tokens per 64-lane workgroup
constexpr int64_t kPositionsPerGroup = 64;   // query_token_positions: tokens per workgroup
constexpr int64_t kI32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxGridYZ = 65535;        // a launch's grid y and z

ffi::Error refuse(const char* target, const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(target) + ": " + what);
}

std::string dims_text(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

bool is_float(ffi::DataType t) {
  return t == ffi::DataType::BF16 || t == ffi::DataType::F16 || t == ffi::DataType::F32;
}
int64_t float_bytes(ffi::DataType t) { return t == ffi::DataType::F32 ? 4 : 2; }

// One compiled variant per io dtype (export.py: NAME_bf16 / NAME_f16 / NAME_f32).
template <typename Call>
struct Variant {
  KernelModule kernel;
  Call call;
};
#define M3SPARSE_VARIANTS(NAME, T)                                                         \
  (T == ffi::DataType::BF16   ? Variant<decltype(&NAME##_bf16_call)>{                     \
                                  M3SPARSE_KERNEL_MODULE(NAME##_bf16), NAME##_bf16_call} \
   : T == ffi::DataType::F16 ? Variant<decltype(&NAME##_bf16_call)>{                      \
                                  M3SPARSE_KERNEL_MODULE(NAME##_f16), NAME##_f16_call}   \
                             : Variant<decltype(&NAME##_bf16_call)>{                      \
                                  M3SPARSE_KERNEL_MODULE(NAME##_f32), NAME##_f32_call})
// ... and per G (16, or 8 from the NAME_g8 modules; same entry-point signatures).
#define M3SPARSE_GROUP_VARIANTS(NAME, T, G) \
  ((G) == kGroupTp8 ? M3SPARSE_VARIANTS(NAME##_g8, T) : M3SPARSE_VARIANTS(NAME, T))

// Cache geometry (SPEC §3) restricted to what the gfx950 kernels are compiled for.
ffi::Error cache_geometry(const char* target, const ffi::AnyBuffer& cache, int64_t layout,
                          CacheGeometry* geo) {
  if (auto e = decode_cache_geometry(cache, layout, kHeadDim, geo); e.failure()) return e;
  if (geo->block_size != kBlockSize)
    return refuse(target, "block_size must be 128 on gfx950, got " + std::to_string(geo->block_size));
  if (geo->num_slots % 2 != 0) return refuse(target, "kv_cache must have 2·Hkv head slots");
  if (geo->num_pages > kI32Max || geo->num_layers > kI32Max)
    return refuse(target, "num_pages and num_layers must fit in int32");
  return ffi::Error::Success();
}

// Strides in bytes for the kernels (SPEC §3.3): page p of layer l at p·page_stride + l·layer_stride.
void strides(const CacheGeometry& geo, int64_t* page_stride, int64_t* layer_stride) {
  *page_stride = geo.page_offset(0, 1) - geo.page_offset(0, 0);
  *layer_stride = geo.page_offset(1, 0) - geo.page_offset(0, 0);
}

bool fits_i32(int64_t bytes) { return bytes >= 0 && bytes <= kI32Max; }

// ---------------------------------------------------------------------------------------------
// m3sparse_pack_kv_pages_rocm (SPEC §2.2, §3)
// ---------------------------------------------------------------------------------------------
constexpr const char* kPackTarget = "m3sparse_pack_kv_pages_rocm";

ffi::Error PackKvPages(hipStream_t stream, int32_t device, ffi::AnyBuffer cache, ffi::AnyBuffer key,
                       ffi::AnyBuffer value, ffi::Buffer<ffi::S32> slot_mapping,
                       ffi::BufferR0<ffi::F32> k_scale, ffi::BufferR0<ffi::F32> v_scale,
                       ffi::BufferR0<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> cache_out,
                       int64_t layout) {
  CacheGeometry geo;
  if (auto e = cache_geometry(kPackTarget, cache, layout, &geo); e.failure()) return e;
  auto kd = key.dimensions();
  const int64_t hkv = geo.num_slots / 2;
  if (kd.size() != 3 || kd[1] != hkv || kd[2] != kHeadDim)
    return refuse(kPackTarget, "key must be [T, Hkv=" + std::to_string(hkv) + ", 128], got " +
                                   dims_text(kd));
  if (value.element_type() != key.element_type() || dims_text(value.dimensions()) != dims_text(kd))
    return refuse(kPackTarget, "value must have key's dtype and shape");
  if (!is_float(key.element_type()))
    return refuse(kPackTarget, "key and value must be float32, bfloat16 or float16");
  const int64_t tokens = kd[0];
  if (int64_t(slot_mapping.element_count()) != tokens)
    return refuse(kPackTarget, "slot_mapping must be [T=" + std::to_string(tokens) + "]");
  if (!fits_i32(tokens * hkv * kHeadDim * float_bytes(key.element_type())))
    return refuse(kPackTarget, "key is larger than 2 GiB");
  if (cache_out->untyped_data() != cache.untyped_data()) {
    // Not aliased (the caller did not donate the cache): start from a copy, as XLA expects.
    hipError_t err = hipMemcpyAsync(cache_out->untyped_data(), cache.untyped_data(),
                                    cache.size_bytes(), hipMemcpyDeviceToDevice, stream);
    if (err != hipSuccess)
      return ffi::Error(ffi::ErrorCode::kInternal, std::string(kPackTarget) +
                                                       ": copying the unaliased cache failed: " +
                                                       hipGetErrorString(err));
  }
  if (tokens == 0) return ffi::Error::Success();
  int64_t page_stride, layer_stride;
  strides(geo, &page_stride, &layer_stride);
  const auto v = M3SPARSE_VARIANTS(pack_kv_pages, key.element_type());
  if (auto e = prepare_launch(kPackTarget, v.kernel, device); e.failure()) return e;
  int32_t st = v.call(cache_out->untyped_data(), key.untyped_data(), value.untyped_data(),
                    slot_mapping.typed_data(), k_scale.typed_data(), v_scale.typed_data(),
                    layer.typed_data(), int32_t(tokens), int32_t(hkv), int32_t(geo.num_pages),
                    int32_t(geo.num_layers), page_stride, layer_stride,
                    int32_t((tokens + kPackTokensPerGroup - 1) / kPackTokensPerGroup), stream);
  return launch_status(kPackTarget, v.kernel, st);
}

// ---------------------------------------------------------------------------------------------
// m3sparse_query_token_positions_rocm (SPEC §4)
// ---------------------------------------------------------------------------------------------
constexpr const char* kPositionsTarget = "m3sparse_query_token_positions_rocm";

ffi::Error QueryTokenPositions(hipStream_t stream, int32_t device, ffi::Buffer<ffi::S32> cu_seqlens_q,
                               ffi::Buffer<ffi::S32> context_lens,
                               ffi::Result<ffi::Buffer<ffi::S32>> query_req_id,
                               ffi::Result<ffi::Buffer<ffi::S32>> query_abs_pos) {
  const int64_t requests = int64_t(context_lens.element_count());
  if (int64_t(cu_seqlens_q.element_count()) != requests + 1)
    return refuse(kPositionsTarget, "cu_seqlens_q must be [R+1] with context_lens [R]");
  const int64_t tokens = int64_t(query_req_id->element_count());
  if (int64_t(query_abs_pos->element_count()) != tokens)
    return refuse(kPositionsTarget, "query_req_id and query_abs_pos must have the same size");
  if (!fits_i32((requests + 1) * 4) || !fits_i32(tokens * 4))
    return refuse(kPositionsTarget, "too many requests or tokens for int32 indexing");
  if (tokens == 0) return ffi::Error::Success();
  int32_t steps = 0;  // ceil(log2(R + 1)): binary-search steps over [0, R)
  while ((int64_t(1) << steps) <= requests) ++steps;
  const KernelModule kernel = M3SPARSE_KERNEL_MODULE(query_token_positions);
  if (auto e = prepare_launch(kPositionsTarget, kernel, device); e.failure()) return e;
  int32_t st = query_token_positions_call(
      cu_seqlens_q.typed_data(), context_lens.typed_data(), query_req_id->typed_data(),
      query_abs_pos->typed_data(), int32_t(requests), int32_t(tokens), steps,
      int32_t((tokens + kPositionsPerGroup - 1) / kPositionsPerGroup), stream);
  return launch_status(kPositionsTarget, kernel, st);
}

// ---------------------------------------------------------------------------------------------
// Shared checks of sparse_decode / sparse_prefill (SPEC §5)
// ---------------------------------------------------------------------------------------------
struct AttendShape {
  CacheGeometry geo;
  int64_t tokens, hkv, group, requests, max_blocks, page_stride, layer_stride;
};

// topk: the selection [Hkv, T, 16], or nullptr for full attention (every block, no list).
ffi::Error attend_shape(const char* target, const ffi::AnyBuffer& q, const ffi::AnyBuffer& cache,
                        const ffi::Buffer<ffi::S32>* topk, const ffi::Buffer<ffi::S32>& block_table,
                        const ffi::AnyBuffer& out, int64_t layout, AttendShape* s) {
  if (auto e = cache_geometry(target, cache, layout, &s->geo); e.failure()) return e;
  s->hkv = s->geo.num_slots / 2;
  auto qd = q.dimensions();
  if (qd.size() != 3 || qd[2] != kHeadDim)
    return refuse(target, "q must be [T, Hq, 128], got " + dims_text(qd));
  if (qd[1] != kGroup * s->hkv && qd[1] != kGroupTp8 * s->hkv)
    return refuse(target, "gfx950 kernels need G = Hq/Hkv = 16 or 8, got Hq=" + std::to_string(qd[1]) +
                              ", Hkv=" + std::to_string(s->hkv));
  s->group = qd[1] / s->hkv;
  if (!is_float(q.element_type()))
    return refuse(target, "q must be float32, bfloat16 or float16");
  if (out.element_type() != q.element_type() || dims_text(out.dimensions()) != dims_text(qd))
    return refuse(target, "out must have q's dtype and shape");
  s->tokens = qd[0];
  if (topk != nullptr) {
    auto td = topk->dimensions();
    if (td.size() != 3 || td[0] != s->hkv || td[1] != s->tokens || td[2] != kTopk)
      return refuse(target, "topk_indices must be [Hkv, T, 16], got " + dims_text(td));
  }
  auto bd = block_table.dimensions();
  if (bd.size() != 2) return refuse(target, "block_table must be [R, M]");
  s->requests = bd[0];
  s->max_blocks = bd[1];
  if (!fits_i32(s->tokens * qd[1] * kHeadDim * float_bytes(q.element_type())) ||
      (topk != nullptr && !fits_i32(s->hkv * s->tokens * kTopk * 4)) ||
      !fits_i32(s->requests * s->max_blocks * 4) || !fits_i32(s->max_blocks * kBlockSize))
    return refuse(target, "an operand is too large for the kernels' 32-bit indexing");
  strides(s->geo, &s->page_stride, &s->layer_stride);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// m3sparse_sparse_decode_rocm (SPEC §5.3)
// ---------------------------------------------------------------------------------------------
constexpr const char* kDecodeTarget = "m3sparse_sparse_decode_rocm";

// Split decode (sparse_decode.py, compile_sparse_decode_split): 4 workgroups per (token, KV head)
// and a merge kernel, for batches too small to fill the GPU with one workgroup per pair
// (MI355X: 256 CUs). Its partials live in XLA scratch memory: T·Hkv·4 records of 8320 bytes.
constexpr int64_t kSplitBelowPairs = 256;
constexpr int64_t kDecodeSplits = 4;
constexpr int64_t kPartialBytes = 16 * 128 * 4 + 16 * 8;

ffi::Error SparseDecode(hipStream_t stream, int32_t device, ffi::ScratchAllocator scratch,
                        ffi::AnyBuffer q, ffi::AnyBuffer cache,
                        ffi::Buffer<ffi::S32> topk, ffi::Buffer<ffi::S32> block_table,
                        ffi::Buffer<ffi::S32> seq_lens, ffi::BufferR0<ffi::F32> k_scale,
                        ffi::BufferR0<ffi::F32> v_scale, ffi::BufferR0<ffi::S32> layer,
                        ffi::Result<ffi::AnyBuffer> out, float scale, int64_t decode_query_len,
                        int64_t layout) {
  AttendShape s;
  if (auto e = attend_shape(kDecodeTarget, q, cache, &topk, block_table, *out, layout, &s); e.failure())
    return e;
  if (decode_query_len < 1 || s.tokens != s.requests * decode_query_len ||
      int64_t(seq_lens.element_count()) != s.requests)
    return refuse(kDecodeTarget, "decode needs T = R·decode_query_len and seq_lens [R]");
  if (s.tokens == 0) return ffi::Error::Success();
  if (decode_query_len == 1 && s.tokens * s.hkv < kSplitBelowPairs) {
    const int64_t ws_bytes = s.tokens * s.hkv * kDecodeSplits * kPartialBytes;
    std::optional<void*> workspace = scratch.Allocate(size_t(ws_bytes), 16);
    if (workspace.has_value()) {
      const auto sv = M3SPARSE_GROUP_VARIANTS(sparse_decode_split, q.element_type(), s.group);
      if (auto e = prepare_launch(kDecodeTarget, sv.kernel, device); e.failure()) return e;
      int32_t st = sv.call(q.untyped_data(), cache.untyped_data(), topk.typed_data(),
                           block_table.typed_data(), seq_lens.typed_data(), k_scale.typed_data(),
                           v_scale.typed_data(), layer.typed_data(), out->untyped_data(), *workspace,
                           int32_t(s.tokens), int32_t(s.hkv), int32_t(s.requests), int32_t(s.max_blocks),
                           int32_t(s.geo.num_pages), int32_t(s.geo.num_layers), s.page_stride,
                           s.layer_stride, int32_t(decode_query_len), scale, stream);
      return launch_status(kDecodeTarget, sv.kernel, st);
    }
    // No scratch memory: the one-pass kernel below computes the same result.
  }
  // dql > 1: union tiles (ffi/flydsl/union_tile.py) load each block a request's rows selected once;
  // the same entry-point signature as the one-pass kernel.
  const auto v = decode_query_len > 1
                     ? M3SPARSE_GROUP_VARIANTS(sparse_decode_union, q.element_type(), s.group)
                     : M3SPARSE_GROUP_VARIANTS(sparse_decode, q.element_type(), s.group);
  if (auto e = prepare_launch(kDecodeTarget, v.kernel, device); e.failure()) return e;
  int32_t st = v.call(q.untyped_data(), cache.untyped_data(), topk.typed_data(), block_table.typed_data(),
                    seq_lens.typed_data(), k_scale.typed_data(), v_scale.typed_data(),
                    layer.typed_data(), out->untyped_data(), int32_t(s.tokens), int32_t(s.hkv),
                    int32_t(s.requests), int32_t(s.max_blocks), int32_t(s.geo.num_pages),
                    int32_t(s.geo.num_layers), s.page_stride, s.layer_stride,
                    int32_t(decode_query_len), scale, stream);
  return launch_status(kDecodeTarget, v.kernel, st);
}

// ---------------------------------------------------------------------------------------------
// m3sparse_sparse_prefill_rocm (SPEC §5.4)
// ---------------------------------------------------------------------------------------------
constexpr const char* kPrefillTarget = "m3sparse_sparse_prefill_rocm";

ffi::Error SparsePrefill(hipStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer cache,
                         ffi::Buffer<ffi::S32> topk, ffi::Buffer<ffi::S32> block_table,
                         ffi::Buffer<ffi::S32> query_req_id, ffi::Buffer<ffi::S32> query_abs_pos,
                         ffi::BufferR0<ffi::F32> k_scale, ffi::BufferR0<ffi::F32> v_scale,
                         ffi::BufferR0<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> out, float scale,
                         int64_t layout) {
  AttendShape s;
  if (auto e = attend_shape(kPrefillTarget, q, cache, &topk, block_table, *out, layout, &s); e.failure())
    return e;
  if (int64_t(query_req_id.element_count()) != s.tokens || int64_t(query_abs_pos.element_count()) != s.tokens)
    return refuse(kPrefillTarget, "query_req_id and query_abs_pos must be [T]");
  if (s.tokens == 0) return ffi::Error::Success();
  const auto v = M3SPARSE_GROUP_VARIANTS(sparse_prefill, q.element_type(), s.group);
  if (auto e = prepare_launch(kPrefillTarget, v.kernel, device); e.failure()) return e;
  int32_t st = v.call(q.untyped_data(), cache.untyped_data(), topk.typed_data(), block_table.typed_data(),
                    query_req_id.typed_data(), query_abs_pos.typed_data(), k_scale.typed_data(),
                    v_scale.typed_data(), layer.typed_data(), out->untyped_data(), int32_t(s.tokens),
                    int32_t(s.hkv), int32_t(s.requests), int32_t(s.max_blocks),
                    int32_t(s.geo.num_pages), int32_t(s.geo.num_layers), s.page_stride,
                    s.layer_stride, scale, stream);
  return launch_status(kPrefillTarget, v.kernel, st);
}

// ---------------------------------------------------------------------------------------------
// m3sparse_full_attention_rocm (SPEC §5.7)
// ---------------------------------------------------------------------------------------------
constexpr const char* kFullTarget = "m3sparse_full_attention_rocm";
// full_attention.py: a row's blocks in parts of 16 (the kernel's constant, not the part_blocks
// attribute, which sizes the CUDA kernel's parts), one workgroup per (row, KV head, part) writing
// its state to XLA scratch memory, then a merge per (row, KV head). The pair runs over chunks of rows
// holding at most kFullMaxStates states (34 MB); a row's work is the same in any chunk.
constexpr int64_t kFullPartBlocks = 16;
constexpr int64_t kFullMaxStates = 4096;

ffi::Error FullAttention(hipStream_t stream, int32_t device, ffi::ScratchAllocator scratch, ffi::AnyBuffer q,
                         ffi::AnyBuffer cache, ffi::Buffer<ffi::S32> block_table,
                         ffi::Buffer<ffi::S32> query_req_id, ffi::Buffer<ffi::S32> query_abs_pos,
                         ffi::BufferR0<ffi::F32> k_scale, ffi::BufferR0<ffi::F32> v_scale,
                         ffi::BufferR0<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::AnyBuffer> /*workspace: CUDA's; not written here*/, float scale,
                         int64_t layout, int64_t /*part_blocks*/) {
  AttendShape s;
  if (auto e = attend_shape(kFullTarget, q, cache, nullptr, block_table, *out, layout, &s); e.failure())
    return e;
  if (int64_t(query_req_id.element_count()) != s.tokens || int64_t(query_abs_pos.element_count()) != s.tokens)
    return refuse(kFullTarget, "query_req_id and query_abs_pos must be [T]");
  const int64_t parts = (s.max_blocks + kFullPartBlocks - 1) / kFullPartBlocks;
  if (!fits_i32(s.hkv * parts * kPartialBytes) || parts > kMaxGridYZ || s.hkv > kMaxGridYZ)
    return refuse(kFullTarget, "an operand is too large for the kernels' 32-bit indexing");
  if (s.tokens == 0) return ffi::Error::Success();
  if (parts == 0) {  // no block in any request (full.py returns zeros before binding; kept defined)
    hipError_t err = hipMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
    if (err != hipSuccess)
      return ffi::Error(ffi::ErrorCode::kInternal,
                        std::string(kFullTarget) + ": hipMemsetAsync failed: " + hipGetErrorString(err));
    return ffi::Error::Success();
  }
  const int64_t chunk = std::max<int64_t>(1, kFullMaxStates / (s.hkv * parts));
  const int64_t rows_max = std::min(chunk, s.tokens);
  const int64_t ws_bytes = rows_max * s.hkv * parts * kPartialBytes;
  std::optional<void*> workspace = scratch.Allocate(size_t(ws_bytes), 16);
  if (!workspace.has_value())
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, std::string(kFullTarget) +
                                                              ": no scratch memory for the parts' states (" +
                                                              std::to_string(ws_bytes) + " bytes)");
  const auto v = M3SPARSE_GROUP_VARIANTS(full_attention, q.element_type(), s.group);
  if (auto e = prepare_launch(kFullTarget, v.kernel, device); e.failure()) return e;
  const int64_t row_bytes = s.hkv * s.group * kHeadDim * float_bytes(q.element_type());
  auto* q_bytes = static_cast<char*>(q.untyped_data());
  auto* out_bytes = static_cast<char*>(out->untyped_data());
  for (int64_t t0 = 0; t0 < s.tokens; t0 += chunk) {
    const int64_t rows = std::min(chunk, s.tokens - t0);
    int32_t st = v.call(q_bytes + t0 * row_bytes, cache.untyped_data(), block_table.typed_data(),
                        query_req_id.typed_data() + t0, query_abs_pos.typed_data() + t0, k_scale.typed_data(),
                        v_scale.typed_data(), layer.typed_data(), out_bytes + t0 * row_bytes, *workspace,
                        int32_t(rows), int32_t(s.hkv), int32_t(s.requests), int32_t(s.max_blocks),
                        int32_t(s.geo.num_pages), int32_t(s.geo.num_layers), s.page_stride, s.layer_stride,
                        int32_t(parts), scale, stream);
    if (auto e = launch_status(kFullTarget, v.kernel, st); e.failure()) return e;
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// m3sparse_select_blocks_rocm (SPEC §8)
// ---------------------------------------------------------------------------------------------
constexpr const char* kSelectTarget = "m3sparse_select_blocks_rocm";
constexpr int64_t kIndexDim = 128;    // Di: the gfx950 kernel serves MiniMax M3's index geometry
constexpr int64_t kRunTile = 64;      // select_blocks.py: rows whose runs one score workgroup serves

// One entry point per (idx_q dtype, index-key dtype); all four have the same signature.
using SelectCall = decltype(&select_blocks_bf16_bf16_call);
Variant<SelectCall> select_variant(ffi::DataType q, ffi::DataType k) {
  const bool q32 = q == ffi::DataType::F32, fp8 = k == ffi::DataType::F8E4M3FN;
  if (q32 && fp8) return {M3SPARSE_KERNEL_MODULE(select_blocks_f32_fp8), select_blocks_f32_fp8_call};
  if (q32) return {M3SPARSE_KERNEL_MODULE(select_blocks_f32_bf16), select_blocks_f32_bf16_call};
  if (fp8) return {M3SPARSE_KERNEL_MODULE(select_blocks_bf16_fp8), select_blocks_bf16_fp8_call};
  return {M3SPARSE_KERNEL_MODULE(select_blocks_bf16_bf16), select_blocks_bf16_bf16_call};
}

ffi::Error SelectBlocks(hipStream_t stream, int32_t device, ffi::ScratchAllocator scratch,
                        ffi::AnyBuffer idx_q, ffi::AnyBuffer idx_k_cache, ffi::Buffer<ffi::S32> block_table,
                        ffi::Buffer<ffi::S32> query_req_id, ffi::Buffer<ffi::S32> query_abs_pos,
                        ffi::BufferR0<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::S32>> topk_indices,
                        int64_t topk_blocks, int64_t local_blocks) {
  SelectGeometry g;
  if (auto e = decode_select_geometry(idx_q, idx_k_cache, block_table, query_req_id,
                                      query_abs_pos, topk_indices->dimensions(), topk_blocks,
                                      local_blocks, &g);
      e.failure())
    return e;
  if (g.index_dim != kIndexDim || g.block_size != kBlockSize)
    return refuse(kSelectTarget, "idx_k_cache must be [P, 128, 128] or [L, P, 128, 128] on gfx950, got " +
                                     dims_text(idx_k_cache.dimensions()));
  const ffi::DataType kt = idx_k_cache.element_type();
  const int64_t tokens = g.num_tokens, hkv = g.num_kv_heads, layers = g.num_layers,
                pages = g.num_pages, requests = g.num_requests, max_blocks = g.max_blocks;
  if (topk_blocks > kI32Max || local_blocks > kI32Max)
    return refuse(kSelectTarget, "topk_blocks and local_blocks must be in [1, 2^31)");
  const int64_t page_stride = kBlockSize * kIndexDim * (kt == ffi::DataType::BF16 ? 2 : 1);
  if (!fits_i32(tokens * hkv * kIndexDim * float_bytes(idx_q.element_type())) ||
      !fits_i32(hkv * tokens * max_blocks * 8) || !fits_i32(hkv * tokens * topk_blocks * 4) ||
      !fits_i32(requests * max_blocks * 4) || !fits_i32(max_blocks * kBlockSize) || pages > kI32Max ||
      layers > kI32Max || (tokens + kRunTile - 1) / kRunTile > kMaxGridYZ || hkv > kMaxGridYZ)
    return refuse(kSelectTarget, "an operand is too large for the kernels' 32-bit indexing");
  if (tokens == 0 || hkv == 0) return ffi::Error::Success();
  if (max_blocks == 0) {  // no candidate: every row is -1 (the score kernel has no block to launch over)
    hipError_t err = hipMemsetAsync(topk_indices->typed_data(), 0xFF, topk_indices->size_bytes(), stream);
    if (err != hipSuccess)
      return ffi::Error(ffi::ErrorCode::kInternal,
                        std::string(kSelectTarget) + ": hipMemsetAsync failed: " + hipGetErrorString(err));
    return ffi::Error::Success();
  }
  // Half-block scores [Hkv, T, M, 2] f32 between the two kernels; every entry read is written first.
  std::optional<void*> workspace = scratch.Allocate(size_t(hkv * tokens * max_blocks * 8), 16);
  if (!workspace.has_value())
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string(kSelectTarget) + ": no scratch memory for the block scores (" +
                          std::to_string(hkv * tokens * max_blocks * 8) + " bytes)");
  const auto v = select_variant(idx_q.element_type(), kt);
  if (auto e = prepare_launch(kSelectTarget, v.kernel, device); e.failure()) return e;
  int32_t st = v.call(idx_q.untyped_data(), idx_k_cache.untyped_data(), block_table.typed_data(),
                      query_req_id.typed_data(), query_abs_pos.typed_data(), layer.typed_data(), *workspace,
                      topk_indices->typed_data(), int32_t(tokens), int32_t(hkv), int32_t(requests),
                      int32_t(max_blocks), int32_t(pages), int32_t(layers), page_stride, pages * page_stride,
                      int32_t(topk_blocks), int32_t(local_blocks),
                      int32_t((tokens + kRunTile - 1) / kRunTile), stream);
  return launch_status(kSelectTarget, v.kernel, st);
}


// ---------------------------------------------------------------------------------------------
// m3sparse_grouped_matmul_rocm (SPEC §9)
// ---------------------------------------------------------------------------------------------
constexpr const char* kGroupedTarget = "m3sparse_grouped_matmul_rocm";
constexpr int64_t kGroupedTileRows = 16;   // grouped_matmul.py: rows a tile, the MFMA's 16 columns
constexpr int64_t kGroupedWaves = 4;       // waves a workgroup, 64 output columns each (32 with an activation)
constexpr int64_t kGroupedStepK = 32;      // k a step
constexpr int64_t kGroupedSplitSteps = 32; // from K / 32 = this, the 4 waves split K (grouped_matmul.py
                                           // SPLIT_MIN_STEPS): a workgroup's columns are one wave's

// One entry point per (weight format, output dtype); all eight have the same signature.
using GroupedCall = decltype(&grouped_matmul_bf16_f32_call);
#define M3SPARSE_GROUPED_VARIANT(W, O) \
  Variant<GroupedCall> { M3SPARSE_KERNEL_MODULE(grouped_matmul_##W##_##O), grouped_matmul_##W##_##O##_call }
Variant<GroupedCall> grouped_variant(int weights, bool out_bf16) {
  switch (weights) {
    case kGroupedMxfp8: return out_bf16 ? M3SPARSE_GROUPED_VARIANT(mxfp8, bf16) : M3SPARSE_GROUPED_VARIANT(mxfp8, f32);
    case kGroupedMxfp4: return out_bf16 ? M3SPARSE_GROUPED_VARIANT(mxfp4, bf16) : M3SPARSE_GROUPED_VARIANT(mxfp4, f32);
    case kGroupedNvfp4: return out_bf16 ? M3SPARSE_GROUPED_VARIANT(nvfp4, bf16) : M3SPARSE_GROUPED_VARIANT(nvfp4, f32);
    default: return out_bf16 ? M3SPARSE_GROUPED_VARIANT(bf16, bf16) : M3SPARSE_GROUPED_VARIANT(bf16, f32);
  }
}

ffi::Error GroupedMatmul(hipStream_t stream, int32_t device, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                         ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer rhs_scale,
                         ffi::Buffer<ffi::S32> lhs_rows, ffi::Buffer<ffi::U8> lhs_scale,
                         ffi::Buffer<ffi::F32> row_scale, ffi::Buffer<ffi::F32> group_scale,
                         ffi::Result<ffi::AnyBuffer> out, int64_t gather, int64_t activation, float alpha,
                         float limit) {
  GroupedGeometry g;
  if (auto e = decode_grouped_geometry(lhs, rhs, group_sizes, rhs_scale, lhs_rows, lhs_scale, row_scale,
                                       group_scale, *out, gather, activation, &g);
      e.failure())
    return e;
  // The kernel's limits (jax_m3sparse lowers anything else to the reference): bf16 rows, whole
  // 32-k steps, whole 16-column output tiles, 32-bit byte offsets.
  const int64_t cols = activation != 0 ? g.n / 2 : g.n;
  if (g.w8a8) return refuse(kGroupedTarget, "an MXFP8 lhs (W8A8) has no gfx950 kernel");
  if (g.k % kGroupedStepK != 0 || cols % 16 != 0)
    return refuse(kGroupedTarget, "K must be a multiple of 32 and the output columns of 16 on gfx950");
  const int64_t slots = (g.m + kGroupedTileRows - 1) / kGroupedTileRows + g.num_groups + 1;
  // K alone decides the split (a row's summation order never depends on the batch, SPEC §9 item 3);
  // a split workgroup is one k-part per wave (grouped_matmul.py asserts KPARTS == WAVES)
  const int64_t kparts = g.k / kGroupedStepK >= kGroupedSplitSteps ? kGroupedWaves : 1;
  const int64_t per_group = kGroupedWaves / kparts * (activation != 0 ? 32 : 64);
  if (!fits_i32(g.lhs_count * g.k * 2) || !fits_i32(g.n * g.k * 2) || !fits_i32(g.m * cols * 4) ||
      g.num_groups > kI32Max || slots > kMaxGridYZ)
    return refuse(kGroupedTarget, "an operand is too large for the kernel's 32-bit indexing");
  if (g.m == 0 || cols == 0) return ffi::Error::Success();
  const auto v = grouped_variant(g.weights, g.out_bf16);
  if (auto e = prepare_launch(kGroupedTarget, v.kernel, device); e.failure()) return e;
  int32_t st = v.call(lhs.untyped_data(), rhs.untyped_data(), rhs_scale.untyped_data(), group_sizes.typed_data(),
                      lhs_rows.typed_data(), row_scale.typed_data(), group_scale.typed_data(), out->untyped_data(),
                      int32_t(g.m), int32_t(g.lhs_count), int32_t(g.k), int32_t(g.n), int32_t(g.num_groups),
                      int32_t(gather != 0), int32_t(activation), int32_t(g.row_scaled), int32_t(g.group_scaled),
                      alpha, limit, int32_t((cols + per_group - 1) / per_group), int32_t(slots), int32_t(kparts),
                      stream);
  return launch_status(kGroupedTarget, v.kernel, st);
}

// ---------------------------------------------------------------------------------------------
// m3sparse_route_experts_rocm (SPEC §10)
// ---------------------------------------------------------------------------------------------
constexpr const char* kRouteTarget = "m3sparse_route_experts_rocm";
constexpr int64_t kRouteMaxExperts = 4096;   // route_experts.py: the grouping kernel's LDS counters
constexpr int64_t kRouteMaxK = 8;            // its unrolled choice rounds

ffi::Error RouteExperts(hipStream_t stream, int32_t device, ffi::Buffer<ffi::F32> scores,
                        ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::PRED> live,
                        ffi::Result<ffi::Buffer<ffi::F32>> weights, ffi::Result<ffi::Buffer<ffi::S32>> experts,
                        ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                        ffi::Result<ffi::Buffer<ffi::S32>> sorted_tokens,
                        ffi::Result<ffi::Buffer<ffi::F32>> sorted_weights,
                        ffi::Result<ffi::Buffer<ffi::S32>> inverse, int64_t k, int64_t renormalize) {
  auto sd = scores.dimensions();
  if (sd.size() != 2 || bias.dimensions().size() != 1 || bias.dimensions()[0] != sd[1] ||
      live.dimensions().size() != 1 || live.dimensions()[0] != sd[0])
    return refuse(kRouteTarget, "scores [T, E], bias [E], live [T]");
  const int64_t T = sd[0], E = sd[1];
  if (E < 1 || E > kRouteMaxExperts || k < 1 || k > std::min(E, kRouteMaxK))
    return refuse(kRouteTarget, "needs 1 <= E <= 4096 and 1 <= k <= min(E, 8) on gfx950");
  if (!fits_i32(T * E * 4) || !fits_i32(T * k * 4)) return refuse(kRouteTarget, "T·E must fit 32-bit offsets");
  if (T == 0) {  // no token: every group empty
    hipError_t err = hipMemsetAsync(group_sizes->typed_data(), 0, size_t(E) * 4, stream);
    if (err != hipSuccess)
      return ffi::Error(ffi::ErrorCode::kInternal,
                        std::string(kRouteTarget) + ": hipMemsetAsync failed: " + hipGetErrorString(err));
    return ffi::Error::Success();
  }
  const KernelModule kernel = M3SPARSE_KERNEL_MODULE(route_experts);
  if (auto e = prepare_launch(kRouteTarget, kernel, device); e.failure()) return e;
  int32_t st = route_experts_call(scores.typed_data(), bias.typed_data(), live.typed_data(), weights->typed_data(),
                                  experts->typed_data(), group_sizes->typed_data(), sorted_tokens->typed_data(),
                                  sorted_weights->typed_data(), inverse->typed_data(), int32_t(T), int32_t(E),
                                  int32_t(k), int32_t(renormalize != 0), stream);
  return launch_status(kRouteTarget, kernel, st);
}

}  // namespace
}  // namespace m3sparse::rocm

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_pack_kv_pages_rocm, m3sparse::rocm::PackKvPages,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<hipStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()               // kv_cache
                                  .Arg<ffi::AnyBuffer>()               // key
                                  .Arg<ffi::AnyBuffer>()               // value
                                  .Arg<ffi::Buffer<ffi::S32>>()        // slot_mapping
                                  .Arg<ffi::BufferR0<ffi::F32>>()      // k_scale
                                  .Arg<ffi::BufferR0<ffi::F32>>()      // v_scale
                                  .Arg<ffi::BufferR0<ffi::S32>>()      // layer
                                  .Ret<ffi::AnyBuffer>()               // kv_cache (aliased)
                                  .Attr<int64_t>("layout"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_query_token_positions_rocm, m3sparse::rocm::QueryTokenPositions,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<hipStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()        // cu_seqlens_q
                                  .Arg<ffi::Buffer<ffi::S32>>()        // context_lens
                                  .Ret<ffi::Buffer<ffi::S32>>()        // query_req_id
                                  .Ret<ffi::Buffer<ffi::S32>>());      // query_abs_pos

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_sparse_decode_rocm, m3sparse::rocm::SparseDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<hipStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()               // q
                                  .Arg<ffi::AnyBuffer>()               // kv_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()        // topk_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()        // block_table
                                  .Arg<ffi::Buffer<ffi::S32>>()        // seq_lens
                                  .Arg<ffi::BufferR0<ffi::F32>>()      // k_scale
                                  .Arg<ffi::BufferR0<ffi::F32>>()      // v_scale
                                  .Arg<ffi::BufferR0<ffi::S32>>()      // layer
                                  .Ret<ffi::AnyBuffer>()               // out
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("decode_query_len")
                                  .Attr<int64_t>("layout"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_sparse_prefill_rocm, m3sparse::rocm::SparsePrefill,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<hipStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()               // q
                                  .Arg<ffi::AnyBuffer>()               // kv_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()        // topk_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()        // block_table
                                  .Arg<ffi::Buffer<ffi::S32>>()        // query_req_id
                                  .Arg<ffi::Buffer<ffi::S32>>()        // query_abs_pos
                                  .Arg<ffi::BufferR0<ffi::F32>>()      // k_scale
                                  .Arg<ffi::BufferR0<ffi::F32>>()      // v_scale
                                  .Arg<ffi::BufferR0<ffi::S32>>()      // layer
                                  .Ret<ffi::AnyBuffer>()               // out
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("layout"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_full_attention_rocm, m3sparse::rocm::FullAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<hipStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()               // q
                                  .Arg<ffi::AnyBuffer>()               // kv_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()        // block_table
                                  .Arg<ffi::Buffer<ffi::S32>>()        // query_req_id
                                  .Arg<ffi::Buffer<ffi::S32>>()        // query_abs_pos
                                  .Arg<ffi::BufferR0<ffi::F32>>()      // k_scale
                                  .Arg<ffi::BufferR0<ffi::F32>>()      // v_scale
                                  .Arg<ffi::BufferR0<ffi::S32>>()      // layer
                                  .Ret<ffi::AnyBuffer>()               // out
                                  .Ret<ffi::AnyBuffer>()               // workspace (CUDA's; untouched)
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("layout")
                                  .Attr<int64_t>("part_blocks"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_select_blocks_rocm, m3sparse::rocm::SelectBlocks,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<hipStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()               // idx_q
                                  .Arg<ffi::AnyBuffer>()               // idx_k_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()        // block_table
                                  .Arg<ffi::Buffer<ffi::S32>>()        // query_req_id
                                  .Arg<ffi::Buffer<ffi::S32>>()        // query_abs_pos
                                  .Arg<ffi::BufferR0<ffi::S32>>()      // layer
                                  .Ret<ffi::Buffer<ffi::S32>>()        // topk_indices
                                  .Attr<int64_t>("topk_blocks")
                                  .Attr<int64_t>("local_blocks"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_grouped_matmul_rocm, m3sparse::rocm::GroupedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<hipStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()               // lhs
                                  .Arg<ffi::AnyBuffer>()               // rhs
                                  .Arg<ffi::Buffer<ffi::S32>>()        // group_sizes
                                  .Arg<ffi::AnyBuffer>()               // rhs_scale
                                  .Arg<ffi::Buffer<ffi::S32>>()        // lhs_rows
                                  .Arg<ffi::Buffer<ffi::U8>>()         // lhs_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()        // row_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()        // group_scale
                                  .Ret<ffi::AnyBuffer>()               // out
                                  .Attr<int64_t>("gather")
                                  .Attr<int64_t>("activation")
                                  .Attr<float>("alpha")
                                  .Attr<float>("limit"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_route_experts_rocm, m3sparse::rocm::RouteExperts,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<hipStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::F32>>()        // scores
                                  .Arg<ffi::Buffer<ffi::F32>>()        // bias
                                  .Arg<ffi::Buffer<ffi::PRED>>()       // live
                                  .Ret<ffi::Buffer<ffi::F32>>()        // weights
                                  .Ret<ffi::Buffer<ffi::S32>>()        // experts
                                  .Ret<ffi::Buffer<ffi::S32>>()        // group_sizes
                                  .Ret<ffi::Buffer<ffi::S32>>()        // sorted_tokens
                                  .Ret<ffi::Buffer<ffi::F32>>()        // sorted_weights
                                  .Ret<ffi::Buffer<ffi::S32>>()        // inverse
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("renormalize"));
