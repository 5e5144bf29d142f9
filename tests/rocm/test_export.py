"""Static checks of the gfx950 FlyDSL kernels: what export.py writes, the ISA each kernel
is meant to use, and its resources. CPU-only: the code objects are compiled, never run."""

from __future__ import annotations

import re

import pytest

from ffi.flydsl import elf_tools

# Instructions each kernel family must contain (the reason is in each kernel's docstring).
EXPECTED = {
    "pack_kv_pages": [
        "buffer_load_dwordx4",          # 16-byte input loads
        "v_div_fixup_f32",              # IEEE fp32 division (SPEC §2.2: 1/g, x·r / sf)
        "v_rndne_f32",                  # E4M3 subnormal rounding, ties to even
        "global_store_dword",           # 64-bit addressed page writes (SPEC §3.3)
    ],
    "sparse_decode": [
        "v_mfma_f32_16x16x32_bf16",     # QK and PV in bf16 (SPEC §5.5)
        "v_cvt_scalef32_pk_f32_fp4",    # E2M1 -> fp32, unit scale
        "v_cvt_pk_f32_fp8",             # E4M3 block scales -> fp32, exact
        "v_pk_mul_f32",                 # the exact block-scale multiply
        "v_cvt_pk_bf16_f32",            # exact products -> bf16 MFMA operands
        "buffer_load_dwordx4",          # 16-byte K/V/Q loads
        "v_exp_f32",                    # fast exp2, no device-library call
        "ds_read_b64",                  # V^T operands from LDS
    ],
    "sparse_prefill": [                 # union tiles (union_tile.py)
        "v_mfma_f32_16x16x32_f16",      # QK and PV in fp16 (SPEC §5.5)
        "v_cvt_scalef32_pk_f16_fp4",    # E2M1 -> fp16, unit scale
        "v_cvt_pk_f32_fp8",
        "v_pk_mul_f16",                 # the exact block-scale multiply in fp16
        "buffer_load_dwordx4",
        "v_exp_f32",
        "ds_read2_b64",                 # V^T operands from LDS (the two halves of a step in one)
        "ds_read_b128",                 # K and Q operands from LDS
        "s_barrier",                    # the union and each staged block are shared by 8 waves
        "s_bcnt1_i32_b32",              # how often a row selected a union entry (ballot + scalar popcount)
    ],
    "query_token_positions": ["buffer_load_dword", "buffer_store_dword"],
    "select_blocks": [
        "v_fmac_f32",                   # the fp32 dot, one fused multiply-add per dimension (SPEC §8 step 3)
        "buffer_load_dwordx4",          # 16-byte key and q loads
        "buffer_store_dword",           # half-block scores, then the ids
        "v_readfirstlane_b32",          # uniform run / row / page values in SGPRs
        "ds_write_b128",                # the half-block's keys staged by the 4 waves ...
        "s_barrier",
        "ds_read_b128",                 # ... and read back whole by each
    ],
    "route_experts": [
        "v_readfirstlane_b32",          # each round's pick, uniform in the wave
        "v_div_fixup_f32",              # IEEE division of the renormalized weights (SPEC §10)
        "s_barrier",                    # the grouping's chunks are shared through LDS
        "ds_read_b128",                 # a chunk's buckets, 4 at a time
    ],
    "grouped_matmul": [
        "v_mfma_f32_16x16x32_bf16",     # bf16 products, fp32 sums (SPEC §9)
        "buffer_load_dwordx4",          # 16-byte row loads
        "v_readfirstlane_b32",          # the walk over group_sizes to the slot's tile, uniform
        "ds_write_b128",                # split K: waves 1-3 park their sums in LDS ...
        "s_barrier",
        "ds_read_b128",                 # ... and wave 0 adds them in part order
    ],
}
EXPECTED["sparse_decode_split"] = EXPECTED["sparse_decode"]
EXPECTED["full_attention"] = EXPECTED["sparse_decode"]     # the per-token decode body over parts of 16 blocks
EXPECTED["sparse_decode_union"] = [m for m in EXPECTED["sparse_decode"] if m != "ds_read_b64"] + \
    ["ds_read2_b64", "ds_read_b128", "s_barrier", "s_bcnt1_i32_b32"]
