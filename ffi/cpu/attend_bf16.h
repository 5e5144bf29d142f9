// The bf16 tile paths, `avx512` (AVX-512 BF16 dot products) and `amx` (AMX-BF16 tile
// products): one kernel, two implementations of its 16 × 16 matrix product (Mma below).
// Compiled for those targets only (target pragmas), so the module still loads anywhere; they
// never ran on the development machines (AVX2 only) and are tested where a CPU has them.
//
// Arithmetic (SPEC §5.5, docs/spec_decisions.md "bf16 tile paths"): products of bf16
// operands, accumulated in fp32.
//   - K and V: NVFP4 · E4M3 is exact in bf16, so the dequantized tiles lose nothing.
//   - q: split into hi + lo bf16 parts (q − hi is exact in fp32), two products: a bf16 or
//     fp16 q is exact, an fp32 q keeps 16 significant bits. The logit scale is applied to
//     the fp32 scores, so a bf16 q needs one product only.
//   - P (the softmax weights, in [0, 1]): rounded to bf16 once, as flash-attention kernels
//     do; the row sum l adds the rounded weights, so the weights used sum to exactly l.
//
// Layouts (the matrix product is C[16][16] += A[16][2K] · B[K][16 pairs]):
//   QK: A = 16 keys of the K tile, bf16 row-major [key][dim]; B = q in pairs of dims
//       ("VNNI"), [dim/2][head]; C = scores key-major, sT[key][head] (heads in lanes, so the
//       online softmax is vertical, one max/exp2/sum per 16 heads).
//   PV: A = P head-major [head][key] bf16 (the softmax writes it through a 16 × 16
//       transpose); B = V in pairs of keys, [key/2][dim]; C = one 16-dim slice of 16 heads'
//       output, folded into the fp32 accumulators with the softmax factor.
// Dims are stored in a permuted order within each block of 32 (k_position, v_position below),
// q in K's order, the output put back in natural order at the end. Heads are padded to 16 and
// keys to 32 with zeros (D is a multiple of 32: the cache geometry checks it).
// Only keys j < n reach the output: the softmax reads scores j < n, P is zero past n, and the
// last partial 32-key step of PV reads a copy of V whose keys ≥ n are zeroed (another token
// of the chunk may attend those keys, and they may hold NaN).
#pragma once

#include <immintrin.h>

#include "attend_common.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
#endif

namespace m3sparse {
namespace bf16tile {

using Words = std::vector<uint32_t, CacheLineAllocator<uint32_t>>;
using Halves = std::vector<uint16_t, CacheLineAllocator<uint16_t>>;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

inline uint32_t load_word(const uint16_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// The matrix products of one block, on 16 × 16 fp32 tiles. `count` (≤ 4) independent tiles
// share one operand, so AMX's multiply latency is hidden behind the others:
//   shared_b: C + t·cstep (row stride ldc floats) = [C +] A_t · B, A_t = A + t·astep;
//   shared_a: C + t·cstep = [C +] A · B_t, B_t = B + t·bstep.
// A: 16 rows of bf16 (stride lda elements); B: kpairs rows of 16 bf16 pairs (stride ldb words);
// the product sums kpairs pairs.
struct Operands {
  float* C;
  int64_t ldc, cstep;
  const uint16_t* A;
  int64_t lda, astep;
  const uint32_t* B;
  int64_t ldb, bstep, kpairs;
  int count;
  bool accumulate;
};

// AVX-512 BF16: 16 accumulator rows per tile; each B row feeds 16 vdpbf16ps with broadcast
// A pairs.
struct DotMma {
  static void begin() {}
  static void end() {}
  static void tile(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint32_t* B,
                   int64_t ldb, int64_t kpairs, bool accumulate) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int m = 0; m < 16; ++m) acc[m] = accumulate ? _mm512_loadu_ps(C + m * ldc) : _mm512_setzero_ps();
    for (int64_t k = 0; k < kpairs; ++k) {
      const __m512bh b = (__m512bh)_mm512_loadu_si512(B + k * ldb);
#pragma GCC unroll 16
      for (int m = 0; m < 16; ++m)
        acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32(int(load_word(A + m * lda + 2 * k))), b);
    }
#pragma GCC unroll 16
    for (int m = 0; m < 16; ++m) _mm512_storeu_ps(C + m * ldc, acc[m]);
  }
  static void shared_b(const Operands& o) {
    for (int t = 0; t < o.count; ++t)
      tile(o.C + t * o.cstep, o.ldc, o.A + t * o.astep, o.lda, o.B, o.ldb, o.kpairs, o.accumulate);
  }
  static void shared_a(const Operands& o) {
    for (int t = 0; t < o.count; ++t)
      tile(o.C + t * o.cstep, o.ldc, o.A, o.lda, o.B + t * o.bstep, o.ldb, o.kpairs, o.accumulate);
  }
};

