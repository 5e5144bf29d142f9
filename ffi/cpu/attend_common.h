// Pieces every CPU attention path shares: the operands of a call, NVFP4 lookup tables,
// SPEC §5.2 block validity, a scalar exp2, cache-line-aligned buffers and tile prefetching.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "elements.h"
#include "m3sparse/cache.h"
#include "m3sparse/nvfp4.h"

namespace m3sparse {

constexpr float kLog2e = 1.4426950408889634f;

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

// 2^x for x <= 0 (x = −inf gives 0, NaN gives NaN), relative error ~2e-7; branch-free so
// loops vectorize. The exponent is converted to int only after fmax/fmin bring it into
// [−127, 127]: converting a NaN or huge float to int is undefined behaviour in C++.
inline float fast_exp2(float x) {
  x = std::max(x, -127.0f);  // keeps NaN (the comparison is false)
  const float n = std::floor(x);
  const float f = x - n;     // NaN for NaN x, so p and the result are NaN
  float p = 1.5353362e-4f;
  p = p * f + 1.3398874e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5503340e-2f;
  p = p * f + 2.4022652e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  const int32_t e = int32_t(std::fmin(std::fmax(n, -127.0f), 127.0f)) + 127;  // fmax(NaN, ·) = ·
  return p * bits_float(uint32_t(e) << 23);
}

// A slot's finished rows: out[h][d] = acc[h · D + position(d)] · v_scale / l[h] for the G
// heads, or exact zeros if the slot attended nothing (a NaN must stay visible, so this is
// decided by `attended`, not by l).
template <typename Position>
inline void normalized_rows(float* out, const float* acc, const float* l, int64_t G, int64_t D,
                            bool attended, float v_scale, Position position) {
  for (int64_t h = 0; h < G; ++h) {
    const float norm = v_scale / l[h];
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = attended ? acc[h * D + position(d)] * norm : 0.0f;
  }
}

// SPEC §5.2: the page of a selected block, or −1 if the slot is invalid.
inline int64_t selected_page(const AttendArgs& a, int64_t r, int64_t b, int64_t vis) {
  if (b < 0 || b >= a.max_blocks || b * a.geo.block_size >= vis) return -1;
  int64_t page = a.block_table[r * a.max_blocks + b];
  return a.geo.valid_page(page) ? page : -1;
}

// Cache-line-aligned float buffers for the kernels' tiles and rows: from the default heap a
// 32-byte vector load would split across two cache lines one time in four.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  bool operator==(const CacheLineAllocator&) const { return true; }
  bool operator!=(const CacheLineAllocator&) const { return false; }
};
using Floats = std::vector<float, CacheLineAllocator<float>>;

// Asks for the K and V tiles of KV head g in `page` ahead of use (prefetches never fault; the
// page was validated by selected_page).
inline void prefetch_tiles(const AttendArgs& a, int64_t page, int64_t g) {
  for (int64_t slot = 2 * g; slot < 2 * g + 2; ++slot) {
    const uint8_t* tile = a.cache + a.geo.tile_offset(a.layer, page, slot);
    for (int64_t b = 0; b < a.geo.tile_bytes(); b += 64) __builtin_prefetch(tile + b);
  }
}

}  // namespace m3sparse
