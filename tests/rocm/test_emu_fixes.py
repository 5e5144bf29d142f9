"""Each fix of tools/rocm/emu_fixes.py against the instruction's documented CDNA4 behaviour.

Tiny programs, assembled by LLVM's own assembler (llvm-mc-22 for gfx950, an encoder independent of
the emulator's decoder), load per-lane inputs, run the instruction under test once and store the
result; the expected values are computed here in numpy from the ISA's definitions (quoted in
emu_fixes.py): lane mapping (swizzle, permlane swaps), nibble order and the E8M0-only scale
(fp4 conversions), exact E4M3 decoding (fp8), byte addressing (sub-dword buffer loads), and the
descriptor's denormal mode. Skips when the emulator or llvm-mc-22 is absent.
"""

from __future__ import annotations

import ctypes
import shutil
import struct
import subprocess

import ml_dtypes
import numpy as np
import pytest

from tools.rocm import emu_fixes, emu_launch

LLVM_MC = shutil.which("llvm-mc-22") or shutil.which("/usr/lib/llvm-22/bin/llvm-mc")
pytestmark = pytest.mark.skipif(emu_launch.emulator_missing() is not None or LLVM_MC is None,
                                reason=emu_launch.emulator_missing() or "llvm-mc-22 missing (apt-get install llvm-22)")

# s[0:1] = kernarg: [in0 ptr, in1 ptr, out0 ptr, out1 ptr, buffer descriptor (16 bytes)]
PROLOGUE = """
s_load_dwordx8 s[4:11], s[0:1], 0x0
s_load_dwordx4 s[12:15], s[0:1], 0x20
s_waitcnt lgkmcnt(0)
v_and_b32 v0, 0x3ff, v0
v_lshlrev_b32 v1, 2, v0
global_load_dword v2, v1, s[4:5]
global_load_dword v3, v1, s[6:7]
s_waitcnt vmcnt(0)
"""
EPILOGUE = """
global_store_dword v1, v4, s[8:9]
global_store_dword v1, v5, s[10:11]
s_waitcnt vmcnt(0)
s_endpgm
"""


def text_section(obj: bytes) -> bytes:
    shoff, = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", obj, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", obj, shoff + i * shentsize) for i in range(shnum)]
    strtab = secs[shstrndx][4]
    for name, _, _, _, off, size, *_ in secs:
        if obj[strtab + name:obj.index(b"\0", strtab + name)] == b".text":
            return obj[off:off + size]
    raise KeyError(".text")


def run(body: str, in0, in1=None, descriptor=b"\0" * 16, denorm_mode=3):
    """Run PROLOGUE + body + EPILOGUE on one wave of 64 lanes; v2 = in0[lane], v3 = in1[lane];
    returns (v4, v5) per lane as uint32."""
    emu = emu_launch.load_emulator()
    src = ".text\n" + PROLOGUE + body + EPILOGUE
    obj = subprocess.run([LLVM_MC, "-triple=amdgcn-amd-amdhsa", "-mcpu=gfx950", "-filetype=obj", "-o", "-"],
                         input=src.encode(), capture_output=True, check=True).stdout
    code = text_section(obj) + b"\0" * 64
    mem = ctypes.create_string_buffer(code, len(code) + 256)
    a0 = np.ascontiguousarray(np.asarray(in0).view(np.uint32))
    a1 = np.ascontiguousarray(np.asarray(in0 if in1 is None else in1).view(np.uint32))
    out0, out1 = np.zeros(64, np.uint32), np.zeros(64, np.uint32)
    kernarg = np.zeros(64, np.uint8)
    struct.pack_into("<QQQQ", kernarg, 0, a0.ctypes.data, a1.ctypes.data, out0.ctypes.data, out1.ctypes.data)
    kernarg[32:48] = np.frombuffer(descriptor, np.uint8)
    emu_fixes.current_fp32_denorm_mode = denorm_mode
    emu.run_asm(ctypes.addressof(mem), len(code), 1, 1, 1, 64, 1, 1, kernarg.ctypes.data, rsrc2=2 << 1, arch="cdna")
    return out0, out1


LANES = np.arange(64)


