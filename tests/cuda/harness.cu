// Standalone device harness of the CUDA backend (no JAX needed): exactness of the register
// dequantization, sparse_decode / sparse_prefill against a float64 host oracle that
// dequantizes the stored bytes (SPEC §6), pack_kv_pages byte-exact against nvfp4.h, then timings
// (CUDA graphs of many launches, CUDA events) next to the device-to-device copy bandwidth.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Iffi/include -Iffi/cuda \
//        tests/cuda/harness.cu ffi/cuda/attention.cu ffi/cuda/pack.cu -o m3sparse_harness
//   ./m3sparse_harness [--quick] [--no-bench | --bench-only | --prefill-only [--correlated] |
//                       --profile [--profile-shape NAME]]
//   (--prefill-only: the prefill timings alone, uniform and correlated selections; --profile:
//   the ncu shapes, decode T = 128 and pack 65536, or the one NAME of decode1, decode32,
//   decode128, dql4 (T = 128 sharing 12 of 16 blocks), prefill (correlated), pack)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "device_utils.cuh"
#include "harness_util.cuh"
#include "m3sparse/cache.h"
#include "m3sparse/common.h"
#include "m3sparse/nvfp4.h"
#include "m3sparse_cuda.h"

using namespace m3sparse;
using namespace m3sparse::cuda;

static int g_num_sms = 132;

