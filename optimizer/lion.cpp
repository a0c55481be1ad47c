#include "optimizer/lion.h"

#include <algorithm>
#include <cstring>

#include "optimizer/lion_kernels.h"
#include "signbits/copy_bits.h"
#include "signbits/unpack.h"

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

bits::PackCounts lion_direction_to(
    DType grad_dtype,
    const void* g,
    DType momentum_dtype,
    const void* m,
    void* m_out,
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
      grad_dtype, g, momentum_dtype, m, m_out, n, k, sign, zero);
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
  return lion_direction_to(
      grad_dtype, g, momentum_dtype, m, m, n, b1, omb1, b2, omb2, sign, zero, isa);
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
  // No m_out: m is only read.
  return lion_direction_to(
      grad_dtype, g, momentum_dtype, m, nullptr, n, b1, omb1, 0.0f, 0.0f, sign, zero, isa);
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

void lion_apply_planes(
    DType param_dtype,
    void* x,
    const uint64_t* sign,
    const uint64_t* zero,
    uint64_t bit_offset,
    size_t n,
    float lr,
    float decay,
    Isa isa) {
  if (n == 0 || !lion_param_dtype_supported(param_dtype)) {
    return;
  }
  // Blocks of Delta unpacked into a float32 buffer that stays in L1, then
  // the dense apply over it: the values the bf16 Delta of the unpack would
  // widen to, so the same bits of x, without Delta's trip through memory.
  constexpr size_t kBlock = 2048;
  constexpr size_t kBlockWords = kBlock / bits::kWordBits;
  static constexpr float kLut[4] = {-1.0f, 1.0f, 0.0f, 0.0f}; // code = sign + 2 * zero
  alignas(64) uint64_t aligned[2][kBlockWords];
  bool aligned_zeroed = false;
  alignas(64) float delta[kBlock];
  const detail::LionKernels& kernels = detail::lion_kernels_for(isa);
  const size_t esize = param_dtype == DType::kFloat32 ? 4 : 2;
  for (size_t i = 0; i < n; i += kBlock) {
    const size_t len = std::min(kBlock, n - i);
    const uint64_t bit = bit_offset + i;
    const uint64_t* planes[2];
    if (bit % bits::kWordBits == 0) {
      planes[0] = sign + bit / bits::kWordBits;
      planes[1] = zero + bit / bits::kWordBits;
    } else {
      if (!aligned_zeroed) {
        // copy_bits blends bits into a word as ((v ^ w) & mask) ^ w (GCC's
        // form), which valgrind's memcheck reads as using every bit of w:
        // zeroed once, make test-valgrind stays clean.
        std::memset(aligned, 0, sizeof(aligned));
        aligned_zeroed = true;
      }
      bits::copy_bits(aligned[0], 0, sign, bit, len);
      bits::copy_bits(aligned[1], 0, zero, bit, len);
      planes[0] = aligned[0];
      planes[1] = aligned[1];
    }
    bits::unpack(DType::kFloat32, planes, 2, len, kLut, delta, isa);
    kernels.apply_dense(
        param_dtype, static_cast<char*>(x) + i * esize, DType::kFloat32, delta, len, lr, decay);
  }
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
