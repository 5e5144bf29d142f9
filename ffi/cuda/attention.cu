// Sparse NVFP4 attention for sm_90: sparse_decode (SPEC §5.3) and sparse_prefill (§5.4).
//
// A row (token, KV head) is computed by one fixed reduction tree whatever the launch shape, so its
// bits never depend on T, Hkv or the other rows (batch- and TP-invariant; tests/cuda). The G <= 16
// query heads of a KV head are the rows of every m16n8k16 mma (rows G..15 are zero padding), so
// each dequantized K/V element serves all G heads.
//   1. Threads 0..K-1 check their top-k slot (SPEC §5.2: 0 <= b < max_blocks, 128·b < vis,
//      0 <= block_table[r, b] < P, layer in [0, L)) before anything is loaded, and the valid
//      slots are compacted in shared memory (warp ballots), kept in top-k order.
//      Meanwhile warp 3 loads Q.
//   2. The row's `count` valid entries form 4 rounds of cpr = ceil(count / 4) consecutive entries
//      (round j: [j·cpr, (j+1)·cpr) ∩ [0, count); a fact of the row alone). A leaf (j, q) is the
//      online softmax of warp q over keys [32q, 32q+32) of round j's blocks: fresh state, the same
//      code in every launch shape.
//   3. The K tile and the V tile of a (page, head) are adjacent in the cache (slots 2h, 2h+1):
//      18432 contiguous bytes, streamed with 16-byte cp.async into a ring (each warp its own
//      quarter of every tile pair). Warp q dequantizes K into mma B fragments (device_utils.cuh:
//      exact), computes S = Q·Kᵀ (fp32), masks keys >= vis with a select, runs the base-2 online
//      softmax, dequantizes V (block scale selected to 0 for masked keys, so NaN/garbage never
//      meets the PV product) and accumulates P·V in fp32. The d order inside a k-step and the key
//      order inside an n-tile are permuted (both sides agree) so every lane reads contiguous bytes.
//   4. The 16 leaves are folded left to right in the order (0,0), (0,1), ..., (3,3) into one
//      state R = (m, l, O) by fold_stats / fold_o (explicitly rounded fp32), then
//      out = O / l · v_scale; rows with no attended key write exact zeros.
// Three launch shapes compute that same tree (attention_split() picks one from the grid; none
// changes a bit):
//   - one CTA (4 warps, 2-stage ring, 4 CTAs/SM) per row: warp q computes its leaves of rounds
//     0..3 in turn and folds each into R in shared memory, the warps one after another in the
//     order above (CTA barriers between the folds);
//   - a cluster of C = 4 or 2 CTAs per row (small and middle batches): CTA c computes the 4 leaves
//     of each of rounds [c·4/C, (c+1)·4/C) (4-stage ring: a round's blocks all in flight at once)
//     and keeps them in shared memory; after a cluster barrier every CTA folds 1/C of the
//     elements of all 16 leaves, read through distributed shared memory, in the same order with
//     the same functions.
// No global workspace: CUDA-graph safe. The softmax is the lean one: the scale is folded into the
// exp2 and the running max moves only when a row's maximum exceeds it by more than kLazy.
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
constexpr float kLog2e = 1.4426950408889634f;
// One fp32 state (m, l, O) of 16 rows x 128 d in the mma fragment layout: float4 [jd][lane]
// (lane (g8, tig) of any warp: acc[jd][0..3]), then m[16], l[16] (kStateFloats, the header).
constexpr int kStateBytes = kStateFloats * 4;  // 8320
// one CTA per row: 4 CTAs per SM (16 warps), a 2-stage ring plus R
constexpr int kMinBlocks = 4;
constexpr int kStagesRow = 2;
constexpr int kSmemRow = kStagesRow * kStageBytes + kStateBytes;
// full_attention, one CTA per row: a second state after R, the fold of the row's parts
constexpr int kSmemFull = kSmemRow + kStateBytes;
// cluster of C: a 4-stage ring (a round's 4 blocks in flight at once); each warp's leaf of the
// CTA's last round reuses its own ring slice, the leaves of its earlier rounds (C = 2: one) sit
// after the ring (C = 2: 107 KB, still 2 CTAs per SM)
constexpr int kStagesSplit = 4;
constexpr int smem_split(int cluster) {
  return kStagesSplit * kStageBytes + (kRounds / cluster - 1) * kWarps * kStateBytes;
}
static_assert(kStagesSplit * kStageBytes / kWarps >= kStateBytes, "leaf fits a warp's slice");
static_assert(kRounds % 2 == 0, "clusters of 2 and kRounds");

