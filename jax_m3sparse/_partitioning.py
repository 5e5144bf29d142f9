"""How the native ops partition over KV heads under plain ``jax.jit`` (docs/DESIGN.md, "Sharding").

XLA computes a custom call it knows nothing about on all-gathered operands. Two things, both
attached to the plain FFI custom call (so ``jax.export`` still serializes the module: no Python
callback lives in it), make each device run our kernel on its own KV heads instead:

1. A Shardy sharding rule (``sdy.sharding_rule``) on the call, for propagation: one factor
   ``h`` (the KV head) runs through the cache's head-slot axis (as ``h × 2``: K/V slot pairs
   stay together, SPEC §3.1), q / out / key / value head axes (``h × G``) and ``topk_indices``
   axis 0. Every other dimension needs replication.
2. An XLA custom-call partitioner registered under the target's name. XLA's SPMD partitioner
   calls it with the operands' shardings; it answers with the shardings every operand and
   result must have (the cache's head tiling carried to the other head axes, everything else
   replicated) and the per-device module: the same custom call, same attributes, local shapes.
   A cache sharded along any other axis, or with a K/V slot pair split across devices, is
   rejected with an error naming the expected ``PartitionSpec`` (never a silent gather).

The registration hooks (``register_custom_call_partitioner``, ``register_plugin_callbacks``) are
the ones ``jax.experimental.custom_partitioning`` itself uses; they are private JAX API, kept to
this one file and tested on every supported jax version (tests/library/test_sharding.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import numpy as np
from jax._src import xla_bridge
from jax._src.lib import xla_client
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import sdy
from jax.interpreters import mlir

from jax_m3sparse import _checks

_log = logging.getLogger("jax_m3sparse.partitioning")


@dataclasses.dataclass(frozen=True)
class ResultAxis:
    """A result that mirrors no operand: its KV-head axis (negative counts from the end)."""

    axis: int


@dataclasses.dataclass(frozen=True)
class HeadAxes:
    """Where the KV-head axis is in each operand and result of a primitive.

    Args:
      operands: per operand, the axis holding KV heads (``h`` or ``h × k`` slots, negative
        counts from the end) or None (the operand is replicated).
      results: per result, the index of the operand it mirrors (same shape, same factors), or
        a :class:`ResultAxis` (its own shape, heads on that axis, every other axis replicated).
      cache: index of the operand whose sharding decides the partitioning (the KV cache, or
        ``idx_q`` for select_blocks).
      per_head: entries per KV head on that operand's head axis: 2 for the cache (a K/V slot
        pair, never split), 1 for an operand with one entry per KV head.
    """

    operands: tuple
    results: tuple
    cache: int
    per_head: int = 2

    def axis(self, i: int, ndim: int) -> int | None:
        a = self.operands[i]
        return None if a is None else a % ndim

    def result_axis(self, j: int, shapes, result_ndim: int) -> int | None:
        """Head axis of result j (of rank ``result_ndim``); ``shapes`` are the operands'."""
        r = self.results[j]
        if isinstance(r, ResultAxis):
            return r.axis % result_ndim
        return self.axis(r, len(shapes[r]))


