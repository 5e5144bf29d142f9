// grouped_matmul for sm_90 (SPEC §9): out[i] = lhs[i] · rhs[g(i)]ᵀ in fp32, the rows of lhs
// grouped by consecutive group_sizes — the routed experts of a mixture of experts, read once each.
// rhs is bf16, MXFP8 (fp8 e4m3 with an E8M0 exponent per 32 k: weight-only, half the bytes), or
// packed FP4 (E2M1 two per byte; MXFP4: an E8M0 exponent per 32 k, NVFP4: an E4M3 scale per 16:
// a quarter of the bytes).
//
//   1. Grid (column tiles of BN) × (min(G, M) + 1). CTA row y finds the y-th non-empty group
//      (sizes clamped at 0, the running end clamped at M; one warp scans them) and its rows
//      [start, end); the last CTA row writes zeros to the rows [Σ, M) no group covers. The
//      weights of experts no token routes to are never read, and a decode batch's few groups
//      launch few CTAs. With 64-row tiles of long K (prefill gate_up) the grid has a CTA row
//      per (group, 64-row tile) instead — min(G, M) + M / 64 + 1 rows, the unused ones exit —
//      so a large group's tiles run side by side and share its weights through L2.
//   2. The CTA walks its rows in tiles of BM (16 for decode-sized groups; 64 when groups are
//      large, so each weight tile is read once per 64 rows) and, per tile, streams K through a
//      ring of shared-memory stages (16-byte cp.async; rows past the group, columns past N and
//      k past K are zero-filled, so nothing outside the operands is read). A stage holds 64 k
//      of bf16 weights, or 128 k of fp8 weights (the same 128 bytes per row) with their four
//      scale bytes per row, or 128 k of FP4 weights (64 bytes per row, two rows per 128-byte
//      line) with four (MXFP4) or eight (NVFP4) scale bytes; lhs rows in [BM][64] sub-tiles.
//      Chunk c of row r sits at chunk c ^ (r & 7) of the row (FP4: of its half line, c ^ (line
//      & 3)): ldmatrix, and the quantized fragments' 2-byte and 1-byte loads, read 8 rows
//      without bank conflicts.
//   3. Each warp owns 32 columns (four n8 tiles) and the BM rows; BN = 32, 64 or 128 (1, 2 or 4
//      warps: narrower tiles give a decode batch's few groups more CTAs). Weights widened in
//      registers (MXFP8, FP4) cost instructions rather than bytes at decode sizes, so their
//      16-row tiles of 32 or 64 columns take four warps of 8 or 16 columns instead of one or
//      two of 32: four times the warps widen the same weights. bf16 weight fragments
//      come from ldmatrix; fp8 ones are loaded per thread and widened in registers to exactly
//      the bf16 value of SPEC §9.1 — the fragment a bf16 launch on the dequantized weights
//      would load. FP4 ones (fp4_stage) are widened 8 k at a time into (k, k + 4) pairs, the
//      lhs fragments paired to match: the same exact values in another slot order. Every output element is one chain of m16n8k16 bf16 mma
//      in k order with an fp32 accumulator: a row's bits depend on its own lhs row and its
//      group's weights only, never on the other rows, the group sizes or the tile shape
//      (batch-invariant; tests/cuda checks it), and an MXFP8 launch equals the bf16 launch on
//      the dequantized weights bit for bit (an FP4 one to fp32 rounding: SPEC §9.3).
//   4. The accumulators are stored (fp32, or rounded to bf16 when out_bf16) for the tile's rows
//      inside the group and columns < N — through the epilogue of SPEC §9 item 6 when asked:
//      times the group's scale, gate and up joined by the activation (the loader pairs gate row
//      j with up row N/2 + j as tile rows 2j, 2j + 1, so a thread's accumulator pair is one
//      output column), times the row's scale. Launches with the epilogue run kernels of their
//      own (kEpi): compiled into every kernel, its branches slowed the plain ones.
// With lhs_rows (SPEC §9 item 4) step 2 reads row i's lhs from lhs_rows[i]: the sorted copy of the
// tokens a mixture of experts would otherwise make is never written.
// No workspace, no host reads of device data: CUDA-graph safe.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "m3sparse_cuda.h"

namespace m3sparse {
namespace cuda {
namespace {

constexpr int kRowBytes = 128;    // bytes per row and stage: 8 chunks of 16 B (64 bf16 / 128 fp8)

__device__ __forceinline__ void cp_async16_zfill(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int n = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled, nothing is read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(gmem_src), "r"(n));
}
__device__ __forceinline__ void cp_async4_zfill(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(gmem_src), "r"(n));
}
__device__ __forceinline__ void cp_async8_zfill(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int n = valid ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(d), "l"(gmem_src), "r"(n));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void wait_groups() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* smem) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

__device__ __forceinline__ void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// E8M0 byte -> 2^(e - 127) as two normal fp32 factors (e = 0's 2^-127 is subnormal, which
// flush-to-zero would read as 0): (2^-64, 2^-63) for e = 0, (NaN, 1) for e = 255, else
// (2^(e - 127), 1) — jax_m3sparse/mxfp8.py's rule.
__device__ __forceinline__ float2 e8m0_factors(uint8_t e) {
  if (e == 0) return make_float2(0x1p-64f, 0x1p-63f);
  return make_float2(__uint_as_float(e == 255 ? 0x7FC00000u : uint32_t(e) << 23), 1.0f);
}

