"""Fixtures of the gfx950 static checks: export every FlyDSL kernel once per session.

These tests run on a CPU-only machine (CI). They need `pip install flydsl==0.5.0 torch` (CPU
torch) and Debian's `lld-22` and `llvm-22` (llvm-objdump-22, llvm-readelf-22); without them they
skip with the reason. No test here touches a GPU (tests/rocm/test_device.py does, where one is).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.rocm.toolchain import EXPORT, Exported, Kernel, toolchain_missing


@pytest.fixture(scope="session")
def exported(tmp_path_factory) -> Exported:
    why = toolchain_missing()
    if why:
        pytest.skip(f"gfx950 toolchain missing: {why}")
    names = subprocess.run([sys.executable, str(EXPORT), "--list"], check=True, capture_output=True,
                           text=True).stdout.split()
    # M3SPARSE_GFX950_KERNELS=DIR reuses an export of this tree (as CMake's PREBUILT_KERNEL_DIR)
    prebuilt = os.environ.get("M3SPARSE_GFX950_KERNELS")
    if prebuilt and all((Path(prebuilt) / f"{n}.o").is_file() for n in names):
        out = Path(prebuilt)
    else:
        out = tmp_path_factory.mktemp("gfx950_export")
        env = dict(os.environ, FLYDSL_GPU_ARCH="gfx950", ARCH="gfx950")
        proc = subprocess.run([sys.executable, str(EXPORT), "--arch", "gfx950", "--out", str(out)],
                              capture_output=True, text=True, env=env)
        if proc.returncode:
            pytest.fail(f"export.py failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")
    result = Exported(out, names)
    for name in names:
        workdir = tmp_path_factory.mktemp(name)
        result.kernels[name] = Kernel(name, out, workdir)
    return result
