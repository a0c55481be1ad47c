// Pack the signs of a buffer into bit-planes.
#pragma once

#include "types.h"
#include "isa.h"

namespace lionbit::bits {

struct PackCounts {
  uint64_t zeros = 0; // elements equal to 0 (including -0.0)
  uint64_t nans = 0; // NaN elements (their sign and zero bits are 0)
  // NaN or +-Inf elements; only optim::lion_direction fills it (an infinite
  // gradient or momentum makes a direction that must not be applied).
  uint64_t nonfinite = 0;
};

// Writes words_for(n) words into `sign` (bit i set: src[i] > 0) and `zero`
// (bit i set: src[i] == 0). Bits past n in the last word are 0. The test is
// made on the bit pattern, so denormals are nonzero whatever the FPU's
// flush-to-zero mode, -0.0 is zero and +-Inf are +-1.
PackCounts pack_signs(
    DType dtype,
    const void* src,
    size_t n,
    uint64_t* sign,
    uint64_t* zero,
    Isa isa = default_isa());

} // namespace lionbit::bits
