"""Loads the compiled FFI modules and registers their targets with XLA.

Each backend module exposes ``registrations() -> {target_name: capsule}``:
``_m3sparse_cpu`` (always built), ``_m3sparse_rocm`` (``M3SPARSE_ENABLE_ROCM=ON``),
``_m3sparse_cuda`` (``M3SPARSE_ENABLE_CUDA=ON``). A module that is absent leaves its
platform on the pure-JAX reference lowering (see ``_primitives.py``).
"""

from __future__ import annotations

import importlib

import jax

# Our platform name -> (module, the platform string register_ffi_target wants).
_MODULES = {
    "cpu": ("jax_m3sparse._m3sparse_cpu", "cpu"),
    "rocm": ("jax_m3sparse._m3sparse_rocm", "ROCM"),
    "cuda": ("jax_m3sparse._m3sparse_cuda", "CUDA"),
}

_registered: dict[str, set[str]] = {}
_import_errors: dict[str, str] = {}


def _load(platform: str) -> set[str]:
    module_name, xla_platform = _MODULES[platform]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        _import_errors[platform] = str(e)
        return set()
    names = set()
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=xla_platform)
        names.add(name)
    return names


def registered_targets(platform: str) -> set[str]:
    """The FFI target names registered for ``platform`` ("cpu", "rocm", "cuda")."""
    if platform not in _registered:
        _registered[platform] = _load(platform)
    return _registered[platform]


def target_name(op: str, platform: str) -> str:
    return f"m3sparse_{op}_{platform}"


def has_native(op: str, platform: str) -> bool:
    """True if the compiled module for ``platform`` serves ``op``."""
    return target_name(op, platform) in registered_targets(platform)


def import_error(platform: str) -> str | None:
    """Why the module of ``platform`` did not load (None if it did or was not tried)."""
    return _import_errors.get(platform)


OPS = ("pack_kv_pages", "query_token_positions", "sparse_decode", "sparse_prefill")


def export_disabled_checks(platforms=("cpu", "rocm", "cuda")):
    """The ``disabled_checks`` that let ``jax.export`` serialize our custom calls.

    jax.export refuses custom calls without a compatibility guarantee; ours are stable
    for a given jax_m3sparse version (docs/ffi_targets.md). Use as
    ``jax.export.export(jax.jit(f), platforms=[...], disabled_checks=export_disabled_checks())``.
    """
    return [jax.export.DisabledSafetyCheck.custom_call(target_name(op, p))
            for p in platforms for op in OPS]
