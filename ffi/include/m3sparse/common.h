// Host/device-safe basics shared by every backend (CPU, CUDA, HIP).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define M3_HD __host__ __device__ inline
#else
#define M3_HD inline
#endif

namespace m3sparse {

M3_HD uint32_t float_bits(float x) {
  uint32_t b;
  memcpy(&b, &x, sizeof(b));
  return b;
}

M3_HD float bits_float(uint32_t b) {
  float x;
  memcpy(&x, &b, sizeof(x));
  return x;
}

M3_HD bool is_nan(float x) { return (float_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }
M3_HD bool is_finite(float x) { return (float_bits(x) & 0x7F800000u) != 0x7F800000u; }

// bfloat16 / float16 <-> float32, round-to-nearest-even, NaN preserved.
M3_HD float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

M3_HD uint16_t float_to_bf16(float x) {
  uint32_t b = float_bits(x);
  if (is_nan(x)) return uint16_t((b >> 16) | 0x40);
  b += 0x7FFFu + ((b >> 16) & 1u);
  return uint16_t(b >> 16);
}

M3_HD float f16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) return bits_float(sign | 0x7F800000u | (man << 13));
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
  // Subnormal (or zero): man * 2^-24, exact in fp32.
  float v = float(man) * 5.9604644775390625e-08f;
  return sign ? -v : v;
}

M3_HD uint16_t float_to_f16(float x) {
  uint32_t b = float_bits(x);
  uint16_t sign = uint16_t((b >> 16) & 0x8000u);
  uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return uint16_t(sign | 0x7E00u);          // NaN
  if (a >= 0x477FF000u) return uint16_t(sign | 0x7C00u);         // rounds to >= 65520: Inf
  if (a < 0x38800000u) {                                         // below 2^-14: subnormal
    // Add 0.5 (in fp32) so the hardware's RNE aligns the bits at 2^-24.
    float v = bits_float(a) + 0.5f;
    return uint16_t(sign | uint16_t(float_bits(v) - 0x3F000000u));
  }
  uint32_t mant_odd = (a >> 13) & 1u;
  a += 0xC8000FFFu + mant_odd;                                   // rebias 127->15 and round
  return uint16_t(sign | uint16_t(a >> 13));
}

}  // namespace m3sparse
