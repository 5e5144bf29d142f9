"""Sparse NVFP4 decode attention for gfx950 (SPEC §5.2, §5.3, §5.5), bf16 MFMA compute.

Compiled variants: `sparse_decode_bf16`, `sparse_decode_f16`, `sparse_decode_f32` (the q / out dtype; the products are
computed in bf16 either way, SPEC §5.5), and the same for G = 8 (M3 at TP8) as `sparse_decode_g8_<dtype>`; the
split variant below, and for decode_query_len > 1 the union-tile variant (`sparse_decode_union_*`,
compile_sparse_decode_union, union_tile.py). Launcher arguments, in order (ffi/rocm/ passes them):

    q            bf16|f16|f32 [T, Hq, D]            Hq = Hkv·G, D = 128, G = 16 (or 8: the *_g8_* variants)
    kv_cache     uint8, SPEC §3 (4-D, or 5-D LBHNC / BLHNC; see page_stride / layer_stride)
    topk_indices int32 [Hkv, T, K]              K = 16 logical block ids, -1 = unused
    block_table  int32 [R, M]
    seq_lens     int32 [R]                      including this step's tokens
    k_scale, v_scale  float32 []                global dequantization multipliers (SPEC §2.1)
    layer        int32 []
    out          q's dtype [T, Hq, D]
    num_tokens T, num_kv_heads Hkv, num_requests R, max_blocks M, num_pages P, num_layers L (int32),
    page_stride, layer_stride (int64 bytes: page p of layer l is at p·page_stride + l·layer_stride),
    decode_query_len dql (int32), scale (float32 softmax scale), stream.

Work decomposition. One workgroup of 4 waves per (token t, KV head g): grid = (T, Hkv). Wave w
takes the selected slots k = 4·w + j, j = 0..3 (SPEC §5.1: order does not matter), runs an online
softmax over them, and the 4 partial results (m, l, O) are merged through LDS at the end (the
"split over the 16 blocks with an LSE merge", inside the workgroup). All 16 query heads of the
KV head share every dequantized K/V tile.

Per slot (SPEC §5.2): r = t // dql, pos = seq_lens[r] - dql + t % dql, vis = pos + 1. The slot's id
b is valid iff 0 <= b < M, 128·b < vis, the layer is in [0, L) and 0 <= block_table[r, b] < P.
An invalid slot gets buffer descriptors of 0 bytes, so its loads return zeros and touch no
memory; its keys are all masked. Key p = 128·b + o is attended iff valid and p < vis. Masking is
by select: scores of unattended keys become -inf before the max, and the raw NVFP4 words of
unattended V tokens are replaced by zeros before dequantization, so garbage (NaN scales in page
tails) never reaches the PV product.

Lane mapping (lane in the wave, lane16 = lane % 16, quad = lane // 16), MFMA v_mfma_f32_16x16x32_bf16
(A 16x32: lane holds row lane16, k = 8·quad + i; B 32x16: column lane16, same k; C 16x16: column
lane16, rows 4·quad + i):
* Q (registers, loaded once): head g·16 + lane16, head-dim d = 32·quad + 8·c + i for MFMA c = 0..3
  (one 64-byte contiguous run per lane; the contraction over d is permuted identically for Q and K,
  which leaves the dot product unchanged).
* S^T = K · Q^T per tile of 16 keys: A = K (row = key 16·jt + lane16, the lane's 16-byte load of
  that token's data bytes 16·quad..16·quad+15 plus its 2 scale bytes), B = Q. C gives the lane
  the scores of head lane16 for keys 16·jt + 4·quad + i. So every lane owns one head; the row max /
  sum need only the xor-16 and xor-32 shuffles.
* O^T = V^T · P^T per 32-key step s: B = P (the lane's own probabilities of tiles 2s, 2s+1, key
  16·(i/4) + 4·quad + i%4 in k-slot i), A = V^T from LDS, C = O^T rows d = 16·dt + 4·quad + i,
  column head lane16 (8 d-tiles, 32 fp32 accumulators per lane).
* V staging (LDS, per wave, per 64-key half of a block): lane16 picks tokens 4·lane16..+3 of the half,
  quad the d range 32·quad..+31; the lane dequantizes and writes, for each of its 32 d, the 4 tokens'
  bf16 as one 8-byte ds_write into Vt[d][token] (row stride VT_ROW_BYTES). The PV A-operand of
  lane (lane16, quad) is two 8-byte reads of row 16·dt + lane16 at tokens 32·s + 4·quad and +16.

Memory order per wave: the slot ids of its 4 slots, then their block_table entries (two round
trips in all); per block, all 8 K tiles (16-byte data + 2 scale bytes per lane) and the first V half
are issued together before the QK MFMAs, the second V half right after the first is staged, so
its latency overlaps the first half's PV (242 VGPRs: 2 waves per SIMD).

NVFP4 -> bf16 (SPEC §2.1): v_cvt_scalef32_pk_f32_fp4 with a *unit* scale gives exact e2m1 values;
the E4M3 block scale (v_cvt_pk_f32_fp8, exact) is applied as an exact fp32 multiply
(v_pk_mul_f32), and v_cvt_pk_bf16_f32 rounds nothing because e2m1·e4m3 is exact in bf16. (The
scaled conversion's scale operand applies only its exponent, so it cannot take an E4M3 scale.)

Softmax (SPEC §5.5): base 2, fp32. The logit scale is scale · k_scale · log2(e) (k_scale folded,
one multiply per score); v_scale is applied once in the epilogue. exp2 is v_exp_f32. A row with
nothing attended has l = 0 and is written as exact zeros; a NaN that is attended stays visible.

Split variant (`sparse_decode_split_*`, used by the handler when dql = 1 and T·Hkv < 256): grid (T, Hkv, 4),
workgroup z covers slots 4·z .. 4·z+3 (one per wave) and writes its merged (O, m, l) to a float32
workspace; a merge kernel, grid (T, Hkv), combines the 4 records with the same LSE formula and
writes the output. 4× more workgroups for small batches, same result.

LDS: 4 waves × VT_BYTES (= 128 rows × 144 B = 18 KiB) = 72 KiB; the merge reuses it.
"""