static_assert(kHeadDim == 128 && kBlockSize == 128 && kGroup == 16, "kernel geometry");

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
                                             int K, int64_t bsel, int64_t* s_off, int* s_nvalid,
                                             uint32_t* s_mask) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  bool ok = false;
  int nv = 0;
  int64_t off = 0;
  if (tid < K && tp.vis > 0) {
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

// Q A-fragments of one lane (rows >= G are zeros): register j = 4W + k (W < kWords) holds
// d = d0 + 8W + k (lo) and d + 4 (hi), the order of the K fragments; sq[s * 32 + lane] gets the
// 4 registers of k-step s. kCvt: fp16 pairs in dequant8_cvt's order. `flip` is xor-ed into
// every register (0x80008000: the sign of a negative softmax scale, folded into Q).
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

// The lean online softmax of one 32-key slice (sc: raw scores of 4
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

// A row's sum over the 4 lanes of its quad (the lanes that hold its columns).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
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

// Output element k (0..2047) of a state in fragment layout (float4 [jd][lane], element e):
// its row h and d (kCvt: the V fragments' d permutation).
template <bool kCvt>
__device__ __forceinline__ void state_elem(int k, int& h, int& d) {
  const int jd = k >> 7, lane = (k >> 2) & 31, e = k & 3;
  h = (lane >> 2) + 8 * (e >> 1);
  const int dj = kCvt ? 8 * (jd / 8) + cvt_elem(jd % 8) : jd;
  d = 16 * (2 * (lane & 3) + (e & 1)) + dj;
}

// out = O / l · vsc (vsc: v_scale times the dequantization power of two); 0 where l == 0.
template <typename T>
__device__ __forceinline__ uint16_t final_value(float O, float L, float vsc) {
  return Traits<T>::from_float(L == 0.f ? 0.f : __fmul_rn(__fdiv_rn(O, L), vsc));
}

// Where a cluster CTA keeps warp q's leaf of its round `slot` (0 .. kRounds / kCluster - 1): the
// last round's in the warp's ring slice, earlier rounds' after the ring.
template <int kCluster>
__device__ __forceinline__ float* leaf_state(uint8_t* smem, int slot, int q) {
  constexpr int kLast = kRounds / kCluster - 1;
  uint8_t* const at = slot == kLast
                          ? smem + q * (kStagesSplit * kStageBytes / kWarps)
                          : smem + kStagesSplit * kStageBytes + (slot * kWarps + q) * kStateBytes;
  return reinterpret_cast<float*>(at);
}

// Row h of element k of a state in fragment layout (state_elem's h).
__device__ __forceinline__ int state_row(int k) {
  return (((k >> 2) & 31) >> 2) + 8 * ((k & 3) >> 1);
}

// The full_attention parts of a row attending keys [0, vis).
__device__ __forceinline__ int64_t full_parts_of_row(int64_t vis, int part_blocks) {
  const int64_t blocks = (vis + kBlockSize - 1) / kBlockSize;
  return (blocks + part_blocks - 1) / part_blocks;
}

// T: q/out dtype. kCvt: dequantize through the fp8 conversion (fp16 mma, Q converted to fp16);
// otherwise through the bit placement of device_utils.cuh (mma in T). kCluster: 1, one CTA per
// row; 2 or kRounds, a cluster of that many CTAs per row, CTA c computing kRounds / kCluster
// consecutive rounds. kFull (kCluster 1 only): full_attention, the row's parts in turn (R2 <-
// R2 ⊕ part state, then out from R2), or with p.full_parts > 0 part blockIdx.y alone, its state
// written to the workspace for full_merge_kernel.
template <typename T, bool kCvt, int kCluster, bool kFull = false>
__global__ void __launch_bounds__(kThreads, kCluster > 1 ? 1 : kMinBlocks)
    sparse_attention_kernel(const AttentionParams p) {
  static_assert(!kFull || kCluster == 1, "full_attention: one CTA per row or per part");
  constexpr bool kSplitted = kCluster > 1;
  constexpr int kRoundsPerCta = kRounds / kCluster;
  using C = std::conditional_t<kCvt, __half, T>;  // mma / P dtype
  constexpr int kStages = kSplitted ? kStagesSplit : kStagesRow;
  constexpr float kComp = kCvt ? kCvtComp : Traits<T>::kComp;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int64_t s_off[kMaxTopk];
  __shared__ uint32_t s_mask[2];   // ballots of the valid slots 0..31, 32..63
  __shared__ int s_nvalid[kMaxTopk];
  __shared__ uint16_t s_mul[256];  // E4M3 byte -> packed multiplier (device_utils.cuh)
  __shared__ uint4 s_q[8][32];     // Q A-fragments per k-step and lane (all warps share them)

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g8 = lane >> 2;   // mma groupID
  const int tig = lane & 3;   // thread in group

  const int rank = int(blockIdx.x % kCluster);  // = the cluster rank
  const int64_t pair = int64_t(blockIdx.x) / kCluster;
  const int Hkv = p.num_kv_heads;
  const int64_t t = pair / Hkv;
  const int g = int(pair % Hkv);
  const int K = kFull ? p.full_part : p.topk;
  const int G = p.group > 0 ? p.group : kGroup;
  // The selected block id does not depend on the position: load it first (one fewer
  // dependent round trip before the block-table read).
  const int64_t bsel0 =
      (!kFull && tid < K) ? int64_t(p.topk_indices[(int64_t(g) * p.num_tokens + t) * K + tid])
                          : -1;
  const TokenPos tp = token_position(p, t);
  // the parts this CTA computes: sparse, one (the top-k list); full, the row's parts or one
  int64_t part0 = 0, part1 = 1;
  if constexpr (kFull) {
    const int64_t parts = full_parts_of_row(tp.vis, K);
    if (p.full_parts > 0) {
      part0 = blockIdx.y;
      part1 = part0 + 1;
      if (part0 >= parts) return;  // the merge reads parts [0, parts) only
    } else {
      part1 = parts;
    }
  }

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
  const float zc = fabsf(zs);
  const int Hq = Hkv * G;
  if (warp == kWarps - 1)
    build_q_frags<T, kCvt, 4>(static_cast<const uint16_t*>(p.q) + ((t * Hq + int64_t(g) * G) * kHeadDim),
                              G, lane, 32 * tig, zs < 0.f ? 0x80008000u : 0u, &s_q[0][0]);

  // one CTA per row: R (the fold's state, after the ring) starts empty; full: R2 too
  float* const R = reinterpret_cast<float*>(smem + kStagesRow * kStageBytes);
  float* const R2 = R + kStateFloats;
  auto clear_state = [&](float* S) {
    for (int i = tid; i < kGroup * kHeadDim; i += kThreads) S[i] = 0.f;
    if (tid < kGroup) {
      S[kGroup * kHeadDim + tid] = -INFINITY;
      S[kGroup * kHeadDim + kGroup + tid] = 0.f;
    }
  };
  if (kFull && p.full_parts == 0) clear_state(R2);  // (compact_slots' barriers publish it)
  for (int64_t part = part0; part < part1; ++part) {
  if constexpr (!kSplitted) clear_state(R);
  const int64_t bsel = kFull ? (tid < K ? part * K + tid : -1) : bsel0;
  const int count = compact_slots(p, tp, g, K, bsel, s_off, s_nvalid, s_mask);  // (barriers)
  const int cpr = (count + kRounds - 1) / kRounds;  // entries per round
  const int jbeg = rank * kRoundsPerCta, jend = jbeg + kRoundsPerCta;
  const int e0 = min(count, jbeg * cpr), e1 = min(count, jend * cpr);  // this CTA's entries

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
  auto issue = [&](int e) {
    if (kb >= s_nvalid[e]) return;  // none of this warp's keys is attended in that block
    const uint8_t* tile = cache + s_off[e];
    uint8_t* dst = wsmem + ((e - e0) % kStages) * kWarpStage;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      cp_async16(dst + 16 * lane + 512 * i, tile + src_d + 512 * i);
      cp_async16(dst + kVd + 16 * lane + 512 * i, tile + src_d + kTileBytes + 512 * i);
    }
    cp_async16(dst + dst_s, tile + src_s);
  };

#pragma unroll
  for (int j = 0; j < kStages - 1; ++j) {
    if (e0 + j < e1) issue(e0 + j);
    cp_async_commit();
  }

  int e = e0;
  for (int jr = jbeg; jr < jend; ++jr) {
  const int ehi = min(count, (jr + 1) * cpr);
  for (; e < ehi; ++e) {
    if (e + kStages - 1 < e1) issue(e + kStages - 1);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    __syncwarp();

    const uint8_t* Ws = wsmem + ((e - e0) % kStages) * kWarpStage;
    const int nvalid = s_nvalid[e];

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
            dequant8<T>(kd.x, s0x2, b[u] + 0);
            dequant8<T>(kd.y, s0x2, b[u] + 4);
            dequant8<T>(kd.z, s1x2, b[u] + 8);
            dequant8<T>(kd.w, s1x2, b[u] + 12);
          }
        }
#pragma unroll
        for (int s = 0; s < 8; ++s) {
          const uint4 qv = s_q[s][lane];
          const uint32_t qa[4] = {qv.x, qv.y, qv.z, qv.w};
          Traits<C>::mma(sc[vp], qa, b[0][2 * s], b[0][2 * s + 1]);
          Traits<C>::mma(sc[vp + 1], qa, b[1][2 * s], b[1][2 * s + 1]);
        }
      }

      online_softmax_lean<kMasked, 16>(sc, acc, m0, m1, l0, l1, zc, kb, nvalid, tig);

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
            dequant8<T>(prmt(wa, wb, sel), sab, b0);
            dequant8<T>(prmt(wc, we, sel), sce, b1);
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
  // ---- leaf (jr, warp) is complete: fold it (one CTA) or keep it (split)
  l0 = quad_sum(l0);
  l1 = quad_sum(l1);
  if constexpr (!kSplitted) {
    // R <- R ⊕ leaf, warp after warp (CTA barriers between the folds)
    for (int w = 0; w < kWarps; ++w) {
    if (warp == w) {
    float4* Ro = reinterpret_cast<float4*>(R);
    float* Rm = R + kGroup * kHeadDim;
    float* Rl = Rm + kGroup;
    float n0, n1, L0, L1, fR0, fL0, fR1, fL1;
    fold_stats(Rm[g8], Rl[g8], m0, l0, n0, L0, fR0, fL0);
    fold_stats(Rm[g8 + 8], Rl[g8 + 8], m1, l1, n1, L1, fR1, fL1);
#pragma unroll
    for (int jd = 0; jd < 16; ++jd) {
      float4 r = Ro[jd * 32 + lane];
      r.x = fold_o(r.x, acc[jd][0], fR0, fL0);
      r.y = fold_o(r.y, acc[jd][1], fR0, fL0);
      r.z = fold_o(r.z, acc[jd][2], fR1, fL1);
      r.w = fold_o(r.w, acc[jd][3], fR1, fL1);
      Ro[jd * 32 + lane] = r;
    }
    __syncwarp();
    if (tig == 0) {
      Rm[g8] = n0;
      Rm[g8 + 8] = n1;
      Rl[g8] = L0;
      Rl[g8 + 8] = L1;
    }
    }
    __syncthreads();
    }
  } else {
    // the leaf into its slot: the CTA's last round into this warp's own ring slice (its copies
    // are complete), an earlier round after the ring (the next round's copies are in flight)
    const int slot = jr - jbeg;
    if (slot == kRoundsPerCta - 1) cp_async_wait<0>();
    __syncwarp();
    float* const leaf = leaf_state<kCluster>(smem, slot, warp);
    float4* Lo = reinterpret_cast<float4*>(leaf);
    float* Lm = leaf + kGroup * kHeadDim;
#pragma unroll
    for (int jd = 0; jd < 16; ++jd)
      Lo[jd * 32 + lane] = make_float4(acc[jd][0], acc[jd][1], acc[jd][2], acc[jd][3]);
    if (tig == 0) {
      Lm[g8] = m0;
      Lm[g8 + 8] = m1;
      Lm[kGroup + g8] = l0;
      Lm[kGroup + g8 + 8] = l1;
    }
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  m0 = m1 = -INFINITY;
  l0 = l1 = 0.f;
  }  // rounds
  cp_async_wait<0>();
  if constexpr (kFull) {
    // R holds the part's state (the last fold ended with a barrier)
    if (p.full_parts > 0) {
      float* ws = p.workspace +
                  ((int64_t(g) * p.num_tokens + t) * p.full_parts + part) * kStateFloats;
      for (int i = tid; i < kStateFloats; i += kThreads) ws[i] = R[i];
    } else {
      // R2 <- R2 ⊕ R: every element with its row's factors, then the rows' statistics
      const float* Rm = R + kGroup * kHeadDim;
      float* R2m = R2 + kGroup * kHeadDim;
      for (int k = tid; k < kGroup * kHeadDim; k += kThreads) {
        const int h = state_row(k);
        float m, l, fR, fL;
        fold_stats(R2m[h], R2m[kGroup + h], Rm[h], Rm[kGroup + h], m, l, fR, fL);
        R2[k] = fold_o(R2[k], R[k], fR, fL);
      }
      __syncthreads();
      if (tid < kGroup) {
        float m, l, fR, fL;
        fold_stats(R2m[tid], R2m[kGroup + tid], Rm[tid], Rm[kGroup + tid], m, l, fR, fL);
        R2m[tid] = m;
        R2m[kGroup + tid] = l;
      }
    }
    __syncthreads();
  }
  }  // parts
  if (kFull && p.full_parts > 0) return;  // full_merge_kernel writes out

  const float vsc = (*p.v_scale) * kComp;
  uint16_t* out = static_cast<uint16_t*>(p.out) + ((t * Hq + int64_t(g) * G) * kHeadDim);
  if constexpr (!kSplitted) {
    // R holds all 16 leaves (the last fold ended with a barrier); full: R2 all parts
    const float* S = kFull ? R2 : R;
    const float* Sl = S + kGroup * kHeadDim + kGroup;
    for (int k = tid; k < kGroup * kHeadDim; k += kThreads) {
      int h, d;
      state_elem<kCvt>(k, h, d);
      if (h < G) out[h * kHeadDim + d] = final_value<T>(S[k], Sl[h], vsc);
    }
  } else {
    // ---- the fold of the cluster's 16 leaves: CTA `rank` takes the float4s
    // [rank·512/C, (rank+1)·512/C), thread tid every 128th of them: all of one fragment lane
    // (rows ra = lane/4 and rb = ra + 8). Every leaf's values are loaded (DSMEM) before the
    // fold's dependent chain starts, and the row statistics' chain (max, factors, sum) runs once
    // for all of a thread's float4s: the same operations on the same values as one chain per
    // element, so the same bits.
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    constexpr int kLeaves = kRounds * kWarps;
    constexpr int kF4 = kGroup * kHeadDim / 4 / kCluster;  // float4s per CTA
    static_assert(kF4 % kThreads == 0, "whole float4s per thread");
    const float* leaf[kLeaves];
#pragma unroll
    for (int i = 0; i < kLeaves; ++i)  // leaf (j, q) = i: round j, warp q
      leaf[i] = cluster.map_shared_rank(
          leaf_state<kCluster>(smem, (i / kWarps) % kRoundsPerCta, i % kWarps),
          (i / kWarps) / kRoundsPerCta);
    const int ra = (tid & 31) >> 2, rb = ra + 8;
    float st[kLeaves][4];  // (m, l) of rows ra, rb
#pragma unroll
    for (int i = 0; i < kLeaves; ++i) {
      const float* Lm = leaf[i] + kGroup * kHeadDim;
      st[i][0] = Lm[ra];
      st[i][1] = Lm[kGroup + ra];
      st[i][2] = Lm[rb];
      st[i][3] = Lm[kGroup + rb];
    }
    float fac[kLeaves][4];  // fR, fL of row ra, then of row rb, at each step
    float mA = -INFINITY, lA = 0.f, mB = -INFINITY, lB = 0.f;
#pragma unroll
    for (int i = 0; i < kLeaves; ++i) {
      fold_stats(mA, lA, st[i][0], st[i][1], mA, lA, fac[i][0], fac[i][1]);
      fold_stats(mB, lB, st[i][2], st[i][3], mB, lB, fac[i][2], fac[i][3]);
    }
    // No CTA may leave while the others read its leaves: every thread arrives at the cluster
    // barrier right after its last DSMEM read and waits for the others only before it exits,
    // so the barrier's latency overlaps the fold's arithmetic and the stores.
    constexpr int kIters = kF4 / kThreads;
#pragma unroll 1
    for (int it = 0; it < kIters; ++it) {
      const int f4 = rank * kF4 + tid + it * kThreads;  // [jd][lane]
      float4 L[kLeaves];
#pragma unroll
      for (int i = 0; i < kLeaves; ++i) L[i] = reinterpret_cast<const float4*>(leaf[i])[f4];
      if (it == kIters - 1) cluster.barrier_arrive();
      float ov[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int i = 0; i < kLeaves; ++i) {
        ov[0] = fold_o(ov[0], L[i].x, fac[i][0], fac[i][1]);
        ov[1] = fold_o(ov[1], L[i].y, fac[i][0], fac[i][1]);
        ov[2] = fold_o(ov[2], L[i].z, fac[i][2], fac[i][3]);
        ov[3] = fold_o(ov[3], L[i].w, fac[i][2], fac[i][3]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int h, d;
        state_elem<kCvt>(4 * f4 + e, h, d);
        if (h < G) out[h * kHeadDim + d] = final_value<T>(ov[e], e < 2 ? lA : lB, vsc);
      }
    }
    cluster.barrier_wait();
  }
}

