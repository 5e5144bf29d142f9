"""MiniMax M3's text-model configuration, field for field transformers' ``MiniMaxM3VLTextConfig``.

:func:`from_hf_config` reads a checkpoint's ``config.json`` (the text model's own, or the VL
wrapper's with the text model under ``text_config``; legacy ``sparse_attention_config`` /
``moe_layer_freq`` keys too). Differences from transformers, all deliberate:

* the rotated width is transformers' ``head_dim · rope_parameters.partial_rotary_factor``
  (1.0 when absent); a ``rotary_dim`` field that disagrees with it is an error, because
  transformers never reads ``rotary_dim`` and a silent choice would rotate the wrong dims;
* ``index_n_heads`` must equal ``num_key_value_heads`` (it does in M3): the sparse kernels take
  one block selection per KV head;
* ``index_block_size`` must be 128, the NVFP4 cache's page size (SPEC §1).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import jax_m3sparse as m3

FULL, SPARSE = "full_attention", "minimax_m3_sparse"     # layer_types
DENSE_MLP, MOE = "dense", "sparse"                       # mlp_layer_types
EXPERT_FORMATS = ("bf16", "mxfp8", "mxfp8_w8a8", "mxfp4", "nvfp4")   # expert_format
EXPERT_LABELS = {"bf16": "", "mxfp8": "MXFP8 ", "mxfp8_w8a8": "MXFP8 (W8A8) ",   # for reports
                 "mxfp4": "MXFP4 ", "nvfp4": "NVFP4 "}

_LEGACY_INDEX = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim",
                 "index_block_size": "sparse_block_size",
                 "index_topk_blocks": "sparse_topk_blocks",
                 "index_local_blocks": "sparse_local_block"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """M3's text architecture; the defaults are the main job's CPU-sized random model.

    The attention geometry is M3's (D = 128, 128-token blocks, RoPE on 64 of 128 dims,
    theta 5e6, Gemma norms); width, depth, vocabulary and expert counts are shrunk.
    ``M3_TEXT`` below holds the published sizes.
    """

    vocab_size: int = 256                      # the byte tokenizer (no tokenizer.json)
    hidden_size: int = 1024
    num_hidden_layers: int = 4
    num_attention_heads: int = 16              # Hq
    num_key_value_heads: int = 1               # Hkv
    head_dim: int = 128                        # D
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5e6
    rotary_dim: int = 64                       # = head_dim · partial_rotary_factor
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576     # a request's prompt + new tokens at most
    # MLPs: swiglu-oai everywhere; "dense" layers one MLP, "sparse" layers a mixture of experts
    dense_intermediate_size: int = 512
    intermediate_size: int = 128               # per expert
    shared_intermediate_size: int = 128
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    routed_scaling_factor: float = 2.0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # the lightning indexer of "minimax_m3_sparse" layers
    index_n_heads: int = 1
    index_head_dim: int = 128
    index_block_size: int = 128
    index_topk_blocks: int = 16
    index_local_blocks: int = 1
    layer_types: tuple[str, ...] = (FULL, SPARSE, SPARSE, SPARSE)
    mlp_layer_types: tuple[str, ...] = (DENSE_MLP, MOE, MOE, MOE)
    # serving, not architecture
    kv_replicas: int = 1                       # copies of each KV head in the cache (TP > Hkv)
    baseline_dtype: str = "bfloat16"           # the baseline stream's caches (or "float32")
    baseline_selection: str = "served"         # its block selections: "served" or "own"
    moe_impl: str = "auto"                     # routed experts: moe.IMPLS ("auto", "dense", ...)
    index_cache_dtype: str = "bfloat16"        # the index keys' cache: or "float8_e4m3fn"
    expert_format: str = "bf16"                # routed experts on the device: or "mxfp8"
                                               # (weights), "mxfp8_w8a8" (weights and inputs),
                                               # "mxfp4", "nvfp4" (FP4 weights; moe.py)
    dense_matmul_rows: int = 16                # GPUs: bf16 projections of <= this many rows and
                                               # an input width % 64 == 0 through
                                               # jax_m3sparse.dense_matmul (0: never; layers.linear)
    moe_epilogue: bool = False                 # "grouped": the SwiGLU and routing weight in the
                                               # gate_up kernel (grouped_matmul's epilogue); off:
                                               # no gain in the H100 step, ~1 % slower at decode
                                               # 64 and prefill (moe.experts_sorted)

    def __post_init__(self):
        L = self.num_hidden_layers
        for name in ("layer_types", "mlp_layer_types"):
            v = tuple(getattr(self, name))
            object.__setattr__(self, name, v)
            if len(v) != L:
                raise ValueError(f"{name} has {len(v)} entries, num_hidden_layers is {L}")
        if bad := set(self.layer_types) - {FULL, SPARSE}:
            raise ValueError(f"layer_types: unknown {sorted(bad)} (want {FULL!r} or {SPARSE!r})")
        if bad := set(self.mlp_layer_types) - {DENSE_MLP, MOE}:
            raise ValueError(f"mlp_layer_types: unknown {sorted(bad)} (want 'dense' or 'sparse')")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a "
                             f"multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim ({self.rotary_dim}) must be even and in (0, head_dim]")
        if SPARSE in self.layer_types and self.index_n_heads != self.num_key_value_heads:
            raise ValueError(f"index_n_heads ({self.index_n_heads}) != num_key_value_heads "
                             f"({self.num_key_value_heads}): jax_m3sparse's attention takes one "
                             f"block selection per KV head (M3 has 4 and 4)")
        if self.moe_impl not in ("auto", "dense", "dense_batched", "gather", "ragged",
                                 "grouped", "tokamax"):                     # moe.IMPLS
            raise ValueError(f"moe_impl {self.moe_impl!r}: 'auto', 'dense', 'dense_batched', "
                             f"'gather', 'ragged', 'grouped' or 'tokamax'")
        if self.index_cache_dtype not in ("bfloat16", "float8_e4m3fn"):
            raise ValueError(f"index_cache_dtype {self.index_cache_dtype!r}: 'bfloat16' or "
                             f"'float8_e4m3fn' (what jax_m3sparse.select_blocks reads)")
        if self.expert_format not in EXPERT_FORMATS:
            raise ValueError(f"expert_format {self.expert_format!r}: one of {EXPERT_FORMATS} "
                             f"(the routed experts' weights as the device holds them)")
        if self.quantized_experts and (self.hidden_size % 32 or self.intermediate_size % 32):
            raise ValueError(f"expert_format {self.expert_format!r} needs hidden_size ({self.hidden_size}) and "
                             f"intermediate_size ({self.intermediate_size}) multiples of 32 "
                             f"(one scale per 32 or 16 inputs)")
        if self.dense_matmul_rows < 0:
            raise ValueError(f"dense_matmul_rows ({self.dense_matmul_rows}) must be >= 0 (0: "
                             f"XLA's dot for every projection)")
        if self.baseline_selection not in ("served", "own"):
            raise ValueError(f"baseline_selection {self.baseline_selection!r}: 'served' or 'own'")
        if self.index_block_size != 128:
            raise ValueError(f"index_block_size {self.index_block_size}: the NVFP4 cache's "
                             f"pages hold 128 tokens (SPEC §1)")
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                             f"[1, num_local_experts = {self.num_local_experts}]")
        if self.index_local_blocks < 1:
            raise ValueError(f"index_local_blocks {self.index_local_blocks}: M3's indexer "
                             f"always keeps the query's own block (>= 1)")
        reason = m3.spec.unsupported_reason(self.num_attention_heads, self.num_key_value_heads,
                                            self.head_dim, self.index_topk_blocks,
                                            self.index_block_size)
        if reason:
            raise ValueError(reason)

    # names the engine and the library use
    @property
    def quantized_experts(self) -> bool:
        """The routed experts' weights are quantized on the device (any expert_format but
        "bf16"): packed data beside ``*_scale`` leaves (model.layer_shapes)."""
        return self.expert_format != "bf16"

    @property
    def mxfp8_experts(self) -> bool:
        """The routed experts' weights are MXFP8 on the device (expert_format "mxfp8" or
        "mxfp8_w8a8"; the latter quantizes their inputs too: moe.experts_sorted)."""
        return self.expert_format in ("mxfp8", "mxfp8_w8a8")

    @property
    def fp4_experts(self) -> bool:
        """The routed experts' weights are packed FP4 (expert_format "mxfp4" or "nvfp4",
        SPEC §9.3): two E2M1 codes per byte, a scale per 32 (MXFP4) or 16 (NVFP4) inputs, and
        for NVFP4 a float32 ``*_scale_2`` per expert."""
        return self.expert_format in ("mxfp4", "nvfp4")

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def block_size(self) -> int:
        return self.index_block_size

    @property
    def cache_kv_heads(self) -> int:
        """KV heads the NVFP4 cache holds: each model KV head ``kv_replicas`` times
        (jax_m3sparse.sharding.replicate_kv_heads), so every TP device owns whole heads."""
        return self.num_key_value_heads * self.kv_replicas

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """Layer indices with the indexer; the index-key cache holds these, in order."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == SPARSE)

    def segments(self) -> tuple[tuple[str, str, int, int], ...]:
        """Runs of consecutive layers of one kind: ``(layer_type, mlp_layer_type, first,
        count)``. Each run's weights are stacked and run under one ``lax.scan``."""
        out, first = [], 0
        kinds = zip(self.layer_types, self.mlp_layer_types)
        for (attn, mlp), run in itertools.groupby(kinds):
            n = len(list(run))
            out.append((attn, mlp, first, n))
            first += n
        return tuple(out)


