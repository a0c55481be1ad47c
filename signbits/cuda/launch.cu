// Device properties the launch helpers of launch.cuh need, cached per device.
#include "signbits/cuda/launch.cuh"

#include <atomic>

namespace lionbit::cuda::detail {

int sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0) {
    (void)cudaGetLastError();
    return 132; // the launch itself will report the real problem
  }
  if (dev < kMaxDevices) {
    const int c = cache[dev].load(std::memory_order_relaxed);
    if (c > 0) {
      return c;
    }
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      sms <= 0) {
    (void)cudaGetLastError();
    return 132;
  }
  if (dev < kMaxDevices) {
    cache[dev].store(sms, std::memory_order_relaxed);
  }
  return sms;
}

} // namespace lionbit::cuda::detail
