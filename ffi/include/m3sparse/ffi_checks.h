// Host-side helpers shared by the FFI handlers of every backend: decoding the
// cache geometry from buffer dimensions and turning mismatches into ffi::Error.
#pragma once

#include <string>

#include "m3sparse/cache.h"
#include "xla/ffi/api/ffi.h"

namespace m3sparse {

namespace ffi = xla::ffi;

inline ffi::Error invalid(const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "m3sparse: " + what);
}

// Reads P, L, 2·Hkv, N and the row width from a 4-D or 5-D uint8 cache (SPEC §3).
inline ffi::Error decode_cache_geometry(const ffi::AnyBuffer& cache, int64_t layout,
                                        int64_t head_dim, CacheGeometry* geo) {
  auto dims = cache.dimensions();
  if (cache.element_type() != ffi::DataType::U8) return invalid("kv_cache must be uint8");
  if (dims.size() != 4 && dims.size() != 5) return invalid("kv_cache must be 4-D or 5-D");
  if (layout != kLBHNC && layout != kBLHNC) return invalid("layout must be 0 (LBHNC) or 1 (BLHNC)");
  size_t r = dims.size();
  geo->layout = layout;
  geo->head_dim = head_dim;
  geo->num_slots = dims[r - 3];
  geo->block_size = dims[r - 2];
  if (r == 4) {
    geo->num_layers = 1;
    geo->num_pages = dims[0];
  } else if (layout == kLBHNC) {
    geo->num_layers = dims[0];
    geo->num_pages = dims[1];
  } else {
    geo->num_pages = dims[0];
    geo->num_layers = dims[1];
  }
  if (head_dim % 32 != 0) return invalid("head_dim must be a multiple of 32");
  if (dims[r - 1] != geo->full_dim())
    return invalid("kv_cache row width must be D/2 + D/16 = " + std::to_string(geo->full_dim()));
  return ffi::Error::Success();
}

// The shapes of a select_blocks call (SPEC §8; docs/ffi_targets.md), read from its buffers.
struct SelectGeometry {
  int64_t num_tokens, num_kv_heads, index_dim;          // idx_q [T, Hkv, Di]
  int64_t num_layers, num_pages, block_size;            // idx_k_cache [(L,) P, N, Di]
  int64_t num_requests, max_blocks;                     // block_table [R, M]
  bool q_f32, key_fp8;                                  // else bf16 q, bf16 keys
};

// Checks a select_blocks call's operands against each other and decodes their geometry: the
// one contract every backend's handler serves (backends add their own kernel limits after).
inline ffi::Error decode_select_geometry(const ffi::AnyBuffer& idx_q,
                                         const ffi::AnyBuffer& idx_k_cache,
                                         const ffi::Buffer<ffi::S32>& block_table,
                                         const ffi::Buffer<ffi::S32>& query_req_id,
                                         const ffi::Buffer<ffi::S32>& query_abs_pos,
                                         ffi::Span<const int64_t> topk_dims, int64_t topk_blocks,
                                         int64_t local_blocks, SelectGeometry* geo) {
  auto qd = idx_q.dimensions();
  if (qd.size() != 3) return invalid("idx_q must be [T, Hkv, Di]");
  if (idx_q.element_type() != ffi::DataType::F32 && idx_q.element_type() != ffi::DataType::BF16)
    return invalid("idx_q must be float32 or bfloat16");
  auto kd = idx_k_cache.dimensions();
  if (kd.size() != 3 && kd.size() != 4)
    return invalid("idx_k_cache must be [P, N, Di] or [L, P, N, Di]");
  if (idx_k_cache.element_type() != ffi::DataType::BF16 &&
      idx_k_cache.element_type() != ffi::DataType::F8E4M3FN)
    return invalid("idx_k_cache must be bfloat16 or float8_e4m3fn");
  const size_t r = kd.size();
  if (kd[r - 1] != qd[2]) return invalid("idx_k_cache's last dim must equal idx_q's Di");
  auto bd = block_table.dimensions();
  if (bd.size() != 2) return invalid("block_table must be [R, M]");
  if (int64_t(query_req_id.element_count()) != qd[0] ||
      int64_t(query_abs_pos.element_count()) != qd[0])
    return invalid("query_req_id and query_abs_pos must be [T]");
  if (topk_blocks < 1 || local_blocks < 1)
    return invalid("topk_blocks and local_blocks must be >= 1");
  if (topk_dims.size() != 3 || topk_dims[0] != qd[1] || topk_dims[1] != qd[0] ||
      topk_dims[2] != topk_blocks)
    return invalid("topk_indices must be [Hkv, T, topk_blocks]");
  *geo = SelectGeometry{qd[0], qd[1], qd[2], r == 4 ? kd[0] : 1, kd[r - 3], kd[r - 2], bd[0],
                        bd[1], idx_q.element_type() == ffi::DataType::F32,
                        idx_k_cache.element_type() == ffi::DataType::F8E4M3FN};
  return ffi::Error::Success();
}

// The shapes and formats of a grouped_matmul call (SPEC §9; docs/ffi_targets.md).
struct GroupedGeometry {
  int64_t m, n, k, num_groups;   // product rows M, rhs [G, N, K] (K in elements)
  int64_t lhs_count;             // rows of lhs (T with gather, else M)
  int weights;                   // 0 bf16, 1 MXFP8, 2 MXFP4, 3 NVFP4 (kGroupedBf16 ...)
  bool w8a8, out_bf16, row_scaled, group_scaled;
};
enum GroupedWeights : int { kGroupedBf16 = 0, kGroupedMxfp8 = 1, kGroupedMxfp4 = 2, kGroupedNvfp4 = 3 };

