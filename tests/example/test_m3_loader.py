"""The M3 example's lazy checkpoint loader holds little host memory beyond what it loads.

A > 2 GB random bf16 checkpoint directory (6 layers, 32-expert MoE, 600 MB shards) is written
and loaded in fresh processes (tests/workers/m3_loader_rss.py). On the CPU backend the loaded
"device" arrays are host memory themselves, so the bound is on what loading adds above them:
peak RSS − baseline − loaded bytes must stay within the largest tensor (256 MiB here) plus a
small constant, however large the checkpoint, and no tensor may be widened from bf16.
"""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "workers" / "m3_loader_rss.py"
# a script in a fresh process: pytest's pythonpath does not reach it (minimax_m3)
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    filter(None, [str(ROOT / "examples"), os.environ.get("PYTHONPATH")])))


def test_lazy_load_peak_rss(tmp_path):
    ckpt = tmp_path / "ckpt"
    subprocess.run([sys.executable, str(SCRIPT), "write", str(ckpt)], check=True, env=ENV)
    assert sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) > 2e9
    assert len(list(ckpt.glob("model-*.safetensors"))) >= 4
    out = subprocess.run([sys.executable, str(SCRIPT), "load", str(ckpt)], check=True, env=ENV,
                         capture_output=True, text=True).stdout
    m = json.loads(out.strip().splitlines()[-1])
    assert m["params"] > 2e9 and m["dtypes"] == ["bfloat16"]
    overhead = m["peak"] - m["baseline"] - m["params"]
    print(f"peak RSS above baseline + loaded bytes: {overhead / 2**20:.0f} MiB "
          f"(largest tensor {m['largest'] / 2**20:.0f} MiB)")
    assert overhead <= m["largest"] + (64 << 20), m