FORBIDDEN = {
    "sparse_decode": ["v_mfma_f32_16x16x32_f16"],
    "sparse_decode_split": ["v_mfma_f32_16x16x32_f16"],
    "sparse_decode_union": ["v_mfma_f32_16x16x32_f16"],
    "sparse_prefill": ["v_mfma_f32_16x16x32_bf16"],
    "full_attention": ["v_mfma_f32_16x16x32_f16"],
    # fp32 products of exactly widened operands: no bf16/fp16 MFMA (LDS stages whole 16-byte chunks)
    "select_blocks": ["v_mfma_f32_16x16x32_bf16", "v_mfma_f32_16x16x32_f16", "ds_write_b32", "ds_read_b32"],
    # operands straight from memory into registers (LDS only joins the k-parts' sums)
    "grouped_matmul": ["v_mfma_f32_16x16x32_f16", "ds_write_b32", "ds_read_b32"],
}
# The weights' widening per format (grouped_matmul.py weight_operand): E2M1 by the unit-scale
# conversion, E4M3 (MXFP8 data, NVFP4 scales) by v_cvt_pk_f32_fp8, then fp32 -> bf16.
GROUPED_WIDENING = {"bf16": [], "mxfp8": ["v_cvt_pk_f32_fp8", "v_cvt_pk_bf16_f32"],
                    "mxfp4": ["v_cvt_scalef32_pk_f32_fp4", "v_cvt_pk_bf16_f32"],
                    "nvfp4": ["v_cvt_scalef32_pk_f32_fp4", "v_cvt_pk_f32_fp8", "v_cvt_pk_bf16_f32"]}
# 4 selected blocks per wave, each 8 QK tiles × 4 MFMAs + 4 PV steps × 8 d-tiles.
ATTENTION_MFMAS = 4 * (8 * 4 + 4 * 8)
# Union tiles (per part of a block: 2 parts for G = 16, 4 for G = 8): QK tiles × 4 MFMAs × 2 column
# groups, PV steps × 8 d-tiles × 2 column groups in the shared-operand form, and the per-row-masked
# form once per row of a column group (1 row for G = 16, 2 for G = 8).
UNION_MFMAS = {16: 2 * (4 * 4 * 2 + 2 * 8 * 2 + 2 * 8 * 2 * 1), 8: 4 * (2 * 4 * 2 + 1 * 8 * 2 + 1 * 8 * 2 * 2)}


def family(name: str) -> str:
    if name.startswith("select_blocks_"):      # select_blocks_<q dtype>_<key dtype>
        return "select_blocks"
    if name.startswith("grouped_matmul_"):     # grouped_matmul_<weights>_<out dtype>
        return "grouped_matmul"
    return re.sub(r"(_g8)?_(bf16|f16|f32)$", "", name)


def test_every_kernel_exported(exported):
    assert {"pack_kv_pages_bf16", "sparse_decode_bf16", "sparse_prefill_f16",
            "query_token_positions"} <= set(exported.names)
    for name in exported.names:
        for ext in (".o", ".h", ".json"):
            assert (exported.out / f"{name}{ext}").is_file(), f"{name}{ext} missing"
        header = (exported.out / f"{name}.h").read_text()
        assert f"{name}__module_load" in header and f"{name}_call(" in header


def test_metadata_says_gfx950(exported):
    for name in exported.names:
        meta = exported[name].meta
        assert meta["arch"] == "gfx950", name
        assert meta["m3sparse"]["e_flags"] == elf_tools.GFX950_E_FLAGS, name
        assert meta["symbol"] == name


def test_code_object_elf_flags_gfx950(exported):
    for name in exported.names:
        co = exported[name].code_object
        assert co[:4] == b"\x7fELF", name
        flags = elf_tools.elf_e_flags(co)
        assert flags & elf_tools.EF_AMDGPU_MACH_MASK == elf_tools.EF_AMDGPU_MACH_GFX950, (name, hex(flags))
        assert flags == elf_tools.GFX950_E_FLAGS, (name, hex(flags))
        assert "amdgcn-amd-amdhsa--gfx950" in exported[name].notes or "gfx950" in exported[name].notes


@pytest.mark.parametrize("fam", sorted(EXPECTED))
def test_expected_instructions(exported, fam):
    names = [n for n in exported.names if family(n) == fam]
    assert names, f"no exported kernel of family {fam}"
    for name in names:
        k = exported[name]
        for mnemonic in EXPECTED[fam]:
            assert k.count(mnemonic) > 0, f"{name}: no {mnemonic}"
        for mnemonic in FORBIDDEN.get(fam, []):
            assert k.count(mnemonic) == 0, f"{name}: unexpected {mnemonic}"


