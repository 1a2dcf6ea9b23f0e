// Properties of the current device that launches ask for, each looked up once per device (a
// cache of what the driver reports, not a setting: launch choices are the ops' arguments).
#include <atomic>

#include <cuda_runtime.h>

#include "common.cuh"

namespace exlcli {
namespace {

constexpr int kMaxDevices = 64;

// The attribute of the current device, from `slots` (0: not looked up yet) or the driver.
int cached_attribute(std::atomic<int> (&slots)[kMaxDevices], cudaDeviceAttr attribute) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  std::atomic<int>& slot = slots[device % kMaxDevices];
  int v = slot.load(std::memory_order_relaxed);
  if (v == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, attribute, device));
    slot.store(v, std::memory_order_relaxed);
  }
  return v;
}

int compute_capability_major() {
  static std::atomic<int> cache[kMaxDevices] = {};
  return cached_attribute(cache, cudaDevAttrComputeCapabilityMajor);
}

}  // namespace

int num_sms() {
  static std::atomic<int> cache[kMaxDevices] = {};
  return cached_attribute(cache, cudaDevAttrMultiProcessorCount);
}

bool device_supports_pdl() { return compute_capability_major() >= 9; }

bool device_has_sm80() { return compute_capability_major() >= 8; }

}  // namespace exlcli
