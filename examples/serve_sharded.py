"""Serving on many devices: a tensor-parallel, donated pack + decode step under plain jax.jit.

    python examples/serve_sharded.py          # 8 simulated CPU devices; GPUs when present

MiniMax M3's attention heads (64 query, 4 KV) at TP 8: each KV head is stored on 2 devices,
each device holds 1 KV head and its 8 query heads, and every op runs on local heads with no
collective. README.md "Serving on many devices" walks through it.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_m3sparse as m3  # noqa: E402
from jax_m3sparse import sharding as shd  # noqa: E402

TP, HQ, HKV, D, LAYERS, PAGES = 8, 64, 4, 128, 2, 16
mesh = jax.make_mesh((TP,), ("tp",), devices=jax.devices()[:TP])
r = shd.kv_head_replicas(HKV, TP)                      # 2 copies of each KV head
spec = shd.tp_cache_spec(m3.KVCacheSpec(HKV, D), TP)   # the global cache stores 8 KV heads
cache = shd.allocate_sharded_kv_cache(spec, PAGES, mesh, num_layers=LAYERS)


@functools.partial(jax.jit, donate_argnums=0)
def step(cache, layer, key, value, q, topk, slots, block_table, seq_lens):
    """key/value [T, Hkv, D], q [R, Hq, D], topk [Hkv, R, K]: the model's own head counts."""
    cache = m3.pack_kv_pages(cache, shd.replicate_kv_heads(key, r),
                             shd.replicate_kv_heads(value, r), slots, 1.0, 1.0, layer=layer,
                             layout="LBHNC")
    out = m3.sparse_decode(q, cache, shd.replicate_kv_heads(topk, r, axis=0), block_table,
                           seq_lens, 1.0, 1.0, layer=layer, layout="LBHNC")
    return cache, out


rng = np.random.default_rng(0)
heads = NamedSharding(mesh, shd.head_specs("tp")["q"])       # P(None, "tp", None)
# 4 KV heads cannot split 8 ways: K/V come replicated (each device keeps its replica's slice).
key, value = (jax.device_put(rng.standard_normal((300, HKV, D), np.float32),
                             NamedSharding(mesh, P())) for _ in range(2))
q = jax.device_put(rng.standard_normal((2, HQ, D), np.float32), heads)
topk = jnp.asarray([[[0, 1, -1]] * 2] * HKV, jnp.int32)     # blocks 0 and 1 of each request
block_table = jnp.asarray([[0, 1], [2, 3]], jnp.int32)      # request r owns pages 2r, 2r + 1
slots = jnp.concatenate([jnp.arange(150), 256 + jnp.arange(150)]).astype(jnp.int32)
seq_lens = jnp.asarray([150, 150], jnp.int32)
args = (jnp.int32(1), key, value, q, topk, slots, block_table, seq_lens)

hlo = step.lower(cache, *args).compile().as_text()
collectives = re.findall(r"all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter",
                         hlo)
cache, out = step(cache, *args)
print(f"devices {TP}; cache {cache.shape} sharded {cache.sharding.spec}: "
      f"{cache.addressable_shards[0].data.nbytes / 2**20:.2f} of "
      f"{cache.nbytes / 2**20:.2f} MiB per device")
print(f"out {out.shape} sharded {out.sharding.spec}; collectives in the compiled step: "
      f"{len(collectives)}")
one = jax.jit(step.__wrapped__)(jax.device_put(np.zeros(cache.shape, np.uint8), jax.devices()[0]),
                                *(jax.device_put(np.asarray(a), jax.devices()[0]) for a in args))
print(f"equal to one device: {np.allclose(np.asarray(out), np.asarray(one[1]), atol=1e-6)}")
