// Indexer block selection for sm_90: select_blocks (SPEC §8), one fused kernel, no global
// workspace (CUDA-graph safe: the handler allocates nothing, reads nothing on the host).
//
// Work mapping. The q-rows u = t·Hkv + g (token t, KV head g) of the batch are cut into pieces:
// a piece is a maximal range of consecutive q-rows whose tokens belong to one run (consecutive
// tokens with the same query_req_id: a prefill chunk, a request's MTP rows) and that does not
// cross a multiple of `rows_per_piece` (32 q-rows, fewer when the block table is very wide). A
// piece's keys are the blocks its rows can see; they are read once for all its rows.
// A persistent grid of clusters of kCluster = 8 CTAs walks the pieces round robin (cluster c
// takes pieces c, c + #clusters, ...): the CTAs of a cluster split the piece's blocks (CTA j takes
// blocks b ≡ j mod 8, its warp w those with b / 8 ≡ w mod 8), so one request and 128 requests
// both spread over the whole GPU, and the block scores of a piece stay in the cluster's shared
// memory (distributed shared memory), never in global memory. A piece of fewer blocks than the
// cluster's 64 warps (short context: 16 blocks at 2k) splits each block over S warps (step 3).
//   1. Every CTA lists the cluster's pieces itself (a block-wide scan over query_req_id; no host
//      sync, no pre-pass kernel): the piece starts are the q-rows where a run starts or a
//      multiple of rows_per_piece falls.
//   2. Per piece, the CTA stages the rows' q in shared memory as mma B fragments: a bf16 q
//      as is, an fp32 q as three bf16 parts hi + mid + lo, which sum to q exactly (FP8 keys: the
//      same in f16, after scaling each row's q by a power of two that puts its largest |q| in
//      [2^14, 2^15), which ranks the blocks the same; row_scales); and each row's
//      position (−1 for a padding row: request outside [0, R), position < 0, layer outside
//      [0, L), SPEC §8 step 1). The piece's blocks are [0, min(max pos // N, M − 1)].
//   3. A warp reads the pages of its blocks 32 at a time (one lane each) before any key load; a
//      block whose page is outside [0, P) scores −inf and is never read. It streams the others in
//      units of 4 KB of keys (16 bf16 keys or 32 E4M3 keys of 128 dims) straight from global
//      memory into registers (16-byte loads, 64 contiguous bytes per 4 lanes, the next unit in
//      flight while the current one is computed). The keys are the A operand of
//      m16n8k16 mma, bf16 (FP8 keys: f16, each pair of E4M3 bytes widened exactly by one
//      cvt, NaN kept), the rows' q the B operand; the dims are permuted inside a
//      k-step the same way on both sides, so each lane loads contiguous bytes. fp32 accumulation,
//      one accumulator per q part, score = hi + (mid + lo). Each key's dot product is the same
//      instruction sequence whichever tile, piece, batch or page it is in (SPEC §8 step 6).
//      Keys past a row's position are masked by a select to −inf, a NaN dot product is dropped by
//      fmaxf, and the block maximum is kept per lane and reduced over the lanes at the block end:
//      the scores [block slot][row] land in the CTA's shared memory.
//      Split: S warps per block, S the largest power of two <= 8 with S · ceil(nb / 8) <= 8 (a
//      CTA's blocks fit its warps) and S <= the block's units, chosen per piece from its block
//      count nb (the same for all its blocks). Warp w takes block slot w / S and units w % S,
//      w % S + S, ... of it (a unit count that is no multiple of S leaves some warps one unit
//      fewer), reduces them to its partial maxima [warp][row] in shared memory (an invalid page:
//      −inf), and after a CTA barrier the block's score is the fmaxf of its S parts. A max is
//      exact in any order, so the ids do not depend on S (−0 and +0 tie in step 4; no part is
//      NaN); S = 1 is the loop above, one warp per block.
//   4. Cluster barrier; then every row is finished by one warp of the cluster (reading the
//      scores through distributed shared memory): its local blocks first in ascending id, then
//      rounds of warp argmax over the other candidates with a finite score, order (score desc,
//      id asc): redux.sync max of an order-preserving key, then min of the id among the lanes
//      holding it (−0 counts as +0); a lane keeps up to 8 candidates in registers (beyond 256
//      candidates it rereads the scores after the previous pick). −1 after. Cluster barrier
//      before the shared memory is reused for the next piece.
// A row's ids depend only on its own q, position, request's pages and keys: the score of a block
// is a max (exact) of dot products whose order is fixed, and the ranking is exact.
#include <cooperative_groups.h>
#include <cub/block/block_scan.cuh>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "device_utils.cuh"
#include "m3sparse_cuda.h"

namespace cg = cooperative_groups;

