// Launch plumbing shared by the .cu files of lionbit_cuda (nvcc only): grid
// sizes, the launch error check and the block-wide sum of the pack counts.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "signbits/cuda/kernels.h"

namespace lionbit::cuda::detail {

constexpr int kBlockThreads = 256;
constexpr int kWarpsPerBlock = kBlockThreads / 32;
// Resident blocks per SM the word-per-warp kernels are compiled for: lets ptxas
// use up to 64 registers a thread (on sm_80 it otherwise aims at 32 and
// spills a few bytes).
constexpr int kMinBlocksPerSm = 4;
constexpr unsigned kFullMask = 0xffffffffu;

// Throws if the launch just made failed.
inline void check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(
        std::string("lionbit: CUDA kernel ") + kernel +
        " failed to launch: " + cudaGetErrorString(err));
  }
}

// Streaming multiprocessors of the current device (cached per device).
int sm_count();

// Blocks of `kernel` resident on one SM at kBlockThreads threads (occupancy
// query; 4 if the query fails, the launch then reports the real error).
template <typename Kernel>
int resident_blocks(Kernel kernel) {
  int b = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, kBlockThreads, 0) != cudaSuccess ||
      b <= 0) {
    (void)cudaGetLastError();
    b = 4;
  }
  return b;
}

// Blocks for `units` independent work units of `per_block` each: enough to
// cover them, at most one full wave of resident blocks (the kernels loop over
// the rest, so every block gets the same share and no partial second wave
// trails behind).
inline unsigned grid_for(size_t units, size_t per_block, int resident) {
  const size_t need = (units + per_block - 1) / per_block;
  const size_t cap = static_cast<size_t>(sm_count()) * static_cast<size_t>(resident);
  const size_t g = need < cap ? need : cap;
  return static_cast<unsigned>(g == 0 ? 1 : g);
}

// Adds the per-thread tallies of a block into *counts with one atomic per
// field and block (none when the block's tallies are 0). Every thread of the
// block must call it.
__device__ __forceinline__ void add_counts(
    Counts* counts,
    unsigned long long zeros,
    unsigned long long nans) {
  __shared__ unsigned long long s_zero[kWarpsPerBlock];
  __shared__ unsigned long long s_nan[kWarpsPerBlock];
  for (int d = 16; d > 0; d >>= 1) {
    zeros += __shfl_down_sync(kFullMask, zeros, d);
    nans += __shfl_down_sync(kFullMask, nans, d);
  }
  const unsigned warp = threadIdx.x / 32;
  if ((threadIdx.x & 31u) == 0) {
    s_zero[warp] = zeros;
    s_nan[warp] = nans;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long z = 0, q = 0;
    for (int i = 0; i < kWarpsPerBlock; ++i) {
      z += s_zero[i];
      q += s_nan[i];
    }
    if (z != 0) {
      atomicAdd(&counts->zeros, z);
    }
    if (q != 0) {
      atomicAdd(&counts->nans, q);
    }
  }
}

} // namespace lionbit::cuda::detail
