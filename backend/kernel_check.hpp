// The self-check of a kernel set: each kernel of a candidate set run against
// a reference set on small random inputs that cover every dtype, format, tie
// rule and boundary (sizes that are not whole words, one element, zeros,
// NaN, planes at odd offsets, N from 1 to 9). The CUDA set runs it against
// the ATen set at first use on each device; the CPU tests run it between the
// SIMD set and the ATen set, so the check itself runs in `make test`.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "backend/kernel_set.hpp"

namespace lionbit {

struct KernelMismatch {
  Kernel kernel;
  std::string case_; // "float16, n=65, offset=3": what to reproduce it with
};

// Runs every kernel of `candidate` and `reference` on the same inputs on
// `device` (both sets must run there) and returns where they differ, at most
// one mismatch per kernel. `seed` picks the random inputs.
std::vector<KernelMismatch> check_kernels(
    const KernelSet& candidate,
    const KernelSet& reference,
    const c10::Device& device,
    uint64_t seed);

// (kernel name, case) per mismatch: what Python receives.
std::vector<std::tuple<std::string, std::string>> as_pairs(
    const std::vector<KernelMismatch>& mismatches);

} // namespace lionbit