// AMX: tiles 0–3 accumulate, tile 4 holds the shared operand's k-step, tiles 5–7 the others'
// (the fourth reuses 5). kpairs is a multiple of 16 (32 bf16 per A row). The configuration is
// loaded before a chunk's first block and released at its first finish (begin/end): between
// two calls, other code on the same thread (XLA's own AMX kernels) may configure the tiles
// differently. Tile numbers must be literals.
struct AmxMma {
  static void begin() {
    alignas(64) static const std::array<uint8_t, 64> config = [] {
      std::array<uint8_t, 64> c{};
      c[0] = 1;  // palette 1
      for (int t = 0; t < 8; ++t) {
        c[16 + 2 * t] = 64;  // bytes per row
        c[48 + t] = 16;      // rows
      }
      return c;
    }();
    _tile_loadconfig(config.data());
  }
  static void end() { _tile_release(); }

  static void init(const Operands& o) {
    if (o.accumulate) {
      _tile_loadd(0, o.C, o.ldc * 4);
      if (o.count > 1) _tile_loadd(1, o.C + o.cstep, o.ldc * 4);
      if (o.count > 2) _tile_loadd(2, o.C + 2 * o.cstep, o.ldc * 4);
      if (o.count > 3) _tile_loadd(3, o.C + 3 * o.cstep, o.ldc * 4);
    } else {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  static void store(const Operands& o) {
    _tile_stored(0, o.C, o.ldc * 4);
    if (o.count > 1) _tile_stored(1, o.C + o.cstep, o.ldc * 4);
    if (o.count > 2) _tile_stored(2, o.C + 2 * o.cstep, o.ldc * 4);
    if (o.count > 3) _tile_stored(3, o.C + 3 * o.cstep, o.ldc * 4);
  }
  static void shared_b(const Operands& o) {
    init(o);
    const int64_t sa = o.lda * 2, sb = o.ldb * 4;
    for (int64_t k = 0; k < o.kpairs; k += 16) {
      const uint16_t* a = o.A + 2 * k;
      _tile_loadd(4, o.B + k * o.ldb, sb);
      _tile_loadd(5, a, sa);
      _tile_dpbf16ps(0, 5, 4);
      if (o.count > 1) { _tile_loadd(6, a + o.astep, sa); _tile_dpbf16ps(1, 6, 4); }
      if (o.count > 2) { _tile_loadd(7, a + 2 * o.astep, sa); _tile_dpbf16ps(2, 7, 4); }
      if (o.count > 3) { _tile_loadd(5, a + 3 * o.astep, sa); _tile_dpbf16ps(3, 5, 4); }
    }
    store(o);
  }
  static void shared_a(const Operands& o) {
    init(o);
    const int64_t sa = o.lda * 2, sb = o.ldb * 4;
    for (int64_t k = 0; k < o.kpairs; k += 16) {
      const uint32_t* b = o.B + k * o.ldb;
      _tile_loadd(4, o.A + 2 * k, sa);
      _tile_loadd(5, b, sb);
      _tile_dpbf16ps(0, 4, 5);
      if (o.count > 1) { _tile_loadd(6, b + o.bstep, sb); _tile_dpbf16ps(1, 4, 6); }
      if (o.count > 2) { _tile_loadd(7, b + 2 * o.bstep, sb); _tile_dpbf16ps(2, 4, 7); }
      if (o.count > 3) { _tile_loadd(5, b + 3 * o.bstep, sb); _tile_dpbf16ps(3, 4, 5); }
    }
    store(o);
  }
};

// 2^x for x <= 0 (NaN stays NaN, −inf gives 0): the AVX2 path's polynomial, 16 lanes.
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-127.0f), x);  // vmaxps returns x when x is NaN
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5353362e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3398874e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503340e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022652e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// Dims are stored in blocks of 32 (two scale groups, 16 data bytes): a K row holds, per block,
// the low nibbles of its 16 bytes (even dims), then the high nibbles (odd dims); q is stored
// the same way. Position p of a block holds dim 2·(p mod 16) + p / 16.
inline int64_t k_position(int64_t d) { return (d & ~int64_t{31}) + (d & 1) * 16 + (d & 31) / 2; }

