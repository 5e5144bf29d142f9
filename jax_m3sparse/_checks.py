"""Trace-time argument checks: every message names the argument, expected and actual (SPEC §7)."""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

from jax_m3sparse.spec import INDEX_KEY_DTYPES, LAYOUTS, layout_code

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def index_arrays(**named):
    """``jnp.asarray`` of each argument, in order. An integer input that is not yet a JAX array
    (NumPy, a list) is checked first: values outside int32 are a ValueError naming it, since
    JAX (64-bit types off) would wrap them to 32 bits, into other pages or requests."""
    out = []
    for name, x in named.items():
        if not isinstance(x, (jax.Array, jax.core.Tracer)):
            a = np.asarray(x)
            wide = a.dtype.itemsize > 4 or a.dtype == np.uint32        # can exceed int32
            if a.dtype.kind in "iu" and wide and a.size:
                info = np.iinfo(np.int32)
                lo, hi = int(a.min()), int(a.max())
                if lo < info.min or hi > info.max:
                    raise ValueError(f"{name} has values outside int32 ([{lo}, {hi}]); the ops take "
                                     f"int32 indices (JAX would wrap these to 32 bits)")
        out.append(jnp.asarray(x))
    return out


def rank(x, name, expected: int, shape_doc: str):
    if x.ndim != expected:
        raise ValueError(f"{name} must have rank {expected} ({shape_doc}), got shape {x.shape}")


def dtype(x, name, allowed):
    allowed = tuple(np.dtype(a) for a in allowed)
    if x.dtype not in allowed:
        names = " or ".join(str(a) for a in allowed)
        raise TypeError(f"{name} must be {names}, got {x.dtype}")


def dim(name, what, expected, actual):
    if expected != actual:
        raise ValueError(f"{name}: {what} must be {expected}, got {actual}")


def scalar(x, name, dt):
    """A rank-0 operand of dtype ``dt`` (a Python number or a 0-d array, may be traced).
    Integer operands (``layer``) must be integers: a float would be silently truncated."""
    x = jnp.asarray(x)
    if x.ndim != 0:
        raise ValueError(f"{name} must be a scalar (shape ()), got shape {x.shape}")
    want_int = jnp.issubdtype(dt, jnp.integer)
    ok = jnp.issubdtype(x.dtype, jnp.integer) if want_int else (
        jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer))
    if not ok or x.dtype == jnp.bool_:
        raise TypeError(f"{name} must be {'an integer' if want_int else 'a number'}, got {x.dtype}")
    return x.astype(dt)


