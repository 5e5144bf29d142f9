"""grouped_matmul (SPEC §9) through the public API on the CPU (its native kernel,
ffi/cpu/grouped_matmul.cc, with the module built; the reference lowering — a product per group,
rows selected — without it and for an MXFP8 lhs) against a float64 NumPy loop over the groups
(tests/support/oracle.py); the size rules for data-dependent group_sizes; the epilogue (§9 item
6); trace-time errors; jit, vmap and the CUDA lowering's custom call.
The CUDA kernel itself: tests/cuda/test_gpu.py and tests/cuda/grouped_harness.cu."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_m3sparse as m3

import oracle


def operands(rng, M, K, G, N):
    lhs = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(G, N, K)), jnp.bfloat16)
    return lhs, rhs


@pytest.mark.parametrize("sizes", [
    [3, 0, 5, 2],        # covers M exactly, one empty group
    [4, 4, 0, 0],        # rows after the last group: 0
    [2, -3, 20, 1],      # a negative size counts 0; rows past M dropped
    [0, 0, 0, 0],        # nothing covered
])
def test_matches_oracle(rng, sizes):
    lhs, rhs, = operands(rng, 10, 24, 4, 16)
    got = np.asarray(jax.jit(m3.grouped_matmul)(lhs, rhs, jnp.asarray(sizes, jnp.int32)))
    want = oracle.grouped_matmul(lhs, rhs, sizes)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert not np.any(got[np.all(want == 0, axis=1)])   # uncovered rows are exact zeros


def test_non_finite_weights_stay_in_their_group(rng):
    """SPEC §9 step 3: a NaN / inf in one group's matrix (an empty group's included) reaches only
    that group's rows; bf16 and MXFP8 (an exponent of 255 is NaN)."""
    lhs, rhs = operands(rng, 4, 64, 3, 8)
    bad = rhs.at[1, 0, 0].set(jnp.nan).at[2, 1, 0].set(jnp.inf)
    for sizes in ([2, 2, 0], [4, 0, 0]):
        got = np.asarray(m3.grouped_matmul(lhs, bad, jnp.asarray(sizes, jnp.int32)))
        want = oracle.grouped_matmul(lhs, rhs, sizes)
        np.testing.assert_allclose(got[:sizes[0]], want[:sizes[0]], rtol=1e-5, atol=1e-4)
        assert np.isnan(got[sizes[0]:, 0]).all() and np.isfinite(got[sizes[0]:, 1:]).all()
    data, scale = m3.mxfp8_quantize(rhs)
    got = np.asarray(m3.grouped_matmul(lhs, data, jnp.asarray([4, 0, 0], jnp.int32),
                                       scale.at[1].set(255)))
    assert np.isfinite(got).all()


@pytest.mark.parametrize("rows", [
    [3, 0, 0, 7, 2, 9, 1, 5],      # repeats, any order
    [-1, 4, 10, 2, 99, 0, 6, 3],   # ids outside [0, T): zero rows
])
def test_gathered_rows(rng, rows):
    """SPEC §9 item 4: lhs_rows reads lhs[lhs_rows[i]] as row i — the oracle on the gathered
    rows, bit-equal to passing the gathered copy, M from lhs_rows (not lhs)."""
    lhs, rhs = operands(rng, 10, 24, 3, 16)
    sizes = jnp.asarray([3, 0, 4], jnp.int32)
    rows = jnp.asarray(rows, jnp.int32)
    got = np.asarray(jax.jit(lambda a, r: m3.grouped_matmul(a, rhs, sizes, lhs_rows=r))(lhs, rows))
    want = oracle.grouped_matmul(lhs, rhs, sizes, lhs_rows=rows)
    assert got.shape == (8, 16)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    ok = (rows >= 0) & (rows < 10)
    copy = jnp.where(ok[:, None], lhs[jnp.clip(rows, 0, 9)], 0).astype(jnp.bfloat16)
    np.testing.assert_array_equal(got, np.asarray(m3.grouped_matmul(copy, rhs, sizes)))
    np.testing.assert_allclose(
        got, np.asarray(m3.reference.grouped_matmul(lhs, rhs, sizes, lhs_rows=rows)),
        rtol=1e-6, atol=1e-5)
    with pytest.raises((TypeError, ValueError), match="lhs_rows"):
        m3.grouped_matmul(lhs, rhs, sizes, lhs_rows=rows.astype(jnp.float32))


