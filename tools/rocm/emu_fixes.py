"""Our fixes for the gaps of tinygrad's CDNA emulator that our gfx950 kernels meet.

tinygrad's `test/mockgpu/amd/emu.py` (a pinned copy at ../shared/emulator/tinygrad, used in place,
never copied here) interprets CDNA machine code on the CPU by compiling each instruction into a
small CPU kernel. Six instructions our kernels use are missing or wrong there; this module replaces
their handlers, each written from the instruction's definition in AMD's CDNA4 ISA (the pseudocode
quoted in each docstring is the ISA's, as shipped in tinygrad's `autogen/amd/cdna/str_pcode.py`):

1. ds_swizzle_b32                 -- the ISA's offset modes (its pseudocode does not parse)
2. v_cvt_pk_f32_fp8 (VOP1)        -- writes a VGPR pair (the emulator asserts "multiple stores")
3. v_cvt_scalef32_pk_{f32,f16,bf16}_fp4  -- "unknown variable: SRC0"
4. v_permlane16_swap_b32          -- "unknown variable: SRC0"
5. v_permlane32_swap_b32          -- "unknown variable: SRC0"
6. buffer_load_{ubyte,sbyte,ushort,sshort} and their _d16 forms at a byte offset that is not a
   multiple of 4 (the emulator returns the aligned dword's low bytes, silently)

and one setting: the emulator runs every kernel with the host in flush-to-zero / denormals-are-zero;
`denormals_from_descriptor` makes it follow the kernel descriptor's FP32 denormal mode instead.

`install(emu)` patches the loaded emulator module once; `tests/rocm/test_emu_fixes.py` pins each
instruction's documented behaviour (lane mapping, nibble order, scale handling, byte addressing).
"""

from __future__ import annotations

WAVE = 64
_installed = False
# FP32 denormal mode of the kernel being run (rsrc1 FLOAT_DENORM_MODE_32): 3 = in and out kept.
current_fp32_denorm_mode = 0


