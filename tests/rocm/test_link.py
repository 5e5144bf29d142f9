"""The HIP FFI module builds and links on a CPU-only machine: the handlers plus the
exported kernel objects resolve every symbol against libamdhip64 (-Wl,--no-undefined), and the
CMake build (ffi/CMakeLists.txt with M3SPARSE_ENABLE_ROCM=ON) produces _m3sparse_rocm whose
registrations() serve exactly the ROCm targets of docs/ffi_targets.md."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.rocm.toolchain import REPO

ROCM_DIR = REPO / "ffi" / "rocm"
HIP_HEADER_DIRS = [Path(os.environ.get("ROCM_PATH", "/opt/rocm")) / "include", Path("/opt/rocm/include"),
                   Path("/usr/include")]
HIP_LIB_DIRS = [Path(os.environ.get("ROCM_PATH", "/opt/rocm")) / "lib", Path("/opt/rocm/lib"),
                Path("/usr/lib/x86_64-linux-gnu")]


def hip_include() -> Path | None:
    return next((d for d in HIP_HEADER_DIRS if (d / "hip" / "hip_runtime_api.h").exists()), None)


def hip_libdir() -> Path | None:
    return next((d for d in HIP_LIB_DIRS if any(d.glob("libamdhip64.so*"))), None)


def xla_include() -> str:
    import jax

    return jax.ffi.include_dir()


@pytest.fixture(scope="module")
def hip():
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    inc, lib = hip_include(), hip_libdir()
    if inc is None or lib is None:
        pytest.skip("HIP headers / libamdhip64 not found (apt-get install libamdhip64-dev, or ROCm)")
    if importlib.util.find_spec("jax") is None:
        pytest.skip("jax not installed (the XLA FFI headers come from jax.ffi.include_dir())")
    return inc, lib


def ffi_targets_rocm() -> set[str]:
    text = (REPO / "docs" / "ffi_targets.md").read_text()
    return {f"m3sparse_{op}_rocm" for op in re.findall(r"`m3sparse_(\w+)_<p>`", text)}


def test_handlers_link_without_undefined_symbols(exported, hip, tmp_path):
    inc, lib = hip
    objs = []
    hip_flags = [] if inc == Path("/usr/include") else ["-isystem", str(inc)]  # never re-add /usr/include
    for src in ("handlers.cc", "device.cc"):
        obj = tmp_path / (src + ".o")
        subprocess.run(["g++", "-std=c++17", "-O1", "-fPIC", "-Wall", "-Werror", "-D__HIP_PLATFORM_AMD__",
                        f"-I{REPO / 'ffi' / 'include'}", f"-I{ROCM_DIR}", f"-I{exported.out}",
                        *hip_flags, "-isystem", xla_include(), "-c", str(ROCM_DIR / src),
                        "-o", str(obj)], check=True)
        objs.append(str(obj))
    kernels = [str(exported.out / f"{n}.o") for n in exported.names]
    so = tmp_path / "libm3sparse_rocm_handlers.so"
    proc = subprocess.run(["g++", "-shared", "-o", str(so), *objs, *kernels, "-Wl,--no-undefined",
                           f"-L{lib}", "-lamdhip64", "-pthread", "-ldl"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    nm = subprocess.run(["nm", "-D", "--defined-only", str(so)], check=True, capture_output=True,
                        text=True).stdout
    defined = set(re.findall(r"\b(m3sparse_\w+_rocm)\b", nm))
    assert defined == ffi_targets_rocm()


def test_cmake_builds_the_rocm_module(exported, hip, tmp_path):
    if shutil.which("cmake") is None:
        pytest.skip("cmake not found")
    if importlib.util.find_spec("nanobind") is None:
        pytest.skip("nanobind not installed")
    build = tmp_path / "build"
    cfg = subprocess.run(["cmake", "-S", str(REPO / "ffi"), "-B", str(build), "-DM3SPARSE_ENABLE_ROCM=ON",
                          "-DM3SPARSE_NATIVE=OFF", f"-DPython_EXECUTABLE={sys.executable}",
                          f"-DM3SPARSE_PREBUILT_KERNEL_DIR={exported.out}"], capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stdout[-3000:] + cfg.stderr[-3000:]
    mk = subprocess.run(["cmake", "--build", str(build), "-j2", "--target", "_m3sparse_rocm",
                         "m3sparse_rocm_linkcheck"], capture_output=True, text=True)
    assert mk.returncode == 0, mk.stdout[-3000:] + mk.stderr[-3000:]
    module = next((build / "rocm").glob("_m3sparse_rocm*.so"))
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('_m3sparse_rocm', sys.argv[1]);"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m);"
            "print(' '.join(sorted(m.registrations())), m.GPU_ARCH)")
    run = subprocess.run([sys.executable, "-c", code, str(module)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    names = run.stdout.split()
    assert names[-1] == "gfx950"
    assert set(names[:-1]) == ffi_targets_rocm()
