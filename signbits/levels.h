// The p-bit values of Lion Cub's L1 aggregation (Ishikawa et al. 2024), as
// bit-planes: each rank's pre-sign update c, scaled by its tensor's mean
// |c|, is rounded to one of 2s + 1 levels q in [-s, s], s = 2^(p-1) - 1, and
// travels as u = q + s in [0, 2s] (p bits): bit b of u in plane b. The owner
// of a shard sums the N ranks' values exactly and keeps the sign of the sum.
// No torch here.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "signbits/isa.h"

namespace lionbit::bits {

constexpr int kMinLevelBits = 2;
constexpr int kMaxLevelBits = 8;
// The most ranks vote_levels sums (its bit-sliced accumulator's width).
constexpr int kMaxLevelRanks = 1 << 20;

// s: the largest |q| at p bits.
inline int level_span(int p) {
  return (1 << (p - 1)) - 1;
}

// u = q + s of one value c: q = clamp(rint(c * factor), -s, s), rint
// rounding half to even, the product in float64; a NaN product (a NaN
// factor) gives q = 0. A non-finite c gives q = 0 (NaN) or +-s (+-Inf)
// whatever the factor, and is counted in `bad`. Every copy of the level
// kernels computes exactly this, element by element.
inline unsigned level_value(float c, double factor, int s, uint64_t& bad) {
  if (!std::isfinite(c)) {
    ++bad;
    return static_cast<unsigned>(std::isnan(c) ? s : (c > 0 ? 2 * s : 0));
  }
  double x = std::nearbyint(static_cast<double>(c) * factor);
  if (!(x == x)) {
    x = 0;
  }
  x = std::min(std::max(x, -static_cast<double>(s)), static_cast<double>(s));
  return static_cast<unsigned>(static_cast<int>(x) + s);
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
    size_t bit_offset,
    Isa isa = default_isa());

// The vote of n ranks' p-bit values over `words` words: rank i's plane b at
// in[i] + b * words. out_sign bit set where sum(q) > 0, out_tie bit set where
// sum(q) == 0 (the tie rule, signbits/ties.h, decides those). n in
// [1, kMaxLevelRanks]. The sum is exact: bit-sliced counters of
// bit_width(n * 2s) planes, 8 words side by side (AVX-512 / AVX2 / scalar
// copies, kernels_impl.h).
void vote_levels(
    const uint64_t* const* in,
    int n,
    int p,
    size_t words,
    uint64_t* out_sign,
    uint64_t* out_tie,
    Isa isa = default_isa());

} // namespace lionbit::bits
