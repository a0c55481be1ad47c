// Internal: one table of Lion kernels per instruction set. lion_impl.h is
// compiled once per ISA (lion_scalar.cpp, lion_avx2.cpp, lion_avx512.cpp) with
// that ISA's compiler flags; lion.cpp picks a table at run time.
#pragma once

#include "optimizer/lion.h"
#include "optimizer/lion_levels.h"

namespace lionbit::optim::detail {

struct LionCoefs {
  float b1, omb1, b2, omb2;
};

struct LionKernels {
  bits::Isa isa; // the instruction set this table was compiled for
  // The new momentum goes to m_out (m itself: in place; nullptr: m only read).
  bits::PackCounts (*direction)(
      bits::DType grad_dtype,
      const void* g,
      bits::DType momentum_dtype,
      const void* m,
      void* m_out,
      size_t n,
      const LionCoefs& k,
      uint64_t* sign,
      uint64_t* zero);
  void (*apply_dense)(
      bits::DType param_dtype,
      void* x,
      bits::DType delta_dtype,
      const void* delta,
      size_t n,
      float lr,
      float decay);
  double (*level_abs_sum)(
      bits::DType grad_dtype,
      const void* g,
      bits::DType momentum_dtype,
      const void* m,
      size_t n,
      const LionCoefs& k);
  uint64_t (*pack_levels)(
      bits::DType grad_dtype,
      const void* g,
      bits::DType momentum_dtype,
      void* m,
      size_t n,
      const LionCoefs& k,
      bool update_momentum,
      double factor,
      const LevelPlanes& out);
};

const LionKernels& lion_kernels_scalar();
#ifdef LIONBIT_HAVE_X86_KERNELS
const LionKernels& lion_kernels_avx2();
const LionKernels& lion_kernels_avx512();
#endif

// The table for `isa`, falling back to the best supported one below it.
const LionKernels& lion_kernels_for(bits::Isa isa);

} // namespace lionbit::optim::detail
