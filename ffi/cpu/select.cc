// select_blocks on the CPU: MiniMax M3's indexer block selection (SPEC §8).
//
// Work mapping, in the order a reviewer can check it:
// 1. Pieces. Tokens are cut into maximal runs of consecutive rows with the same query_req_id
//    (a decode request's dql rows, a prefill chunk's tokens), and long runs into pieces of at
//    most kPieceTokens tokens, so one prefill chunk still feeds every core; pool tasks take
//    ranges of pieces. A token's result does not depend on its piece (step 3).
// 2. Rows. In a piece, every (token, KV head) whose token is not padding (SPEC §8 step 1:
//    request outside [0, R), pos < 0, or a layer outside [0, L): written all −1 at once) is a
//    row, with its last candidate block min(pos / N, M − 1) and its idx_q widened to fp32.
// 3. Scores. Blocks b = 0 .. the piece's last candidate, in order. A block whose page is
//    outside [0, P) is skipped (scores stay −inf, the page is never read); otherwise its keys
//    up to the furthest any row sees there are read once per group of rows — straight from
//    the cache when at most kFewRows rows see it (decode; the next block's page is prefetched
//    meanwhile), else widened once into an L1 tile of kKeyTile keys shared by all rows
//    (prefill) — and dotted with each row that sees them. Every dot product is the same sum
//    on every path: 8 fp32 partial sums (lane l takes dims l, l + 8, ...: one explicit fma
//    each, in increasing dim), folded ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)); the file is built
//    with -ffp-contract=off, and bf16 / E4M3 widen exactly. So a row's scores are the same
//    bits on the generic, avx2 and avx512 paths, on every machine, in any batch, piece, pool
//    size or page placement. The block score is the max over the row's visible keys (offsets
//    ≤ pos − b·N); a NaN dot product never wins a `>`, so it counts as −inf.
// 4. Top-k. Per row: the local blocks (pos/N − local_blocks < b ≤ pos/N, b < M) in ascending
//    id, then the other candidates with a finite score by descending score, ties to the lower
//    id (visited in ascending id, inserted with a strict `>` into a list of at most K), −1 in
//    the rest. Scores live in a per-task [rows × blocks] buffer: no [T, P·N] or [T, M·N] array.
// Every read is inside its buffer: page ids and the layer are checked before they address
// the cache (64-bit offsets), block ids are bounded by M, a key group past the block's last
// needed key re-reads that key.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "m3sparse/ffi_checks.h"
#include "m3sparse/nvfp4.h"
#include "parallel.h"
#include "vec8.h"

