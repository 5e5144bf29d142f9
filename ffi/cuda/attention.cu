// Sparse NVFP4 attention for sm_90a: sparse_decode (SPEC §5.3) and sparse_prefill (§5.4).
//
// One CTA row (token, KV head) is a warpgroup of 4 consumer warps plus one producer warp:
//   1. Threads 0..K-1 check their top-k slot (SPEC §5.2: 0 <= b < max_blocks, 128·b < vis,
//      0 <= block_table[r, b] < P, layer in [0, L)) before anything is loaded; the valid slots
//      are compacted in shared memory, in top-k order. Meanwhile Qᵀ (d permuted, see below) is
//      written once into shared memory as wgmma's B operand.
//   2. The producer (one lane) streams each valid (page, head) tile pair — K and V are adjacent
//      in the cache, 18432 bytes — with one bulk copy into a ring of stages, completing on the
//      stage's `full` mbarrier; consumers free a stage through its `empty` mbarrier.
//   3. The consumers compute Sᵀ = K·Qᵀ with wgmma m64n16k16: the block's 128 tokens on M (two
//      m-tiles), the G <= 16 heads on N (heads >= G are zero columns), K dequantized once per
//      element straight into the A registers (device_utils.cuh: exact). Each thread holds 4
//      tokens x 4 heads of scores; the base-2 online softmax is lazy: the running max of a head
//      moves only when the block's max exceeds it by more than kLazy, decided for the whole
//      warpgroup by one bar.red.or, so the cross-warp max exchange runs only then.
//   4. P (bf16/f16) goes to shared memory as the B operand of Oᵀ += Vᵀ·Pᵀ (wgmma, d on M, heads on
//      N, tokens on K); Vᵀ's A registers come from the raw nibbles by ldmatrix.trans (a register
//      then holds two tokens' codes of the same 4 d) and the same exact dequantization, with the
//      V block scales of masked keys (>= vis) selected to 0 so garbage never meets P.
//   5. Reduction tree (batch- and TP-invariant): a row's `count` valid entries form 4 rounds of
//      cpr = ceil(count / 4) consecutive entries; round j is one online softmax from a fresh
//      state, and the 4 round states fold left to right (fold_stats / fold_o, every rounding
//      explicit) into R. Thread x of the warpgroup always holds the same elements, so the fold is
//      per thread; the softmax sums l stay per-thread partials (the fold is linear in l) and are
//      summed across the warpgroup in a fixed order at the end: out = O / l · v_scale.
// Two launch shapes compute that same tree (attention_split() picks one from the grid; neither
// changes a bit): one CTA per row (3-stage ring, 3 CTAs per SM) folding its rounds as it goes,
// or a cluster of 4 CTAs per row (small batches) where CTA j computes round j and rank 0 folds
// the 4 round states through distributed shared memory.
// No global workspace: CUDA-graph safe.
#include <cooperative_groups.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "device_utils.cuh"
#include "m3sparse_cuda.h"

namespace cg = cooperative_groups;

