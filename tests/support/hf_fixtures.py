"""Hugging Face transformers fixtures for the MiniMax M3 example (test-only helper).

transformers (5.24, ``transformers.models.minimax_m3_vl``) and torch are test dependencies
only; nothing under ``examples/`` or ``jax_m3sparse/`` imports this module.

API
---
* ``tiny_text_config(**overrides)``  a tiny random M3 text config (fp32, eager attention).
* ``build_model(config, seed)``      ``MiniMaxM3VLForCausalLM``, eval, with the seeded init below.
* ``save_checkpoint(model, path, *, layout, max_shard_size, fp8, tied)``  a checkpoint
  directory as published; returns the model whose weights are exactly what is on disk
  (the dequantized model when ``fp8=True``).
* ``dequantized_twin(path_fp8, path_out)``  the FP8 directory with every FP8 weight replaced
  by its exact fp32 dequantization (same layout, names, shards); returns that model.
* ``hf_outputs(model, input_ids, max_new_tokens)``  numpy arrays to compare against.
* ``prompt_ids(n, vocab, seed)``       a deterministic prompt.

Seeded init (``init_weights``)
------------------------------
transformers' own init (std 0.02, norms 0) gives nearly flat logits, so every parameter is
redrawn from ``torch.Generator().manual_seed(seed)`` in ``named_parameters`` order:
``nn.Linear`` / 2-D projection weights ``[out, in]`` ~ N(0, 1/in); embeddings ~ N(0, 1);
expert ``gate_up_proj [E, 2I, H]`` ~ N(0, 1/H) and ``down_proj [E, H, I]`` ~ N(0, 1/I);
router ``gate.weight [E, H]`` ~ N(0, 1/H); every RMSNorm weight ~ N(0, 0.1²) (Gemma style,
the scale is ``1 + w``); ``lm_head`` ~ N(0, 1/H) (untied); the router buffer
``e_score_correction_bias [E]`` ~ N(0, 0.1²), large enough against sigmoid scores to change
some expert choices.  With tied embeddings the head is the N(0, 1) embedding, so logits are
about sqrt(H) times larger than untied.

What is on disk (tiny config: H 128, D 128, 8 heads, 2 KV heads, I 64, dense 96, E 4)
-------------------------------------------------------------------------------------
layout "transformers" = ``MiniMaxM3VLForCausalLM.save_pretrained`` (config.json with
model_type ``minimax_m3_vl_text``, architectures ``MiniMaxM3VLForCausalLM``, plus
generation_config.json; one ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` +
``model.safetensors.index.json``).  Dense layer 0 and MoE+sparse layer 1::

    model.embed_tokens.weight                         [512, 128]
    model.layers.0.self_attn.{q,k,v,o}_proj.weight    [1024,128] [256,128] [256,128] [128,1024]
    model.layers.0.self_attn.{q,k}_norm.weight        [128]       (per head, shared by heads)
    model.layers.0.mlp.gate_up_proj.weight            [192, 128]  rows [:96] gate, [96:] up
    model.layers.0.mlp.down_proj.weight               [128, 96]
    model.layers.0.{input,post_attention}_layernorm.weight [128]
    model.layers.1.self_attn.indexer.q_proj.weight    [index_n_heads*64 = 128, 128]
    model.layers.1.self_attn.indexer.k_proj.weight    [64, 128]   ONE key head (MQA-style)
    model.layers.1.self_attn.indexer.{q,k}_norm.weight [64]
    model.layers.1.mlp.gate.weight                    [4, 128]
    model.layers.1.mlp.gate.e_score_correction_bias   [4]         (a persistent buffer)
    model.layers.1.mlp.experts.gate_up_proj           [4, 128, 128] = [E, 2I, H] (gate rows [:I], up [I:]), no ".weight"
    model.layers.1.mlp.experts.down_proj              [4, 128, 64]  = [E, H, I]
    model.layers.1.mlp.shared_experts.gate_up_proj.weight [128, 128]  ([2*shared_I, H])
    model.layers.1.mlp.shared_experts.down_proj.weight    [128, 64]
    model.norm.weight [128]; lm_head.weight [512, 128] (absent when tied)

layout "upstream" (the published naming; written here by renaming the text state dict,
which gives exactly the names ``MiniMaxM3SparseForConditionalGeneration.save_pretrained``
writes -- transformers 5.24 reverses the "minimax_m3_vl" conversion mapping on save;
``test_hf_fixtures`` checks the name sets agree).  config.json is a ``MiniMaxM3VLConfig``
(model_type ``minimax_m3_vl``, text config under ``text_config``, tiny ``vision_config``)::

    language_model.model.embed_tokens.weight           [512, 128]
    language_model.model.layers.0.mlp.{gate,up}_proj.weight   [96, 128]
    language_model.model.layers.0.mlp.down_proj.weight        [128, 96]
    language_model.model.layers.1.self_attn.index_{q,k}_proj.weight  [128,128] [64,128]
    language_model.model.layers.1.self_attn.index_{q,k}_norm.weight  [64]
    language_model.model.layers.1.block_sparse_moe.gate.weight            [4, 128]
    language_model.model.layers.1.block_sparse_moe.e_score_correction_bias [4]
    language_model.model.layers.1.block_sparse_moe.experts.{j}.w1.weight  [64, 128] gate
    language_model.model.layers.1.block_sparse_moe.experts.{j}.w3.weight  [64, 128] up
    language_model.model.layers.1.block_sparse_moe.experts.{j}.w2.weight  [128, 64] down
    language_model.model.layers.1.block_sparse_moe.shared_experts.{gate,up}_proj.weight [64,128]
    language_model.model.layers.1.block_sparse_moe.shared_experts.down_proj.weight     [128,64]
    language_model.model.norm.weight; language_model.lm_head.weight (absent when tied)
    + the tiny vision tower / projector (vision_tower.vision_model.*, multi_modal_projector.*,
      patch_merge_mlp.*, fp32, never quantized) and one fake ``mtp.0.eh_proj.weight [128, 256]``.
    (other attention / norm names as in the transformers layout, under language_model.model.)

fp8=True: every 2-D linear weight (attention q/k/v/o, indexer q/k proj, dense MLP, shared
experts, per-expert w1/w2/w3) is ``float8_e4m3fn`` with ``<name minus .weight>.weight_scale_inv``
fp32 ``[ceil(out/128), ceil(in/128)]``, ``scale_inv = amax(|block|)/448`` (1.0 for an all-zero
block), dequant = fp8 * scale_inv per 128x128 block; config.json gets ``quantization_config``
{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size":
[128, 128]} (upstream: top level of the VL config).  Embeddings, norms, lm_head, router gate,
the correction bias, vision and mtp tensors stay fp32.  In the transformers layout (also
supported) the 3-D experts ``experts.gate_up_proj [E, 2I, H]`` get ``experts.gate_up_proj_scale_inv``
``[E, ceil(2I/128), ceil(H/128)]`` (transformers' finegrained-FP8 naming) -- note the fused gate/up
is blocked as one [2I, H] matrix there, while upstream blocks w1 and w3 separately, so the
two layouts' dequantized values differ (each is its own ground truth).  transformers 5.24 loads the
upstream FP8 directory on CPU (it dequantizes) to exactly the returned model's logits, but NOT the
transformers-layout FP8 one (it reports the 3-D ``*_scale_inv`` as unexpected and uses raw FP8).

hidden_states (``hf_outputs``): ``[L+1, S, H]``; index 0 is the embedding output
(input of layer 0), index i (1 <= i < L) the residual stream after layer i-1, and index L
is AFTER the final norm (transformers overwrites the last entry with ``last_hidden_state``).
The last layer's pre-norm output is returned separately as ``layer_outputs[L-1]``
(``layer_outputs [L, S, H]`` = every decoder layer's output, before any final norm).
"""
from __future__ import annotations

