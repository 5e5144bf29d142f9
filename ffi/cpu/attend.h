// The CPU sparse-attention core shared by the decode and prefill handlers (SPEC §5).
//
// Work item = (KV head g, token t); items are numbered g-major, so a task holds a run of
// consecutive tokens of one KV head, served kChunk at a time: each distinct page they select
// is dequantized once for all of them. The G = Hq/Hkv query heads of g share every
// dequantized K/V tile. For each selected block the SPEC §5.2 validity rules are checked
// before the page is touched; only the attended tokens of a valid page (p < vis) are read
// into the softmax and the PV product, so garbage in page tails never reaches the output.
// Online softmax in base 2, fp32 accumulation; k_scale is folded into the logit scale and
// v_scale into the epilogue. A row with nothing attended gets exact zeros.
//
// The tile math runs on one of several paths chosen per call (isa.h): `generic` here,
// `avx2` in attend_avx2.h, `avx512` and `amx` in attend_bf16.h. Each path is a Kernel of
// kChunk token slots with begin (a slot's q rows) / dequantize (one selected tile pair,
// shared) / block (fold it into one slot) / finish (a slot's normalized rows).
#pragma once

#include <memory>

#include "attend_common.h"
#include "attend_generic.h"
#include "isa.h"
#include "m3sparse/ffi_checks.h"
#include "parallel.h"
#if M3_X86
#include "attend_avx2.h"
#include "attend_bf16.h"
#endif

