// query_token_positions on the CPU (SPEC §4).
#include "m3sparse/ffi_checks.h"

namespace m3sparse {
namespace {

// query_req_id[j] = number of r in [1, R] with cu[r] <= j (the request whose range holds j;
// zero-length requests are skipped), −1 once that reaches R. The count form gives a
// defined result even for a non-monotonic cu_seqlens_q (SPEC §7).
ffi::Error QueryTokenPositions(ffi::Buffer<ffi::S32> cu_seqlens_q, ffi::Buffer<ffi::S32> context_lens,
                               ffi::Result<ffi::Buffer<ffi::S32>> req_id,
                               ffi::Result<ffi::Buffer<ffi::S32>> abs_pos) {
  const int64_t R = context_lens.element_count();
  const int64_t T = req_id->element_count();
  if (cu_seqlens_q.element_count() != R + 1) return invalid("cu_seqlens_q must be [R + 1]");
  const int32_t* cu = cu_seqlens_q.typed_data();
  const int32_t* ctx = context_lens.typed_data();
  int32_t* rid = req_id->typed_data();
  int32_t* pos = abs_pos->typed_data();
  for (int64_t j = 0; j < T; ++j) {
    int64_t r = 0;
    for (int64_t k = 1; k <= R; ++k) r += cu[k] <= j;
    if (r >= R) {
      rid[j] = -1;
      pos[j] = -1;
    } else {
      rid[j] = int32_t(r);
      pos[j] = int32_t(int64_t(ctx[r]) + (j - cu[r]));
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace m3sparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_query_token_positions_cpu, m3sparse::QueryTokenPositions,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // cu_seqlens_q
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // context_lens
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()   // query_req_id
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()); // query_abs_pos
