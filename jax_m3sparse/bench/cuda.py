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
calls, wall time / calls), with the kernel's device time from the trace beside it; so does
full_attention (every key up to the position: decode 8 @ 128k, 128 @ 16k, prefill 2048 @ 8k at
the TP-8 rank's Hkv 1, G 8, beside its floor: each row's K/V bytes once at the copy rate).
Shapes and byte/flop counts follow BENCHMARKS.md: Hkv = 4, G = 16 (TP 1; and G = 8, 4), and
Hkv = 1, G = 8 (one rank of M3 at TP 8: decode T = 8, 32, 128; prefill 2048), D = N = 128,
top-16 blocks, seq 32768, bf16; prefill 2048 / 8192 tokens after 8192 context; pack 4096 /
65536 tokens.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import jax_m3sparse as m3
from jax_m3sparse import reference
from jax_m3sparse import sharding as shd
from jax_m3sparse.bench.timing import D, K, N, TOKEN_BYTES, copy_bandwidth, fill_cache
from jax_m3sparse.ops import full as full_ops

REPS = 20
HBM_BYTES_PER_S = 4.25e12   # the H200's cudaMemcpy rate and dense bf16 rate: BENCHMARKS.md's
BF16_FLOPS = 790e12         # floors
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


def summary(events, label, top=10, file=sys.stderr):
    """Each kernel name's count and mean µs in ``events`` (gpu_events), the ``top`` by total."""
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


