"""NVFP4 page packing for gfx950 (SPEC §2.2, §2.3, §3): quantize new K/V tokens, write the page map.

Entry point of the compiled module (one per input dtype, `pack_kv_pages_bf16`, `pack_kv_pages_f16`, `pack_kv_pages_f32`):

    launch(kv_cache, key, value, slot_mapping, k_scale, v_scale, layer,
           num_tokens, num_kv_heads, num_pages, num_layers, page_stride, layer_stride, stream)

Operands (device pointers; the FFI handler in ffi/rocm/ passes the XLA buffers):
* ``kv_cache``      uint8, the whole cache buffer (4-D one layer, or 5-D LBHNC / BLHNC, SPEC §3.3)
* ``key``/``value`` bf16, f16 or f32 [T, Hkv, D], D = 128, contiguous
* ``slot_mapping``  int32 [T], slot = page·N + offset (SPEC §3.4)
* ``k_scale``/``v_scale`` float32 [] global dequantization multipliers g (SPEC §2.1)
* ``layer``         int32 [] layer index (0 for a 4-D cache)
Scalars: T, Hkv, P, L (int32) and the 64-bit strides in bytes (SPEC §3.3):
  page p of layer l starts at  p·page_stride + l·layer_stride
  LBHNC / 4-D: page_stride = page_bytes, layer_stride = P·page_bytes
  BLHNC:       page_stride = L·page_bytes, layer_stride = page_bytes
  with page_bytes = 2·Hkv·N·72.

Thread mapping. One 64-lane workgroup per (4 tokens, KV head, side); grid = (ceil(T/4), Hkv, 2),
side 0 = K (slot 2h), side 1 = V (slot 2h+1), SPEC §3.1. Inside the workgroup lane l handles
token 4·blockIdx.x + l // 16 and the 8 consecutive elements e = 8·(l % 16) … +7 of that head
vector: one 16-byte buffer load of the input (two for f32). Two neighbouring lanes hold one NVFP4 group of 16
(SPEC §2.1): group s = (l % 16) // 2. The group max and the NaN flag are combined across the pair
with one xor-shuffle. Each lane writes its 8 codes as one 32-bit word at data byte 4·(l % 16) of
the token (element 2j in the low nibble of byte j, SPEC §2.3); the even lane of a pair writes the
group's scale byte. Inside the (page, slot) tile (SPEC §3.2): data at t·64, scales at 8192 + t·8.

Arithmetic (SPEC §2.2), all fp32 with round-to-nearest-even, the same operations in the same order
as ``nvfp4_inverse_scale`` / ``nvfp4_quantize_group`` in ffi/include/m3sparse/nvfp4.h:
1. r = 1 / g (IEEE division); r is NaN unless 2^-126 <= g <= 2^126 (§2.2 step 5).
2. a = max |x_i| (NaNs ignored here, caught by step 4); s = (a / 6) · r;
   sf = e4m3_rne(min(max(s, 2^-9), 448)) by integer rounding of the fp32 bits (3 mantissa bits,
   ties to even; below 2^-6 the subnormal units of 2^-9 via roundeven(v·512)).
3. y = (x_i · r) / float(sf); code by the comparison ladder of ``e2m1_from_float`` (ties to
   even, saturating, −0 → +0).
4. NaN in the group (or r NaN): scale byte 0x7F and all 16 codes 0.
Writes happen only for 0 ≤ slot < P·N and 0 ≤ layer < L (SPEC §3.3, §3.4, §7); the addresses
are 64-bit (global stores, not 32-bit buffer offsets, because a multi-layer cache can exceed 4 GiB).
"""

import functools

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr
from flydsl.expr import math as fmath

from common import buffer_rsrc, load_dwords

# Geometry (SPEC §1, §2.3, §3.2), fixed for the gfx950 kernels.
HEAD_DIM = 128                      # D
BLOCK_SIZE = 128                    # N tokens per page
GROUP = 16                          # NVFP4 elements per E4M3 scale
DATA_BYTES = HEAD_DIM // 2          # 64 data bytes per token
SCALE_BYTES = HEAD_DIM // GROUP     # 8 scale bytes per token
TILE_BYTES = BLOCK_SIZE * (DATA_BYTES + SCALE_BYTES)   # 9216 bytes per (page, slot)
SCALE_PLANE = BLOCK_SIZE * DATA_BYTES                  # 8192: start of the scale plane

WAVE = 64
ELEMS_PER_LANE = 8                  # one 16-byte load of bf16/f16 (two of f32)
LANES_PER_VECTOR = HEAD_DIM // ELEMS_PER_LANE          # 16
TOKENS_PER_GROUP = WAVE // LANES_PER_VECTOR            # 4 tokens per workgroup

# NVFP4 constants (SPEC §2.1, nvfp4.h).
E2M1_MAX = 6.0
E4M3_MAX = 448.0
SCALE_FLOOR = 2.0 ** -9
SCALE_NAN = 0x7F
F32_EXP_MASK = 0x7F800000
F32_ABS_MASK = 0x7FFFFFFF
F32_QNAN = 0x7FC00000

