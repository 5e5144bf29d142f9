"""The fused attention input projection (examples/minimax_m3/attention.py ``qkv_proj``):
fusing and splitting are exact inverses, and ``project`` computes what the five separate
checkpoint-layout projections compute, checked against a numpy oracle written here."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from minimax_m3.attention import fuse_qkv, fused_width, project, split_qkv
from minimax_m3.config import DENSE_MLP, SPARSE, ModelConfig
from minimax_m3.model import fuse_projections, init_params, param_shapes, unfuse_projections

CFG = ModelConfig(hidden_size=96, num_hidden_layers=1, num_attention_heads=8,
                  num_key_value_heads=2, index_n_heads=2, index_head_dim=64,
                  dense_intermediate_size=64, layer_types=(SPARSE,), mlp_layer_types=(DENSE_MLP,))


def _weights(cfg, rng, lead=()):
    H, D, Di = cfg.hidden_size, cfg.head_dim, cfg.index_head_dim
    w = lambda n: rng.standard_normal((*lead, n, H)).astype(np.float32)   # noqa: E731
    return dict(q_proj=w(cfg.num_attention_heads * D), k_proj=w(cfg.num_key_value_heads * D),
                v_proj=w(cfg.num_key_value_heads * D),
                index_q_proj=w(cfg.index_n_heads * Di), index_k_proj=w(Di))


@pytest.mark.parametrize("replicas", [1, 2, 4])
@pytest.mark.parametrize("lead", [(), (3,)])
def test_fuse_then_split_is_the_identity(replicas, lead):
    cfg = dataclasses.replace(CFG, kv_replicas=replicas)
    ws = _weights(cfg, np.random.default_rng(replicas), lead)
    fused = np.asarray(fuse_qkv(ws["q_proj"], ws["k_proj"], ws["v_proj"], ws["index_q_proj"],
                                ws["index_k_proj"], cfg=cfg))
    assert fused.shape == (*lead, cfg.cache_kv_heads, fused_width(cfg, True), cfg.hidden_size)
    back = split_qkv(fused, cfg, sparse=True)
    assert set(back) == set(ws)
    for k in ws:
        np.testing.assert_array_equal(np.asarray(back[k]), ws[k], err_msg=k)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (1 + w)


def _rope(x, pos, rd, theta):
    inv = 1.0 / theta ** (np.arange(0, rd, 2) / rd)
    ang = pos[:, None, None] * inv                              # [T, 1, rd/2]
    c, s = np.cos(ang), np.sin(ang)
    a, b, rest = x[..., :rd // 2], x[..., rd // 2:rd], x[..., rd:]
    return np.concatenate([a * c - b * s, b * c + a * s, rest], -1)


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_project_matches_the_separate_projections(replicas):
    """q, k, v, the index queries (one per stored KV head) and the index key from the fused
    weight equal numpy's five separate matmuls, Gemma norms and rotate-half RoPE (fp64)."""
    from minimax_m3.layers import rotary_cos_sin
    cfg = dataclasses.replace(CFG, kv_replicas=replicas)
    rng = np.random.default_rng(7)
    T, H, D, Di = 5, cfg.hidden_size, cfg.head_dim, cfg.index_head_dim
    ws = _weights(cfg, rng)
    norms = {k: 0.1 * rng.standard_normal(n).astype(np.float32)
             for k, n in [("q_norm", D), ("k_norm", D), ("iq_norm", Di), ("ik_norm", Di)]}
    p = dict(qkv_proj=fuse_qkv(*[jnp.asarray(ws[k]) for k in ("q_proj", "k_proj", "v_proj",
                                                               "index_q_proj", "index_k_proj")],
                               cfg=cfg),
             q_norm=norms["q_norm"], k_norm=norms["k_norm"],
             indexer=dict(q_norm=norms["iq_norm"], k_norm=norms["ik_norm"]))
    h = rng.standard_normal((T, H)).astype(np.float32)
    pos = np.arange(3, 3 + T)
    cos, sin = rotary_cos_sin(jnp.asarray(pos), cfg.rotary_dim, cfg.rope_theta)
    q, k, v, iq, ik = (np.asarray(a) for a in project(p, jnp.asarray(h), cos, sin, cfg))

    h64, eps, rd = h.astype(np.float64), cfg.rms_norm_eps, cfg.rotary_dim
    mm = lambda w, n: (h64 @ w.astype(np.float64).T).reshape(T, n, -1)   # noqa: E731
    want_q = _rope(_rms(mm(ws["q_proj"], cfg.num_attention_heads), norms["q_norm"], eps), pos, rd, cfg.rope_theta)
    want_k = _rope(_rms(mm(ws["k_proj"], cfg.num_key_value_heads), norms["k_norm"], eps), pos, rd, cfg.rope_theta)
    want_v = mm(ws["v_proj"], cfg.num_key_value_heads)
    want_iq = _rope(_rms(mm(ws["index_q_proj"], cfg.index_n_heads), norms["iq_norm"], eps), pos, Di, cfg.rope_theta)
    want_ik = _rope(_rms(mm(ws["index_k_proj"], 1), norms["ik_norm"], eps), pos, Di, cfg.rope_theta)[:, 0]
    rep = lambda a: np.repeat(a, replicas, axis=1)   # noqa: E731 (stored head j = KV head j // replicas)
    tol = dict(rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(q, want_q, **tol)
    np.testing.assert_allclose(k, rep(want_k), **tol)
    np.testing.assert_allclose(v, rep(want_v), **tol)
    np.testing.assert_allclose(iq, rep(want_iq), **tol)
    np.testing.assert_allclose(ik, want_ik, **tol)


def test_init_params_fuses_what_unfuse_returns():
    """The served pytree holds one ``qkv_proj`` per attention layer; unfusing it gives the
    checkpoint layout's shapes, and fusing that again gives the same bits."""
    cfg = dataclasses.replace(CFG, kv_replicas=2)
    served = init_params(cfg, seed=3)
    att = served["segments"][0]["self_attn"]
    assert "qkv_proj" in att and "q_proj" not in att and "q_proj" not in att["indexer"]
    flat = unfuse_projections(served, cfg)
    want = param_shapes(cfg, fused=False)
    got = {k: tuple(v.shape) for k, v in flat["segments"][0]["self_attn"].items() if k != "indexer"}
    assert got == {k: v for k, v in want["segments"][0]["self_attn"].items() if k != "indexer"}
    again = fuse_projections(flat, cfg)
    np.testing.assert_array_equal(np.asarray(again["segments"][0]["self_attn"]["qkv_proj"]),
                                  np.asarray(att["qkv_proj"]))
