"""route_experts (SPEC §10): every field against the pure-Python oracle (tests/support/oracle.py:
the choice by (key desc, id asc) with NaN as −inf and ±0 tied, the weights summed in choice order, the stable
grouping with padding tokens last), on ties, NaN, ±0, bias, padding rows and k up to 8; the
jnp reference bit for bit; a token's fields independent of its batch; vmap, export (the CUDA
lowering, and its size limit) and trace-time errors. The CUDA kernel against the same oracle:
tests/cuda/test_gpu.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle  # tests/support/

import jax_m3sparse as m3
from jax_m3sparse import reference


def check(got, want):
    for name, g, w in zip(m3.ExpertRouting._fields, got, want):
        np.testing.assert_array_equal(np.asarray(g), w, err_msg=name)


@pytest.mark.parametrize("T,E,k", [(0, 8, 2), (1, 128, 4), (5, 3, 3), (37, 16, 4), (129, 130, 8),
                                   (300, 64, 1), (64, 128, 4)])
@pytest.mark.parametrize("ties", [False, True])
def test_matches_oracle(rng, T, E, k, ties):
    scores = oracle.route_scores(rng, T, E, ties)
    bias = (rng.normal(size=E) * 0.1).astype(np.float32)
    if ties:
        bias = np.round(bias * 8) / 8
    live = rng.uniform(size=T) > 0.2
    got = jax.jit(lambda s, b, l: m3.route_experts(s, k, bias=b, live=l))(scores, bias, live)
    check(got, oracle.route_experts(scores, bias, live, k))
    check(reference.route_experts(scores, k, bias=bias, live=live),
          oracle.route_experts(scores, bias, live, k))


def test_defaults_and_no_renormalize(rng):
    scores = oracle.route_scores(rng, 20, 32)
    got = m3.route_experts(scores, 4, renormalize=False)
    check(got, oracle.route_experts(scores, np.zeros(32, np.float32), np.ones(20, bool), 4, renormalize=False))
    np.testing.assert_array_equal(np.asarray(got.weights),
                                  np.take_along_axis(scores, np.asarray(got.experts), 1))
    assert int(np.sum(got.group_sizes)) == 20 * 4


def test_padding_rows_join_no_group(rng):
    """Tokens that are not live are placed last and counted in no group; the live tokens'
    fields equal those of the batch without them."""
    scores = oracle.route_scores(rng, 12, 16)
    live = np.array([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1], bool)
    got = m3.route_experts(scores, 3, live=live)
    n_live = int(live.sum()) * 3
    assert int(np.sum(got.group_sizes)) == n_live
    assert set(np.asarray(got.sorted_tokens[n_live:])) == set(np.flatnonzero(~live))
    alone = m3.route_experts(scores[live], 3)
    np.testing.assert_array_equal(np.asarray(got.group_sizes), np.asarray(alone.group_sizes))
    np.testing.assert_array_equal(np.asarray(got.sorted_tokens[:n_live]),
                                  np.flatnonzero(live)[np.asarray(alone.sorted_tokens)])
    np.testing.assert_array_equal(np.asarray(got.weights[live]), np.asarray(alone.weights))


def test_token_fields_do_not_depend_on_the_batch(rng):
    scores = oracle.route_scores(rng, 50, 128, ties=True)
    whole = m3.route_experts(scores, 4)
    part = m3.route_experts(scores[17:23], 4)
    for name in ("weights", "experts"):
        np.testing.assert_array_equal(np.asarray(getattr(whole, name)[17:23]),
                                      np.asarray(getattr(part, name)))


def test_vmap_and_export(rng):
    scores = jnp.asarray(oracle.route_scores(rng, 2 * 9, 16).reshape(2, 9, 16))
    got = jax.vmap(lambda s: m3.route_experts(s, 2))(scores)
    for b in range(2):
        check([x[b] for x in got], oracle.route_experts(scores[b], np.zeros(16, np.float32), np.ones(9, bool), 2))
    exp = jax.export.export(jax.jit(lambda s: m3.route_experts(s, 4)), platforms=["cpu", "cuda", "rocm"],
                            disabled_checks=m3.export_disabled_checks())(scores[0])
    assert exp.platforms == ("cpu", "cuda", "rocm")
    assert "m3sparse_route_experts_cuda" in exp.mlir_module()
    assert "m3sparse_route_experts_rocm" in exp.mlir_module()
    # the ExpertRouting result survives serialization (a registered namedtuple)
    back = jax.export.deserialize(exp.serialize()).call(scores[0])
    assert isinstance(back, m3.ExpertRouting)
    check(back, oracle.route_experts(scores[0], np.zeros(16, np.float32), np.ones(9, bool), 4))
    wide = jnp.zeros((4, 600), jnp.float32)
    with pytest.raises(ValueError, match="E <= 512"):
        jax.export.export(jax.jit(lambda s: m3.route_experts(s, 4)), platforms=["cuda"],
                          disabled_checks=m3.export_disabled_checks())(wide)


@pytest.mark.parametrize("call,error,match", [
    (lambda: m3.route_experts(jnp.zeros((4, 8), jnp.bfloat16), 2), TypeError, "scores must be"),
    (lambda: m3.route_experts(jnp.zeros((4, 8, 1)), 2), ValueError, "rank 2"),
    (lambda: m3.route_experts(jnp.zeros((4, 8)), 9), ValueError, "k must be <= E"),
    (lambda: m3.route_experts(jnp.zeros((4, 8)), 0), ValueError, "k must be >= 1"),
    (lambda: m3.route_experts(jnp.zeros((4, 8)), 2.0), TypeError, "static int"),
    (lambda: m3.route_experts(jnp.zeros((4, 8)), 2, bias=jnp.zeros(7)), ValueError, "bias"),
    (lambda: m3.route_experts(jnp.zeros((4, 8)), 2, live=jnp.ones(4, jnp.int32)), TypeError,
     "live must be bool"),
    (lambda: m3.route_experts(jnp.zeros((4, 8)), 2, live=jnp.ones(5, bool)), ValueError, "live"),
])
def test_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()
