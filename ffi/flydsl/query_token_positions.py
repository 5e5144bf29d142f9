"""Position metadata for prefill tokens on gfx950 (SPEC §4), compiled as `query_token_positions`.

    launch(cu_seqlens_q, context_lens, query_req_id, query_abs_pos,
           num_requests, num_tokens, search_steps, grid, stream)

* ``cu_seqlens_q`` int32 [R+1] (non-decreasing, cu[0] = 0), ``context_lens`` int32 [R]
* ``query_req_id``, ``query_abs_pos`` int32 [num_tokens] (results)
* ``search_steps`` = ceil(log2(R + 1)), ``grid`` = ceil(num_tokens / 64), both from the host.

One lane per token j (64 per workgroup). query_req_id[j] is the first r in [0, R) with
cu[r+1] > j, found by a binary search of `search_steps` steps (zero-length requests own no token,
because their cu[r+1] = cu[r] <= j); it is -1 for j >= cu[R]. query_abs_pos[j] =
context_lens[r] + (j - cu[r]), or -1 where query_req_id is -1. All loads and stores go through
buffer descriptors sized to their arrays, so malformed input (non-monotonic cu) gives some value
but never an out-of-bounds access (SPEC §7).
"""

import functools

import flydsl.compiler as flyc
import flydsl.expr as fx

from common import WAVE, buffer_rsrc, load_dwords, store_dwords


@functools.lru_cache(maxsize=None)
def compile_query_token_positions():
    @flyc.kernel(known_block_size=(WAVE, 1, 1))
    def query_token_positions_kernel(
        cu_seqlens_q: fx.Pointer, context_lens: fx.Pointer, query_req_id: fx.Pointer,
        query_abs_pos: fx.Pointer, num_requests: fx.Int32, num_tokens: fx.Int32, search_steps: fx.Int32,
    ):
        j = fx.Int32(fx.block_idx.x) * WAVE + fx.Int32(fx.thread_idx.x)
        cu = buffer_rsrc(cu_seqlens_q, fx.Int64(num_requests + 1) * 4)
        ctx = buffer_rsrc(context_lens, fx.Int64(num_requests) * 4)
        # binary search over [lo, hi) for the first r with cu[r+1] > j
        lo = fx.Int32(0)
        hi = num_requests
        for _step, state in range(0, search_steps, 1, init=[lo, hi]):
            lo_s = fx.Int32(state[0])
            hi_s = fx.Int32(state[1])
            active = lo_s < hi_s
            mid = (lo_s + hi_s) // 2
            right = load_dwords(cu, (mid + 1) * 4, 1) <= j
            lo_n = (active & right).select(mid + 1, lo_s)
            hi_n = (active & (~right)).select(mid, hi_s)
            results = yield [lo_n, hi_n]
        req = fx.Int32(results[0])
        total = load_dwords(cu, num_requests * 4, 1)
        owned = (j < total) & (req < num_requests)
        req_safe = owned.select(req, 0)
        pos = load_dwords(ctx, req_safe * 4, 1) + j - load_dwords(cu, req_safe * 4, 1)
        # stores past num_tokens fall outside the descriptors and are dropped
        out_bytes = fx.Int64(num_tokens) * 4
        store_dwords(buffer_rsrc(query_req_id, out_bytes), j * 4, owned.select(req, -1))
        store_dwords(buffer_rsrc(query_abs_pos, out_bytes), j * 4, owned.select(pos, -1))

    @flyc.jit
    def launch(
        cu_seqlens_q: fx.Pointer, context_lens: fx.Pointer, query_req_id: fx.Pointer,
        query_abs_pos: fx.Pointer, num_requests: fx.Int32, num_tokens: fx.Int32, search_steps: fx.Int32,
        grid: fx.Int32, stream: fx.Stream = fx.Stream(None),
    ):
        query_token_positions_kernel(
            cu_seqlens_q, context_lens, query_req_id, query_abs_pos, num_requests, num_tokens, search_steps,
        ).launch(grid=(grid, 1, 1), block=(WAVE, 1, 1), stream=stream)

    return launch


def placeholders():
    ptr = flyc.from_c_void_p
    return (
        ptr(fx.Int32, None, assumed_align=4), ptr(fx.Int32, None, assumed_align=4),
        ptr(fx.Int32, None, assumed_align=4), ptr(fx.Int32, None, assumed_align=4),
        fx.Int32(1), fx.Int32(1), fx.Int32(1), fx.Int32(1),
    )
