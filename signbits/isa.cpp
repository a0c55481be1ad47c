#include "isa.h"

#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "kernels.h"

namespace lionbit::bits {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat64:
      return 8;
    case DType::kInt8:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat64:
      return "float64";
    case DType::kInt8:
      return "int8";
  }
  return "unknown";
}

bool dtype_is_floating(DType t) {
  return t != DType::kInt8;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return true;
#ifdef LIONBIT_HAVE_X86_KERNELS
    // The features of cmake/isa.cmake's flags for each ISA.
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("f16c") != 0 &&
          __builtin_cpu_supports("bmi") != 0 && __builtin_cpu_supports("bmi2") != 0 &&
          __builtin_cpu_supports("popcnt") != 0;
    case Isa::kAvx512:
      return isa_supported(Isa::kAvx2) && __builtin_cpu_supports("avx512f") != 0 &&
          __builtin_cpu_supports("avx512bw") != 0 && __builtin_cpu_supports("avx512vl") != 0 &&
          __builtin_cpu_supports("avx512dq") != 0;
#else
    default:
      return false;
#endif
  }
  return false;
}

namespace {
Isa pick_default() {
  Isa best = Isa::kScalar;
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512}) {
    if (isa_supported(isa)) {
      best = isa;
    }
  }
  const char* env = std::getenv("LIONBIT_ISA");
  if (env != nullptr) {
    for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
      if (std::strcmp(env, isa_name(isa)) == 0 && isa_supported(isa)) {
        return isa;
      }
    }
  }
  return best;
}
} // namespace

Isa default_isa() {
  static const Isa isa = pick_default();
  return isa;
}

namespace detail {
const Kernels& kernels_for(Isa isa) {
#ifdef LIONBIT_HAVE_X86_KERNELS
  static constexpr PerIsa<Kernels> copies{kernels_scalar, kernels_avx2, kernels_avx512};
#else
  static constexpr PerIsa<Kernels> copies{kernels_scalar};
#endif
  return pick_kernels(isa, copies);
}
} // namespace detail

} // namespace lionbit::bits
