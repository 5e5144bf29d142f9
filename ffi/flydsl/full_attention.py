"""Full NVFP4 attention for gfx950 (SPEC §5.7): every key of a row's request up to its position, as
parts of 16 blocks, each part a sparse row, folded in part order. bf16 MFMA compute: the per-token
decode body's arithmetic (SPEC §5.5).

Compiled variants: `full_attention_bf16`, `full_attention_f16`, `full_attention_f32` (the q / out
dtype) and the same for G = 8 (M3 at TP8) as `full_attention_g8_<dtype>`. Launcher arguments, in order:

    q            bf16|f16|f32 [T, Hq, D]            Hq = Hkv·G, D = 128, G = 16 (or 8: the *_g8_* variants)
    kv_cache     uint8, SPEC §3 (4-D, or 5-D LBHNC / BLHNC)
    block_table  int32 [R, M]
    query_req_id int32 [T]                      SPEC §4; < 0 or >= R marks a padding row (zero output)
    query_abs_pos int32 [T]                     SPEC §4; < 0 also marks a padding row
    k_scale, v_scale  float32 []
    layer        int32 []
    out          q's dtype [T, Hq, D]
    workspace    float32, T·Hkv·num_parts records of 8320 bytes (attention_core.PARTIAL_BYTES)
    num_tokens T, num_kv_heads Hkv, num_requests R, max_blocks M, num_pages P, num_layers L (int32),
    page_stride, layer_stride (int64 bytes), num_parts = ceil(M / 16) (int32), scale (float32), stream.

Parts. Part p of a row is blocks 16·p .. 16·p + 15: exactly a sparse row whose 16 selected ids are
those blocks (SPEC §5.7: the result is §5.4's with every block selected), computed by
attention_core.attend, the per-token decode body (one workgroup of 4 waves, 4 blocks per wave, the
waves' states merged through LDS), which writes the part's unnormalized state (O, m, l per head,
base 2) to the workspace. The part size is this module's constant, never the batch's: a row's bits
depend on it only. Block ids past M, 128·b >= vis, pages outside [0, P) and a layer outside [0, L)
are invalid slots as in §5.2 (0-byte descriptors: nothing read); a row uses parts
0 .. visible_parts - 1 only (a part starting at or past vis, or any part of a padding row, has
nothing to attend: its workgroup returns at once and its record is never read).

Merge. One workgroup of 256 threads per (row, KV head): thread t takes head t // 16 and
d = 8·(t % 16) .. +7, folds the row's records left to right in part order (the fold of
ffi/cuda/attention.cu: m = max(m_R, m_L), factors 2^(m_R - m), 2^(m_L - m) with -inf - -inf kept
out, l and O scaled and summed) and writes O / l · v_scale, exact zeros where l = 0 (SPEC §5.5).
Skipping the parts past vis changes no bit: an empty state's factor is exactly 0 and the running
state's exactly 1.

ffi/rocm/handlers.cc launches the pair over token chunks (at most 4096 (row, KV head, part) states
per launch, 34 MB of XLA scratch memory), offsetting q, out and the metadata pointers: every row's
work is the same whatever the chunk.

NVFP4 -> bf16 and the softmax: as sparse_decode.py / attention_core.py (unit-scale conversion, exact
E4M3 multiply in fp32, exact bf16 rounding; k_scale folded into the logit scale, v_scale in the
merge's epilogue).
"""

import functools

import flydsl.compiler as flyc
import flydsl.expr as fx

from attention_core import (
    COMPUTE_DTYPES, IO_DTYPES, PARTIAL_BYTES, THREADS, TOPK, Operands, attend, finish, load_partial,
    owned_bytes, shared_storage, store_values,
)
from common import BLOCK_SIZE, GROUP_HEADS, HEAD_DIM, NEG_INF, buffer_rsrc, exp2_fast, uniform
from union_tile import dyn_for, when

# SPEC §5.5: bf16 products, as the per-token decode whose body this is. (The body's fp16 form, the
# per-token prefill until 2026-12-02 and exported no more, gave rel-F 0.15 on the emulator in this
# kernel, against 0.001 for bf16; not investigated.)
COMPUTE = "bf16"
PART_BLOCKS = TOPK          # blocks per part: one workgroup's 16 slots (a constant: a row's bits follow it)
PART_KEYS = PART_BLOCKS * BLOCK_SIZE


