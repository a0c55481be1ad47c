// Kernel sets by the names Python passes ("simd", "aten", "cuda"), and the
// check's mismatches as Python reads them: shared by lionbit._C (the check)
// and lionbit._test_hooks (single kernels, the planted faults).
#pragma once

#include <c10/core/Device.h>

#include <string>
#include <tuple>
#include <vector>

#include "backend/kernel_check.hpp"
#include "backend/kernel_set.hpp"

namespace lionbit {

// The set named `name` for tensors on `device`; raises ValueError (naming
// `op`) for an unknown name or a set that does not run there. "cuda": every
// custom CUDA kernel, unchecked.
const KernelSet& named_set(const char* op, const std::string& name, const c10::Device& device);

// (kernel, case) per mismatch.
std::vector<std::tuple<std::string, std::string>> as_pairs(
    const std::vector<KernelMismatch>& mismatches);

} // namespace lionbit
