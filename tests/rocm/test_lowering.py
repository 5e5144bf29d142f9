"""The public ops lower on platform "rocm" to the custom calls the HIP handlers serve
(docs/ffi_targets.md): target name, operand count and types, attributes, cache aliasing.
No GPU and no ROCm plugin needed (lowering for a platform does not need its device)."""

from __future__ import annotations

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
m3 = pytest.importorskip("jax_m3sparse")

T, HKV, G, D, K, P, R, M, L = 4, 2, 16, 128, 16, 8, 2, 6, 3


def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def lowered(fn, *args, donate=()):
    return jax.jit(fn, donate_argnums=donate).trace(*args).lower(lowering_platforms=("rocm",)).as_text()


def custom_calls(text):
    return [line for line in text.splitlines() if "stablehlo.custom_call" in line]


def operand_count(line):
    inner = re.search(r"custom_call @\w+\(([^)]*)\)", line).group(1)
    return len([a for a in inner.split(",") if a.strip()])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("five_d", [False, True])
def test_sparse_decode_lowers_to_rocm_target(dtype, five_d):
    cache = spec((L, P, 2 * HKV, 128, 72) if five_d else (P, 2 * HKV, 128, 72), jnp.uint8)
    args = (spec((T, HKV * G, D), dtype), cache, spec((HKV, T, K), jnp.int32), spec((R, M), jnp.int32),
            spec((R,), jnp.int32), spec((), jnp.float32), spec((), jnp.float32))
    layer = spec((), jnp.int32) if five_d else None

    def fn(q, c, topk, bt, sl, ks, vs, *rest):
        return m3.sparse_decode(q, c, topk, bt, sl, ks, vs, decode_query_len=2,
                                layer=rest[0] if rest else None, layout="BLHNC" if five_d else "LBHNC")

    text = lowered(fn, *args, *([layer] if five_d else []))
    calls = custom_calls(text)
    assert len(calls) == 1 and "@m3sparse_sparse_decode_rocm" in calls[0]
    assert operand_count(calls[0]) == 8
    assert "decode_query_len = 2 : i64" in calls[0]
    assert re.search(r"layout = %d : i64" % (1 if five_d else 0), calls[0])
    assert re.search(r"scale = [0-9.e-]+ : f32", calls[0])


def test_sparse_prefill_lowers_to_rocm_target():
    args = (spec((T, HKV * G, D), jnp.float16), spec((P, 2 * HKV, 128, 72), jnp.uint8),
            spec((HKV, T, K), jnp.int32), spec((R, M), jnp.int32), spec((T,), jnp.int32),
            spec((T,), jnp.int32), spec((), jnp.float32), spec((), jnp.float32))
    calls = custom_calls(lowered(lambda *a: m3.sparse_prefill(*a), *args))
    assert len(calls) == 1 and "@m3sparse_sparse_prefill_rocm" in calls[0]
    assert operand_count(calls[0]) == 9


@pytest.mark.parametrize("group", [16, 8])
def test_full_attention_lowers_to_rocm_target(group):
    """The gfx950 kernels serve full attention (SPEC §5.7): no top-k list, so no K to refuse."""
    args = (spec((T, HKV * group, D), jnp.bfloat16), spec((L, P, 2 * HKV, 128, 72), jnp.uint8),
            spec((R, M), jnp.int32), spec((T,), jnp.int32), spec((T,), jnp.int32), spec((), jnp.float32),
            spec((), jnp.float32), spec((), jnp.int32))

    def fn(q, c, bt, req, pos, ks, vs, layer):
        return m3.full_attention(q, c, bt, req, pos, ks, vs, layer=layer, layout="BLHNC")

    calls = custom_calls(lowered(fn, *args))
    assert len(calls) == 1 and "@m3sparse_full_attention_rocm" in calls[0]
    assert operand_count(calls[0]) == 8
    assert "layout = 1 : i64" in calls[0] and "part_blocks = 32 : i64" in calls[0]


def test_full_attention_rocm_refuses_other_geometry():
    args = (spec((T, HKV * 4, D), jnp.bfloat16), spec((P, 2 * HKV, 128, 72), jnp.uint8), spec((R, M), jnp.int32),
            spec((T,), jnp.int32), spec((T,), jnp.int32), spec((), jnp.float32), spec((), jnp.float32))
    with pytest.raises(ValueError, match=r"num_heads / num_kv_heads must be one of \[8, 16\] \(got 4\)"):
        lowered(lambda *a: m3.full_attention(*a), *args)


def test_pack_lowers_with_cache_aliasing():
    args = (spec((P, 2 * HKV, 128, 72), jnp.uint8), spec((T, HKV, D), jnp.bfloat16),
            spec((T, HKV, D), jnp.bfloat16), spec((T,), jnp.int32), spec((), jnp.float32),
            spec((), jnp.float32))
    text = lowered(lambda *a: m3.pack_kv_pages(*a), *args, donate=(0,))
    calls = custom_calls(text)
    assert len(calls) == 1 and "@m3sparse_pack_kv_pages_rocm" in calls[0]
    assert operand_count(calls[0]) == 7
    assert "output_operand_aliases" in calls[0]


def test_positions_lowers_to_rocm_target():
    args = (spec((R + 1,), jnp.int32), spec((R,), jnp.int32))
    calls = custom_calls(lowered(lambda cu, ctx: m3.query_token_positions(cu, ctx, 16), *args))
    assert len(calls) == 1 and "@m3sparse_query_token_positions_rocm" in calls[0]


