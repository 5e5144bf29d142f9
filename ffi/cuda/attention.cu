// Sparse NVFP4 attention for sm_90: sparse_decode (SPEC §5.3) and sparse_prefill (§5.4).
//
// One CTA (4 warps) per (token, KV head, split). The G <= 16 query heads of a KV head are the
// rows of every m16n8k16 mma (rows G..15 are zero padding), so each dequantized K/V element
// serves all G heads.
//   1. Threads 0..K-1 check their top-k slot (SPEC §5.2: 0 <= b < max_blocks, 128·b < vis,
//      0 <= block_table[r, b] < P, layer in [0, L)) before anything is loaded, and the valid
//      slots are compacted in shared memory (warp ballots); split `rank` of S takes entries
//      rank, rank+S, ... Meanwhile warp 3 loads Q.
//   2. The K tile and the V tile of a (page, head) are adjacent in the cache (slots 2h, 2h+1):
//      18432 contiguous bytes, streamed with 16-byte cp.async into a 4-stage ring.
//   3. Warp w owns keys [32w, 32w+32) of every block: it dequantizes K into mma B fragments
//      (device_utils.cuh: exact), computes S = Q·Kᵀ (fp32), masks keys >= vis with a select,
//      runs the base-2 online softmax, dequantizes V (block scale selected to 0 for masked keys,
//      so NaN/garbage never meets the PV product) and accumulates P·V in fp32.
//      The d order inside a k-step and the key order inside an n-tile are permuted (both sides
//      agree) so that every lane reads contiguous bytes: 16 B per key for K, 8 B for V.
//   4. The 4 warps' (m, l, acc) merge in shared memory; the S CTAs of a cluster merge through
//      distributed shared memory (no global workspace, CUDA-graph safe). Rows with no attended
//      key write exact zeros.
// The pair kernel (further down, small T) runs 8 warps: the two warps of a pair share 32 keys and
// split D, so its P·V accumulator is half as large.
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

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTileBytes = kBlockSize * (kHeadDim / 2 + kHeadDim / 16);  // 9216
constexpr int kScalePlane = kBlockSize * kHeadDim / 2;                     // 8192
constexpr int kStageBytes = 2 * kTileBytes;                                // K tile, V tile
constexpr int kMaxSplits = 16;
constexpr float kLog2e = 1.4426950408889634f;
// Merge scratch (reuses the stage ring): 4 warp partials + one CTA partial.
constexpr int kMergeBytes =
    (kWarps * kGroup * kHeadDim + 2 * kWarps * kGroup + kGroup * kHeadDim + 2 * kGroup) * 4;

// Launch variants: (CTAs per SM, cp.async stages). Variant 1 trades prefetch depth for a
// fourth resident CTA (16 warps / SM); both were timed on the H200 (BENCHMARKS.md).
template <int kMinBlocks, int kStages, bool kQinRegs = false, bool kImadDq = true,
          bool kLeanSoftmax = false>
struct Variant {
  static constexpr int kBlocks = kMinBlocks;
  static constexpr int kNumStages = kStages;
  static constexpr bool kQregs = kQinRegs;  // Q A-fragments held in registers (else shared)
  // bf16 bit placement by the multiply form (device_utils.cuh); false: the shift/mask form
  static constexpr bool kImad = kImadDq;
  // scores scaled inside the exp2 (one FFMA) and the lazy running max of the pair kernel
  static constexpr bool kLean = kLeanSoftmax;
  static constexpr int kSmemBytes =
      kStages * kStageBytes > kMergeBytes ? kStages * kStageBytes : kMergeBytes;
};
using Variant0 = Variant<3, 3>;
using Variant1 = Variant<4, 2>;
using Variant2 = Variant<3, 3, true>;
using Variant3 = Variant<4, 2, false, false>;  // Variant1 with the older shift/mask dequantization
using Variant4 = Variant<4, 2, false, true, true>;  // Variant1 with the lean softmax
using Variant5 = Variant<3, 3, false, true, true>;  // Variant0 with the lean softmax

static_assert(kHeadDim == 128 && kBlockSize == 128 && kGroup == 16, "kernel geometry");

// ---- steps shared by both kernels

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
// s_bt: the request's block-table row already in shared memory (nullptr: read it here).
__device__ __forceinline__ int compact_slots(const AttentionParams& p, const TokenPos& tp, int g,
                                             int64_t bsel, int64_t* s_off, int* s_nvalid,
                                             uint32_t* s_mask, const int32_t* s_bt = nullptr) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  bool ok = false;
  int nv = 0;
  int64_t off = 0;
  if (tid < p.topk && tp.vis > 0) {
    const int64_t b = bsel;
    if (b >= 0 && b < p.max_blocks && b * kBlockSize < tp.vis) {
      const int64_t page = s_bt ? s_bt[b] : p.block_table[tp.r * p.max_blocks + b];
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

// Q A-fragments of one lane (rows >= G are zeros): register j = 4W + k (W < kWords) holds
// d = d0 + 8W + k (lo) and d + 4 (hi), the order of the K fragments; sq[s * 32 + lane] gets the
// 4 registers of k-step s. kCvt: fp16 pairs in dequant8_cvt's order. `flip` is xor-ed into
// every register (0x80008000: the pair kernel folds the sign of the softmax scale into Q).
template <typename T, bool kCvt, int kWords>
__device__ __forceinline__ void build_q_frags(const uint16_t* qbase, int G, int lane, int d0,
                                              uint32_t flip, uint4* sq) {
  const int g8 = lane >> 2;
  uint32_t row[2][4 * kWords];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int h = g8 + 8 * half;
    const uint4* src = reinterpret_cast<const uint4*>(qbase + h * kHeadDim + d0);
#pragma unroll
    for (int W = 0; W < kWords; ++W) {
      const uint4 c = h < G ? src[W] : make_uint4(0, 0, 0, 0);
      if constexpr (kCvt) {
        // fp16 pairs in dequant8_cvt's order: (e0, e2), (e4, e6), (e1, e3), (e5, e7)
        const uint32_t wd[4] = {c.x, c.y, c.z, c.w};
        float e[8];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          e[2 * k] = Traits<T>::to_float(uint16_t(wd[k] & 0xFFFF));
          e[2 * k + 1] = Traits<T>::to_float(uint16_t(wd[k] >> 16));
        }
        row[half][4 * W + 0] = Traits<__half>::pack2(e[0], e[2]);
        row[half][4 * W + 1] = Traits<__half>::pack2(e[4], e[6]);
        row[half][4 * W + 2] = Traits<__half>::pack2(e[1], e[3]);
        row[half][4 * W + 3] = Traits<__half>::pack2(e[5], e[7]);
      } else {
        row[half][4 * W + 0] = prmt(c.x, c.z, 0x5410);
        row[half][4 * W + 1] = prmt(c.x, c.z, 0x7632);
        row[half][4 * W + 2] = prmt(c.y, c.w, 0x5410);
        row[half][4 * W + 3] = prmt(c.y, c.w, 0x7632);
      }
    }
  }
#pragma unroll
  for (int s = 0; s < 2 * kWords; ++s)
    sq[s * 32 + lane] = make_uint4(row[0][2 * s] ^ flip, row[1][2 * s] ^ flip,
                                   row[0][2 * s + 1] ^ flip, row[1][2 * s + 1] ^ flip);
}