def static_int(x, name, minimum):
    """A static Python int >= minimum (shapes and loop counts are compiled in)."""
    try:
        value = operator.index(x)
    except TypeError:
        raise TypeError(f"{name} must be a static int, got {x!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def static_values(x):
    """x as a NumPy array if its values are static (a Python number or sequence, a NumPy
    array or scalar), else None: a jax.Array, concrete or traced, is data with a defined
    result for any value (SPEC §7)."""
    if isinstance(x, (bool, int, float, list, tuple, np.ndarray, np.generic)):
        return np.asarray(x)
    return None


def static_layer(layer, num_layers, shape, cache_name="kv_cache"):
    """A static layer outside [0, L) is the caller's bug, which a defined empty result would
    hide: ValueError naming it. A jax.Array layer keeps SPEC §3.3's defined result (read
    nothing / write nothing)."""
    value = static_values(layer)
    if value is None or value.ndim or not np.issubdtype(value.dtype, np.integer):
        return
    if not 0 <= int(value) < num_layers:
        article = "an" if cache_name[0] in "aeiou" else "a"
        raise ValueError(f"layer must be in [0, {num_layers}) for {article} {cache_name} of "
                         f"{num_layers} layers (shape {tuple(shape)}), got {int(value)}")


def cache_geometry(kv_cache, layer, layout):
    """Checks a 4-D/5-D uint8 cache with its layer/layout; returns (layer operand, layout code,
    num_layers, num_pages, num_slots, block_size, head_dim)."""
    if kv_cache.dtype != jnp.uint8:
        raise TypeError(f"kv_cache must be uint8, got {kv_cache.dtype}")
    if kv_cache.ndim not in (4, 5):
        raise ValueError(f"kv_cache must be 4-D [P, 2Hkv, N, C] or 5-D ({' / '.join(LAYOUTS)}), "
                         f"got shape {kv_cache.shape}")
    if kv_cache.ndim == 5 and layer is None:
        raise ValueError(f"layer is required for a 5-D kv_cache (shape {kv_cache.shape}); "
                         "pass the layer index (int32 scalar, may be traced)")
    code = layout_code(layout, kv_cache.ndim)
    if kv_cache.ndim == 4 and layer is not None:
        raise ValueError(f"layer must be None for a 4-D kv_cache (shape {kv_cache.shape})")
    if kv_cache.ndim == 4:
        num_layers, num_pages = 1, kv_cache.shape[0]
    elif code == 0:
        num_layers, num_pages = kv_cache.shape[:2]
    else:
        num_pages, num_layers = kv_cache.shape[:2]
    num_slots, block_size, full_dim = kv_cache.shape[-3:]
    if full_dim % 9 or (full_dim * 16 // 9) % 32:
        raise ValueError(f"kv_cache last dim must be D/2 + D/16 (72 for D = 128) with D a "
                         f"multiple of 32, got {full_dim}")
    if num_slots % 2:
        raise ValueError(f"kv_cache head-slot dim must be 2·Hkv (even), got {num_slots}")
    cache_sharding(kv_cache)
    layer_op = scalar(0 if layer is None else layer, "layer", jnp.int32)
    if layer is not None:
        static_layer(layer, num_layers, kv_cache.shape)
    return layer_op, code, num_layers, num_pages, num_slots, block_size, full_dim * 16 // 9


def cache_sharding(kv_cache):
    """Under Explicit mesh axes the cache's sharding is known while tracing: reject what the
    partitioner would reject (docs/DESIGN.md, "Sharding"), naming the PartitionSpec to use."""
    sharding = getattr(jax.typeof(kv_cache), "sharding", None)
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if not spec or mesh is None or mesh.empty:
        return
    spec = tuple(spec) + (None,) * (kv_cache.ndim - len(spec))
    names = [s if isinstance(s, tuple) else (s,) for s in spec]
    shards = [int(np.prod([mesh.shape[n] for n in ns if n is not None])) for ns in names]
    axis_name = next((s for s in spec if s is not None), "tp")
    reject_cache_sharding(kv_cache.shape, shards, axis_name, f"spec {spec}")


def reject_cache_sharding(shape, shards, axis_name="tp", how=""):
    """ValueError unless a cache of ``shape`` split ``shards[d]`` ways along each dim d keeps
    every K/V slot pair on one device and splits nothing but the head-slot axis. Shared by the
    trace-time check above and the XLA partitioner (_partitioning.py)."""
    axis = len(shape) - 3
    want = ", ".join(repr(axis_name) if d == axis else "None" for d in range(len(shape)))
    fix = (f"jax_m3sparse partitions only over the KV-head slot axis: shard the cache as "
           f"PartitionSpec({want}) (jax_m3sparse.sharding.cache_spec) and replicate its other "
           f"axes; for more devices than KV heads replicate KV heads "
           f"(jax_m3sparse.sharding.replicate_kv_heads).")
    bad = [d for d in range(len(shape)) if d != axis and shards[d] != 1]
    if bad:
        raise ValueError(f"kv_cache {list(shape)} is sharded along axis {bad}"
                         f"{f' ({how})' if how else ''}. {fix}")
    if shape[axis] % shards[axis] or (shape[axis] // shards[axis]) % 2:
        raise ValueError(f"kv_cache head-slot axis ({shape[axis]} slots = 2·Hkv) split into "
                         f"{shards[axis]} shards cuts a K/V slot pair (SPEC §3.1). {fix}")


def index_cache(idx_k_cache, layer, di, di_of):
    """Checks a 3-D ``[P, N, Di]`` / 4-D ``[L, P, N, Di]`` index-key cache (bf16 or fp8) with
    its ``layer`` (Di: that of the argument named ``di_of``); returns the int32 layer operand
    (0 for a 3-D cache)."""
    if idx_k_cache.ndim not in (3, 4):
        raise ValueError(f"idx_k_cache must have rank 3 ([P, N, Di]) or 4 ([L, P, N, Di]), "
                         f"got shape {idx_k_cache.shape}")
    dtype(idx_k_cache, "idx_k_cache", INDEX_KEY_DTYPES)
    if idx_k_cache.shape[-1] != di:
        raise ValueError(f"{di_of} has Di = {di} but idx_k_cache (shape {idx_k_cache.shape}) has "
                         f"Di = {idx_k_cache.shape[-1]}: they must match")
    if idx_k_cache.ndim == 4 and layer is None:
        raise ValueError(f"layer is required for a 4-D idx_k_cache (shape {idx_k_cache.shape}); "
                         "pass the layer index (int32 scalar, may be traced)")
    if idx_k_cache.ndim == 3 and layer is not None:
        raise ValueError(f"layer must be None for a 3-D idx_k_cache (shape {idx_k_cache.shape})")
    if layer is not None:
        static_layer(layer, idx_k_cache.shape[0], idx_k_cache.shape, "idx_k_cache")
    return scalar(0 if layer is None else layer, "layer", jnp.int32)
