"""route_experts for gfx950 (SPEC §10), compiled as `route_experts`.

Each token's top-k experts and weights, then the (token, expert) pairs grouped by expert, where
XLA ran a top-k sort, an argsort, scatters and gathers. Never run on hardware: compiled ahead of
time and executed on the ISA emulator in CI (tests/rocm). Launcher arguments, in order
(ffi/rocm/handlers.cc passes them):

    scores float32 [T, E];  bias float32 [E];  live bool [T] (one byte a token)
    weights float32 [T, k];  experts int32 [T, k];  group_sizes int32 [E];
    sorted_tokens int32 [T·k];  sorted_weights float32 [T·k];  inverse int32 [T, k]   (results)
    T, E, k, renormalize (int32), stream.

Two kernels, launched one after the other on the stream:

1. Choice, grid (T), one wave a token: lane l holds the keys of experts l, l + 64, … (key =
   score + bias, NaN as −inf). k rounds (k ≤ 8, unrolled), each the wave's best (key descending,
   ties to the lower id: −0 and +0 compare equal, so the lower id wins, as the reference's
   canonicalized keys do) among the experts that rank after the previous round's pick, combined
   by xor shuffles (exact: every lane agrees). The chosen scores are re-read, summed in choice
   order and divided (IEEE division) when renormalizing.
2. Grouping, one workgroup of 256 threads: pair p = t·k + j has bucket experts[p], or E when
   token t is not live. Pass 1 counts each bucket over chunks of 256 pairs in pair order (a
   thread's rank in its chunk = the chunk's earlier pairs of its bucket, read from LDS; the last
   pair of a bucket in the chunk advances the bucket's count); wave 0 turns the counts into
   each bucket's start (group_sizes are the first E counts). Pass 2 walks the chunks again: a
   pair's position = its bucket's start + the pairs of that bucket before it in pair order —
   the stable order of the reference's argsort. Integer counting only: the same bits in every
   launch, whatever the batch.

Every load and store goes through a buffer descriptor sized to its array. E ≤ MAX_EXPERTS (the
counters live in LDS), k ≤ MAX_K.
"""


import functools

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import gpu, range_constexpr

from common import WAVE, buffer_rsrc, load_dwords, load_u8, store_dwords
from select_blocks import INT32_MAX, NEG_INF, better, wave_best
from union_tile import dyn_for, lds_i32, put_i32, when

MAX_EXPERTS = 4096
MAX_K = 8
GROUP_THREADS = 256
# LDS of the grouping kernel: counters [E + 1], starts [E + 1], the chunk's buckets [256]
# (each array 16-byte aligned: the chunk is read 4 entries at a time). Every LDS access is made
# by whole waves at valid addresses: a masked lane writes the spare slot DUMMY instead of
# skipping (the ISA emulator reads inactive lanes' addresses too).
SLOTS = (MAX_EXPERTS + 2 + 3) // 4 * 4
DUMMY = SLOTS - 1
RUNNING, START, CHUNK = 0, 4 * SLOTS, 8 * SLOTS
LDS_BYTES = CHUNK + 4 * GROUP_THREADS


