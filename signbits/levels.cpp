#include "signbits/levels.h"

#include "signbits/kernels.h"

namespace lionbit::bits {

uint64_t pack_levels(
    const float* c,
    size_t n,
    double factor,
    int p,
    uint64_t* planes,
    size_t plane_words,
    size_t bit_offset,
    Isa isa) {
  if (n == 0) {
    return 0;
  }
  return detail::kernels_for(isa).pack_levels(c, n, factor, p, planes, plane_words, bit_offset);
}

void vote_levels(
    const uint64_t* const* in,
    int n,
    int p,
    size_t words,
    uint64_t* out_sign,
    uint64_t* out_tie,
    Isa isa) {
  detail::kernels_for(isa).vote_levels(in, n, p, words, out_sign, out_tie);
}

} // namespace lionbit::bits