namespace m3sparse {
namespace cuda {
namespace {

constexpr int kConsumers = 128;               // one warpgroup
constexpr int kThreads = kConsumers + 32;     // + the producer warp
constexpr int kTileBytes = kBlockSize * (kHeadDim / 2 + kHeadDim / 16);  // 9216
constexpr int kScalePlane = kBlockSize * kHeadDim / 2;                     // 8192
constexpr int kStageBytes = 2 * kTileBytes;                                // K tile, V tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLazy = 8.0f;
constexpr int kRounds = 4;   // rounds of a row's entries = CTAs of the split launch
constexpr int kSplit = kRounds;
#ifndef M3_ROW_CTAS
#define M3_ROW_CTAS 3
#endif
constexpr int kMinBlocks = M3_ROW_CTAS;  // one CTA per row: CTAs per SM
constexpr int kStagesRow = kMinBlocks == 2 ? 4 : kMinBlocks == 3 ? 3 : 2;
constexpr int kMtRow = kMinBlocks == 2 ? 2 : 1;
constexpr int kStagesSplit = 4;   // a round's 4 blocks in flight at once
// shared operands of the wgmmas (no swizzle; core matrix = 8 rows x 16 bytes)
constexpr int kQtStep = 512;      // Qᵀ per k-step: 2 K-groups (lbo 256) x 2 N-groups (sbo 128)
constexpr int kPtLbo = 272;       // Pᵀ: K-group stride padded by 16 bytes (no bank conflicts)
constexpr int kPtStep = 544;
constexpr int kQtBytes = 8 * kQtStep;
constexpr int kPtBytes = 8 * kPtStep;
constexpr int kVmBytes = 8 * kBlockSize * 2;  // V multipliers [group][token], 16-bit
constexpr int kRedBytes = 4 * kGroup * 4;     // float [warp][head]
constexpr int kStateFloats = 24;              // per thread: O 16, m 4, l 4
template <int S>
constexpr int smem_bytes() {
  return S * kStageBytes + kQtBytes + kPtBytes + kVmBytes + kRedBytes + 2 * S * 8;
}
static_assert(kHeadDim == 128 && kBlockSize == 128 && kGroup == 16, "kernel geometry");
static_assert(kStagesSplit * kStageBytes >= kStateFloats * 4 * kConsumers, "leaves fit the ring");

// ---- steps of the kernel

struct TokenPos {
  int64_t r;      // request
  int64_t vis;    // the attended keys are [0, vis) (0: none)
  int64_t layer;
};

// Position of token t (SPEC §5.3 / §5.4).
__device__ __forceinline__ TokenPos token_position(const AttentionParams& p, int64_t t) {
  TokenPos tp;
  int64_t pos;
  bool live;
  if (!p.is_prefill) {
    const int dql = p.decode_query_len;
    tp.r = t / dql;
    live = tp.r < p.num_requests;
    pos = live ? int64_t(p.seq_lens[tp.r]) - dql + (t % dql) : -1;
  } else {
    tp.r = p.query_req_id[t];
    live = tp.r >= 0 && tp.r < p.num_requests;
    pos = live ? int64_t(p.query_abs_pos[t]) : -1;
  }
  tp.layer = *p.layer;
  live = live && p.geom.valid_layer(tp.layer);
  tp.vis = (live && pos >= 0) ? pos + 1 : 0;
  return tp;
}

// Validity of every top-k slot before any load (SPEC §5.2: 0 <= b < max_blocks, 128·b < vis,
// 0 <= block_table[r, b] < P, layer valid), checked by threads 0..K-1 (warps 0, 1; K <= 64).
// The valid slots are compacted into s_off / s_nvalid (slot k's entry is the number of valid
// slots before it, from warp ballots). Every thread calls it (two barriers); returns the count.
__device__ __forceinline__ int compact_slots(const AttentionParams& p, const TokenPos& tp, int g,
                                             int64_t bsel, int64_t* s_off, int* s_nvalid,
                                             uint32_t* s_mask) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  bool ok = false;
  int nv = 0;
  int64_t off = 0;
  if (tid < p.topk && tp.vis > 0) {
    const int64_t b = bsel;
    if (b >= 0 && b < p.max_blocks && b * kBlockSize < tp.vis) {
      const int64_t page = p.block_table[tp.r * p.max_blocks + b];
      if (p.geom.valid_page(page)) {
        const int64_t rest = tp.vis - b * kBlockSize;
        nv = int(rest < kBlockSize ? rest : kBlockSize);
        off = p.geom.tile_offset(tp.layer, page, 2 * g);
        ok = true;
      }
    }
  }
  const uint32_t ballot = __ballot_sync(0xffffffffu, ok);
  if (warp < 2 && lane == 0) s_mask[warp] = ballot;
  __syncthreads();
  const uint32_t mask0 = s_mask[0];
  if (ok) {
    const int idx = (warp == 0 ? 0 : __popc(mask0)) + __popc(ballot & ((1u << lane) - 1u));
    s_off[idx] = off;
    s_nvalid[idx] = nv;
  }
  const int count = __popc(mask0) + __popc(s_mask[1]);
  __syncthreads();
  return count;
}

// One step of the left fold R <- R ⊕ L of two softmax states, with every rounding explicit (no
// contraction choice left to the compiler), so both launch shapes give the same bits: the row's
// new max, both factors, the new sum; fold_o for each O element.
__device__ __forceinline__ void fold_stats(float mR, float lR, float mL, float lL, float& m,
                                           float& l, float& fR, float& fL) {
  m = fmaxf(mR, mL);
  const float mu = m == -INFINITY ? 0.f : m;  // two empty states stay empty (factors 0)
  fR = fast_exp2(__fsub_rn(mR, mu));
  fL = fast_exp2(__fsub_rn(mL, mu));
  l = __fmaf_rn(lL, fL, __fmul_rn(lR, fR));
}
__device__ __forceinline__ float fold_o(float oR, float oL, float fR, float fL) {
  return __fmaf_rn(oL, fL, __fmul_rn(oR, fR));
}

// out = O / l · vsc (vsc: v_scale times the dequantization power of two); 0 where l == 0.
template <typename T>
__device__ __forceinline__ uint16_t final_value(float O, float L, float vsc) {
  return Traits<T>::from_float(L == 0.f ? 0.f : __fmul_rn(__fdiv_rn(O, L), vsc));
}

// Byte offset in Qᵀ (wgmma B, K-major) of element (d, head n). The K A-registers of lane
// (g8, c) hold the codes of bytes [16c, 16c + 16) of a token's row (d 32c .. 32c + 31): k-step s
// takes word W = s / 2, dequant8 pair 2(s & 1) as columns 2c, 2c + 1 and pair 2(s & 1) + 1 as
// columns 2c + 8, 2c + 9; pair k of a word holds elements k (lo) and k + 4 (hi). So column kk of
// k-step s is d = 32c + 8W + 2(s & 1) + kk / 8 + 4 (kk & 1) with c = (kk & 7) / 2.
__device__ __forceinline__ int qt_offset(int d, int n) {
  const int c = d >> 5, W = (d >> 3) & 3, r = d & 7, e = r >> 2, rem = r & 3;
  const int s = 2 * W + (rem >> 1), kk = 8 * (rem & 1) + 2 * c + e;
  return s * kQtStep + (kk >> 3) * 256 + (n >> 3) * 128 + (n & 7) * 16 + (kk & 7) * 2;
}

// The consumer warpgroup's state of one row: thread (w, g8, c) holds Oᵀ[d][n] for d = 32w + 4g8 + k
// (k = 0..3) and heads n = 8j + 2c + e (q = 2j + e = 0..3) at o[8 (k / 2) + 4j + 2 (k & 1) + e],
// the wgmma accumulator layout of two m-tiles (d 0..63 is not m-tile 0: the d order follows the
// ldmatrix.trans registers), the running max m[q] (the same in every thread) and the thread's
// partial softmax sum l[q].
struct RowState {
  float o[16];
  float m[4];
  float l[4];
  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int k = 0; k < 16; ++k) o[k] = 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) m[q] = -INFINITY, l[q] = 0.f;
  }
  // this <- this ⊕ L (the left fold of the reduction tree)
  __device__ __forceinline__ void fold(const float* Lo, const float* Lm, const float* Ll) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      float nm, nl, fR, fL;
      fold_stats(m[q], l[q], Lm[q], Ll[q], nm, nl, fR, fL);
      m[q] = nm;
      l[q] = nl;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int i = 8 * (k >> 1) + 4 * (q >> 1) + 2 * (k & 1) + (q & 1);
        o[i] = fold_o(o[i], Lo[i], fR, fL);
      }
    }
  }
};

