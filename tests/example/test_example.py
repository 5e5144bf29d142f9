"""The MiniMax M3 example (examples/minimax_m3): engine smoke test, select_blocks, checkpoints.

Tiny sizes (D = 128 as in M3, everything else shrunk; top-2 blocks so that 3-5 block prompts
really skip blocks; sparse and full attention, MoE and dense MLPs interleaved). The jitted step's padded shapes are shared by every engine of a module
(jit's cache), so the batched and the one-request runs compile each shape once.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_m3 import parallel, report, text
from minimax_m3.checkpoint import load_params, save_checkpoint
from minimax_m3.config import DENSE_MLP, FULL, MOE, SPARSE, ModelConfig, from_hf_config
from minimax_m3.engine import Engine, EngineConfig, cosine, propose_drafts
from minimax_m3.model import init_params, param_shapes

import jax_m3sparse as m3
from jax_m3sparse.select import select_blocks

from prompts import license_prompts

CFG = ModelConfig(hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=1, index_n_heads=1, dense_intermediate_size=256,
                  intermediate_size=64, shared_intermediate_size=64, num_local_experts=4,
                  index_head_dim=64, index_topk_blocks=2, layer_types=(SPARSE, FULL, SPARSE),
                  mlp_layer_types=(MOE, DENSE_MLP, MOE))
ECFG = EngineConfig(num_pages=9, max_running=2, chunk_size=256, max_seq_len=768,
                    spec_tokens=2, compare=True, keep_logits=True)


def _prompts():
    """Real text of 3 lengths (2, 4 and 5 blocks); the third waits for freed pages."""
    return license_prompts({"BSD": 200, "Apache-2.0": 470, "GPL-3": 600}, filler_repeat=10)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=0)


def _run_batched(params):
    """The batched run, stepped by hand to check page ownership after every step."""
    engine = Engine(params, CFG, ECFG)
    for rid, p in enumerate(_prompts()):
        engine.add_request(rid, p, max_new_tokens=5)
    steps = 0
    while engine.waiting or engine.running:
        engine.step()
        steps += 1
        live = [p for r in engine.running for p in r.pages]
        assert len(live) == len(set(live)), "a page is shared between live requests"
        assert set(live) == set(engine.allocator.owner)
    return engine, steps


@pytest.fixture(scope="module")
def batched(params):
    return _run_batched(params)


CPU_PATHS, DEFAULT_PATH = (m3.cpu_attention_paths() if jax.default_backend() == "cpu"
                           else (["native"], "native"))


@pytest.mark.parametrize("path", CPU_PATHS)
def test_batched_matches_unbatched(params, batched, path, monkeypatch):
    """A request's tokens and logits do not depend on its batch, on every CPU attention path
    the machine has (M3SPARSE_CPU_ISA is read per call: nothing recompiles). The third request
    waits for pages the first two free, so it gets them in another order than alone."""
    if path != DEFAULT_PATH:
        monkeypatch.setenv("M3SPARSE_CPU_ISA", path)
        batched = _run_batched(params)
    engine, _ = batched
    for r in engine.finished:
        alone = Engine(params, CFG, ECFG)
        alone.add_request(r.rid, r.prompt, max_new_tokens=5)
        (a,) = alone.run()
        assert a.generated == r.generated, f"request {r.rid}: tokens differ"
        assert len(a.logits) == len(r.logits) == 5
        for step, (x, y) in enumerate(zip(r.logits, a.logits)):
            assert cosine(x, y) >= 0.9999, f"request {r.rid} step {step}: {cosine(x, y)}"


def test_pages_returned_and_reused(batched):
    engine, _ = batched
    alloc = engine.allocator
    assert alloc.num_free() == alloc.num_pages and not alloc.owner
    assert alloc.total_allocations > alloc.num_pages     # the third request reused freed pages
    assert sorted(alloc.free_pages) == list(range(alloc.num_pages))


def test_compiles_once_per_shape(batched):
    engine, steps = batched
    assert engine.compiles, "nothing compiled?"
    assert all(n == 1 for n in engine.compiles.values()), engine.compiles
    assert len(engine.compiles) <= len(ECFG.prefill_buckets()) < steps


def test_accuracy_within_documented_bounds(batched):
    engine, _ = batched
    s = report.summarize(engine, 1.0)
    b = report.BOUNDS
    assert min(s["attn_cos"]) >= b["attn_cos_min"], s["attn_cos"]
    assert max(s["attn_rel_f"]) <= b["attn_rel_f_max"], s["attn_rel_f"]
    assert s["logit_cos"] >= b["logit_cos_min"], s["logit_cos"]
    assert s["agreement"] >= b["agreement_min"], s["agreement"]
    assert s["generated_tokens"] == 15
    assert max(s["blocks_attended"][i] for i in CFG.sparse_layers) < 0.9 and s["blocks_skipped"] > 0
    assert "prefill" in report.format_summary(s, CFG)


def _load(path, cfg, dtype=None):
    shardings = parallel.param_shardings(param_shapes(cfg), cfg, parallel.make_mesh(1))
    return load_params(str(path), cfg, shardings, dtype=dtype)


@pytest.mark.parametrize("shard_bytes", [None, 100_000])
def test_checkpoint_roundtrip(params, tmp_path, shard_bytes):
    save_checkpoint(str(tmp_path), params, CFG, max_shard_bytes=shard_bytes)
    cfg = from_hf_config(str(tmp_path))
    assert cfg == CFG
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard_bytes)
    loaded = _load(tmp_path, cfg)
    flat_a = jax.tree_util.tree_leaves_with_path(params)
    flat_b = dict(jax.tree_util.tree_leaves_with_path(loaded))
    assert len(flat_a) == len(flat_b)
    for key, a in flat_a:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(flat_b[key]), err_msg=str(key))


def test_checkpoint_bf16_and_errors(params, tmp_path):
    import ml_dtypes
    from safetensors.numpy import load_file, save_file
    save_checkpoint(str(tmp_path), params, CFG, dtype=ml_dtypes.bfloat16)
    loaded = _load(tmp_path, CFG)
    assert loaded["lm_head"].dtype == jnp.bfloat16          # kept bf16, no fp32 copy
    np.testing.assert_allclose(np.asarray(loaded["lm_head"], np.float32),
                               np.asarray(params["lm_head"]), rtol=1e-2, atol=1e-2)
    f = tmp_path / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["model.layers.0.self_attn.indexer.k_proj.weight"]
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"][:7]
    tensors["extra.weight"] = np.zeros(3, np.float32)
    tensors["mtp.0.proj.weight"] = np.zeros(3, np.float32)            # skipped, as published
    save_file(tensors, str(f))
    with pytest.raises(ValueError) as e:
        _load(tmp_path, CFG)
    msg = str(e.value)
    assert "missing model.layers.0.self_attn.indexer.k_proj.weight" in msg
    assert "model.layers.1.mlp.down_proj.weight: expected shape (128, 256), got (7, 256)" in msg
    assert "unexpected extra.weight" in msg and "mtp" not in msg


def _select_bruteforce(iq, kc, table, req, pos, K, N, local_blocks=1):
    Hkv, T = iq.shape[1], iq.shape[0]
    out = np.full((Hkv, T, K), -1, np.int32)
    for t in range(T):
        if req[t] < 0:
            continue
        local = pos[t] // N
        for g in range(Hkv):
            scores = []
            for b in range(local):
                keys = kc[table[req[t], b]].astype(np.float32)          # [N, Di]
                scores.append((keys @ iq[t, g].astype(np.float32)).max())
            near = [b for b in range(local, local - local_blocks, -1) if b >= 0]
            order = sorted((b for b in range(local) if b not in near), key=lambda b: (-scores[b], b))
            ids = [*near, *order][:K]
            out[g, t, :len(ids)] = ids
    return out


def test_select_blocks_bruteforce():
    rng = np.random.default_rng(1)
    P, N, Di, Hkv, K, M = 10, 128, 32, 2, 3, 6
    kc = rng.normal(size=(P, N, Di)).astype(jnp.bfloat16)     # the index cache is bf16 / fp8
    table = np.array([[3, 7, 1, 9, 0, -1], [2, 5, 8, 4, 6, -1]], np.int32)
    req = np.array([0, 0, 1, 1, -1, 0], np.int32)
    pos = np.array([5, 700, 130, 520, 3, 383], np.int32)
    iq = rng.normal(size=(len(req), Hkv, Di)).astype(np.float32)
    got = np.asarray(select_blocks(iq, kc, table, req, pos, topk_blocks=K))
    want = _select_bruteforce(iq, kc, table, req, pos, K, N)
    np.testing.assert_array_equal(got, want)
    # The local block's own score only counts tokens p <= pos: a huge key after pos is ignored.
    kc2 = kc.copy()
    kc2[table[0, 5 // N], 6:] = 1e6
    np.testing.assert_array_equal(np.asarray(select_blocks(iq, kc2, table, req, pos,
                                                           topk_blocks=K))[:, 0], got[:, 0])
    assert jax.jit(select_blocks, static_argnames="topk_blocks")(
        jnp.asarray(iq), kc, table, req, pos, topk_blocks=K).shape == (Hkv, len(req), K)
    # index_local_blocks = 2 (transformers' +inf boost of the local blocks): same sets.
    got2 = np.sort(np.asarray(select_blocks(iq, kc, table, req, pos, topk_blocks=K,
                                            local_blocks=2)), -1)
    np.testing.assert_array_equal(got2, np.sort(_select_bruteforce(iq, kc, table, req, pos, K, N,
                                                                   local_blocks=2), -1))
    assert not np.array_equal(got2, np.sort(got, -1))
    with pytest.raises(ValueError, match="local_blocks"):
        select_blocks(iq, kc, table, req, pos, topk_blocks=K, local_blocks=0)


def test_hf_config_fields_and_errors():
    """from_hf_config: the VL wrapper's text_config, legacy keys, and the rotated width."""
    base = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                head_dim=128, vocab_size=256, index_n_heads=1,
                rope_parameters=dict(rope_type="default", rope_theta=5e6, partial_rotary_factor=0.5))
    legacy = dict(base, sparse_attention_config=dict(sparse_attention_freq=[0, 1], sparse_topk_blocks=4,
                                                     sparse_local_block=2), moe_layer_freq=[1, 0])
    cfg = from_hf_config(dict(text_config=legacy, tie_word_embeddings=True))
    assert cfg.layer_types == (FULL, SPARSE) and cfg.mlp_layer_types == (MOE, DENSE_MLP)
    assert (cfg.index_topk_blocks, cfg.index_local_blocks, cfg.rotary_dim) == (4, 2, 64)
    assert cfg.tie_word_embeddings
    with pytest.raises(ValueError, match="rotary_dim 32 disagrees"):
        from_hf_config(dict(base, rotary_dim=32))
    with pytest.raises(ValueError, match="index_n_heads"):
        from_hf_config(dict(base, index_n_heads=2, layer_types=[FULL, SPARSE]))
    with pytest.raises(ValueError, match="rope_type"):
        from_hf_config(dict(base, rope_parameters=dict(rope_type="yarn", rope_theta=1.0)))


