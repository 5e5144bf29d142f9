// The CPU sparse-attention core shared by the decode and prefill handlers (SPEC §5).
//
// Work item = (token t, KV head g). The G = Hq/Hkv query heads of g share every
// dequantized K/V tile. For each selected block the SPEC §5.2 validity rules are
// checked before the page is touched; only the attended tokens of a valid page
// (p < vis) are dequantized, so garbage in page tails never reaches the softmax
// or the PV product. Online softmax in base 2, fp32 accumulation; k_scale is folded
// into the logit scale and v_scale into the epilogue. A row with nothing attended
// gets exact zeros.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <memory>
#include <vector>

#include "elements.h"
#include "m3sparse/cache.h"
#include "m3sparse/ffi_checks.h"
#include "m3sparse/nvfp4.h"
#include "parallel.h"

namespace m3sparse {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int64_t kItemsPerTask = 1;  // one item is 16 blocks of work: worth a task of its own

struct AttendArgs {
  CacheGeometry geo;
  const uint8_t* cache;
  int64_t layer;
  ffi::DataType dtype;
  const void* q;        // [T, Hq, D]
  void* out;            // [T, Hq, D]
  const int32_t* topk;  // [Hkv, T, K]
  const int32_t* block_table;  // [R, max_blocks]
  int64_t num_tokens, num_heads, num_kv_heads, topk_blocks, num_requests, max_blocks;
  float logit_scale;    // scale · k_scale · log2(e)
  float v_scale;
  std::shared_ptr<std::vector<int32_t>> req, pos;  // per token: request (−1: none), absolute position
};

// Lookup tables: the two E2M1 values of a data byte, and the value of an E4M3 scale byte.
struct Nvfp4Tables {
  std::array<float, 512> pair;
  std::array<float, 256> scale;
  Nvfp4Tables() {
    for (int b = 0; b < 256; ++b) {
      pair[2 * b] = e2m1_to_float(b & 15);
      pair[2 * b + 1] = e2m1_to_float(b >> 4);
      scale[b] = e4m3_to_float(uint8_t(b));
    }
  }
};

inline const Nvfp4Tables& nvfp4_tables() {
  static const Nvfp4Tables tables;
  return tables;
}

// 2^x for x <= 0 (x = −inf gives 0), relative error ~2e-7; branch-free so loops vectorize.
inline float fast_exp2(float x) {
  x = std::max(x, -127.0f);
  float n = std::floor(x);
  float f = x - n;
  float p = 1.5353362e-4f;
  p = p * f + 1.3398874e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5503340e-2f;
  p = p * f + 2.4022652e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  int32_t e = int32_t(n) + 127;
  return p * bits_float(uint32_t(std::max(e, 0)) << 23);
}

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

// Scratch space of one worker, reused across work items.
struct AttendScratch {
  std::vector<float> q, kt, v, s, acc, m, l, scales;
  AttendScratch(int64_t G, int64_t D, int64_t N)
      : q(G * D), kt(D * N), v(N * D), s(G * N), acc(G * D), m(G), l(G), scales(N * D / 16) {}
};

// SPEC §5.2: the page of a selected block, or −1 if the slot is invalid.
inline int64_t selected_page(const AttendArgs& a, int64_t r, int64_t b, int64_t vis) {
  if (b < 0 || b >= a.max_blocks || b * a.geo.block_size >= vis) return -1;
  int64_t page = a.block_table[r * a.max_blocks + b];
  return a.geo.valid_page(page) ? page : -1;
}

// 8-lane float vectors (GCC/Clang vector extensions: AVX2 registers where the CPU has them,
// pairs of SSE registers otherwise). Register-blocked so each loaded K/V vector feeds many FMAs.
typedef float v8f __attribute__((vector_size(32)));
inline v8f load8(const float* p) { v8f v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }

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

// Folds one selected block (n attended keys) into the running softmax of G heads.
// Scores of lanes j >= n (stale tile columns) are computed but never read.
inline void attend_block(const AttendArgs& a, AttendScratch& w, int64_t G, int64_t g, int64_t page,
                         int64_t n) {
  const int64_t D = a.geo.head_dim, N = a.geo.block_size;
  const uint8_t* k_tile = a.cache + a.geo.tile_offset(a.layer, page, 2 * g);
  const uint8_t* v_tile = a.cache + a.geo.tile_offset(a.layer, page, 2 * g + 1);
  dequantize_tile(a.geo, k_tile, n, w.kt.data(), N, /*transposed=*/true, w.scales.data());
  dequantize_tile(a.geo, v_tile, n, w.v.data(), D, /*transposed=*/false, w.scales.data());
  for (int64_t j0 = 0; j0 < n; j0 += 8)
    over_heads(G, [&](auto H, int64_t i0) {
      qk_tile<decltype(H)::value>(w.q.data(), w.kt.data(), w.s.data(), D, N, i0, j0);
    });
  for (int64_t i = 0; i < G; ++i) {
    float* s = &w.s[i * N];
    float block_max = -INFINITY;
    for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, s[j]);
    const float m_new = std::max(w.m[i], block_max);
    const float alpha = fast_exp2(w.m[i] - m_new);
    // Separate loops: the exp2 loop vectorizes; the sum (a float reduction) would stop it.
    for (int64_t j = 0; j < n; ++j) s[j] = fast_exp2(s[j] - m_new);
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) sum += s[j];
    w.m[i] = m_new;
    w.l[i] = w.l[i] * alpha + sum;
    float* acc = &w.acc[i * D];
    for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
  }
  for (int64_t d0 = 0; d0 < D; d0 += 16)
    over_heads(G, [&](auto H, int64_t i0) {
      pv_tile<decltype(H)::value>(w.s.data(), w.v.data(), w.acc.data(), D, N, n, i0, d0);
    });
}

