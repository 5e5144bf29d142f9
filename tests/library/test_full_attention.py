"""full_attention (SPEC §5.7) against the float64 oracle with every block selected; its CPU
lowering (the CPU attention kernels), reference, jit/vmap/export, sharding-free errors.
The CUDA kernel: tests/cuda/test_gpu.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_m3sparse as m3
from jax_m3sparse import reference
from jax_m3sparse.ops.full import workspace_shape

import oracle
from attention_checks import assert_close
from attention_problems import decode_problem, prefill_problem


def every_block(p):
    """The oracle's top-k list for full attention: every logical block of the table."""
    Hkv = p.cache.shape[-3] // 2
    M = p.block_table.shape[1]
    return np.broadcast_to(np.arange(M, dtype=np.int32), (Hkv, len(p.req), M))


def want(p, **kw):
    return oracle.attention(np.asarray(p.q, np.float32), p.cache, every_block(p), p.block_table,
                            p.req, p.pos, p.k_scale, p.v_scale, **kw)


def run(p, fn=m3.full_attention, **kw):
    return np.asarray(jax.jit(lambda *a: fn(*a, **kw))(
        p.q, p.cache, p.block_table, p.req, p.pos, p.k_scale, p.v_scale), np.float64)


@pytest.mark.parametrize("fn", [m3.full_attention, reference.full_attention])
@pytest.mark.parametrize("Hkv,G", [(1, 8), (2, 4)])
def test_prefill_chunks_and_padding(rng, fn, Hkv, G):
    """Chunks of three requests (block boundaries, a shared page, NaN bytes past the end of each
    request's keys) and padding rows: every key up to each token's position."""
    p = prefill_problem(rng, Hkv, G, [5, 130, 1], [300, 130, 257], pad=3)
    out = run(p, fn)
    assert_close(out, want(p))
    assert (out[-3:] == 0).all()


@pytest.mark.parametrize("fn", [m3.full_attention, reference.full_attention])
def test_decode_rows_through_token_rows(rng, fn):
    """Decode rows (speculative ones too) given by their (request, position)."""
    p = decode_problem(rng, 1, 16, [129, 1, 700], dql=2)
    assert_close(run(p, fn), want(p))


def test_faults_give_defined_results(rng):
    """Invalid pages, a request id past R, a negative position: skipped keys, zero rows."""
    p = prefill_problem(rng, 1, 8, [4, 3], [300, 200])
    p.block_table[0, 1] = -1                      # a hole in request 0's pages
    p.block_table[1, 0] = 10**6                    # an out-of-range page
    p.req[0] = 7                                   # past R: padding
    p.pos[1] = -5                                  # a negative position: padding
    out = run(p)
    assert_close(out, want(p))
    assert (out[:2] == 0).all()


def test_request_ids_past_r_and_an_empty_table_attend_nothing(rng):
    """A request id ≥ R is padding (SPEC §5.7), as < 0 is; a table without columns attends
    nothing (not an error about a top-k size the op does not take)."""
    p = prefill_problem(rng, 1, 8, [3], [200])
    p.req[1] = 1                                  # R = 1
    out = run(p)
    assert (out[1] == 0).all() and (out[[0, 2]] != 0).any()
    empty = np.asarray(m3.full_attention(p.q, p.cache, p.block_table[:, :0], p.req, p.pos,
                                         0.75, 0.85))
    assert empty.shape == p.q.shape and (empty == 0).all()


def test_equals_sparse_prefill_with_every_block(rng):
    """The CPU lowering is sparse_prefill over every block: the same bits."""
    p = prefill_problem(rng, 2, 4, [7, 2], [400, 129])
    full = run(p)
    sparse = np.asarray(m3.sparse_prefill(p.q, p.cache, every_block(p), p.block_table, p.req,
                                          p.pos, p.k_scale, p.v_scale), np.float64)
    np.testing.assert_array_equal(full, sparse)


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_5d_cache_traced_layer(rng, layout):
    p = prefill_problem(rng, 1, 8, [3], [260], num_layers=3, layout=layout, layer=2,
                        fill_layers=False)
    fn = jax.jit(lambda q, c, layer: m3.full_attention(q, c, p.block_table, p.req, p.pos,
                                                       0.75, 0.85, layer=layer, layout=layout))
    assert_close(np.asarray(fn(p.q, p.cache, jnp.int32(2)), np.float64),
                 want(p, layer=2, layout=layout))
    assert (np.asarray(fn(p.q, p.cache, jnp.int32(3))) == 0).all()   # layer outside [0, L)


