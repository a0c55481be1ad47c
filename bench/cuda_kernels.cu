// Throughput of the lionbit GPU kernels (lionbit_bench_cuda; not run by
// ctest). For each kernel and size: the median of timed repeats (cudaEvent,
// after warm-up), the bytes the kernel actually reads and writes, GB/s, and
// the ratio to the device-to-device cudaMemcpyAsync bandwidth measured in the
// same run (a copy of B bytes moves 2B: read + write).
//
//   lionbit_bench_cuda [elements ...]     (default 16777216 268435456: 16M and 256M)
//
// Without a CUDA device it says so and exits 0.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "signbits/count.h"
#include "signbits/cuda/kernels.h"
#include "optimizer/lion_cuda.h"
#include "optimizer/lion_list.cuh"

namespace {

using lionbit::bits::DType;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "lionbit_bench_cuda: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// Deterministic pseudo-random bytes (a hash of the index) so that signs,
// zeros and codes vary the way real data does.
__global__ void fill_kernel(
    uint32_t* p,
    size_t n32,
    uint32_t seed,
    uint32_t and_mask,
    uint32_t or_mask) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n32;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 0x9e3779b9u ^ seed;
    x ^= x >> 16;
    x *= 0x85ebca6bu;
    x ^= x >> 13;
    x *= 0xc2b2ae35u;
    x ^= x >> 16;
    p[i] = (x & and_mask) | or_mask;
  }
}

void fill(void* p, size_t bytes, uint32_t seed, uint32_t and_mask = ~0u, uint32_t or_mask = 0) {
  fill_kernel<<<1024, 256>>>(static_cast<uint32_t*>(p), bytes / 4, seed, and_mask, or_mask);
  check(cudaGetLastError(), "fill");
}

struct Timer {
  cudaStream_t stream;
  int warmup = 3;
  int repeats = 15;
  // Median milliseconds of one call of fn.
  double median_ms(const std::function<void()>& fn) const {
    cudaEvent_t a, b;
    check(cudaEventCreate(&a), "event");
    check(cudaEventCreate(&b), "event");
    for (int i = 0; i < warmup; ++i) {
      fn();
    }
    std::vector<double> t;
    for (int i = 0; i < repeats; ++i) {
      check(cudaEventRecord(a, stream), "record");
      fn();
      check(cudaEventRecord(b, stream), "record");
      check(cudaEventSynchronize(b), "sync");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, a, b), "elapsed");
      t.push_back(ms);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
};

void row(const char* kernel, size_t n, double ms, double bytes, double copy_gbs) {
  const double gbs = bytes / (ms * 1e-3) / 1e9;
  std::printf(
      "%-28s %8zuM %10.1f %9.1f %9.1f %7.1f%%\n", kernel, n >> 20, ms * 1e3, bytes / 1e6, gbs,
      100.0 * gbs / copy_gbs);
}

} // namespace

