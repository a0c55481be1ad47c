// The tie rule of a vote: what the result is where the ranks' sum is 0 (an
// even split, or every rank 0). "zero" keeps 0 (Distributed Lion's sign(0))
// and needs a second bit; the other two answer +1 or -1, so the result is
// exactly one bit per element (Lion Cub, Ishikawa et al. 2024):
//   alternate  +1 where the seed (the step) is even, -1 where it is odd;
//   random     a pseudo-random sign per element, a function of the seed and
//              the element's position in the call's tensor only (not of the
//              world size or the sharding): unbiased per element.
// Only the shard's owner applies the rule, so every rank gets the same bits.
// __host__ __device__ (LIONBIT_HD): the CPU and GPU paths share it. No torch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "signbits/float16.h" // LIONBIT_HD

namespace lionbit::bits {

// Values are part of the wire header: never renumber.
enum class TieBreak : uint8_t {
  kZero = 0,
  kAlternate = 1,
  kRandom = 2,
};

struct TieRule {
  TieBreak mode = TieBreak::kZero;
  uint64_t seed = 0;
};

const char* tie_break_name(TieBreak t);

namespace {

// SplitMix64's finalizer: a bijection of 64-bit words whose outputs for
// consecutive inputs pass as independent.
LIONBIT_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The signs the rule gives the 64 elements of word `word` of the call's
// tensor (bit set: +1). kZero: never used (ties stay 0).
LIONBIT_HD uint64_t tie_word(const TieRule& rule, uint64_t word) {
  if (rule.mode == TieBreak::kAlternate) {
    return (rule.seed & 1) == 0 ? ~uint64_t{0} : uint64_t{0};
  }
  return mix64(mix64(rule.seed) + 0x9e3779b97f4a7c15ull * (word + 1));
}

} // namespace

// sign |= tie & tie_word(rule, first_word + w) for the `words` words of a
// vote's result (a tie's sign bit is 0); the tie plane is left as it was.
// first_word: the position of word 0 in the call's tensor (in words).
void break_ties(
    uint64_t* sign,
    const uint64_t* tie,
    size_t words,
    const TieRule& rule,
    uint64_t first_word);

} // namespace lionbit::bits
