"""One TP serving step over a 5-D cache, shared by test_sharding.py and the two-process test:
``lax.scan`` over layers (traced layer index) of pack -> decode -> prefill -> mixed batch ->
full attention."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_m3sparse as m3
from jax_m3sparse import sharding as shd

COLLECTIVE = re.compile(r"all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter")
K_SCALE, V_SCALE = 0.5, 0.25


@dataclasses.dataclass
class Case:
    """Inputs of :func:`step` (numpy), KV heads already replicated for ``tp``."""
    cache: np.ndarray
    args: dict
    layout: str


def make_case(rng, tp, num_kv_heads, num_heads, layers=2, layout="LBHNC", seq=(200, 300)):
    r = shd.kv_head_replicas(num_kv_heads, tp)
    spec = shd.tp_cache_spec(m3.KVCacheSpec(num_kv_heads), tp)
    hkv, D = spec.num_kv_heads, spec.head_dim
    pages = [-(-s // 128) for s in seq]
    P_ = sum(pages) + 1
    block_table = np.full((len(seq), max(pages) + 1), -1, np.int32)
    perm = rng.permutation(P_)
    used = 0
    for i, n in enumerate(pages):
        block_table[i, :n] = perm[used:used + n]
        used += n
    req = np.concatenate([np.full(s, i) for i, s in enumerate(seq)])
    pos = np.concatenate([np.arange(s) for s in seq])
    slots = (block_table[req, pos // 128] * 128 + pos % 128).astype(np.int32)
    T = len(req)

    def kv():
        x = rng.standard_normal((layers, T, num_kv_heads, D)).astype(np.float32)
        return np.asarray(shd.replicate_kv_heads(jnp.asarray(x), r, axis=2))

    def topk(rows_pos):
        nb = rows_pos // 128 + 1
        t = rng.integers(-1, nb[None, :, None] + 2, (num_kv_heads, len(rows_pos), 16))
        return np.asarray(shd.replicate_kv_heads(jnp.asarray(t, jnp.int32), r, axis=0))

    pre = rng.choice(T, 24, replace=False)  # a prefill chunk: 24 of the tokens
    seq_lens = np.asarray(seq, np.int32)
    q = lambda n: rng.standard_normal((layers, n, num_heads, D)).astype(np.float32)
    args = dict(key=kv(), value=kv(), slots=slots, block_table=block_table, seq_lens=seq_lens,
                q_dec=q(len(seq)), topk_dec=topk(seq_lens - 1),
                q_pre=q(len(pre)), topk_pre=topk(pos[pre]),
                req=req[pre].astype(np.int32), pos=pos[pre].astype(np.int32))
    cache = np.zeros(spec.cache_shape(P_, layers, layout), np.uint8)
    return Case(cache=cache, args=args, layout=layout)


def step(cache, a, layout):
    """pack -> decode -> prefill -> mixed -> full for every layer, in one scan (traced layer)."""
    meta = m3.SparseAttentionMetadata(a["block_table"], a["seq_lens"], a["req"], a["pos"],
                                      num_decode_tokens=a["q_dec"].shape[1])

    def layer_step(cache, xs):
        layer, k, v, qd, qp = xs
        kw = dict(layer=layer, layout=layout)
        cache = m3.pack_kv_pages(cache, k, v, a["slots"], K_SCALE, V_SCALE, **kw)
        dec = m3.sparse_decode(qd, cache, a["topk_dec"], a["block_table"], a["seq_lens"],
                               K_SCALE, V_SCALE, **kw)
        pre = m3.sparse_prefill(qp, cache, a["topk_pre"], a["block_table"], a["req"], a["pos"],
                                K_SCALE, V_SCALE, **kw)
        mixed = m3.sparse_attention(jnp.concatenate([qd, qp]), cache,
                                    jnp.concatenate([a["topk_dec"], a["topk_pre"]], axis=1),
                                    meta, K_SCALE, V_SCALE, **kw)
        full = m3.full_attention(qp, cache, a["block_table"], a["req"], a["pos"], K_SCALE,
                                 V_SCALE, **kw)
        return cache, (dec, pre, mixed, full)

    layers = a["key"].shape[0]
    xs = (jnp.arange(layers, dtype=jnp.int32), a["key"], a["value"], a["q_dec"], a["q_pre"])
    return jax.lax.scan(layer_step, cache, xs)


def shardings(mesh, case: Case, axis="tp"):
    """NamedShardings of (cache, args): per-layer arrays carry a leading layer axis."""
    heads = P(None, None, axis, None)
    specs = dict(key=heads, value=heads, q_dec=heads, q_pre=heads,
                 topk_dec=P(axis, None, None), topk_pre=P(axis, None, None))
    named = {k: NamedSharding(mesh, specs.get(k, P())) for k in case.args}
    return NamedSharding(mesh, shd.cache_spec(axis, case.cache.ndim)), named


def run_sharded(mesh, case: Case):
    """Returns (compiled HLO text, cache, outputs) of the donated, sharded step."""
    cache_sh, arg_sh = shardings(mesh, case)
    cache = jax.make_array_from_callback(case.cache.shape, cache_sh, lambda i: case.cache[i])
    args = {k: jax.make_array_from_callback(v.shape, arg_sh[k], lambda i, v=v: v[i])
            for k, v in case.args.items()}
    fn = jax.jit(lambda c, a: step(c, a, case.layout), donate_argnums=0)
    text = fn.lower(cache, args).compile().as_text()
    return text, *fn(cache, args)


def run_single(case: Case, device=None):
    device = device or jax.devices()[0]
    put = lambda x: jax.device_put(x, device)
    return jax.jit(lambda c, a: step(c, a, case.layout))(
        put(case.cache), {k: put(v) for k, v in case.args.items()})
