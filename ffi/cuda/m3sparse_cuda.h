// CUDA (sm_90) backend of jax_m3sparse: host-side launch API shared by the XLA FFI handlers
// (handlers.cc) and the standalone device harness (tests/cuda/harness.cu).
//
// Every pointer is a device pointer; scalars that are data (k_scale, v_scale, layer) stay on the
// device and are read by the kernels, so a captured command buffer never goes stale.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "m3sparse/cache.h"

namespace m3sparse {
namespace cuda {

// Geometry the attention kernels are built for (SPEC §1); pack handles any D % 16 == 0, N.
constexpr int kHeadDim = 128;      // D
constexpr int kBlockSize = 128;    // N
constexpr int kGroup = 16;         // the 16 rows of an mma tile: G = Hq / Hkv may be 1..16
constexpr int kMaxTopk = 64;       // K (topk_blocks) upper bound of the attention kernels
// The rounds of a row's entries in the attention kernels' reduction tree = the CTAs of a row's
// cluster in the split launch shape (8 lost to 4 at every T: BENCHMARKS.md 2026-12-02, round 4).
constexpr int kRounds = 4;
// full_attention (SPEC §5.7): a row's blocks in parts of AttentionParams::full_part (1..kMaxTopk)
// consecutive blocks; a part is computed like a sparse row whose top-k list is those blocks, and
// the row's state is the left fold of its parts' states (one CTA per row, or one CTA per part
// plus a merge: the same bits).
// floats of one softmax state (m, l, O of 16 rows x 128 d): a full_attention workspace entry
constexpr int kStateFloats = kGroup * kHeadDim + 2 * kGroup;

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct AttentionParams {
  const void* q;                  // [T, Hkv*G, D] bf16/f16
  void* out;                      // [T, Hkv*G, D] q's dtype
  const uint8_t* kv_cache;        // base of the (possibly multi-layer) cache
  const int32_t* topk_indices;    // [Hkv, T, K]
  const int32_t* block_table;     // [R, M]
  const int32_t* seq_lens;        // decode: [R]
  const int32_t* query_req_id;    // prefill: [T]
  const int32_t* query_abs_pos;   // prefill: [T]
  const float* k_scale;           // [] device scalar
  const float* v_scale;           // [] device scalar
  const int32_t* layer;           // [] device scalar
  CacheGeometry geom;
  int64_t num_tokens;             // T
  int32_t num_kv_heads;           // Hkv
  int32_t topk;                   // K
  int32_t num_requests;           // R
  int32_t max_blocks;             // M (block_table width)
  int32_t decode_query_len;       // dql (decode only)
  int32_t is_prefill;             // 0: positions from seq_lens (SPEC §5.3); 1: §5.4
  float scale;                    // softmax scale
  DType dtype;                    // of q / out
  int32_t group;                  // G = Hq / Hkv, 1..16 (0 means 16); rows >= G are padding
  int32_t split;                  // launch shape: 0 chosen from the grid (attention_split), 1 one
                                  // CTA per row, 2 or kRounds a cluster of that many CTAs per row
                                  // (the same bits)
  int32_t full;                   // 1: full_attention, every block up to the position (topk
                                  // unused; positions as prefill, SPEC §5.7)
  int32_t full_part;              // full: blocks per part, 1..kMaxTopk (the same for every call
                                  // whose bits must agree)
  int32_t full_parts;             // full: parts per row in `workspace` (one CTA per part, then
                                  // a merge); 0: one CTA per row folds all its parts
  float* workspace;               // full, full_parts > 0: [Hkv, T, full_parts, kStateFloats]
};

struct PackParams {
  uint8_t* kv_cache;
  const void* key;                // [T, Hkv, D]
  const void* value;              // [T, Hkv, D]
  const int32_t* slot_mapping;    // [T]
  const float* k_scale;
  const float* v_scale;
  const int32_t* layer;
  CacheGeometry geom;
  int64_t num_tokens;
  int32_t num_kv_heads;
  DType dtype;
};

// select_blocks (SPEC §8; ffi/cuda/select.cu).
struct SelectParams {
  const void* idx_q;              // [T, Hkv, Di] f32 or bf16 (q_dtype)
  const void* idx_k;              // [L, P, N, Di] bf16 or float8_e4m3fn (key_fp8); L = 1 for 3-D
  const int32_t* block_table;     // [R, M]
  const int32_t* query_req_id;    // [T]
  const int32_t* query_abs_pos;   // [T]
  const int32_t* layer;           // [] device scalar
  int32_t* topk_indices;          // [Hkv, T, K]
  int64_t num_tokens;             // T
  int32_t num_kv_heads;           // Hkv
  int32_t head_dim;               // Di
  int64_t num_pages;              // P
  int64_t num_layers;             // L
  int64_t block_size;             // N
  int32_t num_requests;           // R
  int32_t max_blocks;             // M
  int64_t topk;                   // K (topk_blocks)
  int64_t local_blocks;           // local_blocks >= 1
  DType q_dtype;                  // kF32 or kBF16
  int32_t key_fp8;                // 1: float8_e4m3fn keys, 0: bf16
};

// One sentence naming the unmet requirements of the select_blocks kernel, or "".
const char* select_unsupported(int64_t head_dim, int64_t block_size, int64_t max_blocks);

// Launches select_blocks (asynchronously on `stream`); returns the launch's error code.
cudaError_t launch_select_blocks(const SelectParams& p, cudaStream_t stream);

// grouped_matmul (SPEC §9; ffi/cuda/grouped_matmul.cu): out[M, N] fp32 = lhs[M, K] · rhs[g]ᵀ per
// group of consecutive rows. lhs bf16, or MXFP8 with MXFP8 rhs (SPEC §9.2); rhs bf16, MXFP8
// (fp8 e4m3 + E8M0 per 32 k), or packed FP4 (MXFP4, NVFP4: SPEC §9.3).
struct GroupedMatmulParams {
  const void* lhs;                // [M, K] bf16, or fp8 e4m3 when lhs_scale is set
  const void* rhs;                // [G, N, K] bf16, or fp8 e4m3 when rhs_scale is set
  const uint8_t* rhs_scale;       // [G, N, K / 32] E8M0 (MXFP8, MXFP4), [G, N, K / 16] E4M3
                                  // (NVFP4), or nullptr (bf16 rhs)
  int32_t fp4;                    // rhs packed FP4 [G, N, K / 2] (SPEC §9.3): 1 = MXFP4,
                                  // 2 = NVFP4; 0: bf16 or MXFP8 rhs
  const uint8_t* lhs_scale;       // [M (or lhs_count), K / 32] E8M0 (MXFP8 lhs, needs MXFP8
                                  // rhs), or nullptr (bf16 lhs)
  const int32_t* group_sizes;     // [G] (negative counts as 0; rows past M are dropped)
  void* out;                      // [M, N] fp32, or bf16 when out_bf16 (each fp32 result
  bool out_bf16;                  // rounded to nearest even as it is stored: SPEC §9 item 5)
  const int32_t* lhs_rows;        // [M]: the lhs row each row reads (< 0 or >= lhs_count: a
                                  // zero row), or nullptr: row i reads lhs row i (SPEC §9 item 4)
  int64_t lhs_count;              // rows of lhs with lhs_rows (T), else unused
  // The epilogue (SPEC §9 item 6): each product times group_scale[g] (or nullptr), then with
  // act 1 (swiglu) / 2 (swiglu_oai: alpha, limit) gate column j and up column n/2 + j joined
  // into out column j (out [M, n/2]), then times row_scale[i] (or nullptr).
  const float* group_scale;       // [G] or nullptr
  const float* row_scale;         // [M] or nullptr
  int32_t act;                    // 0: none (out [M, N])
  float alpha, limit;
  int64_t m, n, k;
  int32_t num_groups;             // G
  int32_t block_m;                // rows per tile: 16 or 64 (0: chosen from M / G and K)
  int32_t block_n;                // columns per tile with 16-row tiles: 32, 64 or 128 (0: chosen);
                                  // with block_m 64 (tests): 1 = a CTA row per 64-row tile,
                                  // 2 = per group, 3 / 4 = per 128 / 256 rows of a group,
                                  // 0 = chosen (grouped_matmul.cu)
};                                // every tile shape gives the same bits

struct GroupedMatmulTile {
  int block_m, block_n;
};

// "" or one sentence naming the unmet requirement (K % 8 == 0; MXFP8 or FP4: K % 128 == 0).
const char* grouped_matmul_unsupported(int64_t k, bool quantized);
// The same for MXFP8 lhs and rhs (SPEC §9.2): "" when K % 128 == 0.
const char* grouped_matmul_w8a8_unsupported(int64_t k);
// The tile a launch of p takes.
GroupedMatmulTile grouped_matmul_tile(const GroupedMatmulParams& p);
cudaError_t launch_grouped_matmul(const GroupedMatmulParams& p, cudaStream_t stream);

// dense_matmul (SPEC §11; ffi/cuda/dense_matmul.cu): out[M, N] = lhs[M, K] · rhs[N, K]ᵀ, bf16
// operands, fp32 sums in a fixed order (a row's bits never depend on M); a weight-streaming
// kernel for decode-sized M.
struct DenseMatmulParams {
  const __nv_bfloat16* lhs;       // [M, K]
  const __nv_bfloat16* rhs;       // [N, K] (PyTorch's Linear weight)
  void* out;                      // [M, N] fp32, or bf16 when out_bf16 (rounded once)
  bool out_bf16;
  int64_t m, n, k;
};
// "" or one sentence naming the unmet requirement (K % 64 == 0).
const char* dense_matmul_unsupported(int64_t k);
cudaError_t launch_dense_matmul(const DenseMatmulParams& p, cudaStream_t stream);

// route_experts (SPEC §10; ffi/cuda/route.cu): each token's top-k experts and weights, and the
// (token, expert) pairs grouped by expert (stable; pairs of tokens not live last, in no group).
constexpr int kRouteMaxExperts = 512;   // E: the grouping CTA's per-warp counters
constexpr int kRouteMaxK = 8;           // k: the choice's per-lane lists
struct RouteParams {
  const float* scores;            // [T, E]
  const float* bias;              // [E], added for the choice only
  const bool* live;               // [T]
  float* weights;                 // [T, k]
  int32_t* experts;               // [T, k]
  int32_t* group_sizes;           // [E]
  int32_t* sorted_tokens;         // [T·k]
  float* sorted_weights;          // [T·k]
  int32_t* inverse;               // [T, k]
  int64_t num_tokens;             // T
  int32_t num_experts;            // E
  int32_t k;
  bool renormalize;
};
// "" or one sentence naming the unmet requirement (1 <= E <= 512, 1 <= k <= min(E, 8)).
const char* route_unsupported(int64_t num_experts, int64_t k);
cudaError_t launch_route_experts(const RouteParams& p, cudaStream_t stream);

// One sentence naming every unmet requirement of the attention kernels, or "" when supported.
// Mirrors jax_m3sparse.spec.unsupported_reason(..., platform="cuda").
const char* attention_unsupported(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t topk_blocks, int64_t block_size);

// Parts (of part_blocks blocks) of a block_table row of max_blocks entries.
inline int64_t full_parts_of(int64_t max_blocks, int64_t part_blocks) {
  return (max_blocks + part_blocks - 1) / part_blocks;
}

// The launch shape the attention kernels take for p on a device of num_sms SMs: 1 (one CTA per
// row), 2 or 4 (a cluster of that many CTAs per row, each computing 4 / C rounds). Every shape
// computes a row's bits the same way.
int attention_split(const AttentionParams& p, int num_sms);

// Launches (asynchronously on `stream`); returns the launch's error code.
cudaError_t launch_sparse_attention(const AttentionParams& p, cudaStream_t stream);
cudaError_t launch_pack_kv_pages(const PackParams& p, cudaStream_t stream);

#ifdef __CUDACC__
// Test hook (pack.cu): quantizes n groups of 16 floats with the kernel's fast path (mode 1) or
// nvfp4.h's reference path (mode 0); <<<ceil(n/256), 256>>>.
__global__ void quantize_groups_kernel(const float* x, float r, uint8_t* data, uint8_t* scale,
                                       int64_t n, int mode);
#endif

}  // namespace cuda
}  // namespace m3sparse