def test_ds_swizzle_bitmask_and_quad_modes():
    data = (LANES * 7 + 1000).astype(np.uint32)
    # swizzle(SWAP,1) = offset 0x041F: and 0x1F, or 0, xor 1 -> lane i reads lane i ^ 1
    got, _ = run("ds_swizzle_b32 v4, v2 offset:swizzle(SWAP,1)\ns_waitcnt lgkmcnt(0)\nv_mov_b32 v5, 0", data)
    np.testing.assert_array_equal(got, data[LANES ^ 1])
    # bitmask and=0x18, or=0x03, xor=0x04 (offset 0x1078), per 32-lane half
    got, _ = run("ds_swizzle_b32 v4, v2 offset:0x1078\ns_waitcnt lgkmcnt(0)\nv_mov_b32 v5, 0", data)
    src = (LANES & 32) | (((LANES & 0x18) | 0x03) ^ 0x04)
    np.testing.assert_array_equal(got, data[src])
    # quad mode (offset[15] = 1): lanes of a quad read [3, 0, 2, 1]
    got, _ = run("ds_swizzle_b32 v4, v2 offset:swizzle(QUAD_PERM,3,0,2,1)\ns_waitcnt lgkmcnt(0)\nv_mov_b32 v5, 0", data)
    np.testing.assert_array_equal(got, data[(LANES & ~3) + np.array([3, 0, 2, 1])[LANES & 3]])


def test_ds_swizzle_reads_zero_from_inactive_lanes():
    data = (LANES + 1).astype(np.uint32)
    body = """v_mov_b32 v4, -1
s_mov_b32 exec_lo, 0x55555555
s_mov_b32 exec_hi, 0x55555555
ds_swizzle_b32 v4, v2 offset:swizzle(SWAP,1)
s_waitcnt lgkmcnt(0)
s_mov_b64 exec, -1
v_mov_b32 v5, 0"""
    got, _ = run(body, data)
    even = LANES % 2 == 0
    # active (even) lanes read their odd neighbour, which is inactive: 0; inactive lanes keep v4
    np.testing.assert_array_equal(got[even], 0)
    np.testing.assert_array_equal(got[~even], 0xFFFFFFFF)


def test_permlane32_swap():
    a, b = (LANES + 100).astype(np.uint32), (LANES + 500).astype(np.uint32)
    got4, got5 = run("v_mov_b32 v4, v2\nv_mov_b32 v5, v3\nv_permlane32_swap_b32 v5, v4", a, b)
    # VGPR[lane][SRC0] <-> VGPR[lane + 32][VDST], lane 0..31: src0 = v4, vdst = v5
    want4, want5 = a.copy(), b.copy()
    want4[:32], want5[32:] = b[32:], a[:32]
    np.testing.assert_array_equal(got4, want4)
    np.testing.assert_array_equal(got5, want5)


def test_permlane16_swap():
    a, b = (LANES + 100).astype(np.uint32), (LANES + 500).astype(np.uint32)
    got4, got5 = run("v_mov_b32 v4, v2\nv_mov_b32 v5, v3\nv_permlane16_swap_b32 v5, v4", a, b)
    want4, want5 = a.copy(), b.copy()
    for base in (0, 32):    # per pass: VGPR[pass·32 + l][SRC0] <-> VGPR[pass·32 + l + 16][VDST], l < 16
        lo = slice(base, base + 16)
        hi = slice(base + 16, base + 32)
        want4[lo], want5[hi] = b[hi], a[lo]
    np.testing.assert_array_equal(got4, want4)
    np.testing.assert_array_equal(got5, want5)


def test_cvt_pk_f32_fp8_is_exact_e4m3():
    # every byte value in the low byte, its successor in the second: both halves, all 256 codes
    codes = np.arange(256, dtype=np.uint32)
    got = []
    for start in range(0, 256, 64):
        lo = codes[start:start + 64]
        word = lo | (((lo + 1) & 0xFF) << 8) | (0xAB << 16)        # bits 16+ must be ignored
        r0, r1 = run("v_cvt_pk_f32_fp8 v[4:5], v2", word)
        np.testing.assert_array_equal(r1.view(np.float32), _e4m3(((lo + 1) & 0xFF)).astype(np.float32),
                                      err_msg="high byte")
        got.append(r0)
    want = _e4m3(codes)
    got = np.concatenate(got).view(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
    assert got[1] == 2.0 ** -9 and got[0x81] == -(2.0 ** -9), "E4M3 subnormals are exact"


def _e4m3(codes):
    return np.asarray(codes, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _e2m1(nibbles):
    mag = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)[nibbles & 7]
    return np.where(nibbles & 8, -mag, mag).astype(np.float32)


@pytest.mark.parametrize("sel", range(4))
def test_cvt_scalef32_pk_f32_fp4_nibble_order_and_byte_select(sel):
    rng = np.random.default_rng(sel)
    words = rng.integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32)
    words[:4] = [0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567]      # every code
    r0, r1 = run(f"v_mov_b32 v6, 1.0\nv_cvt_scalef32_pk_f32_fp4 v[4:5], v2, v6 op_sel:[{sel & 1},{sel >> 1},0]",
                 words)
    byte = (words >> (8 * sel)) & 0xFF
    np.testing.assert_array_equal(r0.view(np.float32), _e2m1(byte & 15))     # low nibble -> D0[31:0]
    np.testing.assert_array_equal(r1.view(np.float32), _e2m1(byte >> 4))     # high nibble -> D0[63:32]


