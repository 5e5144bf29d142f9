"""The CUDA backend through the public API, on a GPU (skipped without one or without the
compiled ``_m3sparse_cuda`` module). Oracles: tests/support/oracle.py (float64 from the stored
bytes, SPEC §6) and the CPU backend (bit-exact pack)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import oracle  # noqa: E402  (tests/support/, on the path through pyproject.toml's pythonpath)

import jax_m3sparse as m3  # noqa: E402
from jax_m3sparse import _ffi  # noqa: E402
from jax_m3sparse.ops import full as full_ops  # noqa: E402


def _gpus():
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


pytestmark = [
    pytest.mark.skipif(not _gpus(), reason="no CUDA device"),
    pytest.mark.skipif(not _gpus() or not _ffi.has_native("sparse_decode", "cuda"),
                       reason="jax_m3sparse._m3sparse_cuda not built"),
]

GPU_COS, GPU_RELF = 0.99, 0.06


def _gpu(x):
    return jax.device_put(x, _gpus()[0])


def _cache(rng, shape):
    """Random cache bytes with the scale planes (tile bytes [8192, 9216)) in a sane E4M3 range."""
    c = rng.integers(0, 256, shape, dtype=np.uint8)
    f = c.reshape(*shape[:-2], 128 * 72)
    f[..., 8192:] = rng.integers(0x28, 0x48, f[..., 8192:].shape, dtype=np.uint8)
    return c


def _setup(rng, Hkv, seq_lens, K, num_layers=None, layout="LBHNC"):
    seq_lens = np.asarray(seq_lens)
    R = len(seq_lens)
    nblocks = (seq_lens + 127) // 128
    M = int(nblocks.max()) + 2
    P = int(nblocks.sum()) + 3
    pages = rng.permutation(P)
    bt = -np.ones((R, M), np.int32)
    tail = np.zeros(P, np.int64)
    i = 0
    for r in range(R):
        for b in range(nblocks[r]):
            bt[r, b] = pages[i]
            tail[pages[i]] = min(128, seq_lens[r] - 128 * b)
            i += 1
        if nblocks[r] < M:
            bt[r, nblocks[r]] = P + 5 if r % 2 else -3
    if num_layers is None:
        shape = (P, 2 * Hkv, 128, 72)
    elif layout == "LBHNC":
        shape = (num_layers, P, 2 * Hkv, 128, 72)
    else:
        shape = (P, num_layers, 2 * Hkv, 128, 72)
    cache = _cache(rng, shape)
    # NaN scales wherever nothing may be read: key tails past seq_len, unreferenced pages
    f = cache.reshape(*shape[:-2], 128 * 72)
    for p in range(P):
        view = f[:, p] if (num_layers is not None and layout == "LBHNC") else f[p]
        view[..., 8192 + 8 * int(tail[p]):] = 0x7F
    return cache, bt, M, P


def _topk(rng, Hkv, T, K, vis_blocks, M):
    topk = -np.ones((Hkv, T, K), np.int32)
    for g in range(Hkv):
        for t in range(T):
            ids = rng.permutation(max(int(vis_blocks[t]), 0))[:K]
            topk[g, t, :len(ids)] = ids
            junk = rng.random(K) < 0.15
            topk[g, t, junk] = rng.choice([-1, -9, M + 2, int(vis_blocks[t]) + 1], junk.sum())
    return topk


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("dql", [1, 2, 4])
def test_decode_matches_oracle(rng, dtype, dql):
    Hkv, K = 2, 16
    seq_lens = np.array([1500, 0, 640, 2049, 77, 3000])
    cache, bt, M, P = _setup(rng, Hkv, seq_lens, K)
    req, pos = oracle.decode_rows(seq_lens, dql)
    T = len(req)
    topk = _topk(rng, Hkv, T, K, (pos + 1 + 127) // 128, M)
    q = jnp.asarray(rng.standard_normal((T, Hkv * 16, 128)), dtype)
    ks, vs = np.float32(0.8), np.float32(1.3)
    fn = jax.jit(lambda *a: m3.sparse_decode(*a, decode_query_len=dql))
    out = fn(_gpu(q), _gpu(cache), _gpu(topk), _gpu(bt), _gpu(seq_lens.astype(np.int32)),
             _gpu(ks), _gpu(vs))
    assert list(out.devices())[0].platform == "gpu"
    out = np.asarray(out.astype(jnp.float32))
    ref = oracle.attention(np.asarray(q.astype(jnp.float32)), cache, topk, bt, req, pos, ks, vs)
    cos, relf = oracle.metrics(out, ref)
    assert np.isfinite(out).all()
    empty = np.abs(ref).sum(-1) == 0
    assert (out[empty] == 0).all()
    assert cos >= GPU_COS and relf <= GPU_RELF, (cos, relf)


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_prefill_multilayer_matches_oracle(rng, layout):
    Hkv, K, L = 1, 16, 3
    seq_lens = np.array([700, 300, 1900])
    cache, bt, M, P = _setup(rng, Hkv, seq_lens, K, num_layers=L, layout=layout)
    chunk = np.array([30, 0, 45])
    ctx = seq_lens - chunk
    cu = np.concatenate([[0], np.cumsum(chunk)]).astype(np.int32)
    T = int(cu[-1]) + 4
    rid, apos = m3.query_token_positions(_gpu(cu), _gpu(ctx.astype(np.int32)), T)
    req, pos = oracle.positions(cu, ctx, T)
    np.testing.assert_array_equal(np.asarray(rid), req)
    np.testing.assert_array_equal(np.asarray(apos), pos)
    topk = _topk(rng, Hkv, T, K, np.where(req >= 0, (pos + 1 + 127) // 128, 2), M)
    q = jnp.asarray(rng.standard_normal((T, 16 * Hkv, 128)), jnp.bfloat16)
    for layer in (1, 7):
        out = jax.jit(lambda *a: m3.sparse_prefill(*a[:-1], layer=a[-1], layout=layout))(
            _gpu(q), _gpu(cache), _gpu(topk), _gpu(bt), rid, apos, _gpu(np.float32(1.0)),
            _gpu(np.float32(0.5)), _gpu(np.int32(layer)))
        out = np.asarray(out.astype(jnp.float32))
        ref = oracle.attention(np.asarray(q.astype(jnp.float32)), cache, topk, bt, req, pos,
                               1.0, 0.5, layer=layer, layout=layout)
        if layer >= L:
            assert (out == 0).all()
            continue
        cos, relf = oracle.metrics(out, ref)
        assert np.isfinite(out).all()
        assert (out[req < 0] == 0).all()
        assert cos >= GPU_COS and relf <= GPU_RELF, (cos, relf)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_pack_bit_exact_vs_cpu_and_oracle(rng, dtype):
    Hkv, T, P = 2, 200, 4
    cache = rng.integers(0, 256, (P, 2 * Hkv, 128, 72), dtype=np.uint8)
    key = rng.standard_normal((T, Hkv, 128)) * np.exp2(rng.integers(-12, 12, (T, Hkv, 1)))
    value = rng.standard_normal((T, Hkv, 128)) * 3
    key[3, 0, 5] = np.nan
    key[4, 1, 17] = np.inf
    value[5, 0, :16] = 0.0
    key, value = jnp.asarray(key, dtype), jnp.asarray(value, dtype)
    slots = rng.permutation(P * 128)[:T].astype(np.int32)
    slots[[2, 9, 11]] = [-1, P * 128, P * 128 + 5]
    ks, vs = np.float32(0.37), np.float32(2.5)
    fn = jax.jit(m3.pack_kv_pages, donate_argnums=0)
    gpu = np.asarray(fn(_gpu(cache), _gpu(key), _gpu(value), _gpu(slots), _gpu(ks), _gpu(vs)))
    cpu_dev = jax.devices("cpu")[0]
    cpu = np.asarray(jax.jit(m3.pack_kv_pages)(*(jax.device_put(x, cpu_dev) for x in (
        cache, key, value, slots, ks, vs))))
    np.testing.assert_array_equal(gpu, cpu)
    want = oracle.pack(cache, np.asarray(key.astype(jnp.float32)),
                       np.asarray(value.astype(jnp.float32)), slots, ks, vs)
    np.testing.assert_array_equal(gpu, want)


def test_pack_then_decode_in_scan_over_layers(rng):
    """Traced layer inside lax.scan, 5-D BLHNC cache donated through the loop."""
    Hkv, L, P, K = 1, 3, 8, 16
    cache = jnp.zeros((P, L, 2 * Hkv, 128, 72), jnp.uint8)
    T = 256
    key = jnp.asarray(rng.standard_normal((L, T, Hkv, 128)), jnp.bfloat16)
    value = jnp.asarray(rng.standard_normal((L, T, Hkv, 128)), jnp.bfloat16)
    slots = jnp.arange(T, dtype=jnp.int32)
    q = jnp.asarray(rng.standard_normal((1, 16 * Hkv, 128)), jnp.bfloat16)
    topk = jnp.asarray([[[0, 1, -1, 3] + [-1] * 12]], jnp.int32)
    bt = jnp.asarray([[0, 1, 2, 3]], jnp.int32)
    seq = jnp.asarray([T], jnp.int32)

    def step(c, xs):
        layer, k, v = xs
        c = m3.pack_kv_pages(c, k, v, slots, 1.0, 1.0, layer=layer, layout="BLHNC")
        o = m3.sparse_decode(q, c, topk, bt, seq, 1.0, 1.0, layer=layer, layout="BLHNC")
        return c, o

    run = jax.jit(lambda c, k, v: jax.lax.scan(step, c, (jnp.arange(L, dtype=jnp.int32), k, v)),
                  donate_argnums=0)
    c, outs = run(_gpu(cache), _gpu(key), _gpu(value))
    c, outs = np.asarray(c), np.asarray(outs.astype(jnp.float32))
    for layer in range(L):
        ref = oracle.attention(np.asarray(q.astype(jnp.float32)), c, np.asarray(topk),
                               np.asarray(bt), [0], [T - 1], 1.0, 1.0, layer=layer,
                               layout="BLHNC")
        cos, relf = oracle.metrics(outs[layer], ref)
        assert cos >= GPU_COS and relf <= GPU_RELF, (layer, cos, relf)


@pytest.mark.parametrize("G", [8, 4])
def test_decode_small_group_in_scan_over_layers(rng, G):
    """G = Hq / Hkv < 16 (TP8-style head counts) served natively: a jitted lax.scan over the
    layers of a 5-D LBHNC cache with a traced layer index, as a model calls it."""
    Hkv, K, L = 2, 16, 3
    seq_lens = np.array([1100, 0, 2049, 300])
    cache, bt, M, P = _setup(rng, Hkv, seq_lens, K, num_layers=L)
    req, pos = oracle.decode_rows(seq_lens, 1)
    T = len(req)
    topk = np.stack([_topk(rng, Hkv, T, K, (pos + 1 + 127) // 128, M) for _ in range(L)])
    q = jnp.asarray(rng.standard_normal((L, T, Hkv * G, 128)), jnp.bfloat16)

    def layer_step(carry, xs):
        layer, qi, ti = xs
        return carry, m3.sparse_decode(qi, cache_d, ti, bt_d, sl_d, 0.9, 1.1, layer=layer,
                                       layout="LBHNC")

    cache_d, bt_d, sl_d = _gpu(cache), _gpu(bt), _gpu(seq_lens.astype(np.int32))
    run = jax.jit(lambda q, t: jax.lax.scan(layer_step, 0, (jnp.arange(L, dtype=jnp.int32), q,
                                                            t))[1])
    outs = np.asarray(run(_gpu(q), _gpu(topk)).astype(jnp.float32))
    for layer in range(L):
        ref = oracle.attention(np.asarray(q[layer].astype(jnp.float32)), cache, topk[layer], bt,
                               req, pos, 0.9, 1.1, layer=layer)
        cos, relf = oracle.metrics(outs[layer], ref)
        assert np.isfinite(outs[layer]).all()
        assert (outs[layer][np.abs(ref).sum(-1) == 0] == 0).all()
        assert cos >= GPU_COS and relf <= GPU_RELF, (layer, cos, relf)


def _bits(x):
    return np.asarray(x).view(np.uint16)


@pytest.mark.parametrize("dql", [1, 2, 4])
def test_decode_batch_and_tp_invariant(rng, dql):
    """Batch and TP invariance: a request's rows are bit-identical alone, in the batch, and with
    the KV heads split as tensor parallelism splits them (the op on head-sliced operands on one
    GPU: TP 2 and 4 over 4 KV heads, and TP 8's G = 8 halves of one replicated KV head)."""
    Hkv, K, G = 4, 16, 16
    seq_lens = np.array([1500, 0, 640, 2049, 77, 3000, 900, 4100])
    cache, bt, M, P = _setup(rng, Hkv, seq_lens, K)
    req, pos = oracle.decode_rows(seq_lens, dql)
    T = len(req)
    topk = _topk(rng, Hkv, T, K, (pos + 1 + 127) // 128, M)
    q = np.asarray(jnp.asarray(rng.standard_normal((T, Hkv * G, 128)), jnp.bfloat16))
    fn = jax.jit(lambda *a: m3.sparse_decode(*a, decode_query_len=dql))

    def run(q, cache, topk, bt, sl):
        return _bits(fn(_gpu(q), _gpu(cache), _gpu(topk), _gpu(bt), _gpu(sl.astype(np.int32)),
                        _gpu(np.float32(0.8)), _gpu(np.float32(1.3))))

    full = run(q, cache, topk, bt, seq_lens)
    assert (full != 0).any()
    for r in range(len(seq_lens)):  # each request alone
        rows = slice(r * dql, (r + 1) * dql)
        np.testing.assert_array_equal(
            run(q[rows], cache, topk[:, rows], bt[r:r + 1], seq_lens[r:r + 1]), full[rows])
    for tp in (2, 4):  # KV heads split over tp devices
        hs = Hkv // tp
        for d in range(tp):
            h = slice(d * hs * G, (d + 1) * hs * G)
            part = run(q[:, h], cache[:, 2 * d * hs:2 * (d + 1) * hs], topk[d * hs:(d + 1) * hs],
                       bt, seq_lens)
            np.testing.assert_array_equal(part, full[:, h])
    for g in range(Hkv):  # TP 8: each KV head replicated on 2 devices, 8 query heads each
        for half in range(2):
            h = slice(g * G + 8 * half, g * G + 8 * half + 8)
            part = run(q[:, h], cache[:, 2 * g:2 * g + 2], topk[g:g + 1], bt, seq_lens)
            np.testing.assert_array_equal(part, full[:, h])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_decode_small_batches_match_large_batch(rng, dtype):
    """Launch-shape invariance: a batch of T = 128 decode rows over 4 KV heads (512 rows: more
    than any GPU's SMs, so one CTA per row) and its first 1, 2, 8 requests (a cluster of 4 CTAs
    per row) and 32 requests (128 rows: a cluster of 2 on a GPU of 128 to 255 SMs, such as the
    H200's 132) give the same bits: the launch shapes compute one reduction tree."""
    Hkv, K, G = 4, 16, 16
    seq_lens = rng.integers(1, 1300, 128)
    seq_lens[3] = 0
    cache, bt, M, P = _setup(rng, Hkv, seq_lens, K)
    req, pos = oracle.decode_rows(seq_lens, 1)
    T = len(req)
    topk = _topk(rng, Hkv, T, K, (pos + 1 + 127) // 128, M)
    q = np.asarray(jnp.asarray(rng.standard_normal((T, Hkv * G, 128)), dtype))
    fn = jax.jit(lambda *a: m3.sparse_decode(*a, decode_query_len=1))
    cache_d = _gpu(cache)

    def run(n):
        return _bits(fn(_gpu(q[:n]), cache_d, _gpu(topk[:, :n]), _gpu(bt[:n]),
                        _gpu(seq_lens[:n].astype(np.int32)), _gpu(np.float32(0.9)),
                        _gpu(np.float32(1.1))))

    full = run(T)
    assert (full != 0).any()
    for n in (1, 2, 8, 32):
        np.testing.assert_array_equal(run(n), full[:n])


def test_prefill_batch_invariant(rng):
    """Batch invariance: a prefill token's output bits do not depend on the other tokens of the
    call."""
    Hkv, K = 2, 16
    seq_lens = np.array([700, 300, 1900])
    cache, bt, M, P = _setup(rng, Hkv, seq_lens, K)
    chunk = np.array([20, 0, 30])
    ctx = seq_lens - chunk
    cu = np.concatenate([[0], np.cumsum(chunk)]).astype(np.int32)
    T = int(cu[-1]) + 3
    req, pos = oracle.positions(cu, ctx, T)
    topk = _topk(rng, Hkv, T, K, np.where(req >= 0, (pos + 1 + 127) // 128, 2), M)
    q = np.asarray(jnp.asarray(rng.standard_normal((T, 16 * Hkv, 128)), jnp.bfloat16))
    fn = jax.jit(lambda *a: m3.sparse_prefill(*a))

    def run(q, topk, rid, apos):
        return _bits(fn(_gpu(q), _gpu(cache), _gpu(topk), _gpu(bt),
                        _gpu(rid.astype(np.int32)), _gpu(apos.astype(np.int32)),
                        _gpu(np.float32(1.0)), _gpu(np.float32(0.5))))

    full = run(q, topk, req, pos)
    assert (full != 0).any()
    for t in range(T):
        np.testing.assert_array_equal(run(q[t:t + 1], topk[:, t:t + 1], req[t:t + 1],
                                          pos[t:t + 1]), full[t:t + 1])


@pytest.mark.parametrize("dql", [2, 4])
def test_decode_row_independent_of_tile_mates(rng, dql):
    """MTP rows: a row's bits must not depend on what its tile-mates (the other rows of
    its request) selected: nothing, or the first row's blocks; the first row of every request
    keeps its bits. The request's later rows attend a key past the first row's limit whose bytes
    are NaN, in a block every row selects: the first row stays finite and matches the float64
    oracle (SPEC §5.2: V select-masked per row)."""
    Hkv, K, G = 2, 16, 16
    seq_lens = np.array([1500, 0, 640, 2049, 77, 3000])
    cache, bt, M, P = _setup(rng, Hkv, seq_lens, K)
    req, pos = oracle.decode_rows(seq_lens, dql)
    T = len(req)
    topk = _topk(rng, Hkv, T, K, (pos + 1 + 127) // 128, M)
    # the last key of every request: NaN block scales (K and V); slot 0 of each row selects its block
    cache = np.array(cache)
    flat = cache.reshape(P, 2 * Hkv, 128 * 72)  # a view: the tile's data and scale planes
    for r, n in enumerate(seq_lens):
        if n <= 0:
            continue
        b, o = (n - 1) // 128, (n - 1) % 128
        flat[bt[r, b], :, 8192 + 8 * o + 1] = 0x7F  # K and V: d 16..31 of that key
        topk[:, r * dql:(r + 1) * dql, 0] = b
    q = np.asarray(jnp.asarray(rng.standard_normal((T, Hkv * G, 128)), jnp.bfloat16))
    fn = jax.jit(lambda *a: m3.sparse_decode(*a, decode_query_len=dql))
    cache_d = _gpu(cache)

    def run(tk):
        return fn(_gpu(q), cache_d, _gpu(tk), _gpu(bt), _gpu(seq_lens.astype(np.int32)),
                  _gpu(np.float32(0.8)), _gpu(np.float32(1.3)))

    full = run(topk)
    first = np.arange(T) % dql == 0
    out = np.asarray(full.astype(jnp.float32))
    ref = oracle.attention(np.asarray(jnp.asarray(q).astype(jnp.float32)), cache, topk, bt, req,
                           pos, np.float32(0.8), np.float32(1.3))
    assert np.isfinite(out[first]).all()
    cos, relf = oracle.metrics(out[first], ref[first])
    assert cos >= GPU_COS and relf <= GPU_RELF, (cos, relf)
    live_last = (np.arange(T) % dql == dql - 1) & (seq_lens[req] > 0)
    assert np.isnan(out[live_last]).any()  # the NaN key reaches the row that attends it
    full = _bits(full)
    mates = np.arange(T) - np.arange(T) % dql  # each row's first row
    for variant in ("none", "first"):
        tk = topk.copy()
        tk[:, ~first] = -1 if variant == "none" else topk[:, mates[~first]]
        np.testing.assert_array_equal(_bits(run(tk))[first], full[first])


# ---------------------------------------------------------------- select_blocks (SPEC §8)

def _select_native():
    return _gpus() and _ffi.has_native("select_blocks", "cuda")


def _select_case(rng, ctx, rows_per_req, Hkv=2, Di=128, key_dtype=jnp.bfloat16, L=None,
                 exact=True, q_dtype=jnp.float32):
    """Requests with contexts `ctx` (pages scattered over a pool) and their last rows; exact
    data (small multiples of powers of two: every dot product is exact in fp32, so the CUDA
    kernel must equal the reference bit for bit, exact ties included) or normal data."""
    ctx = np.asarray(ctx)
    nblk = (ctx + 127) // 128
    R, M, P = len(ctx), int(nblk.max()) + 1, int(nblk.sum()) + 5
    pages = rng.permutation(P)
    bt = -np.ones((R, M), np.int32)
    i = 0
    for r, n in enumerate(nblk):
        bt[r, :n] = pages[i:i + n]
        i += n
    shape = (P, 128, Di) if L is None else (L, P, 128, Di)
    if exact:
        keys = rng.integers(-4, 5, shape) / 4.0
    else:
        keys = rng.standard_normal(shape)
    keys = jnp.asarray(keys, jnp.float32).astype(key_dtype)
    req = np.repeat(np.arange(R), rows_per_req).astype(np.int32)
    pos = np.concatenate([np.arange(n - k, n) for n, k in zip(ctx, rows_per_req)]).astype(np.int32)
    T = len(req)
    if exact:
        q = rng.integers(-8, 9, (T, Hkv, Di)) / 4.0 + rng.integers(-32, 33, (T, Hkv, Di)) / 256.0
        if q_dtype == jnp.bfloat16:
            q = rng.integers(-8, 9, (T, Hkv, Di)) / 4.0
    else:
        q = rng.standard_normal((T, Hkv, Di))
    return jnp.asarray(q, q_dtype), keys, bt, req, pos


@pytest.mark.skipif(not _select_native(), reason="no CUDA device, or select_blocks not in its CUDA module")
@pytest.mark.parametrize("key_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
def test_select_blocks_matches_reference(rng, key_dtype, q_dtype):
    """Exact data: the CUDA kernel equals the jnp reference exactly; mixed decode rows, an MTP
    run and a prefill run, padding rows (request -1 and R, position -1), invalid pages (a local
    block's too), ties from duplicated blocks, local_blocks 1 and 2, K above the blocks."""
    q, keys, bt, req, pos = _select_case(rng, [3000, 129, 1100, 700], [2, 1, 4, 40],
                                         key_dtype=key_dtype, q_dtype=q_dtype)
    req, pos, bt = req.copy(), pos.copy(), bt.copy()
    req[0], req[2], pos[3] = -1, len(bt), -1
    bt[2, 1], bt[3, 5] = -1, 10 ** 6                     # request 3's local block page invalid
    k = np.array(keys)
    k[bt[0, 7]] = k[bt[0, 3]]                            # an exact tie: blocks 3 and 7
    keys = jnp.asarray(k)
    for K, local in ((8, 1), (8, 2), (40, 1)):
        args = (q, keys, bt, req, pos)
        got = m3.select_blocks(*map(_gpu, args), topk_blocks=K, local_blocks=local)
        want = m3.reference.select_blocks(*args, topk_blocks=K, local_blocks=local)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.skipif(not _select_native(), reason="no CUDA device, or select_blocks not in its CUDA module")
def test_select_blocks_4d_layer_in_scan(rng):
    """A 4-D cache inside jit(lax.scan) over the layers (the layer a traced device scalar; XLA
    may put the call in a command buffer): each layer equals the reference; a layer outside
    [0, L) gives all -1."""
    q, keys, bt, req, pos = _select_case(rng, [900, 2000, 300], [2, 1, 3], L=3)

    @jax.jit
    def per_layer(q, keys, bt, req, pos):
        def body(c, layer):
            return c, m3.select_blocks(q, keys, bt, req, pos, topk_blocks=6, layer=layer)
        return jax.lax.scan(body, 0, jnp.arange(4, dtype=jnp.int32))[1]

    got = np.asarray(per_layer(*map(_gpu, (q, keys, bt, req, pos))))
    for layer in range(3):
        want = m3.reference.select_blocks(q, keys, bt, req, pos, topk_blocks=6,
                                          layer=jnp.int32(layer))
        np.testing.assert_array_equal(got[layer], np.asarray(want))
    assert (got[3] == -1).all()


@pytest.mark.skipif(not _select_native(), reason="no CUDA device, or select_blocks not in its CUDA module")
def test_select_blocks_batch_and_pool_invariant(rng):
    """Normal data (rounding matters): each request's rows are bit-identical alone and in the
    batch, and with its pages moved into a 4x pool (SPEC §8 step 6)."""
    ctx, rows = [4000, 700, 2600, 130, 5000], [1, 3, 30, 1, 2]
    q, keys, bt, req, pos = _select_case(rng, ctx, rows, Hkv=4, exact=False)
    fn = jax.jit(lambda *a: m3.select_blocks(*a, topk_blocks=16))
    full = np.asarray(fn(*map(_gpu, (q, keys, bt, req, pos))))
    t0 = 0
    for n in rows:
        sl = slice(t0, t0 + n)
        alone = fn(*map(_gpu, (q[sl], keys, bt, req[sl], pos[sl])))
        np.testing.assert_array_equal(np.asarray(alone), full[:, sl])
        t0 += n
    P = keys.shape[0]
    perm = rng.permutation(4 * P)[:P]
    big = jnp.zeros((4 * P,) + keys.shape[1:], keys.dtype).at[perm].set(keys)
    bt2 = np.where((bt >= 0) & (bt < P), perm[np.clip(bt, 0, P - 1)], bt).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(fn(*map(_gpu, (q, big, bt2, req, pos)))), full)


# ------------------------------------------------------------------ grouped_matmul (SPEC §9)
def _grouped_operands(rng, M, K, G, N):
    return (_gpu(jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)),
            _gpu(jnp.asarray(rng.normal(size=(G, N, K)) * 0.05, jnp.bfloat16)))


@pytest.mark.parametrize("M,K,G,N,sizes", [
    (37, 72, 5, 40, [9, 0, 20, 3, 5]),
    (50, 136, 4, 200, [7, -4, 100, 9]),
    (24, 384, 128, 768, None),                  # one TP-8 rank's experts, 6 tokens × k 4
])
def test_grouped_matmul_matches_oracle(rng, M, K, G, N, sizes):
    lhs, rhs = _grouped_operands(rng, M, K, G, N)
    if sizes is None:
        sizes = np.bincount(rng.integers(0, G, M), minlength=G)
    sizes = _gpu(jnp.asarray(sizes, jnp.int32))
    got = np.asarray(jax.jit(m3.grouped_matmul)(lhs, rhs, sizes))
    want = oracle.grouped_matmul(lhs, rhs, sizes)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())
    assert not np.any(got[np.all(want == 0, axis=1)])


@pytest.mark.parametrize("T,K,G,N,k", [
    (6, 384, 128, 768, 4),          # decode: one TP-8 rank's down_proj K, 16-row tiles
    (300, 256, 8, 256, 4),          # prefill-sized groups: 64-row tiles
    (40, 6144, 128, 768, 4),        # gate_up K 6144
])
def test_grouped_matmul_gathered_rows_equal_the_copy(rng, T, K, G, N, k):
    """SPEC §9 item 4: lhs_rows (the sorted pairs' tokens, plus ids out of range) gives the
    bits of the call on the gathered copy, bf16 and MXFP8."""
    lhs, rhs = _grouped_operands(rng, T, K, G, N)
    chosen = rng.integers(0, G, (T, k))
    order = np.argsort(chosen.reshape(-1), kind="stable")
    rows = (order // k).astype(np.int32)
    rows[::7] = np.where(np.arange(len(rows[::7])) % 2, -1, T + 3)   # zero rows
    sizes = _gpu(jnp.asarray(np.bincount(chosen.reshape(-1), minlength=G), jnp.int32))
    rows = _gpu(jnp.asarray(rows))
    ok = (rows >= 0) & (rows < T)
    copy = jnp.where(ok[:, None], lhs[jnp.clip(rows, 0, T - 1)], 0).astype(jnp.bfloat16)
    for w in ((rhs,), m3.mxfp8_quantize(rhs)) if K % 128 == 0 else ((rhs,),):
        got = np.asarray(jax.jit(lambda a, r: m3.grouped_matmul(a, *w[:1], sizes, *w[1:],
                                                                lhs_rows=r))(lhs, rows))
        want = np.asarray(jax.jit(lambda a: m3.grouped_matmul(a, *w[:1], sizes, *w[1:]))(copy))
        np.testing.assert_array_equal(got, want)
        assert not np.any(got[~np.asarray(ok)])


@pytest.mark.parametrize("M,K,G,N", [(24, 384, 128, 6144), (600, 384, 8, 640)])
def test_grouped_matmul_bf16_output_is_the_fp32_result_rounded(rng, M, K, G, N):
    """SPEC §9 item 5: out_dtype bfloat16 stores each fp32 result rounded to nearest even (16-
    and 64-row tiles, gathered rows, bf16 and MXFP8 weights), zeros for uncovered rows."""
    lhs, rhs = _grouped_operands(rng, M, K, G, N)
    counts = np.bincount(rng.integers(0, G, M - 5), minlength=G)     # 5 rows uncovered
    sizes = _gpu(jnp.asarray(counts, jnp.int32))
    rows = _gpu(jnp.asarray(rng.permutation(M).astype(np.int32)))
    for w in ((rhs,), m3.mxfp8_quantize(rhs)):
        for kw in ({}, {"lhs_rows": rows}):
            f32 = jax.jit(lambda a: m3.grouped_matmul(a, *w[:1], sizes, *w[1:], **kw))(lhs)
            bf16 = jax.jit(lambda a: m3.grouped_matmul(a, *w[:1], sizes, *w[1:], **kw,
                                                       out_dtype=jnp.bfloat16))(lhs)
            np.testing.assert_array_equal(np.asarray(bf16), np.asarray(f32.astype(jnp.bfloat16)))
            assert not np.asarray(bf16[M - 5:], np.float32).any()


@pytest.mark.parametrize("M,K,G,N", [(24, 6144, 128, 768), (600, 384, 8, 640),
                                     (2000, 256, 16, 768)])
def test_grouped_matmul_epilogue(rng, M, K, G, N):
    """SPEC §9 item 6 on CUDA (16- and 64-row tiles, gathered rows, bf16 / MXFP8 / NVFP4
    weights): the fused call equals the plain fp32 call finished by the reference's epilogue
    to a few fp32 ulps, zeros for uncovered rows; through jax.jit, bf16 out = the fp32 out
    rounded; the XLA reference agrees."""
    lhs, rhs = _grouped_operands(rng, M, K, G, N)
    counts = np.bincount(rng.integers(0, G, M - 5), minlength=G)     # 5 rows uncovered
    sizes = _gpu(jnp.asarray(counts, jnp.int32))
    rows = _gpu(jnp.asarray(rng.permutation(M).astype(np.int32)))
    rs = _gpu(jnp.asarray(rng.uniform(0.2, 2, M), jnp.float32))
    gs = _gpu(jnp.asarray(rng.uniform(0.5, 2, G), jnp.float32))
    group = np.repeat(np.arange(G), counts)
    weights = [(rhs,), m3.mxfp8_quantize(rhs)]
    if K % 128 == 0:
        weights.append(m3.nvfp4_quantize(rhs, 1.0)[:2])
    for w in weights:
        for kw in ({}, {"lhs_rows": rows}):
            plain = np.asarray(jax.jit(lambda a: m3.grouped_matmul(a, *w[:1], sizes, *w[1:],
                                                                    **kw))(lhs))
            P = plain[:M - 5] * np.asarray(gs)[group][:, None]
            # both activations on bf16 weights; the quantized formats' loaders with one
            # (each variant is a compilation: the test must fit a device call)
            for act in ("swiglu", "swiglu_oai") if len(w) == 1 else ("swiglu_oai",):
                f = jax.jit(lambda a, r, g, o=jnp.float32: m3.grouped_matmul(
                    a, *w[:1], sizes, *w[1:], **kw, activation=act, row_scale=r,
                    group_scale=g, out_dtype=o), static_argnums=3)
                got = np.asarray(f(lhs, rs, gs, jnp.float32))
                want = np.asarray(m3.reference.swiglu(jnp.asarray(P[:, :N // 2]),
                                                      jnp.asarray(P[:, N // 2:]), act))
                want = want * np.asarray(rs)[:M - 5, None]
                assert got.shape == (M, N // 2)
                np.testing.assert_allclose(got[:M - 5], want, rtol=4e-6,
                                           atol=1e-6 * np.abs(want).max())
                assert not got[M - 5:].any()
                bf16 = f(lhs, rs, gs, jnp.bfloat16)
                np.testing.assert_array_equal(np.asarray(bf16),
                                              np.asarray(jnp.asarray(got).astype(jnp.bfloat16)))
    ref = m3.reference.grouped_matmul(lhs, rhs, sizes, activation="swiglu_oai", row_scale=rs,
                                      group_scale=gs)
    got = jax.jit(lambda a: m3.grouped_matmul(a, rhs, sizes, activation="swiglu_oai",
                                              row_scale=rs, group_scale=gs))(lhs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4,
                               atol=1e-4 * np.abs(np.asarray(ref)).max())


def test_grouped_matmul_rows_batch_invariant_in_scan(rng):
    """A row's bits do not depend on the other rows (decode-sized and prefill-sized calls take
    different tile heights), inside lax.scan over stacked layers."""
    M, K, G, N, L = 512, 256, 16, 384, 2
    lhs, _ = _grouped_operands(rng, M, K, G, N)
    rhs = _gpu(jnp.asarray(rng.normal(size=(L, G, N, K)) * 0.05, jnp.bfloat16))
    full_sizes = _gpu(jnp.full((G,), M // G, jnp.int32))

    def scan(x, sizes):
        return jax.lax.scan(lambda c, w: (c, m3.grouped_matmul(x, w, sizes)), 0, rhs)[1]

    full = np.asarray(jax.jit(scan)(lhs, full_sizes))
    few = np.zeros(G, np.int32)
    few[5] = 3
    alone = np.asarray(jax.jit(scan)(lhs[5 * (M // G):5 * (M // G) + 3], _gpu(jnp.asarray(few))))
    np.testing.assert_array_equal(alone, full[:, 5 * (M // G):5 * (M // G) + 3])


def _mxfp8_weights(rng, G, N, K, spread=6, edge=False):
    """MXFP8 weights whose 32-blocks differ in scale by up to 2^±spread; ``edge``: some blocks
    at exponents 0 (2^-127: products flushed to ±0), 1, 254 and 255 (NaN)."""
    w = rng.normal(size=(G, N, K // 32, 32)) * 2.0 ** rng.integers(-spread, spread + 1,
                                                                    (G, N, K // 32, 1))
    data, scale = m3.mxfp8_quantize(jnp.asarray(w.reshape(G, N, K), jnp.float32))
    scale = np.asarray(scale).copy()
    if edge:
        pick = rng.random(scale.shape)
        scale[pick < 0.02] = 0
        scale[(pick >= 0.02) & (pick < 0.04)] = 1
        scale[(pick >= 0.04) & (pick < 0.05)] = 254
        scale[(pick >= 0.05) & (pick < 0.06)] = 255
    return _gpu(data), _gpu(jnp.asarray(scale))


@pytest.mark.parametrize("M,K,G,N,sizes,edge", [
    (37, 128, 5, 40, [9, 0, 20, 3, 5], True),
    (300, 256, 4, 200, [70, -4, 200, 9], False),   # 64-row tiles
    (24, 384, 128, 768, None, False),              # one TP-8 rank: down_proj K, 6 tokens × k 4
    (16, 6144, 128, 768, None, False),             # gate_up_proj K 6144, 4 tokens × k 4
])
def test_grouped_matmul_mxfp8_equals_bf16_on_dequantized(rng, M, K, G, N, sizes, edge):
    """SPEC §9.1: the kernel on MXFP8 weights equals the kernel on mxfp8_dequantize's bf16
    weights bit for bit (NaN where they are NaN), and the float64 oracle within rounding."""
    lhs, _ = _grouped_operands(rng, M, K, 1, 1)
    data, scale = _mxfp8_weights(rng, G, N, K, edge=edge)
    if sizes is None:
        sizes = np.bincount(rng.integers(0, G, M), minlength=G)
    sizes = _gpu(jnp.asarray(sizes, jnp.int32))
    got = np.asarray(jax.jit(m3.grouped_matmul)(lhs, data, sizes, scale))
    bf16 = np.asarray(jax.jit(lambda a, d, s, n: m3.grouped_matmul(
        a, m3.mxfp8_dequantize(d, s), n))(lhs, data, scale, sizes))
    np.testing.assert_array_equal(got, bf16)
    if not edge:
        want = oracle.grouped_matmul(lhs, data, sizes, rhs_scale=scale)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("M,K,G,N,sizes", [
    (37, 128, 5, 40, [9, 0, 20, 3, 5]),
    (50, 384, 4, 200, [7, -4, 100, 9]),
    (300, 1024, 3, 264, [40, 250, 10]),          # 64-row tiles
    (24, 6144, 128, 768, None),                  # one TP-8 rank's gate_up, 6 tokens × k 4
])
def test_grouped_matmul_w8a8_matches_oracle(rng, M, K, G, N, sizes):
    """SPEC §9.2: MXFP8 rows × MXFP8 weights on the tensor cores equal the float64 products of
    the two dequantized operands within fp32 rounding, through jit."""
    x = rng.normal(size=(M, K // 32, 32)) * 2.0 ** rng.integers(-3, 4, (M, K // 32, 1))
    a8, ae = (_gpu(v) for v in m3.mxfp8_quantize(jnp.asarray(x.reshape(M, K), jnp.float32)))
    data, scale = _mxfp8_weights(rng, G, N, K)
    if sizes is None:
        sizes = np.bincount(rng.integers(0, G, M), minlength=G)
    f = jax.jit(lambda a, d, n, s, e: m3.grouped_matmul(a, d, n, s, lhs_scale=e))
    got = np.asarray(f(a8, data, _gpu(jnp.asarray(sizes, jnp.int32)), scale, ae))
    want = oracle.grouped_matmul(a8, data, sizes, rhs_scale=scale, lhs_scale=ae)
    mag = oracle.grouped_matmul(np.abs(oracle.mxfp8_weights(a8, ae)), np.abs(
        oracle.mxfp8_weights(data, scale)), sizes)
    assert np.all(np.abs(got - want) <= 1e-5 * mag + 1e-30), np.max(np.abs(got - want) / (mag + 1e-30))


def test_grouped_matmul_w8a8_rows_batch_invariant_and_gathered(rng):
    """An MXFP8 row's bits do not depend on the other rows (16- and 64-row tiles), and the
    gathered launch (lhs_rows) gives the sorted copy's bits."""
    M, K, G, N = 512, 256, 16, 384
    a8, ae = (_gpu(v) for v in m3.mxfp8_quantize(jnp.asarray(rng.normal(size=(M, K)),
                                                             jnp.float32)))
    data, scale = _mxfp8_weights(rng, G, N, K)
    f = jax.jit(lambda a, n, e, r=None: m3.grouped_matmul(a, data, n, scale, lhs_scale=e,
                                                          lhs_rows=r))
    full = np.asarray(f(a8, _gpu(jnp.full((G,), M // G, jnp.int32)), ae))
    few = np.zeros(G, np.int32)
    few[5] = 3
    rows = slice(5 * (M // G), 5 * (M // G) + 3)
    np.testing.assert_array_equal(np.asarray(f(a8[rows], _gpu(jnp.asarray(few)), ae[rows])),
                                  full[rows])
    perm = rng.permutation(M).astype(np.int32)
    inv = np.argsort(perm).astype(np.int32)
    gathered = np.asarray(f(a8[perm], _gpu(jnp.full((G,), M // G, jnp.int32)), ae[perm],
                            _gpu(jnp.asarray(inv))))
    np.testing.assert_array_equal(gathered, full)


def _fp4_weights(rng, G, N, K, fmt):
    """Packed FP4 weights as the quantizers make them (MXFP4: mxfp4_quantize; NVFP4:
    nvfp4_quantize at global scale 1) of blocks whose scales differ by up to 2^±6."""
    w = rng.normal(size=(G, N, K // 32, 32)) * 2.0 ** rng.integers(-6, 7, (G, N, K // 32, 1))
    w = jnp.asarray(w.reshape(G, N, K), jnp.float32)
    data, scale = m3.mxfp4_quantize(w) if fmt == "mxfp4" else m3.nvfp4_quantize(w, 1.0)
    return _gpu(data), _gpu(scale)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("M,K,G,N,sizes", [
    (37, 128, 5, 40, [9, 0, 20, 3, 5]),
    (300, 256, 4, 200, [70, -4, 200, 9]),         # 64-row tiles
    (24, 384, 128, 768, None),                    # one TP-8 rank: down_proj K, 6 tokens × k 4
    (16, 6144, 128, 768, None),                   # gate_up_proj K 6144, 4 tokens × k 4
])
def test_grouped_matmul_fp4_matches_oracle(rng, fmt, M, K, G, N, sizes):
    """SPEC §9.3: the kernel on packed FP4 weights equals the float64 oracle on the decoded
    weights and the bf16 kernel on fp4_dequantize's weights within fp32 rounding (it sums each
    32 k in its own order); gathered rows give the sorted copy's bits."""
    lhs, _ = _grouped_operands(rng, M, K, 1, 1)
    data, scale = _fp4_weights(rng, G, N, K, fmt)
    if sizes is None:
        sizes = np.bincount(rng.integers(0, G, M), minlength=G)
    sizes = _gpu(jnp.asarray(sizes, jnp.int32))
    got = np.asarray(jax.jit(m3.grouped_matmul)(lhs, data, sizes, scale))
    bf16 = np.asarray(jax.jit(lambda a, d, s, n: m3.grouped_matmul(
        a, m3.fp4_dequantize(d, s), n))(lhs, data, scale, sizes))
    want = oracle.grouped_matmul(lhs, data, sizes, rhs_scale=scale)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())
    np.testing.assert_allclose(got, bf16, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    perm = rng.permutation(M).astype(np.int32)
    gathered = np.asarray(jax.jit(lambda a, r: m3.grouped_matmul(a, data, sizes, scale,
                                                                 lhs_rows=r))(
        lhs[perm], _gpu(jnp.asarray(np.argsort(perm).astype(np.int32)))))
    np.testing.assert_array_equal(gathered, got)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_grouped_matmul_quantized_rows_batch_invariant(rng, fmt):
    """With MXFP8 or FP4 weights a row's bits do not depend on the other rows (16- and 64-row
    tiles)."""
    M, K, G, N = 512, 256, 16, 384
    lhs, _ = _grouped_operands(rng, M, K, 1, 1)
    data, scale = (_mxfp8_weights(rng, G, N, K) if fmt == "mxfp8" else
                   _fp4_weights(rng, G, N, K, fmt))
    full = np.asarray(jax.jit(m3.grouped_matmul)(lhs, data, _gpu(jnp.full((G,), M // G,
                                                                          jnp.int32)), scale))
    few = np.zeros(G, np.int32)
    few[5] = 3
    rows = slice(5 * (M // G), 5 * (M // G) + 3)
    alone = np.asarray(jax.jit(m3.grouped_matmul)(lhs[rows], data, _gpu(jnp.asarray(few)), scale))
    np.testing.assert_array_equal(alone, full[rows])


# ----------------------------------------------------------------------------- full_attention
def _full_problem(rng, Hkv, G, seq_lens, chunk, dtype):
    """Prefill chunks (chunk[r] last tokens of request r) and 3 padding rows, at contexts of
    several 32-block parts; returns (q, cache, bt, req, pos)."""
    seq_lens = np.asarray(seq_lens)
    cache, bt, M, P = _setup(rng, Hkv, seq_lens, 1)
    cu = np.concatenate([[0], np.cumsum(chunk)]).astype(np.int32)
    req, pos = oracle.positions(cu, (seq_lens - chunk).astype(np.int32), int(cu[-1]) + 3)
    q = np.asarray(jnp.asarray(rng.standard_normal((len(req), G * Hkv, 128)), dtype))
    return q, cache, bt, req.astype(np.int32), pos.astype(np.int32)


def _full(q, cache, bt, req, pos, ws=None, part=full_ops.PART_BLOCKS):
    """full_attention on the GPU with parts of ``part`` blocks; ``ws`` (a workspace shape)
    forces a launch shape ((Hkv, 1): one CTA per row folding its parts)."""
    def fn(*a):
        return full_ops.bind(*a, jnp.float32(1.0), jnp.float32(0.5), jnp.int32(0),
                             scale=128 ** -0.5, layout=0, part_blocks=part, workspace=ws)
    return jax.jit(fn)(*map(_gpu, (q, cache, bt, req, pos)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("Hkv,G", [(1, 8), (2, 16)])
def test_full_attention_matches_oracle(rng, dtype, Hkv, G):
    """Every key up to each token's position, at contexts of 1-3 parts (part boundaries at
    4096 keys), through the public op; rows of nothing are zeros."""
    q, cache, bt, req, pos = _full_problem(rng, Hkv, G, [9000, 130, 4100], [5, 2, 4], dtype)
    out = jax.jit(lambda *a: m3.full_attention(*a, 1.0, 0.5))(*map(_gpu, (q, cache, bt, req, pos)))
    out = np.asarray(jnp.asarray(out, jnp.float32))
    topk = np.broadcast_to(np.arange(bt.shape[1], dtype=np.int32), (Hkv, len(req), bt.shape[1]))
    ref = oracle.attention(np.asarray(jnp.asarray(q, jnp.float32)), cache, topk, bt, req, pos,
                           1.0, 0.5)
    cos, relf = oracle.metrics(out, ref)
    assert np.isfinite(out).all() and (out[req < 0] == 0).all()
    assert cos >= GPU_COS and relf <= GPU_RELF, (cos, relf)


@pytest.mark.parametrize("part", [full_ops.PART_BLOCKS, 7, 64])
def test_full_attention_launch_shapes_and_batch_give_the_same_bits(rng, part):
    """One CTA per part plus the merge, or one CTA per row folding its parts: the same bits;
    a row alone equals the row in a batch; every part size agrees with the oracle."""
    q, cache, bt, req, pos = _full_problem(rng, 1, 8, [9000, 4097, 300], [4, 3, 2],
                                           jnp.bfloat16)
    parts = _bits(_full(q, cache, bt, req, pos, part=part))
    rows = _bits(_full(q, cache, bt, req, pos, ws=(1, 1), part=part))
    out = np.asarray(jnp.asarray(_full(q, cache, bt, req, pos, part=part), jnp.float32))
    topk = np.broadcast_to(np.arange(bt.shape[1], dtype=np.int32), (1, len(req), bt.shape[1]))
    ref = oracle.attention(np.asarray(jnp.asarray(q, jnp.float32)), cache, topk, bt, req, pos,
                           1.0, 0.5)
    cos, relf = oracle.metrics(out, ref)
    assert cos >= GPU_COS and relf <= GPU_RELF, (cos, relf)
    assert (parts != 0).any()
    np.testing.assert_array_equal(parts, rows)
    for t in (0, 3, 5, 7):
        np.testing.assert_array_equal(
            _bits(_full(q[t:t + 1], cache, bt, req[t:t + 1], pos[t:t + 1], part=part)),
            parts[t:t + 1])


@pytest.mark.parametrize("T,E,k", [(1, 128, 4), (4, 128, 4), (8, 128, 4), (3, 16, 8),
                                   (9, 128, 4), (128, 256, 8), (129, 128, 4), (2048, 128, 4),
                                   (5000, 7, 3), (300, 512, 1)])
@pytest.mark.parametrize("ties", [False, True])
def test_route_experts_matches_oracle(rng, T, E, k, ties):
    """SPEC §10: the CUDA kernel (one warp grouping up to 32 pairs, one launch up to 128
    tokens, two above) gives the oracle's fields bit for bit: ties, NaN, ±0, bias, padding
    rows."""
    scores = oracle.route_scores(rng, T, E, ties)
    bias = (rng.normal(size=E) * 0.1).astype(np.float32)
    if ties:
        bias = np.round(bias * 8) / 8
    live = rng.uniform(size=T) > 0.2
    got = jax.jit(lambda s, b, l: m3.route_experts(s, k, bias=b, live=l))(
        _gpu(jnp.asarray(scores)), _gpu(jnp.asarray(bias)), _gpu(jnp.asarray(live)))
    for name, g, w in zip(m3.ExpertRouting._fields, got, oracle.route_experts(scores, bias, live, k)):
        np.testing.assert_array_equal(np.asarray(g), w, err_msg=name)


@pytest.mark.parametrize("M,N,K", [(1, 128, 6144), (4, 1536, 6144), (5, 6144, 1024),
                                   (17, 6144, 384), (33, 100, 64), (64, 768, 6144),
                                   (130, 50, 128), (0, 16, 64), (3, 0, 64)])
def test_dense_matmul_matches_oracle(rng, M, N, K):
    """SPEC §11: the CUDA kernel within the fp32 summation bound of a float64 oracle; bf16
    output = the fp32 result rounded, bit for bit; N not a multiple of 16, K of one chunk."""
    lhs = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(N, K)) / np.sqrt(K), jnp.bfloat16)
    f = jax.jit(m3.dense_matmul, static_argnames="out_dtype")
    got = np.asarray(f(_gpu(lhs), _gpu(rhs)))
    want, bound = oracle.dense_matmul(lhs, rhs)
    assert got.shape == (M, N)
    assert np.all(np.abs(got - want) <= bound)
    bf = np.asarray(f(_gpu(lhs), _gpu(rhs), out_dtype=jnp.bfloat16))
    np.testing.assert_array_equal(bf.astype(np.float32),
                                  np.asarray(jnp.asarray(got).astype(jnp.bfloat16), np.float32))


@pytest.mark.parametrize("K,N", [(1024, 272), (6144, 128)])
def test_dense_matmul_rows_do_not_depend_on_the_batch(rng, K, N):
    """A row's bits are the same alone, in batches of every size the launch treats differently
    (8, 16, 32 rows per CTA row; several CTA rows), and with NaN/inf in other rows; a NaN in
    one weight row reaches only its own column; the same through a scan over stacked weights.
    6144 x 128 is M3's router at TP 8 (8 CTAs of 16 warps)."""
    lhs = jnp.asarray(rng.normal(size=(100, K)), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(N, K)) / 32, jnp.bfloat16)
    f = jax.jit(m3.dense_matmul)
    alone = np.concatenate([np.asarray(f(_gpu(lhs[i:i + 1]), _gpu(rhs))) for i in range(100)])
    for M in (3, 8, 9, 16, 31, 32, 33, 100):
        np.testing.assert_array_equal(np.asarray(f(_gpu(lhs[:M]), _gpu(rhs))), alone[:M])
    bad = lhs.at[5].set(jnp.nan).at[6, 3].set(jnp.inf)
    got = np.asarray(f(_gpu(bad), _gpu(rhs)))
    np.testing.assert_array_equal(np.delete(got, [5, 6], 0), np.delete(alone, [5, 6], 0))
    assert np.isnan(got[5]).all()
    nan_w = np.asarray(f(_gpu(lhs[:9]), _gpu(rhs.at[7, K - 5].set(jnp.nan))))
    assert np.isnan(nan_w[:, 7]).all()
    np.testing.assert_array_equal(np.delete(nan_w, 7, 1), np.delete(alone[:9], 7, 1))
    stack = _gpu(jnp.stack([rhs, rhs[::-1]]))
    scanned = jax.jit(lambda x, ws: jax.lax.scan(
        lambda c, w: (c, m3.dense_matmul(x, w)), 0, ws)[1])(_gpu(lhs[:4]), stack)
    np.testing.assert_array_equal(np.asarray(scanned[0]), alone[:4])
    np.testing.assert_array_equal(np.asarray(scanned[1]), alone[:4, ::-1])