# The released M3 config.json's text model (MiniMaxAI/MiniMax-M3*: model_type minimax_m3_vl; no
# layer_types, the pattern in sparse_attention_freq / moe_layer_freq, partial_rotary_factor at
# the top level), as the public loaders (vLLM, SGLang) read it.
RELEASED_TEXT = dict(
    vocab_size=200064, hidden_size=6144, num_hidden_layers=60, num_attention_heads=64,
    num_key_value_heads=4, head_dim=128, intermediate_size=3072, dense_intermediate_size=12288,
    shared_intermediate_size=3072, num_local_experts=128, num_experts_per_tok=4,
    hidden_act="swigluoai", use_gemma_norm=True, qk_norm_type="per_head", rotary_dim=64,
    partial_rotary_factor=0.5, rope_theta=5e6, max_position_embeddings=1048576,
    moe_layer_freq=[0, 0, 0] + [1] * 57, num_mtp_modules=1,
    sparse_attention_config=dict(
        sparse_attention_freq=[0, 0, 0] + [1] * 57, sparse_num_index_heads=4, sparse_index_dim=128,
        sparse_topk_blocks=16, sparse_block_size=128, sparse_local_block=1, sparse_init_block=0,
        sparse_score_type="max", sparse_disable_index_value=[0, 0, 0] + [1] * 57))


