// count_code and vote on the GPU: one thread per 64-bit word position. The
// thread reads word w of each of the n contributions (coalesced across the
// warp: consecutive threads, consecutive words), adds them into bit-sliced
// counters held in registers (element.cuh: Counter<P>, a full adder per pair
// of contributions plus a ripple of the carry) and writes the code planes or
// the vote. The kernels are compiled for a few counter widths P; a call uses
// the smallest P >= bit_width(n).
#include "signbits/ties.h"
#include "signbits/cuda/element.cuh"
#include "signbits/cuda/kernels.h"
#include "signbits/cuda/launch.cuh"

namespace lionbit::cuda {
namespace detail {
namespace {

template <int P>
__global__ void __launch_bounds__(kBlockThreads) count_code_kernel(
    const uint64_t* __restrict__ sign,
    const uint64_t* __restrict__ zero,
    size_t stride,
    int n,
    size_t words,
    int planes,
    uint64_t* __restrict__ out) {
  const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t w = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < words;
       w += step) {
    uint64_t code[P + 1];
    code_word<P>(sign, zero, stride, n, w, code);
#pragma unroll
    for (int b = 0; b <= P; ++b) {
      if (b < planes) {
        out[static_cast<size_t>(b) * words + w] = code[b];
      }
    }
  }
}

template <int P>
__global__ void __launch_bounds__(kBlockThreads) vote_kernel(
    const uint64_t* __restrict__ sign,
    const uint64_t* __restrict__ zero,
    size_t stride,
    int n,
    size_t words,
    uint64_t* __restrict__ out_sign,
    uint64_t* __restrict__ out_zero) {
  const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t w = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < words;
       w += step) {
    uint64_t s, z;
    vote_word<P>(sign, zero, stride, n, w, &s, &z);
    out_sign[w] = s;
    out_zero[w] = z;
  }
}

__global__ void __launch_bounds__(kBlockThreads) break_ties_kernel(
    uint64_t* __restrict__ sign,
    const uint64_t* __restrict__ tie,
    const uint64_t* __restrict__ still,
    size_t words,
    bits::TieRule rule,
    uint64_t first_word) {
  const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t w = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < words;
       w += step) {
    const uint64_t t = tie[w] & ~still[w];
    if (t != 0) {
      sign[w] |= t & bits::tie_word(rule, first_word + w);
    }
  }
}

void check_n(int n, const char* what) {
  if (n < 1 || n > 1024) {
    throw std::invalid_argument(
        std::string("lionbit: ") + what + ": n must be 1 .. 1024, got " + std::to_string(n));
  }
}

template <int P>
void launch_count(
    const uint64_t* sign,
    const uint64_t* zero,
    size_t stride,
    int n,
    size_t words,
    uint64_t* out,
    cudaStream_t stream) {
  const int planes = width_of(static_cast<uint32_t>(zero != nullptr ? 2 * n : n));
  static const int resident = resident_blocks(count_code_kernel<P>);
  count_code_kernel<P><<<grid_for(words, kBlockThreads, resident), kBlockThreads, 0, stream>>>(
      sign, zero, stride, n, words, planes, out);
  check_launch("count_code");
}

template <int P>
void launch_vote(
    const uint64_t* sign,
    const uint64_t* zero,
    size_t stride,
    int n,
    size_t words,
    uint64_t* out_sign,
    uint64_t* out_zero,
    cudaStream_t stream) {
  static const int resident = resident_blocks(vote_kernel<P>);
  vote_kernel<P><<<grid_for(words, kBlockThreads, resident), kBlockThreads, 0, stream>>>(
      sign, zero, stride, n, words, out_sign, out_zero);
  check_launch("vote");
}

// Calls F<P>(args...) for the P that pick_planes(n) names.
#define LIONBIT_DISPATCH_PLANES(n, FN, ...) \
  switch (pick_planes(n)) {                 \
    case 1:                                 \
      return FN<1>(__VA_ARGS__);            \
    case 2:                                 \
      return FN<2>(__VA_ARGS__);            \
    case 3:                                 \
      return FN<3>(__VA_ARGS__);            \
    case 4:                                 \
      return FN<4>(__VA_ARGS__);            \
    case 5:                                 \
      return FN<5>(__VA_ARGS__);            \
    case 6:                                 \
      return FN<6>(__VA_ARGS__);            \
    case 7:                                 \
      return FN<7>(__VA_ARGS__);            \
    case 8:                                 \
      return FN<8>(__VA_ARGS__);            \
    default:                                \
      return FN<11>(__VA_ARGS__);           \
  }

} // namespace
} // namespace detail

void count_code(
    const uint64_t* sign,
    const uint64_t* zero,
    size_t stride,
    int n,
    size_t words,
    uint64_t* out,
    cudaStream_t stream) {
  detail::check_n(n, "count_code");
  if (words == 0) {
    return;
  }
  using namespace detail;
  LIONBIT_DISPATCH_PLANES(n, launch_count, sign, zero, stride, n, words, out, stream)
}

void vote(
    const uint64_t* sign,
    const uint64_t* zero,
    size_t stride,
    int n,
    size_t words,
    uint64_t* out_sign,
    uint64_t* out_zero,
    cudaStream_t stream) {
  detail::check_n(n, "vote");
  if (words == 0) {
    return;
  }
  using namespace detail;
  LIONBIT_DISPATCH_PLANES(n, launch_vote, sign, zero, stride, n, words, out_sign, out_zero, stream)
}

void break_ties(
    uint64_t* sign,
    const uint64_t* tie,
    const uint64_t* still,
    size_t words,
    const bits::TieRule& rule,
    uint64_t first_word,
    cudaStream_t stream) {
  if (words == 0 || rule.mode == bits::TieBreak::kZero) {
    return;
  }
  using namespace detail;
  static const int resident = resident_blocks(break_ties_kernel);
  break_ties_kernel<<<grid_for(words, kBlockThreads, resident), kBlockThreads, 0, stream>>>(
      sign, tie, still, words, rule, first_word);
  check_launch("break_ties");
}

} // namespace lionbit::cuda