// out = O / l · vsc for the warpgroup's row (consumer threads only; s_red: scratch, named barrier
// 1): l summed over the 32 threads of a head in a fixed order.
template <typename T>
__device__ __forceinline__ void store_row(const RowState& R, float vsc, int G, uint16_t* out,
                                          float* s_red) {
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g8 = lane >> 2, c = lane & 3;
  bar_sync(1, kConsumers);  // s_red is free
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float x = R.l[q];
    x += __shfl_xor_sync(0xffffffffu, x, 4);
    x += __shfl_xor_sync(0xffffffffu, x, 8);
    x += __shfl_xor_sync(0xffffffffu, x, 16);
    if (g8 == 0) s_red[w * kGroup + 8 * (q >> 1) + 2 * c + (q & 1)] = x;
  }
  bar_sync(1, kConsumers);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int n = 8 * (q >> 1) + 2 * c + (q & 1);
    if (n >= G) continue;
    const float L = __fadd_rn(__fadd_rn(__fadd_rn(s_red[n], s_red[kGroup + n]),
                                        s_red[2 * kGroup + n]), s_red[3 * kGroup + n]);
    uint16_t v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      v[k] = final_value<T>(R.o[8 * (k >> 1) + 4 * (q >> 1) + 2 * (k & 1) + (q & 1)], L, vsc);
    *reinterpret_cast<uint2*>(out + n * kHeadDim + 32 * w + 4 * g8) =
        make_uint2(v[0] | (uint32_t(v[1]) << 16), v[2] | (uint32_t(v[3]) << 16));
  }
}

