// Encoding of a zero plane (or tie plane) on the wire: a sorted list of
// 32-bit offsets when the plane is sparse, the dense plane otherwise.
//
// Every sender announces a capacity K (the most set bits in any plane it will
// send) before the data moves, so every receiver knows each message's size:
//   K == 0             -> 0 bytes (no plane at all)
//   list smaller       -> K uint32 offsets, ascending, padded with kNoIndex to
//                         an even count (a whole number of 64-bit words)
//   otherwise          -> the dense plane
// A rank with one stray zero thus sends 8 bytes (the offset and its padding),
// not a second plane.
#pragma once

#include "types.h"

namespace lionbit::bits {

constexpr uint32_t kNoIndex = 0xffffffffu;

// Number of set bits in words[0..n_words).
uint64_t count_bits(const uint64_t* words, size_t n_words);

// Whether a plane of `words` words with capacity K is sent as a list.
bool zeros_as_list(uint64_t capacity, size_t words);

// Bytes on the wire for a plane of `words` words with capacity K.
size_t zero_encoding_bytes(uint64_t capacity, size_t words);

// Writes zero_encoding_bytes(capacity, words) bytes. The plane must have at
// most `capacity` bits set.
void encode_zeros(const uint64_t* plane, size_t words, uint64_t capacity, uint8_t* out);

// Reads what encode_zeros wrote into a plane of `words` words. Returns false
// (plane unspecified) if an offset is out of range, out of order or more than
// the capacity: a corrupt message.
bool decode_zeros(const uint8_t* in, size_t words, uint64_t capacity, uint64_t* plane);

} // namespace lionbit::bits
