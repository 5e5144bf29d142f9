// Standalone harness of the CUDA grouped_matmul kernel (SPEC §9; no JAX needed): the kernel
// against a float64 host loop over the groups, the size rules (empty, negative, past M,
// uncovered rows), bit-identity across tile heights and batches, then timings at one TP-8 rank
// of MiniMax M3's routed experts (E 128, k 4, H 6144, I 384), with bf16 and with MXFP8 weights
// (and MXFP8 lhs: w8a8), and with MXFP4 and NVFP4 weights,
// beside the floor = (bytes of the experts the batch routes to + activations) / 4.25 TB/s, or
// the FLOPs / 790 TFLOP/s. (MXFP8 values: tests/cuda/test_gpu.py, through the public API.)
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Iffi/include -Iffi/cuda \
//        tests/cuda/grouped_harness.cu ffi/cuda/grouped_matmul.cu -o grouped_harness
//   ./grouped_harness [--no-bench | --bench-only] [--prefill-only] [--no-w8a8] [--no-fp4]
//                     [--tiles bm:bn,...] [--modes bf16,...] [--act]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "m3sparse/common.h"
#include "m3sparse_cuda.h"
#include "harness_util.cuh"

using namespace m3sparse;
using namespace m3sparse::cuda;

// Every launch the bit-identity checks compare: (block_m, block_n) = 16-row tiles of 32, 64 and
// 128 columns; 64 × 128 tiles with one CTA row per 64-row tile (block_n 1), per group (2) and
// per 128 rows of a group (3); the launch's choice (0, 0).
static const std::pair<int, int> kTileList[] = {{16, 32}, {16, 64}, {16, 128}, {64, 1},
                                                {64, 2}, {64, 3}, {0, 0}};
static const char* const kTileNames = "tiles 16×32, 16×64, 16×128, 64×128 (CTA rows per tile, "
                                      "per group and per 128 rows) and the launch's choice";

// A case: M rows in groups of `sizes` over G groups, K inputs, N outputs; what it covers.
struct Shape { int64_t M, N, K; int G; std::vector<int32_t> sizes; const char* what; };
// The quantized formats' cases (MXFP8 weights, MXFP8 rows, FP4); the last, K 256, draws
// E8M0 exponents 0..12 (the flushing path) and applies to E8M0 weight scales only.
static const std::vector<Shape> kQuantShapes = {
    {37, 40, 128, 5, {9, 0, 20, 3, 5}, "covers M; an empty group; N < 32"},
    {50, 200, 384, 4, {7, -4, 100, 9}, "K 384 (down_proj's)"},
    {300, 264, 1024, 3, {40, 250, 10}, "several 64-row tiles per group"},
    {37, 40, 256, 5, {9, 0, 20, 3, 5}, "exponents 0..12 (products flushed below 2^-126)"},
};
static bool tiny_exponents(const Shape& s) { return s.K == 256; }

struct Problem {
  int64_t M, N, K;
  int G;
  std::vector<uint16_t> lhs, rhs;   // bf16 bits
  std::vector<int32_t> sizes;
};

static Problem random_problem(std::mt19937& rng, int64_t M, int64_t N, int64_t K, int G) {
  Problem p{M, N, K, G, std::vector<uint16_t>(M * K), std::vector<uint16_t>(size_t(G) * N * K),
            std::vector<int32_t>(G, 0)};
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& x : p.lhs) x = float_to_bf16(nd(rng));
  for (auto& x : p.rhs) x = float_to_bf16(nd(rng) * 0.05f);
  return p;
}

// SPEC §9 in float64: per group, negative sizes 0, rows past M dropped, uncovered rows 0; also
// Σ|a·b| per element for the tolerance.
static void oracle(const Problem& p, std::vector<double>* out, std::vector<double>* mag) {
  out->assign(p.M * p.N, 0.0);
  mag->assign(p.M * p.N, 0.0);
  int64_t start = 0;
  for (int g = 0; g < p.G; ++g) {
    const int64_t end = std::min(p.M, start + std::max<int64_t>(p.sizes[g], 0));
    for (int64_t i = start; i < end; ++i)
      for (int64_t n = 0; n < p.N; ++n) {
        double s = 0, a = 0;
        for (int64_t k = 0; k < p.K; ++k) {
          const double x = double(bf16_to_float(p.lhs[i * p.K + k])) *
                           double(bf16_to_float(p.rhs[(g * p.N + n) * p.K + k]));
          s += x;
          a += std::fabs(x);
        }
        (*out)[i * p.N + n] = s;
        (*mag)[i * p.N + n] = a;
      }
    start = end;
  }
}