def full_row(token, query_req_id, query_abs_pos, num_requests):
    """SPEC §5.4 / §5.7: (req, vis = pos + 1, row_ok); a request outside [0, R) or a negative position
    is a padding row. Values made wave-uniform (SGPRs)."""
    req_raw = uniform(fx.Int32(query_req_id[token]))
    pos = uniform(fx.Int32(query_abs_pos[token]))
    row_ok = (req_raw >= 0) & (req_raw < num_requests) & (pos >= 0)
    return row_ok.select(req_raw, 0), pos + 1, row_ok, pos


def visible_parts(pos, row_ok, num_parts):
    """Parts holding a key at or before pos: min(pos // PART_KEYS + 1, num_parts); 0 for a padding row."""
    n = pos // PART_KEYS + 1
    n = (n > num_parts).select(num_parts, n)
    return row_ok.select(n, fx.Int32(0))


def fold(m_r, l_r, o_r, m_l, l_l, o_l):
    """The running state R folded with the next part's L (base 2): m = max, factors 2^(m_R - m) and
    2^(m_L - m) (0 for an empty state; two empty states stay empty), l and O scaled and summed."""
    m = fx.maxnumf(m_r, m_l)
    mu = (m == NEG_INF).select(fx.Float32(0.0), m)
    f_r = exp2_fast(m_r - mu)
    f_l = exp2_fast(m_l - mu)
    o = o_r * fx.Vector.from_elements([f_r] * 8, dtype=fx.Float32) + \
        o_l * fx.Vector.from_elements([f_l] * 8, dtype=fx.Float32)
    return m, l_r * f_r + l_l * f_l, o