def test_released_config_and_unmodelled_values():
    """The released layer pattern (3 full + dense MLP, then 57 sparse + MoE) and geometry are
    read; a value this model does not implement is an error naming its key."""
    import copy
    cfg = from_hf_config(dict(model_type="minimax_m3_vl", text_config=RELEASED_TEXT))
    assert cfg.layer_types == (FULL,) * 3 + (SPARSE,) * 57
    assert cfg.mlp_layer_types == (DENSE_MLP,) * 3 + (MOE,) * 57
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk_blocks, cfg.index_local_blocks,
            cfg.rotary_dim) == (4, 128, 16, 1, 64)
    bad = [(("sparse_attention_config", "sparse_score_type"), "mean", "sparse_score_type"),
           (("sparse_attention_config", "sparse_init_block"), 2, "sparse_init_block"),
           (("sparse_attention_config", "sparse_disable_index_value"), [0] * 60,
            r"sparse layers \[3, 4"),
           (("hidden_act",), "gelu", "hidden_act"),
           (("qk_norm_type",), "per_layer", "qk_norm_type"),
           (("use_gemma_norm",), False, "use_gemma_norm"),
           (("moe_layer_freq",), [1] * 59, "59 entries"),
           (("moe_layer_freq",), [0, 0, 0] + [2] * 57, "moe_layer_freq must be a list of 0 or 1"),
           (("sparse_attention_config", "sparse_attention_freq"), "1" * 60,
            "sparse_attention_freq must be a list"),
           (("sparse_attention_config", "sparse_disable_index_value"), 1,
            "sparse_disable_index_value must hold 0 or 1 per layer"),
           (("model_type",), "minimax_m2", "model_type 'minimax_m2' is not MiniMax M3's")]
    for path, value, match in bad:
        text_cfg = copy.deepcopy(RELEASED_TEXT)
        d = text_cfg
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value
        with pytest.raises(ValueError, match=match):
            from_hf_config(dict(model_type="minimax_m3_vl", text_config=text_cfg)
                           if path != ("model_type",) else text_cfg)
    with pytest.raises(ValueError, match="model_type 'llama' is not MiniMax M3's"):
        from_hf_config(dict(model_type="llama", text_config=RELEASED_TEXT))
    assert cfg.max_position_embeddings == 1048576


