// query_token_positions for CUDA (SPEC §4): one thread per token, the shared count form of
// m3sparse/positions.h.
#include <cstdint>

#include <cuda_runtime.h>

#include "m3sparse/positions.h"

namespace m3sparse {
namespace cuda {
namespace {

__global__ void positions_kernel(const int32_t* cu, const int32_t* ctx, int64_t R, int32_t* rid,
                                 int32_t* pos, int64_t T) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= T) return;
  token_position(cu, ctx, R, j, rid + j, pos + j);
}

}  // namespace

cudaError_t launch_query_token_positions(const int32_t* cu_seqlens_q, const int32_t* context_lens,
                                         int64_t num_requests, int32_t* query_req_id,
                                         int32_t* query_abs_pos, int64_t num_tokens,
                                         cudaStream_t stream) {
  if (num_tokens <= 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = (num_tokens + threads - 1) / threads;
  positions_kernel<<<unsigned(blocks), threads, 0, stream>>>(cu_seqlens_q, context_lens,
                                                              num_requests, query_req_id,
                                                              query_abs_pos, num_tokens);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace m3sparse