// T: q/out dtype (the wgmma and P dtype). kSplitted: the cluster launch (4 CTAs per row, CTA j
// computes round j); else one CTA per row.
template <typename T, bool kSplitted>
__global__ void __launch_bounds__(kThreads, kSplitted ? 1 : kMinBlocks)
    sparse_attention_kernel(const __grid_constant__ AttentionParams p) {
  constexpr int kStages = kSplitted ? kStagesSplit : kStagesRow;
  // m-tiles per Sᵀ wgmma group: 1 keeps 32 A registers live (the 3-CTA budget), 2 overlaps both
  constexpr int kMt = kSplitted ? 2 : kMtRow;
  constexpr float kComp = Traits<T>::kComp;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int64_t s_off[kMaxTopk];
  __shared__ uint32_t s_mask[2];   // ballots of the valid slots 0..31, 32..63
  __shared__ int s_nvalid[kMaxTopk];
  __shared__ uint16_t s_mul[256];  // E4M3 byte -> packed multiplier (device_utils.cuh)
  uint8_t* const ring = smem;
  uint8_t* const s_qt = ring + kStages * kStageBytes;
  uint8_t* const s_pt = s_qt + kQtBytes;
  uint16_t* const s_vm = reinterpret_cast<uint16_t*>(s_pt + kPtBytes);
  float* const s_red = reinterpret_cast<float*>(s_pt + kPtBytes + kVmBytes);
  uint64_t* const full = reinterpret_cast<uint64_t*>(s_pt + kPtBytes + kVmBytes + kRedBytes);
  uint64_t* const empty = full + kStages;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g8 = lane >> 2;
  const int c = lane & 3;

  const int rank = kSplitted ? int(blockIdx.x % kSplit) : 0;  // = the cluster rank
  const int64_t pair = int64_t(blockIdx.x) / (kSplitted ? kSplit : 1);
  const int Hkv = p.num_kv_heads;
  const int64_t t = pair / Hkv;
  const int g = int(pair % Hkv);
  const int K = p.topk;
  const int G = p.group > 0 ? p.group : kGroup;
  const int Hq = Hkv * G;

  // The selected block id does not depend on the position: load it first.
  const int64_t bsel =
      tid < K ? int64_t(p.topk_indices[(int64_t(g) * p.num_tokens + t) * K + tid]) : -1;
  const TokenPos tp = token_position(p, t);
  if (tid < 128) {
    s_mul[tid] = scale_multiplier<T>(tid);
    s_mul[tid + 128] = scale_multiplier<T>(tid + 128);
  }
  // lean softmax: zc >= 0, a negative softmax scale flips the sign of Q instead
  const float zs = p.scale * (*p.k_scale) * kComp * kLog2e;
  const float zc = fabsf(zs);
  {
    const uint16_t* qrow = static_cast<const uint16_t*>(p.q) + (t * Hq + int64_t(g) * G) * kHeadDim;
    const uint16_t flip = zs < 0.f ? 0x8000u : 0u;
    for (int i = tid; i < kGroup * kHeadDim; i += kThreads) {
      const int n = i >> 7, d = i & (kHeadDim - 1);
      *reinterpret_cast<uint16_t*>(s_qt + qt_offset(d, n)) =
          n < G ? uint16_t(qrow[n * kHeadDim + d] ^ flip) : uint16_t(0);
    }
  }
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], kConsumers / 32);
    }
    mbar_init_fence();
  }
  fence_async_smem();  // Qᵀ is read by wgmma (the async proxy)
  const int count = compact_slots(p, tp, g, bsel, s_off, s_nvalid, s_mask);  // (barriers)
  const int cpr = (count + kRounds - 1) / kRounds;  // entries per round
  const int jbeg = kSplitted ? rank : 0, jend = kSplitted ? rank + 1 : kRounds;
  const int e0 = min(count, jbeg * cpr), e1 = min(count, jend * cpr);  // this CTA's entries

  RowState R;
  R.clear();
  if (warp == kConsumers / 32) {
    // ---- producer: one lane streams the entries' tile pairs through the ring
    if (lane == 0) {
      for (int e = e0; e < e1; ++e) {
        const int i = e - e0, st = i % kStages;
        if (i >= kStages) mbar_wait(&empty[st], ((i / kStages) - 1) & 1);
        const uint8_t* src = p.kv_cache + s_off[e];
        uint8_t* dst = ring + st * kStageBytes;
        const int nv = s_nvalid[e];
        if (nv == kBlockSize) {
          mbar_expect_tx(&full[st], kStageBytes);
          bulk_copy(dst, src, kStageBytes, &full[st]);
        } else {  // the attended tokens' rows only
          const uint32_t db = uint32_t(nv) * 64, sb = (uint32_t(nv) * 8 + 15) & ~15u;
          mbar_expect_tx(&full[st], 2 * (db + sb));
          bulk_copy(dst, src, db, &full[st]);
          bulk_copy(dst + kScalePlane, src + kScalePlane, sb, &full[st]);
          bulk_copy(dst + kTileBytes, src + kTileBytes, db, &full[st]);
          bulk_copy(dst + kTileBytes + kScalePlane, src + kTileBytes + kScalePlane, sb, &full[st]);
        }
      }
    }
  } else {
    // ---- consumers
    const int w = warp;
    // S rows g8 and g8 + 8 of a warp's 16 are tokens 2g8 and 2g8 + 1 (in an order that keeps
    // the K row loads free of bank conflicts), so a thread's two P values of a head are adjacent
    const int tokA = 2 * g8 + (g8 & 1), tokB = 2 * g8 + 1 - (g8 & 1);
    const uint64_t qdesc = smem_desc(s_qt, 256, 128);
    const uint64_t pdesc = smem_desc(s_pt, kPtLbo, 128);
    const int vgrp = 2 * w + (g8 >> 2);  // the V scale group of this thread's 4 d
    const uint32_t psel = (g8 & 1) ? 0x1032u : 0x3210u;  // prmt: swap the halves or not
    float sc[2][8];
#pragma unroll
    for (int k = 0; k < 8; ++k) sc[0][k] = sc[1][k] = 0.f;
    RowState S;
    int e = e0;
    for (int jr = jbeg; jr < jend; ++jr) {
      S.clear();
      const int ehi = min(count, (jr + 1) * cpr);
      for (; e < ehi; ++e) {
        const int i = e - e0, st = i % kStages;
        mbar_wait(&full[st], (i / kStages) & 1);
        const uint8_t* Ks = ring + st * kStageBytes;
        const uint8_t* Vs = Ks + kTileBytes;
        const int nvalid = s_nvalid[e];

        // ---- Sᵀ = K·Qᵀ (tokens on M, heads on N), kMt m-tiles per wgmma group
#pragma unroll
        for (int m0 = 0; m0 < 2; m0 += kMt) {
          uint32_t a[kMt][8][4];
#pragma unroll
          for (int mi = 0; mi < kMt; ++mi) {
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
              const int tok = 64 * (m0 + mi) + 16 * w + (hr ? tokB : tokA);
              const uint4 kd = *reinterpret_cast<const uint4*>(Ks + tok * 64 + 16 * c);
              const uint32_t sfb =
                  *reinterpret_cast<const uint16_t*>(Ks + kScalePlane + tok * 8 + 2 * c);
              const uint32_t s0 = s_mul[sfb & 0xFF], s1 = s_mul[sfb >> 8];
              uint32_t q[4][4];
              dequant8<T>(kd.x, s0 | (s0 << 16), q[0]);
              dequant8<T>(kd.y, s0 | (s0 << 16), q[1]);
              dequant8<T>(kd.z, s1 | (s1 << 16), q[2]);
              dequant8<T>(kd.w, s1 | (s1 << 16), q[3]);
#pragma unroll
              for (int s = 0; s < 8; ++s) {
                a[mi][s][hr] = q[s >> 1][2 * (s & 1)];
                a[mi][s][2 + hr] = q[s >> 1][2 * (s & 1) + 1];
              }
            }
          }
          wgmma_fence();
#pragma unroll
          for (int mi = 0; mi < kMt; ++mi)
#pragma unroll
            for (int s = 0; s < 8; ++s)
              wgmma_m64n16k16<T>(sc[m0 + mi], a[mi][s], qdesc + ((s * kQtStep) >> 4), s > 0);
          wgmma_commit_wait();
#pragma unroll
          for (int mi = 0; mi < kMt; ++mi) {
#pragma unroll
            for (int s = 0; s < 8; ++s)
#pragma unroll
              for (int r = 0; r < 4; ++r) keep(a[mi][s][r]);
#pragma unroll
            for (int k = 0; k < 8; ++k) keep(sc[m0 + mi][k]);
          }
        }

        // ---- lean online softmax over the block (kMasked: keys >= nvalid masked), then the V
        // multipliers [group][token] (0 for masked keys) and Pᵀ (wgmma B, K-major)
        auto softmax = [&](auto masked_tag) {
          constexpr bool kMasked = decltype(masked_tag)::value;
          float cm[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int x = 0; x < 8; ++x) {
              const int hr = (x >> 1) & 1, q = 2 * (x >> 2) + (x & 1);
              if (kMasked && 64 * mt + 16 * w + (hr ? tokB : tokA) >= nvalid) sc[mt][x] = -INFINITY;
              cm[q] = fmaxf(cm[q], sc[mt][x]);
            }
          bool up = false;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const float ms = cm[q] == -INFINITY ? -INFINITY : cm[q] * zc;
            up = up || ms > S.m[q] + kLazy;  // m = -inf: any finite max
          }
          if (bar_or(1, kConsumers, up)) {  // some head's max moves: the warpgroup's maxima
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              cm[q] = fmaxf(cm[q], __shfl_xor_sync(0xffffffffu, cm[q], 4));
              cm[q] = fmaxf(cm[q], __shfl_xor_sync(0xffffffffu, cm[q], 8));
              cm[q] = fmaxf(cm[q], __shfl_xor_sync(0xffffffffu, cm[q], 16));
              if (g8 == 0) s_red[w * kGroup + 8 * (q >> 1) + 2 * c + (q & 1)] = cm[q];
            }
            bar_sync(1, kConsumers);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              const int n = 8 * (q >> 1) + 2 * c + (q & 1);
              const float x = fmaxf(fmaxf(s_red[n], s_red[kGroup + n]),
                                    fmaxf(s_red[2 * kGroup + n], s_red[3 * kGroup + n]));
              const float ms = x == -INFINITY ? -INFINITY : x * zc;
              const float nm = ms > S.m[q] + kLazy ? ms : S.m[q];
              const float al = fast_exp2(S.m[q] - (nm == -INFINITY ? 0.f : nm));
              S.l[q] *= al;
#pragma unroll
              for (int k = 0; k < 4; ++k) S.o[8 * (k >> 1) + 4 * (q >> 1) + 2 * (k & 1) + (q & 1)] *= al;
              S.m[q] = nm;
            }
          }
          float nu[4];
