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

namespace {
// c = fl(fl(b1 m) + fl(omb1 g)) in float32 (optimizer/lion.h): separate
// float32 operations with float32 scalars.
at::Tensor lion_direction_tensor(
    const at::Tensor& g,
    const at::Tensor& m,
    const LionLevelCoefs& k) {
  return at::add(at::mul(m.to(at::kFloat), k.b1), at::mul(g.to(at::kFloat), k.omb1));
}
} // namespace

double KernelSet::level_abs_sum(const at::Tensor& g, const at::Tensor& m, const LionLevelCoefs& k)
    const {
  if (g.numel() == 0) {
    return 0.0;
  }
  return lion_direction_tensor(g, m, k).abs().sum(at::kDouble).item<double>();
}

uint64_t KernelSet::pack_lion_levels(
    const at::Tensor& g,
    at::Tensor& m,
    const LionLevelCoefs& k,
    bool update_momentum,
    double factor,
    int p,
    at::Tensor& planes,
    size_t plane_words,
    uint64_t bit_offset) const {
  if (g.numel() == 0) {
    return 0;
  }
  const at::Tensor gf = g.to(at::kFloat), mf = m.to(at::kFloat); // widened once
  const uint64_t bad = pack_levels(
      lion_direction_tensor(gf, mf, k), factor, p, planes, plane_words, bit_offset);
  if (update_momentum) {
    m.copy_(at::add(at::mul(mf, k.b2), at::mul(gf, k.omb2)));
  }
  return bad;
}

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
    case Kernel::kZeroCodes:
      return "zero_codes";
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

at::Tensor device_bytes(size_t n, const c10::Device& device) {
  return at::empty({static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte).device(device));
}

at::Tensor lut_tensor(
    bits::DType dtype,
    const std::vector<double>& values,
    const c10::Device& device) {
  const size_t esize = bits::dtype_size(dtype);
  // Off the CPU from pinned memory without waiting: a copy from pageable
  // memory would make the host wait for the stream once a chunk.
  at::Tensor host = at::empty(
      {static_cast<int64_t>(values.size() * esize)},
      at::TensorOptions().dtype(at::kByte).pinned_memory(!device.is_cpu()));
  bits::make_lut(dtype, values.data(), values.size(), bytes_of(host));
  at::Tensor typed = host.view(torch_dtype(dtype));
  return device.is_cpu() ? typed : typed.to(device, /*non_blocking=*/true);
}

} // namespace lionbit
