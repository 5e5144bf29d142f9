"""The per-token body of the gfx950 sparse decode kernels (SPEC §5.2, §5.5), and the steps the
union-tile body (union_tile.py: prefill, and decode with decode_query_len > 1) shares with it.

`sparse_decode.py`'s one-pass and split kernels compute a token's (req, vis, row_ok) (SPEC §5.3)
and call `attend()`, which does the rest for one (token, KV head) per workgroup of 4 waves. The
thread/tile mapping is documented in sparse_decode.py's docstring.
"""

from dataclasses import dataclass

import flydsl.expr as fx
from flydsl.expr import gpu, range_constexpr
from flydsl.expr.typing import T

from common import (
    BLOCK_SIZE, D_PER_QUAD, DATA_BYTES, GROUP_HEADS, HEAD_DIM, LOG2E, NEG_INF, SCALE_BYTES,
    SCALE_PLANE, TILE_BYTES, TOPK, WAVE, buffer_rsrc, dequant_dword, dequant_dword_f16, e4m3_pair,
    exp2_fast, lane_ids, load_dwords, load_u16, store_dwords, uniform,
)

NUM_WAVES = 4                                  # waves per workgroup
SLOTS_PER_WAVE = TOPK // NUM_WAVES             # 4 selected blocks per wave
KEY_TILES = BLOCK_SIZE // 16                   # 8 QK tiles of 16 keys per block
PV_STEPS = BLOCK_SIZE // 32                    # 4 PV steps of 32 keys per block
D_TILES = HEAD_DIM // 16                       # 8 output tiles of 16 head-dim rows
HALF = BLOCK_SIZE // 2                         # V is staged 64 keys at a time
VT_ROW_BYTES = HALF * 2 + 16                   # 64 16-bit values + 16 bytes padding (bank spread)
VT_BYTES = HEAD_DIM * VT_ROW_BYTES             # 18432 bytes of LDS per wave
LDS_BYTES = NUM_WAVES * VT_BYTES               # 73728 bytes per workgroup
# The merge reuses the staging LDS after a barrier: per wave O[16 heads][128 d] f32, then (m, l).
MERGE_O_BYTES = GROUP_HEADS * HEAD_DIM * 4     # 8192 per wave
MERGE_ML_OFF = NUM_WAVES * MERGE_O_BYTES       # 32768
THREADS = NUM_WAVES * WAVE
# V halves whose loads are issued with the block's K loads, before QK (more overlap, more VGPRs;
# 2 halves exceed 256 VGPRs and halve the occupancy).
PREFETCH_V_HALVES = 1

GROUPS = (16, 8)                               # G served: M3 at TP4 (16) and TP8 (8)
IO_DTYPES = {"bf16": fx.BFloat16, "f16": fx.Float16, "f32": fx.Float32}  # q / out dtypes
COMPUTE_DTYPES = {"bf16": fx.BFloat16, "f16": fx.Float16}


@dataclass
class Operands:
    """Pointers and sizes the attention body needs (all from the kernel's arguments)."""
    q: object
    kv_cache: object
    topk_indices: object
    block_table: object
    k_scale: object
    v_scale: object
    layer: object
    out: object
    num_tokens: object
    num_kv_heads: object
    num_requests: object
    max_blocks: object
    num_pages: object
    num_layers: object
    page_stride: object
    layer_stride: object
    scale: object


def read_common(ops: Operands):
    """What every attention workgroup reads first: whether the layer is in range and its byte base
    (SPEC §3.3, §7), the base-2 logit scale with k_scale folded in and v_scale (SPEC §5.5), and the
    block_table / topk_indices descriptors."""
    layer = fx.Int32(ops.layer.load())
    layer_ok = (layer >= 0) & (layer < ops.num_layers)
    layer_base = fx.Int64(layer_ok.select(layer, 0)) * ops.layer_stride
    qk_scale = ops.scale * fx.Float32(ops.k_scale.load()) * LOG2E
    v_scale = fx.Float32(ops.v_scale.load())
    table_rsrc = buffer_rsrc(ops.block_table, fx.Int64(ops.num_requests) * fx.Int64(ops.max_blocks) * 4)
    topk_rsrc = None if ops.topk_indices is None else \
        buffer_rsrc(ops.topk_indices, fx.Int64(ops.num_kv_heads) * fx.Int64(ops.num_tokens) * (TOPK * 4))
    return layer_ok, layer_base, qk_scale, v_scale, table_rsrc, topk_rsrc


