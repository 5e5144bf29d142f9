"""grouped_matmul for gfx950 (SPEC §9), compiled as `grouped_matmul_<w>_<o>`.

Compiled variants: weights <w> in {bf16, mxfp8, mxfp4, nvfp4} × output <o> in {f32, bf16}; the
rows (lhs) are bf16 (an MXFP8 lhs, SPEC §9.2, lowers to the reference on rocm). Never run on
hardware: compiled ahead of time and executed on the ISA emulator in CI (tests/rocm).
Launcher arguments, in order (ffi/rocm/handlers.cc passes them):

    lhs          bf16 [T, K]  (the rows; with gather, any T rows read through lhs_rows)
    rhs          bf16 | e4m3 [G, N, K], or uint8 [G, N, K/2] (two E2M1 codes a byte, low first)
    rhs_scale    uint8 [G, N, K/32] (E8M0: MXFP8, MXFP4) | e4m3 [G, N, K/16] (NVFP4) | unused
    group_sizes  int32 [G];  lhs_rows  int32 [M] (gather) or unused
    row_scale    float32 [M] or unused;  group_scale  float32 [G] or unused
    out          float32 | bf16 [M, N] ([M, N/2] with an activation)
    M, T, K, N, G, gather, activation (0 none, 1 swiglu, 2 swiglu_oai), has_row_scale,
    has_group_scale (int32), alpha, limit (float32), col_groups, slots, kparts (int32), stream.

Grid (ceil(out_cols / columns per workgroup), ceil(M / 16) + G + 1), 4 waves a workgroup. The
launcher's `kparts` (1 or KPARTS, chosen by the host from K alone: KPARTS when K has at least
SPLIT_MIN_STEPS k-steps) says how the 4 waves share the work: kparts 1, each wave its own 64
weight rows over all of K (256 a workgroup); kparts 4, the 4 waves the same 64 weight rows, wave
p the p-th quarter of the k-steps (⌈steps / 4⌉ each, the last one fewer), their sums added by
wave 0 through LDS as ((part 0 + part 1) + part 2) + part 3. Why: at decode sizes a long-K
product (M3's gate_up, K 6144, 768 rows: 3 workgroups a routed expert) has far fewer workgroups
than the GPU has CUs; splitting K gives 4× as many, each streaming a quarter of the bytes. The
order of the sum depends on K only, never on M or the groups (SPEC §9 item 3). The y
index is a *tile slot*: group g's rows [start_g, end_g) (sizes clipped to [0, M], the running end
clipped to M: SPEC §9 item 1) are cut into tiles of 16 rows, the groups' tiles numbered in group
order, then the rows no group covers ([end_{G-1}, M), written as zeros). A workgroup finds its
tile from group_sizes itself (find_tile: 64 groups' sizes per load, their ends and tile counts
scanned across the wave; no scratch, no second kernel); slots past the last tile return at
once. So each routed group's weights are read once per 16 of its rows, an empty group's never,
and the work is the routed rows' only.

Each wave owns 4 tiles of 16 weight rows (no activation: output columns c0 .. c0 + 63; with an
activation: the gate rows c0 .. c0 + 31 and the up rows N/2 + c0 .. +31, so a lane holds the
gate and up values of the same output column). Per 32 k, v_mfma_f32_16x16x32_bf16 with A = 16
weight rows (lane: row lane16, k = 8·quad .. +7, widened to bf16 exactly as SPEC §9.1 / §9.3
say: bf16 as stored; fp8 · 2^(e−127) and e2m1 · 2^(e−127) through two normal fp32 factors, below
2^-126 → ±0, e = 255 → NaN; e2m1 · e4m3 exact) and B = the tile's 16 rows (lane: row lane16,
the same k; a row past the tile or a gathered id outside [0, T) reads zeros). C gives each lane
4 consecutive output columns of one row, summed in fp32 over K in a fixed order — kparts 1: the
32-k steps in k order; kparts 4: each wave its quarter's steps in k order, then the quarters
added in part order — which depends on K alone: a row's result depends only on its row, its
group's weights and its scales. A wave's loop takes 4 k-steps at a time and issues all their
loads (20 of 16 bytes a lane for bf16, plus the scale bytes) before their 16 MFMAs, a
scheduling barrier keeping them there: a wave then has its next 4 steps' operands in flight at
once, not one load at a time (what LLVM's scheduler made of the plain loop, trading
memory-level parallelism for registers). The wave's steps mod 4 follow one at a time.

Epilogue (SPEC §9 item 6), in fp32 in the lane: × group_scale[g], the activation (the reference's
formulas; NaN kept), × row_scale[row], rounded to nearest even for bf16 output. Every load and
store goes through a buffer descriptor sized to its array (per-group descriptors for the
weights and their scales), so ids out of range read zeros and stores past a tile are dropped.
"""

