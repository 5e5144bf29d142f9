// Loading and storing q/key/value/out elements of any supported float dtype on the CPU.
#pragma once

#include "m3sparse/common.h"
#include "xla/ffi/api/ffi.h"

namespace m3sparse {

namespace ffi = xla::ffi;

inline bool is_supported_float(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

// dst[i] = float(src[offset + i]) for i < n.
inline void load_floats(ffi::DataType t, const void* src, int64_t offset, int64_t n, float* dst) {
  if (t == ffi::DataType::F32) {
    const float* s = static_cast<const float*>(src) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = s[i];
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
    if (t == ffi::DataType::BF16)
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
    else
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_float(s[i]);
  }
}

// dst[offset + i] = convert(src[i]) for i < n, rounding to nearest even.
inline void store_floats(ffi::DataType t, const float* src, int64_t n, void* dst, int64_t offset) {
  if (t == ffi::DataType::F32) {
    float* d = static_cast<float*>(dst) + offset;
    for (int64_t i = 0; i < n; ++i) d[i] = src[i];
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst) + offset;
    if (t == ffi::DataType::BF16)
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
    else
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_f16(src[i]);
  }
}

}  // namespace m3sparse
