"""full_attention: attention of tokens over every key of their request up to their position
(SPEC §5.7) — MiniMax M3's full-attention layers over the same NVFP4 paged cache."""

from __future__ import annotations

import jax.numpy as jnp
from jax.core import ShapedArray

from jax_m3sparse import _checks, reference
from jax_m3sparse._partitioning import ResultAxis
from jax_m3sparse._primitives import HeadAxes, define_primitive, f32, i64
from jax_m3sparse.ops._attention_common import check_attention, platform_reason
from jax_m3sparse.ops.prefill import sparse_prefill_p

# The CUDA kernel splits rows into parts of PART_BLOCKS blocks and keeps a part's softmax state
# in 16 x 128 + 2 x 16 floats (kStateFloats, ffi/cuda/m3sparse_cuda.h). Where the rows' parts
# fit _MAX_WORKSPACE_STATES states (34 MB), each part gets its own CTA and a merge folds them
# (short batches at long context fill the GPU); beyond it each row's CTA folds its parts in turn.
# Both give the same bits (ffi/cuda/attention.cu). The part size is one constant: a row's bits
# depend on it, so it must not follow the batch. The gfx950 kernel (ffi/flydsl/full_attention.py)
# has its own constant, parts of 16 blocks, and keeps its states in XLA scratch memory: on rocm the
# workspace result is not written and `part_blocks` is not read.
PART_BLOCKS = 32
_STATE_FLOATS = 16 * 128 + 2 * 16
_MAX_WORKSPACE_STATES = 4096


