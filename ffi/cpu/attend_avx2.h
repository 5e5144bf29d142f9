// The AVX2 + FMA attention path (fp32 compute, SPEC §5.5), compiled for that target only
// (a target pragma, not a build flag), so the module still loads on CPUs without AVX2.
//
// 1. Dequantization (SPEC §2.1): 8 data bytes of a 16-element group → 16 floats. The group's
//    E4M3 scale multiplies the 8 E2M1 magnitudes once (exact: ≤ 6 significant bits); each
//    nibble picks its magnitude with one vpermps and gets its sign by one xor (bit 3 → 31).
//    Low nibbles (even dims) and high nibbles (odd dims) land in separate vectors, so a tile
//    row holds the dims of each group as [0,2,…,14,1,3,…,15]. q is loaded in the same order
//    and the output is put back in natural order at the end: dot products do not care.
// 2. K and V are both dequantized token-major ([N][D]). Heads live in vector lanes: q is kept
//    transposed, so QK broadcasts one K element against 8 heads (12 accumulators: 6 keys × 16
//    heads), and the scores come out key-major. PV broadcasts p to 6 heads and streams V rows,
//    rescaling the accumulators by the softmax factor as it loads them.
// 3. Online softmax in base 2, 8 heads per vector, never a reduction across lanes; only keys
//    j < n are scored, normalized and summed, and PV reads only those, so bytes past n (page
//    tails, possibly NaN) never reach the output.
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
  // Entry i of the scaled table is stored with i << 28 xor-ed in: xor-ing the looked-up entry
  // with (nibble << 28) then cancels those bits and leaves the nibble's sign bit at bit 31,
  // one masking op less per 8 elements (exact for any scale, NaN included).
  const __m256 prexor = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), 28));
  const int64_t D = geo.head_dim, row = geo.data_bytes(), srow = geo.scale_bytes();
  const uint8_t* data = tile + geo.token_data_offset(0);
  const uint8_t* scales = tile + geo.token_scale_offset(0);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t gi = 0; gi < srow; ++gi) {
      const __m256i lo = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(data + j * row + gi * 8)));
      const __m256i hi = _mm256_srli_epi32(lo, 4);
      const __m256 t = _mm256_xor_ps(
          _mm256_mul_ps(magnitudes, _mm256_set1_ps(scale_of[scales[j * srow + gi]])), prexor);
      const __m256 vlo = _mm256_xor_ps(_mm256_permutevar8x32_ps(t, lo),
                                       _mm256_castsi256_ps(_mm256_slli_epi32(lo, 28)));
      const __m256 vhi = _mm256_xor_ps(_mm256_permutevar8x32_ps(t, hi),
                                       _mm256_castsi256_ps(_mm256_slli_epi32(hi, 28)));
      _mm256_storeu_ps(dst + j * D + gi * 16, vlo);
      _mm256_storeu_ps(dst + j * D + gi * 16 + 8, vhi);
    }
  }
}

// Heads live in vector lanes from here on: q is stored transposed, qT[d][Gp] (Gp = G rounded
// up to 8, the padding heads zero), and the scores key-major, sT[j][Gp]. QK then broadcasts one
// K element against 8 heads at a time (no horizontal reductions), and the online softmax is
// vertical: one max, exp2 and sum per 8 heads, never a reduction across lanes.