// The lean online softmax of one 32-key slice (both kernels' option; sc: raw scores of 4
// n-tiles, lane (g8, tig) holding keys kb+8v+tig (+4) of rows g8 (0, 1) and g8+8 (2, 3)):
// masked keys (kMasked: key >= nvalid) get -inf; the row maxima of the raw scores times zc >= 0
// move the running max only when they exceed it by more than kLazy, so the accumulator is
// rarely rescaled and P <= 2^kLazy (out = Σ p·v / Σ p holds for any common reference); each
// p = exp2(fma(s, zc, -m)) is one FFMA and one MUFU. sc returns P (0 for masked keys).
constexpr float kLazy = 8.0f;
template <bool kMasked, int kNj>
__device__ __forceinline__ void online_softmax_lean(float (&sc)[4][4], float (&acc)[kNj][4],
                                                    float& m0, float& m1, float& l0, float& l1,
                                                    float zc, int kb, int nvalid, int tig) {
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int v = 0; v < 4; ++v) {
    if constexpr (kMasked) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (kb + 8 * v + 4 * (e & 1) + tig >= nvalid) sc[v][e] = -INFINITY;
    }
    mx0 = fmaxf(mx0, fmaxf(sc[v][0], sc[v][1]));
    mx1 = fmaxf(mx1, fmaxf(sc[v][2], sc[v][3]));
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  // -inf (a fully masked row) stays -inf also for zc == 0
  const float ms0 = mx0 == -INFINITY ? -INFINITY : mx0 * zc;
  const float ms1 = mx1 == -INFINITY ? -INFINITY : mx1 * zc;
  const bool up0 = ms0 > m0 + kLazy, up1 = ms1 > m1 + kLazy;  // m = -inf: any finite max
  if (__any_sync(0xffffffffu, up0 || up1)) {
    const float n0 = up0 ? ms0 : m0, n1 = up1 ? ms1 : m1;
    const float al0 = fast_exp2(m0 - (n0 == -INFINITY ? 0.f : n0));
    const float al1 = fast_exp2(m1 - (n1 == -INFINITY ? 0.f : n1));
    l0 *= al0;
    l1 *= al1;
#pragma unroll
    for (int jd = 0; jd < kNj; ++jd) {
      acc[jd][0] *= al0;
      acc[jd][1] *= al0;
      acc[jd][2] *= al1;
      acc[jd][3] *= al1;
    }
    m0 = n0;
    m1 = n1;
  }
  const float nu0 = m0 == -INFINITY ? 0.f : -m0;
  const float nu1 = m1 == -INFINITY ? 0.f : -m1;
#pragma unroll
  for (int v = 0; v < 4; ++v) {
    sc[v][0] = fast_exp2(fmaf(sc[v][0], zc, nu0));
    sc[v][1] = fast_exp2(fmaf(sc[v][1], zc, nu0));
    sc[v][2] = fast_exp2(fmaf(sc[v][2], zc, nu1));
    sc[v][3] = fast_exp2(fmaf(sc[v][3], zc, nu1));
    if constexpr (kMasked) {  // -inf · 0 would be NaN for zc == 0
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (kb + 8 * v + 4 * (e & 1) + tig >= nvalid) sc[v][e] = 0.f;
    }
    l0 += sc[v][0] + sc[v][1];
    l1 += sc[v][2] + sc[v][3];
  }
}

// Shared-memory merge scratch (reuses the stage ring): 4 partials + one CTA partial.
struct MergeSmem {
  float* part;   // [4][16][128]
  float* pm;     // [4][16]
  float* pl;     // [4][16]
  float* cta_o;  // [16][128]
  float* cta_m;  // [16]
  float* cta_l;  // [16]
  __device__ explicit MergeSmem(uint8_t* smem) {
    part = reinterpret_cast<float*>(smem);
    pm = part + 4 * kGroup * kHeadDim;
    pl = pm + 4 * kGroup;
    cta_o = pl + 4 * kGroup;
    cta_m = cta_o + kGroup * kHeadDim;
    cta_l = cta_m + kGroup;
  }
  // Partial `slot`'s running max and sum of rows g8 and g8 + 8.
  __device__ void store_stats(int slot, int g8, float m0, float m1, float l0, float l1) const {
    pm[slot * kGroup + g8] = m0;
    pm[slot * kGroup + g8 + 8] = m1;
    pl[slot * kGroup + g8] = l0;
    pl[slot * kGroup + g8 + 8] = l1;
  }
};