@functools.lru_cache(maxsize=None)
def compile_full_attention(dtype: str = "bf16", group: int = GROUP_HEADS):
    """Launcher for q/out dtype `dtype` ("bf16", "f16" or "f32") and G = `group` (16 or 8): the part
    kernel over grid (T, Hkv, num_parts), then the merge over (T, Hkv); products in bf16."""
    io = IO_DTYPES[dtype]
    compute = COMPUTE_DTYPES[COMPUTE]
    SharedStorage = shared_storage()

    @flyc.kernel(known_block_size=(THREADS, 1, 1))
    def full_attention_part_kernel(
        q: fx.Pointer, kv_cache: fx.Pointer, block_table: fx.Pointer, query_req_id: fx.Pointer,
        query_abs_pos: fx.Pointer, k_scale: fx.Pointer, v_scale: fx.Pointer, layer: fx.Pointer,
        out: fx.Pointer, workspace: fx.Pointer,
        num_tokens: fx.Int32, num_kv_heads: fx.Int32, num_requests: fx.Int32, max_blocks: fx.Int32,
        num_pages: fx.Int32, num_layers: fx.Int32, page_stride: fx.Int64, layer_stride: fx.Int64,
        num_parts: fx.Int32, scale: fx.Float32,
    ):
        token = fx.Int32(fx.block_idx.x)
        kv_head = fx.Int32(fx.block_idx.y)
        part = fx.Int32(fx.block_idx.z)
        lds = fx.SharedAllocator().allocate(SharedStorage).peek()
        lds_base = fx.recast_iter(fx.Uint8, lds.buf.ptr)
        req, vis, row_ok, pos = full_row(token, query_req_id, query_abs_pos, num_requests)
        ops = Operands(q, kv_cache, None, block_table, k_scale, v_scale, layer, out,
                       num_tokens, num_kv_heads, num_requests, max_blocks, num_pages, num_layers,
                       page_stride, layer_stride, scale)
        when(part < visible_parts(pos, row_ok, num_parts),
             lambda: attend(ops, compute, io, token, kv_head, req, vis, row_ok, lds_base, split=part,
                            workspace=workspace, num_splits=num_parts, group=group,
                            first_block=part * PART_BLOCKS))

    @flyc.kernel(known_block_size=(THREADS, 1, 1))
    def full_attention_merge_kernel(
        query_req_id: fx.Pointer, query_abs_pos: fx.Pointer, v_scale: fx.Pointer, out: fx.Pointer,
        workspace: fx.Pointer, num_tokens: fx.Int32, num_kv_heads: fx.Int32, num_requests: fx.Int32,
        num_parts: fx.Int32,
    ):
        # thread tid: head tid // 16, d = 8·(tid % 16) .. +7; with G = 8 waves 2, 3 store nothing
        token = fx.Int32(fx.block_idx.x)
        kv_head = fx.Int32(fx.block_idx.y)
        tid = fx.Int32(fx.thread_idx.x)
        head = tid // 16
        owns = (uniform(tid // 64) * 4 < group) if group < GROUP_HEADS else None
        d0 = (tid % 16) * 8
        _, _, row_ok, pos = full_row(token, query_req_id, query_abs_pos, num_requests)
        ws = buffer_rsrc(workspace, fx.Int64(num_tokens) * fx.Int64(num_kv_heads) * fx.Int64(num_parts) * PARTIAL_BYTES)
        first = (token * num_kv_heads + kv_head) * num_parts * PARTIAL_BYTES

        def step(p, st):
            m, l, o = fold(st["m"], st["l"], st["o"], *load_partial(ws, first + p * PARTIAL_BYTES, head, d0))
            return {"m": m, "l": l, "o": o}

        state = {"m": fx.Float32(NEG_INF), "l": fx.Float32(0.0), "o": fx.Vector.filled(8, 0.0, fx.Float32)}
        state = dyn_for(0, visible_parts(pos, row_ok, num_parts), state, step)
        num_heads = num_kv_heads * group
        io_bytes = io.width // 8
        out_bytes = fx.Int64(num_tokens) * fx.Int64(num_heads) * (HEAD_DIM * io_bytes)
        out_rsrc = buffer_rsrc(out, owned_bytes(owns, out_bytes))
        out_off = ((token * num_heads + kv_head * group + head) * HEAD_DIM + d0) * io_bytes
        store_values(out_rsrc, out_off, finish(state["o"], state["l"], fx.Float32(v_scale.load())), io)

    @flyc.jit
    def launch(
        q: fx.Pointer, kv_cache: fx.Pointer, block_table: fx.Pointer, query_req_id: fx.Pointer,
        query_abs_pos: fx.Pointer, k_scale: fx.Pointer, v_scale: fx.Pointer, layer: fx.Pointer, out: fx.Pointer,
        workspace: fx.Pointer,
        num_tokens: fx.Int32, num_kv_heads: fx.Int32, num_requests: fx.Int32, max_blocks: fx.Int32,
        num_pages: fx.Int32, num_layers: fx.Int32, page_stride: fx.Int64, layer_stride: fx.Int64,
        num_parts: fx.Int32, scale: fx.Float32,
        stream: fx.Stream = fx.Stream(None),
    ):
        full_attention_part_kernel(
            q, kv_cache, block_table, query_req_id, query_abs_pos, k_scale, v_scale, layer, out, workspace,
            num_tokens, num_kv_heads, num_requests, max_blocks, num_pages, num_layers, page_stride,
            layer_stride, num_parts, scale,
        ).launch(grid=(num_tokens, num_kv_heads, num_parts), block=(THREADS, 1, 1), stream=stream)
        full_attention_merge_kernel(
            query_req_id, query_abs_pos, v_scale, out, workspace, num_tokens, num_kv_heads, num_requests, num_parts,
        ).launch(grid=(num_tokens, num_kv_heads, 1), block=(THREADS, 1, 1), stream=stream)

    return launch


def placeholders(dtype: str = "bf16", group: int = GROUP_HEADS):
    """Arguments for flyc.compile without a GPU (null pointers, dummy scalars)."""
    io = IO_DTYPES[dtype]
    ptr = flyc.from_c_void_p
    return (
        ptr(io, None, assumed_align=16), ptr(fx.Uint8, None, assumed_align=16),
        ptr(fx.Int32, None, assumed_align=4), ptr(fx.Int32, None, assumed_align=4),
        ptr(fx.Int32, None, assumed_align=4), ptr(fx.Float32, None, assumed_align=4),
        ptr(fx.Float32, None, assumed_align=4), ptr(fx.Int32, None, assumed_align=4),
        ptr(io, None, assumed_align=16), ptr(fx.Float32, None, assumed_align=16),
        fx.Int32(1), fx.Int32(1), fx.Int32(1), fx.Int32(1), fx.Int32(1), fx.Int32(1),
        fx.Int64(1), fx.Int64(1), fx.Int32(1), fx.Float32(1.0),
    )
