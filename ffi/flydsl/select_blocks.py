"""MiniMax M3's indexer block selection for gfx950 (SPEC §8), compiled as `select_blocks_<q>_<k>`.

Compiled variants: q dtype <q> in {bf16, f32} × index-key dtype <k> in {bf16, fp8} (float8_e4m3fn),
for the M3 geometry only: Di = 128, N = 128 (ffi/rocm/handlers.cc refuses anything else). Never
run on hardware: compiled ahead of time and executed on the ISA emulator in CI (tests/rocm).
Launcher arguments, in order (ffi/rocm/handlers.cc passes them):

    idx_q        bf16|f32 [T, Hkv, 128]
    idx_k_cache  bf16|e4m3 [P, 128, 128] or [L, P, 128, 128] (bytes; page p of layer l at
                 l·layer_stride + p·page_stride)
    block_table  int32 [R, M];  query_req_id, query_abs_pos  int32 [T];  layer  int32 []
    workspace    float32 [Hkv, T, M, 2]  (XLA scratch: the half-block scores, see below)
    topk_indices int32 [Hkv, T, K]  (the result)
    num_tokens T, num_kv_heads Hkv, num_requests R, max_blocks M, num_pages P, num_layers L
    (int32), page_stride, layer_stride (int64 bytes), topk_blocks K, local_blocks (int32),
    run_tiles = ceil(T / 64) (int32, from the host), stream.

Two kernels, launched one after the other on the stream:

1. Scores, grid (M, ceil(T / 64), 2), 4 waves each: workgroup (b, j, half) serves logical block
   b and key half `half` (keys 64·half .. +63 of the block) for every *run* that starts among the
   rows 64·j .. 64·j + 63 (the row tile j). A run is a maximal group of consecutive rows with the same request r
   in [0, R) (a decode request's MTP rows, a prefill chunk's tokens); it starts at row s when
   s = 0 or query_req_id[s − 1] differs (a ballot over the tile's 64 rows; every wave walks the set
   bits, so the 4 waves visit the same runs in the same order). The run may extend past the tile: its workgroup follows it to its end, so each run is
   served by exactly one workgroup per (block, half).
   a. The run's end and the largest position among its rows, 64 rows a load (a ballot finds
      the first row past the run).
   b. If some row sees block b (max pos ≥ 128·b) and the page block_table[r, b] is in [0, P),
      lane l holds key 64·half + l of the page (256 bytes bf16 / 128 bytes E4M3) widened exactly
      to 128 fp32 registers. A run of at least 4 rows (a prefill chunk; 4 or more MTP rows too:
      the split is by length) is *shared*: the 4 waves
      read a quarter of each of the 64 keys into LDS (16-byte chunks), a barrier, every wave
      widens the whole half-block from LDS, and a second barrier keeps the next run's keys out
      of LDS until every wave holds its copy. A shorter run (decode rows, up to 3 MTP rows) goes
      to one wave — wave (the run's index among the tile's runs) mod 4 — which loads its keys
      itself, no barrier. Either way that is the only key read: each key of the run's visible blocks is read
      once per run, whatever its number of rows and heads. An invalid page is not read (a 0-byte
      descriptor) and scores −∞.
   c. For every row t of the run that sees the block (pos ≥ 128·b) — a shared run's rows dealt
      to the waves, s + w, s + w + 4, … for wave w — and every KV head g: the
      lane's dot product idx_q[t, g] · key in fp32, one fused multiply-add per dimension in the
      order d = 0, 1, …, 127 from 0 (q is read as uniform 16-byte loads and widened exactly);
      a NaN dot or a key past pos is −∞; the wave's max (exact, order-free) is the half-block
      score, stored to workspace[g, t, b, half]. Per-key scores never leave the registers.
      A row's scores depend only on its q, its keys and its position (batch invariance, §8.6).
2. Top-k, grid (T, Hkv), one wave per (row t, KV head g): padding rows (r outside [0, R),
   pos < 0, layer outside [0, L)) get K × −1. Otherwise, with own = pos // 128,
   last = min(own, M − 1) and lo = max(own − local_blocks + 1, 0): the local blocks lo .. last
   first, ascending (at most K); then K − that many rounds, each picking among the other
   candidates b < min(lo, last + 1) with a finite score s(b) = max(workspace[g, t, b, 0..1]) the
   best that ranks after the previous pick (score descending, ties to the lower id): lane l scans
   b = l, l + 64, …, the wave combines (score, id) pairs by xor shuffles (max score, then min id:
   exact, so every lane agrees). A round with nothing left ends the ranking; the rest is −1.

Every load and store goes through a buffer descriptor sized to its array (out-of-range ids or
pages read zeros and are masked, or are not read at all; SPEC §7). Workspace entries the top-k
kernel reads are exactly those the score kernel writes (candidates b ≤ min(own, M − 1) of valid
rows), so the scratch memory needs no initialization.
"""

