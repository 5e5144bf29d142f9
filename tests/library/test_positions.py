"""query_token_positions (SPEC §4)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_m3sparse as m3
from jax_m3sparse import reference

import oracle

IMPLS = {"native": m3.query_token_positions, "reference": reference.query_token_positions}


@pytest.mark.parametrize("impl", list(IMPLS))
def test_context_plus_queries(impl):
    req, pos = IMPLS[impl](jnp.array([0, 5], jnp.int32), jnp.array([300], jnp.int32), 5)
    assert list(np.asarray(pos)) == [300, 301, 302, 303, 304] and not np.asarray(req).any()


@pytest.mark.parametrize("impl", list(IMPLS))
def test_zero_length_requests_and_padding(rng, impl):
    qlens = np.array([3, 0, 0, 4, 1, 0], np.int32)
    cu = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    ctx = rng.integers(0, 5000, len(qlens)).astype(np.int32)
    req, pos = jax.jit(IMPLS[impl], static_argnums=2)(cu, ctx, 12)
    want_req, want_pos = oracle.positions(cu, ctx, 12)
    np.testing.assert_array_equal(np.asarray(req), want_req)
    np.testing.assert_array_equal(np.asarray(pos), want_pos)
    assert list(np.asarray(req)[8:]) == [-1] * 4 and list(np.asarray(pos)[8:]) == [-1] * 4
    assert 1 not in np.asarray(req) and 2 not in np.asarray(req)


def test_native_matches_reference_on_garbage(rng):
    for _ in range(5):
        # not monotonic: still defined, equal (jax.Arrays: data, so cu[R] > 32 is no error)
        cu = jnp.asarray(rng.integers(-5, 40, 7).astype(np.int32))
        ctx = jnp.asarray(rng.integers(-100, 100, 6).astype(np.int32))
        a = m3.query_token_positions(cu, ctx, 32)
        b = reference.query_token_positions(cu, ctx, 32)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_errors():
    with pytest.raises(ValueError, match="cu_seqlens_q: length \\(R \\+ 1 for context_lens \\[R\\]\\) must be 3, got 2"):
        m3.query_token_positions(jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), 4)
    with pytest.raises(TypeError, match="num_tokens must be a static int"):
        m3.query_token_positions(jnp.zeros(2, jnp.int32), jnp.zeros(1, jnp.int32), 4.5)


def test_static_tokens_that_do_not_fit_are_an_error():
    """Static (Python / NumPy) values that num_tokens would silently cut raise at trace time,
    naming the argument and the size needed."""
    with pytest.raises(ValueError, match=r"num_tokens must be >= cu_seqlens_q\[R\] = 12 .* got 10"):
        m3.query_token_positions(np.array([0, 5, 12], np.int32), np.zeros(2, np.int32), 10)
    table = np.zeros((2, 4), np.int32)
    with pytest.raises(ValueError, match=r"num_tokens must be >= 51 .*50 prefill tokens.* got 8"):
        m3.build_attention_metadata([1, 50], [99, 0], table, num_decode_requests=1, num_tokens=8)
    with pytest.raises(ValueError, match=r"num_tokens must be >= 56 .*got 55"):
        m3.build_attention_metadata(np.array([3, 0, 50], np.int32), np.array([99, 0, 7], np.int32),
                                    np.zeros((3, 4), np.int32), num_decode_requests=2,
                                    num_tokens=55, decode_query_len=3)
    meta = m3.build_attention_metadata([1, 50], [99, 0], table, num_decode_requests=1, num_tokens=51)
    assert list(np.asarray(meta.query_req_id)) == [1] * 50


def test_traced_tokens_that_do_not_fit_are_cut_and_reported():
    """Traced, the same values keep SPEC §4's result for the rows there are (the tokens past
    num_tokens are cut), and check_inputs reports it, eagerly and under checkify (SPEC §7)."""
    cu, ctx = np.array([0, 5, 12], np.int32), np.array([100, 200], np.int32)
    req, pos = jax.jit(m3.query_token_positions, static_argnums=2)(cu, ctx, 10)
    want_req, want_pos = oracle.positions(cu, ctx, 10)
    np.testing.assert_array_equal(np.asarray(req), want_req)
    np.testing.assert_array_equal(np.asarray(pos), want_pos)
    assert list(np.asarray(pos)) == [100, 101, 102, 103, 104, 200, 201, 202, 203, 204]

    build = jax.jit(lambda q, c: m3.build_attention_metadata(
        q, c, np.zeros((2, 4), np.int32), num_decode_requests=1, num_tokens=8))
    meta = build(np.array([1, 50], np.int32), np.array([99, 0], np.int32))
    assert list(np.asarray(meta.query_req_id)) == [1] * 7
    assert list(np.asarray(meta.query_abs_pos)) == list(range(7))

    with pytest.raises(checkify.JaxRuntimeError, match=r"cu_seqlens_q\[R\] = 12 exceeds num_tokens = 10"):
        m3.check_inputs(cu_seqlens_q=jnp.asarray(cu), num_tokens=10)
    m3.check_inputs(cu_seqlens_q=jnp.asarray(cu), num_tokens=12)  # fits: nothing to report
    err, _ = jax.jit(checkify.checkify(lambda c: m3.check_inputs(cu_seqlens_q=c, num_tokens=10)))(cu)
    with pytest.raises(checkify.JaxRuntimeError, match=r"\[True\] cu_seqlens_q\[R\] = 12 exceeds"):
        err.throw()


def test_metadata_token_rows_cover_every_row():
    """SparseAttentionMetadata.token_rows: decode rows (dql 2: request t // 2, positions
    seq_len − 2 and seq_len − 1; a padded decode request's rows at −1) then the prefill
    tokens, written out by hand here; the same under jit."""
    bt = np.array([[5, 0, 9, -1], [1, 2, 3, 4], [6, 7, 8, -1]], np.int32)
    meta = m3.build_attention_metadata(np.array([2, 0, 5], np.int32),
                                       np.array([298, 0, 400], np.int32), bt,
                                       num_decode_requests=2, num_tokens=10, decode_query_len=2)
    want_req = [0, 0, 1, 1, 2, 2, 2, 2, 2, -1]
    want_pos = [298, 299, -1, -1, 400, 401, 402, 403, 404, -1]
    for req, pos in (meta.token_rows(), jax.jit(lambda m: m.token_rows())(meta)):
        np.testing.assert_array_equal(np.asarray(req)[np.asarray(pos) >= 0],
                                      np.array(want_req)[np.array(want_pos) >= 0])
        np.testing.assert_array_equal(np.asarray(pos), want_pos)
