// The tie rule of a vote: what the result is where the ranks' sum is 0 among
// non-zero votes (an even split). "zero" keeps 0 (Distributed Lion's
// sign(0)); the other two answer +1 or -1 (Lion Cub, Ishikawa et al. 2024):
//   alternate  +1 where the seed (the step) is even, -1 where it is odd;
//   random     a pseudo-random sign per element, a function of the seed and
//              the element's position in the call's tensor only (not of the
//              world size or the sharding): unbiased per element.
// An element every rank votes 0 for (a still element: an embedding row no
// rank saw, padding; with levels, level 0 on every rank) is not a tie: its
// result is 0 under every rule, as in the Lion Cub authors' code, so that
// unused rows do not random-walk by +-lr a step. A vote's result is thus a
// sign plane and a plane of zeros (ties under "zero", still elements under
// the others), and phase 2 carries the second plane as it carries ties.
// Only the shard's owner applies the rule, so every rank gets the same bits.
// __host__ __device__ (LIONBIT_HD): the CPU and GPU paths share it. No torch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "signbits/float16.h" // LIONBIT_HD
#include "signbits/types.h"

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

// The elements of `words` words that every one of n contributions votes 0
// for: out = AND of the zero planes (a contribution without a zero plane
// has none, so out is then 0).
void all_zero(const Contribution* in, int n, size_t words, uint64_t* out);

// The same for p-bit levels (levels.h): rank i's plane b at in[i] + b *
// words; out bit set where every rank sends level 0 (u = s: bit p - 1
// clear, bits 0..p-2 set).
void all_zero_levels(const uint64_t* const* in, int n, int p, size_t words, uint64_t* out);

// sign |= tie & ~still & tie_word(rule, first_word + w) for the `words`
// words of a vote's result (a tie's sign bit is 0; still: all_zero's plane,
// a subset of tie); the tie and still planes are left as they are. After
// it, `still` is the result's plane of zeros. first_word: the position of
// word 0 in the call's tensor (in words). kZero: nothing to do.
void break_ties(
    uint64_t* sign,
    const uint64_t* tie,
    const uint64_t* still,
    size_t words,
    const TieRule& rule,
    uint64_t first_word);

} // namespace lionbit::bits
