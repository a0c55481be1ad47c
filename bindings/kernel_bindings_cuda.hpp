// The fused Lion kernels of kernel_bindings.hpp for CUDA tensors (built with
// the CUDA path). Each enqueues on the current stream of the tensors' device
// and returns: no host synchronisation. lion_direction_into_device adds its
// tallies to an int64 tensor `counts` {c == 0, c non-finite} on the same
// device (the caller zeroes it); with update_momentum=False it only reads m
// (lion_direction_into's update_momentum=False). (Packing signs and levels goes through the
// kernel sets on every device: pack_signs_into, pack_levels_into.)
#pragma once

#include <ATen/core/Tensor.h>

namespace lionbit {

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
    int64_t bit_offset,
    bool update_momentum);

void lion_apply_device(at::Tensor& x, const at::Tensor& delta, double lr, double decay);

} // namespace lionbit
