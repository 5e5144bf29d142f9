// The nanobind module `jax_m3sparse._m3sparse_cpu`: hands out the CPU FFI handlers
// as capsules for jax.ffi.register_ffi_target (platform "cpu").
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" {
XLA_FFI_Error* m3sparse_pack_kv_pages_cpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_query_token_positions_cpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_sparse_decode_cpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_sparse_prefill_cpu(XLA_FFI_CallFrame*);
}

namespace {
template <typename F>
nb::capsule capsule(F* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_m3sparse_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["m3sparse_pack_kv_pages_cpu"] = capsule(m3sparse_pack_kv_pages_cpu);
    d["m3sparse_query_token_positions_cpu"] = capsule(m3sparse_query_token_positions_cpu);
    d["m3sparse_sparse_decode_cpu"] = capsule(m3sparse_sparse_decode_cpu);
    d["m3sparse_sparse_prefill_cpu"] = capsule(m3sparse_sparse_prefill_cpu);
    return d;
  });
  m.attr("XLA_FFI_API_VERSION") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
}
