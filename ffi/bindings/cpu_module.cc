// The nanobind module `jax_m3sparse._m3sparse_cpu`: hands out the CPU FFI handlers
// as capsules for jax.ffi.register_ffi_target (platform "cpu").
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "xla/ffi/api/c_api.h"
#include "../cpu/isa.h"

namespace nb = nanobind;

extern "C" {
XLA_FFI_Error* m3sparse_pack_kv_pages_cpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_query_token_positions_cpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_sparse_decode_cpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_sparse_prefill_cpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_select_blocks_cpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_write_index_keys_cpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_grouped_matmul_cpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_missing_cuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* m3sparse_missing_rocm(XLA_FFI_CallFrame*);
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
    d["m3sparse_select_blocks_cpu"] = capsule(m3sparse_select_blocks_cpu);
    d["m3sparse_write_index_keys_cpu"] = capsule(m3sparse_write_index_keys_cpu);
    d["m3sparse_grouped_matmul_cpu"] = capsule(m3sparse_grouped_matmul_cpu);
    return d;
  });
  // The stand-in handler for the targets of a GPU module ("cuda", "rocm") that did not load
  // (missing_module.cc): it fails every call, naming the module.
  m.def("missing_module_handler", [](const std::string& platform) {
    if (platform == "cuda") return capsule(m3sparse_missing_cuda);
    if (platform == "rocm") return capsule(m3sparse_missing_rocm);
    throw nb::value_error(("no stand-in for platform '" + platform + "'").c_str());
  });
  // The attention paths (ffi/cpu/isa.h): those this machine supports, narrowest first,
  // and the one a call takes now (M3SPARSE_CPU_ISA caps it; ValueError if that names no path,
  // the error every attention call would give).
  m.def("cpu_paths", []() {
    nb::list paths;
    for (int i = 0; i <= int(m3sparse::machine_cpu_path()); ++i) paths.append(m3sparse::kCpuPathNames[i]);
    return paths;
  });
  m.def("cpu_path", []() {
    m3sparse::CpuPath path;
    if (!m3sparse::current_cpu_path(&path))
      throw nb::value_error(m3sparse::cpu_path_error().c_str());
    return nb::str(m3sparse::kCpuPathNames[int(path)]);
  });
  m.attr("XLA_FFI_API_VERSION") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
}