__device__ __forceinline__ float mul_ftz(float a, float b) {
  float d;
  asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// Two fp8 e4m3 (the lower k in the low byte) times the scale s, rounded to a packed bf16 pair:
// the dequantized weights of SPEC §9.1 (fp8 -> f16 -> f32 exact; the products exact, those
// below 2^-126 flushed to ±0), as an mma B fragment register.
__device__ __forceinline__ uint32_t dequant_fp8x2(uint16_t q, float2 s) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(q, __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  const __nv_bfloat162 b = __floats2bfloat162_rn(mul_ftz(mul_ftz(f.x, s.x), s.y),
                                                 mul_ftz(mul_ftz(f.y, s.x), s.y));
  return *reinterpret_cast<const uint32_t*>(&b);
}

__device__ __forceinline__ float mul_rn(float a, float b) {   // IEEE: subnormals kept
  float d;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// E2M1 code (bit 3 the sign) -> its value exactly: the code's exponent and mantissa bits placed
// at fp32's exponent LSB and first mantissa bit make 2^-126 times the value (code 1, 0.5, a
// subnormal), which one IEEE multiply by 2^126 restores.
__device__ __forceinline__ float e2m1_value(uint32_t code) {
  return mul_rn(__uint_as_float(((code & 8u) << 28) | ((code & 7u) << 22)), 0x1p126f);
}

// The 8 FP4 codes of w (element i in nibble i) as 4 packed bf16 pairs p[j] = (element j,
// element j + 4) of W (SPEC §9.3): each code's sign and three magnitude bits placed at bf16's
// sign, exponent LSBs and first mantissa bit make 2^-126 times its E2M1 value (code 1, 0.5, a
// bf16 subnormal); one multiply by 2^126 restores the value and one by the scale s (a bf16
// pair, both halves equal) applies it — both exact (at most 6 significant bits), the second
// overflowing to ±inf past bf16's range as the fp32 route does. For NVFP4 any E4M3 scale, for
// MXFP4 2^(e − 127) with e >= 2 (smaller e can give products below 2^-126: fp4x8_exact).
__device__ __forceinline__ void fp4x8(uint32_t w, uint32_t s, uint32_t* p) {
  const __nv_bfloat162 k126 = __halves2bfloat162(__ushort_as_bfloat16(0x7E80),
                                                 __ushort_as_bfloat16(0x7E80));   // 2^126
  const __nv_bfloat162 sc = *reinterpret_cast<const __nv_bfloat162*>(&s);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t v = w << (12 - 4 * j);            // nibbles j, j + 4 at bits 12-15, 28-31
    const uint32_t x = (v & 0x80008000u) | ((v >> 6) & 0x01C001C0u);
    const __nv_bfloat162 y = __hmul2(__hmul2(*reinterpret_cast<const __nv_bfloat162*>(&x), k126),
                                     sc);
    p[j] = *reinterpret_cast<const uint32_t*>(&y);
  }
}

// The same for MXFP4 exponents e < 2 in fp32: e2m1 · 2^(e − 127) with the scale's two factors
// f, products below 2^-126 flushed to ±0 (as MXFP8's, SPEC §9.1), rounded to bf16.
__device__ __forceinline__ void fp4x8_exact(uint32_t w, float2 f, uint32_t* p) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float lo = e2m1_value(w >> (4 * j) & 15u), hi = e2m1_value(w >> (4 * j + 16) & 15u);
    const __nv_bfloat162 b = __floats2bfloat162_rn(mul_ftz(mul_ftz(lo, f.x), f.y),
                                                   mul_ftz(mul_ftz(hi, f.x), f.y));
    p[j] = *reinterpret_cast<const uint32_t*>(&b);
  }
}

// E4M3 byte -> its fp32 value (NaN codes: NaN), via the exact fp8 -> f16 conversion.
__device__ __forceinline__ float e4m3_float(uint8_t q) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(q, __NV_E4M3);
  return __half2float(*reinterpret_cast<const __half*>(&h));
}

// Byte offset of 16-byte chunk c of row r in a [rows][128 B] stage (swizzled, step 2).
__device__ __forceinline__ int swz(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }
// FP4 launches' lhs sub-tiles: as swz, and row r's chunks moved by 4 when r is odd, so the
// 16-byte loads of fp4_step (rows 2p and 2p + 1, four chunks each) hit 8 distinct bank groups.
__device__ __forceinline__ int swz_a4(int r, int c) {
  return r * 128 + ((c ^ (r & 7) ^ ((r & 1) << 2)) << 4);
}
// The same for FP4 weight rows of 64 bytes, two per 128-byte line: chunk c (0..3) of row r.
__device__ __forceinline__ int swz4(int r, int c) {
  return (r >> 1) * 128 + ((4 * (r & 1) + (c ^ ((r >> 1) & 3))) << 4);
}

// Step 1: the rows [start, end) of the y-th non-empty group (sizes clamped at 0, the running end
// at M; *g = its index); or, with kSplit and unit > 0, of the y-th chunk of unit rows when every
// non-empty group is cut into such chunks in order (its last chunk partial): the CTAs of one
// group's chunks are adjacent in the grid, so they run together and read the group's weights
// from HBM about once, and no CTA walks a large group alone. For tail, the rows [Σ, M) no group
// covers (*g = -1). start >= end: nothing to do. One warp scans the sizes 32 at a time.
template <bool kSplit>
__device__ void find_group(const int32_t* sizes, int G, int64_t M, int64_t y, bool tail,
                           int64_t unit, int* g, int64_t* start, int64_t* end) {
  __shared__ int s_g;
  __shared__ int64_t s_start, s_end;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int64_t running = 0;
    std::conditional_t<kSplit, int64_t, int> count = 0;   // units before these 32 groups
    int found = -2;
    int64_t fs = 0, fe = 0;
    for (int base = 0; base < G && found == -2; base += 32) {
      const int j = base + lane;
      const int64_t v = j < G && sizes[j] > 0 ? sizes[j] : 0;
      int64_t incl = v;
      for (int o = 1; o < 32; o <<= 1) {
        const int64_t x = __shfl_up_sync(0xFFFFFFFFu, incl, o);
        if (lane >= o) incl += x;
      }
      const int64_t st = min(running + incl - v, M), en = min(running + incl, M);
      // (With unit 0 the chunk prefix below would do, but its scan cost down_proj's
      // per-group launch ~3 %: its CTAs are many and short.)
      if (!kSplit || unit == 0) {   // units: the non-empty groups
        const unsigned live = __ballot_sync(0xFFFFFFFFu, en > st);
        const int n = __popc(live);
        if (!tail && count + n > y) {
          const int want = int(y - count);  // the want-th set bit of live
          const bool mine = (live >> lane & 1u) && __popc(live & ((1u << lane) - 1u)) == want;
          const unsigned who = __ballot_sync(0xFFFFFFFFu, mine);
          const int src = __ffs(who) - 1;
          found = __shfl_sync(0xFFFFFFFFu, j, src);
          fs = __shfl_sync(0xFFFFFFFFu, st, src);
          fe = __shfl_sync(0xFFFFFFFFu, en, src);
        }
        count += n;
      } else {    // units: the groups' chunks; their inclusive prefix
        const int64_t kT = unit;
        const int64_t nu = en > st ? (en - st + kT - 1) / kT : 0;
        int64_t uincl = nu;
        for (int o = 1; o < 32; o <<= 1) {
          const int64_t x = __shfl_up_sync(0xFFFFFFFFu, uincl, o);
          if (lane >= o) uincl += x;
        }
        const int64_t n = __shfl_sync(0xFFFFFFFFu, uincl, 31);
        if (!tail && count + n > y) {
          const int64_t want = y - count;  // the lane whose tiles hold unit y
          const unsigned who = __ballot_sync(0xFFFFFFFFu, want >= uincl - nu && want < uincl);
          const int src = __ffs(who) - 1;
          found = __shfl_sync(0xFFFFFFFFu, j, src);
          const int64_t e0 = __shfl_sync(0xFFFFFFFFu, en, src);
          fs = __shfl_sync(0xFFFFFFFFu, st + (want - (uincl - nu)) * kT, src);
          fe = min(fs + kT, e0);
        }
        count += n;
      }
      running += __shfl_sync(0xFFFFFFFFu, incl, 31);
    }
    if (lane == 0) {
      if (tail) {
        s_g = -1, s_start = min(running, M), s_end = M;
      } else {
        s_g = found, s_start = fs, s_end = found >= 0 ? fe : fs;
      }
    }
  }
  __syncthreads();
  *g = s_g, *start = s_start, *end = s_end;
}