struct Device {
  void *lhs, *rhs, *sizes, *out;
  explicit Device(const Problem& p) {
    CK(cudaMalloc(&lhs, std::max<size_t>(2, p.lhs.size() * 2)));
    CK(cudaMalloc(&rhs, std::max<size_t>(2, p.rhs.size() * 2)));
    CK(cudaMalloc(&sizes, std::max<size_t>(4, p.sizes.size() * 4)));
    CK(cudaMalloc(&out, std::max<size_t>(4, p.M * p.N * 4)));
    CK(cudaMemcpy(lhs, p.lhs.data(), p.lhs.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(rhs, p.rhs.data(), p.rhs.size() * 2, cudaMemcpyHostToDevice));
  }
  ~Device() {
    cudaFree(lhs);
    cudaFree(rhs);
    cudaFree(sizes);
    cudaFree(out);
  }
  GroupedMatmulParams params(const Problem& p, int block_m, int block_n = 0) const {
    GroupedMatmulParams q = {};
    q.lhs = static_cast<const __nv_bfloat16*>(lhs);
    q.rhs = static_cast<const __nv_bfloat16*>(rhs);
    q.group_sizes = static_cast<const int32_t*>(sizes);
    q.out = static_cast<float*>(out);
    q.m = p.M, q.n = p.N, q.k = p.K, q.num_groups = p.G, q.block_m = block_m;
    q.block_n = block_n;
    return q;
  }
  // Launches q with out pre-filled with NaN (every element must be written); its result.
  std::vector<float> launch(const GroupedMatmulParams& q) {
    CK(cudaMemset(out, 0xFF, q.m * q.n * 4));
    CK(launch_grouped_matmul(q, nullptr));
    CK(cudaDeviceSynchronize());
    std::vector<float> h(q.m * q.n);
    CK(cudaMemcpy(h.data(), out, h.size() * 4, cudaMemcpyDeviceToHost));
    return h;
  }
  // Runs with p.sizes.
  std::vector<float> run(const Problem& p, int block_m, int block_n = 0) {
    CK(cudaMemcpy(sizes, p.sizes.data(), p.sizes.size() * 4, cudaMemcpyHostToDevice));
    return launch(params(p, block_m, block_n));
  }
};

// A device copy of host bytes (one byte allocated at least); the caller frees it.
static void* upload(const std::vector<uint8_t>& v) {
  void* d;
  CK(cudaMalloc(&d, std::max<size_t>(1, v.size())));
  CK(cudaMemcpy(d, v.data(), v.size(), cudaMemcpyHostToDevice));
  return d;
}

static void check(const std::string& name, const Problem& p, const std::vector<float>& got) {
  std::vector<double> want, mag;
  oracle(p, &want, &mag);
  double worst = 0;
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = 1e-5 * mag[i] + 1e-30;  // fp32 sums over K/16 mma steps
    const double err = std::fabs(double(got[i]) - want[i]);
    if (!(err <= tol) || (want[i] == 0 && mag[i] == 0 && got[i] != 0.0f)) ++bad;
    if (mag[i] > 0) worst = std::max(worst, err / mag[i]);
  }
  char d[128];
  snprintf(d, sizeof d, "%lld of %zu off; worst |err| / Σ|a·b| = %.2e", (long long)bad,
           got.size(), worst);
  report(bad == 0, name, d);
}

// e4m3 code (not a NaN code) -> its value, decoded from the bits.
static double e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const double mag = e == 0 ? m / 8.0 * std::ldexp(1.0, -6) : (1 + m / 8.0) * std::ldexp(1.0, e - 7);
  return (b & 0x80) ? -mag : mag;
}

// Random MXFP8 codes for the values in *vals (not NaN codes) and exponents 118..129, or 0..12
// with `tiny`; *vals gets their exact bf16 values (products below 2^-126 flushed to ±0).
static void random_mxfp8(std::mt19937& rng, bool tiny, std::vector<uint16_t>* vals,
                         std::vector<uint8_t>* codes, std::vector<uint8_t>* exps) {
  codes->resize(vals->size());
  exps->resize(vals->size() / 32);
  for (auto& e : *exps) e = uint8_t(tiny ? rng() % 13 : 118 + rng() % 12);
  for (size_t i = 0; i < codes->size(); ++i) {
    uint8_t b = uint8_t(rng());
    if ((b & 0x7F) == 0x7F) b ^= 1;
    (*codes)[i] = b;
    const double w = e4m3_value(b) * std::ldexp(1.0, (*exps)[i / 32] - 127);
    (*vals)[i] = float_to_bf16(float(std::fabs(w) < std::ldexp(1.0, -126) ? 0.0 * w : w));
  }
}