DTYPES = {"bf16": fx.BFloat16, "f16": fx.Float16, "f32": fx.Float32}


def _is_nan(x):
    """x is NaN, by bits (independent of any fast-math flag)."""
    return (x.bitcast(fx.Uint32) & F32_ABS_MASK) > F32_EXP_MASK


def inverse_scale(g):
    """SPEC §2.2 steps 1 and 5 (nvfp4_inverse_scale): 1/g for 2^-126 <= g <= 2^126, else NaN."""
    r = fx.Float32(1.0) / g
    ok = (g >= 2.0 ** -126) & (g <= 2.0 ** 126)
    return ok.select(r, fx.Uint32(F32_QNAN).bitcast(fx.Float32))


def e4m3_round(v):
    """E4M3 byte and its exact value for v in [2^-9, 448], round to nearest even (SPEC §2.2 step 2).

    Returns (byte as Uint32, value as Float32).
    """
    bits = v.bitcast(fx.Uint32)
    # Normal E4M3 range (v >= 2^-6): keep 3 mantissa bits, ties to even; a carry moves into the
    # exponent field, which is exactly the E4M3 successor. v <= 448 never rounds above 448.
    keep_odd = (bits >> 20) & 1
    rounded = (bits + (keep_odd + 0x7FFFF)) & fx.Uint32(0xFFF00000)
    normal_byte = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)
    normal_value = rounded.bitcast(fx.Float32)
    # Subnormal E4M3 range (v < 2^-6): units of 2^-9; v·512 is exact, q in [1, 8] (8 is 2^-6).
    q = fmath.roundeven(v * 512.0)
    sub_byte = q.to(fx.Uint32)
    sub_value = q * SCALE_FLOOR
    is_sub = v < 2.0 ** -6
    return is_sub.select(sub_byte, normal_byte), is_sub.select(sub_value, normal_value)


def e2m1_code(y):
    """E2M1 code of y: ties to even, saturating to ±6, −0 → +0 (SPEC §2.2 step 3, e2m1_from_float)."""
    a = fmath.absf(y)
    m = fx.Uint32(0)
    # The ladder of nvfp4.h: each threshold adds one magnitude step.
    m = m + (a > 0.25).select(fx.Uint32(1), fx.Uint32(0))
    m = m + (a >= 0.75).select(fx.Uint32(1), fx.Uint32(0))
    m = m + (a > 1.25).select(fx.Uint32(1), fx.Uint32(0))
    m = m + (a >= 1.75).select(fx.Uint32(1), fx.Uint32(0))
    m = m + (a > 2.5).select(fx.Uint32(1), fx.Uint32(0))
    m = m + (a >= 3.5).select(fx.Uint32(1), fx.Uint32(0))
    m = m + (a > 5.0).select(fx.Uint32(1), fx.Uint32(0))
    negative = (y.bitcast(fx.Uint32) >> 31) != 0
    return (negative & (m != 0)).select(m | 8, m)


