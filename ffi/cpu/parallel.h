// Splitting CPU work over XLA's intra-op thread pool (ffi::ThreadPool).
// The handler schedules chunks and returns a Future; it never blocks waiting for
// pool tasks (the pool may run them on the calling thread).
#pragma once

#include <algorithm>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace m3sparse {

namespace ffi = xla::ffi;

inline ffi::Future ready_future(ffi::Error error = ffi::Error::Success()) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (error.success()) promise.SetAvailable();
  else promise.SetError(error);
  return future;
}

// Runs body(begin, end) over [0, n) in chunks of at least `min_chunk` items.
template <typename Body>
ffi::Future parallel_for(ffi::ThreadPool& pool, int64_t n, int64_t min_chunk, Body body) {
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t chunks = std::clamp<int64_t>(n / std::max<int64_t>(1, min_chunk), 1, 4 * threads);
  if (n <= 0 || chunks == 1) {
    if (n > 0) body(int64_t{0}, n);
    return ready_future();
  }
  ffi::CountDownPromise done(chunks);
  ffi::Future future(done);
  for (int64_t c = 0; c < chunks; ++c) {
    int64_t begin = n * c / chunks, end = n * (c + 1) / chunks;
    pool.Schedule([=]() mutable {
      body(begin, end);
      done.CountDown();
    });
  }
  return future;
}

}  // namespace m3sparse