namespace m3sparse {
namespace cuda {
namespace {

constexpr int kCluster = 8;                 // CTAs per cluster
constexpr int kWarpsSel = 8;                // warps per CTA
constexpr int kThreadsSel = kWarpsSel * 32;
constexpr int kMaxTiles = 4;                // n-tiles of 8 q-rows: at most 32 rows per piece
constexpr int kScanTokens = 8;              // tokens per thread per scan round
constexpr float kNegInf = -INFINITY;

// Shared-memory layout of one launch (host and device compute it the same way).
struct SelectLayout {
  int rows_per_piece;   // multiple of 8, <= 64
  int parts;            // q parts: 1 (bf16 q) or 3 (fp32 q)
  int slots;            // ceil(M / kCluster): block slots per CTA
  int piece_cap;        // pieces per cluster at most
  int q_bytes, pos_off, part_off, score_off, piece_off, total;
};

__host__ __device__ inline SelectLayout make_layout(int rows_per_piece, int parts, int head_dim,
                                                    int64_t max_blocks, int piece_cap) {
  SelectLayout l;
  l.rows_per_piece = rows_per_piece;
  l.parts = parts;
  l.slots = int((max_blocks + kCluster - 1) / kCluster);
  l.piece_cap = piece_cap;
  l.q_bytes = rows_per_piece * parts * head_dim * 2;
  l.pos_off = l.q_bytes;
  l.part_off = l.pos_off + rows_per_piece * 4;   // split blocks: the warps' partial maxima
  l.score_off = l.part_off + kWarpsSel * rows_per_piece * 4;
  l.piece_off = l.score_off + l.slots * rows_per_piece * 4;
  l.total = l.piece_off + 2 * piece_cap * 4;
  return l;
}

__device__ __forceinline__ uint4 load_stream(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Four E4M3 bytes -> two f16x2 words (bytes 0, 1 -> lo; 2, 3 -> hi), exactly: every E4M3 value
// (subnormals included) is an f16 normal, and the two NaN codes become f16 NaNs. One conversion
// instruction per two keys (sm_89+), where widening to bf16 took about seven integer ones.
__device__ __forceinline__ void e4m3x4_to_f16(uint32_t w, uint32_t* lo, uint32_t* hi) {
  asm("{.reg .b16 l, h;\n\t"
      "mov.b32 {l, h}, %2;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, l;\n\t"
      "cvt.rn.f16x2.e4m3x2 %1, h;}"
      : "=r"(*lo), "=r"(*hi)
      : "r"(w));
}

// ---- step 1: the cluster's pieces


// Piece starts inside token t: its first q-row if a run starts there or a multiple of rp falls
// on it, and the multiples of rp strictly inside its Hkv q-rows.
__device__ __forceinline__ int starts_in_token(bool run_start, int64_t t, int hkv, int rp) {
  const int64_t u = t * hkv;
  const int64_t inner = (u + hkv - 1) / rp - u / rp;  // multiples of rp in (u, u + hkv)
  return int(run_start || u % rp == 0) + int(inner);
}

// Lists the pieces of cluster `cid` (of `ncl`) into s_start / s_end; returns how many.
__device__ int list_pieces(const SelectParams& p, const SelectLayout& l, int cid, int ncl,
                           int32_t* s_start, int32_t* s_end) {
  using Scan = cub::BlockScan<int, kThreadsSel>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int s_carry;
  const int tid = threadIdx.x;
  const int hkv = p.num_kv_heads, rp = l.rows_per_piece;
  const int64_t T = p.num_tokens;
  const int32_t rows = int32_t(T * hkv);
  for (int i = tid; i < l.piece_cap; i += kThreadsSel) s_end[i] = rows;
  if (tid == 0) s_carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < T; base += int64_t(kThreadsSel) * kScanTokens) {
    const int64_t t0 = base + int64_t(tid) * kScanTokens;
    int32_t req[kScanTokens + 1];
#pragma unroll
    for (int e = 0; e <= kScanTokens; ++e) {
      const int64_t t = t0 - 1 + e;
      req[e] = (t >= 0 && t < T) ? p.query_req_id[t] : 0;
    }
    int cnt = 0;
#pragma unroll
    for (int e = 0; e < kScanTokens; ++e) {
      const int64_t t = t0 + e;
      if (t < T) cnt += starts_in_token(t == 0 || req[e + 1] != req[e], t, hkv, rp);
    }
    int rank;
    Scan(scan_tmp).ExclusiveSum(cnt, rank);
    rank += s_carry;
#pragma unroll
    for (int e = 0; e < kScanTokens; ++e) {
      const int64_t t = t0 + e;
      if (t >= T) break;
      const int64_t u = t * hkv;
      const bool first = t == 0 || req[e + 1] != req[e] || u % rp == 0;
      for (int64_t m = first ? u : (u / rp + 1) * rp; m < u + hkv; m = (m / rp + 1) * rp) {
        if (rank % ncl == cid) s_start[rank / ncl] = int32_t(m);
        if (rank >= 1 && (rank - 1) % ncl == cid) s_end[(rank - 1) / ncl] = int32_t(m);
        ++rank;
      }
    }
    __syncthreads();  // every thread has read s_carry
    if (tid == kThreadsSel - 1) s_carry = rank;
    __syncthreads();
  }
  const int total = s_carry;
  return total > cid ? (total - cid + ncl - 1) / ncl : 0;
}

// ---- step 3: the scores of a warp's blocks

template <int DI, bool FP8>
struct KeyUnit {
  static constexpr int kKeys = FP8 ? 32 : 16;          // keys per 4 KB unit (DI = 128)
  static constexpr int kBytes = kKeys * DI * (FP8 ? 1 : 2);
  static constexpr int kLoads = DI / 16;                // uint4 per lane
  static constexpr int kSteps = DI / 16;                // mma k-steps
  static constexpr int kSub = FP8 ? 2 : 1;              // 16-key m-tiles per unit

