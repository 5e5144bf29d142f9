// The portable attention path (fp32, GCC/Clang vector extensions, no ISA assumptions):
// what every CPU runs when it has no AVX2, and the baseline the SIMD paths are tested
// beside. The K tile is dequantized transposed ([D][N]) so the QK micro-kernel streams
// 8 keys per load; V is dequantized token-major.
#pragma once

#include <type_traits>

#include "attend_common.h"
#include "vec8.h"

namespace m3sparse {
namespace generic {

// Dequantizes tokens [0, n) of a (page, slot) tile (without the global scale).
// transposed: dst[d * stride + j] (the K tile, for the QK micro-kernel), walking tokens in
// the inner loop so the stores stay contiguous; else dst[j * stride + d] (the V tile).
// `sc` is scratch for n · D/16 floats.
inline void dequantize_tile(const CacheGeometry& geo, const uint8_t* tile, int64_t n, float* dst,
                            int64_t stride, bool transposed, float* sc) {
  const Nvfp4Tables& tb = nvfp4_tables();
  const int64_t D = geo.head_dim;
  const uint8_t* data = tile + geo.token_data_offset(0);
  const uint8_t* scales = tile + geo.token_scale_offset(0);
  const int64_t row = geo.data_bytes(), srow = geo.scale_bytes();
  if (transposed) {
    // The tile's block scales as floats, once, instead of a table lookup per element pair.
    for (int64_t i = 0; i < n * srow; ++i) sc[i] = tb.scale[scales[i]];
    for (int64_t d = 0; d < D; d += 2) {
      float* lo = dst + d * stride;
      float* hi = lo + stride;
      for (int64_t j = 0; j < n; ++j) {
        const float s = sc[j * srow + d / kNvfp4Group];
        const float* v = &tb.pair[2 * data[j * row + d / 2]];
        lo[j] = v[0] * s;
        hi[j] = v[1] * s;
      }
    }
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t d = 0; d < D; d += 2) {
      const float s = tb.scale[scales[j * srow + d / kNvfp4Group]];
      const float* v = &tb.pair[2 * data[j * row + d / 2]];
      dst[j * stride + d] = v[0] * s;
      dst[j * stride + d + 1] = v[1] * s;
    }
  }
}

// 8-lane float vectors (vec8.h), register-blocked so each loaded K/V vector feeds many FMAs.

// s[i][j0..j0+8) = q_i · k_j for H heads from i0; kt is the transposed tile [D][N].
template <int H>
inline void qk_tile(const float* q, const float* kt, float* s, int64_t D, int64_t N, int64_t i0,
                    int64_t j0) {
  v8f acc[H] = {};
  for (int64_t d = 0; d < D; ++d) {
    const v8f k = load8(kt + d * N + j0);
    for (int h = 0; h < H; ++h) acc[h] += q[(i0 + h) * D + d] * k;
  }
  for (int h = 0; h < H; ++h) store8(s + (i0 + h) * N + j0, acc[h]);
}

// acc[i][d0..d0+16) += Σ_j p[i][j] · v[j][d0..d0+16) for H heads from i0, over n keys.
template <int H>
inline void pv_tile(const float* p, const float* v, float* acc, int64_t D, int64_t N, int64_t n,
                    int64_t i0, int64_t d0) {
  v8f lo[H], hi[H];
  for (int h = 0; h < H; ++h) {
    lo[h] = load8(acc + (i0 + h) * D + d0);
    hi[h] = load8(acc + (i0 + h) * D + d0 + 8);
  }
  for (int64_t j = 0; j < n; ++j) {
    const v8f vl = load8(v + j * D + d0), vh = load8(v + j * D + d0 + 8);
    for (int h = 0; h < H; ++h) {
      const float pj = p[(i0 + h) * N + j];
      lo[h] += pj * vl;
      hi[h] += pj * vh;
    }
  }
  for (int h = 0; h < H; ++h) {
    store8(acc + (i0 + h) * D + d0, lo[h]);
    store8(acc + (i0 + h) * D + d0 + 8, hi[h]);
  }
}

// Runs tile(H, i0) over heads [0, G) in blocks of 8, then 4, then 1.
template <typename Tile>
inline void over_heads(int64_t G, Tile tile) {
  int64_t i = 0;
  for (; i + 8 <= G; i += 8) tile(std::integral_constant<int, 8>(), i);
  for (; i + 4 <= G; i += 4) tile(std::integral_constant<int, 4>(), i);
  for (; i < G; ++i) tile(std::integral_constant<int, 1>(), i);
}

// One worker's state: C token slots (q, accumulators, running max and sum) and the scratch
// they share (the dequantized tile, scores). Same interface as the SIMD paths.
struct Kernel {
  int64_t G, D, N;
  Floats q, acc, m, l, kt, v, s, scales, out;