template <typename T>
static T* dev_upload(const std::vector<T>& v) {
  T* d = nullptr;
  CK(cudaMalloc(&d, std::max<size_t>(1, v.size() * sizeof(T))));
  if (!v.empty()) CK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// ------------------------------------------------------------------ 0. dequantization exactness
template <typename T>
__global__ void dequant_probe(uint16_t* out) {
  // out[sf * 256 + byte] (element 2·byte_lo) and out[65536 + ...] (hi nibble)
  const int sf = blockIdx.x, byte = threadIdx.x;
  const uint32_t s = scale_multiplier<T>(sf);
  const uint32_t s2 = s | (s << 16);
  const uint32_t w = uint32_t(byte) | (uint32_t(byte) << 16) | (uint32_t(byte) << 8) |
                     (uint32_t(byte) << 24);
  uint32_t r[4];
  dequant8<T>(w, s2, r);
  // pair 0 = (nibble 0, nibble 4) = (byte lo, byte(2) lo); pair 1 = (nibble 1, nibble 5)
  out[sf * 256 + byte] = uint16_t(r[0] & 0xFFFF);
  out[65536 + sf * 256 + byte] = uint16_t(r[1] & 0xFFFF);
  // all four pairs must be consistent: lo/hi halves equal here
  if ((r[0] & 0xFFFF) != (r[0] >> 16) || (r[1] & 0xFFFF) != (r[1] >> 16) ||
      (r[2] & 0xFFFF) != (r[0] & 0xFFFF) || (r[3] & 0xFFFF) != (r[1] & 0xFFFF))
    out[2 * 65536] = 1;
  // the multiply form (default for bf16) against the shift/mask form on words whose 8 nibbles
  // differ: 65536 mixed words per scale byte
  for (int i = 0; i < 256; ++i) {
    const uint32_t x = (uint32_t(byte) << 8 | uint32_t(i)) * 0x9E3779B1u;
    const uint32_t v = x ^ (x >> 15) ^ (uint32_t(i) << 24);
    uint32_t a[4], b[4];
    dequant8<T, true>(v, s2, a);
    dequant8<T, false>(v, s2, b);
    if (a[0] != b[0] || a[1] != b[1] || a[2] != b[2] || a[3] != b[3]) out[2 * 65536] = 1;
  }
}

template <typename T>
static void test_dequant(const char* name, bool bf16) {
  std::vector<uint16_t> h(2 * 65536 + 1, 0);
  uint16_t* d = dev_upload(h);
  dequant_probe<T><<<256, 256>>>(d);
  CK(cudaGetLastError());
  CK(cudaMemcpy(h.data(), d, h.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaFree(d));
  const double comp = bf16 ? 256.0 : 128.0;
  long bad = 0;
  for (int sf = 0; sf < 256; ++sf)
    for (int byte = 0; byte < 256; ++byte)
      for (int hi = 0; hi < 2; ++hi) {
        const unsigned code = hi ? (byte >> 4) : (byte & 15);
        const double want = double(e2m1_to_float(code)) * double(e4m3_to_float(uint8_t(sf)));
        const uint16_t bits = h[hi * 65536 + sf * 256 + byte];
        const double got = (bf16 ? bf16_to_float(bits) : f16_to_float(bits)) * comp;
        const bool ok = std::isnan(want) ? std::isnan(got) : (got == want);
        if (!ok && bad++ < 5)
          printf("  %s sf=0x%02x code=0x%x want %.9g got %.9g\n", name, sf, code, want, got);
      }
  if (h[2 * 65536]) ++bad;
  char msg[128];
  snprintf(msg, sizeof msg, "dequant %s: all 256 scales x 16 codes exact (%ld mismatches)", name,
           bad);
  report(bad == 0, msg);
}

// ------------------------------------------------------------------ host cache + oracle
struct HostCase {
  CacheGeometry geom;
  int Hkv, T, K, R, M, dql, prefill, layer;
  int G = 16;  // query heads per KV head
  float scale, kscale, vscale;
  std::vector<uint8_t> cache;
  std::vector<uint16_t> q;  // bf16 or f16 bits
  std::vector<int32_t> topk, block_table, seq_lens, req_id, abs_pos;
  bool f16 = false;
};

static float qval(const HostCase& c, size_t i) {
  return c.f16 ? f16_to_float(c.q[i]) : bf16_to_float(c.q[i]);
}

// fp64 attention from the stored bytes (SPEC §5.2, §5.5, §6)
static std::vector<double> oracle(const HostCase& c, std::vector<char>* empty_rows) {
  const int D = 128, G = c.G, Hq = c.Hkv * G;
  std::vector<double> out(size_t(c.T) * Hq * D, 0.0);
  if (empty_rows) empty_rows->assign(size_t(c.T) * Hq, 1);
  const CacheGeometry& geo = c.geom;
  for (int t = 0; t < c.T; ++t) {
    int64_t r, pos;
    bool live;
    if (!c.prefill) {
      r = t / c.dql;
      live = r < c.R;
      pos = live ? int64_t(c.seq_lens[r]) - c.dql + t % c.dql : -1;
    } else {
      r = c.req_id[t];
      live = r >= 0 && r < c.R;
      pos = live ? c.abs_pos[t] : -1;
    }
    live = live && geo.valid_layer(c.layer);
    const int64_t vis = (live && pos >= 0) ? pos + 1 : 0;
    for (int g = 0; g < c.Hkv; ++g) {
      // attended keys: (tile offset K, token)
      std::vector<std::pair<int64_t, int>> keys;
      for (int k = 0; k < c.K; ++k) {
        if (vis <= 0) break;
        const int64_t b = c.topk[(int64_t(g) * c.T + t) * c.K + k];
        if (b < 0 || b >= c.M || b * 128 >= vis) continue;
        const int64_t page = c.block_table[r * c.M + b];
        if (!geo.valid_page(page)) continue;
        for (int o = 0; o < 128; ++o)
          if (b * 128 + o < vis) keys.push_back({geo.tile_offset(c.layer, page, 2 * g), o});
      }
      if (keys.empty()) continue;
      const size_t nk = keys.size();
      std::vector<double> kd(nk * D), vd(nk * D);
      for (size_t i = 0; i < nk; ++i) {
        for (int side = 0; side < 2; ++side) {
          const uint8_t* tile = c.cache.data() + keys[i].first + side * geo.tile_bytes();
          const int o = keys[i].second;
          const double gsc = side ? c.vscale : c.kscale;
          for (int d = 0; d < D; ++d) {
            const uint8_t byte = tile[o * 64 + d / 2];
            const unsigned code = (d & 1) ? (byte >> 4) : (byte & 15);
            const uint8_t sf = tile[8192 + o * 8 + d / 16];
            const double v = double(e2m1_to_float(code)) * double(e4m3_to_float(sf)) * gsc;
            (side ? vd : kd)[i * D + d] = v;
          }
        }
      }
      for (int h = 0; h < G; ++h) {
        const int hq = g * G + h;
        if (empty_rows) (*empty_rows)[size_t(t) * Hq + hq] = 0;
        const size_t qo = (size_t(t) * Hq + hq) * D;
        std::vector<double> z(nk);
        double mx = -INFINITY;
        for (size_t i = 0; i < nk; ++i) {
          double s = 0;
          for (int d = 0; d < D; ++d) s += double(qval(c, qo + d)) * kd[i * D + d];
          z[i] = s * c.scale;
          mx = std::max(mx, z[i]);
        }
        double l = 0;
        for (size_t i = 0; i < nk; ++i) l += (z[i] = std::exp(z[i] - mx));
        double* o = out.data() + qo;
        for (size_t i = 0; i < nk; ++i)
          for (int d = 0; d < D; ++d) o[d] += z[i] / l * vd[i * D + d];
      }
    }
  }
  return out;
}

static AttentionParams upload_case(const HostCase& c, std::vector<void*>& owned) {
  AttentionParams p = {};
  auto up = [&](const auto& v) {
    auto* d = dev_upload(v);
    owned.push_back(d);
    return d;
  };
  p.q = up(c.q);
  void* out = nullptr;
  CK(cudaMalloc(&out, std::max<size_t>(2, c.q.size() * 2)));
  owned.push_back(out);
  p.out = out;
  p.kv_cache = up(c.cache);
  p.topk_indices = up(c.topk);
  p.block_table = up(c.block_table);
  p.seq_lens = up(c.seq_lens);
  p.query_req_id = up(c.req_id);
  p.query_abs_pos = up(c.abs_pos);
  p.k_scale = up(std::vector<float>{c.kscale});
  p.v_scale = up(std::vector<float>{c.vscale});
  p.layer = up(std::vector<int32_t>{c.layer});
  p.geom = c.geom;
  p.num_tokens = c.T;
  p.num_kv_heads = c.Hkv;
  p.topk = c.K;
  p.num_requests = c.R;
  p.max_blocks = c.M;
  p.decode_query_len = c.dql;
  p.is_prefill = c.prefill;
  p.scale = c.scale;
  p.dtype = c.f16 ? DType::kF16 : DType::kBF16;
  p.group = c.G;
  return p;
}

struct Metrics {
  double relf, cosine;
  long nan, nonzero_empty, unwritten;
};

static Metrics compare(const HostCase& c, const std::vector<uint16_t>& got,
                       const std::vector<double>& ref, const std::vector<char>& empty) {
  Metrics m = {0, 0, 0, 0, 0};
  double num = 0, den = 0, dot = 0, ng = 0;
  const int D = 128;
  for (size_t i = 0; i < ref.size(); ++i) {
    const uint16_t bits = got[i];
    if (bits == 0xFFFF) ++m.unwritten;  // poison pattern (a NaN)
    const double g = c.f16 ? f16_to_float(bits) : bf16_to_float(bits);
    if (std::isnan(g)) {
      ++m.nan;
      continue;
    }
    if (empty[i / D] && bits != 0) ++m.nonzero_empty;
    num += (g - ref[i]) * (g - ref[i]);
    den += ref[i] * ref[i];
    dot += g * ref[i];
    ng += g * g;
  }
  m.relf = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  m.cosine = (den > 0 && ng > 0) ? dot / std::sqrt(den * ng) : 1.0;
  return m;
}

// split: the launch shape (0: chosen from the grid, 1: one CTA per row, 2 or 4: a cluster of
// that many CTAs per row)
static std::vector<uint16_t> run_case(const HostCase& c, int split = 0) {
  std::vector<void*> owned;
  AttentionParams p = upload_case(c, owned);
  p.split = split;
  CK(cudaMemset(p.out, 0xFF, std::max<size_t>(2, c.q.size() * 2)));  // poison
  CK(launch_sparse_attention(p, 0));
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> got(c.q.size());
  CK(cudaMemcpy(got.data(), p.out, got.size() * 2, cudaMemcpyDeviceToHost));
  for (void* d : owned) CK(cudaFree(d));
  return got;
}

// Random NVFP4 bytes; scale bytes in a sane range; NaN scales (0x7F) planted wherever the
// spec says nothing may be read: unused pages and keys at or past seq_len.
static void fill_cache(HostCase& c, std::mt19937& rng, const std::vector<int64_t>& seq_of_page_tail) {
  std::uniform_int_distribution<int> byte(0, 255), sc(0x28, 0x48);
  const CacheGeometry& geo = c.geom;
  c.cache.resize(size_t(geo.total_bytes()));
  for (auto& b : c.cache) b = uint8_t(byte(rng));
  for (int64_t l = 0; l < geo.num_layers; ++l)
    for (int64_t pg = 0; pg < geo.num_pages; ++pg)
      for (int64_t s = 0; s < geo.num_slots; ++s) {
        uint8_t* tile = c.cache.data() + geo.tile_offset(l, pg, s);
        const int64_t valid = seq_of_page_tail[pg];  // keys of this page that may be read
        for (int o = 0; o < 128; ++o)
          for (int j = 0; j < 8; ++j) tile[8192 + o * 8 + j] = o < valid ? uint8_t(sc(rng)) : 0x7F;
      }
}

// Builds a decode (prefill = false) or prefill case with every fault of SPEC §5.2 / §7.
static HostCase make_case(std::mt19937& rng, bool prefill, int Hkv, int R, int dql, int K,
                          int layers, int layout, int layer, bool f16, int G = 16) {
  HostCase c;
  c.G = G;
  c.f16 = f16;
  c.Hkv = Hkv;
  c.R = R;
  c.dql = dql;
  c.K = K;
  c.prefill = prefill;
  c.layer = layer;
  c.kscale = 0.75f;
  c.vscale = 1.25f;
  c.scale = 1.0f / std::sqrt(128.0f) * 0.25f;
  std::uniform_int_distribution<int> len(1, 2600);
  std::vector<int> total(R), ctx(R), chunk(R);
  for (int r = 0; r < R; ++r) {
    total[r] = len(rng);
    if (r == 1) total[r] = 0;              // padded request
    if (r == 2) total[r] = 128 * 5;        // exact block boundary
  }
  int max_blocks = 0;
  for (int r = 0; r < R; ++r) max_blocks = std::max(max_blocks, (total[r] + 127) / 128);
  c.M = max_blocks + 2;
  // pages: a permutation, plus spare pages never referenced
  int npages = 0;
  for (int r = 0; r < R; ++r) npages += (total[r] + 127) / 128;
  const int P = npages + 3;
  std::vector<int> perm(P);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  c.block_table.assign(size_t(R) * c.M, -1);
  std::vector<int64_t> tail(P, 0);
  int next = 0;
  for (int r = 0; r < R; ++r) {
    const int nb = (total[r] + 127) / 128;
    for (int b = 0; b < nb; ++b) {
      const int pg = perm[next++];
      c.block_table[size_t(r) * c.M + b] = pg;
      tail[pg] = std::min(128, total[r] - 128 * b);
    }
    if (nb < c.M) c.block_table[size_t(r) * c.M + nb] = (r % 2) ? P + 7 : -5;  // garbage
  }
  c.geom = CacheGeometry{P, layers, 2 * Hkv, 128, 128, layout};
  // tokens
  if (!prefill) {
    c.T = R * dql;
    c.seq_lens.assign(total.begin(), total.end());
    // a padded request with seq_len 0 attends nothing; request 1 is that
  } else {
    std::uniform_int_distribution<int> ch(1, 40);
    std::vector<int> cu(R + 1, 0);
    for (int r = 0; r < R; ++r) {
      chunk[r] = total[r] == 0 ? 0 : std::min(total[r], ch(rng));
      ctx[r] = total[r] - chunk[r];
      cu[r + 1] = cu[r] + chunk[r];
    }
    c.T = cu[R] + 5;  // padding tokens
    c.req_id.assign(c.T, -1);
    c.abs_pos.assign(c.T, -1);
    for (int r = 0; r < R; ++r)
      for (int j = cu[r]; j < cu[r + 1]; ++j) {
        c.req_id[j] = r;
        c.abs_pos[j] = ctx[r] + (j - cu[r]);
      }
  }
  c.seq_lens.resize(R);
  if (c.req_id.empty()) c.req_id.assign(1, 0), c.abs_pos.assign(1, 0);
  // top-k ids: mostly distinct valid blocks, then the faults
  c.topk.assign(size_t(Hkv) * c.T * K, -1);
  std::uniform_int_distribution<int> u01(0, 99);
  for (int g = 0; g < Hkv; ++g)
    for (int t = 0; t < c.T; ++t) {
      int64_t vis_blocks;
      if (!prefill) {
        const int r = t / dql;
        vis_blocks = (int64_t(total[r]) - dql + t % dql + 1 + 127) / 128;
      } else {
        vis_blocks = c.req_id[t] < 0 ? 3 : (int64_t(c.abs_pos[t]) + 1 + 127) / 128;
      }
      std::vector<int> ids(std::max<int64_t>(vis_blocks, 0));
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      int32_t* row = c.topk.data() + (size_t(g) * c.T + t) * K;
      for (int k = 0; k < K; ++k) {
        const int x = u01(rng);
        if (k < int(ids.size()) && x < 80) row[k] = ids[k];
        else if (x < 85) row[k] = c.M + 3;                   // >= max_blocks
        else if (x < 90) row[k] = int32_t(vis_blocks + 1);   // beyond vis / garbage
        else if (x < 93) row[k] = -7;
        else row[k] = -1;
      }
      if (t == 0 && g == 0 && K >= 2 && ids.size() >= 1) row[1] = row[0] = ids[0];  // duplicate
    }
  std::vector<int64_t> tail_all = tail;
  fill_cache(c, rng, tail_all);
  // q: unit-ish random, as bf16/f16 bits
  const int Hq = Hkv * G;
  std::normal_distribution<float> nd(0.f, 1.f);
  c.q.resize(size_t(c.T) * Hq * 128);
  for (auto& v : c.q) v = f16 ? float_to_f16(nd(rng)) : float_to_bf16(nd(rng));
  return c;
}

static void test_attention(std::mt19937& rng, const char* name, bool prefill, int Hkv, int R,
                           int dql, int K, int layers, int layout, int layer, bool f16, int G = 16) {
  HostCase c = make_case(rng, prefill, Hkv, R, dql, K, layers, layout, layer, f16, G);
  std::vector<char> empty;
  const std::vector<double> ref = oracle(c, &empty);
  long nempty = std::count(empty.begin(), empty.end(), 1);
  const std::vector<uint16_t> got = run_case(c);
  const Metrics m = compare(c, got, ref, empty);
  const bool ok = m.nan == 0 && m.unwritten == 0 && m.nonzero_empty == 0 && m.relf <= 0.06 &&
                  m.cosine >= 0.99;
  char msg[256];
  snprintf(msg, sizeof msg,
           "%s T=%d Hkv=%d G=%d K=%d: rel-F %.5f cosine %.6f (nan %ld, unwritten %ld, "
           "nonzero-empty %ld of %ld empty rows)",
           name, c.T, Hkv, c.G, K, m.relf, m.cosine, m.nan, m.unwritten, m.nonzero_empty, nempty);
  report(ok, msg);
}

// dql > 1: the last key of every request gets a NaN block scale, and every row's slot 0 selects
// the request's last block. Only the request's last row attends that key; every other row (whose
// limit ends before it, in a block it shares) must match the oracle with no NaN (SPEC §5.2: V
// select-masked per row; the guard a kernel sharing blocks between rows needs).
static void test_shared_block_nan_tail(std::mt19937& rng, int dql, bool f16) {
  HostCase c = make_case(rng, false, 2, 9, dql, 16, 1, 0, 0, f16);
  for (int r = 0; r < c.R; ++r) {
    const int total = c.seq_lens[r];
    if (total <= 0) continue;
    const int b = (total - 1) / 128, o = (total - 1) % 128;
    for (int g = 0; g < c.Hkv; ++g) {
      uint8_t* tile = c.cache.data() + c.geom.tile_offset(0, c.block_table[size_t(r) * c.M + b], 2 * g);
      for (int side = 0; side < 2; ++side) tile[side * 9216 + 8192 + o * 8 + 1] = 0x7F;
      for (int i = 0; i < dql; ++i) c.topk[(size_t(g) * c.T + r * dql + i) * c.K] = b;
    }
  }
  std::vector<char> empty;
  std::vector<double> ref = oracle(c, &empty);
  std::vector<uint16_t> got = run_case(c);
  long last_nan = 0;
  const size_t row = size_t(c.Hkv) * c.G * 128;
  for (int t = 0; t < c.T; ++t)
    if (t % dql == dql - 1)
      for (size_t k = 0; k < row; ++k) {
        last_nan += std::isnan(c.f16 ? f16_to_float(got[t * row + k]) : bf16_to_float(got[t * row + k]));
        got[t * row + k] = 0;
        ref[t * row + k] = 0;
      }
  const Metrics m = compare(c, got, ref, empty);
  char msg[256];
  snprintf(msg, sizeof msg,
           "shared block dql=%d %s: a NaN key attended by the last row only: other rows rel-F %.5f cosine "
           "%.6f, nan %ld (last rows: %ld NaN values, as the oracle)",
           dql, f16 ? "f16" : "bf16", m.relf, m.cosine, m.nan, last_nan);
  report(m.nan == 0 && m.unwritten == 0 && m.nonzero_empty == 0 && m.relf <= 0.06 &&
             m.cosine >= 0.99 && last_nan > 0, msg);
}

// Prefill: token t's own key gets a NaN V scale in group 3 (d 48..63) of KV head 0, and t and
// the token before it (same request, same block) both select that block. t attends the key: NaN
// exactly in those 16 d of its 16 heads (and so every later token of its request that selects
// the block), as the oracle. The token before it shares the block but stops before the key
// (the guard a kernel that dequantizes a block once for several tokens needs): finite, within
// tolerance, like every other token.
static void test_prefill_nan_key(std::mt19937& rng, bool f16) {
  HostCase c = make_case(rng, true, 2, 4, 1, 16, 1, 0, 0, f16);
  int t = -1;
  for (int i = 1; i < c.T && t < 0; ++i)
    if (c.req_id[i] >= 0 && c.req_id[i] == c.req_id[i - 1] && c.abs_pos[i] % 128 != 0) t = i;
  if (t < 0) return report(false, "prefill NaN key: no two tokens of a request in one block");
  const int r = c.req_id[t], pos = c.abs_pos[t], b = pos / 128;
  for (int tt : {t - 1, t}) c.topk[size_t(tt) * c.K] = b;  // KV head 0, slot 0
  const int64_t page = c.block_table[size_t(r) * c.M + b];
  c.cache[c.geom.tile_offset(c.layer, page, 1) + 8192 + (pos % 128) * 8 + 3] = 0x7F;
  std::vector<char> empty;
  std::vector<double> ref = oracle(c, &empty);
  std::vector<uint16_t> got = run_case(c);
  long want = 0, hit = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isnan(ref[i])) continue;
    ++want;
    hit += std::isnan(c.f16 ? f16_to_float(got[i]) : bf16_to_float(got[i]));
    got[i] = 0;
    ref[i] = 0;
  }
  const Metrics m = compare(c, got, ref, empty);
  char msg[256];
  snprintf(msg, sizeof msg,
           "prefill NaN key %s: token %d's own key NaN in V group 3: %ld of %ld expected NaN "
           "values; the rest rel-F %.5f cosine %.6f, nan %ld",
           f16 ? "f16" : "bf16", t, hit, want, m.relf, m.cosine, m.nan);
  report(want > 0 && want % (16 * 16) == 0 && hit == want && m.nan == 0 && m.unwritten == 0 &&
             m.nonzero_empty == 0 && m.relf <= 0.06 && m.cosine >= 0.99, msg);
}