// A row's sum over the 4 lanes of its quad (the lanes that hold its columns).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The cluster merge of thread d for the heads h = rank, rank + kS, ...: the remote (DSMEM) loads
// are issued in batches of 4 (kS/2 round trips per head instead of 3·kS dependent ones).
template <int kS, typename T>
__device__ __forceinline__ void merge_cluster(const MergeSmem& ms, cg::cluster_group& cluster,
                                              uint16_t* out, int G, int rank, int d, float vsc) {
  constexpr int kC = kS < 4 ? kS : 4;  // loads in flight per batch (register budget)
  for (int h = rank; h < G; h += kS) {
    float mw = -INFINITY;
#pragma unroll
    for (int q0 = 0; q0 < kS; q0 += kC) {
      float mq[kC];
#pragma unroll
      for (int c = 0; c < kC; ++c) mq[c] = cluster.map_shared_rank(ms.cta_m, q0 + c)[h];
#pragma unroll
      for (int c = 0; c < kC; ++c) mw = fmaxf(mw, mq[c]);
    }
    const float mu = mw == -INFINITY ? 0.f : mw;
    float L = 0.f, O = 0.f;
#pragma unroll
    for (int q0 = 0; q0 < kS; q0 += kC) {
      float mq[kC], lq[kC], oq[kC];
#pragma unroll
      for (int c = 0; c < kC; ++c) {
        mq[c] = cluster.map_shared_rank(ms.cta_m, q0 + c)[h];
        lq[c] = cluster.map_shared_rank(ms.cta_l, q0 + c)[h];
        oq[c] = cluster.map_shared_rank(ms.cta_o, q0 + c)[h * kHeadDim + d];
      }
#pragma unroll
      for (int c = 0; c < kC; ++c) {
        const float f = fast_exp2(mq[c] - mu);
        L += lq[c] * f;
        O += oq[c] * f;
      }
    }
    const float o = L == 0.f ? 0.f : O / L * vsc;
    out[h * kHeadDim + d] = Traits<T>::from_float(o);
  }
}

// Merge of the 4 partial (m, l, O) of a CTA (written to ms.part / pm / pl before the caller's
// barrier), then of the S CTAs of the cluster through distributed shared memory (no global
// workspace: CUDA-graph safe). Threads 0..127 own one d each; every thread calls it. Rows with
// no attended key write exact zeros. vsc: v_scale times the dequantization power of two.
// kBatched: the cluster merge of merge_cluster (its registers cost the 4-warp kernels spills
// in their main loop; they keep the serial loop).
template <typename T, bool kBatched = false>
__device__ __forceinline__ void merge_and_store(const AttentionParams& p, const MergeSmem& ms,
                                                cg::cluster_group& cluster, int64_t t, int g,
                                                int G, float vsc) {
  const int S = int(cluster.num_blocks());
  const int rank = int(cluster.block_rank());
  const int d = threadIdx.x;
  if (d < kHeadDim) {
#pragma unroll 4
    for (int h = 0; h < kGroup; ++h) {
      float mw = -INFINITY;
#pragma unroll
      for (int w = 0; w < 4; ++w) mw = fmaxf(mw, ms.pm[w * kGroup + h]);
      const float mu = mw == -INFINITY ? 0.f : mw;
      float L = 0.f, O = 0.f;
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float f = fast_exp2(ms.pm[w * kGroup + h] - mu);
        L += ms.pl[w * kGroup + h] * f;
        O += ms.part[(w * kGroup + h) * kHeadDim + d] * f;
      }
      ms.cta_o[h * kHeadDim + d] = O;
      if (d == 0) {
        ms.cta_m[h] = mw;
        ms.cta_l[h] = L;
      }
    }
  }
  const int Hq = p.num_kv_heads * G;
  uint16_t* out = static_cast<uint16_t*>(p.out) + ((t * Hq + int64_t(g) * G) * kHeadDim);
  if (S == 1) {
    __syncthreads();
    if (d < kHeadDim) {
      for (int h = 0; h < G; ++h) {
        const float L = ms.cta_l[h];
        const float o = L == 0.f ? 0.f : ms.cta_o[h * kHeadDim + d] / L * vsc;
        out[h * kHeadDim + d] = Traits<T>::from_float(o);
      }
    }
  } else {
    cluster.sync();
    if (d < kHeadDim) {
      if constexpr (kBatched) {
        switch (S) {
          case 2: merge_cluster<2, T>(ms, cluster, out, G, rank, d, vsc); break;
          case 4: merge_cluster<4, T>(ms, cluster, out, G, rank, d, vsc); break;
          case 8: merge_cluster<8, T>(ms, cluster, out, G, rank, d, vsc); break;
          default: merge_cluster<16, T>(ms, cluster, out, G, rank, d, vsc); break;
        }
      } else {
        for (int h = rank; h < G; h += S) {
          float mw = -INFINITY;
          for (int q = 0; q < S; ++q) mw = fmaxf(mw, cluster.map_shared_rank(ms.cta_m, q)[h]);
          const float mu = mw == -INFINITY ? 0.f : mw;
          float L = 0.f, O = 0.f;
          for (int q = 0; q < S; ++q) {
            const float f = fast_exp2(cluster.map_shared_rank(ms.cta_m, q)[h] - mu);
            L += cluster.map_shared_rank(ms.cta_l, q)[h] * f;
            O += cluster.map_shared_rank(ms.cta_o, q)[h * kHeadDim + d] * f;
          }
          const float o = L == 0.f ? 0.f : O / L * vsc;
          out[h * kHeadDim + d] = Traits<T>::from_float(o);
        }
      }
    }
    cluster.sync();
  }
}

