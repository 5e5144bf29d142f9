"""CUDA benchmark through the public API: ``python -m jax_m3sparse.bench.cuda [--quick]``.

Decode is timed the way a model calls it: one jitted function that runs ``STEPS`` decode steps,
each a ``lax.scan`` over the ``L = 8`` layers of one 5-D LBHNC cache with a traced layer index
(each step with its own block table, top-k selection and q, so small batches do not read from
L2). Per-layer time = wall time / (STEPS · L), median of 5 runs; ours and the pure-XLA
reference are timed in the same run. Beside it, from a ``jax.profiler`` trace of one run of the
same function: our kernel's median device time ("kernel"), and the GPU time per layer of
everything else the jitted scan launches (XLA's slicing of the scanned inputs, the loop
counter, output copies) with the idle time between them.

Prefill and pack keep the older form (one jitted function that makes several independent
calls, wall time / calls), with the kernel's device time from the trace beside it.
Shapes and byte/flop counts follow BENCHMARKS.md: Hkv = 4, G = 16 (and G = 8), D = N = 128,
top-16 blocks, seq 32768, bf16; prefill 2048 / 8192 tokens after 8192 context; pack 4096 /
65536 tokens.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_m3sparse as m3
from jax_m3sparse import reference
from jax_m3sparse.bench.timing import D, K, N, TOKEN_BYTES, copy_bandwidth, fill_cache

REPS = 20
LAYERS = 8


def _median_wall(fn, args, runs=5):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gpu_events(fn, args, host=None):
    """[(name, start µs, duration µs)] of the GPU activity of one call of ``fn`` (a
    ``jax.profiler`` trace; CUPTI kernel and memcpy records), sorted by start. ``host``: a
    list that receives the host-side events the same way."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(fn(*args))
        files = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        if not files:
            return []
        with gzip.open(files[0], "rt") as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu_pids = {e["pid"] for e in events
                if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in str(e.get("args", {}).get("name", ""))}
    out = [(e["name"], float(e["ts"]), float(e.get("dur", 0.0))) for e in events
           if e.get("ph") == "X" and e.get("pid") in gpu_pids]
    if host is not None:
        host.extend((e["name"], float(e["ts"]), float(e.get("dur", 0.0))) for e in events
                    if e.get("ph") == "X" and e.get("pid") not in gpu_pids)
    return sorted(out, key=lambda x: x[1])


def _summary(events, label, top=10, file=sys.stderr):
    names = {}
    for name, _, d in events:
        c, tot = names.get(name[:100], (0, 0.0))
        names[name[:100]] = (c + 1, tot + d)
    for name, (c, tot) in sorted(names.items(), key=lambda x: -x[1][1])[:top]:
        print(f"  trace {label}: {c:5d} x {tot / c:9.2f} us  {name}", file=file)


def split_events(events, ours):
    """(our kernel durations, other kernels' total µs, busy-span µs, idle µs) of a trace."""
    if not events:
        return [], 0.0, 0.0, 0.0
    mine = [d for n, _, d in events if ours in n]
    other = sum(d for n, _, d in events if ours not in n)
    span = max(t + d for _, t, d in events) - events[0][1]
    busy, end = 0.0, -1e30
    for _, t, d in events:  # union of intervals (kernels of one stream do not overlap)
        busy += max(0.0, t + d - max(t, end))
        end = max(end, t + d)
    return mine, other, span, span - busy


def _random_cache(shape, device, seed):
    """Random NVFP4 bytes made on the device, every scale byte finite (< 0x70)."""
    bits = jax.jit(lambda k: jax.random.bits(k, shape, jnp.uint8) & jnp.uint8(0x6F))
    return jax.device_put(bits(jax.random.key(seed)), device)