// Batch and TP invariance (a row's result never depends on its batch): every row's output bits
// alone (decode: its request's dql rows in a batch of one request; prefill: the token alone) and
// with the KV heads split as tensor parallelism splits them (a cache of the heads' slots only,
// their top-k rows and q heads) equal the bits of the whole batch.
static HostCase head_slice(const HostCase& c, int g0, int hs) {
  HostCase s = c;
  s.Hkv = hs;
  s.geom.num_slots = 2 * hs;
  s.cache.assign(size_t(s.geom.total_bytes()), 0);
  const int64_t tb = c.geom.tile_bytes();
  for (int64_t l = 0; l < c.geom.num_layers; ++l)
    for (int64_t pg = 0; pg < c.geom.num_pages; ++pg)
      for (int sl = 0; sl < 2 * hs; ++sl)
        memcpy(s.cache.data() + s.geom.tile_offset(l, pg, sl),
               c.cache.data() + c.geom.tile_offset(l, pg, 2 * g0 + sl), size_t(tb));
  s.topk.assign(c.topk.begin() + size_t(g0) * c.T * c.K,
                c.topk.begin() + size_t(g0 + hs) * c.T * c.K);
  const size_t hd = size_t(c.G) * 128;  // one KV head's q elements per token
  s.q.clear();
  for (int t = 0; t < c.T; ++t)
    for (int g = g0; g < g0 + hs; ++g) {
      const auto src = c.q.begin() + (size_t(t) * c.Hkv + g) * hd;
      s.q.insert(s.q.end(), src, src + hd);
    }
  return s;
}

