"""``--dry-run``: the model at any size, built abstractly, and what one device must hold.

No weight is read or allocated: the step is traced with ``jax.eval_shape`` over
``ShapeDtypeStruct`` parameters and caches (so the real M3 config is checked end to end: every
shape of every layer), and the bytes per device follow from each leaf's PartitionSpec
(parallel.py) and the caches' layout. Not counted: activations and XLA's workspace (a prefill
chunk's, a few GB at M3 size), and the framework's own reserve.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp

import jax_m3sparse as m3
from jax_m3sparse.sharding import kv_head_replicas

from . import model
from .parallel import AXIS, check_divisible, is_shape, leaf_spec

JAX_MEM_FRACTION = 0.75   # the share of a GPU JAX's pool takes when XLA_PYTHON_CLIENT_MEM_FRACTION is unset


def _per_device(shape, spec, tp: int) -> int:
    """Elements of one device's shard of ``shape`` under ``spec``."""
    dims = [d // tp if ax == AXIS else d for d, ax in zip(shape, (*spec, *(None,) * len(shape)))]
    return math.prod(dims)


def plan(cfg, *, tp: int, context_len: int, batch: int, weight_dtype="bfloat16",
         device_memory_gb: float | None = None, reserve_gb: float = 8.0,
         mem_fraction: float | None = None) -> dict:
    """Per-device bytes of weights and caches of ``cfg`` at tensor parallel ``tp`` for
    ``batch`` requests of ``context_len`` tokens (the served stream alone: ``--no-compare``),
    whether the step traces, and whether it fits JAX's pool on a device of
    ``device_memory_gb`` (``mem_fraction`` of it: by default
    ``$XLA_PYTHON_CLIENT_MEM_FRACTION``, else JAX's 0.75) with ``reserve_gb`` left for
    activations; with ``device_memory_gb``, ``formats`` also gives that for each routed-
    experts format on the device (bf16, mxfp8, nvfp4, mxfp4) and index-key cache dtype (bf16, fp8), with
    the requests of ``context_len`` tokens that fit (``max_requests``) and the requests that fit
    at each of :func:`plan_contexts` (``max_requests_at``).

    Raises:
      ValueError when ``tp`` does not divide the model's sizes, ``context_len`` exceeds the
      model's ``max_position_embeddings``, or ``mem_fraction`` is not in (0, 1].
    """
    source = "--mem-fraction"
    if mem_fraction is None:
        source = "XLA_PYTHON_CLIENT_MEM_FRACTION"
        raw = os.environ.get(source, str(JAX_MEM_FRACTION))
        try:
            mem_fraction = float(raw)
        except ValueError:
            raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION must be a number in (0, 1], got "
                             f"{raw!r}") from None
    if not 0 < mem_fraction <= 1:
        raise ValueError(f"mem_fraction (XLA_PYTHON_CLIENT_MEM_FRACTION) must be in (0, 1], "
                         f"got {mem_fraction}")
    if context_len < 1 or batch < 1:
        raise ValueError(f"context_len ({context_len}) and batch ({batch}) must be >= 1")
    if context_len > cfg.max_position_embeddings:
        raise ValueError(f"context_len {context_len} exceeds the model's max_position_embeddings "
                         f"{cfg.max_position_embeddings} (config.json)")
    check_divisible(cfg, tp)
    cfg = dataclasses.replace(cfg, kv_replicas=kv_head_replicas(cfg.num_key_value_heads, tp))
    shapes = model.param_shapes(cfg)
    weight_bytes = _weight_bytes(cfg, tp, weight_dtype)
    # parameters: the checkpoint's elements, whatever the experts' format (the served qkv_proj
    # repeats replicated KV heads; block scales are part of their weights' format)
    total_weights = sum(math.prod(s) for s in jax.tree_util.tree_leaves(
        model.param_shapes(dataclasses.replace(cfg, expert_format="bf16"), fused=False),
        is_leaf=is_shape))
    pages = batch * -(-context_len // cfg.block_size)
    kv_bytes, idx_bytes = _cache_bytes(cfg, tp, pages, cfg.index_cache_dtype)
    traced = _trace(cfg, shapes, weight_dtype, pages, batch)
    out = dict(tp=tp, context_len=context_len, batch=batch, pages=pages,
               parameters=total_weights, weight_dtype=str(jnp.dtype(weight_dtype)) + (
                   f", routed experts {cfg.expert_format}" if cfg.quantized_experts else ""),
               weight_bytes_per_device=weight_bytes, kv_cache_bytes_per_device=kv_bytes,
               index_cache_bytes_per_device=idx_bytes, index_cache_dtype=cfg.index_cache_dtype,
               total_bytes_per_device=weight_bytes + kv_bytes + idx_bytes,
               cache_kv_heads=cfg.cache_kv_heads, step_logits=traced)
    if device_memory_gb:
        out["device_memory_bytes"] = int(device_memory_gb * 1e9)
        out["mem_fraction"] = mem_fraction
        out["mem_fraction_source"] = source
        out["pool_bytes"] = int(device_memory_gb * 1e9 * mem_fraction)
        out["reserve_bytes"] = int(reserve_gb * 1e9)
        out["fits"] = out["total_bytes_per_device"] + out["reserve_bytes"] <= out["pool_bytes"]
        out["formats"] = _formats(cfg, tp, context_len, batch, weight_dtype,
                                  out["pool_bytes"] - out["reserve_bytes"])
    return out


def _weight_bytes(cfg, tp: int, weight_dtype) -> int:
    """One device's bytes of ``cfg``'s weights at ``tp`` (each leaf's shard by its spec)."""
    per_leaf = jax.tree_util.tree_map_with_path(
        lambda path, s, dt: _per_device(s, leaf_spec(path, cfg, tp), tp) * dt.itemsize,
        model.param_shapes(cfg), model.param_dtypes(cfg, weight_dtype), is_leaf=is_shape)
    return sum(jax.tree_util.tree_leaves(per_leaf))


def _cache_bytes(cfg, tp: int, pages: int, index_dtype) -> tuple[int, int]:
    """One device's bytes of the NVFP4 K/V cache and of the index-key cache for ``pages``."""
    spec = m3.KVCacheSpec(cfg.cache_kv_heads // tp, cfg.head_dim, cfg.block_size)
    idx = (len(cfg.sparse_layers) * pages * cfg.block_size * cfg.index_head_dim
           * jnp.dtype(index_dtype).itemsize)
    return cfg.num_layers * pages * spec.page_bytes, idx


def plan_contexts(cfg, context_len: int) -> tuple[int, ...]:
    """The contexts the plan's grid shows: 8k, 32k, 128k and 1M tokens up to the model's
    ``max_position_embeddings``, and ``context_len``."""
    grid = {c for c in (8192, 32768, 131072, 1048576) if c <= cfg.max_position_embeddings}
    return tuple(sorted(grid | {context_len}))


def _formats(cfg, tp, context_len, batch, weight_dtype, budget) -> list[dict]:
    """Per device, for each routed-experts format on the device and index-key cache dtype:
    weight, NVFP4 K/V and index-key cache bytes for ``batch`` requests of ``context_len``,
    whether they fit ``budget`` bytes, how many requests of ``context_len`` tokens fit it, and
    (``max_requests_at``) how many fit at each of :func:`plan_contexts`."""
    per_request = lambda ctx, index: _cache_bytes(cfg, tp, -(-ctx // cfg.block_size), index)
    rows = []
    for experts in ("bf16", "mxfp8", "nvfp4", "mxfp4"):
        weights = _weight_bytes(dataclasses.replace(cfg, expert_format=experts), tp, weight_dtype)
        room = max(budget - weights, 0)
        for index in ("bfloat16", "float8_e4m3fn"):
            kv, idx = per_request(context_len, index)
            rows.append(dict(experts=experts, index_cache_dtype=index, weight_bytes=weights,
                             kv_cache_bytes=batch * kv, index_cache_bytes=batch * idx,
                             cache_bytes=batch * (kv + idx),
                             fits=weights + batch * (kv + idx) <= budget,
                             max_requests=room // (kv + idx),
                             max_requests_at={c: room // sum(per_request(c, index))
                                              for c in plan_contexts(cfg, context_len)}))
    return rows


def _trace(cfg, shapes, weight_dtype, pages, requests: int) -> tuple[int, ...]:
    """The logits shape of one decode step of ``requests`` requests (every row sampled),
    traced abstractly (no weights, no caches allocated)."""
    import inspect  # noqa: PLC0415
    params = jax.tree_util.tree_map(jax.ShapeDtypeStruct, shapes,
                                    model.param_dtypes(cfg, weight_dtype), is_leaf=is_shape)
    R, M = requests, 4
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    batch = dict(tokens=i32(R), slot_mapping=i32(R), query_lens=i32(R), context_lens=i32(R),
                 block_table=i32(R, M))
    # The step's interface as it is: the served stream only; logits of the sampled rows.
    takes = inspect.signature(model.forward_step).parameters
    kw = dict(compare=False) if "compare" in takes else {}
    if "return_logits" in takes:
        from . import sampling  # noqa: PLC0415
        kw["return_logits"] = True
        batch.update(jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                            sampling.batch_arrays(list(range(R)))))
    alloc = inspect.signature(model.allocate_caches).parameters
    caches = jax.eval_shape(lambda: model.allocate_caches(
        cfg, min(pages, 64), **({"compare": False} if "compare" in alloc else {})))
    _, out = jax.eval_shape(lambda p, c, b: model.forward_step(
        p, c, b, cfg=cfg, num_decode_requests=R, decode_query_len=1, **kw), params, caches, batch)
    return tuple(out["logits"].shape)


def weight_bytes_per_device(cfg, dtype, shardings=None) -> int:
    """Bytes of ``cfg``'s weights in ``dtype`` that one device holds: each leaf's shard under
    ``shardings`` (a pytree of ``NamedSharding``, as parallel.param_shardings gives), else the
    whole model."""
    shapes = model.param_shapes(cfg)
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=is_shape)
    sizes = [dt.itemsize for dt in treedef.flatten_up_to(model.param_dtypes(cfg, dtype))]
    if shardings is None:
        return sum(math.prod(s) * b for s, b in zip(leaves, sizes))
    places = treedef.flatten_up_to(shardings)
    return sum(math.prod(sh.shard_shape(s)) * b for s, sh, b in zip(leaves, places, sizes))


def available_memory(devices) -> tuple[int, str]:
    """(bytes one device can still take, where that number comes from). Accelerators: XLA's
    pool (``bytes_limit − bytes_in_use``); the CPU: the host's ``MemAvailable`` shared by all
    ``devices`` (every CPU device lives in host memory)."""
    d = devices[0]
    stats = d.memory_stats() if d.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0), f"{d.device_kind} XLA pool"
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    return avail // len(devices), f"host MemAvailable / {len(devices)} device(s)"


def check_fits(cfg, dtype, shardings=None, *, cache_bytes: int = 0,
               reserve_fraction: float = 0.05) -> dict:
    """Raises MemoryError, naming the numbers, when ``cfg``'s weights in ``dtype`` (sharded by
    ``shardings``) plus ``cache_bytes`` per device leave less than ``reserve_fraction`` of a
    device's available memory (activations, workspace). Arithmetic only: allocates nothing.
    Returns the numbers (bytes) when it fits."""
    devices = (sorted({d for sh in jax.tree_util.tree_leaves(shardings) for d in sh.device_set},
                      key=lambda d: d.id) if shardings is not None else jax.devices()[:1])
    weights = weight_bytes_per_device(cfg, dtype, shardings)
    avail, source = available_memory(devices)
    need = weights + cache_bytes
    out = dict(weight_bytes_per_device=weights, cache_bytes_per_device=cache_bytes,
               available_bytes_per_device=avail, devices=len(devices))
    if need > avail * (1 - reserve_fraction):
        gb = lambda b: f"{b / 1e9:,.1f} GB"
        raise MemoryError(
            f"the model does not fit: {gb(weights)} of {jnp.dtype(dtype).name} weights + "
            f"{gb(cache_bytes)} of caches per device = {gb(need)} > {gb(avail)} available "
            f"({source}) less {reserve_fraction:.0%} kept for activations, on {len(devices)} "
            f"device(s); nothing was allocated. Plan it with --dry-run (plan.plan), or use "
            f"more devices (--tp), bfloat16, or fewer layers")
    return out


def format_plan(p: dict) -> str:
    gb = lambda b: f"{b / 1e9:,.1f} GB"
    lines = [
        f"dry run: {p['parameters'] / 1e9:,.3g} B parameters ({p['weight_dtype']}), tp {p['tp']}, "
        f"{p['batch']} requests × {p['context_len']} tokens ({p['pages']} pages of 128); the "
        f"decode step of {p['batch']} requests traces (logits {p['step_logits']})",
        f"  weights per device:        {gb(p['weight_bytes_per_device'])}",
        f"  NVFP4 K/V cache per device: {gb(p['kv_cache_bytes_per_device'])} "
        f"({p['cache_kv_heads']} KV heads stored, {p['cache_kv_heads'] // p['tp']} per device)",
        f"  index-key cache per device: {gb(p['index_cache_bytes_per_device'])} ({p['index_cache_dtype']}, replicated)",
        f"  total per device:           {gb(p['total_bytes_per_device'])}"
        + (f" of {gb(p['pool_bytes'])} ({p['mem_fraction'] * 100:g} % of {gb(p['device_memory_bytes'])}, "
           f"JAX's pool): {'fits' if p['fits'] else 'does NOT fit'} "
           f"with {gb(p['reserve_bytes'])} kept for activations" if "fits" in p else ""),
        "  (the served stream alone, as with --no-compare; activations and XLA workspace not "
        + ("counted; JAX's pool is XLA_PYTHON_CLIENT_MEM_FRACTION of a GPU, 75 % unless set)"
           if p.get("mem_fraction_source") != "--mem-fraction" else
           "counted; the pool as --mem-fraction says: set XLA_PYTHON_CLIENT_MEM_FRACTION to "
           "that for the run)")]
    if "formats" in p:
        contexts = list(p["formats"][0]["max_requests_at"])
        ctx = lambda c: f"{c // 1048576}M" if c % 1048576 == 0 else (
            f"{c // 1024}k" if c % 1024 == 0 else str(c))
        lines.append(f"  each format in that pool less {gb(p['reserve_bytes'])}: per device, GB of "
                     f"weights, K/V and index keys (keys: their cache's dtype) for {p['batch']} requests × "
                     f"{p['context_len']} tokens, and the requests that fit at each context:")
        lines.append("    experts keys  | weights    K/V   keys | fits | " + " ".join(
            f"{ctx(c):>6s}" for c in contexts))
        for f in p["formats"]:
            idx = "bf16" if f["index_cache_dtype"] == "bfloat16" else "fp8"
            lines.append(f"    {f['experts']:7s} {idx:5s} | {f['weight_bytes'] / 1e9:7.1f} "
                         f"{f['kv_cache_bytes'] / 1e9:6.1f} {f['index_cache_bytes'] / 1e9:6.1f} | "
                         f"{'yes ' if f['fits'] else 'NO  '} | " + " ".join(
                             f"{f['max_requests_at'][c]:6d}" for c in contexts))
        lines.append("  (every checkpoint format loads into every experts format (--expert-format): "
                     "the experts are quantized on the "
                     "device — exactly for the MXFP8 and MXFP4 checkpoints — or, in the format "
                     "they are stored in (nvfp4, mxfp4), kept as stored)")
    return "\n".join(lines)
