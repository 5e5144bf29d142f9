// query_token_positions on the CPU (SPEC §4).
#include "m3sparse/ffi_checks.h"
#include "m3sparse/positions.h"

namespace m3sparse {
namespace {

ffi::Error QueryTokenPositions(ffi::Buffer<ffi::S32> cu_seqlens_q, ffi::Buffer<ffi::S32> context_lens,
                               ffi::Result<ffi::Buffer<ffi::S32>> req_id,
                               ffi::Result<ffi::Buffer<ffi::S32>> abs_pos) {
  const int64_t R = context_lens.element_count();
  const int64_t T = req_id->element_count();
  if (cu_seqlens_q.element_count() != R + 1) return invalid("cu_seqlens_q must be [R + 1]");
  for (int64_t j = 0; j < T; ++j)
    token_position(cu_seqlens_q.typed_data(), context_lens.typed_data(), R, j,
                   req_id->typed_data() + j, abs_pos->typed_data() + j);
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
