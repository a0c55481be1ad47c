#include "bindings/kernel_sets_by_name.hpp"

#include <c10/util/Exception.h>

#ifdef LIONBIT_WITH_CUDA
#include "backend/kernels_cuda.hpp"
#endif

namespace lionbit {

const KernelSet& named_set(const char* op, const std::string& name, const c10::Device& device) {
  if (name == "aten") {
    return aten_kernels();
  }
#ifdef LIONBIT_WITH_CUDA
  if (name == "cuda") {
    TORCH_CHECK_VALUE(
        device.is_cuda(), "lionbit.", op, ": the cuda set runs on CUDA devices only, not on ",
        device);
    return cuda_kernels(device, /*checked=*/false); // every custom kernel, unchecked
  }
#endif
  TORCH_CHECK_VALUE(
      name == "simd", "lionbit.", op,
      ": a kernel set is 'simd', 'aten' or (CUDA builds) 'cuda', got '", name, "'");
  TORCH_CHECK_VALUE(
      device.is_cpu(), "lionbit.", op, ": the simd set runs on the CPU only, not on ", device);
  return simd_kernels();
}

std::vector<std::tuple<std::string, std::string>> as_pairs(
    const std::vector<KernelMismatch>& mismatches) {
  std::vector<std::tuple<std::string, std::string>> out;
  for (const KernelMismatch& m : mismatches) {
    out.emplace_back(kernel_name(m.kernel), m.case_);
  }
  return out;
}

} // namespace lionbit