// A V pair row interleaves two keys' K-ordered rows word by word within 128-bit lanes
// (vpunpcklwd / vpunpckhwd): pair word v of a block holds K position 8·(i / 4) + i mod 4 (+ 4
// for the second half, v ≥ 16), i = v mod 16.
inline int64_t v_position(int64_t d) {
  const int64_t p = k_position(d) & 31;
  const int64_t half = (p & 4) ? 16 : 0;
  return (d & ~int64_t{31}) + half + (p / 8) * 4 + (p & 3);
}

// bf16(e2m1(code) · e4m3(scale)) for every scale byte and signed code (exact in bf16):
// 16 entries (32 bytes) per scale byte.
struct Bf16Tables {
  alignas(64) uint16_t entry[256][16];
  Bf16Tables() {
    const Nvfp4Tables& t = nvfp4_tables();
    for (int s = 0; s < 256; ++s)
      for (int c = 0; c < 16; ++c) entry[s][c] = float_to_bf16(e2m1_to_float(c) * t.scale[s]);
  }
};

inline const Bf16Tables& bf16_tables() {
  static const Bf16Tables tables;
  return tables;
}

// One key's 32 dims of a block (16 data bytes, two E4M3 scale bytes) as bf16 in K order: the
// two scales' 16-entry tables fill one register and one vpermw looks up all 32 nibbles
// (index = code + 16 · group).
inline __m512i dequantize_block(const uint8_t* bytes, const uint8_t* scales) {
  const Bf16Tables& t = bf16_tables();
  const __m256i group = _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16);
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m256i lo = _mm256_add_epi16(_mm256_and_si256(w, _mm256_set1_epi16(15)), group);
  const __m256i hi = _mm256_add_epi16(_mm256_srli_epi16(w, 4), group);
  const __m512i table = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(t.entry[scales[0]]))),
      _mm256_load_si256(reinterpret_cast<const __m256i*>(t.entry[scales[1]])), 1);
  return _mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), table);
}

// Transposes a 16 × 16 matrix of 32-bit words in place (r[i] = row i).
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + c], lane l: rows 4g..4g+3 at column 4l + c
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // row 4l + c = lane l of u[c], u[4 + c], u[8 + c], u[12 + c]
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// One worker's state (same interface as the other paths): C token slots (q in pairs, hi and
// lo; accumulators; running max and sum) and the scratch they share (the K tile in bf16, the
// V tile in key pairs, scores, P, the block's PV product). D is a multiple of 32 (the cache
// geometry checks it).
template <typename Mma>
struct Kernel {
  int64_t G, D, N, Gp, Np;
  Words qhi, qlo, vp, vtail;
  Halves kb, pa;
  Floats acc, m, l, alpha, sT, pv, out;
  std::vector<char> has_lo;
  float logit_scale = 1.0f;
  bool tiles_configured = false;  // between a chunk's first block and its first finish

  Kernel(int64_t G_, int64_t D_, int64_t N_, int64_t C_)
      : G(G_), D(D_), N(N_), Gp(round_up(G_, 16)), Np(round_up(N_, 32)), qhi(C_ * Gp * D_ / 2),
        qlo(C_ * Gp * D_ / 2), vp(Np / 2 * D_), vtail(16 * D_), kb(Np * D_), pa(Gp * Np),
        acc(C_ * Gp * D_), m(C_ * Gp), l(C_ * Gp), alpha(Gp), sT(Np * Gp), pv(16 * D_),
        out(G_ * D_), has_lo(C_) {}