def lds_ptr(base, byte_off, elem_ty, align):
    p = fx.add_offset(base, fx.make_int_tuple(byte_off))
    return fx.recast_iter(fx.PointerType.get(elem_ty.ir_type, fx.AddressSpace.Shared, align), p)


def lds_store(base, byte_off, vec, elem_ty, align):
    fx.ptr_store(vec, lds_ptr(base, byte_off, elem_ty, align))


def lds_load(base, byte_off, elem_ty, n, align):
    return fx.ptr_load(lds_ptr(base, byte_off, elem_ty, align), result_type=fx.Vector.make_type(n, elem_ty))


def mfma(compute, a, b, acc):
    """C += A·B with v_mfma_f32_16x16x32_bf16 or v_mfma_f32_16x16x32_f16."""
    op = fx.rocdl.mfma_f32_16x16x32_bf16 if compute is fx.BFloat16 else fx.rocdl.mfma_f32_16x16x32_f16
    return fx.Vector(op(T.f32x4, [a, b, acc, 0, 0, 0]))


def scale_pair(compute, scale_word):
    """The lane's two E4M3 block scales, as f32 (bf16 path) or as fp16 (f16 path), exactly."""
    sc = e4m3_pair(scale_word)
    if compute is fx.BFloat16:
        return [sc[0], sc[1]]
    return [sc[0].to(fx.Float16), sc[1].to(fx.Float16)]


def dequant(compute, word, scale):
    """8 NVFP4 values -> vector<8 x compute>, exactly (see common.dequant_dword*)."""
    if compute is fx.BFloat16:
        return dequant_dword(word, scale, fx.BFloat16)
    return dequant_dword_f16(word, scale)


def load_v_half(v_rsrc, hb, lane16, quad):
    """Raw NVFP4 words of V tokens 64·hb + 4·lane16 + u (u = 0..3), d = 32·quad .. +31: per token
    one 16-byte data load and the 2 scale bytes. Issued early so the loads overlap QK."""
    raw = []
    for u in range_constexpr(4):
        tok = 64 * hb + 4 * lane16 + u
        raw.append((load_dwords(v_rsrc, tok * DATA_BYTES + 16 * quad, 4),
                    load_u16(v_rsrc, SCALE_PLANE + tok * SCALE_BYTES + 2 * quad)))
    return raw