#pragma unroll
          for (int q = 0; q < 4; ++q) nu[q] = S.m[q] == -INFINITY ? 0.f : -S.m[q];
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int x = 0; x < 8; ++x) {
              const int hr = (x >> 1) & 1, q = 2 * (x >> 2) + (x & 1);
              float pv = fast_exp2(fmaf(sc[mt][x], zc, nu[q]));
              if (kMasked && 64 * mt + 16 * w + (hr ? tokB : tokA) >= nvalid) pv = 0.f;  // -inf·0
              sc[mt][x] = pv;
              S.l[q] += pv;
            }

          // ---- V multipliers [group][token] (0 for masked keys), Pᵀ (wgmma B, K-major)
          {
            const uint2 vb = *reinterpret_cast<const uint2*>(Vs + kScalePlane + tid * 8);
#pragma unroll
            for (int gr = 0; gr < 8; ++gr) {
              const uint32_t byte = ((gr < 4 ? vb.x : vb.y) >> (8 * (gr & 3))) & 0xFFu;
              s_vm[gr * kBlockSize + tid] = !kMasked || tid < nvalid ? s_mul[byte] : uint16_t(0);
            }
          }
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
              for (int ee = 0; ee < 2; ++ee) {
                const int n = 8 * j + 2 * c + ee, kk = 2 * g8;
                // rows g8, g8 + 8 are tokens (2g8, 2g8 + 1), swapped for odd g8
                *reinterpret_cast<uint32_t*>(s_pt + (4 * mt + w) * kPtStep + (kk >> 3) * kPtLbo +
                                             (n >> 3) * 128 + (n & 7) * 16 + (kk & 7) * 2) =
                    prmt(Traits<T>::pack2(sc[mt][4 * j + ee], sc[mt][4 * j + 2 + ee]), 0u, psel);
              }
        };
        if (nvalid < kBlockSize) softmax(std::true_type{});
        else softmax(std::false_type{});
        fence_async_smem();
        bar_sync(1, kConsumers);

        // ---- Oᵀ += Vᵀ·Pᵀ (d on M, heads on N, tokens on K), 8 / (2 / kMt) k-steps per group
        constexpr int kKs = 4 * kMt;
