// The AVX2 + FMA attention path (fp32 compute, SPEC §5.5), compiled for that target only
// (a target pragma, not a build flag), so the module still loads on CPUs without AVX2.
//
// 1. Dequantization (SPEC §2.1): 8 data bytes of a 16-element group → 16 floats. The group's
//    E4M3 scale multiplies the 8 E2M1 magnitudes once (exact: ≤ 6 significant bits); each
//    nibble picks its magnitude with one vpermps and its sign by an xor of bit 3 into bit 31.
//    Low nibbles (even dims) and high nibbles (odd dims) land in separate vectors, so a tile
//    row holds the dims of each group as [0,2,…,14,1,3,…,15]. q is loaded in the same order
//    and the output is put back in natural order at the end: dot products do not care.
// 2. K and V are both dequantized token-major ([N][D]); QK reduces 2 heads × 4 keys per
//    register block with a horizontal-add tree; PV broadcasts p to 6 heads and streams V rows.
// 3. Online softmax in base 2, 8 lanes at a time; lanes past the n attended keys are masked
//    to −inf before the max and to 0 in the sum, and PV reads only keys j < n, so bytes past
//    n (page tails, possibly NaN) never reach the output.
#pragma once

#include <immintrin.h>

#include "attend_common.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

namespace m3sparse {
namespace avx2 {

// Where dim d of a group-of-16 layout is stored (see 1. above).
inline int64_t stored_dim(int64_t d) {
  const int64_t i = d & 15;
  return (d & ~int64_t{15}) + ((i & 1) ? 8 + i / 2 : i / 2);
}

// 2^x for x <= 0 (NaN stays NaN, −inf gives 0); no float→int conversion of NaN in C++.
inline __m256 exp2_ps(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-127.0f), x);  // vmaxps returns x when x is NaN
  const __m256 n = _mm256_floor_ps(x);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.5353362e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3398874e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5503340e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022652e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  // n in [−127, 0] (or NaN, where vcvttps2dq's defined result is irrelevant: p is NaN).
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Tokens [0, n) of a (page, slot) tile as fp32 rows dst[j·D + stored_dim(d)] (global scale
// not applied).
inline void dequantize_rows(const CacheGeometry& geo, const uint8_t* tile, int64_t n, float* dst) {
  const float* scale_of = nvfp4_tables().scale.data();
  const __m256 magnitudes = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256i sign = _mm256_set1_epi32(int(0x80000000u));
  const int64_t D = geo.head_dim, row = geo.data_bytes(), srow = geo.scale_bytes();
  const uint8_t* data = tile + geo.token_data_offset(0);
  const uint8_t* scales = tile + geo.token_scale_offset(0);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t gi = 0; gi < srow; ++gi) {
      const __m256i lo = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(data + j * row + gi * 8)));
      const __m256i hi = _mm256_srli_epi32(lo, 4);
      const __m256 t = _mm256_mul_ps(magnitudes, _mm256_set1_ps(scale_of[scales[j * srow + gi]]));
      const __m256 vlo = _mm256_xor_ps(_mm256_permutevar8x32_ps(t, lo),
                                       _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(lo, 28), sign)));
      const __m256 vhi = _mm256_xor_ps(_mm256_permutevar8x32_ps(t, hi),
                                       _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(hi, 28), sign)));
      _mm256_storeu_ps(dst + j * D + gi * 16, vlo);
      _mm256_storeu_ps(dst + j * D + gi * 16 + 8, vhi);
    }
  }
}

