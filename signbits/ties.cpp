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

void break_ties(
    uint64_t* sign,
    const uint64_t* tie,
    size_t words,
    const TieRule& rule,
    uint64_t first_word) {
  if (rule.mode == TieBreak::kZero) {
    return;
  }
  for (size_t w = 0; w < words; ++w) {
    if (tie[w] != 0) {
      sign[w] |= tie[w] & tie_word(rule, first_word + w);
    }
  }
}

} // namespace lionbit::bits
