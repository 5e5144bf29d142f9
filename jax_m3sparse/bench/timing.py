"""Timing tables for pack, decode and prefill: our op vs the pure-XLA reference, on any
JAX platform, against the device's measured copy bandwidth; on the CPU one row per attention
path (ffi/cpu/isa.h) and the machine's measured ceilings (``bench peak``)."""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import jax_m3sparse as m3
from jax_m3sparse import reference

D, N, K = 128, 128, 16
TILE = N * (D // 2 + D // 16)       # bytes of one (page, slot) tile
TOKEN_BYTES = D // 2 + D // 16      # bytes of one token's head vector


def median_time(fn, args, iters, donate_first=False):
    """Median wall time (s) of fn(*args) over ``iters`` runs after one warm-up."""
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(iters):
        if donate_first:
            args = (out, *args[1:])
        t0 = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device, nbytes=256 << 20):
    """Bytes read + written per second by a jitted elementwise pass over ``nbytes``."""
    x = jax.device_put(jnp.zeros(nbytes // 4, jnp.float32), device)
    # Donated, so the pass writes over its input instead of faulting in fresh pages.
    t = median_time(jax.jit(lambda a: a + 1.0, donate_argnums=0), (x,), 5, donate_first=True)
    return 2 * nbytes / t


def fill_cache(rng, shape, device):
    """Random NVFP4 bytes with every scale byte finite (bytes < 0x70)."""
    raw = np.frombuffer(rng.bytes(int(np.prod(shape))), np.uint8).reshape(shape) & 0x6F
    return jax.device_put(raw, device)


def decode_case(rng, T, Hkv, G, seq, dql, device):
    """A decode batch of T rows (R = T / dql requests), each request with its own pages."""
    R = T // dql
    blocks = -(-seq // N)
    P = R * blocks
    cache = fill_cache(rng, m3.KVCacheSpec(Hkv).cache_shape(P), device)
    block_table = rng.permutation(P).astype(np.int32).reshape(R, blocks)
    topk = np.stack([rng.choice(blocks, K, replace=False) for _ in range(Hkv * T)])
    q = rng.standard_normal((T, Hkv * G, D)).astype(np.float32)
    args = (jnp.asarray(q, jnp.bfloat16), cache, jnp.asarray(topk.reshape(Hkv, T, K), jnp.int32),
            jnp.asarray(block_table), jnp.full((R,), seq, jnp.int32))
    return [jax.device_put(a, device) for a in args]


def row(name, ours, ref, nbytes, copy_bw, flops=None):
    cells = [name, f"{ours * 1e6:10.1f}", f"{ref * 1e6:12.1f}", f"{ref / ours:7.1f}x",
             f"{nbytes / ours / 1e9:8.2f}", f"{100 * nbytes / ours / copy_bw:6.1f}%"]
    if flops is not None:
        cells.append(f"{flops / ours / 1e9:8.1f}")
    return " | ".join(cells)


def header(first, flops=False):
    cols = [first, "ours (µs)", "XLA ref (µs)", "ratio (ref ÷ ours)", "GB/s", "% copy"]
    if flops:
        cols.append("GFLOP/s")
    line = " | ".join(cols)
    return line + "\n" + "-" * len(line)


def device_name(device):
    """'cpu' or e.g. 'cuda (NVIDIA H200)'."""
    kind = device.device_kind
    return device.platform if kind == device.platform else f"{device.platform} ({kind})"


def cpu_paths(device):
    """The CPU attention paths to time (one row each): every one this machine supports, up to
    the cap M3SPARSE_CPU_ISA sets (ValueError if it names no path); [None] elsewhere or
    without the native module."""
    found = m3.cpu_attention_paths() if device.platform == "cpu" else None
    if found is None:
        return [None]
    paths, now = found
    return list(paths[:paths.index(now) + 1])


@contextlib.contextmanager
def cpu_path(path):
    """Caps the CPU handlers at ``path`` (M3SPARSE_CPU_ISA, read on every call)."""
    old = os.environ.get("M3SPARSE_CPU_ISA")
    if path is not None:
        os.environ["M3SPARSE_CPU_ISA"] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("M3SPARSE_CPU_ISA", None)
        else:
            os.environ["M3SPARSE_CPU_ISA"] = old


def read_bandwidth(device, nbytes=256 << 20):
    """Bytes read per second by a jitted sum over ``nbytes`` (decode only reads the cache)."""
    x = jax.device_put(jnp.ones(nbytes // 4, jnp.float32), device)
    return nbytes / median_time(jax.jit(jnp.sum), (x,), 5)


# The multiply-add loop (ffi/cpu/peak.cc) that bounds each CPU path's tile math.
PATH_LOOPS = {"generic": "fp32_fma_avx2", "avx2": "fp32_fma_avx2",
              "avx512": "bf16_dot_avx512", "amx": "bf16_amx"}


def cpu_peaks():
    """{name: GFLOP/s} of the register-resident multiply-add loops in ffi/cpu/peak.cc on all
    cores, for the instructions this machine has."""
    from jax_m3sparse.bench import _m3sparse_cpu_bench  # noqa: PLC0415
    threads = os.cpu_count() or 1
    out = {}
    for kind in ("fp32_fma_avx2", "fp32_fma_avx512", "bf16_dot_avx512", "bf16_amx"):
        g = max(_m3sparse_cpu_bench.peak_gflops(kind, threads) for _ in range(3))
        if g > 0:
            out[kind] = g
    return out


def bench_peak(device, quick=False):
    print(f"ceilings on {device_name(device)}: {os.cpu_count()} cores; best of 3 for the "
          "multiply-add loops (ffi/cpu/peak.cc, every core), median of 5 for the jitted passes")
    print("ceiling | value\n" + "-" * 24)
    if device.platform == "cpu":
        for kind, g in cpu_peaks().items():
            print(f"{kind} | {g:8.1f} GFLOP/s")
        from jax_m3sparse.bench import _m3sparse_cpu_bench  # noqa: PLC0415
        print("\nattention block math, one thread (no jit, no DRAM): each block's K/V tiles "
              "dequantized, then one tile dequantized once and folded in every time (the block "
              "math alone); % of the path's own multiply-add loop on one thread, measured just "
              "before")
        print("path | GFLOP/s | loop | loop, 1 thread | % loop | tile dequantized once: GFLOP/s\n"
              + "-" * 84)
        for path in cpu_paths(device):
            kind = PATH_LOOPS.get(path, "fp32_fma_avx2")
            loop = _m3sparse_cpu_bench.peak_gflops(kind, 1)
            g = _m3sparse_cpu_bench.kernel_gflops(path, False)
            c = f"{_m3sparse_cpu_bench.kernel_gflops(path, True):7.1f}"
            pct = f"{100 * g / loop:5.0f}%" if loop > 0 else "  n/a"
            print(f"{path} | {g:7.1f} | {kind} | {loop:7.1f} | {pct} | {c}")
        print()
    print(f"copy (x + 1, donated, read + write) | {copy_bandwidth(device) / 1e9:8.1f} GB/s")
    print(f"read (sum) | {read_bandwidth(device) / 1e9:8.1f} GB/s")


def bench_decode(device, quick=False, seq=32768, Hkv=4, G=16):
    rng = np.random.default_rng(0)
    copy_bw = copy_bandwidth(device)
    print(f"decode on {device_name(device)}; copy bandwidth "
          f"{copy_bw / 1e9:.1f} GB/s; Hkv={Hkv} G={G} seq={seq} top-{K}x{N}")
    print(header("T (dql) [CPU path]", flops=True))
    shapes = [(1, 1), (32, 1), (128, 1)] if device.platform == "cpu" else \
        [(1, 1), (8, 1), (32, 1), (128, 1), (512, 1), (128, 4)]
    # disable=None: no bar when stderr is not a terminal (it would splice into logged tables)
    for T, dql in tqdm(shapes[:2] if quick else shapes, desc="decode", leave=False, disable=None):
        args = decode_case(rng, T, Hkv, G, seq, dql, device)
        ours = jax.jit(lambda *a: m3.sparse_decode(*a, 1.0, 1.0, decode_query_len=dql))
        ref = jax.jit(lambda *a: reference.sparse_decode(*a, 1.0, 1.0, decode_query_len=dql))
        iters = (10 if T <= 32 else 3) if device.platform == "cpu" else 50
        t_ref = median_time(ref, args, max(1, iters // 3))
        nbytes = T * Hkv * K * N * TOKEN_BYTES * 2
        flops = 4 * G * D * K * N * T * Hkv
        for path in cpu_paths(device):
            with cpu_path(path):
                t_ours = median_time(ours, args, iters)
            name = f"{T} ({dql})" + (f" [{path}]" if path else "")
            tqdm.write(row(name, t_ours, t_ref, nbytes, copy_bw, flops))


def bench_prefill(device, quick=False, Hkv=4, G=16):
    rng = np.random.default_rng(1)
    copy_bw = copy_bandwidth(device)
    context = 8192
    sizes = [2048] if device.platform == "cpu" else [2048, 8192]
    print(f"prefill on {device_name(device)}; context {context}; Hkv={Hkv} "
          f"G={G}; flops = 4·G·D per attended key per token and KV head")
    print(header("tokens [CPU path]", flops=True))
    for T in (sizes[:1] if quick else sizes):
        T = 256 if quick else T
        kv_len = context + T
        blocks = -(-kv_len // N)
        cache = fill_cache(rng, m3.KVCacheSpec(Hkv).cache_shape(blocks), device)
        bt = jnp.asarray(rng.permutation(blocks).astype(np.int32)[None])
        pos = np.arange(context, kv_len, dtype=np.int32)
        topk = np.stack([rng.choice(p // N + 1, K, replace=False) for p in np.tile(pos, Hkv)])
        q = jnp.asarray(rng.standard_normal((T, Hkv * G, D)), jnp.bfloat16)
        args = [jax.device_put(a, device) for a in (
            q, cache, jnp.asarray(topk.reshape(Hkv, T, K), jnp.int32), bt,
            jnp.zeros(T, jnp.int32), jnp.asarray(pos))]
        ours = jax.jit(lambda *a: m3.sparse_prefill(*a, 1.0, 1.0))
        ref = jax.jit(lambda *a: reference.sparse_prefill(*a, 1.0, 1.0))
        iters = 1 if device.platform == "cpu" else 20
        t_ref = median_time(ref, args, iters)
        nbytes = T * Hkv * K * N * TOKEN_BYTES * 2
        flops = 4 * G * D * K * N * T * Hkv
        # "shared": each run of 64 tokens selects the same K − 1 earlier blocks plus its own
        # local block, as an indexer's picks mostly are (on the CPU, 8 tokens share each
        # dequantized tile); the reference's cost does not depend on the selection.
        shared = np.stack([np.append(rng.choice(pos[t - t % 64] // N, K - 1, replace=False),
                                     pos[t] // N) for _ in range(Hkv) for t in range(T)])
        shared_args = list(args)
        shared_args[2] = jax.device_put(jnp.asarray(shared.reshape(Hkv, T, K), jnp.int32), device)
        for label, a in (("", args), (" shared", shared_args)):
            for path in cpu_paths(device):
                with cpu_path(path):
                    t_ours = median_time(ours, a, iters)
                tqdm.write(row(f"{T}{label}" + (f" [{path}]" if path else ""), t_ours, t_ref, nbytes,
                               copy_bw, flops))


def bench_pack(device, quick=False, Hkv=4):
    rng = np.random.default_rng(2)
    copy_bw = copy_bandwidth(device)
    print(f"pack on {device_name(device)}; copy bandwidth "
          f"{copy_bw / 1e9:.1f} GB/s; Hkv={Hkv}; GB/s counts bf16 K/V read + NVFP4 bytes written")
    print(header("T"))
    sizes = [128, 4096] if device.platform == "cpu" else [4096, 65536]
    for T in (sizes[:1] if quick else sizes):
        P = 2 * -(-T // N)
        cache = jax.device_put(jnp.zeros(m3.KVCacheSpec(Hkv).cache_shape(P), jnp.uint8), device)
        k = jnp.asarray(rng.standard_normal((T, Hkv, D)), jnp.bfloat16)
        slots = jnp.asarray(rng.choice(P * N, T, replace=False).astype(np.int32))
        args = [cache] + [jax.device_put(a, device) for a in (k, -k, slots)]
        ours = jax.jit(lambda c, *a: m3.pack_kv_pages(c, *a, 1.0, 1.0), donate_argnums=0)
        ref = jax.jit(lambda c, *a: reference.pack_kv_pages(c, *a, 1.0, 1.0), donate_argnums=0)
        iters = 20 if T <= 4096 else 10
        t_ours = median_time(ours, args, iters, donate_first=True)
        args[0] = jax.device_put(jnp.zeros_like(args[0]), device)
        t_ref = median_time(ref, args, iters, donate_first=True)
        nbytes = T * Hkv * 2 * (2 * D + TOKEN_BYTES)
        tqdm.write(row(str(T), t_ours, t_ref, nbytes, copy_bw))


def select_case(rng, T, Hkv, context, pool, device, Di=128, prefill=False, key_dtype=jnp.bfloat16,
                in_use=None):
    """``select_blocks`` operands: T decode rows (one request each, every request at
    ``context`` tokens) or one prefill chunk of T tokens after ``context``; each request's
    pages drawn at random from ``in_use`` random pages of a pool of ``pool`` (default: all of
    them; requests share pages when there are fewer than they need)."""
    R = 1 if prefill else T
    pos = (np.arange(context, context + T) if prefill else np.full(T, context - 1)).astype(np.int32)
    M = int(pos.max()) // N + 1
    used = rng.choice(pool, in_use or pool, replace=False)
    table = np.stack([used[rng.permutation(len(used))[:M]] if len(used) >= M else
                      rng.choice(used, M) for _ in range(R)]).astype(np.int32)
    keys = rng.standard_normal((pool, N, Di)).astype(np.float32)
    q = rng.standard_normal((T, Hkv, Di)).astype(np.float32)
    req = np.zeros(T, np.int32) if prefill else np.arange(T, dtype=np.int32)
    args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(keys, key_dtype), table, req, pos)
    nbytes = (M if prefill else T * M) * N * Di * jnp.dtype(key_dtype).itemsize  # own keys, once
    return [jax.device_put(a, device) for a in args], nbytes


def bench_select(device, quick=False, Hkv=4, Di=128):
    rng = np.random.default_rng(3)
    copy_bw = copy_bandwidth(device)
    print(f"select_blocks on {device_name(device)}; copy bandwidth {copy_bw / 1e9:.1f} GB/s; "
          f"Hkv={Hkv} Di={Di} bf16 keys unless fp8, top-{K}; GB/s counts each request's own keys "
          "once; flops = 2·Di per (token, KV head, visible key)")
    print(header("case [CPU path]", flops=True))
    fp8 = jnp.float8_e4m3fn
    # (name, T, context, pool, prefill, key dtype, pages in use): the first two read the same
    # 8 MB of keys (256 pages shared by the 32 requests) from pools of 256 and 4096 pages, so
    # they differ only in the pool size; the third reads 1024 distinct pages (33.5 MB).
    cases = [("decode 32 @4096, pool 256", 32, 4096, 256, False, jnp.bfloat16, None),
             ("decode 32 @4096, pool 4096 (256 in use)", 32, 4096, 4096, False, jnp.bfloat16, 256),
             ("decode 32 @4096, pool 4096 (1024 in use)", 32, 4096, 4096, False, jnp.bfloat16,
              1024),
             ("decode 32 @4096, pool 4096 (1024), fp8", 32, 4096, 4096, False, fp8, 1024),
             ("prefill 512 after 4096, pool 4096", 512, 4096, 4096, True, jnp.bfloat16, None)]
    ours = jax.jit(lambda *a: m3.select_blocks(*a, topk_blocks=K))
    ref = jax.jit(lambda *a: reference.select_blocks(*a, topk_blocks=K))
    for name, T, context, pool, prefill, kd, in_use in tqdm(
            cases[:1] if quick else cases, desc="select", leave=False, disable=None):
        args, nbytes = select_case(rng, T, Hkv, context, pool, device, Di, prefill, kd, in_use)
        visible = int(np.sum(np.asarray(args[4]) + 1))
        flops = 2 * Di * Hkv * visible
        t_ref = median_time(ref, args, 3)
        for path in cpu_paths(device):
            with cpu_path(path):
                t_ours = median_time(ours, args, 20)
            tqdm.write(row(name + (f" [{path}]" if path else ""), t_ours, t_ref, nbytes, copy_bw,
                           flops))
    # Writing the step's index keys first (write_index_keys, SPEC §8.1): in place, O(keys),
    # against the reference's scatter (on the CPU, XLA converts the whole bf16 cache per call).
    tqdm.write("write_index_keys rows: the cache donated; GB/s counts the key bytes written "
               "(no FLOPs)")
    for kd in (jnp.bfloat16, fp8):
        T, pool = 32, (256 if quick else 4096)
        cache = jax.device_put(jnp.zeros((2, pool, N, Di), kd), device)
        keys = jax.device_put(jnp.asarray(rng.standard_normal((T, Di)), jnp.float32), device)
        slots = jax.device_put(jnp.asarray(rng.choice(pool * N, T, replace=False), jnp.int32),
                               device)
        args = [cache, keys, slots]
        t = []
        for fn in (lambda c, k, s_: m3.write_index_keys(c, k, s_, layer=jnp.int32(1)),
                   lambda c, k, s_: reference.write_index_keys(c, k, s_, 1)):
            args[0] = jax.device_put(jnp.zeros_like(args[0]), device)
            t.append(median_time(jax.jit(fn, donate_argnums=0), args, 10, donate_first=True))
        tqdm.write(row(f"write_index_keys {T} keys, pool {pool}, {jnp.dtype(kd).name}", *t,
                       T * Di * jnp.dtype(kd).itemsize, copy_bw))


def bench_grouped(device, quick=False):
    """grouped_matmul (SPEC §9) against the reference lowering (one product per group, rows
    selected: G× the routed FLOPs) and against one XLA dot of the routed FLOPs; bf16 rows,
    bf16 / MXFP8 / MXFP4 weights; the rows routed at random over G experts (a multinomial draw:
    some groups may be empty — the row says how many are routed). GB/s counts the routed
    groups' weights once (what the kernel must read); GFLOP/s the routed products."""
    rng = np.random.default_rng(5)
    copy_bw = copy_bandwidth(device)
    print(f"grouped_matmul on {device_name(device)}; copy bandwidth {copy_bw / 1e9:.1f} GB/s; "
          "'XLA dot' is one [M, K] × [K, N] product of the routed FLOPs")
    head = header("rows M × K × N, G groups, weights", flops=True).splitlines()[0]
    head += " | XLA dot (µs)"
    print(head + "\n" + "-" * len(head))
    # (M, K, N, G): a decode MoE of 8 rows, a 64-row one, a prefill chunk's rows
    cases = [(8, 1024, 256, 8), (64, 1024, 256, 16), (512, 1024, 256, 16)]
    for M, Kd, Nd, G in tqdm(cases[:1] if quick else cases, desc="grouped", leave=False,
                             disable=None):
        lhs = jnp.asarray(rng.standard_normal((M, Kd)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((G, Nd, Kd)), jnp.float32)
        sizes = jnp.asarray(rng.multinomial(M, np.ones(G) / G), jnp.int32)
        dot = jax.jit(lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.float32))
        t_dot = median_time(dot, [jax.device_put(a, device) for a in (lhs, w[0].astype(
            jnp.bfloat16))], 10)
        routed = int(np.count_nonzero(np.asarray(sizes)))
        for fmt, (rhs, scale) in (("bf16", (w.astype(jnp.bfloat16), None)),
                                  ("mxfp8", m3.mxfp8_quantize(w)), ("mxfp4", m3.mxfp4_quantize(w))):
            args = [jax.device_put(a, device) for a in (lhs, rhs, sizes)]
            kw = {} if scale is None else {"rhs_scale": jax.device_put(scale, device)}
            ours = jax.jit(lambda a, b, s: m3.grouped_matmul(a, b, s, **kw))
            ref = jax.jit(lambda a, b, s: reference.grouped_matmul(a, b, s, **kw))
            t_ours, t_ref = median_time(ours, args, 10), median_time(ref, args, 5)
            nbytes = routed * rhs[0].size * rhs.dtype.itemsize
            tqdm.write(row(f"{M} × {Kd} × {Nd}, G {G} ({routed} routed), {fmt}", t_ours, t_ref,
                           nbytes, copy_bw,
                           2 * M * Kd * Nd) + f" | {t_dot * 1e6:10.1f}")
