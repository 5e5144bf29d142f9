"""Union-tile sparse attention for gfx950: consecutive query rows share each selected block
(SPEC §5.2, §5.5; serves sparse_prefill and sparse_decode with decode_query_len > 1).

Why: neighbouring tokens of a request select mostly the same blocks. The per-token kernel
(attention_core.attend) reads a token's 16 blocks for that token alone, so a prefill chunk reads
K/V about 16 × (tokens per block selected by neighbours) times over. Here one workgroup takes a
*tile* of consecutive rows (16 for G = 16, 32 for G = 8: `tile_rows`) and one KV head, forms the
sorted union of the rows' selected blocks, and loads and dequantizes each union block once.

Workgroup: 8 waves (512 threads). A wave has 2 MFMA column groups of 16 columns; a column group
holds one row's 16 heads (G = 16) or two rows' 8 heads (G = 8: row j in columns 8j .. 8j+7), so a
wave owns 2 or 4 consecutive rows: their Q (staged in LDS as each lane's B operands) and their
online-softmax state (m, l and O^T accumulators per column), with attention_core.attend's lane
mapping otherwise.

1. Union (one thread per (row τ, slot k): 256 or 512): the slot's key is req·M + b when the slot
   is valid (SPEC §5.2: 0 <= b < M, 128·b < vis, layer in range, 0 <= block_table[req, b] < P),
   else a sentinel. A thread whose key has no equal at a lower index is the key's first
   occurrence; its rank among the first occurrences (the number of smaller distinct keys) is the
   key's place in the sorted union. Keys of one request sort by block id, so every row meets its
   own blocks in increasing block order whatever the other rows of its tile selected: a row's
   result does not depend on its tile-mates (batch invariance). The union holds at most one entry
   per candidate, all of which fit in LDS, so no tile ever falls back. Per entry the union keeps b
   and the largest block-local limit any selecting row has (keys at or past it are attended by no row).
2. Per union entry: all 512 threads load the page's K and V tiles once (K: thread t reads token
   t/4's 16 data bytes and 2 scale bytes; V: 4 tokens × one data dword and its scale byte) and
   write them dequantized to LDS, K as rows [key][d] and V transposed as Vt[d][key]. V words of
   keys at or past the entry's limit are zeroed as raw NVFP4 words (garbage never reaches PV).
3. Each wave finds how often each of its rows selected the entry (a ballot of the rows' slot keys
   against the entry's key: a duplicate id counts once per occurrence, SPEC §5.1, applied as a
   weight on P and l). A wave whose rows did not select the entry skips it (no MFMA). Otherwise,
   per part of the block (64 keys, or 32 for G = 8): S^T = K·Q^T for both column groups from the
   same K operands (select-masked to -inf past each column's row's causal limit, or wholly where
   that row did not select the entry), the online softmax update, and O^T += V^T·P^T. When every
   row of the wave attends all staged keys, one V^T operand serves both column groups; otherwise
   (the diagonal block, or a row that did not select the entry) V^T, the MFMA's A operand shared by
   all 16 columns, is masked by a select of raw bits for one row at a time and only that row's
   columns keep the result (keys past a row's limit may hold another row's data; 0·NaN must not
   reach the row, SPEC §5.2). Both forms give a row the same bits.
4. Each wave writes its rows (exact zeros where nothing was attended).

Products in the caller's compute dtype (bf16 for decode, fp16 for prefill, SPEC §5.5); NVFP4 ->
compute exactly as attention_core (unit-scale conversion, exact E4M3 multiply).

LDS: K 128 × 272 B + Vt 128 × 272 B + the union's tables (6 KiB, G = 8: 12 KiB) + Q 64 KiB = 138 KiB
(144 KiB): one workgroup per CU, 2 waves per SIMD, which is what 256 VGPRs allow anyway.
"""

from __future__ import annotations

import flydsl.expr as fx
from flydsl._mlir.dialects import arith as _arith
from flydsl.compiler.ast_rewriter import InsertEmptyYieldForSCFFor, ReplaceIfWithDispatch
from flydsl.expr import gpu, range_constexpr
from flydsl.expr.typing import T

