"""Small ELF64 helpers for the gfx950 export checks (no third-party ELF library needed).

`export.py`, tools/rocm, the tests in tests/rocm and `benchmarks/gfx950_static.py` use these to pull the
gfx950 code object (symbol `<name>__kernels_binary`) and the JSON metadata (symbol
`<name>__metadata`) out of the x86-64 object that FlyDSL's `export_to_c` writes, and to read the
AMDGPU resource notes of the code object with `llvm-readelf-22 --notes`.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

EF_AMDGPU_MACH_MASK = 0xFF
EF_AMDGPU_MACH_GFX950 = 0x4F
GFX950_E_FLAGS = 0x54F  # MACH gfx950 | XNACK any | SRAMECC any, as LLVM writes for code object v6


def _sections(data: bytes):
    (e_shoff,) = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = []
    for i in range(e_shnum):
        off = e_shoff + i * e_shentsize
        name, typ, flags, addr, offset, size, link, info, align, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", data, off)
        sections.append(dict(name=name, type=typ, offset=offset, size=size, link=link, entsize=entsize))
    shstr = sections[e_shstrndx]
    for s in sections:
        end = data.index(b"\0", shstr["offset"] + s["name"])
        s["name"] = data[shstr["offset"] + s["name"]:end].decode()
    return sections


def elf_e_flags(data: bytes) -> int:
    """e_flags of an ELF64 little-endian image."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not an ELF64 image")
    return struct.unpack_from("<I", data, 0x30)[0]


def read_symbol(path_or_bytes, name: str) -> bytes:
    """The bytes of the defined data symbol `name` in an ELF64 relocatable object."""
    data = Path(path_or_bytes).read_bytes() if not isinstance(path_or_bytes, bytes) else path_or_bytes
    sections = _sections(data)
    for sec in sections:
        if sec["type"] != 2:  # SHT_SYMTAB
            continue
        strtab = sections[sec["link"]]
        for i in range(sec["size"] // 24):
            st_name, st_info, st_other, st_shndx, st_value, st_size = struct.unpack_from(
                "<IBBHQQ", data, sec["offset"] + 24 * i)
            end = data.index(b"\0", strtab["offset"] + st_name)
            if data[strtab["offset"] + st_name:end].decode() != name:
                continue
            owner = sections[st_shndx]
            start = owner["offset"] + st_value
            return data[start:start + st_size]
    raise KeyError(f"symbol {name!r} not found")


def code_object(obj_path, kernel: str) -> bytes:
    """The gfx950 code object (an AMDGPU ELF) embedded in FlyDSL's exported `<kernel>.o`."""
    return read_symbol(obj_path, f"{kernel}__kernels_binary")


def export_metadata(obj_path, kernel: str) -> str:
    """FlyDSL's JSON metadata string embedded in `<kernel>.o` (symbol `<kernel>__metadata`)."""
    return read_symbol(obj_path, f"{kernel}__metadata").rstrip(b"\0").decode()


def llvm_tool(name: str) -> str | None:
    """Path of an LLVM 22 tool (`llvm-objdump`, `llvm-readelf`), or None when absent."""
    for cand in (f"{name}-22", f"/usr/lib/llvm-22/bin/{name}"):
        found = shutil.which(cand)
        if found:
            return found
    return None


def disassemble(co_bytes: bytes, workdir) -> str:
    """`llvm-objdump-22 -d --mcpu=gfx950` text of a code object."""
    path = Path(workdir) / "co.hsaco"
    path.write_bytes(co_bytes)
    tool = llvm_tool("llvm-objdump")
    if tool is None:
        raise FileNotFoundError("llvm-objdump-22 not found (Debian package llvm-22)")
    return subprocess.run([tool, "-d", "--mcpu=gfx950", str(path)], check=True,
                          capture_output=True, text=True).stdout


def notes(co_bytes: bytes, workdir) -> str:
    """`llvm-readelf-22 --notes` text (the AMDGPU metadata in YAML form)."""
    path = Path(workdir) / "co.hsaco"
    path.write_bytes(co_bytes)
    tool = llvm_tool("llvm-readelf")
    if tool is None:
        raise FileNotFoundError("llvm-readelf-22 not found (Debian package llvm-22)")
    return subprocess.run([tool, "--notes", str(path)], check=True, capture_output=True, text=True).stdout


_NOTE_KEYS = {
    "vgpr": ".vgpr_count",
    "agpr": ".agpr_count",
    "sgpr": ".sgpr_count",
    "lds_bytes": ".group_segment_fixed_size",
    "scratch_bytes": ".private_segment_fixed_size",
    "vgpr_spills": ".vgpr_spill_count",
    "sgpr_spills": ".sgpr_spill_count",
    "wavefront_size": ".wavefront_size",
    "max_flat_workgroup_size": ".max_flat_workgroup_size",
}


def resources_per_kernel(notes_text: str) -> dict:
    """{GPU kernel name: resource numbers} from a code object's notes (one entry per kernel)."""
    body = notes_text.split("amdhsa.kernels:", 1)[-1].split("amdhsa.target:", 1)[0]
    entries = re.split(r"\n  - ", "\n" + body)
    out = {}
    for entry in entries:
        name = re.search(r"\.name:\s+(\S+)", entry)
        if not name:
            continue
        res = {}
        for key, field in _NOTE_KEYS.items():
            m = re.search(re.escape(field) + r":\s+(\d+)", entry)
            res[key] = int(m.group(1)) if m else None
        out[name.group(1)] = res
    return out


# gfx950 (CDNA3/4): 512 unified VGPR+AGPR per lane per SIMD, allocated in granules of 8;
# 160 KiB LDS per CU, 4 SIMDs per CU, at most 8 waves per SIMD.
GFX950_REGS_PER_SIMD_LANE = 512
GFX950_REG_GRANULE = 8
GFX950_LDS_PER_CU = 160 * 1024
GFX950_SIMDS_PER_CU = 4
GFX950_MAX_WAVES_PER_SIMD = 8


def waves_per_simd(vgpr: int, agpr: int, lds_bytes: int, workgroup_size: int) -> int:
    """Occupancy bound on gfx950 from registers and LDS (waves per SIMD)."""
    # Unified register file: AGPRs start at the VGPR count rounded up to a multiple of 4.
    regs = (-(-vgpr // 4) * 4 if agpr else vgpr) + agpr
    regs = max(GFX950_REG_GRANULE, -(-regs // GFX950_REG_GRANULE) * GFX950_REG_GRANULE)
    by_regs = min(GFX950_MAX_WAVES_PER_SIMD, GFX950_REGS_PER_SIMD_LANE // regs)
    if lds_bytes:
        waves_per_group = -(-workgroup_size // 64)
        groups_per_cu = GFX950_LDS_PER_CU // lds_bytes
        by_lds = (groups_per_cu * waves_per_group) // GFX950_SIMDS_PER_CU
        return max(0, min(by_regs, by_lds))
    return by_regs