  // lane (g, t) loads rows g, g + 8 of each m-tile, chunks 4j + t (64 contiguous bytes per row
  // and load across the 4 lanes of a row)
  __device__ __forceinline__ static void load(uint4* raw, const uint8_t* unit, int lane) {
    const int g = lane >> 2, t = lane & 3;
    constexpr int kRowBytes = DI * (FP8 ? 1 : 2);
    constexpr int kChunks = kRowBytes / 64;             // 16-byte loads per lane per row
#pragma unroll
    for (int s = 0; s < kSub; ++s)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < kChunks; ++j)
          raw[(s * 2 + h) * kChunks + j] =
              load_stream(unit + (16 * s + g + 8 * h) * kRowBytes + (4 * j + t) * 16);
  }

  // A fragment (a0..a3) of m-tile s, k-step ks: ks = 2·ci + hh, with B from q chunk ci.
  __device__ __forceinline__ static void frag(const uint4* raw, int s, int ks, uint32_t* a) {
    const int ci = ks >> 1, hh = ks & 1;
    if constexpr (!FP8) {
      constexpr int kChunks = DI / 32;
      const uint32_t* r0 = reinterpret_cast<const uint32_t*>(&raw[ci]);
      const uint32_t* r1 = reinterpret_cast<const uint32_t*>(&raw[kChunks + ci]);
      a[0] = r0[2 * hh];
      a[2] = r0[2 * hh + 1];
      a[1] = r1[2 * hh];
      a[3] = r1[2 * hh + 1];
    } else {
      constexpr int kChunks = DI / 64;
      const int j = ci >> 1, w = 2 * (ci & 1) + hh;
      const uint32_t* r0 = reinterpret_cast<const uint32_t*>(&raw[(s * 2) * kChunks + j]);
      const uint32_t* r1 = reinterpret_cast<const uint32_t*>(&raw[(s * 2 + 1) * kChunks + j]);
      e4m3x4_to_f16(r0[w], &a[0], &a[2]);
      e4m3x4_to_f16(r1[w], &a[1], &a[3]);
    }
  }
};

// The dims of q that lane (g, t) holds for q chunk ci (8 consecutive dims), matching frag().
template <int DI, bool FP8>
__device__ __forceinline__ int q_chunk_dim(int ci, int t) {
  if constexpr (!FP8) return 8 * (4 * ci + t);
  else return 16 * (4 * (ci >> 1) + t) + 8 * (ci & 1);
}

template <int DI, bool FP8, int PARTS>
__device__ __forceinline__ void score_unit(const uint4* raw, const uint4* s_q, const int* s_pos,
                                           int nt, int64_t key0, int64_t block_pos0, int lane,
                                           float (*run)[2]) {
  using U = KeyUnit<DI, FP8>;
  constexpr int kQChunks = DI / 32;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int s = 0; s < U::kSub; ++s) {
    uint32_t a[U::kSteps][4];
#pragma unroll
    for (int ks = 0; ks < U::kSteps; ++ks) U::frag(raw, s, ks, a[ks]);
    const int kk0 = int(key0) + 16 * s + g;  // key index inside the block of c0, c1
#pragma unroll
    for (int n = 0; n < kMaxTiles; ++n) {
      if (n >= nt) break;
      float acc[PARTS][4];
#pragma unroll
      for (int q = 0; q < PARTS; ++q) acc[q][0] = acc[q][1] = acc[q][2] = acc[q][3] = 0.0f;
#pragma unroll
      for (int ci = 0; ci < kQChunks; ++ci)
#pragma unroll
        for (int q = 0; q < PARTS; ++q) {
          const uint4 b = s_q[((n * PARTS + q) * kQChunks + ci) * 32 + lane];
          const uint32_t* k0 = a[2 * ci];
          const uint32_t* k1 = a[2 * ci + 1];
          using KeyT = std::conditional_t<FP8, __half, __nv_bfloat16>;   // FP8: f16 mma
          Traits<KeyT>::mma(acc[q], k0, b.x, b.y);
          Traits<KeyT>::mma(acc[q], k1, b.z, b.w);
        }
      // columns 2t, 2t+1 of n-tile n: keys kk0 (c0, c1) and kk0 + 8 (c2, c3)
      const int2 pos2 = *reinterpret_cast<const int2*>(&s_pos[n * 8 + 2 * t]);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t lim64 = int64_t(e ? pos2.y : pos2.x) - block_pos0;
        const int lim = lim64 < -1 ? -1 : (lim64 > 1 << 30 ? 1 << 30 : int(lim64));
        float v0 = acc[0][e], v1 = acc[0][2 + e];
        if constexpr (PARTS == 3) {
          // hi + (mid + lo); an infinite hi stays (its parts' products may be inf - inf)
          const float r0 = acc[1][e] + acc[2][e], r1 = acc[1][2 + e] + acc[2][2 + e];
          v0 = isinf(v0) ? v0 : v0 + r0;
          v1 = isinf(v1) ? v1 : v1 + r1;
        }
        v0 = kk0 <= lim ? v0 : kNegInf;
        v1 = kk0 + 8 <= lim ? v1 : kNegInf;
        run[n][e] = fmaxf(run[n][e], fmaxf(v0, v1));  // fmaxf drops a NaN dot product
      }
    }
  }
}

