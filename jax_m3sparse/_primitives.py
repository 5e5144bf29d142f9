"""The one way a jax_m3sparse primitive is defined.

:func:`define_primitive` makes a ``jax.extend.core.Primitive`` with

* an abstract-eval rule (shapes and dtypes only; ``jax.eval_shape`` runs no handler),
* a lowering per platform to ``custom_call @m3sparse_<op>_<platform>`` with the operands and
  attributes of ``docs/ffi_targets.md`` — for ``cpu`` when the compiled module is present, for
  ``cuda`` and ``rocm`` always (GPU code is exported from machines without a GPU; a run
  without the module fails naming it), with ``unsupported_reason(platform=...)`` applied,
* a fallback lowering to the pure-JAX reference (``mlir.lower_fun``) for every other platform
  and for ``cpu`` when its module is not built,
* a batching rule: ``vmap`` over any operands runs the primitive once per batch element
  (``lax.map``), which is exact for every op, including the in-place cache update,
* a JVP rule that raises "inference-only" (SPEC §7): JAX's own error would not say why; it runs
  only when a tangent reaches the op, so operands under ``stop_gradient`` are fine,
* for ops with a KV-head axis, partitioning over KV heads under plain ``jax.jit``: a Shardy
  sharding rule on the custom call and an XLA partitioner for its target
  (``_partitioning.py``), so a cache sharded over head slots is never gathered.

Static attributes are passed to the FFI call as explicit numpy scalars.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_m3sparse import _ffi, _partitioning
from jax_m3sparse._partitioning import HeadAxes

# Platforms whose lowering is the FFI custom call even without a local module: GPU programs
# are exported from build boxes without the GPU (and its module); a run without the module
# fails naming it (_ffi.py's stand-ins). cpu without its module lowers to the reference.
_ALWAYS_NATIVE = ("rocm", "cuda")


def define_primitive(op: str, *, abstract_eval: Callable, reference: Callable,
                     attributes: Callable[..., dict], multiple_results: bool = False,
                     operand_output_aliases: dict[int, int] | None = None,
                     native_platforms=("cpu", "rocm", "cuda"),
                     platform_reason: Callable | None = None,
                     reference_when: Callable | None = None,
                     head_axes: HeadAxes | None = None,
                     lowerings: dict[str, Callable] | None = None) -> Primitive:
    """Defines primitive ``m3sparse_<op>``.

    Args:
      op: the op's name; FFI targets are ``m3sparse_<op>_<platform>``.
      abstract_eval: ``(*avals, **params) -> ShapedArray | tuple``.
      reference: ``(*operands, **params) -> result(s)`` in pure jnp (the fallback lowering).
      attributes: ``(**params) -> {name: numpy scalar}``, the FFI attributes.
      multiple_results: the primitive returns a tuple.
      operand_output_aliases: ``{operand index: result index}`` for in-place results.
      native_platforms: platforms that may have an FFI target for this op.
      platform_reason: ``(platform, *avals, **params) -> str | None``: why that platform's
        kernels cannot serve these shapes; raised as ValueError when lowering for it.
      reference_when: ``(platform, *avals, **params) -> bool``: calls that platform's kernels
        do not serve and that lower to the reference there instead (a kernel that covers the
        common shapes of an op whose reference is cheap enough for the rest).
      head_axes: where each operand's KV-head axis is; None for ops without one (their
        operands are small and replicated).
      lowerings: ``{platform: fn}`` for platforms without this op's FFI target that serve it
        through other primitives: ``fn(*operands, **params)`` in JAX, lowered in place of the
        reference (full_attention on the CPU: sparse_prefill with every block selected).
    """
    prim = Primitive(f"m3sparse_{op}")
    prim.multiple_results = multiple_results
    prim.def_abstract_eval(abstract_eval)
    prim.def_impl(lambda *args, **params: jax.jit(functools.partial(prim.bind, **params))(*args))

    reference_rule = mlir.lower_fun(reference, multiple_results=multiple_results)
    mlir.register_lowering(prim, reference_rule)
    for platform in native_platforms:
        native = _ffi.has_native(op, platform)  # loads the module (or its stand-ins) first
        if native or platform in _ALWAYS_NATIVE:
            target = _ffi.target_name(op, platform)
            mlir.register_lowering(
                prim, _ffi_rule(target, attributes, operand_output_aliases,
                                functools.partial(platform_reason, platform) if platform_reason
                                else None, head_axes,
                                functools.partial(reference_when, platform) if reference_when
                                else None, reference_rule),
                platform=platform)
            if head_axes is not None:
                _partitioning.register(target, platform, head_axes, operand_output_aliases)

    for platform, fn in (lowerings or {}).items():
        mlir.register_lowering(prim, mlir.lower_fun(fn, multiple_results=multiple_results),
                               platform=platform)

    batching.primitive_batchers[prim] = functools.partial(_batch_by_map, prim)
    ad.primitive_jvps[prim] = functools.partial(_no_derivative, op)
    return prim


def _no_derivative(op, primals, tangents, **params):
    raise NotImplementedError(
        f"jax_m3sparse.{op} is inference-only: it has no derivative (SPEC §7). Put "
        "jax.lax.stop_gradient on its float operands where they depend on what you "
        "differentiate, or differentiate a pure-jnp model instead (jax_m3sparse.reference).")


def _ffi_rule(target: str, attributes: Callable, aliases, reason: Callable | None,
              head_axes: HeadAxes | None, fallback: Callable | None = None,
              reference_rule: Callable | None = None):
    rule = jax.ffi.ffi_lowering(target, operand_output_aliases=aliases)

    def lower(ctx, *args, **params):
        if fallback is not None and fallback(*ctx.avals_in, **params):
            return reference_rule(ctx, *args, **params)
        why = reason(*ctx.avals_in, **params) if reason else None
        if why:
            raise ValueError(why)
        results = rule(ctx, *args, **attributes(**params))
        if head_axes is not None:
            _partitioning.attach_rule(results, head_axes, [a.type for a in args])
        return results

    return lower


def _batch_by_map(prim, args, dims, **params):
    """vmap rule: one primitive call per batch element, via ``lax.map``."""
    batched = [d is not None for d in dims]
    moved = [jax.numpy.moveaxis(a, d, 0) if b else a for a, d, b in zip(args, dims, batched)]
    mapped = [a for a, b in zip(moved, batched) if b]

    def one(xs):
        it = iter(xs)
        call = [next(it) if b else a for a, b in zip(moved, batched)]
        return prim.bind(*call, **params)

    out = jax.lax.map(one, mapped)
    if prim.multiple_results:
        return out, [0] * len(out)
    return out, 0


def f32(x) -> np.float32:
    return np.float32(x)


def i64(x) -> np.int64:
    return np.int64(x)