def install(emu) -> None:
    """Patch the handlers of `emu` (the module test.mockgpu.amd.emu); idempotent."""
    global _installed
    if _installed:
        return
    from tinygrad.dtype import AddrSpace, dtypes
    from tinygrad.runtime.autogen.amd.cdna import ins as irc
    from tinygrad.uop.ops import UOp

    c = emu._c

    def i32(n):
        return UOp.const(n, dtypes.int)

    def lane_on(exec_mask, lane):
        return emu._lane_active(exec_mask, lane)

    # ---- 1. ds_swizzle_b32 --------------------------------------------------------------------
    def swizzle_source(offset: int, lane):
        """Source lane of `lane` (a UOp) for DS_SWIZZLE_B32 with 16-bit `offset` (CDNA ISA):
        offset[15] = 1: "full data sharing within 4 consecutive threads", lane i of each quad
        reads lane 4·(i/4) + offset[2i+1:2i]; offset[15] = 0 (below 0xC000): "limited data sharing
        within 32 consecutive threads", j = ((i & and_mask) | or_mask) ^ xor_mask with
        and_mask = offset[4:0], or_mask = offset[9:5], xor_mask = offset[14:10], per half-wave.
        The rotate (>= 0xC000) and FFT (>= 0xE000) modes are not used by our kernels."""
        if offset >= 0xC000:
            raise NotImplementedError(f"ds_swizzle_b32 offset {offset:#x}: rotate/FFT modes not emulated")
        if offset & 0x8000:
            sel = (c(offset) >> ((lane & i32(3)) * i32(2)).cast(dtypes.uint32)) & c(3)
            return (lane & i32(~3)) + sel.cast(dtypes.int)
        and_m, or_m, xor_m = offset & 31, (offset >> 5) & 31, (offset >> 10) & 31
        return (lane & i32(32)) | (((lane & i32(and_m)) | i32(or_m)) ^ i32(xor_m))

    def ds_swizzle(inst, ctx):
        offset = (emu._iattr(inst, "offset1") << 8) | emu._iattr(inst, "offset0")
        src, dst = ctx.inst_field(type(inst).addr), ctx.inst_field(type(inst).vdst)
        exec_mask = ctx.rexec()
        tmp = UOp.placeholder((WAVE,), dtypes.uint32, slot=0, addrspace=AddrSpace.LOCAL)
        rl = ctx.range()
        j = swizzle_source(offset, rl)
        # thread_out[i] = thread_valid[j] ? thread_in[j] : 0, all read before any is written
        val = lane_on(exec_mask, j).where(ctx.rvgpr_dyn(src, j), c(0))
        read = UOp.group(tmp.index(rl).store(val)).end(rl)
        tmp2 = tmp.after(read)
        wl = ctx.range()
        write = UOp.group(ctx.wvgpr_dyn(dst, wl, tmp2.index(wl), exec_mask)).end(wl)
        return UOp.sink(read, write, *ctx.inc_pc())

    # ---- 2. v_cvt_pk_f32_fp8 (VOP1) -------------------------------------------------------------
    def e4m3_to_f32_bits(b):
        """OCP E4M3 (float8_e4m3fn) byte -> f32 bits, exactly: normal (e-7)·2^e·(1+m/8), subnormal
        m·2^-9, ±0, and 0x7F / 0xFF -> NaN (E4M3 has no infinities)."""
        sign = (b >> c(7)) << c(31)
        e, m = (b >> c(3)) & c(15), b & c(7)
        normal = sign | ((e + c(120)) << c(23)) | (m << c(20))
        sub = (m.cast(dtypes.float32) * UOp.const(2.0 ** -9, dtypes.float32)).bitcast(dtypes.uint32) | sign
        nan = sign | c(0x7FC00000)
        return (e.eq(c(15)) & m.eq(c(7))).where(nan, e.eq(c(0)).where(sub, normal))

    def cvt_pk_f32_fp8(inst, ctx):
        """VOP1 (e32) V_CVT_PK_F32_FP8: tmp = S0[15:0]; D0[31:0].f32 = fp8_to_f32(tmp[7:0]);
        D0[63:32].f32 = fp8_to_f32(tmp[15:8]) -- a VGPR pair (the e32 form has no word select)."""
        exec_mask, lane = ctx.rexec(), ctx.range()
        s0 = ctx.rsrc_dyn(ctx.inst_field(type(inst).src0), lane)
        dst = ctx.inst_field(type(inst).vdst)
        lo, hi = e4m3_to_f32_bits(s0 & c(0xFF)), e4m3_to_f32_bits((s0 >> c(8)) & c(0xFF))
        stores = [ctx.wvgpr_dyn(dst, lane, lo, exec_mask), ctx.wvgpr_dyn(dst + c(1), lane, hi, exec_mask)]
        return UOp.sink(UOp.group(*stores).end(lane), *ctx.inc_pc())

    # ---- 3. v_cvt_scalef32_pk_{f32,f16,bf16}_fp4 ------------------------------------------------
    def e2m1_to_f32(code):
        """E2M1 nibble -> f32: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign (8 = -0)."""
        mag = code & c(7)
        e, m = mag >> c(1), mag & c(1)
        normal = ((e + c(126)) << c(23)) | (m << c(22))            # 2^(e-1)·(1 + m/2)
        bits = e.eq(c(0)).where(m.eq(c(1)).where(c(0x3F000000), c(0)), normal)   # 0.5 or 0
        return (bits | ((code >> c(3)) << c(31))).bitcast(dtypes.float32)

    def cvt_scalef32_pk_fp4(inst, ctx, out: str):
        """V_CVT_SCALEF32_PK_{F32,F16,BF16}_FP4 (VOP3):
            scale = 32'U(exponent(S1.f32)); srcbyte = OPSEL[1:0].i32 * 8;
            src = VGPR[laneId][SRC0.u32][srcbyte + 7 : srcbyte].b8;
            tmp0 = fp4_to_<out>_scale(src[3:0].fp4, scale.u8); tmp1 = fp4_to_<out>_scale(src[7:4].fp4, scale.u8);
            f32: D0[31:0] = tmp0; D0[63:32] = tmp1     f16/bf16: D0[15:0] = tmp0; D0[31:16] = tmp1
        Only the biased exponent field of S1 is used (an E8M0 scale): value · 2^(exponent - 127);
        exponent 255 gives NaN. The result's destination rounding is exact for every scale that
        keeps the value in the output format's normal range (all our kernels use a unit scale)."""
        exec_mask, lane = ctx.rexec(), ctx.range()
        opsel = emu._iattr(inst, "opsel") & 3
        s0 = ctx.rsrc_dyn(ctx.inst_field(type(inst).src0), lane)
        s1 = ctx.rsrc_dyn(ctx.inst_field(type(inst).src1), lane)
        dst = ctx.inst_field(type(inst).vdst)
        byte = (s0 >> c(8 * opsel)) & c(0xFF)
        scale = (s1 >> c(23)) & c(0xFF)
        pow2 = (scale << c(23)).bitcast(dtypes.float32)             # 2^(scale-127) for scale in [1, 254]
        nan = UOp.const(float("nan"), dtypes.float32)
        vals = []
        for nib in (byte & c(15), byte >> c(4)):
            v = e2m1_to_f32(nib) * pow2
            vals.append(scale.eq(c(255)).where(nan, v))
        if out == "f32":
            stores = [ctx.wvgpr_dyn(dst, lane, vals[0].bitcast(dtypes.uint32), exec_mask),
                      ctx.wvgpr_dyn(dst + c(1), lane, vals[1].bitcast(dtypes.uint32), exec_mask)]
        else:
            if out == "f16":
                halves = [v.cast(dtypes.half).bitcast(dtypes.uint16).cast(dtypes.uint32) for v in vals]
            else:   # bf16: the upper half of the f32 bits (exact: at most 2 significant bits)
                halves = [v.bitcast(dtypes.uint32) >> c(16) for v in vals]
            stores = [ctx.wvgpr_dyn(dst, lane, halves[0] | (halves[1] << c(16)), exec_mask)]
        return UOp.sink(UOp.group(*stores).end(lane), *ctx.inc_pc())

    # ---- 4./5. v_permlane16_swap_b32 / v_permlane32_swap_b32 (VOP1) -----------------------------
    def permlane_swap(inst, ctx, width: int):
        """V_PERMLANE32_SWAP_B32:  for lane in 0:31: swap VGPR[lane][SRC0] and VGPR[lane + 32][VDST].
        V_PERMLANE16_SWAP_B32: for pass in 0:1, lane in 0:15: swap VGPR[pass·32 + lane][SRC0] and
        VGPR[pass·32 + lane + 16][VDST]. (EXEC does not take part in the ISA's pseudocode.)"""
        src = ctx.inst_field(type(inst).src0) - c(256)
        dst = ctx.inst_field(type(inst).vdst)
        tmp = UOp.placeholder((2 * WAVE,), dtypes.uint32, slot=0, addrspace=AddrSpace.LOCAL)
        rl = ctx.range()
        read = UOp.group(tmp.index(rl).store(ctx.rvgpr_dyn(src, rl)),
                         tmp.index(rl + i32(WAVE)).store(ctx.rvgpr_dyn(dst, rl))).end(rl)
        tmp2 = tmp.after(read)
        all_on = UOp.const(0xFFFFFFFFFFFFFFFF, dtypes.uint64)
        wl = ctx.range(WAVE // 2)          # the 32 lanes l whose pair is (l, l + width)
        low = (wl // i32(width)) * i32(2 * width) + wl % i32(width)
        write = UOp.group(ctx.wvgpr_dyn(src, low, tmp2.index(low + i32(width) + i32(WAVE)), all_on),
                          ctx.wvgpr_dyn(dst, low + i32(width), tmp2.index(low), all_on)).end(wl)
        return UOp.sink(read, write, *ctx.inc_pc())

    # ---- 6. sub-dword buffer loads at any byte offset -------------------------------------------
    SUBDWORD = {  # op: (bytes, signed, d16 half: None | "lo" | "hi")
        "BUFFER_LOAD_UBYTE": (1, False, None), "BUFFER_LOAD_SBYTE": (1, True, None),
        "BUFFER_LOAD_USHORT": (2, False, None), "BUFFER_LOAD_SSHORT": (2, True, None),
        "BUFFER_LOAD_UBYTE_D16": (1, False, "lo"), "BUFFER_LOAD_UBYTE_D16_HI": (1, False, "hi"),
        "BUFFER_LOAD_SBYTE_D16": (1, True, "lo"), "BUFFER_LOAD_SBYTE_D16_HI": (1, True, "hi"),
        "BUFFER_LOAD_SHORT_D16": (2, False, "lo"), "BUFFER_LOAD_SHORT_D16_HI": (2, False, "hi"),
    }

    def buffer_load_subdword(inst, ctx, nbytes: int, signed: bool, d16):
        """e.g. BUFFER_LOAD_USHORT: addr = CalcBufferAddr(VADDR, SRSRC, SOFFSET, OFFSET);
        VDATA.u32 = 32'U({ 16'0U, MEM[addr].u16 }) -- MEM is byte-addressed: the bytes at addr,
        addr+1 (which may straddle two dwords), zero- or sign-extended; the _D16 forms write
        VDATA[15:0] (or [31:16] for _HI) and keep the other half. Addressing and the range check
        (offset < num_records, as the emulator's own MUBUF path) are the emulator's."""
        if emu._iattr(inst, "lds") or emu._iattr(inst, "idxen"):
            raise NotImplementedError("sub-dword buffer load with lds or idxen")
        exec_mask = ctx.rexec()
        vdata, vaddr = ctx.inst_field(type(inst).vdata), ctx.inst_field(type(inst).vaddr)
        srsrc, soffset = ctx.inst_field(type(inst).srsrc) * c(4), ctx.inst_field(type(inst).soffset)
        offset, offen = ctx.inst_field(type(inst).offset), ctx.inst_field(type(inst).offen)
        base = emu._u64(ctx.rsgpr_dyn(srsrc), ctx.rsgpr_dyn(srsrc + c(1))) & UOp.const(0xFFFFFFFFFFFF, dtypes.uint64)
        num_records = ctx.rsgpr_dyn(srsrc + c(2))
        lane = ctx.range()
        active = lane_on(exec_mask, lane)
        soff = (soffset < c(128)).where(ctx.rsgpr_dyn(soffset), soffset - c(128)).cast(dtypes.uint64)
        voff = offen.ne(c(0)).where(ctx.rvgpr_dyn(vaddr, lane), c(0))
        buf_off = voff + offset
        ok = active & (buf_off < num_records)
        addr = ok.where(base + soff + buf_off.cast(dtypes.uint64), UOp.const(0, dtypes.uint64))
        word = addr >> UOp.const(2, dtypes.uint64)
        shift = (addr.cast(dtypes.uint32) & c(3)) * c(8)
        w0 = ok.where(ctx.vmem.index(word.cast(dtypes.int64).valid(ok)).load(), c(0))
        straddles = ok & ((addr.cast(dtypes.uint32) & c(3)) + c(nbytes)).__gt__(c(4))
        nxt = (word + UOp.const(1, dtypes.uint64)).cast(dtypes.int64)
        w1 = straddles.where(ctx.vmem.index(nxt.valid(straddles)).load(), c(0))
        pair = w0.cast(dtypes.uint64) | (w1.cast(dtypes.uint64) << UOp.const(32, dtypes.uint64))
        mask = 0xFF if nbytes == 1 else 0xFFFF
        v = (pair >> shift.cast(dtypes.uint64)).cast(dtypes.uint32) & c(mask)
        if signed:
            top = 0x80 if nbytes == 1 else 0x8000
            v = (v ^ c(top)) - c(top)
            if d16:
                v = v & c(0xFFFF)
        if d16 == "lo":
            v = (ctx.rvgpr_dyn(vdata, lane) & c(0xFFFF0000)) | (v & c(0xFFFF))
        elif d16 == "hi":
            v = (ctx.rvgpr_dyn(vdata, lane) & c(0xFFFF)) | ((v & c(0xFFFF)) << c(16))
        write = ctx.waccvgpr_dyn if emu._iattr(inst, "acc") else ctx.wvgpr_dyn
        return UOp.sink(UOp.group(write(vdata, lane, v, exec_mask)).end(lane), *ctx.inc_pc())

    # ---- dispatch: wrap the emulator's handlers, ours first ------------------------------------
    orig_ds, orig_vop1 = emu._INST_HANDLERS[irc.DS], emu._INST_HANDLERS[irc.VOP1]
    orig_vop3, orig_mubuf = emu._INST_HANDLERS[irc.VOP3], emu._INST_HANDLERS[irc.MUBUF]

    def ds(inst, ctx):
        return ds_swizzle(inst, ctx) if emu._op_name(inst) == "DS_SWIZZLE_B32" else orig_ds(inst, ctx)

    def vop1(inst, ctx):
        name = emu._op_name(inst)
        if name == "V_CVT_PK_F32_FP8_E32":
            return cvt_pk_f32_fp8(inst, ctx)
        if name == "V_PERMLANE16_SWAP_B32_E32":
            return permlane_swap(inst, ctx, 16)
        if name == "V_PERMLANE32_SWAP_B32_E32":
            return permlane_swap(inst, ctx, 32)
        return orig_vop1(inst, ctx)

    def vop3(inst, ctx):
        name = emu._op_name(inst)
        for out in ("F32", "F16", "BF16"):
            if name == f"V_CVT_SCALEF32_PK_{out}_FP4":
                return cvt_scalef32_pk_fp4(inst, ctx, out.lower())
        return orig_vop3(inst, ctx)

    def mubuf(inst, ctx):
        spec = SUBDWORD.get(emu._op_name(inst))
        return buffer_load_subdword(inst, ctx, *spec) if spec else orig_mubuf(inst, ctx)

    ours = {orig_ds: ds, orig_vop1: vop1, orig_vop3: vop3, orig_mubuf: mubuf}   # each falls back
    for t, h in list(emu._INST_HANDLERS.items()):
        emu._INST_HANDLERS[t] = ours.get(h, h)
    emu._get_runner.cache_clear()
    emu._canonical_runner_cache.clear()

    # ---- denormals: follow the descriptor's FP32 mode, not always flush-to-zero -----------------
    class DenormContext:
        """x86 MXCSR DAZ|FTZ only when the running kernel's FLOAT_DENORM_MODE_32 flushes; the host
        has one mode for all widths, so the FP32 field decides (our descriptors keep denormals)."""
        __slots__ = ("_saved",)

        def __enter__(self):
            lib, ftz_bits = emu._get_ftz_lib()
            if lib is None:
                return self
            self._saved = lib.get_fpcr()
            keep = current_fp32_denorm_mode == 3
            lib.set_fpcr((self._saved & ~ftz_bits) if keep else (self._saved | ftz_bits))
            return self

        def __exit__(self, *args):
            lib, _ = emu._get_ftz_lib()
            if lib is not None and hasattr(self, "_saved"):
                lib.set_fpcr(self._saved)

    emu._MXCSRContext = DenormContext
    _installed = True
