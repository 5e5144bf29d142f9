// pack_kv_pages on the CPU: quantize new K/V tokens to NVFP4 (SPEC §2.2) and write
// them into their cache slots (SPEC §3.2–3.4), in place.
#include <cstring>
#include <vector>

#include "elements.h"
#include "m3sparse/cache.h"
#include "m3sparse/ffi_checks.h"
#include "m3sparse/nvfp4.h"
#include "parallel.h"

namespace m3sparse {
namespace {

constexpr int64_t kTokensPerTask = 64;

struct PackArgs {
  CacheGeometry geo;
  uint8_t* cache;
  ffi::DataType dtype;
  const void* key;
  const void* value;
  const int32_t* slot_mapping;
  int64_t num_kv_heads;
  float inv_k_scale;
  float inv_v_scale;
  int64_t layer;
};

// Quantizes one head vector (D floats) into its token row of a (page, slot) tile.
void write_head_vector(const CacheGeometry& geo, const float* x, float r, uint8_t* tile, int64_t t) {
  uint8_t* data = tile + geo.token_data_offset(t);
  uint8_t* scales = tile + geo.token_scale_offset(t);
  for (int64_t g = 0; g < geo.head_dim / kNvfp4Group; ++g)
    nvfp4_quantize_group(x + g * kNvfp4Group, r, data + g * (kNvfp4Group / 2), scales + g);
}

void pack_tokens(const PackArgs& a, int64_t begin, int64_t end) {
  const CacheGeometry& geo = a.geo;
  const int64_t D = geo.head_dim;
  std::vector<float> x(D);
  for (int64_t t = begin; t < end; ++t) {
    int64_t slot = a.slot_mapping[t];
    if (slot < 0 || slot >= geo.num_pages * geo.block_size) continue;  // SPEC §3.4
    int64_t page = slot / geo.block_size, offset = slot % geo.block_size;
    for (int64_t h = 0; h < a.num_kv_heads; ++h) {
      int64_t src = (t * a.num_kv_heads + h) * D;
      load_floats(a.dtype, a.key, src, D, x.data());
      write_head_vector(geo, x.data(), a.inv_k_scale,
                        a.cache + geo.tile_offset(a.layer, page, 2 * h), offset);
      load_floats(a.dtype, a.value, src, D, x.data());
      write_head_vector(geo, x.data(), a.inv_v_scale,
                        a.cache + geo.tile_offset(a.layer, page, 2 * h + 1), offset);
    }
  }
}

ffi::Future PackKvPages(ffi::ThreadPool pool, ffi::AnyBuffer cache, ffi::AnyBuffer key,
                        ffi::AnyBuffer value, ffi::Buffer<ffi::S32> slot_mapping,
                        ffi::BufferR0<ffi::F32> k_scale, ffi::BufferR0<ffi::F32> v_scale,
                        ffi::BufferR0<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> out,
                        int64_t layout) {
  auto kd = key.dimensions();
  if (kd.size() != 3) return ready_future(invalid("key must be [T, Hkv, D]"));
  if (!is_supported_float(key.element_type()) || value.element_type() != key.element_type())
    return ready_future(invalid("key and value must share one float dtype (f32, bf16, f16)"));
  PackArgs a;
  if (auto e = decode_cache_geometry(cache, layout, kd[2], &a.geo); e.failure()) return ready_future(e);
  if (a.geo.num_slots != 2 * kd[1]) return ready_future(invalid("kv_cache slots must be 2·Hkv"));
  if (slot_mapping.element_count() != kd[0]) return ready_future(invalid("slot_mapping must be [T]"));
  // The result aliases the cache (input_output_aliases); copy only if XLA gave two buffers.
  a.cache = static_cast<uint8_t*>(out->untyped_data());
  if (out->untyped_data() != cache.untyped_data())
    std::memcpy(out->untyped_data(), cache.untyped_data(), cache.size_bytes());
  a.dtype = key.element_type();
  a.key = key.untyped_data();
  a.value = value.untyped_data();
  a.slot_mapping = slot_mapping.typed_data();
  a.num_kv_heads = kd[1];
  a.inv_k_scale = nvfp4_inverse_scale(*k_scale.typed_data());
  a.inv_v_scale = nvfp4_inverse_scale(*v_scale.typed_data());
  a.layer = *layer.typed_data();
  if (!a.geo.valid_layer(a.layer)) return ready_future();  // SPEC §3.3: writes nothing
  return parallel_for(pool, kd[0], kTokensPerTask,
                      [a](int64_t begin, int64_t end) { pack_tokens(a, begin, end); });
}

}  // namespace
}  // namespace m3sparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_pack_kv_pages_cpu, m3sparse::PackKvPages,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()   // kv_cache
                                  .Arg<xla::ffi::AnyBuffer>()   // key
                                  .Arg<xla::ffi::AnyBuffer>()   // value
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // slot_mapping
                                  .Arg<xla::ffi::BufferR0<xla::ffi::F32>>()  // k_scale
                                  .Arg<xla::ffi::BufferR0<xla::ffi::F32>>()  // v_scale
                                  .Arg<xla::ffi::BufferR0<xla::ffi::S32>>()  // layer
                                  .Ret<xla::ffi::AnyBuffer>()   // kv_cache (aliased)
                                  .Attr<int64_t>("layout"));
