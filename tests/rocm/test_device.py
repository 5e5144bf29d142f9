"""Correctness of the gfx950 kernels on a real gfx950 against the CPU backend (SPEC §2–§7).

Runs only where JAX sees a ROCm gfx950 device and jax_m3sparse was built with
M3SPARSE_ENABLE_ROCM=ON (the `_m3sparse_rocm` module); elsewhere every test skips with the reason.
The same inputs go through the CPU backend (fp32 compute) and the gfx950 kernels:
* pack_kv_pages: the whole cache, byte for byte (SPEC §2.2 is bit-exact), 4-D and 5-D, with
  NaN/Inf groups, padding and out-of-range slots, a layer out of range;
* query_token_positions: exactly;
* sparse_decode (bf16 MFMA) / sparse_prefill (fp16 MFMA) / full_attention (bf16): SPEC §6 GPU bars against the CPU result
  (cosine >= 0.99, relative Frobenius error <= 0.06), exact zeros wherever the CPU gives a row of
  zeros (nothing attended, padding, bad layer), no NaN leaking from poisoned page tails;
* grouped_matmul (bf16, MXFP8, MXFP4, NVFP4 weights, the swiglu_oai epilogue): cosine >= 0.9999,
  relative Frobenius error <= 1e-4 against the CPU (fp32 sums in another order);
* route_experts: every field bit-identical to the CPU.

M3SPARSE_DEVICE_TEST_PLATFORM=cpu runs the suite with the CPU on both sides (a self-check of this
file on machines without a GPU).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
m3 = pytest.importorskip("jax_m3sparse")

PLATFORM = os.environ.get("M3SPARSE_DEVICE_TEST_PLATFORM", "rocm")
HKV, G, D, K, N = 2, 16, 128, 16, 128


def gfx950_or_skip():
    if PLATFORM == "cpu":
        return jax.devices("cpu")[0]
    try:
        devices = jax.devices("rocm")
    except RuntimeError as e:
        pytest.skip(f"no ROCm device visible to JAX ({e})")
    dev = next((d for d in devices if "gfx950" in str(getattr(d, "compute_capability", "")) + d.device_kind),
               None)
    if dev is None and os.environ.get("M3SPARSE_ASSUME_GFX950") != "1":
        pytest.skip(f"no gfx950 among {[d.device_kind for d in devices]} (M3SPARSE_ASSUME_GFX950=1 overrides)")
    from jax_m3sparse import _ffi

    if not _ffi.has_native("sparse_decode", "rocm"):
        pytest.skip(f"_m3sparse_rocm not built ({_ffi.import_error('rocm')}); build with M3SPARSE_ENABLE_ROCM=ON")
    return dev or devices[0]


@pytest.fixture(scope="module")
def gpu():
    return gfx950_or_skip()


@pytest.fixture(scope="module")
def cpu():
    return jax.devices("cpu")[0]


def on(device, *arrays):
    return [jax.device_put(a, device) for a in arrays]


def metrics(got, want):
    got = np.asarray(got, np.float64).ravel()
    want = np.asarray(want, np.float64).ravel()
    cos = got @ want / (np.linalg.norm(got) * np.linalg.norm(want) + 1e-300)
    relf = np.linalg.norm(got - want) / (np.linalg.norm(want) + 1e-300)
    return cos, relf


# ---- pack ------------------------------------------------------------------------------------
def pack_inputs(rng, T, dtype):
    k = rng.standard_normal((T, HKV, D)).astype(np.float32) * rng.uniform(0.1, 8.0, (T, HKV, 1)).astype(np.float32)
    v = rng.standard_normal((T, HKV, D)).astype(np.float32)
    k[0, 0, 3] = np.nan
    k[1, 1, 17] = np.inf
    v[2, 0, 100] = -np.inf
    k[3, 0, :16] = 0.0
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("layout,layer", [(None, None), ("LBHNC", 2), ("BLHNC", 1), ("BLHNC", 7)])
def test_pack_bit_exact(gpu, cpu, rng, dtype, layout, layer):
    P, L, T = 6, 3, 37
    spec = m3.KVCacheSpec(num_kv_heads=HKV)
    cache0 = rng.integers(0, 256, spec.cache_shape(P, L if layout else None, layout or "LBHNC"), np.uint8)
    k, v = pack_inputs(rng, T, dtype)
    slots = rng.permutation(P * N)[:T].astype(np.int32)
    slots[4], slots[5], slots[6] = -1, P * N, P * N + 1000            # padding / out of range
    kw = {} if layout is None else dict(layout=layout, layer=jnp.int32(layer))
    outs = []
    for dev in (gpu, cpu):
        c, kk, vv, sm = on(dev, jnp.asarray(cache0), k, v, jnp.asarray(slots))
        fn = jax.jit(lambda c, kk, vv, sm: m3.pack_kv_pages(c, kk, vv, sm, jnp.float32(0.37), jnp.float32(1.0), **kw))
        outs.append(np.asarray(fn(c, kk, vv, sm)))
    assert np.array_equal(outs[0], outs[1])


def test_pack_bad_global_scale_gives_nan_groups(gpu, cpu, rng):
    spec = m3.KVCacheSpec(num_kv_heads=HKV)
    cache0 = np.zeros(spec.cache_shape(2), np.uint8)
    k, v = pack_inputs(rng, 8, jnp.bfloat16)
    slots = jnp.arange(8, dtype=jnp.int32)
    outs = []
    for dev in (gpu, cpu):
        c, kk, vv, sm = on(dev, jnp.asarray(cache0), k, v, slots)
        outs.append(np.asarray(jax.jit(lambda *a: m3.pack_kv_pages(*a, jnp.float32(0.0), jnp.float32(-1.0)))(
            c, kk, vv, sm)))
    assert np.array_equal(outs[0], outs[1])


# ---- positions ---------------------------------------------------------------------------------
def test_query_token_positions_exact(gpu, cpu):
    cu = jnp.asarray([0, 3, 3, 10, 11, 40], jnp.int32)
    ctx = jnp.asarray([5, 0, 128, 7, 1000], jnp.int32)
    outs = []
    for dev in (gpu, cpu):
        c, x = on(dev, cu, ctx)
        outs.append([np.asarray(a) for a in jax.jit(lambda c, x: m3.query_token_positions(c, x, 64))(c, x)])
    for a, b in zip(*outs):
        assert np.array_equal(a, b)


# ---- attention ---------------------------------------------------------------------------------
def attention_problem(rng, seq_lens, dtype, extra_pages=2):
    """A cache packed with random K/V for every request's tokens, poisoned page tails, random top-k
    (with garbage ids in unused slots) and a shuffled block table."""
    R = len(seq_lens)
    blocks = [(s + N - 1) // N for s in seq_lens]
    M = max(max(blocks), 1) + 1
    P = sum(blocks) + extra_pages
    spec = m3.KVCacheSpec(num_kv_heads=HKV)
    pages = rng.permutation(P)
    table = np.full((R, M), -1, np.int32)
    slot_list, at = [], 0
    for r, s in enumerate(seq_lens):
        for b in range(blocks[r]):
            table[r, b] = pages[at]
            at += 1
        slot_list += [table[r, t // N] * N + t % N for t in range(s)]
    slots = np.asarray(slot_list, np.int32)
    kv = rng.standard_normal((2, len(slots), HKV, D)).astype(np.float32)
    cache = m3.pack_kv_pages(jnp.zeros(spec.cache_shape(P), jnp.uint8), jnp.asarray(kv[0]), jnp.asarray(kv[1]),
                             jnp.asarray(slots), jnp.float32(0.5), jnp.float32(0.25))
    cache = np.array(cache)
    # poison: every unused token row of every page gets NaN scales and random data (SPEC §5.2)
    used = np.zeros((P, N), bool)
    used.reshape(-1)[slots] = True
    view = cache.reshape(P, 2 * HKV, N * 72)
    for p in range(P):
        for t in np.flatnonzero(~used[p]):
            view[p, :, t * 64:(t + 1) * 64] = rng.integers(0, 256, (2 * HKV, 64), np.uint8)
            view[p, :, N * 64 + t * 8:N * 64 + (t + 1) * 8] = 0x7F
    return cache, table, M


def topk_for(rng, req, pos, M):
    T = len(req)
    topk = np.full((HKV, T, K), -1, np.int32)
    for t in range(T):
        if req[t] < 0 or pos[t] < 0:
            continue
        nb = pos[t] // N + 1
        for g in range(HKV):
            pick = rng.permutation(nb)[:K]
            topk[g, t, :len(pick)] = pick
            if len(pick) < K:
                topk[g, t, len(pick):] = rng.choice([-1, 10**6, M, -7], K - len(pick))
    return topk


def check_attention(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert not np.isnan(got).any()
    zero_rows = np.all(want.reshape(want.shape[0], -1) == 0, axis=1)
    assert np.all(got[zero_rows] == 0), "rows with nothing attended must be exact zeros"
    if (~zero_rows).any():
        cos, relf = metrics(got[~zero_rows], want[~zero_rows])
        assert cos >= 0.99 and relf <= 0.06, (cos, relf)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("dql", [1, 2])
def test_sparse_decode_matches_cpu(gpu, cpu, rng, dtype, dql):
    seq_lens = np.asarray([1, 129, 2500, 0, 777, 128 * 16 + 5], np.int32)   # 0: padded request
    cache, table, M = attention_problem(rng, np.maximum(seq_lens, 0), dtype)
    R = len(seq_lens)
    T = R * dql
    req = np.repeat(np.arange(R), dql)
    pos = seq_lens[req] - dql + np.tile(np.arange(dql), R)
    topk = topk_for(rng, req, pos, M)
    q = jnp.asarray(rng.standard_normal((T, HKV * G, D)).astype(np.float32) * 2, dtype)
    outs = []
    for dev in (gpu, cpu):
        args = on(dev, q, jnp.asarray(cache), jnp.asarray(topk), jnp.asarray(table), jnp.asarray(seq_lens))
        fn = jax.jit(lambda *a: m3.sparse_decode(*a, jnp.float32(0.5), jnp.float32(0.25), decode_query_len=dql))
        outs.append(fn(*args))
    assert outs[0].dtype == dtype
    check_attention(outs[0], outs[1])


def test_sparse_decode_large_batch_matches_cpu(gpu, cpu, rng):
    """T·Hkv >= 256: the handler takes the one-pass kernel instead of the split one."""
    seq_lens = rng.integers(0, 700, 130).astype(np.int32)
    cache, table, M = attention_problem(rng, seq_lens, jnp.bfloat16)
    req = np.arange(len(seq_lens))
    topk = topk_for(rng, req, seq_lens - 1, M)
    q = jnp.asarray(rng.standard_normal((len(seq_lens), HKV * G, D)).astype(np.float32), jnp.bfloat16)
    outs = []
    for dev in (gpu, cpu):
        args = on(dev, q, jnp.asarray(cache), jnp.asarray(topk), jnp.asarray(table), jnp.asarray(seq_lens))
        outs.append(jax.jit(lambda *a: m3.sparse_decode(*a, jnp.float32(0.5), jnp.float32(0.25)))(*args))
    check_attention(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_sparse_prefill_matches_cpu(gpu, cpu, rng, dtype):
    seq_lens = np.asarray([300, 2100, 64], np.int32)
    cache, table, M = attention_problem(rng, seq_lens, dtype)
    req = np.concatenate([np.full(40, 0), np.full(50, 1), np.full(10, 2), np.full(6, -1)]).astype(np.int32)
    pos = np.concatenate([np.arange(260, 300), np.arange(2050, 2100), np.arange(54, 64), np.full(6, -1)])
    pos = pos.astype(np.int32)
    topk = topk_for(rng, req, pos, M)
    q = jnp.asarray(rng.standard_normal((len(req), HKV * G, D)).astype(np.float32), dtype)
    outs = []
    for dev in (gpu, cpu):
        args = on(dev, q, jnp.asarray(cache), jnp.asarray(topk), jnp.asarray(table), jnp.asarray(req),
                  jnp.asarray(pos))
        fn = jax.jit(lambda *a: m3.sparse_prefill(*a, jnp.float32(0.5), jnp.float32(0.25)))
        outs.append(fn(*args))
    check_attention(outs[0], outs[1])
    assert np.all(np.asarray(outs[0], np.float32)[-6:] == 0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_full_attention_matches_cpu(gpu, cpu, rng, dtype):
    """SPEC §5.7: prefill and decode rows over every visible block (up to 5000 keys: 3 parts of 16
    blocks), padding rows (request -1 or R, position -1), a -1 inside a row's blocks; a row alone
    gives the bits it has in the batch."""
    seq_lens = np.asarray([5000, 300, 2049], np.int32)
    cache, table, M = attention_problem(rng, seq_lens, dtype)
    table[0, 5] = -1
    req = np.concatenate([np.full(20, 0), np.full(3, 1), np.full(1, 2), [-1, 3, 0]]).astype(np.int32)
    pos = np.concatenate([np.arange(4980, 5000), np.arange(297, 300), [2048], [7, 7, -1]]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((len(req), HKV * G, D)).astype(np.float32), dtype)
    fn = jax.jit(lambda *a: m3.full_attention(*a, jnp.float32(0.5), jnp.float32(0.25)))
    outs = [fn(*on(dev, q, jnp.asarray(cache), jnp.asarray(table), jnp.asarray(req), jnp.asarray(pos)))
            for dev in (gpu, cpu)]
    check_attention(outs[0], outs[1])
    assert np.all(np.asarray(outs[0], np.float32)[-3:] == 0)
    for t in (0, 21, 23):
        one = fn(*on(gpu, q[t:t + 1], jnp.asarray(cache), jnp.asarray(table), jnp.asarray(req[t:t + 1]),
                     jnp.asarray(pos[t:t + 1])))
        assert np.array_equal(np.asarray(one), np.asarray(outs[0])[t:t + 1]), f"row {t}"


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_sparse_decode_layers(gpu, cpu, rng, layout):
    seq_lens = np.asarray([700, 1500], np.int32)
    cache4, table, M = attention_problem(rng, seq_lens, jnp.bfloat16)
    L, layer = 3, 2
    other = rng.integers(0, 256, cache4.shape, np.uint8)
    stack = np.stack([other, other, cache4]) if layout == "LBHNC" else np.stack([other, other, cache4], axis=1)
    req = np.arange(2)
    pos = seq_lens - 1
    topk = topk_for(rng, req, pos, M)
    q = jnp.asarray(rng.standard_normal((2, HKV * G, D)), jnp.bfloat16)
    for lay in (layer, L, -1):                      # a bad layer reads nothing: zeros (SPEC §3.3)
        outs = []
        for dev in (gpu, cpu):
            args = on(dev, q, jnp.asarray(stack), jnp.asarray(topk), jnp.asarray(table), jnp.asarray(seq_lens))
            fn = jax.jit(lambda *a: m3.sparse_decode(*a, jnp.float32(0.5), jnp.float32(0.25),
                                                     layer=jnp.int32(lay), layout=layout))
            outs.append(fn(*args))
        check_attention(outs[0], outs[1])
        if lay != layer:
            assert np.all(np.asarray(outs[0], np.float32) == 0)


# ---- grouped_matmul (SPEC §9) -------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "mxfp4", "nvfp4"])
def test_grouped_matmul_matches_cpu(gpu, cpu, rng, fmt):
    """M3's gate_up at a decode step's shape (K 6144, N 768, 128 experts, 16 routed pairs), with the
    swiglu_oai epilogue and both scales, against the CPU backend: fp32 sums in another order."""
    T, K, N, E = 4, 6144, 768, 128
    w = jnp.asarray(rng.standard_normal((E, N, K)) * 0.02, jnp.float32)
    quant = {"bf16": lambda x: (x.astype(jnp.bfloat16), None), "mxfp8": m3.mxfp8_quantize,
             "mxfp4": m3.mxfp4_quantize, "nvfp4": lambda x: m3.nvfp4_quantize(x, 1.0)}[fmt]
    rhs, scale = quant(w)
    x = jnp.asarray(rng.standard_normal((T, K)), jnp.bfloat16)
    sizes = np.zeros(E, np.int32)
    sizes[rng.choice(E, 10, replace=False)] = [1, 2, 1, 3, 1, 1, 2, 2, 2, 1]
    rows = rng.integers(0, T, 16).astype(np.int32)
    rs = rng.uniform(0.1, 1.0, 16).astype(np.float32)
    gs = rng.uniform(0.5, 2.0, E).astype(np.float32)

    def run(device):
        ops = on(device, x, rhs, sizes, rows, rs, gs) + ([] if scale is None else on(device, scale))
        f = jax.jit(lambda x, w, s, r, rs, gs, *sc: m3.grouped_matmul(
            x, w, s, *sc, lhs_rows=r, row_scale=rs, group_scale=gs, activation="swiglu_oai"))
        return np.asarray(f(*ops))

    got, want = run(gpu), run(cpu)
    cos, relf = metrics(got, want)
    assert cos >= 0.9999 and relf <= 1e-4, (fmt, cos, relf)


# ---- route_experts (SPEC §10) -------------------------------------------------------------------
def test_route_experts_matches_cpu(gpu, cpu, rng):
    """M3's router at a decode and a prefill size (E 128, k 4), padding tokens included: every
    field bit-identical to the CPU (integer counting and one IEEE division per weight)."""
    import oracle
    for T in (4, 2048):
        scores = oracle.route_scores(rng, T, 128, ties=True)
        bias = rng.uniform(-0.05, 0.05, 128).astype(np.float32)
        live = rng.random(T) > 0.1

        def run(device):
            f = jax.jit(lambda s, b, l: tuple(m3.route_experts(s, 4, bias=b, live=l)))
            return [np.asarray(x) for x in f(*on(device, scores, bias, live))]

        for g, w in zip(run(gpu), run(cpu)):
            assert np.array_equal(g, w, equal_nan=True), T