import functools

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl._mlir.dialects import arith as _arith
from flydsl.compiler.ast_rewriter import CanonicalizeWhile
from flydsl.expr import math as fmath
from flydsl.expr import range_constexpr
from flydsl.expr.typing import T

from flydsl.expr import gpu

from attention_core import lds_load, lds_store
from common import WAVE, buffer_rsrc, load_dwords, store_dwords, uniform, wave_max_i32
from union_tile import dyn_for, dyn_if, when

INDEX_DIM = 128                 # Di (M3's index head dim)
BLOCK_SIZE = 128                # N
HALF_KEYS = BLOCK_SIZE // 2     # keys per score workgroup: one per lane
RUN_TILE = WAVE                 # rows whose run starts one score workgroup serves
SCORE_WAVES = 4                 # waves of a score workgroup: a run's rows dealt round robin
KEY_STRIDE = {"bf16": 256 + 16, "fp8": 128 + 16}   # LDS bytes per staged key (padded: no bank clash)
NEG_INF = float("-inf")
INT32_MAX = 2**31 - 1

Q_DTYPES = {"bf16": fx.BFloat16, "f32": fx.Float32}
KEY_BYTES = {"bf16": 2, "fp8": 1}


def first_lane(mask):
    """The lowest set bit of a wave's 64-bit ballot mask (nonzero), uniform."""
    return uniform(fx.Int32(_arith.trunci(T.i32, fmath.cttz(fx.Int64(mask).ir_value()))))


def _max_i32(a, b):
    return fx.Int32(_arith.maxsi(fx.Int32(a).ir_value(), fx.Int32(b).ir_value()))


def dyn_while(cond, state: dict, body):
    """scf.while: while cond(state) (a wave-uniform i1): state = body(state)."""
    names = tuple(state)

    def before(_names, *vals):
        return cond(dict(zip(names, vals)))

    def after(_names, *vals):
        return body(dict(zip(names, vals)))

    out = CanonicalizeWhile.scf_while_dispatch(before, after, result_names=names,
                                               result_values=tuple(state[n] for n in names))
    return dict(zip(names, out if len(names) > 1 else (out,)))


def bf16_pair(word):
    """The two bf16 values packed in a dword (element 0 in the low half), widened exactly."""
    w = fx.Int32(word)
    return [(w << 16).bitcast(fx.Float32), (w & fx.Int32(-65536)).bitcast(fx.Float32)]


def e4m3_quad(word):
    """The four float8_e4m3fn values of a dword (byte 0 first), widened exactly (v_cvt_pk_f32_fp8).

    The high pair is shifted down rather than selected with the word-select bit: that form (SDWA)
    is one the emulator cannot run, and the shift costs one instruction per dword of a key."""
    w = fx.Int32(word)
    lo = fx.Vector(fx.rocdl.cvt_pk_f32_fp8(T.vec(2, T.f32), w.ir_value(), False))
    hi = fx.Vector(fx.rocdl.cvt_pk_f32_fp8(T.vec(2, T.f32), fx.Int32(w >> 16).ir_value(), False))
    return [lo[0], lo[1], hi[0], hi[1]]


