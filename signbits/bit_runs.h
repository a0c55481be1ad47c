// Walking the runs of set bits in a plane (bit 0 of word 0 first), shared by
// the zero encodings (zeros.cpp, packed_runs.cpp). No torch here.
#pragma once

#include "types.h"

namespace lionbit::bits {

// Index of the first bit at or after `from` that is set (`set`) or clear;
// the plane's size in bits when there is none.
inline uint64_t next_bit(const uint64_t* plane, size_t words, uint64_t from, bool set) {
  const uint64_t limit = static_cast<uint64_t>(words) * kWordBits;
  while (from < limit) {
    const size_t w = from / kWordBits;
    uint64_t x = set ? plane[w] : ~plane[w];
    x &= ~uint64_t{0} << (from % kWordBits);
    if (x != 0) {
      return w * kWordBits + static_cast<uint64_t>(__builtin_ctzll(x));
    }
    from = (w + 1) * kWordBits;
  }
  return limit;
}

// Sets bits [first, end) of a plane.
inline void set_bit_range(uint64_t* plane, uint64_t first, uint64_t end) {
  while (first < end) {
    const size_t w = first / kWordBits;
    const unsigned lo = static_cast<unsigned>(first % kWordBits);
    const uint64_t n = end - first < kWordBits - lo ? end - first : kWordBits - lo;
    const uint64_t mask = n == kWordBits ? ~uint64_t{0} : ((uint64_t{1} << n) - 1) << lo;
    plane[w] |= mask;
    first += n;
  }
}

} // namespace lionbit::bits
