// 8-lane fp32 vectors for the portable CPU code (GCC/Clang vector extensions: AVX registers
// where the CPU has them, SSE pairs or NEON otherwise), and the fixed 8-lane sum tree that the
// selection's and the grouped matmul's dot products share.
#pragma once

#include <cmath>
#include <cstring>

namespace m3sparse {
namespace generic {

typedef float v8f __attribute__((vector_size(32)));
inline v8f load8(const float* p) { v8f v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }

// a · b + c per lane, one rounding (GCC and Clang make it one vector fma where the ISA has one)
inline v8f fma8(v8f a, v8f b, v8f c) {
  v8f r;
#pragma omp simd
  for (int l = 0; l < 8; ++l) r[l] = std::fma(a[l], b[l], c[l]);
  return r;
}

// The lanes' sum in the fixed order ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)).
inline float fold8(v8f x) { return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7])); }

// [a0+a1, a2+a3, a4+a5, a6+a7, b0+b1, b2+b3, b4+b5, b6+b7]: one level of the tree for two
// vectors at once (a + b is the same bits as b + a, so lane order inside a pair is free).
inline v8f pair_sums(v8f a, v8f b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}

// Eight vectors' fold8 at once, as vectors (7 adds in all): lane c is fold8(x[c]).
inline v8f fold8x8(const v8f* x) {
  return pair_sums(pair_sums(pair_sums(x[0], x[1]), pair_sums(x[2], x[3])),
                   pair_sums(pair_sums(x[4], x[5]), pair_sums(x[6], x[7])));
}

}  // namespace generic
}  // namespace m3sparse
