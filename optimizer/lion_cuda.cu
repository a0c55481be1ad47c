// The fused Lion kernels on the GPU (optimizer/lion_cuda.h), bitwise equal to
// the CPU kernels of optimizer/lion.h. The float arithmetic is in
// signbits/cuda/element.cuh (lion_direction_math, lion_apply_math): every
// operation an __fmul_rn / __fadd_rn / __fsub_rn intrinsic, which nvcc never
// contracts into an FMA (the library is also built with --fmad=false), and
// float16 / bfloat16 conversions done on the bit patterns, never flushing.
//
//  * lion_direction: as pack_signs, a warp makes kDirGroups groups of
//    kWordsPerWarpIter words of the sign and zero planes at a time
//    (optimizer/lion_warp.cuh): whole groups with g, m and m_out at 16-byte
//    boundaries by the vector path (lane l: 8 elements a group in 16-byte
//    loads and stores, kDirBatch groups' loads in flight at once, shuffles
//    join the bytes), the others by the ballot path (lane l:
//    elements l and l + 32 of a word, coalesced loads of g and m, coalesced
//    store of the new momentum to m_out (m itself in place, another buffer,
//    or none: the momentum only read), two ballots per plane); the
//    boundary words read-modify-written; the zero / non-finite tallies summed
//    per block, one atomic per block.
//  * lion_apply_dense: a block per unit of kApplyUnit elements and iteration:
//    16-byte loads and stores of kApplyGroups groups of 8 elements a thread
//    where the unit is whole and x and delta aligned (every group's loads
//    first), else kApplyDenseUnroll elements a thread kBlockThreads apart.
#include "optimizer/lion_cuda.h"

#include "optimizer/lion_warp.cuh"
#include "signbits/cuda/element.cuh"
#include "signbits/cuda/launch.cuh"