import copy
import json
import math
import os
import re

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.models.minimax_m3_vl import (MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig,
                                               MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig)
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (MiniMaxM3VLExperts, MiniMaxM3VLIndexer,
                                                                      MiniMaxM3VLRMSNorm, MiniMaxM3VLTopKRouter,
                                                                      apply_rotary_pos_emb)

FP8_BLOCK = 128
FP8_MAX = 448.0
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
MTP_KEY = "mtp.0.eh_proj.weight"
SKIPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.", "mtp.")

_ATTN_PATTERN = ["full_attention", "minimax_m3_sparse"]
_MLP_PATTERN = ["dense", "sparse", "sparse", "dense"]

TINY = dict(
    vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    head_dim=128, index_n_heads=2, index_head_dim=64, index_block_size=128, index_topk_blocks=2,
    index_local_blocks=1, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
    shared_intermediate_size=64, dense_intermediate_size=96,
    rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}, rotary_dim=64,
    rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096,
    bos_token_id=None, eos_token_id=None, pad_token_id=None, use_cache=True)

TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   image_size=56, patch_size=14)


def tiny_text_config(**overrides) -> MiniMaxM3VLTextConfig:
    """Tiny M3 text config (fp32, eager).  ``index_n_heads`` follows ``num_key_value_heads`` and
    ``layer_types`` / ``mlp_layer_types`` follow ``num_hidden_layers`` unless given."""
    kw = copy.deepcopy(TINY)
    if "num_key_value_heads" in overrides and "index_n_heads" not in overrides:
        kw["index_n_heads"] = overrides["num_key_value_heads"]
    L = overrides.get("num_hidden_layers", kw["num_hidden_layers"])
    kw["layer_types"] = [_ATTN_PATTERN[i % 2] for i in range(L)]
    kw["mlp_layer_types"] = [_MLP_PATTERN[i % 4] for i in range(L)]
    if "rope_parameters" in overrides:
        overrides = dict(overrides)
        rp = dict(kw["rope_parameters"], **overrides.pop("rope_parameters"))
        kw["rope_parameters"] = rp
    kw.update(overrides)
    hd = kw["head_dim"]
    if "rotary_dim" not in overrides:
        kw["rotary_dim"] = int(hd * kw["rope_parameters"].get("partial_rotary_factor", 1.0))
    cfg = MiniMaxM3VLTextConfig(**kw, attn_implementation="eager")
    cfg._attn_implementation = "eager"
    cfg.dtype = torch.float32
    return cfg


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter (and the correction-bias buffer) as in the module docstring."""
    g = torch.Generator().manual_seed(int(seed))

    def normal(t, std):
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype) * std)

    with torch.no_grad():
        owners = {}
        for mname, mod in model.named_modules():
            for pname, _ in mod.named_parameters(recurse=False):
                owners[f"{mname}.{pname}" if mname else pname] = mod
        for name, p in model.named_parameters():
            mod = owners[name]
            if isinstance(mod, MiniMaxM3VLRMSNorm):
                normal(p, 0.1)
            elif isinstance(mod, torch.nn.Embedding):
                normal(p, 1.0)
            elif isinstance(mod, MiniMaxM3VLExperts):
                normal(p, 1.0 / math.sqrt(p.shape[-1]))
            elif isinstance(mod, MiniMaxM3VLTopKRouter):
                normal(p, 1.0 / math.sqrt(p.shape[-1]))
            elif p.ndim >= 2:
                normal(p, 1.0 / math.sqrt(p[0].numel()))
            else:
                normal(p, 0.1)           # biases (vision tower only) and other vectors
        for mod in model.modules():
            if isinstance(mod, MiniMaxM3VLTopKRouter):
                normal(mod.e_score_correction_bias, 0.1)


def build_model(config: MiniMaxM3VLTextConfig, seed: int) -> MiniMaxM3VLForCausalLM:
    """``MiniMaxM3VLForCausalLM(config)`` in eval mode, fp32, eager, seeded init."""
    torch.manual_seed(int(seed))
    config._attn_implementation = "eager"
    model = MiniMaxM3VLForCausalLM(config).to(torch.float32).eval()
    init_weights(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


# --------------------------------------------------------------------------- names

_DENSE_GU = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate_up_proj\.weight$")
# Per-layer names that map one to one: transformers' -> upstream (the inverse reads it backwards).
_ONE_TO_ONE = {"mlp.shared_experts.down_proj.weight": "block_sparse_moe.shared_experts.down_proj.weight",
               "mlp.gate.weight": "block_sparse_moe.gate.weight",
               "mlp.gate.e_score_correction_bias": "block_sparse_moe.e_score_correction_bias"}
_INDEXER = ("self_attn.indexer.", "self_attn.index_")      # prefix, transformers' / upstream


def upstream_state_dict(model: MiniMaxM3VLForCausalLM) -> dict[str, torch.Tensor]:
    """The text model's tensors under the published (upstream) names; no vision / mtp."""
    cfg = model.config
    I = cfg.intermediate_size
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach().to(torch.float32).contiguous()
        if k == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            out["language_model.lm_head.weight"] = v
            continue
        assert k.startswith("model."), k
        base = "language_model." + k
        m = re.match(r"^(language_model\.model\.layers\.\d+\.)(.*)$", base)
        if m is None:
            out[base] = v
            continue
        pre, rest = m.groups()
        if rest in ("mlp.gate_up_proj.weight", "mlp.shared_experts.gate_up_proj.weight"):
            half = v.shape[0] // 2
            stem = pre + ("mlp." if rest.startswith("mlp.gate") else "block_sparse_moe.shared_experts.")
            out[stem + "gate_proj.weight"] = v[:half].clone()
            out[stem + "up_proj.weight"] = v[half:].clone()
        elif rest in _ONE_TO_ONE:
            out[pre + _ONE_TO_ONE[rest]] = v
        elif rest == "mlp.experts.gate_up_proj":
            for j in range(v.shape[0]):
                out[pre + f"block_sparse_moe.experts.{j}.w1.weight"] = v[j, :I].clone()
                out[pre + f"block_sparse_moe.experts.{j}.w3.weight"] = v[j, I:].clone()
        elif rest == "mlp.experts.down_proj":
            for j in range(v.shape[0]):
                out[pre + f"block_sparse_moe.experts.{j}.w2.weight"] = v[j].clone()
        elif rest.startswith(_INDEXER[0]):
            out[pre + _INDEXER[1] + rest[len(_INDEXER[0]):]] = v
        else:
            out[base] = v
    return out


