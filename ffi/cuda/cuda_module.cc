// The nanobind module `jax_m3sparse._m3sparse_cuda`: hands out the CUDA FFI handlers as
// capsules for jax.ffi.register_ffi_target(..., platform="CUDA").
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" {
XLA_FFI_Error* m3sparse_grouped_matmul_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_full_attention_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_pack_kv_pages_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_query_token_positions_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_route_experts_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_dense_matmul_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_select_blocks_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_sparse_decode_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_sparse_prefill_cuda(XLA_FFI_CallFrame*);
}

namespace {
template <typename F>
nb::capsule capsule(F* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_m3sparse_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["m3sparse_grouped_matmul_cuda"] = capsule(m3sparse_grouped_matmul_cuda);
    d["m3sparse_full_attention_cuda"] = capsule(m3sparse_full_attention_cuda);
    d["m3sparse_pack_kv_pages_cuda"] = capsule(m3sparse_pack_kv_pages_cuda);
    d["m3sparse_query_token_positions_cuda"] = capsule(m3sparse_query_token_positions_cuda);
    d["m3sparse_route_experts_cuda"] = capsule(m3sparse_route_experts_cuda);
    d["m3sparse_dense_matmul_cuda"] = capsule(m3sparse_dense_matmul_cuda);
    d["m3sparse_select_blocks_cuda"] = capsule(m3sparse_select_blocks_cuda);
    d["m3sparse_sparse_decode_cuda"] = capsule(m3sparse_sparse_decode_cuda);
    d["m3sparse_sparse_prefill_cuda"] = capsule(m3sparse_sparse_prefill_cuda);
    return d;
  });
  m.attr("XLA_FFI_API_VERSION") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  // The attention kernels' limits (jax_m3sparse.spec.unsupported_reason(..., platform="cuda")).
  m.attr("HEAD_DIM") = 128;
  m.attr("BLOCK_SIZE") = 128;
  m.attr("GROUP") = 16;
  m.attr("MAX_TOPK") = 64;
}
