// route_experts for sm_90 (SPEC §10): each token's top-k experts and weights, and the (token,
// expert) pairs grouped by expert, in one launch at decode sizes (two for long chunks) where XLA
// ran a top-k sort, an argsort, scatters and gathers (about ten kernels per MoE layer).
//
//   A. Choice: 8 lanes per token. Lane s scans the experts e ≡ s (mod 8), 8 loads in flight
//      before their insertions, and keeps its 8 best (key, id) in registers, sorted by (key desc, id asc) — key = score + bias, NaN as −inf;
//      float comparison makes −0 and +0 tie, so the lower id wins, as the reference's
//      canonicalized keys do. Three butterfly steps merge the 8 lists (a sorted list and its
//      partner's reversed one, elementwise better, are a bitonic sequence holding the top 8 of
//      both; three compare-exchange stages sort it). The order is strict (ids are unique), so the
//      top k are the reference's, in its order. Lane 0 writes the experts and the weights:
//      the scores re-read, summed in choice order, divided (IEEE division, no fast math).
//   B. Grouping, one CTA of 32 warps: the T·k pairs (pair p = t·k + j; bucket = its expert, or
//      E for a token that is not live) are cut into 32 contiguous ranges, one per warp. Each warp
//      counts its range's buckets in shared memory; a warp scan down each bucket's column gives
//      the warps' prefix and the bucket's total, a block scan of the totals each bucket's start,
//      and so each warp's own start per bucket. Then each warp walks its range again, 32 pairs
//      at a time: a pair's
//      rank among the earlier pairs of its bucket in the batch is the popcount of the lanes below
//      it in its __match_any_sync mask, and the group's leader advances the warp's start. A
//      pair's position is therefore its bucket's start plus the pairs of that bucket before it in
//      pair order: the stable order of the reference's argsort. Everything is integer counting:
//      the same bits in every launch.
// T ≤ 128: A runs in the grouping CTA before B (one launch), its results kept in shared memory;
// otherwise A is a grid of its own. T·k ≤ 32 (decode): warp 0 groups alone (group_kernel).
// No workspace, no host reads of device data: CUDA-graph safe.
#include <cmath>
#include <cstdint>
#include <climits>

#include "m3sparse_cuda.h"