def sharding_rule(heads: HeadAxes, in_types, out_types):
    """The ``sdy.op_sharding_rule`` attribute: factor ``h`` (KV heads) on every head axis,
    a need-replication factor on every other dimension."""
    shapes = [ir.RankedTensorType(t).shape for t in in_types]
    out_shapes = [ir.RankedTensorType(t).shape for t in out_types]
    num_kv_heads = (shapes[heads.cache][heads.axis(heads.cache, len(shapes[heads.cache]))]
                    // heads.per_head)
    if num_kv_heads <= 1:
        return None  # nothing to split (Shardy rejects a size-1 factor in a compound; Hkv = 0)
    sizes = [num_kv_heads]  # factor 0 is h

    def mapping(i, shape, head_axis):
        dims = []
        for d, size in enumerate(shape):
            if d == head_axis:
                if size % num_kv_heads:
                    raise ValueError(f"{i}: head axis {size} is not a multiple of "
                                     f"Hkv = {num_kv_heads}")
                factors = [0]
                if size != num_kv_heads:  # h × (slot pair | query heads per KV head)
                    sizes.append(size // num_kv_heads)
                    factors.append(len(sizes) - 1)
            else:
                sizes.append(size)
                factors = [len(sizes) - 1]
            dims.append(sdy.DimMappingAttr.get(factor_indices=factors))
        return sdy.TensorMappingAttr.get(dim_mappings=dims)

    mappings = [mapping(f"operand {i}", shape, heads.axis(i, len(shape)))
                for i, shape in enumerate(shapes)]
    results = [mapping(f"result {j}", out, heads.result_axis(j, shapes, len(out)))
               if isinstance(heads.results[j], ResultAxis) else mappings[heads.results[j]]
               for j, out in enumerate(out_shapes)]
    return sdy.OpShardingRuleAttr.get(
        factor_sizes=sizes, operand_mappings=mappings, result_mappings=results,
        need_replication_factors=list(range(1, len(sizes))), is_custom=True)


def attach_rule(results, heads: HeadAxes, operand_types):
    """Puts the sharding rule on the custom call that produced ``results``."""
    rule = sharding_rule(heads, operand_types, [r.type for r in results])
    if rule is not None:
        results[0].owner.attributes["sdy.sharding_rule"] = rule


# ---- the partitioner XLA calls at compile time ----------------------------------------------

def _tiling(sharding):
    """(device array [data dims..., subgroup dims...], subgroup types) of a tiled sharding,
    or None for replicated / maximal / manual shardings."""
    if not sharding.is_tiled():
        return None
    dims = sharding.tile_assignment_dimensions()
    devices = np.asarray(sharding.tile_assignment_devices()).reshape(dims)
    types = list(sharding.subgroup_types())
    if sharding.replicate_on_last_tile_dim():
        types = [xla_client.OpSharding.Type.REPLICATED]
    return devices, types


def _sharding(devices, types):
    proto = xla_client.OpSharding()
    proto.type = xla_client.OpSharding.Type.OTHER
    proto.tile_assignment_dimensions = list(devices.shape)
    proto.tile_assignment_devices = [int(d) for d in devices.ravel()]
    if types == [xla_client.OpSharding.Type.REPLICATED]:
        proto.replicate_on_last_tile_dim = True
    elif types:
        proto.last_tile_dims = types
    return xla_client.HloSharding.from_proto(proto)


def _with_head_tiling(cache_sharding, cache_rank, cache_axis, rank, axis):
    """The cache's sharding re-expressed for an operand of ``rank`` with its head axis at
    ``axis`` (None: replicated over the head shards). Same devices, same subgroups (manual or
    replicated tails from ``shard_map`` / other mesh axes)."""
    tiling = _tiling(cache_sharding)
    if tiling is None:
        return cache_sharding
    devices, types = tiling
    heads = devices.reshape(devices.shape[cache_axis], *devices.shape[cache_rank:])
    if axis is not None:
        shape = [1] * rank
        shape[axis] = heads.shape[0]
        return _sharding(heads.reshape(*shape, *heads.shape[1:]), types)
    replicated = xla_client.OpSharding.Type.REPLICATED
    if replicated in types:  # fold the head shards into the existing replication group
        k = types.index(replicated) + 1
        heads = np.moveaxis(heads, 0, k - 1).reshape(
            *heads.shape[1:k], heads.shape[0] * heads.shape[k], *heads.shape[k + 1:])
    else:
        heads, types = np.moveaxis(heads, 0, -1), types + [replicated]
    if heads.size == heads.shape[-1] and types == [replicated]:
        return xla_client.HloSharding.replicate()
    return _sharding(heads.reshape(*([1] * rank), *heads.shape), types)


def _check_cache_sharding(sharding, shape, op, heads: HeadAxes):
    tiling = _tiling(sharding)
    if tiling is None:
        return
    shards = tiling[0].shape[:len(shape)]
    try:
        if heads.per_head == 2:
            _checks.reject_cache_sharding(shape, shards, how=str(sharding))
        else:
            _reject_head_operand_sharding(shape, shards, heads.axis(heads.cache, len(shape)),
                                          str(sharding))
    except ValueError as e:
        raise ValueError(f"{op}: {e}") from None


def _reject_head_operand_sharding(shape, shards, axis, how):
    """The deciding operand of an op without a cache operand (select_blocks' idx_q): only its
    KV-head axis may be split, evenly."""
    want = ", ".join("'tp'" if d == axis else "None" for d in range(len(shape)))
    bad = [d for d in range(len(shape)) if d != axis and shards[d] != 1]
    if bad or shape[axis] % shards[axis]:
        raise ValueError(f"operand {list(shape)} sharded as {how}: jax_m3sparse partitions only "
                         f"over its KV-head axis {axis}, split evenly: shard it as "
                         f"PartitionSpec({want}) and replicate its other axes (for more devices "
                         f"than KV heads, replicate KV heads: jax_m3sparse.sharding)")


def _tensor_type(shape) -> str:
    dims = "".join(f"{d}x" for d in shape.dimensions())
    return f"tensor<{dims}{mlir.dtype_to_ir_type(np.dtype(shape.numpy_dtype()))}>"


def _local_module(target, backend_config: str, operand_shapes, result_shapes, aliases) -> bytes:
    """The per-device computation: the same custom call on local shapes."""
    with mlir.make_ir_context():
        return mlir.module_to_bytecode(ir.Module.parse(_local_text(
            target, backend_config, [_tensor_type(s) for s in operand_shapes],
            [_tensor_type(s) for s in result_shapes], aliases)))


def _local_text(target, backend_config, operand_types, result_types, aliases) -> str:
    args = ", ".join(f"%arg{i}: {t}" for i, t in enumerate(operand_types))
    names = ", ".join(f"%arg{i}" for i in range(len(operand_types)))
    outs = ", ".join(result_types)
    alias = ", ".join(
        f"#stablehlo.output_operand_alias<output_tuple_indices = "
        f"[{'' if len(result_types) == 1 else o}], operand_index = {i}, operand_tuple_indices = []>"
        for i, o in (aliases or {}).items())
    refs = ", ".join(f"%0#{k}" if len(result_types) > 1 else "%0"
                     for k in range(len(result_types)))
    text = (f"module @m3sparse_shard {{\n func.func public @main({args}) -> ({outs}) {{\n"
            f"  %0{':' + str(len(result_types)) if len(result_types) > 1 else ''} = "
            f"stablehlo.custom_call @{target}({names}) {{api_version = 4 : i32, "
            f"backend_config = {backend_config or '{}'}"
            f"{', output_operand_aliases = [' + alias + ']' if alias else ''}}} : "
            f"({', '.join(operand_types)}) -> ({outs})\n"
            f"  return {refs} : {outs}\n }}\n}}")
    return text


def _partition(target, heads: HeadAxes, aliases, arg_shapes, arg_shardings, result_shape,
               result_sharding, backend_config):
    cache_shape = arg_shapes[heads.cache].dimensions()
    cache_axis = heads.axis(heads.cache, len(cache_shape))
    cache_sharding = arg_shardings[heads.cache]
    _check_cache_sharding(cache_sharding, cache_shape, target, heads)
    shardings = [
        _with_head_tiling(cache_sharding, len(cache_shape), cache_axis,
                          len(s.dimensions()), heads.axis(i, len(s.dimensions())))
        for i, s in enumerate(arg_shapes)]
    results = result_shape.tuple_shapes() if result_shape.is_tuple() else [result_shape]
    out_shardings = _result_shardings(heads, arg_shapes, arg_shardings, results)
    module = _local_module(
        target, backend_config.decode() if isinstance(backend_config, bytes) else backend_config,
        [sh.tile(s) for sh, s in zip(shardings, arg_shapes)],
        [sh.tile(s) for sh, s in zip(out_shardings, results)], aliases)
    out = (xla_client.HloSharding.tuple_sharding(result_shape, out_shardings)
           if result_shape.is_tuple() else out_shardings[0])
    _log.debug("%s: operands %s -> %s, result %s", target, [str(s) for s in arg_shardings],
               [str(s) for s in shardings], out)
    return module, shardings, out


def _infer_from_operands(heads: HeadAxes, arg_shapes, arg_shardings, result_shape, _config):
    """GSPMD propagation (Shardy uses the rule instead): results follow the cache's tiling."""
    results = result_shape.tuple_shapes() if result_shape.is_tuple() else [result_shape]
    outs = _result_shardings(heads, arg_shapes, arg_shardings, results)
    if result_shape.is_tuple():
        return xla_client.HloSharding.tuple_sharding(result_shape, outs)
    return outs[0]


def _result_shardings(heads: HeadAxes, arg_shapes, arg_shardings, results):
    """Each result's sharding: the deciding operand's head tiling on the result's head axis."""
    cache_shape = arg_shapes[heads.cache].dimensions()
    cache_axis = heads.axis(heads.cache, len(cache_shape))
    shapes = [s.dimensions() for s in arg_shapes]
    return [_with_head_tiling(arg_shardings[heads.cache], len(cache_shape), cache_axis,
                              len(r.dimensions()),
                              heads.result_axis(j, shapes, len(r.dimensions())))
            for j, r in enumerate(results)]


def _keep_user_sharding(user_sharding, _shape, _config):
    return user_sharding


def register(target: str, platform: str, heads: HeadAxes, aliases):
    """Registers the partitioner of FFI target ``target`` (lowered for ``platform``)."""
    callbacks = dict(
        prop_user_sharding=_keep_user_sharding,
        partition=functools.partial(_partition, target, heads, aliases),
        infer_sharding_from_operands=functools.partial(_infer_from_operands, heads),
        can_side_effecting_have_replicated_sharding=True)
    if platform == "cpu":
        xla_client.register_custom_call_partitioner(target, **callbacks)
    else:  # GPU plugins take it through their C API when they load
        xla_bridge.register_plugin_callbacks(functools.partial(
            xla_client.register_custom_call_partitioner, name=target, **callbacks))
