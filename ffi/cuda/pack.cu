// pack_kv_pages for CUDA (SPEC §2.2, §3.2–§3.4): one pass, bit-identical to
// m3sparse::nvfp4_quantize_group (nvfp4.h), which the CPU backend runs. fp32 round-to-nearest-even
// throughout; this file is compiled without fast-math and every rounding step is an explicit
// __f*_rn intrinsic, so nothing can contract into an FMA.
//
// The kernel was issue-bound (about 40 instructions per element, most of them on the half-rate
// integer pipe), not memory-bound, so the scheme is built around per-element instruction count:
//  - a = |x|·r, then y = RN(a/sf) by Markstein's division (q = RN(a·rc), rc = RN(1/sf) once per
//    group, y = RN(q + RN(a − q·sf)·rc)), as before;
//  - the E2M1 magnitude index of y on the FP pipe: it is rint(φ(y)) for the concave piecewise
//    linear φ(y) = min(2y, y + 2, y/2 + 4) (grid points map to 0..7, the ties of SPEC §2.2 to
//    half-integers that rint sends to the even index), i.e. min(rint(2y), rint(y) + 2,
//    rint(y/2) + 4); each rint is one FFMA/FADD with a 2^23 magic constant (the index is then the
//    low bits of the float), the two mins are FMNMX;
//  - the eight indices of a word are packed by an integer Horner chain (IMAD), saturated to 7 and
//    given their signs with a few word-wide (SWAR) operations: the sign is read from the input's
//    sign bits (sign(y) = sign(x) wherever the index is not 0) and applied where the index is not
//    0, so −0 and tiny negatives stay +0;
//  - RN(amax/6) by Markstein with the constant RN(1/6) (exact for all fp32 with a normal
//    quotient), the E4M3 scale byte by bit rounding, {sf, RN(1/sf)} from a per-block table in
//    shared memory; for a power-of-two r (the default g = 1) the table holds {sf/r, r·RN(1/sf)} and
//    |x| enters the division directly (same bits, one multiply fewer per element);
//  - NaN, ±Inf, groups whose scale saturates (s > 448) and r > 2^100 take nvfp4.h's own function
//    (a branch, rare).
// The arithmetic was checked on the host, compiled from this file, against nvfp4.h: the E2M1 index
// after Markstein for every fp32 a in [sf/8, 12·sf] and every scale byte, RN(amax/6) for every
// fp32, the E4M3 rounding for every v in [2^-9, 448], whole groups at every threshold and at random;
// the harness's "pack division" test runs the same function (quantize_groups_kernel) on the device.
// Threads: one lane quantizes two groups (32 elements) of one token's K or V head vector, so a
// head vector of D = 128 is 4 lanes: four 16-byte loads (streaming), one 16-byte store of data and
// one 2-byte store of scales per lane (the token's 64 data bytes and 8 scale bytes of a head slot
// are contiguous across its 4 lanes). Warps hold one side (K or V: one r); resident blocks loop
// over tokens, so the per-lane setup and the table are paid once.
// slot < 0, slot >= P·N, or a layer outside [0, L) writes nothing; offsets are 64-bit.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "m3sparse/cache.h"
#include "m3sparse/nvfp4.h"
#include "m3sparse_cuda.h"

