// Tensor-level entry points to the bit kernels for Python (lionbit._C): what
// the optimizer uses to pack many parameters' direction bits into one flat
// buffer for a single collective.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace lionbit {

// Packs the signs of `t` (contiguous CPU, a sign all-reduce dtype) into the
// uint8 planes `sign` / `zero` at bit offset `bit_offset`. Returns
// (zeros, nans) counted in `t`.
std::tuple<int64_t, int64_t> pack_signs_into(
    const at::Tensor& t,
    at::Tensor& sign,
    at::Tensor& zero,
    int64_t bit_offset);

} // namespace lionbit
