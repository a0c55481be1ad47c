// The fused Lion kernels of optimizer/lion.h on the GPU, under exactly the
// same float contract (see lion.h: float32 arithmetic, every operation
// rounded on its own, never a fused multiply-add, round-to-nearest-even
// stores) and therefore bitwise equal to the CPU kernels. No torch here;
// compiled by nvcc into lionbit_optim_cuda.
//
// As in signbits/cuda/kernels.h: device pointers, enqueue on `stream` only,
// no host synchronisation, std::runtime_error on a launch failure.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "signbits/types.h"
#include "signbits/cuda/kernels.h"
#include "optimizer/lion_list.cuh"

namespace lionbit::optim::cuda {

// Step 1 in one pass over g and m (dtypes as lion_direction): writes the signs
// of c = b1*m + omb1*g into bits [bit_offset, bit_offset + n) of `sign` and
// `zero` (all other bits left as they are, as lionbit::cuda::pack_signs) and
// the new momentum b2*m + omb2*g into `m_out` (n elements of the momentum
// dtype): m_out == m updates the momentum in place (optim::lion_direction);
// m_out another buffer, which must not overlap m or g, leaves m as it was and
// gives the next momentum there (double-buffered momentum); m_out == nullptr
// only reads m (optim::lion_direction_only). Bits, counts and the new
// momentum's values are the same in all three. (The 16-byte vector path runs
// where g, m and m_out each put element -(bit_offset % 64) on a 16-byte
// boundary; an m_out off it, e.g. one element, gives the same results by the
// slower ballot path.) Adds the c == 0 count to counts->zeros and the
// non-finite count (c NaN or +-Inf, as PackCounts::nonfinite: a step that
// must not be applied) to counts->nans.
void lion_direction(
    bits::DType grad_dtype,
    const void* g,
    bits::DType momentum_dtype,
    const void* m,
    size_t n,
    float b1,
    float omb1,
    float b2,
    float omb2,
    uint64_t* sign,
    uint64_t* zero,
    size_t bit_offset,
    lionbit::cuda::Counts* counts,
    cudaStream_t stream,
    void* m_out);

// The in-place update (m_out == m): the call as it was before m_out.
inline void lion_direction(
    bits::DType grad_dtype,
    const void* g,
    bits::DType momentum_dtype,
    void* m,
    size_t n,
    float b1,
    float omb1,
    float b2,
    float omb2,
    uint64_t* sign,
    uint64_t* zero,
    size_t bit_offset,
    lionbit::cuda::Counts* counts,
    cudaStream_t stream) {
  lion_direction(
      grad_dtype, g, momentum_dtype, m, n, b1, omb1, b2, omb2, sign, zero, bit_offset, counts,
      stream, m);
}

// x[i] = fl(fl(x[i] * decay) - fl(lr * delta[i])), as lion_apply_dense.
void lion_apply_dense(
    bits::DType param_dtype,
    void* x,
    bits::DType delta_dtype,
    const void* delta,
    size_t n,
    float lr,
    float decay,
    cudaStream_t stream);

// ---------------------------------------------------------- lists ----
// (lion_cuda_list.cu) The same kernels over many tensors in one launch: a
// device-side table of the tensors (lion_list.cuh: DirectionSeg, ApplySeg,
// their units), a warp or block finding its tensor by a binary search on
// the units' first indices. A step of a model of hundreds of tensors is a
// few launches.

// lion_direction over the `count` tensors of the table `segs` (device
// memory, direction_units filled in; `units` its result): every tensor
// written at its bit offset of `sign` and `zero` (the tensors' bits may share
// plane words: their edge words are written with atomics), or, with sign
// == nullptr (zero and counts too), the momentum update alone; each tensor's
// new momentum goes to its segs[s].m_out (as lion_direction's m_out: segs[s].m
// in place, another buffer not overlapping it, or nullptr: not written). One
// launch.
void lion_direction_list(
    bits::DType grad_dtype,
    bits::DType momentum_dtype,
    const DirectionSeg* segs,
    size_t count,
    uint64_t units,
    float b1,
    float omb1,
    float b2,
    float omb2,
    uint64_t* sign,
    uint64_t* zero,
    lionbit::cuda::Counts* counts,
    cudaStream_t stream);

// lion_apply_dense over the tensors of `segs` (device memory,
// apply_units filled in). One launch.
void lion_apply_list(
    bits::DType param_dtype,
    bits::DType delta_dtype,
    const ApplySeg* segs,
    size_t count,
    uint64_t units,
    float lr,
    float decay,
    cudaStream_t stream);

// lion_apply_planes over the tensors of `segs` (device memory, apply_units
// filled in): tensor s's Delta from bits segs[s].bit_offset .. + n of the
// vote's result planes `sign` and `zero`. One launch.
void lion_apply_planes_list(
    bits::DType param_dtype,
    const ApplySeg* segs,
    size_t count,
    uint64_t units,
    const uint64_t* sign,
    const uint64_t* zero,
    float lr,
    float decay,
    cudaStream_t stream);

} // namespace lionbit::optim::cuda
