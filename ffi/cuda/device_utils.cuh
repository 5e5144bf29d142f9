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
#include <type_traits>

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


// ---- sm_90a: wgmma with A from registers, mbarriers, bulk copies, warpgroup barriers

// D[64 x 16] (+)= A[64 x 16] (registers, mma.m16n8k16 A layout per warp) x B[16 x 16]
// (shared memory, K-major, `desc`); fp32 accumulators. accumulate = false: D = A·B.
template <typename T>
__device__ __forceinline__ void wgmma_m64n16k16(float* d, const uint32_t* a, uint64_t desc,
                                                bool accumulate) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %13, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, "
        "{%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(int(accumulate))
        : "memory");
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %13, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, "
        "{%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(int(accumulate))
        : "memory");
  }
}
// D[64 x 64] (+)= A[64 x 16] (registers) x B[16 x 64] (shared memory, K-major, `desc`).
template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16(float* d, const uint32_t* a, uint64_t desc,
                                                bool accumulate) {
#define M3_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
                 "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define M3_WGMMA64(TY)                                                                          \
  asm volatile(                                                                                 \
      "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"                                            \
      " wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                              \
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23," \
      "%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"              \
      : M3_D8(0), M3_D8(8), M3_D8(16), M3_D8(24)                                                \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(int(accumulate))             \
      : "memory")
  if constexpr (std::is_same_v<T, __half>) M3_WGMMA64("f16");
  else M3_WGMMA64("bf16");
#undef M3_WGMMA64
#undef M3_D8
}
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit_wait() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}
// Keeps a register live (and unmoved) up to this point: A operands and accumulators of an
// asynchronous wgmma must not be reused or read before its wait.
__device__ __forceinline__ void keep(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
__device__ __forceinline__ void keep(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// Shared-memory matrix descriptor, no swizzle: core matrices of 8 rows x 16 bytes (128
// contiguous bytes); lbo: byte stride between core matrices along K, sbo: along M/N.
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return uint64_t((a & 0x3FFFFu) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t a = smem_addr(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
  } while (!done);
}
// Global -> shared bulk copy (bytes % 16 == 0, both addresses 16-byte aligned), completing on bar.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
// Generic-proxy shared stores made visible to the async proxy (wgmma operands).
__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Named barrier `id` over `n` threads; bar_or also returns whether any thread's pred was true.
__device__ __forceinline__ void bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ bool bar_or(int id, int n, bool pred) {
  uint32_t r;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n"
      " selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(r)
      : "r"(uint32_t(pred)), "r"(id), "r"(n)
      : "memory");
  return r != 0;
}
// Four transposed 8x8 b16 matrices; lane l gives the row address of matrix l / 8, row l % 8.
__device__ __forceinline__ void ldsm_x4_trans(const void* row, uint32_t* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row))
               : "memory");
}

}  // namespace cuda
}  // namespace m3sparse
