"""CI guard for the CUDA backend (no GPU needed): every source under ffi/cuda/ and the device
harness compile with nvcc for sm_90a, and the attention kernel keeps its register budget with
no spills. Skips cleanly where nvcc (or, for the handlers, jax's FFI headers) is absent."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CUDA = ROOT / "ffi" / "cuda"
NVCC = shutil.which("nvcc")
GENCODE = "-gencode=arch=compute_90a,code=sm_90a"

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


def _nvcc(src: pathlib.Path, out: pathlib.Path, *extra: str) -> str:
    cmd = [NVCC, "-std=c++17", "-O3", GENCODE, f"-I{ROOT / 'ffi' / 'include'}", f"-I{CUDA}",
           *extra, "-c", str(src), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout}\n{res.stderr}"
    return res.stdout + res.stderr


@pytest.mark.parametrize("name", ["pack.cu", "positions.cu"])
def test_kernels_compile(tmp_path, name):
    _nvcc(CUDA / name, tmp_path / (name + ".o"))


def test_attention_compiles_without_spills(tmp_path):
    log = _nvcc(CUDA / "attention.cu", tmp_path / "attention.o", "-Xptxas", "-v")
    entries = re.findall(r"Used (\d+) registers", log)
    assert len(entries) == 2, log  # bf16 and fp16 instantiations
    assert all(int(n) <= 170 for n in entries), log  # __launch_bounds__(128, 3)
    assert "spill stores" in log and not re.search(r"[1-9]\d* bytes spill stores", log), log
    assert not re.search(r"[1-9]\d* bytes stack frame", log), log


def test_handlers_compile(tmp_path):
    jax = pytest.importorskip("jax")
    _nvcc(CUDA / "handlers.cc", tmp_path / "handlers.o", "-isystem", jax.ffi.include_dir())


def test_harness_compiles(tmp_path):
    _nvcc(ROOT / "tests" / "cuda" / "harness.cu", tmp_path / "harness.o")
