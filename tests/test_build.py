"""The CPU FFI module is built and serves every primitive (else the suite would only test
the reference fallback)."""

import jax_m3sparse as m3
from jax_m3sparse import _ffi


def test_cpu_module_registers_every_target():
    assert _ffi.import_error("cpu") is None
    for op in _ffi.ops_of("cpu"):
        assert _ffi.has_native(op, "cpu"), op
    assert not _ffi.has_native("grouped_matmul", "cpu")   # CUDA only: the reference lowering


def test_cpu_lowering_is_the_custom_call():
    import jax
    import jax.numpy as jnp
    cache = m3.allocate_kv_cache(m3.KVCacheSpec(1), 1)
    k = jnp.zeros((2, 1, 128), jnp.bfloat16)
    text = jax.jit(lambda c, k: m3.pack_kv_pages(c, k, k, jnp.zeros(2, jnp.int32), 1.0, 1.0)) \
        .lower(cache, k).as_text()
    assert "custom_call @m3sparse_pack_kv_pages_cpu" in text
    assert "output_operand_aliases" in text


def test_export_needs_only_the_core_dependencies():
    """Exported.serialize() imports flatbuffers; README's first install command
    installs the core dependencies only, so flatbuffers must be one of them."""
    import pathlib
    import re
    text = (pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    core = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    assert re.search(r'"flatbuffers[<>=!~ ]', core), core