def decode_scan(device, rng, T, dql, Hkv, G, seq=32768, with_ref=True, min_pages=8192):
    """Per-layer seconds (ours, reference) and our kernel's trace figures, for decode inside a
    jitted scan over LAYERS layers."""
    R = T // dql
    blocks = -(-seq // N)
    steps = 8 if T <= 8 else (4 if T <= 32 else 2)
    # Page pool: every request of every step gets its own pages while that fits in 3 GiB per
    # layer; small batches draw from at least 8192 pages so that repeated runs miss L2.
    per_layer = 2 * Hkv * N * TOKEN_BYTES
    P = max(min_pages, min(R * blocks * steps, (3 << 30) // per_layer))
    cache = _random_cache(m3.KVCacheSpec(Hkv).cache_shape(P, LAYERS), device, T)
    bts = np.stack([rng.choice(P, (R, blocks), replace=R * blocks > P) for _ in range(steps)])
    topks = np.stack([[np.argsort(rng.random((Hkv * T, blocks)), axis=1)[:, :K]
                       .reshape(Hkv, T, K) for _ in range(LAYERS)] for _ in range(steps)])
    q = rng.standard_normal((steps, LAYERS, T, Hkv * G, D)).astype(np.float32)
    seq_lens = np.full((R,), seq, np.int32)
    args = [jax.device_put(a, device) for a in (
        jnp.asarray(q, jnp.bfloat16), cache, topks.astype(np.int32), bts.astype(np.int32),
        seq_lens)]

    def model(attend, unroll=1):
        @jax.jit
        def run(q, cache, topks, bts, seq_lens):
            outs = []
            for s in range(steps):
                def layer(carry, xs):
                    i, qi, ti = xs
                    o = attend(qi, cache, ti, bts[s], seq_lens, 1.0, 1.0, decode_query_len=dql,
                               layer=i)
                    return carry, o
                _, o = jax.lax.scan(layer, 0, (jnp.arange(LAYERS, dtype=jnp.int32), q[s],
                                               topks[s]), unroll=unroll)
                outs.append(o)
            return outs
        return run

    ours = model(m3.sparse_decode)
    t_ours = _median_wall(ours, args) / (steps * LAYERS)
    t_unrolled = _median_wall(model(m3.sparse_decode, LAYERS), args) / (steps * LAYERS)
    t_ref = _median_wall(model(reference.sparse_decode), args, runs=3) / (steps * LAYERS) \
        if with_ref else float("nan")
    events = gpu_events(ours, args)
    if os.environ.get("M3SPARSE_BENCH_TRACE"):  # what the jitted scan launches, per name
        _summary(events, f"T={T} G={G}", 12)
    mine, other, span, idle = split_events(events, "sparse_attention")
    n = steps * LAYERS
    kern = statistics.median(mine) * 1e-6 if mine else float("nan")
    return t_ours, t_unrolled, t_ref, kern, other / n * 1e-6, idle / n * 1e-6


def gap(device, rng, T, Hkv=4, G=16, seq=32768, min_pages=8192):
    """Where the time of decode inside a jitted scan goes: per-layer wall time of variants that
    leave parts out, with the host-side time of our FFI handler from the trace."""
    blocks = -(-seq // N)
    P = max(min_pages, min(T * blocks, (3 << 30) // (2 * Hkv * N * TOKEN_BYTES)))
    cache = _random_cache(m3.KVCacheSpec(Hkv).cache_shape(P, LAYERS), device, 7)
    bt = jax.device_put(rng.choice(P, (T, blocks), replace=T * blocks > P).astype(np.int32),
                        device)
    topk = jax.device_put(np.stack([np.argsort(rng.random((Hkv * T, blocks)), axis=1)[:, :K]
                                    .reshape(Hkv, T, K) for _ in range(LAYERS)])
                          .astype(np.int32), device)
    q = jax.device_put(jnp.asarray(rng.standard_normal((LAYERS, T, Hkv * G, D)), jnp.bfloat16),
                       device)
    sl = jax.device_put(np.full((T,), seq, np.int32), device)
    layers = jnp.arange(LAYERS, dtype=jnp.int32)

    def call(qi, ti, i, cache, bt, sl):
        return m3.sparse_decode(qi, cache, ti, bt, sl, 1.0, 1.0, layer=i)

    def stand_in(qi, ti, i, *_):  # same operands and result, no custom call
        return qi * (ti[0, 0, 0] + i).astype(qi.dtype)

    def scan_of(body, unroll=1):
        def run(q, topk, *rest):  # the cache is an argument, never a captured constant
            return jax.lax.scan(lambda c, xs: (c, body(*xs, *rest)), 0, (q, topk, layers),
                                unroll=unroll)[1]
        return jax.jit(run)

    variants = {
        "scan, ours": scan_of(call),
        "scan, stand-in (no custom call)": scan_of(stand_in),
        "scan unroll=8, ours": scan_of(call, LAYERS),
        "python loop, ours": jax.jit(lambda q, topk, *rest: [
            call(q[i], topk[i], layers[i], *rest) for i in range(LAYERS)]),
    }
    args = (q, topk, cache, bt, sl)
    reps = 10
    qs = jax.device_put(jnp.asarray(rng.standard_normal((reps, *q.shape)), jnp.bfloat16), device)
    for name, fn in variants.items():
        # distinct q per repetition: XLA would merge identical calls into one
        many = jax.jit(lambda qs, *a, fn=fn: [fn(qs[r], *a) for r in range(reps)])
        t = _median_wall(many, (qs, *args[1:])) / (reps * LAYERS)
        host = []
        ev = gpu_events(fn, args, host=host)
        mine, other, span, idle = split_events(ev, "sparse_attention")
        hs = [d for n, _, d in host if "sparse_decode" in n or "custom-call" in n.lower()]
        kern = statistics.median(mine) if mine else float("nan")
        print(f"gap T={T} | {name:32s} | {t * 1e6:8.2f} µs/layer | kernel {kern:7.2f} | "
              f"other {other / LAYERS:6.2f} | idle {idle / LAYERS:6.2f} | host events "
              f"{len(hs)} x {statistics.median(hs) if hs else float('nan'):.2f} µs")
        if os.environ.get("M3SPARSE_BENCH_TRACE") and name == "scan, ours":
            _summary(ev, f"gap T={T} GPU", 10)
            _summary(host, f"gap T={T} host", 25)


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
    mine = split_events(gpu_events(many, args), "sparse_attention")[0]
    kern = statistics.median(mine) * 1e-6 if mine else float("nan")
    # attended keys per (token, KV head): min(128, vis - 128 b) per selected block
    vis = pos[None, :, None] + 1
    keys = np.clip(vis - N * topks[0], 0, N).sum()
    flops = 4 * G * D * float(keys)
    return t, kern, flops


def pack(device, rng, T, Hkv=4):
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
    box = [cache]

    def once(k, slots):  # the donated cache threads through the profiled call
        box[0] = fn(box[0], k, slots)
        return box[0]

    mine = split_events(gpu_events(once, (k, slots)), "pack_kernel")[0]
    kern = statistics.median(mine) * 1e-6 if mine else float("nan")
    nbytes = T * Hkv * 2 * (2 * D + TOKEN_BYTES)
    return t, kern, nbytes


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m jax_m3sparse.bench.cuda", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="decode T in {1, 128} only")
    parser.add_argument("--no-ref", action="store_true", help="skip the XLA reference")
    parser.add_argument("--gap", action="store_true",
                        help="only the kernel vs through-JAX gap analysis (variants of the scan)")
    args = parser.parse_args(argv)
    device = jax.devices("cuda")[0]
    rng = np.random.default_rng(0)
    if args.gap:
        print(f"gap analysis; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
        for T in (1, 128):
            gap(device, rng, T)
        return 0
    copy_bw = copy_bandwidth(device, 1 << 30)
    print(f"CUDA benchmark on {device.device_kind}; jax {jax.__version__}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; copy bandwidth "
          f"{copy_bw / 1e12:.3f} TB/s (jitted x+1 over 1 GiB, read + write)")
    print(f"decode inside a jitted lax.scan over {LAYERS} layers of a 5-D LBHNC cache "
          "(traced layer), µs per layer; seq 32768, top-16x128, bf16; 'other' = XLA's own "
          "kernels per layer, 'idle' = GPU idle per layer (trace)")
    print("Hkv G | T (dql) | ours (scan) | ours (scan, unroll=8) | XLA ref (scan) | ref/ours | "
          "kernel | % copy (kernel) | % copy (ours, unrolled) | other | idle")
    shapes = [(1, 1, 4, 16), (128, 1, 4, 16)] if args.quick else [
        (1, 1, 4, 16), (32, 1, 4, 16), (128, 1, 4, 16), (128, 4, 4, 16), (128, 1, 4, 8),
        (128, 1, 4, 4)]
    for T, dql, Hkv, G in shapes:
        t, tu, tr, kern, other, idle = decode_scan(device, rng, T, dql, Hkv, G,
                                                   with_ref=not args.no_ref)
        nbytes = T * Hkv * K * N * TOKEN_BYTES * 2
        print(f"{Hkv} {G:2d} | {T} ({dql}) | {t * 1e6:8.2f} | {tu * 1e6:8.2f} | {tr * 1e6:8.1f} | "
              f"{tr / t:6.1f}x | {kern * 1e6:7.2f} | {100 * nbytes / kern / copy_bw:5.1f}% | "
              f"{100 * nbytes / tu / copy_bw:5.1f}% | {other * 1e6:6.2f} | {idle * 1e6:6.2f}")
    if not args.quick:
        print("prefill (context 8192, Hkv=4, G=16) | tokens | µs/call | kernel µs | "
              "TFLOP/s (call) | TFLOP/s (kernel)")
        for T in (2048,):
            t, kern, fl = prefill(device, rng, T)
            print(f"prefill | {T} | {t * 1e6:9.1f} | {kern * 1e6:9.1f} | {fl / t / 1e12:7.1f} | "
                  f"{fl / kern / 1e12:7.1f}")
        print("pack (Hkv=4, bf16) | tokens | µs/call | kernel µs | % copy (call) | % copy (kernel)")
        for T in (4096, 65536):
            t, kern, nb = pack(device, rng, T)
            print(f"pack | {T} | {t * 1e6:9.2f} | {kern * 1e6:9.2f} | "
                  f"{100 * nb / t / copy_bw:5.1f}% | {100 * nb / kern / copy_bw:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
