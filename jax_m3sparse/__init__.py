"""jax_m3sparse: MiniMax M3 block-sparse attention over an NVFP4 paged KV cache, for JAX.

Public API (SPEC.md sections in each docstring):

* NVFP4: :func:`nvfp4_quantize`, :func:`nvfp4_dequantize` (SPEC §2)
* cache: :class:`KVCacheSpec`, :func:`allocate_kv_cache`, :func:`pack_kv_pages`,
  :func:`unpack_kv_pages` (SPEC §3)
* metadata: :func:`query_token_positions` (SPEC §4), :class:`SparseAttentionMetadata`,
  :func:`build_attention_metadata`
* attention: :func:`sparse_decode`, :func:`sparse_prefill`, :func:`sparse_attention` (SPEC §5),
  :func:`full_attention` (every key up to the position: M3's full layers, SPEC §5.7)
* MiniMax M3's indexer: :func:`allocate_index_cache`, :func:`write_index_keys` (SPEC §8.1),
  :func:`select_blocks` (SPEC §8)
* the routed experts' matmuls: :func:`grouped_matmul` (SPEC §9), bf16 or MXFP8 weights
  (:func:`mxfp8_quantize`, :func:`mxfp8_dequantize`, SPEC §9.1), MXFP4 or NVFP4 weights
  (:func:`mxfp4_quantize`, :func:`nvfp4_quantize`, :func:`fp4_dequantize`, SPEC §9.3)
* a decode step's dense projections: :func:`dense_matmul` (SPEC §11)
* geometry and faults: :func:`unsupported_reason` (SPEC §1), :func:`check_inputs` (SPEC §7)
* :func:`export_disabled_checks` for ``jax.export`` of functions that call these ops
* :mod:`jax_m3sparse.sharding`: PartitionSpecs and KV-head replication for many devices
* :func:`native_platforms`: which platforms run the compiled modules (the others the reference);
  :func:`native_module`: a platform's module and why it did not load;
  :func:`cpu_attention_paths`: which CPU attention path (generic, avx2, avx512, amx) runs
* :mod:`jax_m3sparse.reference`: pure-jnp versions of all of these.

The ops are inference-only: they have no derivative (SPEC §7).
"""

from jax_m3sparse import reference, sharding
from jax_m3sparse._ffi import (NativeModuleWarning, cpu_attention_paths, export_disabled_checks,
                               native_module, native_platforms)
from jax_m3sparse.faults import check_inputs
from jax_m3sparse.metadata import SparseAttentionMetadata, build_attention_metadata
from jax_m3sparse.mxfp4 import fp4_dequantize, mxfp4_quantize
from jax_m3sparse.mxfp8 import mxfp8_dequantize, mxfp8_quantize
from jax_m3sparse.nvfp4 import nvfp4_dequantize, nvfp4_quantize
from jax_m3sparse.ops.attention import sparse_attention
from jax_m3sparse.ops.decode import sparse_decode
from jax_m3sparse.ops.full import full_attention
from jax_m3sparse.ops.dense_matmul import dense_matmul
from jax_m3sparse.ops.grouped_matmul import grouped_matmul
from jax_m3sparse.ops.pack import pack_kv_pages, unpack_kv_pages
from jax_m3sparse.ops.positions import query_token_positions
from jax_m3sparse.ops.prefill import sparse_prefill
from jax_m3sparse.ops.route import ExpertRouting, route_experts
from jax_m3sparse.ops.index_keys import write_index_keys
from jax_m3sparse.ops.select import select_blocks
from jax_m3sparse.spec import KVCacheSpec, allocate_index_cache, allocate_kv_cache, unsupported_reason

__version__ = "0.1.0"

__all__ = [
    "ExpertRouting", "KVCacheSpec", "NativeModuleWarning", "SparseAttentionMetadata",
    "allocate_index_cache", "allocate_kv_cache", "build_attention_metadata", "check_inputs", "cpu_attention_paths",
    "dense_matmul", "export_disabled_checks", "fp4_dequantize", "full_attention", "grouped_matmul",
    "mxfp4_quantize", "mxfp8_dequantize", "mxfp8_quantize", "native_module", "native_platforms",
    "nvfp4_dequantize", "nvfp4_quantize", "pack_kv_pages", "query_token_positions", "reference",
    "route_experts", "select_blocks", "sharding", "sparse_attention", "sparse_decode",
    "sparse_prefill", "unpack_kv_pages", "unsupported_reason", "write_index_keys",
]