// The operands' formats: bf16 lhs and weights; bf16 lhs and MXFP8 weights widened to bf16
// (SPEC §9.1); MXFP8 lhs and weights multiplied as fp8 (SPEC §9.2); bf16 lhs and FP4 weights
// widened to bf16, MXFP4 or NVFP4 (SPEC §9.3).
enum class Fmt { kBf16, kFp8W, kW8A8, kFp4Mx, kFp4Nv };

// Stage geometry of a launch: quantized weights take 128 k per stage (fp8: the same 128 bytes
// per row; FP4: 64), with a bf16 lhs in two [BM][64] sub-tiles, an fp8 lhs in one [BM][128];
// four E8M0 bytes per fp8 or MXFP4 row and stage, eight E4M3 per NVFP4 row (weights, then the
// lhs rows).
template <Fmt kF, int kMTiles, int kWarpsN, int kNT>
struct Geometry {
  static constexpr bool kFp4 = kF == Fmt::kFp4Mx || kF == Fmt::kFp4Nv;
  static constexpr bool kFp8B = kF != Fmt::kBf16, kFp8A = kF == Fmt::kW8A8;  // kFp8B: quantized
  static constexpr int kThreads = 32 * kWarpsN, kBN = 8 * kNT * kWarpsN, kBM = 16 * kMTiles;
  static constexpr int kWarpN = 8 * kNT;                        // columns per warp
  // A CTA row per chunk of a group's rows (64-row tiles; narrow-warp 16-row ones): find_group
  static constexpr bool kSplit = kBM > 16 || kNT < 4;
  static constexpr int kSubTiles = kF == Fmt::kFp8W || kFp4 ? 2 : 1;   // [BM][128 B] lhs sub-tiles
  static constexpr int kStepK = kFp8B ? 128 : 64;              // k per stage
  static constexpr int kScaleB = kF == Fmt::kFp4Nv ? 8 : kFp8B ? 4 : 0;   // per weight row
  static constexpr int kSubA = kBM * kRowBytes;
  static constexpr int kStageA = kSubA * kSubTiles, kStageB = kBN * (kFp4 ? 64 : kRowBytes);
  static constexpr int kStageS = kBN * kScaleB + (kFp8A ? kBM * 4 : 0);
  static constexpr int kStage = kStageA + kStageB + kStageS;
};

// E8M0 byte -> 2^(e - 127) as one fp32 (e = 0: the subnormal 2^-127; 255: NaN).
__device__ __forceinline__ float e8m0_float(uint32_t e) {
  return __uint_as_float(e == 255 ? 0x7FC00000u : e == 0 ? 0x00400000u : e << 23);
}

__device__ __forceinline__ void mma_fp8(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%10,%10,%10};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
}

// One stage (128 k) of an FP4 launch: four steps of 32 k, each two m16n8k16 mma whose k slots
// hold the k order fp4x8 makes — thread (g, t)'s B pairs are weight k (8t + j, 8t + j + 4),
// so its A pairs are the lhs elements at the same k: k 8t..8t + 7 of rows g and g + 8 in one
// 16-byte load each, paired by byte permutes. The mma sums each 16-k slot set in a fixed order
// for every tile and batch: a row's bits still depend only on its row and its group's weights.
// kExact (MXFP4 only): some exponent of the warp's stage is below 2, so every (row, 32 k) tests
// its own; otherwise none does and the stage's code has no branch (fp4_stage chooses per warp).
template <Fmt kF, int kMTiles, int kNT, bool kExact>
__device__ __forceinline__ void fp4_steps(const uint8_t* a, const uint8_t* b, int sub_a,
                                          int stage_b, float (*acc)[kNT][4], int wn, int lane,
                                          const uint32_t* ew) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int k2 = 0; k2 < 4; ++k2) {             // sub-tile k2 / 2, its 32 k from 32 · (k2 % 2)
    uint32_t af[kMTiles][2][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      uint32_t x[2][4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {            // rows g, g + 8
        const uint4 v = *reinterpret_cast<const uint4*>(
            a + (k2 >> 1) * sub_a + swz_a4(mt * 16 + g + 8 * h, 4 * (k2 & 1) + t));
        x[h][0] = v.x, x[h][1] = v.y, x[h][2] = v.z, x[h][3] = v.w;
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {            // (k 8t + j, 8t + j + 4): mma j / 2, a0/a1 or a2/a3
        const uint32_t sel = j & 1 ? 0x7632u : 0x5410u;
        af[mt][j >> 1][2 * (j & 1)] = __byte_perm(x[0][j >> 1], x[0][2 + (j >> 1)], sel);
        af[mt][j >> 1][2 * (j & 1) + 1] = __byte_perm(x[1][j >> 1], x[1][2 + (j >> 1)], sel);
      }
    }
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      const int r = (wn * kNT + nt) * 8 + g;
      const uint32_t w = *reinterpret_cast<const uint32_t*>(b + swz4(r, k2) + 4 * t);
      uint32_t p[4];
      if constexpr (kF == Fmt::kFp4Nv) {       // the E4M3 scale of k 16 · (2 · k2 + t / 2)
        const uint8_t* sr = b + stage_b + 8 * r;
        const __nv_bfloat16 s = __float2bfloat16_rn(e4m3_float(sr[2 * k2 + (t >> 1)]));
        fp4x8(w, uint32_t(__bfloat16_as_ushort(s)) * 0x10001u, p);
      } else {                                 // the E8M0 exponent of this k32
        const uint32_t e = ew[nt] >> (8 * k2) & 0xFFu;
        if (!kExact || e >= 2) fp4x8(w, e == 255 ? 0x7FC07FC0u : (e << 7) * 0x10001u, p);
        else fp4x8_exact(w, e8m0_factors(uint8_t(e)), p);
      }
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        mma(acc[mt][nt], af[mt][0], p[0], p[1]);
        mma(acc[mt][nt], af[mt][1], p[2], p[3]);
      }
    }
  }
}

