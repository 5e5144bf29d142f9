"""Every CPU attention path this machine supports (ffi/cpu/isa.h), forced one at a time with
M3SPARSE_CPU_ISA, against the float64 oracle (SPEC §5, §6); plus the NaN / exp2 regression."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_m3sparse as m3
from jax_m3sparse import _m3sparse_cpu

from attention_checks import assert_close, expected, run_decode, run_prefill
from attention_problems import decode_problem, prefill_problem
import oracle

PATHS = _m3sparse_cpu.cpu_paths()


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """The handlers read M3SPARSE_CPU_ISA on every call (no recompile needed)."""
    monkeypatch.setenv("M3SPARSE_CPU_ISA", request.param)
    assert _m3sparse_cpu.cpu_path() == request.param
    return request.param


def test_paths_listed():
    assert PATHS[0] == "generic" and set(PATHS) <= {"generic", "avx2", "avx512", "amx"}


@pytest.mark.parametrize("Hkv,G,dql,seq_lens,D", [
    (1, 16, 1, [1, 128, 129, 4097], 128), (2, 8, 3, [300, 1500, 2049], 128),
    (4, 4, 1, [700, 5000], 128), (1, 6, 2, [257, 1000], 128), (2, 4, 2, [300, 700], 64),
    (1, 16, 1, [300, 900], 256), (1, 24, 1, [129, 1100], 128), (2, 1, 1, [200, 900], 128)])
def test_decode(rng, path, Hkv, G, dql, seq_lens, D):
    p = decode_problem(rng, Hkv, G, seq_lens, dql, D=D, extra_pages=1)
    assert_close(run_decode(p, "native"), expected(p))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_q(rng, path, dtype):
    p = decode_problem(rng, 2, 16, [300, 1000], 2, dtype=dtype)
    assert_close(run_decode(p, "native"), expected(p))


def test_prefill(rng, path):
    p = prefill_problem(rng, 2, 16, (65, 129, 257), (129, 257, 385), pad=3)
    out = run_prefill(p, "native")
    assert_close(out, expected(p))
    assert (out[-3:] == 0).all()


def test_prefill_tokens_sharing_blocks(rng, path):
    """Consecutive tokens that select the same blocks (served together, each tile dequantized
    once), including the local block, whose attended length n grows by one per token, and a
    page shared between two requests."""
    p = prefill_problem(rng, 1, 16, (200, 150), (700, 400))
    for t in range(len(p.req)):
        nb = p.pos[t] // 128 + 1
        chosen = [b for b in (0, 1, 2, nb - 2, nb - 1) if 0 <= b < nb]
        ids = list(dict.fromkeys(chosen))
        p.topk[:, t, :] = -1
        p.topk[:, t, :len(ids)] = ids
    assert_close(run_prefill(p, "native"), expected(p))


def test_token_result_does_not_depend_on_its_batch(rng, path):
    """Tokens are served 8 at a time, sharing dequantized tiles; each still folds its own blocks
    in one fixed order, so shuffling the tokens (new chunk mates, new task and chunk
    boundaries) shuffles the rows of the result and changes no bit of them."""
    p = prefill_problem(rng, 2, 16, (200, 150), (700, 400))
    perm = rng.permutation(len(p.req))
    shuffled = dataclasses.replace(p, q=p.q[perm], topk=p.topk[:, perm], req=p.req[perm],
                                   pos=p.pos[perm])
    np.testing.assert_array_equal(run_prefill(shuffled, "native"), run_prefill(p, "native")[perm])


def _move_pages(p, rng):
    """The problem with every page moved to a new place (as an engine hands a request the
    pages earlier requests freed, in any order) and each selection listed back to front."""
    sigma = rng.permutation(p.cache.shape[0])  # page i moves to sigma[i]
    cache = np.empty_like(p.cache)
    cache[sigma] = p.cache
    table = np.where(p.block_table >= 0, sigma[np.maximum(p.block_table, 0)], p.block_table)
    return dataclasses.replace(p, cache=cache, block_table=table.astype(np.int32),
                               topk=np.ascontiguousarray(p.topk[..., ::-1]))


@pytest.mark.parametrize("what", ["decode", "prefill"])
def test_token_result_does_not_depend_on_its_pages(rng, path, what):
    """A token folds its blocks in position order, so its rows are the same bits
    whichever pages hold its blocks and in whatever order the selection lists them (folding
    in page order made the example's logits change with the batch on the bf16 paths, whose
    P is rounded against the running max)."""
    if what == "decode":
        p, run = decode_problem(rng, 2, 8, [300, 1000, 2100], 3), run_decode
    else:
        p, run = prefill_problem(rng, 2, 8, (40, 129), (300, 1500), pad=3), run_prefill
    out = run(p, "native")
    assert_close(out, expected(p))
    np.testing.assert_array_equal(run(_move_pages(p, rng), "native"), out)


def _request_pages(rng, kv_len, C):
    """Random finite NVFP4 tiles [pages, 2, 128, C] for kv_len tokens (scale bytes 0x30-0x3f),
    NaN scale bytes (0x7F) past the last token (SPEC §3.2's planes: data, then scales)."""
    n = -(-kv_len // 128)
    pages = rng.integers(0, 256, (n, 2, 128, C), dtype=np.uint8)
    flat = pages.reshape(n, 2, 128 * C)
    data = 128 * (C * 8 // 9)  # D/2 of C = D/2 + D/16 bytes per token
    flat[..., data:] = rng.integers(0x30, 0x40, flat[..., data:].shape, dtype=np.uint8)
    if kv_len % 128:
        flat[-1, :, data + (kv_len % 128) * (C // 9):] = 0x7F
    return pages


@pytest.mark.parametrize("selection", ["dense", "sparse"])
def test_request_alone_and_in_a_mixed_batch(rng, path, selection):
    """Batch invariance at the op level: each request's rows of one sparse_attention call (MTP
    decode rows, a padded decode request, two prefill chunks, padding tokens) are the same bits as
    the request alone, with its blocks in other pages of a 5-D cache (layer 1 of 3), pages of
    stale NaN bytes around, and either every block selected (K = max_blocks = 18, as the
    example's dense layers) or 16 random ones; the batch matches the float64 oracle."""
    D, G, dql, L, layer, M = 128, 4, 3, 3, 1, 18
    C = D // 2 + D // 16
    # (query_len, context_len) per request: decode, padded decode, prefill, prefill
    reqs = [(dql, 697), (0, 0), (50, 1250), (8, 2192)]
    kv_lens = [q + c for q, c in reqs]
    content = [_request_pages(rng, n, C) if n else None for n in kv_lens]
    total = sum(len(c) for c in content if c is not None)

    def place(order):
        """A 5-D cache of NaN bytes holding every request's pages at `order`'s places."""
        cache = np.full((L, total + 4, 2, 128, C), 0xFF, np.uint8)
        table = np.full((len(reqs), M), -1, np.int32)
        used = 0
        for r, c in enumerate(content):
            if c is None:
                continue
            at = order[used:used + len(c)]
            cache[layer, at], table[r, :len(c)] = c, at
            used += len(c)
        return cache, table

    T_pre = sum(q for q, _ in reqs[2:])
    T = 2 * dql + T_pre + 5  # 5 padding tokens
    q = (rng.standard_normal((T, G, D)) * 2).astype(np.float32)
    q = np.asarray(jnp.asarray(q, jnp.bfloat16))
    if selection == "dense":
        topk = np.broadcast_to(np.arange(M, dtype=np.int32), (1, T, M)).copy()
    else:
        topk = np.stack([rng.permutation(M)[:16] for _ in range(T)])[None].astype(np.int32)

    def call(q, cache, topk, table, query_lens, ctx, r_dec, num_tokens):
        meta = m3.build_attention_metadata(np.asarray(query_lens, np.int32),
                                           np.asarray(ctx, np.int32), table,
                                           num_decode_requests=r_dec, num_tokens=num_tokens,
                                           decode_query_len=dql)
        fn = jax.jit(lambda *a: m3.sparse_attention(*a, meta, 0.75, 0.85, layer=layer,
                                                          layout="LBHNC"))
        return np.asarray(fn(q, cache, topk), np.float64), meta

    batch_cache, batch_table = place(rng.permutation(total + 4))
    out, meta = call(q, batch_cache, topk[..., ::-1].copy(), batch_table,
                     [q_ for q_, _ in reqs], [c for _, c in reqs], 2, T)
    req = np.concatenate([np.repeat(np.where(np.asarray(meta.seq_lens) > 0, np.arange(2), -1), dql),
                          np.asarray(meta.query_req_id)])
    pos = np.concatenate([np.repeat(np.asarray(meta.seq_lens), dql) - dql + np.tile(np.arange(dql), 2),
                          np.asarray(meta.query_abs_pos)])
    want = oracle.attention(np.asarray(q, np.float32), batch_cache, topk, batch_table, req, pos,
                            0.75, 0.85, layer=layer, layout="LBHNC")
    assert_close(out, want)
    assert (out[dql:2 * dql] == 0).all() and (out[-5:] == 0).all()

    alone_cache, alone_table = place(np.arange(total + 4))
    starts = np.cumsum([0, dql, dql, reqs[2][0], reqs[3][0]])
    for r, (ql, ctx) in enumerate(reqs):
        if ql == 0:
            continue
        rows = slice(starts[r], starts[r + 1])
        decode = r < 2
        got, _ = call(q[rows], alone_cache, topk[:, rows], alone_table[r:r + 1], [ql], [ctx],
                      int(decode), ql)
        np.testing.assert_array_equal(out[rows], got, err_msg=f"request {r}")


def test_cache_changes_between_calls(rng, path):
    """Tiles dequantized by one call are never served to the next (the bytes may have changed)."""
    p = decode_problem(rng, 1, 16, [300, 700], 1)
    assert_close(run_decode(p, "native"), expected(p))
    page = p.block_table[0, 0]
    k = rng.standard_normal((128, 1, 128)).astype(np.float32)
    p.cache = np.array(m3.pack_kv_pages(p.cache, k, -k, jnp.arange(page * 128, page * 128 + 128,
                                                                     dtype=jnp.int32), 0.75, 0.85))
    assert_close(run_decode(p, "native"), expected(p))


def test_nan_logits_give_nan_rows(path):
    """A fuzzer finding: every scale byte 0xFF (E4M3 NaN) makes the attended logits NaN;
    the rows must be NaN (no undefined float→int conversion on the way, see the sanitizer
    job), and a NaN must not leak into rows that attend nothing."""
    D = 32
    cache = jnp.full((2, 2, 128, D // 2 + D // 16), 0xFF, jnp.uint8)
    q = jnp.ones((2, 1, D), jnp.float32)
    out = np.asarray(jax.jit(lambda *a: m3.sparse_decode(*a, 1.0, 1.0))(
        q, cache, jnp.zeros((1, 2, 1), jnp.int32), jnp.asarray([[0], [1]], jnp.int32),
        jnp.asarray([1, 0], jnp.int32)))
    assert np.isnan(out[0]).all()
    assert (out[1] == 0).all()


def test_unknown_path_is_an_error(monkeypatch, rng):
    monkeypatch.setenv("M3SPARSE_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="M3SPARSE_CPU_ISA must be one of .*got 'sse9'"):
        _m3sparse_cpu.cpu_path()
    p = decode_problem(rng, 1, 4, [130], 1)
    with pytest.raises(Exception, match="M3SPARSE_CPU_ISA must be one of .*got 'sse9'"):
        run_decode(p, "native")


def test_public_cpu_attention_paths(path, monkeypatch):
    """jax_m3sparse.cpu_attention_paths() reports the machine's paths and the capped one a call
    takes; a value of M3SPARSE_CPU_ISA that names no path is a ValueError naming it."""
    assert m3.cpu_attention_paths() == (tuple(PATHS), path)
    monkeypatch.setenv("M3SPARSE_CPU_ISA", "AVX2")
    with pytest.raises(ValueError, match="got 'AVX2'"):
        m3.cpu_attention_paths()
