"""The M3 example with --tp: Megatron-style shardings over simulated CPU devices give the same
tokens as one device, with KV heads replicated past Hkv (M3's 64 query / 4 KV heads at TP 8)."""

import pathlib
import sys

import jax
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

import minimax_m3_generate  # noqa: E402

TINY = ["--layers", "2", "--hidden", "128", "--intermediate", "128", "--max-new-tokens", "4",
        "--max-prompt-tokens", "200", "--no-compare"]


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 simulated devices")
def test_tp8_with_replicated_kv_heads_matches_tp1(capsys):
    heads = ["--heads", "64", "--kv-heads", "4"]
    one = minimax_m3_generate.main(TINY + heads + ["--tp", "1"])
    eight = minimax_m3_generate.main(TINY + heads + ["--tp", "8"])
    assert eight["generated"] == one["generated"]
    assert all(len(g) == 4 for g in one["generated"].values())
    # 4 KV heads stored twice over 8 devices: each holds 1 KV head, 1/4 of the TP1 cache.
    assert eight["cache_kv_heads"] == 8
    assert eight["kv_cache_bytes_per_device"] * 4 == one["kv_cache_bytes_per_device"]
    assert "MiB per device" in capsys.readouterr().out