// MXFP8 weights (SPEC §9.1): random codes and exponents 118..129 (or 0..12: the two-factor,
// flushing widening); p.rhs gets their exact bf16 values, so the bf16 oracle applies. Every
// tile (16 × 32, 16 × 64, 16 × 128, 64 × 128, the launch's choice) must give the bits of the
// bf16 kernel on those values.
static void mxfp8_tests(std::mt19937& rng) {
  for (const Shape& s : kQuantShapes) {
    const std::string what = std::string("MXFP8: ") + s.what;
    Problem p = random_problem(rng, s.M, s.N, s.K, s.G);
    p.sizes = s.sizes;
    std::vector<uint8_t> codes, exps;
    random_mxfp8(rng, tiny_exponents(s), &p.rhs, &codes, &exps);
    Device d(p);
    void *w8 = upload(codes), *sc = upload(exps);
    CK(cudaMemcpy(d.sizes, p.sizes.data(), p.sizes.size() * 4, cudaMemcpyHostToDevice));
    auto run = [&](int bm, int bn) {
      GroupedMatmulParams q = d.params(p, bm, bn);
      q.rhs = w8;
      q.rhs_scale = static_cast<const uint8_t*>(sc);
      return d.launch(q);
    };
    const auto a = d.run(p, 16, 128);   // the bf16 kernel on the exact values
    check(what + " (bf16 kernel on the values)", p, a);
    bool same = true;
    for (auto [bm, bn] : kTileList) {
      const auto b = run(bm, bn);
      same = same && memcmp(a.data(), b.data(), a.size() * 4) == 0;
    }
    report(same, what + ": " + kTileNames +
                     " bit-identical to the bf16 kernel on the dequantized values");
    CK(cudaFree(w8));
    CK(cudaFree(sc));
  }
}

// MXFP8 lhs and weights (SPEC §9.2): random codes, exponents 118..129; p.lhs and p.rhs get
// their exact values (bf16 holds them), so the float64 oracle applies (each 32-k block's sum is
// the tensor core's fp32 one, scaled by a power of two). Every tile must give the same bits,
// and a gathered launch (lhs_rows) the bits of the sorted copy. (A row alone against its batch:
// tests/cuda/test_gpu.py.)
static void w8a8_tests(std::mt19937& rng) {
  for (const Shape& s : kQuantShapes) {
    if (tiny_exponents(s)) continue;
    const std::string what = std::string("MXFP8 lhs: ") + s.what;
    Problem p = random_problem(rng, s.M, s.N, s.K, s.G);
    p.sizes = s.sizes;
    std::vector<uint8_t> a8, ae, w8, we;
    random_mxfp8(rng, false, &p.lhs, &a8, &ae);
    random_mxfp8(rng, false, &p.rhs, &w8, &we);
    Device d(p);
    void *da8 = upload(a8), *dae = upload(ae), *dw8 = upload(w8), *dwe = upload(we);
    CK(cudaMemcpy(d.sizes, p.sizes.data(), p.sizes.size() * 4, cudaMemcpyHostToDevice));
    // lhs_rows: the rows reversed, read from a copy of the lhs stored in reverse order
    std::vector<int32_t> rev(p.M);
    for (int64_t i = 0; i < p.M; ++i) rev[i] = int32_t(p.M - 1 - i);
    std::vector<uint8_t> a8r(a8.size()), aer(ae.size());
    const int64_t sr = p.K / 32;
    for (int64_t i = 0; i < p.M; ++i) {
      std::copy_n(a8.begin() + i * p.K, p.K, a8r.begin() + (p.M - 1 - i) * p.K);
      std::copy_n(ae.begin() + i * sr, sr, aer.begin() + (p.M - 1 - i) * sr);
    }
    void *da8r = upload(a8r), *daer = upload(aer), *rows;
    CK(cudaMalloc(&rows, rev.size() * 4));
    CK(cudaMemcpy(rows, rev.data(), rev.size() * 4, cudaMemcpyHostToDevice));
    auto run = [&](int bm, int bn, bool gather) {
      GroupedMatmulParams q = d.params(p, bm, bn);
      q.lhs = gather ? da8r : da8;
      q.lhs_scale = static_cast<const uint8_t*>(gather ? daer : dae);
      q.rhs = dw8;
      q.rhs_scale = static_cast<const uint8_t*>(dwe);
      if (gather) q.lhs_rows = static_cast<const int32_t*>(rows), q.lhs_count = p.M;
      return d.launch(q);
    };
    const auto a = run(16, 128, false);
    check(what + " (against float64)", p, a);
    bool same = true, gathered = true;
    for (auto [bm, bn] : kTileList) {
      same = same && memcmp(a.data(), run(bm, bn, false).data(), a.size() * 4) == 0;
      gathered = gathered && memcmp(a.data(), run(bm, bn, true).data(), a.size() * 4) == 0;
    }
    report(same, what + ": " + kTileNames + " bit-identical");
    report(gathered, what + ": lhs_rows gives the sorted copy's bits");
    for (void* x : {da8, dae, dw8, dwe, rows, da8r, daer}) CK(cudaFree(x));
  }
}

