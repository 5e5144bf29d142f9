"""Run our exported gfx950 code objects on tinygrad's CDNA emulator, the way ffi/rocm/handlers.cc
launches them on a GPU.

Where the emulator is: $M3SPARSE_TINYGRAD (a checkout of tinygrad at the commit BUILD.md names),
else ../shared/emulator/tinygrad beside the repository (where CI's clean clone finds it). It also
needs `clang` on PATH (Debian's clang-22 is linked as `clang` in a private folder when only
clang-22 exists).
`emulator_missing()` says why it cannot run; the tests skip with that reason.

What a launcher must do that the GPU's packet processor does (learned from the emulator):
* the code object is mapped at its segments' addresses in host memory; a kernel's first
  instruction is at its descriptor (`<kernel>.kd`) + kernel_code_entry_byte_offset;
* the descriptor's rsrc2 LDS field is 0 (the dispatch packet sets it): we fill it from
  group_segment_fixed_size;
* the kernarg pointer is the only user SGPR pair (checked in the descriptor), and argument
  offsets come from the code object's notes, not from FlyDSL's host header;
* device addresses are plain host addresses (numpy arrays' data pointers).
Workgroups run one after another, waves of a workgroup in turn between barriers.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tools.rocm import emu_fixes

REPO = Path(__file__).resolve().parents[2]

# ---- finding and loading the emulator -------------------------------------------------------------

def tinygrad_dir() -> Path | None:
    env = os.environ.get("M3SPARSE_TINYGRAD")
    path = Path(env) if env else REPO.parent / "shared" / "emulator" / "tinygrad"
    return path if (path / "test" / "mockgpu" / "amd" / "emu.py").is_file() else None


def _clang_on_path() -> bool:
    if shutil.which("clang"):
        return True
    for cand in ("clang-22", "/usr/lib/llvm-22/bin/clang", "clang-21", "clang-20", "clang-19"):
        found = shutil.which(cand)
        if found:
            folder = Path(tempfile.gettempdir()) / f"m3sparse-clang-{os.getuid()}"
            folder.mkdir(exist_ok=True)
            link = folder / "clang"
            if not link.exists():
                link.symlink_to(found)
            os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
            return True
    return False


def emulator_missing() -> str | None:
    """Why the emulated tests cannot run here, or None."""
    if tinygrad_dir() is None:
        env = os.environ.get("M3SPARSE_TINYGRAD")
        if env:
            return f"tinygrad's emulator not found: M3SPARSE_TINYGRAD={env} has no test/mockgpu/amd/emu.py"
        return ("tinygrad's emulator not found: set M3SPARSE_TINYGRAD or put it at "
                f"{REPO.parent / 'shared' / 'emulator' / 'tinygrad'}")
    if not _clang_on_path():
        return "clang not found (apt-get install clang-22)"
    return None


_emu = None


def load_emulator():
    """The module test.mockgpu.amd.emu, with emu_fixes installed (once per process)."""
    global _emu
    if _emu is None:
        why = emulator_missing()
        if why:
            raise RuntimeError(why)
        root = str(tinygrad_dir())
        if root not in sys.path:     # a tinygrad checkout used in place, not an installed package
            sys.path.insert(0, root)
        # tinygrad's `test` package must win over the standard library's `test`
        if "test" in sys.modules and not getattr(sys.modules["test"], "__file__", "").startswith(root):
            del sys.modules["test"]
        os.environ.setdefault("DEV", "CPU")
        from test.mockgpu.amd import emu  # noqa: PLC0415

        emu_fixes.install(emu)
        _emu = emu
    return _emu


# ---- code objects ------------------------------------------------------------------------------

@dataclass
class GpuKernel:
    name: str
    entry: int            # host address of the first instruction
    rsrc1: int
    rsrc2: int            # with the LDS size filled in
    scratch: int
    kernarg_size: int
    args: list            # [(offset, size)] in the kernel's argument order


def _notes_args(notes: str) -> dict:
    """{kernel name: (kernarg size, [(offset, size)], lds bytes)} from `llvm-readelf --notes` text."""
    body = notes.split("amdhsa.kernels:", 1)[1].split("amdhsa.target:", 1)[0]
    out = {}
    for entry in re.split(r"\n  - ", "\n" + body):
        name = re.search(r"\n    \.name:\s+(\S+)", entry)
        if not name:
            continue
        args = [(int(o), int(s)) for o, s in re.findall(r"\.offset:\s+(\d+)\s+\.size:\s+(\d+)", entry)]
        size = int(re.search(r"\.kernarg_segment_size:\s+(\d+)", entry).group(1))
        lds = int(re.search(r"\.group_segment_fixed_size:\s+(\d+)", entry).group(1))
        out[name.group(1)] = (size, args, lds)
    return out


class CodeObject:
    """A gfx950 code object (AMDGPU ELF) mapped into host memory for the emulator."""

    def __init__(self, image: bytes, notes: str):
        phoff, = struct.unpack_from("<Q", image, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", image, 0x36)
        loads = []
        for i in range(phnum):
            p_type, _, p_offset, p_vaddr, _, p_filesz, p_memsz, _ = struct.unpack_from(
                "<IIQQQQQQ", image, phoff + i * phentsize)
            if p_type == 1:  # PT_LOAD
                loads.append((p_offset, p_vaddr, p_filesz, p_memsz))
        size = max(v + m for _, v, _, m in loads) + 4096     # slack: the decoder reads 16 bytes ahead
        self._mem = (ctypes.c_char * (size + 256))()
        self.base = (ctypes.addressof(self._mem) + 255) & ~255
        for off, vaddr, filesz, _ in loads:
            ctypes.memmove(self.base + vaddr, image[off:off + filesz], filesz)
        symbols = _dynamic_symbols(image)
        self.kernels = {}
        for name, (kernarg_size, args, lds) in _notes_args(notes).items():
            kd = self.base + symbols[f"{name}.kd"]
            desc = ctypes.string_at(kd, 64)
            entry_off, = struct.unpack_from("<q", desc, 16)
            rsrc1, rsrc2 = struct.unpack_from("<II", desc, 48)
            props, preload = struct.unpack_from("<HH", desc, 56)
            scratch, = struct.unpack_from("<I", desc, 4)
            user_sgprs = (rsrc2 >> 1) & 0x1F
            # only the kernarg segment pointer (bit 3), no kernarg preload: s[0:1] = kernarg
            if props & 0x7F != 0x08 or user_sgprs != 2 or preload & 0x7F:
                raise NotImplementedError(f"{name}: user SGPR set-up props={props:#x} count={user_sgprs}")
            granules = -(-lds // 512)
            rsrc2 = (rsrc2 & ~(0x1FF << 15)) | (granules << 15)
            self.kernels[name] = GpuKernel(name, kd + entry_off, rsrc1, rsrc2, scratch, kernarg_size, args)


def _dynamic_symbols(image: bytes) -> dict:
    shoff, = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", image, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)]
    out = {}
    for name, typ, _, _, off, size, link, _, _, entsize in secs:
        if typ not in (2, 11):  # SHT_SYMTAB, SHT_DYNSYM
            continue
        stroff = secs[link][4]
        for k in range(size // 24):
            st_name, _, _, _, st_value, _ = struct.unpack_from("<IBBHQQ", image, off + 24 * k)
            end = image.index(b"\0", stroff + st_name)
            out[image[stroff + st_name:end].decode()] = st_value
    return out


# ---- launching ---------------------------------------------------------------------------------

class Arg:
    """Typed scalar kernel arguments (pointers are numpy arrays or ints)."""

    def __init__(self, fmt, value):
        self.fmt, self.value = fmt, value


def i32(v):
    return Arg("<i", int(v))


def i64(v):
    return Arg("<q", int(v))


def f32(v):
    return Arg("<f", float(v))


def launch(kernel: GpuKernel, grid, block, args) -> None:
    """Run `kernel` over grid (x, y, z) with block (x, y, z) and `args` in argument order."""
    emu = load_emulator()
    if len(args) != len(kernel.args):
        raise ValueError(f"{kernel.name}: {len(args)} arguments given, its notes list {len(kernel.args)}")
    kernarg = np.zeros(max(kernel.kernarg_size, 8) + 64, np.uint8)
    ka = (kernarg.ctypes.data + 63) & ~63
    for a, (off, size) in zip(args, kernel.args):
        if isinstance(a, np.ndarray):
            data = struct.pack("<Q", a.ctypes.data)
        elif isinstance(a, Arg):
            data = struct.pack(a.fmt, a.value)
        else:
            raise TypeError(f"{kernel.name}: argument {a!r} is neither an array nor a typed scalar")
        if len(data) != size:
            raise ValueError(f"{kernel.name}: argument at offset {off} has {len(data)} bytes, notes say {size}")
        ctypes.memmove(ka + off, data, size)
    emu_fixes.current_fp32_denorm_mode = (kernel.rsrc1 >> 16) & 3
    if any(g <= 0 for g in grid):
        return
    emu.run_asm(kernel.entry, 0, *grid, *block, ka, rsrc2=kernel.rsrc2, scratch_size=kernel.scratch, arch="cdna")


# ---- the FFI handlers' launches (ffi/rocm/handlers.cc), on host arrays -------------------------------

D, N, TOKEN_BYTES = 128, 128, 72          # head_dim, block_size, bytes per token and head slot
SPLIT_BELOW_PAIRS, SPLITS, PARTIAL_BYTES = 256, 4, 16 * 128 * 4 + 16 * 8
UNION_THREADS = 512                         # union_tile.py's THREADS
FULL_PART_BLOCKS, FULL_MAX_STATES = 16, 4096    # full_attention.py's parts; handlers.cc's chunk bound


def union_tile_rows(group: int) -> int:
    """union_tile.py's tile_rows: 16 rows per workgroup for G = 16, 32 for G = 8."""
    return 16 * (16 // group)


def io_name(dtype) -> str:
    """The exported variant's suffix for a q / key dtype."""
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}[np.dtype(dtype).name]