@pytest.mark.parametrize("out", ["f16", "bf16"])
def test_cvt_scalef32_pk_16bit_fp4(out):
    words = np.repeat(np.array([0x76543210, 0xFEDCBA98], np.uint32), 32)
    r0, _ = run(f"v_mov_b32 v6, 1.0\nv_cvt_scalef32_pk_{out}_fp4 v4, v2, v6\nv_mov_b32 v5, 0", words)
    dt = np.float16 if out == "f16" else ml_dtypes.bfloat16
    halves = r0.view(np.uint16).view(dt).astype(np.float32).reshape(64, 2)
    byte = words & 0xFF
    np.testing.assert_array_equal(halves[:, 0], _e2m1(byte & 15))            # D0[15:0]
    np.testing.assert_array_equal(halves[:, 1], _e2m1(byte >> 4))            # D0[31:16]


def test_cvt_scalef32_fp4_scale_uses_only_the_exponent():
    words = np.full(64, 0x000000F7, np.uint32)      # low nibble 7 (6.0), high nibble 0xF (-6.0)
    scales = np.array([1.0, 1.5, 1.9375, 0.25, 0.375, 4.0, 96.0, 2.0 ** -20] * 8, np.float32)
    r0, r1 = run("v_cvt_scalef32_pk_f32_fp4 v[4:5], v2, v3", words, scales)
    pow2 = np.exp2(np.floor(np.log2(scales))).astype(np.float32)   # 2^(exponent - 127): mantissa ignored
    np.testing.assert_array_equal(r0.view(np.float32), 6.0 * pow2)
    np.testing.assert_array_equal(r1.view(np.float32), -6.0 * pow2)


@pytest.mark.parametrize("op,nbytes,signed", [("ubyte", 1, False), ("sbyte", 1, True),
                                               ("ushort", 2, False), ("sshort", 2, True)])
def test_subdword_buffer_loads_at_every_byte_offset(op, nbytes, signed):
    mem = np.arange(256, dtype=np.uint8)[::-1].copy()        # byte k holds 255 - k
    desc = struct.pack("<QII", mem.ctypes.data, 200, 0x00027000)   # num_records = 200 bytes
    offsets = np.arange(64, dtype=np.uint32) * 3 + 7            # every byte position within a dword
    offsets[-1] = 199 if nbytes == 1 else 198                    # the last in range
    offsets[-2] = 200                                            # out of range: 0
    got, _ = run(f"buffer_load_{op} v4, v2, s[12:15], 0 offen\ns_waitcnt vmcnt(0)\nv_mov_b32 v5, 0",
                 offsets, descriptor=desc)
    want = []
    for o in offsets:
        if o >= 200:
            want.append(0)
            continue
        v = int.from_bytes(mem[o:o + nbytes].tobytes(), "little", signed=signed)
        want.append(v & 0xFFFFFFFF)
    np.testing.assert_array_equal(got, np.array(want, np.uint32))


def test_d16_buffer_load_keeps_the_other_half():
    mem = np.arange(64, dtype=np.uint8) + 1
    desc = struct.pack("<QII", mem.ctypes.data, 64, 0x00027000)
    offsets = np.arange(64, dtype=np.uint32) % 61
    body = """v_mov_b32 v4, 0xdead0000
v_mov_b32 v5, 0x0000beef
buffer_load_short_d16 v4, v2, s[12:15], 0 offen
buffer_load_short_d16_hi v5, v2, s[12:15], 0 offen
s_waitcnt vmcnt(0)"""
    lo, hi = run(body, offsets, descriptor=desc)
    u16 = np.array([int.from_bytes(mem[o:o + 2].tobytes(), "little") for o in offsets], np.uint32)
    np.testing.assert_array_equal(lo, 0xDEAD0000 | u16)
    np.testing.assert_array_equal(hi, 0x0000BEEF | (u16 << 16))


@pytest.mark.parametrize("mode", [0, 3])
def test_denormals_follow_the_descriptor(mode):
    x = np.full(64, 2.0 ** -140, np.float32)         # an fp32 denormal
    got, _ = run("v_mul_f32 v4, 1.0, v2\nv_mov_b32 v5, 0", x, denorm_mode=mode)
    want = x if mode == 3 else np.zeros_like(x)       # FLOAT_DENORM_MODE_32: 3 keeps, 0 flushes
    np.testing.assert_array_equal(got.view(np.float32), want)
