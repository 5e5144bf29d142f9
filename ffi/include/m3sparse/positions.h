// query_token_positions for one token (SPEC §4), shared by the CPU and CUDA backends.
#pragma once

#include "m3sparse/common.h"

namespace m3sparse {

// query_req_id[j] = number of r in [1, R] with cu[r] <= j (the request whose range holds j;
// zero-length requests are skipped), −1 once that reaches R; query_abs_pos[j] =
// context_lens[r] + j − cu[r]. The count form gives a defined result even for a
// non-monotonic cu_seqlens_q (SPEC §7).
M3_HD void token_position(const int32_t* cu, const int32_t* ctx, int64_t R, int64_t j,
                          int32_t* req_id, int32_t* abs_pos) {
  int64_t r = 0;
  for (int64_t k = 1; k <= R; ++k) r += cu[k] <= j;
  if (r >= R) {
    *req_id = -1;
    *abs_pos = -1;
  } else {
    *req_id = int32_t(r);
    *abs_pos = int32_t(int64_t(ctx[r]) + (j - cu[r]));
  }
}

}  // namespace m3sparse