// One stage (128 k) of an FP4 launch. MXFP4: each thread's 4 rows' exponent words (4 k32 each)
// are read once, and one vote per warp picks the stage's code: a branch per (row, k32) step cut
// the unrolled steps into regions the scheduler could not interleave (docs/perf-log/fp4-experts.md).
template <Fmt kF, int kMTiles, int kNT>
__device__ __forceinline__ void fp4_stage(const uint8_t* a, const uint8_t* b, int sub_a,
                                          int stage_b, float (*acc)[kNT][4], int wn, int lane) {
  uint32_t ew[kNT] = {};
  if constexpr (kF == Fmt::kFp4Mx) {
    bool low = false;                        // some byte < 2: (x − 0x02..) & ~x & 0x80.. != 0
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      ew[nt] = *reinterpret_cast<const uint32_t*>(b + stage_b + 4 * ((wn * kNT + nt) * 8 +
                                                                     (lane >> 2)));
      low |= ((ew[nt] - 0x02020202u) & ~ew[nt] & 0x80808080u) != 0;
    }
    if (__any_sync(0xFFFFFFFFu, low)) {
      fp4_steps<kF, kMTiles, kNT, true>(a, b, sub_a, stage_b, acc, wn, lane, ew);
      return;
    }
  }
  fp4_steps<kF, kMTiles, kNT, false>(a, b, sub_a, stage_b, acc, wn, lane, ew);
}

// The weight row behind tile row r (n0 + local row). With an activation (SPEC §9 item 6) the
// tile pairs gate row j with up row n / 2 + j at rows 2j, 2j + 1, so each thread's accumulator
// pair (columns 2t, 2t + 1 of an n8 tile) holds one output column's gate and up.
template <bool kEpi>
__device__ __forceinline__ int64_t weight_row(const GroupedMatmulParams& p, int64_t r) {
  if constexpr (!kEpi) return r;
  return p.act != 0 ? (r >> 1) + (r & 1) * (p.n >> 1) : r;
}

// SPEC §9 item 6's activations in fp32, each multiply rounded on its own (no contraction);
// a NaN gate or up stays NaN (comparisons, not fminf).
__device__ __forceinline__ float activate(const GroupedMatmulParams& p, float gate, float up) {
  if (p.act == 1) {
    const float s = __frcp_rn(__fadd_rn(1.0f, expf(-gate)));
    return __fmul_rn(__fmul_rn(gate, s), up);
  }
  const float g = gate > p.limit ? p.limit : gate;
  const float u = up < -p.limit ? -p.limit : up > p.limit ? p.limit : up;
  const float s = __frcp_rn(__fadd_rn(1.0f, expf(-__fmul_rn(g, p.alpha))));
  return __fmul_rn(__fmul_rn(__fadd_rn(u, 1.0f), g), s);
}

// One or two output elements, fp32 or rounded to bf16 (nearest even) as stored (SPEC §9 item 5).
__device__ __forceinline__ void store1(const GroupedMatmulParams& p, int64_t i, float v) {
  if (p.out_bf16) static_cast<__nv_bfloat16*>(p.out)[i] = __float2bfloat16_rn(v);
  else static_cast<float*>(p.out)[i] = v;
}
__device__ __forceinline__ void store2(const GroupedMatmulParams& p, int64_t i, float v0, float v1) {
  if (p.out_bf16)
    *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.out) + i) =
        __floats2bfloat162_rn(v0, v1);
  else *reinterpret_cast<float2*>(static_cast<float*>(p.out) + i) = make_float2(v0, v1);
}

// Step 4 for a warp's 32 columns from c0 of the tile rows m0.. (< end): the accumulators as they
// are (fp32, or rounded to bf16 when out_bf16). Written out rather than through store1 / store2:
// this is the plain kernels' code as it was measured (register-identical to before the epilogue).
template <int kMTiles, int kNT>
__device__ __forceinline__ void store_tile(const GroupedMatmulParams& p, const float (*acc)[kNT][4],
                                           int64_t m0, int64_t end, int64_t c0, int lane) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = m0 + mt * 16 + (lane >> 2) + 8 * half;
      if (row >= end) continue;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const int64_t col = c0 + nt * 8 + 2 * (lane & 3);
        const float v0 = acc[mt][nt][2 * half], v1 = acc[mt][nt][2 * half + 1];
        if (p.out_bf16) {   // rounded to nearest even as stored
          __nv_bfloat16* o = static_cast<__nv_bfloat16*>(p.out) + row * p.n + col;
          if (col + 1 < p.n && (p.n & 1) == 0) {
            *reinterpret_cast<__nv_bfloat162*>(o) = __floats2bfloat162_rn(v0, v1);
          } else {
            if (col < p.n) o[0] = __float2bfloat16_rn(v0);
            if (col + 1 < p.n) o[1] = __float2bfloat16_rn(v1);
          }
          continue;
        }
        float* o = static_cast<float*>(p.out) + row * p.n + col;
        if (col + 1 < p.n && (p.n & 1) == 0) {
          *reinterpret_cast<float2*>(o) = make_float2(v0, v1);
        } else {
          if (col < p.n) o[0] = v0;
          if (col + 1 < p.n) o[1] = v1;
        }
      }
    }
  }
}