inline void attend_item(const AttendArgs& a, AttendScratch& w, int64_t t, int64_t g) {
  const int64_t D = a.geo.head_dim, N = a.geo.block_size;
  const int64_t G = a.num_heads / a.num_kv_heads;
  const int64_t row = (t * a.num_heads + g * G) * D;  // first of the G query heads of g
  std::fill(w.acc.begin(), w.acc.end(), 0.0f);
  std::fill(w.l.begin(), w.l.end(), 0.0f);
  std::fill(w.m.begin(), w.m.end(), -INFINITY);
  const int64_t r = (*a.req)[t];
  const int64_t vis = int64_t((*a.pos)[t]) + 1;
  bool attended = false;  // a NaN in attended bytes must stay visible, so track this apart from l
  if (r >= 0 && r < a.num_requests && vis > 0 && a.geo.valid_layer(a.layer)) {
    load_floats(a.dtype, a.q, row, G * D, w.q.data());
    for (float& x : w.q) x *= a.logit_scale;
    const int32_t* ids = a.topk + (g * a.num_tokens + t) * a.topk_blocks;
    for (int64_t k = 0; k < a.topk_blocks; ++k) {
      const int64_t page = selected_page(a, r, ids[k], vis);
      if (page < 0) continue;
      attend_block(a, w, G, g, page, std::min(N, vis - int64_t(ids[k]) * N));
      attended = true;
    }
  }
  for (int64_t i = 0; i < G; ++i) {
    float* acc = &w.acc[i * D];
    const float norm = a.v_scale / w.l[i];
    for (int64_t d = 0; d < D; ++d) acc[d] = attended ? acc[d] * norm : 0.0f;
  }
  store_floats(a.dtype, w.acc.data(), G * D, a.out, row);
}

// Validates the operands shared by decode and prefill and fills everything but req/pos.
inline ffi::Error prepare_attend(ffi::AnyBuffer q, ffi::AnyBuffer cache, ffi::Buffer<ffi::S32> topk,
                                 ffi::Buffer<ffi::S32> block_table, float k_scale, float v_scale,
                                 int32_t layer, ffi::Result<ffi::AnyBuffer> out, float scale,
                                 int64_t layout, AttendArgs* a) {
  auto qd = q.dimensions();
  auto td = topk.dimensions();
  auto bd = block_table.dimensions();
  if (qd.size() != 3) return invalid("q must be [T, Hq, D]");
  if (!is_supported_float(q.element_type()) || out->element_type() != q.element_type())
    return invalid("q and out must share one float dtype (f32, bf16, f16)");
  if (auto e = decode_cache_geometry(cache, layout, qd[2], &a->geo); e.failure()) return e;
  if (td.size() != 3 || td[1] != qd[0] || 2 * td[0] != a->geo.num_slots)
    return invalid("topk_indices must be [Hkv, T, K]");
  if (bd.size() != 2) return invalid("block_table must be [R, max_blocks]");
  if (qd[1] % td[0] != 0) return invalid("Hq must be a multiple of Hkv");
  a->cache = static_cast<const uint8_t*>(cache.untyped_data());
  a->layer = layer;
  a->dtype = q.element_type();
  a->q = q.untyped_data();
  a->out = out->untyped_data();
  a->topk = topk.typed_data();
  a->block_table = block_table.typed_data();
  a->num_tokens = qd[0];
  a->num_heads = qd[1];
  a->num_kv_heads = td[0];
  a->topk_blocks = td[2];
  a->num_requests = bd[0];
  a->max_blocks = bd[1];
  a->logit_scale = scale * k_scale * kLog2e;
  a->v_scale = v_scale;
  return ffi::Error::Success();
}

// Runs every (token, KV head) item on the thread pool.
inline ffi::Future run_attend(ffi::ThreadPool& pool, AttendArgs a) {
  const int64_t items = a.num_tokens * a.num_kv_heads;
  return parallel_for(pool, items, kItemsPerTask, [a](int64_t begin, int64_t end) {
    const int64_t G = a.num_heads / a.num_kv_heads;
    AttendScratch w(G, a.geo.head_dim, a.geo.block_size);
    for (int64_t item = begin; item < end; ++item)
      attend_item(a, w, item / a.num_kv_heads, item % a.num_kv_heads);
  });
}

}  // namespace m3sparse
