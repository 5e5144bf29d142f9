"""The CPU FFI module is built and serves every primitive (else the suite would only test
the reference fallback)."""

import jax_m3sparse as m3
from jax_m3sparse import _ffi


def test_cpu_module_registers_every_target():
    assert _ffi.import_error("cpu") is None
    for op in _ffi.ops_of("cpu"):
        assert _ffi.has_native(op, "cpu"), op
    assert not _ffi.has_native("dense_matmul", "cpu")   # CUDA only: the reference lowering


def test_cpu_lowering_is_the_custom_call():
    import jax
    import jax.numpy as jnp
    cache = m3.allocate_kv_cache(m3.KVCacheSpec(1), 1)
    k = jnp.zeros((2, 1, 128), jnp.bfloat16)
    text = jax.jit(lambda c, k: m3.pack_kv_pages(c, k, k, jnp.zeros(2, jnp.int32), 1.0, 1.0)) \
        .lower(cache, k).as_text()
    assert "custom_call @m3sparse_pack_kv_pages_cpu" in text
    assert "output_operand_aliases" in text
    lhs, rhs = jnp.zeros((4, 32), jnp.bfloat16), jnp.zeros((2, 8, 32), jnp.bfloat16)
    sizes = jnp.asarray([1, 3], jnp.int32)
    text = jax.jit(m3.grouped_matmul).lower(lhs, rhs, sizes).as_text()
    assert "custom_call @m3sparse_grouped_matmul_cpu" in text
    # an MXFP8 lhs (W8A8) is the reference's on the CPU: no custom call
    a8, ae = m3.mxfp8_quantize(lhs)
    w8, we = m3.mxfp8_quantize(rhs)
    text = jax.jit(lambda *a: m3.grouped_matmul(*a[:4], lhs_scale=a[4])).lower(
        a8, w8, sizes, we, ae).as_text()
    assert "m3sparse_grouped_matmul_cpu" not in text


def test_export_needs_only_the_core_dependencies():
    """Exported.serialize() imports flatbuffers; README's first install command
    installs the core dependencies only, so flatbuffers must be one of them."""
    import pathlib
    import re
    text = (pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    core = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    assert re.search(r'"flatbuffers[<>=!~ ]', core), core


def test_package_stands_alone():
    """What the wheel ships imports nothing from the source checkout (tests/, ffi/, tools/,
    benchmarks/), edits no sys.path, and only the bench loads the bench's loop module; the
    bench reads the native modules through the public API."""
    import ast
    import pathlib
    root = pathlib.Path(m3.__file__).parent
    bad = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).as_posix()
        text = path.read_text()
        if "sys.path" in text:
            bad.append(f"{rel}: sys.path")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):     # `from a import b` may import module a.b
                here = rel[:-3].replace("/", ".").rsplit(".", node.level)[0] if node.level else ""
                module = ".".join(p for p in (here, node.module) if p)
                names = [module] + [f"{module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] in {"tests", "ffi", "tools", "benchmarks"}:
                    bad.append(f"{rel}: imports {name}")
                if "bench" in path.parts and name == "jax_m3sparse._ffi":
                    bad.append(f"{rel}: imports the private {name}")
        if "_m3sparse_cpu_bench" in text and "bench" not in path.parts:
            bad.append(f"{rel}: loads the bench module")
    assert not bad, bad
    assert m3.native_module("cpu") == ("jax_m3sparse._m3sparse_cpu", None)
