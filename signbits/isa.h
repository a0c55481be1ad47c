// Run-time choice of the instruction set used by the CPU kernels. Each kernel
// family (signbits/kernels_*.cpp, optimizer/lion_*.cpp) compiles its
// implementation once per ISA with the flags of cmake/isa.cmake and picks a
// copy with pick_kernels; isa_supported checks every CPU feature those flags
// assume.
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

// The copies of one kernel family: a table of function pointers per ISA (the
// x86 ones are null in a build without them).
template <typename Table>
struct PerIsa {
  const Table& (*scalar)();
  const Table& (*avx2)() = nullptr;
  const Table& (*avx512)() = nullptr;
};

// The copy for `isa`, falling back to the best supported one below it.
template <typename Table>
const Table& pick_kernels(Isa isa, const PerIsa<Table>& copies) {
  if (isa >= Isa::kAvx512 && copies.avx512 != nullptr && isa_supported(Isa::kAvx512)) {
    return copies.avx512();
  }
  if (isa >= Isa::kAvx2 && copies.avx2 != nullptr && isa_supported(Isa::kAvx2)) {
    return copies.avx2();
  }
  return copies.scalar();
}

} // namespace lionbit::bits