def stage_v_half(compute, lds_base, vt_base, raw, hb, lane16, quad, limit):
    """Dequantize the words of load_v_half into Vt[d][token] (d = 32·quad .. +31, token 4·lane16 + u
    of the half), as `compute`.

    Tokens that are not attended (block-local index >= limit) are zeroed as raw NVFP4 words
    (data and scale) before dequantization: a select, never a multiply (SPEC §5.2).
    """
    words = []
    scales = []
    for u in range_constexpr(4):
        attended = (64 * hb + 4 * lane16 + u) < limit
        data, sw = raw[u]
        words.append([attended.select(data[c], fx.Int32(0)) for c in range_constexpr(4)])
        scales.append(scale_pair(compute, attended.select(sw, fx.Int32(0))))
    for c in range_constexpr(4):
        vals = [dequant(compute, words[u][c], scales[u][c // 2]) for u in range_constexpr(4)]
        for i in range_constexpr(8):
            d = 32 * quad + 8 * c + i
            col = fx.Vector.from_elements([vals[u][i] for u in range_constexpr(4)], dtype=compute)
            lds_store(lds_base, vt_base + d * VT_ROW_BYTES + (4 * lane16) * 2, col, compute, 8)


def load_vec8(rsrc, byte_off, io, compute):
    """8 consecutive q values (16 bytes for bf16/f16, two 16-byte loads for f32) as vector<8 x compute>."""
    if io is fx.Float32:
        lo = load_dwords(rsrc, byte_off, 4).bitcast(fx.Float32)
        hi = load_dwords(rsrc, byte_off + 16, 4).bitcast(fx.Float32)
        return fx.Vector.from_elements([lo[i] for i in range(4)] + [hi[i] for i in range(4)],
                                       dtype=fx.Float32).to(compute)
    raw = load_dwords(rsrc, byte_off, 4).bitcast(io)
    return raw if io is compute else raw.to(fx.Float32).to(compute)


def store_values(rsrc, byte_off, vals, io):
    """Store a vector of fp32 results as io: their dwords in stores of at most 16 bytes (8 values
    are one store for bf16/f16, two for f32)."""
    bits = vals.bitcast(fx.Int32) if io is fx.Float32 else vals.to(io).bitcast(fx.Int32)
    if len(bits) <= 4:
        store_dwords(rsrc, byte_off, bits)
        return
    for k in range(0, len(bits), 4):
        store_dwords(rsrc, byte_off + 4 * k, fx.Vector.from_elements([bits[i] for i in range(k, k + 4)],
                                                                     dtype=fx.Int32))


# A split's partial result in the workspace (split decode): O[16 heads][128 d] f32 (not yet divided
# by l), then (m, l) per head. One record per (token, KV head, split).
PARTIAL_O_BYTES = GROUP_HEADS * HEAD_DIM * 4   # 8192
PARTIAL_BYTES = PARTIAL_O_BYTES + GROUP_HEADS * 8


def load_partial(ws, record, head, d0):
    """One thread's share of a workspace record at byte `record`: (m, l) of head `head` and
    O[head][d0 .. d0 + 7] (f32, two 16-byte loads)."""
    ml = load_dwords(ws, record + PARTIAL_O_BYTES + head * 8, 2).bitcast(fx.Float32)
    lo = load_dwords(ws, record + (head * HEAD_DIM + d0) * 4, 4).bitcast(fx.Float32)
    hi = load_dwords(ws, record + (head * HEAD_DIM + d0) * 4 + 16, 4).bitcast(fx.Float32)
    o = fx.Vector.from_elements([lo[i] for i in range(4)] + [hi[i] for i in range(4)], dtype=fx.Float32)
    return ml[0], ml[1], o


def owned_bytes(owns, num_bytes):
    """A descriptor size: num_bytes, or 0 (every store dropped) where `owns` is false; owns None = all."""
    return num_bytes if owns is None else owns.select(num_bytes, fx.Int64(0))


def lse_combine(ms, ls, os_):
    """Merge partial softmax states (m_u, l_u, O_u) (base 2): weights 2^(m_u - max m), where a part
    that attended nothing (m_u = -inf) weighs exactly 0. Returns (m, l, O)."""
    m_all = ms[0]
    for m_u in ms[1:]:
        m_all = fx.maxnumf(m_all, m_u)
    l_all = fx.Float32(0.0)
    o_all = fx.Vector.filled(8, 0.0, fx.Float32)
    for m_u, l_u, o_u in zip(ms, ls, os_):
        w_u = (m_u == NEG_INF).select(fx.Float32(0.0), exp2_fast(m_u - m_all))
        l_all = l_all + l_u * w_u
        o_all = o_all + o_u * fx.Vector.from_elements([w_u] * 8, dtype=fx.Float32)
    return m_all, l_all, o_all


def finish(o_all, l_all, v_scale):
    """O / l · v_scale; exact zeros where nothing was attended (l = 0, SPEC §5.5); an attended NaN
    keeps l NaN, so it stays visible in the output."""
    attended_any = l_all != 0.0
    inv = attended_any.select(v_scale / l_all, fx.Float32(0.0))      # v_scale in the epilogue
    o_all = o_all * fx.Vector.from_elements([inv] * 8, dtype=fx.Float32)
    return attended_any.select(o_all, fx.Vector.filled(8, 0.0, fx.Float32))


def attend(ops: Operands, compute, io, token, kv_head, req, vis, row_ok, lds_base,
           slots_per_wave=SLOTS_PER_WAVE, split=None, workspace=None, num_splits=1, group=GROUP_HEADS,
           first_block=None):
    """Attention of one token's 16 query heads of KV head `kv_head` over its selected blocks.

    req: the token's request (row of block_table); vis = pos + 1; row_ok: false for a padding
    token (every slot is then invalid and the output is exact zeros).
    Without `split`, the workgroup covers all 16 slots (4 per wave) and writes the output.
    With `split` (an Int32 in [0, num_splits)), it covers slots split·4·slots_per_wave + … and
    writes its partial (O, m, l) to `workspace` for sparse_decode's merge kernel.
    With `first_block` (an Int32; full_attention.py) the slots' block ids are first_block + k for
    slot k, not read from topk_indices (which may then be None): a part of a row's blocks as a
    sparse row that selected exactly them; with `split` it writes the part's record.
    group: G, the query heads per KV head (16, or 8 for M3 at TP8). The MFMA's 16 columns stay
    16 wide: with G = 8, lanes 8..15 of each quarter-wave repeat heads 0..7 (same scores, never
    stored), and the waves that hold no head < G write through a 0-byte descriptor (nothing).
    """
    tid = fx.Int32(fx.thread_idx.x)
    wave = uniform(tid // WAVE)
    lane, lane16, quad = lane_ids(tid)
    num_heads = ops.num_kv_heads * group
    vt_base = wave * VT_BYTES

    layer_ok, layer_base, qk_scale, v_scale, table_rsrc, topk_rsrc = read_common(ops)

    # ---- Q in registers: head g·16 + lane16, d = 32·quad + 8·c + i (four 16-byte loads) --------
    io_bytes = io.width // 8
    q_rsrc = buffer_rsrc(ops.q, fx.Int64(ops.num_tokens) * fx.Int64(num_heads) * (HEAD_DIM * io_bytes))
    q_row = ((token * num_heads + kv_head * group + lane16 % group) * HEAD_DIM + quad * D_PER_QUAD) * io_bytes
    q_ops = []
    for c in range_constexpr(4):
        q_ops.append(load_vec8(q_rsrc, q_row + 8 * io_bytes * c, io, compute))

    # ---- running state of this wave: max m and partial sum l of head lane16, O^T accumulators --
    m_run = fx.Float32(NEG_INF)
    l_run = fx.Float32(0.0)
    o_acc = [fx.Vector.filled(4, 0.0, fx.Float32) for _ in range_constexpr(D_TILES)]

    # ---- this wave's slots and their validity (SPEC §5.2), wave-uniform; all ids are loaded
    # first, then all block_table entries (two round trips for the wave, not two per slot) -------
    ids, id_ok, pages = [], [], []
    for j in range_constexpr(slots_per_wave):
        k_slot = wave * slots_per_wave + j
        if first_block is not None:
            ids.append(first_block + k_slot)
            continue
        if split is not None:
            k_slot = split * (NUM_WAVES * slots_per_wave) + k_slot
        ids.append(load_dwords(topk_rsrc, ((kv_head * ops.num_tokens + token) * TOPK + k_slot) * 4, 1))
    for j in range_constexpr(slots_per_wave):
        b = uniform(ids[j])
        b_ok = row_ok & layer_ok & (b >= 0) & (b < ops.max_blocks) & (b * BLOCK_SIZE < vis)
        ids[j] = b
        id_ok.append(b_ok)
        pages.append(load_dwords(table_rsrc, b_ok.select(req * ops.max_blocks + b, 0) * 4, 1))

    for j in range_constexpr(slots_per_wave):
        b = ids[j]
        page = uniform(pages[j])
        valid = id_ok[j] & (page >= 0) & (page < ops.num_pages)
        # 64-bit page offset (SPEC §3.3); an invalid slot gets 0-byte descriptors: reads nothing
        page_base = layer_base + fx.Int64(valid.select(page, 0)) * ops.page_stride
        tile_bytes = valid.select(fx.Int32(TILE_BYTES), fx.Int32(0))
        k_rsrc = buffer_rsrc(ops.kv_cache + (page_base + fx.Int64(kv_head * 2) * TILE_BYTES), tile_bytes)
        v_rsrc = buffer_rsrc(ops.kv_cache + (page_base + fx.Int64(kv_head * 2 + 1) * TILE_BYTES), tile_bytes)
        # block-local keys o >= limit are not attended (128·b + o >= vis, or the slot is invalid)
        limit = valid.select(vis - b * BLOCK_SIZE, 0)

        # ---- S^T = K · Q^T, 8 tiles of 16 keys; select-mask to -inf (SPEC §5.2) --------------------
        # all of the block's K loads first (one round trip, not eight), then V's, overlapping QK
        k_raw = []
        for jt in range_constexpr(KEY_TILES):
            key = 16 * jt + lane16
            k_raw.append((load_dwords(k_rsrc, key * DATA_BYTES + 16 * quad, 4),
                          load_u16(k_rsrc, SCALE_PLANE + key * SCALE_BYTES + 2 * quad)))
        v_raw = [load_v_half(v_rsrc, hb, lane16, quad) for hb in range_constexpr(PREFETCH_V_HALVES)]
        scores = []
        m_blk = fx.Float32(NEG_INF)
        for jt in range_constexpr(KEY_TILES):
            data, sw = k_raw[jt]
            sc = scale_pair(compute, sw)
            acc = fx.Vector.filled(4, 0.0, fx.Float32)
            for c in range_constexpr(4):
                acc = mfma(compute, dequant(compute, data[c], sc[c // 2]), q_ops[c], acc)
            z = []
            for i in range_constexpr(4):
                attended = (16 * jt + 4 * quad + i) < limit
                zi = attended.select(acc[i] * qk_scale, fx.Float32(NEG_INF))
                m_blk = fx.maxnumf(m_blk, zi)
                z.append(zi)
            scores.append(z)
        m_blk = fx.maxnumf(m_blk, m_blk.shuffle_xor(16, WAVE))
        m_blk = fx.maxnumf(m_blk, m_blk.shuffle_xor(32, WAVE))

        # ---- online softmax update, base 2, fp32 (SPEC §5.5) ---------------------------------------
        m_new = fx.maxnumf(m_run, m_blk)
        m_safe = (m_new == NEG_INF).select(fx.Float32(0.0), m_new)    # no -inf - -inf
        alpha = exp2_fast(m_run - m_safe)
        p_ops = []
        l_blk = fx.Float32(0.0)
        for st in range_constexpr(PV_STEPS):
            vals = []
            for half_tile in range_constexpr(2):
                for i in range_constexpr(4):
                    p = exp2_fast(scores[2 * st + half_tile][i] - m_safe)
                    l_blk = l_blk + p
                    vals.append(p)
            p_ops.append(fx.Vector.from_elements(vals, dtype=fx.Float32).to(compute))
        l_run = l_run * alpha + l_blk
        m_run = m_new
        alpha4 = fx.Vector.from_elements([alpha] * 4, dtype=fx.Float32)
        for dt in range_constexpr(D_TILES):
            o_acc[dt] = o_acc[dt] * alpha4

        # ---- O^T += V^T · P^T, V staged through this wave's LDS 64 keys at a time --------------------
        # (the second half's loads are issued right after the first half is staged, so they overlap
        # the first half's PV)
        for hb in range_constexpr(2):
            fx.rocdl.wave_barrier()
            stage_v_half(compute, lds_base, vt_base, v_raw[hb], hb, lane16, quad, limit)
            fx.rocdl.wave_barrier()
            if hb + 1 < 2 and hb + 1 >= PREFETCH_V_HALVES:
                v_raw.append(load_v_half(v_rsrc, hb + 1, lane16, quad))
            for s in range_constexpr(2):
                for dt in range_constexpr(D_TILES):
                    row = vt_base + (16 * dt + lane16) * VT_ROW_BYTES
                    lo = lds_load(lds_base, row + (32 * s + 4 * quad) * 2, compute, 4, 8)
                    hi = lds_load(lds_base, row + (32 * s + 16 + 4 * quad) * 2, compute, 4, 8)
                    v_op = fx.Vector.from_elements([lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]],
                                                   dtype=compute)
                    o_acc[dt] = mfma(compute, v_op, p_ops[2 * hb + s], o_acc[dt])

    # ---- merge the 4 waves' (m, l, O) through LDS (LSE merge) and write the output ----------------
    l_run = l_run + l_run.shuffle_xor(16, WAVE)
    l_run = l_run + l_run.shuffle_xor(32, WAVE)
    gpu.barrier()
    for dt in range_constexpr(D_TILES):
        off = wave * MERGE_O_BYTES + (lane16 * HEAD_DIM + 16 * dt + 4 * quad) * 4
        lds_store(lds_base, off, o_acc[dt], fx.Float32, 16)
    # m and l are already reduced over the 4 quads: the 4 lanes of a head store the same pair
    ml = fx.Vector.from_elements([m_run, l_run], dtype=fx.Float32)
    lds_store(lds_base, MERGE_ML_OFF + (wave * GROUP_HEADS + lane16) * 8, ml, fx.Float32, 8)
    gpu.barrier()

    # wave w writes heads 4·w + quad, d = 8·lane16 .. +7 (one 16-byte store per lane); with G < 16
    # the waves past head G - 1 store through 0-byte descriptors, i.e. not at all
    head = wave * 4 + quad
    owns = (wave * 4 < group) if group < GROUP_HEADS else None
    d0 = lane16 * 8
    stats = [lds_load(lds_base, MERGE_ML_OFF + (u * GROUP_HEADS + head) * 8, fx.Float32, 2, 8)
             for u in range_constexpr(NUM_WAVES)]
    parts = [lds_load(lds_base, u * MERGE_O_BYTES + (head * HEAD_DIM + d0) * 4, fx.Float32, 8, 16)
             for u in range_constexpr(NUM_WAVES)]
    m_all, l_all, o_all = lse_combine([st[0] for st in stats], [st[1] for st in stats], parts)
    if split is None:
        out_bytes = fx.Int64(ops.num_tokens) * fx.Int64(num_heads) * (HEAD_DIM * io_bytes)
        out_rsrc = buffer_rsrc(ops.out, owned_bytes(owns, out_bytes))
        out_off = ((token * num_heads + kv_head * group + head) * HEAD_DIM + d0) * io_bytes
        store_values(out_rsrc, out_off, finish(o_all, l_all, v_scale), io)
    else:
        ws_bytes = fx.Int64(ops.num_tokens) * fx.Int64(ops.num_kv_heads) * fx.Int64(num_splits) * PARTIAL_BYTES
        ws_rsrc = buffer_rsrc(workspace, owned_bytes(owns, ws_bytes))
        record = ((token * ops.num_kv_heads + kv_head) * num_splits + split) * PARTIAL_BYTES
        store_values(ws_rsrc, record + (head * HEAD_DIM + d0) * 4, o_all, fx.Float32)
        # the 16 lanes of a head store the same (m, l) pair
        ml = fx.Vector.from_elements([m_all, l_all], dtype=fx.Float32).bitcast(fx.Int32)
        store_dwords(ws_rsrc, record + PARTIAL_O_BYTES + head * 8, ml)


def shared_storage():
    @fx.struct
    class SharedStorage:
        buf: fx.Array[fx.Int32, LDS_BYTES // 4, 16]

    return SharedStorage
