"""check_inputs: reports the data faults of SPEC §7 a serving engine wants to know about."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import checkify


def check_inputs(*, topk_indices=None, block_table=None, num_pages=None, seq_lens=None,
                 cu_seqlens_q=None, slot_mapping=None, k_scale=None, v_scale=None):
    """Checks engine inputs for data faults (SPEC §7); every argument is optional.

    Eagerly this raises ``jax.experimental.checkify.JaxRuntimeError`` at the first fault;
    inside ``jax.jit`` wrap the caller in ``checkify.checkify`` and call ``err.throw()``.
    The kernels themselves never fault on these (they give SPEC's defined results); this
    is the debug view.

    Reports:
      * ``topk_indices`` (``int32[Hkv, T, K]``): ids < −1, ids ≥ max_blocks (with
        ``block_table``), and duplicate ids within a row (−1 excluded).
      * ``block_table`` with ``num_pages``: entries ≥ num_pages (−1 is "no page").
      * ``seq_lens``: negative lengths.
      * ``cu_seqlens_q``: ``cu[0] != 0`` or a decrease.
      * ``slot_mapping`` with ``num_pages`` and ``block_table``'s N=128: slots ≥ P·N.
      * ``k_scale``/``v_scale``: g ≤ 0 or not finite (SPEC §2.2 step 5).
    """
    if topk_indices is not None:
        ids = jnp.asarray(topk_indices)
        checkify.check(jnp.all(ids >= -1), "topk_indices has ids < -1 (min {m})", m=jnp.min(ids))
        if block_table is not None:
            m = jnp.asarray(block_table).shape[1]
            checkify.check(jnp.all(ids < m), f"topk_indices has ids >= max_blocks = {m} (max {{x}})",
                           x=jnp.max(ids))
        s = jnp.sort(ids, axis=-1)
        dup = (s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)
        checkify.check(~jnp.any(dup), "topk_indices has {n} duplicate ids within a row",
                       n=jnp.sum(dup))
    if block_table is not None and num_pages is not None:
        bt = jnp.asarray(block_table)
        checkify.check(jnp.all(bt < num_pages), f"block_table has pages >= num_pages = {num_pages}")
    if seq_lens is not None:
        checkify.check(jnp.all(jnp.asarray(seq_lens) >= 0), "seq_lens has negative lengths")
    if cu_seqlens_q is not None:
        cu = jnp.asarray(cu_seqlens_q)
        checkify.check(cu[0] == 0, "cu_seqlens_q[0] must be 0, got {c}", c=cu[0])
        checkify.check(jnp.all(cu[1:] >= cu[:-1]), "cu_seqlens_q is not non-decreasing")
    if slot_mapping is not None and num_pages is not None:
        checkify.check(jnp.all(jnp.asarray(slot_mapping) < num_pages * 128),
                       f"slot_mapping has slots >= num_pages·128 = {num_pages * 128}")
    for name, g in (("k_scale", k_scale), ("v_scale", v_scale)):
        if g is not None:
            g = jnp.asarray(g, jnp.float32)
            checkify.check((g > 0) & jnp.isfinite(g), f"{name} must be finite and > 0, got {{g}}",
                           g=g)
