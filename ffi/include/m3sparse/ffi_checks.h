// Host-side helpers shared by the FFI handlers of every backend: decoding the
// cache geometry from buffer dimensions and turning mismatches into ffi::Error.
#pragma once

#include <string>

#include "m3sparse/cache.h"
#include "xla/ffi/api/ffi.h"

namespace m3sparse {

namespace ffi = xla::ffi;

inline ffi::Error invalid(const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "m3sparse: " + what);
}

// Reads P, L, 2·Hkv, N and the row width from a 4-D or 5-D uint8 cache (SPEC §3).
inline ffi::Error decode_cache_geometry(const ffi::AnyBuffer& cache, int64_t layout,
                                        int64_t head_dim, CacheGeometry* geo) {
  auto dims = cache.dimensions();
  if (cache.element_type() != ffi::DataType::U8) return invalid("kv_cache must be uint8");
  if (dims.size() != 4 && dims.size() != 5) return invalid("kv_cache must be 4-D or 5-D");
  if (layout != kLBHNC && layout != kBLHNC) return invalid("layout must be 0 (LBHNC) or 1 (BLHNC)");
  size_t r = dims.size();
  geo->layout = layout;
  geo->head_dim = head_dim;
  geo->num_slots = dims[r - 3];
  geo->block_size = dims[r - 2];
  if (r == 4) {
    geo->num_layers = 1;
    geo->num_pages = dims[0];
  } else if (layout == kLBHNC) {
    geo->num_layers = dims[0];
    geo->num_pages = dims[1];
  } else {
    geo->num_pages = dims[0];
    geo->num_layers = dims[1];
  }
  if (head_dim % 32 != 0) return invalid("head_dim must be a multiple of 32");
  if (dims[r - 1] != geo->full_dim())
    return invalid("kv_cache row width must be D/2 + D/16 = " + std::to_string(geo->full_dim()));
  return ffi::Error::Success();
}

}  // namespace m3sparse