// T: q/out dtype. kCvt: dequantize through the fp8 conversion (fp16 mma, Q converted to fp16);
// otherwise through the bit placement of device_utils.cuh (mma in T).
template <typename T, typename V, bool kCvt>
__global__ void __launch_bounds__(kThreads, V::kBlocks)
    sparse_attention_kernel(const AttentionParams p) {
  using C = std::conditional_t<kCvt, __half, T>;  // mma / P dtype
  constexpr float kComp = kCvt ? kCvtComp : Traits<T>::kComp;
  constexpr int kStages = V::kNumStages;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int64_t s_off[kMaxTopk];
  __shared__ uint32_t s_mask[2];   // ballots of the valid slots 0..31, 32..63
  __shared__ int s_nvalid[kMaxTopk];
  __shared__ uint16_t s_mul[256];  // E4M3 byte -> packed multiplier (device_utils.cuh)
  __shared__ uint4 s_q[8][32];     // Q A-fragments per k-step and lane (all warps share them)

  cg::cluster_group cluster = cg::this_cluster();
  const int S = int(cluster.num_blocks());
  const int rank = int(cluster.block_rank());
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g8 = lane >> 2;   // mma groupID
  const int tig = lane & 3;   // thread in group

  const int64_t pair = int64_t(blockIdx.x) / S;
  const int Hkv = p.num_kv_heads;
  const int64_t t = pair / Hkv;
  const int g = int(pair % Hkv);
  const int K = p.topk;
  const int G = p.group > 0 ? p.group : kGroup;
  // The selected block id does not depend on the position: load it first (one fewer
  // dependent round trip before the block-table read).
  const int64_t bsel =
      tid < K ? int64_t(p.topk_indices[(int64_t(g) * p.num_tokens + t) * K + tid]) : -1;
  const TokenPos tp = token_position(p, t);

  if constexpr (kCvt) {
    s_mul[tid] = Traits<__half>::from_float(e4m3_to_float(uint8_t(tid)));
    s_mul[tid + 128] = Traits<__half>::from_float(e4m3_to_float(uint8_t(tid + 128)));
  } else {
    s_mul[tid] = scale_multiplier<T>(tid);
    s_mul[tid + 128] = scale_multiplier<T>(tid + 128);
  }

  // Q fragments (A operand), d permuted to match the K fragments below: register j = 4W + k
  // of lane (g8, tig) holds d = 32·tig + 8W + k (lo) and d + 4 (hi). Warp 3 builds them once
  // while warps 0, 1 check the slots; every warp reads one 16-byte vector per k-step.
  // lean softmax: zc >= 0, a negative softmax scale flips the sign of Q instead
  const float zs = p.scale * (*p.k_scale) * kComp * kLog2e;
  const float zc = V::kLean ? fabsf(zs) : zs;
  const int Hq = Hkv * G;
  if (warp == kWarps - 1)
    build_q_frags<T, kCvt, 4>(static_cast<const uint16_t*>(p.q) + ((t * Hq + int64_t(g) * G) * kHeadDim),
                              G, lane, 32 * tig, V::kLean && zs < 0.f ? 0x80008000u : 0u, &s_q[0][0]);

  const int count = compact_slots(p, tp, g, bsel, s_off, s_nvalid, s_mask);
  const int nmine = count > rank ? (count - rank + S - 1) / S : 0;

  // Q fragments in registers (variants with the register budget), loaded after the barrier.
  uint32_t qreg[V::kQregs ? 8 : 1][4];
  if constexpr (V::kQregs) {
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const uint4 qv = s_q[s][lane];
      qreg[s][0] = qv.x;
      qreg[s][1] = qv.y;
      qreg[s][2] = qv.z;
      qreg[s][3] = qv.w;
    }
  }

  float acc[16][4];
#pragma unroll
  for (int j = 0; j < 16; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

  const uint8_t* cache = p.kv_cache;
  // Each warp streams its own quarter of every (K, V) tile pair: keys [kb, kb+32) — K data
  // (2048 B), K scales (256 B), V data (2048 B), V scales (256 B) — into its own slice of the
  // stage ring, so warps synchronize only with themselves (cp.async.wait_group + __syncwarp).
  const int kb = 32 * warp;  // this warp's keys in every block
  constexpr int kWarpStage = kStageBytes / kWarps;  // 4608
  constexpr int kKs = 2048, kVd = 2304, kVs = 4352;  // offsets inside a warp's stage slice
  uint8_t* wsmem = smem + warp * (kStages * kWarpStage);
  // Lane chunks: 4 of K data, 4 of V data (keys kb + lane/4 + 8i, 16 bytes each) and one scale
  // chunk (lanes 0..15: K scales, 16..31: V scales): two base pointers plus immediates.
  const int src_d = kb * 64 + 16 * lane;
  const int src_s = kScalePlane + kb * 8 + 16 * (lane & 15) + (lane >= 16 ? kTileBytes : 0);
  const int dst_s = 16 * lane + (lane >= 16 ? kVs - 256 : kKs);
  auto issue = [&](int j) {
    const int e = rank + j * S;
    if (kb >= s_nvalid[e]) return;  // none of this warp's keys is attended in that block
    const uint8_t* tile = cache + s_off[e];
    uint8_t* dst = wsmem + (j % kStages) * kWarpStage;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      cp_async16(dst + 16 * lane + 512 * i, tile + src_d + 512 * i);
      cp_async16(dst + kVd + 16 * lane + 512 * i, tile + src_d + kTileBytes + 512 * i);
    }
    cp_async16(dst + dst_s, tile + src_s);
  };