namespace m3sparse {
namespace {

constexpr int64_t kLanes = 8;         // partial sums per dot product (the summation layout)
constexpr int64_t kKeyTile = 24;      // keys widened at a time (24 × Di fp32 stay in L1)
constexpr int64_t kFewRows = 8;       // up to this many rows read a block's keys from the cache
constexpr int64_t kPieceTokens = 32;  // most tokens of one run served by one piece
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct SelectArgs {
  const void* q;
  ffi::DataType q_type;
  const void* keys;
  ffi::DataType k_type;
  const int32_t* table;
  const int32_t* req;
  const int32_t* pos;
  int32_t* out;
  int64_t T, Hkv, Di, Dp, L, P, N, R, M, K, local;
  int32_t layer;
};

struct Piece {
  int64_t t0, t1;  // tokens [t0, t1), one request id
};

// ---- rows, buffers -------------------------------------------------------------------------

struct Row {
  const float* q;  // Dp floats, zero past Di
  float* scores;   // [blocks of the piece], −inf until a visible key scores
  int64_t pos, last;
};

struct Buffers {
  std::vector<float> q, tile, scores, q256;  // q256: the avx2 path's seeing rows' q · 256
  std::vector<Row> rows, seeing;
  std::vector<int64_t> top;
};

// One block of one piece: its keys [0, n_keys) (every key a seeing row can see) at `keys`.
struct BlockJob {
  int64_t b, n_keys;
  const char* keys;
  const char* next;  // the next valid block's keys (prefetched while this one is scored)
};

int64_t key_bytes(const SelectArgs& a) { return a.Di * (a.k_type == ffi::DataType::BF16 ? 2 : 1); }

// Tile offsets ≤ this are visible to the row (its last key of block b, relative to o0).
inline int64_t visible_limit(const SelectArgs& a, const Row& r, int64_t b, int64_t o0) {
  return std::min(r.pos - b * a.N, a.N - 1) - o0;
}

// ---- the generic path: portable C++ in the reference summation layout --------------------

// e4m3_to_float as masks, so a loop of it vectorizes: s.eeee.mmm with e ≥ 1 is the bits
// (eeeemmm << 20) + (120 << 23); with e = 0 the same bits one binade up, 2^-6 + m · 2^-9, less
// 2^-6 (exact: m · 2^-9, +0 for m = 0); 0x7F is NaN; then the sign.
inline float e4m3_lanes(uint32_t byte) {
  const uint32_t mag = byte & 0x7Fu;
  const uint32_t sub = 0u - uint32_t(mag < 8), nan = 0u - uint32_t(mag == 0x7Fu);
  const float v = bits_float((mag << 20) + (120u << 23) + (sub & (1u << 23))) -
                  bits_float(sub & 0x3C800000u);  // 2^-6 where e = 0, else +0
  const uint32_t bits = (0x7FC00000u & nan) | (float_bits(v) & ~nan);
  return bits_float(bits | ((byte & 0x80u) << 24));
}

void widen_generic(const SelectArgs& a, const void* src, int64_t n, float* dst) {
  if (a.k_type == ffi::DataType::BF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
  } else {
    const uint8_t* s = static_cast<const uint8_t*>(src);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = e4m3_lanes(s[i]);
  }
}

// q · key c for kGenericKeys consecutive widened keys (Dp floats each, a multiple of 8), each with
// kLanes partial sums (lane l: dims l, l + 8, ...; explicit fma, increasing dim), folded as
// ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)). The keys give independent fma chains and
// a key's lanes one vector fma (`omp simd`), so portable C++ keeps the FMA pipes busy.
constexpr int kGenericKeys = 8;

static_assert(kKeyTile % kGenericKeys == 0, "key groups stay inside the tile");

inline void dots_generic(const float* q, const float* key, int64_t Dp, float* out) {
  static_assert(kGenericKeys == 8 && kLanes == 8, "the fold below is an 8 x 8 tree");
  float x[kGenericKeys][kLanes] = {};
  for (int64_t d = 0; d < Dp; d += kLanes)
    for (int c = 0; c < kGenericKeys; ++c) {
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) x[c][l] = std::fma(q[d + l], key[c * Dp + d + l], x[c][l]);
    }
  // The 8 keys' folds as vectors: lane c of the result is key c's fold8.
  generic::v8f v[kGenericKeys];
  std::memcpy(v, x, sizeof(v));
  generic::store8(out, generic::fold8x8(v));
}

// Each seeing row's block maximum over the tile's keys [0, n) (o0: the first one's offset in
// the block), kGenericKeys consecutive tile rows at a time: a group may reach past key n − 1
// into rows of the tile not filled by this block (allocated, never used in a maximum).
void rows_max_generic(const SelectArgs& a, const Buffers& buf, int64_t b, int64_t o0, int64_t n) {
  float d[kGenericKeys];
  for (const Row& r : buf.seeing) {
    const int64_t lim = std::min(visible_limit(a, r, b, o0), n - 1);
    float m = r.scores[b];
    for (int64_t o = 0; o <= lim; o += kGenericKeys) {
      dots_generic(r.q, buf.tile.data() + o * a.Dp, a.Dp, d);
      for (int c = 0; c < kGenericKeys; ++c)
        if (o + c <= lim && d[c] > m) m = d[c];  // NaN never wins: it counts as −inf
    }
    r.scores[b] = m;
  }
}

// Widens keys [o0, o0 + n) of the block into the tile (rows of Dp floats, zero past Di).
template <typename Widen>
void widen_tile(const SelectArgs& a, Buffers& buf, const BlockJob& job, int64_t o0, int64_t n,
                Widen widen) {
  buf.tile.resize(kKeyTile * a.Dp);
  for (int64_t o = 0; o < n; ++o) {
    float* dst = buf.tile.data() + o * a.Dp;
    widen(a, job.keys + (o0 + o) * key_bytes(a), a.Di, dst);
    std::fill(dst + a.Di, dst + a.Dp, 0.0f);
  }
}

// ---- generic decode, bf16 keys: straight from the cache ----
// With few rows per block, the tile's store and reload cost as much as the dot products. Here
// each bf16 key's 8 dims are widened in registers (the bits shifted up) and meet R rows at
// once, R · C = 8 dot products in flight, the 8 folds as one fold8x8 — the same fmas in the
// same order, so the same bits. E4M3 keys keep the tile: their widening vectorizes across the
// whole key there (16 lanes on AVX-512), and on 8 lanes in registers it cost 1.4× the time.
typedef uint32_t v8u32 __attribute__((vector_size(32)));

inline generic::v8f widen8(const uint16_t* p) {
  typedef uint16_t v8u16 __attribute__((vector_size(16)));
  v8u16 h;
  std::memcpy(&h, p, sizeof(h));
  return (generic::v8f)(__builtin_convertvector(h, v8u32) << 16);
}

template <int R, int C, typename T>
void rows_max_direct(const SelectArgs& a, const Row* const* rows, const T* base, int64_t b,
                     int64_t n, const char* next) {
  static_assert(R * C == 8, "one fold8x8");
  const float* q[R];
  int64_t lim[R];
  float m[R];
  for (int r = 0; r < R; ++r) {
    q[r] = rows[r]->q;
    lim[r] = visible_limit(a, *rows[r], b, 0);
    m[r] = rows[r]->scores[b];
  }
  const int64_t kb = key_bytes(a);
  for (int64_t o = 0; o < n; o += C) {
    const T* k[C];
    for (int c = 0; c < C; ++c) k[c] = base + std::min<int64_t>(o + c, n - 1) * a.Di;
    if (next)
      for (int64_t byte = o * kb; byte < (o + C) * kb; byte += 64)
        __builtin_prefetch(next + byte, 0, 3);
    generic::v8f x[8] = {};
    for (int64_t d = 0; d < a.Di; d += kLanes) {
      generic::v8f key[C];
      for (int c = 0; c < C; ++c) key[c] = widen8(k[c] + d);
      for (int r = 0; r < R; ++r) {
        const generic::v8f qr = generic::load8(q[r] + d);
        for (int c = 0; c < C; ++c) x[r * C + c] = generic::fma8(qr, key[c], x[r * C + c]);
      }
    }
    float s[8];
    generic::store8(s, generic::fold8x8(x));
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        if (o + c <= lim[r] && s[r * C + c] > m[r]) m[r] = s[r * C + c];
  }
  for (int r = 0; r < R; ++r) rows[r]->scores[b] = m[r];
}

template <typename T>
void all_rows_direct(const SelectArgs& a, const Buffers& buf, const T* base, int64_t b, int64_t n,
                     const char* next) {
  const int64_t S = int64_t(buf.seeing.size());
  for (int64_t i = 0; i < S; i += 4) {
    const Row* r[4];
    for (int j = 0; j < 4; ++j) r[j] = &buf.seeing[std::min(i + j, S - 1)];
    const int64_t left = S - i;
    if (left == 1) rows_max_direct<1, 8>(a, r, base, b, n, next);
    else if (left == 2) rows_max_direct<2, 4>(a, r, base, b, n, next);
    else rows_max_direct<4, 2>(a, r, base, b, n, next);
    next = nullptr;
  }
}

// Tiles of widened keys (the widening and the dot products are separate loops: GCC and Clang
// vectorize both; widening in the dot loop spilled its halves through the stack).
// The next valid block's keys at the same offsets are prefetched tile by tile, so its page
// arrives while this one is scored (a decode request's pages are scattered over the pool).
void score_block_generic(const SelectArgs& a, Buffers& buf, const BlockJob& job) {
  if (a.k_type == ffi::DataType::BF16 && a.Di % kLanes == 0 &&
      int64_t(buf.seeing.size()) <= kFewRows)
    return all_rows_direct(a, buf, reinterpret_cast<const uint16_t*>(job.keys), job.b,
                           job.n_keys, job.next);
  const int64_t kb = key_bytes(a);
  for (int64_t o0 = 0; o0 < job.n_keys; o0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, job.n_keys - o0);
    if (job.next)
      for (int64_t byte = o0 * kb; byte < (o0 + n) * kb; byte += 64)
        __builtin_prefetch(job.next + byte, 0, 3);
    widen_tile(a, buf, job, o0, n, widen_generic);
    rows_max_generic(a, buf, job.b, o0, n);
  }
}

