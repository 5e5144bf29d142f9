"""Serving across devices (docs/DESIGN.md, "Sharding"): every op partitions over KV heads under
plain jax.jit on simulated CPU devices — no collective in the compiled program, shardings kept,
results equal to one device — plus KV-head replication, export, rejected shardings, DP x TP,
and two processes through jax.distributed."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_m3sparse as m3
from jax_m3sparse import sharding as shd

import sharding_case as sc

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 simulated devices")


def mesh(n, axis_type=AxisType.Auto):
    return jax.make_mesh((n,), ("tp",), axis_types=(axis_type,), devices=jax.devices()[:n])


def assert_same(sharded, single):
    cache, outs = sharded
    want_cache, want_outs = single
    np.testing.assert_array_equal(np.asarray(cache), np.asarray(want_cache))  # pack: bit-exact
    for got, want in zip(outs, want_outs):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tp,hkv,hq,layout", [
    (2, 4, 64, "LBHNC"),   # G = 16, 2 KV heads per device
    (4, 4, 64, "BLHNC"),   # G = 16, 1 KV head per device
    (8, 4, 64, "LBHNC"),   # M3 at TP8: KV heads replicated twice, G = 8
    (2, 1, 16, "BLHNC"),   # one KV head replicated on both devices, G = 8
    (8, 8, 64, "LBHNC"),   # G = 8 without replication
])
def test_tp_step_has_no_collective_and_matches_one_device(rng, tp, hkv, hq, layout):
    case = sc.make_case(rng, tp, hkv, hq, layout=layout)
    m = mesh(tp)
    text, cache, outs = sc.run_sharded(m, case)
    assert not sc.COLLECTIVE.search(text), [l for l in text.splitlines()
                                             if sc.COLLECTIVE.search(l)][:3]
    assert "input_output_alias" in text  # the donated cache is updated in place,
    assert not re.search(r"= u8\[[^\]]*\]\S* copy\(", text)  # never copied
    assert cache.sharding.spec == shd.cache_spec("tp", 5)
    for out in outs:
        assert out.sharding.is_equivalent_to(NamedSharding(m, P(None, None, "tp")), out.ndim)
    assert_same((cache, outs), sc.run_single(case))


def test_4d_cache_and_explicit_mesh(rng):
    """One-layer 4-D cache, under an Explicit-axes mesh (jax.make_mesh's default)."""
    m = mesh(4, AxisType.Explicit)
    spec = m3.KVCacheSpec(4)
    cache = np.zeros(spec.cache_shape(3), np.uint8)
    k = rng.standard_normal((40, 4, 128)).astype(np.float32)
    slots = rng.permutation(3 * 128)[:40].astype(np.int32)
    q = rng.standard_normal((2, 32, 128)).astype(np.float32)
    topk = rng.integers(-1, 3, (4, 2, 16)).astype(np.int32)
    bt, sl = np.array([[0, 1, 2], [2, 1, 0]], np.int32), np.array([300, 100], np.int32)

    def f(c, k, q, t):
        c = m3.pack_kv_pages(c, k, k * 0.5, slots, 1.0, 1.0)
        return c, m3.sparse_decode(q, c, t, bt, sl, 1.0, 1.0)

    put = lambda x, s: jax.device_put(x, NamedSharding(m, s))
    args = (put(cache, shd.cache_spec("tp", 4)), put(k, P(None, "tp", None)),
            put(q, P(None, "tp", None)), put(topk, P("tp", None, None)))
    jf = jax.jit(f, donate_argnums=0)
    assert not sc.COLLECTIVE.search(jf.lower(*args).compile().as_text())
    got = jf(*args)
    assert got[0].sharding.spec == shd.cache_spec("tp", 4)
    want = jax.jit(f)(cache, k, q, topk)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-6)


def test_kv_head_replication_is_the_same_attention(rng):
    """M3 at TP8 (Hq 64, Hkv 4 replicated to 8, G 16 -> 8) equals the unreplicated model."""
    base = sc.make_case(np.random.default_rng(7), 1, 4, 64, layers=1)
    repl = sc.make_case(np.random.default_rng(7), 8, 4, 64, layers=1)
    _, outs1 = sc.run_single(base)
    _, outs8 = sc.run_single(repl)
    for a, b in zip(outs1, outs8):   # decode, prefill, mixed batch, full attention
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert shd.kv_head_replicas(4, 8) == 2 and shd.kv_head_replicas(4, 2) == 1
    with pytest.raises(ValueError, match="must divide"):
        shd.kv_head_replicas(4, 3)


@pytest.mark.parametrize("n,spec,match", [
    (2, P(None, "tp", None, None, None), "sharded along axis \\[1\\]"),   # the page axis
    (8, P(None, None, "tp", None, None), "cuts a K/V slot pair"),         # 8 slots, 8 devices
])
def test_unservable_cache_sharding_is_rejected(rng, n, spec, match):
    case = sc.make_case(rng, 4, 4, 64, layers=1)
    m = mesh(n)
    cache = jax.device_put(case.cache, NamedSharding(m, spec))
    a = case.args
    f = jax.jit(lambda c: m3.sparse_decode(a["q_dec"][0], c, a["topk_dec"], a["block_table"],
                                           a["seq_lens"], 1.0, 1.0, layer=0,
                                           layout="LBHNC"))
    with pytest.raises(Exception, match=match) as err:
        f.lower(cache).compile()
    assert "PartitionSpec(None, None, 'tp', None, None)" in str(err.value)


