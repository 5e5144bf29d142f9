// Host check of pack.cu's quantizer (no GPU): its device arithmetic has host twins, so
// quantize_group_words runs here and is compared with nvfp4.h's nvfp4_quantize_group (SPEC §2.2,
// the code the CPU backend runs) on groups built to sit on and around every E2M1 rounding
// threshold, on random groups and on special values, for several global scales r.
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Iffi/include -Iffi/cuda \
//     tests/cuda/pack_host_check.cu -o pack_host_check
//   ./pack_host_check [groups per r]     prints "pack host check: N groups, M mismatches"
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "pack.cu"

using namespace m3sparse;
using namespace m3sparse::cuda;

int main(int argc, char** argv) {
  const long per_r = argc > 1 ? std::atol(argv[1]) : 200000;
  // powers of two (the kernel's pre-scaled path) and general r, incl. 2^100 (the fast path's edge)
  const float rs[] = {1.0f, 0.5f, 64.0f, 0x1p-20f, 3.0f, 0.37f, 1.0f / 448.0f, 1234.5f, 0x1p100f};
  const float thr[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f};
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> u01(0.f, 1.f);
  long groups = 0, bad = 0;
  std::vector<float2> table(128);
  for (float r : rs) {
    for (int b = 0; b < 128; ++b) table[b] = scale_entry(b, r);
    const ScaleTable scales{0, table.data()};
    const float s_max = r > kFastRMax ? -1.0f : kE4M3Max;
    for (long n = 0; n < per_r; ++n) {
      float x[kNvfp4Group];
      // amax log-uniform over [2^-40, 2^20] / r so that every scale byte occurs; every 5th
      // group's amax puts s = RN(amax/6)·r a few ulps from a midpoint of two E4M3 scales
      float amax = std::ldexp(1.0f + u01(rng), int(u01(rng) * 60) - 40) / r;
      const int kind = int(n % 5);
      if (kind == 4) {
        const int b = 1 + int(rng() % 125);  // bytes 1..126: the midpoint of b - 1 and b
        const float mid = 0.5f * (e4m3_to_float(uint8_t(b - 1)) + e4m3_to_float(uint8_t(b)));
        amax = 6.0f * mid / r;
        for (int k = int(rng() % 9) - 4; k != 0; k += k > 0 ? -1 : 1)
          amax = std::nextafter(amax, k > 0 ? 1e30f : 0.f);
      }
      for (int i = 0; i < kNvfp4Group; ++i) {
        float v;
        if (i == 0) v = amax;
        else if (kind == 0 || kind == 4) v = amax * (2.f * u01(rng) - 1.f);
        else {  // on and around a threshold t·sf/r (sf ≈ amax·r/6), a few ulps either side
          const float t = thr[rng() % 8] * amax / 6.0f;
          v = std::nextafter(t, 0.f);
          for (int k = int(rng() % 7); k > 0; --k) v = std::nextafter(v, kind == 1 ? 0.f : 1e30f);
          if (rng() & 1) v = -v;
        }
        x[i] = v;
      }
      if (n % 997 == 0) x[1 + rng() % 15] = 0.0f * -1.0f;           // -0
      if (n % 1999 == 0) x[1 + rng() % 15] = 1e-45f;                 // a subnormal
      if (n % 4999 == 0) x[rng() % 16] = NAN;                        // nvfp4.h's path
      if (n % 7001 == 0) x[rng() % 16] = -INFINITY;
      uint32_t sw[kNvfp4Group / 2];
      sign_words(x, sw);
      const GroupBytes g = pow2_scale(r) ? quantize_group_words<true>(x, sw, r, s_max, scales)
                                         : quantize_group_words<false>(x, sw, r, s_max, scales);
      uint8_t d[kNvfp4Group / 2], sf;
      nvfp4_quantize_group(x, r, d, &sf);
      uint8_t got[kNvfp4Group / 2];
      memcpy(got, &g.lo, 4);
      memcpy(got + 4, &g.hi, 4);
      const bool ok = sf == g.scale && memcmp(got, d, sizeof d) == 0;
      if (!ok && bad < 5) {
        std::printf("mismatch r=%a amax=%a: scale %u vs %u\n", r, amax, unsigned(g.scale),
                    unsigned(sf));
      }
      bad += !ok;
      ++groups;
    }
  }
  std::printf("pack host check: %ld groups, %ld mismatches\n", groups, bad);
  return bad ? 1 : 0;
}