// ---- the avx2 path: the same sums, 12 dot products at a time -----------------------------
// Keys are read straight from the cache (bf16 / E4M3 widened in registers) when few rows see
// the block (decode), or widened once into a tile shared by many rows (prefill). Either way
// each dot product is the generic layout: one ymm accumulator (lane l), one fma per 8 dims,
// then dot_generic's tree by hadd, 4 dot products at a time. 12 accumulators in flight
// (R rows × C keys) keep both FMA pipes busy through the 4-cycle fma latency.
#if M3_X86
// f16c: E4M3 keys widen through fp16 (every AVX2 CPU has F16C; has_f16c() checks it anyway).
#define M3_AVX2 __attribute__((target("avx2,fma,f16c")))

M3_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

M3_AVX2 inline __m256 load8(const uint16_t* p) {
  const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}

// E4M3 through fp16: s.eeee.mmm → the fp16 bits s.0eeee.mmm0000000, which are the value · 2^-8
// exactly (an E4M3 subnormal becomes an fp16 subnormal; vcvtph2ps converts those exactly and
// ignores MXCSR.DAZ), then × 256 (exact). 0x7F / 0xFF become the fp16 NaN 0x7E00 / 0xFE00, which
// widen to 0x7FC00000 | sign and stay so through the multiply. Equal to e4m3_to_float, bit for
// bit, for all 256 bytes. x: the bytes zero-extended to 16-bit lanes.
M3_AVX2 inline __m128i e4m3_half_bits(__m128i x) {  // 8 lanes
  const __m128i mag = _mm_set1_epi16(0x7F);
  const __m128i h = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(x, 8), 1),  // s.s.eeee.mmm.0⁷
                                  _mm_set1_epi16(int16_t(0xBFFF)));         // → s.0.eeee.mmm.0⁷
  const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(x, mag), mag);
  return _mm_xor_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x3F80 ^ 0x7E00)));
}

M3_AVX2 inline __m256i e4m3_half_bits(__m256i x) {  // 16 lanes, the same steps
  const __m256i mag = _mm256_set1_epi16(0x7F);
  const __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(x, 8), 1),
                                     _mm256_set1_epi16(int16_t(0xBFFF)));
  const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(x, mag), mag);
  return _mm256_xor_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x3F80 ^ 0x7E00)));
}

M3_AVX2 inline __m256 load8(const uint8_t* p) {
  long long raw;
  std::memcpy(&raw, p, 8);
  const __m128i h = e4m3_half_bits(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(raw)));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}

// 16 E4M3 values at once (the 16-bit work on one ymm): dims [0, 8) in *lo, [8, 16) in *hi.
M3_AVX2 inline void load16(const uint8_t* p, __m256* lo, __m256* hi) {
  const __m256i h = e4m3_half_bits(
      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  *lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_set1_ps(256.0f));
  *hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), _mm256_set1_ps(256.0f));
}

// E4M3 keys of a block with no NaN byte, dotted with q · 256 (score_block_avx2 checks both):
// the fp16 bits alone (value · 2^-8, exact) — q · 256 · (k · 2^-8) is the same exact product,
// so every fma rounds the same. Saves the NaN fix and the multiply.
struct E4M3Scaled {
  uint8_t byte;
};

M3_AVX2 inline __m128i e4m3_half_bits_finite(__m128i x) {  // no 0x7F / 0xFF among the bytes
  return _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(x, 8), 1), _mm_set1_epi16(int16_t(0xBFFF)));
}

M3_AVX2 inline __m256 load8(const E4M3Scaled* p) {
  long long raw;
  std::memcpy(&raw, p, 8);
  return _mm256_cvtph_ps(e4m3_half_bits_finite(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(raw))));
}

M3_AVX2 inline void load16(const E4M3Scaled* p, __m256* lo, __m256* hi) {
  const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(x, 8), 1),
                                     _mm256_set1_epi16(int16_t(0xBFFF)));
  *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// Whether any of the n bytes is an E4M3 NaN (0x7F / 0xFF).