// The same through SPEC §9 item 6's epilogue: times the group's scale, the activation's pairs
// (v0, v1) = (gate, up) of output column col / 2 (weight_row), times the row's scale.
template <int kMTiles, int kNT>
__device__ __forceinline__ void store_tile_epilogue(const GroupedMatmulParams& p,
                                                 const float (*acc)[kNT][4], int g, int64_t m0,
                                                 int64_t end, int64_t c0, int lane) {
  const float gs = p.group_scale != nullptr ? p.group_scale[g] : 1.0f;   // x · 1 = x exactly
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = m0 + mt * 16 + (lane >> 2) + 8 * half;
      if (row >= end) continue;
      const float rs = p.row_scale != nullptr ? p.row_scale[row] : 1.0f;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const int64_t col = c0 + nt * 8 + 2 * (lane & 3);
        const float v0 = __fmul_rn(acc[mt][nt][2 * half], gs);
        const float v1 = __fmul_rn(acc[mt][nt][2 * half + 1], gs);
        if (p.act != 0) {
          if (col < p.n) store1(p, row * (p.n / 2) + col / 2, __fmul_rn(activate(p, v0, v1), rs));
          continue;
        }
        const int64_t o = row * p.n + col;
        if (col + 1 < p.n && (p.n & 1) == 0) {
          store2(p, o, __fmul_rn(v0, rs), __fmul_rn(v1, rs));
        } else {
          if (col < p.n) store1(p, o, __fmul_rn(v0, rs));
          if (col + 1 < p.n) store1(p, o + 1, __fmul_rn(v1, rs));
        }
      }
    }
  }
}

