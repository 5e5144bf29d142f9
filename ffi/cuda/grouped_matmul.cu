// grouped_matmul for sm_90 (SPEC §9): out[i] = lhs[i] · rhs[g(i)]ᵀ in fp32, the rows of lhs
// grouped by consecutive group_sizes — the routed experts of a mixture of experts, read once each.
//
//   1. Grid (N tiles of 128 columns) × (G + 1 groups). A CTA prefix-sums the group sizes (each
//      clamped at 0, the running end clamped at M) to find its group's rows [start, end); the
//      extra group G writes zeros to the rows [Σ, M) no group covers. An empty group's CTAs exit
//      before reading anything: the weights of experts no token routes to are never read.
//   2. The CTA walks its rows in tiles of BM (16 for the decode shape, 128 when groups are large)
//      and, per tile, streams K in steps of 64 through a ring of kStages shared-memory stages
//      (16-byte cp.async; rows past the group, columns past N and k past K are zero-filled, so
//      nothing outside the operands is read). Chunk c of row r sits at chunk c ^ (r & 7) of the
//      row: ldmatrix reads 8 rows × 16 B without bank conflicts.
//   3. Four warps split the 128 columns (32 each: four n8 tiles); with BM = 128 two more split
//      the rows. Every output element is one chain of m16n8k16 bf16 mma in k order with an fp32
//      accumulator: a row's bits depend on its own lhs row and its group's weights only, never
//      on the other rows, the group sizes or BM (batch-invariant; tests/cuda checks it).
//   4. The accumulators are stored (fp32) for the tile's rows inside the group and columns < N.
// No workspace, no host reads of device data: CUDA-graph safe.
#include <cuda_bf16.h>

#include <cstdint>

#include "m3sparse_cuda.h"

namespace m3sparse {
namespace cuda {
namespace {

constexpr int kBN = 128;          // columns per CTA (4 warps × 32)
constexpr int kBK = 64;           // k per stage (8 chunks of 16 B per row)
constexpr int kWarpsN = 4;

__device__ __forceinline__ void cp_async16_zfill(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int n = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled, nothing is read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(gmem_src), "r"(n));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void wait_groups() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* smem) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

__device__ __forceinline__ void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte offset of 16-byte chunk c of row r in a [rows][64] bf16 stage (swizzled, step 2).
__device__ __forceinline__ int swz(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

// The clamped rows [start, end) of group g and the covered total (step 1).
__device__ void group_rows(const int32_t* sizes, int G, int64_t M, int g, int64_t* start,
                           int64_t* end) {
  __shared__ int64_t part[32];
  __shared__ int64_t own;
  int64_t s = 0;
  for (int j = threadIdx.x; j < G; j += blockDim.x) {
    const int64_t v = sizes[j] > 0 ? sizes[j] : 0;
    if (j < g) s += v;
    if (j == g) own = v;
  }
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
  __syncthreads();
  int64_t before = 0;
  for (int w = 0; w < int(blockDim.x >> 5); ++w) before += part[w];
  const int64_t size = g < G ? own : M;   // group G: everything after the covered rows
  *start = before < M ? before : M;
  *end = *start + size < M ? *start + size : M;
}

template <int kWarpsM, int kMTiles, int kStages>
__global__ void __launch_bounds__(32 * kWarpsM * kWarpsN, kWarpsM == 1 ? 4 : 2)
grouped_matmul_kernel(GroupedMatmulParams p) {
  constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  constexpr int kBM = 16 * kMTiles * kWarpsM;
  constexpr int kStageA = kBM * kBK * 2, kStageB = kBN * kBK * 2;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* sa = smem;
  uint8_t* sb = smem + kStages * kStageA;

  const int g = blockIdx.y;
  const int64_t n0 = int64_t(blockIdx.x) * kBN;
  int64_t start, end;
  group_rows(p.group_sizes, p.num_groups, p.m, g, &start, &end);
  if (start >= end) return;
  float* out = p.out;
  if (g == p.num_groups) {  // rows no group covers: zeros (SPEC §9)
    for (int64_t i = start; i < end; ++i)
      for (int64_t n = n0 + threadIdx.x; n < n0 + kBN && n < p.n; n += kThreads)
        out[i * p.n + n] = 0.0f;
    return;
  }

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wn = warp % kWarpsN, wm = warp / kWarpsN;
  const __nv_bfloat16* lhs = p.lhs;
  const __nv_bfloat16* rhs = p.rhs + int64_t(g) * p.n * p.k;
  const int ksteps = int((p.k + kBK - 1) / kBK);

  for (int64_t m0 = start; m0 < end; m0 += kBM) {
    // Enqueues k-step ks into stage ks % kStages (an empty commit past the end keeps counts).
    auto load = [&](int ks) {
      if (ks < ksteps) {
        uint8_t* a = sa + (ks % kStages) * kStageA;
        uint8_t* b = sb + (ks % kStages) * kStageB;
        const int64_t k0 = int64_t(ks) * kBK;
        for (int i = tid; i < kBM * 8; i += kThreads) {
          const int r = i >> 3, c = i & 7;
          const int64_t row = m0 + r, kk = k0 + 8 * c;
          const bool ok = row < end && kk < p.k;
          cp_async16_zfill(a + swz(r, c), ok ? lhs + row * p.k + kk : lhs, ok);
        }
        for (int i = tid; i < kBN * 8; i += kThreads) {
          const int r = i >> 3, c = i & 7;
          const int64_t col = n0 + r, kk = k0 + 8 * c;
          const bool ok = col < p.n && kk < p.k;
          cp_async16_zfill(b + swz(r, c), ok ? rhs + col * p.k + kk : rhs, ok);
        }
      }
      commit();
    };

    float acc[kMTiles][4][4] = {};
    for (int s = 0; s < kStages - 1; ++s) load(s);
    for (int ks = 0; ks < ksteps; ++ks) {
      wait_groups<kStages - 2>();
      __syncthreads();                  // stage ks visible; stage ks - 1 free for reuse
      load(ks + kStages - 1);
      const uint8_t* a = sa + (ks % kStages) * kStageA;
      const uint8_t* b = sb + (ks % kStages) * kStageB;
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        uint32_t bf[4][2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {   // n8 tiles 2h, 2h + 1 of this warp's 32 columns
          const int r = wn * 32 + h * 16 + (lane & 7) + ((lane >> 4) << 3);
          uint32_t x[4];
          ldmatrix_x4(x, b + swz(r, 2 * kk + ((lane >> 3) & 1)));
          bf[2 * h][0] = x[0], bf[2 * h][1] = x[1], bf[2 * h + 1][0] = x[2],
          bf[2 * h + 1][1] = x[3];
        }
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          uint32_t af[4];
          const int r = (wm * kMTiles + mt) * 16 + (lane & 15);
          ldmatrix_x4(af, a + swz(r, 2 * kk + (lane >> 4)));
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) mma(acc[mt][nt], af, bf[nt][0], bf[nt][1]);
        }
      }
    }
    wait_groups<0>();
    __syncthreads();                    // the ring is free before the next tile's prologue

#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t row = m0 + (wm * kMTiles + mt) * 16 + (lane >> 2) + 8 * half;
        if (row >= end) continue;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int64_t col = n0 + wn * 32 + nt * 8 + 2 * (lane & 3);
          float* o = out + row * p.n + col;
          const float v0 = acc[mt][nt][2 * half], v1 = acc[mt][nt][2 * half + 1];
          if (col + 1 < p.n && (p.n & 1) == 0) {
            *reinterpret_cast<float2*>(o) = make_float2(v0, v1);
          } else {
            if (col < p.n) o[0] = v0;
            if (col + 1 < p.n) o[1] = v1;
          }
        }
      }
    }
  }
}

