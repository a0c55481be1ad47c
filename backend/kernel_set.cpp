#include "backend/kernel_set.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

#include "backend/torch_adapter.hpp"
#include "signbits/unpack.h"
#ifdef LIONBIT_WITH_CUDA
#include "backend/kernels_cuda.hpp"
#endif

namespace lionbit {

const char* kernel_name(Kernel k) {
  switch (k) {
    case Kernel::kPack:
      return "pack";
    case Kernel::kPackLevels:
      return "pack_levels";
    case Kernel::kClean:
      return "clean";
    case Kernel::kCountBits:
      return "count_bits";
    case Kernel::kEncodeZeros:
      return "encode_zeros";
    case Kernel::kDecodeZeros:
      return "decode_zeros";
    case Kernel::kCountCode:
      return "count_code";
    case Kernel::kVote:
      return "vote";
    case Kernel::kVoteLevels:
      return "vote_levels";
    case Kernel::kAllZero:
      return "all_zero";
    case Kernel::kBreakTies:
      return "break_ties";
    case Kernel::kEncodeTrits:
      return "encode_trits";
    case Kernel::kDecodeTrits:
      return "decode_trits";
    case Kernel::kEncodeZeroCounts:
      return "encode_zero_counts";
    case Kernel::kApplyZeroCounts:
      return "apply_zero_counts";
    case Kernel::kUnpack:
      return "unpack";
    case Kernel::kCount:
      break;
  }
  return "?";
}

KernelChoice requested_kernels() {
  const char* v = std::getenv("LIONBIT_KERNELS");
  const std::string s = v == nullptr ? "" : v;
  if (s.empty() || s == "auto") {
    return KernelChoice::kAuto;
  }
  if (s == "custom") {
    return KernelChoice::kCustom;
  }
  if (s == "aten") {
    return KernelChoice::kAten;
  }
  TORCH_CHECK_VALUE(false, "lionbit: LIONBIT_KERNELS must be auto, custom or aten, got '", s, "'");
  return KernelChoice::kAuto;
}

const KernelSet& kernels_for(const c10::Device& device) {
  const KernelChoice choice = requested_kernels();
  if (choice == KernelChoice::kAten) {
    return aten_kernels();
  }
  if (device.is_cpu()) {
    return simd_kernels();
  }
#ifdef LIONBIT_WITH_CUDA
  if (device.is_cuda()) {
    return cuda_kernels(device, choice == KernelChoice::kAuto);
  }
#endif
  return aten_kernels();
}

at::Tensor device_bytes(size_t n, const c10::Device& device) {
  return at::empty({static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte).device(device));
}

at::Tensor lut_tensor(
    bits::DType dtype,
    const std::vector<double>& values,
    const c10::Device& device) {
  const size_t esize = bits::dtype_size(dtype);
  at::Tensor host = byte_buffer(values.size() * esize);
  bits::make_lut(dtype, values.data(), values.size(), bytes_of(host));
  at::Tensor typed = host.view(torch_dtype(dtype));
  return device.is_cpu() ? typed : typed.to(device);
}

} // namespace lionbit
