// Standalone harness of the CUDA select_blocks kernel (SPEC §8; no JAX needed): the kernel
// against this file's own brute-force host oracle (float64 dot products of the stored values,
// the selection rule written out step by step), batch / pool invariance, then timings (a CUDA
// graph of many launches, CUDA events) next to the floor = key bytes / 4.25 TB/s and the
// measured device-to-device copy rate.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Iffi/include -Iffi/cuda \
//        tests/cuda/select_harness.cu ffi/cuda/select.cu -o select_harness
//   ./select_harness [--no-bench | --bench-only] [--quick]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "m3sparse/common.h"
#include "m3sparse/nvfp4.h"
#include "m3sparse_cuda.h"
#include "harness_util.cuh"

using namespace m3sparse;
using namespace m3sparse::cuda;

// ------------------------------------------------------------------ a case and its oracle
struct Case {
  int64_t T = 0, Hkv = 1, Di = 128, P = 0, L = 1, N = 128, R = 0, M = 0, K = 16, local = 1;
  bool q_f32 = false, fp8 = false, four_d = false;
  int32_t layer = 0;
  std::vector<float> q;             // [T, Hkv, Di] values (bf16-exact when !q_f32)
  std::vector<uint8_t> keys;        // [L, P, N, Di] bf16 (2 bytes, little endian) or e4m3 bytes
  std::vector<int32_t> table, req, pos;
};

static double key_value(const Case& c, int64_t idx) {
  if (c.fp8) return double(e4m3_to_float(c.keys[idx]));
  uint16_t h;
  memcpy(&h, &c.keys[2 * idx], 2);
  return double(bf16_to_float(h));
}

static void set_key(Case& c, int64_t idx, float v) {
  if (c.fp8) {  // v must be an E4M3 value (or NaN)
    uint8_t best = 0x7F;
    if (!std::isnan(v))
      for (int b = 0; b < 256; ++b)
        if ((b & 0x7F) != 0x7F && e4m3_to_float(uint8_t(b)) == v) { best = uint8_t(b); break; }
    c.keys[idx] = best;
  } else {
    const uint16_t h = float_to_bf16(v);
    memcpy(&c.keys[2 * idx], &h, 2);
  }
}

// SPEC §8, step by step, in float64 (every product of bf16/E4M3 and fp32 is exact in float64;
// the sums are within an ulp of fp32's at these sizes).
static std::vector<double> oracle_scores(const Case& c, int64_t t, int64_t g, bool* padding) {
  const int64_t r = c.req[t], p = c.pos[t];
  *padding = r < 0 || r >= c.R || p < 0 || c.layer < 0 || c.layer >= c.L;
  std::vector<double> s;
  if (*padding) return s;
  const int64_t own = p / c.N;
  const int64_t last = std::min(own, c.M - 1);
  for (int64_t b = 0; b <= last; ++b) {
    double best = -INFINITY;
    const int64_t page = c.table[r * c.M + b];
    if (page >= 0 && page < c.P) {
      for (int64_t o = 0; o < c.N && b * c.N + o <= p; ++o) {
        double dot = 0.0;
        const int64_t kbase = ((int64_t(c.layer) * c.P + page) * c.N + o) * c.Di;
        for (int64_t d = 0; d < c.Di; ++d)
          dot += double(c.q[(t * c.Hkv + g) * c.Di + d]) * key_value(c, kbase + d);
        if (!std::isnan(dot) && dot > best) best = dot;
      }
    }
    s.push_back(best);
  }
  return s;
}

struct Row {
  std::vector<int32_t> ids;       // K entries
  std::vector<double> scores;     // per candidate block
  int64_t nloc = 0;
};

static Row oracle_row(const Case& c, int64_t t, int64_t g) {
  Row row;
  bool padding;
  row.scores = oracle_scores(c, t, g, &padding);
  row.ids.assign(c.K, -1);
  if (padding || c.M == 0) return row;
  const int64_t own = c.pos[t] / c.N, last = std::min(own, c.M - 1);
  std::vector<int64_t> out;
  for (int64_t b = std::max<int64_t>(0, own - c.local + 1); b <= last; ++b) out.push_back(b);
  row.nloc = std::min<int64_t>(int64_t(out.size()), c.K);
  const int64_t lo = std::max<int64_t>(0, own - c.local + 1);
  std::vector<int64_t> rest;
  for (int64_t b = 0; b < std::min(lo, last + 1); ++b)
    if (std::isfinite(row.scores[b])) rest.push_back(b);
  std::stable_sort(rest.begin(), rest.end(), [&](int64_t a, int64_t b) {
    return row.scores[a] > row.scores[b];  // stable: ties keep the lower id first
  });
  out.insert(out.end(), rest.begin(), rest.end());
  for (int64_t k = 0; k < c.K && k < int64_t(out.size()); ++k) row.ids[k] = int32_t(out[k]);
  return row;
}