M3_AVX2 bool e4m3_any_nan(const uint8_t* p, int64_t n) {
  const __m256i mag = _mm256_set1_epi8(0x7F);
  __m256i m = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    m = _mm256_max_epu8(m, _mm256_and_si256(
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)), mag));
  bool nan = _mm256_movemask_epi8(_mm256_cmpeq_epi8(m, mag)) != 0;
  for (; i < n; ++i) nan |= (p[i] & 0x7F) == 0x7F;
  return nan;
}

// Points the seeing rows at q · 256; false (nothing changed) unless every q is ±0, normal below
// 2^120, ±inf or NaN (tested on the bits, whatever MXCSR says): then q · 256 is exact and normal
// under FTZ / DAZ too, and so is k · 2^-8, so each fma sees the same exact product as q · k.
M3_AVX2 bool scale_seeing_q(const SelectArgs& a, Buffers& buf) {
  const int64_t S = int64_t(buf.seeing.size());
  buf.q256.resize(S * a.Dp);
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i min_normal = _mm256_set1_epi32(0x00800000 - 1), zero = _mm256_setzero_si256();
  const __m256i big = _mm256_set1_epi32(0x7B800000 - 1), inf = _mm256_set1_epi32(0x7F800000);
  __m256i bad = zero;
  for (int64_t i = 0; i < S; ++i)
    for (int64_t d = 0; d < a.Dp; d += kLanes) {
      const __m256 v = _mm256_loadu_ps(buf.seeing[i].q + d);
      const __m256i m = _mm256_and_si256(_mm256_castps_si256(v), abs_mask);
      const __m256i subnormal =
          _mm256_and_si256(_mm256_cmpgt_epi32(m, zero), _mm256_cmpgt_epi32(min_normal, m));
      const __m256i huge = _mm256_and_si256(_mm256_cmpgt_epi32(m, big), _mm256_cmpgt_epi32(inf, m));
      bad = _mm256_or_si256(bad, _mm256_or_si256(subnormal, huge));
      _mm256_storeu_ps(buf.q256.data() + i * a.Dp + d, _mm256_mul_ps(v, _mm256_set1_ps(256.0f)));
    }
  if (!_mm256_testz_si256(bad, bad)) return false;
  for (int64_t i = 0; i < S; ++i) buf.seeing[i].q = buf.q256.data() + i * a.Dp;
  return true;
}

M3_AVX2 void widen_avx2(const SelectArgs& a, const void* src, int64_t n, float* dst) {
  int64_t i = 0;
  const uint16_t* bf16 = static_cast<const uint16_t*>(src);
  const uint8_t* e4m3 = static_cast<const uint8_t*>(src);
  if (a.k_type == ffi::DataType::BF16)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(bf16 + i));
  else
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(e4m3 + i));
  const int64_t elem = a.k_type == ffi::DataType::BF16 ? 2 : 1;
  widen_generic(a, static_cast<const char*>(src) + i * elem, n - i, dst + i);
}