def workspace_shape(num_tokens: int, num_kv_heads: int, max_blocks: int,
                    part_blocks: int = PART_BLOCKS) -> tuple[int, ...]:
    """The CUDA kernel's fp32 scratch for these static shapes: ``[Hkv, T, parts, state]`` when
    the rows' parts go to their own CTAs, else ``[Hkv, 1]`` (KV heads first: it is sharded
    with them)."""
    parts = -(-max_blocks // part_blocks)
    if parts >= 2 and num_tokens * num_kv_heads * parts <= _MAX_WORKSPACE_STATES:
        return (num_kv_heads, num_tokens, parts, _STATE_FLOATS)
    return (num_kv_heads, 1)


def _abstract_eval(q, kv_cache, block_table, query_req_id, query_abs_pos, k_scale, v_scale,
                   layer, *, scale, layout, workspace_shape, part_blocks):
    return q.update(weak_type=False), ShapedArray(workspace_shape, jnp.float32)


def _cpu_lowering(q, kv_cache, block_table, query_req_id, query_abs_pos, k_scale, v_scale,
                  layer, *, scale, layout, workspace_shape, part_blocks):
    """The CPU kernels serve any K: sparse_prefill with every block selected."""
    topk = reference.all_blocks(kv_cache.shape[-3] // 2, q.shape[0], block_table.shape[1])
    out = sparse_prefill_p.bind(q, kv_cache, topk, block_table, query_req_id, query_abs_pos,
                                k_scale, v_scale, layer, scale=scale, layout=layout)
    return out, jnp.zeros(workspace_shape, jnp.float32)   # never read: XLA drops it


def _platform_reason(platform, q, kv_cache, *_, **__):
    return platform_reason(platform, q, kv_cache, None)   # no K: every block is attended


full_attention_p = define_primitive(
    "full_attention",
    abstract_eval=_abstract_eval,
    reference=reference.full_impl,
    multiple_results=True,
    attributes=lambda scale, layout, workspace_shape, part_blocks: {
        "scale": f32(scale), "layout": i64(layout), "part_blocks": i64(part_blocks)},
    platform_reason=_platform_reason,
    native_platforms=("cuda", "rocm"),
    lowerings={"cpu": _cpu_lowering},
    # KV heads: cache head slots (2h, 2h+1), q/out axis 1, the workspace axis 0.
    head_axes=HeadAxes(operands=(-2, -3, None, None, None, None, None, None),
                       results=(0, ResultAxis(0)), cache=1),
)


def full_attention(q, kv_cache, block_table, query_req_id, query_abs_pos, k_scale, v_scale, *,
                   scale=None, layer=None, layout=None):
    """Attention of each token over every key of its request at positions ≤ its own (SPEC §5.7).

    What M3's full-attention layers compute: :func:`sparse_prefill` with every block of the
    request selected, without a top-k list (cost follows each request's own context). Decode
    rows work the same way: give their request and position, e.g. from a mixed batch's
    ``SparseAttentionMetadata.token_rows()``.

    Args:
      q: ``[T, Hq, D]`` float32/bfloat16/float16 (the cuda kernels: bfloat16/float16; the rocm
        kernels: D = 128 and G = Hq / Hkv of 16 or 8).
      kv_cache: ``uint8`` NVFP4 cache, 4-D or 5-D (see :func:`pack_kv_pages`). Only read.
      block_table: ``int32[R, max_blocks]``; rows indexed by ``query_req_id``; entries outside
        ``[0, P)`` are skipped.
      query_req_id, query_abs_pos: ``int32[T]`` (a request < 0 or ≥ R, or a negative
        position: a padding row, zero output).
      k_scale, v_scale: fp32 scalar global scales (operands, may be traced).
      scale: static softmax scale, default ``D ** -0.5``.
      layer, layout: as :func:`sparse_prefill`.

    Returns:
      ``[T, Hq, D]`` in q's dtype (SPEC §5.5); rows with no attended key are exact zeros.
      CPU: the CPU attention kernels with every block selected; CUDA: a kernel splitting each
      row into parts of 32 blocks folded in a fixed order (bits independent of the batch);
      rocm (gfx950): FlyDSL kernels, parts of 16 blocks (bf16 products) folded in part order, bits
      independent of the batch — run on an ISA emulator only, never on an AMD GPU.
      Inference-only (SPEC §7).

    Raises:
      ValueError / TypeError at trace time, as :func:`sparse_prefill`.
    """
    q, kv_cache, block_table, query_req_id, query_abs_pos = _checks.index_arrays(
        q=q, kv_cache=kv_cache, block_table=block_table, query_req_id=query_req_id,
        query_abs_pos=query_abs_pos)
    layer_op, code, scale = check_attention(q, kv_cache, None, block_table, layer, layout, scale)
    if block_table.shape[1] == 0:      # no block in any request: nothing can be attended
        return jnp.zeros(q.shape, q.dtype)
    for name, x in (("query_req_id", query_req_id), ("query_abs_pos", query_abs_pos)):
        _checks.rank(x, name, 1, "[T]")
        _checks.dtype(x, name, (jnp.int32,))
        _checks.dim(name, "length (T of q)", q.shape[0], x.shape[0])
    return bind(q, kv_cache, block_table, query_req_id, query_abs_pos,
                _checks.scalar(k_scale, "k_scale", jnp.float32),
                _checks.scalar(v_scale, "v_scale", jnp.float32), layer_op, scale=scale,
                layout=code)


def bind(q, kv_cache, block_table, query_req_id, query_abs_pos, k_scale, v_scale, layer, *,
         scale, layout, part_blocks=PART_BLOCKS, workspace=None):
    """The primitive on checked operands (``layer`` an int32 scalar, ``layout`` its code);
    returns ``out``. ``part_blocks`` and ``workspace`` (a workspace shape; ``(Hkv, 1)``: one CTA
    per row) choose the CUDA kernel's parts and launch shape — for the tests and benchmarks that
    compare them; the bits depend on ``part_blocks`` only. The rocm kernel ignores both."""
    shape = workspace or workspace_shape(q.shape[0], kv_cache.shape[-3] // 2,
                                         block_table.shape[1], part_blocks)
    return full_attention_p.bind(q, kv_cache, block_table, query_req_id, query_abs_pos, k_scale,
                                 v_scale, layer, scale=scale, layout=layout,
                                 workspace_shape=shape, part_blocks=part_blocks)[0]
