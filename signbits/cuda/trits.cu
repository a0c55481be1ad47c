// The base-3 form of a vote's results on the GPU (signbits/trits.h): encode
// writes a byte a thread (13 a 64-bit word, each thread reading its word's
// sign and tie words, shared through the cache by the word's 13 threads);
// decode writes an element a thread from its byte, as the values of a
// 3-entry table moved as raw 1, 2, 4 or 8-byte patterns (every dtype exact),
// and flags a byte that is not a code. The per-byte and per-element logic is
// trits.cuh's.
#include "signbits/cuda/kernels.h"
#include "signbits/cuda/launch.cuh"
#include "signbits/cuda/trits.cuh"

namespace lionbit::cuda {
namespace detail {
namespace {

__global__ void __launch_bounds__(kBlockThreads) encode_trits_kernel(
    const uint64_t* __restrict__ sign,
    const uint64_t* __restrict__ tie,
    size_t bytes,
    uint8_t* __restrict__ out) {
  const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t k = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < bytes;
       k += step) {
    const size_t w = k / bits::kTritBytesPerWord;
    out[k] = trit_byte(sign[w], tie[w], static_cast<unsigned>(k % bits::kTritBytesPerWord));
  }
}

template <typename S>
__global__ void __launch_bounds__(kBlockThreads) decode_trits_kernel(
    const uint8_t* __restrict__ trits,
    size_t n,
    const S* __restrict__ lut,
    S* __restrict__ dst,
    unsigned* __restrict__ bad) {
  const S v0 = lut[0], v1 = lut[1], v2 = lut[2];
  const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const unsigned t = trit_of(trits[trit_byte_of(i)], i);
    if (t == 3u) {
      *bad = 1u;
      continue;
    }
    dst[i] = t == 0u ? v0 : (t == 1u ? v1 : v2);
  }
}

template <typename S>
void launch_decode(
    const uint8_t* trits,
    size_t n,
    const void* lut,
    void* dst,
    unsigned* bad,
    cudaStream_t stream) {
  static const int resident = resident_blocks(decode_trits_kernel<S>);
  decode_trits_kernel<S><<<grid_for(n, kBlockThreads, resident), kBlockThreads, 0, stream>>>(
      trits, n, static_cast<const S*>(lut), static_cast<S*>(dst), bad);
  check_launch("decode_trits");
}

} // namespace
} // namespace detail

void encode_trits(
    const uint64_t* sign,
    const uint64_t* tie,
    size_t words,
    uint8_t* out,
    cudaStream_t stream) {
  if (words == 0) {
    return;
  }
  using namespace detail;
  const size_t bytes = words * bits::kTritBytesPerWord;
  static const int resident = resident_blocks(encode_trits_kernel);
  encode_trits_kernel<<<grid_for(bytes, kBlockThreads, resident), kBlockThreads, 0, stream>>>(
      sign, tie, bytes, out);
  check_launch("encode_trits");
}

void decode_trits(
    bits::DType dtype,
    const uint8_t* trits,
    size_t n,
    const void* lut,
    void* dst,
    unsigned* bad,
    cudaStream_t stream) {
  if (n == 0) {
    return;
  }
  using namespace detail;
  switch (bits::dtype_size(dtype)) {
    case 1:
      return launch_decode<uint8_t>(trits, n, lut, dst, bad, stream);
    case 2:
      return launch_decode<uint16_t>(trits, n, lut, dst, bad, stream);
    case 4:
      return launch_decode<uint32_t>(trits, n, lut, dst, bad, stream);
    default:
      return launch_decode<uint64_t>(trits, n, lut, dst, bad, stream);
  }
}

} // namespace lionbit::cuda