@functools.lru_cache(maxsize=None)
def compile_pack_kv_pages(dtype: str = "bf16"):
    """Build the launcher for one input dtype ("bf16", "f16" or "f32")."""
    elem = DTYPES[dtype]
    ELEM_BYTES = elem.width // 8

    @flyc.kernel
    def pack_kv_pages_kernel(
        kv_cache: fx.Pointer,
        src: fx.Pointer,
        slot_mapping: fx.Pointer,
        global_scale: fx.Pointer,
        layer_ptr: fx.Pointer,
        num_tokens: fx.Int32,
        num_kv_heads: fx.Int32,
        num_pages: fx.Int32,
        num_layers: fx.Int32,
        page_stride: fx.Int64,
        layer_stride: fx.Int64,
        side: fx.Int32,
    ):
        lane = fx.thread_idx.x
        head = fx.Int32(fx.block_idx.y)
        token = fx.Int32(fx.block_idx.x) * TOKENS_PER_GROUP + fx.Int32(lane) // LANES_PER_VECTOR
        part = fx.Int32(lane) % LANES_PER_VECTOR             # 8-element chunk of the head vector
        token_ok = token < num_tokens
        token_safe = token_ok.select(token, 0)

        # 1. Load 8 input elements (one 16-byte buffer load) and convert to fp32 exactly.
        src_rsrc = buffer_rsrc(src, fx.Int64(num_tokens) * fx.Int64(num_kv_heads) * (HEAD_DIM * ELEM_BYTES))
        chunk = (token_safe * num_kv_heads + head) * LANES_PER_VECTOR + part
        if const_expr(elem is fx.Float32):      # 32 bytes: two 16-byte buffer loads
            lo = load_dwords(src_rsrc, chunk * 32, 4).bitcast(fx.Float32)
            hi = load_dwords(src_rsrc, chunk * 32 + 16, 4).bitcast(fx.Float32)
            x = fx.Vector.from_elements([lo[i] for i in range(4)] + [hi[i] for i in range(4)], dtype=fx.Float32)
        else:                                   # 16 bytes: one buffer_load_dwordx4
            x = load_dwords(src_rsrc, chunk * 16, 4).bitcast(elem).to(fx.Float32)

        # 2. r = 1/g (SPEC §2.2 step 1), the layer (SPEC §3.3) and the slot (SPEC §3.4).
        g = fx.Float32(global_scale.load())
        r = inverse_scale(g)
        layer = fx.Int32(layer_ptr.load())
        slot = fx.Int32(slot_mapping[token_safe])
        valid = token_ok & (slot >= 0) & (fx.Int64(slot) < fx.Int64(num_pages) * BLOCK_SIZE)
        valid = valid & (layer >= 0) & (layer < num_layers)

        # 3. Group max and NaN flag over the lane pair (SPEC §2.2 steps 2, 4).
        amax = fx.Float32(0.0)
        nan_count = fx.Int32(0)
        for i in fx.range_constexpr(ELEMS_PER_LANE):
            xi = x[i]
            ai = fmath.absf(xi)
            amax = (ai > amax).select(ai, amax)
            nan_count = nan_count + _is_nan(xi).select(fx.Int32(1), fx.Int32(0))
        peer_amax = amax.shuffle_xor(1, WAVE)
        amax = (peer_amax > amax).select(peer_amax, amax)
        nan_count = nan_count + nan_count.shuffle_xor(1, WAVE)
        nan_group = (nan_count > 0) | _is_nan(r)

        # 4. Block scale (SPEC §2.2 step 2).
        s = (amax / E2M1_MAX) * r
        s = (s > SCALE_FLOOR).select(s, fx.Float32(SCALE_FLOOR))
        s = (s < E4M3_MAX).select(s, fx.Float32(E4M3_MAX))
        sf_byte, sf_value = e4m3_round(s)

        # 5. Codes (SPEC §2.2 step 3), packed two per byte (SPEC §2.3), 4 bytes per lane.
        word = fx.Uint32(0)
        for i in fx.range_constexpr(ELEMS_PER_LANE):
            code = e2m1_code((x[i] * r) / sf_value)
            word = word | (code << (4 * i))
        word = nan_group.select(fx.Uint32(0), word)
        sf_byte = nan_group.select(fx.Uint32(SCALE_NAN), sf_byte)

        # 6. 64-bit addresses (SPEC §3.2, §3.3) and the writes.
        slot_safe = valid.select(slot, 0)
        page = fx.Int64(slot_safe // BLOCK_SIZE)
        offset = slot_safe % BLOCK_SIZE
        tile = (fx.Int64(valid.select(layer, 0)) * layer_stride + page * page_stride
                + fx.Int64(head * 2 + side) * TILE_BYTES)
        data_at = tile + fx.Int64(offset * DATA_BYTES + part * (ELEMS_PER_LANE // 2))
        scale_at = tile + fx.Int64(SCALE_PLANE + offset * SCALE_BYTES + part // 2)
        if valid:
            fx.recast_iter(fx.Pointer[fx.Uint32, fx.AddressSpace.Global, 4].ir_type, kv_cache + data_at).store(word)
            if part % 2 == 0:
                (kv_cache + scale_at).store(fx.Uint8(sf_byte.to(fx.Uint8)))

    @flyc.jit
    def launch(
        kv_cache: fx.Pointer,
        key: fx.Pointer,
        value: fx.Pointer,
        slot_mapping: fx.Pointer,
        k_scale: fx.Pointer,
        v_scale: fx.Pointer,
        layer: fx.Pointer,
        num_tokens: fx.Int32,
        num_kv_heads: fx.Int32,
        num_pages: fx.Int32,
        num_layers: fx.Int32,
        page_stride: fx.Int64,
        layer_stride: fx.Int64,
        grid_tokens: fx.Int32,
        stream: fx.Stream = fx.Stream(None),
    ):
        """grid_tokens = ceil(T / 4), computed by the host (no grid-size intrinsics on device)."""
        for side, src, g in ((0, key, k_scale), (1, value, v_scale)):
            pack_kv_pages_kernel(
                kv_cache, src, slot_mapping, g, layer, num_tokens, num_kv_heads, num_pages, num_layers,
                page_stride, layer_stride, fx.Int32(side),
            ).launch(grid=(grid_tokens, num_kv_heads, 1), block=(WAVE, 1, 1), stream=stream)

    return launch


def placeholders(dtype: str = "bf16"):
    """Arguments for flyc.compile on a machine without a GPU."""
    elem = DTYPES[dtype]
    ptr = flyc.from_c_void_p
    return (
        ptr(fx.Uint8, None, assumed_align=16),      # kv_cache
        ptr(elem, None, assumed_align=16),          # key
        ptr(elem, None, assumed_align=16),          # value
        ptr(fx.Int32, None, assumed_align=4),       # slot_mapping
        ptr(fx.Float32, None, assumed_align=4),     # k_scale
        ptr(fx.Float32, None, assumed_align=4),     # v_scale
        ptr(fx.Int32, None, assumed_align=4),       # layer
        fx.Int32(1), fx.Int32(1), fx.Int32(1), fx.Int32(1),
        fx.Int64(1), fx.Int64(1), fx.Int32(1),
    )
