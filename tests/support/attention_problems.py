"""Random sparse-attention problems over a cache of random bytes (shared by the test suites)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

import jax_m3sparse as m3

GARBAGE_IDS = (10**6, -7)  # plus max_blocks, added per problem


@dataclasses.dataclass
class Problem:
    q: np.ndarray
    cache: np.ndarray
    topk: np.ndarray
    block_table: np.ndarray
    req: np.ndarray
    pos: np.ndarray
    k_scale: float = 0.75
    v_scale: float = 0.85
    seq_lens: np.ndarray | None = None
    dql: int = 1


def random_topk(rng, Hkv, req, pos, K, max_blocks, garbage=True):
    """Up to K distinct visible blocks per (KV head, token), the local block always included;
    the unused tail holds −1 or garbage ids."""
    T = len(req)
    topk = np.full((Hkv, T, K), -1, np.int32)
    for t in range(T):
        if req[t] < 0 or pos[t] < 0:
            continue
        nb = pos[t] // 128 + 1
        for g in range(Hkv):
            pick = rng.permutation(nb)[:K]
            if nb - 1 not in pick:
                pick[0] = nb - 1
            topk[g, t, :len(pick)] = rng.permutation(pick)
            if garbage and len(pick) < K:
                topk[g, t, len(pick):] = rng.choice([-1, *GARBAGE_IDS, max_blocks], K - len(pick))
    return topk


def build(rng, Hkv, G, kv_lens, rows, K=16, dtype=jnp.float32, extra_pages=3, D=128,
          num_layers=None, layout="LBHNC", layer=0, fill_layers=True):
    """A cache of random bytes holding every request's K/V (written by pack_kv_pages, whose
    bytes the pack tests prove exact), shuffled and partly shared pages, NaN scale bytes in
    unattended page tails, and rows (req, pos) with random top-k selections."""
    spec = m3.KVCacheSpec(Hkv, D)
    R = len(kv_lens)
    need = [-(-n // 128) for n in kv_lens]
    P = sum(need) + extra_pages
    max_blocks = max(need) + 2
    cache = rng.integers(0, 256, spec.cache_shape(P, num_layers, layout), dtype=np.uint8)
    perm = rng.permutation(P)
    block_table = np.full((R, max_blocks), -1, np.int32)
    used = 0
    for r, n in enumerate(need):
        block_table[r, :n] = perm[used:used + n]
        used += n
    layers = range(num_layers) if (num_layers and fill_layers) else [layer]
    for r, n in enumerate(kv_lens):
        if n == 0:
            continue
        tokens = np.arange(n)
        slots = block_table[r, tokens // 128] * 128 + tokens % 128
        for lyr in layers:
            k = rng.standard_normal((n, Hkv, D)).astype(np.float32)
            v = rng.standard_normal((n, Hkv, D)).astype(np.float32)
            kw = {} if num_layers is None else dict(layer=lyr, layout=layout)
            cache = np.array(m3.pack_kv_pages(cache, k, v, jnp.asarray(slots, jnp.int32),
                                                0.75, 0.85, **kw))
    # NaN scale bytes in the unattended tail of every request's last page (SPEC §5.2).
    for r, n in enumerate(kv_lens):
        if n % 128:
            page = block_table[r, n // 128]
            view = cache[page] if num_layers is None else (
                cache[layer, page] if layout == "LBHNC" else cache[page, layer])
            flat = view.reshape(2 * Hkv, -1)
            flat[:, 128 * D // 2 + (n % 128) * D // 16:] = 0x7F
    if R > 1 and need[0] > 1 and need[1] > 1:
        # Shared pages are legal: request 1's first block reads request 0's first page.
        block_table[1, 0] = block_table[0, 0]
    req, pos = rows
    topk = random_topk(rng, Hkv, req, pos, K, max_blocks)
    q = (rng.standard_normal((len(req), Hkv * G, D)) * 2).astype(np.float32)
    return Problem(q=np.asarray(jnp.asarray(q, dtype)), cache=cache, topk=topk,
                   block_table=block_table, req=np.asarray(req), pos=np.asarray(pos))


def decode_problem(rng, Hkv, G, seq_lens, dql=1, **kw):
    req = np.repeat(np.arange(len(seq_lens)), dql)
    pos = np.asarray(seq_lens)[req] - dql + np.tile(np.arange(dql), len(seq_lens))
    p = build(rng, Hkv, G, list(seq_lens), (req, np.maximum(pos, -1)), **kw)
    p.seq_lens, p.dql = np.asarray(seq_lens, np.int32), dql
    return p


def prefill_problem(rng, Hkv, G, q_lens, kv_lens, pad=0, **kw):
    """Chunked prefill: request r's q_lens[r] tokens are its last ones of kv_lens[r]."""
    req = np.concatenate([np.full(q, r) for r, q in enumerate(q_lens)] + [np.full(pad, -1)])
    pos = np.concatenate([np.arange(kv - q, kv) for q, kv in zip(q_lens, kv_lens)]
                         + [np.full(pad, -1)])
    return build(rng, Hkv, G, list(kv_lens), (req.astype(np.int32), pos.astype(np.int32)), **kw)