// q-row u's 8 dims [8·c8, 8·c8 + 8) as fp32 (a bf16 q widened exactly).
__device__ __forceinline__ void load_q8(const SelectParams& p, int64_t u, int c8, int di,
                                        float (&x)[8]) {
  const int64_t off = u * di + 8 * c8;
  if (p.q_dtype == DType::kF32) {
    const float4* src = reinterpret_cast<const float4*>(static_cast<const float*>(p.idx_q) + off);
    const float4 v0 = src[0], v1 = src[1];
    x[0] = v0.x; x[1] = v0.y; x[2] = v0.z; x[3] = v0.w;
    x[4] = v1.x; x[5] = v1.y; x[6] = v1.z; x[7] = v1.w;
  } else {
    const uint4 v = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.idx_q) + off);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[2 * k] = __uint_as_float(w[k] << 16);
      x[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
    }
  }
}

// FP8 keys multiply in f16 (step 3), so each row's q is scaled by 2^s, s such that its largest
// finite |q| lands in [2^14, 2^15): a power of two changes no block's rank, an E4M3 key times
// such a q is exact in fp32, and f16 parts hold every q element of magnitude >= 2^-15 (PARTS =
// 3) or >= 2^-17 (PARTS = 1, bf16 q: 8 significant bits) of that largest one exactly; smaller
// ones are rounded to f16's subnormal grid (docs/spec_decisions.md). The scaled sums cannot
// overflow (|score| < 2^15 · 448 · 128). A warp per row; s_scale[row] = s.
template <int DI>
__device__ void row_scales(const SelectParams& p, int32_t u0, int nrows, bool live, int rp,
                           int* s_scale) {
  const int lane = threadIdx.x & 31;
  for (int row = threadIdx.x >> 5; row < rp; row += kWarpsSel) {
    float m = 0.0f;
    if (live && row < nrows)
      for (int c8 = lane; c8 < DI / 8; c8 += 32) {
        float x[8];
        load_q8(p, u0 + row, c8, DI, x);
#pragma unroll
        for (int k = 0; k < 8; ++k) m = fmaxf(m, fabsf(x[k]));   // fmaxf skips a NaN
      }
    // non-negative floats order as their bits
    const uint32_t top = __reduce_max_sync(0xffffffffu, __float_as_uint(m));
    // floor(log2 m): from the exponent field (inf: 128), or the top bit of a subnormal
    const int e = int(top >> 23);
    const int lg = e != 0 ? e - 127 : (31 - __clz(int(top))) - 149;
    if (lane == 0) s_scale[row] = top == 0u ? 0 : 14 - lg;
  }
}