def test_attention_mfma_counts(exported):
    for name in exported.names:
        fam = family(name)
        if fam == "sparse_decode":
            assert exported[name].count("v_mfma_f32_16x16x32_bf16") == ATTENTION_MFMAS, name
        union = UNION_MFMAS[8 if "_g8_" in name else 16]
        if fam == "sparse_prefill":
            assert exported[name].count("v_mfma_f32_16x16x32_f16") == union, name
        if fam == "sparse_decode_union":
            assert exported[name].count("v_mfma_f32_16x16x32_bf16") == union, name
        if fam == "sparse_decode_split":   # one slot per wave; the merge kernel has none
            assert exported[name].count("v_mfma_f32_16x16x32_bf16") == ATTENTION_MFMAS // 4, name
        if fam == "full_attention":        # a part: 4 blocks per wave, as the decode; the merge has none
            assert exported[name].count("v_mfma_f32_16x16x32_bf16") == ATTENTION_MFMAS, name
            assert sorted(exported[name].resources) == ["full_attention_merge_kernel_1",
                                                        "full_attention_part_kernel_0"], name


def test_grouped_matmul_step(exported):
    """Each variant: K steps of 4 MFMAs (a wave's 4 weight tiles against its 16 rows; LLVM
    unrolls the bf16 loop 4 times beside its remainder), the widening its weight format needs,
    and no fp4 conversion where there is no FP4."""
    names = [n for n in exported.names if family(n) == "grouped_matmul"]
    assert len(names) == 8, names
    for name in names:
        k = exported[name]
        fmt = name.split("_")[2]
        mfmas = k.count("v_mfma_f32_16x16x32_bf16")
        assert mfmas >= 4 and mfmas % 4 == 0, (name, mfmas)
        for mnemonic in GROUPED_WIDENING[fmt]:
            assert k.count(mnemonic) > 0, f"{name}: no {mnemonic}"
        if fmt in ("bf16", "mxfp8"):
            assert k.count("v_cvt_scalef32_pk_f32_fp4") == 0, name


def longest_load_run(asm: str) -> int:
    """The most buffer loads issued between two MFMAs (waits and ALU work in between allowed)."""
    best = run = 0
    for line in asm.splitlines():
        if "buffer_load_" in line:
            run += 1
            best = max(best, run)
        elif "v_mfma_" in line:
            run = 0
    return best


def test_grouped_matmul_loads_go_out_together(exported):
    """The main loop issues 4 k-steps' operands (a row load and 4 weight loads each: 20 loads,
    plus a scale byte per weight load for the block-scaled formats) before its first MFMA, so a
    wave has them in flight at once; a load, its wait and its MFMA in turn leave one in flight —
    what LLVM's scheduler made of the loop before its sched_barrier (at most 6 in a run)."""
    for name in (n for n in exported.names if family(n) == "grouped_matmul"):
        per_step = 5 if name.split("_")[2] == "bf16" else 9
        assert longest_load_run(exported[name].asm) >= 4 * per_step, name


def test_select_blocks_dot_is_one_fma_chain(exported):
    """SPEC §8 step 3 on gfx950: each key's dot product is 128 fp32 fused multiply-adds (d = 0 ..
    127 from 0; the first is v_fma_f32 with a 0 addend) in each of the score kernel's two run
    paths (a run shared by the workgroup's 4 waves, a short run on one wave); E4M3 keys are
    widened with 64 v_cvt_pk_f32_fp8 a path (2 per key dword), bf16 keys by shifts."""
    names = [n for n in exported.names if family(n) == "select_blocks"]
    assert sorted(names) == ["select_blocks_bf16_bf16", "select_blocks_bf16_fp8", "select_blocks_f32_bf16",
                             "select_blocks_f32_fp8"]
    for name in names:
        k = exported[name]
        assert sorted(k.resources) == ["select_blocks_scores_0", "select_blocks_topk_1"], name
        assert k.count("v_fmac_f32") + k.count("v_fma_f32") == 2 * 128, name
        assert k.count("v_cvt_pk_f32_fp8") == (2 * 64 if name.endswith("_fp8") else 0), name
        # 16-byte loads: a lane's whole key (one-wave path: 256 B bf16 / 128 B E4M3), a quarter of
        # it (shared path, staged in LDS), and a q row per path (256 B bf16 / 512 B f32)
        key_bytes = 256 if name.endswith("_bf16") else 128
        q_loads = 32 if name.startswith("select_blocks_f32") else 16
        assert k.count("buffer_load_dwordx4") == key_bytes // 16 * 5 // 4 + 2 * q_loads, name
        assert k.count("ds_write_b128") == key_bytes // 16 // 4, name
        assert k.count("ds_read_b128") == key_bytes // 16, name