def shared_storage():
    @fx.struct
    class SharedStorage:
        buf: fx.Array[fx.Int32, LDS_BYTES // 4, 16]

    return SharedStorage


@functools.lru_cache(maxsize=None)
def compile_route_experts():
    """Launcher of the choice kernel over (T) and the grouping kernel over (1)."""
    SharedStorage = shared_storage()

    @flyc.kernel(known_block_size=(WAVE, 1, 1))
    def route_experts_choose(
        scores: fx.Pointer, bias: fx.Pointer, weights: fx.Pointer, experts: fx.Pointer,
        T_tokens: fx.Int32, E: fx.Int32, k: fx.Int32, renormalize: fx.Int32,
    ):
        t = fx.Int32(fx.block_idx.x)
        lane = fx.Int32(fx.thread_idx.x)
        s_rsrc = buffer_rsrc(scores, fx.Int64(T_tokens) * fx.Int64(E) * 4)
        b_rsrc = buffer_rsrc(bias, fx.Int64(E) * 4)
        w_rsrc = buffer_rsrc(weights, fx.Int64(T_tokens) * fx.Int64(k) * 4)
        e_rsrc = buffer_rsrc(experts, fx.Int64(T_tokens) * fx.Int64(k) * 4)
        row = t * E
        chunks = (E + (WAVE - 1)) // WAVE
        prev_s, prev_b = fx.Float32(float("inf")), fx.Int32(-1)
        chosen, raw = [], []
        for j in range_constexpr(MAX_K):
            def scan(i, acc, prev_s=prev_s, prev_b=prev_b):
                e = i * WAVE + lane
                key = fx.Float32(load_dwords(s_rsrc, (row + e) * 4, 1).bitcast(fx.Float32)
                                 + load_dwords(b_rsrc, e * 4, 1).bitcast(fx.Float32))
                key = (key == key).select(key, fx.Float32(NEG_INF))
                after = (key < prev_s) | ((key == prev_s) & (e > prev_b))
                take = (e < E) & after & better(key, e, fx.Float32(acc["s"]), fx.Int32(acc["b"]))
                return {"s": take.select(key, fx.Float32(acc["s"])), "b": take.select(e, fx.Int32(acc["b"]))}

            best = dyn_for(0, chunks, {"s": fx.Float32(NEG_INF), "b": fx.Int32(INT32_MAX)}, scan)
            best_s, best_b = wave_best(fx.Float32(best["s"]), fx.Int32(best["b"]))
            chosen.append(best_b)
            raw.append(load_dwords(s_rsrc, (row + best_b) * 4, 1).bitcast(fx.Float32))
            prev_s, prev_b = best_s, best_b
        total = raw[0]
        for j in range_constexpr(1, MAX_K):
            total = (fx.Int32(j) < k).select(fx.Float32(total + raw[j]), total)
        first = lane == 0
        for j in range_constexpr(MAX_K):
            w = (renormalize != 0).select(fx.Float32(raw[j] / total), raw[j])
            off = (first & (fx.Int32(j) < k)).select((t * k + j) * 4, fx.Int32(-16))
            store_dwords(e_rsrc, off, chosen[j])
            store_dwords(w_rsrc, off, w.bitcast(fx.Int32))

    @flyc.kernel(known_block_size=(GROUP_THREADS, 1, 1))
    def route_experts_group(
        live: fx.Pointer, weights: fx.Pointer, experts: fx.Pointer, group_sizes: fx.Pointer,
        sorted_tokens: fx.Pointer, sorted_weights: fx.Pointer, inverse: fx.Pointer,
        T_tokens: fx.Int32, E: fx.Int32, k: fx.Int32,
    ):
        tid = fx.Int32(fx.thread_idx.x)
        lds = fx.SharedAllocator().allocate(SharedStorage).peek()
        base = fx.recast_iter(fx.Uint8, lds.buf.ptr)
        n = T_tokens * k
        live_rsrc = buffer_rsrc(live, fx.Int64(T_tokens))
        w_rsrc = buffer_rsrc(weights, fx.Int64(n) * 4)
        e_rsrc = buffer_rsrc(experts, fx.Int64(n) * 4)
        sizes_rsrc = buffer_rsrc(group_sizes, fx.Int64(E) * 4)
        st_rsrc = buffer_rsrc(sorted_tokens, fx.Int64(n) * 4)
        sw_rsrc = buffer_rsrc(sorted_weights, fx.Int64(n) * 4)
        inv_rsrc = buffer_rsrc(inverse, fx.Int64(n) * 4)
        buckets = E + 1
        sweeps = (buckets + (GROUP_THREADS - 1)) // GROUP_THREADS

        def each_bucket(action):
            """action(b, ok) for b = tid, tid + 256, ... over sweeps covering E + 1 buckets; b is the
            spare slot where not ok."""
            def body(i, st):
                b = i * GROUP_THREADS + tid
                ok = b < buckets
                action(ok.select(b, fx.Int32(DUMMY)), ok)
                return st
            dyn_for(0, sweeps, {"i": fx.Int32(0)}, body)

        each_bucket(lambda b, ok: put_i32(base, RUNNING + 4 * b, fx.Int32(0)))
        gpu.barrier()

        def chunk_pass(write):
            def body(c, st):
                p = c * GROUP_THREADS + tid
                valid = p < n
                tok = p // k
                e = load_dwords(e_rsrc, p * 4, 1)
                is_live = load_u8(live_rsrc, tok) != 0
                b = valid.select(is_live.select(e, E), fx.Int32(-1))
                put_i32(base, CHUNK + 4 * tid, b)
                gpu.barrier()

                def count(i, acc):
                    others = lds_i32(base, CHUNK + 16 * i, 4)
                    before, after = fx.Int32(acc["before"]), fx.Int32(acc["after"])
                    for u in range_constexpr(4):
                        same = (fx.Int32(others[u]) == b)
                        j = 4 * i + u
                        before = before + (same & (fx.Int32(j) < tid)).select(fx.Int32(1), fx.Int32(0))
                        after = after + (same & (fx.Int32(j) > tid)).select(fx.Int32(1), fx.Int32(0))
                    return {"before": before, "after": after}

                ranks = dyn_for(0, GROUP_THREADS // 4, {"before": fx.Int32(0), "after": fx.Int32(0)}, count)
                before, after = fx.Int32(ranks["before"]), fx.Int32(ranks["after"])
                slot = RUNNING + 4 * valid.select(b, 0)
                pos = lds_i32(base, slot) + before
                if write:
                    out = valid.select(pos * 4, fx.Int32(-16))
                    store_dwords(inv_rsrc, valid.select(p * 4, fx.Int32(-16)), pos)
                    store_dwords(st_rsrc, out, tok)
                    store_dwords(sw_rsrc, out, load_dwords(w_rsrc, p * 4, 1))
                gpu.barrier()                       # every thread has read the counters
                put_i32(base, (valid & (after == 0)).select(slot, fx.Int32(RUNNING + 4 * DUMMY)), pos + 1)
                gpu.barrier()
                return st

            dyn_for(0, (n + (GROUP_THREADS - 1)) // GROUP_THREADS, {"c": fx.Int32(0)}, body)

        chunk_pass(False)                           # RUNNING[b] = the pairs of bucket b

        def starts():
            def body(b, acc):
                count = lds_i32(base, RUNNING + 4 * b)
                put_i32(base, START + 4 * b, fx.Int32(acc["acc"]))
                return {"acc": fx.Int32(acc["acc"]) + count}
            dyn_for(0, buckets, {"acc": fx.Int32(0)}, body)

        when(tid < WAVE, starts)                    # wave 0, every lane the same scan
        gpu.barrier()
        each_bucket(lambda b, ok: store_dwords(sizes_rsrc, (ok & (b < E)).select(b * 4, fx.Int32(-16)),
                                               lds_i32(base, RUNNING + 4 * b)))
        gpu.barrier()                               # the counts are read before they are reset
        each_bucket(lambda b, ok: put_i32(base, RUNNING + 4 * b, lds_i32(base, START + 4 * b)))
        gpu.barrier()
        chunk_pass(True)

    @flyc.jit
    def launch(
        scores: fx.Pointer, bias: fx.Pointer, live: fx.Pointer, weights: fx.Pointer, experts: fx.Pointer,
        group_sizes: fx.Pointer, sorted_tokens: fx.Pointer, sorted_weights: fx.Pointer, inverse: fx.Pointer,
        T_tokens: fx.Int32, E: fx.Int32, k: fx.Int32, renormalize: fx.Int32,
        stream: fx.Stream = fx.Stream(None),
    ):
        route_experts_choose(scores, bias, weights, experts, T_tokens, E, k, renormalize).launch(
            grid=(T_tokens, 1, 1), block=(WAVE, 1, 1), stream=stream)
        route_experts_group(live, weights, experts, group_sizes, sorted_tokens, sorted_weights, inverse,
                            T_tokens, E, k).launch(grid=(1, 1, 1), block=(GROUP_THREADS, 1, 1), stream=stream)

    return launch


def placeholders():
    """Arguments for flyc.compile without a GPU (null pointers, dummy scalars)."""
    ptr = flyc.from_c_void_p
    return (
        ptr(fx.Float32, None, assumed_align=4), ptr(fx.Float32, None, assumed_align=4),
        ptr(fx.Uint8, None, assumed_align=1), ptr(fx.Float32, None, assumed_align=4),
        ptr(fx.Int32, None, assumed_align=4), ptr(fx.Int32, None, assumed_align=4),
        ptr(fx.Int32, None, assumed_align=4), ptr(fx.Float32, None, assumed_align=4),
        ptr(fx.Int32, None, assumed_align=4),
        fx.Int32(1), fx.Int32(1), fx.Int32(1), fx.Int32(1),
    )
