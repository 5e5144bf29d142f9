"""safetensors checkpoints in Hugging Face naming (``model.layers.{i}.self_attn.q_proj.weight``).

Linear weights are stored ``[out, in]`` (the PyTorch convention) and transposed on load; the
loader checks every name and shape against the config and names what is missing, unexpected
or mis-shaped. The names follow the usual HF decoder layout plus
``self_attn.indexer.{q,k}_proj`` / ``{q,k}_norm`` for the indexer; the real MiniMax M3
checkpoint (MoE experts, other sizes) does not fit this small dense-MLP model as is.
"""

from __future__ import annotations

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from .config import ModelConfig
from .model import unflatten, param_shapes

# our per-layer key -> (HF suffix, stored transposed)
_LAYER_NAMES = {
    "ln1": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "wo": ("self_attn.o_proj.weight", True),
    "ln2": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
    "w_iq": ("self_attn.indexer.q_proj.weight", True),
    "w_ik": ("self_attn.indexer.k_proj.weight", True),
    "iq_norm": ("self_attn.indexer.q_norm.weight", False),
    "ik_norm": ("self_attn.indexer.k_norm.weight", False),
}
_TOP_NAMES = {"embed": ("model.embed_tokens.weight", False),
              "final_norm": ("model.norm.weight", False),
              "lm_head": ("lm_head.weight", True)}


def _layer_groups(cfg: ModelConfig):
    """(group, first global layer index, count)."""
    return (("dense", 0, cfg.num_dense_layers),
            ("sparse", cfg.num_dense_layers, cfg.num_sparse_layers))


def hf_tensors(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The params as ``{HF name: float32 array}`` (one tensor per layer, [out, in])."""
    out = {}
    for key, (name, t) in _TOP_NAMES.items():
        a = np.asarray(params[key], np.float32)
        out[name] = np.ascontiguousarray(a.T if t else a)
    for group, first, n in _layer_groups(cfg):
        for key, stacked in params.get(group, {}).items():
            suffix, t = _LAYER_NAMES[key]
            for i in range(n):
                a = np.asarray(stacked[i], np.float32)
                out[f"model.layers.{first + i}.{suffix}"] = np.ascontiguousarray(a.T if t else a)
    return out


def save_checkpoint(path: str, params: dict, cfg: ModelConfig) -> None:
    """Writes ``params`` as one safetensors file in HF naming."""
    save_file(hf_tensors(params, cfg), path)


def load_checkpoint(path: str, cfg: ModelConfig, dtype=np.float32) -> dict:
    """Reads a safetensors file into the param pytree of :func:`model.init_params`.

    Tensors may be stored in any float dtype (bf16 included); they are cast to ``dtype``.

    Raises:
      ValueError naming every missing, unexpected or mis-shaped tensor.
    """
    shapes = param_shapes(cfg)
    flat, problems = {}, []
    with safe_open(path, framework="numpy") as f:
        names = set(f.keys())
        used = set()

        def get(name, transposed, shape):
            if name not in names:
                problems.append(f"missing {name}")
                return np.zeros(shape, dtype)
            used.add(name)
            a = f.get_tensor(name)
            a = a.T if transposed else a
            if a.shape != tuple(shape):
                problems.append(f"{name}: expected shape {tuple(shape[::-1]) if transposed else shape}"
                                f", got {a.shape[::-1] if transposed else a.shape}")
                return np.zeros(shape, dtype)
            return a.astype(dtype)

        for key, (name, t) in _TOP_NAMES.items():
            flat[key] = get(name, t, shapes[key])
        for group, first, n in _layer_groups(cfg):
            for key, shape in shapes.get(group, {}).items():
                suffix, t = _LAYER_NAMES[key]
                flat[f"{group}.{key}"] = np.stack(
                    [get(f"model.layers.{first + i}.{suffix}", t, shape[1:]) for i in range(n)])
    problems += [f"unexpected {name}" for name in sorted(names - used)]
    if problems:
        raise ValueError(f"checkpoint {path} does not fit {cfg}: " + "; ".join(problems))
    return unflatten(flat, shapes)