def widened_key(chunk, kdt):
    """A key (INDEX_DIM values) as fp32, in d order, widened exactly; chunk(c) gives its c-th 16
    bytes as 4 dwords (from memory or from LDS)."""
    vals = []
    for c in range_constexpr(INDEX_DIM * KEY_BYTES[kdt] // 16):
        words = chunk(c)
        for i in range_constexpr(4):
            vals.extend(bf16_pair(words[i]) if kdt == "bf16" else e4m3_quad(words[i]))
    return vals


def stage_key(k_rsrc, key, kdt, lds_base, lane, wave):
    """This wave's share of the workgroup's 64 keys into LDS: 16-byte chunks c ≡ wave (mod
    SCORE_WAVES) of lane `lane`'s key `key` (each chunk of the half-block read once)."""
    kb = KEY_BYTES[kdt]
    for c in range_constexpr(INDEX_DIM * kb // 16 // SCORE_WAVES):
        chunk = c * SCORE_WAVES + wave
        words = load_dwords(k_rsrc, key * (INDEX_DIM * kb) + 16 * chunk, 4)
        lds_store(lds_base, lane * KEY_STRIDE[kdt] + 16 * chunk, words, fx.Int32, 16)


def run_keys(shared, k_rsrc, key, kdt, lds_base, lane, wave):
    """Lane `lane`'s key `key` for a run, as fp32 registers: staged through LDS by the
    workgroup's 4 waves (`shared`: every wave then holds all 64 keys; two barriers), else loaded
    by this wave from memory (16-byte loads)."""
    if not shared:
        key_bytes = INDEX_DIM * KEY_BYTES[kdt]
        return widened_key(lambda c: load_dwords(k_rsrc, key * key_bytes + 16 * c, 4), kdt)
    stage_key(k_rsrc, key, kdt, lds_base, lane, wave)
    gpu.barrier()
    kv = widened_key(lambda c: fx.Vector(lds_load(lds_base, lane * KEY_STRIDE[kdt] + 16 * c,
                                                  fx.Int32, 4, 16)), kdt)
    gpu.barrier()
    return kv


def dot_q(q_rsrc, q_off, qdt, key):
    """idx_q row at byte q_off (uniform) · key, fp32: fma in the order d = 0 .. 127, from 0."""
    acc = fx.Float32(0.0)
    qb = 2 if qdt == "bf16" else 4
    for c in range_constexpr(INDEX_DIM * qb // 16):
        words = load_dwords(q_rsrc, q_off + 16 * c, 4)
        if qdt == "f32":
            qs = [words[i].bitcast(fx.Float32) for i in range(4)]
        else:
            qs = [v for i in range(4) for v in bf16_pair(words[i])]
        d0 = c * len(qs)
        for i in range_constexpr(len(qs)):
            acc = fx.Float32(fmath.fma(qs[i], key[d0 + i], acc))
    return acc


def wave_max(x):
    for k in (32, 16, 8, 4, 2, 1):
        x = fx.maxnumf(x, x.shuffle_xor(k, WAVE))
    return fx.Float32(x)


def better(s, b, best_s, best_b):
    """(s, b) ranks before (best_s, best_b): higher score, ties to the lower id (SPEC §8 step 4)."""
    return (s > best_s) | ((s == best_s) & (b < best_b))


def wave_best(best_s, best_b):
    """The wave's best (score, id) of the lanes' candidates by `better`, combined by xor shuffles
    (exact, so every lane agrees); the id made uniform."""
    for k in (32, 16, 8, 4, 2, 1):
        os_, ob = fx.Float32(best_s.shuffle_xor(k, WAVE)), fx.Int32(best_b.shuffle_xor(k, WAVE))
        take = better(os_, ob, best_s, best_b)
        best_s, best_b = take.select(os_, best_s), take.select(ob, best_b)
    return best_s, uniform(best_b)


def shared_storage(kdt: str):
    @fx.struct
    class SharedStorage:
        keys: fx.Array[fx.Int32, HALF_KEYS * KEY_STRIDE[kdt] // 4, 16]

    return SharedStorage


@functools.lru_cache(maxsize=None)
def compile_select_blocks(qdt: str = "bf16", kdt: str = "bf16"):
    """Launcher for idx_q dtype `qdt` ("bf16", "f32") and key dtype `kdt` ("bf16", "fp8")."""
    if qdt not in Q_DTYPES or kdt not in KEY_BYTES:
        raise ValueError(f"select_blocks: no variant q={qdt!r}, keys={kdt!r}")
    q_bytes = Q_DTYPES[qdt].width // 8
    page_bytes = BLOCK_SIZE * INDEX_DIM * KEY_BYTES[kdt]
    SharedStorage = shared_storage(kdt)

    @flyc.kernel(known_block_size=(WAVE * SCORE_WAVES, 1, 1))
    def select_blocks_scores(
        idx_q: fx.Pointer, idx_k_cache: fx.Pointer, block_table: fx.Pointer, query_req_id: fx.Pointer,
        query_abs_pos: fx.Pointer, layer_ptr: fx.Pointer, workspace: fx.Pointer,
        num_tokens: fx.Int32, num_kv_heads: fx.Int32, num_requests: fx.Int32, max_blocks: fx.Int32,
        num_pages: fx.Int32, num_layers: fx.Int32, page_stride: fx.Int64, layer_stride: fx.Int64,
    ):
        b = fx.Int32(fx.block_idx.x)
        tile = fx.Int32(fx.block_idx.y)
        half = fx.Int32(fx.block_idx.z)
        tid = fx.Int32(fx.thread_idx.x)
        wave = uniform(tid // WAVE)
        lane = tid % WAVE
        lds = fx.SharedAllocator().allocate(SharedStorage).peek()
        lds_base = fx.recast_iter(fx.Uint8, lds.keys.ptr)
        layer = fx.Int32(layer_ptr.load())
        layer_ok = (layer >= 0) & (layer < num_layers)
        req_rsrc = buffer_rsrc(query_req_id, fx.Int64(num_tokens) * 4)
        pos_rsrc = buffer_rsrc(query_abs_pos, fx.Int64(num_tokens) * 4)
        table_rsrc = buffer_rsrc(block_table, fx.Int64(num_requests) * fx.Int64(max_blocks) * 4)
        q_rsrc = buffer_rsrc(idx_q, fx.Int64(num_tokens) * fx.Int64(num_kv_heads) * (INDEX_DIM * q_bytes))
        ws_rsrc = buffer_rsrc(workspace, fx.Int64(num_kv_heads) * fx.Int64(num_tokens) * fx.Int64(max_blocks) * 8)

        # runs starting in this tile: row t starts one when its request is real and differs from
        # row t - 1's (row -1 reads offset -4: outside the descriptor, 0, and t = 0 starts anyway)
        t = tile * RUN_TILE + lane
        r_t = load_dwords(req_rsrc, t * 4, 1)
        r_prev = load_dwords(req_rsrc, t * 4 - 4, 1)
        starts = layer_ok & (t < num_tokens) & (r_t >= 0) & (r_t < num_requests) & ((t == 0) | (r_prev != r_t))
        mask = fx.Int64(fx.rocdl.ballot(T.i64, starts.ir_value()))
        first_key = b * BLOCK_SIZE
        key = half * HALF_KEYS + lane              # this lane's key in the block

        def one_run(st):
            m = fx.Int64(st["mask"])
            s = tile * RUN_TILE + first_lane(m)
            r = uniform(load_dwords(req_rsrc, s * 4, 1))
            # a. the run's end and its largest position, 64 rows a load (lane = row): the end is
            # the first lane past the run, found by a ballot; a prefill chunk's run of 2048 rows
            # takes 32 loads, not 2048 dependent ones
            def rows(e):
                t = fx.Int32(e["base"]) + lane
                inside = (t < num_tokens) & (load_dwords(req_rsrc, t * 4, 1) == r)
                out = fx.Int64(fx.rocdl.ballot(T.i64, (~inside).ir_value()))
                pos = load_dwords(pos_rsrc, t * 4, 1)
                return {"base": fx.Int32(e["base"]) + WAVE,
                        "end": (out != 0).select(fx.Int32(e["base"]) + first_lane(out), fx.Int32(-1)),
                        "max_pos": _max_i32(fx.Int32(e["max_pos"]), wave_max_i32(inside.select(pos, -1)))}

            ends = dyn_while(lambda e: fx.Int32(e["end"]) < 0,
                             {"base": s, "end": fx.Int32(-1), "max_pos": fx.Int32(-1)}, rows)
            end, max_pos = fx.Int32(ends["end"]), fx.Int32(ends["max_pos"])

            def score_run(shared):
                # b. the half-block's keys, once for the run (an invalid page: 0-byte descriptor,
                # zeros). shared (a run of ≥ 4 rows): the 4 waves load a quarter of each key each,
                # then every wave widens the whole half-block from LDS (lane l: key 64·half + l);
                # the second barrier keeps the next run's keys out of LDS until every wave has
                # its copy. Else one wave loads its lanes' keys itself and takes every row.
                page = uniform(load_dwords(table_rsrc, (r * max_blocks + b) * 4, 1))
                page_ok = (page >= 0) & (page < num_pages)
                base = (fx.Int64(layer_ok.select(layer, 0)) * layer_stride
                        + fx.Int64(page_ok.select(page, 0)) * page_stride)
                k_rsrc = buffer_rsrc(idx_k_cache + base, page_ok.select(fx.Int32(page_bytes), fx.Int32(0)))
                kv = run_keys(shared, k_rsrc, key, kdt, lds_base, lane, wave)
                first_row, stride = (s + wave, SCORE_WAVES) if shared else (s, 1)

                # c. every row of the run that sees the block, every KV head
                def row(tt, st_row):
                    pos = uniform(load_dwords(pos_rsrc, tt * 4, 1))
                    visible = page_ok & (key <= pos - first_key)

                    def heads():
                        def head(g, st_head):
                            dot = dot_q(q_rsrc, (tt * num_kv_heads + g) * (INDEX_DIM * q_bytes), qdt, kv)
                            score = (visible & (dot == dot)).select(dot, fx.Float32(NEG_INF))
                            best = wave_max(score)
                            off = (((g * num_tokens + tt) * max_blocks + b) * 2 + half) * 4
                            store_dwords(ws_rsrc, off, best.bitcast(fx.Int32))
                            return st_head
                        dyn_for(0, num_kv_heads, {"g": fx.Int32(0)}, head)

                    when(pos >= first_key, heads)
                    return st_row

                # the run's rows first_row, first_row + stride, ... (a row's scores: one wave's max)
                count = (end - first_row + (stride - 1)) // stride
                dyn_for(0, (count > 0).select(count, 0), {"row": fx.Int32(0)},
                        lambda i, st_row: row(first_row + i * stride, st_row))

            # a run of at least 4 rows (a prefill chunk) is shared by the 4 waves; shorter runs
            # (decode rows, MTP rows) go to the waves in turn, a wave each, no barrier
            n_run = fx.Int32(st["n"])
            seen = max_pos >= first_key
            shared_run = (end - s) >= SCORE_WAVES
            when(seen & shared_run, lambda: score_run(True))
            when(seen & ~shared_run & (n_run % SCORE_WAVES == wave), lambda: score_run(False))
            return {"mask": m & (m - 1), "n": n_run + 1}

        dyn_while(lambda st: fx.Int64(st["mask"]) != 0, {"mask": mask, "n": fx.Int32(0)}, one_run)

    @flyc.kernel(known_block_size=(WAVE, 1, 1))
    def select_blocks_topk(
        workspace: fx.Pointer, query_req_id: fx.Pointer, query_abs_pos: fx.Pointer, layer_ptr: fx.Pointer,
        topk_indices: fx.Pointer,
        num_tokens: fx.Int32, num_kv_heads: fx.Int32, num_requests: fx.Int32, max_blocks: fx.Int32,
        num_layers: fx.Int32, topk_blocks: fx.Int32, local_blocks: fx.Int32,
    ):
        t = fx.Int32(fx.block_idx.x)
        g = fx.Int32(fx.block_idx.y)
        lane = fx.Int32(fx.thread_idx.x)
        layer = fx.Int32(layer_ptr.load())
        r = uniform(fx.Int32(query_req_id[t]))
        pos = uniform(fx.Int32(query_abs_pos[t]))
        live = (layer >= 0) & (layer < num_layers) & (r >= 0) & (r < num_requests) & (pos >= 0)
        own = live.select(pos, 0) // BLOCK_SIZE
        last = live.select((own < max_blocks).select(own, max_blocks - 1), fx.Int32(-1))
        lo = own - local_blocks + 1
        lo = (lo > 0).select(lo, 0)
        n_local = last - lo + 1
        n_local = (n_local > 0).select(n_local, 0)
        n_local = (n_local < topk_blocks).select(n_local, topk_blocks)
        n_rank = (lo < last + 1).select(lo, last + 1)                # candidates 0 .. n_rank - 1
        n_rank = (n_rank > 0).select(n_rank, 0)
        ws_rsrc = buffer_rsrc(workspace, fx.Int64(num_kv_heads) * fx.Int64(num_tokens) * fx.Int64(max_blocks) * 8)
        out_rsrc = buffer_rsrc(topk_indices, fx.Int64(num_kv_heads) * fx.Int64(num_tokens) * fx.Int64(topk_blocks) * 4)
        row_ws = (g * num_tokens + t) * max_blocks
        row_out = (g * num_tokens + t) * topk_blocks
        chunks = (n_rank + (WAVE - 1)) // WAVE

        def pick(st):
            prev_s, prev_b = fx.Float32(st["prev_s"]), fx.Int32(st["prev_b"])

            def scan(i, acc):
                bb = i * WAVE + lane
                pair = load_dwords(ws_rsrc, (row_ws + bb) * 8, 2).bitcast(fx.Float32)
                s = fx.maxnumf(pair[0], pair[1])
                s = fx.Float32(s)
                finite = (s > fx.Float32(NEG_INF)) & (s < fx.Float32(float("inf")))
                after = (s < prev_s) | ((s == prev_s) & (bb > prev_b))
                take = (bb < n_rank) & finite & after & better(s, bb, fx.Float32(acc["s"]), fx.Int32(acc["b"]))
                return {"s": take.select(s, fx.Float32(acc["s"])), "b": take.select(bb, fx.Int32(acc["b"]))}

            best = dyn_for(0, chunks, {"s": fx.Float32(NEG_INF), "b": fx.Int32(INT32_MAX)}, scan)
            best_s, best_b = wave_best(fx.Float32(best["s"]), fx.Int32(best["b"]))
            found = best_b != INT32_MAX
            filled = fx.Int32(st["filled"])
            when(found, lambda: store_dwords(out_rsrc, (row_out + filled) * 4, best_b))
            return {"filled": found.select(filled + 1, filled), "prev_s": best_s, "prev_b": best_b,
                    "done": (~found) | (filled + 1 >= topk_blocks)}

        ranked = dyn_while(lambda st: ~fx.Boolean(st["done"]),
                           {"filled": n_local, "prev_s": fx.Float32(float("inf")), "prev_b": fx.Int32(-1),
                            "done": n_local >= topk_blocks}, pick)
        filled = fx.Int32(ranked["filled"])

        # the local blocks in slots 0 .. n_local - 1, -1 in slots filled .. K - 1 (the ranked ones
        # between were stored above); other lanes' stores go past the descriptor: dropped
        def fill(c, st):
            j = c * WAVE + lane
            mine = (j < n_local) | ((j >= filled) & (j < topk_blocks))
            store_dwords(out_rsrc, mine.select((row_out + j) * 4, fx.Int32(-16)),
                         (j < n_local).select(lo + j, fx.Int32(-1)))
            return st

        dyn_for(0, (topk_blocks + (WAVE - 1)) // WAVE, {"c": fx.Int32(0)}, fill)

    @flyc.jit
    def launch(
        idx_q: fx.Pointer, idx_k_cache: fx.Pointer, block_table: fx.Pointer, query_req_id: fx.Pointer,
        query_abs_pos: fx.Pointer, layer: fx.Pointer, workspace: fx.Pointer, topk_indices: fx.Pointer,
        num_tokens: fx.Int32, num_kv_heads: fx.Int32, num_requests: fx.Int32, max_blocks: fx.Int32,
        num_pages: fx.Int32, num_layers: fx.Int32, page_stride: fx.Int64, layer_stride: fx.Int64,
        topk_blocks: fx.Int32, local_blocks: fx.Int32, run_tiles: fx.Int32,
        stream: fx.Stream = fx.Stream(None),
    ):
        select_blocks_scores(
            idx_q, idx_k_cache, block_table, query_req_id, query_abs_pos, layer, workspace,
            num_tokens, num_kv_heads, num_requests, max_blocks, num_pages, num_layers, page_stride, layer_stride,
        ).launch(grid=(max_blocks, run_tiles, 2), block=(WAVE * SCORE_WAVES, 1, 1), stream=stream)
        select_blocks_topk(
            workspace, query_req_id, query_abs_pos, layer, topk_indices,
            num_tokens, num_kv_heads, num_requests, max_blocks, num_layers, topk_blocks, local_blocks,
        ).launch(grid=(num_tokens, num_kv_heads, 1), block=(WAVE, 1, 1), stream=stream)

    return launch


def placeholders(qdt: str = "bf16", kdt: str = "bf16"):
    """Arguments for flyc.compile without a GPU (null pointers, dummy scalars)."""
    ptr = flyc.from_c_void_p
    return (
        ptr(Q_DTYPES[qdt], None, assumed_align=16), ptr(fx.Uint8, None, assumed_align=16),
        ptr(fx.Int32, None, assumed_align=4), ptr(fx.Int32, None, assumed_align=4),
        ptr(fx.Int32, None, assumed_align=4), ptr(fx.Int32, None, assumed_align=4),
        ptr(fx.Float32, None, assumed_align=16), ptr(fx.Int32, None, assumed_align=4),
        fx.Int32(1), fx.Int32(1), fx.Int32(1), fx.Int32(1), fx.Int32(1), fx.Int32(1),
        fx.Int64(1), fx.Int64(1), fx.Int32(1), fx.Int32(1), fx.Int32(1),
    )