#pragma unroll
  for (int j = 0; j < kStages - 1; ++j) {
    if (j < nmine) issue(j);
    cp_async_commit();
  }

  for (int j = 0; j < nmine; ++j) {
    if (j + kStages - 1 < nmine) issue(j + kStages - 1);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    __syncwarp();

    const uint8_t* Ws = wsmem + (j % kStages) * kWarpStage;
    const int nvalid = s_nvalid[rank + j * S];

    auto process = [&](auto masked_tag) {
      constexpr bool kMasked = decltype(masked_tag)::value;
      // ---- S = Q·Kᵀ over 4 n-tiles of 8 keys; column c of n-tile v is key kb+8v+4(c&1)+(c>>1)
      float sc[4][4];
      // two n-tiles at a time: independent mma chains interleave
#pragma unroll
      for (int vp = 0; vp < 4; vp += 2) {
        uint32_t b[2][16];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int v = vp + u;
          sc[v][0] = sc[v][1] = sc[v][2] = sc[v][3] = 0.f;
          const int kl = 8 * v + 4 * (g8 & 1) + (g8 >> 1);  // key kb + kl
          const uint4 kd = *reinterpret_cast<const uint4*>(Ws + kl * 64 + 16 * tig);
          const uint32_t sfb = *reinterpret_cast<const uint16_t*>(Ws + kKs + kl * 8 + 2 * tig);
          const uint32_t s0 = s_mul[sfb & 0xFF];
          const uint32_t s1 = s_mul[sfb >> 8];
          const uint32_t s0x2 = s0 | (s0 << 16);
          const uint32_t s1x2 = s1 | (s1 << 16);
          if constexpr (kCvt) {
            dequant8_cvt(kd.x, s0x2, b[u] + 0);
            dequant8_cvt(kd.y, s0x2, b[u] + 4);
            dequant8_cvt(kd.z, s1x2, b[u] + 8);
            dequant8_cvt(kd.w, s1x2, b[u] + 12);
          } else {
            dequant8<T, V::kImad>(kd.x, s0x2, b[u] + 0);
            dequant8<T, V::kImad>(kd.y, s0x2, b[u] + 4);
            dequant8<T, V::kImad>(kd.z, s1x2, b[u] + 8);
            dequant8<T, V::kImad>(kd.w, s1x2, b[u] + 12);
          }
        }
#pragma unroll
        for (int s = 0; s < 8; ++s) {
          if constexpr (V::kQregs) {
            Traits<C>::mma(sc[vp], qreg[s], b[0][2 * s], b[0][2 * s + 1]);
            Traits<C>::mma(sc[vp + 1], qreg[s], b[1][2 * s], b[1][2 * s + 1]);
          } else {
            const uint4 qv = s_q[s][lane];
            const uint32_t qa[4] = {qv.x, qv.y, qv.z, qv.w};
            Traits<C>::mma(sc[vp], qa, b[0][2 * s], b[0][2 * s + 1]);
            Traits<C>::mma(sc[vp + 1], qa, b[1][2 * s], b[1][2 * s + 1]);
          }
        }
      }

      if constexpr (V::kLean) {
        online_softmax_lean<kMasked, 16>(sc, acc, m0, m1, l0, l1, zc, kb, nvalid, tig);
      } else {
        // ---- mask (select; partial blocks only), base-2 online softmax
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int v = 0; v < 4; ++v) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if constexpr (kMasked) {
              const int key = kb + 8 * v + 4 * (e & 1) + tig;
              sc[v][e] = key < nvalid ? sc[v][e] * zc : -INFINITY;
            } else {
              sc[v][e] *= zc;
            }
          }
          mx0 = fmaxf(mx0, fmaxf(sc[v][0], sc[v][1]));
          mx1 = fmaxf(mx1, fmaxf(sc[v][2], sc[v][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float mu0 = mn0 == -INFINITY ? 0.f : mn0;
        const float mu1 = mn1 == -INFINITY ? 0.f : mn1;
        if (__any_sync(0xffffffffu, mn0 != m0 || mn1 != m1)) {
          // rescale only when some row's running max moved (exp2(0) == 1 otherwise)
          const float al0 = fast_exp2(m0 - mu0), al1 = fast_exp2(m1 - mu1);
          l0 *= al0;
          l1 *= al1;
#pragma unroll
          for (int jd = 0; jd < 16; ++jd) {
            acc[jd][0] *= al0;
            acc[jd][1] *= al0;
            acc[jd][2] *= al1;
            acc[jd][3] *= al1;
          }
          m0 = mn0;
          m1 = mn1;
        }
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          sc[v][0] = fast_exp2(sc[v][0] - mu0);
          sc[v][1] = fast_exp2(sc[v][1] - mu0);
          sc[v][2] = fast_exp2(sc[v][2] - mu1);
          sc[v][3] = fast_exp2(sc[v][3] - mu1);
          l0 += sc[v][0] + sc[v][1];
          l1 += sc[v][2] + sc[v][3];
        }
      }

      // ---- O += P·V: k-step i covers n-tiles 2i, 2i+1; lane (g8, tig) supplies keys
      // ka = kb+16i+tig, +4 (b0) and +8, +12 (b1), d = 16·g8 + jd for d-tile jd.
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        uint32_t pa[4];
        pa[0] = Traits<C>::pack2(sc[2 * i][0], sc[2 * i][1]);
        pa[1] = Traits<C>::pack2(sc[2 * i][2], sc[2 * i][3]);
        pa[2] = Traits<C>::pack2(sc[2 * i + 1][0], sc[2 * i + 1][1]);
        pa[3] = Traits<C>::pack2(sc[2 * i + 1][2], sc[2 * i + 1][3]);
        uint2 w[4];
        uint32_t smul[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int kl = 16 * i + tig + 4 * q;  // key kb + kl
          const int key = kb + kl;
          w[q] = *reinterpret_cast<const uint2*>(Ws + kVd + kl * 64 + 8 * g8);
          const uint32_t sm = s_mul[Ws[kVs + kl * 8 + g8]];
          // masked keys: multiplier 0 (codes are finite), so garbage never meets P·V
          if constexpr (kMasked) smul[q] = key < nvalid ? sm : 0u;
          else smul[q] = sm;
        }
        const uint32_t sab = smul[0] | (smul[1] << 16);
        const uint32_t sce = smul[2] | (smul[3] << 16);
        if constexpr (kCvt) {
          // word wi of keys (a, b) and (c, e): E4M3 bytes interleaved by key, 2 per cvt;
          // d-tile 8·wi + r holds d = 16·g8 + 8·wi + cvt_elem(r)
#pragma unroll
          for (int wi = 0; wi < 2; ++wi) {
            const uint32_t wa = wi ? w[0].y : w[0].x, wb = wi ? w[1].y : w[1].x;
            const uint32_t wc = wi ? w[2].y : w[2].x, we = wi ? w[3].y : w[3].x;
#pragma unroll
            for (int par = 0; par < 2; ++par) {  // 0: even elements, 1: odd
              const uint32_t xa = par ? e4m3_odd(wa) : e4m3_even(wa);
              const uint32_t xb = par ? e4m3_odd(wb) : e4m3_even(wb);
              const uint32_t xc = par ? e4m3_odd(wc) : e4m3_even(wc);
              const uint32_t xe = par ? e4m3_odd(we) : e4m3_even(we);
#pragma unroll
              for (int hh = 0; hh < 2; ++hh) {
                const uint32_t sel = hh ? 0x7362 : 0x5140;
                const uint32_t tab = prmt(xa, xb, sel), tce = prmt(xc, xe, sel);
                const int r0 = 4 * par + 2 * hh;
                Traits<__half>::mma(acc[8 * wi + r0], pa,
                                    Traits<__half>::mul2(cvt_e4m3x2_lo(tab), sab),
                                    Traits<__half>::mul2(cvt_e4m3x2_lo(tce), sce));
                Traits<__half>::mma(acc[8 * wi + r0 + 1], pa,
                                    Traits<__half>::mul2(cvt_e4m3x2_hi(tab), sab),
                                    Traits<__half>::mul2(cvt_e4m3x2_hi(tce), sce));
              }
            }
          }
        } else {
#pragma unroll
          for (int tq = 0; tq < 4; ++tq) {
            const uint32_t sel = (tq & 1) ? 0x7632 : 0x5410;
            const uint32_t wa = (tq < 2) ? w[0].x : w[0].y;
            const uint32_t wb = (tq < 2) ? w[1].x : w[1].y;
            const uint32_t wc = (tq < 2) ? w[2].x : w[2].y;
            const uint32_t we = (tq < 2) ? w[3].x : w[3].y;
            uint32_t b0[4], b1[4];
            dequant8<T, V::kImad>(prmt(wa, wb, sel), sab, b0);
            dequant8<T, V::kImad>(prmt(wc, we, sel), sce, b1);
#pragma unroll
            for (int k = 0; k < 4; ++k) Traits<T>::mma(acc[4 * tq + k], pa, b0[k], b1[k]);
          }
        }
      }
    };
    if (kb + 32 <= nvalid) process(std::false_type{});
    else if (kb < nvalid) process(std::true_type{});
    __syncwarp();
  }
  cp_async_wait<0>();
  __syncthreads();

  // ---- merge the 4 warps (shared memory), then the S CTAs of the cluster (DSMEM)
  l0 = quad_sum(l0);
  l1 = quad_sum(l1);
  const MergeSmem ms(smem);
