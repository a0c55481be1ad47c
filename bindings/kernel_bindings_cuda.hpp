// The tensor-level kernel entry points of kernel_bindings.hpp for CUDA
// tensors (built with the CUDA path). Each enqueues on the current stream of
// the tensors' device and returns: no host synchronisation. Zero and NaN
// tallies go into an int64 tensor `counts` {zeros, NaNs} on the same device
// (added to; the caller zeroes it), which all_reduce_sign_packed_device takes.
#pragma once

#include <ATen/core/Tensor.h>

namespace lionbit {

void pack_signs_into_device(
    const at::Tensor& t,
    at::Tensor& sign,
    at::Tensor& zero,
    at::Tensor& counts,
    int64_t bit_offset);

void lion_direction_into_device(
    const at::Tensor& g,
    at::Tensor& m,
    double b1,
    double omb1,
    double b2,
    double omb2,
    at::Tensor& sign,
    at::Tensor& zero,
    at::Tensor& counts,
    int64_t bit_offset);

void lion_apply_device(at::Tensor& x, const at::Tensor& delta, double lr, double decay);

} // namespace lionbit
