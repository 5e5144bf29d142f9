// The nanobind module `jax_m3sparse.bench._m3sparse_cpu_bench`: the machine ceilings of
// `python -m jax_m3sparse.bench peak` (ffi/cpu/peak.cc). Built beside _m3sparse_cpu with the
// same flags; no op imports it.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

namespace nb = nanobind;

namespace m3sparse {
double peak_gflops(const std::string& kind, int threads);
double kernel_gflops(const std::string& path, bool cached);
}

NB_MODULE(_m3sparse_cpu_bench, m) {
  m.def("peak_gflops", &m3sparse::peak_gflops,
        "GFLOP/s of a register-resident multiply-add loop on `threads` threads; -1 if this machine lacks it.");
  m.def("kernel_gflops", &m3sparse::kernel_gflops,
        "GFLOP/s of one CPU path's per-block attention math on one thread; -1 if this machine lacks it.");
}
