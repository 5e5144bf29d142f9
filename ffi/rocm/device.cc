// Device checks and module loading for the gfx950 handlers (see kernels.h).
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "kernels.h"

namespace m3sparse::rocm {
namespace {

constexpr const char* kArch = "gfx950";

std::string hip_error_text(hipError_t err) {
  const char* name = hipGetErrorName(err);
  const char* text = hipGetErrorString(err);
  return std::string(name ? name : "hipError") + " (" + std::to_string(int(err)) + "): " +
         (text ? text : "");
}

ffi::Error hip_failure(const char* target, const char* kernel, const char* what, hipError_t err) {
  return ffi::Error(ffi::ErrorCode::kInternal, std::string(target) + ": " + what + " for kernel " +
                                                   kernel + " failed: " + hip_error_text(err));
}

// The architecture name of `device` without feature suffixes ("gfx950:sramecc+:xnack-" -> "gfx950").
ffi::Error device_arch(const char* target, int32_t device, std::string* arch) {
  hipDeviceProp_t prop;
  std::memset(&prop, 0, sizeof(prop));
  hipError_t err = hipGetDeviceProperties(&prop, device);
  if (err != hipSuccess) return hip_failure(target, "-", "hipGetDeviceProperties", err);
  std::string name(prop.gcnArchName);
  *arch = name.substr(0, name.find(':'));
  return ffi::Error::Success();
}

std::mutex mu;
std::set<int32_t> checked_devices;                  // devices known to be gfx950
std::set<std::pair<std::string, int32_t>> loaded;    // (kernel, device) with the module loaded

}  // namespace

ffi::Error prepare_launch(const char* target, const KernelModule& kernel, int32_t device) {
  std::lock_guard<std::mutex> lock(mu);
  if (!checked_devices.count(device)) {
    std::string arch;
    if (auto e = device_arch(target, device, &arch); e.failure()) return e;
    if (arch != kArch)
      return ffi::Error(ffi::ErrorCode::kUnimplemented,
                        std::string(target) + ": device " + std::to_string(device) + " is " + arch +
                            "; the m3sparse ROCm kernels are compiled for " + kArch +
                            " only (use the CPU backend or the reference elsewhere)");
    checked_devices.insert(device);
  }
  int current = -1;
  hipError_t err = hipGetDevice(&current);
  if (err != hipSuccess) return hip_failure(target, kernel.name, "hipGetDevice", err);
  if (current != device) {
    err = hipSetDevice(device);
    if (err != hipSuccess) return hip_failure(target, kernel.name, "hipSetDevice", err);
  }
  auto key = std::make_pair(std::string(kernel.name), device);
  if (!loaded.count(key)) {
    int32_t st = kernel.init();
    if (st != 0) return launch_status(target, kernel, st);
    st = kernel.load(device);
    if (st != 0) return launch_status(target, kernel, st);
    loaded.insert(key);
  }
  return ffi::Error::Success();
}

ffi::Error launch_status(const char* target, const KernelModule& kernel, int32_t status) {
  hipError_t pending = hipGetLastError();
  if (status == 0 && pending == hipSuccess) return ffi::Error::Success();
  std::string why;
  if (status == -1)
    why = "module not initialized";
  else if (status == -2)
    why = "module not loaded on this device";
  else if (status != 0)
    why = hip_error_text(hipError_t(status));
  else
    why = hip_error_text(pending);
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string(target) + ": kernel " + kernel.name + " failed: " + why);
}

}  // namespace m3sparse::rocm
