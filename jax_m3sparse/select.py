"""MiniMax M3's indexer block selection (SPEC §8), under its historical module name.

:func:`select_blocks` is the primitive of :mod:`jax_m3sparse.ops.select` (native kernels);
:func:`indexer_block_scores` and :func:`top_blocks`, the two halves of its pure-JAX reference,
come from :mod:`jax_m3sparse.reference` (the examples score their own keys with them).
"""

from jax_m3sparse.ops.select import select_blocks
from jax_m3sparse.reference import indexer_block_scores, top_blocks

__all__ = ["indexer_block_scores", "select_blocks", "top_blocks"]
