#include "signbits/ties.h"

namespace lionbit::bits {

const char* tie_break_name(TieBreak t) {
  switch (t) {
    case TieBreak::kZero:
      return "zero";
    case TieBreak::kAlternate:
      return "alternate";
    case TieBreak::kRandom:
      return "random";
  }
  return "unknown";
}

void all_zero(const Contribution* in, int n, size_t words, uint64_t* out) {
  for (size_t w = 0; w < words; ++w) {
    out[w] = n > 0 ? ~uint64_t{0} : 0;
  }
  for (int i = 0; i < n; ++i) {
    const uint64_t* z = in[i].zero;
    for (size_t w = 0; w < words; ++w) {
      out[w] &= z == nullptr ? 0 : z[w];
    }
  }
}

void all_zero_levels(const uint64_t* const* in, int n, int p, size_t words, uint64_t* out) {
  for (size_t w = 0; w < words; ++w) {
    out[w] = n > 0 ? ~uint64_t{0} : 0;
  }
  for (int i = 0; i < n; ++i) {
    for (int b = 0; b < p; ++b) {
      const uint64_t* plane = in[i] + static_cast<size_t>(b) * words;
      const bool set = b < p - 1; // u = s = 2^(p-1) - 1
      for (size_t w = 0; w < words; ++w) {
        out[w] &= set ? plane[w] : ~plane[w];
      }
    }
  }
}

void break_ties(
    uint64_t* sign,
    const uint64_t* tie,
    const uint64_t* still,
    size_t words,
    const TieRule& rule,
    uint64_t first_word) {
  if (rule.mode == TieBreak::kZero) {
    return;
  }
  for (size_t w = 0; w < words; ++w) {
    const uint64_t t = tie[w] & ~still[w];
    if (t != 0) {
      sign[w] |= t & tie_word(rule, first_word + w);
    }
  }
}

} // namespace lionbit::bits
