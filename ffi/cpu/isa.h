// Which CPU path the attention handlers take, chosen at run time (cpuid), capped by the
// environment variable M3SPARSE_CPU_ISA so every narrower path can be tested on a wider machine.
//
//   generic  portable C++ (GCC/Clang vector extensions), fp32 compute
//   avx2     AVX2 + FMA: SIMD NVFP4 dequantization, fp32 FMA tile math, vector exp2
//   avx512   AVX-512 F/BW/VL/DQ + AVX512_BF16: bf16 tiles, vdpbf16ps, fp32 accumulation
//   amx      avx512 plus AMX-BF16 tile products; Linux needs an arch_prctl permission first
//            (refused: the avx512 path)
//
// Each path is the best one the machine (and OS) supports at or below the cap.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define M3_X86 1
#else
#define M3_X86 0
#endif

namespace m3sparse {

enum class CpuPath : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };
constexpr const char* kCpuPathNames[] = {"generic", "avx2", "avx512", "amx"};

#if M3_X86
inline unsigned long long xgetbv0() {
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}

// Linux keeps AMX tile data disabled per process until it is asked for (kernel ≥ 5.16).
inline bool request_amx_permission() {
  constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  unsigned long long bits = 0;
  return syscall(SYS_arch_prctl, kArchGetXcompPerm, &bits) == 0 && (bits >> kXfeatureXtiledata & 1);
}

inline CpuPath detect_cpu_path() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) return CpuPath::kGeneric;  // OSXSAVE
  const bool fma = c >> 12 & 1;
  const unsigned long long xcr0 = xgetbv0();
  if ((xcr0 & 0x6) != 0x6 || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return CpuPath::kGeneric;
  const unsigned b7 = b, d7 = d;
  if (!(fma && (b7 >> 5 & 1))) return CpuPath::kGeneric;  // AVX2 + FMA
  unsigned a71 = 0, b71, c71, d71;
  __get_cpuid_count(7, 1, &a71, &b71, &c71, &d71);
  const bool avx512 = (b7 >> 16 & 1) && (b7 >> 17 & 1) && (b7 >> 30 & 1) && (b7 >> 31 & 1) &&
                      (a71 >> 5 & 1) && (xcr0 & 0xE0) == 0xE0;  // F DQ BW VL BF16, ZMM state
  if (!avx512) return CpuPath::kAvx2;
  const bool amx = (d7 >> 24 & 1) && (d7 >> 22 & 1) && (xcr0 & 0x60000) == 0x60000;
  return amx && request_amx_permission() ? CpuPath::kAmx : CpuPath::kAvx512;
}
#else
inline CpuPath detect_cpu_path() { return CpuPath::kGeneric; }
#endif

// The widest path this module implements.
constexpr CpuPath kWidestBuilt = M3_X86 ? CpuPath::kAmx : CpuPath::kGeneric;

// The widest path this machine supports and the module implements (detected once).
inline CpuPath machine_cpu_path() {
  static const CpuPath path = std::min(detect_cpu_path(), kWidestBuilt);
  return path;
}

// The path to take now: the machine's, capped by M3SPARSE_CPU_ISA. False if the variable
// names no path.
inline bool current_cpu_path(CpuPath* path) {
  *path = machine_cpu_path();
  const char* cap = std::getenv("M3SPARSE_CPU_ISA");
  if (cap == nullptr || *cap == '\0') return true;
  for (int i = 0; i < 4; ++i)
    if (std::strcmp(cap, kCpuPathNames[i]) == 0) {
      if (i < int(*path)) *path = CpuPath(i);
      return true;
    }
  return false;
}

// What is wrong when current_cpu_path() returns false (the handlers' error and cpu_path()'s).
inline std::string cpu_path_error() {
  return std::string("M3SPARSE_CPU_ISA must be one of generic, avx2, avx512, amx (lower case); "
                     "got '") + std::getenv("M3SPARSE_CPU_ISA") + "'";
}

}  // namespace m3sparse
