// sparse_decode on the CPU (SPEC §5.3): row t belongs to request t / dql at
// position seq_lens[r] − dql + t % dql.
#include "attend.h"

namespace m3sparse {
namespace {

ffi::Future SparseDecode(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer cache,
                         ffi::Buffer<ffi::S32> topk, ffi::Buffer<ffi::S32> block_table,
                         ffi::Buffer<ffi::S32> seq_lens, ffi::BufferR0<ffi::F32> k_scale,
                         ffi::BufferR0<ffi::F32> v_scale, ffi::BufferR0<ffi::S32> layer,
                         ffi::Result<ffi::AnyBuffer> out, float scale, int64_t decode_query_len,
                         int64_t layout) {
  AttendArgs a;
  if (auto e = prepare_attend(q, cache, topk, block_table, *k_scale.typed_data(),
                              *v_scale.typed_data(), *layer.typed_data(), out, scale, layout, &a);
      e.failure())
    return ready_future(e);
  const int64_t dql = decode_query_len;
  if (dql < 1 || a.num_tokens != a.num_requests * dql ||
      seq_lens.element_count() != a.num_requests)
    return ready_future(invalid("decode needs T = R·decode_query_len and seq_lens [R]"));
  a.req = std::make_shared<std::vector<int32_t>>(a.num_tokens);
  a.pos = std::make_shared<std::vector<int32_t>>(a.num_tokens);
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    const int64_t r = t / dql;
    const int64_t pos = int64_t(seq_lens.typed_data()[r]) - dql + t % dql;
    (*a.req)[t] = int32_t(r);
    (*a.pos)[t] = int32_t(std::max<int64_t>(pos, -1));  // pos < 0: attends nothing
  }
  return run_attend(pool, a);
}

}  // namespace
}  // namespace m3sparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_sparse_decode_cpu, m3sparse::SparseDecode,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()               // q
                                  .Arg<xla::ffi::AnyBuffer>()               // kv_cache
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // topk_indices
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // block_table
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // seq_lens
                                  .Arg<xla::ffi::BufferR0<xla::ffi::F32>>()  // k_scale
                                  .Arg<xla::ffi::BufferR0<xla::ffi::F32>>()  // v_scale
                                  .Arg<xla::ffi::BufferR0<xla::ffi::S32>>()  // layer
                                  .Ret<xla::ffi::AnyBuffer>()               // out
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("decode_query_len")
                                  .Attr<int64_t>("layout"));