def test_pack_divisions_are_ieee(exported):
    """Every fp32 division of SPEC §2.2 stays a division (no reciprocal rewrite): per GPU kernel
    1/g, a/6 and the 8 element divisions x·r/sf = 10 v_div_fixup_f32."""
    for name in exported.names:
        if family(name) != "pack_kv_pages":
            continue
        k = exported[name]
        kernels = len(k.resources)
        assert kernels == 2, name  # K and V launches
        assert k.count("v_div_fixup_f32") == 10 * kernels, name
        assert k.count("v_rcp_iflag_f32") == 0


def test_no_device_library_calls(exported):
    for name in exported.names:
        k = exported[name]
        assert "__ocml_" not in k.asm and "__ockl_" not in k.asm, name
        assert b"__ocml_" not in k.code_object and b"__ockl_" not in k.code_object, name
        assert k.count("s_swappc_b64") == 0 and k.count("s_setpc_b64") == 0, f"{name}: has a call"


def test_ieee_denormals_for_bit_exact_pack(exported):
    """SPEC §2.2 is fp32 with denormals; the pack kernel's descriptors must not flush them."""
    for name in exported.names:
        if family(name) == "pack_kv_pages":
            kd = exported[name].descriptors
            modes = re.findall(r"\.amdhsa_float_denorm_mode_32 (\d)", kd)
            assert modes and all(m == "3" for m in modes), (name, modes)


def test_resources(exported):
    for name in exported.names:
        for gpu_kernel, res in exported[name].resources.items():
            where = f"{name}/{gpu_kernel}"
            assert res["vgpr_spills"] == 0 and res["sgpr_spills"] == 0, where
            assert res["scratch_bytes"] == 0, where
            assert res["wavefront_size"] == 64, where
            waves = elf_tools.waves_per_simd(res["vgpr"], res["agpr"], res["lds_bytes"],
                                             res["max_flat_workgroup_size"])
            if family(name) in ("sparse_decode", "sparse_decode_split", "full_attention"):
                assert waves >= 2, f"{where}: {res} allows {waves} waves/SIMD"
                assert res["lds_bytes"] <= 80 * 1024, where
            elif family(name) == "select_blocks":
                # the score kernel holds its key as 128 fp32 registers, the half-block's 64 keys
                # staged in LDS (padded rows); the top-k kernel no LDS
                assert waves >= 3, f"{where}: {res} allows {waves} waves/SIMD"
                staged = 64 * (272 if name.endswith("_bf16") else 144)      # bf16 / E4M3 keys
                assert res["lds_bytes"] == (staged if gpu_kernel.startswith("select_blocks_scores") else 0), where
            elif family(name) == "grouped_matmul":
                # registers hold 4 k-steps' loads in flight (MXFP8's widening: 140 VGPRs); LDS
                # holds 3 waves' k-part sums (4 × 4 fp32 a lane)
                assert waves >= 3, f"{where}: {res} allows {waves} waves/SIMD"
                assert res["lds_bytes"] == 3 * 64 * 16 * 4, where
            elif family(name) in ("sparse_prefill", "sparse_decode_union"):
                # union tiles: one 8-wave workgroup per CU (LDS holds the staged block and the
                # tile's Q), 2 waves per SIMD, as its 256-VGPR budget allows
                assert waves >= 2, f"{where}: {res} allows {waves} waves/SIMD"
                assert res["lds_bytes"] <= elf_tools.GFX950_LDS_PER_CU, where
            else:
                assert waves >= 4, where


def test_export_is_deterministic(exported, tmp_path):
    """Re-exporting one kernel gives the same bytes (FlyDSL's AOT output is reproducible)."""
    import subprocess
    import sys

    from tools.rocm.toolchain import EXPORT

    subprocess.run([sys.executable, str(EXPORT), "--arch", "gfx950", "--out", str(tmp_path),
                    "--only", "query_token_positions"], check=True, capture_output=True)
    assert (tmp_path / "query_token_positions.o").read_bytes() == \
        (exported.out / "query_token_positions.o").read_bytes()