// Steps 2-4 for the rows [start, end) of group g and the column tile from n0.
template <Fmt kF, int kMTiles, int kWarpsN, int kNT, int kStages, bool kEpi>
__device__ __forceinline__ void gemm_rows(const GroupedMatmulParams& p, int g, int64_t start,
                                          int64_t end, int64_t n0, uint8_t* smem) {
  using Geo = Geometry<kF, kMTiles, kWarpsN, kNT>;
  // Narrower warps (kNT < 4: 8 or 16 columns) only where fragments are widened per thread
  // (ldmatrix takes two n8 tiles), and at most one lhs row per thread's copies.
  static_assert(kNT == 4 || kF == Fmt::kFp8W || Geo::kFp4, "narrow warps: widened weights only");
  static_assert(Geo::kThreads / 8 <= Geo::kBM, "more copying threads than lhs rows");
  constexpr bool kFp8B = Geo::kFp8B, kFp8A = Geo::kFp8A;
  constexpr int kThreads = Geo::kThreads, kBN = Geo::kBN, kBM = Geo::kBM;
  constexpr bool kFp4 = Geo::kFp4;
  constexpr int kElem = kFp8B ? 1 : 2;                   // weight bytes per element (not FP4)
  constexpr int kElemA = kFp8A ? 1 : 2;                  // lhs bytes per element
  constexpr int kChunkK = 16 / kElemA;                   // lhs k per 16-byte chunk
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wn = warp;
  const uint8_t* lhs = static_cast<const uint8_t*>(p.lhs);
  const int64_t wrow = kFp4 ? p.k / 2 : p.k * kElem;    // weight bytes per row
  const uint8_t* rhs = static_cast<const uint8_t*>(p.rhs) + int64_t(g) * p.n * wrow;
  const int64_t scale_row = p.k / 32;                    // E8M0 bytes per fp8 row
  const int64_t wscale_row = p.k / 32 * (Geo::kScaleB / 4);   // scale bytes per weight row
  const uint8_t* scales = kFp8B ? p.rhs_scale + int64_t(g) * p.n * wscale_row : nullptr;
  const int ksteps = int((p.k + Geo::kStepK - 1) / Geo::kStepK);

  for (int64_t m0 = start; m0 < end; m0 += kBM) {
    // Enqueues k-step ks into stage ks % kStages (an empty commit past the end keeps counts).
    // Each thread copies chunk c = tid % 8 of rows tid / 8 + j · kRowStep of both tiles: the
    // pointers and row checks are made once per tile, a k-step only adds k0 (a single warp
    // issuing per-chunk address arithmetic would otherwise cost more than the copy's latency).
    // With fp8 weights thread t also copies the scale bytes of weight row t (BN = threads),
    // with an fp8 lhs threads t < BM those of lhs row t.
    constexpr int kRowStep = kThreads / 8, kRowsA = kBM / kRowStep, kRowsB = kBN / kRowStep;
    const int c = tid & 7, r0 = tid >> 3;
    // The lhs row each of this thread's A rows reads: the row itself, or its lhs_rows entry
    // (gathered as it is read; ids outside [0, lhs_count) and rows past the group read zeros).
    auto source_row = [&](int64_t row, bool* live) {
      int64_t src = row;
      *live = row < end;
      if (p.lhs_rows != nullptr) {
        src = *live ? p.lhs_rows[row] : 0;
        *live = *live && src >= 0 && src < p.lhs_count;
      }
      return *live ? src : 0;
    };
    const uint8_t* pa[kRowsA];
    bool live_a[kRowsA];
#pragma unroll
    for (int j = 0; j < kRowsA; ++j)
      pa[j] = lhs + source_row(m0 + r0 + j * kRowStep, &live_a[j]) * p.k * kElemA + 16 * c;
    bool live_sa = false;                  // fp8 lhs: thread tid < BM copies row tid's scales
    const uint8_t* psa = p.lhs_scale;
    if constexpr (kFp8A) {
      if (tid < kBM) psa = p.lhs_scale + source_row(m0 + tid, &live_sa) * scale_row;
    }
    // FP4: thread tid copies chunk c & 3 of row 2 · (tid / 8) + c / 4 (+ 2 · j · kRowStep)
    const int rb = kFp4 ? 2 * r0 + (c >> 2) : r0;
    const uint8_t* pb = rhs + weight_row<kEpi>(p, n0 + rb) * wrow + 16 * (kFp4 ? c & 3 : c);
    // tile rows a thread's copies step by (kRowStep, even), as weight rows: half that when paired.
    // (The plain kernels keep their own expression below: `pb + j * bstep` there reorders their
    // PTX, and their timings were measured as written.)
    const int64_t bstep = (kEpi && p.act != 0 ? kRowStep / 2 : kRowStep) * wrow;
    const int64_t live_b = p.n - n0 - rb;   // weight row j valid: j·step < live_b
    auto load = [&](int ks) {
      if (ks < ksteps) {
        uint8_t* a = smem + (ks % kStages) * Geo::kStage;
        uint8_t* b = a + Geo::kStageA;
        const int64_t k0 = int64_t(ks) * Geo::kStepK;
#pragma unroll
        for (int h = 0; h < Geo::kSubTiles; ++h) {
          const bool k_ok = k0 + 64 * h + kChunkK * c < p.k;
#pragma unroll
          for (int j = 0; j < kRowsA; ++j) {
            const bool ok = k_ok && live_a[j];
            const uint8_t* src = pa[j] + (k0 + 64 * h) * kElemA;
            const int at = Geo::kFp4 ? swz_a4(r0 + j * kRowStep, c) : swz(r0 + j * kRowStep, c);
            cp_async16_zfill(a + h * Geo::kSubA + at, ok ? src : lhs, ok);
          }
        }
        if constexpr (kFp4) {   // K % 128 == 0: a stage's 64 bytes per row are whole
#pragma unroll
          for (int j = 0; j < kRowsB / 2; ++j) {
            const bool ok = 2 * j * kRowStep < live_b;
            const uint8_t* src = (kEpi ? pb + 2 * j * bstep : pb + int64_t(2 * j * kRowStep) * wrow) + k0 / 2;
            cp_async16_zfill(b + swz4(rb + 2 * j * kRowStep, c & 3), ok ? src : rhs, ok);
          }
        } else {
          const bool kb_ok = (k0 * kElem + 16 * c) < p.k * kElem;
#pragma unroll
          for (int j = 0; j < kRowsB; ++j) {
            const bool ok = kb_ok && j * kRowStep < live_b;
            const uint8_t* src = (kEpi ? pb + j * bstep : pb + int64_t(j) * kRowStep * wrow) + k0 * kElem;
            cp_async16_zfill(b + swz(r0 + j * kRowStep, c), ok ? src : rhs, ok);
          }
        }
        // K % 128 == 0: a stage's scale bytes are whole and aligned. Threads t < BN copy.
        if constexpr (kFp8B) if (kThreads == kBN || tid < kBN) {
          const bool ok = tid < p.n - n0;      // weight row n0 + tid < N
          if constexpr (Geo::kScaleB == 8) {
            const uint8_t* src = scales + weight_row<kEpi>(p, n0 + tid) * wscale_row + k0 / 16;
            cp_async8_zfill(b + Geo::kStageB + 8 * tid, ok ? src : scales, ok);
          } else {
            const uint8_t* src = scales + weight_row<kEpi>(p, n0 + tid) * wscale_row + k0 / 32;
            cp_async4_zfill(b + Geo::kStageB + 4 * tid, ok ? src : scales, ok);
          }
        }
        if constexpr (kFp8A) {
          if (tid < kBM)
            cp_async4_zfill(b + Geo::kStageB + 4 * kBN + 4 * tid, live_sa ? psa + k0 / 32 : psa,
                            live_sa);
        }
      }
      commit();
    };

    float acc[kMTiles][kNT][4] = {};
    for (int s = 0; s < kStages - 1; ++s) load(s);
    for (int ks = 0; ks < ksteps; ++ks) {
      wait_groups<kStages - 2>();
      __syncthreads();                  // stage ks visible; stage ks - 1 free for reuse
      load(ks + kStages - 1);
      const uint8_t* a = smem + (ks % kStages) * Geo::kStage;
      const uint8_t* b = a + Geo::kStageA;
      if constexpr (kFp4) {
        fp4_stage<kF, kMTiles, kNT>(a, b, Geo::kSubA, Geo::kStageB, acc, wn, lane);
      } else {
        // A k-step kk covers 32 bytes of every row (16 bf16 k, or 32 fp8 k: one MXFP8 block).
        // (fp8 lhs: two at a time, one with 64-row tiles; unrolled further, ptxas spills.)
#pragma unroll(kFp8A ? (kMTiles == 1 ? 2 : 1) : 4 * Geo::kSubTiles)
        for (int kk = 0; kk < 4 * Geo::kSubTiles; ++kk) {
          uint32_t bf[kNT][2];
          if constexpr (kF == Fmt::kFp8W) {
            // Thread (g, t) of n8 tile nt holds rows nt·8 + g, k = 16·kk + 2t (+1) and + 8.
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
              const int r = (wn * kNT + nt) * 8 + (lane >> 2);
              const uint8_t* q = b + swz(r, kk) + 2 * (lane & 3);
              const float2 s = e8m0_factors(b[Geo::kStageB + 4 * r + (kk >> 1)]);
              bf[nt][0] = dequant_fp8x2(*reinterpret_cast<const uint16_t*>(q), s);
              bf[nt][1] = dequant_fp8x2(*reinterpret_cast<const uint16_t*>(q + 8), s);
            }
          } else if constexpr (kNT == 4) {
            // bf16 (16 k) or fp8 (32 k) fragments: the same bytes of the same rows either way
#pragma unroll
            for (int h = 0; h < 2; ++h) {   // n8 tiles 2h, 2h + 1 of this warp's 32 columns
              const int r = wn * 32 + h * 16 + (lane & 7) + ((lane >> 4) << 3);
              uint32_t x[4];
              ldmatrix_x4(x, b + swz(r, 2 * kk + ((lane >> 3) & 1)));
              bf[2 * h][0] = x[0], bf[2 * h][1] = x[1], bf[2 * h + 1][0] = x[2],
              bf[2 * h + 1][1] = x[3];
            }
          }
          const uint8_t* a_sub = a + (kk >> 2) * Geo::kSubA;
          if constexpr (kFp8A) {
            // One MXFP8 block: each product tile from a fresh accumulator, then added to the
            // running sum times 2^(e_lhs − 127) · 2^(e_w − 127) (SPEC §9.2).
            const uint8_t* sb = b + Geo::kStageB;
            const uint8_t* sa = sb + 4 * kBN;
            uint32_t af[kMTiles][4];
            float fa[kMTiles][2];
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
              ldmatrix_x4(af[mt], a_sub + swz(mt * 16 + (lane & 15), 2 * (kk & 3) + (lane >> 4)));
              fa[mt][0] = e8m0_float(sa[4 * (mt * 16 + (lane >> 2)) + kk]);
              fa[mt][1] = e8m0_float(sa[4 * (mt * 16 + (lane >> 2) + 8) + kk]);
            }
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
              const int col = wn * 32 + nt * 8 + 2 * (lane & 3);
              const float fw0 = e8m0_float(sb[4 * col + kk]);
              const float fw1 = e8m0_float(sb[4 * col + 4 + kk]);
#pragma unroll
              for (int mt = 0; mt < kMTiles; ++mt) {
                float d[4];
                mma_fp8(d, af[mt], bf[nt][0], bf[nt][1]);
                acc[mt][nt][0] = fmaf(d[0], fa[mt][0] * fw0, acc[mt][nt][0]);
                acc[mt][nt][1] = fmaf(d[1], fa[mt][0] * fw1, acc[mt][nt][1]);
                acc[mt][nt][2] = fmaf(d[2], fa[mt][1] * fw0, acc[mt][nt][2]);
                acc[mt][nt][3] = fmaf(d[3], fa[mt][1] * fw1, acc[mt][nt][3]);
              }
            }
          } else {
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
              uint32_t af[4];
              const int r = mt * 16 + (lane & 15);
              ldmatrix_x4(af, a_sub + swz(r, 2 * (kk & 3) + (lane >> 4)));
#pragma unroll
              for (int nt = 0; nt < kNT; ++nt) mma(acc[mt][nt], af, bf[nt][0], bf[nt][1]);
            }
          }
        }
      }
    }
    wait_groups<0>();
    __syncthreads();                    // the ring is free before the next tile's prologue

    const int64_t c0 = n0 + wn * Geo::kWarpN;
    if constexpr (kEpi) store_tile_epilogue<kMTiles, kNT>(p, acc, g, m0, end, c0, lane);
    else store_tile<kMTiles, kNT>(p, acc, m0, end, c0, lane);
  }
}