// Units [u0, u0 + n) of a case (decode: requests with their dql rows; prefill: tokens) as a case.
static HostCase sub_batch(const HostCase& c, int u0, int n) {
  HostCase s = c;
  const int dql = c.prefill ? 1 : c.dql, t0 = u0 * dql, nt = n * dql;
  const size_t row = size_t(c.Hkv) * c.G * 128;
  s.T = nt;
  if (!c.prefill) {
    s.R = n;
    s.seq_lens.assign(c.seq_lens.begin() + u0, c.seq_lens.begin() + u0 + n);
    s.block_table.assign(c.block_table.begin() + size_t(u0) * c.M,
                         c.block_table.begin() + size_t(u0 + n) * c.M);
  } else {
    s.req_id.assign(c.req_id.begin() + t0, c.req_id.begin() + t0 + nt);
    s.abs_pos.assign(c.abs_pos.begin() + t0, c.abs_pos.begin() + t0 + nt);
  }
  s.topk.clear();
  for (int g = 0; g < c.Hkv; ++g)
    s.topk.insert(s.topk.end(), c.topk.begin() + (size_t(g) * c.T + t0) * c.K,
                  c.topk.begin() + (size_t(g) * c.T + t0 + nt) * c.K);
  s.q.assign(c.q.begin() + t0 * row, c.q.begin() + (t0 + nt) * row);
  return s;
}

// The expected bits are the whole batch with one CTA per row (the large-T shape); the batch
// with a cluster of 2 and of 4 per row, every unit alone, the batches of the first 1, 2, 8 units
// (the launch shape chosen from their grid: a cluster at small T) and the head slices must equal
// them.
static void test_invariance(std::mt19937& rng, const char* name, bool prefill, int Hkv, int R,
                            int dql, bool f16, int G = 16) {
  const int K = 16;
  const HostCase c = make_case(rng, prefill, Hkv, R, dql, K, 1, 0, 0, f16, G);
  const std::vector<uint16_t> full = run_case(c, 1);
  const size_t row = size_t(Hkv) * G * 128;  // elements of one token
  long bad_alone = 0, bad_tp = 0, units = 0, bad_shape = 0, bad_prefix = 0, nonzero = 0;
  for (uint16_t b : full) nonzero += b != 0;
  bad_shape += run_case(c, 2) != full;
  bad_shape += run_case(c, kRounds) != full;
  bad_shape += run_case(c, 0) != full;
  long bad_mates = 0;
  if (!prefill && dql > 1) {
    // a row's bits do not depend on its tile-mates' selections: the other rows of every
    // request select (a) nothing, (b) the first row's blocks; the first rows must keep theirs
    for (int variant = 0; variant < 2; ++variant) {
      HostCase v = c;
      for (int g = 0; g < Hkv; ++g)
        for (int t = 0; t < c.T; ++t) {
          int32_t* tr = v.topk.data() + (size_t(g) * c.T + t) * K;
          const int32_t* r0 = c.topk.data() + (size_t(g) * c.T + t - t % dql) * K;
          if (t % dql)
            for (int k = 0; k < K; ++k) tr[k] = variant == 0 ? -1 : r0[k];
        }
      const std::vector<uint16_t> got = run_case(v, 0);
      for (int t = 0; t < c.T; t += dql)
        bad_mates += !std::equal(got.begin() + t * row, got.begin() + (t + 1) * row,
                                 full.begin() + t * row);
    }
  }
  const int nunits = prefill ? c.T : c.R;
  const int udql = prefill ? 1 : dql;
  for (int u = 0; u < nunits; ++u) {  // each decode request (its dql rows) / prefill token alone
    const std::vector<uint16_t> got = run_case(sub_batch(c, u, 1));
    bad_alone += !std::equal(got.begin(), got.end(), full.begin() + size_t(u) * udql * row);
    ++units;
  }
  for (int n : {2, 8}) {  // the first n units as a batch
    if (n > nunits) continue;
    const std::vector<uint16_t> got = run_case(sub_batch(c, 0, n));
    bad_prefix += !std::equal(got.begin(), got.end(), full.begin());
  }
  // KV heads split as TP 2 (when Hkv is even) and TP Hkv would split them
  for (int hs : {Hkv / 2, 1}) {
    if (hs < 1 || Hkv % hs) continue;
    for (int g0 = 0; g0 < Hkv; g0 += hs) {
      const std::vector<uint16_t> got = run_case(head_slice(c, g0, hs));
      const size_t part = size_t(hs) * G * 128;
      for (int t = 0; t < c.T; ++t)
        bad_tp += !std::equal(got.begin() + t * part, got.begin() + (t + 1) * part,
                              full.begin() + t * row + size_t(g0) * G * 128);
    }
  }
  AttentionParams pc = {};
  pc.num_tokens = c.T;
  pc.num_kv_heads = Hkv;
  AttentionParams p1 = pc;
  p1.num_tokens = udql;
  char msg[400];
  snprintf(msg, sizeof msg,
           "invariance %s T=%d Hkv=%d G=%d (auto shape: batch %d, unit alone %d CTAs/row): "
           "clusters of 2, 4 and auto vs one-CTA batch %ld differ, "
           "%ld first rows differ with other tile-mates, "
           "%ld of %ld units alone differ, %ld prefix "
           "batches differ, %ld head-sliced rows differ (bit for bit; %ld nonzero)",
           name, c.T, Hkv, G, attention_split(pc, g_num_sms), attention_split(p1, g_num_sms),
           bad_shape, bad_mates, bad_alone, units, bad_prefix, bad_tp, nonzero);
  report(bad_shape == 0 && bad_mates == 0 && bad_alone == 0 && bad_prefix == 0 && bad_tp == 0 &&
             nonzero > 0, msg);
}

