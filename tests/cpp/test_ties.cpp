// The tie rules (signbits/ties.h).
#include "signbits/ties.h"

#include <gtest/gtest.h>

#include <bit>
#include <vector>

namespace lionbit::bits {
namespace {

TEST(Ties, ZeroLeavesTheVoteAlone) {
  std::vector<uint64_t> sign = {0x0f}, tie = {0xf0};
  break_ties(sign.data(), tie.data(), 1, TieRule{TieBreak::kZero, 3}, 0);
  EXPECT_EQ(sign[0], 0x0fu);
}

TEST(Ties, AlternateIsPlusOnEvenSeedsMinusOnOdd) {
  for (uint64_t seed : {0, 1, 2, 7, 1000}) {
    std::vector<uint64_t> sign = {0x0f, 0}, tie = {0xf0, ~0ull};
    break_ties(sign.data(), tie.data(), 2, TieRule{TieBreak::kAlternate, seed}, 5);
    if (seed % 2 == 0) {
      EXPECT_EQ(sign[0], 0xffu);
      EXPECT_EQ(sign[1], ~0ull);
    } else {
      EXPECT_EQ(sign[0], 0x0fu);
      EXPECT_EQ(sign[1], 0u);
    }
    EXPECT_EQ(tie[0], 0xf0u); // the tie plane is not touched
  }
}

TEST(Ties, RandomTouchesOnlyTiesAndDependsOnSeedAndPosition) {
  const TieRule a{TieBreak::kRandom, 11}, b{TieBreak::kRandom, 12};
  const size_t words = 4096;
  std::vector<uint64_t> tie(words, ~0ull), s1(words, 0), s2(words, 0), s3(words, 0);
  break_ties(s1.data(), tie.data(), words, a, 0);
  break_ties(s2.data(), tie.data(), words, b, 0);
  // The same words reached from another starting position: the same signs.
  break_ties(s3.data() + 100, tie.data(), words - 100, a, 100);
  uint64_t ones = 0, differ = 0;
  for (size_t w = 0; w < words; ++w) {
    ones += static_cast<uint64_t>(std::popcount(s1[w]));
    differ += static_cast<uint64_t>(std::popcount(s1[w] ^ s2[w]));
    if (w >= 100) {
      ASSERT_EQ(s1[w], s3[w]) << w;
    }
  }
  // Unbiased: 262,144 fair coins; 6 standard deviations is +-1,536.
  const double total = 64.0 * words;
  EXPECT_NEAR(static_cast<double>(ones), total / 2, 1536);
  EXPECT_NEAR(static_cast<double>(differ), total / 2, 1536);
  // Non-ties keep their sign.
  std::vector<uint64_t> sign = {0xff}, notie = {0};
  break_ties(sign.data(), notie.data(), 1, a, 0);
  EXPECT_EQ(sign[0], 0xffu);
}

TEST(Ties, RandomSignsOfOneElementAcrossSeedsAreBalanced) {
  // Element 5 of word 3 over 20,000 steps: a fair coin per step.
  int plus = 0;
  for (uint64_t step = 0; step < 20000; ++step) {
    plus += static_cast<int>((tie_word(TieRule{TieBreak::kRandom, step}, 3) >> 5) & 1);
  }
  EXPECT_NEAR(plus, 10000, 6 * 71); // sd = sqrt(20000) / 2 ~ 71
}

} // namespace
} // namespace lionbit::bits
