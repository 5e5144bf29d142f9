// The nanobind module `jax_m3sparse._m3sparse_rocm`: hands out the gfx950 FFI handlers as
// capsules for jax.ffi.register_ffi_target(name, capsule, platform="ROCM"). Mirrors the CPU
// module in ffi/bindings/cpu_module.cc.
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" {
XLA_FFI_Error* m3sparse_pack_kv_pages_rocm(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_query_token_positions_rocm(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_sparse_decode_rocm(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_sparse_prefill_rocm(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_full_attention_rocm(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_select_blocks_rocm(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_grouped_matmul_rocm(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_route_experts_rocm(XLA_FFI_CallFrame*);
}

namespace {
template <typename F>
nb::capsule capsule(F* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_m3sparse_rocm, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["m3sparse_pack_kv_pages_rocm"] = capsule(m3sparse_pack_kv_pages_rocm);
    d["m3sparse_query_token_positions_rocm"] = capsule(m3sparse_query_token_positions_rocm);
    d["m3sparse_sparse_decode_rocm"] = capsule(m3sparse_sparse_decode_rocm);
    d["m3sparse_sparse_prefill_rocm"] = capsule(m3sparse_sparse_prefill_rocm);
    d["m3sparse_full_attention_rocm"] = capsule(m3sparse_full_attention_rocm);
    d["m3sparse_select_blocks_rocm"] = capsule(m3sparse_select_blocks_rocm);
    d["m3sparse_grouped_matmul_rocm"] = capsule(m3sparse_grouped_matmul_rocm);
    d["m3sparse_route_experts_rocm"] = capsule(m3sparse_route_experts_rocm);
    return d;
  });
  m.attr("XLA_FFI_API_VERSION") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  m.attr("GPU_ARCH") = "gfx950";
}
