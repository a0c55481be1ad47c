// The tie rules (signbits/ties.h).
#include "signbits/ties.h"

#include <gtest/gtest.h>

#include <bit>
#include <vector>

namespace lionbit::bits {
namespace {

TEST(Ties, ZeroLeavesTheVoteAlone) {
  std::vector<uint64_t> sign = {0x0f}, tie = {0xf0}, still = {0};
  break_ties(sign.data(), tie.data(), still.data(), 1, TieRule{TieBreak::kZero, 3}, 0);
  EXPECT_EQ(sign[0], 0x0fu);
}

TEST(Ties, AlternateIsPlusOnEvenSeedsMinusOnOdd) {
  for (uint64_t seed : {0, 1, 2, 7, 1000}) {
    std::vector<uint64_t> sign = {0x0f, 0}, tie = {0xf0, ~0ull}, still = {0, 0};
    break_ties(sign.data(), tie.data(), still.data(), 2, TieRule{TieBreak::kAlternate, seed}, 5);
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
  std::vector<uint64_t> tie(words, ~0ull), none(words, 0), s1(words, 0), s2(words, 0), s3(words, 0);
  break_ties(s1.data(), tie.data(), none.data(), words, a, 0);
  break_ties(s2.data(), tie.data(), none.data(), words, b, 0);
  // The same words reached from another starting position: the same signs.
  break_ties(s3.data() + 100, tie.data(), none.data(), words - 100, a, 100);
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
  break_ties(sign.data(), notie.data(), notie.data(), 1, a, 0);
  EXPECT_EQ(sign[0], 0xffu);
}

TEST(Ties, StillElementsStayZeroUnderEveryRule) {
  // Word 0: ties at bits 0..7, of which bits 2 and 5 are still (every rank
  // voted 0). Under every rule the still bits keep sign 0; the other ties
  // follow the rule.
  for (const TieRule rule :
       {TieRule{TieBreak::kAlternate, 0}, TieRule{TieBreak::kAlternate, 1},
        TieRule{TieBreak::kRandom, 5}, TieRule{TieBreak::kZero, 0}}) {
    std::vector<uint64_t> sign = {0xff00}, tie = {0xff}, still = {0x24};
    break_ties(sign.data(), tie.data(), still.data(), 1, rule, 7);
    EXPECT_EQ(sign[0] & 0x24u, 0u) << tie_break_name(rule.mode);
    EXPECT_EQ(sign[0] & 0xff00u, 0xff00u);
    const uint64_t broken = rule.mode == TieBreak::kZero ? 0 : (0xdbu & tie_word(rule, 7));
    EXPECT_EQ(sign[0] & 0xffu, broken) << tie_break_name(rule.mode);
    EXPECT_EQ(tie[0], 0xffu);
    EXPECT_EQ(still[0], 0x24u);
  }
}

// A small deterministic generator for the references below.
struct Lcg {
  uint64_t state;
  uint64_t operator()() {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return state >> 11;
  }
};

// The reference: element by element, every rank's value 0.
TEST(Ties, AllZeroIsTheElementsEveryRankVotedZeroFor) {
  const size_t words = 3;
  Lcg next{12345};
  for (int n : {1, 2, 3, 7}) {
    for (bool one_without_zeros : {false, true}) {
      std::vector<std::vector<uint64_t>> sign(n, std::vector<uint64_t>(words, 0));
      std::vector<std::vector<uint64_t>> zero(n, std::vector<uint64_t>(words, 0));
      std::vector<bool> expected(words * 64);
      for (size_t e = 0; e < words * 64; ++e) {
        const bool still = next() % 2 == 0;
        bool all = true;
        for (int r = 0; r < n; ++r) {
          const bool z = still || next() % 3 == 0;
          const bool no_plane = one_without_zeros && r == n - 1;
          if (z && !no_plane) {
            zero[r][e / 64] |= uint64_t{1} << (e % 64);
          } else if (next() % 2 == 0) {
            sign[r][e / 64] |= uint64_t{1} << (e % 64);
          }
          all = all && z && !no_plane;
        }
        expected[e] = all;
      }
      std::vector<Contribution> in(n);
      for (int r = 0; r < n; ++r) {
        in[r].sign = sign[r].data();
        in[r].zero = one_without_zeros && r == n - 1 ? nullptr : zero[r].data();
      }
      std::vector<uint64_t> out(words, 0xabcdu);
      all_zero(in.data(), n, words, out.data());
      for (size_t e = 0; e < words * 64; ++e) {
        ASSERT_EQ(((out[e / 64] >> (e % 64)) & 1u) != 0, expected[e]) << "n=" << n << " e=" << e;
      }
    }
  }
}

TEST(Ties, AllZeroLevelsIsLevelZeroOnEveryRank) {
  const size_t words = 2;
  Lcg next{777};
  for (int p : {2, 3, 4, 8}) {
    const uint64_t s = (uint64_t{1} << (p - 1)) - 1;
    for (int n : {1, 2, 5}) {
      // rank r's planes: [plane 0 | plane 1 | ...], words each
      std::vector<std::vector<uint64_t>> planes(n, std::vector<uint64_t>(p * words, 0));
      std::vector<bool> expected(words * 64);
      for (size_t e = 0; e < words * 64; ++e) {
        const bool still = next() % 2 == 0;
        bool all = true;
        for (int r = 0; r < n; ++r) {
          const uint64_t u = still ? s : next() % (2 * s + 1); // q = u - s
          for (int b = 0; b < p; ++b) {
            if ((u >> b) & 1u) {
              planes[r][b * words + e / 64] |= uint64_t{1} << (e % 64);
            }
          }
          all = all && u == s;
        }
        expected[e] = all;
      }
      std::vector<const uint64_t*> in(n);
      for (int r = 0; r < n; ++r) {
        in[r] = planes[r].data();
      }
      std::vector<uint64_t> out(words, 0);
      all_zero_levels(in.data(), n, p, words, out.data());
      for (size_t e = 0; e < words * 64; ++e) {
        ASSERT_EQ(((out[e / 64] >> (e % 64)) & 1u) != 0, expected[e])
            << "p=" << p << " n=" << n << " e=" << e;
      }
    }
  }
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