#pragma unroll
  for (int jd = 0; jd < 16; ++jd) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = g8 + 8 * (e >> 1);
      const int dj = kCvt ? 8 * (jd / 8) + cvt_elem(jd % 8) : jd;
      const int d = 16 * (2 * tig + (e & 1)) + dj;
      ms.part[(warp * kGroup + h) * kHeadDim + d] = acc[jd][e];
    }
  }
  if (tig == 0) ms.store_stats(warp, g8, m0, m1, l0, l1);
  __syncthreads();
  merge_and_store<T>(p, ms, cluster, t, g, G, (*p.v_scale) * kComp);
}

// ---- the pair kernel: 8 warps, each K/V tile's 128 keys split over 4 warp pairs; the two
// warps of a pair split D (64 each) for both products, so the P·V accumulator is 32 registers
// instead of 64 and twice the warps fit per SM. The partial Q·Kᵀ of the two halves meet in
// shared memory (two CTA barriers per tile); both warps then run the same softmax on identical
// sums (bit-identical m and l), the lean one (online_softmax_lean).
constexpr int kPairThreads = 256;
constexpr int kPairWarpStage = 2560;  // per warp and stage: K data, V data (its D half), K, V scales
constexpr int kPKd = 0, kPVd = 1024, kPKs = 2048, kPVs = 2304;

template <int kMinBlocks, int kStages, bool kQinRegs>
struct PairVariant {
  static constexpr int kBlocks = kMinBlocks;
  static constexpr int kNumStages = kStages;
  static constexpr bool kQregs = kQinRegs;
  static constexpr int kRingBytes = 8 * kStages * kPairWarpStage;
  static constexpr int kXBytes = 8 * 4 * 32 * 16;  // partial scores, one buffer per warp
  static constexpr int kSmemBytes =
      kRingBytes + kXBytes > kMergeBytes ? kRingBytes + kXBytes : kMergeBytes;
};
using PairVariant0 = PairVariant<2, 3, true>;   // 16 warps / SM, 128 registers
using PairVariant1 = PairVariant<3, 2, false>;  // 24 warps / SM, 80 registers