from attention_core import (
    D_TILES, KEY_TILES, PV_STEPS, dequant, lds_load, lds_store, load_vec8, mfma, read_common, scale_pair,
    store_values,
)
from common import (
    BLOCK_SIZE, D_PER_QUAD, DATA_BYTES, GROUP_HEADS, HEAD_DIM, NEG_INF, SCALE_BYTES, SCALE_PLANE,
    TILE_BYTES, TOPK, WAVE, buffer_rsrc, exp2_fast, lane_ids, load_dwords, load_u16, uniform,
)

NUM_WAVES = 8
THREADS = NUM_WAVES * WAVE              # 512
COLUMN_GROUPS = 2                       # MFMA column groups (16 columns each) per wave
SENTINEL = 0x7FFFFFFF                   # key of an invalid slot: sorts after every valid key
ROW_BYTES = 128 * 2 + 16                # 128 16-bit values + 16 bytes of padding (bank spread)
K_OFF = 0                               # K[key][d]
VT_OFF = BLOCK_SIZE * ROW_BYTES         # Vt[d][key]


def rows_per_group(group: int) -> int:
    """Rows sharing one MFMA's 16 columns: 1 for G = 16, 2 for G = 8 (row j in columns 8j .. 8j+7)."""
    return GROUP_HEADS // group


def tile_rows(group: int = GROUP_HEADS) -> int:
    """Consecutive rows per workgroup: 16 for G = 16, 32 for G = 8."""
    return NUM_WAVES * COLUMN_GROUPS * rows_per_group(group)


class Layout:
    """LDS byte offsets for G = group: the staged block, the union's tables, each wave's Q."""

    def __init__(self, group: int):
        self.candidates = tile_rows(group) * TOPK           # (row, slot) pairs: 256 or 512
        n = 4 * self.candidates
        self.cand = VT_OFF + HEAD_DIM * ROW_BYTES           # int32: each (row, slot)'s key
        self.cand_vis = self.cand + n                       # int32: the row's vis
        self.first = self.cand_vis + n                      # int32: key if first occurrence, else sentinel
        self.union_key = self.first + n                     # int32: the sorted union's keys
        self.union_b = self.union_key + n                   # ... their block ids
        self.union_lim = self.union_b + n                   # ... the largest block-local limit of a selecting row
        self.q = self.union_lim + n                         # per wave: each lane's Q B operands
        self.q_wave = COLUMN_GROUPS * 4 * WAVE * 16
        self.bytes = self.q + NUM_WAVES * self.q_wave


def lds_bytes(group: int = GROUP_HEADS) -> int:
    return Layout(group).bytes


def parts(group: int) -> int:
    """Online-softmax updates per block: 2 (64 keys each) for G = 16; 4 for G = 8, whose per-row
    masked V pass keeps two results live (a whole block at once spills)."""
    return 2 if group == GROUP_HEADS else 4


def dyn_for(start, stop, state: dict, body):
    """scf.for over i in [start, stop) (Int32) carrying the pytree dict `state`; body(i, state) -> state."""
    names = tuple(state)

    def fn(iv, _names, *vals):
        return body(fx.Int32(iv), dict(zip(names, vals)))

    out = InsertEmptyYieldForSCFFor.scf_for_dispatch(
        fx.Int32(start), fx.Int32(stop), fx.Int32(1), fn,
        result_names=names, result_values=tuple(state[n] for n in names))
    return dict(zip(names, out if len(names) > 1 else (out,)))


def dyn_if(cond, state: dict, then):
    """scf.if: state = then(state) where cond (a wave-uniform i1) holds, else unchanged."""
    names = tuple(state)

    def fn(_names, *vals):
        return then(dict(zip(names, vals)))

    out = ReplaceIfWithDispatch.scf_if_dispatch(
        cond, fn, None, result_names=names, result_values=tuple(state[n] for n in names))
    return dict(zip(names, out if len(names) > 1 else (out,)))


def when(cond, action):
    """scf.if without results: action() runs where cond holds."""
    ReplaceIfWithDispatch.scf_if_dispatch(cond, lambda *_: action(), None)


def lds_i32(lds_base, byte_off, n=1):
    v = lds_load(lds_base, byte_off, fx.Int32, n, 4 * n if n > 1 else 4)
    return fx.Int32(v[0]) if n == 1 else v


def put_i32(lds_base, byte_off, value):
    lds_store(lds_base, byte_off, fx.Vector.from_elements([fx.Int32(value)], dtype=fx.Int32), fx.Int32, 4)


