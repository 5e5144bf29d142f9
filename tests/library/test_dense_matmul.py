"""dense_matmul (SPEC §11): against a float64 oracle within the fp32 summation bound, bf16
output as the fp32 result rounded, vmap, the scan over
stacked weights the example runs, export with the CUDA lowering (and its K % 64 rule), and
trace-time errors. The CUDA kernel against the same oracle, and its rows' independence of the
batch (XLA's CPU dot, the reference here, picks its summation order by shape): tests/cuda/
test_gpu.py."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import oracle  # tests/support/

import jax_m3sparse as m3


def operands(rng, M, N, K):
    lhs = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(N, K)) / np.sqrt(K), jnp.bfloat16)
    return lhs, rhs


@pytest.mark.parametrize("M,N,K", [(1, 16, 64), (4, 100, 384), (33, 48, 1024), (0, 8, 64)])
def test_matches_oracle(rng, M, N, K):
    lhs, rhs = operands(rng, M, N, K)
    got = np.asarray(jax.jit(m3.dense_matmul)(lhs, rhs))
    want, bound = oracle.dense_matmul(lhs, rhs)
    assert got.shape == (M, N) and got.dtype == np.float32
    assert np.all(np.abs(got - want) <= bound)
    bf = np.asarray(m3.dense_matmul(lhs, rhs, out_dtype=jnp.bfloat16))
    np.testing.assert_array_equal(bf, got.astype(ml_dtypes.bfloat16))


def test_vmap_scan_and_export(rng):
    lhs, rhs = operands(rng, 3, 32, 128)
    stack = jnp.stack([rhs, 2 * rhs])
    want = np.asarray(m3.dense_matmul(lhs, rhs))
    got = jax.vmap(m3.dense_matmul, in_axes=(None, 0))(lhs, stack)
    np.testing.assert_array_equal(np.asarray(got[0]), want)
    scanned = jax.jit(lambda x, ws: jax.lax.scan(
        lambda c, w: (c, m3.dense_matmul(x, w)), 0, ws)[1])(lhs, stack)
    np.testing.assert_array_equal(np.asarray(scanned), np.asarray(got))
    exp = jax.export.export(jax.jit(m3.dense_matmul), platforms=["cpu", "cuda"],
                            disabled_checks=m3.export_disabled_checks())(lhs, rhs)
    assert "m3sparse_dense_matmul_cuda" in exp.mlir_module()
    with pytest.raises(ValueError, match=r"% 64 == 0"):
        jax.export.export(jax.jit(m3.dense_matmul), platforms=["cuda"],
                          disabled_checks=m3.export_disabled_checks())(lhs[:, :96], rhs[:, :96])


@pytest.mark.parametrize("call,error,match", [
    (lambda: m3.dense_matmul(jnp.zeros((4, 64)), jnp.zeros((8, 64), jnp.bfloat16)), TypeError,
     "lhs must be"),
    (lambda: m3.dense_matmul(jnp.zeros((4, 64), jnp.bfloat16), jnp.zeros((8, 64))), TypeError,
     "rhs must be"),
    (lambda: m3.dense_matmul(jnp.zeros((4, 64, 1), jnp.bfloat16), jnp.zeros((8, 64), jnp.bfloat16)),
     ValueError, "rank 2"),
    (lambda: m3.dense_matmul(jnp.zeros((4, 64), jnp.bfloat16), jnp.zeros((8, 32), jnp.bfloat16)),
     ValueError, "share K"),
    (lambda: m3.dense_matmul(jnp.zeros((4, 64), jnp.bfloat16), jnp.zeros((8, 64), jnp.bfloat16),
                             out_dtype=jnp.float16), ValueError, "out_dtype"),
])
def test_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()