def test_propose_drafts():
    assert propose_drafts([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]
    assert propose_drafts([5, 6, 7], 3) == [7, 7, 7]
    assert propose_drafts([4, 8, 4], 2) == [8, 4]


def test_text_roundtrip(tmp_path):
    s = "naïve text\n"
    assert text.decode(text.encode(s)) == s
    assert isinstance(text.tokenizer_for(str(tmp_path)), text.ByteTokenizer)
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = text.tokenizer_for(str(tmp_path))
    assert hf.encode(b"hello world foo") == [1, 2, 0]
    assert hf.printable([1, 2]) == "hello world"


def test_printable_cuts_between_escapes():
    """Undecodable bytes print as \\xNN and a cut line never ends inside one."""
    t = list(b"ab") + [0xf0] * 40
    for limit in range(5, 30):
        s = text.printable(t, limit)
        assert len(s) <= limit and s.endswith("..."), s
        body = s[:-3]
        assert body == "ab" + "\\xf0" * ((len(body) - 2) // 4), s
    assert text.printable(list(b"a\\b")) == "a\\b"
    # a checkpoint's ids past 255 without its tokenizer.json: <id>, bytes around them decoded
    assert text.printable([104, 105, 300, 0xe2, 0x82, 0xac, 1000]) == "hi<300>€<1000>"
    assert text.decode([104, 300, 105]) == "h<300>i"


def test_plot(batched, tmp_path):
    engine, _ = batched
    path = tmp_path / "accuracy.png"
    report.plot(engine, report.summarize(engine, 1.0), str(path))
    assert path.stat().st_size > 10_000


def test_cli_with_checkpoint_and_prompt_files(tmp_path):
    """The entry point end to end: --checkpoint, repeated --prompt-file (no baseline stream,
    which keeps its compilations cheap)."""
    import minimax_m3_generate as cli
    ckpt = str(tmp_path / "ckpt")
    save_checkpoint(ckpt, init_params(CFG, seed=3), CFG, max_shard_bytes=200_000)
    files = []
    for i, n in enumerate((150, 300)):
        f = tmp_path / f"p{i}.txt"
        f.write_bytes(bytes(_prompts()[2][:n]))
        files += ["--prompt-file", str(f)]
    s = cli.main(["--checkpoint", ckpt, *files, "--max-new-tokens", "3", "--no-compare",
                  "--chunk-size", "128", "--max-running", "2", "--num-pages", "8"])
    assert s["requests"] == 2 and s["generated_tokens"] == 6
    assert s["prefill_tokens"] + s["decode_tokens"] <= 450 + 6
    assert s["pages_free_at_end"] == 8 and "attn_cos" not in s


def test_bf16_baseline_attention_matches_library_reference():
    """The baseline stream's plain-jnp paged attention (both its paths) equals
    jax_m3sparse.reference on K/V that bf16 holds exactly (dequantized NVFP4)."""
    import jax_m3sparse as m3
    from minimax_m3.attention import paged_attention_jnp
    rng = np.random.default_rng(2)
    P, Hkv, G, D, N = 8, 2, 4, 128, 128
    cache = m3.allocate_kv_cache(m3.KVCacheSpec(Hkv, D, N), P)
    kv = jnp.asarray(rng.normal(size=(2, P * N, Hkv, D)), jnp.float32)
    cache = m3.pack_kv_pages(cache, kv[0], kv[1], jnp.arange(P * N, dtype=jnp.int32), 1.0, 1.0)
    k, v = m3.unpack_kv_pages(cache, jnp.arange(P, dtype=jnp.int32), 1.0, 1.0)  # [P, Hkv, N, D]
    table = np.array([[5, 2, 7, 0, 4, 1], [1, 6, 3, -1, 2, 0]], np.int32)   # 2 steps of 4 blocks
    # 40 prefill tokens of request 0 (one-request chunks), then rows of both (mixed chunk).
    req = np.array([0] * 40 + [1, 0, 1, -1, 1], np.int32)
    pos = np.array(list(range(560, 600)) + [300, 500, 40, -1, 650], np.int32)
    T = len(req)
    topk = np.full((Hkv, T, 3), -1, np.int32)
    for g in range(Hkv):
        for t in range(T):
            local = max(pos[t], 0) // N
            ids = [local, *rng.permutation(local)[:int(rng.integers(0, 3))]]
            topk[g, t, :len(ids[:3])] = ids[:3]
    q = jnp.asarray(rng.normal(size=(T, Hkv * G, D)), jnp.float32)
    topk, table, req, pos = map(jnp.asarray, (topk, table, req, pos))
    want = m3.reference.sparse_prefill(q, cache, topk, table, req, pos, 1.0, 1.0)
    got = paged_attention_jnp(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), topk, table,
                               req, pos, D ** -0.5, chunk=16)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-5)