// full_attention's merge (full_parts > 0): row (t, g) is the left fold of its parts' states in
// part order, element by element with the same fold_stats / fold_o as the one-CTA-per-row fold,
// so both launch shapes give the same bits. Grid (rows, kMergeSlices): a CTA takes 1/16 of the
// row's 2048 state elements, a thread one element; the parts' values do not depend on the fold,
// so their loads run ahead of it.
constexpr int kMergeSlices = kGroup * kHeadDim / kThreads;  // 16
template <typename T, bool kCvt>
__global__ void __launch_bounds__(kThreads) full_merge_kernel(const AttentionParams p) {
  const int64_t pair = blockIdx.x;
  const int Hkv = p.num_kv_heads;
  const int64_t t = pair / Hkv;
  const int g = int(pair % Hkv);
  const int G = p.group > 0 ? p.group : kGroup;
  const int k = int(blockIdx.y) * kThreads + threadIdx.x;
  int h, d;
  state_elem<kCvt>(k, h, d);
  if (h >= G) return;
  const int64_t parts = full_parts_of_row(token_position(p, t).vis, p.full_part);
  const float* ws = p.workspace + (int64_t(g) * p.num_tokens + t) * p.full_parts * kStateFloats;
  constexpr float kComp = kCvt ? kCvtComp : Traits<T>::kComp;
  float m = -INFINITY, l = 0.f, o = 0.f;
#pragma unroll 8
  for (int64_t i = 0; i < parts; ++i) {
    const float* S = ws + i * kStateFloats;
    float fR, fL;
    fold_stats(m, l, S[kGroup * kHeadDim + h], S[kGroup * kHeadDim + kGroup + h], m, l, fR, fL);
    o = fold_o(o, S[k], fR, fL);
  }
  uint16_t* out = static_cast<uint16_t*>(p.out) + ((t * Hkv * G + int64_t(g) * G) * kHeadDim);
  out[h * kHeadDim + d] = final_value<T>(o, l, (*p.v_scale) * kComp);
}

