"""Smoke test of the real-size benchmark (examples/minimax_m3/bench.py) at a tiny size on the
CPU: it runs end to end, as ``python -m examples.minimax_m3.bench`` too, and its numbers hang
together (no timing is asserted)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from minimax_m3 import bench

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_module_entry_point():
    """``python -m examples.minimax_m3.bench`` from the repository root, no sys.path edits."""
    r = subprocess.run([sys.executable, "-m", "examples.minimax_m3.bench", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--moe-impl" in r.stdout and "--quick" in r.stdout


def test_tiny_bench_runs(tmp_path):
    out = tmp_path / "bench.json"
    rep = bench.main(["--tiny", "--batch", "2", "--context", "256,512", "--prefill", "0",
                      "--repeats", "1", "--warmup", "0", "--moe-impls", "dense,ragged",
                      "--json", str(out)])
    assert json.loads(out.read_text())["shapes"][0]["kind"] == "decode"
    row, longer = rep["shapes"]
    assert row["tokens"] == 2 and row["host_bytes"]["to_host"] < 1 << 20
    parts = {p["part"]: p for p in row["parts"]}
    # the parts whose shapes do not change with the context are timed once and say so
    again = {p["part"]: p for p in longer["parts"]}
    assert again["dense MLP"]["reused_from"] == 256 and "reused_from" not in again["selection"]
    assert again["dense MLP"]["us_per_layer"] == parts["dense MLP"]["us_per_layer"]
    assert {"attention (sparse)", "attention (full)", "selection", "moe (dense)",
            "moe (ragged)", "dense MLP", "projections+norms", "lm_head+sampling"} <= set(parts)
    assert all(p["us_per_layer"] > 0 and p["floor_us"] > 0 for p in parts.values())
    # two tokens of top-4-of-16 routing touch between 4 and 8 experts
    assert 4 <= parts["moe (dense)"]["routed_experts"] <= 8
    assert row["projected_step_ms"] >= row["step_ms"]
    # the floor is each built part's max(bytes, FLOPs) time: never under its bytes alone
    assert row["step_floor_ms"] * 1e-3 * 4.25e12 >= row["step_floor_gb"] * 1e9 * (1 - 1e-9) > 0
    # --no-parts: the same floors from the parts' counts, no part compiled or timed
    quick = bench.main(["--tiny", "--batch", "2", "--context", "256", "--prefill", "0",
                        "--repeats", "1", "--warmup", "0", "--no-parts"])
    (q,) = quick["shapes"]
    assert all(p["us_per_layer"] is None for p in q["parts"]) and "projected_step_ms" not in q
    assert (q["step_floor_ms"], q["step_floor_gb"]) == (row["step_floor_ms"], row["step_floor_gb"])


def test_random_caches_are_finite_and_the_step_routes_widely():
    """The bench's random K/V pages dequantize to finite values (SPEC §3.2's planes: codes in the
    data plane, 1.0 in the scale plane), so the step's activations are finite and its routing
    is the router's, not NaN's: 32 tokens of top-4-of-16 touch nearly every expert. (Filled as
    72-byte token rows, the scale plane got random codes, the attention outputs were NaN and
    every token routed to the same 4 experts.)"""
    import jax.numpy as jnp
    import jax_m3sparse as m3
    rep = bench.main(["--tiny", "--batch", "32", "--context", "256", "--prefill", "0",
                      "--repeats", "1", "--warmup", "0", "--no-parts"])
    (row,) = rep["shapes"]
    r = row["routing"]
    assert r["experts_min"] >= 12 and r["uniform_experts"] > 15.9, r
    # 128 pairs over 16 experts, 8 on average: with the router's correction bias 0
    # (bench.balanced_router) the largest group stays near a multinomial's (the random N(0, 0.1)
    # bias gave 19.7; NaN activations gave 32, every token on the same experts)
    assert r["largest_group_mean"] < 16, r
    caches = bench.random_caches(bench.full_config(bench.parse_args(["--tiny"])), 3, 0)
    k, v = m3.reference.unpack_kv_pages(caches["kv"], jnp.arange(3), 1.0, 1.0, layer=0,
                                       layout="LBHNC")
    assert bool(jnp.isfinite(k).all() & jnp.isfinite(v).all())
    assert float(jnp.abs(k).max()) == 6.0            # random E2M1 codes at scale 1.0
