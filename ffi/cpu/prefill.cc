// sparse_prefill on the CPU (SPEC §5.4): row t belongs to request query_req_id[t]
// (−1: padding, zero output) at position query_abs_pos[t].
#include "attend.h"

namespace m3sparse {
namespace {

ffi::Future SparsePrefill(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer cache,
                          ffi::Buffer<ffi::S32> topk, ffi::Buffer<ffi::S32> block_table,
                          ffi::Buffer<ffi::S32> query_req_id, ffi::Buffer<ffi::S32> query_abs_pos,
                          ffi::BufferR0<ffi::F32> k_scale, ffi::BufferR0<ffi::F32> v_scale,
                          ffi::BufferR0<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> out,
                          float scale, int64_t layout) {
  AttendArgs a;
  if (auto e = prepare_attend(q, cache, topk, block_table, *k_scale.typed_data(),
                              *v_scale.typed_data(), *layer.typed_data(), out, scale, layout, &a);
      e.failure())
    return ready_future(e);
  if (query_req_id.element_count() != a.num_tokens || query_abs_pos.element_count() != a.num_tokens)
    return ready_future(invalid("query_req_id and query_abs_pos must be [T]"));
  const int32_t* req = query_req_id.typed_data();
  const int32_t* pos = query_abs_pos.typed_data();
  a.req = std::make_shared<std::vector<int32_t>>(req, req + a.num_tokens);
  a.pos = std::make_shared<std::vector<int32_t>>(pos, pos + a.num_tokens);
  return run_attend(pool, a);
}

}  // namespace
}  // namespace m3sparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_sparse_prefill_cpu, m3sparse::SparsePrefill,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()               // q
                                  .Arg<xla::ffi::AnyBuffer>()               // kv_cache
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // topk_indices
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // block_table
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // query_req_id
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // query_abs_pos
                                  .Arg<xla::ffi::BufferR0<xla::ffi::F32>>()  // k_scale
                                  .Arg<xla::ffi::BufferR0<xla::ffi::F32>>()  // v_scale
                                  .Arg<xla::ffi::BufferR0<xla::ffi::S32>>()  // layer
                                  .Ret<xla::ffi::AnyBuffer>()               // out
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("layout"));