import functools

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import gpu, range_constexpr
from flydsl.expr.typing import T

from attention_core import lds_load, lds_store
from common import (LOG2E, WAVE, buffer_rsrc, e2m1_pair_f32, exp2_fast, load_dwords, load_u8, store_dwords,
                    uniform, wave_max_i32)
from select_blocks import dyn_while, e4m3_quad
from union_tile import dyn_for, when

TILE_ROWS = 16                  # rows of lhs per tile (the MFMA's 16 columns)
WAVES = 4
STEP_K = 32                     # k per MFMA
UNROLL = 4                      # k-steps whose loads are issued together (memory-level parallelism)
KPARTS = 4                      # k-parts of a split workgroup (one a wave)
SPLIT_MIN_STEPS = 32            # K / 32 from which the host splits K (kparts = KPARTS)
PART_BYTES = WAVE * 4 * 16      # one wave's 4 accumulators of 4 fp32 a lane, in LDS
assert KPARTS == WAVES, "a split workgroup is one k-part per wave (the host passes kparts = its waves)"
FP32_NORMAL_MIN = 2.0 ** -126
OFF = 0x7FFFFFF0                # a byte offset past every descriptor: loads give 0, stores drop

WEIGHTS = ("bf16", "mxfp8", "mxfp4", "nvfp4")
OUTS = {"f32": fx.Float32, "bf16": fx.BFloat16}
# bytes of one weight row per k (numerator, denominator) and k per scale
ROW_BYTES = {"bf16": (2, 1), "mxfp8": (1, 1), "mxfp4": (1, 2), "nvfp4": (1, 2)}
SCALE_K = {"bf16": 0, "mxfp8": 32, "mxfp4": 32, "nvfp4": 16}


def e8m0_factors(e):
    """2^(e − 127) as two normal fp32 factors (jax_m3sparse.mxfp8._exponent_factors): (2^-64, 2^-63)
    for e = 0, (NaN, 1) for e = 255, else (2^(e − 127), 1)."""
    hi = (e << 23).bitcast(fx.Float32)
    hi = (e == 0).select(fx.Float32(2.0 ** -64), hi)
    hi = (e == 255).select(fx.Float32(float("nan")), hi)
    lo = (e == 0).select(fx.Float32(2.0 ** -63), fx.Float32(1.0))
    return hi, lo


def e8m0_scaled(vals, e):
    """vals (exact fp32) · 2^(e − 127), products below 2^-126 → ±0 (SPEC §9.1)."""
    hi, lo = e8m0_factors(e)
    out = []
    for v in vals:
        x = fx.Float32((v * hi) * lo)
        tiny = (x.bitcast(fx.Int32) & fx.Int32(0x7FFFFFFF)) < fx.Int32(0x00800000)
        out.append(tiny.select((x.bitcast(fx.Int32) & fx.Int32(-2147483648)).bitcast(fx.Float32), x))
    return out


def e2m1_eight(word):
    """The eight E2M1 codes of a dword (element 2i in the low nibble of byte i), exact fp32."""
    vals = []
    for sel in range(4):
        pair = e2m1_pair_f32(word, sel)
        vals += [pair[0], pair[1]]
    return vals


