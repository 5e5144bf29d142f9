"""Pieces shared by the gfx950 attention kernels (sparse_decode.py, sparse_prefill.py).

Everything here is a small, named step of SPEC §2–§5 so a kernel body reads like the spec:
constants of the geometry and the page map, buffer descriptors for one (page, slot) tile,
the NVFP4 dequantization of one token's 32 head-dim values, and the fast exp2.
"""

import math

import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl._mlir.dialects import llvm
from flydsl.expr import arith
from flydsl.expr.typing import T

# ---- geometry (SPEC §1) and the page map (SPEC §3.2) --------------------------------------
HEAD_DIM = 128          # D
GROUP_HEADS = 16        # G query heads per KV head
TOPK = 16               # K selected blocks per (token, KV head)
BLOCK_SIZE = 128        # N tokens per page = per sparse block
NVFP4_GROUP = 16        # elements per E4M3 block scale
DATA_BYTES = HEAD_DIM // 2              # 64 data bytes per token
SCALE_BYTES = HEAD_DIM // NVFP4_GROUP   # 8 scale bytes per token
TILE_BYTES = BLOCK_SIZE * (DATA_BYTES + SCALE_BYTES)   # 9216 bytes per (page, slot)
SCALE_PLANE = BLOCK_SIZE * DATA_BYTES                  # 8192: scale plane offset in a tile

# ---- wave / MFMA shapes --------------------------------------------------------------------
WAVE = 64
MFMA_M = 16             # v_mfma_f32_16x16x32_{bf16,f16}: C is 16x16, A 16x32, B 32x16
MFMA_K = 32
LANE_K = 8              # k values per lane per MFMA operand (lane l: k = 8*(l//16) + i)
D_PER_QUAD = HEAD_DIM // 4              # 32 head-dim values per quarter-wave (one 16-byte load)

LOG2E = 1.4426950408889634
NEG_INF = float("-inf")


def lane_ids(tid):
    """(lane, lane16, quad) of a thread: lane in the wave, lane % 16 and lane // 16."""
    lane = tid % WAVE
    return lane, lane % 16, lane // 16


def uniform(x):
    """Make an int32 value wave-uniform (an SGPR) with readfirstlane; x must already be uniform."""
    return fx.Int32(fx.rocdl.readfirstlane(T.i32, fx.Int32(x).ir_value()))


def wave_max_i32(x):
    """The wave's largest int32 (xor shuffles: every lane gets it), made uniform."""
    for k in (1, 2, 4, 8, 16, 32):
        o = fx.Int32(x.shuffle_xor(k, WAVE))
        x = (o > x).select(o, x)
    return uniform(x)


def buffer_rsrc(ptr, num_bytes):
    """Buffer descriptor of `num_bytes` bytes at `ptr`; loads past num_bytes return 0 and touch nothing.

    A descriptor of 0 bytes is how the kernels read an invalid slot without dereferencing it
    (SPEC §5.2): every load through it yields zero.
    """
    return fx.rocdl.get_buffer_rsrc(fx.rocdl.make_buffer_ptr(ptr, num_records_bytes=fx.Int64(num_bytes)))


def load_dwords(rsrc, byte_offset, n):
    """n dwords (n in 1, 2, 4) at byte_offset through a buffer descriptor: buffer_load_dword{,x2,x4}."""
    ty = T.i32 if n == 1 else T.vec(n, T.i32)
    v = fx.rocdl.raw_ptr_buffer_load(ty, rsrc, fx.Int32(byte_offset).ir_value(), fx.Int32(0).ir_value(), 0)
    return fx.Int32(v) if n == 1 else fx.Vector(v)


def load_u16(rsrc, byte_offset):
    """One 16-bit word (zero-extended into an int32): buffer_load_ushort."""
    v = fx.rocdl.raw_ptr_buffer_load(T.i16, rsrc, fx.Int32(byte_offset).ir_value(), fx.Int32(0).ir_value(), 0)
    return fx.Int32(arith.extui(T.i32, v))