// Stages the piece's rows [u0, u1): positions (−1: padding) and q in B-fragment order (bf16
// parts; f16 parts of 2^s · q for FP8 keys). s_tmp: rp ints of scratch.
template <int DI, bool FP8, int PARTS>
__device__ void stage_piece(const SelectParams& p, const SelectLayout& l, int32_t u0, int32_t u1,
                            bool live, uint4* s_q, int* s_pos, int* s_tmp) {
  const int tid = threadIdx.x;
  const int rp = l.rows_per_piece, hkv = p.num_kv_heads;
  const int nrows = u1 - u0;
  for (int i = tid; i < rp; i += kThreadsSel) {
    int pos = -1;
    if (live && i < nrows) {
      const int32_t x = p.query_abs_pos[(u0 + i) / hkv];
      pos = x >= 0 ? x : -1;
    }
    s_pos[i] = pos;
  }
  if constexpr (FP8) {
    row_scales<DI>(p, u0, nrows, live, rp, s_tmp);
    __syncthreads();
  }
  constexpr int kC8 = DI / 8;  // 8-dim chunks per row
  constexpr int kQChunks = DI / 32;
  for (int i = tid; i < rp * kC8; i += kThreadsSel) {
    const int row = i / kC8, c8 = i % kC8;
    // which lane and chunk hold dims [8·c8, 8·c8 + 8) (inverse of q_chunk_dim)
    int t, ci;
    if constexpr (!FP8) {
      t = c8 & 3;
      ci = c8 >> 2;
    } else {
      const int c16 = c8 >> 1;
      t = c16 & 3;
      ci = 2 * (c16 >> 2) + (c8 & 1);
    }
    const int lane = (row & 7) * 4 + t, n = row >> 3;
    float x[8];
    if (live && row < nrows) {
      load_q8(p, u0 + row, c8, DI, x);
      if constexpr (FP8) {
        const int sc = s_tmp[row];
#pragma unroll
        for (int k = 0; k < 8; ++k) x[k] = scalbnf(x[k], sc);
      }
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) x[k] = 0.0f;
    }
    // parts: hi = h(x), mid = h(x - hi), lo = h(x - hi - mid), h = bf16 (f16 for FP8 keys)
    // rounding; they sum to x exactly (an fp32 x; for FP8 keys within the bound above)
#pragma unroll
    for (int q = 0; q < PARTS; ++q) {
      uint32_t w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float lo, hi;
        if constexpr (FP8) {
          const __half2 h = __floats2half2_rn(x[2 * k], x[2 * k + 1]);
          w[k] = *reinterpret_cast<const uint32_t*>(&h);
          lo = __low2float(h);
          hi = __high2float(h);
        } else {
          const __nv_bfloat162 h = __floats2bfloat162_rn(x[2 * k], x[2 * k + 1]);
          w[k] = *reinterpret_cast<const uint32_t*>(&h);
          lo = __low2float(h);
          hi = __high2float(h);
        }
        x[2 * k] -= lo;
        x[2 * k + 1] -= hi;
      }
      s_q[((n * PARTS + q) * kQChunks + ci) * 32 + lane] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// ---- step 4: a row's ids from the cluster's scores

__device__ __forceinline__ bool ranks_before(float s, int64_t b, float s2, int64_t b2) {
  return s > s2 || (s == s2 && b < b2);
}

// Order-preserving key of a score (larger float, larger key); 0 is below every score.
__device__ __forceinline__ uint32_t score_key(float s) {
  const uint32_t u = __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

constexpr int kCached = 8;  // candidates per lane kept in registers (rows of <= 256 candidates)

__device__ void finish_row(const SelectParams& p, const SelectLayout& l, cg::cluster_group& cluster,
                           float* s_score, int pos, int32_t u, int row_in_piece, int lane) {
  const int64_t T = p.num_tokens, K = p.topk;
  const int hkv = p.num_kv_heads;
  const int64_t t = u / hkv, g = u % hkv;
  int32_t* out = p.topk_indices + (g * T + t) * K;
  int64_t nloc = 0, nsel = 0;
  if (pos >= 0 && p.max_blocks > 0) {
    const int64_t own = pos / p.block_size;
    const int64_t last = own < p.max_blocks - 1 ? own : p.max_blocks - 1;
    int64_t lo = own - p.local_blocks + 1;
    lo = lo < 0 ? 0 : lo;
    nloc = last >= lo ? last - lo + 1 : 0;
    nloc = nloc < K ? nloc : K;
    for (int64_t k = lane; k < nloc; k += 32) out[k] = int32_t(lo + k);
    const int64_t ncand = lo < last + 1 ? lo : last + 1;  // the non-local candidates [0, ncand)
    const int rp = l.rows_per_piece;
    // a candidate's score, −inf unless finite (+0 for −0: they tie); lane's candidates are
    // b ≡ lane (mod 32), all in CTA lane % 8
    const float* base = cluster.map_shared_rank(s_score, unsigned(lane % kCluster)) + row_in_piece;
    auto score = [&](int64_t b) {
      const float s = base[(b / kCluster) * rp] + 0.0f;
      return isfinite(s) ? s : kNegInf;
    };
    const bool cached = ncand <= 32 * kCached;
    float cs[kCached];
#pragma unroll
    for (int m = 0; m < kCached; ++m) {
      const int64_t b = lane + 32 * m;
      cs[m] = (cached && b < ncand) ? score(b) : kNegInf;
    }
    // the lane's best: (score desc, id asc) among its untaken candidates; only the winner of a
    // round recomputes (cached: its registers, the taken one set to −inf; else the scores
    // after the previous pick, read again through distributed shared memory)
    float bs = kNegInf;
    int64_t bb = -1;
    auto lane_best = [&](float ps, int64_t pb) {
      bs = kNegInf;
      bb = -1;
      if (cached) {
#pragma unroll
        for (int m = 0; m < kCached; ++m)
          if (cs[m] > bs) bs = cs[m], bb = lane + 32 * m;
      } else {
        for (int64_t b = lane; b < ncand; b += 32) {
          const float s = score(b);
          if (s == kNegInf || !ranks_before(ps, pb, s, b)) continue;
          if (bb < 0 || ranks_before(s, b, bs, bb)) bs = s, bb = b;
        }
      }
    };
    lane_best(INFINITY, -1);
    for (; nloc + nsel < K; ++nsel) {
      const uint32_t key = bb >= 0 ? score_key(bs) : 0u;
      const uint32_t top = __reduce_max_sync(0xffffffffu, key);
      if (top == 0u) break;
      const uint32_t wb = __reduce_min_sync(0xffffffffu, key == top ? uint32_t(bb) : 0xFFFFFFFFu);
      if (lane == 0) out[nloc + nsel] = int32_t(wb);
      if (int(wb % 32) == lane) {
        if (cached) {
#pragma unroll
          for (int m = 0; m < kCached; ++m)
            if (uint32_t(lane + 32 * m) == wb) cs[m] = kNegInf;
        }
        lane_best(bs, int64_t(wb));
      }
    }
  }
  for (int64_t k = nloc + nsel + lane; k < K; k += 32) out[k] = -1;
}

// A warp's blocks b_k = first + step·k (k = 0, 1, ...; b_k < nb), their pages read 32 at a time
// (lane i: block k0 + i) before any key load; a block whose page is outside [0, P) gets −inf
// scores here and is skipped.
struct BlockList {
  int32_t first, step, nb, k0;  // block ids < M <= 2^20 (select_unsupported)
  uint32_t mask;
  int32_t page_lane;
  bool split;                   // split blocks: each warp scores its part of one block

  // where block b's scores (or, split, this warp's part of them: the parts [warp][rp] lie just
  // below the scores) go: [rp] floats
  __device__ __forceinline__ float* dst(float* s_score, int32_t b, int rp) const {
    return s_score + (split ? int(threadIdx.x >> 5) - kWarpsSel : b / kCluster) * rp;
  }

  __device__ __forceinline__ void load_chunk(const SelectParams& p, const int32_t* table,
                                             float* s_score, int rp, int lane) {
    const int32_t b = first + step * (k0 + lane);
    int32_t pg = -1;
    bool ok = false;
    if (b < nb) {
      pg = table[b];
      ok = pg >= 0 && int64_t(pg) < p.num_pages;
      if (!ok) {
        float* d = dst(s_score, b, rp);
        for (int i = 0; i < rp; ++i) d[i] = kNegInf;
      }
    }
    page_lane = pg;
    mask = __ballot_sync(0xffffffffu, ok);
  }

  __device__ __forceinline__ bool next(const SelectParams& p, const int32_t* table,
                                       float* s_score, int rp, int lane, int32_t* b,
                                       int32_t* page) {
    while (true) {
      if (mask) {
        const int i = __ffs(mask) - 1;
        mask &= mask - 1;
        *b = first + step * (k0 + i);
        *page = __shfl_sync(0xffffffffu, page_lane, i);
        return true;
      }
      k0 += 32;
      if (first + step * k0 >= nb) return false;
      load_chunk(p, table, s_score, rp, lane);
    }
  }
};

// Warps per block of a piece of nb blocks: the largest power of two s <= 8 that keeps
// s · ceil(nb / 8) (a CTA's blocks) within its 8 warps and s within a block's units. The same
// for every block of the piece; a block's score is a max, so the split never changes a bit.
__device__ __forceinline__ int split_for(int64_t nb, int units) {
  const int64_t per_cta = (nb + kCluster - 1) / kCluster;
  int s = 1;
  while (2 * s <= kWarpsSel && 2 * s * per_cta <= kWarpsSel && 2 * s <= units) s *= 2;
  return s;
}

// ---- the kernel

template <int DI, bool FP8, int PARTS>
__global__ void __launch_bounds__(kThreadsSel, 2)
    select_blocks_kernel(const SelectParams p, const SelectLayout l) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint4* s_q = reinterpret_cast<uint4*>(smem);
  int* s_pos = reinterpret_cast<int*>(smem + l.pos_off);
  float* s_score = reinterpret_cast<float*>(smem + l.score_off);
  float* s_part = reinterpret_cast<float*>(smem + l.part_off);   // [warp][row]
  int32_t* s_start = reinterpret_cast<int32_t*>(smem + l.piece_off);
  int32_t* s_end = s_start + l.piece_cap;
  __shared__ int s_wmax[2];
  using U = KeyUnit<DI, FP8>;

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int cid = int(blockIdx.x / kCluster), ncl = int(gridDim.x / kCluster);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int hkv = p.num_kv_heads, rp = l.rows_per_piece;
  const int64_t N = p.block_size, M = p.max_blocks;
  const int64_t layer = *p.layer;
  const bool layer_ok = layer >= 0 && layer < p.num_layers;
  const uint8_t* keys = static_cast<const uint8_t*>(p.idx_k) +
                        (layer_ok ? layer : 0) * p.num_pages * N * DI * (FP8 ? 1 : 2);
  const int64_t page_bytes = N * DI * (FP8 ? 1 : 2);
  const int units = int(N / U::kKeys);

  const int npieces = list_pieces(p, l, cid, ncl, s_start, s_end);
  for (int pi = 0; pi < npieces; ++pi) {
    const int32_t u0 = s_start[pi], u1 = s_end[pi];
    const int nrows = u1 - u0, nt = (nrows + 7) / 8;
    const int64_t r = p.query_req_id[u0 / hkv];
    const bool live = layer_ok && r >= 0 && r < p.num_requests;
    // 2. stage q and positions; the piece's blocks [0, nb)
    stage_piece<DI, FP8, PARTS>(p, l, u0, u1, live, s_q, s_pos, reinterpret_cast<int*>(s_part));
    __syncthreads();
    if (warp < 2) {
      const int i = warp * 32 + lane;
      const int m = __reduce_max_sync(0xffffffffu, i < rp ? s_pos[i] : -1);
      if (lane == 0) s_wmax[warp] = m;
    }
    __syncthreads();
    const int maxpos = max(s_wmax[0], s_wmax[1]);
    const int64_t nb = (maxpos < 0 || M == 0) ? 0 : min(int64_t(maxpos) / N, M - 1) + 1;
    const int32_t* table = p.block_table + (live ? r : 0) * M;

    // 3. split S warps per block: warp w streams units w % S, w % S + S, ... of the blocks
    //    b = rank + 8·(w / S + (8 / S)·k), their pages checked before any load
    const int S = split_for(nb, units), G = kWarpsSel / S, sub = warp % S;
    BlockList bl{rank + kCluster * (warp / S), kCluster * G, int32_t(nb), 0, 0u, -1, S > 1};
    if (bl.first < nb) bl.load_chunk(p, table, s_score, rp, lane);
    int32_t b = 0, page = 0, b_next = 0, page_next = 0;
    bool have = bl.first < nb && bl.next(p, table, s_score, rp, lane, &b, &page);
    uint4 raw_next[U::kLoads];
    if (have) U::load(raw_next, keys + int64_t(page) * page_bytes + sub * U::kBytes, lane);
    while (have) {
      const bool have_next = bl.next(p, table, s_score, rp, lane, &b_next, &page_next);
      float run[kMaxTiles][2];
#pragma unroll
      for (int n = 0; n < kMaxTiles; ++n) run[n][0] = run[n][1] = kNegInf;
      const uint8_t* block = keys + int64_t(page) * page_bytes;
      for (int un = sub; un < units; un += S) {
        uint4 raw[U::kLoads];
#pragma unroll
        for (int i = 0; i < U::kLoads; ++i) raw[i] = raw_next[i];
        const bool more = un + S < units;
        const uint8_t* src = more ? block + (un + S) * U::kBytes
                                  : keys + int64_t(page_next) * page_bytes + sub * U::kBytes;
        if (more || have_next) U::load(raw_next, src, lane);
        score_unit<DI, FP8, PARTS>(raw, s_q, s_pos, nt, int64_t(un) * U::kKeys, int64_t(b) * N, lane, run);
      }
      // the block's (or this warp's part's) maximum over the lanes of a column (the 8 lanes
      // g = 0..7 of each t)
#pragma unroll
      for (int n = 0; n < kMaxTiles; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
          for (int o = 4; o < 32; o <<= 1)
            run[n][e] = fmaxf(run[n][e], __shfl_xor_sync(0xffffffffu, run[n][e], o));
      if (lane < 4) {
        float* d = bl.dst(s_score, b, rp);
#pragma unroll
        for (int n = 0; n < kMaxTiles; ++n)
          if (n * 8 < rp) {
            d[n * 8 + 2 * lane] = run[n][0];
            d[n * 8 + 2 * lane + 1] = run[n][1];
          }
      }
      have = have_next;
      b = b_next;
      page = page_next;
    }
    if (S > 1) {  // a block's score: the max of its S warps' parts (exact, any order)
      __syncthreads();
      for (int i = tid; i < G * rp; i += kThreadsSel) {
        const int j = i / rp, row = i % rp;
        if (rank + kCluster * j >= nb) continue;
        const float* src = s_part + j * S * rp + row;
        float m = src[0];
        for (int k = 1; k < S; ++k) m = fmaxf(m, src[k * rp]);
        s_score[j * rp + row] = m;
      }
    }

    // 4. every row's ids, by one warp of the cluster each
    cluster.sync();
    for (int i = rank * kWarpsSel + warp; i < nrows; i += kCluster * kWarpsSel)
      finish_row(p, l, cluster, s_score, s_pos[i], u0 + i, i, lane);
    cluster.sync();
  }
}

struct SelectDevice {
  bool configured = false;
  int clusters = 0;  // clusters of 8 resident at once
};

template <int DI, bool FP8, int PARTS>
cudaError_t launch_typed(const SelectParams& p, cudaStream_t stream) {
  auto kernel = select_blocks_kernel<DI, FP8, PARTS>;
  static SelectDevice info[64];
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= 64) return cudaErrorInvalidDevice;
  constexpr int kSmemMax = 110 * 1024;  // two CTAs per SM
  // rows per piece: 64, or fewer where a wide block table's scores need the room
  const int64_t rows = p.num_tokens * p.num_kv_heads;
  int rp = kMaxTiles * 8;
  auto layout_for = [&](int rows_per_piece) {
    const int64_t pieces = p.num_tokens + (rows + rows_per_piece - 1) / rows_per_piece;
    return make_layout(rows_per_piece, PARTS, DI, p.max_blocks, int(pieces));
  };
  if (!info[dev].configured) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemMax);
    if (err != cudaSuccess) return err;
    ClusterLaunch one(kCluster, kThreadsSel, kSmemMax, kCluster);
    err = cudaOccupancyMaxActiveClusters(&info[dev].clusters, kernel, &one.cfg);
    if (err != cudaSuccess) return err;
    if (info[dev].clusters < 1) info[dev].clusters = 1;
    info[dev].configured = true;
  }
  SelectLayout l = layout_for(rp);
  while (rp > 8 && l.total - 8 * l.piece_cap > kSmemMax / 2) l = layout_for(rp -= 8);
  // the pieces per cluster bound the piece list: size the grid first
  const int64_t max_pieces = l.piece_cap;
  const int ncl = int(max_pieces < info[dev].clusters ? max_pieces : info[dev].clusters);
  l = make_layout(rp, PARTS, DI, p.max_blocks, int((max_pieces + ncl - 1) / ncl));
  if (l.total > kSmemMax) return cudaErrorInvalidValue;
  ClusterLaunch launch(unsigned(ncl * kCluster), kThreadsSel, size_t(l.total), kCluster, stream);
  return cudaLaunchKernelEx(&launch.cfg, kernel, p, l);
}

