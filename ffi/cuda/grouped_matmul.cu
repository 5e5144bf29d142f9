// grouped_matmul for sm_90 (SPEC §9): out[i] = lhs[i] · rhs[g(i)]ᵀ in fp32, the rows of lhs
// grouped by consecutive group_sizes — the routed experts of a mixture of experts, read once each.
//
//   1. Grid (column tiles of BN) × (min(G, M) + 1). CTA row y finds the y-th non-empty group
//      (sizes clamped at 0, the running end clamped at M; one warp scans them) and its rows
//      [start, end); the last CTA row writes zeros to the rows [Σ, M) no group covers. The
//      weights of experts no token routes to are never read, and a decode batch's few groups
//      launch few CTAs.
//   2. The CTA walks its rows in tiles of BM (16 for decode-sized groups; 64 when groups are
//      large, so each weight tile is read once per 64 rows) and, per tile, streams K in
//      steps of 64 through a ring of shared-memory stages (16-byte cp.async; rows past the
//      group, columns past N and k past K are zero-filled, so nothing outside the operands is
//      read). Chunk c of row r sits at chunk c ^ (r & 7) of the row: ldmatrix reads 8 rows ×
//      16 B without bank conflicts.
//   3. Each warp owns 32 columns (four n8 tiles) and the BM rows; BN = 32, 64 or 128 (1, 2 or 4
//      warps: narrower tiles give a decode batch's few groups more CTAs). Every output element is one chain of m16n8k16 bf16 mma in k order
//      with an fp32 accumulator: a row's bits depend on its own lhs row and its group's weights
//      only, never on the other rows, the group sizes or the tile shape (batch-invariant;
//      tests/cuda checks it).
//   4. The accumulators are stored (fp32) for the tile's rows inside the group and columns < N.
// No workspace, no host reads of device data: CUDA-graph safe.
#include <cuda_bf16.h>

#include <cstdint>

#include "m3sparse_cuda.h"

