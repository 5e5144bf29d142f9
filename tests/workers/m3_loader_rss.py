"""Run by tests/example/test_m3_loader.py in fresh processes: writes a > 2 GB random bf16 checkpoint
directory (``write DIR``), or loads one lazily and prints host-memory figures (``load DIR``).

The writer builds each shard from random bf16 bit patterns (no fp32 copy, one shard in memory);
the loader reports, in bytes: the process's resident set before loading (``baseline``), its
peak during loading (``VmHWM``), the loaded parameters' bytes (on the CPU backend the "device"
arrays live in host memory) and the largest tensor.
"""

import json
import os
import sys

import numpy as np

# examples/ on PYTHONPATH (the launcher, tests/example/test_m3_loader.py, sets it)
from minimax_m3.config import DENSE_MLP, FULL, MOE, ModelConfig

# 6 MoE layers of 32 experts: experts.gate_up_proj is 256 MiB per layer, about 2.3 GB in all.
CFG = ModelConfig(vocab_size=32000, hidden_size=1024, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=1, index_n_heads=1,
                  num_local_experts=32, intermediate_size=2048, shared_intermediate_size=1024,
                  dense_intermediate_size=1024, layer_types=(FULL,) * 6,
                  mlp_layer_types=(DENSE_MLP,) + (MOE,) * 5)
SHARD_BYTES = 600 << 20


def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def write(path):
    import ml_dtypes
    import jax
    from safetensors.numpy import save_file

    from minimax_m3.checkpoint import Source, _sources, _write_index, to_hf_config
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(to_hf_config(CFG), f)
    top, segments = _sources(CFG, "transformers")
    srcs = jax.tree_util.tree_leaves((top, segments), is_leaf=lambda x: isinstance(x, Source))
    rng = np.random.default_rng(0)
    shard, size, n = {}, 0, 0
    for name, shape in ((nm, s) for src in srcs for nm, s in zip(src.names, src.stored)):
        # bf16 values in [1, 2) with random mantissas: a sign-0, exponent-127 bit pattern.
        bits = rng.integers(0x3F80, 0x4000, size=shape, dtype=np.uint16)
        if shard and size + bits.nbytes > SHARD_BYTES:
            n += 1
            save_file(shard, os.path.join(path, f"model-{n:05d}.safetensors"))
            shard, size = {}, 0
        shard[name], size = bits.view(ml_dtypes.bfloat16), size + bits.nbytes
    save_file(shard, os.path.join(path, f"model-{n + 1:05d}.safetensors"))
    _write_index(path)


def load(path):
    import jax

    from minimax_m3 import model, parallel
    from minimax_m3.checkpoint import load_params
    shardings = parallel.param_shardings(model.param_shapes(CFG), CFG, parallel.make_mesh(1))
    jax.block_until_ready(jax.numpy.zeros(8) + 1)          # the backend is up before baseline
    baseline = status("VmRSS")
    params = load_params(path, CFG, shardings)
    jax.block_until_ready(params)
    leaves = jax.tree_util.tree_leaves(params)
    per_layer = [x.nbytes // x.shape[0] for x in jax.tree_util.tree_leaves(params["segments"])]
    largest = max(per_layer + [params[k].nbytes for k in ("embed_tokens", "lm_head", "norm")])
    print(json.dumps(dict(baseline=baseline, peak=status("VmHWM"), final=status("VmRSS"),
                          params=sum(x.nbytes for x in leaves), largest=largest,
                          dtypes=sorted({str(x.dtype) for x in leaves}))))


if __name__ == "__main__":
    {"write": write, "load": load}[sys.argv[1]](sys.argv[2])