def decode_inputs(device, rng, T, dql, Hkv, G, seq=32768, min_pages=8192, layer_bytes=3 << 30,
                  steps=None, shared=None):
    """(steps, [q, cache, topks, bts, seq_lens] on ``device``) for :func:`decode_model`: each
    step its own block table, top-k and q; the cache holds random NVFP4 pages. ``shared`` (dql >
    1): every row of a request selects the same ``shared`` blocks and K - shared of its own
    (else each row draws its own K)."""
    R = T // dql
    blocks = -(-seq // N)
    steps = steps or (8 if T <= 8 else (4 if T <= 32 else 2))
    # Page pool: every request of every step gets its own pages while that fits in
    # ``layer_bytes`` per layer; small batches draw from at least ``min_pages`` pages so that
    # repeated runs miss L2.
    per_layer = 2 * Hkv * N * TOKEN_BYTES
    P = max(min_pages, min(R * blocks * steps, layer_bytes // per_layer))
    cache = _random_cache(m3.KVCacheSpec(Hkv).cache_shape(P, LAYERS), device, T)
    bts = np.stack([rng.choice(P, (R, blocks), replace=R * blocks > P) for _ in range(steps)])
    if shared is None:
        topks = np.stack([[np.argsort(rng.random((Hkv * T, blocks)), axis=1)[:, :K]
                           .reshape(Hkv, T, K) for _ in range(LAYERS)] for _ in range(steps)])
    else:  # per (head, request) one draw: [0, shared) common, then K - shared per row
        own = K - shared
        cols = np.array([[k if k < shared else k + i * own for k in range(K)]
                         for i in range(dql)])                                 # [dql, K]
        draw = np.argsort(rng.random((steps, LAYERS, Hkv, R, blocks)), axis=-1)
        topks = np.take_along_axis(draw[..., None, :], cols[None, None, None, None], -1)
        topks = topks.reshape(steps, LAYERS, Hkv, T, K)
    q = rng.standard_normal((steps, LAYERS, T, Hkv * G, D)).astype(np.float32)
    seq_lens = np.full((R,), seq, np.int32)
    return steps, [jax.device_put(a, device) for a in (
        jnp.asarray(q, jnp.bfloat16), cache, topks.astype(np.int32), bts.astype(np.int32),
        seq_lens)]


def decode_model(attend, steps, dql, unroll=1):
    """The jitted decode of :func:`decode_inputs`' operands: ``steps`` steps, each a
    ``lax.scan`` over the LAYERS layers (traced layer index); returns one [LAYERS, T, Hq, D]
    output per step."""
    @jax.jit
    def run(q, cache, topks, bts, seq_lens):
        outs = []
        for s in range(steps):
            def layer(carry, xs):
                i, qi, ti = xs
                o = attend(qi, cache, ti, bts[s], seq_lens, 1.0, 1.0, decode_query_len=dql,
                           layer=i, layout="LBHNC")
                return carry, o
            _, o = jax.lax.scan(layer, 0, (jnp.arange(LAYERS, dtype=jnp.int32), q[s],
                                           topks[s]), unroll=unroll)
            outs.append(o)
        return outs
    return run


def decode_scan(device, rng, T, dql, Hkv, G, seq=32768, with_ref=True, min_pages=8192,
                shared=None):
    """Per-layer seconds (ours, reference) and our kernel's trace figures, for decode inside a
    jitted scan over LAYERS layers."""
    steps, args = decode_inputs(device, rng, T, dql, Hkv, G, seq, min_pages, shared=shared)
    ours = decode_model(m3.sparse_decode, steps, dql)
    t_ours = _median_wall(ours, args) / (steps * LAYERS)
    t_unrolled = _median_wall(decode_model(m3.sparse_decode, steps, dql, LAYERS), args) / (
        steps * LAYERS)
    t_ref = _median_wall(decode_model(reference.sparse_decode, steps, dql), args, runs=3) / (
        steps * LAYERS) if with_ref else float("nan")
    events = gpu_events(ours, args)
    if os.environ.get("M3SPARSE_BENCH_TRACE"):  # what the jitted scan launches, per name
        summary(events, f"T={T} G={G}", 12)
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
        return m3.sparse_decode(qi, cache, ti, bt, sl, 1.0, 1.0, layer=i, layout="LBHNC")

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
            summary(ev, f"gap T={T} GPU", 10)
            summary(host, f"gap T={T} host", 25)


def prefill_inputs(device, rng, T, Hkv=4, G=16, context=8192, reps=4):
    """([q, cache, topks, bt, req_id, pos] on ``device``, flops of one call): one request of
    ``T`` tokens after ``context``, ``reps`` distinct top-k selections."""
    kv_len = context + T
    blocks = -(-kv_len // N)
    cache = fill_cache(rng, m3.KVCacheSpec(Hkv).cache_shape(blocks), device)
    bt = jax.device_put(rng.permutation(blocks).astype(np.int32)[None], device)
    pos = np.arange(context, kv_len, dtype=np.int32)
    topks = np.stack([np.stack([rng.choice(p // N + 1, K, replace=False)
                                for p in np.tile(pos, Hkv)]).reshape(Hkv, T, K)
                      for _ in range(reps)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((T, Hkv * G, D)), jnp.bfloat16)
    args = [jax.device_put(a, device) for a in (q, cache, topks, bt, jnp.zeros(T, jnp.int32),
                                                jnp.asarray(pos))]
    # attended keys per (token, KV head): min(128, vis - 128 b) per selected block
    vis = pos[None, :, None] + 1
    keys = np.clip(vis - N * topks[0], 0, N).sum()
    return args, 4 * G * D * float(keys)


def prefill_model(reps=4):
    """One jitted function that makes ``reps`` independent prefill calls (one per top-k)."""
    @jax.jit
    def many(q, cache, topks, bt, rid, pos):
        return [m3.sparse_prefill(q, cache, topks[i], bt, rid, pos, 1.0, 1.0) for i in range(reps)]
    return many


def prefill(device, rng, T, Hkv=4, G=16, context=8192):
    reps = 4
    args, flops = prefill_inputs(device, rng, T, Hkv, G, context, reps)
    many = prefill_model(reps)
    t = _median_wall(many, args) / reps
    mine = split_events(gpu_events(many, args), "sparse_attention")[0]
    kern = statistics.median(mine) * 1e-6 if mine else float("nan")
    return t, kern, flops


def full_inputs(device, rng, T, context, Hkv=1, G=8, prefill=False, reps=4):
    """(args, bytes, flops) for full_attention: ``T`` decode rows of ``T`` requests at
    ``context`` tokens (each its own pages), or one request's ``T`` prefill tokens after
    ``context``; ``reps`` different q (one call each). bytes: the K/V tiles every (row, KV head)
    must read once (prefill: the request's, once); flops: QK and PV of every attended key."""
    kv_len = context + (T if prefill else 0)
    blocks = -(-kv_len // N)
    R = 1 if prefill else T
    cache = _random_cache(m3.KVCacheSpec(Hkv).cache_shape(R * blocks), device, T)
    bt = rng.permutation(R * blocks).astype(np.int32).reshape(R, blocks)
    if prefill:
        req, pos = np.zeros(T, np.int32), np.arange(context, kv_len, dtype=np.int32)
    else:
        req, pos = np.arange(T, dtype=np.int32), np.full(T, context - 1, np.int32)
    q = jnp.asarray(rng.standard_normal((reps, T, Hkv * G, D)), jnp.bfloat16)
    args = [jax.device_put(a, device) for a in (q, cache, bt, req, pos)]
    tile = N * TOKEN_BYTES
    nbytes = 2 * Hkv * tile * R * blocks
    flops = 4 * Hkv * G * D * float(np.sum(pos + 1))
    return args, nbytes, flops


def full(device, rng, T, context, Hkv=1, G=8, prefill=False, with_ref=True, reps=4,
         part_blocks=None):
    """(seconds per call through jax.jit, kernel seconds per call from the trace (attention and
    merge kernels), the merge's share, reference seconds per call, bytes, flops) of
    full_attention; ``part_blocks``: the CUDA kernel's part size (default the library's)."""
    args, nbytes, flops = full_inputs(device, rng, T, context, Hkv, G, prefill, reps)
    attend = m3.full_attention
    if part_blocks:
        def attend(q, cache, bt, req, pos, ks, vs):
            return full_ops.bind(q, cache, bt, req, pos, jnp.float32(ks), jnp.float32(vs),
                                 jnp.int32(0), scale=D ** -0.5, layout=0,
                                 part_blocks=part_blocks)

    def model(fn):
        @jax.jit
        def many(q, cache, bt, req, pos):
            return [fn(q[i], cache, bt, req, pos, 1.0, 1.0) for i in range(reps)]
        return many

    ours = model(attend)
    t = _median_wall(ours, args) / reps
    events = gpu_events(ours, args)
    kern = sum(d for n, _, d in events if "sparse_attention" in n or "full_merge" in n)
    merge = sum(d for n, _, d in events if "full_merge" in n)
    t_ref = (_median_wall(model(reference.full_attention), args, runs=2) / reps
             if with_ref else float("nan"))
    return t, kern * 1e-6 / reps, merge * 1e-6 / reps, t_ref, nbytes, flops


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


# --- Tensor parallel over KV heads (``--tp N``) ----------------------------------------------

AXIS = "tp"
COLLECTIVE = re.compile(r"all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter")
# operand specs of decode_inputs / prefill_inputs on a 1-D mesh (jax_m3sparse.sharding)
DECODE_SPECS = (PartitionSpec(None, None, None, AXIS, None), shd.cache_spec(AXIS, 5),
                PartitionSpec(None, None, AXIS, None, None), PartitionSpec(), PartitionSpec())
PREFILL_SPECS = (shd.head_specs(AXIS)["q"], shd.cache_spec(AXIS, 4),
                 PartitionSpec(None, AXIS, None, None), PartitionSpec(), PartitionSpec(),
                 PartitionSpec())


def _replicate_slots(cache, replicas, axis):
    """Each KV head's K/V slot pair (slots 2h, 2h+1) ``replicas`` times along the head-slot
    ``axis``: what :func:`jax_m3sparse.sharding.replicate_kv_heads` does to key/value before
    pack, done to an already packed cache."""
    if replicas == 1:
        return cache
    s = cache.shape
    pairs = cache.reshape(*s[:axis], s[axis] // 2, 2, *s[axis + 1:])
    return jnp.repeat(pairs, replicas, axis=axis).reshape(*s[:axis], s[axis] * replicas,
                                                          *s[axis + 1:])


def tp_operands(args, mesh, specs, replicas, slot_axis, topk_axis):
    """The one-device operands ``args`` (q, cache, topk, ...) placed on ``mesh`` by ``specs``,
    with the cache's and topk's KV heads replicated ``replicas`` times first (TP > Hkv)."""
    args = list(args)
    if replicas > 1:
        args[1] = jax.jit(_replicate_slots, static_argnums=(1, 2))(args[1], replicas, slot_axis)
        args[2] = shd.replicate_kv_heads(args[2], replicas, axis=topk_axis)
    return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]


def _max_abs(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def tp_compare(fn, args1, argsN, calls, ours="sparse_attention"):
    """One jitted ``fn`` on one device and on the mesh: per-call seconds (TP 1, TP N), our
    kernel's median device time in each trace, the collectives in the compiled TP-N module,
    whether that module sees the cache's per-device shape, max |out_N - out_1| and its
    relative Frobenius norm, and max |shard - fn(that device's own operand shards)| over the
    devices (0: each device's part of the TP-N module computes exactly what a one-device call
    on its shards does)."""
    t1 = _median_wall(fn, args1) / calls
    tn = _median_wall(fn, argsN) / calls
    kern = []
    for a in (args1, argsN):
        mine = split_events(gpu_events(fn, a), ours)[0]
        kern.append(statistics.median(mine) * 1e-6 if mine else float("nan"))
    text = fn.lower(*argsN).compile().as_text()
    local = argsN[1].addressable_shards[0].data.shape
    local_in_hlo = f"u8[{','.join(map(str, local))}]" in text
    out1 = jax.tree.leaves(fn(*args1))
    outn = jax.tree.leaves(fn(*argsN))
    diff = max(_max_abs(a, b) for a, b in zip(out1, outn))
    rel = float(np.sqrt(sum(np.sum((np.asarray(a, np.float32) - np.asarray(b, np.float32)) ** 2)
                            for a, b in zip(out1, outn)) /
                        sum(np.sum(np.asarray(a, np.float32) ** 2) for a in out1)))
    own = 0.0
    for dev in argsN[1].sharding.device_set:
        shard = lambda x: next(s.data for s in x.addressable_shards if s.device == dev)
        got = jax.tree.leaves(fn(*[shard(a) for a in argsN]))
        own = max([own] + [_max_abs(shard(a), b) for a, b in zip(outn, got)])
    return t1, tn, kern, COLLECTIVE.findall(text), local_in_hlo, local, diff, rel, own


def tp_bench(tp, platform="cuda", T=128, seq=32768, prefill_T=2048, context=8192,
             min_pages=8192, layer_bytes=3 << 30):
    """Decode (jitted layer scan, plain and unroll=8) and prefill with M3's attention heads
    (Hq 64, Hkv 4) at TP 1 and TP ``tp`` in one run, the cache sharded over KV-head slots on a
    1-D mesh; prints one table row per case."""
    devices = jax.devices(platform)
    if len(devices) < tp:
        hint = (f" (on the CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={tp} "
                "before Python starts)") if platform == "cpu" else ""
        raise SystemExit(f"--tp {tp} needs {tp} {platform} devices, JAX sees {len(devices)}{hint}")
    mesh = jax.make_mesh((tp,), (AXIS,), axis_types=(AxisType.Auto,), devices=devices[:tp])
    dev0, rng = devices[0], np.random.default_rng(0)
    Hkv, G = 4, 16
    r = shd.kv_head_replicas(Hkv, tp)
    stored = Hkv * r
    copy_bw = copy_bandwidth(dev0, 1 << 30)
    print(f"TP benchmark on {tp} x {dev0.device_kind} ({platform}); jax {jax.__version__}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; copy bandwidth of device 0 "
          f"{copy_bw / 1e12:.3f} TB/s (jitted x+1 over 1 GiB, read + write)")
    print(f"Hq 64, Hkv {Hkv}: the cache stores {stored} KV heads ({r} cop{'y' if r == 1 else 'ies'}"
          f" each), {stored // tp} per device, G = {64 // stored} per device; cache spec "
          f"{shd.cache_spec(AXIS, 5)}; TP 1 = the unreplicated G = 16 cache on device 0")
    print(f"decode: T = {T} rows (seq {seq}, top-{K}x{N}), jitted lax.scan over {LAYERS} layers, "
          f"µs per layer; prefill: {prefill_T} tokens after {context}, µs per call")
    print("case | TP 1 µs | TP N µs (per device) | TP1/TPN | TP N aggregate | TP 1 | kernel µs "
          "TP 1 / TP N | collectives in TP-N HLO | local cache shape in HLO | max |out - TP 1| "
          "(rel-F) | max |shard - one-device call on its shards|")
    # 8 steps per call (pages shared between steps, still 3 GiB a layer): the dispatch of a
    # several-device call is amortized over 64 layers
    steps, args1 = decode_inputs(dev0, rng, T, 1, Hkv, G, seq, min_pages, layer_bytes, steps=8)
    argsN = tp_operands(args1, mesh, DECODE_SPECS, r, slot_axis=2, topk_axis=2)
    bytes1 = T * Hkv * K * N * TOKEN_BYTES * 2      # every selected K/V byte read once
    rows = []
    for unroll in (1, LAYERS):
        fn = decode_model(m3.sparse_decode, steps, 1, unroll)
        res = tp_compare(fn, args1, argsN, steps * LAYERS)
        t1, tn = res[:2]
        rows.append((f"decode T={T} scan" + (f" unroll={unroll}" if unroll > 1 else ""), res,
                     f"{bytes1 * r / tn / 1e12:.3f} TB/s", f"{bytes1 / t1 / 1e12:.3f} TB/s"))
    del argsN
    reps = 4
    args1, flops = prefill_inputs(dev0, rng, prefill_T, Hkv, G, context, reps)
    argsN = tp_operands(args1, mesh, PREFILL_SPECS, r, slot_axis=1, topk_axis=1)
    res = tp_compare(prefill_model(reps), args1, argsN, reps)
    rows.append((f"prefill {prefill_T} @ {context}", res, f"{flops / res[1] / 1e12:.1f} TFLOP/s",
                 f"{flops / res[0] / 1e12:.1f} TFLOP/s"))
    for name, (t1, tn, kern, coll, local_ok, local, diff, rel, own), agg_n, agg_1 in rows:
        print(f"{name} | {t1 * 1e6:8.2f} | {tn * 1e6:8.2f} | {t1 / tn:5.2f}x | {agg_n} | {agg_1} | "
              f"{kern[0] * 1e6:7.2f} / {kern[1] * 1e6:7.2f} | {len(coll)}"
              f"{' ' + ','.join(sorted(set(coll))) if coll else ''} | "
              f"{'yes' if local_ok else 'NO'} u8{list(local)} | {diff:.3g} ({rel:.2g}) | {own:.3g}")
    bad = [name for name, res, *_ in rows if res[3] or not res[4]]
    print("HLO check: " + ("no collective in any TP-%d module; each device's module takes its "
                           "own cache shard" % tp if not bad else f"FAILED for {bad}"))
    return 0 if not bad else 1


def bench_full(device, rng, copy_bw, args):
    """The full_attention table: decode at long context and a prefill chunk, TP-8 rank shape."""
    print("full_attention (Hkv 1, G 8: one TP-8 rank) | rows | part | µs/call | kernel µs | "
          "of which merge | floor µs (bytes ÷ 4.25 TB/s or FLOPs ÷ 790 TFLOP/s) | kernel / floor | "
          "XLA ref µs | ref / ours | TFLOP/s (kernel)")
    cases = [(8, 131072, False), (128, 16384, False), (2048, 8192, True)]
    if not args.quick:
        cases[1:1] = [(32, 32768, False)]
    for T, ctx, pre in cases:
        for part in args.part_blocks or [full_ops.PART_BLOCKS]:
            t, kern, merge, tr, nb, fl = full(device, rng, T, ctx, prefill=pre, part_blocks=part,
                                       with_ref=not args.no_ref and not pre and
                                       part == (args.part_blocks or [part])[0])
            floor = max(nb / HBM_BYTES_PER_S, fl / BF16_FLOPS)
            label = f"prefill {T} @ {ctx}" if pre else f"decode {T} @ {ctx}"
            print(f"full | {label} | {part} | {t * 1e6:9.1f} | {kern * 1e6:9.1f} | "
                  f"{merge * 1e6:7.1f} | {floor * 1e6:8.1f} | {kern / floor:5.2f}x | {tr * 1e6:9.1f} | {tr / t:6.1f}x | "
                  f"{fl / kern / 1e12:6.1f}")
    return 0


# One TP-8 rank of MiniMax M3: (name, N, K) of the projections a decode step reads.
DENSE_SHAPES = (("qkv_proj", 1536, 6144), ("o_proj", 6144, 1024), ("router", 128, 6144),
                ("shared gate_up", 768, 6144), ("shared down", 6144, 384),
                ("dense gate_up", 3072, 6144), ("dense down", 6144, 1536))


def dense(device, rng, M, N, K, copies=8):
    """(kernel µs of dense_matmul, of XLA's dot) per call: one jitted function over ``copies``
    distinct weights (more than L2 holds for the large ones), kernel times from a trace."""
    x = jax.device_put(jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16), device)
    ws = jax.device_put(jnp.asarray(rng.normal(size=(copies, N, K)) / 64, jnp.bfloat16), device)
    ours = jax.jit(lambda x, ws: [m3.dense_matmul(x, ws[i]) for i in range(copies)])
    xla = jax.jit(lambda x, ws: [jnp.einsum("mk,nk->mn", x, ws[i],
                                            preferred_element_type=jnp.float32)
                                 for i in range(copies)])
    out = []
    for fn in (ours, xla):
        ev = [e for e in gpu_events(fn, (x, ws)) if "memcpy" not in e[0].lower()]
        out.append(sum(d for _, _, d in ev) / copies)
    return out


def bench_dense(device, rng):
    """The dense_matmul table: ours against XLA's dot (cuBLAS) at a decode step's row counts."""
    print("dense_matmul (one TP-8 rank of M3) | N x K | rows | ours kernel µs | XLA dot kernel "
          "µs | XLA / ours | floor µs (bytes ÷ 4.25 TB/s) | ours / floor")
    for name, N, K in DENSE_SHAPES:
        for M in (1, 4, 16, 64, 128):
            ours, xla = dense(device, rng, M, N, K)
            floor = (N * K + M * K + M * N * 2) * 2 / HBM_BYTES_PER_S * 1e6
            print(f"dense | {name} {N}x{K} | {M} | {ours:8.2f} | {xla:8.2f} | {xla / ours:5.2f}x | "
                  f"{floor:7.2f} | {ours / floor:5.2f}x")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m jax_m3sparse.bench.cuda", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="decode T in {1, 32, 128} (+ the TP-8 rank's 8, 32, 128), prefill, no pack")
    parser.add_argument("--no-ref", action="store_true", help="skip the XLA reference")
    parser.add_argument("--full", action="store_true",
                        help="only the full_attention rows (with their XLA reference unless --no-ref)")
    parser.add_argument("--part-blocks", type=lambda s: [int(x) for x in s.split(",")],
                        help="with --full: the CUDA kernel's part sizes to compare (e.g. 8,16,32)")
    parser.add_argument("--dense", action="store_true",
                        help="only the dense_matmul rows (ours against XLA's dot)")
    parser.add_argument("--gap", action="store_true",
                        help="only the kernel vs through-JAX gap analysis (variants of the scan)")
    parser.add_argument("--tp", type=int, metavar="N",
                        help="only decode T = 128 and prefill 2048 @ 8192 at TP 1 and TP N, the "
                             "cache sharded over KV heads on N devices (M3's heads: G = 16 for "
                             "N <= 4, KV heads replicated and G = 8 at N = 8)")
    parser.add_argument("--platform", default="cuda",
                        help="JAX platform of --tp (cpu: a dry run on simulated devices)")
    parser.add_argument("--small", action="store_true",
                        help="with --tp: small shapes (T 16, seq 2048, prefill 128 @ 2048)")
    args = parser.parse_args(argv)
    if args.tp:
        small = dict(T=16, seq=2048, prefill_T=128, context=2048, min_pages=64,
                     layer_bytes=1 << 22) if args.small else {}
        return tp_bench(args.tp, args.platform, **small)
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
    if args.full:
        return bench_full(device, rng, copy_bw, args)
    if args.dense:
        return bench_dense(device, rng)
    print(f"decode inside a jitted lax.scan over {LAYERS} layers of a 5-D LBHNC cache "
          "(traced layer), µs per layer; seq 32768, top-16x128, bf16; 'other' = XLA's own "
          "kernels per layer, 'idle' = GPU idle per layer (trace); dql 's12': a request's rows "
          "share 12 of their 16 blocks")
    print("Hkv G | T (dql) | ours (scan) | ours (scan, unroll=8) | XLA ref (scan) | ref/ours | "
          "kernel | % copy (kernel) | % copy (ours, unrolled) | other | idle")
    # (T, dql, Hkv, G, shared): dql 4 "s12": the rows of a request share 12 of their 16 blocks
    # Hkv 1, G 8: what one rank of M3 at TP 8 runs (4 KV heads replicated to 8, one per device).
    tp8 = [(8, 1, 1, 8, None), (32, 1, 1, 8, None), (128, 1, 1, 8, None)]
    shapes = [(1, 1, 4, 16, None), (32, 1, 4, 16, None), (128, 1, 4, 16, None),
              (128, 4, 4, 16, 12), *tp8] if args.quick else [*tp8,
        (1, 1, 4, 16, None), (32, 1, 4, 16, None), (128, 1, 4, 16, None), (128, 4, 4, 16, None),
        (128, 4, 4, 16, 12), (32, 4, 4, 16, 12), (128, 1, 4, 8, None), (128, 1, 4, 4, None)]
    for T, dql, Hkv, G, shared in shapes:
        t, tu, tr, kern, other, idle = decode_scan(device, rng, T, dql, Hkv, G,
                                                   with_ref=not args.no_ref, shared=shared)
        nbytes = T * Hkv * K * N * TOKEN_BYTES * 2
        tag = f"{dql}" if shared is None else f"{dql} s{shared}"
        print(f"{Hkv} {G:2d} | {T} ({tag}) | {t * 1e6:8.2f} | {tu * 1e6:8.2f} | {tr * 1e6:8.1f} | "
              f"{tr / t:6.1f}x | {kern * 1e6:7.2f} | {100 * nbytes / kern / copy_bw:5.1f}% | "
              f"{100 * nbytes / tu / copy_bw:5.1f}% | {other * 1e6:6.2f} | {idle * 1e6:6.2f}")
    print("prefill (context 8192) | Hkv G | tokens | µs/call | kernel µs | "
          "TFLOP/s (call) | TFLOP/s (kernel)")
    for Hkv, G in ((4, 16), (1, 8)):     # TP 1 and one TP-8 rank
        t, kern, fl = prefill(device, rng, 2048, Hkv, G)
        print(f"prefill | {Hkv} {G:2d} | 2048 | {t * 1e6:9.1f} | {kern * 1e6:9.1f} | "
              f"{fl / t / 1e12:7.1f} | {fl / kern / 1e12:7.1f}")
    bench_full(device, rng, copy_bw, args)
    if not args.quick:
        print("pack (Hkv=4, bf16) | tokens | µs/call | kernel µs | % copy (call) | % copy (kernel)")
        for T in (4096, 65536):
            t, kern, nb = pack(device, rng, T)
            print(f"pack | {T} | {t * 1e6:9.2f} | {kern * 1e6:9.2f} | "
                  f"{100 * nb / t / copy_bw:5.1f}% | {100 * nb / kern / copy_bw:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
