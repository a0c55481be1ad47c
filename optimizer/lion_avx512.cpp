// The Lion kernels built for the avx512 instruction set (see lion_impl.h).
// Compiled with the avx512 flags of cmake/isa.cmake: what
// bits::isa_supported(Isa::kAvx512) checks.
#if !defined(__AVX512F__)
#error "lion_avx512.cpp needs -mavx512f (see cmake/isa.cmake)"
#endif
#define LIONBIT_OPTIM_NS avx512
#define LIONBIT_OPTIM_ISA kAvx512
#include "optimizer/lion_impl.h"

namespace lionbit::optim::detail {
const LionKernels& lion_kernels_avx512() {
  return avx512::table();
}
} // namespace lionbit::optim::detail