int main(int argc, char** argv) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    std::printf(
        "lionbit_bench_cuda: no CUDA device (%s); nothing to measure\n",
        err != cudaSuccess ? cudaGetErrorString(err) : "cudaGetDeviceCount returned 0");
    return 0;
  }
  // Sizes in elements, each a multiple of 2^20 (default 16M and 256M).
  std::vector<size_t> sizes;
  for (int i = 1; i < argc; ++i) {
    const size_t n = std::strtoull(argv[i], nullptr, 10);
    if (n == 0 || n % (size_t{1} << 20) != 0) {
      std::fprintf(
          stderr, "lionbit_bench_cuda: sizes are multiples of 1048576, got '%s'\n", argv[i]);
      return 2;
    }
    sizes.push_back(n);
  }
  if (sizes.empty()) {
    sizes = {size_t{16} << 20, size_t{256} << 20};
  }
  const size_t max_n = *std::max_element(sizes.begin(), sizes.end());
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "properties");
  std::printf(
      "device: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor,
      prop.multiProcessorCount);

  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "stream");
  Timer timer{stream};

  // Buffers for the largest size: two element buffers of 4 bytes, sign and
  // zero planes for 64 contributions, output planes and a LUT.
  constexpr int kMaxRanks = 64;
  const size_t words_max = (max_n + 63) / 64;
  void *a = nullptr, *b = nullptr;
  uint64_t *planes = nullptr, *out = nullptr;
  float* lut = nullptr;
  lionbit::cuda::Counts* counts = nullptr;
  lionbit::optim::cuda::ApplySeg* seg = nullptr; // the planes apply's table: one tensor
  check(cudaMalloc(&seg, sizeof(lionbit::optim::cuda::ApplySeg)), "malloc");
  check(cudaMalloc(&a, max_n * 4), "malloc");
  check(cudaMalloc(&b, max_n * 4), "malloc");
  check(cudaMalloc(&planes, 2 * kMaxRanks * words_max * 8), "malloc");
  check(cudaMalloc(&out, 8 * words_max * 8), "malloc");
  check(cudaMalloc(&lut, 16 * sizeof(float)), "malloc");
  check(cudaMalloc(&counts, sizeof(lionbit::cuda::Counts)), "malloc");
  // float32 values in [-2, 2) with random signs (exponent 127 or 128).
  fill(a, max_n * 4, 1, 0x807fffffu, 0x3f800000u);
  fill(b, max_n * 4, 2, 0x807fffffu, 0x3f800000u);
  // Sign planes random; zero planes sparse (about 1 bit in 256 set).
  fill(planes, kMaxRanks * words_max * 8, 3);
  fill(planes + kMaxRanks * words_max, kMaxRanks * words_max * 8, 4, 0x01000000u, 0);
  const float vote_lut[4] = {-1.0f, 1.0f, 0.0f, 0.0f};
  check(cudaMemcpy(lut, vote_lut, sizeof vote_lut, cudaMemcpyHostToDevice), "lut");
  check(cudaMemset(counts, 0, sizeof(lionbit::cuda::Counts)), "memset");
  check(cudaDeviceSynchronize(), "init");

  std::printf(
      "%-28s %9s %10s %9s %9s %8s\n", "kernel", "elements", "time_us", "MB", "GB/s", "of_copy");
  for (size_t n : sizes) {
    const size_t words = n / 64;
    // Device-to-device copy of n float32: 4n bytes read and 4n written.
    const double copy_ms = timer.median_ms(
        [&] { check(cudaMemcpyAsync(b, a, n * 4, cudaMemcpyDeviceToDevice, stream), "copy"); });
    const double copy_gbs = 8.0 * n / (copy_ms * 1e-3) / 1e9;
    std::printf(
        "%-28s %8zuM %10.1f %9.1f %9.1f %7.1f%%\n", "memcpy D2D (f32)", n >> 20, copy_ms * 1e3,
        8.0 * n / 1e6, copy_gbs, 100.0);
    fill(b, n * 4, 2, 0x807fffffu, 0x3f800000u); // b again holds momentum-like values

    row("pack_signs f32", n, timer.median_ms([&] {
      lionbit::cuda::pack_signs(DType::kFloat32, a, n, out, out + words, 0, counts, stream);
    }),
        4.0 * n + n / 4.0, copy_gbs);
    row("pack_signs bf16", n, timer.median_ms([&] {
      lionbit::cuda::pack_signs(DType::kBFloat16, a, n, out, out + words, 0, counts, stream);
    }),
        2.0 * n + n / 4.0, copy_gbs);
    row("pack_signs f16", n, timer.median_ms([&] {
      lionbit::cuda::pack_signs(DType::kFloat16, a, n, out, out + words, 0, counts, stream);
    }),
        2.0 * n + n / 4.0, copy_gbs);
    // The same at bit offset 1: no 16-byte boundary, so the ballot path
    // (not a goal row: what the vector path gains).
    row("pack_signs bf16 @bit 1", n, timer.median_ms([&] {
      lionbit::cuda::pack_signs(DType::kBFloat16, a, n, out, out + words + 1, 1, counts, stream);
    }),
        2.0 * n + n / 4.0, copy_gbs);
    row("pack_levels f32 p=4", n, timer.median_ms([&] {
      lionbit::cuda::pack_levels(
          static_cast<const float*>(a), n, 3.0, 4, out, words, 0, counts, stream);
    }),
        4.0 * n + 4.0 * n / 8.0, copy_gbs);
    // A rank's share of the vote: `ranks` contributions (sign and zero
    // planes) to a shard of n elements read, the result's planes written.
    for (int ranks : {2, 4, 8, 16, 32, 64}) {
      const uint64_t* zero = planes + kMaxRanks * words_max;
      const std::string vote = "vote N=" + std::to_string(ranks);
      row(vote.c_str(), n, timer.median_ms([&] {
        lionbit::cuda::vote(planes, zero, words, ranks, words, out, out + words, stream);
      }),
          (2 * ranks + 2) * n / 8.0, copy_gbs);
    }
    for (int ranks : {2, 8, 64}) {
      const uint64_t* zero = planes + kMaxRanks * words_max;
      const int code_planes = lionbit::bits::code_planes(ranks, /*with_zeros=*/true);
      const std::string name = "count_code N=" + std::to_string(ranks);
      row(name.c_str(), n, timer.median_ms([&] {
        lionbit::cuda::count_code(planes, zero, words, ranks, words, out, stream);
      }),
          (2 * ranks + code_planes) * n / 8.0, copy_gbs);
    }
    row("unpack f32 (2 planes)", n, timer.median_ms([&] {
      lionbit::cuda::unpack(DType::kFloat32, {planes, 2, words}, n, lut, b, stream);
    }),
        4.0 * n + n / 4.0, copy_gbs);
    row("unpack bf16 (2 planes)", n, timer.median_ms([&] {
      lionbit::cuda::unpack(DType::kBFloat16, {planes, 2, words}, n, lut, b, stream);
    }),
        2.0 * n + n / 4.0, copy_gbs);
    fill(b, n * 4, 2, 0x807fffffu, 0x3f800000u);
    row("lion_direction f32/f32", n, timer.median_ms([&] {
      lionbit::optim::cuda::lion_direction(
          DType::kFloat32, a, DType::kFloat32, b, n, 0.9f, 0.1f, 0.99f, 0.01f, out, out + words, 0,
          counts, stream);
    }),
        12.0 * n + n / 4.0, copy_gbs);
    row("lion_direction bf16/bf16", n, timer.median_ms([&] {
      lionbit::optim::cuda::lion_direction(
          DType::kBFloat16, a, DType::kBFloat16, b, n, 0.9f, 0.1f, 0.99f, 0.01f, out, out + words,
          0, counts, stream);
    }),
        6.0 * n + n / 4.0, copy_gbs);
    row("lion_direction bf16/bf16 @bit 1", n, timer.median_ms([&] {
      lionbit::optim::cuda::lion_direction(
          DType::kBFloat16, a, DType::kBFloat16, b, n, 0.9f, 0.1f, 0.99f, 0.01f, out,
          out + words + 1, 1, counts, stream);
    }),
        6.0 * n + n / 4.0, copy_gbs);
    row("lion_direction bf16/f32", n, timer.median_ms([&] {
      lionbit::optim::cuda::lion_direction(
          DType::kBFloat16, a, DType::kFloat32, b, n, 0.9f, 0.1f, 0.99f, 0.01f, out, out + words, 0,
          counts, stream);
    }),
        10.0 * n + n / 4.0, copy_gbs);
    row("lion_apply_dense f32/f32", n, timer.median_ms([&] {
      lionbit::optim::cuda::lion_apply_dense(
          DType::kFloat32, b, DType::kFloat32, a, n, 1e-4f, 0.99999f, stream);
    }),
        12.0 * n, copy_gbs);
    row("lion_apply_dense bf16/bf16", n, timer.median_ms([&] {
      lionbit::optim::cuda::lion_apply_dense(
          DType::kBFloat16, b, DType::kBFloat16, a, n, 1e-4f, 0.99999f, stream);
    }),
        6.0 * n, copy_gbs);
    // Delta from a vote's result planes (sign and the sparse zero plane of
    // contribution 0): 2 bits an element instead of a bfloat16 value.
    lionbit::optim::cuda::ApplySeg host_seg{b, nullptr, n, 0, 0};
    const uint64_t units = lionbit::optim::cuda::apply_units(&host_seg, 1);
    check(cudaMemcpy(seg, &host_seg, sizeof host_seg, cudaMemcpyHostToDevice), "table");
    const uint64_t* vote_zero = planes + kMaxRanks * words_max;
    row("lion_apply_planes f32", n, timer.median_ms([&] {
      lionbit::optim::cuda::lion_apply_planes_list(
          DType::kFloat32, seg, 1, units, planes, vote_zero, 1e-4f, 0.99999f, stream);
    }),
        8.0 * n + n / 4.0, copy_gbs);
    row("lion_apply_planes bf16", n, timer.median_ms([&] {
      lionbit::optim::cuda::lion_apply_planes_list(
          DType::kBFloat16, seg, 1, units, planes, vote_zero, 1e-4f, 0.99999f, stream);
    }),
        4.0 * n + n / 4.0, copy_gbs);
  }
  check(cudaStreamSynchronize(stream), "final sync");
  check(cudaGetLastError(), "last error");
  cudaFree(a);
  cudaFree(b);
  cudaFree(planes);
  cudaFree(out);
  cudaFree(lut);
  cudaFree(counts);
  cudaFree(seg);
  cudaStreamDestroy(stream);
  return 0;
}
