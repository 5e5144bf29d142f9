// The NVFP4 format of SPEC §2: E2M1 codes, E4M3 block scales per 16 elements,
// an fp32 global dequantization multiplier g. Host/device-safe, no tables in memory.
#pragma once

#include <cmath>

#include "m3sparse/common.h"

namespace m3sparse {

constexpr int kNvfp4Group = 16;         // elements per E4M3 block scale
constexpr uint8_t kScaleNaN = 0x7F;     // E4M3 NaN: marks a group that held a NaN (SPEC §2.2 step 4)
constexpr float kE2M1Max = 6.0f;
constexpr float kE4M3Max = 448.0f;
constexpr float kScaleFloor = 0.001953125f;  // 2^-9, the smallest E4M3 subnormal

// Magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} by index 0..7 (SPEC §2.1).
M3_HD float e2m1_magnitude(unsigned m) {
  return m < 4 ? 0.5f * float(m) : (m < 7 ? float(m) - 2.0f : 6.0f);
}

M3_HD float e2m1_to_float(unsigned code) {
  float v = e2m1_magnitude(code & 7u);
  return (code & 8u) ? -v : v;
}

// float8_e4m3fn byte -> float (every byte value, including sign and NaN).
M3_HD float e4m3_to_float(uint8_t byte) {
  uint32_t sign = uint32_t(byte & 0x80u) << 24;
  uint32_t exp = (byte >> 3) & 0xFu;
  uint32_t man = byte & 7u;
  if (exp == 0xF && man == 7) return bits_float(sign | 0x7FC00000u);
  if (exp == 0) {
    float v = float(man) * kScaleFloor;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 120u) << 23) | (man << 20));
}

// Round v in [0, 448] to the nearest E4M3 value, ties to even (SPEC §2.2 step 2; the block
// scales pass v >= 2^-9, write_index_keys any magnitude up to 448).
M3_HD uint8_t e4m3_from_clamped(float v) {
  uint32_t b = float_bits(v);
  int exp = int(b >> 23) - 127;
  if (exp < -6) {
    // E4M3 subnormal range: units of 2^-9. v*512 is exact; q == 8 is the code of 2^-6.
    return uint8_t(rintf(v * 512.0f));
  }
  uint32_t mant = b & 0x7FFFFFu;
  uint32_t keep = mant >> 20;        // 3 mantissa bits survive
  uint32_t rest = mant & 0xFFFFFu;   // 20 bits are rounded away
  if (rest > 0x80000u || (rest == 0x80000u && (keep & 1u))) ++keep;
  uint32_t exp_field = uint32_t(exp + 7);
  if (keep == 8) { keep = 0; ++exp_field; }
  return uint8_t((exp_field << 3) | keep);
}

// E2M1 code of y, ties to even, saturating to ±6; −0 and tiny negatives give +0 (SPEC §2.2 step 3).
// The magnitude index counts the thresholds |y| passes: `>` at the ties that round down to
// the even code (0.25, 1.25, 2.5, 5), `>=` at those that round up to it (0.75, 1.75, 3.5).
// Branch-free, so loops over elements vectorize.
M3_HD uint8_t e2m1_from_float(float y) {
  float a = fabsf(y);
  unsigned m = unsigned(a > 0.25f) + unsigned(a >= 0.75f) + unsigned(a > 1.25f) +
               unsigned(a >= 1.75f) + unsigned(a > 2.5f) + unsigned(a >= 3.5f) + unsigned(a > 5.0f);
  unsigned sign = (m != 0u) & (float_bits(y) >> 31);
  return uint8_t(m | (sign << 3));
}

constexpr float kGlobalScaleMin = 1.17549435e-38f;  // 2^-126: smallest normal fp32
constexpr float kGlobalScaleMax = 8.50705917e+37f;  // 2^126: 1/g is still normal

// r = 1/g for 2^-126 <= g <= 2^126, else NaN, so every group quantized with it becomes a NaN
// group (SPEC §2.2 steps 1, 5; docs/spec_decisions.md). Both g and r are then normal numbers:
// flushing subnormals to zero (XLA's CPU threads do; GPUs may not) cannot change the result.
// NaN g fails both comparisons.
M3_HD float nvfp4_inverse_scale(float g) {
  bool ok = g >= kGlobalScaleMin && g <= kGlobalScaleMax;
  return ok ? 1.0f / g : bits_float(0x7FC00000u);
}

// Quantizes 16 fp32 values: data[8] (element 2j in the low nibble of byte j) and one scale byte.
M3_HD void nvfp4_quantize_group(const float* x, float r, uint8_t* data, uint8_t* scale) {
  float amax = 0.0f;
  bool nan = is_nan(r);
  for (int i = 0; i < kNvfp4Group; ++i) {
    float a = fabsf(x[i]);
    nan |= is_nan(x[i]);
    amax = a > amax ? a : amax;  // NaN groups are handled below, so no fmaxf semantics needed
  }
  if (nan) {
    *scale = kScaleNaN;
    for (int j = 0; j < kNvfp4Group / 2; ++j) data[j] = 0;
    return;
  }
  float s = (amax / kE2M1Max) * r;                    // not NaN: amax and r are not
  s = s < kScaleFloor ? kScaleFloor : (s > kE4M3Max ? kE4M3Max : s);
  uint8_t sf = e4m3_from_clamped(s);
  float sf_value = e4m3_to_float(sf);
  *scale = sf;
  uint8_t codes[kNvfp4Group];
  for (int i = 0; i < kNvfp4Group; ++i) codes[i] = e2m1_from_float((x[i] * r) / sf_value);
  for (int j = 0; j < kNvfp4Group / 2; ++j) data[j] = uint8_t(codes[2 * j] | (codes[2 * j + 1] << 4));
}

}  // namespace m3sparse