#pragma unroll
        for (int s0 = 0; s0 < 8; s0 += kKs) {
          uint32_t av[2][kKs][4];
#pragma unroll
          for (int sp = 0; sp < kKs / 2; ++sp) {
            const int mi = lane >> 3;
            const int tok = 16 * (s0 + 2 * sp + (mi >> 1)) + 8 * (mi & 1) + (lane & 7);
            uint32_t v[4];
            ldsm_x4_trans(Vs + tok * 64 + 16 * w, v);
#pragma unroll
            for (int ss = 0; ss < 2; ++ss)
#pragma unroll
              for (int hl = 0; hl < 2; ++hl) {
                const int s = 2 * sp + ss;
                const uint32_t mul = *reinterpret_cast<const uint32_t*>(
                    s_vm + vgrp * kBlockSize + 16 * (s0 + s) + 8 * hl + 2 * c);
                uint32_t dq[4];
                dequant8<T>(v[2 * ss + hl], mul, dq);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                  av[mt][s][2 * hl] = dq[2 * mt];
                  av[mt][s][2 * hl + 1] = dq[2 * mt + 1];
                }
              }
          }
          wgmma_fence();
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int s = 0; s < kKs; ++s)
              wgmma_m64n16k16<T>(S.o + 8 * mt, av[mt][s], pdesc + (((s0 + s) * kPtStep) >> 4),
                                 true);
          wgmma_commit_wait();
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int s = 0; s < kKs; ++s)
#pragma unroll
              for (int r = 0; r < 4; ++r) keep(av[mt][s][r]);
