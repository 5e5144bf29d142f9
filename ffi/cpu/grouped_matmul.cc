// grouped_matmul on the CPU (SPEC §9): the routed experts of a mixture of experts, each group's
// weights dequantized once per call and multiplied with that group's rows only.
//
// Work mapping:
// 1. Groups. Sizes are clamped to [0, M] and summed in 64 bits; group g covers rows
//    [min(S_g, M), min(S_g + size_g, M)). Rows after the last group's end are written 0.
// 2. Items. A pool task takes (group, chunk of kChunk weight rows): the chunk's rows are
//    dequantized into an fp32 tile (bf16 widened; MXFP8 / MXFP4 / NVFP4 by SPEC §9.1 / §9.3,
//    the values of the jnp reference's W), then every row tile of the group meets them. With
//    an activation a chunk holds gate rows j and up rows N/2 + j of the same output columns,
//    so the epilogue joins them in the task. An empty group's weights are never read.
// 3. Dot products. out[i, n] = Σ_k lhs[i, k] · W[n, k] in fp32, each as 8 lane sums (lane l
//    takes k = l, l + 8, ...: one explicit fma each, in increasing k) folded as
//    ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) — built with -ffp-contract=off, so a
//    row's result depends only on its row and its group's matrix (SPEC §9 item 3), whatever
//    the tile it sits in.
// 4. Epilogue (SPEC §9 item 6): group_scale, the activation, row_scale, each multiply rounded
//    on its own; then the store, fp32 or bf16 rounded to nearest even (item 5).
// An MXFP8 lhs (W8A8, §9.2) is not served here: the primitive lowers it to the reference.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "m3sparse/ffi_checks.h"
#include "m3sparse/nvfp4.h"
#include "parallel.h"
#include "vec8.h"

namespace m3sparse {
namespace {

constexpr int64_t kLanes = 8;   // partial sums per dot product
constexpr int64_t kChunk = 32;  // weight rows dequantized per task (16 output columns with an activation)
constexpr int64_t kRowTile = 4;

struct Args {
  const void* lhs;
  const void* rhs;
  const uint8_t* rhs_scale;
  const int32_t* lhs_rows;  // nullptr: row i of the product is lhs row i
  const float* row_scale;   // nullptr: none
  const float* group_scale;
  void* out;
  int64_t m, n, k, kp, groups, lhs_count;
  int weights, activation;
  bool out_bf16;
  float alpha, limit;
};

// ---- the weights' values (SPEC §9.1, §9.3) ------------------------------------------------

// Every E4M3 byte's value and every E2M1 code's (e4m3_to_float, e2m1_to_float), looked up.
struct Tables {
  float e4m3[256], e2m1[16];
  Tables() {
    for (int i = 0; i < 256; ++i) e4m3[i] = e4m3_to_float(uint8_t(i));
    for (int i = 0; i < 16; ++i) e2m1[i] = e2m1_to_float(unsigned(i));
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}

// dst[i] = v[i] · 2^(e − 127) for n ≤ 32 values of one E8M0 block, as SPEC §9.1 items 1–2 say:
// e = 255 NaN, e = 0 the subnormal 2^-127; a product below 2^-126 is ±0 with its sign. No
// subnormal operand is formed (e = 0 multiplies by 2^-64, then 2^-63) and the flush is explicit,
// so MXCSR's FTZ / DAZ change nothing. v has ≤ 4 significant bits: the product is exact when
// normal (no bf16 rounding needed); past fp32's range it is ±inf.
inline void times_e8m0(const float* v, uint8_t e, int64_t n, float* dst) {
  const float f1 = e == 255 ? std::numeric_limits<float>::quiet_NaN()
                            : e == 0 ? 0x1p-64f : bits_float(uint32_t(e) << 23);
  const float f2 = e == 0 ? 0x1p-63f : 1.0f;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float p = (v[i] * f1) * f2;
    dst[i] = std::fabs(p) < 0x1p-126f ? std::copysign(0.0f, p) : p;
  }
}

// Weight rows ids[0 .. rows) of group g as fp32, Kp floats each (zero past K), into tile.
void dequantize_rows(const Args& a, int64_t g, const int64_t* ids, int64_t rows, float* tile) {
  const int64_t K = a.k;
  const Tables& t = tables();
  float v[32];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = g * a.n + ids[r];
    float* dst = tile + r * a.kp;
    if (a.weights == kGroupedBf16) {
      const uint16_t* w = static_cast<const uint16_t*>(a.rhs) + row * K;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) dst[k] = bf16_to_float(w[k]);
    } else if (a.weights == kGroupedMxfp8) {
      const uint8_t* w = static_cast<const uint8_t*>(a.rhs) + row * K;
      const uint8_t* s = a.rhs_scale + row * (K / 32);
      for (int64_t k0 = 0; k0 < K; k0 += 32) {
        for (int64_t i = 0; i < 32; ++i) v[i] = t.e4m3[w[k0 + i]];
        times_e8m0(v, s[k0 / 32], 32, dst + k0);
      }
    } else {  // packed E2M1, element 2i in the low nibble of byte i
      const uint8_t* w = static_cast<const uint8_t*>(a.rhs) + row * (K / 2);
      const bool nv = a.weights == kGroupedNvfp4;
      const int64_t block = nv ? 16 : 32;
      const uint8_t* s = a.rhs_scale + row * (K / block);
      for (int64_t k0 = 0; k0 < K; k0 += block) {
        for (int64_t i = 0; i < block; i += 2) {
          const uint8_t byte = w[(k0 + i) / 2];
          v[i] = t.e2m1[byte & 15u];
          v[i + 1] = t.e2m1[byte >> 4];
        }
        if (nv) {  // e2m1 · E4M3 scale: exact (≤ 6 significant bits); a NaN scale gives NaN
          const float scale = t.e4m3[s[k0 / 16]];
#pragma omp simd
          for (int64_t i = 0; i < 16; ++i) dst[k0 + i] = v[i] * scale;
        } else {
          times_e8m0(v, s[k0 / 32], 32, dst + k0);
        }
      }
    }
    std::fill(dst + K, dst + a.kp, 0.0f);
  }
}