// Packed FP4 weights (SPEC §9.3), MXFP4 (fp4 1) or NVFP4 (2): random bytes (every code in
// both nibbles) with E8M0 exponents 118..129 (or 0..12: products flushed below 2^-126) or
// random finite E4M3 scales; p.rhs gets their exact bf16 values, so the float64 oracle applies
// (the FP4 launch sums each 32 k in its own slot order: SPEC §9.3, not the bf16 kernel's bits).
// Every tile must give the same bits.
static void fp4_tests(std::mt19937& rng) {
  static const double kE2m1[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (const int fmt : {1, 2})
  for (const Shape& s : kQuantShapes) {
    const bool tiny = tiny_exponents(s), nv = fmt == 2;
    if (tiny && nv) continue;
    const std::string what = std::string(nv ? "NVFP4: " : "MXFP4: ") + s.what;
    Problem p = random_problem(rng, s.M, s.N, s.K, s.G);
    p.sizes = s.sizes;
    const int block = nv ? 16 : 32;
    std::vector<uint8_t> codes(p.rhs.size() / 2), scales(p.rhs.size() / block);
    for (auto& x : scales) {
      if (nv) do x = uint8_t(rng()); while ((x & 0x7F) == 0x7F);   // finite E4M3 (signed)
      else x = uint8_t(tiny ? rng() % 13 : 118 + rng() % 12);
    }
    for (auto& x : codes) x = uint8_t(rng());
    for (size_t i = 0; i < p.rhs.size(); ++i) {
      const int c = (codes[i / 2] >> (4 * (i & 1))) & 15;
      const double v = (c & 8 ? -1 : 1) * kE2m1[c & 7];
      const uint8_t sc = scales[i / block];
      double w = v * (nv ? e4m3_value(sc) : std::ldexp(1.0, sc - 127));
      if (!nv && std::fabs(w) < std::ldexp(1.0, -126)) w = 0.0 * w;
      p.rhs[i] = float_to_bf16(float(w));
    }
    Device d(p);
    void *w4 = upload(codes), *sc = upload(scales);
    CK(cudaMemcpy(d.sizes, p.sizes.data(), p.sizes.size() * 4, cudaMemcpyHostToDevice));
    auto run = [&](int bm, int bn) {
      GroupedMatmulParams q = d.params(p, bm, bn);
      q.rhs = w4;
      q.rhs_scale = static_cast<const uint8_t*>(sc);
      q.fp4 = fmt;
      return d.launch(q);
    };
    const auto a = run(16, 128);
    check(what + " (against float64)", p, a);
    bool same = true;
    for (auto [bm, bn] : kTileList)
      same = same && memcmp(a.data(), run(bm, bn).data(), a.size() * 4) == 0;
    report(same, what + ": " + kTileNames + " bit-identical");
    CK(cudaFree(w4));
    CK(cudaFree(sc));
  }
}

// The epilogue (SPEC §9 item 6) with bf16, MXFP8, MXFP4 and NVFP4 weights (the loader pairs
// gate row j with up row N/2 + j, scales included): against the same format's plain fp32
// launch finished on the host — bit for bit with the scales alone; with swiglu / swiglu_oai to
// a few ulps (the device's expf against the host's) — and every tile bit-identical.
static float host_act(int act, float gate, float up, float alpha, float limit) {
  if (act == 1) return gate * (1.0f / (1.0f + std::exp(-gate))) * up;
  const float g = gate > limit ? limit : gate;
  const float u = up < -limit ? -limit : up > limit ? limit : up;
  return (u + 1.0f) * g * (1.0f / (1.0f + std::exp(-(g * alpha))));
}

static void epilogue_tests(std::mt19937& rng) {
  static const char* const kFmt[] = {"bf16", "MXFP8", "MXFP4", "NVFP4"};
  for (int fmt = 0; fmt < 4; ++fmt)
  for (size_t si = 0; si < 3; ++si) {
    const Shape& s = kQuantShapes[si];
    Problem p = random_problem(rng, s.M, s.N, s.K, s.G);
    p.sizes = s.sizes;
    // the weights in the format (bf16: p.rhs itself); MXFP8 / FP4 bytes and scales
    std::vector<uint8_t> codes, scales;
    if (fmt == 1) {
      random_mxfp8(rng, false, &p.rhs, &codes, &scales);
    } else if (fmt >= 2) {
      codes.resize(p.rhs.size() / 2);
      scales.resize(p.rhs.size() / (fmt == 3 ? 16 : 32));
      for (auto& x : codes) x = uint8_t(rng());
      for (auto& x : scales)
        if (fmt == 3) do x = uint8_t(rng()); while ((x & 0x7F) == 0x7F);
        else x = uint8_t(118 + rng() % 12);
    }
    Device d(p);
    void* w = fmt ? upload(codes) : nullptr;
    void* sc = fmt ? upload(scales) : nullptr;
    std::vector<float> rs(p.M), gs(p.G);
    std::uniform_real_distribution<float> ud(0.25f, 2.0f);
    for (auto& x : rs) x = ud(rng);
    for (auto& x : gs) x = ud(rng);
    void *drs, *dgs;
    CK(cudaMalloc(&drs, rs.size() * 4));
    CK(cudaMalloc(&dgs, std::max<size_t>(4, gs.size() * 4)));
    CK(cudaMemcpy(drs, rs.data(), rs.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dgs, gs.data(), gs.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.sizes, p.sizes.data(), p.sizes.size() * 4, cudaMemcpyHostToDevice));
    const float alpha = 1.702f, limit = 7.0f;
    auto run = [&](int bm, int bn, int act, bool scaled) {
      GroupedMatmulParams q = d.params(p, bm, bn);
      if (fmt) q.rhs = w, q.rhs_scale = static_cast<const uint8_t*>(sc);
      q.fp4 = fmt >= 2 ? fmt - 1 : 0;
      q.act = act, q.alpha = alpha, q.limit = limit;
      if (scaled) q.row_scale = static_cast<float*>(drs), q.group_scale = static_cast<float*>(dgs);
      auto out = d.launch(q);
      out.resize(p.M * (act ? p.N / 2 : p.N));
      return out;
    };
    const auto plain = run(16, 128, 0, false);
    std::vector<int> group(p.M, -1);   // each row's group, -1: uncovered
    for (int64_t g = 0, start = 0; g < p.G; ++g) {
      const int64_t end = std::min(p.M, start + std::max<int64_t>(p.sizes[g], 0));
      for (int64_t i = start; i < end; ++i) group[i] = int(g);
      start = end;
    }
    const std::string what = std::string("epilogue, ") + kFmt[fmt] + ": " + s.what;
    for (int act = 0; act < 3; ++act) {
      const int64_t n_out = act ? p.N / 2 : p.N;
      std::vector<float> want(p.M * n_out, 0.0f);
      for (int64_t i = 0; i < p.M; ++i) {
        if (group[i] < 0) continue;
        for (int64_t j = 0; j < n_out; ++j) {
          const float a = plain[i * p.N + j] * gs[group[i]];
          const float v = act ? host_act(act, a, plain[i * p.N + p.N / 2 + j] * gs[group[i]],
                                         alpha, limit) : a;
          want[i * n_out + j] = v * rs[i];
        }
      }
      const auto got = run(16, 128, act, true);
      int64_t bad = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        const bool ok = act ? std::fabs(got[i] - want[i]) <= 2e-6f * std::fabs(want[i])
                            : memcmp(&got[i], &want[i], 4) == 0;
        bad += !ok;
      }
      char dd[96];
      snprintf(dd, sizeof dd, "%lld of %zu off", (long long)bad, got.size());
      const char* name = act == 0 ? "group and row scales (bit for bit)"
                       : act == 1 ? "swiglu" : "swiglu_oai";
      report(bad == 0, what + ", " + name, dd);
      bool same = true;
      for (auto [bm, bn] : kTileList)
        same = same && memcmp(got.data(), run(bm, bn, act, true).data(), got.size() * 4) == 0;
      report(same, what + ", " + name + ": " + kTileNames + " bit-identical");
    }
    for (void* x : {w, sc, drs, dgs}) if (x) CK(cudaFree(x));
  }
}

