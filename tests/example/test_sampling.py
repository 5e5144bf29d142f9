"""Sampling on the device (examples/minimax_m3/sampling.py) and the engine around it.

Oracles: numpy's sort and softmax for the top-k / top-p masks, the softmax itself for the
frequencies of 20,000 seeded draws (a chi-square bound), and the engine's own runs for
reproducibility (same seed: same tokens, alone or batched, with or without speculative drafts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_m3 import sampling, text
from minimax_m3.config import DENSE_MLP, FULL, MOE, SPARSE, ModelConfig
from minimax_m3.engine import Engine, EngineConfig
from minimax_m3.model import init_params
from minimax_m3.sampling import SamplingParams

from prompts import license_prompts

CFG = ModelConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, index_n_heads=1, dense_intermediate_size=256,
                  intermediate_size=64, shared_intermediate_size=64, num_local_experts=4,
                  index_head_dim=64, index_topk_blocks=2, layer_types=(FULL, SPARSE),
                  mlp_layer_types=(DENSE_MLP, MOE))
ECFG = EngineConfig(num_pages=8, max_running=2, chunk_size=128, max_seq_len=512, compare=False)
HOT = dict(temperature=1.5, top_p=0.9, top_k=40)     # random weights: flat-ish, many candidates


def _mask_oracle(z, k, p):
    """numpy: sort descending, keep rank < k, then the smallest prefix reaching mass p."""
    order = np.argsort(-z, kind="stable")
    k = len(z) if k <= 0 or k >= len(z) else k
    e = np.exp(z[order[:k]] - z[order[0]])
    probs = e / e.sum()
    n = k if p >= 1 else int(np.searchsorted(np.cumsum(probs), p) + 1)
    keep = np.zeros(len(z), bool)
    keep[order[:min(n, k)]] = True
    return keep


def test_filter_mask_exact(rng):
    V = 64
    z = rng.permutation(np.linspace(-4.0, 3.0, V)).astype(np.float32)     # distinct values
    cases = [(0, 1.0), (1, 1.0), (5, 1.0), (V, 1.0), (0, 0.5), (0, 0.999), (10, 0.6), (3, 0.01)]
    zs = np.stack([z] * len(cases))
    k = np.array([c[0] for c in cases], np.int32)
    p = np.array([c[1] for c in cases], np.float32)
    got = np.asarray(jax.jit(sampling.filter_mask)(zs, k, p))
    for i, (ki, pi) in enumerate(cases):
        np.testing.assert_array_equal(got[i], _mask_oracle(z, ki, pi), err_msg=str(cases[i]))
    # by hand: probabilities 0.4, 0.3, 0.2, 0.1 -> top-p 0.65 keeps the first two
    small = np.log(np.array([[0.1, 0.4, 0.2, 0.3]], np.float32))
    keep = sampling.filter_mask(small, np.array([0], np.int32), np.array([0.65], np.float32))
    np.testing.assert_array_equal(np.asarray(keep), [[False, True, False, True]])


def _draws(logits, n, **kw):
    """``n`` tokens from one row of logits: seeds 0..n−1 at position 7."""
    p = SamplingParams(**kw)
    b = sampling.batch_arrays(np.arange(n), [SamplingParams(**kw, seed=i) for i in range(n)]
                              if p.temperature else None)
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
    pos = jnp.full(n, 6, jnp.int32)                      # sampled position 7
    return np.asarray(jax.jit(sampling.sample_rows_out)(rows, b, pos)["tokens"])


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8),
                                dict(temperature=1.3, top_k=3)])
def test_frequencies_match_the_softmax(kw):
    """20,000 draws on 6 tokens: Pearson's chi-square against the (tempered, filtered,
    renormalised) softmax stays below 22.46, the 0.999 quantile of chi-square with 6 − 1 = 5
    degrees of freedom (the draws are fixed by their seeds: this is a fixed check of the
    sampler, failing only if its distribution is wrong by more than sampling noise)."""
    logits = np.array([1.0, 0.5, 0.0, -0.5, 1.5, -2.0], np.float32)
    n = 20_000
    tokens = _draws(logits, n, **kw)
    z = logits / kw["temperature"]
    keep = _mask_oracle(z, kw.get("top_k", 0), kw.get("top_p", 1.0))
    probs = np.where(keep, np.exp(z - z.max()), 0.0)
    probs /= probs.sum()
    counts = np.bincount(tokens, minlength=len(logits))
    assert np.all(counts[~keep] == 0), counts               # filtered tokens never drawn
    expected = n * probs[keep]
    chi2 = float(np.sum((counts[keep] - expected) ** 2 / expected))
    assert chi2 < 22.46, (chi2, counts, expected)


def test_greedy_and_keys():
    logits = np.array([[0.0, 2.0, 2.0, 1.0]], np.float32)
    assert _draws(logits[0], 3).tolist() == [1, 1, 1]          # greedy: first of ties
    a = _draws(np.zeros(50, np.float32), 64, temperature=1.0)
    assert a.tolist() == _draws(np.zeros(50, np.float32), 64, temperature=1.0).tolist()
    assert len(set(a.tolist())) > 20                             # seeds give different draws
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


def test_logprobs():
    logits = jnp.asarray([[1.0, 3.0, 2.0, 0.0]], jnp.float32)
    out = sampling.logprobs(logits, jnp.array([2]), 2)
    ref = np.asarray(jax.nn.log_softmax(logits))[0]
    np.testing.assert_allclose(out["logprob"], [ref[2]], rtol=1e-6)
    np.testing.assert_array_equal(out["top_ids"], [[1, 2]])
    np.testing.assert_allclose(out["top_logprobs"], [ref[[1, 2]]], rtol=1e-6)


# ----------------------------------------------------------------------------- the engine
def _prompts():
    return license_prompts({"BSD": 150, "Apache-2.0": 300, "GPL-3": 200}, filler_repeat=4)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=0)


def _run(params, reqs, ecfg=ECFG, new=6):
    """reqs: [(rid, prompt, SamplingParams)] -> (engine, {rid: generated})."""
    e = Engine(params, CFG, ecfg)
    for rid, prompt, sp in reqs:
        e.add_request(rid, prompt, new, sp)
    return e, {r.rid: r.generated for r in e.run()}


def test_seeded_sampling_reproducible_and_batch_independent(params):
    """Seeded top-p/top-k sampling: the same tokens run twice, alone or batched with other
    (greedy and sampling) requests, and with speculative drafts verified in the step."""
    ps = _prompts()
    reqs = [(0, ps[0], SamplingParams(**HOT, seed=11)), (1, ps[1], SamplingParams()),
            (2, ps[2], SamplingParams(**HOT, seed=12))]
    _, batched = _run(params, reqs)
    _, again = _run(params, reqs)
    assert batched == again
    for req in reqs:
        assert _run(params, [req])[1] == {req[0]: batched[req[0]]}, req[0]
    spec = EngineConfig(**{**ECFG.__dict__, "spec_tokens": 2})
    assert _run(params, reqs, spec)[1] == batched
    other_seed = _run(params, [(0, ps[0], SamplingParams(**HOT, seed=99))])[1][0]
    assert batched[0] != other_seed       # the seed matters (6 tokens, flat logits)


def test_stop_token_ends_a_request_and_frees_its_pages(params):
    ps = _prompts()
    _, plain = _run(params, [(0, ps[0], SamplingParams()), (1, ps[1], SamplingParams())])
    stop = plain[0][2]
    first = plain[0].index(stop)
    e = Engine(params, CFG, ECFG)
    e.add_request(0, ps[0], 6, SamplingParams(stop_token_ids=(stop,)))
    e.add_request(1, ps[1], 6)
    freed_early = False
    while e.waiting or e.running:
        e.step()
        if any(r.rid == 0 for r in e.finished) and e.running:   # 0 stopped, 1 still running
            assert set(e.allocator.owner.values()) == {1}        # 0's pages are back
            freed_early = True
    assert freed_early
    done = {r.rid: r for r in e.finished}
    assert done[0].generated == plain[0][:first + 1]           # the stop token is kept
    assert done[0].finish_reason == "stop" and done[1].finish_reason == "length"
    assert done[1].generated == plain[1]
    assert e.allocator.num_free() == e.allocator.num_pages and not e.allocator.owner


def test_eos_ids_from_config_and_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"eos_token_id": [7, 3], "text_config": {"eos_token_id": 9}}')
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 11}')
    assert text.eos_token_ids(str(tmp_path), text.ByteTokenizer()) == [3, 7, 9, 11]
    assert text.eos_token_ids(str(tmp_path / "config.json"), text.ByteTokenizer()) == [3, 7, 9, 11]
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({"[UNK]": 0, "</s>": 5}, unk_token="[UNK]")).save(
        str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": {"content": "</s>"}}')
    assert text.eos_token_ids(str(tmp_path), text.tokenizer_for(str(tmp_path))) == [3, 5, 7, 9, 11]
    assert text.eos_token_ids(None, text.ByteTokenizer()) == []


def test_host_bytes_per_step_at_real_vocab():
    """A decode step of 128 requests (T = 128) of a model with M3's vocabulary (200064)
    brings at most 1 MB to the host (tokens, block counts; + top-5 logprobs), never logits."""
    cfg = ModelConfig(vocab_size=200064, hidden_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=1, index_n_heads=1,
                      dense_intermediate_size=64, layer_types=(FULL,), mlp_layer_types=(DENSE_MLP,))
    ecfg = EngineConfig(num_pages=128, max_running=128, chunk_size=128, max_seq_len=128,
                        compare=False, num_logprobs=5)
    e = Engine(init_params(cfg, seed=0), cfg, ecfg)
    for rid in range(128):
        e.add_request(rid, [rid % 256], 2)
    e.step()                                   # the prompts (128 one-token chunks)
    assert all(len(r.generated) == 1 for r in e.running)
    e.step()                                   # one decode step: T = 128 rows
    assert len(e.finished) == 128
    assert e.host_bytes <= 1 << 20, e.host_bytes
    assert e.host_bytes < 128 * 200064 * 4 / 100
    assert e.finished[0].logprobs and len(e.finished[0].logprobs[0][1]) == 5
