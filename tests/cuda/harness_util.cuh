// What the standalone harnesses (harness.cu: attention and pack; select_harness.cu: the
// selection; grouped_harness.cu: the grouped matmul) need around their kernels: the CUDA error
// check, PASS/FAIL lines and their count, the copy rate the tables are read against, and timing
// a launch as a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, \
              __LINE__, #x);                                                           \
      exit(2);                                                                         \
    }                                                                                  \
  } while (0)

// Failed checks so far; report() prints one PASS/FAIL line (": detail" when given).
static int g_failures = 0;
static void report(bool ok, const std::string& what, const std::string& detail = "") {
  printf("%-6s %s%s%s\n", ok ? "PASS" : "FAIL", what.c_str(), detail.empty() ? "" : ": ",
         detail.c_str());
  if (!ok) ++g_failures;
  fflush(stdout);
}

// TB/s of a 2 GiB device-to-device cudaMemcpy (read + write), median of 5.
static double copy_bandwidth() {
  const size_t bytes = size_t(2) << 30;
  void *a, *b;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMemset(a, 1, bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
  std::vector<float> ts;
  for (int i = 0; i < 5; ++i) {
    CK(cudaEventRecord(e0));
    CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    ts.push_back(ms);
  }
  std::sort(ts.begin(), ts.end());
  CK(cudaFree(a));
  CK(cudaFree(b));
  return 2.0 * bytes / (ts[2] * 1e-3) / 1e12;
}

// Times `launch` (which enqueues one call on input set v) as a CUDA graph of n calls, after
// `warmup` direct calls; median of `reps` replays, microseconds per call.
template <typename F>
static double time_graph(F launch, int nvariants, int n = 20, int reps = 9, int warmup = 3) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int i = 0; i < warmup; ++i) launch(i % nvariants, s);  // and attribute setup
  CK(cudaStreamSynchronize(s));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < n; ++i) launch(i % nvariants, s);
  CK(cudaStreamEndCapture(s, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  CK(cudaGraphLaunch(exec, s));
  CK(cudaStreamSynchronize(s));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ts;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(e0, s));
    CK(cudaGraphLaunch(exec, s));
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    ts.push_back(ms);
  }
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(s));
  std::sort(ts.begin(), ts.end());
  return ts[reps / 2] * 1e3 / n;
}