namespace m3sparse {
namespace cuda {
namespace {

constexpr int kBK = 64;           // k per stage (8 chunks of 16 B per row)

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

// Step 1: the rows [start, end) of the y-th non-empty group (sizes clamped at 0, the running end
// at M; *g = its index), or for y == num_groups_grid - 1 the rows [Σ, M) no group covers
// (*g = -1). start >= end: nothing to do. One warp scans the sizes 32 at a time.
__device__ void find_group(const int32_t* sizes, int G, int64_t M, int y, bool tail, int* g,
                           int64_t* start, int64_t* end) {
  __shared__ int s_g;
  __shared__ int64_t s_start, s_end;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int64_t running = 0;
    int count = 0, found = -2;
    int64_t fs = 0, fe = 0;
    for (int base = 0; base < G && found == -2; base += 32) {
      const int j = base + lane;
      const int64_t v = j < G && sizes[j] > 0 ? sizes[j] : 0;
      int64_t incl = v;
      for (int o = 1; o < 32; o <<= 1) {
        const int64_t x = __shfl_up_sync(0xFFFFFFFFu, incl, o);
        if (lane >= o) incl += x;
      }
      const int64_t st = min(running + incl - v, M), en = min(running + incl, M);
      const unsigned live = __ballot_sync(0xFFFFFFFFu, en > st);
      const int n = __popc(live);
      if (!tail && count + n > y) {
        const int want = y - count;  // the want-th set bit of live
        const bool mine = (live >> lane & 1u) && __popc(live & ((1u << lane) - 1u)) == want;
        const unsigned who = __ballot_sync(0xFFFFFFFFu, mine);
        const int src = __ffs(who) - 1;
        found = __shfl_sync(0xFFFFFFFFu, j, src);
        fs = __shfl_sync(0xFFFFFFFFu, st, src);
        fe = __shfl_sync(0xFFFFFFFFu, en, src);
      }
      count += n;
      running += __shfl_sync(0xFFFFFFFFu, incl, 31);
    }
    if (lane == 0) {
      if (tail) {
        s_g = -1, s_start = min(running, M), s_end = M;
      } else {
        s_g = found, s_start = fs, s_end = found >= 0 ? fe : fs;
      }
    }
  }
  __syncthreads();
  *g = s_g, *start = s_start, *end = s_end;
}

template <int kMTiles, int kWarpsN, int kStages>
__global__ void __launch_bounds__(32 * kWarpsN, kMTiles == 1 ? 4 : 2)
grouped_matmul_kernel(GroupedMatmulParams p) {
  constexpr int kThreads = 32 * kWarpsN;
  constexpr int kBN = 32 * kWarpsN;
  constexpr int kBM = 16 * kMTiles;
  constexpr int kStageA = kBM * kBK * 2, kStageB = kBN * kBK * 2;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* sa = smem;
  uint8_t* sb = smem + kStages * kStageA;

  const int64_t n0 = int64_t(blockIdx.x) * kBN;
  int g;
  int64_t start, end;
  find_group(p.group_sizes, p.num_groups, p.m, blockIdx.y, blockIdx.y == gridDim.y - 1, &g,
             &start, &end);
  if (start >= end) return;
  float* out = p.out;
  if (g < 0) {  // rows no group covers: zeros (SPEC §9)
    for (int64_t i = start; i < end; ++i)
      for (int64_t n = n0 + threadIdx.x; n < n0 + kBN && n < p.n; n += kThreads)
        out[i * p.n + n] = 0.0f;
    return;
  }

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wn = warp;
  const __nv_bfloat16* lhs = p.lhs;
  const __nv_bfloat16* rhs = p.rhs + int64_t(g) * p.n * p.k;
  const int ksteps = int((p.k + kBK - 1) / kBK);

  for (int64_t m0 = start; m0 < end; m0 += kBM) {
    // Enqueues k-step ks into stage ks % kStages (an empty commit past the end keeps counts).
    // Each thread copies chunk c = tid % 8 of rows tid / 8 + j · kRowStep of both tiles: the
    // pointers and row checks are made once per tile, a k-step only adds k0 (a single warp
    // issuing per-chunk address arithmetic would otherwise cost more than the copy's latency).
    constexpr int kRowStep = kThreads / 8, kRowsA = kBM / kRowStep, kRowsB = kBN / kRowStep;
    const int c = tid & 7, r0 = tid >> 3;
    const __nv_bfloat16* pa = lhs + (m0 + r0) * p.k + 8 * c;
    const __nv_bfloat16* pb = rhs + (n0 + r0) * p.k + 8 * c;
    const int64_t live_a = end - m0 - r0, live_b = p.n - n0 - r0;   // row j valid: j·step < live
    auto load = [&](int ks) {
      if (ks < ksteps) {
        uint8_t* a = sa + (ks % kStages) * kStageA;
        uint8_t* b = sb + (ks % kStages) * kStageB;
        const int64_t k0 = int64_t(ks) * kBK;
        const bool k_ok = k0 + 8 * c < p.k;
#pragma unroll
        for (int j = 0; j < kRowsA; ++j) {
          const bool ok = k_ok && j * kRowStep < live_a;
          const __nv_bfloat16* src = pa + int64_t(j) * kRowStep * p.k + k0;
          cp_async16_zfill(a + swz(r0 + j * kRowStep, c), ok ? src : lhs, ok);
        }
#pragma unroll
        for (int j = 0; j < kRowsB; ++j) {
          const bool ok = k_ok && j * kRowStep < live_b;
          const __nv_bfloat16* src = pb + int64_t(j) * kRowStep * p.k + k0;
          cp_async16_zfill(b + swz(r0 + j * kRowStep, c), ok ? src : rhs, ok);
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
          const int r = mt * 16 + (lane & 15);
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
        const int64_t row = m0 + mt * 16 + (lane >> 2) + 8 * half;
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

template <int kMTiles, int kWarpsN, int kStages>
cudaError_t launch(const GroupedMatmulParams& p, cudaStream_t stream) {
  constexpr int kThreads = 32 * kWarpsN;
  constexpr int kBM = 16 * kMTiles, kBN = 32 * kWarpsN;
  constexpr size_t kSmem = size_t(kStages) * (kBM + kBN) * kBK * 2;
  auto kernel = grouped_matmul_kernel<kMTiles, kWarpsN, kStages>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(kSmem));
  if (e != cudaSuccess) return e;
  // At most min(G, M) groups are non-empty: one CTA row each, plus the uncovered rows' one.
  const int64_t groups = p.num_groups < p.m ? p.num_groups : p.m;
  const dim3 grid(unsigned((p.n + kBN - 1) / kBN), unsigned(groups + 1));
  kernel<<<grid, kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

// CTAs of a launch with column tiles of bn, if every possible group is non-empty.
int64_t ctas(const GroupedMatmulParams& p, int bn) {
  return (p.num_groups < p.m ? p.num_groups : p.m) * ((p.n + bn - 1) / bn);
}

}  // namespace

GroupedMatmulTile grouped_matmul_tile(const GroupedMatmulParams& p) {
  GroupedMatmulTile t = {p.block_m, p.block_n};
  if (t.block_m != 16 && t.block_m != 64) {
    // Groups of a few rows (decode): 16-row tiles, little mma on padding rows. Larger groups
    // (prefill): 64-row tiles read each weight tile once per 64 rows — from 16 rows per group
    // when a tile's weights (BN × K) outgrow what L2 serves again cheaply (H200, one TP-8 rank
    // of M3: gate_up K 6144 from 16 rows, down K 384 from 32; BENCHMARKS.md).
    const int64_t rows = p.num_groups > 0 ? p.m / p.num_groups : p.m;
    const bool big_tile = 128 * p.k * 2 > (256 << 10);
    t.block_m = rows >= 32 || (rows >= 16 && big_tile) ? 64 : 16;
  }
  if (t.block_m != 16 || (t.block_n != 32 && t.block_n != 64 && t.block_n != 128)) {
    // Narrower column tiles when few groups would leave SMs idle (one CTA streams its tile).
    t.block_n = t.block_m != 16 || ctas(p, 128) >= 264 ? 128 : ctas(p, 64) >= 264 ? 64 : 32;
  }
  return t;
}

const char* grouped_matmul_unsupported(int64_t k) {
  return k % 8 == 0 ? "" : "the CUDA grouped_matmul kernel needs K (the contracted dim) % 8 == 0";
}

cudaError_t launch_grouped_matmul(const GroupedMatmulParams& p, cudaStream_t stream) {
  if (p.k % 8 != 0 || p.m < 0 || p.n < 1 || p.num_groups < 0 || p.num_groups > 65534)
    return cudaErrorInvalidValue;
  if (p.m == 0) return cudaSuccess;
  const GroupedMatmulTile t = grouped_matmul_tile(p);
  if (t.block_m == 64) return launch<4, 4, 4>(p, stream);
  if (t.block_n == 32) return launch<1, 1, 8>(p, stream);
  if (t.block_n == 64) return launch<1, 2, 6>(p, stream);
  return launch<1, 4, 4>(p, stream);
}

}  // namespace cuda
}  // namespace m3sparse