@dataclass
class Geometry:
    """Cache geometry and the kernels' strides (SPEC §3.3, handlers.cc `strides`)."""
    num_pages: int
    num_layers: int
    hkv: int
    page_stride: int
    layer_stride: int

    @classmethod
    def of(cls, cache: np.ndarray, layout: str | None) -> "Geometry":
        hkv = cache.shape[-3] // 2
        page = 2 * hkv * N * TOKEN_BYTES
        if cache.ndim == 4:
            return cls(cache.shape[0], 1, hkv, page, cache.shape[0] * page)
        if layout == "BLHNC":
            p, l = cache.shape[:2]
            return cls(p, l, hkv, l * page, page)
        l, p = cache.shape[:2]
        return cls(p, l, hkv, page, p * page)


def scalar(x, dtype) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype).reshape(1))


class Handlers:
    """What m3sparse_<op>_rocm does, with `modules(name)` giving the exported code object `name`.

    Arrays must be C-contiguous numpy arrays (bfloat16 from ml_dtypes); results are written in place.
    """

    def __init__(self, modules):
        self.modules = modules

    def _kernels(self, name):
        ks = self.modules(name).kernels
        return [ks[k] for k in sorted(ks, key=lambda k: int(k.rsplit("_", 1)[1]))]

    def pack_kv_pages(self, cache, key, value, slot_mapping, k_scale, v_scale, layer=0, layout=None):
        geo = Geometry.of(cache, layout)
        tokens = key.shape[0]
        if tokens == 0:
            return cache
        k0, k1 = self._kernels(f"pack_kv_pages_{io_name(key.dtype)}")
        common = [slot_mapping.astype(np.int32)]
        layer_a = scalar(layer, np.int32)
        for side, (kern, src, g) in enumerate(((k0, key, k_scale), (k1, value, v_scale))):
            launch(kern, (-(-tokens // 4), geo.hkv, 1), (64, 1, 1),
                   [cache, np.ascontiguousarray(src), common[0], scalar(g, np.float32), layer_a, i32(tokens),
                    i32(geo.hkv), i32(geo.num_pages), i32(geo.num_layers), i64(geo.page_stride),
                    i64(geo.layer_stride), i32(side)])
        return cache

    def query_token_positions(self, cu_seqlens_q, context_lens, num_tokens):
        requests = context_lens.shape[0]
        rid = np.full(num_tokens, 0x5A5A5A5A, np.int32)        # garbage: every entry must be written
        pos = np.full(num_tokens, 0x5A5A5A5A, np.int32)
        if num_tokens == 0:
            return rid, pos
        steps = 0
        while (1 << steps) <= requests:
            steps += 1
        (kern,) = self._kernels("query_token_positions")
        launch(kern, (-(-num_tokens // 64), 1, 1), (64, 1, 1),
               [cu_seqlens_q.astype(np.int32), context_lens.astype(np.int32), rid, pos, i32(requests),
                i32(num_tokens), i32(steps)])
        return rid, pos

    def _attend_args(self, q, cache, block_table, layout):
        geo = Geometry.of(cache, layout)
        requests, max_blocks = block_table.shape
        return geo, [i32(q.shape[0]), i32(geo.hkv), i32(requests), i32(max_blocks), i32(geo.num_pages),
                     i32(geo.num_layers), i64(geo.page_stride), i64(geo.layer_stride)]

    @staticmethod
    def decode_kernel(tokens, hkv, decode_query_len, split=None) -> str:
        """The handler's choice: "union" for dql > 1, else "split" when T·Hkv < 256, else "plain";
        split True/False forces the per-token split / one-pass kernel."""
        if split is not None:
            return "split" if split else "plain"
        if decode_query_len > 1:
            return "union"
        return "split" if tokens * hkv < SPLIT_BELOW_PAIRS else "plain"

    def sparse_decode(self, q, cache, topk, block_table, seq_lens, k_scale, v_scale, layer, scale,
                      decode_query_len, layout=None, split=None, group=16):
        """split None: the handler's rule (decode_kernel); True/False forces a per-token kernel."""
        out = np.full(q.shape, np.nan, q.dtype)
        geo, sizes = self._attend_args(q, cache, block_table, layout)
        tokens = q.shape[0]
        if tokens == 0:
            return out
        ptrs = [q, cache, topk.astype(np.int32), block_table.astype(np.int32), seq_lens.astype(np.int32),
                scalar(k_scale, np.float32), scalar(v_scale, np.float32), scalar(layer, np.int32), out]
        tail = sizes + [i32(decode_query_len), f32(scale)]
        g = "" if group == 16 else f"g{group}_"
        kind = self.decode_kernel(tokens, geo.hkv, decode_query_len, split)
        if kind == "split":
            main, merge = self._kernels(f"sparse_decode_split_{g}{io_name(q.dtype)}")
            # garbage (NaN bytes) in the workspace: the merge must read only what the splits wrote
            ws = np.full(tokens * geo.hkv * SPLITS * PARTIAL_BYTES // 4, np.nan, np.float32)
            launch(main, (tokens, geo.hkv, SPLITS), (256, 1, 1), ptrs + [ws] + tail)
            launch(merge, (tokens, geo.hkv, 1), (256, 1, 1), [ws, ptrs[6], out, i32(tokens), i32(geo.hkv)])
        elif kind == "union":
            (kern,) = self._kernels(f"sparse_decode_union_{g}{io_name(q.dtype)}")
            launch(kern, (-(-tokens // union_tile_rows(group)), geo.hkv, 1), (UNION_THREADS, 1, 1), ptrs + tail)
        else:
            (kern,) = self._kernels(f"sparse_decode_{g}{io_name(q.dtype)}")
            launch(kern, (tokens, geo.hkv, 1), (256, 1, 1), ptrs + tail)
        return out

    def select_blocks(self, idx_q, idx_k_cache, block_table, query_req_id, query_abs_pos, layer=0,
                      topk_blocks=16, local_blocks=1):
        """m3sparse_select_blocks_rocm (SPEC §8; ffi/flydsl/select_blocks.py): the score kernel over
        (M, ceil(T / 64), 2) waves, then the top-k kernel over (T, Hkv)."""
        T, hkv, di = idx_q.shape
        keys = idx_k_cache if idx_k_cache.ndim == 4 else idx_k_cache[None]
        L, P, n, _ = keys.shape
        R, M = block_table.shape
        out = np.full((hkv, T, topk_blocks), 0x5A5A5A5A, np.int32)     # garbage: every slot is written
        if T == 0:
            return out
        # finite garbage, ranked first if the top-k kernel ever read an entry the scores did not write
        ws = np.full(hkv * T * M * 2, 3e38, np.float32)
        kdt = "fp8" if keys.dtype.itemsize == 1 else "bf16"
        scores, topk = self._kernels(f"select_blocks_{io_name(idx_q.dtype)}_{kdt}")
        page_stride = n * di * keys.dtype.itemsize
        args = [idx_q, idx_k_cache, block_table.astype(np.int32), query_req_id.astype(np.int32),
                query_abs_pos.astype(np.int32), scalar(layer, np.int32), ws, out, i32(T), i32(hkv), i32(R), i32(M),
                i32(P), i32(L), i64(page_stride), i64(P * page_stride), i32(topk_blocks), i32(local_blocks),
                i32(-(-T // 64))]
        launch(scores, (M, -(-T // 64), 2), (64 * SELECT_SCORE_WAVES, 1, 1), args[:7] + args[8:16])
        launch(topk, (T, hkv, 1), (64, 1, 1), [ws, args[3], args[4], args[5], out, i32(T), i32(hkv), i32(R),
                                               i32(M), i32(L), i32(topk_blocks), i32(local_blocks)])
        return out

    def sparse_prefill(self, q, cache, topk, block_table, query_req_id, query_abs_pos, k_scale, v_scale,
                       layer, scale, layout=None, group=16):
        out = np.full(q.shape, np.nan, q.dtype)
        geo, sizes = self._attend_args(q, cache, block_table, layout)
        if q.shape[0] == 0:
            return out
        g = "" if group == 16 else f"g{group}_"
        (kern,) = self._kernels(f"sparse_prefill_{g}{io_name(q.dtype)}")
        # union tiles (ffi/flydsl/union_tile.py): one workgroup of 512 threads per 16 tokens (G = 8: 32)
        # and KV head
        launch(kern, (-(-q.shape[0] // union_tile_rows(group)), geo.hkv, 1), (UNION_THREADS, 1, 1),
               [q, cache, topk.astype(np.int32), block_table.astype(np.int32), query_req_id.astype(np.int32),
                query_abs_pos.astype(np.int32), scalar(k_scale, np.float32), scalar(v_scale, np.float32),
                scalar(layer, np.int32), out] + sizes + [f32(scale)])
        return out

    def full_attention(self, q, cache, block_table, query_req_id, query_abs_pos, k_scale, v_scale, layer,
                       scale, layout=None, group=16, max_states=FULL_MAX_STATES):
        """m3sparse_full_attention_rocm (SPEC §5.7; ffi/flydsl/full_attention.py): per chunk of rows
        (at most `max_states` (row, KV head, part) records), the part kernel over (rows, Hkv, parts)
        and the merge over (rows, Hkv), on the chunk's slices of q, out and the metadata."""
        out = np.full(q.shape, np.nan, q.dtype)
        geo, sizes = self._attend_args(q, cache, block_table, layout)
        tokens, max_blocks = q.shape[0], block_table.shape[1]
        parts = -(-max_blocks // FULL_PART_BLOCKS)
        if tokens == 0 or parts == 0:
            return np.zeros_like(q) if tokens else out
        g = "" if group == 16 else f"g{group}_"
        part_kernel, merge = self._kernels(f"full_attention_{g}{io_name(q.dtype)}")
        req, pos = query_req_id.astype(np.int32), query_abs_pos.astype(np.int32)
        table = block_table.astype(np.int32)
        common = [scalar(k_scale, np.float32), scalar(v_scale, np.float32), scalar(layer, np.int32)]
        chunk = max(1, max_states // (geo.hkv * parts))
        for t0 in range(0, tokens, chunk):
            rows = min(chunk, tokens - t0)
            # garbage (NaN bytes) in the workspace: the merge must read only what the parts wrote
            ws = np.full(rows * geo.hkv * parts * PARTIAL_BYTES // 4, np.nan, np.float32)
            view = out[t0:t0 + rows]
            sizes[0] = i32(rows)
            launch(part_kernel, (rows, geo.hkv, parts), (256, 1, 1),
                   [q[t0:t0 + rows], cache, table, req[t0:t0 + rows], pos[t0:t0 + rows], *common, view, ws]
                   + sizes + [i32(parts), f32(scale)])
            launch(merge, (rows, geo.hkv, 1), (256, 1, 1),
                   [req[t0:t0 + rows], pos[t0:t0 + rows], common[1], view, ws, i32(rows), i32(geo.hkv),
                    i32(block_table.shape[0]), i32(parts)])
        return out

    def grouped_matmul(self, lhs, rhs, group_sizes, rhs_scale=None, lhs_rows=None, row_scale=None,
                       group_scale=None, out_dtype=np.float32, activation=0, alpha=1.702, limit=7.0):
        """m3sparse_grouped_matmul_rocm (SPEC §9; ffi/flydsl/grouped_matmul.py): one launch over
        (column groups, ceil(M / 16) + G + 1 tile slots), 4 waves a workgroup."""
        T, K = lhs.shape
        G, N = rhs.shape[:2]
        weights = grouped_format(rhs, rhs_scale)
        M = T if lhs_rows is None else len(lhs_rows)
        cols = N // 2 if activation else N
        out_name = io_name(out_dtype)
        out = np.full((M, cols), np.nan, out_dtype)                 # every element must be written
        if M == 0 or cols == 0:
            return out
        (kernel,) = self._kernels(f"grouped_matmul_{weights}_{out_name}")
        dummy = np.zeros(4, np.uint8)                               # absent operands: 0-byte descriptors
        args = [np.ascontiguousarray(lhs), np.ascontiguousarray(rhs),
                dummy if rhs_scale is None else np.ascontiguousarray(rhs_scale),
                np.ascontiguousarray(group_sizes, np.int32),
                dummy if lhs_rows is None else np.ascontiguousarray(lhs_rows, np.int32),
                dummy if row_scale is None else np.ascontiguousarray(row_scale, np.float32),
                dummy if group_scale is None else np.ascontiguousarray(group_scale, np.float32), out,
                i32(M), i32(T), i32(K), i32(N), i32(G), i32(lhs_rows is not None), i32(activation),
                i32(row_scale is not None), i32(group_scale is not None), f32(alpha), f32(limit)]
        kparts = GROUPED_WAVES if K // 32 >= GROUPED_SPLIT_STEPS else 1    # the handler's rule
        per_group = GROUPED_WAVES // kparts * (32 if activation else 64)
        launch(kernel, (-(-cols // per_group), -(-M // 16) + G + 1, 1), (64 * GROUPED_WAVES, 1, 1),
               args + [i32(kparts)])
        return out


    def route_experts(self, scores, bias, live, k, renormalize=True):
        """m3sparse_route_experts_rocm (SPEC §10; ffi/flydsl/route_experts.py): the choice kernel over
        (T), then the grouping kernel over (1), 256 threads."""
        T, E = scores.shape
        garbage = 0x5A5A5A5A                                      # every entry must be written
        out = (np.full((T, k), np.nan, np.float32), np.full((T, k), garbage, np.int32),
               np.full(E, garbage, np.int32), np.full(T * k, garbage, np.int32),
               np.full(T * k, np.nan, np.float32), np.full((T, k), garbage, np.int32))
        if T == 0:
            out[2][:] = 0
            return out
        choose, group = self._kernels("route_experts")
        weights, experts, sizes, tokens, sweights, inverse = out
        sc, bi = np.ascontiguousarray(scores, np.float32), np.ascontiguousarray(bias, np.float32)
        lv = np.ascontiguousarray(live, np.uint8)
        launch(choose, (T, 1, 1), (64, 1, 1), [sc, bi, weights, experts, i32(T), i32(E), i32(k), i32(renormalize)])
        launch(group, (1, 1, 1), (256, 1, 1), [lv, weights, experts, sizes, tokens, sweights, inverse,
                                                i32(T), i32(E), i32(k)])
        return out

GROUPED_WAVES = 4                                 # grouped_matmul.py: waves per workgroup
SELECT_SCORE_WAVES = 4                            # select_blocks.py SCORE_WAVES
GROUPED_SPLIT_STEPS = 32                          # grouped_matmul.py SPLIT_MIN_STEPS


def grouped_format(rhs, rhs_scale) -> str:
    """The grouped_matmul variant's weight format: bf16, mxfp8, mxfp4 or nvfp4."""
    name = np.dtype(rhs.dtype).name
    if name == "bfloat16":
        return "bf16"
    if name == "float8_e4m3fn":
        return "mxfp8"
    return "nvfp4" if np.dtype(rhs_scale.dtype).name == "float8_e4m3fn" else "mxfp4"
