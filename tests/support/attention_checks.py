"""Running sparse_decode / sparse_prefill (native or reference) on an attention problem
(attention_problems.Problem) and checking the result against the float64 oracle (SPEC §5, §6);
shared by tests/library/test_attention.py and tests/library/test_cpu_paths.py."""

import jax
import numpy as np

import jax_m3sparse as m3
from jax_m3sparse import reference

import oracle

COS, RELF = 0.999, 0.02   # SPEC §6, CPU path (fp32 compute)


def run_decode(p, impl, **kw):
    fn = m3.sparse_decode if impl == "native" else reference.sparse_decode
    return np.asarray(jax.jit(lambda *a: fn(*a, decode_query_len=p.dql, **kw))(
        p.q, p.cache, p.topk, p.block_table, p.seq_lens, p.k_scale, p.v_scale), np.float64)


def run_prefill(p, impl, **kw):
    fn = m3.sparse_prefill if impl == "native" else reference.sparse_prefill
    return np.asarray(jax.jit(lambda *a: fn(*a, **kw))(
        p.q, p.cache, p.topk, p.block_table, p.req, p.pos, p.k_scale, p.v_scale), np.float64)


def expected(p, **kw):
    return oracle.attention(np.asarray(p.q, np.float32), p.cache, p.topk, p.block_table, p.req,
                            p.pos, p.k_scale, p.v_scale, **kw)


def assert_close(out, want, cos=COS, relf=RELF):
    assert np.isfinite(out).all()
    c, r = oracle.metrics(out, want)
    assert c >= cos and r <= relf, f"cosine {c:.6f}, rel-F {r:.4f}"
    empty = ~np.any(want != 0, axis=-1)
    assert (out[empty] == 0).all(), "rows with nothing attended must be exact zeros"