// [Σa0, Σa1, …, Σa7] of eight vectors.
inline __m256 reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                      __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// s[h][j] = q_h · k_j for heads [h0, h0+H) (H = 1 or 2), keys [j0, j0+4), rows of length D.
// Accumulators by name (an indexed __m256 array would live on the stack). The four K vectors
// are pinned in registers (the empty asm): folded into the FMAs as memory operands they
// would be loaded once per head, and the loads, not the FMAs, would set the pace.
template <int H>
inline void qk_block(const float* q, const float* k, float* s, int64_t D, int64_t N, int64_t h0,
                     int64_t j0) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  const float* q0 = q + h0 * D;
  const float* q1 = q0 + (H == 2 ? D : 0);
  const float* k0 = k + j0 * D;
  for (int64_t d = 0; d < D; d += 8) {
    __m256 x0 = _mm256_loadu_ps(k0 + d), x1 = _mm256_loadu_ps(k0 + D + d);
    __m256 x2 = _mm256_loadu_ps(k0 + 2 * D + d), x3 = _mm256_loadu_ps(k0 + 3 * D + d);
    __asm__("" : "+x"(x0), "+x"(x1), "+x"(x2), "+x"(x3));
    const __m256 qa = _mm256_loadu_ps(q0 + d);
    a0 = _mm256_fmadd_ps(qa, x0, a0);
    a1 = _mm256_fmadd_ps(qa, x1, a1);
    a2 = _mm256_fmadd_ps(qa, x2, a2);
    a3 = _mm256_fmadd_ps(qa, x3, a3);
    if (H == 2) {
      const __m256 qb = _mm256_loadu_ps(q1 + d);
      b0 = _mm256_fmadd_ps(qb, x0, b0);
      b1 = _mm256_fmadd_ps(qb, x1, b1);
      b2 = _mm256_fmadd_ps(qb, x2, b2);
      b3 = _mm256_fmadd_ps(qb, x3, b3);
    }
  }
  alignas(32) float r[8];
  _mm256_store_ps(r, reduce8(a0, a1, a2, a3, b0, b1, b2, b3));
  std::memcpy(s + h0 * N + j0, r, 4 * sizeof(float));
  if (H == 2) std::memcpy(s + (h0 + 1) * N + j0, r + 4, 4 * sizeof(float));
}

// acc[h][d0..d0+16) += Σ_{j<n} p[h][j] · v[j][d0..d0+16) for heads [h0, h0+4), the eight
// accumulators written out by name: GCC keeps an indexed __m256 array on the stack here.
inline void pv_block4(const float* p, const float* v, float* acc, int64_t D, int64_t N, int64_t n,
                      int64_t h0, int64_t d0) {
  float* a0 = acc + h0 * D + d0;
  const float* p0 = p + h0 * N;
  __m256 l0 = _mm256_loadu_ps(a0), u0 = _mm256_loadu_ps(a0 + 8);
  __m256 l1 = _mm256_loadu_ps(a0 + D), u1 = _mm256_loadu_ps(a0 + D + 8);
  __m256 l2 = _mm256_loadu_ps(a0 + 2 * D), u2 = _mm256_loadu_ps(a0 + 2 * D + 8);
  __m256 l3 = _mm256_loadu_ps(a0 + 3 * D), u3 = _mm256_loadu_ps(a0 + 3 * D + 8);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 vl = _mm256_loadu_ps(v + j * D + d0), vh = _mm256_loadu_ps(v + j * D + d0 + 8);
    __m256 pj = _mm256_broadcast_ss(p0 + j);
    l0 = _mm256_fmadd_ps(pj, vl, l0);
    u0 = _mm256_fmadd_ps(pj, vh, u0);
    pj = _mm256_broadcast_ss(p0 + N + j);
    l1 = _mm256_fmadd_ps(pj, vl, l1);
    u1 = _mm256_fmadd_ps(pj, vh, u1);
    pj = _mm256_broadcast_ss(p0 + 2 * N + j);
    l2 = _mm256_fmadd_ps(pj, vl, l2);
    u2 = _mm256_fmadd_ps(pj, vh, u2);
    pj = _mm256_broadcast_ss(p0 + 3 * N + j);
    l3 = _mm256_fmadd_ps(pj, vl, l3);
    u3 = _mm256_fmadd_ps(pj, vh, u3);
  }
  _mm256_storeu_ps(a0, l0), _mm256_storeu_ps(a0 + 8, u0);
  _mm256_storeu_ps(a0 + D, l1), _mm256_storeu_ps(a0 + D + 8, u1);
  _mm256_storeu_ps(a0 + 2 * D, l2), _mm256_storeu_ps(a0 + 2 * D + 8, u2);
  _mm256_storeu_ps(a0 + 3 * D, l3), _mm256_storeu_ps(a0 + 3 * D + 8, u3);
}

