// Tensor-level entry points to the bit kernels for Python (lionbit._C): what
// the optimizer uses to pack many parameters' direction bits into one flat
// buffer for a single collective.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>
#include <tuple>

#include "signbits/types.h"

namespace lionbit {

// Raises ValueError "lionbit.<op>: <problem>" when a check of
// backend/torch_adapter.hpp found one.
inline void require(const char* op, const std::string& problem) {
  TORCH_CHECK_VALUE(problem.empty(), "lionbit.", op, ": ", problem);
}

// Packs the signs of `t` (contiguous CPU, a sign all-reduce dtype) into the
// uint8 planes `sign` / `zero` at bit offset `bit_offset`. Returns
// (zeros, nans) counted in `t`.
std::tuple<int64_t, int64_t> pack_signs_into(
    const at::Tensor& t,
    at::Tensor& sign,
    at::Tensor& zero,
    int64_t bit_offset);

// Fused Lion direction (optimizer/lion.h): reads g and m once, writes the new
// m in place (unless update_momentum is false) and the direction's bits into
// the planes at `bit_offset`. Returns the number of non-finite directions
// (NaN or +-Inf: a non-finite g or m). Coefficients as in lion.h.
int64_t lion_direction_into(
    const at::Tensor& g,
    at::Tensor& m,
    double b1,
    double omb1,
    double b2,
    double omb2,
    at::Tensor& sign,
    at::Tensor& zero,
    int64_t bit_offset,
    bool update_momentum);

// x = x * decay - lr * delta, in place (optimizer/lion.h).
void lion_apply(at::Tensor& x, const at::Tensor& delta, double lr, double decay);

// Whether the fused kernels take these dtypes.
bool lion_fused_supported(at::ScalarType param, at::ScalarType grad, at::ScalarType momentum);

} // namespace lionbit
