"""Loads the compiled FFI modules and registers their targets with XLA.

Each backend module exposes ``registrations() -> {target_name: capsule}``:
``_m3sparse_cpu`` (always built), ``_m3sparse_rocm`` (``M3SPARSE_ENABLE_ROCM=ON``),
``_m3sparse_cuda`` (``M3SPARSE_ENABLE_CUDA=ON``). An absent CPU module leaves cpu on the
pure-JAX reference lowering (see ``_primitives.py``); an absent cuda / rocm module leaves
their FFI lowering in place, with stand-in handlers that fail a run naming the module.

A module that should be there and is not is said once, loudly: a :class:`NativeModuleWarning`
naming the platform, the import error and the fix (the CPU module always; the CUDA/ROCm modules
when JAX has that platform's plugin installed or the module exists but fails to load). The
environment variable ``JAX_M3SPARSE_REQUIRE_NATIVE`` (a comma-separated list of platforms, or
``1`` for every platform that would warn) turns that into an ImportError.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings

import jax

# Our platform name -> (module, the platform string register_ffi_target wants).
_MODULES = {
    "cpu": ("jax_m3sparse._m3sparse_cpu", "cpu"),
    "rocm": ("jax_m3sparse._m3sparse_rocm", "ROCM"),
    "cuda": ("jax_m3sparse._m3sparse_cuda", "CUDA"),
}

# JAX plugin packages whose presence means the platform is in use here.
_PLUGINS = {"cuda": ("jax_cuda12_plugin", "jax_cuda13_plugin"),
            "rocm": ("jax_rocm60_plugin", "jax_rocm7_plugin")}
REQUIRE_ENV = "JAX_M3SPARSE_REQUIRE_NATIVE"

_registered: dict[str, set[str]] = {}
_import_errors: dict[str, str] = {}


class NativeModuleWarning(UserWarning):
    """A compiled jax_m3sparse module that should be loaded is not: its platform runs the
    pure-JAX reference (correct, much slower)."""


def _load(platform: str) -> set[str]:
    module_name, xla_platform = _MODULES[platform]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        _import_errors[platform] = f"{type(e).__name__}: {e}"
        _report_missing(platform, e)
        _register_stand_ins(platform)
        return set()
    names = set()
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=xla_platform)
        names.add(name)
    return names


def _register_stand_ins(platform: str) -> None:
    """The cuda and rocm lowerings emit our custom calls without a local module (a build box
    exports for GPUs it lacks): register, for each of that platform's targets, the CPU
    module's stand-in handler, which fails a run with a message naming the missing module
    (ffi/bindings/missing_module.cc), instead of XLA's "no handler registered"."""
    if platform == "cpu":
        return
    try:
        cpu = importlib.import_module(_MODULES["cpu"][0])
    except ImportError:  # no CPU module either: said already; XLA's own error it is
        return
    for op in ops_of(platform):
        jax.ffi.register_ffi_target(target_name(op, platform), cpu.missing_module_handler(platform),
                                    platform=_MODULES[platform][1])


def _expected(platform: str, error: ImportError) -> bool:
    """Whether a missing module of ``platform`` is worth saying (see the module docstring)."""
    if platform == "cpu" or not isinstance(error, ModuleNotFoundError):
        return True
    return any(importlib.util.find_spec(p) is not None for p in _PLUGINS.get(platform, ()))


def _required(platform: str) -> bool:
    wanted = {p.strip().lower() for p in os.environ.get(REQUIRE_ENV, "").split(",")}
    return platform in wanted or bool(wanted & {"1", "all", "true"})