// ------------------------------------------------------------------ pack exactness
static void test_pack(std::mt19937& rng, DType dt, int layers, int layout, int layer,
                      const char* name) {
  const int Hkv = 2, D = 128, T = 300, P = 5;
  CacheGeometry geom{P, layers, 2 * Hkv, 128, D, layout};
  std::vector<uint8_t> cache(size_t(geom.total_bytes()));
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : cache) b = uint8_t(byte(rng));
  const size_t n = size_t(T) * Hkv * D;
  std::vector<float> kf(n), vf(n);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> u(0, 999);
  for (size_t i = 0; i < n; ++i) {
    for (int side = 0; side < 2; ++side) {
      float x = nd(rng) * std::exp2(float(u(rng) % 40 - 20));
      const int sp = u(rng);
      if (sp < 3) x = NAN;
      else if (sp < 6) x = (sp & 1) ? INFINITY : -INFINITY;
      else if (sp < 30) x = 0.0f;
      else if (sp < 40) x = -0.0f;
      else if (sp < 60) x = 0.25f * float(u(rng) % 30 - 15);  // ties
      (side ? vf : kf)[i] = x;
    }
  }
  // round inputs to the dtype and keep the raw bytes
  std::vector<uint8_t> kraw, vraw;
  auto encode = [&](std::vector<float>& f, std::vector<uint8_t>& raw) {
    if (dt == DType::kF32) {
      raw.resize(n * 4);
      memcpy(raw.data(), f.data(), n * 4);
      return;
    }
    raw.resize(n * 2);
    for (size_t i = 0; i < n; ++i) {
      const uint16_t h = dt == DType::kBF16 ? float_to_bf16(f[i]) : float_to_f16(f[i]);
      f[i] = dt == DType::kBF16 ? bf16_to_float(h) : f16_to_float(h);
      memcpy(raw.data() + 2 * i, &h, 2);
    }
  };
  encode(kf, kraw);
  encode(vf, vraw);
  std::vector<int32_t> slots(T);
  std::vector<int> perm(P * 128);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int t = 0; t < T; ++t) slots[t] = perm[t];
  slots[3] = -1;
  slots[7] = P * 128;       // out of range: nothing written
  slots[11] = P * 128 + 77;
  const float ks = 0.37f, vs = 2.5f;
  // expected
  std::vector<uint8_t> want = cache;
  if (geom.valid_layer(layer))
    for (int t = 0; t < T; ++t) {
      const int64_t s = slots[t];
      if (s < 0 || s >= int64_t(P) * 128) continue;
      for (int h = 0; h < Hkv; ++h)
        for (int side = 0; side < 2; ++side) {
          uint8_t* tile = want.data() + geom.tile_offset(layer, s / 128, 2 * h + side);
          const float* x = (side ? vf : kf).data() + (size_t(t) * Hkv + h) * D;
          const float r = nvfp4_inverse_scale(side ? vs : ks);
          for (int grp = 0; grp < D / 16; ++grp)
            nvfp4_quantize_group(x + 16 * grp, r, tile + geom.token_data_offset(s % 128) + 8 * grp,
                                 tile + geom.token_scale_offset(s % 128) + grp);
        }
    }
  PackParams p = {};
  std::vector<void*> owned;
  auto up = [&](const auto& v) {
    auto* d = dev_upload(v);
    owned.push_back(d);
    return d;
  };
  p.kv_cache = up(cache);
  p.key = up(kraw);
  p.value = up(vraw);
  p.slot_mapping = up(slots);
  p.k_scale = up(std::vector<float>{ks});
  p.v_scale = up(std::vector<float>{vs});
  p.layer = up(std::vector<int32_t>{layer});
  p.geom = geom;
  p.num_tokens = T;
  p.num_kv_heads = Hkv;
  p.dtype = dt;
  CK(launch_pack_kv_pages(p, 0));
  CK(cudaDeviceSynchronize());
  std::vector<uint8_t> got(cache.size());
  CK(cudaMemcpy(got.data(), p.kv_cache, got.size(), cudaMemcpyDeviceToHost));
  for (void* d : owned) CK(cudaFree(d));
  long diff = 0;
  for (size_t i = 0; i < got.size(); ++i) diff += got[i] != want[i];
  char msg[200];
  snprintf(msg, sizeof msg, "pack %s: %zu cache bytes, %ld differ from nvfp4.h on the host", name,
           got.size(), diff);
  report(diff == 0, msg);
}

