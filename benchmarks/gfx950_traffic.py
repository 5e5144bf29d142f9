"""``python -m benchmarks.gfx950_traffic [--quick]`` (from the repository root): what the gfx950 attention kernels read,
counted on the ISA emulator, beside what the selections need, and an MI355X time model.

Needs the repository checkout (ffi/flydsl, tools/rocm, tests/support/attention_problems.py), FlyDSL, lld/llvm-22, clang and tinygrad's
CDNA emulator (see tools/rocm/emu_launch.py): the kernels are exported exactly as the build
exports them and launched as ffi/rocm/handlers.cc launches them. **Nothing here ran on gfx950
hardware**: bytes and MFMAs are counted per executed instruction on the emulator
(tools/rocm/emu_traffic.py), and times are a model.

Selections. Neighbouring tokens of a request select mostly the same blocks (their queries are
alike and a block's pooled index key is fixed). The model: block b of KV head g has a relevance
r_gb ~ N(0, 1) shared by the request's tokens; token t scores r_gb + σ·n_tgb with n an AR(1)
process along t (n_t = ρ·n_{t-1} + sqrt(1-ρ²)·ε); the token takes its local block and the top 15
other visible blocks. `--sigma` / `--rho` set σ and ρ; the table prints the overlap they give
(blocks shared by adjacent tokens). The decode case is the usual MTP shape: dql 4 rows sharing 12 of
their 16 blocks (4 own blocks per row).

References per case: the per-token sum (each token's valid selected blocks, 18 KiB of K+V per
block and KV head: what the per-token kernel reads), the sum over tiles of each tile's union (16
consecutive rows: the union-tile ideal) and the context (every page once). The MI355X model:
max(HBM bytes / 8 TB/s, MFMA FLOPs / 2.5 PFLOP/s, LDS bytes / (256 CUs · 128 B/clk · 2.4 GHz));
it assumes the grid fills the machine and hides latency (it does not model occupancy).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import jax_m3sparse as m3
from ffi.flydsl import elf_tools
from tests.support.attention_problems import build, decode_problem
from tools.rocm import emu_launch, emu_traffic
from tools.rocm.toolchain import EXPORT, toolchain_missing

BLOCK_BYTES = 2 * 128 * 72                      # K + V of one (page, KV head): 18432
HBM, MFMA_PEAK, LDS_BW = 8e12, 2.5e15, 256 * 128 * 2.4e9


# ---- selections ------------------------------------------------------------------------------

def correlated_topk(rng, hkv, pos, max_blocks, sigma, rho, k=16):
    """[Hkv, T, K] selections of one request's tokens at positions `pos` (consecutive), by the
    module docstring's model; -1 where fewer than K blocks are visible."""
    T = len(pos)
    rel = rng.standard_normal((hkv, max_blocks))
    noise = rng.standard_normal((hkv, max_blocks))
    topk = np.full((hkv, T, k), -1, np.int32)
    for t in range(T):
        noise = rho * noise + np.sqrt(1 - rho * rho) * rng.standard_normal((hkv, max_blocks))
        local = pos[t] // 128
        for g in range(hkv):
            score = rel[g, :local] + sigma * noise[g, :local]
            others = np.argsort(-score)[:k - 1]
            pick = np.concatenate([[local], others]).astype(np.int32)
            topk[g, t, :len(pick)] = rng.permutation(pick)
    return topk


def shared_topk(rng, hkv, rows_per_req, visible_blocks, common=12, k=16):
    """[Hkv, R·dql, K]: the rows of a request share `common` blocks (their local block among them)
    and own k - common blocks each."""
    R = len(visible_blocks)
    own = k - common
    topk = np.full((hkv, R * rows_per_req, k), -1, np.int32)
    for r, nb in enumerate(visible_blocks):
        for g in range(hkv):
            pool = rng.permutation(nb - 1)
            shared = np.concatenate([[nb - 1], pool[:common - 1]])
            for i in range(rows_per_req):
                mine = pool[common - 1 + own * i:common - 1 + own * (i + 1)]
                topk[g, r * rows_per_req + i] = rng.permutation(np.concatenate([shared, mine]))
    return topk


# ---- expected counts ---------------------------------------------------------------------------

def valid_keys(topk, req, pos, block_table, num_pages):
    """Per (head, token): the set of (request, block) keys of its valid slots (SPEC §5.2), as a list
    of lists of tuples (duplicates kept)."""
    hkv, T, _ = topk.shape
    M = block_table.shape[1]
    out = []
    for g in range(hkv):
        rows = []
        for t in range(T):
            keys = []
            if req[t] >= 0:
                for b in topk[g, t]:
                    if 0 <= b < M and 128 * b < pos[t] + 1 and 0 <= block_table[req[t], b] < num_pages:
                        keys.append((int(req[t]), int(b)))
            rows.append(keys)
        out.append(rows)
    return out