namespace m3sparse {
namespace cuda {
namespace {

constexpr int kLanes = 8;            // lanes per token in the choice
constexpr int kList = 8;             // top-k list length (k <= 8)
constexpr int kChooseThreads = 256;  // A's grid: 32 tokens per CTA
constexpr int kGroupWarps = 32;      // B: one CTA of 1024 threads
constexpr int kGroupThreads = kGroupWarps * 32;
constexpr int kFusedTokens = kGroupThreads / kLanes;   // T <= 128: A inside B's launch

__device__ __forceinline__ bool better(float ka, int ia, float kb, int ib) {
  return ka > kb || (ka == kb && ia < ib);
}

// Compare-exchange of list slots a < b: the better of the two goes to a.
__device__ __forceinline__ void cx(float* key, int* id, int a, int b) {
  const bool swap = better(key[b], id[b], key[a], id[a]);
  const float ka = key[a];
  const int ia = id[a];
  key[a] = swap ? key[b] : ka;
  id[a] = swap ? id[b] : ia;
  key[b] = swap ? ka : key[b];
  id[b] = swap ? ia : id[b];
}

// Step A for token t (lane s of its 8; the 8 lanes are consecutive and aligned in the warp, and
// all 32 lanes of the warp call this, `active` false past the last token).
// With sb / sw (the fused launch) each pair's bucket (its expert, or E for a token that is not
// live) and weight also go to shared memory.
__device__ void choose(const RouteParams& p, int64_t t, int s, bool active, int* sb = nullptr,
                       float* sw = nullptr) {
  const bool live = sb && active && s == 0 && p.live[t];   // loaded while the scan runs
  float key[kList];
  int id[kList];
#pragma unroll
  for (int j = 0; j < kList; ++j) key[j] = -INFINITY, id[j] = INT_MAX;
  if (active) {
    const float* row = p.scores + t * p.num_experts;
    // kUnroll experts' loads issued before their insertions: one memory latency per kUnroll
    // experts instead of one per expert
    constexpr int kUnroll = 8;
    for (int e0 = s; e0 < p.num_experts; e0 += kLanes * kUnroll) {
      float v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int e = e0 + u * kLanes;
        v[u] = e < p.num_experts ? row[e] + p.bias[e] : -INFINITY;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int e = e0 + u * kLanes;
        if (e >= p.num_experts) break;
        float ck = isnan(v[u]) ? -INFINITY : v[u];
        int ci = e;
#pragma unroll
        for (int j = 0; j < kList; ++j) {   // insertion: the candidate bubbles down the list
          const bool b = better(ck, ci, key[j], id[j]);
          const float tk = b ? key[j] : ck;
          const int ti = b ? id[j] : ci;
          key[j] = b ? ck : key[j];
          id[j] = b ? ci : id[j];
          ck = tk;
          ci = ti;
        }
      }
    }
  }
#pragma unroll
  for (int off = 1; off < kLanes; off <<= 1) {
    float ok[kList];
    int oi[kList];
#pragma unroll
    for (int j = 0; j < kList; ++j) {
      ok[j] = __shfl_xor_sync(0xffffffffu, key[j], off);
      oi[j] = __shfl_xor_sync(0xffffffffu, id[j], off);
    }
#pragma unroll
    for (int j = 0; j < kList; ++j) {   // the top 8 of both lists, as a bitonic sequence
      const bool b = better(ok[kList - 1 - j], oi[kList - 1 - j], key[j], id[j]);
      key[j] = b ? ok[kList - 1 - j] : key[j];
      id[j] = b ? oi[kList - 1 - j] : id[j];
    }
#pragma unroll
    for (int d = kList / 2; d >= 1; d >>= 1) {
#pragma unroll
      for (int j = 0; j < kList; ++j)
        if ((j & d) == 0) cx(key, id, j, j + d);
    }
  }
  if (!active || s != 0) return;
  const float* row = p.scores + t * p.num_experts;
  float w[kList];
  float total = 0.0f;
#pragma unroll
  for (int j = 0; j < kList; ++j) {
    if (j < p.k) {
      w[j] = row[id[j]];
      total = j == 0 ? w[j] : total + w[j];
      p.experts[t * p.k + j] = id[j];
      if (sb) sb[t * p.k + j] = live ? id[j] : p.num_experts;
    }
  }
#pragma unroll
  for (int j = 0; j < kList; ++j) {
    if (j < p.k) {
      const float v = p.renormalize ? __fdiv_rn(w[j], total) : w[j];
      p.weights[t * p.k + j] = v;
      if (sw) sw[t * p.k + j] = v;
    }
  }
}

__global__ void __launch_bounds__(kChooseThreads) choose_kernel(const RouteParams p) {
  const int64_t u = int64_t(blockIdx.x) * kChooseThreads + threadIdx.x;
  const int64_t t = u / kLanes;
  choose(p, t, int(u % kLanes), t < p.num_tokens);
}

// Exclusive scan of v over the CTA's 1024 threads (sums: 32 ints of shared memory).
__device__ int block_exclusive_scan(int v, int* sums) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) sums[w] = x;
  __syncthreads();
  if (w == 0) {
    int s = sums[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    sums[lane] = s;
  }
  __syncthreads();
  return x - v + (w > 0 ? sums[w - 1] : 0);
}

// Step B (and A first when fused). tiny (fused, T·k <= 32): warp 0 groups the pairs alone — a
// pair's start is the count of pairs in lower buckets (32 shuffles), its rank the lanes below
// it in its match mask — with no shared counters and no further barrier.
__global__ void __launch_bounds__(kGroupThreads, 1) group_kernel(const RouteParams p, bool fused,
                                                                 bool tiny) {
  extern __shared__ int counts[];   // [kGroupWarps][E + 1] per warp and bucket, then [E + 1]
  __shared__ int sums[32];
  __shared__ int sb[kFusedTokens * kList];     // fused: the pairs' buckets and weights
  __shared__ float sw[kFusedTokens * kList];
  const int E = p.num_experts, B = E + 1;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int n = int(p.num_tokens) * p.k;                     // < 2^31 (the handler checks)
  if (fused) {  // T <= 128: step A here
    choose(p, threadIdx.x / kLanes, threadIdx.x % kLanes, threadIdx.x / kLanes < p.num_tokens, sb,
           sw);
    __syncthreads();
  }
  auto bucket_of = [&](int q) -> int {
    if (fused) return sb[q];
    return p.live[q / p.k] ? p.experts[q] : E;
  };
  auto weight_of = [&](int q) -> float { return fused ? sw[q] : p.weights[q]; };
  if (tiny) {
    if (w != 0) return;
    const bool valid = lane < n;
    const int b = valid ? sb[lane] : INT_MAX;
    const unsigned same = __match_any_sync(0xffffffffu, b);
    int below = 0;
#pragma unroll
    for (int l = 0; l < 32; ++l) below += __shfl_sync(0xffffffffu, b, l) < b;
    const int pos = below + __popc(same & ((1u << lane) - 1u));
    for (int e = lane; e < E; e += 32) p.group_sizes[e] = 0;
    __syncwarp();
    if (valid && b < E && (__ffs(same) - 1) == lane) p.group_sizes[b] = __popc(same);
    if (valid) {
      p.inverse[lane] = pos;
      p.sorted_tokens[pos] = lane / p.k;
      p.sorted_weights[pos] = sw[lane];
    }
    return;
  }
  for (int i = threadIdx.x; i < kGroupWarps * B; i += kGroupThreads) counts[i] = 0;
  __syncthreads();

  const int per = (n + kGroupWarps - 1) / kGroupWarps;
  const int lo = min(n, w * per), hi = min(n, lo + per);
  int* mine = counts + w * B;
  for (int base = lo; base < hi; base += 32) {                // count this warp's buckets
    const int q = base + lane;
    const int b = q < hi ? bucket_of(q) : -1;
    const unsigned same = __match_any_sync(0xffffffffu, b);
    if (q < hi && (__ffs(same) - 1) == lane) mine[b] += __popc(same);
  }
  __syncthreads();

  // Each bucket's column [warp][b] becomes the warps' exclusive prefix (warp w scans the
  // columns b ≡ w mod 32, lane v holding warp v's count: the stride B is odd, no bank
  // conflicts), its total goes to totals[b]; a block scan of the totals gives each bucket's
  // start, added to its column.
  int* totals = counts + kGroupWarps * B;
  for (int b = w; b < B; b += kGroupWarps) {
    const int c = counts[lane * B + b];
    int x = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    counts[lane * B + b] = x - c;
    if (lane == 31) totals[b] = x;
  }
  __syncthreads();
  const int total = threadIdx.x < B ? totals[threadIdx.x] : 0;
  const int start = block_exclusive_scan(total, sums);
  if (threadIdx.x < E) p.group_sizes[threadIdx.x] = total;
  if (threadIdx.x < B) totals[threadIdx.x] = start;
  __syncthreads();
  for (int b = w; b < B; b += kGroupWarps) counts[lane * B + b] += totals[b];
  __syncthreads();

  for (int base = lo; base < hi; base += 32) {                // place this warp's pairs
    const int q = base + lane;
    const bool valid = q < hi;
    const int b = valid ? bucket_of(q) : -1;
    const unsigned same = __match_any_sync(0xffffffffu, b);
    const int pos = valid ? mine[b] + __popc(same & ((1u << lane) - 1u)) : 0;
    __syncwarp();
    if (valid && (__ffs(same) - 1) == lane) mine[b] += __popc(same);
    __syncwarp();
    if (valid) {
      p.inverse[q] = pos;
      p.sorted_tokens[pos] = q / p.k;
      p.sorted_weights[pos] = weight_of(q);
    }
  }
}

}  // namespace

