"""The MiniMax M3 example's MoE formulations and random weights (examples/minimax_m3).

The grouped formulation (tokens sorted by expert, ``jax.lax.ragged_dot_general``) against dense
dispatch, in fp32, at sizes where some experts get no token, inside ``lax.scan`` and inside
the tensor-parallel ``shard_map``; ``init_params`` on the device and its size check.
"""

from __future__ import annotations

import dataclasses
import resource

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_m3sparse
import oracle
from minimax_m3 import model, moe, parallel
from minimax_m3.config import M3_TEXT, ModelConfig

CFG = ModelConfig()
# each test compiles its own models (formats × meshes): freed after it, not at the file's end
# (CI keeps the suite under 4 GB)
pytestmark = pytest.mark.usefixtures("free_compiled")


def _routing(w, chosen, E, live=None):
    """The routing that picks ``chosen [T, k]`` with weights ``w`` (in (0, 1)): scores of −1
    elsewhere, not renormalized (jax_m3sparse.route_experts orders a token's experts best
    first, which only reorders the sum's terms)."""
    T, k = chosen.shape
    scores = jnp.full((T, E), -1.0, jnp.float32).at[jnp.arange(T)[:, None], chosen].set(w)
    return jax_m3sparse.route_experts(scores, k, live=live, renormalize=False)


def _experts(rng, T, E, k, H, I):
    p = dict(gate_up_proj=jnp.asarray(rng.normal(0, H ** -0.5, (E, 2, I, H)), jnp.float32),
             down_proj=jnp.asarray(rng.normal(0, I ** -0.5, (E, H, I)), jnp.float32))
    x = jnp.asarray(rng.normal(0, 1, (T, H)), jnp.float32)
    chosen = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]), jnp.int32)
    w = jnp.asarray(rng.random((T, k)) * 0.99 + 0.01, jnp.float32)
    return p, x, _routing(w, chosen, E)


@pytest.mark.parametrize("T,E,k", [(1, 16, 2), (5, 128, 8), (37, 8, 3), (64, 4, 4)])
def test_formulations_equal_dense(rng, T, E, k):
    """Σ_k w·expert(x) is the same sum in every formulation (fp32, to rounding), with
    experts that receive no token (T·k < E) and every expert busy (k = E)."""
    p, x, r = _experts(rng, T, E, k, H=64, I=16)
    w, chosen = r.weights, r.experts
    dense = np.asarray(moe.experts(p, x, r, CFG, impl="dense"))
    others = {impl: np.asarray(jax.jit(lambda *a, i=impl: moe.experts(*a, CFG, impl=i))(
        p, x, r)) for impl in ("ragged", "dense_batched", "gather")}
    # the oracle: each token's chosen experts, one at a time, in float64
    ref = np.zeros((T, 64))
    g = np.asarray(p["gate_up_proj"], np.float64)
    d = np.asarray(p["down_proj"], np.float64)
    for t in range(T):
        for j in range(k):
            e = int(chosen[t, j])
            gu = g[e] @ np.asarray(x[t], np.float64)                 # [2, I]
            gate, up = np.minimum(gu[0], 7.0), np.clip(gu[1], -7.0, 7.0)
            h = (up + 1) * gate / (1 + np.exp(-1.702 * gate))
            ref[t] += float(w[t, j]) * (d[e] @ h)
    scale = np.abs(ref).max()
    assert np.abs(dense - ref).max() <= 2e-6 * scale
    for impl, out in others.items():
        assert np.abs(out - ref).max() <= 2e-6 * scale, impl
        assert np.abs(out - dense).max() <= 2e-6 * scale, impl
    assert int(np.sum(r.group_sizes == 0)) == E - len(np.unique(chosen))


@pytest.mark.parametrize("T,E,k", [(3, 16, 2), (40, 8, 4)])
def test_grouped_equals_dense_in_bf16(rng, T, E, k):
    """moe_impl "grouped" (jax_m3sparse.grouped_matmul; on the CPU its reference lowering)
    with bf16 weights gives dense dispatch's sum to bf16 rounding of the hidden activations."""
    p, x, r = _experts(rng, T, E, k, H=64, I=16)
    p = {name: v.astype(jnp.bfloat16) for name, v in p.items()}
    dense = np.asarray(moe.experts(p, x, r, CFG, impl="dense"))
    grouped = np.asarray(jax.jit(lambda *a: moe.experts(*a, CFG, impl="grouped"))(p, x, r))
    np.testing.assert_allclose(grouped, dense, rtol=0, atol=1e-2 * np.abs(dense).max())