namespace m3sparse {
namespace cuda {
namespace {

// Host twins, so that tests/cuda/pack_host_check.cu checks the exact arithmetic on the CPU in CI
// (each is one instruction on the device).
M3_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
M3_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
M3_HD float fma_rn(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return fmaf(a, b, c);
#endif
}
M3_HD float rcp_rn(float a) {
#ifdef __CUDA_ARCH__
  return __frcp_rn(a);
#else
  return 1.0f / a;
#endif
}
// max that returns NaN when either input is NaN (FMNMX.NAN): one NaN check per group.
M3_HD float max_nan(float a, float b) {
#ifdef __CUDA_ARCH__
  float m;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
  return m;
#else
  return (is_nan(a) || is_nan(b)) ? bits_float(0x7FFFFFFFu) : (a > b ? a : b);
#endif
}
// PTX prmt.b32 (default mode): selector nibble bit 3 replicates the chosen byte's sign bit.
M3_HD uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
#ifdef __CUDA_ARCH__
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
#else
  const uint64_t v = uint64_t(b) << 32 | a;
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t n = (sel >> (4 * i)) & 0xFu;
    uint32_t byte = uint32_t(v >> (8 * (n & 7u))) & 0xFFu;
    if (n & 8u) byte = (byte & 0x80u) ? 0xFFu : 0u;
    d |= byte << (8 * i);
  }
  return d;
#endif
}

constexpr float kRcp6 = 0.16666667163372039795f;  // RN(1/6)
constexpr float kMagic = 8388608.0f;               // 2^23: RN(v + 2^23) = 2^23 + rint(v)

// RN(amax / 6) for every fp32 amax >= 0 (+Inf gives NaN, which the caller sends to nvfp4.h).
M3_HD float div6_rn(float amax) {
  const float q = mul_rn(amax, kRcp6);
  return fma_rn(fma_rn(-q, 6.0f, amax), kRcp6, q);
}

// E4M3 byte of v in [2^-9, 448], ties to even (e4m3_from_clamped). Below 2^-5 the E4M3 grid is
// uniform (2^-9: subnormals and the first binade), so RN(v + 2^14) rounds it; from 2^-6 up the
// fp32 bits round to 3 mantissa bits. Each formula is right on its range and the wrong one is
// the larger there (unsigned), hence the min/max.
M3_HD uint32_t e4m3_rne(float v) {
  const uint32_t b = float_bits(v);
  const uint32_t normal = ((b + 0x7FFFFu + ((b >> 20) & 1u)) >> 20) - 960u;  // 960 = 120 << 3
  const uint32_t uniform = float_bits(add_rn(v, 16384.0f)) - 0x46800000u;
  const uint32_t floor8 = normal > 8u ? normal : 8u;
  return uniform < floor8 ? uniform : floor8;
}

// E2M1 magnitude index of y >= 0 plus 2^23, as a float (its bits are 0x4B000000 + index; past 6
// the index goes on growing, saturated later).
M3_HD float e2m1_index(float y) {
  const float k1 = fma_rn(y, 2.0f, kMagic);          // rint(2y)
  const float k2 = add_rn(y, kMagic + 2.0f);         // rint(y) + 2
  const float k3 = fma_rn(y, 0.5f, kMagic + 4.0f);   // rint(y/2) + 4
  return fminf(fminf(k1, k2), k3);
}

// Signs of 8 elements as full nibbles (0xF where negative), nibble i = element i, from words
// whose bits 15 and 31 are the signs of elements 2j and 2j+1 (raw bf16/f16 pairs).
M3_HD uint32_t sign_nibbles(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
  const uint32_t p = prmt(w0, w1, 0xFBD9u);  // bytes: s0 s2 s1 s3 (0xFF or 0)
  const uint32_t q = prmt(w2, w3, 0xFBD9u);  // s4 s6 s5 s7
  return (prmt(p, q, 0x5410u) & 0x0F0F0F0Fu) | (prmt(p, q, 0x7632u) & 0xF0F0F0F0u);
}

// Data word of 8 elements from the Horner sum of their index floats' bits (the 0x4B000000
// offsets add up to 0xFB000000 mod 2^32): an index of 8 (y in (7, 9], only under E4M3-subnormal
// scales; 9 cannot occur: see quantize_group_words) saturates to 7, and the sign goes where the
// index is not 0 (bit 3 of index + 7).
M3_HD uint32_t finish_word(uint32_t horner, uint32_t signs) {
  const uint32_t m = horner + 0x05000000u;
  const uint32_t nonzero = horner + 0x7C777777u;  // m + 0x77777777
  return m - ((m >> 3) & 0x11111111u) + (signs & nonzero & 0x88888888u);
}

struct GroupBytes {
  uint32_t lo, hi;  // data bytes 0-3, 4-7 (element 2j in the low nibble of byte j)
  uint32_t scale;   // E4M3 scale byte
};

M3_HD bool pow2_scale(float r) {  // r = 2^k, |k| <= 20
  return (float_bits(r) & 0x7FFFFFu) == 0 && r >= 9.5367432e-07f && r <= 1048576.0f;
}

// Scale byte -> {sf, RN(1/sf)} (SPEC §2.1 E4M3), or {sf/r, r·RN(1/sf)} (exact) for a
// power-of-two r; built per block in shared memory.
M3_HD float2 scale_entry(int byte, float r) {
  const float v = e4m3_to_float(uint8_t(byte));
  const float rc = rcp_rn(v);
  return pow2_scale(r) ? make_float2(mul_rn(v, rcp_rn(r)), mul_rn(r, rc)) : make_float2(v, rc);
}

struct ScaleTable {
  uint32_t base;           // device: shared-memory address of entry 0
  const float2* entries;   // host
  M3_HD float2 operator[](uint32_t byte) const {
#ifdef __CUDA_ARCH__
    float2 e;
    asm("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(e.x), "=f"(e.y) : "r"(base + byte * 8));
    return e;
#else
    return entries[byte];
#endif
  }
};

// r above this sends every group to nvfp4.h: there RN(amax/6) could be subnormal, where the
// Markstein quotient may be off, and still matter (s >= 2^-9 needs r > 2^117).
constexpr float kFastRMax = 1.2676506e30f;  // 2^100

// nvfp4_quantize_group of x[16] with global inverse scale r; sw[j] holds the signs of elements
// 2j, 2j+1 at bits 15, 31; s_max is 448, or -1 when r > 2^100. In the fast path the index is at
// most 8: sf = 2^-9 means s < 1.5·2^-9, so amax·r < 9·2^-9 + 3·2^-33 rounds to <= 9·2^-9 and
// y <= 9; rint(9/2) + 4 = 8.
// kPow2 (r = 2^k, |k| <= 20, e.g. the default g = 1): a = |x|·r is exact, so q = RN(|x|·(r·rc)),
// e = RN(|x| − q·(sf/r)) = (a − q·sf)/r and y = RN(q + e·(r·rc)) are the general path's values
// bit for bit without forming a (where a would be subnormal, y is far below 0.25 either way).
template <bool kPow2>
M3_HD GroupBytes quantize_group_words(const float* x, const uint32_t* sw, float r, float s_max,
                                      ScaleTable scales) {
  float amax = fabsf(x[0]);
#pragma unroll
  for (int i = 1; i < kNvfp4Group; ++i) amax = max_nan(amax, fabsf(x[i]));
  const float s = mul_rn(div6_rn(amax), r);
  GroupBytes g;
  if (!(s <= s_max)) {  // NaN in x or r, ±Inf, a saturating scale, a huge r: nvfp4.h itself
    uint8_t d[kNvfp4Group / 2], sf;
    nvfp4_quantize_group(x, r, d, &sf);
    memcpy(&g.lo, d, 4);
    memcpy(&g.hi, d + 4, 4);
    g.scale = sf;
    return g;
  }
  g.scale = e4m3_rne(fmaxf(s, kScaleFloor));
  const float2 e = scales[g.scale];
  const float sfv = e.x, rc = e.y;  // kPow2: sf/r and r·RN(1/sf)
  uint32_t w[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    uint32_t h = 0;
#pragma unroll
    for (int i = 7; i >= 0; --i) {
      const float a = kPow2 ? fabsf(x[8 * k + i]) : mul_rn(fabsf(x[8 * k + i]), r);
      const float q = mul_rn(a, rc);
      const float y = fma_rn(fma_rn(-q, sfv, a), rc, q);  // RN(|x|·r / sf), >= 0
      h = h * 16u + float_bits(e2m1_index(y));
    }
    w[k] = finish_word(h, sign_nibbles(sw[4 * k], sw[4 * k + 1], sw[4 * k + 2], sw[4 * k + 3]));
  }
  g.lo = w[0];
  g.hi = w[1];
  return g;
}

// quantize_group_words' sign words of 16 fp32 elements: word j holds the high halves of elements
// 2j, 2j + 1 (their sign bits at 15 and 31).
M3_HD void sign_words(const float* x, uint32_t* sw) {
#pragma unroll
  for (int j = 0; j < kNvfp4Group / 2; ++j)
    sw[j] = prmt(float_bits(x[2 * j]), float_bits(x[2 * j + 1]), 0x7632u);
}

// 16 raw input elements (two 16-byte loads for 16-bit types, four for fp32) -> fp32 values and
// sign words. 16-bit types (bf16, f16): the raw words are the sign words.
template <typename T>
struct Group16 {
  uint4 v[2];
  __device__ __forceinline__ void load(const T* src) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    v[0] = __ldcs(s);
    v[1] = __ldcs(s + 1);
  }
  __device__ __forceinline__ static float widen(uint32_t h) {  // h: the 16 bits, zero-extended
    if constexpr (std::is_same_v<T, __nv_bfloat16>) return bits_float(h << 16);
    else return __half2float(__ushort_as_half(uint16_t(h)));
  }
  __device__ __forceinline__ void unpack(float* x, uint32_t* sw) const {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        x[8 * i + 2 * k] = widen(w[k] & 0xFFFFu);
        x[8 * i + 2 * k + 1] = widen(w[k] >> 16);
        sw[4 * i + k] = w[k];
      }
    }
  }
};

