// Run-time choice of the instruction set used by the bit kernels.
#pragma once

#include "types.h"

namespace lionbit::bits {

const char* isa_name(Isa isa);

// True when this build holds kernels for `isa` and this CPU can run them.
bool isa_supported(Isa isa);

// The ISA the kernels use by default: the best one supported, or the one named
// by the environment variable LIONBIT_ISA ("scalar", "avx2", "avx512") when
// that is supported (a request for an unsupported one falls back to the best).
Isa default_isa();

} // namespace lionbit::bits