// out[r·C + c] = q[r] · k[c] for R·C = 12 dot products over Dp dims (a multiple of 8).
template <int R, int C, typename T>
M3_AVX2 inline void dots(const float* const* q, const T* const* k, int64_t Dp, float* out) {
  static_assert(R * C == 12, "three hadd trees of four");
  __m256 x[12];
  for (auto& v : x) v = _mm256_setzero_ps();
  int64_t d = 0;
  if constexpr ((std::is_same_v<T, uint8_t> || std::is_same_v<T, E4M3Scaled>) && C <= 4) {
    // E4M3: 16 dims a step (one 16-bit widening for two ymm); each accumulator still takes
    // dim d, then d + 8: the same sums.
#pragma GCC unroll 2
    for (; d + 2 * kLanes <= Dp; d += 2 * kLanes) {
      __m256 lo[C], hi[C];
      for (int c = 0; c < C; ++c) load16(k[c] + d, &lo[c], &hi[c]);
      for (int r = 0; r < R; ++r) {
        const __m256 q0 = _mm256_loadu_ps(q[r] + d), q1 = _mm256_loadu_ps(q[r] + d + kLanes);
        for (int c = 0; c < C; ++c)
          x[r * C + c] = _mm256_fmadd_ps(q1, hi[c], _mm256_fmadd_ps(q0, lo[c], x[r * C + c]));
      }
    }
  }
#pragma GCC unroll 4  // 4 × 12 fmas between loop tests: 50 vs 35 GFLOP/s on one Zen 3 core
  for (; d < Dp; d += kLanes) {
    __m256 key[C];
    for (int c = 0; c < C; ++c) key[c] = load8(k[c] + d);
    for (int r = 0; r < R; ++r) {
      const __m256 qr = _mm256_loadu_ps(q[r] + d);
      for (int c = 0; c < C; ++c) x[r * C + c] = _mm256_fmadd_ps(qr, key[c], x[r * C + c]);
    }
  }
  // hadd pairs (x0+x1, x2+x3 | x4+x5, x6+x7) per 128-bit half, the second hadd adds those
  // pairs, the last add joins the halves: dot_generic's tree.
  for (int i = 0; i < 12; i += 4) {
    const __m256 h =
        _mm256_hadd_ps(_mm256_hadd_ps(x[i], x[i + 1]), _mm256_hadd_ps(x[i + 2], x[i + 3]));
    _mm_storeu_ps(out + i, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
}

// Block maxima of R rows (repeats allowed) over keys [0, n) at base + o·stride (tile offsets;
// o0 is the tile's first key in the block), C keys at a time; a key index past n − 1 is read
// as key n − 1 (the same dot product again: the max does not change). `next`, if set, is
// prefetched at the same offsets.
template <int R, int C, typename T>
M3_AVX2 void rows_max(const SelectArgs& a, const Row* const* rows, const T* base, int64_t stride,
                      int64_t Dp, int64_t b, int64_t o0, int64_t n, const char* next) {
  const float* q[R];
  int64_t lim[R];
  float m[R];
  for (int r = 0; r < R; ++r) {
    q[r] = rows[r]->q;
    lim[r] = visible_limit(a, *rows[r], b, o0);
    m[r] = rows[r]->scores[b];
  }
  const int64_t kb = key_bytes(a);
  alignas(16) float d[12];
  for (int64_t o = 0; o < n; o += C) {
    const T* k[C];
    for (int c = 0; c < C; ++c) k[c] = base + std::min(o + c, n - 1) * stride;
    if (next)
      for (int64_t byte = o * kb; byte < (o + C) * kb; byte += 64)
        _mm_prefetch(next + byte, _MM_HINT_T0);
    dots<R, C>(q, k, Dp, d);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        if (o + c <= lim[r] && d[r * C + c] > m[r]) m[r] = d[r * C + c];
  }
  for (int r = 0; r < R; ++r) rows[r]->scores[b] = m[r];  // a repeated row: the same value
}

// Every seeing row: groups of 4 rows × 3 keys; the last 1–3 rows as 1 × 12, 2 × 6, 3 × 4.
template <typename T>
M3_AVX2 void all_rows_max(const SelectArgs& a, const Buffers& buf, const T* base, int64_t stride,
                          int64_t Dp, int64_t b, int64_t o0, int64_t n, const char* next) {
  const int64_t S = int64_t(buf.seeing.size());
  for (int64_t i = 0; i < S; i += 4) {
    const Row* r[4];
    for (int j = 0; j < 4; ++j) r[j] = &buf.seeing[std::min(i + j, S - 1)];
    const int64_t left = S - i;
    if (left == 1) rows_max<1, 12>(a, r, base, stride, Dp, b, o0, n, next);
    else if (left == 2) rows_max<2, 6>(a, r, base, stride, Dp, b, o0, n, next);
    else if (left == 3) rows_max<3, 4>(a, r, base, stride, Dp, b, o0, n, next);
    else rows_max<4, 3>(a, r, base, stride, Dp, b, o0, n, next);
    next = nullptr;  // prefetched once
  }
}

M3_AVX2 void score_block_avx2(const SelectArgs& a, Buffers& buf, const BlockJob& job) {
  if (a.Di % kLanes == 0 && int64_t(buf.seeing.size()) <= kFewRows) {
    if (a.k_type == ffi::DataType::BF16)
      all_rows_max(a, buf, reinterpret_cast<const uint16_t*>(job.keys), a.Di, a.Di, job.b, 0,
                   job.n_keys, job.next);
    else if (!e4m3_any_nan(reinterpret_cast<const uint8_t*>(job.keys), job.n_keys * a.Di) &&
             scale_seeing_q(a, buf))
      all_rows_max(a, buf, reinterpret_cast<const E4M3Scaled*>(job.keys), a.Di, a.Di, job.b, 0,
                   job.n_keys, job.next);
    else
      all_rows_max(a, buf, reinterpret_cast<const uint8_t*>(job.keys), a.Di, a.Di, job.b, 0,
                   job.n_keys, job.next);
    return;
  }
  for (int64_t o0 = 0; o0 < job.n_keys; o0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, job.n_keys - o0);
    widen_tile(a, buf, job, o0, n, widen_avx2);
    all_rows_max(a, buf, buf.tile.data(), a.Dp, a.Dp, job.b, o0, n, nullptr);
  }
}

// ---- the avx512 path: two keys per zmm ----------------------------------------------------
// A zmm holds lane l of two keys' dot products (key c in lanes [0, 8), key c + 1 in [8, 16))
// against a row's q broadcast to both halves: per 8 dims one fma serves two keys, where the avx2
// path needs one per key. Decode (few rows) reads the keys straight from the cache (bf16, or
// E4M3 through fp16 against q · 256, as the avx2 shortcut, both halves in one conversion);
// prefill widens a tile of keys once, stored pairwise ([key c dims 8j..8j+7, key c + 1 the
// same] for each j) so that a pair's 16 dims are one load. Every lane takes the same fmas in the
// same order as the generic layout and the fold below is its tree, so the scores are the same
// bits. Blocks seen by one or two rows, or with Dp not a multiple of 16, go to the avx2 path;
// decode blocks with an E4M3 NaN byte or a q the ×256 trick cannot scale, to the pairwise tile.
#define M3_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

// Dims [d, d + 16) of keys k0 and k1: *lo = [k0 d..d+7 | k1 d..d+7], *hi = [.. d+8..d+15].
M3_AVX512 inline void load_pair(const uint16_t* k0, const uint16_t* k1, __m512* lo, __m512* hi) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k0));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k1));
  auto widen = [](__m256i h) {  // 16 bf16 → fp32: the bits shifted up
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  };
  *lo = widen(_mm256_permute2x128_si256(a, b, 0x20));
  *hi = widen(_mm256_permute2x128_si256(a, b, 0x31));
}

M3_AVX512 inline void load_pair(const E4M3Scaled* k0, const E4M3Scaled* k1, __m512* lo,
                                __m512* hi) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(k0));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(k1));
  // bytes [k0 d..d+7, k1 d..d+7 | k0 d+8.., k1 d+8..] → 16-bit fp16 bits (value · 2^-8)
  const __m512i x = _mm512_cvtepu8_epi16(
      _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi64(a, b)),
                              _mm_unpackhi_epi64(a, b), 1));
  const __m512i h = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(x, 8), 1),
                                     _mm512_set1_epi16(int16_t(0xBFFF)));
  *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

