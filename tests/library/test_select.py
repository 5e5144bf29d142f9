"""select_blocks (SPEC §8): the native CPU kernel (every CPU path this machine has) against the
pure-jnp reference and a NumPy brute force of the SPEC rule written here; bit-identity in any
batch, pool size and page placement; trace-time errors; vmap, export and KV-head sharding."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_m3sparse as m3
from jax_m3sparse import _m3sparse_cpu, reference

PATHS = _m3sparse_cpu.cpu_paths()
NATIVE = "cpu" in m3.native_platforms()
# Relative gap under which two blocks' fp32 scores may rank differently on two backends (their
# summation orders differ): a Di-term fp32 dot product is off by at most ~Di·2⁻²⁴ of Σ|q·k|.
EPS = 1e-5


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """The handler reads M3SPARSE_CPU_ISA on every call (no recompile needed)."""
    monkeypatch.setenv("M3SPARSE_CPU_ISA", request.param)
    return request.param


def native(*args, **kw):
    assert NATIVE
    return np.asarray(jax.jit(lambda *a: m3.select_blocks(*a, **kw))(*args))


def ref(*args, **kw):
    return np.asarray(jax.jit(lambda *a: reference.select_blocks(*a, **kw))(*args))


# ----------------------------------------------------------------------------- the oracle
def brute_scores(q, keys, table, req, pos, layer=None):
    """SPEC §8 steps 1-3 literally, in float64: {(g, t): [s(b) for candidate b]}, None for a
    padding row. keys: float32 [P, N, Di] or [L, P, N, Di]."""
    q = np.asarray(q, np.float32).astype(np.float64)
    keys = np.asarray(keys).astype(np.float64)
    if keys.ndim == 4:
        keys = keys[layer] if 0 <= layer < keys.shape[0] else None
    R, M = table.shape
    out = {}
    for t in range(q.shape[0]):
        r, p = int(req[t]), int(pos[t])
        for g in range(q.shape[1]):
            if keys is None or not (0 <= r < R) or p < 0:
                out[g, t] = None
                continue
            Pn, N = keys.shape[:2]
            s = []
            for b in range(min(p // N, M - 1) + 1):
                page = int(table[r, b])
                if not 0 <= page < Pn:
                    s.append(-np.inf)
                    continue
                with np.errstate(invalid="ignore", over="ignore"):
                    d = keys[page, :min(N, p - b * N + 1)] @ q[t, g]
                d = d[~np.isnan(d)]
                s.append(d.max() if d.size else -np.inf)
            out[g, t] = s
    return out


def brute_select(scores, pos, N, K, local_blocks, Hkv, T):
    """SPEC §8 step 4 from brute_scores."""
    out = np.full((Hkv, T, K), -1, np.int32)
    for (g, t), s in scores.items():
        if s is None:
            continue
        own = int(pos[t]) // N
        near = [b for b in range(len(s)) if b > own - local_blocks]
        rest = sorted((b for b in range(len(s)) if b not in near and np.isfinite(s[b])),
                      key=lambda b: (-s[b], b))
        ids = (near + rest)[:K]
        out[g, t, :len(ids)] = ids
    return out


def widened(x):
    return np.asarray(x).astype(np.float32)


def assert_same_up_to_near_ties(got, want, scores, tol):
    """got == want except where, at a position k, the two ids' scores s (of the oracle) agree
    within tol(g, t): |s(got) − s(want)| ≤ tol (a near-tie ranked the other way)."""
    for g, t, k in zip(*np.nonzero(got != want)):
        a, b = int(got[g, t, k]), int(want[g, t, k])
        assert a >= 0 and b >= 0, (g, t, k, got[g, t], want[g, t])
        s = scores[g, t]
        assert abs(s[a] - s[b]) <= tol(g, t), (g, t, k, a, b, s[a], s[b])


# ----------------------------------------------------------------------------- problems
def adversarial(rng, key_dtype, q_dtype, N=16, Di=32, Hkv=3, four_d=False):
    """Integer-valued q and keys (every dot product exact in fp32 and fp64, so ties are exact):
    positions at block boundaries, K above the blocks so far, invalid pages (−1, ≥ P)
    including a local block's, padding rows (req −1, req ≥ R, pos −1), a run of rows of one
    request (decode_query_len > 1 style), several requests in one chunk, NaN keys."""
    Pn, R, M = 40, 4, 9
    keys = rng.integers(-2, 3, (Pn, N, Di)).astype(np.float32)
    keys[5, 3] = np.nan                                   # one NaN key in page 5
    keys[6] = np.nan                                      # a page of NaN keys
    table = rng.permutation(Pn)[:R * M].reshape(R, M).astype(np.int32)
    table[0, 2] = -1
    table[1, 1] = Pn + 3
    table[2, 4] = -1                                      # request 2's local block at pos 4N..
    table[3, :3] = [5, 6, 5]
    #          boundary      K > blocks  invalid local  run of 3 (dql=3)        padding
    req = np.array([0, 0, 0, 1, 2, 2, 3, 3, 3, 1, 0, -1, 4, 2, 3], np.int32)
    pos = np.array([N - 1, N, 2 * N + 1, 0, 4 * N, 5 * N - 1, 3 * N - 1, 3 * N, 3 * N + 1,
                    M * N + 40, 7 * N + 3, 5, 7, -1, 2 * N], np.int32)
    T = len(req)
    q = rng.integers(-2, 3, (T, Hkv, Di)).astype(np.float32)
    if four_d:
        keys = np.stack([rng.integers(-2, 3, keys.shape).astype(np.float32), keys])
    return (jnp.asarray(q, q_dtype), jnp.asarray(keys, key_dtype), table, req, pos)


def random_problem(rng, T_per_req=(1, 3, 40), ctx=(700, 300, 1200), N=128, Di=64, Hkv=2,
                   extra_pages=5, key_dtype=jnp.bfloat16):
    """Random normal q and keys: requests with their own pages, tokens of a request consecutive."""
    blocks = [-(-(c + t) // N) for c, t in zip(ctx, T_per_req)]
    M = max(blocks)
    Pn = sum(blocks) + extra_pages
    perm = rng.permutation(Pn)
    table = np.full((len(ctx), M), -1, np.int32)
    used = 0
    for r, nb in enumerate(blocks):
        table[r, :nb] = perm[used:used + nb]
        used += nb
    req = np.concatenate([np.full(t, r) for r, t in enumerate(T_per_req)]).astype(np.int32)
    pos = np.concatenate([np.arange(c, c + t) for c, t in zip(ctx, T_per_req)]).astype(np.int32)
    keys = jnp.asarray(rng.standard_normal((Pn, N, Di)), key_dtype)
    q = jnp.asarray(rng.standard_normal((len(req), Hkv, Di)), jnp.float32)
    return q, keys, table, req, pos


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("key_dtype,q_dtype,local_blocks,K,four_d", [
    (jnp.bfloat16, jnp.float32, 1, 4, False),
    (jnp.bfloat16, jnp.bfloat16, 2, 3, False),
    (jnp.float8_e4m3fn, jnp.float32, 1, 12, True),
    (jnp.float8_e4m3fn, jnp.bfloat16, 2, 2, False),
])
def test_adversarial_exact(rng, path, key_dtype, q_dtype, local_blocks, K, four_d):
    q, keys, table, req, pos = adversarial(rng, key_dtype, q_dtype, four_d=four_d)
    kw = dict(topk_blocks=K, local_blocks=local_blocks, layer=jnp.int32(1) if four_d else None)
    scores = brute_scores(widened(q), widened(keys), table, req, pos, 1 if four_d else None)
    want = brute_select(scores, pos, keys.shape[-2], K, local_blocks, q.shape[1], q.shape[0])
    got = native(q, keys, table, req, pos, **kw)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ref(q, keys, table, req, pos, **kw), want)
    # what the case covers (so a future edit of the problem does not quietly drop it)
    assert (want[:, 11:14] == -1).all() and (want[:, 3, 0] == 0).all()       # padding; pos 0
    assert (want[:, 4, local_blocks - 1] == 4).all()  # the local block kept on an invalid page
    assert (want[:, 1, :2] == [0, 1]).all() if local_blocks == 2 else (want[:, 1, 0] == 1).all()


def test_layer_outside_the_cache_gives_padding(rng, path):
    q, keys, table, req, pos = adversarial(rng, jnp.bfloat16, jnp.float32, four_d=True)
    for layer in (-1, 2):
        got = native(q, keys, table, req, pos, topk_blocks=4, layer=jnp.int32(layer))
        assert (got == -1).all()
        assert (ref(q, keys, table, req, pos, topk_blocks=4, layer=jnp.int32(layer)) == -1).all()
    with pytest.raises(ValueError, match=r"layer must be in \[0, 2\) for an idx_k_cache"):
        m3.select_blocks(q, keys, table, req, pos, layer=2)


@pytest.mark.parametrize("key_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_random_against_reference_and_brute_force(rng, path, key_dtype):
    q, keys, table, req, pos = random_problem(rng, key_dtype=key_dtype)
    K = 6
    got = native(q, keys, table, req, pos, topk_blocks=K)
    want_ref = ref(q, keys, table, req, pos, topk_blocks=K)
    scores = brute_scores(widened(q), widened(keys), table, req, pos)
    want = brute_select(scores, pos, 128, K, 1, q.shape[1], q.shape[0])
    qn = np.abs(widened(q))
    kmax = np.abs(widened(keys)).max()
    tol = lambda g, t: EPS * qn[t, g].sum() * kmax                # ≥ EPS · Σ|q·k| of any key
    assert_same_up_to_near_ties(got, want, scores, tol)
    assert_same_up_to_near_ties(want_ref, want, scores, tol)
    assert (got != -1).sum() == (want != -1).sum()
    assert (got == want_ref).mean() > 0.99


def test_bit_identical_in_any_batch_pool_and_placement(rng, path):
    """A request's rows alone, in a batch (other requests, shuffled order), and with its keys
    copied into a 16× larger pool at other pages: the same ids, on every path; and the ids are
    the same on every path (the summation layout does not depend on the ISA)."""
    q, keys, table, req, pos = random_problem(rng, T_per_req=(3, 2, 5), ctx=(900, 2000, 513))
    K = 8
    batch = native(q, keys, table, req, pos, topk_blocks=K)
    for r in range(table.shape[0]):
        rows = np.nonzero(req == r)[0]
        alone = native(q[rows], keys, table[r:r + 1], np.zeros(len(rows), np.int32), pos[rows],
                       topk_blocks=K)
        np.testing.assert_array_equal(alone, batch[:, rows])
        # the same request in a pool of 16x the pages, its blocks on other pages
        Pn = keys.shape[0]
        big = np.zeros((16 * Pn,) + keys.shape[1:], keys.dtype)
        new_pages = rng.choice(16 * Pn, table.shape[1], replace=False).astype(np.int32)
        valid = table[r] >= 0
        big[new_pages[valid]] = np.asarray(keys)[table[r][valid]]
        moved = np.where(valid, new_pages, -1)[None]
        np.testing.assert_array_equal(
            native(q[rows], jnp.asarray(big), moved, np.zeros(len(rows), np.int32), pos[rows],
                   topk_blocks=K), batch[:, rows])
    perm = rng.permutation(len(req))
    np.testing.assert_array_equal(native(q[perm], keys, table, req[perm], pos[perm], topk_blocks=K),
                                  batch[:, perm])


@pytest.mark.parametrize("rows", [1, 9])   # keys read from the cache (≤ 8 rows) / widened to a tile
def test_every_e4m3_key_value_ranks_by_its_value(path, rows):
    """Each of the 256 E4M3 bytes (zeros of both signs, subnormals, 448, both NaNs) as the one
    key of its own block (block 256, zero, is the local block), q = e₀: every block's score is
    its key's value, so the ids are the values' order (ties to the lower id, NaN blocks never
    chosen) — each path's E4M3 widening checked against ml_dtypes through the NumPy oracle."""
    Di = 8
    keys = np.zeros((257, 1, Di), np.uint8)
    keys[:256, 0, 0] = np.arange(256)
    keys = keys.view(jnp.float8_e4m3fn)
    q = np.zeros((rows, 1, Di), np.float32)
    q[:, 0, 0] = 1.0
    table = np.arange(257, dtype=np.int32)[None]
    req = np.zeros(rows, np.int32)
    pos = np.full(rows, 256, np.int32)
    scores = brute_scores(q, widened(keys), table, req, pos)
    want = brute_select(scores, pos, 1, 257, 1, 1, rows)
    assert (want[0, :, :2] == [256, 126]).all() and (want[0, :, -2:] == -1).all()  # 448; NaNs
    np.testing.assert_array_equal(native(jnp.asarray(q), jnp.asarray(keys), table, req, pos,
                                         topk_blocks=257), want)