def weight_load(w, rsrc, srsrc, n, k, K):
    """The stored bytes of weight row n, k .. k + 7 (k a multiple of 8): (data dwords, scale
    byte or None) — loads only, so a step's loads can all be issued before its MFMAs."""
    if w == "bf16":
        return load_dwords(rsrc, (n * K + k) * 2, 4), None
    if w == "mxfp8":
        return load_dwords(rsrc, n * K + k, 2), load_u8(srsrc, n * (K // 32) + k // 32)
    data = load_dwords(rsrc, n * (K // 2) + k // 2, 1)
    if w == "mxfp4":
        return data, load_u8(srsrc, n * (K // 32) + k // 32)
    return data, load_u8(srsrc, n * (K // 16) + k // 16)    # nvfp4: one E4M3 scale per 16 k


def weight_operand(w, loaded):
    """weight_load's bytes as vector<8 x bf16>, exactly SPEC §9.1 / §9.3's values (every one is
    exact in bf16; the final conversion rounds nothing)."""
    data, scale = loaded
    if w == "bf16":
        return data.bitcast(fx.BFloat16)
    if w == "mxfp8":
        vals = e8m0_scaled(e4m3_quad(data[0]) + e4m3_quad(data[1]), scale)
    elif w == "mxfp4":
        vals = e8m0_scaled(e2m1_eight(data), scale)
    else:   # nvfp4: an exact fp32 product with the E4M3 scale
        sc = fx.Vector(fx.rocdl.cvt_pk_f32_fp8(T.vec(2, T.f32), scale.ir_value(), False))[0]
        vals = [fx.Float32(v * sc) for v in e2m1_eight(data)]
    return fx.Vector.from_elements(vals, dtype=fx.Float32).to(fx.BFloat16)


def sigmoid(x):
    """1 / (1 + 2^(−x·log2 e)), fp32 (v_exp_f32)."""
    return fx.Float32(1.0) / (fx.Float32(1.0) + exp2_fast(x * fx.Float32(-LOG2E)))


def activate(gate, up, activation, alpha, limit):
    """SPEC §9 item 6 (jax_m3sparse.reference.swiglu): 1 swiglu silu(gate)·up; 2 swiglu_oai
    (clip(up, ±limit) + 1)·g·sigmoid(alpha·g), g = min(gate, limit), NaN kept (selects)."""
    silu = fx.Float32(gate * sigmoid(gate) * up)
    neg = fx.Float32(0.0) - limit
    g = (gate > limit).select(limit, gate)
    u = (up > limit).select(limit, up)
    u = (u < neg).select(neg, u)
    oai = fx.Float32((u + fx.Float32(1.0)) * g * sigmoid(g * alpha))
    return (activation == 1).select(silu, oai)


def wave_scan(x, lane, add):
    """Butterfly scan of `add` (associative, commutative) over the wave: (the sum of the lower
    lanes' x, the sum of every lane's x), both with 0 as the empty sum."""
    below, total = fx.Int32(0), x
    for k in (1, 2, 4, 8, 16, 32):
        other = fx.Int32(total.shuffle_xor(k, WAVE))
        upper = (lane & k) != 0                       # the partner's block precedes this lane's
        below = upper.select(add(other, below), below)
        total = add(total, other)
    return below, total


def find_tile(slot, sizes_rsrc, G, M, lane):
    """The 16-row tile of tile slot `slot`: (hit, group, first row, end of the group's rows), or,
    past every group's tiles, (False, G, a row of [end of the last group, M) in steps of 16, M).
    SPEC §9 item 1: sizes read as max(size, 0), the running end clipped to M, so group g ends at
    min(Σ_{h≤g} size_h, M). A wave reads 64 groups' sizes at once (lane l: group 64·c + l; loads
    past G read 0) and scans their ends and tile counts with shuffles — a chunk per memory
    latency, not a group per memory latency as a scalar walk would."""
    def sat(a, b):            # min(a + b, M) for a, b in [0, M], without int32 overflow
        room = M - a
        return a + (b < room).select(b, room)

    def chunk(st):
        c, end0, tiles0 = fx.Int32(st["c"]), fx.Int32(st["end"]), fx.Int32(st["tiles"])
        g = c * WAVE + lane
        size = load_dwords(sizes_rsrc, g * 4, 1)
        size = (size > 0).select(size, 0)
        size = (size < M).select(size, M)
        below, total = wave_scan(size, lane, sat)
        first = sat(end0, below)                      # the group's rows: [first, last)
        last = sat(first, size)
        tiles = (last - first + (TILE_ROWS - 1)) // TILE_ROWS
        t_below, t_total = wave_scan(tiles, lane, lambda a, b: a + b)
        before = tiles0 + t_below
        mine = (slot >= before) & (slot < before + tiles)   # one lane at most (tile ranges are disjoint)
        row = first + (slot - before) * TILE_ROWS
        hit_g = wave_max_i32(mine.select(g, -1))
        return {"c": c + 1, "end": uniform(sat(end0, total)), "tiles": uniform(tiles0 + t_total),
                "g": hit_g, "row": wave_max_i32(mine.select(row, -1)),
                "last": wave_max_i32(mine.select(last, -1))}

    chunks = (G + (WAVE - 1)) // WAVE
    st = dyn_while(lambda st: (fx.Int32(st["c"]) < chunks) & (fx.Int32(st["g"]) < 0),
                   {"c": fx.Int32(0), "end": fx.Int32(0), "tiles": fx.Int32(0), "g": fx.Int32(-1),
                    "row": fx.Int32(0), "last": fx.Int32(0)}, chunk)
    hit = fx.Int32(st["g"]) >= 0
    past = fx.Int32(st["end"]) + (slot - fx.Int32(st["tiles"])) * TILE_ROWS
    return (hit, hit.select(fx.Int32(st["g"]), G), hit.select(fx.Int32(st["row"]), past),
            hit.select(fx.Int32(st["last"]), M))


def shared_storage():
    @fx.struct
    class SharedStorage:
        parts: fx.Array[fx.Int32, (KPARTS - 1) * PART_BYTES // 4, 16]

    return SharedStorage


@functools.lru_cache(maxsize=None)
def compile_grouped_matmul(weights: str = "bf16", out: str = "f32"):
    """Launcher for weight format `weights` (WEIGHTS) and output dtype `out` ("f32", "bf16")."""
    if weights not in WEIGHTS or out not in OUTS:
        raise ValueError(f"grouped_matmul: no variant weights={weights!r}, out={out!r}")
    num, den = ROW_BYTES[weights]
    out_bytes = 4 if out == "f32" else 2
    sk = SCALE_K[weights]
    SharedStorage = shared_storage()

    @flyc.kernel(known_block_size=(WAVE * WAVES, 1, 1))
    def grouped_matmul_tiles(
        lhs: fx.Pointer, rhs: fx.Pointer, rhs_scale: fx.Pointer, group_sizes: fx.Pointer,
        lhs_rows: fx.Pointer, row_scale: fx.Pointer, group_scale: fx.Pointer, out_ptr: fx.Pointer,
        M: fx.Int32, T_rows: fx.Int32, K: fx.Int32, N: fx.Int32, G: fx.Int32, gather: fx.Int32,
        activation: fx.Int32, has_row_scale: fx.Int32, has_group_scale: fx.Int32,
        alpha: fx.Float32, limit: fx.Float32, kparts: fx.Int32,
    ):
        slot = fx.Int32(fx.block_idx.y)
        tid = fx.Int32(fx.thread_idx.x)
        wave = uniform(tid // WAVE)
        lane = tid % WAVE
        part = wave % kparts                      # this wave's share of the k-steps
        lds = fx.SharedAllocator().allocate(SharedStorage).peek()
        lds_base = fx.recast_iter(fx.Uint8, lds.parts.ptr)
        lane16, quad = lane % 16, lane // 16
        act = activation != 0
        out_cols = act.select(N // 2, N)
        sizes_rsrc = buffer_rsrc(group_sizes, fx.Int64(G) * 4)

        hit, g, start, stop = find_tile(slot, sizes_rsrc, G, M, lane)
        live = hit | (start < M)

        def tile():
            col0 = (fx.Int32(fx.block_idx.x) * (WAVES // kparts) + wave // kparts) * 64   # no activation
            col0 = act.select(col0 // 2, col0)                             # 32 output columns a wave
            bases = [act.select(col0 + 16 * (j % 2) + (j // 2) * (N // 2), col0 + 16 * j) for j in range(4)]
            gg = hit.select(g, 0)
            row_bytes = fx.Int64(K) * num // den
            rsrc = buffer_rsrc(rhs + fx.Int64(gg) * fx.Int64(N) * row_bytes,
                               hit.select(fx.Int64(N) * row_bytes, fx.Int64(0)))
            srsrc = (buffer_rsrc(rhs_scale + fx.Int64(gg) * fx.Int64(N) * fx.Int64(K // sk),
                                 hit.select(fx.Int64(N) * fx.Int64(K // sk), fx.Int64(0))) if sk else rsrc)
            # this lane's row of the tile (the B operand's column lane16)
            row = start + lane16
            in_tile = row < stop
            rows_rsrc = buffer_rsrc(lhs_rows, (gather != 0).select(fx.Int64(M) * 4, fx.Int64(0)))
            src = (gather != 0).select(load_dwords(rows_rsrc, row * 4, 1), row)
            ok = in_tile & (src >= 0) & (src < T_rows)
            lhs_rsrc = buffer_rsrc(lhs, fx.Int64(T_rows) * fx.Int64(K) * 2)
            lhs_base = ok.select(src * K * 2, fx.Int32(OFF))
            zero = fx.Vector.from_elements([fx.Float32(0.0)] * 4, dtype=fx.Float32)

            def steps_from(s0, count, st):
                """k-steps s0 .. s0 + count − 1: every load first (count × 5 in flight per lane,
                instead of one load, its wait, its MFMA at a time), then the MFMAs in k order."""
                loaded = []
                for u in range_constexpr(count):
                    k = (s0 + u) * STEP_K + 8 * quad
                    b = load_dwords(lhs_rsrc, ok.select(lhs_base + k * 2, fx.Int32(OFF)), 4)
                    loaded.append((b, [weight_load(weights, rsrc, srsrc, bases[j] + lane16, k, K)
                                       for j in range(4)]))
                fx.rocdl.sched_barrier(0)   # else the scheduler sinks loads to spare registers
                accs = dict(st)
                for u in range_constexpr(count):
                    b, ws = loaded[u]
                    for j in range_constexpr(4):
                        accs[f"a{j}"] = fx.Vector(fx.rocdl.mfma_f32_16x16x32_bf16(
                            T.f32x4, [weight_operand(weights, ws[j]), b.bitcast(fx.BFloat16),
                                      fx.Vector(accs[f"a{j}"]), 0, 0, 0]))
                return accs

            all_steps = K // STEP_K
            share = (all_steps + kparts - 1) // kparts
            first = part * share
            stop_step = hit.select(first + share, first)
            stop_step = (stop_step < all_steps).select(stop_step, all_steps)
            steps = (stop_step > first).select(stop_step - first, 0)
            groups = steps // UNROLL
            acc = dyn_for(0, groups, {f"a{j}": zero for j in range(4)},
                          lambda i, st: steps_from(first + i * UNROLL, UNROLL, st))
            acc = dyn_for(first + groups * UNROLL, first + steps, acc, lambda s, st: steps_from(s, 1, st))
            acc = join_parts(acc)
            gs = ((has_group_scale != 0) & hit).select(
                load_dwords(buffer_rsrc(group_scale, (has_group_scale != 0).select(fx.Int64(G) * 4, fx.Int64(0))),
                            gg * 4, 1).bitcast(fx.Float32),
                fx.Float32(1.0))
            rs = (has_row_scale != 0).select(
                load_dwords(buffer_rsrc(row_scale, (has_row_scale != 0).select(fx.Int64(M) * 4, fx.Int64(0))),
                            row * 4, 1).bitcast(fx.Float32),
                fx.Float32(1.0))
            out_rsrc = buffer_rsrc(out_ptr, fx.Int64(M) * fx.Int64(out_cols) * out_bytes)

            def epilogue():
                for j in range_constexpr(4):
                    a = fx.Vector(acc[f"a{j}"])
                    u = fx.Vector(acc[f"a{j + 2}"]) if j < 2 else a
                    vals = []
                    for i in range_constexpr(4):
                        plain = fx.Float32(a[i] * gs)
                        joined = activate(plain, fx.Float32(u[i] * gs), activation, alpha, limit)
                        v = (act.select(joined, plain) * rs) if j < 2 else plain * rs
                        vals.append(hit.select(fx.Float32(v), fx.Float32(0.0)))
                    col = act.select(col0 + 16 * j, bases[j]) + 4 * quad
                    keep = in_tile & (col < out_cols)
                    if j >= 2:          # the up tiles of an activation are not outputs
                        keep = keep & ~act
                    off = keep.select((row * out_cols + col) * out_bytes, fx.Int32(OFF))
                    v4 = fx.Vector.from_elements(vals, dtype=fx.Float32)
                    bits = v4.bitcast(fx.Int32) if out == "f32" else v4.to(fx.BFloat16).bitcast(fx.Int32)
                    store_dwords(out_rsrc, off, bits)

            when(part == 0, epilogue)       # kparts 1: every wave; else wave 0, the parts joined

        def join_parts(acc):
            """kparts > 1: waves 1 .. kparts − 1 park their sums in LDS; after the barrier wave 0
            adds them to its own in part order. kparts 1: nothing (no LDS access, no barrier)."""
            def park():
                for j in range_constexpr(4):
                    lds_store(lds_base, (part - 1) * PART_BYTES + (j * WAVE + lane) * 16,
                              fx.Vector(acc[f"a{j}"]), fx.Float32, 16)

            def add_part(p, st):
                out = {}
                for j in range_constexpr(4):
                    other = fx.Vector(lds_load(lds_base, (p - 1) * PART_BYTES + (j * WAVE + lane) * 16,
                                               fx.Float32, 4, 16))
                    mine = fx.Vector(st[f"a{j}"])
                    out[f"a{j}"] = fx.Vector.from_elements([fx.Float32(mine[i] + other[i]) for i in range(4)],
                                                           dtype=fx.Float32)
                return out

            split = kparts > 1
            when(split & (part != 0), park)
            when(split, gpu.barrier)
            return dyn_for(1, (part == 0).select(kparts, 1), acc, add_part)

        when(live, tile)

    @flyc.jit
    def launch(
        lhs: fx.Pointer, rhs: fx.Pointer, rhs_scale: fx.Pointer, group_sizes: fx.Pointer, lhs_rows: fx.Pointer,
        row_scale: fx.Pointer, group_scale: fx.Pointer, out_ptr: fx.Pointer,
        M: fx.Int32, T_rows: fx.Int32, K: fx.Int32, N: fx.Int32, G: fx.Int32, gather: fx.Int32,
        activation: fx.Int32, has_row_scale: fx.Int32, has_group_scale: fx.Int32,
        alpha: fx.Float32, limit: fx.Float32, col_groups: fx.Int32, slots: fx.Int32, kparts: fx.Int32,
        stream: fx.Stream = fx.Stream(None),
    ):
        grouped_matmul_tiles(
            lhs, rhs, rhs_scale, group_sizes, lhs_rows, row_scale, group_scale, out_ptr,
            M, T_rows, K, N, G, gather, activation, has_row_scale, has_group_scale, alpha, limit, kparts,
        ).launch(grid=(col_groups, slots, 1), block=(WAVE * WAVES, 1, 1), stream=stream)

    return launch


def placeholders(weights: str = "bf16", out: str = "f32"):
    """Arguments for flyc.compile without a GPU (null pointers, dummy scalars)."""
    ptr = flyc.from_c_void_p
    return (
        ptr(fx.BFloat16, None, assumed_align=16), ptr(fx.Uint8, None, assumed_align=16),
        ptr(fx.Uint8, None, assumed_align=4), ptr(fx.Int32, None, assumed_align=4),
        ptr(fx.Int32, None, assumed_align=4), ptr(fx.Float32, None, assumed_align=4),
        ptr(fx.Float32, None, assumed_align=4), ptr(OUTS[out], None, assumed_align=16),
        *(fx.Int32(1) for _ in range(9)), fx.Float32(1.702), fx.Float32(7.0), fx.Int32(1), fx.Int32(1),
        fx.Int32(1),
    )
