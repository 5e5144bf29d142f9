"""Tensor parallel over a 1-D mesh axis "tp", Megatron style, by shardings (and one shard_map).

Each weight gets a ``NamedSharding`` (:func:`param_specs`); ``jax.jit`` partitions the step:

* attention: the fused ``qkv_proj [S, C, H]`` (attention.py) over its stored-KV-head groups,
  so each device computes its query heads, its KV head (one replica of it when "tp" exceeds
  Hkv, jax_m3sparse.sharding) and its index head; ``o_proj`` row-parallel (XLA adds the
  all-reduce after it). In the checkpoint layout (loading): ``q_proj`` column-parallel,
  ``k_proj``/``v_proj`` column-parallel when "tp" divides Hkv, else replicated;
* MLPs (dense, shared expert, every routed expert): the intermediate axis split over "tp"
  (``gate_up_proj [..., 2, I, H]`` on I, ``down_proj [..., H, I]`` on I); ``moe.mlp`` runs them
  in a ``shard_map`` ending in one ``psum``. No device holds all of any expert's weights;
* ``embed_tokens`` and ``lm_head`` over the vocabulary (``[V, H]`` on V): the lookup is a
  masked local lookup and one ``psum`` of ``[T, H]``, the head an all-gather of the sampled
  rows' ``[S, V]`` logits (model.embed, model.logits_of); neither table is ever gathered;
* the NVFP4 cache over its head-slot axis (jax_m3sparse.sharding.cache_spec): our ops run per
  device on local KV heads with no collective; norms, router, indexer and the comparison
  stream's caches are replicated.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jax_m3sparse import sharding as shd

AXIS = "tp"


def is_shape(x) -> bool:
    """A leaf of model.param_shapes' pytree (a tuple of ints)."""
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def make_mesh(tp: int) -> jax.sharding.Mesh:
    if jax.device_count() < tp:
        raise ValueError(f"--tp {tp} needs {tp} devices, JAX sees {jax.device_count()} "
                         f"({jax.default_backend()}); on the CPU set XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={tp} before JAX starts")
    return jax.make_mesh((tp,), (AXIS,), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:tp])


def tp_size() -> int:
    """The "tp" axis size of the mesh in context (``jax.set_mesh``); 1 without one."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or AXIS not in mesh.axis_names else mesh.shape[AXIS]


def tp_partitioned() -> bool:
    """Whether this trace's arrays are split over "tp" by ``jax.jit`` (an Auto "tp" axis of
    size > 1 in context), as opposed to no mesh, one device, or the per-device body of a
    ``shard_map`` (a Manual axis). A custom call without a sharding rule there would have its
    operands gathered."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names or mesh.shape[AXIS] == 1:
        return False
    return mesh.axis_types[mesh.axis_names.index(AXIS)] != AxisType.Manual


def check_divisible(cfg, tp: int) -> None:
    """Raises ValueError naming each size that ``tp`` does not divide."""
    sizes = dict(num_attention_heads=cfg.num_attention_heads,
                 dense_intermediate_size=cfg.dense_intermediate_size,
                 intermediate_size=cfg.intermediate_size,
                 shared_intermediate_size=cfg.shared_intermediate_size,
                 vocab_size=cfg.vocab_size)
    bad = [f"{k} = {v}" for k, v in sizes.items() if v % tp]
    if not bad and cfg.quantized_experts and (cfg.intermediate_size // tp) % 32:
        raise ValueError(f"--tp {tp} with {cfg.expert_format} experts needs intermediate_size "
                         f"/ tp = {cfg.intermediate_size // tp} to be a multiple of 32 "
                         f"(down_proj's scales, one per 32 or 16 inputs, are split with its "
                         f"inputs)")
    if bad:
        raise ValueError(f"--tp {tp} must divide " + ", ".join(bad))


def leaf_spec(path, cfg, tp: int) -> P:
    """The PartitionSpec of one parameter, by its path in the pytree (model.param_shapes);
    a path inside one layer (no leading "segments") gives the per-layer spec (moe.mlp)."""
    names = [getattr(k, "key", None) for k in path]
    stacked = names[0] == "segments"                  # leading layer axis
    lead = (None,) if stacked else ()
    leaf, parent = names[-1], names[-2] if len(names) > 1 else None
    if parent == "experts" and leaf.endswith("_scale"):   # block scales: as their weights
        leaf = leaf[:-len("_scale")]                      # (NVFP4's per-expert scale_2: P())
    if names == [leaf] and leaf in ("embed_tokens", "lm_head"):    # [V, H], vocab-parallel
        return P(AXIS, None)
    if parent == "self_attn":
        if leaf == "qkv_proj":       # [S, C, H] by stored KV head; replicated unless tp divides S
            return P(*lead, AXIS, None, None) if cfg.cache_kv_heads % tp == 0 else P()
        if leaf == "q_proj" or (leaf in ("k_proj", "v_proj") and cfg.num_key_value_heads % tp == 0):
            return P(*lead, AXIS, None)
        if leaf == "o_proj":
            return P(*lead, None, AXIS)
    if leaf == "gate_up_proj":
        return P(*lead, *(None,) * (parent == "experts"), None, AXIS, None)
    if leaf == "down_proj":
        return P(*lead, *(None,) * (parent == "experts"), None, AXIS)
    return P()


def param_shardings(shapes: dict, cfg, mesh) -> dict:
    """A ``NamedSharding`` per leaf of ``shapes`` (model.param_shapes) on ``mesh``."""
    tp = mesh.shape[AXIS]
    check_divisible(cfg, tp)
    return jax.tree_util.tree_map_with_path(
        lambda path, _: NamedSharding(mesh, leaf_spec(path, cfg, tp)), shapes, is_leaf=is_shape)


def shard(params: dict, caches: dict, cfg, mesh) -> tuple[dict, dict]:
    """Places ``params`` (a no-op for leaves already placed so) and ``caches`` on ``mesh``."""
    specs = jax.tree_util.tree_map_with_path(
        lambda path, _: NamedSharding(mesh, leaf_spec(path, cfg, mesh.shape[AXIS])), params)
    params = jax.tree_util.tree_map(jax.device_put, params, specs)
    caches = {k: jax.device_put(c, NamedSharding(mesh, shd.cache_spec(AXIS, c.ndim)
                                                 if k == "kv" else P()))
              for k, c in caches.items()}
    return params, caches


def bytes_per_device(x) -> int:
    """Bytes of ``x`` held by one device (its first addressable shard)."""
    return x.addressable_shards[0].data.nbytes
