"""Sparse NVFP4 prefill attention for gfx950 (SPEC §5.2, §5.4, §5.5), fp16 MFMA compute, union tiles.

Compiled variants: `sparse_prefill_bf16`, `sparse_prefill_f16`, `sparse_prefill_f32` (the q / out dtype; the products are
computed in fp16 either way, SPEC §5.5), and the same for G = 8 (M3 at TP8) as `sparse_prefill_g8_<dtype>`.
Launcher arguments, in order:

    q            bf16|f16|f32 [T, Hq, D]            Hq = Hkv·G, D = 128, G = 16 (or 8: the *_g8_* variants)
    kv_cache     uint8, SPEC §3 (4-D, or 5-D LBHNC / BLHNC)
    topk_indices int32 [Hkv, T, K]              per-token selection, K = 16, -1 = unused
    block_table  int32 [R, M]
    query_req_id int32 [T]                      SPEC §4; < 0 marks a padding token (zero output)
    query_abs_pos int32 [T]                     SPEC §4
    k_scale, v_scale  float32 []
    layer        int32 []
    out          q's dtype [T, Hq, D]
    num_tokens T, num_kv_heads Hkv, num_requests R, max_blocks M, num_pages P, num_layers L (int32),
    page_stride, layer_stride (int64 bytes), scale (float32), stream.

One workgroup of 8 waves per (tile of 16 consecutive tokens, or 32 for G = 8, KV head), grid =
(ceil(T / tile), Hkv):
the tokens of a tile share every block any of them selected, loaded and dequantized once
(union_tile.py has the algorithm, the mapping and the masking). Per token (SPEC §5.4):
r = query_req_id[t] (a padding token, r < 0 or r >= R, attends nothing and writes exact zeros),
pos = query_abs_pos[t], vis = pos + 1; slot validity as SPEC §5.2. A tile may hold tokens of
several requests: the union is over (request, block) pairs.
NVFP4 -> fp16: v_cvt_scalef32_pk_f16_fp4 with a unit scale (exact e2m1 in fp16), then one exact
v_pk_mul_f16 by the E4M3 block scale (converted exactly to fp16); e2m1·e4m3 in [2^-10, 2688]
with at most 6 significant bits is exact in fp16 (SPEC §2.1). QK and PV with
v_mfma_f32_16x16x32_f16, fp32 accumulation, base-2 online softmax with v_exp_f32, k_scale folded
into the logit scale, v_scale applied in the epilogue.
"""

import functools

import flydsl.compiler as flyc
import flydsl.expr as fx

from attention_core import COMPUTE_DTYPES, IO_DTYPES, Operands
from common import GROUP_HEADS
from union_tile import THREADS, attend_union, lds_bytes, tile_rows

COMPUTE = "f16"             # SPEC §5.5: the gfx950 prefill computes the products in fp16


@functools.lru_cache(maxsize=None)
def compile_sparse_prefill(dtype: str = "f16", group: int = GROUP_HEADS):
    """Launcher for q/out dtype `dtype` ("bf16", "f16" or "f32") and G = `group` (16 or 8); products in fp16."""
    io = IO_DTYPES[dtype]
    compute = COMPUTE_DTYPES[COMPUTE]

    @fx.struct
    class SharedStorage:
        buf: fx.Array[fx.Int32, lds_bytes(group) // 4, 16]

    @flyc.kernel(known_block_size=(THREADS, 1, 1))
    def sparse_prefill_kernel(
        q: fx.Pointer, kv_cache: fx.Pointer, topk_indices: fx.Pointer, block_table: fx.Pointer,
        query_req_id: fx.Pointer, query_abs_pos: fx.Pointer, k_scale: fx.Pointer, v_scale: fx.Pointer,
        layer: fx.Pointer, out: fx.Pointer,
        num_tokens: fx.Int32, num_kv_heads: fx.Int32, num_requests: fx.Int32, max_blocks: fx.Int32,
        num_pages: fx.Int32, num_layers: fx.Int32, page_stride: fx.Int64, layer_stride: fx.Int64,
        scale: fx.Float32,
    ):
        tile = fx.Int32(fx.block_idx.x)
        kv_head = fx.Int32(fx.block_idx.y)
        lds = fx.SharedAllocator().allocate(SharedStorage).peek()
        lds_base = fx.recast_iter(fx.Uint8, lds.buf.ptr)

        def row_of(token):
            # SPEC §5.4: request and absolute position from the §4 metadata; r < 0 is padding.
            req_raw = fx.Int32(query_req_id[token])
            row_ok = (req_raw >= 0) & (req_raw < num_requests)
            return row_ok.select(req_raw, 0), fx.Int32(query_abs_pos[token]) + 1, row_ok

        ops = Operands(q, kv_cache, topk_indices, block_table, k_scale, v_scale, layer, out,
                       num_tokens, num_kv_heads, num_requests, max_blocks, num_pages, num_layers,
                       page_stride, layer_stride, scale)
        attend_union(ops, compute, io, tile, kv_head, row_of, lds_base, group=group)

    rows = tile_rows(group)

    @flyc.jit
    def launch(
        q: fx.Pointer, kv_cache: fx.Pointer, topk_indices: fx.Pointer, block_table: fx.Pointer,
        query_req_id: fx.Pointer, query_abs_pos: fx.Pointer, k_scale: fx.Pointer, v_scale: fx.Pointer,
        layer: fx.Pointer, out: fx.Pointer,
        num_tokens: fx.Int32, num_kv_heads: fx.Int32, num_requests: fx.Int32, max_blocks: fx.Int32,
        num_pages: fx.Int32, num_layers: fx.Int32, page_stride: fx.Int64, layer_stride: fx.Int64,
        scale: fx.Float32,
        stream: fx.Stream = fx.Stream(None),
    ):
        sparse_prefill_kernel(
            q, kv_cache, topk_indices, block_table, query_req_id, query_abs_pos, k_scale, v_scale, layer,
            out, num_tokens, num_kv_heads, num_requests, max_blocks, num_pages, num_layers, page_stride,
            layer_stride, scale,
        ).launch(grid=((num_tokens + rows - 1) // rows, num_kv_heads, 1), block=(THREADS, 1, 1),
                 stream=stream)

    return launch


def placeholders(dtype: str = "f16", group: int = GROUP_HEADS):
    """Arguments for flyc.compile without a GPU (null pointers, dummy scalars)."""
    io = IO_DTYPES[dtype]
    ptr = flyc.from_c_void_p
    return (
        ptr(io, None, assumed_align=16), ptr(fx.Uint8, None, assumed_align=16),
        ptr(fx.Int32, None, assumed_align=4), ptr(fx.Int32, None, assumed_align=4),
        ptr(fx.Int32, None, assumed_align=4), ptr(fx.Int32, None, assumed_align=4),
        ptr(fx.Float32, None, assumed_align=4), ptr(fx.Float32, None, assumed_align=4),
        ptr(fx.Int32, None, assumed_align=4), ptr(io, None, assumed_align=16),
        fx.Int32(1), fx.Int32(1), fx.Int32(1), fx.Int32(1), fx.Int32(1), fx.Int32(1),
        fx.Int64(1), fx.Int64(1), fx.Float32(1.0),
    )