// A pair of widened keys in the pairwise tile: dims [d, d + 16) are 32 floats at pair + d.
struct TilePair {
  float v[2];
};

M3_AVX512 inline void load_pair(const TilePair* pair, const TilePair*, __m512* lo, __m512* hi) {
  *lo = _mm512_loadu_ps(pair->v);
  *hi = _mm512_loadu_ps(pair->v + 16);
}

// [a0+a1, a2+a3, b0+b1, b2+b3] in each 128-bit quarter: _mm256_hadd_ps, on a zmm.
M3_AVX512 inline __m512 hadd512(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

// out[r · 2P + c] = q[r] · k[c] for R rows and 2P keys (k[2p], k[2p + 1]: pair p) over D dims
// (a multiple of 16).
template <int R, int P, typename T>
M3_AVX512 inline void dots512(const float* const* q, const T* const* k, int64_t D, float* out) {
  static_assert(R * P % 4 == 0 && R * P <= 16, "folds of four accumulators");
  __m512 x[R * P];
  for (auto& v : x) v = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    __m512 q0[R], q1[R];
    for (int r = 0; r < R; ++r) {
      q0[r] = _mm512_broadcast_f32x8(_mm256_loadu_ps(q[r] + d));
      q1[r] = _mm512_broadcast_f32x8(_mm256_loadu_ps(q[r] + d + 8));
    }
    for (int p = 0; p < P; ++p) {
      __m512 lo, hi;
      load_pair(k[2 * p] + d, k[2 * p + 1] + d, &lo, &hi);
      for (int r = 0; r < R; ++r)
        x[r * P + p] = _mm512_fmadd_ps(q1[r], hi, _mm512_fmadd_ps(q0[r], lo, x[r * P + p]));
    }
  }
  // The avx2 fold on four accumulators at once: quarter 0 (+ 1) holds their first keys' lanes
  // 0-3 (4-7), quarters 2 and 3 their second keys'.
  for (int i = 0; i < R * P; i += 4) {
    const __m512 h = hadd512(hadd512(x[i], x[i + 1]), hadd512(x[i + 2], x[i + 3]));
    const __m512 s = _mm512_add_ps(h, _mm512_shuffle_f32x4(h, h, _MM_SHUFFLE(2, 3, 0, 1)));
    alignas(64) float v[16];
    _mm512_store_ps(v, s);
    for (int j = 0; j < 4; ++j) {
      const int r = (i + j) / P, p = (i + j) % P;
      out[r * 2 * P + 2 * p] = v[j];
      out[r * 2 * P + 2 * p + 1] = v[8 + j];
    }
  }
}

// Block maxima of R rows (repeats allowed) over keys [0, n), 2P at a time, as rows_max: the
// keys from the cache (base + key · Di; a key index past n − 1 reads key n − 1), or from the
// pairwise tile (o0: its first key's offset in the block; rows of the tile past n are read and
// never used in a maximum).
template <int R, int P, typename T>
M3_AVX512 void rows_max512(const SelectArgs& a, const Row* const* rows, const T* base, int64_t D,
                           int64_t b, int64_t o0, int64_t n, const char* next) {
  const float* q[R];
  int64_t lim[R];
  float m[R];
  for (int r = 0; r < R; ++r) {
    q[r] = rows[r]->q;
    lim[r] = visible_limit(a, *rows[r], b, o0);
    m[r] = rows[r]->scores[b];
  }
  const int64_t kb = key_bytes(a);
  float d[R * 2 * P];
  for (int64_t o = 0; o < n; o += 2 * P) {
    const T* k[2 * P];
    for (int c = 0; c < 2 * P; ++c)
      k[c] = std::is_same_v<T, TilePair> ? base + (o + c) / 2 * D
                                         : base + std::min<int64_t>(o + c, n - 1) * a.Di;
    if (next)
      for (int64_t byte = o * kb; byte < (o + 2 * P) * kb; byte += 64)
        _mm_prefetch(next + byte, _MM_HINT_T0);
    dots512<R, P>(q, k, D, d);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 2 * P; ++c)
        if (o + c <= lim[r] && d[r * 2 * P + c] > m[r]) m[r] = d[r * 2 * P + c];
  }
  for (int r = 0; r < R; ++r) rows[r]->scores[b] = m[r];
}

// Every seeing row, 4 at a time; 2P keys a step, P such that 2P divides kKeyTile (the tile).
template <typename T>
M3_AVX512 void all_rows_max512(const SelectArgs& a, const Buffers& buf, const T* base, int64_t D,
                               int64_t b, int64_t o0, int64_t n, const char* next) {
  const int64_t S = int64_t(buf.seeing.size());
  for (int64_t i = 0; i < S; i += 4) {
    const Row* r[4];
    for (int j = 0; j < 4; ++j) r[j] = &buf.seeing[std::min(i + j, S - 1)];
    const int64_t left = S - i;
    if (left == 1) rows_max512<1, 12>(a, r, base, D, b, o0, n, next);
    else if (left == 2) rows_max512<2, 6>(a, r, base, D, b, o0, n, next);
    else if (left == 3) rows_max512<3, 4>(a, r, base, D, b, o0, n, next);
    else rows_max512<4, 4>(a, r, base, D, b, o0, n, next);
    next = nullptr;  // prefetched once
  }
}
static_assert(kKeyTile % 24 == 0, "2P = 24, 12 and 8 keys a step stay inside the tile");

