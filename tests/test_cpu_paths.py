"""Every CPU attention path this machine supports (ffi/cpu/isa.h), forced one at a time with
M3SPARSE_CPU_ISA, against the float64 oracle (SPEC §5, §6); plus the NaN / exp2 regression."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_m3sparse as m3
from jax_m3sparse import _m3sparse_cpu

from attention_problems import decode_problem, prefill_problem
from test_attention import assert_close, expected, run_decode, run_prefill

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
    """Issue 12 finding 4: every scale byte 0xFF (E4M3 NaN) makes the attended logits NaN;
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
