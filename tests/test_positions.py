"""query_token_positions (SPEC §4)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
        cu = rng.integers(-5, 40, 7).astype(np.int32)  # not monotonic: still defined, equal
        ctx = rng.integers(-100, 100, 6).astype(np.int32)
        a = m3.query_token_positions(cu, ctx, 32)
        b = reference.query_token_positions(cu, ctx, 32)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_errors():
    with pytest.raises(ValueError, match="cu_seqlens_q: length \\(R \\+ 1 for context_lens \\[R\\]\\) must be 3, got 2"):
        m3.query_token_positions(jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), 4)
    with pytest.raises(TypeError, match="num_tokens must be a static int"):
        m3.query_token_positions(jnp.zeros(2, jnp.int32), jnp.zeros(1, jnp.int32), 4.5)