#pragma unroll
          for (int k = 0; k < 16; ++k) keep(S.o[k]);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[st]);
      }
      R.fold(S.o, S.m, S.l);  // round jr's state into R
    }
  }

  const float vsc = (*p.v_scale) * kComp;
  uint16_t* out = static_cast<uint16_t*>(p.out) + ((t * Hq + int64_t(g) * G) * kHeadDim);
  if constexpr (!kSplitted) {
    if (warp < kConsumers / 32) store_row<T>(R, vsc, G, out, s_red);
  } else {
    // the 4 round states through distributed shared memory; rank 0 folds them in order
    cg::cluster_group cluster = cg::this_cluster();
    float* leaf = reinterpret_cast<float*>(ring);
    if (warp < kConsumers / 32) {
      bar_sync(1, kConsumers);  // every warp is done with the ring
#pragma unroll
      for (int k = 0; k < 16; ++k) leaf[k * kConsumers + tid] = R.o[k];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        leaf[(16 + q) * kConsumers + tid] = R.m[q];
        leaf[(20 + q) * kConsumers + tid] = R.l[q];
      }
    }
    cluster.sync();
    if (rank == 0 && warp < kConsumers / 32) {
      RowState F;
      F.clear();
#pragma unroll 1
      for (int j = 0; j < kSplit; ++j) {
        const float* lf = cluster.map_shared_rank(leaf, j);
        float Lo[16], Lm[4], Ll[4];
#pragma unroll
        for (int k = 0; k < 16; ++k) Lo[k] = lf[k * kConsumers + tid];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          Lm[q] = lf[(16 + q) * kConsumers + tid];
          Ll[q] = lf[(20 + q) * kConsumers + tid];
        }
        F.fold(Lo, Lm, Ll);
      }
      store_row<T>(F, vsc, G, out, s_red);
    }
    cluster.sync();  // no CTA leaves while rank 0 reads its leaf
  }
}

