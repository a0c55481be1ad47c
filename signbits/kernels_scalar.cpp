// The bit kernels built for the scalar instruction set (see kernels_impl.h).
#define LIONBIT_KERNELS_NS scalar
#include "kernels_impl.h"

namespace lionbit::bits::detail {
const Kernels& kernels_scalar() {
  return scalar::table();
}
} // namespace lionbit::bits::detail