def test_bf16_output_is_the_fp32_result_rounded(rng):
    """SPEC §9 item 5: out_dtype bfloat16 is the float32 call rounded to nearest even (with
    gathered rows and MXFP8 weights too); other dtypes are refused."""
    lhs, rhs = operands(rng, 12, 64, 3, 16)
    sizes = jnp.asarray([5, 0, 6], jnp.int32)
    rows = jnp.asarray([3, 1, 1, 11, 0, 7, 9, 2, 4, 20, 5, 6], jnp.int32)
    for w in ((rhs,), m3.mxfp8_quantize(rhs)):
        for kw in ({}, {"lhs_rows": rows}):
            f32 = m3.grouped_matmul(lhs, *w[:1], sizes, *w[1:], **kw)
            bf16 = jax.jit(lambda a: m3.grouped_matmul(a, *w[:1], sizes, *w[1:], **kw,
                                                       out_dtype=jnp.bfloat16))(lhs)
            assert bf16.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(bf16), np.asarray(f32.astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match="out_dtype"):
        m3.grouped_matmul(lhs, rhs, sizes, out_dtype=jnp.float16)


def test_reference_module_agrees(rng):
    """The reference module and the lowered call agree to fp32 rounding (each backend sums in
    an order of its own, SPEC §9 item 2), and exactly where every sum is exact (small integers)."""
    lhs, rhs = operands(rng, 12, 16, 3, 8)
    sizes = jnp.asarray([5, 0, 7], jnp.int32)
    np.testing.assert_allclose(np.asarray(m3.reference.grouped_matmul(lhs, rhs, sizes)),
                               np.asarray(m3.grouped_matmul(lhs, rhs, sizes)), rtol=1e-6,
                               atol=1e-5)
    small = lambda x: jnp.round(x * 4).astype(jnp.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(m3.reference.grouped_matmul(small(lhs), small(rhs), sizes)),
        np.asarray(m3.grouped_matmul(small(lhs), small(rhs), sizes)))


def test_rows_do_not_depend_on_their_batch(rng):
    """SPEC §9 item 3: a row's result is the same bits alone, in a batch, behind other groups of
    any size and at any place in its group's row tiles (the CPU kernel's tiles of 1-4 rows,
    bf16 and FP4 weights, with the epilogue)."""
    lhs, rhs = operands(rng, 11, 96, 3, 24)     # K = 96: three 32-blocks of MXFP4
    data, scale = m3.mxfp4_quantize(rhs.astype(jnp.float32))
    for w in ((rhs,), (data, scale)):
        for kw in ({}, {"activation": "swiglu_oai", "group_scale": jnp.asarray([0.5, 2, 3.0])}):
            full = np.asarray(m3.grouped_matmul(lhs, w[0], jnp.asarray([2, 7, 2], jnp.int32),
                                                *w[1:], **kw))
            for i in range(11):
                g = 0 if i < 2 else 1 if i < 9 else 2
                alone = [0, 0, 0]
                alone[g] = 1
                one = np.asarray(m3.grouped_matmul(lhs[i:i + 1], w[0], jnp.asarray(
                    alone, jnp.int32), *w[1:], **kw))
                np.testing.assert_array_equal(one[0], full[i])