// sT[j0 + i][hv·8 ..] = Σ_d K[j0 + i][d] · qT[d][hv·8 ..] for i < J keys, hv < HV head
// vectors (J·HV ≤ 12 accumulators; with the q vectors and one broadcast that fills the 16 ymm
// registers). Accumulators by name through a fixed-size array the compiler keeps in registers
// once the loops over J and HV are unrolled.
template <int HV, int J>
inline void qk_block(const float* qT, const float* k, float* sT, int64_t D, int64_t Gp, int64_t j0) {
  __m256 acc[J][HV];
#pragma GCC unroll 12
  for (int i = 0; i < J; ++i)
#pragma GCC unroll 2
    for (int hv = 0; hv < HV; ++hv) acc[i][hv] = _mm256_setzero_ps();
  const float* k0 = k + j0 * D;
  for (int64_t d = 0; d < D; ++d) {
    __m256 qv[HV];
#pragma GCC unroll 2
    for (int hv = 0; hv < HV; ++hv) qv[hv] = _mm256_loadu_ps(qT + d * Gp + 8 * hv);
#pragma GCC unroll 12
    for (int i = 0; i < J; ++i) {
      const __m256 kb = _mm256_broadcast_ss(k0 + i * D + d);
#pragma GCC unroll 2
      for (int hv = 0; hv < HV; ++hv) acc[i][hv] = _mm256_fmadd_ps(kb, qv[hv], acc[i][hv]);
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < J; ++i)
#pragma GCC unroll 2
    for (int hv = 0; hv < HV; ++hv) _mm256_storeu_ps(sT + (j0 + i) * Gp + 8 * hv, acc[i][hv]);
}

// Scores of keys [0, n) for all heads: 12-accumulator blocks, then the tail in pairs and singles.
template <int HV>
inline void qk_tile(const float* qT, const float* k, float* sT, int64_t D, int64_t n, int64_t Gp) {
  constexpr int J = 12 / HV;
  int64_t j0 = 0;
  for (; j0 + J <= n; j0 += J) qk_block<HV, J>(qT, k, sT, D, Gp, j0);
  for (; j0 + 2 <= n; j0 += 2) qk_block<HV, 2>(qT, k, sT, D, Gp, j0);
  for (; j0 < n; ++j0) qk_block<HV, 1>(qT, k, sT, D, Gp, j0);
}

// acc[h][d0..d0+16) = alpha[h] · acc[h][d0..d0+16) + Σ_{j<n} p[j][h] · v[j][d0..d0+16) for
// heads [h0, h0+H) (p key-major with row stride Gp). H·2 accumulator chains, by name through
// an array the unrolled loops keep in registers; 2 V loads and H broadcasts per H·2 FMAs.
template <int H>
inline void pv_block(const float* p, const float* alpha, const float* v, float* acc, int64_t D,
                     int64_t Gp, int64_t n, int64_t h0, int64_t d0) {
  __m256 lo[H], hi[H];
#pragma GCC unroll 6
  for (int i = 0; i < H; ++i) {
    const __m256 a = _mm256_broadcast_ss(alpha + h0 + i);
    lo[i] = _mm256_mul_ps(a, _mm256_loadu_ps(acc + (h0 + i) * D + d0));
    hi[i] = _mm256_mul_ps(a, _mm256_loadu_ps(acc + (h0 + i) * D + d0 + 8));
  }
  for (int64_t j = 0; j < n; ++j) {
    const __m256 vl = _mm256_loadu_ps(v + j * D + d0), vh = _mm256_loadu_ps(v + j * D + d0 + 8);
#pragma GCC unroll 6
    for (int i = 0; i < H; ++i) {
      const __m256 pj = _mm256_broadcast_ss(p + j * Gp + h0 + i);
      lo[i] = _mm256_fmadd_ps(pj, vl, lo[i]);
      hi[i] = _mm256_fmadd_ps(pj, vh, hi[i]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < H; ++i) {
    _mm256_storeu_ps(acc + (h0 + i) * D + d0, lo[i]);
    _mm256_storeu_ps(acc + (h0 + i) * D + d0 + 8, hi[i]);
  }
}

// Online softmax of keys [0, n) for 8 heads (lanes): sT rows → p in place (stride Gp), the
// running max m and sum l updated, alpha = the factor the heads' accumulators must take.
// vmaxps(s, mx) returns mx when s is NaN; a NaN score still reaches p (and the output)
// through exp2, so NaN in attended bytes stays visible.
inline void softmax_lanes(float* sT, int64_t Gp, int64_t n, float* m, float* l, float* alpha) {
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; ++j) mx = _mm256_max_ps(_mm256_loadu_ps(sT + j * Gp), mx);
  const __m256 m_old = _mm256_loadu_ps(m);
  const __m256 m_new = _mm256_max_ps(mx, m_old);
  const __m256 a = exp2_ps(_mm256_sub_ps(m_old, m_new));
  __m256 sum0 = _mm256_setzero_ps(), sum1 = sum0;
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    const __m256 p0 = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(sT + j * Gp), m_new));
    const __m256 p1 = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(sT + (j + 1) * Gp), m_new));
    _mm256_storeu_ps(sT + j * Gp, p0);
    _mm256_storeu_ps(sT + (j + 1) * Gp, p1);
    sum0 = _mm256_add_ps(sum0, p0);
    sum1 = _mm256_add_ps(sum1, p1);
  }
  if (j < n) {
    const __m256 p0 = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(sT + j * Gp), m_new));
    _mm256_storeu_ps(sT + j * Gp, p0);
    sum0 = _mm256_add_ps(sum0, p0);
  }
  _mm256_storeu_ps(m, m_new);
  _mm256_storeu_ps(l, _mm256_fmadd_ps(_mm256_loadu_ps(l), a, _mm256_add_ps(sum0, sum1)));
  _mm256_storeu_ps(alpha, a);
}