template <typename T, typename V>
__global__ void __launch_bounds__(kPairThreads, V::kBlocks)
    sparse_attention_pair_kernel(const AttentionParams p) {
  constexpr float kComp = Traits<T>::kComp;
  constexpr int kStages = V::kNumStages;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int64_t s_off[kMaxTopk];
  __shared__ uint32_t s_mask[2];
  __shared__ int s_nvalid[kMaxTopk];
  __shared__ uint16_t s_mul[256];
  __shared__ uint4 s_q[2][4][32];  // [D half][k-step][lane]
  __shared__ int32_t s_bt[kPairThreads];  // the block-table row when max_blocks <= 256

  cg::cluster_group cluster = cg::this_cluster();
  const int S = int(cluster.num_blocks());
  const int rank = int(cluster.block_rank());
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g8 = lane >> 2;
  const int tig = lane & 3;
  const int wp = warp >> 1;  // warp pair: keys [32·wp, 32·wp + 32) of every block
  const int hf = warp & 1;   // D half: d in [64·hf, 64·hf + 64)

  const int64_t pr = int64_t(blockIdx.x) / S;
  const int Hkv = p.num_kv_heads;
  const int64_t t = pr / Hkv;
  const int g = int(pr % Hkv);
  const int K = p.topk;
  const int G = p.group > 0 ? p.group : kGroup;
  const int64_t bsel =
      tid < K ? int64_t(p.topk_indices[(int64_t(g) * p.num_tokens + t) * K + tid]) : -1;
  const TokenPos tp = token_position(p, t);
  s_mul[tid] = scale_multiplier<T>(tid);  // kPairThreads == 256

  // zc >= 0: a negative softmax scale flips the sign of Q instead, so that the row maximum of
  // the raw scores times zc is the maximum of the scaled ones.
  const float zs = p.scale * (*p.k_scale) * kComp * kLog2e;
  const float zc = fabsf(zs);
  const int Hq = Hkv * G;
  if (warp == 2 || warp == 3)
    build_q_frags<T, false, 2>(
        static_cast<const uint16_t*>(p.q) + ((t * Hq + int64_t(g) * G) * kHeadDim), G, lane,
        64 * (warp - 2) + 16 * tig, zs < 0.f ? 0x80008000u : 0u, &s_q[warp - 2][0][0]);

  // a short block-table row is read whole, beside the top-k ids (in bounds: the row of a valid
  // request), so the slot check waits for one global round trip less
  const bool bt_pre = p.max_blocks <= kPairThreads;
  if (bt_pre) {
    if (tid < p.max_blocks && tp.r >= 0 && tp.r < p.num_requests)
      s_bt[tid] = p.block_table[tp.r * p.max_blocks + tid];
    __syncthreads();
  }
  const int count =
      compact_slots(p, tp, g, bsel, s_off, s_nvalid, s_mask, bt_pre ? s_bt : nullptr);
  const int nmine = count > rank ? (count - rank + S - 1) / S : 0;

  uint32_t qreg[V::kQregs ? 4 : 1][4];
  if constexpr (V::kQregs) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const uint4 qv = s_q[hf][s][lane];
      qreg[s][0] = qv.x;
      qreg[s][1] = qv.y;
      qreg[s][2] = qv.z;
      qreg[s][3] = qv.w;
    }
  }

  float acc[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

  const int kb = 32 * wp;
  uint8_t* wsmem = smem + warp * (kStages * kPairWarpStage);
  float4* xmine = reinterpret_cast<float4*>(smem + V::kRingBytes) + warp * 128 + lane;
  const float4* xother = reinterpret_cast<const float4*>(smem + V::kRingBytes) + (warp ^ 1) * 128 + lane;
  // cp.async sources of this lane inside a tile: K/V data chunk (key kb + lane/2 (+16), 16 bytes
  // of this warp's D half) and one scale chunk (lanes 0..15: K scales, 16..31: V scales).
  const int src_d = (kb + (lane >> 1)) * 64 + 32 * hf + 16 * (lane & 1);
  const int src_s = kScalePlane + kb * 8 + 16 * (lane & 15) + (lane >= 16 ? kTileBytes : 0);
  auto issue = [&](int j) {
    const int e = rank + j * S;
    if (kb >= s_nvalid[e]) return;  // none of this pair's keys is attended in that block
    const uint8_t* tile = p.kv_cache + s_off[e];
    uint8_t* dst = wsmem + (j % kStages) * kPairWarpStage + 16 * lane;
    cp_async16(dst + kPKd, tile + src_d);
    cp_async16(dst + kPKd + 512, tile + src_d + 1024);
    cp_async16(dst + kPVd, tile + src_d + kTileBytes);
    cp_async16(dst + kPVd + 512, tile + src_d + kTileBytes + 1024);
    cp_async16(dst + kPKs, tile + src_s);
  };

#pragma unroll
  for (int j = 0; j < kStages - 1; ++j) {
    if (j < nmine) issue(j);
    cp_async_commit();
  }

  for (int j = 0; j < nmine; ++j) {
    if (j + kStages - 1 < nmine) issue(j + kStages - 1);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    __syncwarp();

    const uint8_t* Ws = wsmem + (j % kStages) * kPairWarpStage;
    const int nvalid = s_nvalid[rank + j * S];

    // ---- partial S = Q·Kᵀ over this warp's 64 d: 4 n-tiles of 8 keys (column c of n-tile v
    // is key kb+8v+4(c&1)+(c>>1)), 4 k-steps each; lane (g8, tig) dequantizes 16 d of one key
    // (one scale block: 4·hf + tig). Pair-uniform: a pair with no attended key in this block
    // skips the work but not the two CTA barriers (the 64-thread named barriers this exchange
    // needs are not followed by compute-sanitizer's racecheck).
    const bool attended = kb < nvalid;
    float sc[4][4];
    if (attended) {
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const int kl = 8 * v + 4 * (g8 & 1) + (g8 >> 1);
        const uint2 kd = *reinterpret_cast<const uint2*>(Ws + kPKd + kl * 32 + 8 * tig);
        const uint32_t s0 = s_mul[Ws[kPKs + kl * 8 + 4 * hf + tig]];
        const uint32_t s2 = s0 | (s0 << 16);
        uint32_t b[8];
        dequant8<T>(kd.x, s2, b);
        dequant8<T>(kd.y, s2, b + 4);
        sc[v][0] = sc[v][1] = sc[v][2] = sc[v][3] = 0.f;
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          if constexpr (V::kQregs) {
            Traits<T>::mma(sc[v], qreg[s], b[2 * s], b[2 * s + 1]);
          } else {
            const uint4 qv = s_q[hf][s][lane];
            const uint32_t qa[4] = {qv.x, qv.y, qv.z, qv.w};
            Traits<T>::mma(sc[v], qa, b[2 * s], b[2 * s + 1]);
          }
        }
      }
    }
    // ---- the two D halves meet: write mine, read the partner's (one buffer per warp: the
    // first barrier keeps the partner's reads of the last tile before this write)
    __syncthreads();
    if (attended) {
#pragma unroll
      for (int v = 0; v < 4; ++v) xmine[32 * v] = make_float4(sc[v][0], sc[v][1], sc[v][2], sc[v][3]);
    }
    __syncthreads();

    auto process = [&](auto masked_tag) {
      constexpr bool kMasked = decltype(masked_tag)::value;
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const float4 o = xother[32 * v];
        sc[v][0] += o.x;
        sc[v][1] += o.y;
        sc[v][2] += o.z;
        sc[v][3] += o.w;
      }

      online_softmax_lean<kMasked, 8>(sc, acc, m0, m1, l0, l1, zc, kb, nvalid, tig);

      // ---- O += P·V over this warp's 64 d: k-step i covers n-tiles 2i, 2i+1; lane (g8, tig)
      // supplies keys kb+16i+tig, +4 (b0) and +8, +12 (b1); d-tile jd, column g8 is
      // d = 64·hf + 8·g8 + jd (one word of 8 codes per key, scale block 4·hf + g8/2).
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        uint32_t pa[4];
        pa[0] = Traits<T>::pack2(sc[2 * i][0], sc[2 * i][1]);
        pa[1] = Traits<T>::pack2(sc[2 * i][2], sc[2 * i][3]);
        pa[2] = Traits<T>::pack2(sc[2 * i + 1][0], sc[2 * i + 1][1]);
        pa[3] = Traits<T>::pack2(sc[2 * i + 1][2], sc[2 * i + 1][3]);
        uint32_t w[4], smul[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int kl = 16 * i + tig + 4 * q;
          w[q] = *reinterpret_cast<const uint32_t*>(Ws + kPVd + kl * 32 + 4 * g8);
          const uint32_t sm = s_mul[Ws[kPVs + kl * 8 + 4 * hf + (g8 >> 1)]];
          // masked keys: multiplier 0 (codes are finite), so garbage never meets P·V
          if constexpr (kMasked) smul[q] = kb + kl < nvalid ? sm : 0u;
          else smul[q] = sm;
        }
        const uint32_t sab = smul[0] | (smul[1] << 16);
        const uint32_t sce = smul[2] | (smul[3] << 16);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const uint32_t sel = hh ? 0x7632 : 0x5410;
          uint32_t b0[4], b1[4];
          dequant8<T>(prmt(w[0], w[1], sel), sab, b0);
          dequant8<T>(prmt(w[2], w[3], sel), sce, b1);
