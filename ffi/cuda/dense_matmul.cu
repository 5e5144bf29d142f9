// dense_matmul for sm_90 (SPEC §11): out[M, N] = lhs[M, K] · rhs[N, K]ᵀ, bf16 operands, fp32
// sums; a weight-streaming kernel for the few rows of a decode step, where cuBLAS reads a
// projection's weight at well under the copy rate (M3 at TP 8, 4 rows: 1.7 TB/s).
//
//   1. A CTA of W warps owns 16 output features (rows of rhs) and up to 16 lhs rows
//      (grid.y = ceil(M / 16)); W (4 to 16) from N and K only (dense_matmul_warps). rhs is the A operand of m16n8k16 bf16 mma (16 features x 16 k),
//      lhs the B operand (16 k x 8 rows): each weight element is read once per CTA and serves
//      every lhs row of it.
//   2. K is cut into chunks of 64; warp w takes chunks w, w + W, w + 2W, ... and accumulates
//      them in fp32 registers in that order. Lane (g, t) loads 32 contiguous bytes of feature
//      rows g and g + 8 and of its lhs rows (k = 64c + 16t ...): inside a chunk the k order is
//      permuted the same way on both operands (step s, mma k index 2t + e -> 16t + 4s + e,
//      2t + 8 + e -> 16t + 4s + 2 + e), so the four lanes of a row read 128 contiguous bytes.
//      Up to three later chunks' loads are in flight while a chunk is multiplied.
//   3. The warps' partial sums meet in shared memory and are added in warp order 0, 1, ...
//      (only warps that had a chunk), then stored (fp32, or rounded to bf16 once).
// An output element is the same instruction sequence over the same operands whatever M is and
// whichever CTA row holds it: a row's bits never depend on the other rows (SPEC §11).
#include <cstdint>

#include "device_utils.cuh"
#include "m3sparse_cuda.h"

namespace m3sparse {
namespace cuda {
namespace {

constexpr int kMaxWarpsDm = 16;
constexpr int kChunk = 64;                  // k per chunk
constexpr int kMaxTilesDm = 2;              // n-tiles of 8 lhs rows: 16 rows per CTA row

struct Frag {
  uint4 w[2][2];                            // feature rows g, g + 8: 2 x 16 bytes each
  uint4 x[kMaxTilesDm][2];                  // lhs row 8j + g of each n-tile
};

template <int NT>
__device__ __forceinline__ void load_chunk(const DenseMatmulParams& p, int64_t n0, int64_t m0,
                                           int chunk, int g, int t, Frag& f) {
  const int64_t k0 = int64_t(chunk) * kChunk + 16 * t;
  const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t n = n0 + g + 8 * h;
    const uint4* src = reinterpret_cast<const uint4*>(p.rhs + n * p.k + k0);
    f.w[h][0] = n < p.n ? __ldg(src) : zero;
    f.w[h][1] = n < p.n ? __ldg(src + 1) : zero;
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int64_t m = m0 + 8 * j + g;
    const uint4* src = reinterpret_cast<const uint4*>(p.lhs + m * p.k + k0);
    f.x[j][0] = m < p.m ? __ldg(src) : zero;
    f.x[j][1] = m < p.m ? __ldg(src + 1) : zero;
  }
}

__device__ __forceinline__ uint32_t word(const uint4 (&v)[2], int i) {   // 32-bit word i of 8
  const uint4& u = v[i >> 2];
  const int r = i & 3;
  return r == 0 ? u.x : r == 1 ? u.y : r == 2 ? u.z : u.w;
}

template <int NT>
__device__ __forceinline__ void mma_chunk(const Frag& f, float (&acc)[NT][4]) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    // A: (g, 2t..), (g + 8, 2t..), (g, 2t + 8..), (g + 8, 2t + 8..) = words 2s, 2s + 1 of rows
    const uint32_t a[4] = {word(f.w[0], 2 * s), word(f.w[1], 2 * s), word(f.w[0], 2 * s + 1),
                           word(f.w[1], 2 * s + 1)};
#pragma unroll
    for (int j = 0; j < NT; ++j)
      Traits<__nv_bfloat16>::mma(acc[j], a, word(f.x[j], 2 * s), word(f.x[j], 2 * s + 1));
  }
}