  // q rows in pairs of K positions, per 16-head block: q[c][hb][position / 2][head % 16];
  // the logit scale is kept for the scores (a bf16 q then stays exact).
  void begin(int64_t c, const float* q_rows, float scale) {
    logit_scale = scale;
    uint16_t* hi = reinterpret_cast<uint16_t*>(&qhi[c * Gp * D / 2]);
    uint16_t* lo = reinterpret_cast<uint16_t*>(&qlo[c * Gp * D / 2]);
    std::fill(hi, hi + Gp * D, uint16_t(0));
    std::fill(lo, lo + Gp * D, uint16_t(0));
    bool any_lo = false;
    for (int64_t h = 0; h < G; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const int64_t p = k_position(d);
        const int64_t at = ((h / 16) * (D / 2) + p / 2) * 32 + (h % 16) * 2 + (p & 1);
        const float x = q_rows[h * D + d];
        hi[at] = float_to_bf16(x);
        lo[at] = float_to_bf16(x - bf16_to_float(hi[at]));
        any_lo |= (lo[at] & 0x7FFF) != 0;
      }
    has_lo[c] = any_lo;
    std::fill(&acc[c * Gp * D], &acc[(c + 1) * Gp * D], 0.0f);
    std::fill(&l[c * Gp], &l[(c + 1) * Gp], 0.0f);
    std::fill(&m[c * Gp], &m[(c + 1) * Gp], -INFINITY);
  }

