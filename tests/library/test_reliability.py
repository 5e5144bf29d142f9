"""Regression tests for what a fuzzer under AddressSanitizer found, one section per finding.

Each op is run natively and through ``jax_m3sparse.reference`` (the lowering of every platform
without a native module); expected values come from SPEC, not from either implementation.
"""

import ast
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_m3sparse as m3
from jax_m3sparse import reference

import oracle

D = 32                       # the smallest head_dim: C = 18 bytes per token
C = D // 2 + D // 16
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
DECODE = {"native": m3.sparse_decode, "reference": reference.sparse_decode}
PREFILL = {"native": m3.sparse_prefill, "reference": reference.sparse_prefill}
PACK = {"native": m3.pack_kv_pages, "reference": reference.pack_kv_pages}
ATTENTION = {"native": m3.sparse_attention, "reference": reference.sparse_attention}


def unit_cache(P=1, Hkv=1):
    """Every token of every page: codes 2 (value 1.0), scale bytes 0x38 (1.0)."""
    cache = np.zeros((P, 2 * Hkv, 128, C), np.uint8)
    tiles = cache.reshape(P, 2 * Hkv, 128 * C)
    tiles[..., :128 * D // 2] = 0x22
    tiles[..., 128 * D // 2:] = 0x38
    return cache


# ---- finding 1: decode positions must not wrap around in int32 (SPEC §5.3) ---------------------
@pytest.mark.parametrize("impl", list(DECODE))
@pytest.mark.parametrize("seq_len,dql", [(INT32_MIN, 1), (INT32_MIN + 1, 4), (INT32_MIN + 3, 4),
                                         (-5, 2), (0, 3)])
def test_decode_negative_positions_attend_nothing(impl, seq_len, dql):
    q = np.ones((dql, 1, D), np.float32)
    out = DECODE[impl](q, unit_cache(), np.zeros((1, dql, 1), np.int32), np.zeros((1, 1), np.int32),
                       np.array([seq_len], np.int32), 1.0, 1.0, decode_query_len=dql)
    np.testing.assert_array_equal(np.asarray(out), np.zeros_like(q))


@pytest.mark.parametrize("impl", list(DECODE))
def test_decode_huge_seq_len_attends_the_whole_block(impl):
    """INT32_MAX positions are not negative: the row attends block 0's 128 keys (all value 1)."""
    q = np.ones((2, 1, D), np.float32)
    out = DECODE[impl](q, unit_cache(), np.zeros((1, 2, 1), np.int32), np.zeros((1, 1), np.int32),
                       np.array([INT32_MAX], np.int32), 1.0, 1.0, decode_query_len=2)
    np.testing.assert_allclose(np.asarray(out), np.ones_like(q), rtol=1e-6)


# ---- findings 2 and 3: empty shapes give correctly shaped zeros / write nothing ----------------
def empty_case(what):
    """(q, cache, topk, block_table, rows) with one dimension empty; rows = (req, pos)."""
    T, P, R, M = 2, 1, 1, 1
    T = 0 if what == "T" else T
    P = 0 if what == "P" else P
    R = 0 if what == "R" else R
    M = 0 if what == "M" else M
    q = np.ones((T, 2, D), np.float32)
    return (q, unit_cache(P), np.zeros((1, T, 2), np.int32), np.zeros((R, M), np.int32),
            np.zeros(T, np.int32), np.full(T, 5, np.int32))


@pytest.mark.parametrize("impl", list(PREFILL))
@pytest.mark.parametrize("what", ["T", "P", "R", "M"])
def test_prefill_and_decode_on_empty_shapes(impl, what):
    q, cache, topk, bt, req, pos = empty_case(what)
    out = PREFILL[impl](q, cache, topk, bt, req, pos, 1.0, 1.0)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_array_equal(np.asarray(out), 0)
    R = bt.shape[0]
    if q.shape[0] == R:   # decode needs T = R · dql
        out = DECODE[impl](q, cache, topk, bt, np.full(R, 5, np.int32), 1.0, 1.0)
        np.testing.assert_array_equal(np.asarray(out), np.zeros(q.shape))
    if what == "T":
        qd = np.ones((0, 2, D), np.float32)
        out = DECODE[impl](qd, cache, topk, np.zeros((0, 1), np.int32), np.zeros(0, np.int32),
                           1.0, 1.0)
        assert out.shape == (0, 2, D)


@pytest.mark.parametrize("impl", list(PACK))
@pytest.mark.parametrize("shape", [(0, 1), (2, 0), (0, 0)])   # (T, Hkv)
def test_pack_on_empty_shapes_writes_nothing(impl, shape, rng):
    T, Hkv = shape
    cache = rng.integers(0, 256, (2, 2 * Hkv, 128, C), dtype=np.uint8)
    key = np.ones((T, Hkv, D), np.float32)
    out = PACK[impl](cache, key, key, np.arange(T, dtype=np.int32), 1.0, 1.0)
    np.testing.assert_array_equal(np.asarray(out), cache)


def test_unpack_of_an_empty_cache_gives_zeros():
    k, v = m3.unpack_kv_pages(np.zeros((0, 2, 128, C), np.uint8), np.array([0, 3], np.int32),
                              1.0, 1.0)
    assert k.shape == v.shape == (2, 1, 128, D)
    np.testing.assert_array_equal(np.asarray(k), 0)


@pytest.mark.parametrize("impl", list(ATTENTION))
def test_sparse_attention_with_no_rows(impl):
    """An engine step with no decode and no prefill rows (T = 0): an empty result."""
    meta = m3.build_attention_metadata(np.zeros(0, np.int32), np.zeros(0, np.int32),
                                       np.zeros((0, 4), np.int32), num_decode_requests=0,
                                       num_tokens=0)
    out = ATTENTION[impl](np.ones((0, 2, D), jnp.bfloat16), unit_cache(),
                          np.zeros((1, 0, 2), np.int32), meta, 1.0, 1.0)
    assert out.shape == (0, 2, D) and out.dtype == jnp.bfloat16


# ---- finding 5: pack at extreme global scales, one rule on every backend ------------------------
EXTREME_G = [3.4e38, 2.0 ** 127, np.nextafter(np.float32(2.0 ** 126), np.float32(np.inf)),
             2.0 ** 126, 2.0 ** -126, np.nextafter(np.float32(2.0 ** -126), np.float32(0)),
             1e-45, 1.0]


@pytest.mark.parametrize("g", EXTREME_G)
def test_pack_extreme_global_scale_is_one_rule(g, rng):
    """SPEC §2.2 step 5 + docs/spec_decisions.md: g outside [2^-126, 2^126] packs NaN groups;
    inside, native, reference and the IEEE numpy oracle agree bit for bit (an Inf group too)."""
    g = np.float32(g)
    key = rng.standard_normal((3, 1, D)).astype(np.float32)
    value = key.copy()
    value[0, 0, 0] = np.inf                      # the reproducer: an Inf group
    value[1, 0, 16] = -np.inf
    cache = rng.integers(0, 256, (2, 2, 128, C), dtype=np.uint8)
    slots = np.array([0, 130, 7], np.int32)
    want = oracle.pack(cache, key, value, slots, np.float32(1.0), g)
    for name, fn in PACK.items():
        got = np.asarray(fn(cache, key, value, slots, 1.0, g))
        np.testing.assert_array_equal(got, want, err_msg=f"{name}, g = {g!r}")
    if not 2.0 ** -126 <= g <= 2.0 ** 126:
        tile = want[0, 1].reshape(-1)            # V of token 0 (slot 0): all NaN groups
        assert (tile[128 * D // 2:128 * D // 2 + 2] == 0x7F).all() and (tile[:16] == 0).all()


@pytest.mark.parametrize("g", [3.4e38, 2.0 ** 127, 1e-45, 0.0, np.nan])
def test_check_inputs_reports_extreme_global_scale(g):
    with pytest.raises(checkify.JaxRuntimeError, match=r"v_scale must be finite and > 0, in \[2\^-126, 2\^126\]"):
        m3.check_inputs(v_scale=np.float32(g))
    m3.check_inputs(v_scale=np.float32(2.0 ** 126), k_scale=np.float32(2.0 ** -126))


# ---- finding 6: check_inputs, KVCacheSpec, output dtype, inference-only ------------------------
def test_check_inputs_reports_seq_lens_beyond_the_block_table_row():
    bt = np.arange(8, dtype=np.int32)[None]              # 8 blocks: 1024 tokens
    m3.check_inputs(seq_lens=np.array([1024], np.int32), block_table=bt)
    with pytest.raises(checkify.JaxRuntimeError, match=r"covers \(max_blocks·128 = 1024 tokens; "
                                                       r"max seq_len 5000\)"):
        m3.check_inputs(seq_lens=np.array([5000], np.int32), block_table=bt)
    holes = bt.copy()
    holes[0, 3] = -1
    with pytest.raises(checkify.JaxRuntimeError, match="no page \\(-1\\) in 1 blocks"):
        m3.check_inputs(seq_lens=np.array([500], np.int32), block_table=holes)
    m3.check_inputs(seq_lens=np.array([384], np.int32), block_table=holes)   # blocks 0-2 only


def test_check_inputs_reports_layer_out_of_range():
    """A traced layer outside [0, L) keeps its defined result (SPEC §3.3);
    check_inputs reports it."""
    with pytest.raises(checkify.JaxRuntimeError, match=r"layer must be in \[0, 4\), got 7"):
        m3.check_inputs(layer=jnp.int32(7), num_layers=4)
    m3.check_inputs(layer=jnp.int32(3), num_layers=4)
    err, _ = jax.jit(checkify.checkify(lambda lyr: m3.check_inputs(layer=lyr, num_layers=4)))(-1)
    with pytest.raises(checkify.JaxRuntimeError, match=r"\[True\] layer must be in"):
        err.throw()


def test_check_inputs_reports_every_fault_not_only_the_first():
    with pytest.raises(checkify.JaxRuntimeError) as e:
        m3.check_inputs(topk_indices=np.array([[[1, 1, -9]]], np.int32),
                        seq_lens=np.array([-1], np.int32), k_scale=0.0,
                        cu_seqlens_q=np.array([0, 5, 2], np.int32))
    msg = str(e.value)
    for part in ("ids < -1 (min -9)", "1 duplicate ids", "negative lengths", "not non-decreasing",
                 "k_scale must be finite and > 0"):
        assert part in msg, (part, msg)


def test_check_inputs_under_checkify_lists_every_check():
    f = checkify.checkify(jax.jit(lambda s, g: m3.check_inputs(seq_lens=s, k_scale=g)))
    err, _ = f(jnp.array([3], jnp.int32), jnp.float32(1.0))
    assert err.get() is None
    err, _ = f(jnp.array([-3], jnp.int32), jnp.float32(np.inf))
    msg = err.get()
    assert "[True] seq_lens has negative lengths" in msg
    assert "[True] k_scale must be finite and > 0" in msg


def test_kv_cache_spec_rejects_block_sizes_the_ops_cannot_serve():
    with pytest.raises(ValueError, match="block_size must be 128.*got 64"):
        m3.KVCacheSpec(1, block_size=64)
    assert m3.KVCacheSpec(1).block_size == 128


def test_float32_q_is_served_and_returned():
    """SPEC §5.5: the output dtype is q's, float32 included (the CPU backend serves it)."""
    q = np.ones((1, 1, D), np.float32)
    out = m3.sparse_decode(q, unit_cache(), np.zeros((1, 1, 1), np.int32),
                           np.zeros((1, 1), np.int32), np.array([3], np.int32), 1.0, 1.0)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), 1.0, rtol=1e-6)


def test_differentiation_says_inference_only():
    cache, bt, seq = unit_cache(), np.zeros((1, 1), np.int32), np.array([3], np.int32)
    topk = np.zeros((1, 1, 1), np.int32)

    def loss(q):
        return m3.sparse_decode(q, cache, topk, bt, seq, 1.0, 1.0).sum()

    with pytest.raises(NotImplementedError, match="sparse_decode is inference-only"):
        jax.grad(loss)(jnp.ones((1, 1, D)))
    with pytest.raises(NotImplementedError, match="pack_kv_pages is inference-only"):
        jax.grad(lambda k: m3.pack_kv_pages(cache, k, k, np.zeros(1, np.int32), 1.0, 1.0)
                 .astype(jnp.float32).sum())(jnp.ones((1, 1, D)))
    # A gradient that does not flow through the op is fine.
    g = jax.grad(lambda w: (w * loss(jax.lax.stop_gradient(jnp.ones((1, 1, D)) * w))))(2.0)
    assert np.isfinite(g)


# ---- finding 7: a missing native module is said, can be an error, and the bench says its path --
HIDE_CPU_MODULE = ("import sys, warnings; sys.modules['jax_m3sparse._m3sparse_cpu'] = None; "
                   "warnings.simplefilter('always'); ")


def run_python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_missing_native_module_warns_and_can_be_an_error():
    res = run_python(HIDE_CPU_MODULE + "import jax_m3sparse as m3; "
                     "from jax_m3sparse.bench.__main__ import timed_path; "
                     "print('NATIVE', m3.native_platforms()); print(timed_path('cpu'))",
                     JAX_M3SPARSE_REQUIRE_NATIVE="")
    assert res.returncode == 0, res.stderr
    assert "NativeModuleWarning" in res.stderr
    assert "native cpu module jax_m3sparse._m3sparse_cpu did not load" in res.stderr
    assert "pip install --no-build-isolation -e ." in res.stderr   # the fix
    assert "NATIVE ()" in res.stdout
    assert "THE PURE-JAX REFERENCE" in res.stdout
    res = run_python(HIDE_CPU_MODULE + "import jax_m3sparse", JAX_M3SPARSE_REQUIRE_NATIVE="cpu")
    assert res.returncode != 0
    assert "ImportError: jax_m3sparse: the native cpu module" in res.stderr


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_stand_in_for_a_missing_gpu_module_names_it(platform):
    """The cuda/rocm lowerings emit our custom calls without a local module; their
    targets then get the CPU module's stand-in, which fails a call naming the module and the
    build flag (run here on the CPU under a test name, with any operands and attributes)."""
    from jax_m3sparse import _m3sparse_cpu
    name = f"m3sparse_test_stand_in_{platform}"
    jax.ffi.register_ffi_target(name, _m3sparse_cpu.missing_module_handler(platform), platform="cpu")
    call = jax.ffi.ffi_call(name, (jax.ShapeDtypeStruct((2,), jnp.float32),) * 2)
    with pytest.raises(Exception, match=rf"module jax_m3sparse\._m3sparse_{platform} is not "
                                        rf"loaded.*M3SPARSE_ENABLE_{platform.upper()}=ON"):
        jax.block_until_ready(call(jnp.ones(3), jnp.zeros((), jnp.int32), scale=np.float32(1),
                                   layout=np.int64(0)))
    with pytest.raises(ValueError, match="no stand-in for platform 'cpu'"):
        _m3sparse_cpu.missing_module_handler("cpu")


def test_native_module_is_loaded_here():
    from jax_m3sparse.bench.__main__ import timed_path
    assert "cpu" in m3.native_platforms()
    assert timed_path("cpu").startswith("timed path on cpu: native module jax_m3sparse._m3sparse_cpu")


# ---- imports inside the package run one way: no cycle, no function-local imports ----------------
def test_package_imports_form_no_cycle_and_need_no_local_imports():
    root = pathlib.Path(m3.__file__).parent
    graph, local = {}, []
    for path in root.rglob("*.py"):
        if "bench" in path.parts:
            continue   # the bench imports optional tools (flydsl, CUDA) lazily on purpose
        rel = path.relative_to(root.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        tree = ast.parse(path.read_text())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax_m3sparse"):
                mods = {f"{node.module}.{a.name}" for a in node.names} | {node.module}
                if node not in tree.body:
                    local.append(f"{name}: from {node.module} import ...")
                deps |= mods
        graph[name] = deps
    assert not local, local
    graph = {k: {d for d in v if d in graph and d != k and not k.startswith(d + ".")}
             for k, v in graph.items()}
    state = {}

    def visit(n, stack):
        if state.get(n) == 1:
            raise AssertionError("import cycle: " + " -> ".join(stack + [n]))
        if state.get(n) != 2:
            state[n] = 1
            for d in sorted(graph[n]):
                visit(d, stack + [n])
            state[n] = 2

    for n in sorted(graph):
        visit(n, [])
