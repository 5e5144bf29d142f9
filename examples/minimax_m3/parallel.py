"""Tensor parallel over a 1-D mesh axis "tp", Megatron style, by shardings alone.

Only the weights and caches are placed; ``jax.jit`` partitions the step from there:

* attention: ``wq`` column-parallel (query heads over "tp"), ``wo`` row-parallel (XLA adds the
  all-reduce after it); ``wk``/``wv`` column-parallel when "tp" divides Hkv, else replicated
  (each device computes every KV head and keeps its replica, jax_m3sparse.sharding);
* MLP: ``w_gate``/``w_up`` column-parallel, ``w_down`` row-parallel;
* the NVFP4 cache over its head-slot axis (jax_m3sparse.sharding.cache_spec): our ops run per
  device on local KV heads with no collective; embeddings, norms, the indexer, the bf16
  comparison caches are replicated.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jax_m3sparse import sharding as shd

AXIS = "tp"
_COLUMN = ("wq", "w_gate", "w_up")
_ROW = ("wo", "w_down")


def make_mesh(tp: int) -> jax.sharding.Mesh:
    if jax.device_count() < tp:
        raise ValueError(f"--tp {tp} needs {tp} devices, JAX sees {jax.device_count()} "
                         f"({jax.default_backend()}); on the CPU set XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={tp} before JAX starts")
    return jax.make_mesh((tp,), (AXIS,), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:tp])


def _weight_spec(name: str, cfg, tp: int) -> P:
    """Stacked layer weights are ``[layers, in, out]``."""
    if name in _COLUMN or (name in ("wk", "wv") and cfg.num_kv_heads % tp == 0):
        return P(None, None, AXIS)
    if name in _ROW:
        return P(None, AXIS, None)
    return P()


def shard(params: dict, caches: dict, cfg, mesh) -> tuple[dict, dict]:
    """Places ``params`` and ``caches`` on ``mesh`` (see the module docstring)."""
    tp = mesh.shape[AXIS]
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    params = {k: ({n: put(w, _weight_spec(n, cfg, tp)) for n, w in v.items()}
                  if isinstance(v, dict) else put(v, P())) for k, v in params.items()}
    caches = {k: put(c, shd.cache_spec(AXIS, c.ndim) if k == "kv" else P())
              for k, c in caches.items()}
    return params, caches


def bytes_per_device(x) -> int:
    """Bytes of ``x`` held by one device (its first addressable shard)."""
    return x.addressable_shards[0].data.nbytes
