// The fused Lion kernels over a list of tensors in one launch
// (optimizer/lion_cuda.h, "lists"): the per-tensor kernels of lion_cuda.cu
// with a grid loop over the list's work units instead of one tensor's. A
// unit is kDirUnitWords plane words of one tensor (the direction: one warp,
// optimizer/lion_warp.cuh) or kApplyUnit elements (the apply: one block); the table gives each
// tensor's first unit, and a warp or block walks its units with a SegmentWalk (element.cuh: a
// binary search over the table, a model's parameter list, only where a unit leaves the last unit's
// tensor). The arithmetic and the lanes' bodies are
// element.cuh's, so each tensor's bits and values are the per-tensor kernel's; the only difference
// is the planes' edge words, which two tensors of one launch may share (commit_word_shared).
#include "optimizer/lion_cuda.h"
#include "optimizer/lion_list.cuh"

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

static_assert(list_detail::kApplyThreads == kBlockThreads, "an apply unit is one block's");

template <DType G, DType M>
__global__ void __launch_bounds__(kBlockThreads, kMinBlocksPerSm) direction_list_kernel(
    const DirectionSeg* __restrict__ segs,
    size_t count,
    uint64_t units,
    cd::LionCoefs k,
    uint64_t* sign,
    uint64_t* zero,
    Counts* counts) {
  const size_t warp = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const size_t nwarps = static_cast<size_t>(gridDim.x) * blockDim.x / 32;
  unsigned long long zeros = 0, nans = 0;
  cd::SegmentWalk<DirectionSeg> walk(segs, count, units);
  for (uint64_t u = warp; u < units; u += nwarps) {
    const DirectionUnit d = direction_unit(segs[walk.at(u)], u);
    const auto* g = static_cast<const typename FloatStore<G>::U*>(d.seg.g);
    const auto* m = static_cast<const typename FloatStore<M>::U*>(d.seg.m);
    auto* m_out = static_cast<typename FloatStore<M>::U*>(d.seg.m_out); // m, another, or none
    const size_t first = static_cast<size_t>(d.seg.bit_offset / 64);
    warp_unit::direction_words<G, M, true>(
        g, m, m_out, static_cast<size_t>(d.seg.n), d.o, d.k0, d.nwords,
        cd::direction_vec_aligned<G, M>(g, m, m_out, d.o), k,
        sign != nullptr ? sign + first : nullptr, zero != nullptr ? zero + first : nullptr, &zeros,
        &nans);
  }
  if (counts != nullptr) {
    cd::add_counts(counts, zeros, nans);
  }
}

template <DType X, DType Dl>
__global__ void __launch_bounds__(kBlockThreads) apply_list_kernel(
    const ApplySeg* __restrict__ segs,
    size_t count,
    uint64_t units,
    float lr,
    float decay) {
  cd::SegmentWalk<ApplySeg> walk(segs, count, units);
  for (uint64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const ApplySeg s = segs[walk.at(u)];
    cd::lion_apply_unit<X, Dl>(
        static_cast<typename FloatStore<X>::U*>(s.x),
        static_cast<const typename FloatStore<Dl>::U*>(s.delta), static_cast<size_t>(s.n),
        apply_first(s, u), threadIdx.x, cd::apply_vec_aligned(s.x, s.delta), lr, decay);
  }
}

template <DType X>
__global__ void __launch_bounds__(kBlockThreads) apply_planes_list_kernel(
    const ApplySeg* __restrict__ segs,
    size_t count,
    uint64_t units,
    const uint64_t* __restrict__ sign,
    const uint64_t* __restrict__ zero,
    float lr,
    float decay) {
  cd::SegmentWalk<ApplySeg> walk(segs, count, units);
  for (uint64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const ApplySeg s = segs[walk.at(u)];
    cd::lion_apply_planes_unit<X>(
        static_cast<typename FloatStore<X>::U*>(s.x), static_cast<size_t>(s.n), apply_first(s, u),
        threadIdx.x, cd::apply_vec_aligned(s.x, s.x), sign, zero, s.bit_offset, lr, decay);
  }
}

template <DType G, DType M>
void launch_direction_list(
    const DirectionSeg* segs,
    size_t count,
    uint64_t units,
    const cd::LionCoefs& k,
    uint64_t* sign,
    uint64_t* zero,
    Counts* counts,
    cudaStream_t stream) {
  static const int resident = cd::resident_blocks(direction_list_kernel<G, M>);
  const unsigned grid = cd::grid_for(units, size_t{kWarpsPerBlock}, resident);
  direction_list_kernel<G, M>
      <<<grid, kBlockThreads, 0, stream>>>(segs, count, units, k, sign, zero, counts);
  cd::check_launch("lion_direction_list");
}

