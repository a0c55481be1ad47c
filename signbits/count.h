// Count N ranks' packed signs per element with bit-sliced counters and form
// the vote or the integer code of the sum.
#pragma once

#include "types.h"
#include "isa.h"

namespace lionbit::bits {

// Planes of the per-element code that count_code() writes.
//  - no contribution has a zero plane: code = #positive, Sum = 2*code - n,
//    bit_width(n) planes;
//  - otherwise: code = 2*#positive + #zero, Sum = code - n, bit_width(2n)
//    planes.
int code_planes(int n, bool with_zeros);

// Bit-sliced code of `words` words of n contributions. out holds
// code_planes(n, with_zeros) planes of `words` words each (plane-major); plane
// b carries bit b of the code. with_zeros is true iff some in[i].zero is set.
void count_code(
    const Contribution* in,
    int n,
    size_t words,
    uint64_t* out,
    Isa isa = default_isa());

// Majority vote: out_sign bit set where Sum > 0, out_zero bit set where
// Sum == 0 (a tie, or all zero). Returns true iff any out_zero bit is set.
bool vote(
    const Contribution* in,
    int n,
    size_t words,
    uint64_t* out_sign,
    uint64_t* out_zero,
    Isa isa = default_isa());

} // namespace lionbit::bits