// CTAs per SM the registers must allow: 4 for 16-row tiles (an fp8 lhs with 128 columns: 3,
// 168 registers and a 4-byte spill, as measured; at 2 it takes 214 registers), 2 for 64-row
// tiles. (3 CTAs of 3 stages for bf16 64-row tiles: gate_up
// 1-2 % faster, down 17-21 % slower at 2048 tokens on an H100; BENCHMARKS.md §1.)
template <Fmt kF, int kMTiles, int kWarpsN>
constexpr int kMinBlocks = kMTiles == 1 ? (kF == Fmt::kW8A8 && kWarpsN == 4 ? 3 : 4) : 2;

template <Fmt kF, int kMTiles, int kWarpsN, int kNT, int kStages, bool kEpi>
__global__ void __launch_bounds__(32 * kWarpsN, (kMinBlocks<kF, kMTiles, kWarpsN>))
grouped_matmul_kernel(GroupedMatmulParams p, int64_t unit) {
  using Geo = Geometry<kF, kMTiles, kWarpsN, kNT>;
  constexpr int kThreads = Geo::kThreads, kBN = Geo::kBN, kBM = Geo::kBM;
  extern __shared__ __align__(128) uint8_t smem[];

  // unit > 0 (Geo::kSplit launches): one CTA row per (group, chunk of unit rows); else one per
  // group. Each CTA row takes one unit (a loop over several changed how ptxas allocates the
  // tile loop, 157 registers instead of 184; the host never needs one: see launch).
  const int64_t n0 = int64_t(blockIdx.x) * kBN;
  int g;
  int64_t start, end;
  find_group<Geo::kSplit>(p.group_sizes, p.num_groups, p.m, blockIdx.y,
                         blockIdx.y == gridDim.y - 1, unit, &g, &start, &end);
  if (start >= end) return;
  if (g < 0) {  // rows no group covers: zeros (SPEC §9), out [M, N] or [M, N / 2]
    const int sh = p.act != 0 ? 1 : 0;
    const int64_t width = p.n >> sh, c0 = n0 >> sh;
    for (int64_t i = start; i < end; ++i)
      for (int64_t n = c0 + threadIdx.x; n < c0 + (kBN >> sh) && n < width; n += kThreads)
        store1(p, i * width + n, 0.0f);
    return;
  }
  gemm_rows<kF, kMTiles, kWarpsN, kNT, kStages, kEpi>(p, g, start, end, n0, smem);
}

template <Fmt kF, int kMTiles, int kWarpsN, int kStages, bool kEpi, int kNT = 4>
cudaError_t launch(const GroupedMatmulParams& p, int64_t unit, cudaStream_t stream) {
  using Geo = Geometry<kF, kMTiles, kWarpsN, kNT>;
  constexpr size_t kSmem = size_t(kStages) * Geo::kStage;
  auto kernel = grouped_matmul_kernel<kF, kMTiles, kWarpsN, kNT, kStages, kEpi>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(kSmem));
  if (e != cudaSuccess) return e;
  // At most min(G, M) groups are non-empty, holding at most min(G, M) + M / unit chunks of
  // unit rows: one CTA row each, plus the uncovered rows' one. Past the grid's 65535 rows (M
  // over ~4 M rows) a split launch takes one CTA row per group instead.
  const int64_t groups = p.num_groups < p.m ? p.num_groups : p.m;
  if (!Geo::kSplit || groups + (unit > 0 ? p.m / unit : 0) > 65534) unit = 0;
  const int64_t units = unit > 0 ? groups + p.m / unit : groups;
  const dim3 grid(unsigned((p.n + Geo::kBN - 1) / Geo::kBN), unsigned(units + 1));
  kernel<<<grid, Geo::kThreads, kSmem, stream>>>(p, unit);
  return cudaGetLastError();
}

// Whether a column tile's weights (128 × K) outgrow what L2 serves again cheaply (H200, one
// TP-8 rank of M3: gate_up's K 6144 does, down's K 384 does not; BENCHMARKS.md).
bool big_tile(const GroupedMatmulParams& p) {
  return 128 * (p.fp4 ? p.k / 2 : p.rhs_scale ? p.k : 2 * p.k) > (256 << 10);
}

