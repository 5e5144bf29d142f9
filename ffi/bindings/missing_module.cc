// Stand-ins for the FFI targets of a GPU module that is not loaded in this process.
// The cuda and rocm lowerings emit our custom calls whether or not their module is here (a
// CPU-only build box exports programs for GPUs it does not have; docs/spec_decisions.md "which
// lowering a platform gets"), so jax_m3sparse/_ffi.py registers these for every cuda / rocm
// target when jax_m3sparse._m3sparse_cuda / _rocm does not import: a program run without the
// module then fails naming the module and the fix, not with XLA's bare "no handler registered".
// Plain C++ (no CUDA, no HIP): the handler only returns the error, so it lives in the CPU
// module, which every install has.
#include <string>

#include "xla/ffi/api/ffi.h"

namespace m3sparse {
namespace {

namespace ffi = xla::ffi;

ffi::Error missing(const char* platform) {
  const std::string module = std::string("jax_m3sparse._m3sparse_") + platform;
  return ffi::Error(
      ffi::ErrorCode::kFailedPrecondition,
      "jax_m3sparse: this program calls jax_m3sparse's " + std::string(platform) +
          " kernels (custom calls m3sparse_<op>_" + platform + "), but the module " + module +
          " is not loaded in this process (jax_m3sparse.native_platforms() lists the loaded "
          "ones; the NativeModuleWarning at import says why). Build it (BUILD.md: -DM3SPARSE_ENABLE_" +
          (std::string(platform) == "cuda" ? "CUDA" : "ROCM") +
          "=ON) or install a wheel that has it, in the process that runs the program.");
}

ffi::Error MissingCuda(ffi::RemainingArgs, ffi::RemainingRets, ffi::Dictionary) {
  return missing("cuda");
}

ffi::Error MissingRocm(ffi::RemainingArgs, ffi::RemainingRets, ffi::Dictionary) {
  return missing("rocm");
}

}  // namespace
}  // namespace m3sparse

// Any operands, results and attributes: one stand-in serves every op of its platform.
XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_missing_cuda, m3sparse::MissingCuda,
                              xla::ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());
XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_missing_rocm, m3sparse::MissingRocm,
                              xla::ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());
