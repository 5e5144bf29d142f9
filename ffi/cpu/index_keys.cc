// write_index_keys on the CPU (SPEC §8.1): each token's index key into its slot of the
// key-only paged index cache [L, P, N, Di], in place. One row copy per token, in token order,
// converted to the cache's dtype: bf16 rounded to nearest even, float8_e4m3fn clamped to ±448
// then rounded to nearest even (NaN stays NaN) — the bits of the jnp reference's convert.
// XLA's CPU scatter into a bf16 buffer widened the whole cache to f32 and back on every call.
// A slot outside [0, P·N) or a layer outside [0, L) writes nothing; offsets are 64-bit.
#include <cmath>
#include <cstring>
#include <vector>

#include "elements.h"
#include "m3sparse/ffi_checks.h"
#include "m3sparse/nvfp4.h"

namespace m3sparse {
namespace {

uint8_t e4m3_saturating(float x) {
  const uint8_t sign = uint8_t((float_bits(x) >> 24) & 0x80u);
  if (std::isnan(x)) return uint8_t(sign | 0x7Fu);
  const float a = std::fabs(x);
  return uint8_t(sign | e4m3_from_clamped(a > kE4M3Max ? kE4M3Max : a));
}

ffi::Error WriteIndexKeys(ffi::AnyBuffer cache, ffi::AnyBuffer keys,
                          ffi::Buffer<ffi::S32> slot_mapping, ffi::BufferR0<ffi::S32> layer,
                          ffi::Result<ffi::AnyBuffer> out) {
  auto cd = cache.dimensions(), kd = keys.dimensions();
  if (cd.size() != 4 || kd.size() != 2 || cd[3] != kd[1])
    return invalid("write_index_keys: idx_k_cache [L, P, N, Di], keys [T, Di]");
  const bool fp8 = cache.element_type() == ffi::DataType::F8E4M3FN;
  if (!fp8 && cache.element_type() != ffi::DataType::BF16)
    return invalid("write_index_keys: idx_k_cache must be bfloat16 or float8_e4m3fn");
  if (keys.element_type() != ffi::DataType::F32 && keys.element_type() != ffi::DataType::BF16)
    return invalid("write_index_keys: keys must be float32 or bfloat16");
  if (slot_mapping.element_count() != kd[0])
    return invalid("write_index_keys: slot_mapping must be [T]");
  // The result aliases the cache (input_output_aliases); copy only if XLA gave two buffers.
  if (out->untyped_data() != cache.untyped_data())
    std::memcpy(out->untyped_data(), cache.untyped_data(), cache.size_bytes());
  const int64_t L = cd[0], P = cd[1], N = cd[2], Di = cd[3], T = kd[0];
  const int64_t l = *layer.typed_data();
  if (l < 0 || l >= L) return ffi::Error::Success();  // SPEC §3.3: writes nothing
  const int32_t* slots = slot_mapping.typed_data();
  const int64_t elem = fp8 ? 1 : 2;
  uint8_t* base = static_cast<uint8_t*>(out->untyped_data()) + l * P * N * Di * elem;
  std::vector<float> x(Di);
  for (int64_t t = 0; t < T; ++t) {  // in token order: of two tokens with one slot, the later
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= P * N) continue;
    load_floats(keys.element_type(), keys.untyped_data(), t * Di, Di, x.data());
    uint8_t* row = base + slot * Di * elem;   // slot = page · N + offset: rows in page order
    if (fp8) {
      for (int64_t d = 0; d < Di; ++d) row[d] = e4m3_saturating(x[d]);
    } else {
      uint16_t* r = reinterpret_cast<uint16_t*>(row);
      for (int64_t d = 0; d < Di; ++d) r[d] = float_to_bf16(x[d]);
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace m3sparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_write_index_keys_cpu, m3sparse::WriteIndexKeys,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()                // idx_k_cache
                                  .Arg<xla::ffi::AnyBuffer>()                // keys
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // slot_mapping
                                  .Arg<xla::ffi::BufferR0<xla::ffi::S32>>()  // layer
                                  .Ret<xla::ffi::AnyBuffer>());              // idx_k_cache (aliased)