// ---- dot products -------------------------------------------------------------------------

using generic::fma8;
using generic::load8;
using generic::v8f;

// d[r][c] = x_r · w_c for R rows of x and C rows of w (Kp floats each, Kp % 8 == 0), in the
// summation layout of step 3. The R · C ≤ 8 accumulators are vector values, so they stay in
// registers (as a float array GCC kept most of them on the stack).
template <int R, int C>
void dots(const float* const* x, const float* const* w, int64_t kp, float (*d)[C]) {
  v8f acc[R][C] = {};
  for (int64_t k = 0; k < kp; k += kLanes) {
    v8f xv[R], wv[C];
    for (int r = 0; r < R; ++r) xv[r] = load8(x[r] + k);
    for (int c = 0; c < C; ++c) wv[c] = load8(w[c] + k);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = fma8(xv[r], wv[c], acc[r][c]);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) d[r][c] = generic::fold8(acc[r][c]);
}

// y[r][c] for R rows against the tile's `rows` weight rows, C at a time (a group of C past the
// last row repeats it; its results are dropped).
template <int R, int C>
void rows_times_tile(const float* const* x, const float* tile, int64_t rows, int64_t kp,
                     float* y /* [R][kChunk] */) {
  for (int64_t c0 = 0; c0 < rows; c0 += C) {
    const float* w[C];
    for (int c = 0; c < C; ++c) w[c] = tile + std::min<int64_t>(c0 + c, rows - 1) * kp;
    float d[R][C];
    dots<R, C>(x, w, kp, d);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C && c0 + c < rows; ++c) y[r * kChunk + c0 + c] = d[r][c];
  }
}

// ---- the epilogue (SPEC §9 item 6) --------------------------------------------------------

