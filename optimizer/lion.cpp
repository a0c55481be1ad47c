#include "optimizer/lion.h"

#include "optimizer/lion_kernels.h"

namespace lionbit::optim {

using bits::DType;
using bits::Isa;

namespace {
bool is_float_storage(DType t) {
  return t == DType::kFloat32 || t == DType::kBFloat16 || t == DType::kFloat16;
}
} // namespace

bool lion_direction_dtypes_supported(DType grad, DType momentum) {
  return is_float_storage(grad) && (momentum == DType::kFloat32 || momentum == DType::kBFloat16);
}

bool lion_param_dtype_supported(DType param) {
  return is_float_storage(param);
}

bool lion_apply_dtypes_supported(DType param, DType delta) {
  return is_float_storage(param) && is_float_storage(delta);
}

namespace detail {
const LionKernels& lion_kernels_for(Isa isa) {
#ifdef LIONBIT_HAVE_X86_KERNELS
  static constexpr bits::PerIsa<LionKernels> copies{
      lion_kernels_scalar, lion_kernels_avx2, lion_kernels_avx512};
#else
  static constexpr bits::PerIsa<LionKernels> copies{lion_kernels_scalar};
#endif
  return bits::pick_kernels(isa, copies);
}
} // namespace detail

Isa lion_kernel_isa(Isa isa) {
  return detail::lion_kernels_for(isa).isa;
}

bits::PackCounts lion_direction(
    DType grad_dtype,
    const void* g,
    DType momentum_dtype,
    void* m,
    size_t n,
    float b1,
    float omb1,
    float b2,
    float omb2,
    uint64_t* sign,
    uint64_t* zero,
    Isa isa) {
  if (n == 0 || !lion_direction_dtypes_supported(grad_dtype, momentum_dtype)) {
    return {};
  }
  const detail::LionCoefs k{b1, omb1, b2, omb2};
  return detail::lion_kernels_for(isa).direction(
      grad_dtype, g, momentum_dtype, m, n, k, sign, zero, true);
}

bits::PackCounts lion_direction_only(
    DType grad_dtype,
    const void* g,
    DType momentum_dtype,
    const void* m,
    size_t n,
    float b1,
    float omb1,
    uint64_t* sign,
    uint64_t* zero,
    Isa isa) {
  if (n == 0 || !lion_direction_dtypes_supported(grad_dtype, momentum_dtype)) {
    return {};
  }
  const detail::LionCoefs k{b1, omb1, 0.0f, 0.0f};
  // update_momentum = false: m is only read.
  return detail::lion_kernels_for(isa).direction(
      grad_dtype, g, momentum_dtype, const_cast<void*>(m), n, k, sign, zero, false);
}

void lion_apply_dense(
    DType param_dtype,
    void* x,
    DType delta_dtype,
    const void* delta,
    size_t n,
    float lr,
    float decay,
    Isa isa) {
  if (n == 0 || !lion_apply_dtypes_supported(param_dtype, delta_dtype)) {
    return;
  }
  detail::lion_kernels_for(isa).apply_dense(param_dtype, x, delta_dtype, delta, n, lr, decay);
}

double lion_level_abs_sum(
    DType grad_dtype,
    const void* g,
    DType momentum_dtype,
    const void* m,
    size_t n,
    float b1,
    float omb1,
    Isa isa) {
  if (n == 0 || !lion_direction_dtypes_supported(grad_dtype, momentum_dtype)) {
    return 0.0;
  }
  const detail::LionCoefs k{b1, omb1, 0.0f, 0.0f};
  return detail::lion_kernels_for(isa).level_abs_sum(grad_dtype, g, momentum_dtype, m, n, k);
}

uint64_t lion_pack_levels(
    DType grad_dtype,
    const void* g,
    DType momentum_dtype,
    void* m,
    size_t n,
    float b1,
    float omb1,
    float b2,
    float omb2,
    bool update_momentum,
    double factor,
    const LevelPlanes& out,
    Isa isa) {
  if (n == 0 || !lion_direction_dtypes_supported(grad_dtype, momentum_dtype)) {
    return 0;
  }
  const detail::LionCoefs k{b1, omb1, b2, omb2};
  return detail::lion_kernels_for(isa).pack_levels(
      grad_dtype, g, momentum_dtype, m, n, k, update_momentum, factor, out);
}

} // namespace lionbit::optim