static void tests(std::mt19937& rng) {
  mxfp8_tests(rng);
  w8a8_tests(rng);
  fp4_tests(rng);
  epilogue_tests(rng);
  const std::vector<Shape> shapes = {
      {37, 40, 72, 5, {9, 0, 20, 3, 5}, "covers M; an empty group; K % 64 != 0; N < 128"},
      {37, 13, 24, 4, {10, 10, 0, 0}, "odd N; rows after the last group are 0"},
      {50, 200, 136, 4, {7, -4, 100, 9}, "a negative size; the running end past M"},
      {64, 136, 64, 3, {0, 0, 0}, "no row covered"},
      {300, 264, 128, 3, {40, 250, 10}, "several 64-row tiles per group"},
      {700, 200, 384, 9, {84, 130, 1, 64, 65, 200, 17, 33, 97},
       "prefill-like groups (1..200 rows: partial and whole 64-row tiles)"},
      {700, 200, 2048, 9, {84, 130, 1, 64, 65, 200, 17, 33, 97},
       "the same, K 2048 (the launch takes one CTA row per 64-row tile)"},
      {1, 128, 64, 0, {}, "G = 0: every row uncovered"},
      {64 * 65534 + 100, 8, 8, 64, std::vector<int32_t>(64, 65535),
       "4.2 M rows in 64 groups: more 64-row tiles than grid rows (65535), so a launch asked "
       "for CTA rows per tile takes them per group"},
  };
  for (const Shape& s : shapes) {
    Problem p = random_problem(rng, s.M, s.N, s.K, s.G);
    p.sizes = s.sizes;
    Device d(p);
    const auto a = d.run(p, 16, 128);
    check(std::string(s.what) + " (16 × 128 tiles)", p, a);
    bool same = true;
    for (auto [bm, bn] : kTileList) {
      const auto b = d.run(p, bm, bn);
      same = same && memcmp(a.data(), b.data(), a.size() * 4) == 0;
    }
    report(same, std::string(s.what) + ": " + kTileNames + " bit-identical");
  }
  {  // one TP-8 rank's gate_up shape, 64 tokens routed to 4 of 128 experts; sampled rows
    Problem p = random_problem(rng, 256, 768, 6144, 128);
    for (int t = 0; t < 64; ++t)
      for (int j = 0; j < 4; ++j) ++p.sizes[(t * 37 + j * 11) % 128];
    Device d(p);
    const auto got = d.run(p, 0);
    Problem head = p;  // the oracle on the first 40 rows (the other groups' rows dropped)
    head.M = 40;
    head.lhs.resize(40 * p.K);
    std::vector<float> first(got.begin(), got.begin() + 40 * p.N);
    check("M3 TP-8 gate_up shape (K 6144, N 768, G 128), first 40 rows", head, first);
  }
  {  // a row's bits do not depend on its batch: group 5's rows alone vs inside a full batch
    Problem p = random_problem(rng, 512, 384, 384, 16);
    for (int g = 0; g < 16; ++g) p.sizes[g] = 32;
    Device d(p);
    const auto full = d.run(p, 0);  // M / G = 32: 64-row tiles
    const auto full_tiles = d.run(p, 64, 1);  // one CTA row per 64-row tile
    Problem alone = p;
    std::fill(alone.sizes.begin(), alone.sizes.end(), 0);
    alone.M = 3;  // rows 0..2 of the lhs as group 5 (the same rows as full's rows 160..162?)
    alone.lhs.assign(p.lhs.begin() + 160 * p.K, p.lhs.begin() + 163 * p.K);
    alone.sizes[5] = 3;
    Device da(alone);
    const auto a = da.run(alone, 0);  // M / G < 32: 16-row tiles
    report(memcmp(a.data(), full.data() + 160 * p.N, a.size() * 4) == 0 &&
               memcmp(a.data(), full_tiles.data() + 160 * p.N, a.size() * 4) == 0,
           "a group's rows alone (16-row tiles) == the same rows in a 512-row batch (64-row "
           "tiles, CTA rows per group and per tile), bit for bit");
  }
}