@pytest.mark.parametrize("key_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("Di", [128, 28])
def test_every_path_gives_the_same_ids(rng, monkeypatch, key_dtype, Di):
    """The paths share one summation layout (ffi/cpu/select.cc), so their scores are the same
    bits; this checks what is visible of that, the ids, on data with heavy cancellation too,
    and (E4M3) with q subnormal or above 2^120 in some rows and NaN bytes in some blocks: the
    avx2 path's E4M3 decode shortcut (q · 256 against keys · 2^-8) must fall back there.
    Di = 28 (padded to 32 dims) takes the avx512 path's pairwise tile with a partial last 8."""
    q, keys, table, req, pos = random_problem(rng, T_per_req=(2, 1, 33), Hkv=4, Di=Di,
                                              key_dtype=key_dtype)
    wild = lambda x: jnp.asarray(np.asarray(x, np.float32) * 2.0 ** rng.integers(-10, 21, x.shape),
                                 x.dtype)
    edge = np.asarray(q, np.float32).copy()
    edge[0, 1, :7] = 1e-40                                # subnormal: the shortcut would flush it
    edge[2, 0, 3] = 2.0 ** 125                            # q · 256 would overflow
    k = np.asarray(keys, np.float32).copy()
    k[table[0, 1], 5, 9] = np.nan                         # a NaN key in one of request 0's blocks
    variants = [(q, keys), (wild(q), wild(keys)), (jnp.asarray(edge), jnp.asarray(k, key_dtype))]
    for q, keys in variants:
        outs = []
        for p in PATHS:
            monkeypatch.setenv("M3SPARSE_CPU_ISA", p)
            outs.append(native(q, keys, table, req, pos, topk_blocks=16))
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])


