"""CUDA benchmark through the public API: ``python -m jax_m3sparse.bench.cuda [--quick]``.

Per-call device time is measured as (wall time of one jitted function that makes ``REPS``
independent calls, each over its own top-k selection) / ``REPS``, median of 5 runs, so host
dispatch is amortized; XLA may replay the calls as a CUDA graph (the handlers are command-buffer
compatible). Shapes and byte/flop counts follow BENCHMARKS.md: decode T in {1, 8, 32, 128, 512}
(+ dql = 4 at T = 128), Hkv = 4, G = 16, seq 32768, top-16 x 128; prefill 2048 / 8192 tokens
after 8192 context; pack 4096 / 65536 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_m3sparse as m3
from jax_m3sparse.bench.timing import D, K, N, TOKEN_BYTES, copy_bandwidth, fill_cache

REPS = 20


def _median_wall(fn, args, runs=5):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _topk(rng, Hkv, T, blocks):
    return np.stack([rng.choice(blocks, K, replace=False)
                     for _ in range(Hkv * T)]).reshape(Hkv, T, K).astype(np.int32)


def decode(device, rng, T, dql, copy_bw, Hkv=4, G=16, seq=32768):
    R = T // dql
    blocks = -(-seq // N)
    P = R * blocks
    cache = fill_cache(rng, m3.KVCacheSpec(Hkv).cache_shape(P), device)
    bt = jax.device_put(rng.permutation(P).astype(np.int32).reshape(R, blocks), device)
    topks = jax.device_put(np.stack([_topk(rng, Hkv, T, blocks) for _ in range(REPS)]), device)
    q = jax.device_put(jnp.asarray(rng.standard_normal((T, Hkv * G, D)), jnp.bfloat16), device)
    seq_lens = jax.device_put(jnp.full((R,), seq, jnp.int32), device)

    @jax.jit
    def many(q, cache, topks, bt, seq_lens):
        return [m3.sparse_decode(q, cache, topks[i], bt, seq_lens, 1.0, 1.0, decode_query_len=dql)
                for i in range(REPS)]

    t = _median_wall(many, (q, cache, topks, bt, seq_lens)) / REPS
    nbytes = T * Hkv * K * N * TOKEN_BYTES * 2
    return t, nbytes / t, 100 * nbytes / t / copy_bw


def prefill(device, rng, T, Hkv=4, G=16, context=8192):
    kv_len = context + T
    blocks = -(-kv_len // N)
    cache = fill_cache(rng, m3.KVCacheSpec(Hkv).cache_shape(blocks), device)
    bt = jax.device_put(rng.permutation(blocks).astype(np.int32)[None], device)
    pos = np.arange(context, kv_len, dtype=np.int32)
    reps = 4
    topks = np.stack([np.stack([rng.choice(p // N + 1, K, replace=False)
                                for p in np.tile(pos, Hkv)]).reshape(Hkv, T, K)
                      for _ in range(reps)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((T, Hkv * G, D)), jnp.bfloat16)
    args = [jax.device_put(a, device) for a in (q, cache, topks, bt, jnp.zeros(T, jnp.int32),
                                                jnp.asarray(pos))]

    @jax.jit
    def many(q, cache, topks, bt, rid, pos):
        return [m3.sparse_prefill(q, cache, topks[i], bt, rid, pos, 1.0, 1.0) for i in range(reps)]

    t = _median_wall(many, args) / reps
    # attended keys per (token, KV head): min(128, vis - 128 b) per selected block
    vis = pos[None, :, None] + 1
    keys = np.clip(vis - N * topks[0], 0, N).sum()
    flops = 4 * G * D * float(keys)
    return t, flops / t


def pack(device, rng, T, copy_bw, Hkv=4):
    P = -(-T // N)
    cache = jax.device_put(jnp.zeros(m3.KVCacheSpec(Hkv).cache_shape(P), jnp.uint8), device)
    k = jax.device_put(jnp.asarray(rng.standard_normal((T, Hkv, D)), jnp.bfloat16), device)
    slots = jax.device_put(np.stack([rng.permutation(P * N)[:T] for _ in range(REPS)])
                           .astype(np.int32), device)

    def many(cache, k, slots):
        for i in range(REPS):
            cache = m3.pack_kv_pages(cache, k, -k, slots[i], 1.0, 1.0)
        return cache

    fn = jax.jit(many, donate_argnums=0)
    cache = fn(cache, k, slots)
    jax.block_until_ready(cache)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        cache = fn(cache, k, slots)
        jax.block_until_ready(cache)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times) / REPS
    nbytes = T * Hkv * 2 * (2 * D + TOKEN_BYTES)
    return t, nbytes / t, 100 * nbytes / t / copy_bw


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m jax_m3sparse.bench.cuda", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="T in {1, 128} decode only")
    args = parser.parse_args(argv)
    device = jax.devices("cuda")[0]
    rng = np.random.default_rng(0)
    copy_bw = copy_bandwidth(device, 1 << 30)
    print(f"CUDA benchmark on {device.device_kind}; jax {jax.__version__}; copy bandwidth "
          f"{copy_bw / 1e12:.3f} TB/s (jitted x+1 over 1 GiB, read + write)")
    print("decode (Hkv=4, G=16, seq 32768, top-16x128, bf16) | T (dql) | us/call | TB/s | % copy")
    shapes = [(1, 1), (128, 1)] if args.quick else [(1, 1), (8, 1), (32, 1), (128, 1), (512, 1),
                                                     (128, 4)]
    for T, dql in shapes:
        t, bw, pct = decode(device, rng, T, dql, copy_bw)
        print(f"decode | {T} ({dql}) | {t * 1e6:9.2f} | {bw / 1e12:6.3f} | {pct:5.1f}%")
    if not args.quick:
        print("prefill (context 8192, Hkv=4, G=16) | tokens | us/call | effective TFLOP/s")
        for T in (2048, 8192):
            t, fl = prefill(device, rng, T)
            print(f"prefill | {T} | {t * 1e6:9.1f} | {fl / 1e12:7.1f}")
        print("pack (Hkv=4, bf16) | tokens | us/call | TB/s | % copy")
        for T in (4096, 65536):
            t, bw, pct = pack(device, rng, T, copy_bw)
            print(f"pack | {T} | {t * 1e6:9.2f} | {bw / 1e12:6.3f} | {pct:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