// ------------------------------------------------------------------ running the kernel
static std::vector<int32_t> run_kernel(const Case& c) {
  std::vector<uint16_t> qb;
  const size_t nq = c.q.size();
  void* dq;
  if (c.q_f32) {
    CK(cudaMalloc(&dq, std::max<size_t>(4, nq * 4)));
    if (nq) CK(cudaMemcpy(dq, c.q.data(), nq * 4, cudaMemcpyHostToDevice));
  } else {
    qb.resize(nq);
    for (size_t i = 0; i < nq; ++i) qb[i] = float_to_bf16(c.q[i]);
    CK(cudaMalloc(&dq, std::max<size_t>(2, nq * 2)));
    if (nq) CK(cudaMemcpy(dq, qb.data(), nq * 2, cudaMemcpyHostToDevice));
  }
  auto up = [](const void* src, size_t bytes) {
    void* d;
    CK(cudaMalloc(&d, std::max<size_t>(16, bytes)));
    if (bytes) CK(cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice));
    return d;
  };
  void* dk = up(c.keys.data(), c.keys.size());
  void* dt = up(c.table.data(), c.table.size() * 4);
  void* dr = up(c.req.data(), c.req.size() * 4);
  void* dp = up(c.pos.data(), c.pos.size() * 4);
  void* dl = up(&c.layer, 4);
  const size_t nout = size_t(c.Hkv * c.T * c.K);
  int32_t* dout;
  CK(cudaMalloc(&dout, std::max<size_t>(4, nout * 4)));
  CK(cudaMemset(dout, 0x5A, std::max<size_t>(4, nout * 4)));  // garbage the kernel must replace
  SelectParams p = {};
  p.idx_q = dq;
  p.idx_k = dk;
  p.block_table = static_cast<int32_t*>(dt);
  p.query_req_id = static_cast<int32_t*>(dr);
  p.query_abs_pos = static_cast<int32_t*>(dp);
  p.layer = static_cast<int32_t*>(dl);
  p.topk_indices = dout;
  p.num_tokens = c.T;
  p.num_kv_heads = int32_t(c.Hkv);
  p.head_dim = int32_t(c.Di);
  p.num_pages = c.P;
  p.num_layers = c.L;
  p.block_size = c.N;
  p.num_requests = int32_t(c.R);
  p.max_blocks = int32_t(c.M);
  p.topk = c.K;
  p.local_blocks = c.local;
  p.q_dtype = c.q_f32 ? DType::kF32 : DType::kBF16;
  p.key_fp8 = c.fp8;
  CK(launch_select_blocks(p, 0));
  CK(cudaDeviceSynchronize());
  std::vector<int32_t> out(nout);
  if (nout) CK(cudaMemcpy(out.data(), dout, nout * 4, cudaMemcpyDeviceToHost));
  for (void* x : {dq, dk, dt, dr, dp, dl, static_cast<void*>(dout)}) CK(cudaFree(x));
  return out;
}

// exact: the ids must equal the oracle's. Otherwise two ids may trade places only where the
// oracle's scores of the two are within tol (last-bit differences, SPEC §8 step 6).
static bool check(const Case& c, const std::vector<int32_t>& got, bool exact, std::string* why) {
  int bad = 0;
  for (int64_t g = 0; g < c.Hkv; ++g)
    for (int64_t t = 0; t < c.T; ++t) {
      const Row want = oracle_row(c, t, g);
      const int32_t* row = &got[(g * c.T + t) * c.K];
      bool ok = true;
      for (int64_t k = 0; k < c.K && ok; ++k) {
        const int32_t a = row[k], b = want.ids[k];
        if (a == b) continue;
        if (exact || k < want.nloc || a < 0 || b < 0 || a >= int32_t(want.scores.size())) {
          ok = false;
          break;
        }
        const double sa = want.scores[a], sb = want.scores[b];
        const double tol = 1e-5 * (1.0 + std::fabs(sb));
        ok = std::isfinite(sa) && std::fabs(sa - sb) <= tol;
      }
      std::vector<int32_t> ids(row, row + c.K);  // no duplicates
      std::sort(ids.begin(), ids.end());
      for (int64_t k = 1; k < c.K; ++k)
        if (ids[k] >= 0 && ids[k] == ids[k - 1]) ok = false;
      if (!ok && bad++ < 3) {
        char buf[256];
        snprintf(buf, sizeof buf, "row t=%lld g=%lld (req %d pos %d): got", (long long)t,
                 (long long)g, c.req[t], c.pos[t]);
        *why += buf;
        for (int64_t k = 0; k < std::min<int64_t>(c.K, 12); ++k) *why += " " + std::to_string(row[k]);
        *why += " want";
        for (int64_t k = 0; k < std::min<int64_t>(c.K, 12); ++k)
          *why += " " + std::to_string(want.ids[k]);
        *why += "; ";
      }
    }
  return bad == 0;
}