namespace m3sparse {

constexpr int64_t kItemsPerTask = 1;  // one item is 16 blocks of work: worth a task of its own
constexpr int64_t kChunk = 8;         // tokens whose selections are served together

// The kernel of this worker thread, kept across calls (its buffers are hundreds of KB).
template <typename Kernel>
Kernel& worker_kernel(int64_t G, int64_t D, int64_t N) {
  thread_local std::unique_ptr<Kernel> k;
  if (!k || k->G != G || k->D != D || k->N != N) k = std::make_unique<Kernel>(G, D, N, kChunk);
  return *k;
}

// One selected block of token slot c of a chunk: its logical block id, page and attended
// keys n.
struct Pick {
  int64_t block, page, n, c;
};

// Appends the valid picks of token t (slot c) of KV head g to `picks`, in slot order: none if
// the token attends nothing (no request, position < 0, or a layer outside the cache); invalid
// slots (SPEC §5.2) are left out.
inline void token_picks(const AttendArgs& a, int64_t t, int64_t g, int64_t c,
                        std::vector<Pick>& picks) {
  const int64_t N = a.geo.block_size;
  const int64_t r = (*a.req)[t];
  const int64_t vis = int64_t((*a.pos)[t]) + 1;
  if (r < 0 || r >= a.num_requests || vis <= 0 || !a.geo.valid_layer(a.layer)) return;
  const int32_t* ids = a.topk + (g * a.num_tokens + t) * a.topk_blocks;
  for (int64_t k = 0; k < a.topk_blocks; ++k) {
    const int64_t page = selected_page(a, r, ids[k], vis);
    if (page >= 0) picks.push_back({ids[k], page, std::min(N, vis - int64_t(ids[k]) * N), c});
  }
}

// Tokens [t0, t0 + count) of KV head g, served together: each selected page is dequantized
// once per run of picks that share it (with the largest n any of them attends) and folded
// into every token that selected it (a block selected twice counts twice, SPEC §5.1).
// Consecutive tokens of a prefill chunk mostly select the same blocks, so this divides the
// dequantization work by up to kChunk; tokens with nothing in common cost what they would
// alone.
// Every token folds its blocks in increasing logical block id (key position) order: the
// online softmax rounds (the bf16 paths round P against the running max), so the order is
// part of the result. Position order depends on nothing but the token's own selection, so
// its result is the same bits whatever its chunk holds, however tokens are grouped into
// tasks or devices, in whatever order the selection lists its blocks, and whichever pages
// hold them (an engine hands a request freed pages in any order, so ordering by page would
// make a request's logits change with its batch). Within one request a block id names one
// page, so the picks of a page stay adjacent after the sort; a page two requests share at
// different block ids is dequantized once per run.
template <typename Kernel>
void attend_chunk(const AttendArgs& a, Kernel& w, std::vector<float>& q, std::vector<Pick>& picks,
                  int64_t t0, int64_t count, int64_t g) {
  const int64_t G = a.num_heads / a.num_kv_heads;
  bool attended[kChunk] = {};
  picks.clear();
  for (int64_t c = 0; c < count; ++c) {
    token_picks(a, t0 + c, g, c, picks);
    load_floats(a.dtype, a.q, ((t0 + c) * a.num_heads + g * G) * a.geo.head_dim, q.size(), q.data());
    w.begin(c, q.data(), a.logit_scale);
  }
  std::stable_sort(picks.begin(), picks.end(), [](const Pick& x, const Pick& y) {
    return x.block != y.block ? x.block < y.block : x.page < y.page;
  });
  for (size_t i = 0; i < picks.size();) {
    const int64_t page = picks[i].page;
    size_t end = i;
    int64_t n = 0;
    for (; end < picks.size() && picks[end].page == page; ++end) n = std::max(n, picks[end].n);
    if (end < picks.size()) prefetch_tiles(a, picks[end].page, g);  // on its way from DRAM
    w.dequantize(a.geo, a.cache + a.geo.tile_offset(a.layer, page, 2 * g),
                 a.cache + a.geo.tile_offset(a.layer, page, 2 * g + 1), n);
    for (; i < end; ++i) {
      w.block(picks[i].c, picks[i].n);
      attended[picks[i].c] = true;
    }
  }
  for (int64_t c = 0; c < count; ++c)
    store_floats(a.dtype, w.finish(c, attended[c], a.v_scale), q.size(), a.out,
                 ((t0 + c) * a.num_heads + g * G) * a.geo.head_dim);
}

// Runs items [begin, end) (g-major: item = g·T + t) on one worker, kChunk tokens of one KV
// head at a time.
template <typename Kernel>
void attend_items(const AttendArgs& a, int64_t begin, int64_t end) {
  const int64_t G = a.num_heads / a.num_kv_heads, T = a.num_tokens;
  Kernel& w = worker_kernel<Kernel>(G, a.geo.head_dim, a.geo.block_size);
  std::vector<float> q(G * a.geo.head_dim);
  std::vector<Pick> picks;
  picks.reserve(kChunk * a.topk_blocks);
  for (int64_t item = begin; item < end;) {
    const int64_t g = item / T, t = item % T;
    const int64_t count = std::min({kChunk, end - item, T - t});
    attend_chunk(a, w, q, picks, t, count, g);
    item += count;
  }
}

// Validates the operands shared by decode and prefill and fills everything but req/pos.
inline ffi::Error prepare_attend(ffi::AnyBuffer q, ffi::AnyBuffer cache, ffi::Buffer<ffi::S32> topk,
                                 ffi::Buffer<ffi::S32> block_table, float k_scale, float v_scale,
                                 int32_t layer, ffi::Result<ffi::AnyBuffer> out, float scale,
                                 int64_t layout, AttendArgs* a) {
  auto qd = q.dimensions();
  auto td = topk.dimensions();
  auto bd = block_table.dimensions();
  if (qd.size() != 3) return invalid("q must be [T, Hq, D]");
  if (!is_supported_float(q.element_type()) || out->element_type() != q.element_type())
    return invalid("q and out must share one float dtype (f32, bf16, f16)");
  if (auto e = decode_cache_geometry(cache, layout, qd[2], &a->geo); e.failure()) return e;
  if (td.size() != 3 || td[1] != qd[0] || 2 * td[0] != a->geo.num_slots)
    return invalid("topk_indices must be [Hkv, T, K]");
  if (bd.size() != 2) return invalid("block_table must be [R, max_blocks]");
  if (qd[1] % td[0] != 0) return invalid("Hq must be a multiple of Hkv");
  a->cache = static_cast<const uint8_t*>(cache.untyped_data());
  a->layer = layer;
  a->dtype = q.element_type();
  a->q = q.untyped_data();
  a->out = out->untyped_data();
  a->topk = topk.typed_data();
  a->block_table = block_table.typed_data();
  a->num_tokens = qd[0];
  a->num_heads = qd[1];
  a->num_kv_heads = td[0];
  a->topk_blocks = td[2];
  a->num_requests = bd[0];
  a->max_blocks = bd[1];
  a->logit_scale = scale * k_scale * kLog2e;
  a->v_scale = v_scale;
  return ffi::Error::Success();
}

// Runs every (KV head, token) item on the thread pool, on the path isa.h picks.
inline ffi::Future run_attend(ffi::ThreadPool& pool, AttendArgs a) {
  CpuPath path;
  if (!current_cpu_path(&path))
    return ready_future(invalid(cpu_path_error()));
  void (*items_fn)(const AttendArgs&, int64_t, int64_t) = attend_items<generic::Kernel>;
#if M3_X86
  if (path >= CpuPath::kAvx2) items_fn = attend_items<avx2::Kernel>;
  if (path >= CpuPath::kAvx512) items_fn = attend_items<bf16tile::Kernel<bf16tile::DotMma>>;
  if (path >= CpuPath::kAmx) items_fn = attend_items<bf16tile::Kernel<bf16tile::AmxMma>>;
#endif
  return parallel_for(pool, a.num_tokens * a.num_kv_heads, kItemsPerTask,
                      [a, items_fn](int64_t begin, int64_t end) { items_fn(a, begin, end); });
}

}  // namespace m3sparse
