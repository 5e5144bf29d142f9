"""The M3 example against transformers' MiniMax M3 (``transformers.models.minimax_m3_vl``).

Tiny random M3 models are built with transformers (fp32, eager attention), saved as checkpoint
directories the way they are published (tests/support/hf_fixtures.py: transformers' names and the
upstream names, sharded and not, tied and untied, FP8 blocks), and loaded by the example's
loader as they are. The example's baseline stream (compare.py), in float32 with its own index
keys and selections (``baseline_selection="own"``), is an independent JAX twin of
transformers' model; it must give transformers' per-layer hidden states, logits, block
selections and greedy tokens.
The served NVFP4 stream's agreement is printed (it is what the main job's summary reports).

Near-ties: with random weights two logits (or two blocks' scores) can be closer than fp32
reassociation error. The fixtures' weights are scaled so that greedy tokens are decisive (the
smallest top-1 / top-2 gap is printed per case); selections and argmax are compared as
fractions (≥ 99 %) and generation token for token.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers.models.minimax_m3_vl")   # transformers >= 5.24

import hf_fixtures as fixtures  # noqa: E402
from minimax_m3 import compare, layers, model, parallel, sampling  # noqa: E402
import jax_m3sparse as m3  # noqa: E402
from minimax_m3.checkpoint import expert_storage, load_params  # noqa: E402
from minimax_m3.config import from_hf_config  # noqa: E402
from minimax_m3.engine import Engine, EngineConfig, cosine  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 400, 16

# (case id, config overrides, save_checkpoint options)
CASES = [
    ("transformers-gqa4", dict(), dict(layout="transformers")),
    ("transformers-sharded-tied-gqa8",
     dict(num_attention_heads=8, num_key_value_heads=1, index_n_heads=1, tie_word_embeddings=True),
     dict(layout="transformers", max_shard_size="300KB", tied=True)),
    ("upstream-sharded-gqa4", dict(), dict(layout="upstream", max_shard_size="300KB")),
]


def _cos_rows(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.sum(a * b, -1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1),
                                          1e-30)


def _differing_leaves(got, want):
    """Paths of the leaves whose values differ (bit for bit) between two param trees."""
    leaves = jax.tree_util.tree_leaves_with_path(jax.tree_util.tree_map(
        lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), got, want))
    return [jax.tree_util.keystr(p) for p, same in leaves if not same]


def _load(path, **overrides):
    cfg = from_hf_config(str(path), baseline_dtype="float32", baseline_selection="own",
                         **overrides)
    mesh = parallel.make_mesh(1)
    return cfg, load_params(str(path), cfg, parallel.param_shardings(model.param_shapes(cfg),
                                                                     cfg, mesh))


def _prefill(cfg, params, tokens):
    """The whole prompt in one step (one request, no decode rows) through the served step and
    the baseline stream (compare.py), every row sampled (greedy), collecting every layer."""
    S, N = len(tokens), cfg.block_size
    M = -(-S // N)
    caches = compare.allocate_caches(cfg, M)
    batch = dict(tokens=np.asarray(tokens, np.int32), slot_mapping=np.arange(S, dtype=np.int32),
                 query_lens=np.array([S], np.int32), context_lens=np.array([0], np.int32),
                 block_table=np.arange(M, dtype=np.int32)[None],
                 **sampling.batch_arrays(np.arange(S)))
    _, out = compare.forward_step(params, caches, batch, cfg=cfg, num_decode_requests=0,
                                  decode_query_len=1, collect=("hidden", "topk"))
    return jax.device_get(out)


def _generate(cfg, params, tokens, follow):
    e = Engine(params, cfg, EngineConfig(num_pages=8, max_running=1, chunk_size=512,
                                         max_seq_len=1024, compare=True, follow=follow))
    e.add_request(0, list(tokens), NEW_TOKENS)
    (r,) = e.run()
    return r.generated


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case(request, tmp_path_factory):
    name, overrides, save = request.param
    tcfg = fixtures.tiny_text_config(**overrides)
    hf = fixtures.build_model(tcfg, seed=0)
    path = tmp_path_factory.mktemp(name)
    fixtures.save_checkpoint(hf, str(path), **save)
    tokens = fixtures.prompt_ids(PROMPT_LEN, tcfg.vocab_size, seed=1)
    want = fixtures.hf_outputs(hf, tokens, max_new_tokens=NEW_TOKENS)
    cfg, params = _load(path)
    return dict(name=name, cfg=cfg, params=params, tokens=tokens, want=want,
                got=_prefill(cfg, params, tokens))


def test_config_read_as_transformers_does(case):
    cfg, want_cfg = case["cfg"], fixtures.tiny_text_config(**CASES[[c[0] for c in CASES].index(
        case["name"])][1])
    assert cfg.layer_types == tuple(want_cfg.layer_types)
    assert cfg.mlp_layer_types == tuple(want_cfg.mlp_layer_types)
    assert cfg.sparse_layers and len(set(cfg.layer_types)) == 2 and len(set(cfg.mlp_layer_types)) == 2
    assert cfg.tie_word_embeddings == ("tied" in case["name"])
    assert ("lm_head" in case["params"]) != cfg.tie_word_embeddings


def test_hidden_states_match_per_layer(case):
    got, want = case["got"]["baseline_hidden"], case["want"]["hidden_states"]
    L = case["cfg"].num_layers
    # transformers: [0] the embeddings, [i] after layer i (i < L), [L] after the final norm.
    for i in range(L):
        cos = _cos_rows(got[i], want[i])
        assert cos.min() >= 0.9999, (case["name"], i, cos.min(), int(cos.argmin()))
    normed = np.asarray(layers.gemma_rms_norm(got[L], case["params"]["norm"], case["cfg"].rms_norm_eps))
    assert _cos_rows(normed, want[L]).min() >= 0.9999
    print(f"{case['name']}: min cosine per layer "
          f"{[round(float(_cos_rows(got[i], want[i]).min()), 7) for i in range(L)]}")


def test_logits_and_selections_match(case):
    got, want = case["got"], case["want"]
    agree = np.mean(np.argmax(got["baseline_logits"], -1) == np.argmax(want["logits"], -1))
    assert agree >= 0.99, agree
    assert _cos_rows(got["baseline_logits"], want["logits"]).min() >= 0.9999
    print(f"{case['name']}: argmax agreement {agree:.4f}, max |logit diff| "
          f"{np.max(np.abs(got['baseline_logits'] - want['logits'])):.2e}")
    sparse = case["cfg"].sparse_layers
    same = []
    for k, layer in enumerate(sparse):
        ours = np.sort(got["baseline_topk"][k], -1)                       # [Hkv, T, K]
        theirs = want["selections"][layer]                           # [Hidx, S, K']
        theirs = np.sort(np.pad(theirs, ((0, 0), (0, 0), (0, ours.shape[-1] - theirs.shape[-1])),
                                constant_values=-1), -1)
        same.append(np.all(ours == theirs, -1).mean())
    served = [np.all(np.sort(got["topk"][k], -1) == np.sort(got["baseline_topk"][k], -1), -1).mean()
              for k in range(len(sparse))]
    print(f"{case['name']}: selections equal to transformers' {np.round(same, 4)}; served "
          f"(bf16 index keys, NVFP4 stream) equal to the baseline {np.round(served, 4)}; "
          f"served argmax agreement "
          f"{np.mean(np.argmax(got['logits'], -1) == np.argmax(want['logits'], -1)):.3f}; "
          f"min top-1/top-2 logit gap {min(np.min(v) for v in case['want']['top2_gap'].values()):.3g}")
    assert min(same) >= 0.99, same


def test_greedy_generation_matches(case):
    generated = _generate(case["cfg"], case["params"], case["tokens"], follow="baseline")
    assert generated == [int(t) for t in case["want"]["generated"]], (generated,
                                                                       case["want"]["generated"])


def test_fp8_checkpoint_loads_to_its_dequantized_twin(tmp_path):
    """Block-scaled FP8 (float8_e4m3fn + weight_scale_inv per 128 × 128) loads to the logits
    of the same checkpoint written in the dequantized fp32 values."""
    tcfg = fixtures.tiny_text_config()
    hf = fixtures.build_model(tcfg, seed=2)
    fixtures.save_checkpoint(hf, str(tmp_path / "fp8"), layout="upstream", fp8=True)
    fixtures.dequantized_twin(str(tmp_path / "fp8"), str(tmp_path / "twin"))
    tokens = fixtures.prompt_ids(PROMPT_LEN, tcfg.vocab_size, seed=3)   # the shapes case 1 compiled
    cfg = from_hf_config(str(tmp_path / "fp8"), baseline_dtype="float32",
                         baseline_selection="own")
    shardings = parallel.param_shardings(model.param_shapes(cfg), cfg, parallel.make_mesh(1))
    p8 = load_params(str(tmp_path / "fp8"), cfg, shardings, dtype="float32")
    _, p32 = _load(tmp_path / "twin")
    a, b = _prefill(cfg, p8, tokens), _prefill(cfg, p32, tokens)
    np.testing.assert_allclose(a["baseline_logits"], b["baseline_logits"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    bf16 = load_params(str(tmp_path / "fp8"), cfg, shardings)
    assert bf16["segments"][0]["self_attn"]["qkv_proj"].dtype == "bfloat16"   # FP8 -> bf16 default
    assert cosine(_prefill(cfg, bf16, tokens)["baseline_logits"], b["baseline_logits"]) >= 0.999


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "mxfp4"])
def test_published_format_loads_to_its_dequantized_values(tmp_path, fmt):
    """MiniMax M3 as published quantized — MXFP8 (E4M3 + an E8M0 exponent per 32 inputs),
    ModelOpt NVFP4 routed experts (packed E2M1, E4M3 scale per 16, fp32 scale_2; the rest
    MXFP8), Quark MXFP4 experts (packed E2M1, E8M0 per 32) — loads to exactly the values the
    fixture's own torch dequantization wrote into a plain twin (every parameter, fp32)."""
    hf = fixtures.build_model(fixtures.tiny_text_config(), seed=2)
    fixtures.save_published(hf, str(tmp_path / fmt), fmt, twin=str(tmp_path / "twin"))
    cfg = from_hf_config(str(tmp_path / fmt))
    shardings = parallel.param_shardings(model.param_shapes(cfg), cfg, parallel.make_mesh(1))
    got = load_params(str(tmp_path / fmt), cfg, shardings, dtype="float32")
    want = load_params(str(tmp_path / "twin"), cfg, shardings, dtype="float32")
    differ = _differing_leaves(got, want)
    assert not differ, differ
    bf16 = load_params(str(tmp_path / fmt), cfg, shardings)
    assert bf16["segments"][1]["mlp"]["experts"]["gate_up_proj"].dtype == "bfloat16"