@pytest.mark.parametrize("impl", ["grouped", "ragged"])
def test_padding_rows_route_to_no_expert(rng, impl):
    """``live``: padding rows get no expert in the sorted formulations — their pairs sort
    last in no group (0 out, no weights read for them) — and the live rows' sums are those of
    the call without padding, bit for bit."""
    T, E, k = 12, 16, 2
    p, x, r = _experts(rng, T, E, k, H=64, I=16)
    p = {name: v.astype(jnp.bfloat16) for name, v in p.items()}
    live = jnp.asarray(np.arange(T) % 3 != 1)
    r = _routing(r.weights, r.experts, E, live)
    f = jax.jit(lambda *a: moe.experts(*a, CFG, impl=impl))
    got = np.asarray(f(p, x, r))
    assert not np.any(got[~np.asarray(live)])
    keep = np.flatnonzero(np.asarray(live))
    alone = np.asarray(f(p, x[keep], _routing(r.weights[keep], r.experts[keep], E)))
    np.testing.assert_array_equal(got[keep], alone)
    assert int(jnp.sum(r.group_sizes)) == len(keep) * k


def test_ragged_in_scan_and_tensor_parallel(rng):
    """moe.mlp over stacked layers in lax.scan, on a 4-device "tp" mesh (I split, one psum):
    the grouped formulation gives dense dispatch's output."""
    cfg = dataclasses.replace(CFG, hidden_size=64, intermediate_size=32,
                              shared_intermediate_size=32, num_local_experts=16,
                              num_experts_per_tok=4)
    shapes = model.layer_shapes(cfg, "minimax_m3_sparse", "sparse")["mlp"]
    L = 2
    p = jax.tree_util.tree_map(
        lambda s: jnp.asarray(rng.normal(0, 0.2, (L, *s)), jnp.float32), shapes,
        is_leaf=parallel.is_shape)
    x = jnp.asarray(rng.normal(0, 1, (6, 64)), jnp.float32)

    def run(impl, mesh):
        c = dataclasses.replace(cfg, moe_impl=impl)
        f = jax.jit(lambda p, x: jax.lax.scan(lambda h, pl: (h + moe.mlp(pl, h, c, True), None),
                                              x, p)[0])
        if mesh is None:
            return np.asarray(f(p, x))
        with jax.set_mesh(mesh):
            return np.asarray(f(p, x))

    dense = run("dense", None)
    for mesh in (None, parallel.make_mesh(4)):
        for impl in ("ragged", "gather"):
            np.testing.assert_allclose(run(impl, mesh), dense, rtol=1e-5,
                                       atol=1e-5 * np.abs(dense).max())


def test_resolve_impl():
    assert moe.resolve_impl("auto", 0.25, "cpu") == "dense"
    assert moe.resolve_impl("auto", 0.25, "cuda") == "grouped"    # the routed experts only
    assert moe.resolve_impl("auto", 64.0, "cuda") == "grouped"
    assert moe.resolve_impl("auto", 0.25, "cuda", jnp.float32) == "gather"   # not bf16
    assert moe.resolve_impl("auto", 4.0, "cuda", jnp.float32) == "dense"
    assert moe.resolve_impl("ragged", 8, "cpu") == "ragged"
    assert moe.resolve_impl("grouped", 8, "cpu") == "grouped"
    with pytest.raises(ValueError, match="moe_impl"):
        moe.resolve_impl("sorted", 8)
    with pytest.raises(ValueError, match="moe_impl"):
        ModelConfig(moe_impl="sorted")
    with pytest.raises(ValueError, match="bfloat16"):
        moe.resolve_impl("grouped", 8, "cuda", jnp.float32)
    if not moe.tokamax_available():
        with pytest.raises(ImportError, match="tokamax"):
            moe.experts(*_experts(np.random.default_rng(0), 2, 4, 2, 8, 4), CFG, impl="tokamax")