def _layout_dot(q, k, steps=None):
    """SPEC §8 step 6's CPU layout (docs/spec_decisions.md) in NumPy: 8 fp32 lanes, lane l
    taking dims l, l + 8, ... with one fma each in increasing dim, folded
    ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)). Exact products (bf16 · bf16), one rounding per fma.
    ``steps``: the order of the 8-dim steps (a wrong order, to find keys that reveal one)."""
    x = np.zeros(8, np.float32)
    for d in steps if steps is not None else range(0, len(q), 8):
        x = (x.astype(np.float64) + q[d:d + 8].astype(np.float64) * k[d:d + 8]).astype(np.float32)
    return (x[0] + x[1] + (x[2] + x[3])) + (x[4] + x[5] + (x[6] + x[7]))


def _bf16_chunks(v, n=3):
    """n bf16 values, each v's next 8 significant bits (truncated): they sum to v exactly in any
    order (every partial sum spans at most 24 bits)."""
    out = []
    for _ in range(n):
        c = np.float32(jnp.asarray(v, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))
        if abs(c) > abs(v):   # rounded away from zero: step back one bf16 ulp toward it
            c = np.float32(np.nextafter(jnp.bfloat16(c), jnp.bfloat16(0)).astype(np.float32))
        out.append(c)
        v = np.float32(v - c)
    assert v == 0
    return out


