// Device helpers of the CUDA backend: exact NVFP4 -> bf16/f16 dequantization in registers,
// mma.sync wrappers, cp.async. sm_90 (nothing here needs sm_90a).
//
// Dequantization (SPEC §2.1: x̂ = e2m1(c) · e4m3(sf) · g, the product exact in bf16 and fp16):
// an E2M1 code c = s e1 e0 m placed in a 16-bit float with its magnitude bits at the bottom of
// the exponent field is, bit for bit, e2m1(c) · 2^-126 (bf16) or e2m1(c) · 2^-14 (fp16) — the
// code 0.5 lands on a subnormal, which bf16x2/f16x2 `mul.rn` (no .ftz) handles exactly. One
// packed multiply by the block scale pre-multiplied by 2^118 (bf16) or 2^7 (fp16) then gives
// e2m1 · sf · 2^-8 (bf16) or · 2^-7 (fp16): every such product has at most 5 significant bits and
// lies in the normal (bf16) or representable (fp16, multiples of 2^-17) range, so it is exact.
// The power of two (kComp) and the global scale g are applied in fp32 after the mma.
// A NaN block scale (0x7F) gives NaN, as SPEC §2.2 step 4 intends.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "m3sparse/nvfp4.h"

namespace m3sparse {
namespace cuda {

template <int A>
__device__ __forceinline__ uint32_t shift_left(uint32_t x) {
  if constexpr (A >= 0) return x << A;
  else return x >> (-A);
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
struct Traits;

template <>
struct Traits<__nv_bfloat16> {
  static constexpr int kMagShift = 6;              // E2M1 magnitude bits -> bf16 bits 6..8
  static constexpr uint32_t kMagMask = 0x01C001C0u;
  static constexpr float kScaleBias = 0x1p118f;    // S' = sf · 2^118 (< 2^127)
  static constexpr float kComp = 256.0f;           // dequantized value = product · 2^8
  __device__ __forceinline__ static uint16_t from_float(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
  __device__ __forceinline__ static float to_float(uint16_t h) {
    return __bfloat162float(__ushort_as_bfloat16(h));
  }
  __device__ __forceinline__ static uint32_t mul2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  __device__ __forceinline__ static uint32_t pack2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __device__ __forceinline__ static void mma(float* c, const uint32_t* a, uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct Traits<__half> {
  static constexpr int kMagShift = 9;              // E2M1 magnitude bits -> f16 bits 9..11
  static constexpr uint32_t kMagMask = 0x0E000E00u;
  static constexpr float kScaleBias = 128.0f;      // S' = sf · 2^7 (<= 57344)
  static constexpr float kComp = 128.0f;
  __device__ __forceinline__ static uint16_t from_float(float x) {
    return __half_as_ushort(__float2half_rn(x));
  }
  __device__ __forceinline__ static float to_float(uint16_t h) {
    return __half2float(__ushort_as_half(h));
  }
  __device__ __forceinline__ static uint32_t mul2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  __device__ __forceinline__ static uint32_t pack2(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __device__ __forceinline__ static void mma(float* c, const uint32_t* a, uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// The packed-multiplier of one E4M3 scale byte (see the file comment), as a 16-bit float.
template <typename T>
__device__ __forceinline__ uint16_t scale_multiplier(uint32_t sf_byte) {
  return Traits<T>::from_float(e4m3_to_float(uint8_t(sf_byte)) * Traits<T>::kScaleBias);
}

// 8 E2M1 codes in a word (nibble k = element k) -> 4 packed pairs; pair k holds
// (element k, element k + 4), each times the packed multiplier `s2` (lo half for element k).
// bf16: nibble k (and k + 4) isolated, then one integer multiply by 2^(6-4k) + 2^(12-4k) writes
// two copies that do not overlap (bits 6..9 and 12..15 of each half): the magnitude of the first
// lands on bits 6..8, the sign of the second on bit 15, and one mask keeps exactly those — 3
// integer ops per pair instead of 4 (nibbles 2, 3 shifted down once per word). Bit-identical to
// the shift/mask form below (checked exhaustively by the harness's "dequant" test). kImad = false keeps the
// shift/mask form (launch variants 1, 2, timed beside it).
template <typename T, bool kImad = true>
__device__ __forceinline__ void dequant8(uint32_t w, uint32_t s2, uint32_t* out) {
  constexpr int S = Traits<T>::kMagShift;
  constexpr uint32_t M = Traits<T>::kMagMask;
  if constexpr (S == 6 && kImad) {
    constexpr uint32_t keep = M | 0x80008000u;
    const uint32_t w8 = w >> 8;
    out[0] = Traits<T>::mul2(((w & 0x000F000Fu) * 0x1040u) & keep, s2);
    out[1] = Traits<T>::mul2(((w & 0x00F000F0u) * 0x0104u) & keep, s2);
    out[2] = Traits<T>::mul2(((w8 & 0x000F000Fu) * 0x1040u) & keep, s2);
    out[3] = Traits<T>::mul2(((w8 & 0x00F000F0u) * 0x0104u) & keep, s2);
    return;
  }
  out[0] = Traits<T>::mul2((shift_left<S>(w) & M) | ((w << 12) & 0x80008000u), s2);
  out[1] = Traits<T>::mul2((shift_left<S - 4>(w) & M) | ((w << 8) & 0x80008000u), s2);
  out[2] = Traits<T>::mul2((shift_left<S - 8>(w) & M) | ((w << 4) & 0x80008000u), s2);
  out[3] = Traits<T>::mul2((shift_left<S - 12>(w) & M) | (w & 0x80008000u), s2);
}

// ---- the fp8-conversion path (sm_89+): E2M1 code c = s e1 e0 m as the E4M3 byte
// s 0 0 e1 e0 m 0 0 is exactly e2m1(c) · 2^-6 (the code 0.5 lands on the E4M3 subnormal 2^-7);
// cvt.rn.f16x2.e4m3x2 turns two such bytes into f16 exactly, and one f16x2 multiply by the block
// scale sf (exact in f16) gives e2m1 · sf · 2^-6, exact (multiples of 2^-16, at most 42).
constexpr float kCvtComp = 64.0f;

// 8 codes (nibble k = element k) -> E4M3 bytes of the even elements (0, 2, 4, 6) and of the odd ones.
__device__ __forceinline__ uint32_t e4m3_even(uint32_t w) {
  return ((w & 0x08080808u) << 4) | ((w & 0x07070707u) << 2);
}
__device__ __forceinline__ uint32_t e4m3_odd(uint32_t w) {
  return (w & 0x80808080u) | ((w >> 2) & 0x1C1C1C1Cu);
}
__device__ __forceinline__ uint32_t cvt_e4m3x2_lo(uint32_t x) {
  uint32_t d;
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, l;\n}"
      : "=r"(d) : "r"(x));
  return d;
}
__device__ __forceinline__ uint32_t cvt_e4m3x2_hi(uint32_t x) {
  uint32_t d;
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, h;\n}"
      : "=r"(d) : "r"(x));
  return d;
}
// 8 codes -> 4 f16 pairs: (e0, e2), (e4, e6), (e1, e3), (e5, e7), each times s2 (f16x2).
__device__ __forceinline__ void dequant8_cvt(uint32_t w, uint32_t s2, uint32_t* out) {
  const uint32_t ev = e4m3_even(w), od = e4m3_odd(w);
  out[0] = Traits<__half>::mul2(cvt_e4m3x2_lo(ev), s2);
  out[1] = Traits<__half>::mul2(cvt_e4m3x2_hi(ev), s2);
  out[2] = Traits<__half>::mul2(cvt_e4m3x2_lo(od), s2);
  out[3] = Traits<__half>::mul2(cvt_e4m3x2_hi(od), s2);
}
// Element offset (within 8) of pair r of dequant8_cvt's order, lo element.
__device__ __forceinline__ constexpr int cvt_elem(int r) {
  return r < 4 ? 2 * (r & 3) : 2 * (r & 3) + 1;
}

__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src) {
  uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(gmem_src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// A cudaLaunchKernelEx configuration with one attribute: clusters of `cluster` CTAs along x.
// Not copyable: cfg.attrs points into the object.
struct ClusterLaunch {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  ClusterLaunch(unsigned grid, unsigned threads, size_t smem, unsigned cluster,
                cudaStream_t stream = nullptr) {
    cfg.gridDim = dim3(grid, 1, 1);
    cfg.blockDim = dim3(threads, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

}  // namespace cuda
}  // namespace m3sparse