template <>
struct Group16<float> {
  uint4 v[4];
  __device__ __forceinline__ void load(const float* src) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = __ldcs(s + i);
  }
  __device__ __forceinline__ void unpack(float* x, uint32_t* sw) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
      for (int k = 0; k < 4; ++k) x[4 * i + k] = bits_float(w[k]);
    }
    sign_words(x, sw);
  }
};

}  // namespace

// The scale tables of a block for inverse scales r[0..sides) (one entry per scale byte; 127 = NaN
// is never looked up).
__device__ __forceinline__ void fill_scales(float2* table, const float* r, int sides) {
  const int n = blockDim.x * blockDim.y * blockDim.z;
  for (int i = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x; i < 128 * sides;
       i += n)
    table[i] = scale_entry(i & 127, r[i >> 7]);
  __syncthreads();
}

__device__ __forceinline__ void store16(uint8_t* p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
}
__device__ __forceinline__ void store8(uint8_t* p, uint32_t a, uint32_t b) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(a), "r"(b) : "memory");
}

// Test hook: the kernel's quantization (mode 1) or nvfp4.h's (mode 0) of n groups.
__global__ void quantize_groups_kernel(const float* x, float r, uint8_t* data, uint8_t* scale,
                                       int64_t n, int mode) {
  __shared__ float2 table[128];
  fill_scales(table, &r, 1);
  const ScaleTable scales{uint32_t(__cvta_generic_to_shared(table)), nullptr};
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v[kNvfp4Group];
#pragma unroll
  for (int k = 0; k < kNvfp4Group; ++k) v[k] = x[i * kNvfp4Group + k];
  if (mode) {
    uint32_t sw[kNvfp4Group / 2];
    sign_words(v, sw);
    const float s_max = r > kFastRMax ? -1.0f : kE4M3Max;
    const GroupBytes g = pow2_scale(r) ? quantize_group_words<true>(v, sw, r, s_max, scales)
                                       : quantize_group_words<false>(v, sw, r, s_max, scales);
    memcpy(data + i * 8, &g.lo, 4);
    memcpy(data + i * 8 + 4, &g.hi, 4);
    scale[i] = uint8_t(g.scale);
  } else {
    nvfp4_quantize_group(v, r, data + i * 8, scale + i);
  }
}