import functools

import flydsl.compiler as flyc
import flydsl.expr as fx

from flydsl.expr import range_constexpr

from attention_core import (
    COMPUTE_DTYPES, IO_DTYPES, NUM_WAVES, PARTIAL_BYTES, THREADS, TOPK, Operands, attend,
    finish, load_partial, lse_combine, owned_bytes, shared_storage, store_values,
)
from common import GROUP_HEADS, HEAD_DIM, buffer_rsrc, uniform
import union_tile

COMPUTE = "bf16"            # SPEC §5.5: the gfx950 decode computes the products in bf16


def decode_row(token, seq_lens, decode_query_len):
    """SPEC §5.3: row t belongs to request r = t // dql at pos = seq_lens[r] - dql + t % dql; returns
    (r, vis = pos + 1, whether the row attends: a padded request, seq_len 0, attends nothing)."""
    req = token // decode_query_len
    vis = fx.Int32(seq_lens[req]) - decode_query_len + token % decode_query_len + 1
    return req, vis, vis > 0


@functools.lru_cache(maxsize=None)
def compile_sparse_decode(dtype: str = "bf16", group: int = GROUP_HEADS):
    """Launcher for q/out dtype `dtype` ("bf16", "f16" or "f32") and G = `group` (16 or 8); products in bf16."""
    io = IO_DTYPES[dtype]
    compute = COMPUTE_DTYPES[COMPUTE]
    SharedStorage = shared_storage()

    @flyc.kernel(known_block_size=(THREADS, 1, 1))
    def sparse_decode_kernel(
        q: fx.Pointer, kv_cache: fx.Pointer, topk_indices: fx.Pointer, block_table: fx.Pointer,
        seq_lens: fx.Pointer, k_scale: fx.Pointer, v_scale: fx.Pointer, layer: fx.Pointer,
        out: fx.Pointer,
        num_tokens: fx.Int32, num_kv_heads: fx.Int32, num_requests: fx.Int32, max_blocks: fx.Int32,
        num_pages: fx.Int32, num_layers: fx.Int32, page_stride: fx.Int64, layer_stride: fx.Int64,
        decode_query_len: fx.Int32, scale: fx.Float32,
    ):
        token = fx.Int32(fx.block_idx.x)
        kv_head = fx.Int32(fx.block_idx.y)
        lds = fx.SharedAllocator().allocate(SharedStorage).peek()
        lds_base = fx.recast_iter(fx.Uint8, lds.buf.ptr)

        req, vis, row_ok = decode_row(token, seq_lens, decode_query_len)

        ops = Operands(q, kv_cache, topk_indices, block_table, k_scale, v_scale, layer, out,
                       num_tokens, num_kv_heads, num_requests, max_blocks, num_pages, num_layers,
                       page_stride, layer_stride, scale)
        attend(ops, compute, io, token, kv_head, req, vis, row_ok, lds_base, group=group)

    @flyc.jit
    def launch(
        q: fx.Pointer, kv_cache: fx.Pointer, topk_indices: fx.Pointer, block_table: fx.Pointer,
        seq_lens: fx.Pointer, k_scale: fx.Pointer, v_scale: fx.Pointer, layer: fx.Pointer, out: fx.Pointer,
        num_tokens: fx.Int32, num_kv_heads: fx.Int32, num_requests: fx.Int32, max_blocks: fx.Int32,
        num_pages: fx.Int32, num_layers: fx.Int32, page_stride: fx.Int64, layer_stride: fx.Int64,
        decode_query_len: fx.Int32, scale: fx.Float32,
        stream: fx.Stream = fx.Stream(None),
    ):
        sparse_decode_kernel(
            q, kv_cache, topk_indices, block_table, seq_lens, k_scale, v_scale, layer, out,
            num_tokens, num_kv_heads, num_requests, max_blocks, num_pages, num_layers, page_stride,
            layer_stride, decode_query_len, scale,
        ).launch(grid=(num_tokens, num_kv_heads, 1), block=(THREADS, 1, 1), stream=stream)

    return launch