const char* route_unsupported(int64_t num_experts, int64_t k) {
  if (num_experts < 1 || num_experts > kRouteMaxExperts)
    return "route_experts: the CUDA kernel takes 1 <= E <= 512 experts";
  if (k < 1 || k > kRouteMaxK || k > num_experts)
    return "route_experts: the CUDA kernel takes 1 <= k <= min(E, 8)";
  return "";
}

cudaError_t launch_route_experts(const RouteParams& p, cudaStream_t stream) {
  const size_t smem = size_t(kGroupWarps + 1) * (p.num_experts + 1) * sizeof(int);
  cudaError_t err = cudaSuccess;
  if (smem > 48 * 1024) {   // E > 371: opt in to more than 48 KB (M3's E = 128 needs 17 KB)
    err = cudaFuncSetAttribute(group_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(smem));
    if (err != cudaSuccess) return err;
  }
  const bool fused = p.num_tokens <= kFusedTokens;
  const bool tiny = fused && p.num_tokens * p.k <= 32;
  if (!fused) {
    const int64_t threads = p.num_tokens * kLanes;
    choose_kernel<<<unsigned((threads + kChooseThreads - 1) / kChooseThreads), kChooseThreads, 0,
                    stream>>>(p);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (tiny) {   // no counters: T·8 choice lanes in whole warps
    const unsigned threads = unsigned((p.num_tokens * kLanes + 31) / 32 * 32 + (p.num_tokens == 0) * 32);
    group_kernel<<<1, threads, 0, stream>>>(p, true, true);
  } else {
    group_kernel<<<1, kGroupThreads, smem, stream>>>(p, fused, false);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace m3sparse