inline float activate(const Args& a, float gate, float up) {
  if (a.activation == 1) return (gate * (1.0f / (1.0f + std::exp(-gate)))) * up;
  const float g = gate > a.limit ? a.limit : gate;  // comparisons: a NaN gate or up stays NaN
  const float u = up < -a.limit ? -a.limit : up > a.limit ? a.limit : up;
  return ((u + 1.0f) * g) * (1.0f / (1.0f + std::exp(-(g * a.alpha))));
}

inline void store(const Args& a, int64_t i, int64_t col, float v) {
  const int64_t cols = a.activation ? a.n / 2 : a.n;
  if (a.out_bf16) static_cast<uint16_t*>(a.out)[i * cols + col] = float_to_bf16(v);
  else static_cast<float*>(a.out)[i * cols + col] = v;
}

// ---- one (group, chunk) task --------------------------------------------------------------

struct Item {
  int64_t group, row0, row1, chunk;  // product rows [row0, row1); output columns of `chunk`
};

struct Buffers {
  std::vector<float> tile, x, y;
};

void run_item(const Args& a, Buffers& buf, const Item& it) {
  // the chunk's weight rows: output columns [c0, c1), and with an activation their up rows
  const int64_t cols = a.activation ? a.n / 2 : a.n;
  const int64_t per = a.activation ? kChunk / 2 : kChunk;
  const int64_t c0 = it.chunk * per, c1 = std::min(cols, c0 + per), nc = c1 - c0;
  int64_t ids[kChunk];
  for (int64_t j = 0; j < nc; ++j) {
    ids[j] = c0 + j;
    if (a.activation) ids[nc + j] = a.n / 2 + c0 + j;
  }
  const int64_t rows = a.activation ? 2 * nc : nc;
  buf.tile.resize(kChunk * a.kp);
  buf.x.resize(kRowTile * a.kp);
  buf.y.resize(kRowTile * kChunk);
  dequantize_rows(a, it.group, ids, rows, buf.tile.data());
  const float gscale = a.group_scale ? a.group_scale[it.group] : 1.0f;
  for (int64_t i0 = it.row0; i0 < it.row1; i0 += kRowTile) {
    const int64_t nr = std::min(kRowTile, it.row1 - i0);
    const float* x[kRowTile];
    for (int64_t r = 0; r < nr; ++r) {
      float* dst = buf.x.data() + r * a.kp;
      const int64_t src = a.lhs_rows ? a.lhs_rows[i0 + r] : i0 + r;
      if (src < 0 || src >= a.lhs_count) {           // SPEC §9 item 4: a zero row
        std::fill(dst, dst + a.kp, 0.0f);
      } else {
        const uint16_t* l = static_cast<const uint16_t*>(a.lhs) + src * a.k;
        for (int64_t k = 0; k < a.k; ++k) dst[k] = bf16_to_float(l[k]);
        std::fill(dst + a.k, dst + a.kp, 0.0f);
      }
      x[r] = dst;
    }
    float* y = buf.y.data();
    const float* tile = buf.tile.data();
    switch (nr) {  // R · C = 8 independent fma chains, whatever is left of the group
      case 1: rows_times_tile<1, 8>(x, tile, rows, a.kp, y); break;
      case 2: rows_times_tile<2, 4>(x, tile, rows, a.kp, y); break;
      case 3: rows_times_tile<3, 2>(x, tile, rows, a.kp, y); break;
      default: rows_times_tile<4, 2>(x, tile, rows, a.kp, y);
    }
    for (int64_t r = 0; r < nr; ++r) {
      const float* yr = y + r * kChunk;
      const float rscale = a.row_scale ? a.row_scale[i0 + r] : 1.0f;
      for (int64_t j = 0; j < nc; ++j) {
        float v = yr[j];
        if (a.group_scale) v = v * gscale;
        if (a.activation) {
          float up = yr[nc + j];
          if (a.group_scale) up = up * gscale;
          v = activate(a, v, up);
        }
        if (a.row_scale) v = v * rscale;
        store(a, i0 + r, c0 + j, v);
      }
    }
  }
}