def from_hf_config(source, **overrides) -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face ``config.json`` (path, directory or dict).

    The layer pattern comes from ``layer_types`` / ``mlp_layer_types`` or, as in the released
    config, from ``sparse_attention_config.sparse_attention_freq`` / ``moe_layer_freq``; with
    neither, transformers' defaults (every layer full attention, every MLP a mixture of
    experts), as transformers itself reads such a file. ``num_mtp_modules`` is read and not
    built (no published checkpoint has ``mtp.*`` weights).

    Raises:
      ValueError: a field our model cannot serve (rope type other than default, rotary_dim
        disagreeing with partial_rotary_factor, index heads != KV heads, a model_type not
        M3's, a ``*_freq`` entry other than 0 / 1, ...), naming it.
    """
    if isinstance(source, (str, os.PathLike)):
        path = os.path.join(source, "config.json") if os.path.isdir(source) else source
        with open(path) as f:
            source = json.load(f)
    c = dict(source.get("text_config") or source)
    if "text_config" in source:        # the VL wrapper's type decides; its text model's own
        c["model_type"] = source.get("model_type", c.get("model_type"))
    sparse_cfg = c.get("sparse_attention_config") or {}
    for flat, legacy in _LEGACY_INDEX.items():
        if flat not in c and legacy in sparse_cfg:
            c[flat] = sparse_cfg[legacy]
    L = c.get("num_hidden_layers", 60)
    layer_types = c.get("layer_types")
    if layer_types is None and "sparse_attention_freq" in sparse_cfg:
        layer_types = [SPARSE if f else FULL for f in sparse_cfg["sparse_attention_freq"]]
    mlp_types = c.get("mlp_layer_types")
    if mlp_types is None and c.get("moe_layer_freq") is not None:
        mlp_types = [MOE if f else DENSE_MLP for f in c["moe_layer_freq"]]
    _check_modelled(c, sparse_cfg, L, layer_types, mlp_types)
    rope = dict(c.get("rope_parameters") or {})
    rope.setdefault("rope_theta", c.get("rope_theta", 5e6))
    if "partial_rotary_factor" in c:      # the released config's top-level form (transformers
        rope.setdefault("partial_rotary_factor", c["partial_rotary_factor"])   # moves it there)
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.rope_type {rope['rope_type']!r}: only 'default' "
                         f"(M3's) is implemented")
    D = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    rotated = int(D * rope.get("partial_rotary_factor", 1.0))
    if c.get("rotary_dim") is not None and c["rotary_dim"] != rotated:
        raise ValueError(f"config.json: rotary_dim {c['rotary_dim']} disagrees with head_dim "
                         f"{D} × rope_parameters.partial_rotary_factor "
                         f"{rope.get('partial_rotary_factor', 1.0)} = {rotated}; transformers "
                         f"rotates {rotated} dims (it never reads rotary_dim): make them agree")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    kw = {k: v for k, v in c.items() if k in fields}
    kw.update(head_dim=D, rotary_dim=rotated, rope_theta=float(rope["rope_theta"]),
              num_hidden_layers=L,
              layer_types=tuple(layer_types or [FULL] * L),
              mlp_layer_types=tuple(mlp_types or [MOE] * L),
              tie_word_embeddings=bool(source.get("tie_word_embeddings", False)
                                       or c.get("tie_word_embeddings", False)))
    kw.update(overrides)
    return ModelConfig(**kw)


def _check_modelled(c: dict, sparse_cfg: dict, L: int, layer_types, mlp_types) -> None:
    """Raises ValueError naming a config.json key whose value this model does not implement
    (each checked where the released config puts it: the text config or its
    ``sparse_attention_config``); an absent key takes M3's value."""
    def get(key):
        return c.get(key, sparse_cfg.get(key))

    def need(key, ok, why):
        if get(key) is not None and get(key) not in ok:
            raise ValueError(f"config.json: {key} {get(key)!r} is not implemented here "
                             f"(only {ok}: {why})")

    model_type = c.get("model_type")
    if model_type not in (None, "minimax_m3_vl", "minimax_m3_vl_text"):
        raise ValueError(f"config.json: model_type {model_type!r} is not MiniMax M3's "
                         f"('minimax_m3_vl', or 'minimax_m3_vl_text' for its text model)")
    for key, freq in (("sparse_attention_freq", sparse_cfg.get("sparse_attention_freq")),
                      ("moe_layer_freq", c.get("moe_layer_freq"))):
        if freq is not None and (not isinstance(freq, list) or any(f not in (0, 1) for f in freq)):
            raise ValueError(f"config.json: {key} must be a list of 0 or 1 per layer, got "
                             f"{freq!r}")
    # num_mtp_modules: the published checkpoints carry no mtp.* weights and the engine drafts
    # from the prompt instead (--spec-tokens), so any count is accepted and none is built.
    need("sparse_score_type", ("max",), "a block scores the max over its keys, SPEC §8")
    need("sparse_init_block", (0,), "no always-selected initial blocks")
    # transformers' config writes "silu" and computes the swiglu-oai gate inline whatever it says
    need("hidden_act", ("swigluoai", "silu"), "the MLPs' swiglu-oai gate, as transformers runs it")
    need("qk_norm_type", ("per_head",), "q_norm / k_norm over each head's D")
    need("use_gemma_norm", (True,), "RMSNorm weights applied as 1 + w")
    for key, kinds in (("layer_types", layer_types), ("mlp_layer_types", mlp_types)):
        if kinds is not None and len(kinds) != L:
            raise ValueError(f"config.json: {key} (or its *_freq form) has {len(kinds)} "
                             f"entries for num_hidden_layers {L}")
    disable = get("sparse_disable_index_value")
    if disable is not None:
        if not isinstance(disable, list) or len(disable) != L or any(v not in (0, 1) for v in disable):
            raise ValueError(f"config.json: sparse_disable_index_value must hold 0 or 1 per "
                             f"layer ({L}), got {disable!r}")
        kinds = layer_types or [FULL] * L
        bad = [i for i, (v, k) in enumerate(zip(disable, kinds)) if k == SPARSE and not v]
        if bad:
            raise ValueError(f"config.json: sparse_disable_index_value is 0 for sparse layers "
                             f"{bad}: an indexer with value projections is not implemented "
                             f"(M3's indexer scores keys only: 1 on every sparse layer)")


def quantization_config(source) -> dict | None:
    """The checkpoint's ``quantization_config`` (top level or under ``text_config``), or None.

    A checkpoint directory whose config.json has none but which holds ModelOpt's older
    ``hf_quant_config.json`` (``{"producer": {"name": "modelopt", ...}, "quantization":
    {"quant_algo": ..., ...}}``) gets that file's ``quantization`` as a ``modelopt`` config;
    config.json's wins where both exist (as transformers reads it)."""
    folder = None
    if isinstance(source, (str, os.PathLike)):
        folder = source if os.path.isdir(source) else None
        path = os.path.join(source, "config.json") if folder else source
        with open(path) as f:
            source = json.load(f)
    qc = source.get("quantization_config") or (source.get("text_config") or {}).get(
        "quantization_config")
    legacy = os.path.join(folder, "hf_quant_config.json") if folder else None
    if qc or not legacy or not os.path.exists(legacy):
        return qc
    with open(legacy) as f:
        data = json.load(f)
    producer = (data.get("producer") or {}).get("name")
    if producer != "modelopt" or not isinstance(data.get("quantization"), dict):
        raise ValueError(f"{legacy}: expected ModelOpt's layout ({{\"producer\": {{\"name\": "
                         f"\"modelopt\"}}, \"quantization\": {{...}}}}), got producer "
                         f"{producer!r}")
    return {"quant_method": "modelopt", **data["quantization"]}


# The published MiniMax M3 text model (transformers' MiniMaxM3VLTextConfig defaults). The
# released config.json has no layer_types: its sparse_attention_config.sparse_attention_freq and
# moe_layer_freq are [0, 0, 0, 1 × 57], i.e. layers 0-2 full attention with a dense MLP, layers
# 3-59 sparse attention with the mixture of experts (from_hf_config reads both forms).
M3_TEXT = dict(vocab_size=200064, hidden_size=6144, num_hidden_layers=60,
               num_attention_heads=64, num_key_value_heads=4, head_dim=128,
               dense_intermediate_size=12288, intermediate_size=3072,
               shared_intermediate_size=3072, num_local_experts=128, num_experts_per_tok=4,
               index_n_heads=4, index_head_dim=128, index_topk_blocks=16,
               layer_types=(FULL,) * 3 + (SPARSE,) * 57,
               mlp_layer_types=(DENSE_MLP,) * 3 + (MOE,) * 57)
