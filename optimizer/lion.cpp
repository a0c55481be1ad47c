#include "optimizer/lion.h"

#include <vector>

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
  return is_float_storage(grad) &&
      (momentum == DType::kFloat32 || momentum == DType::kBFloat16);
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
  if (isa >= Isa::kAvx512 && bits::isa_supported(Isa::kAvx512)) {
    return lion_kernels_avx512();
  }
  if (isa >= Isa::kAvx2 && bits::isa_supported(Isa::kAvx2) &&
      __builtin_cpu_supports("f16c") != 0) {
    return lion_kernels_avx2();
  }
#endif
  (void)isa;
  return lion_kernels_scalar();
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
  detail::lion_kernels_for(isa).apply_dense(
      param_dtype, x, delta_dtype, delta, n, lr, decay);
}

void lion_apply_planes(
    DType param_dtype,
    void* x,
    size_t n,
    const uint64_t* const* planes,
    int nplanes,
    const float* lut,
    float lr,
    float decay,
    Isa isa) {
  if (n == 0 || !lion_param_dtype_supported(param_dtype) || nplanes < 0 ||
      nplanes > kLionMaxPlanes) {
    return;
  }
  // step[c] = fl(lr * lut[c]): the product every element with code c uses,
  // rounded once, as in fl(fl(x * decay) - fl(lr * Delta)).
  const size_t entries = size_t{1} << nplanes;
  float local[detail::kMinStepTable] = {};
  std::vector<float> heap;
  float* step = local;
  if (entries > static_cast<size_t>(detail::kMinStepTable)) {
    heap.resize(entries);
    step = heap.data();
  }
  for (size_t c = 0; c < entries; ++c) {
    step[c] = lr * lut[c];
  }
  detail::lion_kernels_for(isa).apply_planes(
      param_dtype, x, n, planes, nplanes, step, decay);
}

} // namespace lionbit::optim
