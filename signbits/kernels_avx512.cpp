// The bit kernels built for the avx512 instruction set (see kernels_impl.h).
#define LIONBIT_KERNELS_NS avx512
#include "kernels_impl.h"

namespace lionbit::bits::detail {
const Kernels& kernels_avx512() {
  return avx512::table();
}
} // namespace lionbit::bits::detail