def test_export_of_a_sharded_step_round_trips(rng):
    case = sc.make_case(rng, 4, 4, 64, layers=2)
    m = mesh(4)
    cache_sh, arg_sh = sc.shardings(m, case)
    fn = jax.jit(lambda c, a: sc.step(c, a, case.layout), in_shardings=(cache_sh, arg_sh))
    exp = jax.export.export(fn, disabled_checks=m3.export_disabled_checks())(
        jax.ShapeDtypeStruct(case.cache.shape, jnp.uint8, sharding=cache_sh),
        {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=arg_sh[k])
         for k, v in case.args.items()})
    back = jax.export.deserialize(exp.serialize())
    cache = jax.device_put(case.cache, cache_sh)
    args = {k: jax.device_put(v, arg_sh[k]) for k, v in case.args.items()}
    assert not sc.COLLECTIVE.search(jax.jit(back.call).lower(cache, args).compile().as_text())
    assert_same(back.call(cache, args), fn(cache, args))


def test_data_parallel_attention_with_shard_map(rng):
    """DP x TP: requests split over "dp" (each shard its own pages and block table, via
    shard_map), KV heads over "tp" (our partitioner, inside the shard_map)."""
    m = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Explicit, AxisType.Auto))
    cases = [sc.make_case(np.random.default_rng(s), 4, 4, 64, layers=1) for s in (1, 2)]
    cat = lambda key, axis: np.concatenate([c.args[key] for c in cases], axis)
    cache = np.concatenate([c.cache for c in cases], axis=1)        # pages: shard 0 | shard 1
    bt, sl = cat("block_table", 0), cat("seq_lens", 0)
    q, topk = cat("q_dec", 1)[0], cat("topk_dec", 1)

    def local(q, cache, topk, bt, sl):  # one DP shard: local pages, local block table
        return m3.sparse_decode(q, cache, topk, bt, sl, 1.0, 1.0, layer=jnp.int32(0),
                                layout="LBHNC")

    dp = jax.jit(jax.shard_map(local, mesh=m, axis_names={"dp"}, out_specs=P("dp"),
                               in_specs=(P("dp"), P(None, "dp"), P(None, "dp"), P("dp"),
                                         P("dp"))))
    put = lambda x, s: jax.device_put(x, NamedSharding(m, s))
    args = (put(q, P("dp", "tp", None)), put(cache, P(None, "dp", "tp", None, None)),
            put(topk, P("tp", "dp", None)), put(bt, P("dp", None)), put(sl, P("dp")))
    with jax.set_mesh(m):
        assert not sc.COLLECTIVE.search(dp.lower(*args).compile().as_text())
        got = np.asarray(dp(*args))
    want = np.concatenate([np.asarray(local(c.args["q_dec"][0], c.cache, c.args["topk_dec"],
                                            c.args["block_table"], c.args["seq_lens"]))
                           for c in cases])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_two_processes_with_jax_distributed(tmp_path):
    """2 processes x 4 CPU devices (gloo), one TP=8 step across the 8 global devices; each
    process checks its shards against a one-device run (tests/workers/multiprocess_worker.py)."""
    tests = Path(__file__).resolve().parents[1]
    worker = tests / "workers" / "multiprocess_worker.py"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # a script in a fresh process: pytest's pythonpath does not reach it (sharding_case)
    env["PYTHONPATH"] = os.pathsep.join([str(tests / "support"), env.get("PYTHONPATH", "")])
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(worker), str(port), str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
        assert "OK process" in out, out[-3000:]


@pytest.mark.parametrize("n,spec,match", [
    (2, P(None, "tp", None, None, None), "along axis \\[1\\]"),
    (8, P(None, None, "tp", None, None), "cuts a K/V slot pair"),
])
def test_explicit_mesh_rejects_at_trace_time(rng, n, spec, match):
    """With Explicit axes the sharding is in the type: the error comes while tracing."""
    case = sc.make_case(rng, 4, 4, 64, layers=1)
    m = mesh(n, AxisType.Explicit)
    cache = jax.device_put(case.cache, NamedSharding(m, spec))
    k = case.args["key"][0]
    with pytest.raises(ValueError, match=match):
        jax.jit(lambda c: m3.pack_kv_pages(c, k, k, case.args["slots"], 1.0, 1.0,
                                           layer=0, layout="LBHNC")).trace(cache)


def test_positions_in_a_sharded_program_stay_local():
    """query_token_positions has no KV-head axis: replicated operands, no collective."""
    m = mesh(4)
    rep = NamedSharding(m, P())
    cu = jax.device_put(np.array([0, 3, 3, 7], np.int32), rep)
    ctx = jax.device_put(np.array([5, 0, 130], np.int32), rep)
    f = jax.jit(lambda cu, ctx: m3.query_token_positions(cu, ctx, 9))
    assert not sc.COLLECTIVE.search(f.lower(cu, ctx).compile().as_text())
    req, pos = f(cu, ctx)
    assert req.tolist() == [0, 0, 0, 2, 2, 2, 2, -1, -1]
    assert pos.tolist() == [5, 6, 7, 130, 131, 132, 133, -1, -1]
