#include "pack.h"

#include "kernels.h"

namespace lionbit::bits {

PackCounts pack_signs(
    DType dtype,
    const void* src,
    size_t n,
    uint64_t* sign,
    uint64_t* zero,
    Isa isa) {
  if (n == 0) {
    return {};
  }
  return detail::kernels_for(isa).pack(dtype, src, n, sign, zero);
}

} // namespace lionbit::bits
