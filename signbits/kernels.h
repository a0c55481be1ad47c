// Internal: one table of kernels per instruction set. kernels_impl.h is
// compiled once per ISA (kernels_scalar.cpp, kernels_avx2.cpp,
// kernels_avx512.cpp) with that ISA's compiler flags; pack.cpp, count.cpp,
// unpack.cpp and levels.cpp pick a table at run time.
#pragma once

#include "pack.h"

namespace lionbit::bits::detail {

struct Kernels {
  PackCounts (*pack)(DType dtype, const void* src, size_t n, uint64_t* sign, uint64_t* zero);
  void (*count_code)(const Contribution* in, int n, size_t words, uint64_t* out);
  bool (*vote)(const Contribution* in, int n, size_t words, uint64_t* out_sign, uint64_t* out_zero);
  void (*unpack)(
      size_t elem_size,
      const uint64_t* const* planes,
      int nplanes,
      size_t n,
      const void* lut,
      void* dst);
  uint64_t (*pack_levels)(
      const float* c,
      size_t n,
      double factor,
      int p,
      uint64_t* planes,
      size_t plane_words,
      size_t bit_offset);
  void (*vote_levels)(
      const uint64_t* const* in,
      int n,
      int p,
      size_t words,
      uint64_t* out_sign,
      uint64_t* out_tie);
  uint64_t (*count_bits)(const uint64_t* words, size_t n_words);
  uint64_t (*count_runs)(const uint64_t* words, size_t n_words);
};

const Kernels& kernels_scalar();
#ifdef LIONBIT_HAVE_X86_KERNELS
const Kernels& kernels_avx2();
const Kernels& kernels_avx512();
#endif

// The table for `isa`, falling back to the best supported one below it.
const Kernels& kernels_for(Isa isa);

} // namespace lionbit::bits::detail