  // Keys [0, n): K as bf16 rows, V as key pairs (zero past n up to the next multiple of 32).
  void dequantize(const CacheGeometry& geo, const uint8_t* k_tile, const uint8_t* v_tile,
                  int64_t n) {
    const int64_t row = geo.data_bytes(), srow = geo.scale_bytes();
    const uint8_t* kd = k_tile + geo.token_data_offset(0);
    const uint8_t* ks = k_tile + geo.token_scale_offset(0);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t b = 0; b < D / 32; ++b)
        _mm512_storeu_si512(&kb[j * D + 32 * b], dequantize_block(kd + j * row + 16 * b, ks + j * srow + 2 * b));
    const uint8_t* vd = v_tile + geo.token_data_offset(0);
    const uint8_t* vs = v_tile + geo.token_scale_offset(0);
    for (int64_t j = 0; j < n; j += 2)
      for (int64_t b = 0; b < D / 32; ++b) {
        const uint8_t* s = vs + j * srow + 2 * b;
        const __m512i v0 = dequantize_block(vd + j * row + 16 * b, s);
        const __m512i v1 = j + 1 < n ? dequantize_block(vd + (j + 1) * row + 16 * b, s + srow)
                                     : _mm512_setzero_si512();
        uint32_t* pair = &vp[j / 2 * D + 32 * b];
        _mm512_storeu_si512(pair, _mm512_unpacklo_epi16(v0, v1));
        _mm512_storeu_si512(pair + 16, _mm512_unpackhi_epi16(v0, v1));
      }
    std::fill(&vp[round_up(n, 2) / 2 * D], &vp[round_up(n, 32) / 2 * D], 0u);
  }

  // Folds keys [0, n) of the dequantized tile into slot c's running softmax.
  void block(int64_t c, int64_t n) {
    if (!tiles_configured) Mma::begin();
    tiles_configured = true;
    scores(c, n);
    const int64_t full = n / 32 * 32;
    if (full < n) mask_tail(full, n);
    for (int64_t hb = 0; hb < Gp / 16; ++hb) {
      softmax(c, hb, n);
      accumulate(c, hb, full, n);
    }
  }

  // sT[j][h] = q_h · k_j for keys in 16-key tiles covering [0, n), four tiles at a time (rows
  // past n unused).
  void scores(int64_t c, int64_t n) {
    for (int64_t hb = 0; hb < Gp / 16; ++hb)
      for (int64_t j0 = 0; j0 < n; j0 += 64) {
        Operands o{&sT[j0 * Gp + hb * 16], Gp, 16 * Gp, &kb[j0 * D], D, 16 * D,
                   &qhi[(c * Gp / 16 + hb) * D / 2 * 16], 16, 0, D / 2,
                   int(std::min<int64_t>(4, (n - j0 + 15) / 16)), false};
        Mma::shared_b(o);
        if (has_lo[c]) {
          o.B = &qlo[(c * Gp / 16 + hb) * D / 2 * 16];
          o.accumulate = true;
          Mma::shared_b(o);
        }
      }
  }

  // vtail = the 16 key pairs from key `full` (the last partial 32-key step), keys ≥ n zeroed.
  void mask_tail(int64_t full, int64_t n) {
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t j = full + 2 * r;
      const __m512i keep = _mm512_set1_epi32(j + 1 < n ? -1 : j < n ? 0xFFFF : 0);
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_si512(&vtail[r * D + d],
                            _mm512_and_si512(keep, _mm512_loadu_si512(&vp[(full / 2 + r) * D + d])));
    }
  }

  // Online softmax of keys [0, n) for heads [16·hb, 16·hb + 16): P rounded to bf16 into
  // pa[head][key] (zero from n to the next multiple of 32), m and l updated, alpha set.
  void softmax(int64_t c, int64_t hb, int64_t n) {
    const float* s = &sT[hb * 16];
    const __m512 scale = _mm512_set1_ps(logit_scale);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; ++j) mx = _mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(s + j * Gp), scale), mx);
    float* mc = &m[c * Gp + hb * 16];
    const __m512 m_old = _mm512_loadu_ps(mc);
    const __m512 m_new = _mm512_max_ps(mx, m_old);
    const __m512 a = exp2_ps(_mm512_sub_ps(m_old, m_new));
    __m512 sum = _mm512_setzero_ps();
    auto weight = [&](int64_t j) {  // bf16(P[j][heads]) in the low halves; 0 past n
      if (j >= n) return _mm512_setzero_si512();
      const __m512 p = exp2_ps(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + j * Gp), scale), m_new));
      const __m512i b = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p));
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)));
      return b;
    };
    for (int64_t j0 = 0; j0 < n; j0 += 32) {
      __m512i w[16];
      for (int r = 0; r < 16; ++r) {
        const __m512i p0 = weight(j0 + 2 * r);
        w[r] = _mm512_or_si512(p0, _mm512_slli_epi32(weight(j0 + 2 * r + 1), 16));
      }
      transpose16(w);  // w[h]: the 32 weights of head h, as 16 pairs
      for (int h = 0; h < 16; ++h) _mm512_storeu_si512(&pa[(hb * 16 + h) * Np + j0], w[h]);
    }
    _mm512_storeu_ps(mc, m_new);
    float* lc = &l[c * Gp + hb * 16];
    _mm512_storeu_ps(lc, _mm512_fmadd_ps(_mm512_loadu_ps(lc), a, sum));
    _mm512_storeu_ps(&alpha[hb * 16], a);
  }

  // acc[h][·] = alpha[h] · acc[h][·] + Σ_{j<n} P[h][j] · V[j][·] for the 16 heads of block hb:
  // keys [0, full) from the tile, the rest from the masked tail, 4 × 16 dims at a time.
  void accumulate(int64_t c, int64_t hb, int64_t full, int64_t n) {
    const uint16_t* p = &pa[hb * 16 * Np];
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int count = int(std::min<int64_t>(4, (D - d0) / 16));
      if (full > 0) Mma::shared_a({&pv[d0], D, 16, p, Np, 0, &vp[d0], D, 16, full / 2, count, false});
      if (full < n)
        Mma::shared_a({&pv[d0], D, 16, p + full, Np, 0, &vtail[d0], D, 16, 16, count, full > 0});
    }
    for (int h = 0; h < 16; ++h) {
      float* a = &acc[(c * Gp + hb * 16 + h) * D];
      const __m512 f = _mm512_set1_ps(alpha[hb * 16 + h]);
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(a + d, _mm512_fmadd_ps(_mm512_loadu_ps(a + d), f, _mm512_loadu_ps(&pv[h * D + d])));
    }
  }

  // Slot c's rows, out[h][d] (natural order) = acc / l · v_scale, or zeros if nothing was
  // attended.
  const float* finish(int64_t c, bool attended, float v_scale) {
    if (tiles_configured) Mma::end();
    tiles_configured = false;
    normalized_rows(out.data(), &acc[c * Gp * D], &l[c * Gp], G, D, attended, v_scale, v_position);
    return out.data();
  }
};

}  // namespace bf16tile
}  // namespace m3sparse

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