template <int kWarpsM, int kMTiles, int kStages>
cudaError_t launch(const GroupedMatmulParams& p, cudaStream_t stream) {
  constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  constexpr int kBM = 16 * kMTiles * kWarpsM;
  constexpr size_t kSmem = size_t(kStages) * (kBM + kBN) * kBK * 2;
  auto kernel = grouped_matmul_kernel<kWarpsM, kMTiles, kStages>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(kSmem));
  if (e != cudaSuccess) return e;
  const dim3 grid(unsigned((p.n + kBN - 1) / kBN), unsigned(p.num_groups + 1));
  kernel<<<grid, kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

int grouped_matmul_block_m(const GroupedMatmulParams& p) {
  if (p.block_m == 16 || p.block_m == 128) return p.block_m;
  // Groups of a few rows (decode): 16-row tiles, no mma on padding rows; larger groups
  // (prefill): 128-row tiles read each weight tile once per 128 rows.
  return p.m >= 32 * int64_t(p.num_groups) ? 128 : 16;
}

const char* grouped_matmul_unsupported(int64_t k) {
  return k % 8 == 0 ? "" : "the CUDA grouped_matmul kernel needs K (the contracted dim) % 8 == 0";
}

cudaError_t launch_grouped_matmul(const GroupedMatmulParams& p, cudaStream_t stream) {
  if (p.k % 8 != 0 || p.m < 0 || p.n < 1 || p.num_groups < 0 || p.num_groups > 65534)
    return cudaErrorInvalidValue;
  if (p.m == 0) return cudaSuccess;
  if (grouped_matmul_block_m(p) == 128) return launch<2, 4, 3>(p, stream);
  return launch<1, 1, 4>(p, stream);
}

}  // namespace cuda
}  // namespace m3sparse