def test_published_format_mismatch_is_named(tmp_path):
    """A tensor format the quant_method does not name, or an unknown quant_method, is an error
    naming it before any weight is read."""
    hf = fixtures.build_model(fixtures.tiny_text_config(), seed=2)
    path = tmp_path / "nvfp4"
    fixtures.save_published(hf, str(path), "nvfp4", twin=str(tmp_path / "twin"))
    cfg = from_hf_config(str(path))
    shardings = parallel.param_shardings(model.param_shapes(cfg), cfg, parallel.make_mesh(1))
    config = json.loads((path / "config.json").read_text())
    for qc, match in (({"quant_method": "mxfp8"}, r"w1\.weight: stored as nvfp4"),
                      ({"quant_method": "awq"}, "quant_method 'awq'"),
                      ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "quant_algo"),
                      ({"quant_method": "mxfp8", "activation_scheme": "static"},
                       "activation_scheme 'static'")):
        (path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
        with pytest.raises(ValueError, match=match):
            load_params(str(path), cfg, shardings)


def test_modelopt_hf_quant_config_json_is_read(tmp_path):
    """ModelOpt's older export keeps the quantization in hf_quant_config.json ({"producer":
    {"name": "modelopt"}, "quantization": {...}}) with none in config.json: the NVFP4 checkpoint
    so written loads to the same values; a group size other than 16, or another producer, is
    refused naming it."""
    hf = fixtures.build_model(fixtures.tiny_text_config(), seed=2)
    new = tmp_path / "new"
    fixtures.save_published(hf, str(new), "nvfp4", twin=str(tmp_path / "twin"))
    old = tmp_path / "old"
    shutil.copytree(new, old)
    config = json.loads((old / "config.json").read_text())
    qc = config.pop("quantization_config")
    (old / "config.json").write_text(json.dumps(config))
    legacy = {"producer": {"name": "modelopt", "version": "0.27.0"},
              "quantization": {k: v for k, v in qc.items() if k != "quant_method"}}
    (old / "hf_quant_config.json").write_text(json.dumps(legacy))
    cfg = from_hf_config(str(new))
    shardings = parallel.param_shardings(model.param_shapes(cfg), cfg, parallel.make_mesh(1))
    got = load_params(str(old), from_hf_config(str(old)), shardings, dtype="float32")
    want = load_params(str(new), cfg, shardings, dtype="float32")
    differ = _differing_leaves(got, want)
    assert not differ, differ
    for quantization, producer, match in (({"quant_algo": "NVFP4", "group_size": 32}, "modelopt",
                                           "group_size 32"),
                                          (legacy["quantization"], "other", "producer 'other'")):
        (old / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": producer}, "quantization": quantization}))
        with pytest.raises(ValueError, match=match):
            load_params(str(old), cfg, shardings)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "mxfp4"])
