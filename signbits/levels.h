// The p-bit values of Lion Cub's L1 aggregation (Ishikawa et al. 2024), as
// bit-planes: each rank's pre-sign update c, scaled by its tensor's mean
// |c|, is rounded to one of 2s + 1 levels q in [-s, s], s = 2^(p-1) - 1, and
// travels as u = q + s in [0, 2s] (p bits): bit b of u in plane b. The owner
// of a shard sums the N ranks' values exactly and keeps the sign of the sum.
// No torch here.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lionbit::bits {

constexpr int kMinLevelBits = 2;
constexpr int kMaxLevelBits = 8;
// The most ranks vote_levels sums (its bit-sliced accumulator's width).
constexpr int kMaxLevelRanks = 1 << 20;

// s: the largest |q| at p bits.
inline int level_span(int p) {
  return (1 << (p - 1)) - 1;
}

// Quantizes c[0..n): q = clamp(rint(c * factor), -s, s), rint rounding half
// to even, the product in float64; ORs bit b of q + s into bit
// bit_offset + i of plane b, which starts at planes + b * plane_words (bit i
// of a plane is bit i % 64 of word i / 64). Other bits are left as they
// are, so several tensors (each with its own factor) pack end to end.
// A non-finite c gives q = 0 (NaN) or +-s (+-Inf) and is counted: returns
// the number of non-finite values. p in [kMinLevelBits, kMaxLevelBits].
uint64_t pack_levels(
    const float* c,
    size_t n,
    double factor,
    int p,
    uint64_t* planes,
    size_t plane_words,
    size_t bit_offset);

// The vote of n ranks' p-bit values over `words` words: rank i's plane b at
// in[i] + b * words. out_sign bit set where sum(q) > 0, out_tie bit set where
// sum(q) == 0 (the tie rule, signbits/ties.h, decides those). n in
// [1, kMaxLevelRanks].
void vote_levels(
    const uint64_t* const* in,
    int n,
    int p,
    size_t words,
    uint64_t* out_sign,
    uint64_t* out_tie);

} // namespace lionbit::bits