def test_speculative_decoding_matches_plain_greedy(params):
    """Prompt-lookup drafts verified in one step give the tokens plain greedy decoding gives
    (random weights soon repeat themselves, so some drafts are accepted)."""
    runs = []
    plain = EngineConfig(num_pages=9, max_running=2, chunk_size=256, max_seq_len=768,
                         spec_tokens=0, compare=False, keep_logits=True)
    for ecfg in (ECFG, plain):                # ECFG: the batched run's shapes, compiled already
        e = Engine(params, CFG, ecfg)
        for rid, p in enumerate(_prompts()[:2]):
            e.add_request(rid, p, max_new_tokens=24)
        runs.append(e.run())
    for a, b in zip(*runs):
        assert a.generated == b.generated, (a.rid, a.generated, b.generated)
        assert min(cosine(x, y) for x, y in zip(a.logits, b.logits)) >= 0.9999
    assert sum(r.accepted for r in runs[0]) > 0, "no draft was ever accepted"


def test_dry_run_plans_the_real_model(capsys, monkeypatch):
    """--dry-run on M3's published shapes at TP 8: no weight allocated, the step traces at full
    size, and the per-device bytes follow from the shapes (checked here by arithmetic); the
    verdict is against JAX's pool (XLA_PYTHON_CLIENT_MEM_FRACTION of the device), not the
    whole device."""
    import minimax_m3_generate as cli
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")    # as the README's run
    cfg_path = str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "m3_config")
    p = cli.main(["--config", cfg_path, "--dry-run", "--tp", "8", "--context-len", "131072",
                  "--batch", "8"])
    assert 420e9 < p["parameters"] < 432e9 and p["step_logits"] == (8, 200064)
    pages = 8 * 131072 // 128
    assert p["kv_cache_bytes_per_device"] == 60 * pages * 2 * 1 * 128 * 72   # 1 KV head/device
    assert p["index_cache_bytes_per_device"] == 57 * pages * 128 * 128 * 2   # 3 full layers
    # weights: about 1/8 of 2 bytes per parameter plus the replicated embeddings, router, indexer
    assert 2 * p["parameters"] / 8 < p["weight_bytes_per_device"] < 2 * p["parameters"] / 8 + 6e9
    out = capsys.readouterr().out
    # an H200 by default: 95 % of 141 GB is 133.95 GB; 131.2 GB + 8 GB kept does not fit it
    assert not p["fits"] and "of 133.9 GB (95 % of 141.0 GB, JAX's pool): does NOT fit" in out
    # each format: the requests of 131072 tokens that fit 133.95 - 8 GB beside the weights
    per_request = 1024 * 60 * 2 * 128 * 72 + 1024 * 57 * 128 * 128 * np.array([2, 1] * 4)
    experts = 57 * 128 * 3 * 6144 * 3072 // 8           # routed-expert weights per device
    bf16 = p["weight_bytes_per_device"]
    weights = np.array([bf16] * 2 + [bf16 - experts + experts // 32] * 2        # 1 + 1/32 B
                       + [bf16 - 2 * experts + experts // 2 + experts // 16      # 1/2 + 1/16 B
                          + 57 * 128 * 2 * 4] * 2                                # + scale_2
                       + [bf16 - 2 * experts + experts // 2 + experts // 32] * 2)  # 1/2 + 1/32 B
    got = [(f["experts"], f["index_cache_dtype"], f["weight_bytes"], f["max_requests"])
           for f in p["formats"]]
    assert got == [(e, i, w, n) for (e, i), w, n in zip(
        [(e, i) for e in ("bf16", "mxfp8", "nvfp4", "mxfp4")
         for i in ("bfloat16", "float8_e4m3fn")],
        weights, (int(141e9 * 0.95) - 8e9 - weights) // per_request)]
    assert [f["fits"] for f in p["formats"]] == [False, True] + [True] * 6 and got[0][3] == 6
    # the split per format, and the grid: at each context the requests of that length that fit
    for f, w in zip(p["formats"], weights):
        isize = 2 if f["index_cache_dtype"] == "bfloat16" else 1
        assert f["kv_cache_bytes"] == p["kv_cache_bytes_per_device"]
        assert f["index_cache_bytes"] == 57 * pages * 128 * 128 * isize
        assert list(f["max_requests_at"]) == [8192, 32768, 131072, 1048576]
        for c, n in f["max_requests_at"].items():
            per = c // 128 * (60 * 2 * 128 * 72 + 57 * 128 * 128 * isize)
            assert n == (int(141e9 * 0.95) - 8e9 - w) // per, (f, c)
    # the example README shows this very command's output: it must be what the code prints
    readme = (pathlib.Path(cfg_path).parents[0] / "minimax_m3" / "README.md").read_text()
    block = readme.split("--tp 8 --context-len 131072 --batch 8\n")[1]
    shown = block.split("```")[0].strip().splitlines()
    assert len(shown) == 17 and all(line in out for line in shown), (shown, out)
    # MXFP8 routed experts: the same parameters; each expert weight 1 byte + 1/32 for its
    # exponent instead of 2 (57 MoE layers × 128 experts × 3 × 6144 × 3072 / 8 per device)
    q = cli.main(["--config", cfg_path, "--dry-run", "--tp", "8", "--context-len", "131072",
                  "--batch", "8", "--expert-format", "mxfp8"])
    experts = 57 * 128 * 3 * 6144 * 3072 // 8
    assert q["parameters"] == p["parameters"] and "mxfp8" in q["weight_dtype"]
    assert p["weight_bytes_per_device"] - q["weight_bytes_per_device"] == experts - experts // 32
    with pytest.raises(ValueError, match="context_len 2097152 exceeds the model's "
                                         "max_position_embeddings 1048576"):
        cli.main(["--config", cfg_path, "--dry-run", "--tp", "8", "--context-len", "2097152"])
    with pytest.raises(ValueError, match=r"context_len \(0\) and batch \(8\) must be >= 1"):
        cli.main(["--config", cfg_path, "--dry-run", "--tp", "8", "--context-len", "0"])
    with pytest.raises(ValueError, match="--tp 3 must divide num_attention_heads = 64"):
        cli.main(["--config", cfg_path, "--dry-run", "--tp", "3"])
    # JAX's default pool (75 %) when the variable is unset; --mem-fraction overrides both
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    r = cli.main(["--config", cfg_path, "--dry-run", "--tp", "8"])
    assert r["pool_bytes"] == int(141e9 * 0.75) and r["mem_fraction"] == 0.75
    r = cli.main(["--config", cfg_path, "--dry-run", "--tp", "8", "--mem-fraction", "1"])
    assert r["pool_bytes"] == int(141e9) and r["fits"]
    assert "set XLA_PYTHON_CLIENT_MEM_FRACTION to that for the run" in capsys.readouterr().out
    with pytest.raises(ValueError, match="mem_fraction"):
        cli.main(["--config", cfg_path, "--dry-run", "--tp", "8", "--mem-fraction", "1.5"])
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "abc")
    with pytest.raises(ValueError, match="XLA_PYTHON_CLIENT_MEM_FRACTION must be a number"):
        cli.main(["--config", cfg_path, "--dry-run", "--tp", "8"])


def _prompt_batch(tokens, pages):
    """One prompt's whole prefill as forward_step's batch: its tokens at slots 0.., pages
    0..pages−1 in its block table, its last token sampled."""
    from minimax_m3 import sampling
    S = len(tokens)
    return dict(tokens=tokens, slot_mapping=np.arange(S, dtype=np.int32),
                query_lens=np.array([S], np.int32), context_lens=np.array([0], np.int32),
                block_table=np.arange(pages, dtype=np.int32)[None],
                **sampling.batch_arrays(np.array([S - 1])))


def _assert_same_caches(a, b):
    """Every cache array equal byte for byte."""
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name]).view(np.uint8),
                                      np.asarray(b[name]).view(np.uint8), err_msg=name)


def test_fp8_index_cache_selects_like_bf16():
    """FP8 (E4M3) index keys against bf16 ones on real text (3072 bytes of docs/SPEC.md through
    the default model): the first sparse layer sees the same hidden states in both runs, so its
    selections differ only through the keys' format. Over the rows that choose (more than 16
    blocks visible), measured on a Zen 3 CPU: 98.5 % of selected blocks shared, 77 % of (token,
    KV head) rows with the same set (FP8 rounding reorders near-equal blocks)."""
    import dataclasses
    from minimax_m3 import model
    tokens = np.frombuffer((pathlib.Path(__file__).resolve().parents[2] / "docs" / "SPEC.md")
                           .read_bytes()[:3072], np.uint8).astype(np.int32)
    base = ModelConfig()
    S, N, K = len(tokens), base.block_size, base.index_topk_blocks
    M = -(-S // N)
    params = init_params(base, 0)
    batch = _prompt_batch(tokens, M)
    topk = {}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        cfg = dataclasses.replace(base, index_cache_dtype=dtype)
        caches = model.allocate_caches(cfg, M)
        assert caches["idx"].dtype == jnp.dtype(dtype)
        _, out = model.forward_step(params, caches, batch, cfg=cfg, num_decode_requests=0,
                                    decode_query_len=1, collect=("topk",))
        topk[dtype] = np.asarray(out["topk"][0])                    # first sparse layer
    a, b = topk["bfloat16"], topk["float8_e4m3fn"]
    rows = np.arange(S) // N + 1 > K
    # every visible block selected (in score order): nothing to choose
    assert (np.sort(a[:, ~rows], -1) == np.sort(b[:, ~rows], -1)).all()
    sa, sb = np.sort(a[:, rows], -1), np.sort(b[:, rows], -1)
    same_rows = np.mean(np.all(sa == sb, -1))
    shared = np.mean([len(np.intersect1d(x, y)) / K for x, y in zip(sa.reshape(-1, K),
                                                                    sb.reshape(-1, K))])
    assert shared >= 0.95 and same_rows >= 0.6, (shared, same_rows)


def test_step_without_block_stats(params):
    """``block_stats=False`` (how the real-size bench times the step) changes nothing but the
    missing ``blocks``: the same tokens and caches bit for bit. With it, ``blocks`` equals a
    count made here from the collected selections (live rows' non-negative ids per sparse
    layer; every visible block on full layers)."""
    from minimax_m3 import model
    cfg = CFG
    S, N = 300, cfg.block_size
    M = -(-S // N)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, S).astype(np.int32)
    batch = _prompt_batch(tokens, M)
    runs = {}
    for stats in (True, False):
        caches, out = model.forward_step(params, model.allocate_caches(cfg, M), batch, cfg=cfg,
                                         num_decode_requests=0, decode_query_len=1,
                                         collect=("topk",), block_stats=stats)
        runs[stats] = jax.device_get((caches, out))
    (c_on, on), (c_off, off) = runs[True], runs[False]
    assert "blocks" not in off and set(on) - set(off) == {"blocks"}
    np.testing.assert_array_equal(on["tokens"], off["tokens"])
    _assert_same_caches(c_on, c_off)
    visible = cfg.num_key_value_heads * int(np.sum(np.arange(S) // N + 1))
    expected = np.full((cfg.num_layers, 2), visible)
    expected[list(cfg.sparse_layers), 0] = (on["topk"] >= 0).sum(axis=(1, 2, 3))
    np.testing.assert_array_equal(on["blocks"], expected)
    assert expected[list(cfg.sparse_layers), 0].min() < visible    # the selection did choose


def test_step_names_missing_batch_arrays(params):
    """A batch without ``sample_rows`` (or another required array) is refused at trace time
    with the names, not a bare KeyError from deep inside the step."""
    from minimax_m3 import model
    cfg = CFG
    batch = dict(tokens=np.zeros(4, np.int32), slot_mapping=np.arange(4, dtype=np.int32),
                 query_lens=np.array([4], np.int32), context_lens=np.array([0], np.int32),
                 block_table=np.zeros((1, 1), np.int32))
    with pytest.raises(KeyError, match=r"lacks \['sample_rows'\].*batch_arrays"):
        model.forward_step(params, model.allocate_caches(cfg, 1), batch, cfg=cfg,
                           num_decode_requests=0, decode_query_len=1)


def test_negative_dense_matmul_rows_is_refused():
    with pytest.raises(ValueError, match=r"dense_matmul_rows \(-1\) must be >= 0"):
        ModelConfig(dense_matmul_rows=-1)


def test_request_longer_than_the_model_is_refused(params):
    """A request past config.json's max_position_embeddings is refused when it is added,
    naming the limit, even where the engine's max_seq_len would hold it."""
    short = dataclasses.replace(CFG, max_position_embeddings=300)
    engine = Engine(params, short, ECFG)
    engine.add_request(0, [1] * 290, max_new_tokens=10)          # exactly the limit
    with pytest.raises(ValueError, match="exceed the model's max_position_embeddings 300"):
        engine.add_request(1, [1] * 291, max_new_tokens=10)
