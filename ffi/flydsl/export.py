#!/usr/bin/env python3
"""Compile every gfx950 FlyDSL kernel ahead of time, on placeholders, and export it for linking.

    python ffi/flydsl/export.py --arch gfx950 --out DIR [--only NAME ...] [--list]

For each kernel NAME of `KERNELS` this writes, into DIR:
  NAME.o     x86-64 object: FlyDSL's AOT runtime + the gfx950 code object (symbol NAME__kernels_binary)
  NAME.h     the typed C entry points: NAME__module_init, NAME__module_load(device), NAME_call(..., stream)
  NAME.json  FlyDSL's export metadata (ABI slots, "arch") plus, when llvm-readelf-22 is present,
             "resources" (VGPR, AGPR, SGPR, LDS, scratch, spills per GPU kernel) and the ELF e_flags.

No GPU is needed or touched: nothing here calls a @flyc.jit function; `flyc.compile` only traces
and compiles. Needs `pip install flydsl==0.5.0 torch` (CPU torch) and Debian's lld-22; the linker
is found through $ROCM_PATH/llvm/bin/ld.lld, which this script sets up in a private folder when
ROCM_PATH does not already provide one (see BUILD.md, "ROCm / gfx950").
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name -> (module in ffi/flydsl, factory, keyword arguments; placeholders come from the module's
# `placeholders` or, for a factory compile_X_split, `placeholders_split`). The handler in ffi/rocm/ calls
# NAME_call with the launcher's arguments in order (see each module's docstring).
KERNELS = {
    "pack_kv_pages_bf16": ("pack_kv_pages", "compile_pack_kv_pages", {"dtype": "bf16"}),
    "pack_kv_pages_f16": ("pack_kv_pages", "compile_pack_kv_pages", {"dtype": "f16"}),
    "pack_kv_pages_f32": ("pack_kv_pages", "compile_pack_kv_pages", {"dtype": "f32"}),
    "query_token_positions": ("query_token_positions", "compile_query_token_positions", {}),
    "sparse_decode_bf16": ("sparse_decode", "compile_sparse_decode", {"dtype": "bf16"}),
    "sparse_decode_f16": ("sparse_decode", "compile_sparse_decode", {"dtype": "f16"}),
    "sparse_decode_f32": ("sparse_decode", "compile_sparse_decode", {"dtype": "f32"}),
    "sparse_decode_split_bf16": ("sparse_decode", "compile_sparse_decode_split", {"dtype": "bf16"}),
    "sparse_decode_split_f16": ("sparse_decode", "compile_sparse_decode_split", {"dtype": "f16"}),
    "sparse_decode_split_f32": ("sparse_decode", "compile_sparse_decode_split", {"dtype": "f32"}),
    "sparse_decode_union_bf16": ("sparse_decode", "compile_sparse_decode_union", {"dtype": "bf16"}),
    "sparse_decode_union_f16": ("sparse_decode", "compile_sparse_decode_union", {"dtype": "f16"}),
    "sparse_decode_union_f32": ("sparse_decode", "compile_sparse_decode_union", {"dtype": "f32"}),
    "sparse_prefill_bf16": ("sparse_prefill", "compile_sparse_prefill", {"dtype": "bf16"}),
    "sparse_prefill_f16": ("sparse_prefill", "compile_sparse_prefill", {"dtype": "f16"}),
    "sparse_prefill_f32": ("sparse_prefill", "compile_sparse_prefill", {"dtype": "f32"}),
    # full attention (SPEC §5.7): parts of 16 blocks and their merge
    "full_attention_bf16": ("full_attention", "compile_full_attention", {"dtype": "bf16"}),
    "full_attention_f16": ("full_attention", "compile_full_attention", {"dtype": "f16"}),
    "full_attention_f32": ("full_attention", "compile_full_attention", {"dtype": "f32"}),
    # the indexer's block selection (SPEC §8): idx_q dtype × index-key dtype (fp8 = float8_e4m3fn)
    **{f"select_blocks_{q}_{k}": ("select_blocks", "compile_select_blocks", {"qdt": q, "kdt": k})
       for q in ("bf16", "f32") for k in ("bf16", "fp8")},
    # grouped_matmul (SPEC §9): weight format × output dtype (bf16 rows)
    **{f"grouped_matmul_{w}_{o}": ("grouped_matmul", "compile_grouped_matmul", {"weights": w, "out": o})
       for w in ("bf16", "mxfp8", "mxfp4", "nvfp4") for o in ("f32", "bf16")},
    # route_experts (SPEC §10): the choice and the grouping
    "route_experts": ("route_experts", "compile_route_experts", {}),
    # G = 8 (MiniMax M3 at TP8: 8 query heads per KV head)
    **{f"{op}_g8_{dt}": (mod, f"compile_{mod}{sfx}", {"dtype": dt, "group": 8})
       for op, mod, sfx in (("sparse_decode", "sparse_decode", ""), ("sparse_decode_split", "sparse_decode", "_split"),
                            ("sparse_decode_union", "sparse_decode", "_union"),
                            ("sparse_prefill", "sparse_prefill", ""), ("full_attention", "full_attention", ""))
       for dt in ("bf16", "f16", "f32")},
}

LLD_CANDIDATES = ("/usr/lib/llvm-22/bin/ld.lld", "/usr/lib/llvm-21/bin/ld.lld", "/usr/lib/llvm-20/bin/ld.lld",
                  "/usr/lib/llvm-19/bin/ld.lld")


def ensure_linker() -> None:
    """Point ROCM_PATH at a folder whose llvm/bin/ld.lld is an lld new enough for gfx950."""
    rocm = os.environ.get("ROCM_PATH")
    if rocm and Path(rocm, "llvm/bin/ld.lld").exists():
        return
    for cand in LLD_CANDIDATES:
        if Path(cand).exists():
            folder = Path(tempfile.gettempdir()) / f"m3sparse-rocm-lld-{os.getuid()}"
            (folder / "llvm/bin").mkdir(parents=True, exist_ok=True)
            link = folder / "llvm/bin/ld.lld"
            if not link.exists():
                link.symlink_to(cand)
            os.environ["ROCM_PATH"] = str(folder)
            return
    raise SystemExit("export.py: no ld.lld for gfx950 found; install Debian's lld-22 (apt-get install lld-22)")


def available() -> list[str]:
    """Kernel names whose source module exists (the list grows as kernels land)."""
    return [n for n, (mod, _, _) in KERNELS.items() if (HERE / f"{mod}.py").exists()]


def export_one(name: str, out: Path, arch: str) -> dict:
    try:
        import flydsl.compiler as flyc
    except ImportError as e:
        raise SystemExit(f"export.py: FlyDSL is not importable ({e}); pip install flydsl==0.5.0 torch") from e

    mod_name, factory, kwargs = KERNELS[name]
    mod = importlib.import_module(mod_name)
    launcher = getattr(mod, factory)(**kwargs)
    make_placeholders = mod.placeholders_split if factory.endswith("_split") else mod.placeholders
    compiled = flyc.compile(launcher, *make_placeholders(**kwargs))
    compiled.export_to_c(str(out), name)

    import elf_tools

    obj = out / f"{name}.o"
    meta = json.loads(elf_tools.export_metadata(obj, name))
    if meta.get("arch") != arch:
        raise SystemExit(f"export.py: {name} was compiled for {meta.get('arch')!r}, not {arch!r}")
    co = elf_tools.code_object(obj, name)
    meta["m3sparse"] = {"kernel": name, "e_flags": elf_tools.elf_e_flags(co), "code_object_bytes": len(co)}
    if elf_tools.llvm_tool("llvm-readelf"):
        with tempfile.TemporaryDirectory() as tmp:
            meta["m3sparse"]["resources"] = elf_tools.resources_per_kernel(elf_tools.notes(co, tmp))
    (out / f"{name}.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="gfx950", choices=["gfx950"], help="GPU architecture (only gfx950)")
    ap.add_argument("--out", required=False, type=Path, help="output folder (created)")
    ap.add_argument("--only", nargs="*", help="kernel names to export (default: all)")
    ap.add_argument("--list", action="store_true", help="print the kernel names and exit")
    args = ap.parse_args(argv)

    names = available()
    if args.list:
        print("\n".join(names))
        return 0
    if args.out is None:
        ap.error("--out is required")
    if args.only:
        unknown = sorted(set(args.only) - set(KERNELS))
        if unknown:
            ap.error(f"unknown kernels {unknown}; known: {sorted(KERNELS)}")
        names = [n for n in names if n in args.only]

    # FlyDSL reads the target from FLYDSL_GPU_ARCH (ARCH overrides it); never let it default to gfx942.
    os.environ["FLYDSL_GPU_ARCH"] = args.arch
    os.environ["ARCH"] = args.arch
    ensure_linker()
    sys.path.insert(0, str(HERE))     # the kernel modules import each other by plain name
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        meta = export_one(name, args.out, args.arch)
        res = meta["m3sparse"].get("resources", {})
        print(f"{name}: arch {meta['arch']}, e_flags {meta['m3sparse']['e_flags']:#x}, "
              f"{json.dumps(res, sort_keys=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
