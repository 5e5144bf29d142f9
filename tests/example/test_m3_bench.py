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
    rep = bench.main(["--tiny", "--batch", "2", "--context", "256", "--prefill", "0",
                      "--repeats", "1", "--warmup", "0", "--moe-impls", "dense,ragged",
                      "--json", str(out)])
    assert json.loads(out.read_text())["shapes"][0]["kind"] == "decode"
    (row,) = rep["shapes"]
    assert row["tokens"] == 2 and row["host_bytes"]["to_host"] < 1 << 20
    parts = {p["part"]: p for p in row["parts"]}
    assert {"attention (sparse)", "attention (full)", "selection", "moe (dense)",
            "moe (ragged)", "dense MLP", "projections+norms", "lm_head+sampling"} <= set(parts)
    assert all(p["us_per_layer"] > 0 and p["floor_us"] > 0 for p in parts.values())
    # two tokens of top-4-of-16 routing touch between 4 and 8 experts
    assert 4 <= parts["moe (dense)"]["routed_experts"] <= 8
    assert row["projected_step_ms"] >= row["step_ms"]