def test_moe_rows_sorted_by_expert(rng):
    """The use it is made for: (token, expert) pairs sorted by expert, one call per
    projection, equal to each token's experts applied one by one."""
    T, k, E, H, I = 6, 2, 5, 16, 8
    x = rng.normal(size=(T, H)).astype(np.float32)
    w = jnp.asarray(rng.normal(size=(E, I, H)), jnp.bfloat16)
    chosen = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    order = np.argsort(chosen.reshape(-1), kind="stable")
    sizes = np.bincount(chosen.reshape(-1), minlength=E).astype(np.int32)
    rows = jnp.asarray(x[order // k], jnp.bfloat16)
    got = np.asarray(m3.grouped_matmul(rows, w, jnp.asarray(sizes)))
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
    for i, pair in enumerate(order):
        t, e = divmod(int(pair), k)
        np.testing.assert_allclose(got[i], xb[t] @ np.asarray(w[chosen[t, e]], np.float64).T,
                                   rtol=1e-5, atol=1e-4)


def test_vmap(rng):
    lhs, rhs = operands(rng, 8, 16, 2, 8)
    sizes = jnp.asarray([[3, 5], [8, 0], [0, 2]], jnp.int32)
    got = jax.vmap(m3.grouped_matmul, in_axes=(None, None, 0))(lhs, rhs, sizes)
    for b in range(3):
        np.testing.assert_allclose(np.asarray(got[b]), oracle.grouped_matmul(lhs, rhs, sizes[b]),
                                   rtol=1e-5, atol=1e-4)


def test_cuda_lowering_is_the_custom_call(rng):
    """A program lowered for CUDA on this machine calls our kernel (it is exported from
    build boxes without the GPU)."""
    lhs, rhs = operands(rng, 8, 16, 2, 8)
    sizes = jnp.asarray([3, 5], jnp.int32)
    exp = jax.export.export(jax.jit(m3.grouped_matmul), platforms=["cuda"],
                            disabled_checks=m3.export_disabled_checks())(lhs, rhs, sizes)
    assert "m3sparse_grouped_matmul_cuda" in exp.mlir_module()
    with pytest.raises(ValueError, match=r"K \(lhs.shape\[1\]\) % 8 == 0"):
        jax.jit(m3.grouped_matmul).trace(*operands(rng, 8, 12, 2, 8), sizes).lower(
            lowering_platforms=("cuda",))


@pytest.mark.parametrize("args, error, match", [
    (((8, 16), (2, 8, 12), (2,)), ValueError, "must share K"),
    (((8, 16), (3, 8, 16), (2,)), ValueError, "group_sizes: length"),
    (((8, 16, 1), (2, 8, 16), (2,)), ValueError, "lhs must have rank 2"),
    (((8, 16), (8, 16), (2,)), ValueError, "rhs must have rank 3"),
])
def test_shape_errors(args, error, match):
    (ls, rs, gs) = args
    with pytest.raises(error, match=match):
        m3.grouped_matmul(jnp.zeros(ls, jnp.bfloat16), jnp.zeros(rs, jnp.bfloat16),
                          jnp.zeros(gs, jnp.int32))


def test_no_derivative(rng):
    lhs, rhs = operands(rng, 8, 16, 2, 8)
    f = lambda a: jnp.sum(m3.grouped_matmul(a.astype(jnp.bfloat16), rhs,
                                            jnp.asarray([3, 5], jnp.int32)))
    with pytest.raises(NotImplementedError, match="grouped_matmul is inference-only"):
        jax.grad(f)(lhs.astype(jnp.float32))


def test_dtype_errors():
    with pytest.raises((TypeError, ValueError), match="lhs"):
        m3.grouped_matmul(jnp.zeros((8, 16)), jnp.zeros((2, 8, 16), jnp.bfloat16),
                          jnp.zeros(2, jnp.int32))
    with pytest.raises((TypeError, ValueError), match="group_sizes"):
        m3.grouped_matmul(jnp.zeros((8, 16), jnp.bfloat16), jnp.zeros((2, 8, 16), jnp.bfloat16),
                          jnp.zeros(2, jnp.float32))


# ------------------------------------------------------------------ the epilogue (SPEC §9 item 6)
@pytest.mark.parametrize("activation", [None, "swiglu", "swiglu_oai"])
@pytest.mark.parametrize("sizes", [[3, 0, 5, 2], [2, -3, 20, 1], [4, 4, 0, 0]])
def test_epilogue_matches_oracle(rng, activation, sizes):
    """group_scale, the activation and row_scale against float64 per element; uncovered rows
    exact zeros whatever their row scale; gathered rows and bf16 output as without them."""
    lhs, rhs = operands(rng, 10, 24, 4, 16)
    rhs = (rhs * 0.3).astype(jnp.bfloat16)
    sizes = jnp.asarray(sizes, jnp.int32)
    rs = jnp.asarray(rng.uniform(0.2, 2, 10), jnp.float32)
    gs = jnp.asarray(rng.uniform(0.5, 2, 4), jnp.float32)
    f = jax.jit(lambda a, r, g: m3.grouped_matmul(a, rhs, sizes, activation=activation,
                                                  row_scale=r, group_scale=g))
    got = np.asarray(f(lhs, rs, gs))
    want = oracle.grouped_epilogue(oracle.grouped_matmul(lhs, rhs, sizes), sizes, activation,
                                   rs, gs)
    assert got.shape == want.shape == (10, 8 if activation else 16)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    covered = min(int(np.clip(sizes, 0, None).sum()), 10)
    assert not got[covered:].any()
    rows = jnp.asarray([9, 2, 2, 0, 5, 7, 1, 3, 4, 6], jnp.int32)
    gathered = m3.grouped_matmul(lhs, rhs, sizes, lhs_rows=rows, activation=activation,
                                 row_scale=rs, group_scale=gs)
    np.testing.assert_array_equal(np.asarray(gathered), np.asarray(f(lhs[rows], rs, gs)))
    bf16 = m3.grouped_matmul(lhs, rhs, sizes, activation=activation, row_scale=rs,
                             group_scale=gs, out_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(bf16), got.astype(jnp.bfloat16))


def test_epilogue_is_the_plain_product_finished(rng):
    """On the CPU the fused call equals the fp32 call followed by the reference's SwiGLU and the
    scales (the M3 example's unfused arithmetic) to a few fp32 ulps (each backend's exp, SPEC §9
    item 6); the oai activation clamps at its limit and keeps NaN; vmap over the row scales."""
    lhs, rhs = operands(rng, 12, 32, 3, 20)
    sizes = jnp.asarray([4, 5, 3], jnp.int32)
    rs = jnp.asarray(rng.uniform(0.2, 2, 12), jnp.float32)
    plain = m3.grouped_matmul(lhs, rhs, sizes)
    fused = m3.grouped_matmul(lhs, rhs, sizes, activation="swiglu_oai", row_scale=rs)
    want = m3.reference.swiglu(plain[:, :10], plain[:, 10:], "swiglu_oai") * rs[:, None]
    np.testing.assert_allclose(np.asarray(fused), np.asarray(want), rtol=4e-7, atol=1e-30)
    assert np.abs(np.asarray(plain)).max() > 7 and np.abs(np.asarray(fused)).max() <= 8 * 7 * 2
    nan = m3.grouped_matmul(lhs, rhs.at[1, 0, 0].set(jnp.nan), sizes, activation="swiglu_oai")
    assert np.isnan(np.asarray(nan)[4:9, 0]).all() and np.isfinite(np.asarray(nan)[:4]).all()
    batched = jax.vmap(lambda r: m3.grouped_matmul(lhs, rhs, sizes, activation="swiglu",
                                                   row_scale=r))(jnp.stack([rs, 2 * rs]))
    one = m3.grouped_matmul(lhs, rhs, sizes, activation="swiglu", row_scale=rs)
    np.testing.assert_array_equal(np.asarray(batched[0]), np.asarray(one))
    np.testing.assert_allclose(np.asarray(batched[1]), 2 * np.asarray(one), rtol=1e-6)


def test_epilogue_cuda_lowering_and_errors(rng):
    lhs, rhs = operands(rng, 8, 16, 2, 8)
    sizes = jnp.asarray([3, 5], jnp.int32)
    exp = jax.export.export(
        jax.jit(lambda a: m3.grouped_matmul(a, rhs, sizes, activation="swiglu_oai",
                                            row_scale=jnp.ones(8, jnp.float32))),
        platforms=["cuda"], disabled_checks=m3.export_disabled_checks())(lhs)
    text = exp.mlir_module()
    assert "m3sparse_grouped_matmul_cuda" in text and "activation = 2" in text
    with pytest.raises(ValueError, match="activation must be None, 'swiglu' or 'swiglu_oai'"):
        m3.grouped_matmul(lhs, rhs, sizes, activation="gelu")
    np.testing.assert_array_equal(     # M3's config.json spelling
        np.asarray(m3.grouped_matmul(lhs, rhs, sizes, activation="swigluoai")),
        np.asarray(m3.grouped_matmul(lhs, rhs, sizes, activation="swiglu_oai")))
    with pytest.raises(ValueError, match="N .rhs.shape.1.. must be even"):
        m3.grouped_matmul(lhs, rhs[:, :7], sizes, activation="swiglu")
    with pytest.raises(ValueError, match="row_scale: length"):
        m3.grouped_matmul(lhs, rhs, sizes, row_scale=jnp.ones(7, jnp.float32))
    with pytest.raises(TypeError, match="group_scale must be float32"):
        m3.grouped_matmul(lhs, rhs, sizes, group_scale=jnp.ones(2, jnp.bfloat16))
    with pytest.raises(ValueError, match="group_scale: length"):
        m3.grouped_matmul(lhs, rhs, sizes, group_scale=jnp.ones(3, jnp.float32))


# ------------------------------------------------------------------ MXFP8 weights (SPEC §9.1)
def mxfp8_operands(rng, M, K, G, N, spread=4):
    """bf16 rows and MXFP8 weights whose 32-blocks differ in scale by up to 2^±spread."""
    lhs = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    w = rng.normal(size=(G, N, K // 32, 32)) * 2.0 ** rng.integers(-spread, spread + 1,
                                                                    (G, N, K // 32, 1))
    data, scale = m3.mxfp8_quantize(jnp.asarray(w.reshape(G, N, K), jnp.float32))
    return lhs, data, scale


@pytest.mark.parametrize("sizes", [[3, 0, 5, 2], [2, -3, 20, 1], [0, 0, 0, 0]])
def test_mxfp8_matches_oracle(rng, sizes):
    lhs, data, scale = mxfp8_operands(rng, 10, 64, 4, 16)
    got = np.asarray(jax.jit(m3.grouped_matmul)(lhs, data, jnp.asarray(sizes, jnp.int32), scale))
    want = oracle.grouped_matmul(lhs, data, sizes, rhs_scale=scale)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert not np.any(got[np.all(want == 0, axis=1)])


def test_mxfp8_equals_bf16_on_dequantized_weights(rng):
    """SPEC §9.1: an MXFP8 call is the bf16 call on mxfp8_dequantize(rhs, scale), bit for bit
    (here both through the CPU's lowering; on CUDA tests/cuda checks the kernel)."""
    lhs, data, scale = mxfp8_operands(rng, 16, 96, 3, 24)
    sizes = jnp.asarray([6, 0, 10], jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(m3.grouped_matmul(lhs, data, sizes, scale)),
        np.asarray(m3.grouped_matmul(lhs, m3.mxfp8_dequantize(data, scale), sizes)))
    # every finite E4M3 byte (subnormals included) under small and large exponents: 0 (2^-127:
    # products below 2^-126 are flushed to ±0), 1, 2, 100, 127, 200; lhs one-hot per row, so
    # each output is exactly one weight (the NaN exponent 255 is test_non_finite_weights_...)
    finite = np.setdiff1d(np.arange(256), [0x7F, 0xFF])
    codes = jnp.asarray(rng.choice(finite, (3, 24, 96)), jnp.uint8).view(jnp.float8_e4m3fn)
    edge = jnp.asarray(rng.choice([0, 1, 2, 100, 127, 200], (3, 24, 3)), jnp.uint8)
    one = jnp.zeros((16, 96), jnp.bfloat16).at[jnp.arange(16), rng.integers(0, 96, 16)].set(1)
    got = np.asarray(m3.grouped_matmul(one, codes, sizes, edge))
    np.testing.assert_array_equal(
        got, np.asarray(m3.grouped_matmul(one, m3.mxfp8_dequantize(codes, edge), sizes)))
    assert (got == 0).any() and np.isfinite(got).all() and np.abs(got[got != 0]).min() < 2.0 ** -100


def test_mxfp8_cuda_lowering(rng):
    lhs, data, scale = mxfp8_operands(rng, 8, 128, 2, 8)
    sizes = jnp.asarray([3, 5], jnp.int32)
    exp = jax.export.export(jax.jit(m3.grouped_matmul), platforms=["cuda"],
                            disabled_checks=m3.export_disabled_checks())(lhs, data, sizes, scale)
    text = exp.mlir_module()
    assert "m3sparse_grouped_matmul_cuda" in text and "f8E4M3FN" in text
    with pytest.raises(ValueError, match=r"% 128 == 0 for MXFP8"):
        jax.jit(m3.grouped_matmul).trace(*mxfp8_operands(rng, 8, 96, 2, 8)[:2], sizes,
                                         mxfp8_operands(rng, 8, 96, 2, 8)[2]).lower(
            lowering_platforms=("cuda",))


def test_mxfp8_argument_errors(rng):
    lhs, data, scale = mxfp8_operands(rng, 8, 64, 2, 8)
    sizes = jnp.asarray([3, 5], jnp.int32)
    with pytest.raises(ValueError, match="pass rhs_scale"):
        m3.grouped_matmul(lhs, data, sizes)
    with pytest.raises(ValueError, match="rhs_scale=None"):
        m3.grouped_matmul(lhs, m3.mxfp8_dequantize(data, scale), sizes, scale)
    with pytest.raises(ValueError, match=r"rhs_scale must be \[G, N, K/32\]"):
        m3.grouped_matmul(lhs, data, sizes, scale[:, :, :1])
    with pytest.raises(TypeError, match="rhs_scale must be uint8"):
        m3.grouped_matmul(lhs, data, sizes, scale.astype(jnp.int32))


# --------------------------------------------------- MXFP8 rows and weights (SPEC §9.2, W8A8)
def w8a8_operands(rng, M, K, G, N):
    """MXFP8 rows (each 32-block at its own scale, as mxfp8_quantize makes activations) and
    MXFP8 weights."""
    x = rng.normal(size=(M, K // 32, 32)) * 2.0 ** rng.integers(-3, 4, (M, K // 32, 1))
    a8, ae = m3.mxfp8_quantize(jnp.asarray(x.reshape(M, K), jnp.float32))
    _, data, scale = mxfp8_operands(rng, M, K, G, N)
    return a8, ae, data, scale


@pytest.mark.parametrize("sizes", [[3, 0, 5, 2], [2, -3, 20, 1], [0, 0, 0, 0]])
def test_mxfp8_rows_match_oracle(rng, sizes):
    a8, ae, data, scale = w8a8_operands(rng, 10, 64, 4, 16)
    got = np.asarray(jax.jit(lambda *a: m3.grouped_matmul(*a[:4], lhs_scale=a[4]))(
        a8, data, jnp.asarray(sizes, jnp.int32), scale, ae))
    want = oracle.grouped_matmul(a8, data, sizes, rhs_scale=scale, lhs_scale=ae)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * max(np.abs(want).max(), 1))
    assert not np.any(got[np.all(want == 0, axis=1)])


def test_mxfp8_rows_are_the_dequantized_products(rng):
    """SPEC §9.2: the products of the bf16 call on both dequantized operands (on the CPU an
    MXFP8 lhs lowers to the reference, which dequantizes: bit for bit with it, and to fp32
    rounding with the native bf16 call; the CUDA kernel sums the 32-blocks in another order)."""
    a8, ae, data, scale = w8a8_operands(rng, 16, 96, 3, 24)
    sizes = jnp.asarray([6, 0, 10], jnp.int32)
    got = np.asarray(m3.grouped_matmul(a8, data, sizes, scale, lhs_scale=ae))
    a = m3.mxfp8_dequantize(a8, ae)
    np.testing.assert_array_equal(got, np.asarray(m3.reference.grouped_matmul(a, data, sizes, scale)))
    np.testing.assert_allclose(got, np.asarray(m3.grouped_matmul(a, data, sizes, scale)),
                               rtol=1e-6, atol=1e-5)


def test_mxfp8_rows_gathered(rng):
    """lhs_rows with an MXFP8 lhs: the rows and their exponents gathered together (the scale
    is [T, K/32], one row per token)."""
    a8, ae, data, scale = w8a8_operands(rng, 6, 64, 2, 8)
    rows = jnp.asarray([5, 0, 7, 2, 2, -1, 3, 1], jnp.int32)     # 7 and -1: zero rows
    sizes = jnp.asarray([3, 5], jnp.int32)
    got = np.asarray(m3.grouped_matmul(a8, data, sizes, scale, lhs_rows=rows, lhs_scale=ae))
    want = oracle.grouped_matmul(a8, data, sizes, rhs_scale=scale, lhs_rows=np.asarray(rows),
                                 lhs_scale=ae)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())
    assert not np.any(got[[2, 5]])


def test_mxfp8_rows_vmap_and_cuda_lowering(rng):
    a8, ae, data, scale = w8a8_operands(rng, 8, 128, 2, 8)
    sizes = jnp.asarray([[3, 5], [8, 0]], jnp.int32)
    f = lambda a, s, n: m3.grouped_matmul(a, data, n, scale, lhs_scale=s)    # noqa: E731
    got = jax.vmap(f, in_axes=(None, None, 0))(a8, ae, sizes)
    for b in range(2):
        np.testing.assert_allclose(np.asarray(got[b]), oracle.grouped_matmul(
            a8, data, sizes[b], rhs_scale=scale, lhs_scale=ae), rtol=1e-5, atol=1e-3)
    exp = jax.export.export(jax.jit(f), platforms=["cuda"],
                            disabled_checks=m3.export_disabled_checks())(a8, ae, sizes[0])
    text = exp.mlir_module()
    assert "m3sparse_grouped_matmul_cuda" in text and "tensor<8x128xf8E4M3FN>" in text
    a8, ae, data, scale = w8a8_operands(rng, 8, 96, 2, 8)
    with pytest.raises(ValueError, match=r"% 128 == 0 for MXFP8"):
        jax.jit(lambda a, s: m3.grouped_matmul(a, data, sizes[0], scale, lhs_scale=s)).trace(
            a8, ae).lower(lowering_platforms=("cuda",))


def test_mxfp8_rows_argument_errors(rng):
    a8, ae, data, scale = w8a8_operands(rng, 8, 64, 2, 8)
    sizes = jnp.asarray([3, 5], jnp.int32)
    with pytest.raises(ValueError, match="pass lhs_scale"):
        m3.grouped_matmul(a8, data, sizes, scale)
    with pytest.raises(ValueError, match="needs MXFP8 rhs"):
        m3.grouped_matmul(a8, m3.mxfp8_dequantize(data, scale), sizes, lhs_scale=ae)
    with pytest.raises(ValueError, match="lhs_scale=None"):
        m3.grouped_matmul(m3.mxfp8_dequantize(a8, ae), data, sizes, scale, lhs_scale=ae)
    with pytest.raises(ValueError, match=r"lhs_scale must be \[M, K/32\]"):
        m3.grouped_matmul(a8, data, sizes, scale, lhs_scale=ae[:, :1])
    with pytest.raises(TypeError, match="lhs_scale must be uint8"):
        m3.grouped_matmul(a8, data, sizes, scale, lhs_scale=ae.astype(jnp.int32))


# ----------------------------------------------------- FP4 weights: MXFP4, NVFP4 (SPEC §9.3)
def fp4_operands(rng, M, K, G, N, fmt):
    """bf16 rows and packed FP4 weights: random bytes (every code, both nibbles) with MXFP4
    exponents around 127 or NVFP4 E4M3 scales of random finite values."""
    lhs = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    data = jnp.asarray(rng.integers(0, 256, (G, N, K // 2)), jnp.uint8)
    if fmt == "mxfp4":
        scale = jnp.asarray(rng.integers(120, 135, (G, N, K // 32)), jnp.uint8)
    else:
        scale = jnp.asarray(rng.uniform(2.0 ** -9, 448, (G, N, K // 16)), jnp.float8_e4m3fn)
    return lhs, data, scale


def test_fp4_dequantize_is_the_spec_value(rng):
    """fp4_dequantize against the oracle's own bit decoding, at the edges: every code in both
    nibbles, E8M0 0 (products below 2^-126: ±0), 1, 254 (past bf16: inf) and 255 (NaN); E4M3
    scales from the smallest subnormal to 448 and NaN."""
    data = jnp.asarray(np.arange(256, dtype=np.uint8).reshape(2, 128), jnp.uint8)
    e = jnp.asarray([[0, 1, 2, 127, 130, 200, 254, 255]], jnp.uint8).repeat(2, 0)
    got = np.asarray(m3.fp4_dequantize(data, e), np.float64)
    np.testing.assert_array_equal(got, oracle.fp4_weights(data, e))
    mag = np.abs(np.asarray(m3.fp4_dequantize(data, jnp.full_like(e, 127)), np.float64))
    assert np.all((got[:, :32] == 0) == (mag[:, :32] < 2))     # 2^-127 · {.5, 1, 1.5} < 2^-126
    assert np.isnan(got[:, -32:]).all() and np.isinf(got[:, 192:224]).sum() > 0
    s = jnp.asarray(np.arange(0, 256, 16, dtype=np.uint8).reshape(1, 16).repeat(2, 0))
    s = jax.lax.bitcast_convert_type(s.at[:, 7].set(0x7F), jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(m3.fp4_dequantize(data, s), np.float64),
                                  oracle.fp4_weights(data, s))


def test_mxfp4_quantize(rng):
    """The exponent rule (smallest e with max|x| / 2^(e−127) ≤ 6: nothing clips), E2M1 round to
    nearest even, an exact round trip for values on the grid, and non-finite blocks."""
    x = rng.normal(size=(4, 64)) * 2.0 ** rng.integers(-20, 20, (4, 1))
    data, e = m3.mxfp4_quantize(jnp.asarray(x, jnp.float32))
    amax = np.abs(x.reshape(4, 2, 32)).max(-1)
    want_e = np.ceil(np.log2(amax.astype(np.float32) / np.float32(6))) + 127
    np.testing.assert_array_equal(np.asarray(e), want_e)
    back = np.asarray(m3.fp4_dequantize(data, e), np.float64)
    step = np.repeat(2.0 ** (want_e - 127), 32, axis=-1)
    assert np.all(np.abs(back - x) <= step * 1.0 + 1e-30)   # half the widest E2M1 gap (2)
    grid = np.asarray(oracle.fp4_weights(data, e))
    np.testing.assert_array_equal(np.asarray(m3.fp4_dequantize(*m3.mxfp4_quantize(
        jnp.asarray(grid, jnp.float32))), np.float64), grid)
    bad = jnp.zeros((2, 32)).at[0, 3].set(jnp.nan).at[1, 5].set(jnp.inf).at[1, 6].set(3.0)
    d, e = m3.mxfp4_quantize(bad)
    assert list(np.asarray(e)[:, 0]) == [255, 127]
    got = np.asarray(m3.fp4_dequantize(d, e), np.float64)
    assert np.isnan(got[0]).all() and got[1, 5] == 6 and got[1, 6] == 3
    with pytest.raises(ValueError, match="multiple of 32"):
        m3.mxfp4_quantize(jnp.zeros((2, 48)))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("sizes", [[3, 0, 5, 2], [2, -3, 20, 1]])
def test_fp4_matches_oracle(rng, fmt, sizes):
    lhs, data, scale = fp4_operands(rng, 10, 64, 4, 16, fmt)
    got = np.asarray(jax.jit(m3.grouped_matmul)(lhs, data, jnp.asarray(sizes, jnp.int32), scale))
    want = oracle.grouped_matmul(lhs, data, sizes, rhs_scale=scale)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())
    assert not np.any(got[np.all(want == 0, axis=1)])


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_is_the_bf16_call_on_dequantized_weights(rng, fmt):
    """SPEC §9.3: the FP4 call is the bf16 call on fp4_dequantize(rhs, scale), bit for bit (CPU
    lowering here; the CUDA kernel in tests/cuda), with gathered rows and a bf16 output too."""
    lhs, data, scale = fp4_operands(rng, 16, 96, 3, 24, fmt)
    sizes = jnp.asarray([6, 0, 10], jnp.int32)
    w = m3.fp4_dequantize(data, scale)
    rows = jnp.asarray(rng.integers(-2, 18, 16), jnp.int32)
    for kw in ({}, {"lhs_rows": rows}, {"out_dtype": jnp.bfloat16}):
        np.testing.assert_array_equal(np.asarray(m3.grouped_matmul(lhs, data, sizes, scale, **kw)),
                                      np.asarray(m3.grouped_matmul(lhs, w, sizes, **kw)))


def test_fp4_vmap_and_cuda_lowering(rng):
    lhs, data, scale = fp4_operands(rng, 8, 128, 2, 8, "nvfp4")
    sizes = jnp.asarray([[3, 5], [8, 0]], jnp.int32)
    got = jax.vmap(m3.grouped_matmul, in_axes=(None, None, 0, None))(lhs, data, sizes, scale)
    for b in range(2):
        np.testing.assert_allclose(np.asarray(got[b]), oracle.grouped_matmul(
            lhs, data, sizes[b], rhs_scale=scale), rtol=1e-5, atol=1e-3)
    for fmt, scale_type in (("nvfp4", "tensor<2x8x8xf8E4M3FN>"), ("mxfp4", "tensor<2x8x4xui8>")):
        args = fp4_operands(rng, 8, 128, 2, 8, fmt)
        exp = jax.export.export(jax.jit(m3.grouped_matmul), platforms=["cuda"],
                                disabled_checks=m3.export_disabled_checks())(
            args[0], args[1], sizes[0], args[2])
        text = exp.mlir_module()
        assert "m3sparse_grouped_matmul_cuda" in text and "tensor<2x8x64xui8>" in text
        assert scale_type in text
    with pytest.raises(ValueError, match=r"% 128 == 0 for FP4"):
        jax.jit(m3.grouped_matmul).trace(*fp4_operands(rng, 8, 96, 2, 8, "mxfp4")[:2], sizes[0],
                                         fp4_operands(rng, 8, 96, 2, 8, "mxfp4")[2]).lower(
            lowering_platforms=("cuda",))


def test_fp4_argument_errors(rng):
    lhs, data, scale = fp4_operands(rng, 8, 64, 2, 8, "mxfp4")
    sizes = jnp.asarray([3, 5], jnp.int32)
    with pytest.raises(ValueError, match="pass rhs_scale"):
        m3.grouped_matmul(lhs, data, sizes)
    with pytest.raises(ValueError, match="must share K"):
        m3.grouped_matmul(lhs[:, :32], data, sizes, scale)
    with pytest.raises(ValueError, match="disagree"):
        m3.grouped_matmul(lhs, data, sizes, scale[:, :, :1])
    with pytest.raises(ValueError, match="disagree"):         # NVFP4 needs K/16 scales
        m3.grouped_matmul(lhs, data, sizes, scale.astype(jnp.float8_e4m3fn))
    with pytest.raises(TypeError, match="uint8 \\(E8M0, MXFP4\\) or float8_e4m3fn"):
        m3.grouped_matmul(lhs, data, sizes, scale.astype(jnp.int32))
    a8, ae = m3.mxfp8_quantize(lhs.astype(jnp.float32))
    with pytest.raises(ValueError, match="needs MXFP8 rhs"):
        m3.grouped_matmul(a8, data, sizes, scale, lhs_scale=ae)
