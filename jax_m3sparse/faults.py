"""check_inputs: reports the data faults of SPEC §7 a serving engine wants to know about."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jax_m3sparse import _checks
from jax_m3sparse.nvfp4 import GLOBAL_SCALE_MAX, GLOBAL_SCALE_MIN

BLOCK_SIZE = 128  # N, the one block size the kernels serve (SPEC §1)


def check_inputs(*, topk_indices=None, block_table=None, num_pages=None, seq_lens=None,
                 cu_seqlens_q=None, num_tokens=None, slot_mapping=None, k_scale=None,
                 v_scale=None, layer=None, num_layers=None, query_req_id=None,
                 query_abs_pos=None):
    """Checks engine inputs for data faults (SPEC §7); every argument is optional.

    Every fault found is reported, not only the first. Eagerly (concrete inputs) this raises
    ``jax.experimental.checkify.JaxRuntimeError`` with one line per fault; inside
    ``jax.jit`` wrap the caller in ``checkify.checkify`` and call ``err.throw()``: the
    message then lists each check with ``True`` where its fault is present. The kernels
    themselves never fault on these (they give SPEC's defined results); this is the debug
    view.

    Reports:
      * ``topk_indices`` (``int32[Hkv, T, K]``): ids < −1, ids ≥ max_blocks (with
        ``block_table``), and duplicate ids within a row (−1 excluded).
      * ``block_table``: entries < −1 (−1 is "no page"); with ``num_pages``: entries ≥ num_pages.
      * ``query_req_id`` / ``query_abs_pos`` (``int32[T]``, :func:`select_blocks`' rows) with
        ``block_table``: a live row (request in ``[0, R)``, position ≥ 0) whose position is past
        what its request's row covers (max_blocks·128 tokens: its selection stops at the last
        block), or whose own block (position // 128) has no page (−1). Rows with a request
        outside ``[0, R)`` or a negative position are padding by definition (SPEC §8 step 1)
        and are not reported.
      * ``seq_lens`` (``int32[R_dec]``, the first rows of ``block_table``): negative lengths;
        with ``block_table``, lengths beyond what the request's row covers (max_blocks·128)
        and rows with no page (−1) in a block the sequence covers.
      * ``cu_seqlens_q``: ``cu[0] != 0`` or a decrease; with ``num_tokens`` (static int, the
        padded prefill rows: ``query_token_positions``' ``num_tokens``, or
        ``build_attention_metadata``'s minus its decode rows), ``cu[R] > num_tokens``, which
        cuts the tokens past ``num_tokens``.
      * ``slot_mapping`` with ``num_pages``: slots ≥ P·N (N = 128).
      * ``k_scale``/``v_scale``: g outside ``[2^-126, 2^126]`` (≤ 0, NaN, ±Inf, subnormal, or
        1/g subnormal), which packs NaN groups (SPEC §2.2 step 5, docs/spec_decisions.md).
      * ``layer`` with ``num_layers``: a layer outside ``[0, L)`` (attention reads nothing,
        pack writes nothing, SPEC §3.3).
      * Any index array given as NumPy with values outside int32 (JAX would wrap them to 32 bits,
        SPEC §7); then nothing else is checked.
    """
    faults = []  # (fault present: bool scalar, message, {name: value shown in the message})

    def add(bad, message, **values):
        faults.append((bad, message, values))

    # NumPy index arrays past int32 would wrap when JAX converts them: report, then check no further
    for name, x in (("topk_indices", topk_indices), ("block_table", block_table),
                    ("seq_lens", seq_lens), ("cu_seqlens_q", cu_seqlens_q),
                    ("slot_mapping", slot_mapping), ("query_req_id", query_req_id),
                    ("query_abs_pos", query_abs_pos)):
        try:
            if x is not None:
                _checks.index_arrays(**{name: x})
        except ValueError as e:
            add(True, str(e).replace("{", "{{").replace("}", "}}"))
    if faults:
        return _report(faults)

    if topk_indices is not None:
        ids = jnp.asarray(topk_indices)
        add(jnp.any(ids < -1), "topk_indices has ids < -1 (min {m})", m=jnp.min(ids, initial=0))
        if block_table is not None:
            m = jnp.asarray(block_table).shape[1]
            add(jnp.any(ids >= m), f"topk_indices has ids >= max_blocks = {m} (max {{x}})",
                x=jnp.max(ids, initial=-1))
        s = jnp.sort(ids, axis=-1)
        dup = (s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)
        add(jnp.any(dup), "topk_indices has {n} duplicate ids within a row", n=jnp.sum(dup))
    if block_table is not None:
        bt = jnp.asarray(block_table)
        add(jnp.any(bt < -1), "block_table has pages < -1 (min {m})", m=jnp.min(bt, initial=0))
        if num_pages is not None:
            add(jnp.any(bt >= num_pages), f"block_table has pages >= num_pages = {num_pages}")
        if query_req_id is not None and query_abs_pos is not None:
            req, pos = jnp.asarray(query_req_id), jnp.asarray(query_abs_pos)
            cover = bt.shape[1] * BLOCK_SIZE
            real = (req >= 0) & (req < bt.shape[0])
            past = real & (pos >= cover)
            add(jnp.any(past), f"query_abs_pos is past what a block_table row covers "
                f"(max_blocks·{BLOCK_SIZE} = {cover} tokens) in {{n}} live rows", n=jnp.sum(past))
            live = real & (pos >= 0) & ~past
            own = bt[jnp.clip(req, 0, bt.shape[0] - 1), jnp.clip(pos // BLOCK_SIZE, 0, bt.shape[1] - 1)]
            nopage = live & (own < 0)
            add(jnp.any(nopage), "{n} live rows' own block has no page (-1): their keys were never "
                "written", n=jnp.sum(nopage))
    if seq_lens is not None:
        sl = jnp.asarray(seq_lens)
        add(jnp.any(sl < 0), "seq_lens has negative lengths")
        if block_table is not None:
            bt = jnp.asarray(block_table)[:sl.shape[0]]
            cover = bt.shape[1] * BLOCK_SIZE
            add(jnp.any(sl > cover), f"seq_lens exceeds what a block_table row covers "
                f"(max_blocks·{BLOCK_SIZE} = {cover} tokens; max seq_len {{x}})",
                x=jnp.max(sl, initial=0))
            blocks = (jnp.clip(sl, 0, cover) + BLOCK_SIZE - 1) // BLOCK_SIZE
            needed = jnp.arange(bt.shape[1])[None, :] < blocks[:, None]
            add(jnp.any(needed & (bt < 0)), "block_table has no page (-1) in {n} blocks that "
                "seq_lens covers", n=jnp.sum(needed & (bt < 0)))
    if cu_seqlens_q is not None:
        cu = jnp.asarray(cu_seqlens_q)
        add(cu[0] != 0, "cu_seqlens_q[0] must be 0, got {c}", c=cu[0])
        add(jnp.any(cu[1:] < cu[:-1]), "cu_seqlens_q is not non-decreasing")
        if num_tokens is not None:
            add(cu[-1] > num_tokens, f"cu_seqlens_q[R] = {{c}} exceeds num_tokens = {num_tokens}: "
                "the tokens past it are cut", c=cu[-1])
    if slot_mapping is not None and num_pages is not None:
        add(jnp.any(jnp.asarray(slot_mapping) >= num_pages * BLOCK_SIZE),
            f"slot_mapping has slots >= num_pages·{BLOCK_SIZE} = {num_pages * BLOCK_SIZE}")
    if layer is not None and num_layers is not None:
        lyr = jnp.asarray(layer)
        add((lyr < 0) | (lyr >= num_layers), f"layer must be in [0, {num_layers}), got {{x}}",
            x=lyr)
    for name, g in (("k_scale", k_scale), ("v_scale", v_scale)):
        if g is not None:
            g = jnp.asarray(g, jnp.float32)
            ok = (g >= jnp.float32(GLOBAL_SCALE_MIN)) & (g <= jnp.float32(GLOBAL_SCALE_MAX))
            add(~ok, f"{name} must be finite and > 0, in [2^-126, 2^126] (g and 1/g normal "
                f"numbers), got {{g}}", g=g)
    _report(faults)


def _report(faults):
    if not faults:
        return
    if not any(isinstance(x, jax.core.Tracer) for bad, _, values in faults
               for x in (bad, *values.values())):
        found = [message.format(**{k: np.asarray(v) for k, v in values.items()})
                 for bad, message, values in faults if bool(bad)]
        if found:
            raise checkify.JaxRuntimeError("check_inputs found " + "; ".join(found))
        return
    # Traced: one check whose message shows every check's flag (checkify keeps one error).
    parts, kwargs = [], {}
    for i, (bad, message, values) in enumerate(faults):
        renamed = {f"{k}_{i}": v for k, v in values.items()}
        for k in values:
            message = message.replace("{" + k + "}", "{" + f"{k}_{i}" + "}")
        parts.append(f"[{{bad_{i}}}] {message}")
        kwargs.update(renamed, **{f"bad_{i}": bad})
    checkify.check(~jnp.any(jnp.stack([jnp.asarray(b) for b, _, _ in faults])),
                   "check_inputs found faults ([True] = present): " + "; ".join(parts), **kwargs)