// Chunks in flight per warp: D - 1 beyond the one being multiplied (fewer with more rows, whose
// lhs fragments take registers; the order of the sums is the same at every depth).
template <int NT>
constexpr int kDepth = NT == 1 ? 4 : 3;

template <int NT>
__global__ void __launch_bounds__(kMaxWarpsDm * 32) dense_matmul_kernel(DenseMatmulParams p) {
  constexpr int D = kDepth<NT>;
  __shared__ float red[kMaxWarpsDm][NT][4][32];
  const int W = blockDim.x >> 5;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t n0 = int64_t(blockIdx.x) * 16, m0 = int64_t(blockIdx.y) * (8 * NT);
  const int chunks = int(p.k / kChunk);

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  // warp w multiplies chunks w, w + W, w + 2W, ... in that order; buf[d] holds the chunk of
  // its d-th turn modulo D (indices fixed at compile time once the inner loop is unrolled)
  Frag buf[D];
#pragma unroll
  for (int d = 0; d < D - 1; ++d)
    if (warp + d * W < chunks) load_chunk<NT>(p, n0, m0, warp + d * W, g, t, buf[d]);
  for (int c0 = warp; c0 < chunks; c0 += D * W) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int c = c0 + d * W;
      if (c >= chunks) break;
      if (c + (D - 1) * W < chunks)
        load_chunk<NT>(p, n0, m0, c + (D - 1) * W, g, t, buf[(d + D - 1) % D]);
      mma_chunk<NT>(buf[d], acc);
    }
  }
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) red[warp][j][r][lane] = acc[j][r];
  __syncthreads();

  const int used = chunks < W ? chunks : W;
  for (int e = threadIdx.x; e < NT * 4 * 32; e += blockDim.x) {
    const int j = e / 128, r = (e / 32) & 3, l = e & 31;
    float v = red[0][j][r][l];
    for (int w = 1; w < used; ++w) v += red[w][j][r][l];
    // C fragment: c0, c1 = (feature g, rows 2t, 2t + 1), c2, c3 = (feature g + 8, same rows)
    const int64_t n = n0 + (l >> 2) + 8 * (r >> 1);
    const int64_t m = m0 + 8 * j + 2 * (l & 3) + (r & 1);
    if (n >= p.n || m >= p.m) continue;
    if (p.out_bf16)
      static_cast<__nv_bfloat16*>(p.out)[m * p.n + n] = __float2bfloat16_rn(v);
    else
      static_cast<float*>(p.out)[m * p.n + n] = v;
  }
}

template <int NT>
cudaError_t launch_nt(const DenseMatmulParams& p, int warps, cudaStream_t stream) {
  const dim3 grid(unsigned((p.n + 15) / 16), unsigned((p.m + 8 * NT - 1) / (8 * NT)));
  dense_matmul_kernel<NT><<<grid, warps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

const char* dense_matmul_unsupported(int64_t k) {
  if (k % kChunk != 0 || k < kChunk) return "dense_matmul: the CUDA kernel needs K % 64 == 0";
  return "";
}

// Warps per CTA (the parts K is dealt to) from the weight's shape only, never from M, so that
// the order of the sums is the same at every M: up to 16, halved while the grid would hold
// more than ~2700 warps (about what fits the H200's 132 SMs at these kernels' registers, so
// that a decode-sized call runs in one wave), at least 4, and no more than the chunks.
int dense_matmul_warps(int64_t n, int64_t k) {
  const int64_t ctas = (n + 15) / 16, chunks = k / kChunk;
  int w = kMaxWarpsDm;
  while (w > 4 && ctas * w > 2700) w /= 2;
  while (w > 1 && w > chunks) w /= 2;
  return w;
}

cudaError_t launch_dense_matmul(const DenseMatmulParams& p, cudaStream_t stream) {
  if (dense_matmul_unsupported(p.k)[0] != '\0' || p.m < 0 || p.n < 0 ||
      (p.n + 15) / 16 > 0x7fffffff || (p.m + 15) / 16 > 65535)
    return cudaErrorInvalidValue;
  if (p.m == 0 || p.n == 0) return cudaSuccess;
  const int warps = dense_matmul_warps(p.n, p.k);
  // rows per CTA row by M only; every choice gives the same bits (step 3)
  if (p.m <= 8) return launch_nt<1>(p, warps, stream);
  return launch_nt<2>(p, warps, stream);
}

}  // namespace cuda
}  // namespace m3sparse
