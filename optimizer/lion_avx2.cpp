// The Lion kernels built for the avx2 instruction set (see lion_impl.h).
// Compiled with the avx2 flags of cmake/isa.cmake (no -mfma).
#if !defined(__AVX2__) || !defined(__F16C__)
#error "lion_avx2.cpp needs -mavx2 -mf16c (see cmake/isa.cmake)"
#endif
#define LIONBIT_OPTIM_NS avx2
#define LIONBIT_OPTIM_ISA kAvx2
#include "optimizer/lion_impl.h"

namespace lionbit::optim::detail {
const LionKernels& lion_kernels_avx2() {
  return avx2::table();
}
} // namespace lionbit::optim::detail