def build_union(lay, lds_base, tid, key, vis, b):
    """Step 1 (see the module docstring): sorted, de-duplicated union of the tile's keys in LDS.
    `key`, `vis`, `b`: thread tid's candidate (the sentinel where invalid). Returns the size."""
    n = lay.candidates
    is_cand = tid < n
    when(is_cand, lambda: (put_i32(lds_base, lay.cand + 4 * tid, key), put_i32(lds_base, lay.cand_vis + 4 * tid, vis)))
    gpu.barrier()

    def scan_equal(j, st):
        keys = lds_i32(lds_base, lay.cand + 16 * j, 4)
        viss = lds_i32(lds_base, lay.cand_vis + 16 * j, 4)
        dup, vmax = st["dup"], st["vmax"]
        for i in range_constexpr(4):
            eq = fx.Int32(keys[i]) == key
            dup = dup | (eq & ((4 * j + i) < tid)).select(fx.Int32(1), fx.Int32(0))
            vmax = (eq & (fx.Int32(viss[i]) > vmax)).select(fx.Int32(viss[i]), vmax)
        return {"dup": dup, "vmax": vmax}

    st = dyn_for(0, n // 4, {"dup": fx.Int32(0), "vmax": fx.Int32(0)}, scan_equal)
    first = (key != SENTINEL) & (st["dup"] == 0)
    when(is_cand, lambda: put_i32(lds_base, lay.first + 4 * tid, first.select(key, fx.Int32(SENTINEL))))
    gpu.barrier()

    def count_smaller(j, st):
        keys = lds_i32(lds_base, lay.first + 16 * j, 4)
        rank, size = st["rank"], st["size"]
        for i in range_constexpr(4):
            k = fx.Int32(keys[i])
            rank = rank + (k < key).select(fx.Int32(1), fx.Int32(0))
            size = size + (k != SENTINEL).select(fx.Int32(1), fx.Int32(0))
        return {"rank": rank, "size": size}

    st2 = dyn_for(0, n // 4, {"rank": fx.Int32(0), "size": fx.Int32(0)}, count_smaller)
    rank = st2["rank"]
    limit = st["vmax"] - b * BLOCK_SIZE
    limit = (limit > BLOCK_SIZE).select(fx.Int32(BLOCK_SIZE), limit)

    def write_entry():
        put_i32(lds_base, lay.union_key + 4 * rank, key)
        put_i32(lds_base, lay.union_b + 4 * rank, b)
        put_i32(lds_base, lay.union_lim + 4 * rank, limit)

    when(is_cand & first, write_entry)
    gpu.barrier()
    return uniform(st2["size"])             # every thread counted the same first occurrences


def stage_k(compute, lds_base, k_rsrc, tid):
    """K tile -> LDS K[key][d] (compute dtype): thread t takes token t/4, d = 32·(t%4) .. +31."""
    key, qd = tid // 4, tid % 4
    data = load_dwords(k_rsrc, key * DATA_BYTES + 16 * qd, 4)
    sc = scale_pair(compute, load_u16(k_rsrc, SCALE_PLANE + key * SCALE_BYTES + 2 * qd))
    base = K_OFF + key * ROW_BYTES + qd * 64
    for c in range_constexpr(4):
        lds_store(lds_base, base + 16 * c, dequant(compute, data[c], sc[c // 2]), compute, 16)


def stage_v(compute, lds_base, v_rsrc, tid, limit):
    """V tile -> LDS Vt[d][key]: thread t takes tokens 4·(t/16) .. +3, d = 8·(t%16) .. +7. Tokens at or
    past `limit` are zeroed as raw words (data and scale) before dequantization (SPEC §5.2)."""
    kg, dg = tid // 16, tid % 16
    data_base = kg * (4 * DATA_BYTES) + 4 * dg
    scale_base = kg * (4 * SCALE_BYTES) + dg // 2
    vals = []
    for u in range_constexpr(4):
        attended = (4 * kg) < (limit - u)              # token 4·kg + u below the limit
        word = attended.select(load_dwords(v_rsrc, data_base + u * DATA_BYTES, 1), fx.Int32(0))
        # the scale plane's constant offset goes in soffset (past the 12-bit immediate field)
        sbyte = fx.rocdl.raw_ptr_buffer_load(T.i8, v_rsrc, fx.Int32(scale_base).ir_value(),
                                             fx.Int32(SCALE_PLANE + u * SCALE_BYTES).ir_value(), 0)
        sword = attended.select(fx.Int32(_arith.extui(T.i32, sbyte)), fx.Int32(0))
        vals.append(dequant(compute, word, scale_pair(compute, sword)[0]))
    base = VT_OFF + dg * (8 * ROW_BYTES) + kg * 8
    for e in range_constexpr(8):
        col = fx.Vector.from_elements([vals[u][e] for u in range_constexpr(4)], dtype=compute)
        lds_store(lds_base, base + e * ROW_BYTES, col, compute, 8)


def key_masks(limit, s, quad):
    """Raw-bit masks of the lane's 8 PV keys of step s (two dwords of 2 keys at 32·s + 4·quad and two
    at 32·s + 16 + 4·quad): all ones where the key is below `limit`, else zero."""
    masks = []
    for half in range_constexpr(2):
        for pair in range_constexpr(2):
            first = 32 * s + 16 * half + 2 * pair          # the lane's keys: 4·quad + first (+1)
            lo = ((4 * quad) < (limit - first)).select(fx.Int32(0xFFFF), fx.Int32(0))
            hi = ((4 * quad) < (limit - (first + 1))).select(fx.Int32(-65536), fx.Int32(0))
            masks.append(lo | hi)
    return masks


def pick(cond, a, b):
    """a where cond (a per-lane i1), else b; b when cond is None (nothing to choose)."""
    return b if cond is None else cond.select(a, b)


def attend_union(ops, compute, io, tile, kv_head, row_of, lds_base, group=GROUP_HEADS):
    """Attention of rows tile_rows·tile .. + tile_rows - 1 (KV head kv_head) over the union of their
    selections.

    row_of(token) -> (req, vis, row_ok): the row's request, vis = pos + 1, and whether it attends
    at all (SPEC §5.3 / §5.4); called with an in-range token. Rows past num_tokens store nothing.
    Wave w owns rows_per_wave consecutive rows: column group cg (of 2) holds rows_per_group of them,
    row j of a group in columns G·j .. G·j + G - 1 (head = column % G).
    """
    lay = Layout(group)
    rpg = rows_per_group(group)
    rpw = COLUMN_GROUPS * rpg                   # rows per wave: 2 (G = 16) or 4 (G = 8)
    n_rows = tile_rows(group)
    tid = fx.Int32(fx.thread_idx.x)
    wave = uniform(tid // WAVE)
    lane, lane16, quad = lane_ids(tid)
    num_heads = ops.num_kv_heads * group
    t0 = tile * n_rows

    layer_ok, layer_base, qk_scale, v_scale, table_rsrc, topk_rsrc = read_common(ops)

    # ---- 1. the candidate of thread tid: row t0 + tid/16, slot tid%16 (SPEC §5.2) ----------------
    token = t0 + (tid // TOPK) % n_rows
    in_range = (tid < lay.candidates) & (token < ops.num_tokens)
    req, vis, row_ok = row_of(in_range.select(token, 0))
    b = load_dwords(topk_rsrc, ((kv_head * ops.num_tokens + in_range.select(token, 0)) * TOPK + tid % TOPK) * 4, 1)
    b_ok = in_range & row_ok & layer_ok & (b >= 0) & (b < ops.max_blocks) & (b * BLOCK_SIZE < vis)
    page = load_dwords(table_rsrc, b_ok.select(req * ops.max_blocks + b, 0) * 4, 1)
    valid = b_ok & (page >= 0) & (page < ops.num_pages)
    key = valid.select(req * ops.max_blocks + b, fx.Int32(SENTINEL))
    union_size = build_union(lay, lds_base, tid, key, vis, b)

    # ---- this wave's rows: Q, the slot keys (lane l < 16·rows: row l/16, slot l%16), vis -----------
    io_bytes = io.width // 8
    q_rsrc = buffer_rsrc(ops.q, fx.Int64(ops.num_tokens) * fx.Int64(num_heads) * (HEAD_DIM * io_bytes))
    rows = [t0 + rpw * wave + r for r in range(rpw)]
    second = (lane16 >= group) if rpg > 1 else None     # the lane's column is the group's second row
    lane_rows = [pick(second, rows[cg * rpg + rpg - 1], rows[cg * rpg]) for cg in range(COLUMN_GROUPS)]
    # Q of the wave's rows goes to LDS, each lane's B operands where that lane reads them back:
    # holding them in registers would leave no room for two column groups' accumulators (256 VGPRs)
    q_base = lay.q + wave * lay.q_wave + lane * 16
    for cg in range_constexpr(COLUMN_GROUPS):
        q_row = ((lane_rows[cg] * num_heads + kv_head * group + lane16 % group) * HEAD_DIM + quad * D_PER_QUAD) * io_bytes
        for c in range_constexpr(4):
            lds_store(lds_base, q_base + (cg * 4 + c) * (WAVE * 16), load_vec8(q_rsrc, q_row + 8 * io_bytes * c, io, compute),
                      compute, 16)
    slot_key = lds_i32(lds_base, lay.cand + 4 * ((rpw * wave) * TOPK + lane % (rpw * TOPK)))
    if rpw * TOPK < WAVE:
        slot_key = (lane < rpw * TOPK).select(slot_key, fx.Int32(SENTINEL))
    vis_addr = [lay.cand_vis + 4 * ((rpw * wave + r) * TOPK) for r in range(rpw)]

    def per_entry(u, st):
        key_u = uniform(lds_i32(lds_base, lay.union_key + 4 * u))
        b_u = uniform(lds_i32(lds_base, lay.union_b + 4 * u))
        lim_u = uniform(lds_i32(lds_base, lay.union_lim + 4 * u))
        page_u = uniform(load_dwords(table_rsrc, key_u * 4, 1))
        page_base = layer_base + fx.Int64(page_u) * ops.page_stride     # 64-bit (SPEC §3.3)
        k_rsrc = buffer_rsrc(ops.kv_cache + (page_base + fx.Int64(kv_head * 2) * TILE_BYTES), fx.Int32(TILE_BYTES))
        v_rsrc = buffer_rsrc(ops.kv_cache + (page_base + fx.Int64(kv_head * 2 + 1) * TILE_BYTES), fx.Int32(TILE_BYTES))
        gpu.barrier()                                   # every wave is done with the last entry's tiles
        stage_k(compute, lds_base, k_rsrc, tid)
        stage_v(compute, lds_base, v_rsrc, tid, lim_u)
        gpu.barrier()
        # how often each row selected this entry (duplicates count per occurrence, SPEC §5.1)
        votes = fx.rocdl.ballot(T.i64, (slot_key == key_u).ir_value())
        words = [fx.Int32(_arith.trunci(T.i32, votes))]
        if rpw * TOPK > 32:
            words.append(fx.Int32(_arith.trunci(T.i32, _arith.shrui(votes, _arith.constant(T.i64, 32)))))
        mult = [fx.Int32(fx.ctpop(fx.Int32(words[r // 2] >> (TOPK * (r % 2))) & 0xFFFF)) for r in range(rpw)]
        limits = []
        for r in range_constexpr(rpw):
            # the row's vis re-read from LDS per entry (a broadcast): held across the loop it would
            # cost an SGPR per row, and G = 8's four rows spill
            lim = uniform(lds_i32(lds_base, vis_addr[r])) - b_u * BLOCK_SIZE
            lim = (lim > BLOCK_SIZE).select(fx.Int32(BLOCK_SIZE), lim)
            limits.append((mult[r] > 0).select(lim, fx.Int32(0)))
        selected, need_mask = mult[0], limits[0] < lim_u
        for r in range(1, rpw):
            selected = selected + mult[r]
            need_mask = need_mask | (limits[r] < lim_u)
        # per column group, the lane's own row's multiplicity and limit
        lane_mult = [pick(second, mult[cg * rpg + rpg - 1], mult[cg * rpg]) for cg in range(COLUMN_GROUPS)]
        lane_limit = [pick(second, limits[cg * rpg + rpg - 1], limits[cg * rpg]) for cg in range(COLUMN_GROUPS)]
        row_limits = [limits[cg * rpg:(cg + 1) * rpg] for cg in range(COLUMN_GROUPS)]
        return dyn_if(selected > 0, st,
                      lambda s: update_rows(compute, lds_base, s, q_base, lane_mult, lane_limit, row_limits, need_mask,
                                            qk_scale, lane16, quad, group))

    state = {"m": [fx.Float32(NEG_INF)] * COLUMN_GROUPS, "l": [fx.Float32(0.0)] * COLUMN_GROUPS,
             "o": [[fx.Vector.filled(4, 0.0, fx.Float32) for _ in range(D_TILES)] for _ in range(COLUMN_GROUPS)]}
    state = dyn_for(0, union_size, state, per_entry)

    # ---- 4. the rows' outputs: O / l · v_scale, exact zeros where nothing was attended -------------
    out_bytes = fx.Int64(ops.num_tokens) * fx.Int64(num_heads) * (HEAD_DIM * io_bytes)
    out_rsrc = buffer_rsrc(ops.out, out_bytes)
    for cg in range_constexpr(COLUMN_GROUPS):
        l_all = state["l"][cg]
        l_all = l_all + l_all.shuffle_xor(16, WAVE)
        l_all = l_all + l_all.shuffle_xor(32, WAVE)
        attended_any = l_all != 0.0
        inv = attended_any.select(v_scale / l_all, fx.Float32(0.0))
        off = ((lane_rows[cg] * num_heads + kv_head * group + lane16 % group) * HEAD_DIM + 4 * quad) * io_bytes
        for dt in range_constexpr(D_TILES):
            o = state["o"][cg][dt] * fx.Vector.from_elements([inv] * 4, dtype=fx.Float32)
            o = attended_any.select(o, fx.Vector.filled(4, 0.0, fx.Float32))
            store_values(out_rsrc, off + 16 * dt * io_bytes, o, io)


def update_rows(compute, lds_base, st, q_ops, mult, limits, row_limits, need_mask, qk_scale, lane16, quad, group):
    """Step 3 for the wave's rows on the staged entry, 64 keys at a time (an online-softmax update
    per half block keeps the live scores few: 0 spills; a whole block spills): S^T, softmax,
    O^T += V^T·P^T."""
    m, l, o = list(st["m"]), list(st["l"]), [list(x) for x in st["o"]]
    for half in range_constexpr(parts(group)):
        fx.rocdl.sched_barrier(0)       # keep the parts apart: the scheduler would overlap their live ranges
        m, l, o = update_half(compute, lds_base, half, m, l, o, q_ops, mult, limits, row_limits, need_mask, qk_scale,
                              lane16, quad, group)
    return {"m": m, "l": l, "o": o}


def update_half(compute, lds_base, half, m, l, o, q_ops, mult, limits, row_limits, need_mask, qk_scale, lane16, quad,
                group):
    """One part of update_rows; index r runs over the wave's column groups, mult / limits are the
    lane's own row's (per lane: with G = 8 the two halves of a group's columns are two rows);
    row_limits[r] the group's rows' limits (wave-uniform), for the per-row V masks."""
    rows = range_constexpr(COLUMN_GROUPS)
    k_base = K_OFF + lane16 * ROW_BYTES + quad * 64         # + constants: ds_read immediate offsets
    n_parts = parts(group)
    tiles = range_constexpr(KEY_TILES // n_parts * half, KEY_TILES // n_parts * (half + 1))
    # S^T = K·Q^T over this part's tiles of 16 keys; each K operand read once from LDS serves both rows
    scores = [{} for _ in rows]
    m_blk = [fx.Float32(NEG_INF) for _ in rows]
    accs = {(r, jt): fx.Vector.filled(4, 0.0, fx.Float32) for r in rows for jt in tiles}
    for c in range_constexpr(4):
        # each Q operand read once per part, each K operand once for both rows
        b = [lds_load(lds_base, q_ops + (r * 4 + c) * (WAVE * 16), compute, 8, 16) for r in rows]
        for jt in tiles:
            a = lds_load(lds_base, k_base + (16 * jt * ROW_BYTES + 16 * c), compute, 8, 16)
            for r in rows:
                accs[r, jt] = mfma(compute, a, b[r], accs[r, jt])
    for jt in tiles:
        for r in rows:
            z = []
            for i in range_constexpr(4):
                # key 16·jt + 4·quad + i < limit, as a lane value against a wave-uniform bound (no
                # per-key constants kept live across the loop)
                attended = (4 * quad) < (limits[r] - (16 * jt + i))
                zi = attended.select(accs[r, jt][i] * qk_scale, fx.Float32(NEG_INF))
                m_blk[r] = fx.maxnumf(m_blk[r], zi)
                z.append(zi)
            scores[r][jt] = z
    p_ops = []
    for r in rows:
        mb = fx.maxnumf(m_blk[r], m_blk[r].shuffle_xor(16, WAVE))
        mb = fx.maxnumf(mb, mb.shuffle_xor(32, WAVE))
        m_new = fx.maxnumf(m[r], mb)
        m_safe = (m_new == NEG_INF).select(fx.Float32(0.0), m_new)        # no -inf - -inf
        alpha = exp2_fast(m[r] - m_safe)
        weight = fx.Float32(_arith.sitofp(T.f32, mult[r].ir_value()))
        l_blk = fx.Float32(0.0)
        ops_r = {}
        for s in range_constexpr(PV_STEPS // n_parts * half, PV_STEPS // n_parts * (half + 1)):
            vals = []
            for sub in range_constexpr(2):
                for i in range_constexpr(4):
                    p = exp2_fast(scores[r][2 * s + sub][i] - m_safe) * weight
                    l_blk = l_blk + p
                    vals.append(p)
            ops_r[s] = fx.Vector.from_elements(vals, dtype=fx.Float32).to(compute)
        p_ops.append(ops_r)
        m[r] = m_new
        l[r] = l[r] * alpha + l_blk
        alpha4 = fx.Vector.from_elements([alpha] * 4, dtype=fx.Float32)
        o[r] = [o[r][dt] * alpha4 for dt in range_constexpr(D_TILES)]
    # O^T += V^T·P^T. Usually every row of the wave attends all the staged keys (limit = lim_u):
    # one read of each V^T operand serves both rows. Otherwise (the diagonal block, or a row that
    # did not select the entry) keys past a row's limit may hold another row's data, which must
    # not reach it even as 0·NaN (SPEC §5.2): each row's operands are masked by a select of raw bits.
    steps = range_constexpr(PV_STEPS // n_parts * half, PV_STEPS // n_parts * (half + 1))
    vt_base = VT_OFF + lane16 * ROW_BYTES + quad * 8

    def v_words(s, dt):
        lo = lds_load(lds_base, vt_base + (16 * dt * ROW_BYTES + 64 * s), fx.Int32, 2, 8)
        hi = lds_load(lds_base, vt_base + (16 * dt * ROW_BYTES + 64 * s + 32), fx.Int32, 2, 8)
        return [fx.Int32(lo[0]), fx.Int32(lo[1]), fx.Int32(hi[0]), fx.Int32(hi[1])]

    def shared(st):
        o = [list(x) for x in st["o"]]
        for s in steps:
            for dt in range_constexpr(D_TILES):
                v_op = fx.Vector.from_elements(v_words(s, dt), dtype=fx.Int32).bitcast(compute)
                for r in rows:
                    o[r][dt] = mfma(compute, v_op, p_ops[r][s], o[r][dt])
        return {"o": o}

    def masked(st):
        # V^T is the MFMA's A operand, shared by all 16 columns: it can carry one row's mask only.
        # With G = 8 a column group holds two rows, so each row's masked pass keeps its own
        # columns' result (the others see keys that row may attend and this one may not).
        o = [list(x) for x in st["o"]]
        for r in rows:
            for j in range_constexpr(len(row_limits[r])):
                if j:
                    fx.rocdl.sched_barrier(0)       # one row's pass at a time (their live ranges add up)
                own = None if len(row_limits[r]) == 1 else ((lane16 >= group) if j else (lane16 < group))
                for s in steps:
                    masks = key_masks(row_limits[r][j], s, quad)
                    for dt in range_constexpr(D_TILES):
                        words = v_words(s, dt)
                        v_op = fx.Vector.from_elements([words[i] & masks[i] for i in range(4)],
                                                       dtype=fx.Int32).bitcast(compute)
                        new = mfma(compute, v_op, p_ops[r][s], o[r][dt])
                        o[r][dt] = new if own is None else own.select(new, o[r][dt])
        return {"o": o}

    o = ReplaceIfWithDispatch.scf_if_dispatch(need_mask, lambda _n, *v: masked({"o": v[0]}),
                                              lambda _n, *v: shared({"o": v[0]}),
                                              result_names=("o",), result_values=(o,))
    return m, l, o