def test_init_on_device_in_dtype():
    """Seeded, in the asked dtype, with the stated spreads; big leaves (one layer at a time,
    sharded) reproduce for a seed and do not depend on the sharding."""
    cfg = dataclasses.replace(CFG, hidden_size=256, vocab_size=256)
    a = model.init_params(cfg, 3, dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree_util.tree_leaves(a)} == {jnp.dtype(jnp.bfloat16)}
    gu = np.asarray(a["segments"][1]["mlp"]["experts"]["gate_up_proj"], np.float32)
    assert abs(gu.std() * 16 - 1) < 0.02                         # N(0, 1/256)
    assert abs(np.asarray(a["embed_tokens"], np.float32).std() - 1) < 0.02
    old = model._ONE_CALL_BYTES
    try:
        model._ONE_CALL_BYTES = 1 << 16                           # the per-layer path
        mesh = parallel.make_mesh(2)
        b = model.init_params(cfg, 3, parallel.param_shardings(model.param_shapes(cfg), cfg, mesh))
        c = model.init_params(cfg, 3)
    finally:
        model._ONE_CALL_BYTES = old
    for x, y in zip(jax.tree_util.tree_leaves(b), jax.tree_util.tree_leaves(c)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    big = b["segments"][1]["mlp"]["experts"]["gate_up_proj"]
    assert {s.data.shape for s in big.addressable_shards} == {(3, 8, 2, 64, 256)}
    assert abs(np.asarray(big).std() * 16 - 1) < 0.02


def test_init_refuses_a_model_that_does_not_fit():
    """Real M3 in fp32 on this machine: refused before anything is allocated, with the plan's
    numbers: 1,705.2 GB of weights per device as served — the checkpoint's 1,704.7 GB plus the
    fused qkv_proj's copy of the index key for each of the 3 other stored KV heads on the 57
    sparse layers (3 · 128 · 6144 · 4 B · 57 = 0.54 GB)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(MemoryError, match=r"1,705\.2 GB of float32 weights .* available"):
        model.init_params(ModelConfig(**M3_TEXT), 0, dtype=jnp.float32)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000   # KiB


# ----------------------------------------------------------------------------- MXFP8 experts
def _mxfp8_experts(p):
    out = {}
    for name, w in p.items():
        out[name], out[name + "_scale"] = jax_m3sparse.mxfp8_quantize(w)
    return out


@pytest.mark.parametrize("T,E,k", [(3, 16, 2), (40, 8, 4)])
def test_mxfp8_experts_equal_their_bf16_twin(rng, T, E, k):
    """MXFP8 experts (fp8 + E8M0 exponents) give what their dequantized bf16 twin gives: dense
    dispatch bit for bit (it widens them first), "grouped" (grouped_matmul's MXFP8 operands)
    equal to "grouped" on the twin bit for bit, and "gather" too."""
    p, x, r = _experts(rng, T, E, k, H=64, I=32)
    mx = _mxfp8_experts(p)
    twin = moe.dequantized(mx)
    assert {v.dtype for v in twin.values()} == {jnp.dtype(jnp.bfloat16)}
    for impl in ("dense", "grouped", "gather"):
        f = jax.jit(lambda p_, *a, i=impl: moe.experts(p_, *a, CFG, impl=i))
        np.testing.assert_array_equal(np.asarray(f(mx, x, r)), np.asarray(f(twin, x, r)),
                                      err_msg=impl)
    assert moe.resolve_impl("auto", 0.25, "cuda", jnp.float8_e4m3fn) == "grouped"


@pytest.mark.parametrize("T,E,k,impl", [(3, 16, 2, "dense"), (40, 8, 4, "auto")])
def test_w8a8_experts_quantize_their_inputs(rng, T, E, k, impl):
    """expert_format "mxfp8_w8a8": every formulation becomes "grouped" with MXFP8 inputs: equal
    to a float64 oracle written here (the tokens and the weighted SwiGLU outputs quantized per
    32 by mxfp8_quantize, the products of the dequantized values), within fp32 rounding; and
    within ten per cent of the bf16 experts."""
    H, I = 64, 32
    p, x, r = _experts(rng, T, E, k, H=H, I=I)
    mx = _mxfp8_experts(p)
    cfg = dataclasses.replace(CFG, expert_format="mxfp8_w8a8")
    got = np.asarray(jax.jit(lambda p_, x_, r_: moe.experts(p_, x_, r_, cfg, impl=impl))(
        mx, x, r), np.float64)
    fq = lambda a: np.asarray(jax_m3sparse.mxfp8_dequantize(*jax_m3sparse.mxfp8_quantize(  # noqa: E731
        jnp.asarray(a, jnp.float32))), np.float64)
    tw = {n: np.asarray(v, np.float64) for n, v in moe.dequantized(mx).items()}
    xq, want = fq(x), np.zeros((T, H))
    chosen, weights = np.asarray(r.experts), np.asarray(r.weights)
    for t in range(T):
        for j in range(k):
            e = chosen[t, j]
            gu = np.stack([tw["gate_up_proj"][e, i] @ xq[t] for i in (0, 1)])
            h = np.asarray(moe.swiglu_oai(jnp.asarray(gu[None], jnp.float32), CFG.swiglu_alpha,
                                          CFG.swiglu_limit))[0] * np.float32(weights[t, j])
            want[t] += np.asarray(jnp.asarray(tw["down_proj"][e] @ fq(h[None])[0],
                                              jnp.float32).astype(jnp.bfloat16), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # against the bf16 experts: the same order as MXFP8 weights alone (relative Frobenius
    # 0.04-0.08 for either at these sizes; fp8 keeps 3 mantissa bits)
    run = lambda p_, c: np.asarray(jax.jit(  # noqa: E731
        lambda q, x_, r_: moe.experts(q, x_, r_, c, impl="grouped"))(p_, x, r), np.float64)
    bf16 = run({n: v.astype(jnp.bfloat16) for n, v in p.items()}, CFG)
    rel = lambda a: np.linalg.norm(a - bf16) / np.linalg.norm(bf16)  # noqa: E731
    assert rel(got) < 0.1 and rel(run(mx, CFG)) < 0.1, (rel(got), rel(run(mx, CFG)))


def test_mxfp8_model_init_plan_and_tensor_parallel(rng):
    """cfg.expert_format "mxfp8": param_shapes/param_dtypes carry fp8 experts and uint8
    exponents (spread about N(0, 1/fan_in)), the plan counts their bytes, each exponent leaf
    is sharded as its weight on a 2-device mesh, and the step on 2 devices equals 1 device."""
    cfg = dataclasses.replace(CFG, hidden_size=256, vocab_size=256, intermediate_size=64,
                              shared_intermediate_size=64, expert_format="mxfp8")
    dts = model.param_dtypes(cfg, jnp.bfloat16)["segments"][1]["mlp"]["experts"]
    assert dts == dict(gate_up_proj=jnp.float8_e4m3fn, down_proj=jnp.float8_e4m3fn,
                       gate_up_proj_scale=jnp.uint8, down_proj_scale=jnp.uint8)
    mesh = parallel.make_mesh(2)
    shardings = parallel.param_shardings(model.param_shapes(cfg), cfg, mesh)
    a = model.init_params(cfg, 3, shardings, dtype=jnp.bfloat16)
    ex = a["segments"][1]["mlp"]["experts"]
    assert ex["gate_up_proj"].dtype == jnp.float8_e4m3fn and ex["down_proj_scale"].dtype == jnp.uint8
    assert {s.data.shape for s in ex["down_proj_scale"].addressable_shards} == {(3, 8, 256, 1)}
    gu = np.asarray(jax_m3sparse.mxfp8_dequantize(ex["gate_up_proj"], ex["gate_up_proj_scale"],
                                                  jnp.float32))
    assert abs(gu.std() * 16 - 1) < 0.1                                    # ≈ N(0, 1/256)
    bf16 = dataclasses.replace(cfg, expert_format="bf16")
    from minimax_m3 import plan
    saved = plan.weight_bytes_per_device(bf16, jnp.bfloat16) - plan.weight_bytes_per_device(
        cfg, jnp.bfloat16)
    n = sum(int(np.prod(s)) for s in jax.tree_util.tree_leaves(
        [seg["mlp"]["experts"] for seg in model.param_shapes(bf16)["segments"]
         if "experts" in seg["mlp"]], is_leaf=parallel.is_shape))
    assert saved == n - n // 32                       # 2 bytes -> 1, plus one byte per 32
    x = jnp.asarray(rng.normal(0, 1, (5, 256)), jnp.float32)
    p1 = jax.tree_util.tree_map(lambda l: l[0], a["segments"][1]["mlp"])
    one = np.asarray(jax.jit(lambda p, x: moe.mlp(p, x, cfg, True))(p1, x))
    with jax.set_mesh(mesh):
        two = np.asarray(jax.jit(lambda p, x: moe.mlp(p, x, cfg, True))(p1, x))
    np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-5 * np.abs(one).max())


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])       # (mxfp4: the same path as mxfp8)
def test_quantized_random_model_is_the_bf16_one_rounded(fmt):
    """init_params with quantized experts draws the same model as with bf16 ones and quantizes
    the experts (per layer for big leaves, sharded): every other leaf equal, every expert leaf
    equal to moe.quantize_expert of the bf16 model's (MXFP8 / MXFP4: jax_m3sparse's
    quantizers; NVFP4: nvfp4_quantize at max|w| / (6 · 448) per expert, checked here)."""
    cfg = dataclasses.replace(CFG, hidden_size=256, vocab_size=256, intermediate_size=64,
                              shared_intermediate_size=64)
    mx = dataclasses.replace(cfg, expert_format=fmt)
    old = model._ONE_CALL_BYTES
    for one_call in (old, 1 << 16):                               # flat draw; per-layer path
        model._ONE_CALL_BYTES = one_call
        try:
            ref = model.init_params(cfg, 7, dtype=jnp.bfloat16)
            mesh = parallel.make_mesh(2)
            got = model.init_params(mx, 7, parallel.param_shardings(model.param_shapes(mx), mx,
                                                                    mesh), dtype=jnp.bfloat16)
        finally:
            model._ONE_CALL_BYTES = old
        for seg_r, seg_g in zip(ref["segments"], got["segments"]):
            ex_r, ex_g = seg_r["mlp"].pop("experts", None), seg_g["mlp"].pop("experts", None)
            for x, y in zip(jax.tree_util.tree_leaves(seg_r), jax.tree_util.tree_leaves(seg_g)):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
            for name in () if ex_r is None else ("gate_up_proj", "down_proj"):
                want = moe.quantize_expert(ex_r[name], fmt, name)
                leaves = list(moe.expert_leaves(fmt, name, ex_r[name].shape))
                assert len(leaves) == len(want) == (3 if fmt == "nvfp4" else 2)
                for leaf, w in zip(leaves, want):
                    np.testing.assert_array_equal(np.asarray(ex_g[leaf]).view(np.uint8),
                                                  np.asarray(w).view(np.uint8), err_msg=leaf)
                if fmt == "nvfp4":     # one scale_2 per layer and expert: max|w| / 2688
                    axes = (2, 3, 4) if name == "gate_up_proj" else (2, 3)
                    amax = np.abs(np.asarray(ex_r[name], np.float32)).max(axes)
                    np.testing.assert_array_equal(np.asarray(ex_g[name + "_scale_2"]),
                                                  amax / np.float32(2688))


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_quantize_experts_is_lossless_for_mx_values(rng, fmt):
    """moe.quantize_experts on bf16 weights that are MXFP8 / MXFP4 values (what such a
    checkpoint loads to): the experts it makes dequantize to those weights bit for bit; a bf16
    model's experts become their quantized form, on their devices, the bf16 leaves deleted."""
    cfg = dataclasses.replace(CFG, hidden_size=256, vocab_size=256, intermediate_size=64,
                              shared_intermediate_size=64, expert_format=fmt)
    bf16 = dataclasses.replace(cfg, expert_format="bf16")
    mesh = parallel.make_mesh(2)
    mx = model.init_params(cfg, 5, parallel.param_shardings(model.param_shapes(cfg), cfg, mesh),
                           dtype=jnp.bfloat16)
    loaded = {**mx, "segments": [
        {**s, "mlp": {**s["mlp"], "experts": moe.dequantized(s["mlp"]["experts"])}}
        if "experts" in s["mlp"] else s for s in mx["segments"]]}
    twin = jax.tree_util.tree_map(lambda v: np.asarray(v), loaded)
    out = moe.quantize_experts(loaded, parallel.param_shardings(model.param_shapes(cfg), cfg,
                                                                mesh), fmt)
    for seg, ref in zip(out["segments"], twin["segments"]):
        if "experts" not in seg["mlp"]:
            continue
        back = moe.dequantized(seg["mlp"]["experts"])
        for name in ("gate_up_proj", "down_proj"):
            np.testing.assert_array_equal(np.asarray(back[name]), ref["mlp"]["experts"][name])
        assert len(seg["mlp"]["experts"]["down_proj"].sharding.device_set) == 2
    assert all(s["mlp"]["experts"]["gate_up_proj"].is_deleted()
               for s in loaded["segments"] if "experts" in s["mlp"])
    assert bf16.expert_format == "bf16"


def test_mxfp8_needs_whole_exponent_blocks_per_device():
    cfg = dataclasses.replace(CFG, intermediate_size=64, shared_intermediate_size=64,
                              expert_format="mxfp8")
    parallel.check_divisible(cfg, 2)
    with pytest.raises(ValueError, match=r"intermediate_size / tp = 16 to be a multiple of 32"):
        parallel.check_divisible(cfg, 4)
    with pytest.raises(ValueError, match="expert_format 'mxfp8' needs hidden_size"):
        dataclasses.replace(cfg, intermediate_size=48)
    with pytest.raises(ValueError, match="expert_format 'fp4'"):
        dataclasses.replace(cfg, expert_format="fp4")


# ----------------------------------------------------------------------------- FP4 experts
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("T,E,k,impl", [(3, 16, 2, "dense"), (40, 8, 4, "auto")])
def test_fp4_experts_match_oracle(rng, fmt, T, E, k, impl):
    """expert_format "mxfp4" / "nvfp4": every formulation becomes "grouped" on the packed
    weights; equal to a float64 oracle written here (the weights decoded by tests/support's
    fp4_weights, NVFP4's per-expert scale_2 applied to the gate/up products and the routing
    weight, the rows and outputs rounded to bf16 where the model rounds them) within fp32
    rounding; and near the bf16 experts (FP4 keeps one mantissa bit)."""
    H, I = 64, 32
    p, x, r = _experts(rng, T, E, k, H=H, I=I)
    q = {}
    for name, w in p.items():
        q.update(zip(moe.expert_leaves(fmt, name, w.shape), moe.quantize_expert(w, fmt, name)))
    cfg = dataclasses.replace(CFG, expert_format=fmt)
    got = np.asarray(jax.jit(lambda p_, x_, r_: moe.experts(p_, x_, r_, cfg, impl=impl))(
        q, x, r), np.float64)
    w = {n: oracle.fp4_weights(q[n], q[n + "_scale"]) for n in ("gate_up_proj", "down_proj")}
    s2 = {n: np.asarray(q.get(n + "_scale_2", np.ones(E, np.float32)))
          for n in ("gate_up_proj", "down_proj")}
    xb = np.asarray(jnp.asarray(x).astype(jnp.bfloat16), np.float64)
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16), np.float64)  # noqa: E731
    want = np.zeros((T, H))
    chosen, weights = np.asarray(r.experts), np.asarray(r.weights)
    for t in range(T):
        for j in range(k):
            e = chosen[t, j]
            gu = np.stack([w["gate_up_proj"][e, i] @ xb[t] for i in (0, 1)]) * s2["gate_up_proj"][e]
            h = np.asarray(moe.swiglu_oai(jnp.asarray(gu[None], jnp.float32), CFG.swiglu_alpha,
                                          CFG.swiglu_limit))[0]
            h = bf(h * (np.float32(weights[t, j]) * s2["down_proj"][e]))
            want[t] += bf(w["down_proj"][e] @ h)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    bf16 = np.asarray(jax.jit(lambda p_, x_, r_: moe.experts(p_, x_, r_, CFG, impl="grouped"))(
        {n: v.astype(jnp.bfloat16) for n, v in p.items()}, x, r), np.float64)
    rel = np.linalg.norm(got - bf16) / np.linalg.norm(bf16)
    assert rel < 0.25, rel


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8_w8a8", "nvfp4"])
def test_moe_epilogue_equals_the_xla_swiglu(rng, fmt):
    """cfg.moe_epilogue: the SwiGLU, routing weight (and NVFP4's scale_2, as group_scale) in
    grouped_matmul's epilogue give the XLA path's sum — bf16 and W8A8 bit for bit on the CPU
    (the reference's epilogue is the same fp32 arithmetic), NVFP4 to its one different bf16
    rounding (scale_2 of down_proj on the product instead of in the routing weight)."""
    T, E, k, H, I = 24, 8, 2, 64, 32
    p, x, r = _experts(rng, T, E, k, H=H, I=I)
    if fmt == "bf16":
        q = {n: w.astype(jnp.bfloat16) for n, w in p.items()}
    else:
        q = {}
        for name, w in p.items():
            q.update(zip(moe.expert_leaves(fmt, name, w.shape), moe.quantize_expert(w, fmt, name)))
    cfg = dataclasses.replace(CFG, expert_format=fmt)
    run = lambda c: np.asarray(jax.jit(lambda p_, x_, r_: moe.experts(p_, x_, r_, c,  # noqa: E731
                                                                      impl="grouped"))(q, x, r))
    xla, fused = run(cfg), run(dataclasses.replace(cfg, moe_epilogue=True))
    if fmt == "nvfp4":
        assert np.linalg.norm(fused - xla) / np.linalg.norm(xla) < 1e-2
    else:
        np.testing.assert_array_equal(fused, xla)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_model_plan_and_tensor_parallel(rng, fmt):
    """FP4 experts: param_dtypes carry packed uint8 weights beside their scales (NVFP4: E4M3
    and a float32 scale_2 per expert), the plan counts their bytes, scales are sharded as their
    weights on a 2-device mesh (scale_2 replicated), and the MLP on 2 devices equals 1 device."""
    cfg = dataclasses.replace(CFG, hidden_size=256, vocab_size=256, intermediate_size=64,
                              shared_intermediate_size=64, expert_format=fmt)
    dts = model.param_dtypes(cfg, jnp.bfloat16)["segments"][1]["mlp"]["experts"]
    scale = jnp.uint8 if fmt == "mxfp4" else jnp.float8_e4m3fn
    want = dict(gate_up_proj=jnp.uint8, down_proj=jnp.uint8, gate_up_proj_scale=scale,
                down_proj_scale=scale)
    if fmt == "nvfp4":
        want.update(gate_up_proj_scale_2=jnp.float32, down_proj_scale_2=jnp.float32)
    assert dts == want
    mesh = parallel.make_mesh(2)
    shardings = parallel.param_shardings(model.param_shapes(cfg), cfg, mesh)
    a = model.init_params(cfg, 3, shardings, dtype=jnp.bfloat16)
    ex = a["segments"][1]["mlp"]["experts"]
    block = 32 if fmt == "mxfp4" else 16
    assert {s.data.shape for s in ex["down_proj"].addressable_shards} == {(3, 8, 256, 16)}
    assert {s.data.shape for s in ex["down_proj_scale"].addressable_shards} == {
        (3, 8, 256, 32 // block)}
    bf16 = dataclasses.replace(cfg, expert_format="bf16")
    from minimax_m3 import plan
    saved = plan.weight_bytes_per_device(bf16, jnp.bfloat16) - plan.weight_bytes_per_device(
        cfg, jnp.bfloat16)
    segs = [seg["mlp"]["experts"] for seg in model.param_shapes(bf16)["segments"]
            if "experts" in seg["mlp"]]
    n = sum(int(np.prod(s)) for s in jax.tree_util.tree_leaves(segs, is_leaf=parallel.is_shape))
    s2 = 0 if fmt == "mxfp4" else 4 * 2 * sum(seg["gate_up_proj"][0] * seg["gate_up_proj"][1]
                                              for seg in segs)
    assert saved == 2 * n - (n // 2 + n // block + s2)
    x = jnp.asarray(rng.normal(0, 1, (5, 256)), jnp.float32)
    p1 = jax.tree_util.tree_map(lambda l: l[0], a["segments"][1]["mlp"])
    one = np.asarray(jax.jit(lambda p, x: moe.mlp(p, x, cfg, True))(p1, x))
    with jax.set_mesh(mesh):
        two = np.asarray(jax.jit(lambda p, x: moe.mlp(p, x, cfg, True))(p1, x))
    # "grouped" rounds each device's partial down_proj output to bf16 before the psum: the two
    # differ by bf16 roundings of the partial sums, not more
    np.testing.assert_allclose(two, one, rtol=0, atol=2.0 ** -7 * np.abs(one).max())
