// The Lion kernels built for the scalar instruction set (see lion_impl.h).
#define LIONBIT_OPTIM_NS scalar
#define LIONBIT_OPTIM_ISA kScalar
#include "optimizer/lion_impl.h"

namespace lionbit::optim::detail {
const LionKernels& lion_kernels_scalar() {
  return scalar::table();
}
} // namespace lionbit::optim::detail
