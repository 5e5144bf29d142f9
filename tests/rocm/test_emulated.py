"""Every exported gfx950 kernel, executed on tinygrad's CDNA emulator, against the CPU backend.

gfx950: executed in CI on an ISA emulator (tinygrad's CDNA emulator plus our fixes, emu_fixes.py);
never on hardware. The code objects are the ones the build links (conftest's `exported`), launched
as ffi/rocm/handlers.cc launches them (emu_launch.Handlers). Bars: pack byte-identical to the CPU
backend (SPEC §2.2 is exact); positions exact; attention SPEC §6 GPU bars (cosine >= 0.99,
rel-F <= 0.06), exact zeros wherever the CPU gives a zero row, and no NaN anywhere (outputs start
as NaN, so a row the kernels never wrote fails).

The emulator is slow (~0.4 s per decode workgroup; the first launch of a kernel compiles its
instructions), so grids are small: few tokens, Hkv 1-2, and each case covers several variants.
Skips when the emulator (M3SPARSE_TINYGRAD or ../shared/emulator/tinygrad) or clang is absent.
Set M3SPARSE_EMULATED_TABLE=path to write the (kernel, case, result, seconds) table.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_m3sparse as m3
import oracle
from attention_problems import decode_problem, prefill_problem
from tools.rocm import emu_launch

pytestmark = pytest.mark.skipif(emu_launch.emulator_missing() is not None,
                                reason=emu_launch.emulator_missing() or "")

COS, RELF = 0.99, 0.06      # SPEC §6, GPU paths
SCALE = 1 / np.sqrt(128)
INT32_MIN, INT32_MAX = np.iinfo(np.int32).min, np.iinfo(np.int32).max
RESULTS: list[tuple[str, str, str, float]] = []


@pytest.fixture(scope="module")
def gpu(exported):
    """The handlers over the exported code objects (one CodeObject per module, loaded once)."""
    loaded = {}

    def modules(name):
        if name not in loaded:
            k = exported[name]
            loaded[name] = emu_launch.CodeObject(k.code_object, k.notes)
        return loaded[name]

    yield emu_launch.Handlers(modules)
    path = os.environ.get("M3SPARSE_EMULATED_TABLE")
    if path:
        with open(path, "w") as f:
            f.write("| kernel | case | result | seconds |\n|---|---|---|---|\n")
            for row in RESULTS:
                f.write("| {} | {} | {} | {:.1f} |\n".format(*row))


def timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0


def metrics(got, want):
    got, want = np.asarray(got, np.float64).ravel(), np.asarray(want, np.float64).ravel()
    cos = got @ want / (np.linalg.norm(got) * np.linalg.norm(want) + 1e-300)
    return cos, np.linalg.norm(got - want) / (np.linalg.norm(want) + 1e-300)


def check_attention(kernel, case, got, want, seconds):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert not np.isnan(got).any(), f"{kernel} {case}: NaN in the output (unwritten or leaked)"
    zero_rows = ~np.any(want != 0, axis=-1)
    assert (got[zero_rows] == 0).all(), f"{kernel} {case}: rows with nothing attended must be exact zeros"
    if zero_rows.all():                 # nothing attended anywhere (a bad layer): all exact zeros
        RESULTS.append((kernel, case, "all exact zeros", seconds))
        return
    cos, relf = metrics(got, want)
    RESULTS.append((kernel, case, f"cos {cos:.5f}, rel-F {relf:.4f}", seconds))
    assert cos >= COS and relf <= RELF, f"{kernel} {case}: cosine {cos:.6f}, rel-F {relf:.4f}"


def poison(p, layout):
    """Garbage the kernels must ignore (SPEC §5.2, §7): INT32_MIN/MAX ids and a block_table entry
    equal to P beside the -1 / 10^6 / max_blocks ids attention_problems already leaves in the tails."""
    p.topk[0, 0, -1] = INT32_MIN
    p.topk[-1, -1, -2] = INT32_MAX
    p.block_table[-1, -1] = emu_launch.Geometry.of(p.cache, layout).num_pages     # >= P: skipped
    return p


# ---- pack ------------------------------------------------------------------------------------
HKV = 2


def pack_inputs(rng, T, dtype):
    k = (rng.standard_normal((T, HKV, 128)) * rng.uniform(0.1, 8.0, (T, HKV, 1))).astype(np.float32)
    v = rng.standard_normal((T, HKV, 128)).astype(np.float32)
    k[0, 0, 3] = np.nan
    k[1, 1, 17] = np.inf
    v[2, 0, 100] = -np.inf
    k[3, 0, :16] = 0.0
    v[5, 1, 16:32] = 0.0
    return np.asarray(jnp.asarray(k, dtype)), np.asarray(jnp.asarray(v, dtype))


@pytest.mark.parametrize("dtype,layout,layer", [
    (jnp.bfloat16, None, 0), (jnp.bfloat16, "LBHNC", 1), (jnp.float16, "BLHNC", 2), (jnp.float32, "BLHNC", 0),
    (jnp.bfloat16, "BLHNC", 3),             # layer out of range: writes nothing
])
def test_pack_byte_identical(gpu, rng, dtype, layout, layer):
    P, L, T = 3, 3, 10
    spec = m3.KVCacheSpec(num_kv_heads=HKV)
    cache0 = rng.integers(0, 256, spec.cache_shape(P, L if layout else None, layout or "LBHNC"), np.uint8)
    k, v = pack_inputs(rng, T, dtype)
    slots = rng.permutation(P * 128)[:T].astype(np.int32)
    slots[6], slots[7], slots[8] = -1, P * 128, INT32_MAX            # padding / out of range
    kw = {} if layout is None else dict(layout=layout, layer=jnp.int32(layer))
    want = np.asarray(m3.pack_kv_pages(jnp.asarray(cache0), k, v, jnp.asarray(slots), jnp.float32(0.37),
                                       jnp.float32(1.0), **kw))
    got, sec = timed(gpu.pack_kv_pages, cache0.copy(), k, v, slots, 0.37, 1.0, layer, layout)
    name = f"pack_kv_pages_{emu_launch.io_name(k.dtype)}"
    RESULTS.append((name, f"T={T} {layout or '4-D'} layer {layer}", "byte-identical"
                    if np.array_equal(got, want) else "DIFFERENT", sec))
    assert np.array_equal(got, want)
    if layer >= L:
        assert np.array_equal(got, cache0), "a layer out of range writes nothing"


def test_pack_bad_global_scale(gpu, rng):
    spec = m3.KVCacheSpec(num_kv_heads=HKV)
    cache0 = rng.integers(0, 256, spec.cache_shape(1), np.uint8)
    k, v = pack_inputs(rng, 6, jnp.bfloat16)
    slots = np.arange(6, dtype=np.int32)
    want = np.asarray(m3.pack_kv_pages(jnp.asarray(cache0), k, v, jnp.asarray(slots), jnp.float32(0.0),
                                       jnp.float32(-1.0)))
    got, sec = timed(gpu.pack_kv_pages, cache0.copy(), k, v, slots, 0.0, -1.0)
    RESULTS.append(("pack_kv_pages_bf16", "g = 0 / -1 (NaN groups)", "byte-identical"
                    if np.array_equal(got, want) else "DIFFERENT", sec))
    assert np.array_equal(got, want)


# ---- positions ---------------------------------------------------------------------------------
def test_query_token_positions_exact(gpu):
    cu = np.array([0, 3, 3, 10, 11, 11, 70], np.int32)           # zero-length requests 1 and 4
    ctx = np.array([5, 0, 128, 7, 9, 1000], np.int32)
    T = 75                                                       # padding past cu[R] = 70
    want = [np.asarray(a) for a in m3.query_token_positions(jnp.asarray(cu), jnp.asarray(ctx), T)]
    (rid, pos), sec = timed(gpu.query_token_positions, cu, ctx, T)
    RESULTS.append(("query_token_positions", f"R=6 (2 empty), T={T}", "exact"
                    if np.array_equal(rid, want[0]) and np.array_equal(pos, want[1]) else "DIFFERENT", sec))
    np.testing.assert_array_equal(rid, want[0])
    np.testing.assert_array_equal(pos, want[1])
    assert (rid[70:] == -1).all() and (pos[70:] == -1).all()


# ---- decode --------------------------------------------------------------------------------------
def cpu_decode(p, layer=0, layout=None):
    kw = {} if layout is None else dict(layout=layout, layer=jnp.int32(layer))
    return np.asarray(m3.sparse_decode(jnp.asarray(p.q), p.cache, p.topk, p.block_table, p.seq_lens, p.k_scale,
                                       p.v_scale, decode_query_len=p.dql, scale=SCALE, **kw), np.float64)


# (G, dtype, Hkv, seq_lens, dql, split, layout, layer): each row a few workgroups; together they
# cover every decode module (plain, split and union, 3 dtypes, G 16 and 8), Hkv 1 and 2, dql 1/2/3/4,
# seq 1/127/128/129 and a few blocks, padding requests, LBHNC/BLHNC with a layer, a bad layer.
DECODE_CASES = [
    (16, jnp.bfloat16, 2, [129, 300], 2, None, None, 0),       # dql > 1: the union kernel
    (16, jnp.bfloat16, 1, [1, 127, 128, 129], 1, None, None, 0),
    (16, jnp.float16, 1, [0, 260], 1, False, "LBHNC", 1),
    (16, jnp.float16, 1, [4, 385], 4, None, "BLHNC", 2),
    (16, jnp.float16, 1, [4, 385], 1, True, "BLHNC", 2),
    (16, jnp.float32, 1, [640], 1, False, None, 0),
    (16, jnp.float32, 2, [200], 1, True, "LBHNC", 5),        # layer out of range: zeros
    (16, jnp.float32, 1, [0, 131, 700], 3, None, None, 0),   # union: 9 rows, 3 requests, one padded
    (8, jnp.bfloat16, 2, [129, 300], 2, None, "BLHNC", 1),
    (8, jnp.bfloat16, 1, [1, 128, 257], 1, None, None, 0),
    (8, jnp.float16, 1, [0, 500], 1, False, None, 0),
    (8, jnp.float16, 2, [140], 1, True, None, 0),
    (8, jnp.float16, 1, [300, 5], 4, None, "LBHNC", 0),
    (8, jnp.float32, 1, [131], 1, False, None, 0),
    (8, jnp.float32, 1, [77, 1000], 2, None, "LBHNC", 0),
    (8, jnp.float32, 1, [77, 1000], 1, True, "LBHNC", 0),
]


@pytest.mark.parametrize("G,dtype,hkv,seq_lens,dql,split,layout,layer", DECODE_CASES)
def test_decode(gpu, rng, G, dtype, hkv, seq_lens, dql, split, layout, layer):
    num_layers = None if layout is None else 3
    p = poison(decode_problem(rng, hkv, G, seq_lens, dql, dtype=dtype, extra_pages=1, num_layers=num_layers,
                              layout=layout or "LBHNC", layer=min(layer, 2), fill_layers=False), layout)
    want = cpu_decode(p, layer, layout)
    q = np.asarray(p.q)
    got, sec = timed(gpu.sparse_decode, q, p.cache, p.topk, p.block_table, p.seq_lens, p.k_scale, p.v_scale,
                     layer, SCALE, dql, layout=layout, split=split, group=G)
    kind = emu_launch.Handlers.decode_kernel(q.shape[0], hkv, dql, split)
    infix = {"plain": "", "split": "_split", "union": "_union"}[kind]
    kernel = f"sparse_decode{infix}{'_g8' if G == 8 else ''}_{emu_launch.io_name(q.dtype)}"
    case = f"Hkv={hkv} seq={seq_lens} dql={dql} {layout or '4-D'}" + (f" layer {layer}" if layout else "")
    check_attention(kernel, case, got, want, sec)
    if layout is not None and layer >= num_layers:
        assert (got == 0).all()


def test_decode_split_and_plain_agree(gpu, rng):
    """The split kernel + merge and the one-pass kernel on the same problem (same bf16 products,
    a different merge order): within the GPU bars of each other, the same exact zeros."""
    p = poison(decode_problem(rng, 1, 16, [0, 129, 400], 1, dtype=jnp.bfloat16, extra_pages=1), None)
    args = (np.asarray(p.q), p.cache, p.topk, p.block_table, p.seq_lens, p.k_scale, p.v_scale, 0, SCALE, 1)
    plain, sec = timed(gpu.sparse_decode, *args, split=False)
    split = gpu.sparse_decode(*args, split=True)
    check_attention("sparse_decode_split_bf16", "vs one-pass, seq=[0, 129, 400]", split, plain, sec)


# ---- prefill ----------------------------------------------------------------------------------
PREFILL_CASES = [   # (G, dtype, hkv, q_lens, kv_lens, pad, layout, layer)
    (16, jnp.float16, 1, (3, 2), (130, 260), 2, None, 0),
    (16, jnp.bfloat16, 2, (2,), (129,), 1, "BLHNC", 1),
    (16, jnp.float32, 1, (1, 2), (1, 300), 1, "LBHNC", 2),
    (8, jnp.float16, 2, (2, 1), (128, 257), 1, None, 0),
    (8, jnp.bfloat16, 1, (3,), (200,), 2, "LBHNC", 1),
    (8, jnp.float32, 1, (1,), (700,), 1, None, 0),
]


@pytest.mark.parametrize("G,dtype,hkv,q_lens,kv_lens,pad,layout,layer", PREFILL_CASES)
def test_prefill(gpu, rng, G, dtype, hkv, q_lens, kv_lens, pad, layout, layer):
    num_layers = None if layout is None else 3
    p = poison(prefill_problem(rng, hkv, G, q_lens, kv_lens, pad=pad, dtype=dtype, extra_pages=1,
                               num_layers=num_layers, layout=layout or "LBHNC", layer=layer, fill_layers=False), layout)
    kw = {} if layout is None else dict(layout=layout, layer=jnp.int32(layer))
    want = np.asarray(m3.sparse_prefill(jnp.asarray(p.q), p.cache, p.topk, p.block_table, p.req, p.pos, p.k_scale,
                                        p.v_scale, scale=SCALE, **kw), np.float64)
    q = np.asarray(p.q)
    got, sec = timed(gpu.sparse_prefill, q, p.cache, p.topk, p.block_table, p.req, p.pos, p.k_scale, p.v_scale,
                     layer, SCALE, layout=layout, group=G)
    kernel = f"sparse_prefill{'_g8' if G == 8 else ''}_{emu_launch.io_name(q.dtype)}"
    check_attention(kernel, f"Hkv={hkv} q={q_lens} kv={kv_lens} pad={pad} {layout or '4-D'}", got, want, sec)
    assert (np.asarray(got)[-pad:] == 0).all(), "padding rows are exact zeros"


# ---- union tiles: what they read, and a row's bits whatever its tile-mates ----------------------
@pytest.mark.parametrize("G", [16, 8])
def test_union_prefill_reads_each_tile_union_once(gpu, rng, G):
    """Counted on the emulator (emu_traffic): the union-tile prefill reads K/V bytes equal to the sum
    over tiles (16 rows; 32 for G = 8) of each tile's distinct valid (request, block) pairs, 18432
    bytes each, and issues 128 MFMAs per (wave, union entry) its rows selected, plus 64 for G = 8
    where a row of the wave stops short of the entry's staged keys (its own masked V pass); the
    per-token kernel on the same rows would read each token's valid slots (a larger sum here).
    Two requests share a tile."""
    from tools.rocm import emu_traffic
    p = prefill_problem(rng, 1, G, (24, 9), (3000, 2100), pad=3, dtype=jnp.float16, extra_pages=1)
    Hkv, T, _ = p.topk.shape
    M, P = p.block_table.shape[1], p.cache.shape[0]
    # neighbours select alike: a request's tokens share 13 of 16 blocks with the one before
    for t in range(1, T):
        if p.req[t] == p.req[t - 1] >= 0 and p.pos[t] // 128 == p.pos[t - 1] // 128:
            p.topk[:, t, :13] = p.topk[:, t - 1, :13]
    valid = lambda t: set() if t >= T else {(p.req[t], int(b)) for b in p.topk[0, t] if p.req[t] >= 0 and 0 <= b < M
                                            and 128 * b <= p.pos[t] and 0 <= p.block_table[p.req[t], b] < P}
    tile, union, mfma = 16 * (16 // G), 0, 0
    per_wave = tile // 8
    for t0 in range(0, T, tile):
        rows = [valid(t) for t in range(t0, t0 + tile)]
        entries = set().union(*rows)
        union += len(entries)
        for key in entries:
            lim = [min(128, p.pos[t0 + i] + 1 - 128 * key[1]) if key in rows[i] else 0 for i in range(tile)]
            for w in range(0, tile, per_wave):
                if any(key in rows[i] for i in range(w, w + per_wave)):
                    mfma += 128 + (64 if G == 8 and min(lim[w:w + per_wave]) < max(lim) else 0)
    per_token = sum(len(valid(t)) for t in range(T))
    q = np.asarray(p.q)
    with emu_traffic.counting({"kv_cache": p.cache, "q": q}) as c:
        gpu.sparse_prefill(q, p.cache, p.topk, p.block_table, p.req, p.pos, p.k_scale, p.v_scale, 0, SCALE, group=G)
    assert c.read["kv_cache"] == union * 18432
    assert c.mfma == mfma
    assert c.read["q"] == q.nbytes
    assert union < per_token / 3
    RESULTS.append((f"sparse_prefill{'_g8' if G == 8 else ''}_f16", f"traffic T={T}",
                    f"K/V {union} blocks (per-token {per_token})", 0.0))


def test_union_row_bits_do_not_depend_on_tile_mates(gpu, rng):
    """A token computed alone (T = 1) and inside a 16-token tile whose other rows select other
    blocks, in both the prefill and the dql > 1 decode kernel: the same bits."""
    for G in (16, 8):       # G = 8: two rows share an MFMA's columns; alone, a row has no partner
        p = prefill_problem(rng, 1, G, (12, 7), (900, 1300), pad=1, dtype=jnp.bfloat16, extra_pages=1)
        q = np.asarray(p.q)
        full = gpu.sparse_prefill(q, p.cache, p.topk, p.block_table, p.req, p.pos, p.k_scale, p.v_scale, 0, SCALE,
                                  group=G)
        for t in (0, 5, 13, 18):
            one = gpu.sparse_prefill(q[t:t + 1], p.cache, np.ascontiguousarray(p.topk[:, t:t + 1]), p.block_table,
                                     p.req[t:t + 1], p.pos[t:t + 1], p.k_scale, p.v_scale, 0, SCALE, group=G)
            assert np.array_equal(one.view(np.uint16), full[t:t + 1].view(np.uint16)), f"G {G} prefill token {t}"
    d = decode_problem(rng, 1, 8, [300, 77, 1000, 5], 4, dtype=jnp.bfloat16, extra_pages=1)
    dq = np.asarray(d.q)
    full = gpu.sparse_decode(dq, d.cache, d.topk, d.block_table, d.seq_lens, d.k_scale, d.v_scale, 0, SCALE, 4,
                             group=8)
    for r in (0, 2):
        rows = slice(4 * r, 4 * r + 4)
        one = gpu.sparse_decode(dq[rows], d.cache, np.ascontiguousarray(d.topk[:, rows]), d.block_table[r:r + 1],
                                d.seq_lens[r:r + 1], d.k_scale, d.v_scale, 0, SCALE, 4, group=8)
        assert np.array_equal(one.view(np.uint16), full[rows].view(np.uint16)), f"decode request {r}"


# ---- full attention (SPEC §5.7): parts of 16 blocks folded in part order -----------------------
def full_problem(rng, G, dtype, hkv, q_lens, kv_lens, layout=None, layer=0):
    """Prefill rows of `q_lens` tokens per request plus 3 padding rows (request -1, request R, position
    -1); invalid block_table entries inside request 0's visible blocks (-1, INT32_MIN, P) beside the
    tail entries (-1, and P from `poison`)."""
    num_layers = None if layout is None else 3
    p = poison(prefill_problem(rng, hkv, G, q_lens, kv_lens, pad=3, dtype=dtype, extra_pages=1,
                               num_layers=num_layers, layout=layout or "LBHNC", layer=min(layer, 2),
                               fill_layers=False), layout)
    p.req[-3:], p.pos[-3:] = [-1, len(kv_lens), 0], [5, 5, -1]
    P = emu_launch.Geometry.of(p.cache, layout).num_pages
    for b, bad in ((3, -1), (17, INT32_MIN), (20, P)):
        if b < -(-kv_lens[0] // 128) - 1:
            p.block_table[0, b] = bad
    return p


def cpu_full(p, layer=0, layout=None):
    kw = {} if layout is None else dict(layout=layout, layer=jnp.int32(layer))
    return np.asarray(m3.full_attention(jnp.asarray(p.q), p.cache, p.block_table, p.req, p.pos, p.k_scale,
                                        p.v_scale, scale=SCALE, **kw), np.float64)


def full_parts(p):
    """Each row's parts of 16 blocks holding a key at or before its position (0 for padding)."""
    R, M = p.block_table.shape
    return [0 if not (0 <= r < R and pos >= 0) else min(pos // 2048 + 1, -(-M // 16)) for r, pos in zip(p.req, p.pos)]


FULL_CASES = [      # (G, dtype, hkv, q_lens, kv_lens, layout, layer): together every full_attention module
    (16, jnp.bfloat16, 1, (2, 1), (5200, 300), None, 0),     # 41 blocks: 3 parts, the last partial
    (16, jnp.float16, 2, (1,), (2100,), "BLHNC", 1),         # 17 blocks: part 1 holds one
    (16, jnp.float32, 1, (1, 1), (129, 3000), "LBHNC", 2),
    (16, jnp.bfloat16, 1, (1,), (300,), "LBHNC", 5),         # layer out of range: zeros
    (8, jnp.bfloat16, 2, (2,), (4200,), None, 0),
    (8, jnp.float16, 1, (1, 2), (700, 2049), "LBHNC", 1),    # position 2048: the first key of part 1
    (8, jnp.float32, 1, (1,), (4500,), None, 0),
]


@pytest.mark.parametrize("G,dtype,hkv,q_lens,kv_lens,layout,layer", FULL_CASES)
def test_full_attention(gpu, rng, G, dtype, hkv, q_lens, kv_lens, layout, layer):
    p = full_problem(rng, G, dtype, hkv, q_lens, kv_lens, layout, layer)
    want = cpu_full(p, layer, layout)
    q = np.asarray(p.q)
    got, sec = timed(gpu.full_attention, q, p.cache, p.block_table, p.req, p.pos, p.k_scale, p.v_scale, layer,
                     SCALE, layout=layout, group=G)
    kernel = f"full_attention{'_g8' if G == 8 else ''}_{emu_launch.io_name(q.dtype)}"
    parts = max(full_parts(p))
    case = f"Hkv={hkv} q={q_lens} kv={kv_lens} ({parts} parts) pad=3 {layout or '4-D'}" + \
        (f" layer {layer}" if layout else "")
    check_attention(kernel, case, got, want, sec)
    assert (got[-3:] == 0).all(), "padding rows are exact zeros"
    if layout is not None and layer >= 3:
        assert (got == 0).all()


@pytest.mark.parametrize("G", [16, 8])
def test_full_attention_row_bits_do_not_depend_on_the_batch(gpu, rng, G):
    """A row alone (T = 1) and inside the batch, and the batch launched in chunks of 2 rows (the
    handler's chunking, with a bound of 2·parts states): the same bits."""
    p = full_problem(rng, G, jnp.bfloat16, 1, (2, 1), (2500, 300))
    q = np.asarray(p.q)
    args = (p.cache, p.block_table)
    full = gpu.full_attention(q, *args, p.req, p.pos, p.k_scale, p.v_scale, 0, SCALE, group=G)
    parts = -(-p.block_table.shape[1] // 16)
    chunked = gpu.full_attention(q, *args, p.req, p.pos, p.k_scale, p.v_scale, 0, SCALE, group=G,
                                 max_states=2 * parts)
    assert np.array_equal(chunked.view(np.uint16), full.view(np.uint16))
    for t in (0, 1, 2):
        one = gpu.full_attention(q[t:t + 1], *args, p.req[t:t + 1], p.pos[t:t + 1], p.k_scale, p.v_scale, 0, SCALE,
                                 group=G)
        assert np.array_equal(one.view(np.uint16), full[t:t + 1].view(np.uint16)), f"G {G} row {t}"


def test_full_attention_reads_each_rows_pages_once_per_kv_head(gpu, rng):
    """Counted on the emulator (emu_traffic): K/V bytes read = for each row and KV head, its visible
    blocks with a valid page once (18432 bytes each: K and V tiles); a decode row (one row per
    request) reads its request's visible pages once per KV head. Parts past a row's position and
    padding rows issue nothing: 1024 MFMAs (4 waves × 4 blocks × 64) per (row, KV head, visible part)."""
    from tools.rocm import emu_traffic
    p = full_problem(rng, 16, jnp.bfloat16, 2, (1, 1, 1, 3), (5200, 300, 1, 2200))
    R, M = p.block_table.shape
    P = emu_launch.Geometry.of(p.cache, None).num_pages
    hkv = p.cache.shape[-3] // 2
    blocks = [0 if not (0 <= r < R and pos >= 0) else
              sum(0 <= p.block_table[r, b] < P for b in range(min(pos // 128 + 1, M))) for r, pos in zip(p.req, p.pos)]
    q = np.asarray(p.q)
    with emu_traffic.counting({"kv_cache": p.cache, "q": q}) as c:
        gpu.full_attention(q, p.cache, p.block_table, p.req, p.pos, p.k_scale, p.v_scale, 0, SCALE)
    assert c.read["kv_cache"] == hkv * sum(blocks) * 18432
    assert c.mfma == 1024 * hkv * sum(full_parts(p))
    RESULTS.append(("full_attention_bf16", f"traffic T={len(p.req)} Hkv={hkv}",
                    f"K/V {hkv * sum(blocks)} blocks = each row's visible valid blocks once per KV head", 0.0))


# ---- select_blocks (SPEC §8): the indexer's block selection --------------------------------------
def brute_select(q, keys, bt, req, pos, layer, K, local):
    """SPEC §8 written out row by row in float64 (exact for the small-integer data used here)."""
    keys = keys if keys.ndim == 4 else keys[None]
    L, P, N, _ = keys.shape
    R, M = bt.shape
    T, H, _ = q.shape
    out = np.full((H, T, K), -1, np.int32)
    qf, kf = np.asarray(q, np.float64), np.asarray(keys, np.float64)
    for t in range(T):
        r, p = int(req[t]), int(pos[t])
        if not (0 <= r < R and p >= 0 and 0 <= layer < L):
            continue
        own = p // N
        cands = range(min(own, M - 1) + 1)
        loc = [b for b in cands if b > own - local]
        for h in range(H):
            scored = []
            for b in cands:
                page = int(bt[r, b])
                if b in loc or not 0 <= page < P:
                    continue
                with np.errstate(invalid="ignore"):
                    dots = kf[layer, page, :min(N, p - b * N + 1)] @ qf[t, h]
                dots = dots[~np.isnan(dots)]
                if dots.size and np.isfinite(dots.max()):
                    scored.append((-dots.max(), b))
            ids = loc + [b for _, b in sorted(scored)]
            out[h, t, :min(K, len(ids))] = ids[:K]
    return out


def select_case(rng, dtype_q, dtype_k, T_req, *, P=12, M=5, L=None, hkv=2, integer=True):
    """Requests' rows consecutive (T_req: [(rows, first pos)] per request), pages shuffled."""
    R = len(T_req)
    shape = (P, 128, 128) if L is None else (L, P, 128, 128)
    if integer:     # small integers: every dot product is exact, so block scores tie often and exactly
        keys = rng.integers(-3, 4, shape).astype(np.float32)
        q = rng.integers(-2, 3, (sum(n for n, _ in T_req), hkv, 128)).astype(np.float32)
    else:
        keys = rng.standard_normal(shape).astype(np.float32)
        q = rng.standard_normal((sum(n for n, _ in T_req), hkv, 128)).astype(np.float32)
    bt = np.stack([rng.permutation(P)[:M] for _ in range(R)]).astype(np.int32)
    req = np.concatenate([np.full(n, r) for r, (n, _) in enumerate(T_req)]).astype(np.int32)
    pos = np.concatenate([p0 + np.arange(n) for n, p0 in T_req]).astype(np.int32)
    return np.array(jnp.asarray(q, dtype_q)), np.array(jnp.asarray(keys, dtype_k)), bt, req, pos


def check_select(kernel, case, got, q, keys, bt, req, pos, layer, K, local, sec, brute=True):
    kw = {} if keys.ndim == 3 else {"layer": jnp.int32(layer)}
    want = np.asarray(ref_select(q, keys, bt, req, pos, topk_blocks=K, local_blocks=local, **kw))
    same = np.array_equal(got, want)
    RESULTS.append((kernel, case, "identical to the reference" if same else "DIFFERENT", sec))
    assert same, f"{kernel} {case}: rows differ at {np.argwhere(got != want)[:8].tolist()}"
    if brute:
        assert np.array_equal(got, brute_select(q, keys, bt, req, pos, layer, K, local))


def ref_select(*args, **kw):
    from jax_m3sparse import reference
    return reference.select_blocks(*args, **kw)


def test_select_blocks_adversarial(gpu, rng):
    """bf16 q and keys, 3-D cache, integer data (exact ties everywhere), Hkv 2, K 5, local 1:
    MTP rows and a prefill chunk, padding rows (req -1, R, INT32_MAX; pos -1), invalid pages
    (-1, P, INT32_MIN: never read), a position past the table (pos // N >= M), block boundaries
    (pos 127, 128, 255, 256), a NaN key, two blocks with identical keys (a tie whatever the order)."""
    q, keys, bt, req, pos = select_case(rng, jnp.bfloat16, jnp.bfloat16, [(3, 254), (4, 126), (2, 700), (1, 0)])
    P = keys.shape[0]
    bt[0, 1], bt[1, 0], bt[2, 3] = -1, P, np.iinfo(np.int32).min
    keys[bt[2, 1]] = keys[bt[2, 2]]                         # blocks 1 and 2 of request 2 tie exactly
    keys[bt[0, 2], 5] = np.nan                              # one NaN key (its dot is -inf)
    keys[bt[3, 0]] = np.nan                                 # request 3's only block: all NaN (local anyway)
    pad = dict(req=[-1, 4, INT32_MAX, 1], pos=[10, 10, 10, -1])
    q = np.concatenate([q, q[:4]])
    req = np.concatenate([req, np.array(pad["req"], np.int32)])
    pos = np.concatenate([pos, np.array(pad["pos"], np.int32)])
    got, sec = timed(gpu.select_blocks, q, keys, bt, req, pos, 0, 5, 1)
    check_select("select_blocks_bf16_bf16", f"T={len(req)} R=4 K=5 ties/padding/invalid pages", got,
                 q, keys, bt, req, pos, 0, 5, 1, sec)
    assert (got[:, -4:] == -1).all()
    # a row alone gives the same ids as in the batch (SPEC §8 step 6)
    for t in (1, 5, 9):
        one = gpu.select_blocks(q[t:t + 1], keys, bt, req[t:t + 1], pos[t:t + 1], 0, 5, 1)
        assert np.array_equal(one[:, 0], got[:, t]), f"row {t} alone"


@pytest.mark.parametrize("dtype_q,dtype_k,layer,K,local,integer", [
    (jnp.float32, jnp.bfloat16, 1, 8, 2, False),    # generic floats (no ties), K above the blocks so far
    (jnp.bfloat16, jnp.float8_e4m3fn, 0, 3, 1, True),
    (jnp.float32, jnp.float8_e4m3fn, 1, 4, 2, True),
    (jnp.bfloat16, jnp.bfloat16, 2, 4, 1, True),       # layer out of range: every row -1
])
def test_select_blocks_variants(gpu, rng, dtype_q, dtype_k, layer, K, local, integer):
    q, keys, bt, req, pos = select_case(rng, dtype_q, dtype_k, [(2, 300), (3, 500)], P=8, L=2, hkv=1,
                                        integer=integer)
    if integer and keys.dtype.itemsize == 1:
        keys.view(np.uint8)[0, bt[1, 1], 7, 3] = 0x7F       # an E4M3 NaN
    got, sec = timed(gpu.select_blocks, q, keys, bt, req, pos, layer, K, local)
    kernel = f"select_blocks_{emu_launch.io_name(q.dtype)}_{'fp8' if keys.dtype.itemsize == 1 else 'bf16'}"
    check_select(kernel, f"4-D layer {layer} K={K} local={local}", got, q, keys, bt, req, pos, layer, K, local,
                 sec, brute=integer)
    if layer >= keys.shape[0]:
        assert (got == -1).all()


@pytest.mark.parametrize("integer", [True, False])
def test_select_blocks_long_run_on_four_waves(gpu, rng, integer):
    """A run of 41 rows (a prefill chunk: the score workgroup's 4 waves share it, rows dealt
    round robin, keys staged in LDS) beside runs of 3 and 1 rows (one wave each, in turn), the
    long run's rows spanning a block boundary with 4 candidate blocks ranked for K = 3 — so every
    row's scores decide its ids. Against the reference and, for integer data, SPEC §8 brute
    force; a row of the long run alone gives the same ids."""
    q, keys, bt, req, pos = select_case(rng, jnp.bfloat16, jnp.bfloat16, [(3, 300), (41, 620), (1, 50)],
                                        P=12, M=6, hkv=2, integer=integer)
    got, sec = timed(gpu.select_blocks, q, keys, bt, req, pos, 0, 3, 1)
    check_select("select_blocks_bf16_bf16", f"a 41-row run on 4 waves ({'integer' if integer else 'float'})",
                 got, q, keys, bt, req, pos, 0, 3, 1, sec, brute=integer)
    for t in (3, 22, 43):
        one = gpu.select_blocks(q[t:t + 1], keys, bt, req[t:t + 1], pos[t:t + 1], 0, 3, 1)
        assert np.array_equal(one[:, 0], got[:, t]), f"row {t} alone"


def test_select_blocks_reads_each_run_keys_once(gpu, rng):
    """Counted on the emulator (emu_traffic): key bytes read = for each run of consecutive rows of
    one request, its visible blocks with a valid page once (32 KiB each), whatever its rows and KV
    heads: MTP rows, a 66-row prefill chunk that crosses the score kernel's 64-row tile, a lone
    row; an invalid page is never read."""
    from tools.rocm import emu_traffic
    q, keys, bt, req, pos = select_case(rng, jnp.bfloat16, jnp.bfloat16, [(3, 300), (66, 130), (1, 50)],
                                        P=10, M=4, hkv=2)
    bt[0, 1] = -1
    with emu_traffic.counting({"idx_k_cache": keys, "idx_q": q}) as c:
        got = gpu.select_blocks(q, keys, bt, req, pos, 0, 4, 1)
    blocks = 2 + 2 + 1                                  # request 0: blocks 0, 2 (1 invalid); 1: 0, 1; 2: 0
    own_keys = blocks * 128 * 128 * 2
    assert c.read["idx_k_cache"] == own_keys <= 1.1 * own_keys
    RESULTS.append(("select_blocks_bf16_bf16", "traffic T=70 (3 runs)",
                    f"keys {c.read['idx_k_cache']} B = each run's blocks once", 0.0))
    check_select("select_blocks_bf16_bf16", "T=70 (3 runs, tile-crossing)", got, q, keys, bt, req, pos, 0, 4, 1,
                 0.0, brute=False)


# ---- grouped_matmul (SPEC §9): the routed experts' grouped GEMM ----------------------------------
ACTIVATIONS = {0: None, 1: "swiglu", 2: "swiglu_oai"}
NAN_BYTES = {"mxfp8": 255, "mxfp4": 255, "nvfp4": 0x7F}          # a NaN scale of each format


def grouped_weights(rng, fmt, G, N, K):
    """(rhs, rhs_scale) of random weights in format `fmt` (rows of varied magnitude)."""
    w = jnp.asarray(rng.standard_normal((G, N, K)) * rng.uniform(0.2, 2.0, (G, N, 1)), jnp.float32)
    if fmt == "bf16":
        return np.array(w.astype(jnp.bfloat16)), None
    quantize = {"mxfp8": m3.mxfp8_quantize, "mxfp4": m3.mxfp4_quantize,
                "nvfp4": lambda x: m3.nvfp4_quantize(x, 1.0)}[fmt]
    return tuple(np.array(a) for a in quantize(w))


def check_grouped(kernel, case, got, want, sec):
    """Each element within fp32 summation error (1e-5 of the largest result) of the float64
    oracle, plus one bf16 rounding for bf16 output; NaN exactly where the oracle has it."""
    got64 = np.asarray(got, np.float64)
    assert np.array_equal(np.isnan(got64), np.isnan(want)), f"{kernel} {case}: NaN where the oracle has none"
    ok = ~np.isnan(want)
    rel = 2.0 ** -8 if np.dtype(got.dtype).itemsize == 2 else 0.0
    err = np.abs(got64[ok] - want[ok])
    bound = 1e-5 * np.abs(want[ok]).max() + rel * np.abs(want[ok])
    RESULTS.append((kernel, case, f"max err {err.max():.2e} (bound {bound.max():.2e})", sec))
    assert (err <= bound).all(), f"{kernel} {case}: max error {err.max():.3e}"


@pytest.mark.parametrize("fmt,steps", [("bf16", 5), ("mxfp8", 5), ("mxfp4", 5), ("nvfp4", 5),
                                       ("bf16", 37), ("nvfp4", 37)])
def test_grouped_matmul_formats(gpu, rng, fmt, steps):
    """Against the float64 oracle (tests/support/oracle.py): gathered rows with ids outside [0, T),
    a negative and an empty group whose weights are NaN (never read: no NaN reaches a row), rows
    after the last group (zeros), N not a multiple of a workgroup's columns; plain f32 output,
    then bf16 output with swiglu_oai, row and group scales, then swiglu with f32 output. K of 5
    k-steps: one group of 4 whose loads go out together, then one alone; K of 37 k-steps (past
    SPLIT_MIN_STEPS): the workgroup's 4 waves take quarters of 10, 10, 10 and 7 steps, each groups
    of 4 and a remainder, joined through LDS."""
    from tools.rocm.emu_launch import GROUPED_SPLIT_STEPS
    T, K, N, G = 13, steps * 32, 96, 5
    assert (steps >= GROUPED_SPLIT_STEPS) == (steps == 37)
    lhs = np.array(jnp.asarray(rng.standard_normal((T, K)), jnp.bfloat16))
    rhs, scale = grouped_weights(rng, fmt, G, N, K)
    if scale is None:
        rhs[1:3] = np.nan
    else:
        scale.view(np.uint8)[1:3] = NAN_BYTES[fmt]
    sizes = np.array([7, -3, 0, 9, 2], np.int32)                       # rows 18 .. 21: no group
    rows = rng.integers(0, T, 22).astype(np.int32)
    rows[[0, 8, 19]] = -1, T, INT32_MAX                              # zero rows
    row_scale = rng.uniform(0.1, 1.0, 22).astype(np.float32)
    group_scale = rng.uniform(0.5, 2.0, G).astype(np.float32)
    product = oracle.grouped_matmul(lhs, rhs, sizes, scale, lhs_rows=rows)
    kernel = f"grouped_matmul_{fmt}"
    got, sec = timed(gpu.grouped_matmul, lhs, rhs, sizes, scale, lhs_rows=rows)
    check_grouped(f"{kernel}_f32", f"M=22 G=5 K={K} gather, NaN unrouted", got,
                  oracle.grouped_epilogue(product, sizes), sec)
    assert (got[18:] == 0).all()
    got, sec = timed(gpu.grouped_matmul, lhs, rhs, sizes, scale, lhs_rows=rows, row_scale=row_scale,
                     group_scale=group_scale, out_dtype=np.dtype(jnp.bfloat16), activation=2)
    want = oracle.grouped_epilogue(product, sizes, "swiglu_oai", row_scale, group_scale)
    check_grouped(f"{kernel}_bf16", f"K={K} swiglu_oai, row + group scales", got, want, sec)
    got, sec = timed(gpu.grouped_matmul, lhs, rhs, sizes, scale, lhs_rows=rows, activation=1)
    check_grouped(f"{kernel}_f32", f"K={K} swiglu", got, oracle.grouped_epilogue(product, sizes, "swiglu"), sec)


@pytest.mark.parametrize("covered", [True, False])
def test_grouped_matmul_many_groups(gpu, rng, covered):
    """M3's expert count and past it: 150 groups, read 64 at a time by each workgroup's tile
    search (three chunks), routed rows spread over every chunk, negative and empty groups, and
    a group whose size runs past M (clipped: the groups after it get no rows) — or, with
    `covered` False, rows after the last group (zeros). Against the float64 oracle."""
    G, K, N = 150, 32, 16
    sizes = np.zeros(G, np.int32)
    routed = rng.choice(G - 2, 30, replace=False)
    sizes[routed] = rng.integers(1, 20, 30)
    sizes[rng.choice(G, 10, replace=False)] = -5
    M = int(np.clip(sizes, 0, None).sum())
    if covered:
        sizes[G - 2], sizes[G - 1] = 2 ** 31 - 1, 7      # runs past M: clipped, group G-1 empty
        M += 9
    else:
        M += 21                                            # rows past the last group: zeros
    T = 40
    lhs = np.array(jnp.asarray(rng.standard_normal((T, K)), jnp.bfloat16))
    rhs, _ = grouped_weights(rng, "bf16", G, N, K)
    rows = rng.integers(0, T, M).astype(np.int32)
    got, sec = timed(gpu.grouped_matmul, lhs, rhs, sizes, None, lhs_rows=rows)
    want = oracle.grouped_epilogue(oracle.grouped_matmul(lhs, rhs, sizes, None, lhs_rows=rows), sizes)
    check_grouped("grouped_matmul_bf16_f32", f"G={G} M={M} {'clipped' if covered else 'uncovered rows'}",
                  got, want, sec)
    if not covered:
        assert (got[M - 21:] == 0).all()


@pytest.mark.parametrize("K", [64, 33 * 32])
def test_grouped_matmul_row_alone_equals_batch(gpu, rng, K):
    """A row's bits depend only on its row, its group's weights and scales (SPEC §9): a group's
    rows run alone (every other group empty, the rows at other offsets) equal the batch's; K of
    2 k-steps, and of 33 (split over the waves)."""
    T, N, G = 40, 64, 3
    lhs = np.array(jnp.asarray(rng.standard_normal((T, K)), jnp.bfloat16))
    rhs, scale = grouped_weights(rng, "mxfp4", G, N, K)
    sizes = np.array([10, 21, 9], np.int32)
    batch = gpu.grouped_matmul(lhs, rhs, sizes, scale)
    alone = gpu.grouped_matmul(lhs[10:31], rhs, np.array([0, 21, 0], np.int32), scale)
    assert np.array_equal(alone, batch[10:31])
    RESULTS.append(("grouped_matmul_mxfp4_f32", f"K={K}: group 1 alone = in the batch", "bit-identical", 0.0))


@pytest.mark.parametrize("K", [64, 32 * 32])
def test_grouped_matmul_reads_routed_weights_once(gpu, rng, K):
    """Counted on the emulator (emu_traffic): each routed group's weights (and scales) are read once
    per tile of 16 of its rows, an unrouted group's never — the work of the routed rows only; also
    with K split over a workgroup's waves (each wave reads its quarter of the same rows)."""
    from tools.rocm import emu_traffic
    T, N, G = 23, 96, 6
    lhs = np.array(jnp.asarray(rng.standard_normal((T, K)), jnp.bfloat16))
    sizes = np.array([0, 20, 0, 3, 0, 0], np.int32)                   # group 1: 2 tiles, group 3: 1
    for fmt in ("bf16", "mxfp4"):
        rhs, scale = grouped_weights(rng, fmt, G, N, K)
        regions = {"rhs": rhs} if scale is None else {"rhs": rhs, "rhs_scale": scale}
        with emu_traffic.counting(regions) as c:
            gpu.grouped_matmul(lhs, rhs, sizes, scale)
        per_group = rhs[0].nbytes
        assert c.read["rhs"] == 3 * per_group, (fmt, c.read["rhs"], per_group)
        if scale is not None:
            assert c.read["rhs_scale"] == 3 * scale[0].nbytes
        RESULTS.append((f"grouped_matmul_{fmt}_f32", f"traffic G=6, 2 routed, K={K}",
                        f"weights {c.read['rhs']} B = 3 tiles' groups once", 0.0))


# ---- route_experts (SPEC §10): the routing and the pairs grouped by expert --------------------------
ROUTE_FIELDS = ("weights", "experts", "group_sizes", "sorted_tokens", "sorted_weights", "inverse")


@pytest.mark.parametrize("T,E,k,ties,renormalize", [
    (5, 16, 2, False, True),
    (9, 130, 4, True, True),       # E past two 64-lane sweeps; exact ties, NaN, ±0, ±inf scores
    (70, 8, 4, True, False),       # 280 pairs: past one 256-pair chunk of the grouping
    (3, 128, 8, True, True),       # M3's E, the largest k
    (40, 128, 1, False, True),
])
def test_route_experts_exact(gpu, rng, T, E, k, ties, renormalize):
    """Every field bit-identical to the reference (jax_m3sparse.reference) and to the Python
    oracle (tests/support/oracle.py): top-k with ties to the lower id, weights summed in choice
    order and divided, padding tokens' pairs after every group, stable grouping."""
    from jax_m3sparse import reference
    scores = oracle.route_scores(rng, T, E, ties=ties)
    bias = rng.uniform(-0.05, 0.05, E).astype(np.float32)
    live = rng.random(T) > 0.25
    got, sec = timed(gpu.route_experts, scores, bias, live, k, renormalize)
    want = reference.route_experts(scores, k, bias=bias, live=live, renormalize=renormalize)
    py = oracle.route_experts(scores, bias, live, k, renormalize)
    for name, g, w, p in zip(ROUTE_FIELDS, got, want, py):
        assert np.array_equal(g, np.asarray(w), equal_nan=True), f"{name} differs from the reference"
        assert np.array_equal(g, p, equal_nan=True), f"{name} differs from the oracle"
    RESULTS.append(("route_experts", f"T={T} E={E} k={k}{' ties' if ties else ''}", "identical to the reference", sec))
