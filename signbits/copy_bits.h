// Copy a run of bits between packed planes at any bit offsets: how the
// optimizer lays many parameters' direction bits end to end in one buffer
// (one collective per step) without padding each to a whole word.
#pragma once

#include <algorithm>

#include "types.h"

namespace lionbit::bits {

// dst bits [dst_bit, dst_bit + nbits) = src bits [src_bit, src_bit + nbits).
// Other bits of dst are left as they are. dst and src must not overlap.
void copy_bits(uint64_t* dst, size_t dst_bit, const uint64_t* src, size_t src_bit, size_t nbits);

} // namespace lionbit::bits
