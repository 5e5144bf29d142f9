// The FlyDSL gfx950 kernels as the HIP handlers see them: one entry per exported kernel
// (ffi/flydsl/export.py writes NAME.o / NAME.h), and the per-device loading of its module.
#pragma once

#include <hip/hip_runtime_api.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

extern "C" {
#include "pack_kv_pages_bf16.h"
#include "pack_kv_pages_f16.h"
#include "pack_kv_pages_f32.h"
#include "query_token_positions.h"
#include "sparse_decode_bf16.h"
#include "sparse_decode_f16.h"
#include "sparse_decode_f32.h"
#include "sparse_decode_split_bf16.h"
#include "sparse_decode_split_f16.h"
#include "sparse_decode_split_f32.h"
#include "sparse_decode_union_bf16.h"
#include "sparse_decode_union_f16.h"
#include "sparse_decode_union_f32.h"
#include "sparse_prefill_bf16.h"
#include "sparse_prefill_f16.h"
#include "sparse_prefill_f32.h"
#include "sparse_decode_g8_bf16.h"
#include "sparse_decode_g8_f16.h"
#include "sparse_decode_g8_f32.h"
#include "sparse_decode_split_g8_bf16.h"
#include "sparse_decode_split_g8_f16.h"
#include "sparse_decode_split_g8_f32.h"
#include "sparse_decode_union_g8_bf16.h"
#include "sparse_decode_union_g8_f16.h"
#include "sparse_decode_union_g8_f32.h"
#include "sparse_prefill_g8_bf16.h"
#include "sparse_prefill_g8_f16.h"
#include "sparse_prefill_g8_f32.h"
#include "full_attention_bf16.h"
#include "full_attention_f16.h"
#include "full_attention_f32.h"
#include "full_attention_g8_bf16.h"
#include "full_attention_g8_f16.h"
#include "full_attention_g8_f32.h"
#include "select_blocks_bf16_bf16.h"
#include "select_blocks_bf16_fp8.h"
#include "select_blocks_f32_bf16.h"
#include "select_blocks_f32_fp8.h"
#include "route_experts.h"
#include "grouped_matmul_bf16_f32.h"
#include "grouped_matmul_bf16_bf16.h"
#include "grouped_matmul_mxfp8_f32.h"
#include "grouped_matmul_mxfp8_bf16.h"
#include "grouped_matmul_mxfp4_f32.h"
#include "grouped_matmul_mxfp4_bf16.h"
#include "grouped_matmul_nvfp4_f32.h"
#include "grouped_matmul_nvfp4_bf16.h"
}

namespace m3sparse::rocm {

namespace ffi = xla::ffi;

// The lifecycle entry points FlyDSL's export_to_c gives every kernel module.
struct KernelModule {
  const char* name;
  int32_t (*init)();
  int32_t (*load)(int32_t device);
};

#define M3SPARSE_KERNEL_MODULE(NAME) \
  KernelModule { #NAME, NAME##__module_init, NAME##__module_load }

// Checks (once per device) that `device` is a gfx950 and loads `kernel`'s code object on it
// (once per kernel and device), leaving `device` current on the calling thread. `target` names
// the FFI target in every error message.
ffi::Error prepare_launch(const char* target, const KernelModule& kernel, int32_t device);

// Turns a FlyDSL entry point's status (0, -1 not initialized, -2 not loaded, else a hipError_t)
// plus any pending HIP error into an ffi::Error naming the target and the kernel.
ffi::Error launch_status(const char* target, const KernelModule& kernel, int32_t status);

}  // namespace m3sparse::rocm