template <DType G>
void direction_list_grad(
    DType md,
    const DirectionSeg* segs,
    size_t count,
    uint64_t units,
    const cd::LionCoefs& k,
    uint64_t* sign,
    uint64_t* zero,
    Counts* counts,
    cudaStream_t stream) {
  switch (md) {
    case DType::kFloat32:
      return launch_direction_list<G, DType::kFloat32>(
          segs, count, units, k, sign, zero, counts, stream);
    case DType::kBFloat16:
      return launch_direction_list<G, DType::kBFloat16>(
          segs, count, units, k, sign, zero, counts, stream);
    default:
      return; // unsupported: nothing touched (the caller validates)
  }
}

template <DType X, DType Dl>
void launch_apply_list(
    const ApplySeg* segs,
    size_t count,
    uint64_t units,
    float lr,
    float decay,
    cudaStream_t stream) {
  static const int resident = cd::resident_blocks(apply_list_kernel<X, Dl>);
  const unsigned grid = cd::grid_for(units, 1, resident);
  apply_list_kernel<X, Dl><<<grid, kBlockThreads, 0, stream>>>(segs, count, units, lr, decay);
  cd::check_launch("lion_apply_list");
}

template <DType X>
void apply_list_param(
    DType dd,
    const ApplySeg* segs,
    size_t count,
    uint64_t units,
    float lr,
    float decay,
    cudaStream_t stream) {
  switch (dd) {
    case DType::kFloat32:
      return launch_apply_list<X, DType::kFloat32>(segs, count, units, lr, decay, stream);
    case DType::kBFloat16:
      return launch_apply_list<X, DType::kBFloat16>(segs, count, units, lr, decay, stream);
    case DType::kFloat16:
      return launch_apply_list<X, DType::kFloat16>(segs, count, units, lr, decay, stream);
    default:
      return;
  }
}

template <DType X>
void launch_apply_planes_list(
    const ApplySeg* segs,
    size_t count,
    uint64_t units,
    const uint64_t* sign,
    const uint64_t* zero,
    float lr,
    float decay,
    cudaStream_t stream) {
  static const int resident = cd::resident_blocks(apply_planes_list_kernel<X>);
  const unsigned grid = cd::grid_for(units, 1, resident);
  apply_planes_list_kernel<X>
      <<<grid, kBlockThreads, 0, stream>>>(segs, count, units, sign, zero, lr, decay);
  cd::check_launch("lion_apply_planes_list");
}

} // namespace

void lion_direction_list(
    DType grad_dtype,
    DType momentum_dtype,
    const DirectionSeg* segs,
    size_t count,
    uint64_t units,
    float b1,
    float omb1,
    float b2,
    float omb2,
    uint64_t* sign,
    uint64_t* zero,
    Counts* counts,
    cudaStream_t stream) {
  if (units == 0) {
    return;
  }
  const cd::LionCoefs k{b1, omb1, b2, omb2};
  switch (grad_dtype) {
    case DType::kFloat32:
      return direction_list_grad<DType::kFloat32>(
          momentum_dtype, segs, count, units, k, sign, zero, counts, stream);
    case DType::kBFloat16:
      return direction_list_grad<DType::kBFloat16>(
          momentum_dtype, segs, count, units, k, sign, zero, counts, stream);
    case DType::kFloat16:
      return direction_list_grad<DType::kFloat16>(
          momentum_dtype, segs, count, units, k, sign, zero, counts, stream);
    default:
      return;
  }
}

void lion_apply_list(
    DType param_dtype,
    DType delta_dtype,
    const ApplySeg* segs,
    size_t count,
    uint64_t units,
    float lr,
    float decay,
    cudaStream_t stream) {
  if (units == 0) {
    return;
  }
  switch (param_dtype) {
    case DType::kFloat32:
      return apply_list_param<DType::kFloat32>(delta_dtype, segs, count, units, lr, decay, stream);
    case DType::kBFloat16:
      return apply_list_param<DType::kBFloat16>(delta_dtype, segs, count, units, lr, decay, stream);
    case DType::kFloat16:
      return apply_list_param<DType::kFloat16>(delta_dtype, segs, count, units, lr, decay, stream);
    default:
      return;
  }
}

void lion_apply_planes_list(
    DType param_dtype,
    const ApplySeg* segs,
    size_t count,
    uint64_t units,
    const uint64_t* sign,
    const uint64_t* zero,
    float lr,
    float decay,
    cudaStream_t stream) {
  if (units == 0) {
    return;
  }
  switch (param_dtype) {
    case DType::kFloat32:
      return launch_apply_planes_list<DType::kFloat32>(
          segs, count, units, sign, zero, lr, decay, stream);
    case DType::kBFloat16:
      return launch_apply_planes_list<DType::kBFloat16>(
          segs, count, units, sign, zero, lr, decay, stream);
    case DType::kFloat16:
      return launch_apply_planes_list<DType::kFloat16>(
          segs, count, units, sign, zero, lr, decay, stream);
    default:
      return;
  }
}

} // namespace lionbit::optim::cuda
