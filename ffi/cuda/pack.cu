// pack_kv_pages for CUDA (SPEC §2.2, §3.2–§3.4): one pass, one thread per 16-element group of
// one token's K or V head vector. Quantization is m3sparse::nvfp4_quantize_group (nvfp4.h), the
// same function the CPU backend runs, so the bytes are identical (fp32, round-to-nearest-even;
// this file is compiled without fast-math and nothing in it can contract into an FMA).
// slot < 0, slot >= P·N, or a layer outside [0, L) writes nothing; offsets are 64-bit.
#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "m3sparse/cache.h"
#include "m3sparse/nvfp4.h"
#include "m3sparse_cuda.h"

namespace m3sparse {
namespace cuda {
namespace {

template <typename T>
__device__ __forceinline__ void load16(const T* src, float* x);

template <>
__device__ __forceinline__ void load16<float>(const float* src, float* x) {
  const float4* s = reinterpret_cast<const float4*>(src);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 v = s[i];
    x[4 * i] = v.x;
    x[4 * i + 1] = v.y;
    x[4 * i + 2] = v.z;
    x[4 * i + 3] = v.w;
  }
}

template <>
__device__ __forceinline__ void load16<__nv_bfloat16>(const __nv_bfloat16* src, float* x) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint4 v = s[i];
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[8 * i + 2 * k] = bf16_to_float(uint16_t(w[k] & 0xFFFFu));
      x[8 * i + 2 * k + 1] = bf16_to_float(uint16_t(w[k] >> 16));
    }
  }
}

template <>
__device__ __forceinline__ void load16<__half>(const __half* src, float* x) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint4 v = s[i];
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[8 * i + 2 * k] = __half2float(__ushort_as_half(uint16_t(w[k] & 0xFFFFu)));
      x[8 * i + 2 * k + 1] = __half2float(__ushort_as_half(uint16_t(w[k] >> 16)));
    }
  }
}

// e2m1_from_float (nvfp4.h) without the threshold chain: round-to-nearest-even onto the E2M1
// grid. |y| < 1 (spacing 0.5): rint(2|y|) by the 2^23 trick; |y| >= 1: round the fp32 bits to one
// mantissa bit (RNE) and read exponent and bit, saturating at 6 (index 7). Same ties
// (0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4) and −0 → +0.
__device__ __forceinline__ uint8_t e2m1_fast(float y) {
  const uint32_t b = float_bits(y);
  const uint32_t a = b & 0x7FFFFFFFu;
  const uint32_t small = float_bits(__fmaf_rn(bits_float(a), 2.0f, 8388608.0f)) & 3u;
  const uint32_t r = a + 0x1FFFFFu + ((a >> 22) & 1u);
  const uint32_t big = min((r >> 22) - 252u, 7u);
  const uint32_t m = a < 0x3F800000u ? small : big;
  return uint8_t((m != 0 && (b >> 31)) ? (m | 8u) : m);
}

}  // namespace

// nvfp4_quantize_group (nvfp4.h) with the 16 divisions (x·r)/sf replaced by Markstein's
// correctly rounded division: rc = RN(1/sf) once per group, then per element
// q = RN(a·rc), e = a − q·sf (exact, FMA), y = RN(q + e·rc) = RN(a/sf). Every quotient that can
// reach an E2M1 rounding threshold is a normal number (|a| >= 2^-11, sf in [2^-9, 448]), where the
// theorem holds; ±Inf inputs keep q (= ±Inf, as the division gives); codes by e2m1_fast.
// Bit-identity with the
// division path is checked exhaustively near every threshold for every scale byte in
// tests/cuda/harness.cu ("pack division") and on random data against the host.
__device__ __forceinline__ void quantize_group_fast(const float* x, float r, uint8_t* data,
                                                    uint8_t* scale) {
  float amax = 0.0f;
  bool nan = is_nan(r);
#pragma unroll
  for (int i = 0; i < kNvfp4Group; ++i) {
    nan = nan || is_nan(x[i]);
    amax = fmaxf(amax, fabsf(x[i]));
  }
  if (nan) {
    *scale = kScaleNaN;
#pragma unroll
    for (int j = 0; j < kNvfp4Group / 2; ++j) data[j] = 0;
    return;
  }
  const float s = __fmul_rn(__fdiv_rn(amax, kE2M1Max), r);
  const uint8_t sf = e4m3_from_clamped(fminf(fmaxf(s, kScaleFloor), kE4M3Max));
  const float sfv = e4m3_to_float(sf);
  const float rc = __frcp_rn(sfv);
  *scale = sf;
#pragma unroll
  for (int j = 0; j < kNvfp4Group / 2; ++j) {
    uint8_t c[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float a = __fmul_rn(x[2 * j + h], r);
      const float q = __fmul_rn(a, rc);
      const float e = __fmaf_rn(-q, sfv, a);
      const float y = isinf(q) ? q : __fmaf_rn(e, rc, q);
      c[h] = e2m1_fast(y);
    }
    data[j] = uint8_t(c[0] | (c[1] << 4));
  }
}