struct DeviceInfo {
  bool configured = false;
  int num_sms = 0;
};

// The number of SMs of the current device, and the kernels' shared-memory limits raised once per
// device (not stream work; also fine inside graph capture).
template <typename T, bool kCvt>
cudaError_t configure(int* num_sms) {
  static DeviceInfo info[64];
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= 64) return cudaErrorInvalidDevice;
  if (!info[dev].configured) {
    err = cudaFuncSetAttribute(sparse_attention_kernel<T, kCvt, 1>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemRow);
    if (err == cudaSuccess)
      err = cudaFuncSetAttribute(sparse_attention_kernel<T, kCvt, 2>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, smem_split(2));
    if (err == cudaSuccess)
      err = cudaFuncSetAttribute(sparse_attention_kernel<T, kCvt, kRounds>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, smem_split(kRounds));
    if (err == cudaSuccess)
      err = cudaFuncSetAttribute(sparse_attention_kernel<T, kCvt, 1, true>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemFull);
    if (err == cudaSuccess)
      err = cudaDeviceGetAttribute(&info[dev].num_sms, cudaDevAttrMultiProcessorCount, dev);
    if (err != cudaSuccess) return err;
    info[dev].configured = true;
  }
  *num_sms = info[dev].num_sms;
  return cudaSuccess;
}