// Widens keys [o0, o0 + n) of the block into the pairwise tile (Dp floats per key, zero past Di).
M3_AVX512 void widen_tile_pairs(const SelectArgs& a, Buffers& buf, const BlockJob& job, int64_t o0,
                                int64_t n) {
  buf.tile.resize(kKeyTile * a.Dp);
  for (int64_t o = 0; o < n; ++o) {
    float* dst = buf.tile.data() + (o / 2) * 2 * a.Dp + (o % 2) * kLanes;
    const char* src = job.keys + (o0 + o) * key_bytes(a);
    for (int64_t d = 0; d < a.Dp; d += kLanes) {
      __m256 v = _mm256_setzero_ps();
      if (d + kLanes <= a.Di)
        v = a.k_type == ffi::DataType::BF16 ? load8(reinterpret_cast<const uint16_t*>(src) + d)
                                            : load8(reinterpret_cast<const uint8_t*>(src) + d);
      else if (d < a.Di) {
        alignas(32) float t[kLanes] = {};
        widen_generic(a, src + d * (key_bytes(a) / a.Di), a.Di - d, t);
        v = _mm256_load_ps(t);
      }
      _mm256_storeu_ps(dst + 2 * d, v);
    }
  }
}

M3_AVX512 void score_block_avx512(const SelectArgs& a, Buffers& buf, const BlockJob& job) {
  if (a.Dp % 16 != 0) return score_block_avx2(a, buf, job);
  const int64_t rows = int64_t(buf.seeing.size());
  // One or two rows: one or two fmas per widened pair, and the pair's shuffles bind — the avx2
  // kernel was as fast or faster there (docs/perf-log/cpu-backend.md, 2026-12-08).
  if (rows <= 2) return score_block_avx2(a, buf, job);
  if (a.Di == a.Dp && rows <= kFewRows) {
    if (a.k_type == ffi::DataType::BF16)
      return all_rows_max512(a, buf, reinterpret_cast<const uint16_t*>(job.keys), a.Di, job.b, 0,
                             job.n_keys, job.next);
    if (!e4m3_any_nan(reinterpret_cast<const uint8_t*>(job.keys), job.n_keys * a.Di) &&
        scale_seeing_q(a, buf))
      return all_rows_max512(a, buf, reinterpret_cast<const E4M3Scaled*>(job.keys), a.Di, job.b,
                             0, job.n_keys, job.next);
  }
  for (int64_t o0 = 0; o0 < job.n_keys; o0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, job.n_keys - o0);
    widen_tile_pairs(a, buf, job, o0, n);
    all_rows_max512(a, buf, reinterpret_cast<const TilePair*>(buf.tile.data()), a.Dp, job.b, o0,
                    n, nullptr);
  }
}

// The avx2 path's E4M3 widening needs F16C (CPUID.1:ECX bit 29), which isa.h does not check:
// every AVX2 CPU has it, but a virtual machine may hide it. Without it: the generic path.
bool has_f16c() {
  static const bool f16c = [] {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c >> 29 & 1);
  }();
  return f16c;
}
#endif

using ScoreBlock = void (*)(const SelectArgs&, Buffers&, const BlockJob&);

// ---- one piece ---------------------------------------------------------------------------

bool live_token(const SelectArgs& a, int64_t t) {
  const int64_t r = a.req[t];
  return r >= 0 && r < a.R && a.pos[t] >= 0 && a.layer >= 0 && a.layer < a.L;
}

// SPEC §8 step 4 for one row; writes its K ids (−1 padded) at `out`.
void top_k(const SelectArgs& a, const Row& row, std::vector<int64_t>& top, int32_t* out) {
  const int64_t own = row.pos / a.N;
  const int64_t lo = std::max<int64_t>(0, own - a.local + 1);
  int64_t k = 0;
  for (int64_t b = lo; b <= row.last && k < a.K; ++b) out[k++] = int32_t(b);
  const int64_t room = a.K - k;
  top.clear();
  for (int64_t b = 0; b <= row.last && room > 0; ++b) {
    const float s = row.scores[b];
    if ((b >= lo && b <= own) || !is_finite(s)) continue;
    if (int64_t(top.size()) == room && !(s > row.scores[top.back()])) continue;
    if (int64_t(top.size()) == room) top.pop_back();
    auto at = top.end();
    while (at != top.begin() && s > row.scores[*(at - 1)]) --at;  // equal scores: older first
    top.insert(at, b);
  }
  for (int64_t b : top) out[k++] = int32_t(b);
  for (; k < a.K; ++k) out[k] = -1;
}

// Step 2: the piece's rows (padding rows written as −1 here); returns its block count.
int64_t gather_rows(const SelectArgs& a, Buffers& buf, Piece piece) {
  const int64_t n_tok = piece.t1 - piece.t0;
  int64_t blocks = 0;  // candidates of the piece: [0, blocks)
  for (int64_t t = piece.t0; t < piece.t1; ++t)
    if (live_token(a, t)) blocks = std::max(blocks, std::min<int64_t>(a.pos[t] / a.N, a.M - 1) + 1);
  buf.rows.clear();
  buf.q.assign(n_tok * a.Hkv * a.Dp, 0.0f);
  buf.scores.assign(n_tok * a.Hkv * blocks, kNegInf);
  for (int64_t t = piece.t0; t < piece.t1; ++t)
    for (int64_t g = 0; g < a.Hkv; ++g) {
      if (!live_token(a, t)) {
        std::fill_n(a.out + (g * a.T + t) * a.K, a.K, -1);
        continue;
      }
      const int64_t i = (t - piece.t0) * a.Hkv + g;
      float* q = buf.q.data() + i * a.Dp;
      if (a.q_type == ffi::DataType::F32) {
        const float* src = static_cast<const float*>(a.q) + (t * a.Hkv + g) * a.Di;
        std::copy(src, src + a.Di, q);
      } else {
        const uint16_t* src = static_cast<const uint16_t*>(a.q) + (t * a.Hkv + g) * a.Di;
        for (int64_t d = 0; d < a.Di; ++d) q[d] = bf16_to_float(src[d]);
      }
      buf.rows.push_back({q, buf.scores.data() + i * blocks, a.pos[t],
                          std::min<int64_t>(a.pos[t] / a.N, a.M - 1)});
    }
  return blocks;
}