// Checks a grouped_matmul call's operands against each other and decodes them: the one
// contract every backend's handler serves (backends add their own kernel limits after).
inline ffi::Error decode_grouped_geometry(const ffi::AnyBuffer& lhs, const ffi::AnyBuffer& rhs,
                                          const ffi::Buffer<ffi::S32>& group_sizes,
                                          const ffi::AnyBuffer& rhs_scale,
                                          const ffi::Buffer<ffi::S32>& lhs_rows,
                                          const ffi::Buffer<ffi::U8>& lhs_scale,
                                          const ffi::Buffer<ffi::F32>& row_scale,
                                          const ffi::Buffer<ffi::F32>& group_scale,
                                          const ffi::AnyBuffer& out, int64_t gather,
                                          int64_t activation, GroupedGeometry* geo) {
  auto ld = lhs.dimensions(), rd = rhs.dimensions(), gd = group_sizes.dimensions();
  auto id = lhs_rows.dimensions();
  if (id.size() != 1 || (!gather && id[0] != 0))
    return invalid("grouped_matmul: lhs_rows must be [M] (gather) or [0]");
  auto sd = rhs_scale.dimensions();
  const bool mxfp8 = rhs.element_type() == ffi::F8E4M3FN, fp4 = rhs.element_type() == ffi::U8;
  if (!mxfp8 && !fp4 && rhs.element_type() != ffi::BF16)
    return invalid("grouped_matmul: rhs must be bf16, float8_e4m3fn (MXFP8) or uint8 (FP4)");
  if (ld.size() != 2 || rd.size() != 3 || gd.size() != 1 || gd[0] != rd[0] ||
      (fp4 ? 2 * rd[2] : rd[2]) != ld[1])
    return invalid("grouped_matmul: lhs [M, K], rhs [G, N, K] (FP4: [G, N, K / 2]), "
                   "group_sizes [G]");
  const int64_t m = gather ? id[0] : ld[0];
  // FP4 scales: E8M0 bytes per 32 k (MXFP4) or E4M3 per 16 (NVFP4), told apart by their dtype
  const bool nv = fp4 && rhs_scale.element_type() == ffi::F8E4M3FN;
  if (rhs_scale.element_type() != ffi::U8 && !nv)
    return invalid("grouped_matmul: rhs_scale must be uint8 (E8M0), or float8_e4m3fn with FP4 rhs");
  if (sd.size() != 3 || sd[0] != rd[0] || sd[1] != rd[1] ||
      sd[2] != (nv ? ld[1] / 16 : mxfp8 || fp4 ? ld[1] / 32 : 0))
    return invalid("grouped_matmul: rhs_scale must be [G, N, K / 32] for MXFP8 or MXFP4 rhs, "
                   "[G, N, K / 16] for NVFP4, [G, N, 0] for bf16");
  if (activation < 0 || activation > 2 || (activation != 0 && rd[1] % 2 != 0))
    return invalid("grouped_matmul: activation must be 0, 1 (swiglu) or 2 (swiglu_oai), "
                   "with an even N");
  auto rsd = row_scale.dimensions(), gsd = group_scale.dimensions();
  if (rsd.size() != 1 || (rsd[0] != 0 && rsd[0] != m) || gsd.size() != 1 ||
      (gsd[0] != 0 && gsd[0] != rd[0]))
    return invalid("grouped_matmul: row_scale must be [M] or [0], group_scale [G] or [0]");
  auto od = out.dimensions();
  if (od.size() != 2 || od[0] != m || od[1] != (activation != 0 ? rd[1] / 2 : rd[1]))
    return invalid("grouped_matmul: out must be [M, N] ([M, N / 2] with an activation)");
  const bool out_bf16 = out.element_type() == ffi::BF16;
  if (!out_bf16 && out.element_type() != ffi::F32)
    return invalid("grouped_matmul: out must be float32 or bfloat16");
  const bool w8a8 = lhs.element_type() == ffi::F8E4M3FN;
  if (!w8a8 && lhs.element_type() != ffi::BF16)
    return invalid("grouped_matmul: lhs must be bf16 or float8_e4m3fn (MXFP8)");
  if (w8a8 && !mxfp8) return invalid("grouped_matmul: an MXFP8 lhs needs MXFP8 rhs");
  auto ad = lhs_scale.dimensions();
  if (ad.size() != 2 || ad[0] != ld[0] || ad[1] != (w8a8 ? ld[1] / 32 : 0))
    return invalid("grouped_matmul: lhs_scale must be [rows of lhs, K / 32] for an MXFP8 lhs, "
                   "[rows of lhs, 0] for bf16");
  *geo = GroupedGeometry{m, rd[1], ld[1], rd[0], ld[0],
                         mxfp8 ? kGroupedMxfp8 : !fp4 ? kGroupedBf16 : nv ? kGroupedNvfp4 : kGroupedMxfp4,
                         w8a8, out_bf16, rsd[0] != 0, gsd[0] != 0};
  return ffi::Error::Success();
}

}  // namespace m3sparse