// Launches for q's dtype: bf16 q keeps bf16 products through the bit placement (no fp16 range
// limit on q); f16 q takes the fp8-conversion path with fp16 products.
template <typename T>
cudaError_t launch_typed(const AttentionParams& p, cudaStream_t stream) {
  constexpr bool kCvt = std::is_same_v<T, __half>;
  int num_sms = 0;
  cudaError_t err = configure<T, kCvt>(&num_sms);
  if (err != cudaSuccess) return err;
  const int64_t rows = p.num_tokens * p.num_kv_heads;
  if (p.full) {
    if (p.full_parts > 0) {
      const dim3 grid(unsigned(rows), unsigned(p.full_parts));
      // a CTA per part: no R2, so the row kernel's 4 CTAs per SM
      sparse_attention_kernel<T, kCvt, 1, true><<<grid, kThreads, kSmemRow, stream>>>(p);
      err = cudaGetLastError();
      if (err != cudaSuccess) return err;
      full_merge_kernel<T, kCvt><<<dim3(unsigned(rows), kMergeSlices), kThreads, 0, stream>>>(p);
    } else {
      sparse_attention_kernel<T, kCvt, 1, true><<<unsigned(rows), kThreads, kSmemFull, stream>>>(p);
    }
    return cudaGetLastError();
  }
  const int cluster = attention_split(p, num_sms);
  if (cluster == 1) {
    sparse_attention_kernel<T, kCvt, 1><<<unsigned(rows), kThreads, kSmemRow, stream>>>(p);
    return cudaGetLastError();
  }
  ClusterLaunch launch(unsigned(rows * cluster), kThreads, smem_split(cluster), unsigned(cluster),
                       stream);
  const cudaLaunchConfig_t& cfg = launch.cfg;
  return cluster == 2 ? cudaLaunchKernelEx(&cfg, sparse_attention_kernel<T, kCvt, 2>, p)
                      : cudaLaunchKernelEx(&cfg, sparse_attention_kernel<T, kCvt, kRounds>, p);
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

// The launch shapes a caller may force through AttentionParams::split (CTAs per row).
static bool forced_shape(int split) { return split == 1 || split == 2 || split == kRounds; }

int attention_split(const AttentionParams& p, int num_sms) {
  if (forced_shape(p.split)) return p.split;
  // the widest cluster whose CTAs fit one wave at 2 per SM (H200: 4 while T·Hkv <= 66, 2 while
  // T·Hkv <= 132); past that one CTA per row, at up to 4 per SM
  const int64_t rows = p.num_tokens * p.num_kv_heads;
  for (int c : {kRounds, 2})
    if (rows * c <= 2 * int64_t(num_sms)) return c;
  return 1;
}

cudaError_t launch_sparse_attention(const AttentionParams& p, cudaStream_t stream) {
  if (p.num_tokens <= 0 || p.num_kv_heads <= 0) return cudaSuccess;
  if (!p.full && (p.topk < 0 || p.topk > kMaxTopk)) return cudaErrorInvalidValue;
  if (p.full && (p.full_part < 1 || p.full_part > kMaxTopk || p.full_parts < 0 ||
                 p.full_parts > 65535 ||
                 (p.full_parts > 0 && (p.workspace == nullptr ||
                                       p.full_parts < full_parts_of(p.max_blocks, p.full_part)))))
    return cudaErrorInvalidValue;
  if (p.num_tokens * p.num_kv_heads > int64_t(0x7FFFFFFF) / kRounds) return cudaErrorInvalidValue;
  if (p.split != 0 && !forced_shape(p.split)) return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kBF16: return launch_typed<__nv_bfloat16>(p, stream);
    case DType::kF16: return launch_typed<__half>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace m3sparse
