// A vote's result with ties, base 3: an element is -1, +1 or 0 (a tie), and
// 5 of them fit in a byte (3^5 = 243 <= 256). A 64-element word of results
// takes 13 bytes (1.625 bits per element) instead of a sign plane and a tie
// plane (2 bits). Phase 2 of a vote whose ties are dense sends this form
// (wire version 5): 19 % fewer bytes than the two planes, decoded with one
// table lookup per byte. No torch here.
#pragma once

#include <cstddef>
#include <cstdint>

#include "types.h"

namespace lionbit::bits {

constexpr size_t kTritBytesPerWord = 13; // ceil(64 / 5)

// Byte b of word w holds elements 64 w + 5 b ... 64 w + 5 b + 4 (the 13th
// byte: elements 60..63 and one unused trit) as sum_j trit_j * 3^j, where
// trit = 0 for -1, 1 for +1, 2 for 0 (a tie). `sign` and `tie` are planes of
// `words` words (tie bit set: the result is 0, whatever the sign bit);
// `out` gets words * 13 bytes.
void encode_trits(const uint64_t* sign, const uint64_t* tie, size_t words, uint8_t* out);

// The inverse, as values: dst[i] = lut[trit_i] for i < n, where lut holds 3
// entries of `dtype` (for trit 0, 1, 2) and `trits` words_for(n) * 13 bytes.
// Returns false (dst partly written) if a byte is not a valid code (>= 243):
// a corrupt message.
bool decode_trits(DType dtype, const uint8_t* trits, size_t n, const void* lut, void* dst);

} // namespace lionbit::bits
