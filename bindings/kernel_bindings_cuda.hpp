// The fused Lion kernels of kernel_bindings.hpp for CUDA tensors (built with
// the CUDA path). Each enqueues on the current stream of the tensors' device
// and returns: no host synchronisation. lion_direction_into_device adds its
// tallies to an int64 tensor `counts` {c == 0, c non-finite} on the same
// device (the caller zeroes it); with update_momentum=False it only reads m
// (lion_direction_into's update_momentum=False). With `m_out` (update_momentum
// must be True; a contiguous tensor of m's dtype and element count on m's
// device, overlapping neither m nor g) the new momentum goes to m_out and m is
// only read: double-buffered momentum, the same bits, counts and values as
// the in-place update. (Packing signs and levels goes through the kernel sets
// on every device: pack_signs_into, pack_levels_into.)
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

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
    bool update_momentum,
    const std::optional<at::Tensor>& m_out = std::nullopt);

void lion_apply_device(at::Tensor& x, const at::Tensor& delta, double lr, double decay);

// The same over lists of tensors in one launch each (optim::cuda's list
// kernels): every gradient of `gs` one dtype, every momentum of `ms` one
// dtype, tensor i's bits (of its span: list_spans) at bit_offsets[i] of the
// shared planes; without `sign` (None) the momentum update alone (no planes,
// no tallies). With `m_outs` (one a pair, update_momentum True; each as
// lion_direction_into_device's m_out for ms[i]) pair i's new momentum of its
// span goes to the same elements of m_outs[i], ms[i] only read; every check
// before anything is launched.
void lion_direction_list_device(
    const std::vector<at::Tensor>& gs,
    const std::vector<at::Tensor>& ms,
    double b1,
    double omb1,
    double b2,
    double omb2,
    const std::optional<at::Tensor>& sign,
    const std::optional<at::Tensor>& zero,
    const std::optional<at::Tensor>& counts,
    const std::vector<int64_t>& bit_offsets,
    bool update_momentum,
    const std::optional<std::vector<int64_t>>& starts = std::nullopt,
    const std::optional<std::vector<int64_t>>& lengths = std::nullopt,
    const std::optional<std::vector<at::Tensor>>& m_outs = std::nullopt);

// lion_apply_device over xs[i], deltas[i] (each list one dtype).
void lion_apply_list_device(
    const std::vector<at::Tensor>& xs,
    const std::vector<at::Tensor>& deltas,
    double lr,
    double decay);

// lion_apply_planes (kernel_bindings.hpp) over xs (one dtype) in one launch:
// xs[i]'s Delta (of its span, list_spans) from bits bit_offsets[i] .. +
// its elements of the vote's result planes `sign` and `zero` (uint8, on the
// xs' device).
void lion_apply_planes_list_device(
    const std::vector<at::Tensor>& xs,
    const at::Tensor& sign,
    const at::Tensor& zero,
    const std::vector<int64_t>& bit_offsets,
    double lr,
    double decay,
    const std::optional<std::vector<int64_t>>& starts = std::nullopt,
    const std::optional<std::vector<int64_t>>& lengths = std::nullopt);

} // namespace lionbit