@pytest.mark.parametrize("tokens", [1, 12])   # 4 rows a block (decode), 48 (the widened tile)
def test_every_path_sums_in_the_fixed_layout(rng, monkeypatch, tokens):
    """Ids only show scores through ranks, so each case is an exact tie: block X holds a key
    whose dot product rounds differently in other summation orders (heavy cancellation), block
    Y a key whose dot product is the layout's value of X in every order (three bf16 pieces of
    it). Ties go to the lower id: with Y before X, a computed X above the layout's value wins;
    with Y after X, one below it loses. Every path must give the tie's answer in both."""
    Di, N, Hkv, n = 32, 16, 4, 24
    ones = np.ones(Di, np.float32)
    xs = []
    while len(xs) < n:   # sensitive keys: a sequential sum, or each 16 dims' halves swapped,
        k = (rng.choice([-1, 1], Di) * (1 + rng.integers(0, 128, Di) / 128)  # round otherwise
             * 2.0 ** rng.integers(-2, 20, Di))
        k = np.asarray(jnp.asarray(k, jnp.bfloat16).astype(jnp.float32))
        v = _layout_dot(ones, k)
        seq = np.float32(0)
        for kd in k:
            seq = np.float32(seq + kd)
        if v > 0 and seq != v and _layout_dot(ones, k, steps=(8, 0, 24, 16)) != v:
            xs.append((k, v))
    R, M = 2 * n, 4                        # blocks 0-2 candidates, block 3 local (K = 2)
    keys = np.full((R * M + 1, N, Di), -1.0, np.float32)   # every other key scores −32
    table = np.arange(R * M, dtype=np.int32).reshape(R, M)
    expect = []
    for i, (k, v) in enumerate(xs):
        y = np.zeros(Di, np.float32)
        y[[0, 9, 18]] = _bf16_chunks(v)
        for r, (bx, by) in ((2 * i, (1, 0)), (2 * i + 1, (1, 2))):   # Y before X, after X
            keys[table[r, bx], 5] = k
            keys[table[r, by], 7] = y
            expect.append(min(bx, by))
    req = np.repeat(np.arange(R, dtype=np.int32), tokens)
    pos = np.tile(3 * N + np.arange(tokens, dtype=np.int32), R)
    q = jnp.ones((R * tokens, Hkv, Di), jnp.bfloat16)
    want = np.repeat(np.array(expect), tokens)
    for p in PATHS:
        monkeypatch.setenv("M3SPARSE_CPU_ISA", p)
        out = native(q, jnp.asarray(keys, jnp.bfloat16), table, req, pos, topk_blocks=2)
        np.testing.assert_array_equal(out[:, :, 0], 3, err_msg=p)
        np.testing.assert_array_equal(out[:, :, 1], np.broadcast_to(want, out.shape[:2]),
                                      err_msg=p)