// ------------------------------------------------------------------------------ timings
// The launches timed (block_m, block_n; the last is the launch's own choice): 16-row tiles,
// 64 × 128 tiles with one CTA row per group ("64/grp") and per 64-row tile ("64/tile").
// --tiles bm:bn,... replaces all but the last.
struct BenchTile { std::string name; int bm, bn; };
static std::vector<BenchTile> g_bench_tiles = {
    {"16x32", 16, 32}, {"16x64", 16, 64}, {"16x128", 16, 128}, {"64/grp", 64, 2},
    {"64/tile", 64, 1}, {"auto", 0, 0}};

// Tokens T (each routed to 4 distinct of 128 experts, uniformly), or T < 0: a prefill chunk of
// -T tokens whose 4·|T| rows go to 98 of the 128 experts with skewed (log-normal, σ 0.6)
// popularity — about 84 rows per routed expert, the largest group ~300-390 rows (an M3 prefill
// chunk's shape at one TP-8 rank: ~98 routed experts, ~84 rows each; not a measured routing).
// T = kBiased: the M3 bench's random model's routing of a 2048-token chunk (bench.py's weights:
// per token and expert a sigmoid score of an N(0, 1) logit, plus an N(0, 0.1) bias per expert,
// top k): ~108 experts routed, the largest groups 250-470 rows.
constexpr int kBiased = 1 << 20;
static std::vector<int32_t> route(std::mt19937& rng, int T, int E, int k) {
  std::vector<int32_t> sizes(E, 0);
  if (T == kBiased) {
    std::normal_distribution<double> nd(0.0, 1.0);
    std::vector<double> bias(E), score(E);
    for (auto& b : bias) b = 0.1 * nd(rng);
    std::vector<int> ids(E);
    for (int t = 0; t < 2048; ++t) {
      for (int e = 0; e < E; ++e) score[e] = 1.0 / (1.0 + std::exp(-nd(rng))) + bias[e], ids[e] = e;
      std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                        [&](int a, int b) { return score[a] > score[b]; });
      for (int j = 0; j < k; ++j) ++sizes[ids[j]];
    }
    return sizes;
  }
  if (T > 0) {
    for (int t = 0; t < T; ++t) {
      std::vector<int> ids(E);
      for (int e = 0; e < E; ++e) ids[e] = e;
      for (int j = 0; j < k; ++j) {
        std::uniform_int_distribution<int> u(j, E - 1);
        std::swap(ids[j], ids[u(rng)]);
        ++sizes[ids[j]];
      }
    }
    return sizes;
  }
  std::vector<int> ids(E);
  for (int e = 0; e < E; ++e) ids[e] = e;
  std::shuffle(ids.begin(), ids.end(), rng);
  std::lognormal_distribution<double> ln(0.0, 0.6);
  std::vector<double> w(98);
  for (auto& x : w) x = ln(rng);
  std::discrete_distribution<int> pick(w.begin(), w.end());
  for (int64_t i = 0; i < int64_t(-T) * k; ++i) ++sizes[ids[pick(rng)]];
  return sizes;
}