// The same for heads [h0, h0+6): twelve accumulator chains, more than the FMA pipes' latency
// needs, and 8 loads per 12 FMAs.
inline void pv_block6(const float* p, const float* v, float* acc, int64_t D, int64_t N, int64_t n,
                      int64_t h0, int64_t d0) {
  float* a0 = acc + h0 * D + d0;
  const float* p0 = p + h0 * N;
  __m256 l0 = _mm256_loadu_ps(a0), u0 = _mm256_loadu_ps(a0 + 8);
  __m256 l1 = _mm256_loadu_ps(a0 + D), u1 = _mm256_loadu_ps(a0 + D + 8);
  __m256 l2 = _mm256_loadu_ps(a0 + 2 * D), u2 = _mm256_loadu_ps(a0 + 2 * D + 8);
  __m256 l3 = _mm256_loadu_ps(a0 + 3 * D), u3 = _mm256_loadu_ps(a0 + 3 * D + 8);
  __m256 l4 = _mm256_loadu_ps(a0 + 4 * D), u4 = _mm256_loadu_ps(a0 + 4 * D + 8);
  __m256 l5 = _mm256_loadu_ps(a0 + 5 * D), u5 = _mm256_loadu_ps(a0 + 5 * D + 8);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 vl = _mm256_loadu_ps(v + j * D + d0), vh = _mm256_loadu_ps(v + j * D + d0 + 8);
    __m256 pj = _mm256_broadcast_ss(p0 + j);
    l0 = _mm256_fmadd_ps(pj, vl, l0), u0 = _mm256_fmadd_ps(pj, vh, u0);
    pj = _mm256_broadcast_ss(p0 + N + j);
    l1 = _mm256_fmadd_ps(pj, vl, l1), u1 = _mm256_fmadd_ps(pj, vh, u1);
    pj = _mm256_broadcast_ss(p0 + 2 * N + j);
    l2 = _mm256_fmadd_ps(pj, vl, l2), u2 = _mm256_fmadd_ps(pj, vh, u2);
    pj = _mm256_broadcast_ss(p0 + 3 * N + j);
    l3 = _mm256_fmadd_ps(pj, vl, l3), u3 = _mm256_fmadd_ps(pj, vh, u3);
    pj = _mm256_broadcast_ss(p0 + 4 * N + j);
    l4 = _mm256_fmadd_ps(pj, vl, l4), u4 = _mm256_fmadd_ps(pj, vh, u4);
    pj = _mm256_broadcast_ss(p0 + 5 * N + j);
    l5 = _mm256_fmadd_ps(pj, vl, l5), u5 = _mm256_fmadd_ps(pj, vh, u5);
  }
  _mm256_storeu_ps(a0, l0), _mm256_storeu_ps(a0 + 8, u0);
  _mm256_storeu_ps(a0 + D, l1), _mm256_storeu_ps(a0 + D + 8, u1);
  _mm256_storeu_ps(a0 + 2 * D, l2), _mm256_storeu_ps(a0 + 2 * D + 8, u2);
  _mm256_storeu_ps(a0 + 3 * D, l3), _mm256_storeu_ps(a0 + 3 * D + 8, u3);
  _mm256_storeu_ps(a0 + 4 * D, l4), _mm256_storeu_ps(a0 + 4 * D + 8, u4);
  _mm256_storeu_ps(a0 + 5 * D, l5), _mm256_storeu_ps(a0 + 5 * D + 8, u5);
}

