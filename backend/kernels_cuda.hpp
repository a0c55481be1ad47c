// The CUDA kernel set: signbits/cuda's custom kernels behind the KernelSet
// interface, on the current CUDA stream. Built with LIONBIT_WITH_CUDA only.
#pragma once

#include "backend/kernel_set.hpp"

namespace lionbit {

// The set for a CUDA device. `checked`: on the first call for the device,
// each custom kernel is run against the ATen set on small random inputs
// (kernel_check.hpp); a kernel that disagrees warns once, naming itself and
// the case, and the ATen kernel is used for it from then on. Unchecked
// (LIONBIT_KERNELS=custom): the custom kernels as they are.
const KernelSet& cuda_kernels(const c10::Device& device, bool checked);

} // namespace lionbit
