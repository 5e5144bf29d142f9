"""check_inputs (SPEC §7) and unsupported_reason (SPEC §1)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_m3sparse as m3


def test_check_inputs_passes_clean_inputs():
    m3.check_inputs(topk_indices=np.array([[[0, 2, -1]]], np.int32),
                    block_table=np.array([[3, 1, 0]], np.int32), num_pages=4,
                    seq_lens=np.array([300], np.int32), cu_seqlens_q=np.array([0, 2, 2, 5], np.int32),
                    slot_mapping=np.array([-1, 5, 511], np.int32), k_scale=0.5, v_scale=1.0,
                    query_req_id=np.array([0, 0, -1, 1], np.int32),    # -1, 1 (≥ R): padding
                    query_abs_pos=np.array([0, 383, 9999, 9999], np.int32))


@pytest.mark.parametrize("kwargs,message", [
    (dict(topk_indices=np.array([[[0, -7]]], np.int32)), "ids < -1"),
    (dict(topk_indices=np.array([[[0, 3]]], np.int32), block_table=np.zeros((1, 3), np.int32)),
     "ids >= max_blocks = 3"),
    (dict(topk_indices=np.array([[[1, 2, 1]]], np.int32)), "1 duplicate ids"),
    (dict(block_table=np.array([[0, 9]], np.int32), num_pages=4), "pages >= num_pages = 4"),
    (dict(block_table=np.array([[0, -7]], np.int32)), "pages < -1 \\(min -7\\)"),
    (dict(block_table=np.zeros((2, 3), np.int32), query_req_id=np.array([0, 1, 2, -1], np.int32),
          query_abs_pos=np.array([383, 384, 999, 999], np.int32)),
     "past what a block_table row covers \\(max_blocks·128 = 384 tokens\\) in 1 live rows"),
    (dict(block_table=np.array([[3, -1, 0]], np.int32), query_req_id=np.array([0, 0, 0], np.int32),
          query_abs_pos=np.array([5, 130, 300], np.int32)),
     "1 live rows' own block has no page \\(-1\\)"),
    (dict(seq_lens=np.array([5, -1], np.int32)), "negative lengths"),
    (dict(cu_seqlens_q=np.array([0, 4, 2], np.int32)), "not non-decreasing"),
    (dict(cu_seqlens_q=np.array([1, 4], np.int32)), "cu_seqlens_q\\[0\\] must be 0"),
    (dict(slot_mapping=np.array([0, 512], np.int32), num_pages=4), "slots >= num_pages·128 = 512"),
    (dict(block_table=np.array([[0, 2 ** 32 - 7]], np.int64), num_pages=16),
     r"block_table has values outside int32 \(\[0, 4294967289\]\)"),
    (dict(slot_mapping=np.array([5, 2 ** 40], np.int64), num_pages=16),
     "slot_mapping has values outside int32"),
    (dict(k_scale=0.0), "k_scale must be finite and > 0"),
    (dict(v_scale=np.inf), "v_scale must be finite and > 0"),
])
def test_check_inputs_reports(kwargs, message):
    with pytest.raises(checkify.JaxRuntimeError, match=message):
        m3.check_inputs(**kwargs)


def test_check_inputs_under_jit_with_checkify():
    f = checkify.checkify(jax.jit(lambda t: m3.check_inputs(topk_indices=t)))
    err, _ = f(jnp.array([[[0, 1]]], jnp.int32))
    assert err.get() is None
    err, _ = f(jnp.array([[[1, 1]]], jnp.int32))
    assert "duplicate" in err.get()


def test_unsupported_reason():
    assert m3.unsupported_reason(64, 4, 128, 16, 128) is None
    assert m3.unsupported_reason(8, 1, 128, 16, 128, "cpu") is None
    assert m3.unsupported_reason(64, 4, 128, 16, 128, "rocm") is None
    assert m3.unsupported_reason(32, 4, 128, 16, 128, "rocm") is None      # G = 8 (M3 at TP8)
    assert m3.unsupported_reason(64, 4, 128, 16, 128, "cuda") is None
    why = m3.unsupported_reason(16, 4, 64, 8, 128, "rocm")
    assert why == ("the rocm (gfx950) kernels cannot serve this geometry: head_dim must be 128 "
                   "(got 64); num_heads / num_kv_heads must be one of [8, 16] (got 4); topk_blocks must be 16 "
                   "(got 8).")
    why = m3.unsupported_reason(6, 4, 100, 0, 64)
    assert "num_heads (6) must be a positive multiple of num_kv_heads (4)" in why
    assert "head_dim must be a multiple of 32 (got 100)" in why
    assert "topk_blocks must be >= 1 (got 0)" in why and "block_size must be 128 (got 64)" in why