#pragma unroll
          for (int k = 0; k < 4; ++k) Traits<T>::mma(acc[4 * hh + k], pa, b0[k], b1[k]);
        }
      }
    };
    if (kb + 32 <= nvalid) process(std::false_type{});
    else if (kb < nvalid) process(std::true_type{});
    __syncwarp();
  }
  cp_async_wait<0>();
  __syncthreads();

  // ---- merge: pair wp is partial wp (its two warps hold identical m, l and one D half each)
  l0 = quad_sum(l0);
  l1 = quad_sum(l1);
  const MergeSmem ms(smem);
#pragma unroll
  for (int jd = 0; jd < 8; ++jd) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = g8 + 8 * (e >> 1);
      const int d = 64 * hf + 8 * (2 * tig + (e & 1)) + jd;
      ms.part[(wp * kGroup + h) * kHeadDim + d] = acc[jd][e];
    }
  }
  if (hf == 0 && tig == 0) ms.store_stats(wp, g8, m0, m1, l0, l1);
  __syncthreads();
  merge_and_store<T, V::kBlocks == 2>(p, ms, cluster, t, g, G, (*p.v_scale) * kComp);
}

int num_sms();

// Launches `kernel` (threads per CTA, dynamic shared memory) with `splits` CTAs per (token, KV
// head) forming one cluster. Function attributes are set once per device (not stream work; also
// fine inside graph capture).
template <typename Kernel>
cudaError_t launch_kernel(Kernel kernel, int threads, int smem_bytes, const AttentionParams& p,
                          int splits, cudaStream_t stream, bool* configured) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= 64 || !configured[dev]) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (err != cudaSuccess) return err;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (err != cudaSuccess) return err;
    if (dev >= 0 && dev < 64) configured[dev] = true;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(p.num_tokens * p.num_kv_heads * splits), 1, 1);
  cfg.blockDim = dim3(unsigned(threads), 1, 1);
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(splits);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

template <typename T, typename V, bool kCvt>
cudaError_t launch_typed(const AttentionParams& p, int splits, cudaStream_t stream) {
  static bool configured[64] = {false};
  return launch_kernel(sparse_attention_kernel<T, V, kCvt>, kThreads, V::kSmemBytes, p, splits,
                       stream, configured);
}

template <typename T, typename V>
cudaError_t launch_pair(const AttentionParams& p, int splits, cudaStream_t stream) {
  static bool configured[64] = {false};
  return launch_kernel(sparse_attention_pair_kernel<T, V>, kPairThreads, V::kSmemBytes, p,
                       splits, stream, configured);
}

// variant 1: Variant0, 2: Variant1 (bit-placement dequantization, mma in q's dtype);
// 3: Variant0, 4: Variant1, 5: Variant2 (fp8-conversion dequantization, fp16 mma);
// 6: Variant3 (variant 2 with the older shift/mask bit placement, kept to time the two side by
// side); 7: the pair kernel, 2 CTAs / SM, 8: the pair kernel, 3 CTAs / SM (bit placement);
// 9: Variant4, 10: Variant5 (variants 2, 1 with the lean softmax), 11: Variant4 through the fp8
// conversion.
// 0 (auto), timed on the H200 (BENCHMARKS.md): the pair kernel when fewer than 2 CTAs per SM have
// at most 4 blocks each to attend (small T: latency-bound, the 8 warps finish each tile sooner); otherwise q's dtype
// decides the path — bf16 q keeps bf16 products (no fp16 range limit on q), f16 q takes the
// conversion path — with 4 CTAs / SM and the lean softmax (variants 9, 11) once there are two
// CTAs per SM to run, 3 CTAs / SM (variants 1, 3) below that.
template <typename T>
cudaError_t launch_variant(const AttentionParams& p, int splits, cudaStream_t stream) {
  int v = p.variant;
  if (v == 0) {
    const bool f16 = std::is_same_v<T, __half>;
    const bool big = p.num_tokens * p.num_kv_heads * splits >= 2 * int64_t(num_sms());
    if (!big && (p.topk + splits - 1) / splits <= 4) v = 7;
    else if (big) v = f16 ? 11 : 9;
    else v = f16 ? 3 : 1;
  }
  switch (v) {
    case 1: return launch_typed<T, Variant0, false>(p, splits, stream);
    case 2: return launch_typed<T, Variant1, false>(p, splits, stream);
    case 3: return launch_typed<T, Variant0, true>(p, splits, stream);
    case 4: return launch_typed<T, Variant1, true>(p, splits, stream);
    case 5: return launch_typed<T, Variant2, true>(p, splits, stream);
    case 6: return launch_typed<T, Variant3, false>(p, splits, stream);
    case 7: return launch_pair<T, PairVariant0>(p, splits, stream);
    case 8: return launch_pair<T, PairVariant1>(p, splits, stream);
    case 9: return launch_typed<T, Variant4, false>(p, splits, stream);
    case 10: return launch_typed<T, Variant5, false>(p, splits, stream);
    default: return launch_typed<T, Variant4, true>(p, splits, stream);
  }
}

int num_sms() {
  static int cached[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 132;
  if (cached[dev] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0)
      n = 132;
    cached[dev] = n;
  }
  return cached[dev];
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

int choose_splits(int64_t pairs, int topk) {
  // Enough CTAs to fill the machine (3 CTAs / SM resident), never more splits than top-k slots.
  // Timed on the H200 (BENCHMARKS.md): about half a CTA per SM is the sweet spot for small T;
  // more splits only add merge work once the machine is full.
  const int64_t target = int64_t(num_sms()) / 2;
  int s = 1;
  while (s < kMaxSplits && s < topk && pairs * s < target) s *= 2;
  return s;
}

cudaError_t launch_sparse_attention(const AttentionParams& p, cudaStream_t stream) {
  if (p.num_tokens <= 0 || p.num_kv_heads <= 0) return cudaSuccess;
  if (p.topk < 0 || p.topk > kMaxTopk) return cudaErrorInvalidValue;
  int splits = p.splits > 0 ? p.splits : choose_splits(p.num_tokens * p.num_kv_heads, p.topk);
  if (splits > kMaxSplits || (splits & (splits - 1)) != 0) return cudaErrorInvalidValue;
  if (p.num_tokens * p.num_kv_heads * splits > int64_t(0x7FFFFFFF)) return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kBF16: return launch_variant<__nv_bfloat16>(p, splits, stream);
    case DType::kF16: return launch_variant<__half>(p, splits, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace m3sparse