void select_piece(const SelectArgs& a, ScoreBlock score_block, Buffers& buf, Piece piece) {
  const int64_t blocks = gather_rows(a, buf, piece);
  const int64_t r = a.req[piece.t0];
  auto page_keys = [&](int64_t b) -> const char* {  // nullptr: an invalid page, never read
    const int64_t page = a.table[r * a.M + b];
    if (page < 0 || page >= a.P) return nullptr;
    const int64_t key0 = (int64_t(a.layer) * a.P + page) * a.N;  // 64-bit: large pools
    return static_cast<const char*>(a.keys) + key0 * key_bytes(a);
  };
  const char* keys = blocks ? page_keys(0) : nullptr;
  for (int64_t b = 0; b < blocks; ++b) {
    const char* next = nullptr;
    for (int64_t nb = b + 1; nb < blocks && !next; ++nb) next = page_keys(nb);
    if (keys) {
      buf.seeing.clear();
      int64_t n_keys = 0;
      for (const Row& row : buf.rows)
        if (row.last >= b) {
          buf.seeing.push_back(row);
          n_keys = std::max(n_keys, std::min(a.N, row.pos - b * a.N + 1));
        }
      score_block(a, buf, BlockJob{b, n_keys, keys, next});
    }
    keys = b + 1 < blocks ? page_keys(b + 1) : nullptr;
  }
  for (const Row& row : buf.rows) {
    const int64_t i = (row.q - buf.q.data()) / a.Dp;
    const int64_t t = piece.t0 + i / a.Hkv, g = i % a.Hkv;
    top_k(a, row, buf.top, a.out + (g * a.T + t) * a.K);
  }
}

// Step 1: maximal runs of one request id, cut into pieces of at most kPieceTokens.
std::vector<Piece> make_pieces(const SelectArgs& a) {
  std::vector<Piece> pieces;
  for (int64_t t0 = 0; t0 < a.T;) {
    int64_t t1 = t0 + 1;
    while (t1 < a.T && a.req[t1] == a.req[t0]) ++t1;
    for (int64_t s = t0; s < t1; s += kPieceTokens)
      pieces.push_back({s, std::min(t1, s + kPieceTokens)});
    t0 = t1;
  }
  return pieces;
}

ffi::Future SelectBlocks(ffi::ThreadPool pool, ffi::AnyBuffer idx_q, ffi::AnyBuffer idx_k_cache,
                         ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> query_req_id,
                         ffi::Buffer<ffi::S32> query_abs_pos, ffi::BufferR0<ffi::S32> layer,
                         ffi::Result<ffi::Buffer<ffi::S32>> topk, int64_t topk_blocks,
                         int64_t local_blocks) {
  SelectGeometry g;
  if (auto e = decode_select_geometry(idx_q, idx_k_cache, block_table, query_req_id,
                                      query_abs_pos, topk->dimensions(), topk_blocks,
                                      local_blocks, &g);
      e.failure())
    return ready_future(std::move(e));
  CpuPath path;
  if (!current_cpu_path(&path)) return ready_future(invalid(cpu_path_error()));

  SelectArgs a;
  a.q = idx_q.untyped_data();
  a.q_type = idx_q.element_type();
  a.keys = idx_k_cache.untyped_data();
  a.k_type = idx_k_cache.element_type();
  a.table = block_table.typed_data();
  a.req = query_req_id.typed_data();
  a.pos = query_abs_pos.typed_data();
  a.out = topk->typed_data();
  a.T = g.num_tokens;
  a.Hkv = g.num_kv_heads;
  a.Di = g.index_dim;
  a.Dp = (a.Di + kLanes - 1) / kLanes * kLanes;
  a.L = g.num_layers;
  a.P = g.num_pages;
  a.N = g.block_size;
  a.R = g.num_requests;
  a.M = g.max_blocks;
  a.K = topk_blocks;
  a.local = local_blocks;
  a.layer = *layer.typed_data();
  if (a.T == 0 || a.Hkv == 0) return ready_future();
  if (a.N == 0 || a.M == 0) a.L = 0;  // no key can be visible: every row is padding-like

  ScoreBlock kernel = score_block_generic;
#if M3_X86
  if (path >= CpuPath::kAvx2 && has_f16c()) kernel = score_block_avx2;
  if (path >= CpuPath::kAvx512 && has_f16c()) kernel = score_block_avx512;
#endif
  auto pieces = std::make_shared<std::vector<Piece>>(make_pieces(a));
  return parallel_for(pool, int64_t(pieces->size()), 1, [a, kernel, pieces](int64_t begin,
                                                                            int64_t end) {
    thread_local Buffers buf;
    for (int64_t i = begin; i < end; ++i) select_piece(a, kernel, buf, (*pieces)[i]);
  });
}

}  // namespace
}  // namespace m3sparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(m3sparse_select_blocks_cpu, m3sparse::SelectBlocks,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()               // idx_q
                                  .Arg<xla::ffi::AnyBuffer>()               // idx_k_cache
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // block_table
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // query_req_id
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // query_abs_pos
                                  .Arg<xla::ffi::BufferR0<xla::ffi::S32>>()  // layer
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()   // topk_indices
                                  .Attr<int64_t>("topk_blocks")
                                  .Attr<int64_t>("local_blocks"));