namespace {

struct PackArgs {
  PackParams p;
  uint32_t div_m, div_l;  // page = umulhi(2·slot, div_m) >> div_l = slot / N for 0 <= slot < 2^31
  int32_t lanes_per_side;  // Hkv · D/32
  int32_t align;           // 16, 8 or 1: the alignment of every data store (2 for scales)
  uint32_t slot_limit;     // min(P·N, 2^31)
  uint64_t page_stride;    // bytes from page p to page p + 1 of one layer
  int64_t token_step;      // gridDim.x · blockDim.y: tokens a block steps by
  int64_t elem_step;       // token_step · Hkv · D: input elements per step
};

template <typename T>
struct Lane {
  const T* src;           // this lane's 32 elements of the first token
  const int32_t* slots;   // that token's slot
  uint8_t* base;          // page 0 of the layer, this lane's tile and 16 data bytes
  float r, s_max;
  uint32_t scale_base;    // scale plane of the tile, from base
};

template <typename T, bool kPow2>
__device__ __forceinline__ void pack_tokens(const PackArgs& args, Lane<T> lane, int64_t t,
                                            ScaleTable scales) {
  const uint32_t n = uint32_t(args.p.geom.block_size);
  const uint32_t data_bytes = uint32_t(args.p.geom.data_bytes());
  const uint32_t scale_bytes = uint32_t(args.p.geom.scale_bytes());
  for (; t < args.p.num_tokens;
       t += args.token_step, lane.src += args.elem_step, lane.slots += args.token_step) {
    const uint32_t slot = uint32_t(*lane.slots);
    if (slot >= args.slot_limit) continue;
    Group16<T> in[2];
    in[0].load(lane.src);
    in[1].load(lane.src + 16);
    const uint32_t page = __umulhi(slot << 1, args.div_m) >> args.div_l;
    const uint32_t o = slot - page * n;
    GroupBytes g[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      float x[kNvfp4Group];
      uint32_t sw[kNvfp4Group / 2];
      in[k].unpack(x, sw);
      g[k] = quantize_group_words<kPow2>(x, sw, lane.r, lane.s_max, scales);
    }
    uint8_t* data = lane.base + uint64_t(page) * args.page_stride + o * data_bytes;
    uint8_t* sc = data + (lane.scale_base + o * (scale_bytes - data_bytes));
    if (args.align == 16) {
      store16(data, g[0].lo, g[0].hi, g[1].lo, g[1].hi);
      *reinterpret_cast<uint16_t*>(sc) = uint16_t(g[0].scale | (g[1].scale << 8));
    } else if (args.align == 8) {
      store8(data, g[0].lo, g[0].hi);
      store8(data + 8, g[1].lo, g[1].hi);
      *reinterpret_cast<uint16_t*>(sc) = uint16_t(g[0].scale | (g[1].scale << 8));
    } else {  // odd geometries (tile bytes not a multiple of 8): byte stores
      const uint32_t w[4] = {g[0].lo, g[0].hi, g[1].lo, g[1].hi};
#pragma unroll
      for (int b = 0; b < 16; ++b) data[b] = uint8_t(w[b / 4] >> (8 * (b % 4)));
      sc[0] = uint8_t(g[0].scale);
      sc[1] = uint8_t(g[1].scale);
    }
  }
}

// blockDim = (lanes, tokens, 2 sides): lane blockIdx.y·blockDim.x + threadIdx.x of side
// threadIdx.z (0 = K, 1 = V) is the 32-element piece qv of KV head h. Side-major, so a warp holds
// one side (one r) when lanes·tokens is a multiple of 32. 32-bit index math where it fits.
template <typename T>
__global__ void __launch_bounds__(256) pack_kernel(const PackArgs args) {
  const PackParams& p = args.p;
  __shared__ float2 table[2 * 128];  // K, V
  const float rs[2] = {nvfp4_inverse_scale(*p.k_scale), nvfp4_inverse_scale(*p.v_scale)};
  fill_scales(table, rs, 2);
  const CacheGeometry geom = p.geom;
  const int64_t layer = *p.layer;
  if (!geom.valid_layer(layer)) return;
  const int qpv = int(geom.head_dim) / 32;
  const int j = int(blockIdx.y * blockDim.x + threadIdx.x);
  if (j >= args.lanes_per_side) return;
  const int side = int(threadIdx.z);
  const int h = j / qpv;
  const int qv = j - h * qpv;

  const float r = rs[side];
  const float s_max = r > kFastRMax ? -1.0f : kE4M3Max;
  const ScaleTable scales{uint32_t(__cvta_generic_to_shared(table + 128 * side)), nullptr};
  uint8_t* const base = p.kv_cache + geom.page_offset(layer, 0) +
                        (2 * h + side) * geom.tile_bytes() + qv * 16;
  const uint32_t scale_base =  // from the lane's data bytes of page 0, token 0
      uint32_t(geom.block_size * geom.data_bytes()) + qv * 2 - qv * 16;

  // Pointers step with the token; slots >= slot_limit (or < 0, as unsigned) are skipped.
  const int64_t t0 = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  Lane<T> lane;
  lane.src = static_cast<const T*>(side ? p.value : p.key) + t0 * p.num_kv_heads * geom.head_dim +
             (h * geom.head_dim + qv * 32);
  lane.slots = p.slot_mapping + t0;
  lane.base = base;
  lane.r = r;
  lane.s_max = s_max;
  lane.scale_base = scale_base;
  if (pow2_scale(r)) pack_tokens<T, true>(args, lane, t0, scales);
  else pack_tokens<T, false>(args, lane, t0, scales);
}

template <typename T>
cudaError_t launch_typed(const PackParams& p, cudaStream_t stream) {
  const int64_t lanes_per_side = int64_t(p.num_kv_heads) * (p.geom.head_dim / 32);
  if (lanes_per_side > 2048) return cudaErrorInvalidValue;  // Hkv·D <= 65536
  const int lanes = int(std::min<int64_t>(lanes_per_side, 128));
  const unsigned splits = unsigned((lanes_per_side + lanes - 1) / lanes);
  const int tokens_per_block = 128 / lanes;
  int64_t blocks = (p.num_tokens + tokens_per_block - 1) / tokens_per_block;
  // A grid of resident blocks that loop over tokens: the per-lane setup is paid once.
  int dev = 0, sms = 0, per_sm = 0;
  const int threads = 2 * lanes * tokens_per_block;
  if (cudaGetDevice(&dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess &&
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, pack_kernel<T>, threads, 0) ==
          cudaSuccess &&
      sms > 0 && per_sm > 0)
    blocks = std::min<int64_t>(blocks, (int64_t(sms) * per_sm + splits - 1) / splits);
  if (blocks > int64_t(0x7FFFFFFF)) blocks = 0x7FFFFFFF;
  PackArgs a;
  a.p = p;
  const uint64_t n = uint64_t(p.geom.block_size);
  if (n == 0 || n > (uint64_t(1) << 31)) return cudaErrorInvalidValue;
  uint32_t l = 0;
  while ((uint64_t(1) << l) < n) ++l;
  a.div_l = l;
  a.div_m = uint32_t(((uint64_t(1) << (31 + l)) + n - 1) / n);  // ceil(2^(31+l) / N) < 2^32
  a.lanes_per_side = int32_t(lanes_per_side);
  a.token_step = blocks * tokens_per_block;
  a.elem_step = a.token_step * p.num_kv_heads * p.geom.head_dim;
  a.slot_limit = uint32_t(std::min<int64_t>(p.geom.num_pages * p.geom.block_size, int64_t(1) << 31));
  a.page_stride = uint64_t(p.geom.layout == kBLHNC ? p.geom.num_layers * p.geom.page_bytes()
                                                   : p.geom.page_bytes());
  const uint64_t at = uint64_t(reinterpret_cast<uintptr_t>(p.kv_cache)) | uint64_t(p.geom.tile_bytes());
  a.align = at % 16 == 0 ? 16 : at % 8 == 0 ? 8 : 1;
  pack_kernel<T><<<dim3(unsigned(blocks), splits), dim3(lanes, tokens_per_block, 2), 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_pack_kv_pages(const PackParams& p, cudaStream_t stream) {
  if (p.num_tokens <= 0 || p.num_kv_heads <= 0) return cudaSuccess;
  if (p.geom.head_dim % 32 != 0) return cudaErrorInvalidValue;  // 16-byte loads, 2 groups a lane
  switch (p.dtype) {
    case DType::kF32: return launch_typed<float>(p, stream);
    case DType::kBF16: return launch_typed<__nv_bfloat16>(p, stream);
    case DType::kF16: return launch_typed<__half>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace m3sparse
