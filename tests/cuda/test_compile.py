"""CI guard for the CUDA backend (no GPU needed): every source under ffi/cuda/ and the device
harness compile with nvcc for sm_90a, and the attention kernels keep their register budget
(the one-CTA-per-row kernels: 128 registers for 4 CTAs per SM, at most a few spilled bytes), and
pack.cu's quantizer matches nvfp4.h on the host. Skips cleanly where nvcc (or, for the handlers,
jax's FFI headers) is absent."""

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


def _nvcc(src: pathlib.Path, out: pathlib.Path, *extra: str, link: bool = False) -> str:
    cmd = [NVCC, "-std=c++17", "-O3", GENCODE, f"-I{ROOT / 'ffi' / 'include'}", f"-I{CUDA}",
           *extra, *([] if link else ["-c"]), str(src), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout}\n{res.stderr}"
    return res.stdout + res.stderr


def _resources(log: str) -> dict[str, dict[str, int]]:
    """{mangled kernel name: {registers, spill_stores, stack}} from `ptxas -v` output."""
    out, name = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = m.group(1)
            out[name] = {}
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", line)
        if m and name:
            out[name].update(stack=int(m.group(1)), spill_stores=int(m.group(2)))
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            out[name]["registers"] = int(m.group(1))
    return out


@pytest.mark.parametrize("name", ["pack.cu", "positions.cu", "select.cu"])
def test_kernels_compile(tmp_path, name):
    _nvcc(CUDA / name, tmp_path / (name + ".o"))


def test_grouped_matmul_resources(tmp_path):
    """The grouped GEMM's four tiles (16 × 32, 16 × 64, 16 × 128 rows × columns: 4 CTAs per SM,
    so at most 128 registers at 4 warps; 64 × 128: 2 CTAs per SM) for bf16 operands, MXFP8
    weights, MXFP8 rows and weights, MXFP4 and NVFP4 weights (the first template argument,
    ``FmtE0`` / ``1`` / ``2`` / ``3`` / ``4``), each plain and with the epilogue (SPEC §9 item
    6; the last template argument), none spilling — but W8A8's 16 × 128 tile, 3 CTAs per SM (at
    most 170 registers), which spills 4 bytes as it was measured (BENCHMARKS.md §1.2). The
    widened formats (MXFP8, MXFP4, NVFP4 weights) run every 16-row tile with 4 warps (the
    template's row tiles, warps and n8 tiles per warp: ``Li1ELi4ELi1E`` / ``2`` / ``4``)."""
    res = _resources(_nvcc(CUDA / "grouped_matmul.cu", tmp_path / "gm.o", "-Xptxas", "-v"))
    kernels = {k: v for k, v in res.items() if "grouped_matmul_kernel" in k}
    assert len(kernels) == 40 and len(res) == 40, res
    fmts = sorted(re.search(r"kernelILNS1_3FmtE(\d)E", k).group(1) for k in kernels)
    assert fmts == [f for f in "01234" for _ in range(8)], fmts
    assert sum(k.endswith("ELb1EEEvNS0_19GroupedMatmulParamsEl") for k in kernels) == 20, kernels
    shapes = sorted(re.search(r"FmtE(\d)ELi(\d)ELi(\d)ELi(\d)E", k).groups() for k in kernels)
    widened = [(f, "1", "4", n) for f in "134" for n in "124"] + [(f, "4", "4", "4") for f in "134"]
    plain = [(f, m, w, "4") for f in "02" for m, w in (("1", "1"), ("1", "2"), ("1", "4"),
                                                         ("4", "4"))]
    assert shapes == sorted(2 * (widened + plain)), shapes
    for name, r in kernels.items():
        w8a8_wide = "FmtE2ELi1ELi4E" in name
        assert r["spill_stores"] <= (8 if w8a8_wide else 0), (name, r)
        if re.search(r"FmtE\dELi1ELi4E", name):   # 16-row, 4 warps: 4 CTAs per SM (W8A8: 3)
            assert r["registers"] <= (170 if w8a8_wide else 128), (name, r)


def test_attention_resources(tmp_path):
    res = _resources(_nvcc(CUDA / "attention.cu", tmp_path / "attention.o", "-Xptxas", "-v"))
    kernels = {k: v for k, v in res.items() if "sparse_attention_kernel" in k}
    merges = {k: v for k, v in res.items() if "full_merge_kernel" in k}
    # per q dtype (bf16: bit placement; f16: fp8 conversion) the three launch shapes of one
    # reduction tree, the cluster size and the full_attention flag last in the mangled name: one
    # CTA per row (`Li1ELb0EE`; 4 CTAs per SM: 128 registers), its full_attention form
    # (`Li1ELb1EE`, the same cap), and the clusters of 2 and 4 per row (`Li2E`, `Li4E`; no
    # register cap, no spills); full_attention's merge of the parts, one per q dtype
    assert len(kernels) == 8 and len(merges) == 2, res
    assert len(res) == len(kernels) + len(merges), res  # no other kernel in the file
    shapes = sorted(re.search(r"Li(\d)ELb(\d)EEEv", name).groups() for name in kernels)
    assert shapes == [("1", "0")] * 2 + [("1", "1")] * 2 + [("2", "0")] * 2 + [("4", "0")] * 2
    for name, r in kernels.items():
        if "Li1ELb" in name:
            assert r["registers"] <= 128 and r["spill_stores"] <= 192, (name, r)
        else:
            assert r["spill_stores"] == 0, (name, r)
    for name, r in merges.items():
        assert r["spill_stores"] == 0, (name, r)


def test_handlers_compile(tmp_path):
    jax = pytest.importorskip("jax")
    _nvcc(CUDA / "handlers.cc", tmp_path / "handlers.o", "-isystem", jax.ffi.include_dir())


@pytest.mark.parametrize("name", ["harness.cu", "select_harness.cu", "grouped_harness.cu"])
def test_harness_compiles(tmp_path, name):
    _nvcc(ROOT / "tests" / "cuda" / name, tmp_path / (name + ".o"))


def test_pack_quantizer_matches_nvfp4_on_host(tmp_path):
    """pack.cu's quantizer (E2M1 rounding on the FP pipe, Markstein quotients, SWAR packing) run
    through its host twins against nvfp4.h, byte for byte, on 1.8 M groups built on
    and around every rounding threshold (no GPU needed; the harness repeats it on the device)."""
    exe = tmp_path / "pack_host_check"
    _nvcc(ROOT / "tests" / "cuda" / "pack_host_check.cu", exe, link=True)
    run = subprocess.run([str(exe), "200000"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "1800000 groups, 0 mismatches" in run.stdout, run.stdout
