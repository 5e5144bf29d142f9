"""The independent check: our bf16-dense path vs Hugging Face transformers on the same GGUF.

transformers' ``LlamaForCausalLM.from_pretrained(dir, gguf_file=...)`` dequantizes the same file
with its own loader (its own q/k row order, tied head, RoPE, RMSNorm) and runs it in CPU torch
float32. Nothing is fetched: the file is local and ``HF_HUB_OFFLINE=1`` is set.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from . import gguf_model, quality


@functools.cache
def _transformers_model():
    """transformers' LlamaForCausalLM of the GGUF file, loaded once (CPU torch, float32)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch  # noqa: PLC0415
    from transformers import LlamaForCausalLM  # noqa: PLC0415

    path = gguf_model.gguf_path()
    return LlamaForCausalLM.from_pretrained(os.path.dirname(path),
                                            gguf_file=os.path.basename(path), dtype=torch.float32)


def transformers_logits(token_ids, kv_dtype=None) -> np.ndarray:
    """``float32[T, V]`` logits of transformers' LlamaForCausalLM on one prompt.

    kv_dtype ``"bf16"``: the RoPE'd keys and the values are rounded to bf16 before attention
    (through a registered attention function), as our bf16 paged cache stores them; None keeps
    them in float32.
    """
    import torch  # noqa: PLC0415
    from transformers import AttentionInterface  # noqa: PLC0415
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: PLC0415

    impl = "sdpa"
    if kv_dtype == "bf16":
        def bf16_kv_attention(module, query, key, value, *args, **kwargs):
            def r(x):
                return x.to(torch.bfloat16).to(x.dtype)
            return sdpa_attention_forward(module, query, r(key), r(value), *args, **kwargs)

        AttentionInterface.register("bf16_kv_sdpa", bf16_kv_attention)
        impl = "bf16_kv_sdpa"
    elif kv_dtype is not None:
        raise ValueError(f"kv_dtype must be None or 'bf16' (got {kv_dtype!r})")
    m = _transformers_model()
    m.set_attn_implementation(impl)
    with torch.no_grad():
        return m(torch.tensor([list(token_ids)])).logits[0].numpy()


def our_logits(params, cfg, token_ids, path="bf16-dense", chunk_size=32) -> np.ndarray:
    """``float32[T, V]`` logits of every prompt position through our engine (chunked prefill)."""
    ecfg = quality.engine_config([len(token_ids)], max_running=1, chunk_size=chunk_size)
    engine = quality.score_windows(params, cfg.with_path(path), ecfg, [(0, list(token_ids))],
                                   keep_logits=True)
    return np.stack(engine.prefill_logits[0])


def per_position_cosine(a, b) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.sum(a * b, -1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1),
                                          1e-30)