def load_u8(rsrc, byte_offset):
    """One byte, zero-extended into an int32: buffer_load_ubyte."""
    v = fx.rocdl.raw_ptr_buffer_load(T.i8, rsrc, fx.Int32(byte_offset).ir_value(), fx.Int32(0).ir_value(), 0)
    return fx.Int32(arith.extui(T.i32, v))


def store_dwords(rsrc, byte_offset, vec):
    """Store a vector of dwords through a buffer descriptor (buffer_store_dword{,x2,x4})."""
    from flydsl._mlir.dialects import rocdl as _rocdl

    data = vec.ir_value() if hasattr(vec, "ir_value") else vec
    _rocdl.raw_ptr_buffer_store(data, rsrc, fx.Int32(byte_offset).ir_value(), fx.Int32(0).ir_value(),
                                aux=ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 0))


def exp2_fast(x):
    """2^x with the hardware v_exp_f32 (no device-library call; exp2(-inf) = 0)."""
    return fx.Float32(llvm.call_intrinsic(T.f32, "llvm.amdgcn.exp2.f32", [fx.Float32(x).ir_value()], [], []))


def e4m3_pair(scale_word):
    """The two E4M3 block scales in the low 16 bits of scale_word, as exact f32 (v_cvt_pk_f32_fp8).

    gfx950 reads fp8 as OCP float8_e4m3fn, the NVFP4 scale format (SPEC §2.1); 0x7F gives NaN.
    """
    return fx.Vector(fx.rocdl.cvt_pk_f32_fp8(T.vec(2, T.f32), fx.Int32(scale_word).ir_value(), False))


def e2m1_pair_f32(word, sel):
    """Elements 2·sel (low nibble) and 2·sel+1 (high nibble) of 8 packed E2M1 codes, as exact f32.

    v_cvt_scalef32_pk_f32_fp4 with a unit scale: the instruction applies only the exponent of its
    f32 scale operand (it serves MX formats with power-of-two scales), so NVFP4's E4M3 scale is
    applied afterwards as an exact fp32 multiply (SPEC §2.1; see the kernels' docstrings).
    """
    one = fx.Float32(1.0).ir_value()
    return fx.Vector(fx.rocdl.cvt_scalef32_pk_f32_fp4(T.vec(2, T.f32), fx.Int32(word).ir_value(), one, sel))


def e2m1_pair_f16(word, sel):
    """As e2m1_pair_f32, but v_cvt_scalef32_pk_f16_fp4 (unit scale) giving two exact fp16 values."""
    one = fx.Float32(1.0).ir_value()
    return fx.Vector(fx.rocdl.cvt_scalef32_pk_f16_fp4(T.vec(2, T.f16), fx.Int32(word).ir_value(), one, sel))


def dequant_dword_f16(word, scale_f16):
    """8 NVFP4 values of one data dword as vector<8 x f16>: unit-scale conversion, then one exact
    packed fp16 multiply per pair by the E4M3 scale (v_pk_mul_f16). e2m1 · e4m3 lies in
    [2^-10, 2688] with at most 6 significant bits, so it is exact in fp16 (SPEC §2.1)."""
    sc2 = fx.Vector.from_elements([scale_f16, scale_f16], dtype=fx.Float16)
    parts = [e2m1_pair_f16(word, sel) * sc2 for sel in range(4)]
    return fx.Vector.from_elements([parts[i // 2][i % 2] for i in range(8)], dtype=fx.Float16)


def dequant_dword(word, scale, out_dtype):
    """8 NVFP4 values of one data dword times their E4M3 scale (f32), as a vector<8 x out_dtype>.

    e2m1 · e4m3 is exact in fp32 and in bf16/fp16 (SPEC §2.1), so the final conversion is exact.
    """
    parts = []
    sc2 = fx.Vector.from_elements([scale, scale], dtype=fx.Float32)
    for sel in range(4):
        parts.append(e2m1_pair_f32(word, sel) * sc2)
    vals = [parts[i // 2][i % 2] for i in range(8)]
    return fx.Vector.from_elements(vals, dtype=fx.Float32).to(out_dtype)