// The pack kernel's division-free quantization against nvfp4.h's division path, on the device:
// every scale byte, quotients within ±40 ulp of every E2M1 rounding threshold, and random
// groups with random global scales (including ±Inf, zeros, ties).
static void test_pack_division(std::mt19937& rng) {
  std::vector<float> x;
  std::vector<float> rs;
  const float taus[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  std::vector<float> elems;
  for (int sf = 1; sf < 0x7F; ++sf) {
    const float sfv = e4m3_to_float(uint8_t(sf));
    elems.clear();
    for (float tau : taus)
      for (int k = -40; k <= 40; ++k) {
        const float a = std::nextafter(tau * sfv, k < 0 ? 0.f : 1e30f);
        float v = tau * sfv;
        for (int i = 0; i < std::abs(k); ++i) v = std::nextafter(v, k < 0 ? 0.f : 1e30f);
        (void)a;
        elems.push_back((k & 1) ? -v : v);
      }
    for (size_t i = 0; i < elems.size(); i += 15) {
      x.push_back(6.0f * sfv);  // amax: scale byte == sf with r = 1
      for (size_t j = 0; j < 15; ++j) x.push_back(i + j < elems.size() ? elems[i + j] : 0.f);
    }
  }
  const size_t n_thr = x.size() / 16;
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> u(0, 999);
  const size_t n_rand = 200000;
  std::vector<float> xr(n_rand * 16);
  for (auto& v : xr) {
    v = nd(rng) * std::exp2(float(u(rng) % 60 - 30));
    const int sp = u(rng);
    if (sp < 2) v = (sp & 1) ? INFINITY : -INFINITY;
    else if (sp < 20) v = 0.f;
    else if (sp < 60) v = 0.25f * float(u(rng) % 40 - 20) * std::exp2(float(u(rng) % 20 - 10));
  }
  long diff = 0;
  for (int pass = 0; pass < 4; ++pass) {
    const std::vector<float>& in = pass == 0 ? x : xr;
    const float r = pass == 0 ? 1.0f : pass == 1 ? 1.0f / 0.37f : pass == 2 ? 2.7f : 1.0f / 3e-3f;
    const size_t n = in.size() / 16;
    float* dx = dev_upload(in);
    uint8_t *dd, *ds;
    CK(cudaMalloc(&dd, n * 8 * 2));
    CK(cudaMalloc(&ds, n * 2));
    quantize_groups_kernel<<<unsigned((n + 255) / 256), 256>>>(dx, r, dd, ds, int64_t(n), 0);
    quantize_groups_kernel<<<unsigned((n + 255) / 256), 256>>>(dx, r, dd + n * 8, ds + n,
                                                                 int64_t(n), 1);
    CK(cudaGetLastError());
    std::vector<uint8_t> hd(n * 16), hs(n * 2);
    CK(cudaMemcpy(hd.data(), dd, hd.size(), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hs.data(), ds, hs.size(), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n * 8; ++i) diff += hd[i] != hd[n * 8 + i];
    for (size_t i = 0; i < n; ++i) diff += hs[i] != hs[n + i];
    CK(cudaFree(dx));
    CK(cudaFree(dd));
    CK(cudaFree(ds));
  }
  char msg[200];
  snprintf(msg, sizeof msg,
           "pack division: fast path == nvfp4.h on %zu threshold groups + 3 x %zu random groups "
           "(%ld bytes differ)", n_thr, n_rand, diff);
  report(diff == 0, msg);
}

// ------------------------------------------------------------------ benchmarks
__device__ __host__ inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// byte at cache offset o: random data; sane scales in the scale planes
__device__ __host__ inline uint8_t bench_byte(uint64_t o) {
  const uint64_t h = mix64(o >> 3) >> (8 * (o & 7));
  return (o % 9216) >= 8192 ? uint8_t(0x30 + (h & 0x17)) : uint8_t(h);
}
__global__ void fill_bench(uint8_t* c, uint64_t n) {
  for (uint64_t i = (uint64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 8; i < n;
       i += uint64_t(gridDim.x) * blockDim.x * 8) {
    uint64_t w = 0;
    for (int k = 0; k < 8; ++k) w |= uint64_t(bench_byte(i + k)) << (8 * k);
    *reinterpret_cast<uint64_t*>(c + i) = w;
  }
}

static uint8_t* g_bench_cache = nullptr;
static uint64_t g_bench_bytes = 0;

struct BenchDecode {
  int T, dql, Hkv, K;
  int64_t seq;
  int split = 0;  // launch shape (0: chosen from the grid; 1, 2, 4 forced)
  int shared = -1;  // dql > 1: blocks every row of a request selects (the rest distinct per row);
                    // -1: every row draws its own
};

// decode over a large hash-filled cache; returns nothing, prints a row per split setting
static void bench_decode(std::mt19937& rng, const BenchDecode& b, double copy_tbs, bool check) {
  const int Hkv = b.Hkv, K = b.K, T = b.T, dql = b.dql, R = T / dql;
  const int M = int((b.seq + 127) / 128);
  const int64_t page_bytes = int64_t(2) * Hkv * 128 * 72;
  const int64_t pages_total = int64_t(g_bench_bytes / page_bytes);
  const int64_t per_variant = int64_t(R) * M;
  const int nv = int(std::max<int64_t>(1, std::min<int64_t>(64, pages_total / per_variant)));
  if (per_variant > pages_total) {
    printf("skip decode T=%d: cache too small\n", T);
    return;
  }
  CacheGeometry geom{pages_total, 1, 2 * Hkv, 128, 128, 0};
  std::vector<int32_t> bt(size_t(nv) * R * M), topk(size_t(Hkv) * T * K), seq(R, int32_t(b.seq));
  for (int v = 0; v < nv; ++v)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) bt[(size_t(v) * R + r) * M + m] = int32_t((int64_t(v) * R + r) * M + m);
  std::vector<int> ids(M);
  std::iota(ids.begin(), ids.end(), 0);
  for (size_t i = 0; i < size_t(Hkv) * T; ++i) {
    const int t = int(i % T), ir = t % dql;
    if (b.shared < 0 || ir == 0) std::shuffle(ids.begin(), ids.end(), rng);
    for (int k = 0; k < K; ++k)  // shared: ids [0, S) in common, then K - S of row ir's own
      topk[i * K + k] = b.shared < 0 ? ids[k] : ids[k < b.shared ? k : k + ir * (K - b.shared)];
  }
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> q(size_t(T) * Hkv * 16 * 128);
  for (auto& x : q) x = float_to_bf16(nd(rng));
  std::vector<void*> owned;
  auto up = [&](const auto& v) {
    auto* d = dev_upload(v);
    owned.push_back(d);
    return d;
  };
  AttentionParams p = {};
  p.q = up(q);
  void* out;
  CK(cudaMalloc(&out, q.size() * 2));
  owned.push_back(out);
  p.out = out;
  p.kv_cache = g_bench_cache;
  p.topk_indices = up(topk);
  int32_t* bt_d = up(bt);
  p.block_table = bt_d;
  p.seq_lens = up(seq);
  p.query_req_id = nullptr;
  p.query_abs_pos = nullptr;
  p.k_scale = up(std::vector<float>{1.0f});
  p.v_scale = up(std::vector<float>{1.0f});
  p.layer = up(std::vector<int32_t>{0});
  p.geom = geom;
  p.num_tokens = T;
  p.num_kv_heads = Hkv;
  p.topk = K;
  p.num_requests = R;
  p.max_blocks = M;
  p.decode_query_len = dql;
  p.is_prefill = 0;
  p.scale = 1.0f / std::sqrt(128.f);
  p.dtype = DType::kBF16;
  p.split = b.split;
  const int shape = attention_split(p, g_num_sms);
  const double bytes = double(T) * Hkv * K * 128 * 72 * 2;
  auto launch = [&](int v, cudaStream_t st) {
    AttentionParams pv = p;
    pv.block_table = bt_d + size_t(v) * R * M;
    CK(launch_sparse_attention(pv, st));
  };
  const double us = time_graph(launch, nv);
  char sh[64];
  snprintf(sh, sizeof sh, "%s%d CTA/row%s", b.split ? "forced " : "", shape,
           dql > 1 ? (b.shared < 0 ? ", own draws" : ", rows share 12 of 16 blocks") : "");
  printf("TABLE decode T=%d dql=%d Hkv=%d K=%d seq=%lld %s: %.2f us, %.3f TB/s, %.1f%% "
         "of copy (%.1f MB read, %d block tables)\n", T, dql, Hkv, K, (long long)b.seq,
         sh, us, bytes / (us * 1e-6) / 1e12,
         100.0 * bytes / (us * 1e-6) / 1e12 / copy_tbs, bytes / 1e6, nv);
  if (check) {
    // correctness at the benchmark shape against the fp64 oracle (bytes re-derived)
    CK(cudaMemset(out, 0xFF, q.size() * 2));
    CK(launch_sparse_attention(p, 0));
    CK(cudaDeviceSynchronize());
    std::vector<uint16_t> got(q.size());
    CK(cudaMemcpy(got.data(), out, got.size() * 2, cudaMemcpyDeviceToHost));
    HostCase c;
    c.geom = geom;
    c.Hkv = Hkv;
    c.T = T;
    c.K = K;
    c.R = R;
    c.M = M;
    c.dql = dql;
    c.prefill = 0;
    c.layer = 0;
    c.scale = p.scale;
    c.kscale = c.vscale = 1.0f;
    c.q = q;
    c.topk = topk;
    c.block_table.assign(bt.begin(), bt.begin() + size_t(R) * M);
    c.seq_lens = seq;
    // materialize only the referenced pages: remap to a compact host cache
    std::vector<int32_t> used;
    for (int g = 0; g < Hkv; ++g)
      for (int t = 0; t < T; ++t)
        for (int k = 0; k < K; ++k)
          used.push_back(c.block_table[size_t(t / dql) * M + topk[(size_t(g) * T + t) * K + k]]);
    std::sort(used.begin(), used.end());
    used.erase(std::unique(used.begin(), used.end()), used.end());
    c.geom.num_pages = int64_t(used.size());
    c.cache.resize(size_t(c.geom.total_bytes()));
    for (size_t i = 0; i < used.size(); ++i) {
      const uint64_t src = uint64_t(used[i]) * page_bytes;
      for (int64_t k = 0; k < page_bytes; ++k) c.cache[i * page_bytes + k] = bench_byte(src + k);
    }
    for (auto& x : c.block_table) {
      auto it = std::lower_bound(used.begin(), used.end(), x);
      x = (it != used.end() && *it == x) ? int32_t(it - used.begin()) : -1;
    }
    std::vector<char> empty;
    const std::vector<double> ref = oracle(c, &empty);
    const Metrics m = compare(c, got, ref, empty);
    char msg[200];
    snprintf(msg, sizeof msg, "decode bench shape T=%d dql=%d vs fp64 oracle: rel-F %.5f cosine %.6f",
             T, dql, m.relf, m.cosine);
    report(m.nan == 0 && m.unwritten == 0 && m.relf <= 0.06 && m.cosine >= 0.99, msg);
  }
  for (void* d : owned) CK(cudaFree(d));
}

// Prefill of T tokens after ctx. Selections: independent uniform draws per token (correlated =
// false: no two tokens need share a block), or the model of `python -m benchmarks.gfx950_traffic`
// (neighbouring tokens select mostly the same blocks, as an indexer's scores of neighbouring
// queries do): block b of head g has relevance r_gb ~ N(0, 1); token t scores
// r_gb + 0.35·n_tgb with n an AR(1) process along t (rho 0.95) and takes its local block and the
// 15 best others.
static void bench_prefill(std::mt19937& rng, int T, int ctx, double copy_tbs, bool correlated = false) {
  const int Hkv = 4, K = 16, R = 1;
  const int M = (ctx + T + 127) / 128;
  CacheGeometry geom{M, 1, 2 * Hkv, 128, 128, 0};
  std::vector<int32_t> bt(M), topk(size_t(Hkv) * T * K), rid(T, 0), pos(T);
  std::iota(bt.begin(), bt.end(), 0);
  double flops = 0, shared = 0;
  for (int t = 0; t < T; ++t) pos[t] = ctx + t;
  std::normal_distribution<float> nd0(0.f, 1.f);
  for (int g = 0; g < Hkv; ++g) {
    std::vector<float> rel(M), noise(M);
    for (int b = 0; b < M; ++b) rel[b] = nd0(rng), noise[b] = nd0(rng);
    std::vector<int> prev;
    for (int t = 0; t < T; ++t) {
      const int vb = (pos[t] + 1 + 127) / 128;
      std::vector<int> ids(vb);
      std::iota(ids.begin(), ids.end(), 0);
      if (correlated) {
        for (int b = 0; b < M; ++b) noise[b] = 0.95f * noise[b] + 0.3122499f * nd0(rng);
        const int local = pos[t] / 128;
        std::vector<int> others(ids.begin(), ids.begin() + local);
        std::partial_sort(others.begin(), others.begin() + (K - 1), others.end(), [&](int a, int b) {
          return rel[a] + 0.35f * noise[a] > rel[b] + 0.35f * noise[b];
        });
        ids.assign(others.begin(), others.begin() + (K - 1));
        ids.push_back(local);
        std::shuffle(ids.begin(), ids.end(), rng);
      } else {
        std::shuffle(ids.begin(), ids.end(), rng);
      }
      for (int k = 0; k < K; ++k) {
        const int b = ids[k];
        topk[(size_t(g) * T + t) * K + k] = b;
        const int64_t keys = std::min<int64_t>(128, int64_t(pos[t]) + 1 - 128 * b);
        flops += 4.0 * 16 * 128 * keys;
      }
      std::vector<int> cur(ids.begin(), ids.begin() + K);
      std::sort(cur.begin(), cur.end());
      if (t > 0) {
        std::vector<int> both;
        std::set_intersection(cur.begin(), cur.end(), prev.begin(), prev.end(),
                              std::back_inserter(both));
        shared += double(both.size()) / (double(Hkv) * (T - 1));
      }
      prev = cur;
    }
  }
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> q(size_t(T) * Hkv * 16 * 128);
  for (auto& x : q) x = float_to_bf16(nd(rng));
  std::vector<void*> owned;
  auto up = [&](const auto& v) {
    auto* d = dev_upload(v);
    owned.push_back(d);
    return d;
  };
  AttentionParams p = {};
  p.q = up(q);
  void* out;
  CK(cudaMalloc(&out, q.size() * 2));
  owned.push_back(out);
  p.out = out;
  p.kv_cache = g_bench_cache;
  p.topk_indices = up(topk);
  p.block_table = up(bt);
  p.seq_lens = nullptr;
  p.query_req_id = up(rid);
  p.query_abs_pos = up(pos);
  p.k_scale = up(std::vector<float>{1.0f});
  p.v_scale = up(std::vector<float>{1.0f});
  p.layer = up(std::vector<int32_t>{0});
  p.geom = geom;
  p.num_tokens = T;
  p.num_kv_heads = Hkv;
  p.topk = K;
  p.num_requests = R;
  p.max_blocks = M;
  p.decode_query_len = 1;
  p.is_prefill = 1;
  p.scale = 1.0f / std::sqrt(128.f);
  p.dtype = DType::kBF16;
  auto launch = [&](int, cudaStream_t st) { CK(launch_sparse_attention(p, st)); };
  const double us = time_graph(launch, 1, 5, 5);
  printf("TABLE prefill T=%d ctx=%d Hkv=%d K=%d %s (adjacent tokens share %.1f of 16 blocks): "
         "%.1f us, %.1f effective TFLOP/s (%.3g GFLOP)\n", T, ctx, Hkv, K,
         correlated ? "correlated" : "uniform", shared, us, flops / (us * 1e-6) / 1e12, flops / 1e9);
  for (void* d : owned) CK(cudaFree(d));
}

static void bench_pack(std::mt19937& rng, int T, double copy_tbs) {
  const int Hkv = 4, D = 128;
  const int P = (T + 127) / 128;
  CacheGeometry geom{P, 1, 2 * Hkv, 128, D, 0};
  uint8_t* cache;
  CK(cudaMalloc(&cache, size_t(geom.total_bytes())));
  std::vector<int32_t> slots(T);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> kv(size_t(T) * Hkv * D);
  for (auto& x : kv) x = float_to_bf16(nd(rng));
  std::vector<void*> owned;
  auto up = [&](const auto& v) {
    auto* d = dev_upload(v);
    owned.push_back(d);
    return d;
  };
  PackParams p = {};
  p.kv_cache = cache;
  p.key = up(kv);
  p.value = up(kv);
  p.slot_mapping = up(slots);
  p.k_scale = up(std::vector<float>{1.0f});
  p.v_scale = up(std::vector<float>{1.0f});
  p.layer = up(std::vector<int32_t>{0});
  p.geom = geom;
  p.num_tokens = T;
  p.num_kv_heads = Hkv;
  p.dtype = DType::kBF16;
  auto launch = [&](int, cudaStream_t st) { CK(launch_pack_kv_pages(p, st)); };
  const double us = time_graph(launch, 1);
  const double bytes = double(T) * Hkv * 2 * (D * 2 + 72);
  const double tbs = bytes / (us * 1e-6) / 1e12;
  printf("TABLE pack T=%d Hkv=%d bf16: %.2f us, %.3f TB/s, %.1f%% of copy (%.1f MB moved)\n", T, Hkv,
         us, tbs, 100 * tbs / copy_tbs, bytes / 1e6);
  CK(cudaFree(cache));
  for (void* d : owned) CK(cudaFree(d));
}

int main(int argc, char** argv) {
  bool quick = false, bench = true, tests = true, profile = false, prefill_only = false,
       correlated_only = false;
  const char* profile_shape = "";
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--quick")) quick = true;
    if (!strcmp(argv[i], "--no-bench")) bench = false;
    if (!strcmp(argv[i], "--bench-only")) tests = false;
    if (!strcmp(argv[i], "--profile")) profile = true, tests = false, quick = true;
    if (!strcmp(argv[i], "--prefill-only")) prefill_only = true, tests = false;
    if (!strcmp(argv[i], "--correlated")) correlated_only = true;
    if (!strcmp(argv[i], "--profile-shape") && i + 1 < argc) profile_shape = argv[++i];
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s, %d SMs, %.0f MB L2, cc %d.%d\n", prop.name, prop.multiProcessorCount,
         prop.l2CacheSize / 1e6, prop.major, prop.minor);
  g_num_sms = prop.multiProcessorCount;
  std::mt19937 rng(1234);

  if (tests) {
  test_dequant<__nv_bfloat16>("bf16", true);
  test_dequant<__half>("f16", false);

  test_attention(rng, "decode bf16 dql=1", false, 2, 6, 1, 16, 1, 0, 0, false);
  test_attention(rng, "decode bf16 dql=2", false, 2, 5, 2, 16, 1, 0, 0, false);
  test_attention(rng, "decode f16 dql=1", false, 1, 4, 1, 16, 1, 0, 0, true);
  test_attention(rng, "decode bf16 K=5", false, 2, 4, 1, 5, 1, 0, 0, false);
  test_attention(rng, "decode bf16 BLHNC layer 1", false, 1, 4, 1, 16, 3, 1, 1, false);
  test_attention(rng, "decode bf16 LBHNC layer 2", false, 1, 4, 1, 16, 3, 0, 2, false);
  test_attention(rng, "decode bf16 layer out of range", false, 1, 3, 1, 16, 2, 0, 5, false);
  test_attention(rng, "prefill bf16", true, 2, 4, 1, 16, 1, 0, 0, false);
  test_attention(rng, "prefill f16 BLHNC layer 1", true, 1, 4, 1, 16, 2, 1, 1, true);
  test_attention(rng, "decode bf16 G=8", false, 3, 5, 1, 16, 1, 0, 0, false, 8);
  test_attention(rng, "decode f16 G=4 dql=2", false, 2, 4, 2, 16, 2, 0, 1, true, 4);
  test_attention(rng, "decode bf16 G=1", false, 2, 4, 1, 7, 1, 0, 0, false, 1);
  test_attention(rng, "decode bf16 dql=4", false, 2, 6, 4, 16, 1, 0, 0, false);
  test_attention(rng, "decode f16 dql=4 K=64 BLHNC layer 1", false, 1, 3, 4, 64, 2, 1, 1, true);
  test_attention(rng, "decode bf16 dql=3 G=1", false, 2, 4, 3, 7, 1, 0, 0, false, 1);
  test_attention(rng, "decode bf16 dql=4 layer out of range", false, 1, 3, 4, 16, 2, 0, 5, false);
  test_attention(rng, "prefill bf16 G=8", true, 2, 4, 1, 16, 1, 0, 0, false, 8);
  test_invariance(rng, "decode bf16 dql=1", false, 4, 12, 1, false);
  test_invariance(rng, "decode f16 dql=2", false, 4, 6, 2, true);
  test_invariance(rng, "decode bf16 dql=4", false, 4, 10, 4, false);
  test_invariance(rng, "decode bf16 G=8 dql=4", false, 2, 6, 4, false, 8);
  test_invariance(rng, "decode f16 dql=6", false, 2, 5, 6, true);  // two row groups
  test_invariance(rng, "decode bf16 dql=4 large batch", false, 4, 40, 4, false);
  test_shared_block_nan_tail(rng, 4, false);
  test_shared_block_nan_tail(rng, 2, true);
  test_prefill_nan_key(rng, false);
  test_prefill_nan_key(rng, true);
  test_invariance(rng, "decode bf16 G=8", false, 2, 5, 1, false, 8);
  test_invariance(rng, "prefill bf16", true, 4, 3, 1, false);
  // a batch large enough for one CTA per row (T·Hkv > SMs) vs its first 1, 2, 8 requests
  test_invariance(rng, "decode bf16 large batch", false, 4, 40, 1, false);
  test_invariance(rng, "decode f16 G=8 large batch", false, 2, 70, 1, true, 8);
  test_pack_division(rng);
  test_pack(rng, DType::kBF16, 1, 0, 0, "bf16 4-D");
  test_pack(rng, DType::kF16, 1, 0, 0, "f16 4-D");
  test_pack(rng, DType::kF32, 1, 0, 0, "f32 4-D");
  test_pack(rng, DType::kBF16, 3, 1, 2, "bf16 BLHNC layer 2");
  test_pack(rng, DType::kBF16, 3, 0, 1, "bf16 LBHNC layer 1");
  test_pack(rng, DType::kBF16, 2, 0, 2, "bf16 layer out of range (writes nothing)");
  }

  if (bench) {
    const double copy = copy_bandwidth();
    printf("TABLE copy bandwidth (cudaMemcpy D2D 2 GiB, read+write): %.3f TB/s\n", copy);
    g_bench_bytes = quick ? (uint64_t(3) << 30) : (uint64_t(10) << 30);
    g_bench_bytes -= g_bench_bytes % 73728;
    CK(cudaMalloc(&g_bench_cache, g_bench_bytes));
    fill_bench<<<4096, 256>>>(g_bench_cache, g_bench_bytes);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    const int64_t seq = 32768;
    if (profile) {  // the shapes for ncu: decode T=128, pack 65536; or the one named
      const std::vector<std::string> shapes =
          *profile_shape ? std::vector<std::string>{profile_shape}
                         : std::vector<std::string>{"decode128", "pack"};
      for (const std::string& sh : shapes) {
        if (sh == "decode1") bench_decode(rng, BenchDecode{1, 1, 4, 16, seq}, copy, false);
        else if (sh == "decode32") bench_decode(rng, BenchDecode{32, 1, 4, 16, seq}, copy, false);
        else if (sh == "decode128") bench_decode(rng, BenchDecode{128, 1, 4, 16, seq}, copy, false);
        else if (sh == "dql4")
          bench_decode(rng, BenchDecode{128, 4, 4, 16, seq, 0, 12}, copy, false);
        else if (sh == "prefill") bench_prefill(rng, 2048, 8192, copy, true);
        else if (sh == "pack") bench_pack(rng, 65536, copy);
        else return fprintf(stderr, "--profile-shape: unknown shape %s\n", sh.c_str()), 2;
      }
      return 0;
    }
    if (prefill_only) {  // the prefill cases (--correlated: that one alone, e.g. for ncu)
      if (!correlated_only) bench_prefill(rng, 2048, 8192, copy);
      bench_prefill(rng, 2048, 8192, copy, true);
      return 0;
    }
    for (int T : {1, 8, 32, 64, 128, 512}) {
      if (quick && T == 512) continue;
      bench_decode(rng, BenchDecode{T, 1, 4, 16, seq}, copy, T == 128 || T == 32 || T == 1);
    }
    for (int T : {1, 8, 32, 64})  // the other launch shapes at the same T (the same bits)
      for (int shape : {1, 2, kRounds}) {
        AttentionParams pc = {};
        pc.num_tokens = T;
        pc.num_kv_heads = 4;
        if (attention_split(pc, g_num_sms) != shape)
          bench_decode(rng, BenchDecode{T, 1, 4, 16, seq, shape}, copy, false);
      }
    // MTP: dql 4 with the rows of a request sharing 12 of their 16 blocks
    // beside dql 1 at the same T (the union kernel that read them once left the build)
    bench_decode(rng, BenchDecode{4, 4, 4, 16, seq, 0, 12}, copy, false);
    bench_decode(rng, BenchDecode{4, 1, 4, 16, seq}, copy, false);
    bench_decode(rng, BenchDecode{128, 4, 4, 16, seq, 0, 12}, copy, true);
    bench_decode(rng, BenchDecode{128, 4, 4, 16, seq}, copy, false);
    bench_prefill(rng, 2048, 8192, copy);
    bench_prefill(rng, 2048, 8192, copy, true);
    if (!quick) bench_prefill(rng, 8192, 8192, copy);
    bench_pack(rng, 4096, copy);
    bench_pack(rng, 65536, copy);
    CK(cudaFree(g_bench_cache));
  }
  printf("%s: %d failure(s)\n", g_failures ? "FAILED" : "OK", g_failures);
  return g_failures ? 1 : 0;
}