// The same for one head.
inline void pv_block1(const float* p, const float* v, float* acc, int64_t D, int64_t N, int64_t n,
                      int64_t h, int64_t d0) {
  float* a = acc + h * D + d0;
  __m256 lo = _mm256_loadu_ps(a), hi = _mm256_loadu_ps(a + 8);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_broadcast_ss(p + h * N + j);
    lo = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * D + d0), lo);
    hi = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * D + d0 + 8), hi);
  }
  _mm256_storeu_ps(a, lo), _mm256_storeu_ps(a + 8, hi);
}

// Online softmax of one head's scores s[0, n) against running (m, l); leaves p in s and
// returns the factor the head's accumulator must be scaled by.
inline float softmax_row(float* s, int64_t n, float* m, float* l) {
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 vmax = neg_inf;
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(n - j)), lane));
    vmax = _mm256_max_ps(_mm256_blendv_ps(neg_inf, _mm256_loadu_ps(s + j), live), vmax);
  }
  const float m_new = std::max(*m, hmax(vmax));
  const float alpha = fast_exp2(*m - m_new);
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(n - j)), lane));
    const __m256 p = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, p);
    sum = _mm256_add_ps(sum, _mm256_and_ps(p, live));
  }
  *m = m_new;
  *l = *l * alpha + hsum(sum);
  return alpha;
}

// One worker's state: q, scores, accumulators, and an LRU cache of dequantized tiles.
struct Kernel {
  int64_t G, D, N;
  std::vector<float> q, s, acc, m, l, out;
  TileCache<float> tiles;

  Kernel(int64_t G_, int64_t D_, int64_t N_)
      : G(G_), D(D_), N(N_), q(G_ * D_), s(G_ * N_), acc(G_ * D_), m(G_), l(G_), out(G_ * D_),
        tiles(N_ * D_) {}

  void reset() { tiles.clear(); }

  void begin(const float* q_rows, float logit_scale) {
    for (int64_t h = 0; h < G; ++h)
      for (int64_t d = 0; d < D; ++d) q[h * D + stored_dim(d)] = q_rows[h * D + d] * logit_scale;
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(l.begin(), l.end(), 0.0f);
    std::fill(m.begin(), m.end(), -INFINITY);
  }

  // reuse: a neighbouring token of the same request may select this tile too.
  void block(const CacheGeometry& geo, const uint8_t* k_tile, const uint8_t* v_tile, int64_t n,
             bool reuse) {
    float *k, *v;
    if (!reuse) tiles.scratch(&k, &v);
    if (!reuse || !tiles.find(k_tile, n, &k, &v)) {
      dequantize_rows(geo, k_tile, n, k);
      dequantize_rows(geo, v_tile, n, v);
    }
    for (int64_t j0 = 0; j0 < n; j0 += 4) {  // rows past n: stale or zero, their scores unread
      int64_t h = 0;
      for (; h + 2 <= G; h += 2) qk_block<2>(q.data(), k, s.data(), D, N, h, j0);
      if (h < G) qk_block<1>(q.data(), k, s.data(), D, N, h, j0);
    }
    for (int64_t h = 0; h < G; ++h) {
      const __m256 alpha = _mm256_set1_ps(softmax_row(&s[h * N], n, &m[h], &l[h]));
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(&acc[h * D + d], _mm256_mul_ps(alpha, _mm256_loadu_ps(&acc[h * D + d])));
    }
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      int64_t h = 0;
      for (; h + 6 <= G; h += 6) pv_block6(s.data(), v, acc.data(), D, N, n, h, d0);
      for (; h + 4 <= G; h += 4) pv_block4(s.data(), v, acc.data(), D, N, n, h, d0);
      for (; h < G; ++h) pv_block1(s.data(), v, acc.data(), D, N, n, h, d0);
    }
  }

  // out[h][d] (natural order) = acc / l · v_scale, or zeros if nothing was attended.
  const float* finish(bool attended, float v_scale) {
    for (int64_t h = 0; h < G; ++h) {
      const float norm = v_scale / l[h];
      for (int64_t d = 0; d < D; ++d)
        out[h * D + d] = attended ? acc[h * D + stored_dim(d)] * norm : 0.0f;
    }
    return out.data();
  }
};

}  // namespace avx2
}  // namespace m3sparse

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