@pytest.mark.parametrize("key_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_select_blocks_lowers_to_rocm_target(key_dtype):
    args = (spec((T, HKV, 128), jnp.float32), spec((L, P, 128, 128), key_dtype), spec((R, M), jnp.int32),
            spec((T,), jnp.int32), spec((T,), jnp.int32), spec((), jnp.int32))

    def fn(q, k, bt, req, pos, layer):
        return m3.select_blocks(q, k, bt, req, pos, topk_blocks=5, local_blocks=2, layer=layer)

    calls = custom_calls(lowered(fn, *args))
    assert len(calls) == 1 and "@m3sparse_select_blocks_rocm" in calls[0]
    assert operand_count(calls[0]) == 6
    assert "topk_blocks = 5 : i64" in calls[0] and "local_blocks = 2 : i64" in calls[0]


def test_select_blocks_rocm_refuses_other_geometry():
    """The gfx950 kernel serves Di = 128, N = 128 only: anything else is refused when lowering."""
    args = (spec((T, HKV, 64), jnp.bfloat16), spec((P, 128, 64), jnp.bfloat16), spec((R, M), jnp.int32),
            spec((T,), jnp.int32), spec((T,), jnp.int32))
    with pytest.raises(ValueError, match="Di = 128 and N = 128; got Di = 64"):
        lowered(lambda *a: m3.select_blocks(*a), *args)


# grouped_matmul (SPEC §9): the gfx950 kernel for bf16 rows, every weight format
GM, GK, GN, GG = 24, 64, 96, 4
GROUPED_WEIGHTS = {"bf16": ((GG, GN, GK), jnp.bfloat16, None), "mxfp8": ((GG, GN, GK), jnp.float8_e4m3fn, 32),
                   "mxfp4": ((GG, GN, GK // 2), jnp.uint8, 32), "nvfp4": ((GG, GN, GK // 2), jnp.uint8, 16)}


@pytest.mark.parametrize("fmt", sorted(GROUPED_WEIGHTS))
def test_grouped_matmul_lowers_to_rocm_target(fmt):
    shape, dtype, block = GROUPED_WEIGHTS[fmt]
    scale = None if block is None else spec((GG, GN, GK // block), jnp.float8_e4m3fn if block == 16 else jnp.uint8)

    def fn(x, w, sizes, rows, rs, gs, *sc):
        return m3.grouped_matmul(x, w, sizes, *sc, lhs_rows=rows, row_scale=rs, group_scale=gs,
                                 activation="swiglu_oai", out_dtype=jnp.bfloat16)

    args = [spec((10, GK), jnp.bfloat16), spec(shape, dtype), spec((GG,), jnp.int32), spec((GM,), jnp.int32),
            spec((GM,), jnp.float32), spec((GG,), jnp.float32)] + ([scale] if scale else [])
    calls = custom_calls(lowered(fn, *args))
    assert len(calls) == 1 and "@m3sparse_grouped_matmul_rocm" in calls[0]
    assert operand_count(calls[0]) == 8
    assert "activation = 2 : i64" in calls[0] and "gather = 1 : i64" in calls[0]


@pytest.mark.parametrize("case", ["w8a8", "k48", "cols8"])
def test_grouped_matmul_rocm_falls_back_to_the_reference(case):
    """Calls the gfx950 kernel does not serve lower to the reference on rocm (no custom call):
    an MXFP8 lhs, K % 32 != 0, output columns % 16 != 0."""
    K = 48 if case == "k48" else GK
    N = 24 if case == "cols8" else GN
    x = spec((GM, K), jnp.float8_e4m3fn if case == "w8a8" else jnp.bfloat16)
    args = [x, spec((GG, N, K), jnp.float8_e4m3fn if case == "w8a8" else jnp.bfloat16), spec((GG,), jnp.int32)]
    kw = {}
    if case == "w8a8":
        args += [spec((GG, N, K // 32), jnp.uint8), spec((GM, K // 32), jnp.uint8)]

    def fn(x, w, sizes, *sc):
        if sc:
            return m3.grouped_matmul(x, w, sizes, sc[0], lhs_scale=sc[1])
        return m3.grouped_matmul(x, w, sizes, activation="swiglu" if case == "cols8" else None, **kw)

    assert custom_calls(lowered(fn, *args)) == []


def test_route_experts_lowers_to_rocm_target():
    args = (spec((T, 128), jnp.float32), spec((128,), jnp.float32), spec((T,), jnp.bool_))
    calls = custom_calls(lowered(lambda s, b, l: m3.route_experts(s, 4, bias=b, live=l), *args))
    assert len(calls) == 1 and "@m3sparse_route_experts_rocm" in calls[0]
    assert "k = 4 : i64" in calls[0]


def test_route_experts_rocm_falls_back_past_its_limits():
    """More experts than the gfx950 grouping kernel's LDS counters hold: the reference (no call)."""
    args = (spec((T, 5000), jnp.float32),)
    assert custom_calls(lowered(lambda s: m3.route_experts(s, 2), *args)) == []


def test_export_for_rocm_serializes():
    args = (spec((T, HKV * G, D), jnp.bfloat16), spec((P, 2 * HKV, 128, 72), jnp.uint8),
            spec((HKV, T, K), jnp.int32), spec((R, M), jnp.int32), spec((R,), jnp.int32),
            spec((), jnp.float32), spec((), jnp.float32))
    exp = jax.export.export(jax.jit(lambda *a: m3.sparse_decode(*a, decode_query_len=2)), platforms=["rocm"],
                            disabled_checks=m3.export_disabled_checks())(*args)
    assert exp.platforms == ("rocm",)
    assert "m3sparse_sparse_decode_rocm" in exp.mlir_module()
    assert len(exp.serialize()) > 0