static bool g_w8a8 = true;   // time MXFP8 lhs + weights too
static bool g_fp4 = true;    // time MXFP4 and NVFP4 weights too
static std::string g_modes;  // --modes bf16,mxfp4,...: time only these (default: all)
static bool g_act = false;   // --act: gate_up with the swiglu_oai epilogue, bf16 out (SPEC §9 item 6)

static void bench(bool prefill_only) {
  const double copy = copy_bandwidth();
  printf("\ndevice-to-device copy: %.2f TB/s (floor below: 4.25 TB/s, 790 TFLOP/s)\n", copy);
  printf("M3 routed experts at one TP-8 rank: E 128, k 4; gate_up N 768 K 6144, down N 6144 "
         "K 384. Tokens routed uniformly (4 distinct experts each; -2048: 98 experts, skewed; "
         "2048b: the M3 bench model's routing); 8 routings cycled. µs per call.\n");
  printf("%-6s %-8s %6s %4s %4s", "rhs", "proj", "tokens", "U", "max");
  for (const BenchTile& t : g_bench_tiles) printf(" %8s", t.name.c_str());
  printf(" %8s %6s %6s %7s\n", "floor", "xfloor", "GB/s", "tile");
  std::mt19937 rng(99);
  const int E = 128, k = 4;
  struct Proj { const char* name; int64_t N, K; };
  // bf16; MXFP8 weights; MXFP8 weights and lhs (w8a8); MXFP4 weights; NVFP4 weights
  static const char* const kModes[] = {"bf16", "mxfp8", "w8a8", "mxfp4", "nvfp4"};
  for (const int mode : {0, 1, 2, 3, 4})
  for (const Proj pr : {Proj{"gate_up", 768, 6144}, Proj{"down", 6144, 384}}) {
    if ((mode == 2 && !g_w8a8) || (mode >= 3 && !g_fp4)) continue;
    if (!g_modes.empty() && ("," + g_modes + ",").find(std::string(",") + kModes[mode] + ",") ==
                                std::string::npos)
      continue;
    const bool fp8 = mode == 1 || mode == 2, w8a8 = mode == 2, fp4 = mode >= 3;
    const int fp4_kind = mode - 2, block = mode == 4 ? 16 : 32;   // (fp4 only)
    // Every expert's weights once on the device (a cheap pattern: the values do not matter);
    // MXFP8: fp8 bytes and E8M0 scales 127 (2^0); FP4: codes with scales 1.0.
    const size_t elems = size_t(E) * pr.N * pr.K;
    const size_t wbytes = fp4 ? elems / 2 : fp8 ? elems : elems * 2;
    std::vector<uint16_t> w(elems);
    for (size_t i = 0; i < w.size(); ++i) w[i] = float_to_bf16(float(int(i * 2654435761u >> 24) - 128) / 4096.0f);
    if (fp8) {  // the same pattern's low bytes as e4m3 codes (never 0x7F / 0xFF: NaN)
      auto* b = reinterpret_cast<uint8_t*>(w.data());
      for (size_t i = 0; i < elems; ++i) b[i] = uint8_t(i * 2654435761u >> 24) & 0x77;
    }
    void* rhs;
    uint8_t* scale = nullptr;
    CK(cudaMalloc(&rhs, wbytes));
    CK(cudaMemcpy(rhs, w.data(), wbytes, cudaMemcpyHostToDevice));
    if (fp8 || fp4) {
      const size_t n = elems / (fp4 ? block : 32);
      CK(cudaMalloc(&scale, n));
      CK(cudaMemset(scale, mode == 4 ? 0x38 : 127, n));   // E4M3 1.0, E8M0 2^0
    }
    std::vector<uint16_t>().swap(w);
    const std::vector<int> all = {1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, -2048,
                                  kBiased};
    const std::vector<int> pre = {256, 512, 1024, 2048, -2048, kBiased};
    for (int T : prefill_only ? pre : all) {
      const int64_t M = int64_t(T == kBiased ? 2048 : T < 0 ? -T : T) * k;
      constexpr int kVariants = 8;
      std::vector<std::vector<int32_t>> routes(kVariants);
      double touched = 0, biggest = 0;
      for (auto& sizes : routes) {
        sizes = route(rng, T, E, k);
        touched += std::count_if(sizes.begin(), sizes.end(), [](int s) { return s > 0; });
        biggest += *std::max_element(sizes.begin(), sizes.end());
      }
      touched /= kVariants, biggest /= kVariants;
      Problem q{M, pr.N, pr.K, E, std::vector<uint16_t>(M * pr.K, float_to_bf16(0.5f)), {},
                std::vector<int32_t>(E, 0)};
      Device d(q);
      void* lhs8 = nullptr;             // w8a8: codes 0x38 (1.0) with exponents 127
      uint8_t* lhs_scale = nullptr;
      if (w8a8) {
        CK(cudaMalloc(&lhs8, M * pr.K));
        CK(cudaMemset(lhs8, 0x38, M * pr.K));
        CK(cudaMalloc(&lhs_scale, M * pr.K / 32));
        CK(cudaMemset(lhs_scale, 127, M * pr.K / 32));
      }
      float* row_scale = nullptr;       // --act: each row's routing weight (0.25)
      const bool act = g_act && pr.N == 768;
      if (act) {
        const std::vector<float> quarter(M, 0.25f);
        CK(cudaMalloc(&row_scale, M * 4));
        CK(cudaMemcpy(row_scale, quarter.data(), M * 4, cudaMemcpyHostToDevice));
      }
      std::vector<int32_t*> dsizes(kVariants);
      for (int v = 0; v < kVariants; ++v) {
        CK(cudaMalloc(&dsizes[v], E * 4));
        CK(cudaMemcpy(dsizes[v], routes[v].data(), E * 4, cudaMemcpyHostToDevice));
      }
      const int tiles = int(g_bench_tiles.size());
      std::vector<double> us(tiles);
      for (int b = 0; b < tiles; ++b) {
        us[b] = time_graph([&](int v, cudaStream_t s) {
          GroupedMatmulParams gp = d.params(q, g_bench_tiles[b].bm, g_bench_tiles[b].bn);
          gp.rhs = rhs;
          gp.rhs_scale = scale;
          gp.fp4 = fp4 ? fp4_kind : 0;
          if (w8a8) gp.lhs = lhs8, gp.lhs_scale = lhs_scale;
          if (act) gp.act = 2, gp.alpha = 1.702f, gp.limit = 7.0f, gp.row_scale = row_scale,
                   gp.out_bf16 = true;
          gp.group_sizes = dsizes[v];
          CK(launch_grouped_matmul(gp, s));
        }, kVariants);
      }
      const double per_weight = fp4 ? 0.5 + 1.0 / block : fp8 ? 1 + 1.0 / 32 : 2;
      const double bytes = touched * pr.N * pr.K * per_weight +
                           double(M) * pr.K * (w8a8 ? 1 + 1.0 / 32 : 2) +
                           (act ? double(M) * pr.N + 4.0 * M : double(M) * pr.N * 4);
      const double floor_us = std::max(bytes / 4.25e12, 2.0 * M * pr.N * pr.K / 790e12) * 1e6;
      GroupedMatmulParams auto_p = d.params(q, 0);
      auto_p.rhs_scale = scale;
      auto_p.fp4 = fp4 ? fp4_kind : 0;
      const GroupedMatmulTile tile = grouped_matmul_tile(auto_p);
      const double best = us[tiles - 1];
      printf("%-6s %-8s %6s %4.0f %4.0f", kModes[mode], act ? "gu+act" : pr.name,
             T == kBiased ? "2048b" : std::to_string(T).c_str(), touched, biggest);
      for (int b = 0; b < tiles; ++b) printf(" %8.1f", us[b]);
      printf(" %8.1f %6.2f %6.0f %3dx%d\n", floor_us, best / floor_us,
             bytes / (best * 1e-6) / 1e9, tile.block_m, tile.block_n);
      fflush(stdout);
      for (auto* x : dsizes) CK(cudaFree(x));
      if (row_scale) CK(cudaFree(row_scale));
      if (w8a8) {
        CK(cudaFree(lhs8));
        CK(cudaFree(lhs_scale));
      }
    }
    CK(cudaFree(rhs));
    if (scale) CK(cudaFree(scale));
  }
}