// ------------------------------------------------------------------ building cases
// Requests with context lengths ctx[r]; each owns its pages (scattered over a pool of P pages);
// tokens: for request r, the positions listed in rows[r] (consecutive tokens, one run).
struct Spec {
  int64_t Hkv = 1, Di = 128, N = 128, K = 16, local = 1, extra_pages = 7, L = 1;
  bool q_f32 = false, fp8 = false, exact = true, four_d = false;
  int32_t layer = 0;
  std::vector<int64_t> ctx;                  // keys per request
  std::vector<std::vector<int32_t>> rows;    // positions of each request's tokens
  int64_t M = -1;                            // -1: enough blocks for the longest context
};

static float exact_q(std::mt19937& rng, bool f32) {
  // bf16: k/4, |k| <= 8; fp32: k/4 + j/256 (9 significant bits: needs more than one bf16
  // part); every dot product of these with the test keys is exact in fp32
  const float a = float(int(rng() % 17) - 8) / 4.0f;
  return f32 ? a + float(int(rng() % 65) - 32) / 256.0f : a;
}

static Case build(std::mt19937& rng, const Spec& s) {
  Case c;
  c.Hkv = s.Hkv;
  c.Di = s.Di;
  c.N = s.N;
  c.K = s.K;
  c.local = s.local;
  c.q_f32 = s.q_f32;
  c.fp8 = s.fp8;
  c.L = s.L;
  c.layer = s.layer;
  c.four_d = s.four_d;
  c.R = int64_t(s.ctx.size());
  int64_t maxb = 1;
  for (int64_t x : s.ctx) maxb = std::max(maxb, (x + c.N - 1) / c.N);
  c.M = s.M >= 0 ? s.M : maxb;
  int64_t need = 0;
  for (int64_t x : s.ctx) need += (x + c.N - 1) / c.N;
  c.P = need + s.extra_pages;
  std::vector<int32_t> perm(c.P);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  c.table.assign(c.R * c.M, -1);
  int64_t next = 0;
  for (int64_t r = 0; r < c.R; ++r)
    for (int64_t b = 0; b < (s.ctx[r] + c.N - 1) / c.N && b < c.M; ++b) c.table[r * c.M + b] = perm[next++];
  const int64_t esz = c.fp8 ? 1 : 2;
  c.keys.assign(size_t(c.L * c.P * c.N * c.Di * esz), 0);
  const int64_t nk = c.L * c.P * c.N * c.Di;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t i = 0; i < nk; ++i) {
    float v;
    if (c.fp8) {  // exact data: 0 or 2^-1 <= |v| <= 7.5 (exponent field 6..9); else any
      uint8_t b;       // non-NaN byte of magnitude <= 240
      do b = uint8_t(rng());
      while ((b & 0x7F) == 0x7F || (s.exact ? ((b & 0x7F) != 0 && ((b & 0x78) < 0x30 || (b & 0x78) > 0x48))
                                            : (b & 0x78) > 0x68));
      c.keys[i] = b;
      continue;
    }
    v = s.exact ? float(int(rng() % 9) - 4) / 4.0f : nd(rng);
    set_key(c, i, v);
  }
  for (int64_t r = 0; r < c.R; ++r)
    for (int32_t p : s.rows[r]) {
      c.req.push_back(int32_t(r));
      c.pos.push_back(p);
    }
  c.T = int64_t(c.req.size());
  c.q.resize(size_t(c.T * c.Hkv * c.Di));
  for (auto& x : c.q) x = s.exact ? exact_q(rng, c.q_f32) : (c.q_f32 ? nd(rng) : bf16_to_float(float_to_bf16(nd(rng))));
  return c;
}

static std::vector<int32_t> decode_rows(int64_t ctx, int dql) {
  std::vector<int32_t> v;
  for (int i = 0; i < dql; ++i) v.push_back(int32_t(ctx - dql + i));
  return v;
}

static void test_case(const std::string& name, const Case& c, bool exact) {
  const std::vector<int32_t> got = run_kernel(c);
  std::string why;
  report(check(c, got, exact, &why), name, why);
}

static void test(std::mt19937& rng, const std::string& name, const Spec& s) {
  test_case(name, build(rng, s), s.exact);
}

// A row's ids alone vs in the batch, and with its pages moved into a 3x larger pool.
static void test_invariance(std::mt19937& rng, const std::string& name, Spec s) {
  s.exact = false;
  Case c = build(rng, s);
  const std::vector<int32_t> all = run_kernel(c);
  bool same = true;
  int64_t t0 = 0;
  for (int64_t r = 0; r < c.R; ++r) {  // request r alone (its tokens only, the same pool)
    const int64_t n = int64_t(s.rows[r].size());
    Case one = c;
    one.T = n;
    one.req.assign(c.req.begin() + t0, c.req.begin() + t0 + n);
    one.pos.assign(c.pos.begin() + t0, c.pos.begin() + t0 + n);
    one.q.assign(c.q.begin() + t0 * c.Hkv * c.Di, c.q.begin() + (t0 + n) * c.Hkv * c.Di);
    const std::vector<int32_t> alone = run_kernel(one);
    for (int64_t g = 0; g < c.Hkv; ++g)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t k = 0; k < c.K; ++k)
          same &= alone[(g * n + i) * c.K + k] == all[(g * c.T + t0 + i) * c.K + k];
    t0 += n;
  }
  report(same, name + ": bit-identical alone and in the batch");
  // pool: 3x the pages, every page moved (keys copied), the table rewritten
  Case big = c;
  big.P = 3 * c.P + 5;
  const int64_t esz = c.fp8 ? 1 : 2, pb = c.N * c.Di * esz;
  big.keys.assign(size_t(c.L * big.P * pb), 0x11);
  std::vector<int32_t> perm(big.P);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int64_t l = 0; l < c.L; ++l)
    for (int64_t pg = 0; pg < c.P; ++pg)
      memcpy(&big.keys[(l * big.P + perm[pg]) * pb], &c.keys[(l * c.P + pg) * pb], size_t(pb));
  for (auto& x : big.table)
    if (x >= 0 && x < c.P) x = perm[x];
  report(run_kernel(big) == all, name + ": bit-identical in a 3x pool with other pages");
  std::string why;
  report(check(c, all, false, &why), name + ": against the oracle", why);
}