// One worker's state: C token slots (q transposed, accumulators, running max and sum), and
// the scratch they share: the dequantized K/V tile and the scores. Per-head arrays have Gp
// lanes; the padding heads are computed and never stored.
struct Kernel {
  int64_t G, D, N, Gp;
  Floats qT, acc, m, l, alpha, k, v, sT, out;

  Kernel(int64_t G_, int64_t D_, int64_t N_, int64_t C_)
      : G(G_), D(D_), N(N_), Gp((G_ + 7) / 8 * 8), qT(C_ * Gp * D_), acc(C_ * G_ * D_),
        m(C_ * Gp), l(C_ * Gp), alpha(Gp), k(N_ * D_), v(N_ * D_), sT(N_ * Gp), out(G_ * D_) {}

  void begin(int64_t c, const float* q_rows, float logit_scale) {
    float* q = &qT[c * Gp * D];
    std::fill(q, q + Gp * D, 0.0f);
    for (int64_t h = 0; h < G; ++h)
      for (int64_t d = 0; d < D; ++d) q[stored_dim(d) * Gp + h] = q_rows[h * D + d] * logit_scale;
    std::fill(&acc[c * G * D], &acc[(c + 1) * G * D], 0.0f);
    std::fill(&l[c * Gp], &l[(c + 1) * Gp], 0.0f);
    std::fill(&m[c * Gp], &m[(c + 1) * Gp], -INFINITY);
  }

  // Keys [0, n) of a (K, V) tile pair, into the shared scratch.
  void dequantize(const CacheGeometry& geo, const uint8_t* k_tile, const uint8_t* v_tile,
                  int64_t n) {
    dequantize_rows(geo, k_tile, n, k.data());
    dequantize_rows(geo, v_tile, n, v.data());
  }

  // Folds keys [0, n) of the dequantized tile into slot c's running softmax (n ≤ the n the
  // tile was dequantized with): rows past n are never read.
  void block(int64_t c, int64_t n) {
    const float* q = &qT[c * Gp * D];
    float* a = &acc[c * G * D];
    for (int64_t h8 = 0; h8 < Gp; h8 += 16) {
      if (h8 + 16 <= Gp) qk_tile<2>(q + h8, k.data(), sT.data() + h8, D, n, Gp);
      else qk_tile<1>(q + h8, k.data(), sT.data() + h8, D, n, Gp);
    }
    for (int64_t h8 = 0; h8 < Gp; h8 += 8)
      softmax_lanes(&sT[h8], Gp, n, &m[c * Gp + h8], &l[c * Gp + h8], &alpha[h8]);
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      int64_t h = 0;
      for (; h + 6 <= G; h += 6) pv_block<6>(sT.data(), alpha.data(), v.data(), a, D, Gp, n, h, d0);
      for (; h + 4 <= G; h += 4) pv_block<4>(sT.data(), alpha.data(), v.data(), a, D, Gp, n, h, d0);
      for (; h < G; ++h) pv_block<1>(sT.data(), alpha.data(), v.data(), a, D, Gp, n, h, d0);
    }
  }

  // Slot c's rows, out[h][d] (natural order) = acc / l · v_scale, or zeros if nothing was
  // attended.
  const float* finish(int64_t c, bool attended, float v_scale) {
    normalized_rows(out.data(), &acc[c * G * D], &l[c * Gp], G, D, attended, v_scale, stored_dim);
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