int main(int argc, char** argv) {
  bool run_tests = true, run_bench = true, prefill_only = false;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--no-bench")) run_bench = false;
    if (!strcmp(argv[i], "--bench-only")) run_tests = false;
    if (!strcmp(argv[i], "--prefill-only")) prefill_only = true;  // tokens 256..2048 only
    if (!strcmp(argv[i], "--no-w8a8")) g_w8a8 = false;            // (an older kernel has none)
    if (!strcmp(argv[i], "--no-fp4")) g_fp4 = false;              // (nor this)
    if (!strcmp(argv[i], "--modes") && i + 1 < argc) g_modes = argv[++i];
    if (!strcmp(argv[i], "--act")) g_act = true;   // gate_up with the epilogue (new kernels only)
    if (!strcmp(argv[i], "--tiles") && i + 1 < argc) {            // bm:bn,... then auto
      g_bench_tiles.clear();
      for (char* t = strtok(argv[++i], ","); t; t = strtok(nullptr, ",")) {
        int bm = 0, bn = 0;
        if (sscanf(t, "%d:%d", &bm, &bn) == 2) g_bench_tiles.push_back({t, bm, bn});
      }
      g_bench_tiles.push_back({"auto", 0, 0});
    }
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s, %d SMs, %.0f MB L2\n", prop.name, prop.multiProcessorCount,
         prop.l2CacheSize / 1e6);
  std::mt19937 rng(1234);
  if (run_tests) tests(rng);
  if (run_bench) bench(prefill_only);
  if (run_tests) printf("\n%s: %d failure(s)\n", g_failures ? "FAILED" : "OK", g_failures);
  return g_failures ? 1 : 0;
}
