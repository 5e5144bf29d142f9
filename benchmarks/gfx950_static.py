"""``python -m benchmarks.gfx950_static [--kernels DIR]`` (from the repository root): static report of the gfx950 kernels.

No GPU needed. Compiles every FlyDSL kernel for gfx950 with ffi/flydsl/export.py (or reads the
objects a previous export wrote to DIR), then prints, per GPU kernel (G = 16 and the G = 8 `_g8_`
modules): VGPR, AGPR, SGPR, LDS bytes,
scratch, spills, the occupancy bound in waves per SIMD, and counts of MFMA, buffer-load and
conversion instructions in the disassembly (llvm-objdump-22 --mcpu=gfx950). Then the MI355X
roofline floors (8 TB/s HBM, 2.5 PFLOP/s dense bf16/fp16) for MiniMax M3 decode and prefill.

Needs the source checkout (ffi/flydsl/), `pip install flydsl==0.5.0 torch` and Debian's lld-22 and
llvm-22 (see BUILD.md, "ROCm / gfx950").
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from ffi.flydsl import elf_tools

FLYDSL_DIR = Path(__file__).resolve().parents[1] / "ffi" / "flydsl"

# MI355X (gfx950) figures for the roofline floor.
HBM_BYTES_PER_S = 8.0e12
DENSE_FLOPS_16BIT = 2.5e15

# MiniMax M3 attention geometry (SPEC §1) and the report's workloads.
HKV, G, D, TOPK, N = 4, 16, 128, 16, 128
TOKEN_BYTES = D // 2 + D // 16            # 72 bytes of NVFP4 per token and head slot
DECODE_TOKENS = (1, 32, 128)
SEQ_LEN = 32768
PREFILL_TOKENS = 2048

COLUMNS = [
    ("mfma", r"v_mfma_\w+"),
    ("buf_ld", r"buffer_load_\w+"),
    ("ld_x4", r"buffer_load_dwordx4"),
    ("cvt_fp4", r"v_cvt_scalef32_pk_\w+_fp4"),
    ("cvt_fp8", r"v_cvt_pk_f32_fp8"),
    ("cvt_other", r"v_cvt_\w+"),
    ("exp", r"v_exp_f32"),
    ("ds_rd", r"ds_read\w*"),
    ("ds_wr", r"ds_write\w*"),
]


def export(out: Path) -> list[str]:
    names = subprocess.run([sys.executable, str(FLYDSL_DIR / "export.py"), "--list"], check=True,
                           capture_output=True, text=True).stdout.split()
    proc = subprocess.run([sys.executable, str(FLYDSL_DIR / "export.py"), "--arch", "gfx950", "--out", str(out)],
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"export.py failed:\n{proc.stderr[-3000:]}")
    return names


def split_functions(asm: str) -> dict[str, list[str]]:
    """Disassembly lines per GPU kernel symbol."""
    funcs, current = {}, None
    for line in asm.splitlines():
        m = re.match(r"^[0-9a-f]+ <([^>]+)>:", line)
        if m:
            current = m.group(1)
            funcs[current] = []
        elif current and line.startswith("\t"):
            funcs[current].append(line.split()[0])
    return funcs


def count(mnemonics: list[str], pattern: str) -> int:
    rx = re.compile(pattern + r"(_e32|_e64)?$")
    return sum(1 for m in mnemonics if rx.match(m))


def kernel_rows(out: Path, names: list[str]):
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            co = elf_tools.code_object(out / f"{name}.o", name)
            res = elf_tools.resources_per_kernel(elf_tools.notes(co, tmp))
            funcs = split_functions(elf_tools.disassemble(co, tmp))
            for gpu_kernel, r in res.items():
                mn = funcs.get(gpu_kernel, [])
                waves = elf_tools.waves_per_simd(r["vgpr"], r["agpr"], r["lds_bytes"], r["max_flat_workgroup_size"])
                counts = {col: count(mn, pat) for col, pat in COLUMNS}
                counts["cvt_other"] -= counts["cvt_fp4"] + counts["cvt_fp8"]
                rows.append((name, gpu_kernel, r, waves, counts))
    return rows


def print_kernels(rows) -> None:
    head = (f"{'kernel':<28} {'fn':>2} {'VGPR':>4} {'AGPR':>4} {'SGPR':>4} {'LDS B':>6} {'scr':>3} "
            f"{'spill':>5} {'w/SIMD':>6} " + " ".join(f"{c:>9}" for c, _ in COLUMNS))
    print(head)
    print("-" * len(head))
    for name, fn, r, waves, c in rows:
        spills = r["vgpr_spills"] + r["sgpr_spills"]
        print(f"{name:<28} {fn.rsplit('_', 1)[-1]:>2} {r['vgpr']:>4} {r['agpr']:>4} {r['sgpr']:>4} {r['lds_bytes']:>6} "
              f"{r['scratch_bytes']:>3} {spills:>5} {waves:>6} " + " ".join(f"{c[k]:>9}" for k, _ in COLUMNS))


def roofline(g: int = G) -> list[tuple[str, float, float]]:
    """(workload, bytes, flops) of the MiniMax M3 cases (SPEC §5) with G = g query heads per KV head."""
    keys = TOPK * N                                        # 2048 attended keys per (token, KV head)
    flops_per_key = 4 * g * D                              # QK and PV: 2·G·D each
    cases = []
    for t in DECODE_TOKENS:
        kv_bytes = t * HKV * TOPK * N * TOKEN_BYTES * 2    # each selected K and V byte once
        cases.append((f"decode T={t}, Hkv={HKV}, seq {SEQ_LEN}", kv_bytes, t * HKV * keys * flops_per_key))
    pre_flops = PREFILL_TOKENS * HKV * keys * flops_per_key
    distinct = SEQ_LEN * HKV * TOKEN_BYTES * 2             # the whole context's K/V once
    cases.append((f"prefill {PREFILL_TOKENS} tok, ctx {SEQ_LEN}", distinct, pre_flops))
    return cases


def print_roofline(g: int = G) -> None:
    print(f"MI355X roofline floor (HBM {HBM_BYTES_PER_S / 1e12:.0f} TB/s, dense bf16/fp16 "
          f"{DENSE_FLOPS_16BIT / 1e15:.1f} PFLOP/s; G={g}, D={D}, top-{TOPK}x{N}, {TOKEN_BYTES} B/token/slot)")
    if g < 16:
        print(f"(the G={g} kernels run the G=16 MFMA tiles with {16 - g} idle columns: their MFMA time is G=16's)")
    print(f"{'workload':<34} {'bytes':>12} {'GFLOP':>9} {'t_mem us':>9} {'t_flop us':>9} {'floor us':>9}")
    for what, nbytes, flops in roofline(g):
        t_mem = nbytes / HBM_BYTES_PER_S * 1e6
        t_flop = flops / DENSE_FLOPS_16BIT * 1e6
        print(f"{what:<34} {nbytes:>12,d} {flops / 1e9:>9.2f} {t_mem:>9.2f} {t_flop:>9.2f} {max(t_mem, t_flop):>9.2f}")
    redundant = PREFILL_TOKENS * HKV * TOPK * N * TOKEN_BYTES * 2
    print(f"(prefill bytes = the context's distinct K/V; a per-token kernel reads each token's selection "
          f"separately, {redundant:,d} B = {redundant / HBM_BYTES_PER_S * 1e6:.0f} us at HBM rate; the union-tile "
          "prefill reads each 16-token tile's union once: `python -m benchmarks.gfx950_traffic`)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gfx950_static", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", type=Path, help="folder written by ffi/flydsl/export.py (default: export now)")
    args = ap.parse_args(argv)
    if args.kernels:
        names = sorted(p.stem for p in args.kernels.glob("*.o"))
        out = args.kernels
        rows = kernel_rows(out, names)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            names = export(Path(tmp))
            rows = kernel_rows(Path(tmp), names)
    print("gfx950 kernels (FlyDSL 0.5.0 AOT; fn = GPU kernel index in the module (pack launches K and V);"
          " waves/SIMD from VGPR+AGPR and LDS)")
    print_kernels(rows)
    for g in (16, 8):       # M3 at TP4-style G = 16 and at TP8 (G = 8, the *_g8_* kernels)
        print()
        print_roofline(g)
    return 0


if __name__ == "__main__":
    sys.exit(main())