  Kernel(int64_t G_, int64_t D_, int64_t N_, int64_t C_)
      : G(G_), D(D_), N(N_), q(C_ * G_ * D_), acc(C_ * G_ * D_), m(C_ * G_), l(C_ * G_),
        kt(D_ * N_), v(N_ * D_), s(G_ * N_), scales(N_ * D_ / 16), out(G_ * D_) {}

  void begin(int64_t c, const float* q_rows, float logit_scale) {
    for (int64_t i = 0; i < G * D; ++i) q[c * G * D + i] = q_rows[i] * logit_scale;
    std::fill(&acc[c * G * D], &acc[(c + 1) * G * D], 0.0f);
    std::fill(&l[c * G], &l[(c + 1) * G], 0.0f);
    std::fill(&m[c * G], &m[(c + 1) * G], -INFINITY);
  }

  void dequantize(const CacheGeometry& geo, const uint8_t* k_tile, const uint8_t* v_tile,
                  int64_t n) {
    dequantize_tile(geo, k_tile, n, kt.data(), N, /*transposed=*/true, scales.data());
    dequantize_tile(geo, v_tile, n, v.data(), D, /*transposed=*/false, scales.data());
  }

  // Folds keys [0, n) of the dequantized tile into slot c's running softmax of G heads.
  // Scores of lanes j >= n (stale tile columns) are computed but never read.
  void block(int64_t c, int64_t n) {
    const float* qc = &q[c * G * D];
    float* ac = &acc[c * G * D];
    for (int64_t j0 = 0; j0 < n; j0 += 8)
      over_heads(G, [&](auto H, int64_t i0) {
        qk_tile<decltype(H)::value>(qc, kt.data(), s.data(), D, N, i0, j0);
      });
    for (int64_t i = 0; i < G; ++i) {
      float* si = &s[i * N];
      float& mi = m[c * G + i];
      float block_max = -INFINITY;
      for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, si[j]);
      const float m_new = std::max(mi, block_max);
      const float alpha = fast_exp2(mi - m_new);
      // Separate loops: the exp2 loop vectorizes; the sum (a float reduction) would stop it.
      for (int64_t j = 0; j < n; ++j) si[j] = fast_exp2(si[j] - m_new);
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) sum += si[j];
      mi = m_new;
      l[c * G + i] = l[c * G + i] * alpha + sum;
      float* acc_i = &ac[i * D];
      for (int64_t d = 0; d < D; ++d) acc_i[d] *= alpha;
    }
    for (int64_t d0 = 0; d0 < D; d0 += 16)
      over_heads(G, [&](auto H, int64_t i0) {
        pv_tile<decltype(H)::value>(s.data(), v.data(), ac, D, N, n, i0, d0);
      });
  }

  // Slot c's acc / l · v_scale, or zeros if nothing was attended (a NaN must stay visible,
  // so this is decided by `attended`, not by l).
  const float* finish(int64_t c, bool attended, float v_scale) {
    normalized_rows(out.data(), &acc[c * G * D], &l[c * G], G, D, attended, v_scale,
                    [](int64_t d) { return d; });
    return out.data();
  }
};

}  // namespace generic
}  // namespace m3sparse