def test_reference_gathers_only_the_request_pages():
    """The reference scales with the requests' pages, not the pool: its jaxpr has no
    [T, P·N]-sized intermediate (a 65536-page pool)."""
    q = jax.ShapeDtypeStruct((4, 2, 128), jnp.float32)
    keys = jax.ShapeDtypeStruct((65536, 128, 128), jnp.bfloat16)
    args = (q, keys, jax.ShapeDtypeStruct((2, 8), jnp.int32),
            jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32))
    jaxpr = jax.make_jaxpr(lambda *a: reference.select_blocks(*a, topk_blocks=4))(*args)
    assert max(_intermediate_sizes(jaxpr.jaxpr)) < 65536 * 128


def _intermediate_sizes(jaxpr):
    """Element counts of every value a jaxpr (and the jaxprs inside it) computes."""
    for e in jaxpr.eqns:
        yield from (int(np.prod(v.aval.shape)) for v in e.outvars)
        for p in e.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _intermediate_sizes(inner)


def test_trace_time_errors():
    q = jnp.zeros((3, 2, 32), jnp.float32)
    keys = jnp.zeros((4, 16, 32), jnp.bfloat16)
    t, r, p = np.zeros((1, 2), np.int32), np.zeros(3, np.int32), np.zeros(3, np.int32)
    cases = [
        ((q[0], keys, t, r, p), {}, ValueError, r"idx_q must have rank 3 \(\[T, Hkv, Di\]\)"),
        ((q.astype(jnp.float16), keys, t, r, p), {}, TypeError,
         "idx_q must be float32 or bfloat16"),
        ((q, keys.astype(jnp.float32), t, r, p), {}, TypeError,
         "idx_k_cache must be bfloat16 or float8_e4m3fn, got float32"),
        ((q, keys[0], t, r, p), {}, ValueError, "idx_k_cache must have rank 3"),
        ((q, keys[..., :16], t, r, p), {}, ValueError,
         r"idx_q has Di = 32 but idx_k_cache \(shape .*\) has Di = 16"),
        ((q, keys, t[0], r, p), {}, ValueError, "block_table must have rank 2"),
        ((q, keys, t.astype(np.float32), r, p), {}, TypeError, "block_table must be int32"),
        ((q, keys, t, r[:2], p), {}, ValueError,
         r"query_req_id: length \(T of idx_q\) must be 3, got 2"),
        ((q, keys, t, r, p), dict(topk_blocks=0), ValueError, "topk_blocks must be >= 1, got 0"),
        ((q, keys, t, r, p), dict(local_blocks=0), ValueError, "local_blocks must be >= 1, got 0"),
        ((q, keys, t, r, p), dict(topk_blocks=2, local_blocks=3), ValueError,
         "local_blocks must be <= topk_blocks = 2"),
        ((q, keys[None], t, r, p), {}, ValueError, "layer is required for a 4-D idx_k_cache"),
        ((q, keys, t, r, p), dict(layer=0), ValueError, "layer must be None for a 3-D idx_k_cache"),
    ]
    for args, kw, err, msg in cases:
        with pytest.raises(err, match=msg):
            m3.select_blocks(*args, **kw)