_VISION_RENAMES = [
    (r"^model\.vision_tower\.embeddings\.proj\.", "vision_tower.vision_model.embeddings.patch_embedding."),
    (r"^model\.vision_tower\.layers\.", "vision_tower.vision_model.encoder.layers."),
    (r"^model\.vision_tower\.pre_layrnorm\.", "vision_tower.vision_model.pre_layrnorm."),
    (r"^model\.multi_modal_projector\.linear_", "multi_modal_projector.linear_"),
    (r"^model\.multi_modal_projector\.merge_linear_", "patch_merge_mlp.linear_"),
]


def vl_config(text_config: MiniMaxM3VLTextConfig) -> MiniMaxM3VLConfig:
    """The VL wrapper config around ``text_config`` with a tiny vision tower."""
    tc = text_config.to_dict()
    cfg = MiniMaxM3VLConfig(text_config=tc, vision_config=dict(TINY_VISION),
                            projector_hidden_size=text_config.hidden_size,
                            tie_word_embeddings=text_config.tie_word_embeddings, attn_implementation="eager")
    cfg.architectures = ["MiniMaxM3SparseForConditionalGeneration"]
    return cfg


def _vision_state_dict(text_config, seed) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    vl = MiniMaxM3SparseForConditionalGeneration(vl_config(text_config)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    out = {}
    for k, v in vl.state_dict().items():
        for pat, rep in _VISION_RENAMES:
            if re.match(pat, k):
                out[re.sub(pat, rep, k)] = (torch.randn(v.shape, generator=g) * 0.05).contiguous()
                break
    return out


# --------------------------------------------------------------------------- FP8

def is_fp8_target(name: str, layout: str, shape) -> bool:
    """Whether ``save_checkpoint(fp8=True)`` stores this tensor as block-scaled FP8."""
    if name.startswith(SKIPPED_PREFIXES):
        return False
    if layout == "transformers" and re.search(r"\.mlp\.experts\.(gate_up_proj|down_proj)$", name):
        return True
    if len(shape) != 2 or not name.endswith("_proj.weight") and not re.search(r"\.w[123]\.weight$", name):
        return False
    return "embed" not in name and "lm_head" not in name


def scale_name(name: str) -> str:
    """``x.weight`` -> ``x.weight_scale_inv``; ``x.gate_up_proj`` (3-D experts) -> ``x.gate_up_proj_scale_inv``."""
    return name[: -len(".weight")] + ".weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"


def _blocks(w: torch.Tensor):
    """View of ``w [..., out, in]`` padded to 128 multiples as ``[..., nb_o, 128, nb_i, 128]``."""
    o, i = w.shape[-2:]
    no, ni = -(-o // FP8_BLOCK), -(-i // FP8_BLOCK)
    pad = torch.zeros(*w.shape[:-2], no * FP8_BLOCK, ni * FP8_BLOCK, dtype=torch.float32)
    pad[..., :o, :i] = w
    return pad.view(*w.shape[:-2], no, FP8_BLOCK, ni, FP8_BLOCK), (o, i)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled FP8: (``float8_e4m3fn`` like ``w``, fp32 ``scale_inv [..., ceil(out/128), ceil(in/128)]``)."""
    b, (o, i) = _blocks(w.float())
    amax = b.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(torch.float32)
    q = (b / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(*w.shape[:-2], b.shape[-4] * FP8_BLOCK, b.shape[-2] * FP8_BLOCK)[..., :o, :i].contiguous()
    return q, scale_inv.contiguous()


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * scale_inv`` per 128x128 block (exact in fp32)."""
    b, (o, i) = _blocks(q.to(torch.float32))
    d = b * scale_inv[..., :, None, :, None]
    return d.view(*q.shape[:-2], b.shape[-4] * FP8_BLOCK, b.shape[-2] * FP8_BLOCK)[..., :o, :i].contiguous()


# --------------------------------------------------------------------------- writing

def parse_size(size) -> int:
    """``"200KB"`` -> 200_000, ``"1MiB"`` -> 1_048_576, ints pass through (transformers' units)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B\s*", size.upper())
    if not m:
        raise ValueError(f"bad size {size!r}")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))


def _natural(name):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def write_safetensors_dir(tensors: dict[str, torch.Tensor], path: str, max_shard_size=None) -> list[str]:
    """``model.safetensors``, or greedy shards ``model-0000k-of-0000n.safetensors`` in natural name
    order + ``model.safetensors.index.json`` ({"metadata": {"total_size"}, "weight_map"}).  A
    ``*_scale_inv`` is written right after its weight (usually, not always, in the same shard)."""
    os.makedirs(path, exist_ok=True)
    names = sorted(tensors, key=_natural)
    if max_shard_size is None:
        save_file({k: tensors[k] for k in names}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    limit = parse_size(max_shard_size)
    shards, cur, cur_bytes = [], [], 0
    for k in names:
        nb = tensors[k].numel() * tensors[k].element_size()
        if cur and cur_bytes + nb > limit:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(k)
        cur_bytes += nb
    if cur:
        shards.append(cur)
    n = len(shards)
    weight_map, files = {}, []
    for s, keys in enumerate(shards):
        fn = f"model-{s + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: tensors[k] for k in keys}, os.path.join(path, fn), metadata={"format": "pt"})
        files.append(fn)
        weight_map.update({k: fn for k in keys})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files


def _write_config(config, path, fp8):
    config.save_pretrained(path)
    cp = os.path.join(path, "config.json")
    with open(cp) as f:
        c = json.load(f)
    c["dtype"] = "float32"
    if fp8:
        c["quantization_config"] = dict(QUANTIZATION_CONFIG)
    with open(cp, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)


def _text_from_upstream(up: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Inverse of ``upstream_state_dict`` (drops vision / mtp): transformers' text names."""
    upstream_to_text = {u: t for t, u in _ONE_TO_ONE.items()}
    out, experts = {}, {}
    for k, v in up.items():
        if k.startswith(SKIPPED_PREFIXES):
            continue
        if k == "language_model.lm_head.weight":
            out["lm_head.weight"] = v
            continue
        k = k[len("language_model."):]
        m = re.match(r"^(model\.layers\.\d+\.)(.*)$", k)
        if m is None:
            out[k] = v
            continue
        pre, rest = m.groups()
        e = re.match(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$", rest)
        if e:
            experts.setdefault(pre, {})[(int(e.group(1)), e.group(2))] = v
        elif rest in ("mlp.gate_proj.weight", "block_sparse_moe.shared_experts.gate_proj.weight"):
            up_k = rest.replace("gate_proj", "up_proj")
            tgt = "mlp.gate_up_proj.weight" if rest.startswith("mlp.") else "mlp.shared_experts.gate_up_proj.weight"
            out[pre + tgt] = torch.cat([v, up[f"language_model.{pre}{up_k}"]], 0)
        elif rest.endswith("up_proj.weight") and not rest.endswith("gate_up_proj.weight"):
            continue
        elif rest in upstream_to_text:
            out[pre + upstream_to_text[rest]] = v
        elif rest.startswith(_INDEXER[1]):
            out[pre + _INDEXER[0] + rest[len(_INDEXER[1]):]] = v
        else:
            out[k] = v
    for pre, d in experts.items():
        E = 1 + max(j for j, _ in d)
        out[pre + "mlp.experts.gate_up_proj"] = torch.stack([torch.cat([d[j, "w1"], d[j, "w3"]], 0) for j in range(E)])
        out[pre + "mlp.experts.down_proj"] = torch.stack([d[j, "w2"] for j in range(E)])
    return out


def _model_with(model, text_sd) -> MiniMaxM3VLForCausalLM:
    twin = copy.deepcopy(model)
    missing, unexpected = twin.load_state_dict(text_sd, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    assert not missing and not unexpected, (missing, unexpected)
    if model.config.tie_word_embeddings:
        twin.tie_weights()
    return twin.eval()


def save_checkpoint(model: MiniMaxM3VLForCausalLM, path: str, *, layout: str = "transformers",
                    max_shard_size=None, fp8: bool = False, tied: bool | None = None,
                    vision: bool = True, mtp: bool = True, seed: int = 0) -> MiniMaxM3VLForCausalLM:
    """Write ``model`` as a checkpoint directory (see the module docstring for names and shapes).

    ``layout``: "transformers" (``save_pretrained`` when not fp8) or "upstream" (published names,
    VL config, tiny vision tower when ``vision``, a fake ``mtp.0.eh_proj.weight`` when ``mtp``).
    ``max_shard_size`` (e.g. "200KB") writes shards + index.  ``tied`` must match
    ``model.config.tie_word_embeddings`` (build a tied model with ``tiny_text_config(tie_word_embeddings=True)``);
    tied checkpoints carry no lm_head.  Returns the model whose weights are exactly the checkpoint's
    (for fp8, a copy with the dequantized weights; else ``model`` itself)."""
    if layout not in ("transformers", "upstream"):
        raise ValueError(f"layout {layout!r}")
    is_tied = bool(model.config.tie_word_embeddings)
    if tied is not None and bool(tied) != is_tied:
        raise ValueError(f"tied={tied} but the model's config has tie_word_embeddings={is_tied}; "
                         "build the model from tiny_text_config(tie_word_embeddings=...)")
    os.makedirs(path, exist_ok=True)
    if layout == "transformers" and not fp8:
        model.save_pretrained(path, max_shard_size=max_shard_size or "50GB")
        return model
    if layout == "transformers":
        tensors = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()
                   if not (is_tied and k == "lm_head.weight")}
    else:
        tensors = upstream_state_dict(model)
        if vision:
            tensors.update(_vision_state_dict(model.config, seed))
        if mtp:
            H = model.config.hidden_size
            g = torch.Generator().manual_seed(seed + 2)
            tensors[MTP_KEY] = torch.randn(H, 2 * H, generator=g) / math.sqrt(2 * H)
    saved = model
    if fp8:
        deq = {}
        for k in list(tensors):
            if is_fp8_target(k, layout, tensors[k].shape):
                q, s = quantize_fp8(tensors[k])
                tensors[k], tensors[scale_name(k)] = q, s
                deq[k] = dequantize_fp8(q, s)
        text = {**tensors, **deq} if layout == "transformers" else _text_from_upstream(
            {**{k: v for k, v in tensors.items() if v.dtype != torch.float8_e4m3fn}, **deq}, model.config)
        text = {k: v for k, v in text.items() if not k.endswith("_scale_inv")}
        saved = _model_with(model, text)
    write_safetensors_dir(tensors, path, max_shard_size)
    _write_config(model.config if layout == "transformers" else vl_config(model.config), path, fp8)
    return saved


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (all shards), as stored."""
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    out = {}
    for fn in files:
        with safe_open(os.path.join(path, fn), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def checkpoint_layout(path: str) -> str:
    with open(os.path.join(path, "config.json")) as f:
        return "upstream" if json.load(f).get("model_type") == "minimax_m3_vl" else "transformers"


def dequantized_twin(path_fp8: str, path_out: str, model: MiniMaxM3VLForCausalLM | None = None):
    """Write ``path_out``: ``path_fp8`` with each FP8 weight replaced by its exact fp32 dequantization
    (same names, same shard boundaries, no ``*_scale_inv``, no quantization_config).  Returns the
    ``MiniMaxM3VLForCausalLM`` with those weights when ``model`` (any model of the same config) is
    given, else None."""
    os.makedirs(path_out, exist_ok=True)
    layout = checkpoint_layout(path_fp8)
    index_p = os.path.join(path_fp8, "model.safetensors.index.json")
    files = sorted(f for f in os.listdir(path_fp8) if f.endswith(".safetensors"))
    all_t = read_checkpoint(path_fp8)
    deq = {}
    for k, v in all_t.items():
        if k.endswith("_scale_inv"):
            continue
        deq[k] = dequantize_fp8(v, all_t[scale_name(k)]) if v.dtype == torch.float8_e4m3fn else v
    weight_map = {}
    for fn in files:
        with safe_open(os.path.join(path_fp8, fn), "pt") as f:
            keys = [k for k in f.keys() if not k.endswith("_scale_inv")]
        save_file({k: deq[k] for k in keys}, os.path.join(path_out, fn), metadata={"format": "pt"})
        weight_map.update({k: fn for k in keys})
    if os.path.exists(index_p):
        total = sum(t.numel() * t.element_size() for t in deq.values())
        with open(os.path.join(path_out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path_fp8, "config.json")) as f:
        c = json.load(f)
    c.pop("quantization_config", None)
    with open(os.path.join(path_out, "config.json"), "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
    if model is None:
        return None
    text = deq if layout == "transformers" else _text_from_upstream(deq, model.config)
    return _model_with(model, text)


def load_transformers(path: str) -> torch.nn.Module:
    """Load a directory back with transformers (text model or the VL wrapper, by model_type), eval, fp32."""
    cls = MiniMaxM3SparseForConditionalGeneration if checkpoint_layout(path) == "upstream" else MiniMaxM3VLForCausalLM
    return cls.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


# --------------------------------------------------------------------------- transformers' outputs

def prompt_ids(n: int = 400, vocab: int = 512, seed: int = 0) -> np.ndarray:
    """A deterministic prompt: ``int32 [n]`` uniform in [0, vocab)."""
    return np.random.default_rng(seed).integers(0, vocab, size=n).astype(np.int32)


def _block_scores(ix: MiniMaxM3VLIndexer, hidden_states, position_embeddings, position_ids):
    """transformers' indexer scores for a cache-less forward: [B, H_idx, S, num_blocks] (locals = +inf)."""
    b, s, _ = hidden_states.shape
    q = ix.q_norm(ix.q_proj(hidden_states).view(b, s, -1, ix.head_dim)).transpose(1, 2)
    k = ix.k_norm(ix.k_proj(hidden_states).view(b, s, 1, ix.head_dim)).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb(q, k, cos[..., : ix.head_dim], sin[..., : ix.head_dim])
    nb = -(-s // ix.block_size)
    sc = torch.matmul(q.float(), k.float().transpose(-1, -2))
    kp = torch.arange(s)
    sc = sc.masked_fill(kp[None, None, None, :] > position_ids[:, None, :, None], float("-inf"))
    sc = torch.nn.functional.pad(sc, (0, nb * ix.block_size - s), value=float("-inf"))
    bs = sc.view(b, ix.num_heads, s, nb, ix.block_size).amax(-1)
    qb = position_ids // ix.block_size
    if ix.local_blocks > 0:
        li = (qb[..., None] - torch.arange(ix.local_blocks).view(1, 1, -1)).clamp(min=0)
        bs.scatter_(-1, li.unsqueeze(1).expand(-1, ix.num_heads, -1, -1), float("inf"))
    return bs


def _gaps(logits: torch.Tensor) -> np.ndarray:
    t = torch.topk(logits.float(), 2, dim=-1).values
    return (t[..., 0] - t[..., 1]).numpy()


def hf_outputs(model: torch.nn.Module, input_ids, max_new_tokens: int = 16) -> dict:
    """transformers' outputs for one prompt (batch 1), as numpy:

    * ``hidden_states`` f32 [L+1, S, H]: [0] embeddings, [i] output of layer i-1, [L] after the final norm.
    * ``layer_outputs`` f32 [L, S, H]: every decoder layer's output (pre final norm).
    * ``logits`` f32 [S, V] of the prompt forward (no cache).
    * ``generated`` int32 [T]: greedy ``generate`` (do_sample False, min = max = T new tokens, no eos),
      ``generated_logits`` f32 [T, V] (step t's logits, from which token t was picked).
    * ``selections`` {layer: int32 [index_n_heads, S, index_topk_blocks]}: the indexer's block ids for
      the prompt (descending score, the local block first at +inf; -1 pads slots on future blocks).
    * ``selection_margin`` {layer: f32 [index_n_heads, S]}: score of the last selected block minus the
      best unselected one (inf where nothing competes); its min says how close a selection flip is.
    * ``router_choices`` {layer: int32 [S, top_k]} (sorted ascending; transformers' topk is unsorted),
      ``router_weights`` {layer: f32 [S, top_k]} aligned with them (normalised, before routed_scaling).
    * ``top2_gap`` {"prompt": f32 [S], "prompt_min": float, "generated": f32 [T], "generated_min": float}:
      top-1 minus top-2 logit per position / step.
    """
    lm = model.model.language_model if hasattr(model.model, "language_model") else model.model
    ids = torch.as_tensor(np.asarray(input_ids, dtype=np.int64)).reshape(1, -1)
    S = ids.shape[1]
    sel, margin, router, layer_out = {}, {}, {}, {}
    hooks = []
    for li, layer in enumerate(lm.layers):
        hooks.append(layer.register_forward_hook(
            lambda m, a, o, li=li: layer_out.__setitem__(li, (o[0] if isinstance(o, tuple) else o)[0].detach())))
        ix = layer.self_attn.indexer
        if ix is not None:
            def ih(m, args, out, li=li):
                sel[li] = out[0].detach().to(torch.int32).numpy()
                bs = _block_scores(m, args[0], args[1], args[3])[0]
                srt = torch.sort(bs, dim=-1, descending=True).values
                k = m.topk_blocks
                if srt.shape[-1] <= k:
                    margin[li] = np.full(srt.shape[:-1], np.inf, np.float32)
                else:
                    d = srt[..., k - 1] - srt[..., k]
                    margin[li] = torch.nan_to_num(d, nan=float("inf")).numpy().astype(np.float32)
            hooks.append(ix.register_forward_hook(ih))
        if isinstance(layer.mlp, torch.nn.Module) and hasattr(layer.mlp, "gate"):
            def rh(m, args, out, li=li):
                w, idx = out[1].detach(), out[2].detach()
                order = torch.argsort(idx, dim=-1)
                router[li] = (torch.gather(idx, -1, order).to(torch.int32).numpy(),
                              torch.gather(w, -1, order).float().numpy())
            hooks.append(layer.mlp.gate.register_forward_hook(rh))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True,
                        use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    hs = torch.stack([h[0] for h in out.hidden_states]).float().numpy()
    logits = out.logits[0].float()
    T = int(max_new_tokens)
    with torch.no_grad():
        g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=T, min_new_tokens=T, eos_token_id=None, pad_token_id=0,
                           output_logits=True, return_dict_in_generate=True, use_cache=True)
    gen_logits = torch.cat([x.float() for x in g.logits], 0)
    gp, gg = _gaps(logits), _gaps(gen_logits)
    return {
        "hidden_states": hs,
        "layer_outputs": torch.stack([layer_out[i] for i in range(len(lm.layers))]).float().numpy(),
        "logits": logits.numpy(),
        "generated": g.sequences[0, S:].to(torch.int32).numpy(),
        "generated_logits": gen_logits.numpy(),
        "selections": sel,
        "selection_margin": margin,
        "router_choices": {k: v[0] for k, v in router.items()},
        "router_weights": {k: v[1] for k, v in router.items()},
        "top2_gap": {"prompt": gp, "prompt_min": float(gp.min()), "generated": gg, "generated_min": float(gg.min())},
    }



# --------------------------------------------------------------------------- published formats
# The quantized checkpoints serving stacks run (MXFP8, ModelOpt NVFP4 experts, Quark MXFP4),
# written here from a model's upstream tensors with torch quantizers of their own, beside a
# "twin" directory holding the exact dequantized values (the loader's oracle).
E2M1_VALUES = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float32)
PUBLISHED = {
    "mxfp8": {"quant_method": "mxfp8", "activation_scheme": "dynamic",
              "weight_block_size": [1, 32], "ignored_layers": ["lm_head"]},
    "nvfp4": {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
              "exclude_modules": ["lm_head"]},                  # + quantized_layers per tensor
    "mxfp4": {"quant_method": "quark", "exclude": ["lm_head"],
              "global_quant_config": {"weight": {"dtype": "fp4", "qscheme": "per_group",
                                                 "group_size": 32, "scale_format": "e8m0"}}},
}


def _groups(w, g):
    return w.float().reshape(*w.shape[:-1], w.shape[-1] // g, g)


def _e8m0(amax, emax):
    """OCP MX shared exponent code per group: floor(log2(amax)) - emax + 127 (amax 0 -> 2^-126)."""
    e = torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - emax
    return (e + 127).clamp(0, 254).to(torch.uint8)


def _e2m1(x):
    """Nearest E2M1 code (bit 3 the sign) of each element of x (already divided by its scale)."""
    idx = (x.abs().clamp(max=6.0)[..., None] - E2M1_VALUES).abs().argmin(-1)
    return idx | ((x < 0).to(torch.int64) << 3)


def _signed_e2m1(codes):
    v = E2M1_VALUES[codes & 7]
    return torch.where(codes >= 8, -v, v)


def _pack(codes):
    """codes [..., n] -> uint8 [..., n/2], element 2i in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def quantize_mxfp8(w):
    g = _groups(w, 32)
    e = _e8m0(g.abs().amax(-1), 8)                          # E4M3's largest exponent: 8
    scale = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.to(torch.int32) - 127)
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    deq = (q.float() * scale[..., None]).reshape(w.shape)
    return {"weight": q.reshape(w.shape), "weight_scale_inv": e}, deq


def quantize_mxfp4(w):
    g = _groups(w, 32)
    e = _e8m0(g.abs().amax(-1), 2)                          # E2M1's largest exponent: 2
    scale = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.to(torch.int32) - 127)
    codes = _e2m1(g / scale[..., None])
    deq = (_signed_e2m1(codes) * scale[..., None]).reshape(w.shape)
    return {"weight": _pack(codes.reshape(w.shape)), "weight_scale": e}, deq


def quantize_nvfp4(w, scale_2):
    g = _groups(w, 16)
    s = ((g.abs().amax(-1) / 6.0) / scale_2).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    step = s.float() * scale_2                               # the loader's product, same order
    codes = _e2m1(torch.where(step[..., None] > 0, g / step[..., None], torch.zeros_like(g)))
    deq = (_signed_e2m1(codes) * step[..., None]).reshape(w.shape)
    return {"weight": _pack(codes.reshape(w.shape)), "weight_scale": s,
            "weight_scale_2": torch.tensor(scale_2, dtype=torch.float32),
            "input_scale": torch.tensor(1.0, dtype=torch.float32)}, deq


def _published_kind(name: str, fmt: str, shape) -> str | None:
    if not is_fp8_target(name, "upstream", shape):
        return None
    routed = re.search(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$", name)
    if fmt == "mxfp8":
        return "mxfp8"
    if fmt == "nvfp4":
        return "nvfp4" if routed else "mxfp8"
    return "mxfp4" if routed or ".shared_experts." in name else None


def save_published(model: MiniMaxM3VLForCausalLM, path: str, fmt: str, twin: str) -> None:
    """``path``: ``model`` (upstream names, VL config) in published format ``fmt`` ("mxfp8",
    "nvfp4": ModelOpt's MIXED_PRECISION, "mxfp4": Quark); ``twin``: the same names holding the
    exact fp32 dequantized values, no quantization_config."""
    tensors = upstream_state_dict(model)
    stored, plain = {}, {}
    # ModelOpt: w1 and w3 of one expert share weight_scale_2 (amax over both / (448 · 6))
    pair_amax = {}
    for k, v in tensors.items():
        m = re.match(r"(.*\.experts\.\d+\.)w[13]\.weight$", k)
        if m:
            pair_amax[m.group(1)] = max(pair_amax.get(m.group(1), 0.0), float(v.abs().max()))
    layers = {}
    for k, v in tensors.items():
        kind = _published_kind(k, fmt, v.shape)
        if kind is None:
            stored[k] = plain[k] = v
            continue
        if kind == "nvfp4":
            m = re.match(r"(.*\.experts\.\d+\.)w[13]\.weight$", k)
            amax = pair_amax[m.group(1)] if m else float(v.abs().max())
            parts, deq = quantize_nvfp4(v, amax / (FP8_MAX * 6.0) or 1.0)
            layers[k[:-len(".weight")]] = {"quant_algo": "NVFP4", "group_size": 16}
        else:
            parts, deq = (quantize_mxfp8 if kind == "mxfp8" else quantize_mxfp4)(v)
            layers[k[:-len(".weight")]] = {"quant_algo": "MXFP8"}
        base = k[:-len("weight")]
        stored.update({base + suffix: t.contiguous() for suffix, t in parts.items()})
        plain[k] = deq
    write_safetensors_dir(stored, path)
    write_safetensors_dir(plain, twin)
    qc = copy.deepcopy(PUBLISHED[fmt])
    if fmt == "nvfp4":
        qc["quantized_layers"] = layers
    for where, extra in ((path, {"quantization_config": qc}), (twin, {})):
        _write_config(vl_config(model.config), where, False)
        cp = os.path.join(where, "config.json")
        with open(cp) as f:
            c = json.load(f)
        c.update(extra)
        with open(cp, "w") as f:
            json.dump(c, f, indent=2, sort_keys=True)