struct DeviceInfo {
  bool configured = false;
  int num_sms = 0;
};

// The number of SMs of the current device, and the kernels' shared-memory limits raised once per
// device (not stream work; also fine inside graph capture).
template <typename T>
cudaError_t configure(int* num_sms) {
  static DeviceInfo info[64];
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= 64) return cudaErrorInvalidDevice;
  if (!info[dev].configured) {
    err = cudaFuncSetAttribute(sparse_attention_kernel<T, false>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                               smem_bytes<kStagesRow>());
    if (err == cudaSuccess)
      err = cudaFuncSetAttribute(sparse_attention_kernel<T, true>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 smem_bytes<kStagesSplit>());
    if (err == cudaSuccess)
      err = cudaDeviceGetAttribute(&info[dev].num_sms, cudaDevAttrMultiProcessorCount, dev);
    if (err != cudaSuccess) return err;
    info[dev].configured = true;
  }
  *num_sms = info[dev].num_sms;
  return cudaSuccess;
}

template <typename T>
cudaError_t launch_typed(const AttentionParams& p, cudaStream_t stream) {
  int num_sms = 0;
  cudaError_t err = configure<T>(&num_sms);
  if (err != cudaSuccess) return err;
  const int64_t rows = p.num_tokens * p.num_kv_heads;
  if (attention_split(p, num_sms) == 1) {
    sparse_attention_kernel<T, false>
        <<<unsigned(rows), kThreads, smem_bytes<kStagesRow>(), stream>>>(p);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(rows * kSplit), 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = smem_bytes<kStagesSplit>();
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kSplit;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, sparse_attention_kernel<T, true>, p);
}

}  // namespace

const char* attention_unsupported(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t topk_blocks, int64_t block_size) {
  const bool ok_g = num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
                    num_heads / num_kv_heads >= 1 && num_heads / num_kv_heads <= kGroup;
  const bool ok = ok_g && head_dim == kHeadDim && block_size == kBlockSize && topk_blocks >= 1 &&
                  topk_blocks <= kMaxTopk;
  return ok ? ""
            : "the CUDA kernels need num_heads == G * num_kv_heads with 1 <= G <= 16, "
              "head_dim == 128, block_size == 128 and 1 <= topk_blocks <= 64";
}

int attention_split(const AttentionParams& p, int num_sms) {
  if (p.split == 1 || p.split == kSplit) return p.split;
  // the cluster launch while its 4 CTAs per row fit at 2 per SM (one wave; H200: T·Hkv <= 66);
  // at T·Hkv = 128 one CTA per row was faster (29.4 vs 37.9 µs, BENCHMARKS 2026-12-02)
  return p.num_tokens * p.num_kv_heads * kSplit <= 2 * int64_t(num_sms) ? kSplit : 1;
}

cudaError_t launch_sparse_attention(const AttentionParams& p, cudaStream_t stream) {
  if (p.num_tokens <= 0 || p.num_kv_heads <= 0) return cudaSuccess;
  if (p.topk < 0 || p.topk > kMaxTopk) return cudaErrorInvalidValue;
  if (p.num_tokens * p.num_kv_heads > int64_t(0x7FFFFFFF) / kSplit) return cudaErrorInvalidValue;
  if (p.split != 0 && p.split != 1 && p.split != kSplit) return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kBF16: return launch_typed<__nv_bfloat16>(p, stream);
    case DType::kF16: return launch_typed<__half>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace m3sparse