def test_int64_numpy_indices_outside_int32_are_an_error(rng):
    """NumPy's default int64: in range it is the same call as int32 (JAX converts it); a value JAX
    would wrap to 32 bits (2³² + 1 -> page 1) is a ValueError naming the argument, eagerly and
    captured under jit (a jit *argument* is converted by JAX before the op: SPEC §7)."""
    q, keys, table, req, pos = random_problem(rng)
    want = native(q, keys, table, req, pos, topk_blocks=4)
    np.testing.assert_array_equal(native(q, keys, table.astype(np.int64), req.astype(np.int64),
                                         pos.astype(np.int64), topk_blocks=4), want)
    wide = table.astype(np.int64)
    wide[0, 0] = 2 ** 32 + 1
    with pytest.raises(ValueError, match=r"block_table has values outside int32 \(\[.*, 4294967297\]\)"):
        m3.select_blocks(q, keys, wide, req, pos)
    with pytest.raises(ValueError, match="query_abs_pos has values outside int32"):
        m3.select_blocks(q, keys, table, req, pos.astype(np.int64) - 2 ** 40)
    # captured by a jitted function: the op sees the NumPy array, so the same error
    with pytest.raises(ValueError, match="block_table has values outside int32"):
        jax.jit(lambda q_: m3.select_blocks(q_, keys, wide, req, pos))(q)


def test_allocate_index_cache(rng):
    """Zeroed caches of the documented shapes and dtypes, usable by write_index_keys and
    select_blocks; bad sizes and dtypes raise naming the argument."""
    c3 = m3.allocate_index_cache(5, index_dim=64)
    c4 = m3.allocate_index_cache(5, 2, dtype=jnp.float8_e4m3fn)
    assert (c3.shape, c3.dtype) == ((5, 128, 64), jnp.bfloat16) and not np.asarray(c3, np.float32).any()
    assert (c4.shape, c4.dtype) == ((2, 5, 128, 128), jnp.float8_e4m3fn)
    keys = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
    c4 = m3.write_index_keys(c4, keys, np.array([0, 130, 257], np.int32), layer=jnp.int32(1))
    ids = m3.select_blocks(jnp.ones((1, 1, 128), jnp.bfloat16), c4, np.array([[0, 1, 2]], np.int32),
                           np.zeros(1, np.int32), np.array([257], np.int32), topk_blocks=3,
                           layer=jnp.int32(1))
    assert sorted(np.asarray(ids)[0, 0].tolist()) == [0, 1, 2]
    for kw, err, msg in ((dict(num_pages=-1), ValueError, "num_pages must be an integer >= 0"),
                         (dict(num_pages=4, num_layers=0), ValueError, "num_layers must be an integer >= 1"),
                         (dict(num_pages=4, index_dim=0), ValueError, "index_dim must be an integer >= 1"),
                         (dict(num_pages=4, dtype=jnp.float32), TypeError,
                          "dtype must be bfloat16 or float8_e4m3fn, got float32")):
        with pytest.raises(err, match=msg):
            m3.allocate_index_cache(**kw)


def test_vmap_and_export(rng):
    q, keys, table, req, pos = random_problem(rng, T_per_req=(1, 2, 3), ctx=(300, 200, 100))
    f = lambda q: m3.select_blocks(q, keys, table, req, pos, topk_blocks=4)
    qs = jnp.stack([q, -q])
    np.testing.assert_array_equal(np.asarray(jax.vmap(f)(qs)), np.stack([f(q), f(-q)]))
    exp = jax.export.export(jax.jit(f), platforms=["cpu"],
                            disabled_checks=m3.export_disabled_checks())(q)
    assert "m3sparse_select_blocks_cpu" in exp.mlir_module()
    round_trip = jax.export.deserialize(exp.serialize())
    np.testing.assert_array_equal(np.asarray(round_trip.call(q)), np.asarray(f(q)))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 simulated devices")
@pytest.mark.parametrize("tp,Hkv", [(2, 4), (4, 4), (8, 8)])
def test_sharded_over_kv_heads_without_gathering(rng, tp, Hkv):
    """idx_q split over KV heads, the index cache and tables replicated: each device selects
    for its own heads; no collective in the compiled program; the result equals one device's."""
    q, keys, table, req, pos = random_problem(rng, Hkv=Hkv, T_per_req=(1, 2, 9))
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    args = (put(q, P(None, "tp", None)), put(keys, P()), put(table, P()), put(req, P()),
            put(pos, P()))
    f = jax.jit(lambda *a: m3.select_blocks(*a, topk_blocks=5))
    text = f.lower(*args).compile().as_text()
    assert not re.search(r"all-gather|all-to-all|collective-permute|all-reduce", text)
    out = f(*args)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("tp", None, None)), 3)
    np.testing.assert_array_equal(np.asarray(out), native(q, keys, table, req, pos, topk_blocks=5))
