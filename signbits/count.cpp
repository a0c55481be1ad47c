#include "count.h"

#include "kernels.h"

namespace lionbit::bits {

int code_planes(int n, bool with_zeros) {
  return bit_width(static_cast<uint64_t>(with_zeros ? 2 * n : n));
}

void count_code(const Contribution* in, int n, size_t words, uint64_t* out, Isa isa) {
  detail::kernels_for(isa).count_code(in, n, words, out);
}

bool vote(
    const Contribution* in,
    int n,
    size_t words,
    uint64_t* out_sign,
    uint64_t* out_zero,
    Isa isa) {
  return detail::kernels_for(isa).vote(in, n, words, out_sign, out_zero);
}

} // namespace lionbit::bits