def expected_counts(keys, block_table, pos, G=16):
    """Per-token sum, tile-union sum, context (bytes), the union sizes' mean, the selections'
    minimum MFMAs (64·G/16 per row and valid slot: with G = 8 two rows could share an MFMA's 16
    columns), and the union kernel's MFMAs by formula: per tile entry and wave whose rows selected
    it, 128, or 192 for G = 8 when one of the wave's rows stops short of the staged keys (its
    per-row masked V pass; ffi/flydsl/union_tile.py)."""
    tile = 16 * (16 // G)
    per_wave = tile // 8
    per_token = union = mfma = 0
    pages = set()
    sizes = []
    for rows in keys:
        T = len(rows)
        per_token += sum(len(r) for r in rows)
        for t0 in range(0, T, tile):
            tile_rows = [set(r) for r in rows[t0:t0 + tile]] + [set()] * max(0, t0 + tile - T)
            vis = [int(p) + 1 for p in pos[t0:t0 + tile]] + [0] * max(0, t0 + tile - T)
            u = set().union(*tile_rows)
            sizes.append(len(u))
            union += len(u)
            for key in u:
                lim = [min(128, vis[i] - 128 * key[1]) if key in tile_rows[i] else 0 for i in range(tile)]
                lim_u = max(lim)
                for w in range(0, tile, per_wave):
                    wave = lim[w:w + per_wave]
                    if any(key in tile_rows[i] for i in range(w, w + per_wave)):
                        mfma += 192 if G == 8 and min(wave) < lim_u else 128
        for rws in rows:
            pages |= {int(block_table[r, b]) for r, b in rws}
    hkv = len(keys)
    return dict(per_token=per_token * BLOCK_BYTES, union=union * BLOCK_BYTES,
                context=len(pages) * hkv * BLOCK_BYTES, mean_union=float(np.mean(sizes)) if sizes else 0.0,
                min_mfma=sum(64 * G // 16 * len(r) for rows in keys for r in rows), union_mfma=mfma)


def adjacent_overlap(topk):
    """Mean number of blocks adjacent tokens (same head) share."""
    hkv, T, _ = topk.shape
    if T < 2:
        return float("nan")
    return float(np.mean([len(set(topk[g, t]) & set(topk[g, t + 1]) - {-1})
                          for g in range(hkv) for t in range(T - 1)]))


# ---- emulated runs -------------------------------------------------------------------------------

def missing() -> str | None:
    """Why this bench cannot run here (before any work), or None."""
    why = [w for w in (toolchain_missing(), emu_launch.emulator_missing()) if w]
    return "; ".join(why) or None


class Kernels:
    """The exported kernels (exported once into a temporary folder) behind emu_launch.Handlers."""

    def __init__(self, names):
        self.out = Path(tempfile.mkdtemp(prefix="gfx950_traffic_"))
        proc = subprocess.run([sys.executable, str(EXPORT), "--arch", "gfx950", "--out",
                               str(self.out), "--only", *names], capture_output=True, text=True,
                              env={**os.environ, "FLYDSL_GPU_ARCH": "gfx950", "ARCH": "gfx950"})
        if proc.returncode:
            raise SystemExit(f"gfx950_traffic: export.py failed:\n{proc.stdout}{proc.stderr[-4000:]}")
        self.loaded = {}

        def modules(name):
            if name not in self.loaded:
                co = elf_tools.code_object(self.out / f"{name}.o", name)
                self.loaded[name] = emu_launch.CodeObject(co, elf_tools.notes(co, Path(tempfile.mkdtemp())))
            return self.loaded[name]

        self.handlers = emu_launch.Handlers(modules)


def count(fn, regions):
    t0 = time.perf_counter()
    with emu_traffic.counting(regions) as c:
        out = fn()
    return out, c, time.perf_counter() - t0


def model_us(hbm_bytes, flop, lds_bytes):
    parts = dict(hbm=hbm_bytes / HBM * 1e6, mfma=flop / MFMA_PEAK * 1e6, lds=lds_bytes / LDS_BW * 1e6)
    return max(parts.values()), parts


def row(kernel, case, c, ref, seconds):
    kv = c.read.get("kv_cache", 0)
    other = sum(v for k, v in c.read.items() if k != "kv_cache")
    written = sum(c.written.values())
    est, parts = model_us(kv + other + written, c.mfma_flop, c.lds_read + c.lds_written)
    bound = max(parts, key=parts.get)
    return (f"| {kernel} | {case} | {kv / 1e6:.3f} | {kv / ref['union']:.2f} | {kv / ref['per_token']:.3f} | "
            f"{(other + written) / 1e6:.3f} | {(c.lds_read + c.lds_written) / 1e6:.1f} | {c.mfma} | "
            f"{c.mfma / (ref['min_mfma'] or 1):.2f} | {est:.2f} ({bound}) | {seconds:.0f} |")


HEADER = ("| kernel | case | K/V read (MB) | ÷ tile unions | ÷ per-token sum | q/out/meta (MB) | LDS (MB) | "
          "MFMAs | ÷ minimum | model µs (bound) | emulated s |\n|---|---|---|---|---|---|---|---|---|---|---|")


def prefill_case(rng, hkv, G, q_len, kv_len, sigma, rho, dtype):
    req = np.zeros(q_len, np.int32)
    pos = np.arange(kv_len - q_len, kv_len, dtype=np.int32)
    p = build(rng, hkv, G, [kv_len], (req, pos), dtype=getattr(jnp, dtype), extra_pages=1)
    p.topk = correlated_topk(rng, hkv, pos, p.block_table.shape[1], sigma, rho)
    return p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gfx950_traffic", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one small prefill case (a smoke run)")
    ap.add_argument("--sigma", type=float, default=0.35)
    ap.add_argument("--rho", type=float, default=0.95)
    args = ap.parse_args(argv)
    why = missing()
    if why:
        raise SystemExit(f"gfx950_traffic needs the repository checkout, `pip install -e .[rocm]` (FlyDSL, CPU torch), "
                         f"Debian's lld-22 llvm-22 clang-22 and tinygrad's emulator (M3SPARSE_TINYGRAD): {why}")
    scale = 1 / np.sqrt(128)
    names = ["sparse_prefill_f16", "sparse_prefill_g8_f16", "sparse_decode_bf16", "sparse_decode_g8_bf16",
             "sparse_decode_union_bf16"]
    k = Kernels(names)
    h = k.handlers
    rng = np.random.default_rng(7)
    print("gfx950 kernels on tinygrad's CDNA emulator (never on hardware); bytes and MFMAs counted per "
          f"executed instruction; selections: σ = {args.sigma}, ρ = {args.rho}\n"
          "K/V read ÷ tile unions / ÷ per-token sum: over each 16-row tile's (G = 8: 32-row) distinct valid blocks "
          "and over each row's valid slots (18432 B each); ÷ minimum: MFMAs over 64·G/16 per (row, valid slot); "
          "model: max(HBM / "
          "8 TB/s, MFMA / 2.5 PFLOP/s, LDS / 78.6 TB/s), a model, not a measurement\n")
    print(HEADER)
    prefill = [(1, 16, 64, 4096), (1, 16, 256, 8192), (1, 8, 128, 6144)]
    if args.quick:
        prefill = prefill[:1]
    notes = []
    lds_per_mfma = []                   # the union kernel's LDS bytes per MFMA, for the formula
    for hkv, G, q_len, kv_len in prefill:
        p = prefill_case(rng, hkv, G, q_len, kv_len, args.sigma, args.rho, "float16")
        keys = valid_keys(p.topk, p.req, p.pos, p.block_table, p.cache.shape[0])
        ref = expected_counts(keys, p.block_table, p.pos, G)
        q = np.asarray(p.q)
        case = f"prefill {q_len} @ {kv_len}, Hkv {hkv}, G {G}"
        want = np.asarray(m3.sparse_prefill(jnp.asarray(q), p.cache, p.topk, p.block_table, p.req, p.pos,
                                            p.k_scale, p.v_scale, scale=scale), np.float64)
        g8 = "g8_" if G == 8 else ""
        # today's per-token design: the per-token kernel body on the same rows (one request's
        # consecutive rows are a decode with dql = q_len), which the prefill kernel shared until now
        seq = np.array([kv_len], np.int32)
        got_pt, c_pt, s_pt = count(lambda: h.sparse_decode(q.astype(jnp.bfloat16), p.cache, p.topk, p.block_table,
                                                           seq, p.k_scale, p.v_scale, 0, scale, q_len, split=False,
                                                           group=G), {"kv_cache": p.cache})
        print(row(f"sparse_decode_{g8}bf16 (per-token, the prefill's design until 2026-12-02)", case, c_pt, ref, s_pt),
              flush=True)
        got, c, s = count(lambda: h.sparse_prefill(q, p.cache, p.topk, p.block_table, p.req, p.pos, p.k_scale,
                                                   p.v_scale, 0, scale, group=G), {"kv_cache": p.cache})
        print(row(f"sparse_prefill_{g8}f16 (union tiles)", case, c, ref, s), flush=True)
        cos = float(np.asarray(got, np.float64).ravel() @ want.ravel()
                    / (np.linalg.norm(got.astype(np.float64)) * np.linalg.norm(want) + 1e-300))
        if G == 16:                     # the full-size formula below is G = 16's
            lds_per_mfma.append((c.lds_read + c.lds_written) / c.mfma)
        assert c.read["kv_cache"] == ref["union"], "union-tile K/V bytes differ from the formula"
        assert c.mfma == ref["union_mfma"], "union-tile MFMAs differ from the formula"
        assert c_pt.read["kv_cache"] == ref["per_token"], "per-token K/V bytes differ from the formula"
        notes.append(f"{case}: adjacent tokens share {adjacent_overlap(p.topk):.1f} of 16 blocks, "
                     f"a {16 * (16 // G)}-token tile's union {ref['mean_union']:.1f} blocks; context {ref['context'] / 1e6:.2f} MB; "
                     f"union output vs CPU cosine {cos:.6f}")
    if not args.quick:
        seq_lens = [8192] * 8
        p = decode_problem(rng, 1, 16, seq_lens, 4, dtype=jnp.bfloat16, extra_pages=1)
        p.topk = shared_topk(rng, 1, 4, [n // 128 for n in seq_lens])
        keys = valid_keys(p.topk, p.req, p.pos, p.block_table, p.cache.shape[0])
        ref = expected_counts(keys, p.block_table, p.pos)
        q = np.asarray(p.q)
        case = "decode T 32 (8 × dql 4), 12 of 16 shared, @ 8192"
        args_ = (q, p.cache, p.topk, p.block_table, p.seq_lens, p.k_scale, p.v_scale, 0, scale, 4)
        _, c_pt, s_pt = count(lambda: h.sparse_decode(*args_, split=False), {"kv_cache": p.cache})
        print(row("sparse_decode_bf16 (per-token, dql > 1's kernel until 2026-12-02)", case, c_pt, ref, s_pt),
              flush=True)
        _, c, s = count(lambda: h.sparse_decode(*args_), {"kv_cache": p.cache})
        print(row("sparse_decode_union_bf16", case, c, ref, s), flush=True)
        notes.append(f"{case}: union ÷ per-token K/V bytes {c.read['kv_cache'] / c_pt.read['kv_cache']:.3f}")
    print()
    for n in notes:
        print("-", n)
    print()
    print(full_size(np.random.default_rng(11), args.sigma, args.rho, max(lds_per_mfma)))
    return 0


def full_size(rng, sigma, rho, lds_per_mfma, hkv=4, q_len=2048, kv_len=8192, G=16):
    """The formulas (checked against the emulated counts above) at M3's 2048-token chunk at 8192;
    the union kernel's LDS bytes scale with its MFMAs at the largest ratio the emulated cases had."""
    pos = np.arange(kv_len - q_len, kv_len)
    M = kv_len // 128
    topk = correlated_topk(rng, hkv, pos, M, sigma, rho)
    table = np.arange(M, dtype=np.int32)[None]
    keys = valid_keys(topk, np.zeros(q_len, np.int32), pos, table, M)
    ref = expected_counts(keys, table, pos, G)
    q_bytes = q_len * hkv * G * 128 * 2
    lines = [f"Formula at prefill {q_len} @ {kv_len}, Hkv {hkv}, G {G} (σ {sigma}, ρ {rho}; adjacent tokens share "
             f"{adjacent_overlap(topk):.1f} of 16, a tile's union {ref['mean_union']:.1f} blocks):",
             "| design | K/V bytes | ÷ per-token sum | MFMA FLOPs | model µs (HBM / MFMA / LDS) |", "|---|---|---|---|---|"]
    for name, kv, mfma, lds in (("per-token (the previous prefill)", ref["per_token"], ref["min_mfma"], None),
                                ("union tiles of 16", ref["union"], ref["union_mfma"], lds_per_mfma),
                                ("context once (floor)", ref["context"], ref["min_mfma"], None)):
        flop = mfma * 2 * 16 * 16 * 32
        est, parts = model_us(kv + 2 * q_bytes, flop, mfma * (lds or 0))
        lds_text = f"{parts['lds']:.0f}" if lds else "—"
        lines.append(f"| {name} | {kv / 1e9:.3f} GB | {kv / ref['per_token']:.3f} | {flop / 1e9:.0f} G | "
                     f"{parts['hbm']:.0f} / {parts['mfma']:.0f} / {lds_text} |")
    floor = ref["min_mfma"] * 2 * 16 * 16 * 32 / MFMA_PEAK * 1e6
    lines.append(f"Compute floor (the selections' MFMAs at 2.5 PFLOP/s): {floor:.0f} µs. Union kernel's LDS: "
                 f"{lds_per_mfma:.0f} bytes per MFMA (the emulated G = 16 cases' largest).")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
