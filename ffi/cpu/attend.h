// The CPU sparse-attention core shared by the decode and prefill handlers (SPEC §5).
//
// Work item = (KV head g, token t); items are numbered g-major, so a task holds a run of
// consecutive tokens of one KV head and its tile cache (attend_common.h) can reuse the
// dequantized tiles those tokens share. The G = Hq/Hkv query heads of g share every
// dequantized K/V tile. For each selected block the SPEC §5.2 validity rules are checked
// before the page is touched; only the attended tokens of a valid page (p < vis) are read
// into the softmax and the PV product, so garbage in page tails never reaches the output.
// Online softmax in base 2, fp32 accumulation; k_scale is folded into the logit scale and
// v_scale into the epilogue. A row with nothing attended gets exact zeros.
//
// The tile math runs on one of several paths chosen per call (isa.h): `generic` here,
// `avx2` in attend_avx2.h. Each path is a Kernel with begin (q rows) / block (one selected
// tile) / finish (the normalized rows).
#pragma once

#include <memory>

#include "attend_common.h"
#include "attend_generic.h"
#include "isa.h"
#include "m3sparse/ffi_checks.h"
#include "parallel.h"
#if M3_X86
#include "attend_avx2.h"
#endif

namespace m3sparse {

constexpr int64_t kItemsPerTask = 1;  // one item is 16 blocks of work: worth a task of its own

// The kernel of this worker thread, kept across calls (its tile cache is megabytes).
template <typename Kernel>
Kernel& worker_kernel(int64_t G, int64_t D, int64_t N) {
  thread_local std::unique_ptr<Kernel> k;
  if (!k || k->G != G || k->D != D || k->N != N) k = std::make_unique<Kernel>(G, D, N);
  return *k;
}

template <typename Kernel>
void attend_item(const AttendArgs& a, Kernel& w, std::vector<float>& q, int64_t t, int64_t g) {
  const int64_t N = a.geo.block_size;
  const int64_t G = a.num_heads / a.num_kv_heads;
  const int64_t row = (t * a.num_heads + g * G) * a.geo.head_dim;  // first of g's query heads
  const int64_t r = (*a.req)[t];
  const int64_t vis = int64_t((*a.pos)[t]) + 1;
  bool attended = false;  // a NaN in attended bytes must stay visible, so track this apart from l
  const bool reuse = (t > 0 && (*a.req)[t - 1] == r) ||
                     (t + 1 < a.num_tokens && (*a.req)[t + 1] == r);  // tiles worth caching
  if (r >= 0 && r < a.num_requests && vis > 0 && a.geo.valid_layer(a.layer)) {
    load_floats(a.dtype, a.q, row, q.size(), q.data());
    w.begin(q.data(), a.logit_scale);
    const int32_t* ids = a.topk + (g * a.num_tokens + t) * a.topk_blocks;
    int64_t next = a.topk_blocks > 0 ? selected_page(a, r, ids[0], vis) : -1;
    for (int64_t k = 0; k < a.topk_blocks; ++k) {
      const int64_t page = next;
      next = k + 1 < a.topk_blocks ? selected_page(a, r, ids[k + 1], vis) : -1;
      if (next >= 0) prefetch_tiles(a, next, g);  // DRAM latency hides behind this block's math
      if (page < 0) continue;
      w.block(a.geo, a.cache + a.geo.tile_offset(a.layer, page, 2 * g),
              a.cache + a.geo.tile_offset(a.layer, page, 2 * g + 1),
              std::min(N, vis - int64_t(ids[k]) * N), reuse);
      attended = true;
    }
  }
  store_floats(a.dtype, w.finish(attended, a.v_scale), q.size(), a.out, row);
}

// Runs items [begin, end) (g-major: item = g·T + t) on one worker.
template <typename Kernel>
void attend_items(const AttendArgs& a, int64_t begin, int64_t end) {
  const int64_t G = a.num_heads / a.num_kv_heads;
  Kernel& w = worker_kernel<Kernel>(G, a.geo.head_dim, a.geo.block_size);
  w.reset();  // the cache bytes may have changed since the last call
  std::vector<float> q(G * a.geo.head_dim);
  for (int64_t item = begin; item < end; ++item)
    attend_item(a, w, q, item % a.num_tokens, item / a.num_tokens);
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
    return ready_future(invalid("M3SPARSE_CPU_ISA must be one of generic, avx2, avx512, amx"));
  void (*items_fn)(const AttendArgs&, int64_t, int64_t) = attend_items<generic::Kernel>;
#if M3_X86
  if (path >= CpuPath::kAvx2) items_fn = attend_items<avx2::Kernel>;
#endif
  return parallel_for(pool, a.num_tokens * a.num_kv_heads, kItemsPerTask,
                      [a, items_fn](int64_t begin, int64_t end) { items_fn(a, begin, end); });
}

}  // namespace m3sparse