// Test hook: fast (mode 1) or reference nvfp4.h (mode 0) quantization of n groups.
__global__ void quantize_groups_kernel(const float* x, float r, uint8_t* data, uint8_t* scale,
                                       int64_t n, int mode) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v[kNvfp4Group];
#pragma unroll
  for (int k = 0; k < kNvfp4Group; ++k) v[k] = x[i * kNvfp4Group + k];
  if (mode) quantize_group_fast(v, r, data + i * 8, scale + i);
  else nvfp4_quantize_group(v, r, data + i * 8, scale + i);
}

namespace {

// blockDim = (per_token, tokens per block); thread x of a token is group grp of side `side` of
// KV head h, grp fastest (8 neighbouring threads write one token's 64 contiguous data bytes).
// 32-bit index math: 64-bit division is a long software sequence on the GPU.
template <typename T>
__global__ void __launch_bounds__(1024) pack_kernel(const PackParams p) {
  const CacheGeometry geom = p.geom;
  const int64_t t = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (t >= p.num_tokens) return;
  const int gpv = int(geom.head_dim) / kNvfp4Group;  // groups per head vector
  const int j = threadIdx.x;
  const int grp = j % gpv;
  const int rest = j / gpv;
  const int side = rest & 1;  // 0 = K, 1 = V
  const int h = rest >> 1;

  const int64_t layer = *p.layer;
  const int32_t slot = p.slot_mapping[t];
  if (!geom.valid_layer(layer) || slot < 0 || int64_t(slot) >= geom.num_pages * geom.block_size)
    return;
  const uint32_t n = uint32_t(geom.block_size);
  const uint32_t page = uint32_t(slot) / n;
  const uint32_t o = uint32_t(slot) - page * n;

  const T* src = static_cast<const T*>(side ? p.value : p.key) +
                 ((t * p.num_kv_heads + h) * geom.head_dim + grp * kNvfp4Group);
  float x[kNvfp4Group];
  load16<T>(src, x);
  const float r = nvfp4_inverse_scale(side ? *p.v_scale : *p.k_scale);
  uint8_t data[kNvfp4Group / 2];
  uint8_t sf;
  quantize_group_fast(x, r, data, &sf);

  uint8_t* tile = p.kv_cache + geom.tile_offset(layer, page, 2 * h + side);
  uint2 packed;
  memcpy(&packed, data, sizeof(packed));
  *reinterpret_cast<uint2*>(tile + geom.token_data_offset(o) + grp * (kNvfp4Group / 2)) = packed;
  tile[geom.token_scale_offset(o) + grp] = sf;
}

template <typename T>
cudaError_t launch_typed(const PackParams& p, cudaStream_t stream) {
  const int per_token = p.num_kv_heads * 2 * int(p.geom.head_dim / kNvfp4Group);
  if (per_token > 1024) return cudaErrorInvalidValue;
  const int tokens_per_block = per_token >= 256 ? 1 : 256 / per_token;
  const int64_t blocks = (p.num_tokens + tokens_per_block - 1) / tokens_per_block;
  if (blocks > int64_t(0x7FFFFFFF)) return cudaErrorInvalidValue;
  pack_kernel<T><<<unsigned(blocks), dim3(per_token, tokens_per_block), 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_pack_kv_pages(const PackParams& p, cudaStream_t stream) {
  if (p.num_tokens <= 0 || p.num_kv_heads <= 0) return cudaSuccess;
  if (p.geom.head_dim % 32 != 0) return cudaErrorInvalidValue;  // 16-byte loads, 8-byte stores
  switch (p.dtype) {
    case DType::kF32: return launch_typed<float>(p, stream);
    case DType::kBF16: return launch_typed<__nv_bfloat16>(p, stream);
    case DType::kF16: return launch_typed<__half>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace m3sparse
