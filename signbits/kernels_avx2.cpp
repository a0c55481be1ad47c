// The bit kernels built for the avx2 instruction set (see kernels_impl.h).
#define LIONBIT_KERNELS_NS avx2
#include "kernels_impl.h"

namespace lionbit::bits::detail {
const Kernels& kernels_avx2() {
  return avx2::table();
}
} // namespace lionbit::bits::detail
