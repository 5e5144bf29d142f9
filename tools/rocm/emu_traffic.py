"""Count what an emulated gfx950 launch moves through memory and how many MFMAs it issues.

Hooked into tinygrad's CDNA emulator (loaded by emu_launch): every executed instruction of the
kinds below is inspected, before it runs, from the wave's registers:

Lanes of one instruction that touch the same address count once (the hardware coalesces a
wave's request); a second instruction reading the same bytes counts them again.

* MUBUF (buffer_load/store_*): per active lane, the emulator's own address and bounds rule
  (base + soffset + stride·index + voffset + offset; a lane whose buffer offset is not below the
  descriptor's num_records touches nothing and is not counted, e.g. an invalid slot's 0-byte
  descriptor). Bytes are attributed to a named region (the KV cache, q, out, ...) by address.
* GLOBAL (global_load/store_*): per active lane, saddr + 32-bit voffset or a 64-bit vaddr, + offset.
* SMEM (s_load_*): bytes only (kernel arguments and scalar metadata), not attributed.
* DS: LDS bytes read and written by active lanes, an address read by several lanes once
  (ds_swizzle / ds_bpermute move no memory).
* V_MFMA_*: instructions issued, and their FLOPs (2·M·N·K).

Use `with counting({"kv_cache": array, ...}) as c: launch(...)`; then c.read / c.written map a
region name (or "other") to bytes. Counting is per executed instruction, so it is exact for what
the kernel issues on the emulator; it says nothing about caches (a second read of a byte is
counted again, as it would cost an L1/L2 hit, or HBM traffic if evicted).
"""

from __future__ import annotations

import ctypes
import re
from collections import Counter
from contextlib import contextmanager

import numpy as np

from tools.rocm import emu_launch

WAVE = 64
EXEC_LO = 126
_active: "Traffic | None" = None
_installed = False


class Traffic:
    def __init__(self, regions: dict):
        self.regions = [(name, a.ctypes.data, a.ctypes.data + a.nbytes) for name, a in regions.items()]
        self.read, self.written = Counter(), Counter()
        self.smem_bytes = self.lds_read = self.lds_written = 0
        self.mfma = self.mfma_flop = 0

    def add(self, addrs: np.ndarray, size: int, store: bool) -> None:
        """Lanes of one instruction at the same address count once: the wave's request is coalesced."""
        book = self.written if store else self.read
        left = np.unique(addrs)
        for name, lo, hi in self.regions:
            inside = (left >= lo) & (left < hi)
            book[name] += int(inside.sum()) * size
            left = left[~inside]
        book["other"] += int(left.size) * size


def _u32(addr, n):
    return np.ctypeslib.as_array((ctypes.c_uint32 * n).from_address(addr))


def _field(raw: int, field) -> int:
    return (raw >> field.lo) & ((1 << (field.hi - field.lo + 1)) - 1)


def _width(op: str) -> int:
    m = re.search(r"(DWORDX(\d)|DWORD|UBYTE|SBYTE|BYTE|USHORT|SSHORT|SHORT|B128|B96|B64|B32|B16|B8|U8|I8|U16|I16)", op)
    if not m:
        return 0
    tok = m.group(1)
    if tok.startswith("DWORDX"):
        return 4 * int(m.group(2))
    return {"DWORD": 4, "UBYTE": 1, "SBYTE": 1, "BYTE": 1, "USHORT": 2, "SSHORT": 2, "SHORT": 2, "B128": 16,
            "B96": 12, "B64": 8, "B32": 4, "B16": 2, "B8": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2}[tok]


def _lanes(sgpr) -> np.ndarray:
    exec_mask = int(sgpr[EXEC_LO]) | (int(sgpr[EXEC_LO + 1]) << 32)
    return np.array([(exec_mask >> i) & 1 for i in range(WAVE)], bool)