def test_published_tensor_damage_is_named(tmp_path, fmt):
    """A block scale cut short, a weight (packed FP4: a byte per two inputs) with a column
    missing, and — NVFP4 experts kept as stored — w1 and w3 of one expert with different
    weight_scale_2: each is refused before any weight is read, naming the tensor."""
    from safetensors.torch import load_file, save_file
    hf = fixtures.build_model(fixtures.tiny_text_config(), seed=2)
    fixtures.save_published(hf, str(tmp_path / "good"), fmt, twin=str(tmp_path / "twin"))
    files = {f.name: load_file(str(f)) for f in (tmp_path / "good").glob("*.safetensors")}
    expert = "language_model.model.layers.1.block_sparse_moe.experts.0."
    scale = expert + ("w1.weight_scale_inv" if fmt == "mxfp8" else "w1.weight_scale")
    damage = [(scale, lambda t: t[:, :-1], rf"{re.escape(scale)}: expected shape"),
              (expert + "w1.weight", lambda t: t[:, :-1],
               rf"{re.escape(expert)}w1\.weight: expected shape")]
    if fmt == "nvfp4":
        damage.append((expert + "w3.weight_scale_2", lambda t: t * 2, "weight_scale_2 differ"))
    for case, (name, cut, match) in enumerate(damage):
        path = tmp_path / f"bad{case}"
        shutil.copytree(tmp_path / "good", path)
        for file, tensors in files.items():
            if name in tensors:
                save_file({**tensors, name: cut(tensors[name]).contiguous()}, str(path / file))
        cfg = from_hf_config(str(path), expert_format="nvfp4" if fmt == "nvfp4" else "bf16")
        shardings = parallel.param_shardings(model.param_shapes(cfg), cfg, parallel.make_mesh(1))
        with pytest.raises(ValueError, match=match):
            load_params(str(path), cfg, shardings)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_experts_load_as_stored(tmp_path, fmt):
    """--expert-format nvfp4 / mxfp4 on a checkpoint whose experts are stored so: the packed
    bytes, the block scales and NVFP4's weight_scale_2 (one per expert, shared by w1 and w3)
    land on the device as they are — their dequantization (× scale_2) is the fixture's fp32
    twin (to one fp32 rounding); every other leaf is what the bf16 load gives; a checkpoint stored otherwise
    is refused, naming the format it holds."""
    hf = fixtures.build_model(fixtures.tiny_text_config(), seed=2)
    fixtures.save_published(hf, str(tmp_path / fmt), fmt, twin=str(tmp_path / "twin"))
    assert expert_storage(str(tmp_path / fmt)) == fmt
    cfg = from_hf_config(str(tmp_path / fmt), expert_format=fmt)
    mesh = parallel.make_mesh(1)
    got = load_params(str(tmp_path / fmt), cfg, parallel.param_shardings(
        model.param_shapes(cfg), cfg, mesh), dtype="float32")
    bf16 = dataclasses.replace(cfg, expert_format="bf16")
    want = load_params(str(tmp_path / "twin"), bf16, parallel.param_shardings(
        model.param_shapes(bf16), bf16, mesh), dtype="float32")
    moe_layers = [i for i, seg in enumerate(got["segments"]) if "experts" in seg["mlp"]]
    assert moe_layers
    for i in moe_layers:
        ex, ref = got["segments"][i]["mlp"].pop("experts"), want["segments"][i]["mlp"].pop("experts")
        assert ex["gate_up_proj"].dtype == jnp.uint8 and ("gate_up_proj_scale_2" in ex) == (
            fmt == "nvfp4")
        for name in ("gate_up_proj", "down_proj"):
            w = np.asarray(m3.fp4_dequantize(ex[name], ex[name + "_scale"], jnp.float32))
            if fmt == "nvfp4":
                s2 = np.asarray(ex[name + "_scale_2"])
                w = w * s2.reshape(*s2.shape, *(1,) * (w.ndim - s2.ndim))
            # the twin multiplies e2m1 · (scale · scale_2), the kernel's order is (e2m1 · scale)
            # · scale_2 (SPEC §9.3): one fp32 rounding apart at most
            np.testing.assert_allclose(w, np.asarray(ref[name]), rtol=2.0 ** -22, atol=0,
                                       err_msg=name)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = "mxfp4" if fmt == "nvfp4" else "nvfp4"
    with pytest.raises(ValueError, match=f"are not {other} .*w1.weight: {fmt}.*--expert-format {fmt}"):
        wrong = dataclasses.replace(cfg, expert_format=other)
        load_params(str(tmp_path / fmt), wrong, parallel.param_shardings(
            model.param_shapes(wrong), wrong, mesh))