namespace lionbit::optim::cuda {
namespace {

using bits::DType;
using lionbit::cuda::Counts;
namespace cd = lionbit::cuda::detail;
using cd::FloatStore;
using cd::kBlockThreads;
using cd::kMinBlocksPerSm;
using cd::kWarpsPerBlock;

// Plane words a warp takes per iteration of the grid loop (optimizer/lion_warp.cuh).
constexpr size_t kDirUnitWords = size_t{cd::kDirGroups} * cd::kWordsPerWarpIter;
static_assert(cd::kApplyThreads == kBlockThreads, "an apply unit is one block's");

template <DType G, DType M>
__global__ void __launch_bounds__(kBlockThreads, kMinBlocksPerSm) direction_kernel(
    const typename FloatStore<G>::U* __restrict__ g,
    const typename FloatStore<M>::U* m, // m_out may be m: neither __restrict__
    typename FloatStore<M>::U* m_out,
    size_t n,
    cd::LionCoefs k,
    uint64_t* __restrict__ sign,
    uint64_t* __restrict__ zero,
    unsigned o,
    size_t nwords,
    Counts* counts) {
  const size_t warp = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const size_t nwarps = static_cast<size_t>(gridDim.x) * blockDim.x / 32;
  unsigned long long zeros = 0, nans = 0;
  const bool vec = cd::direction_vec_aligned<G, M>(g, m, m_out, o);
  for (size_t k0 = warp * kDirUnitWords; k0 < nwords; k0 += nwarps * kDirUnitWords) {
    warp_unit::direction_words<G, M, false>(
        g, m, m_out, n, o, k0, nwords, vec, k, sign, zero, &zeros, &nans);
  }
  if (counts != nullptr) {
    cd::add_counts(counts, zeros, nans);
  }
}

template <DType G, DType M>
void launch_direction(
    const void* g,
    const void* m,
    void* m_out,
    size_t n,
    const cd::LionCoefs& k,
    uint64_t* sign,
    uint64_t* zero,
    size_t bit_offset,
    Counts* counts,
    cudaStream_t stream) {
  const unsigned o = static_cast<unsigned>(bit_offset % 64);
  const size_t first = bit_offset / 64;
  const size_t nwords = cd::words_out(o, n);
  static const int resident = cd::resident_blocks(direction_kernel<G, M>);
  const unsigned grid = cd::grid_for(nwords, size_t{kWarpsPerBlock} * kDirUnitWords, resident);
  direction_kernel<G, M><<<grid, kBlockThreads, 0, stream>>>(
      static_cast<const typename FloatStore<G>::U*>(g),
      static_cast<const typename FloatStore<M>::U*>(m),
      static_cast<typename FloatStore<M>::U*>(m_out), n, k, sign + first, zero + first, o, nwords,
      counts);
  cd::check_launch("lion_direction");
}

template <DType G>
void direction_grad(
    DType md,
    const void* g,
    const void* m,
    void* m_out,
    size_t n,
    const cd::LionCoefs& k,
    uint64_t* sign,
    uint64_t* zero,
    size_t bit_offset,
    Counts* counts,
    cudaStream_t stream) {
  switch (md) {
    case DType::kFloat32:
      return launch_direction<G, DType::kFloat32>(
          g, m, m_out, n, k, sign, zero, bit_offset, counts, stream);
    case DType::kBFloat16:
      return launch_direction<G, DType::kBFloat16>(
          g, m, m_out, n, k, sign, zero, bit_offset, counts, stream);
    default:
      return; // unsupported: nothing touched (the caller validates)
  }
}

template <DType X, DType Dl>
__global__ void __launch_bounds__(kBlockThreads) apply_dense_kernel(
    typename FloatStore<X>::U* __restrict__ x,
    const typename FloatStore<Dl>::U* __restrict__ delta,
    size_t n,
    float lr,
    float decay) {
  const bool vec = cd::apply_vec_aligned(x, delta);
  const size_t units = (n + cd::kApplyUnit - 1) / cd::kApplyUnit;
  for (size_t u = blockIdx.x; u < units; u += gridDim.x) {
    cd::lion_apply_unit<X, Dl>(x, delta, n, u * cd::kApplyUnit, threadIdx.x, vec, lr, decay);
  }
}

template <DType X, DType Dl>
void launch_apply_dense(
    void* x,
    const void* delta,
    size_t n,
    float lr,
    float decay,
    cudaStream_t stream) {
  static const int resident = cd::resident_blocks(apply_dense_kernel<X, Dl>);
  const unsigned grid = cd::grid_for(n, cd::kApplyUnit, resident);
  apply_dense_kernel<X, Dl><<<grid, kBlockThreads, 0, stream>>>(
      static_cast<typename FloatStore<X>::U*>(x),
      static_cast<const typename FloatStore<Dl>::U*>(delta), n, lr, decay);
  cd::check_launch("lion_apply_dense");
}

template <DType X>
void apply_dense_param(
    DType dd,
    void* x,
    const void* delta,
    size_t n,
    float lr,
    float decay,
    cudaStream_t stream) {
  switch (dd) {
    case DType::kFloat32:
      return launch_apply_dense<X, DType::kFloat32>(x, delta, n, lr, decay, stream);
    case DType::kBFloat16:
      return launch_apply_dense<X, DType::kBFloat16>(x, delta, n, lr, decay, stream);
    case DType::kFloat16:
      return launch_apply_dense<X, DType::kFloat16>(x, delta, n, lr, decay, stream);
    default:
      return;
  }
}

} // namespace

void lion_direction(
    DType grad_dtype,
    const void* g,
    DType momentum_dtype,
    const void* m,
    size_t n,
    float b1,
    float omb1,
    float b2,
    float omb2,
    uint64_t* sign,
    uint64_t* zero,
    size_t bit_offset,
    Counts* counts,
    cudaStream_t stream,
    void* m_out) {
  if (n == 0) {
    return;
  }
  const cd::LionCoefs k{b1, omb1, b2, omb2};
  switch (grad_dtype) {
    case DType::kFloat32:
      return direction_grad<DType::kFloat32>(
          momentum_dtype, g, m, m_out, n, k, sign, zero, bit_offset, counts, stream);
    case DType::kBFloat16:
      return direction_grad<DType::kBFloat16>(
          momentum_dtype, g, m, m_out, n, k, sign, zero, bit_offset, counts, stream);
    case DType::kFloat16:
      return direction_grad<DType::kFloat16>(
          momentum_dtype, g, m, m_out, n, k, sign, zero, bit_offset, counts, stream);
    default:
      return;
  }
}

void lion_apply_dense(
    DType param_dtype,
    void* x,
    DType delta_dtype,
    const void* delta,
    size_t n,
    float lr,
    float decay,
    cudaStream_t stream) {
  if (n == 0) {
    return;
  }
  switch (param_dtype) {
    case DType::kFloat32:
      return apply_dense_param<DType::kFloat32>(delta_dtype, x, delta, n, lr, decay, stream);
    case DType::kBFloat16:
      return apply_dense_param<DType::kBFloat16>(delta_dtype, x, delta, n, lr, decay, stream);
    case DType::kFloat16:
      return apply_dense_param<DType::kFloat16>(delta_dtype, x, delta, n, lr, decay, stream);
    default:
      return;
  }
}

} // namespace lionbit::optim::cuda