// The tile's launch for each format. Stages: a ring of about 64-84 KB for 16-row tiles (4 CTAs
// per SM: the copies in flight cover the latency), 2 CTAs per SM for 64-row tiles (4 stages;
// 3 with fp8 weights and a bf16 lhs). 64-row tiles of big column tiles take one CTA row per
// (group, 64-row tile): a group's tiles run side by side and share its weights through L2,
// where one CTA walking them in turn read the weights from HBM once per tile (L2 holds far less
// than the weights the resident CTAs stream). Small column tiles (down's K 384) keep one CTA
// row per group: the second pass hits L2, and twice the CTAs would each pay the prologue.
// (Tests force either with p.block_n = 1: per tile, 2: per group; 3, 4: per chunk of 128 or
// 256 rows.)
// FP4 stages hold half the weight bytes of fp8 ones: more of them keep as many in flight.
template <Fmt kF, bool kEpi>
cudaError_t launch_tile(const GroupedMatmulParams& p, const GroupedMatmulTile& t,
                        cudaStream_t stream) {
  constexpr bool kFp8B = kF != Fmt::kBf16, kFp4 = kF == Fmt::kFp4Mx || kF == Fmt::kFp4Nv;
  if (t.block_m == 64) {
    const int64_t unit = p.block_n == 1 ? 64 : p.block_n == 2 ? 0 : p.block_n == 3 ? 128
                       : p.block_n == 4 ? 256 : big_tile(p) ? 64 : 0;
    return launch<kF, 4, 4, kF == Fmt::kFp8W ? 3 : 4, kEpi>(p, unit, stream);
  }
  constexpr int kS32 = kFp8B ? (kFp4 ? 8 : 6) : 8, kS64 = kFp8B ? (kFp4 ? 7 : 5) : 6;
  // Widened weights: four warps of BN / 4 columns (step 3); the narrower ones take one CTA row
  // per 16 rows of a group, so a skewed batch's few large groups run side by side.
  if constexpr (kF == Fmt::kFp8W || kFp4) {
    if (t.block_n == 32) return launch<kF, 1, 4, kS32, kEpi, 1>(p, 16, stream);
    if (t.block_n == 64) return launch<kF, 1, 4, kS64, kEpi, 2>(p, 16, stream);
  } else {
    if (t.block_n == 32) return launch<kF, 1, 1, kS32, kEpi>(p, 0, stream);
    if (t.block_n == 64) return launch<kF, 1, 2, kS64, kEpi>(p, 0, stream);
  }
  return launch<kF, 1, 4, kFp4 ? 6 : 4, kEpi>(p, 0, stream);
}

// Kernels with the epilogue only where it is asked for: compiled into the plain ones, its
// branches cost the plain down projection 18-36 % at prefill sizes (H100; docs/perf-log).
template <Fmt kF>
cudaError_t launch_tile(const GroupedMatmulParams& p, const GroupedMatmulTile& t,
                        cudaStream_t stream) {
  const bool epi = p.act != 0 || p.row_scale != nullptr || p.group_scale != nullptr;
  return epi ? launch_tile<kF, true>(p, t, stream) : launch_tile<kF, false>(p, t, stream);
}

// CTAs of a launch with column tiles of bn, if every possible group is non-empty.
int64_t ctas(const GroupedMatmulParams& p, int bn) {
  return (p.num_groups < p.m ? p.num_groups : p.m) * ((p.n + bn - 1) / bn);
}

}  // namespace

GroupedMatmulTile grouped_matmul_tile(const GroupedMatmulParams& p) {
  GroupedMatmulTile t = {p.block_m, p.block_n};
  if (t.block_m != 16 && t.block_m != 64) {
    // Groups of a few rows (decode): 16-row tiles, little mma on padding rows. Larger groups
    // (prefill): 64-row tiles read each weight tile once per 64 rows — from 16 rows per group
    // when a tile's weights (BN × K) outgrow what L2 serves again cheaply (H200, one TP-8 rank
    // of M3: gate_up K 6144 from 16 rows, down K 384 from 32; BENCHMARKS.md).
    const int64_t rows = p.num_groups > 0 ? p.m / p.num_groups : p.m;
    t.block_m = rows >= 32 || (rows >= 16 && big_tile(p)) ? 64 : 16;
  }
  if (t.block_m != 16 || (t.block_n != 32 && t.block_n != 64 && t.block_n != 128)) {
    // Narrower column tiles when few groups would leave SMs idle (one CTA streams its tile).
    t.block_n = t.block_m != 16 || ctas(p, 128) >= 264 ? 128 : ctas(p, 64) >= 264 ? 64 : 32;
    // Weights widened in registers (MXFP8, FP4) with a long K (gate_up's) are bound by the
    // widening's instructions: narrower tiles (four warps each, step 3) spread them over more
    // warps — for MXFP8 at every 16-row size, for FP4 up to ~64 groups of rows (one H200,
    // docs/perf-log/fp4-experts.md, round 4).
    const bool widened = p.rhs_scale != nullptr && p.lhs_scale == nullptr;
    if (t.block_m == 16 && widened && big_tile(p))
      t.block_n = p.fp4 == 0 || ctas(p, 64) < 264 ? 32 : ctas(p, 128) < 528 ? 64 : 128;
  }
  return t;
}

const char* grouped_matmul_w8a8_unsupported(int64_t k) {
  return k % 128 == 0 ? "" : "the CUDA grouped_matmul kernel needs K % 128 == 0 for MXFP8 lhs "
                             "and weights (whole stages of 128 k and 4-byte scale rows)";
}

const char* grouped_matmul_unsupported(int64_t k, bool quantized) {
  if (quantized)
    return k % 128 == 0 ? "" : "the CUDA grouped_matmul kernel needs K % 128 == 0 for MXFP8 "
                               "or FP4 weights (whole stages of 128 k and whole scale rows)";
  return k % 8 == 0 ? "" : "the CUDA grouped_matmul kernel needs K (the contracted dim) % 8 == 0";
}

cudaError_t launch_grouped_matmul(const GroupedMatmulParams& p, cudaStream_t stream) {
  const bool quantized = p.rhs_scale != nullptr, w8a8 = p.lhs_scale != nullptr;
  const bool mxfp8 = quantized && p.fp4 == 0;
  if ((w8a8 && (!mxfp8 || grouped_matmul_w8a8_unsupported(p.k)[0] != '\0')) ||
      grouped_matmul_unsupported(p.k, quantized)[0] != '\0' || p.m < 0 || p.n < 1 ||
      p.num_groups < 0 || p.num_groups > 65534 || p.fp4 < 0 || p.fp4 > 2 ||
      (p.fp4 != 0 && !quantized))
    return cudaErrorInvalidValue;
  if (p.m == 0) return cudaSuccess;
  const GroupedMatmulTile t = grouped_matmul_tile(p);
  if (w8a8) return launch_tile<Fmt::kW8A8>(p, t, stream);
  if (p.fp4 == 1) return launch_tile<Fmt::kFp4Mx>(p, t, stream);
  if (p.fp4 == 2) return launch_tile<Fmt::kFp4Nv>(p, t, stream);
  return mxfp8 ? launch_tile<Fmt::kFp8W>(p, t, stream) : launch_tile<Fmt::kBf16>(p, t, stream);
}

}  // namespace cuda
}  // namespace m3sparse