template <int DI>
cudaError_t launch_di(const SelectParams& p, cudaStream_t stream) {
  const bool f32 = p.q_dtype == DType::kF32;
  if (p.key_fp8)
    return f32 ? launch_typed<DI, true, 3>(p, stream) : launch_typed<DI, true, 1>(p, stream);
  return f32 ? launch_typed<DI, false, 3>(p, stream) : launch_typed<DI, false, 1>(p, stream);
}

}  // namespace

const char* select_unsupported(int64_t head_dim, int64_t block_size, int64_t max_blocks) {
  const bool ok = (head_dim == 64 || head_dim == 128) && block_size >= 32 &&
                  block_size % 32 == 0 && block_size <= (1 << 20) && max_blocks <= (1 << 20);
  return ok ? ""
            : "the CUDA select_blocks kernel needs an index head_dim of 64 or 128, a block_size "
              "that is a multiple of 32 and a block table of at most 2^20 columns";
}

cudaError_t launch_select_blocks(const SelectParams& p, cudaStream_t stream) {
  if (p.num_tokens <= 0 || p.num_kv_heads <= 0 || p.topk <= 0) return cudaSuccess;
  if (select_unsupported(p.head_dim, p.block_size, p.max_blocks)[0] != '\0')
    return cudaErrorInvalidValue;
  if (p.num_tokens * p.num_kv_heads > int64_t(0x3FFFFFFF)) return cudaErrorInvalidValue;
  if (p.q_dtype != DType::kF32 && p.q_dtype != DType::kBF16) return cudaErrorInvalidValue;
  return p.head_dim == 64 ? launch_di<64>(p, stream) : launch_di<128>(p, stream);
}

}  // namespace cuda
}  // namespace m3sparse