def _report_missing(platform: str, error: ImportError) -> None:
    if not (_expected(platform, error) or _required(platform)):
        return
    module_name = _MODULES[platform][0]
    here = os.path.dirname(os.path.abspath(__file__))
    consequence = (f"every jax_m3sparse op on {platform} now runs the pure-JAX reference "
                   "(correct but much slower)") if platform == "cpu" else (
        f"programs lowered for {platform} still call its kernels (so they can be exported), and "
        f"running one here fails naming this module (jax_m3sparse.reference has pure-JAX ops)")
    message = (
        f"jax_m3sparse: the native {platform} module {module_name} did not load "
        f"({type(error).__name__}: {error}); {consequence}. The package was imported from {here}. "
        "Fix: build it (`pip install --no-build-isolation -e .` in the source tree, or install "
        "the wheel); if that directory is a source checkout without the built module, it is "
        "shadowing the installed package: run from another directory. "
        f"Set {REQUIRE_ENV}={platform} to make this an error.")
    if _required(platform):
        raise ImportError(message) from error
    warnings.warn(message, NativeModuleWarning, stacklevel=2)


def native_platforms() -> tuple[str, ...]:
    """The platforms ("cpu", "rocm", "cuda") whose compiled jax_m3sparse module is loaded.

    On a platform not listed, every op lowers to the pure-JAX reference (``cpu``), or
    (``cuda``, ``rocm``) to the FFI call, which needs the module where the program runs (a
    run without it fails naming the module). Why a module did not load: the
    :class:`NativeModuleWarning` given at import.
    """
    return tuple(p for p in _MODULES if registered_targets(p))


def native_module(platform: str) -> tuple[str, str | None]:
    """The compiled module of ``platform`` ("cpu", "rocm", "cuda"): (its import name, e.g.
    ``"jax_m3sparse._m3sparse_cpu"``; why it did not load, or None if it is loaded). Loads it
    if not tried yet. Raises ValueError for another platform name.
    """
    if platform not in _MODULES:
        raise ValueError(f"unknown platform {platform!r}; expected one of {sorted(_MODULES)}")
    loaded = bool(registered_targets(platform))
    return _MODULES[platform][0], None if loaded else (import_error(platform) or "not built")


def cpu_attention_paths() -> tuple[tuple[str, ...], str] | None:
    """The CPU module's attention paths (BUILD.md "CPU attention paths"): (every path this CPU supports,
    narrowest first, from "generic", "avx2", "avx512", "amx"; the one a call takes now — the
    widest, capped by the environment variable ``M3SPARSE_CPU_ISA``), or None without the CPU
    module. Raises ValueError if ``M3SPARSE_CPU_ISA`` names no path. ``select_blocks`` has two
    codes: it runs its ``avx2`` code on the ``avx512`` and ``amx`` paths.
    """
    if "cpu" not in native_platforms():
        return None
    module = importlib.import_module(_MODULES["cpu"][0])
    return tuple(module.cpu_paths()), module.cpu_path()


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


OPS = ("pack_kv_pages", "query_token_positions", "sparse_decode", "sparse_prefill",
       "full_attention", "select_blocks", "write_index_keys", "grouped_matmul", "route_experts",
       "dense_matmul")
# Ops with a kernel on some platforms only (the others lower them to the reference or, for
# full_attention on the CPU, to another op's kernel).
_ONLY_ON = {"grouped_matmul": ("cpu", "cuda", "rocm"), "dense_matmul": ("cuda",), "route_experts": ("cuda", "rocm"),
            "full_attention": ("cuda", "rocm"),
            "write_index_keys": ("cpu",)}


def ops_of(platform: str) -> tuple[str, ...]:
    """The ops whose FFI target ``platform``'s module registers (docs/ffi_targets.md)."""
    return tuple(op for op in OPS if platform in _ONLY_ON.get(op, (platform,)))


def export_disabled_checks(platforms=("cpu", "rocm", "cuda")):
    """The ``disabled_checks`` that let ``jax.export`` serialize our custom calls.

    jax.export refuses custom calls without a compatibility guarantee; ours are stable
    for a given jax_m3sparse version (docs/ffi_targets.md). Use as
    ``jax.export.export(jax.jit(f), platforms=[...], disabled_checks=export_disabled_checks())``.
    """
    return [jax.export.DisabledSafetyCheck.custom_call(target_name(op, p))
            for p in platforms for op in OPS]
