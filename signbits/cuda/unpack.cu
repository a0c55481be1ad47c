// unpack on the GPU: a warp writes a group of kWordsPerWarpIter words'
// elements at a time. With one or two planes (a sign, a vote) and 2- or
// 4-byte values, whole groups at a 16-byte boundary take the vector path,
// kUnpackGroups groups an iteration (element.cuh's unpack_vec_batch: lane l
// reads every group's plane bytes, then writes 8 elements a group in 16-byte
// stores, the LUT's entries in registers); other groups: lane l writes elements l and
// l + 32 of each word, the plane words of a position the same for the whole
// warp (one broadcast load per plane), the LUT (2^nplanes entries in device
// memory) read through the cache. Elements are moved as raw 1, 2, 4 or 8-byte
// patterns, so every dtype is exact.
#include "signbits/cuda/element.cuh"
#include "signbits/cuda/kernels.h"
#include "signbits/cuda/launch.cuh"

namespace lionbit::cuda {
namespace detail {
namespace {

constexpr int kUnpackUnroll = kWordsPerWarpIter;

template <typename S, int NP>
__global__ void __launch_bounds__(kBlockThreads, kMinBlocksPerSm) unpack_kernel(
    const uint64_t* __restrict__ base,
    int nplanes,
    size_t shard_words,
    size_t n,
    size_t nwords,
    const S* __restrict__ lut,
    S* __restrict__ dst) {
  const unsigned lane = threadIdx.x & 31u;
  const size_t warp = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const size_t nwarps = static_cast<size_t>(gridDim.x) * blockDim.x / 32;
  if constexpr (kUnpackVec<S, NP>) {
    S regs[1 << NP];
    for (int j = 0; j < (1 << NP); ++j) {
      regs[j] = lut[j];
    }
    const bool vec = reinterpret_cast<uintptr_t>(dst) % 16u == 0u;
    constexpr size_t kUnitWords = size_t{kUnpackGroups} * kUnpackUnroll;
    for (size_t k0 = warp * kUnitWords; k0 < nwords; k0 += nwarps * kUnitWords) {
      if (vec && (k0 + kUnitWords) * 64 <= n) { // warp-uniform
        unpack_vec_batch<S, NP, kUnpackGroups>(base, shard_words, k0, lane, regs, dst);
        continue;
      }
#pragma unroll 1 // the edges' path: one copy of its body
      for (size_t k = k0; k < k0 + kUnitWords && k < nwords; k += kUnpackUnroll) {
        if (vec && (k + kUnpackUnroll) * 64 <= n) {
          unpack_vec_batch<S, NP, 1>(base, shard_words, k, lane, regs, dst);
        } else {
          unpack_group<S, NP>(base, nplanes, shard_words, n, k, lane, lut, dst);
        }
      }
    }
  } else {
    for (size_t k0 = warp * kUnpackUnroll; k0 < nwords; k0 += nwarps * kUnpackUnroll) {
      unpack_group<S, NP>(base, nplanes, shard_words, n, k0, lane, lut, dst);
    }
  }
}

template <typename S, int NP>
void launch_unpack_np(
    ShardedPlanes planes,
    size_t n,
    const void* lut,
    void* dst,
    cudaStream_t stream) {
  const size_t nwords = (n + 63) / 64;
  static const int resident = resident_blocks(unpack_kernel<S, NP>);
  const size_t per_warp = kUnpackVec<S, NP> ? size_t{kUnpackGroups} * kUnpackUnroll : kUnpackUnroll;
  const unsigned grid = grid_for(nwords, size_t{kWarpsPerBlock} * per_warp, resident);
  unpack_kernel<S, NP><<<grid, kBlockThreads, 0, stream>>>(
      planes.base, planes.nplanes, planes.shard_words, n, nwords, static_cast<const S*>(lut),
      static_cast<S*>(dst));
  check_launch("unpack");
}

// Plane counts compiled in: 1 (sign only), 2 (a vote); others at run time.
template <typename S>
void launch_unpack(
    ShardedPlanes planes,
    size_t n,
    const void* lut,
    void* dst,
    cudaStream_t stream) {
  switch (planes.nplanes) {
    case 1:
      return launch_unpack_np<S, 1>(planes, n, lut, dst, stream);
    case 2:
      return launch_unpack_np<S, 2>(planes, n, lut, dst, stream);
    default:
      return launch_unpack_np<S, -1>(planes, n, lut, dst, stream);
  }
}

} // namespace
} // namespace detail

void unpack(
    bits::DType dtype,
    ShardedPlanes planes,
    size_t n,
    const void* lut,
    void* dst,
    cudaStream_t stream) {
  if (n == 0) {
    return;
  }
  if (planes.nplanes < 0 || planes.nplanes > 16) {
    throw std::invalid_argument(
        "lionbit: unpack: nplanes must be 0 .. 16, got " + std::to_string(planes.nplanes));
  }
  switch (dtype) {
    case bits::DType::kInt8:
      return detail::launch_unpack<uint8_t>(planes, n, lut, dst, stream);
    case bits::DType::kFloat16:
    case bits::DType::kBFloat16:
      return detail::launch_unpack<uint16_t>(planes, n, lut, dst, stream);
    case bits::DType::kFloat32:
      return detail::launch_unpack<uint32_t>(planes, n, lut, dst, stream);
    case bits::DType::kFloat64:
      return detail::launch_unpack<unsigned long long>(planes, n, lut, dst, stream);
  }
  throw std::runtime_error("lionbit: unpack: unknown dtype");
}

} // namespace lionbit::cuda
