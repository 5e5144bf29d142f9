"""The gfx950 export toolchain: whether FlyDSL's export can run here, and the exported kernels'
code objects, disassembly and resources (tests/rocm's fixtures, benchmarks/gfx950_traffic.py).

The static checks (tests/rocm) run on a CPU-only machine (CI). They need `pip install
flydsl==0.5.0 torch` (CPU torch) and Debian's `lld-22` and `llvm-22` (llvm-objdump-22,
llvm-readelf-22); without them they skip with the reason. None of them touches a GPU
(tests/rocm/test_device.py does, where one is).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ffi.flydsl import elf_tools  # no third-party imports

REPO = Path(__file__).resolve().parents[2]
FLYDSL_DIR = REPO / "ffi" / "flydsl"
EXPORT = FLYDSL_DIR / "export.py"


def toolchain_missing() -> str | None:
    """Why the gfx950 export cannot run here, or None."""
    missing = []
    if importlib.util.find_spec("flydsl") is None:
        missing.append("flydsl (pip install flydsl==0.5.0 torch)")
    elif importlib.util.find_spec("torch") is None:
        missing.append("torch (flydsl.compiler imports it; a CPU build is enough)")
    has_lld = any(Path(p).exists() for p in ("/usr/lib/llvm-22/bin/ld.lld", "/usr/lib/llvm-21/bin/ld.lld",
                                             "/usr/lib/llvm-20/bin/ld.lld", "/usr/lib/llvm-19/bin/ld.lld"))
    if not has_lld and not Path(os.environ.get("ROCM_PATH", "/nonexistent"), "llvm/bin/ld.lld").exists():
        missing.append("ld.lld for gfx950 (apt-get install lld-22)")
    for tool in ("llvm-objdump", "llvm-readelf"):
        if elf_tools.llvm_tool(tool) is None:
            missing.append(f"{tool}-22 (apt-get install llvm-22)")
    return ", ".join(missing) if missing else None


@dataclass
class Kernel:
    """One exported kernel module: its files, code object, disassembly and resources."""
    name: str
    out: Path
    workdir: Path

    @property
    def obj(self) -> Path:
        return self.out / f"{self.name}.o"

    @cached_property
    def meta(self) -> dict:
        return json.loads((self.out / f"{self.name}.json").read_text())

    @cached_property
    def code_object(self) -> bytes:
        return elf_tools.code_object(self.obj, self.name)

    @cached_property
    def asm(self) -> str:
        return elf_tools.disassemble(self.code_object, self.workdir)

    @cached_property
    def notes(self) -> str:
        return elf_tools.notes(self.code_object, self.workdir)

    @cached_property
    def resources(self) -> dict:
        """{GPU kernel symbol: resources}; a launcher may hold several GPU kernels."""
        return elf_tools.resources_per_kernel(self.notes)

    @cached_property
    def descriptors(self) -> str:
        """The kernel descriptors (.kd), disassembled (denormal mode, IEEE mode, ...)."""
        path = self.workdir / "kd.hsaco"
        path.write_bytes(self.code_object)
        return subprocess.run([elf_tools.llvm_tool("llvm-objdump"), "-D", "--mcpu=gfx950", "-j", ".rodata",
                               str(path)], check=True, capture_output=True, text=True).stdout

    def count(self, mnemonic: str) -> int:
        """Occurrences of an instruction mnemonic (first token of a line, with or without the
        encoding suffix _e32 / _e64 / _sdwa / _dpp)."""
        n = 0
        for line in self.asm.splitlines():
            tok = line.split()[:1]
            if tok and re.sub(r"_(e32|e64|sdwa|dpp)$", "", tok[0]) == mnemonic:
                n += 1
        return n


@dataclass
class Exported:
    out: Path
    names: list[str]
    kernels: dict = field(default_factory=dict)

    def __getitem__(self, name) -> Kernel:
        return self.kernels[name]