ffi::Future GroupedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                          ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer rhs_scale,
                          ffi::Buffer<ffi::S32> lhs_rows, ffi::Buffer<ffi::U8> lhs_scale,
                          ffi::Buffer<ffi::F32> row_scale, ffi::Buffer<ffi::F32> group_scale,
                          ffi::Result<ffi::AnyBuffer> out, int64_t gather, int64_t activation,
                          float alpha, float limit) {
  GroupedGeometry g;
  if (auto e = decode_grouped_geometry(lhs, rhs, group_sizes, rhs_scale, lhs_rows, lhs_scale,
                                       row_scale, group_scale, *out, gather, activation, &g);
      e.failure())
    return ready_future(std::move(e));
  if (g.w8a8)  // the primitive lowers an MXFP8 lhs to the reference on the CPU
    return ready_future(invalid("grouped_matmul (CPU): an MXFP8 lhs is served by the reference"));
  if (g.weights != kGroupedBf16 && g.k % (g.weights == kGroupedNvfp4 ? 16 : 32) != 0)
    return ready_future(invalid("grouped_matmul: quantized weights need whole scale blocks "
                                "(K % 32 == 0; NVFP4: K % 16 == 0)"));
  Args a;
  a.lhs = lhs.untyped_data();
  a.rhs = rhs.untyped_data();
  a.rhs_scale = g.weights == kGroupedBf16 ? nullptr
                                          : static_cast<const uint8_t*>(rhs_scale.untyped_data());
  a.lhs_rows = gather ? lhs_rows.typed_data() : nullptr;
  a.row_scale = g.row_scaled ? row_scale.typed_data() : nullptr;
  a.group_scale = g.group_scaled ? group_scale.typed_data() : nullptr;
  a.out = out->untyped_data();
  a.m = g.m;
  a.n = g.n;
  a.k = g.k;
  a.kp = (g.k + kLanes - 1) / kLanes * kLanes;
  a.groups = g.num_groups;
  a.lhs_count = g.lhs_count;
  a.weights = g.weights;
  a.activation = int(activation);
  a.out_bf16 = g.out_bf16;
  a.alpha = alpha;
  a.limit = limit;

  // Step 1: the groups' rows; step 2: one item per (non-empty group, chunk).
  const int32_t* sizes = group_sizes.typed_data();
  const int64_t cols = a.activation ? a.n / 2 : a.n;
  const int64_t per = a.activation ? kChunk / 2 : kChunk;
  const int64_t chunks = (cols + per - 1) / per;
  auto items = std::make_shared<std::vector<Item>>();
  int64_t end = 0;
  for (int64_t gi = 0; gi < a.groups; ++gi) {
    const int64_t start = end;
    end = std::min(a.m, end + std::clamp<int64_t>(sizes[gi], 0, a.m));
    if (end > start)  // K = 0 too: the epilogue of an empty sum (0) is still applied
      for (int64_t c = 0; c < chunks; ++c) items->push_back({gi, start, end, c});
  }
  const int64_t elem = a.out_bf16 ? 2 : 4;  // rows no group covers are 0
  std::memset(static_cast<char*>(a.out) + end * cols * elem, 0, (a.m - end) * cols * elem);
  return parallel_for(pool, int64_t(items->size()), 1, [a, items](int64_t begin, int64_t stop) {
    thread_local Buffers buf;
    for (int64_t i = begin; i < stop; ++i) run_item(a, buf, (*items)[i]);
  });
}

}  // namespace
}  // namespace m3sparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_grouped_matmul_cpu, m3sparse::GroupedMatmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()               // lhs
                                  .Arg<xla::ffi::AnyBuffer>()               // rhs
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // group_sizes
                                  .Arg<xla::ffi::AnyBuffer>()               // rhs_scale
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // lhs_rows
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()    // lhs_scale
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // row_scale
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // group_scale
                                  .Ret<xla::ffi::AnyBuffer>()               // out
                                  .Attr<int64_t>("gather")
                                  .Attr<int64_t>("activation")
                                  .Attr<float>("alpha")
                                  .Attr<float>("limit"));
