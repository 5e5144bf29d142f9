// Machine ceilings for the bench (`python -m jax_m3sparse.bench peak`): register-resident
// multiply-add loops on every core, one per tile-math instruction the attention paths use.
// Built into the bench module _m3sparse_cpu_bench (ffi/bindings/cpu_bench_module.cc), not the ops'.
#include <algorithm>
#include <chrono>
#include <random>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "attend.h"
#include "isa.h"
#if M3_X86
#include <immintrin.h>
#endif

namespace m3sparse {
namespace {

#if M3_X86
// Independent accumulator chains (more than FMA latency × ports) so the loop runs at issue rate.
__attribute__((target("avx2,fma"))) double fma_avx2(int64_t iters) {
  __m256 acc[12];
#pragma GCC unroll 16
  for (int k = 0; k < 12; ++k) acc[k] = _mm256_set1_ps(float(k));
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
  for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 16
    for (int k = 0; k < 12; ++k) acc[k] = _mm256_fmadd_ps(acc[k], a, b);
  float sink = 0;
  for (int k = 0; k < 12; ++k) sink += _mm256_cvtss_f32(acc[k]);
  return sink == 12345.0f ? 0.0 : double(iters) * 12 * 8 * 2;
}

__attribute__((target("avx512f"))) double fma_avx512(int64_t iters) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int k = 0; k < 16; ++k) acc[k] = _mm512_set1_ps(float(k));
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
  for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) acc[k] = _mm512_fmadd_ps(acc[k], a, b);
  float sink = 0;
  for (int k = 0; k < 16; ++k) sink += _mm512_reduce_add_ps(acc[k]);
  return sink == 12345.0f ? 0.0 : double(iters) * 16 * 16 * 2;
}

__attribute__((target("avx512f,avx512bf16"))) double dot_bf16(int64_t iters) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int k = 0; k < 16; ++k) acc[k] = _mm512_set1_ps(float(k));
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3F80), b = (__m512bh)_mm512_set1_epi16(0x3A83);
  for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) acc[k] = _mm512_dpbf16_ps(acc[k], a, b);
  float sink = 0;
  for (int k = 0; k < 16; ++k) sink += _mm512_reduce_add_ps(acc[k]);
  return sink == 12345.0f ? 0.0 : double(iters) * 16 * 32 * 2;
}

__attribute__((target("amx-tile,amx-bf16"))) double amx_bf16(int64_t iters) {
  alignas(64) uint8_t cfg[64] = {};
  cfg[0] = 1;  // palette 1: 8 tiles of 16 rows × 64 bytes
  for (int t = 0; t < 8; ++t) {
    uint16_t colsb = 64;
    std::memcpy(cfg + 16 + 2 * t, &colsb, 2);
    cfg[48 + t] = 16;
  }
  alignas(64) static thread_local uint16_t buf[16 * 32];
  std::fill(buf, buf + 16 * 32, uint16_t(0x3F80));
  _tile_loadconfig(cfg);
  _tile_loadd(4, buf, 64);
  _tile_loadd(5, buf, 64);
  _tile_loadd(6, buf, 64);
  _tile_loadd(7, buf, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) static thread_local float out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0] == 12345.0f ? 0.0 : double(iters) * 4 * 16 * 16 * 32 * 2;
}
#endif

}  // namespace

// GFLOP/s of one path's per-block attention math on one thread (bench only): G = 16 heads,
// D = 128, full 128-key blocks of a 64-page random cache (its tiles stay in L2/L3, so this is
// the kernel without DRAM), each block dequantized (cached = false) or one tile dequantized
// once and folded in every time (cached = true: the block math alone, what serving a chunk of
// tokens that share their blocks approaches). Flops = 4·G·D per key. −1 for a path
// this machine lacks.
template <typename Kernel>
double kernel_rate(bool cached) {
  const int64_t G = 16, D = 128, N = 128, P = 64, blocks = 3000;
  const CacheGeometry geo{P, 1, 2, N, D, kLBHNC};
  std::vector<uint8_t> cache(geo.total_bytes());
  std::mt19937 rng(1);
  for (auto& b : cache) b = uint8_t(rng() & 0x6F);  // finite scale bytes
  std::vector<float> q(G * D);
  for (auto& x : q) x = float(int(rng() % 200) - 100) / 100.0f;
  Kernel w(G, D, N, 1);
  w.begin(0, q.data(), 0.1f);
  w.dequantize(geo, cache.data() + geo.tile_offset(0, 0, 0), cache.data() + geo.tile_offset(0, 0, 1), N);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < blocks; ++i) {
    if (!cached) {
      const int64_t page = int64_t(rng() % P);
      w.dequantize(geo, cache.data() + geo.tile_offset(0, page, 0),
                   cache.data() + geo.tile_offset(0, page, 1), N);
    }
    w.block(0, N);
  }
  const float sink = w.finish(0, true, 1.0f)[0];
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return sink == 12345.0f ? 0.0 : 4.0 * G * D * N * blocks / s / 1e9;
}

double kernel_gflops(const std::string& path, bool cached) {
  if (path == "generic") return kernel_rate<generic::Kernel>(cached);
#if M3_X86
  if (path == "avx2" && machine_cpu_path() >= CpuPath::kAvx2) return kernel_rate<avx2::Kernel>(cached);
  if (path == "avx512" && machine_cpu_path() >= CpuPath::kAvx512)
    return kernel_rate<bf16tile::Kernel<bf16tile::DotMma>>(cached);
  if (path == "amx" && machine_cpu_path() >= CpuPath::kAmx)
    return kernel_rate<bf16tile::Kernel<bf16tile::AmxMma>>(cached);
#endif
  return -1.0;
}

// GFLOP/s of `kind` ("fp32_fma_avx2", "fp32_fma_avx512", "bf16_dot_avx512", "bf16_amx") on
// `threads` threads, or −1 if this machine (or build) lacks it.
double peak_gflops(const std::string& kind, int threads) {
#if M3_X86
  const CpuPath have = detect_cpu_path();
  double (*loop)(int64_t) = nullptr;
  int64_t iters = 0;
  if (kind == "fp32_fma_avx2" && have >= CpuPath::kAvx2) loop = fma_avx2, iters = 20000000;
  if (kind == "fp32_fma_avx512" && have >= CpuPath::kAvx512) loop = fma_avx512, iters = 10000000;
  if (kind == "bf16_dot_avx512" && have >= CpuPath::kAvx512) loop = dot_bf16, iters = 10000000;
  if (kind == "bf16_amx" && have >= CpuPath::kAmx) loop = amx_bf16, iters = 200000;
  if (loop == nullptr) return -1.0;
  std::vector<double> flops(threads);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) pool.emplace_back([&, i] { flops[i] = loop(iters); });
  for (auto& t : pool) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double total = 0;
  for (double f : flops) total += f;
  return total / s / 1e9;
#else
  (void)kind; (void)threads;
  return -1.0;
#endif
}

}  // namespace m3sparse