def _counter_for(inst, raw: int, emu):
    """A function(sgpr, vgpr) counting one execution of `inst`, or None for other instructions."""
    op = emu._op_name(inst)
    cls = type(inst)
    kind = cls.__name__
    if op.startswith("V_MFMA"):
        m = re.search(r"(\d+)X(\d+)X(\d+)", op)
        flop = 2 * int(m.group(1)) * int(m.group(2)) * int(m.group(3)) if m else 0

        def mfma(sgpr, vgpr, t):
            t.mfma += 1
            t.mfma_flop += flop
        return mfma, False
    size = _width(op)
    if kind == "MUBUF" and size:
        store = "STORE" in op
        vaddr, srsrc = _field(raw, cls.vaddr), _field(raw, cls.srsrc) * 4
        soffset, offset = _field(raw, cls.soffset), _field(raw, cls.offset)
        offen, idxen = _field(raw, cls.offen), _field(raw, cls.idxen)

        def mubuf(sgpr, vgpr, t):
            lanes = _lanes(sgpr)
            base = (int(sgpr[srsrc]) | (int(sgpr[srsrc + 1]) << 32)) & 0xFFFFFFFFFFFF
            records, stride = int(sgpr[srsrc + 2]), int(sgpr[srsrc + 3]) & 0x3FFF
            soff = int(sgpr[soffset]) if soffset < 128 else soffset - 128
            index = vgpr[vaddr * WAVE:(vaddr + 1) * WAVE].astype(np.uint64) if idxen else 0
            vreg = vaddr + 1 if idxen else vaddr
            voff = vgpr[vreg * WAVE:(vreg + 1) * WAVE].astype(np.uint64) if offen else np.uint64(0)
            boff = (np.uint64(stride) * index + voff + np.uint64(offset)) & np.uint64(0xFFFFFFFF)
            boff = np.broadcast_to(boff, (WAVE,))
            ok = lanes & (boff < np.uint64(records))
            t.add(np.uint64(base + soff) + boff[ok], size, store)
        return mubuf, True
    if kind == "GLOBAL" and size:
        store = "STORE" in op
        saddr, addr, offset = _field(raw, cls.saddr), _field(raw, cls.addr), _field(raw, cls.offset)
        offset = offset - (1 << 13) if offset & (1 << 12) else offset       # 13-bit signed

        def global_(sgpr, vgpr, t):
            lanes = _lanes(sgpr)
            lo = vgpr[addr * WAVE:(addr + 1) * WAVE].astype(np.uint64)
            if saddr != 0x7F:
                base = np.uint64(int(sgpr[saddr]) | (int(sgpr[saddr + 1]) << 32)) + lo
            else:
                base = lo | (vgpr[(addr + 1) * WAVE:(addr + 2) * WAVE].astype(np.uint64) << np.uint64(32))
            t.add((base + np.uint64(offset & 0xFFFFFFFFFFFFFFFF) if offset >= 0 else base - np.uint64(-offset))[lanes],
                  size, store)
        return global_, True
    if kind == "SMEM" and "LOAD" in op:
        def smem(sgpr, vgpr, t):
            t.smem_bytes += size
        return smem, False
    if kind == "DS" and size and not re.search(r"SWIZZLE|PERMUTE|GWS|BARRIER|APPEND|CONSUME", op):
        store = "WRITE" in op or "STORE" in op
        addr = _field(raw, cls.addr)
        off0, off1 = _field(raw, cls.offset0), _field(raw, cls.offset1)
        if "2" in re.sub(r"B\d+|X\d+|U\d+|I\d+", "", op):       # read2 / write2: two addresses
            unit = size * (64 if "ST64" in op else 1)
            offsets = [off0 * unit, off1 * unit]
        else:
            offsets = [(off1 << 8) | off0]

        def ds(sgpr, vgpr, t):
            base = vgpr[addr * WAVE:(addr + 1) * WAVE][_lanes(sgpr)].astype(np.int64)
            n = sum(np.unique(base + o).size for o in offsets) * size     # a broadcast counts once
            if store:
                t.lds_written += n
            else:
                t.lds_read += n
        return ds, True
    return None, False


def install() -> None:
    """Wrap the emulator's instruction decoder so executed instructions can be counted (once)."""
    global _installed
    if _installed:
        return
    emu = emu_launch.load_emulator()
    original = emu._decode_at

    def decode_at(pc, arch):
        (prg, runtime), inst = original(pc, arch)
        raw = int.from_bytes(bytes((ctypes.c_char * 16).from_address(pc).raw)[:inst.size()], "little")
        count, needs_regs = _counter_for(inst, raw, emu)
        if count is None:
            return (prg, runtime), inst
        globals_list = list(prg.arg.globals)
        si = globals_list.index(0) if 0 in globals_list else None
        vi = globals_list.index(1) if 1 in globals_list else None
        fxn = runtime.fxn

        def counted(*bufs):
            t = _active
            if t is not None:
                sgpr = _u32(bufs[si].value, emu.SGPR_COUNT) if si is not None else None
                vgpr = _u32(bufs[vi].value, 256 * WAVE) if vi is not None else None
                if needs_regs and sgpr is None:
                    raise RuntimeError(f"cannot count {inst!r}: its runner does not read the SGPRs")
                count(sgpr, vgpr, t)
            return fxn(*bufs)

        class Runtime:
            pass

        wrapped = Runtime()
        wrapped.fxn = counted
        return (prg, wrapped), inst

    emu._decode_at = decode_at
    _installed = True


@contextmanager
def counting(regions: dict):
    """Count every launch inside the block; regions: {name: numpy array} attributes bytes by address."""
    global _active
    install()
    t = Traffic(regions)
    _active = t
    try:
        yield t
    finally:
        _active = None