def test_jit_export_vmap(rng):
    p = prefill_problem(rng, 1, 8, [3], [260], dtype=jnp.bfloat16)
    args = (p.q, p.cache, p.block_table, p.req, p.pos)
    fn = lambda q, c, b, r, s: m3.full_attention(q, c, b, r, s, 0.75, 0.85)
    shape = jax.eval_shape(fn, *args)
    assert shape.shape == p.q.shape and shape.dtype == p.q.dtype
    exp = jax.export.export(jax.jit(fn), platforms=["cpu", "cuda"],
                            disabled_checks=m3.export_disabled_checks())(*args)
    assert "@m3sparse_full_attention_cuda" in exp.mlir_module()
    again = jax.export.deserialize(exp.serialize())
    cpu = jax.devices("cpu")[0]
    np.testing.assert_array_equal(np.asarray(again.call(*[jax.device_put(a, cpu) for a in args])),
                                  np.asarray(fn(*args)))
    qs = np.stack([p.q, -p.q])
    out = jax.vmap(fn, in_axes=(0, None, None, None, None))(qs, *args[1:])
    for b in range(2):
        np.testing.assert_array_equal(np.asarray(out[b]), np.asarray(fn(qs[b], *args[1:])))


def test_workspace_only_where_parts_get_their_own_ctas():
    """[Hkv, T, parts, state] for short batches at long context (parts of 32 blocks), else a
    stub; KV heads first either way (sharded with them)."""
    assert workspace_shape(8, 1, 1024) == (1, 8, 32, 2080)      # 8 requests at 128k
    assert workspace_shape(128, 1, 128) == (1, 128, 4, 2080)    # 128 requests at 16k
    assert workspace_shape(2048, 1, 1024) == (1, 1)             # a long prefill chunk
    assert workspace_shape(8, 2, 32) == (2, 1)                  # one part: nothing to merge


def test_trace_time_errors(rng):
    p = prefill_problem(rng, 2, 4, [3], [260])
    q, c, b, r, s = p.q, p.cache, p.block_table, p.req, p.pos
    full = m3.full_attention
    cases = [
        (ValueError, r"q must have rank 3", lambda: full(q.reshape(3, -1), c, b, r, s, 1.0, 1.0)),
        (TypeError, "q must be float32 or bfloat16 or float16, got int32",
         lambda: full(q.astype(np.int32), c, b, r, s, 1.0, 1.0)),
        (ValueError, r"query_abs_pos: length \(T of q\) must be 3, got 2",
         lambda: full(q, c, b, r, s[:2], 1.0, 1.0)),
        (TypeError, "query_req_id must be int32", lambda: full(q, c, b, r.astype(np.float32), s,
                                                               1.0, 1.0)),
        (ValueError, "num_heads \\(5\\) must be a positive multiple of num_kv_heads \\(2\\)",
         lambda: full(q[:, :5], c, b, r, s, 1.0, 1.0)),
        (ValueError, "layer is required for a 5-D kv_cache", lambda: full(q, c[None], b, r, s,
                                                                          1.0, 1.0)),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()
    with pytest.raises(NotImplementedError, match="inference-only"):
        jax.grad(lambda x: full(x, c, b, r, s, 1.0, 1.0).sum())(q)
    with pytest.raises(ValueError, match=r"cuda \(sm_90\) kernels take q in bfloat16"):
        jax.jit(lambda *a: full(*a, 1.0, 1.0)).trace(q, c, b, r, s).lower(
            lowering_platforms=("cuda",))