# ---- split decode: more workgroups for small batches -------------------------------------------
NUM_SPLITS = 4                                  # workgroups per (token, KV head)
SPLIT_SLOTS_PER_WAVE = TOPK // (NUM_SPLITS * NUM_WAVES)   # 1 selected block per wave


@functools.lru_cache(maxsize=None)
def compile_sparse_decode_split(dtype: str = "bf16", group: int = GROUP_HEADS):
    """Launcher of the split decode: grid (T, Hkv, 4) workgroups, each over 4 of the 16 slots (one
    per wave), writing partial (O, m, l) to `workspace` (float32, T·Hkv·4·8320 bytes, from the
    handler's scratch allocator); then the merge kernel, grid (T, Hkv), combines the 4 partials
    (LSE merge, base 2) and writes the output. Same arguments as `compile_sparse_decode` plus
    `workspace` after `out`. The handler uses it when T·Hkv is small (few workgroups otherwise)."""
    io = IO_DTYPES[dtype]
    compute = COMPUTE_DTYPES[COMPUTE]
    SharedStorage = shared_storage()

    @flyc.kernel(known_block_size=(THREADS, 1, 1))
    def sparse_decode_split_kernel(
        q: fx.Pointer, kv_cache: fx.Pointer, topk_indices: fx.Pointer, block_table: fx.Pointer,
        seq_lens: fx.Pointer, k_scale: fx.Pointer, v_scale: fx.Pointer, layer: fx.Pointer,
        out: fx.Pointer, workspace: fx.Pointer,
        num_tokens: fx.Int32, num_kv_heads: fx.Int32, num_requests: fx.Int32, max_blocks: fx.Int32,
        num_pages: fx.Int32, num_layers: fx.Int32, page_stride: fx.Int64, layer_stride: fx.Int64,
        decode_query_len: fx.Int32, scale: fx.Float32,
    ):
        token = fx.Int32(fx.block_idx.x)
        kv_head = fx.Int32(fx.block_idx.y)
        split = fx.Int32(fx.block_idx.z)
        lds = fx.SharedAllocator().allocate(SharedStorage).peek()
        lds_base = fx.recast_iter(fx.Uint8, lds.buf.ptr)
        req, vis, row_ok = decode_row(token, seq_lens, decode_query_len)
        ops = Operands(q, kv_cache, topk_indices, block_table, k_scale, v_scale, layer, out,
                       num_tokens, num_kv_heads, num_requests, max_blocks, num_pages, num_layers,
                       page_stride, layer_stride, scale)
        attend(ops, compute, io, token, kv_head, req, vis, row_ok, lds_base,
               slots_per_wave=SPLIT_SLOTS_PER_WAVE, split=split, workspace=workspace, num_splits=NUM_SPLITS,
               group=group)

    @flyc.kernel(known_block_size=(THREADS, 1, 1))
    def sparse_decode_merge_kernel(
        workspace: fx.Pointer, v_scale: fx.Pointer, out: fx.Pointer, num_tokens: fx.Int32, num_kv_heads: fx.Int32,
    ):
        # thread tid: head tid // 16, d = 8·(tid % 16) .. +7; with G = 8 waves 2, 3 store nothing
        token = fx.Int32(fx.block_idx.x)
        kv_head = fx.Int32(fx.block_idx.y)
        tid = fx.Int32(fx.thread_idx.x)
        head = tid // 16
        owns = (uniform(tid // 64) * 4 < group) if group < GROUP_HEADS else None
        d0 = (tid % 16) * 8
        ws = buffer_rsrc(workspace, fx.Int64(num_tokens) * fx.Int64(num_kv_heads) * (NUM_SPLITS * PARTIAL_BYTES))
        first = (token * num_kv_heads + kv_head) * NUM_SPLITS * PARTIAL_BYTES
        ms, ls, os_ = [], [], []
        for s in range_constexpr(NUM_SPLITS):
            m, l, o = load_partial(ws, first + s * PARTIAL_BYTES, head, d0)
            ms.append(m)
            ls.append(l)
            os_.append(o)
        _, l_all, o_all = lse_combine(ms, ls, os_)
        num_heads = num_kv_heads * group
        io_bytes = io.width // 8
        out_bytes = fx.Int64(num_tokens) * fx.Int64(num_heads) * (HEAD_DIM * io_bytes)
        out_rsrc = buffer_rsrc(out, owned_bytes(owns, out_bytes))
        out_off = ((token * num_heads + kv_head * group + head) * HEAD_DIM + d0) * io_bytes
        store_values(out_rsrc, out_off, finish(o_all, l_all, fx.Float32(v_scale.load())), io)

    @flyc.jit
    def launch(
        q: fx.Pointer, kv_cache: fx.Pointer, topk_indices: fx.Pointer, block_table: fx.Pointer,
        seq_lens: fx.Pointer, k_scale: fx.Pointer, v_scale: fx.Pointer, layer: fx.Pointer, out: fx.Pointer,
        workspace: fx.Pointer,
        num_tokens: fx.Int32, num_kv_heads: fx.Int32, num_requests: fx.Int32, max_blocks: fx.Int32,
        num_pages: fx.Int32, num_layers: fx.Int32, page_stride: fx.Int64, layer_stride: fx.Int64,
        decode_query_len: fx.Int32, scale: fx.Float32,
        stream: fx.Stream = fx.Stream(None),
    ):
        sparse_decode_split_kernel(
            q, kv_cache, topk_indices, block_table, seq_lens, k_scale, v_scale, layer, out, workspace,
            num_tokens, num_kv_heads, num_requests, max_blocks, num_pages, num_layers, page_stride,
            layer_stride, decode_query_len, scale,
        ).launch(grid=(num_tokens, num_kv_heads, NUM_SPLITS), block=(THREADS, 1, 1), stream=stream)
        sparse_decode_merge_kernel(workspace, v_scale, out, num_tokens, num_kv_heads).launch(
            grid=(num_tokens, num_kv_heads, 1), block=(THREADS, 1, 1), stream=stream)

    return launch


# ---- decode_query_len > 1: the rows of a request share their blocks (union tiles) ---------------
@functools.lru_cache(maxsize=None)
def compile_sparse_decode_union(dtype: str = "bf16", group: int = GROUP_HEADS):
    """Launcher of the union-tile decode for decode_query_len > 1 (MTP / speculative rows): one
    workgroup of 512 threads per 16 consecutive rows (32 for G = 8) and KV head, grid (ceil(T / tile), Hkv); the rows
    of a tile (a request's draft rows, or several requests' when dql < 16) load each block any of
    them selected once (union_tile.py). Products in bf16 as the per-token decode (SPEC §5.5); the
    same arguments as `compile_sparse_decode`. The handler uses it whenever dql > 1."""
    io = IO_DTYPES[dtype]
    compute = COMPUTE_DTYPES[COMPUTE]

    @fx.struct
    class UnionStorage:
        buf: fx.Array[fx.Int32, union_tile.lds_bytes(group) // 4, 16]

    @flyc.kernel(known_block_size=(union_tile.THREADS, 1, 1))
    def sparse_decode_union_kernel(
        q: fx.Pointer, kv_cache: fx.Pointer, topk_indices: fx.Pointer, block_table: fx.Pointer,
        seq_lens: fx.Pointer, k_scale: fx.Pointer, v_scale: fx.Pointer, layer: fx.Pointer,
        out: fx.Pointer,
        num_tokens: fx.Int32, num_kv_heads: fx.Int32, num_requests: fx.Int32, max_blocks: fx.Int32,
        num_pages: fx.Int32, num_layers: fx.Int32, page_stride: fx.Int64, layer_stride: fx.Int64,
        decode_query_len: fx.Int32, scale: fx.Float32,
    ):
        tile = fx.Int32(fx.block_idx.x)
        kv_head = fx.Int32(fx.block_idx.y)
        lds = fx.SharedAllocator().allocate(UnionStorage).peek()
        lds_base = fx.recast_iter(fx.Uint8, lds.buf.ptr)

        def row_of(token):
            return decode_row(token, seq_lens, decode_query_len)

        ops = Operands(q, kv_cache, topk_indices, block_table, k_scale, v_scale, layer, out,
                       num_tokens, num_kv_heads, num_requests, max_blocks, num_pages, num_layers,
                       page_stride, layer_stride, scale)
        union_tile.attend_union(ops, compute, io, tile, kv_head, row_of, lds_base, group=group)

    rows = union_tile.tile_rows(group)

    @flyc.jit
    def launch(
        q: fx.Pointer, kv_cache: fx.Pointer, topk_indices: fx.Pointer, block_table: fx.Pointer,
        seq_lens: fx.Pointer, k_scale: fx.Pointer, v_scale: fx.Pointer, layer: fx.Pointer, out: fx.Pointer,
        num_tokens: fx.Int32, num_kv_heads: fx.Int32, num_requests: fx.Int32, max_blocks: fx.Int32,
        num_pages: fx.Int32, num_layers: fx.Int32, page_stride: fx.Int64, layer_stride: fx.Int64,
        decode_query_len: fx.Int32, scale: fx.Float32,
        stream: fx.Stream = fx.Stream(None),
    ):
        sparse_decode_union_kernel(
            q, kv_cache, topk_indices, block_table, seq_lens, k_scale, v_scale, layer, out,
            num_tokens, num_kv_heads, num_requests, max_blocks, num_pages, num_layers, page_stride,
            layer_stride, decode_query_len, scale,
        ).launch(grid=((num_tokens + rows - 1) // rows, num_kv_heads, 1),
                 block=(union_tile.THREADS, 1, 1), stream=stream)

    return launch


def placeholders_split(dtype: str = "bf16", group: int = GROUP_HEADS):
    base = placeholders(dtype)
    return base[:9] + (flyc.from_c_void_p(fx.Float32, None, assumed_align=16),) + base[9:]


def placeholders(dtype: str = "bf16", group: int = GROUP_HEADS):
    """Arguments for flyc.compile without a GPU (null pointers, dummy scalars)."""
    io = IO_DTYPES[dtype]
    ptr = flyc.from_c_void_p
    return (
        ptr(io, None, assumed_align=16), ptr(fx.Uint8, None, assumed_align=16),
        ptr(fx.Int32, None, assumed_align=4), ptr(fx.Int32, None, assumed_align=4),
        ptr(fx.Int32, None, assumed_align=4), ptr(fx.Float32, None, assumed_align=4),
        ptr(fx.Float32, None, assumed_align=4), ptr(fx.Int32, None, assumed_align=4),
        ptr(io, None, assumed_align=16),
        fx.Int32(1), fx.Int32(1), fx.Int32(1), fx.Int32(1), fx.Int32(1), fx.Int32(1),
        fx.Int64(1), fx.Int64(1), fx.Int32(1), fx.Float32(1.0),
    )