// ------------------------------------------------------------------ timings
__global__ void fill_random(uint8_t* p, uint64_t n, bool fp8) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n / 2;
       i += uint64_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 0x9E3779B1u + uint32_t(i >> 32) * 0x85EBCA77u;
    x ^= x >> 15;
    x *= 0x2C1B3C6Du;
    x ^= x >> 12;
    uint16_t v;
    if (fp8) v = uint16_t(x & 0x3737u);  // no NaN bytes
    else v = uint16_t(0x3C00u | (x & 0x83FFu)) ^ 0x0080u;  // bf16 in about ±[0.5, 2)
    reinterpret_cast<uint16_t*>(p)[i] = v;
  }
}

// microseconds per launch: a CUDA graph of n launches (launch i on block table i % nvar of
// `tables`, each `stride` entries), median of reps replays
static double time_graph(SelectParams p, int32_t* tables, int64_t stride, int nvar, int n = 20,
                         int reps = 7) {
  return time_graph([&](int v, cudaStream_t s) {
    p.block_table = tables + v * stride;
    CK(launch_select_blocks(p, s));
  }, nvar, n, reps, 2);
}

static uint8_t* g_pool = nullptr;
static uint64_t g_pool_bytes = 0;

// rows: `nreq` requests of `dql` rows each (or one prefill chunk of `chunk` tokens) at context
// `ctx`; pages scattered over a pool of `pages` pages. nvar > 1: cold keys, as in a model step
// (where each layer reads other keys): nvar block tables of distinct pages, one per launch of
// the graph, so a replay reads nvar times the keys (more than the L2 holds).
static void bench(std::mt19937& rng, const char* label, int nreq, int dql, int chunk, int64_t ctx,
                  int Hkv, bool fp8, bool q_f32, int64_t pages, double copy_tbs, int nvar = 1) {
  const int64_t N = 128, Di = 128, esz = fp8 ? 1 : 2, page_bytes = N * Di * esz;
  if (uint64_t(pages * page_bytes) > g_pool_bytes) {
    printf("TABLE %s: skipped (pool of %lld pages does not fit)\n", label, (long long)pages);
    return;
  }
  const int64_t M = (ctx + N - 1) / N;
  const int R = nreq;
  std::vector<int32_t> table(size_t(nvar) * R * M), req, pos;
  // distinct random pages (a permutation prefix when they fit)
  std::vector<int32_t> perm(pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (size_t i = 0; i < table.size(); ++i) table[i] = perm[i % pages];
  for (int r = 0; r < R; ++r) {
    const int rows = chunk > 0 ? chunk : dql;
    for (int i = 0; i < rows; ++i) {
      req.push_back(r);
      pos.push_back(int32_t(ctx - rows + i));
    }
  }
  const int64_t T = int64_t(req.size());
  std::vector<float> q(size_t(T * Hkv * Di));
  std::normal_distribution<float> nd;
  for (auto& x : q) x = nd(rng);
  std::vector<uint16_t> qb(q.size());
  for (size_t i = 0; i < q.size(); ++i) qb[i] = float_to_bf16(q[i]);
  void *dq, *dt, *dr, *dp, *dl, *dout;
  CK(cudaMalloc(&dq, q.size() * 4));
  if (q_f32) CK(cudaMemcpy(dq, q.data(), q.size() * 4, cudaMemcpyHostToDevice));
  else CK(cudaMemcpy(dq, qb.data(), qb.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&dt, table.size() * 4));
  CK(cudaMemcpy(dt, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&dr, T * 4));
  CK(cudaMemcpy(dr, req.data(), T * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&dp, T * 4));
  CK(cudaMemcpy(dp, pos.data(), T * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&dl, 4));
  CK(cudaMemset(dl, 0, 4));
  const int64_t K = 16;
  CK(cudaMalloc(&dout, Hkv * T * K * 4));
  SelectParams p = {};
  p.idx_q = dq;
  p.idx_k = g_pool;
  p.block_table = static_cast<int32_t*>(dt);
  p.query_req_id = static_cast<int32_t*>(dr);
  p.query_abs_pos = static_cast<int32_t*>(dp);
  p.layer = static_cast<int32_t*>(dl);
  p.topk_indices = static_cast<int32_t*>(dout);
  p.num_tokens = T;
  p.num_kv_heads = Hkv;
  p.head_dim = int32_t(Di);
  p.num_pages = pages;
  p.num_layers = 1;
  p.block_size = N;
  p.num_requests = R;
  p.max_blocks = int32_t(M);
  p.topk = K;
  p.local_blocks = 1;
  p.q_dtype = q_f32 ? DType::kF32 : DType::kBF16;
  p.key_fp8 = fp8;
  const double us = nvar > 1 ? time_graph(p, static_cast<int32_t*>(dt), int64_t(R) * M, nvar, nvar)
                             : time_graph(p, static_cast<int32_t*>(dt), 0, 1);
  // bytes: each request's visible keys once; flops: every (row, visible key) dot product
  double bytes = 0, flops = 0;
  for (int r = 0; r < R; ++r) bytes += double(std::min<int64_t>(ctx, M * N)) * Di * esz;
  for (int64_t t = 0; t < T; ++t) flops += 2.0 * Hkv * Di * double(pos[t] + 1);
  const double floor_us = bytes / 4.25e12 * 1e6;
  printf("TABLE %-44s T=%-5lld Hkv=%d %s keys, %s q, pool %lld pages: %8.2f us | keys %.1f MB, "
         "floor %.2f us (x%.2f), %.2f TB/s (%.0f%% of copy %.2f), %.1f TFLOP/s\n",
         label, (long long)T, Hkv, fp8 ? "fp8 " : "bf16", q_f32 ? "f32 " : "bf16",
         (long long)pages, us, bytes / 1e6, floor_us, us / floor_us, bytes / us / 1e6,
         100.0 * bytes / us / 1e6 / copy_tbs, copy_tbs, flops / us / 1e6);
  fflush(stdout);
  for (void* x : {dq, dt, dr, dp, dl, dout}) CK(cudaFree(x));
}

int main(int argc, char** argv) {
  bool tests = true, bench_on = true, quick = false;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--no-bench")) bench_on = false;
    if (!strcmp(argv[i], "--bench-only")) tests = false;
    if (!strcmp(argv[i], "--quick")) quick = true;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s, %d SMs, %.0f MB L2, cc %d.%d\n", prop.name, prop.multiProcessorCount,
         prop.l2CacheSize / 1e6, prop.major, prop.minor);
  std::mt19937 rng(4321);

  if (tests) {
    // decode rows of several requests (dql 1), every key dtype and q dtype; exact data
    for (int fp8 = 0; fp8 < 2; ++fp8)
      for (int f32 = 0; f32 < 2; ++f32) {
        Spec s;
        s.fp8 = fp8;
        s.q_f32 = f32;
        s.Hkv = 2;
        s.K = 6;
        s.ctx = {1, 127, 128, 129, 700, 1500, 2049, 256};
        for (int64_t x : s.ctx) s.rows.push_back(decode_rows(x, 1));
        test(rng, std::string("decode dql=1 ") + (fp8 ? "fp8" : "bf16") + " keys, " +
                      (f32 ? "f32" : "bf16") + " q, block boundaries", s);
      }
    {  // dql > 1 runs, Hkv 4
      Spec s;
      s.Hkv = 4;
      s.K = 5;
      s.q_f32 = true;
      s.ctx = {300, 1025, 2000, 90};
      for (int64_t x : s.ctx) s.rows.push_back(decode_rows(x, 4));
      test(rng, "decode dql=4 Hkv=4 f32 q", s);
    }
    {  // local_blocks 2 and K above the blocks so far
      Spec s;
      s.local = 2;
      s.K = 40;
      s.ctx = {5, 130, 257, 640, 900};
      for (int64_t x : s.ctx) s.rows.push_back(decode_rows(x, 3));
      test(rng, "local_blocks=2, K=40 above the blocks so far", s);
      s.local = 1;
      test(rng, "local_blocks=1, K=40", s);
      s.local = 100;
      test(rng, "local_blocks=100 (every block local)", s);
      s.K = 1;
      s.local = 2;
      test(rng, "K=1 local_blocks=2 (the local block alone)", s);
    }
    {  // a mixed chunk: prefill runs of several requests (> 32 rows: several pieces), decode rows
      Spec s;
      s.Hkv = 2;
      s.K = 8;
      s.q_f32 = true;
      s.ctx = {1000, 400, 2300, 64};
      std::vector<int32_t> pre0, pre2;
      for (int i = 0; i < 70; ++i) pre0.push_back(1000 - 70 + i);
      for (int i = 0; i < 45; ++i) pre2.push_back(2300 - 45 + i);
      s.rows = {pre0, decode_rows(400, 1), pre2, decode_rows(64, 2)};
      test(rng, "mixed chunk: prefill runs of 70 and 45 tokens, decode rows, Hkv=2", s);
      s.fp8 = true;
      test(rng, "mixed chunk, fp8 keys", s);
    }
    {  // 4-D cache, layers
      Spec s;
      s.L = 3;
      s.four_d = true;
      s.K = 6;
      s.ctx = {500, 900, 129};
      for (int64_t x : s.ctx) s.rows.push_back(decode_rows(x, 2));
      s.layer = 1;
      test(rng, "4-D cache, layer 1 of 3", s);
      s.layer = 2;
      s.fp8 = true;
      test(rng, "4-D fp8 cache, layer 2 of 3", s);
      s.layer = 3;
      test(rng, "4-D cache, layer 3 outside [0, 3): every row -1", s);
      s.layer = -1;
      test(rng, "4-D cache, layer -1: every row -1", s);
    }
    {  // padding rows: request -1, R, position -1; invalid pages (a local block's page too)
      std::mt19937 r2(7);
      Spec s;
      s.K = 7;
      s.Hkv = 3;
      s.ctx = {800, 1000, 300};
      for (int64_t x : s.ctx) s.rows.push_back(decode_rows(x, 2));
      Case c = build(r2, s);
      c.req[0] = -1;
      c.req[2] = int32_t(c.R);
      c.pos[3] = -1;
      c.req.push_back(1 << 30);
      c.pos.push_back(5);
      c.req.push_back(1);
      c.pos.push_back(-7);
      c.T += 2;
      c.q.resize(size_t(c.T * c.Hkv * c.Di), 0.5f);
      c.table[1 * c.M + 2] = -1;                 // request 1: block 2 invalid
      c.table[1 * c.M + 7] = int32_t(c.P);       // request 1: its local block's page invalid
      c.table[0 * c.M + 3] = 1 << 30;
      test_case("padding rows (req -1, R, 2^30; pos -1, -7), invalid pages (local one too)", c, true);
    }
    {  // exact ties: blocks with identical keys (ties go to the lower id), NaN keys
      std::mt19937 r2(11);
      for (int fp8 = 0; fp8 < 2; ++fp8) {
        Spec s;
        s.fp8 = fp8;
        s.K = 12;
        s.ctx = {2048, 1700};
        for (int64_t x : s.ctx) s.rows.push_back(decode_rows(x, 2));
        Case c = build(r2, s);
        const int64_t esz = c.fp8 ? 1 : 2, pb = c.N * c.Di * esz;
        auto page = [&](int r, int b) { return int64_t(c.table[r * c.M + b]); };
        for (int b : {3, 9, 12})   // blocks 3, 9, 12 of request 0 = block 5's keys
          memcpy(&c.keys[page(0, b) * pb], &c.keys[page(0, 5) * pb], size_t(pb));
        memcpy(&c.keys[page(1, 0) * pb], &c.keys[page(1, 8) * pb], size_t(pb));
        // NaN keys: one key of block 1 (the others count), every key of block 2 (-inf)
        set_key(c, page(0, 1) * c.N * c.Di + 17 * c.Di + 3, NAN);
        for (int64_t o = 0; o < c.N; ++o) set_key(c, (page(0, 2) * c.N + o) * c.Di + 5, NAN);
        test_case(std::string("exact ties and NaN keys, ") + (fp8 ? "fp8" : "bf16"), c, true);
      }
    }
    {  // FP8 keys multiply in f16 after scaling each row's q by a power of two: rows whose q
       // sits anywhere in the exponent range (2^-120 .. 2^100), a zero row (every block ties),
       // rows holding +inf or NaN elements; exact data, so the ids equal the oracle's
      std::mt19937 r2(17);
      for (int f32 = 0; f32 < 2; ++f32) {
        Spec s;
        s.fp8 = true;
        s.q_f32 = f32;
        s.K = 8;
        s.ctx = {1500, 2049, 900, 1300, 700, 1024, 2000, 640, 1800};
        for (int64_t x : s.ctx) s.rows.push_back(decode_rows(x, 1));
        Case c = build(r2, s);
        const int e[] = {-120, -60, -20, 20, 60, 100};
        for (int64_t t = 0; t < c.T; ++t)
          for (int64_t d = 0; d < c.Di; ++d) {
            float& x = c.q[t * c.Di + d];
            if (t < 6) x = std::ldexp(x, e[t]);
            else if (t == 6) x = 0.0f;
            else if (t == 7 && d == 5) x = INFINITY;
            else if (t == 8 && d == 9) x = NAN;
          }
        test_case(std::string("fp8 keys, q scaled 2^-120..2^100, zero, inf and NaN rows, ") +
                      (f32 ? "f32" : "bf16") + " q", c, true);
      }
    }
    {  // split blocks: pieces of few blocks spread a block's units over 2, 4 or 8 warps (the
       // max of the warps' parts); block counts 1..40 (S = 8, 4, 2, 1 and CTAs with fewer
       // blocks than others), N = 96 (6 bf16 / 3 fp8 units: not a multiple of the split)
      std::mt19937 r2(13);
      for (int64_t N : {128, 96})
        for (int fp8 = 0; fp8 < 2; ++fp8) {
          Spec s;
          s.N = N;
          s.fp8 = fp8;
          s.q_f32 = N == 96;
          s.Hkv = 2;
          s.K = 8;
          for (int64_t nb : {1, 3, 5, 8, 9, 11, 13, 16, 17, 27, 33, 40}) {
            s.ctx.push_back(nb * N - int64_t(r2() % 20));
            s.rows.push_back(decode_rows(s.ctx.back(), nb % 3 == 0 ? 3 : 1));
          }
          Case c = build(r2, s);
          const std::string tag = std::string(fp8 ? "fp8" : "bf16") + " N=" + std::to_string(N);
          test_case("split blocks (1..40 blocks), exact, " + tag, c, true);
          // invalid pages (request 2's block 1; request 5's local block) and NaN keys (one key
          // of request 7's block 4; one dim of every key of request 9's block 2) in split pieces
          c.table[2 * c.M + 1] = -1;
          c.table[5 * c.M + 10] = int32_t(c.P);
          auto key0 = [&](int r, int b) { return int64_t(c.table[r * c.M + b]) * c.N * c.Di; };
          set_key(c, key0(7, 4) + 37 * c.Di + 9, NAN);
          for (int64_t o = 0; o < c.N; ++o) set_key(c, key0(9, 2) + o * c.Di + 1, NAN);
          test_case("split blocks, invalid pages and NaN keys, " + tag, c, true);
        }
    }
    {  // the split never changes a bit: a row alone in its piece (1..33 blocks, S = 8..1) and
       // the same row next to a later row of its request (47 blocks: S = 1); random data
      std::mt19937 r2(17);
      for (int v = 0; v < 3; ++v) {
        Spec s;
        s.exact = false;
        s.fp8 = v == 1;
        s.q_f32 = v == 2;
        s.Hkv = 2;
        for (int32_t p : {60, 500, 1000, 1500, 1900, 2100, 3000, 4100}) {
          s.ctx.push_back(6000);
          s.rows.push_back({p});
        }
        const Case c = build(r2, s);
        Case w = c;  // token t -> tokens 2t (the same row) and 2t + 1 (position 5999)
        w.req.clear();
        w.pos.clear();
        w.q.clear();
        std::normal_distribution<float> nd;
        for (int64_t t = 0; t < c.T; ++t) {
          for (int e = 0; e < 2; ++e) {
            w.req.push_back(c.req[t]);
            w.pos.push_back(e ? 5999 : c.pos[t]);
          }
          w.q.insert(w.q.end(), c.q.begin() + t * c.Hkv * c.Di, c.q.begin() + (t + 1) * c.Hkv * c.Di);
          for (int64_t i = 0; i < c.Hkv * c.Di; ++i)
            w.q.push_back(c.q_f32 ? nd(r2) : bf16_to_float(float_to_bf16(nd(r2))));
        }
        w.T = 2 * c.T;
        const std::vector<int32_t> alone = run_kernel(c), wide = run_kernel(w);
        bool same = true;
        for (int64_t g = 0; g < c.Hkv; ++g)
          for (int64_t t = 0; t < c.T; ++t)
            for (int64_t k = 0; k < c.K; ++k)
              same &= alone[(g * c.T + t) * c.K + k] == wide[(g * w.T + 2 * t) * c.K + k];
        const std::string tag = v == 1 ? "fp8 keys" : v == 2 ? "bf16 keys, f32 q" : "bf16 keys";
        report(same, "split invariance (split pieces vs S = 1), " + tag);
        std::string why;
        report(check(c, alone, false, &why), "split pieces against the oracle, " + tag, why);
      }
    }
    {  // empty cases: R = 0 (every row padding), M = 0
      std::mt19937 r2(5);
      Spec s;
      s.ctx = {300};
      s.rows = {decode_rows(300, 2)};
      Case c = build(r2, s);
      Case c0 = c;
      c0.R = 0;
      c0.table.clear();
      c0.M = 0;
      test_case("R = 0: every row -1", c0, true);
      Case c1 = c;
      c1.M = 0;
      c1.table.clear();
      test_case("M = 0: every row -1", c1, true);
      Case c2 = c;
      c2.P = 0;
      c2.keys.clear();
      test_case("P = 0: the local block only", c2, true);
    }
    {  // head_dim 64, block_size 32, a wide table (pieces of fewer rows); positions past the table
      Spec s;
      s.Di = 64;
      s.N = 32;
      s.K = 9;
      s.ctx = {5000, 3000};
      s.rows = {decode_rows(5000, 3), decode_rows(3000, 40)};
      test(rng, "Di=64 N=32, 40-token run", s);
      s.fp8 = true;
      s.q_f32 = true;
      test(rng, "Di=64 N=32 fp8 keys f32 q", s);
      Spec w = s;
      w.M = 5000;  // M·rows too wide for 32-row pieces
      w.ctx = {5000 * 32};
      w.rows = {decode_rows(5000 * 32, 3)};
      w.fp8 = false;
      test(rng, "M=5000 (narrower pieces)", w);
      Spec past = s;
      past.M = 20;                                   // positions past the table: blocks < M
      past.ctx = {640};
      past.rows = {{900, 901, 2000}};
      past.local = 2;
      test(rng, "positions past the table (pos // N >= M), local_blocks 2", past);
    }
    {  // random data: tolerant comparison, then the invariance checks
      Spec s;
      s.exact = false;
      s.q_f32 = true;
      s.Hkv = 4;
      s.K = 16;
      s.ctx = {4000, 130, 2500, 6000, 1000, 333};
      std::vector<int32_t> pre;
      for (int i = 0; i < 100; ++i) pre.push_back(2500 - 100 + i);
      s.rows = {decode_rows(4000, 1), decode_rows(130, 1), pre, decode_rows(6000, 4),
                decode_rows(1000, 2), decode_rows(333, 1)};
      test(rng, "random f32 q, bf16 keys, Hkv=4 (tolerance 1e-5 for swaps)", s);
      test_invariance(rng, "random f32 q bf16 keys Hkv=4", s);
      s.fp8 = true;
      test_invariance(rng, "random f32 q fp8 keys Hkv=4", s);
      s.fp8 = false;
      s.q_f32 = false;
      s.Hkv = 1;
      test_invariance(rng, "random bf16 q bf16 keys Hkv=1", s);
      Spec many;
      many.exact = false;
      many.q_f32 = true;
      many.K = 16;
      for (int r = 0; r < 150; ++r) {
        many.ctx.push_back(200 + int64_t(rng() % 3000));
        many.rows.push_back(decode_rows(many.ctx.back(), 1));
      }
      test_invariance(rng, "150 decode requests (several pieces per cluster)", many);
    }
  }

  if (bench_on) {
    const double copy = copy_bandwidth();
    printf("TABLE copy bandwidth (cudaMemcpy D2D 2 GiB, read+write): %.3f TB/s\n", copy);
    const int64_t pool_pages = 16512, big_pages = 16 * 16512;
    g_pool_bytes = uint64_t(big_pages) * 128 * 128 * 2;  // 8.7 GB: 16x pool in bf16
    CK(cudaMalloc(&g_pool, g_pool_bytes));
    for (int fp8 = 0; fp8 < 2; ++fp8) {
      fill_random<<<4096, 256>>>(g_pool, g_pool_bytes / (fp8 ? 2 : 1), fp8);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      for (int f32 = 0; f32 < 2; ++f32) {
        if (quick && f32 && fp8) continue;
        bench(rng, "decode 128 req x 16k", 128, 1, 0, 16384, 1, fp8, f32, pool_pages, copy);
        if (!f32) bench(rng, "decode 128 req x 16k, 16x pool", 128, 1, 0, 16384, 1, fp8, f32,
                        big_pages, copy);
        bench(rng, "prefill 2048 @ 10k", 1, 1, 2048, 10240, 1, fp8, f32, pool_pages, copy);
        if (!f32) bench(rng, "prefill 2048 @ 10k, 16x pool", 1, 1, 2048, 10240, 1, fp8, f32,
                        big_pages, copy);
      }
      bench(rng, "decode 4 req x 2k", 4, 1, 0, 2048, 1, fp8, false, pool_pages, copy);
      bench(rng, "decode 64 req x 2k", 64, 1, 0, 2048, 1, fp8, false, pool_pages, copy);
      bench(rng, "decode 4 req x 2k, cold keys (64 tables)", 4, 1, 0, 2048, 1, fp8, false,
            big_pages, copy, 64);
      bench(rng, "decode 64 req x 2k, cold keys (64 tables)", 64, 1, 0, 2048, 1, fp8, false,
            big_pages, copy, 64);
      bench(rng, "decode 64 req x 4k", 64, 1, 0, 4096, 1, fp8, false, pool_pages, copy);
      bench(rng, "prefill 2048 @ 8k", 1, 1, 2048, 8192, 1, fp8, false, pool_pages, copy);
      bench(rng, "decode 128 req x 16k Hkv=4", 128, 1, 0, 16384, 4, fp8, false, pool_pages, copy);
      bench(rng, "decode 8 req x 16k", 8, 1, 0, 16384, 1, fp8, false, pool_pages, copy);
      bench(rng, "decode 32 req x 16k", 32, 1, 0, 16384, 1, fp8, false, pool_pages, copy);
      bench(rng, "decode 32 req x 16k Hkv=4", 32, 1, 0, 16384, 4, fp8, false, pool_pages, copy);
      bench(rng, "decode 32 req x 16k dql=4", 32, 4, 0, 16384, 1, fp8, false, pool_pages, copy);
      bench(rng, "prefill 2048 @ 10k Hkv=4", 1, 1, 2048, 10240, 4, fp8, false, pool_pages, copy);
      if (!quick) bench(rng, "decode 8 req x 128k", 8, 1, 0, 131072, 1, fp8, false, pool_pages, copy);
    }
    CK(cudaFree(g_pool));
  }
  printf("%s: %d failure(s)\n", g_failures ? "FAILED" : "OK", g_failures);
  return g_failures ? 1 : 0;
}
