// pack_levels and vote_levels (signbits/levels.h) against naive references
// written from the contract: q = clamp(rint(c * factor), -s, s), u = q + s,
// bit b of u in plane b; the vote is the sign of sum(q), the tie where it is 0.
#include "signbits/levels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace lionbit::bits {
namespace {

int naive_q(float c, double factor, int s) {
  if (std::isnan(c)) {
    return 0;
  }
  if (std::isinf(c)) {
    return c > 0 ? s : -s;
  }
  const double x = std::nearbyint(static_cast<double>(c) * factor);
  return static_cast<int>(std::min<double>(std::max<double>(x, -s), s));
}

int level_at(const std::vector<uint64_t>& planes, size_t plane_words, int p, size_t pos) {
  int u = 0;
  for (int b = 0; b < p; ++b) {
    u |= static_cast<int>((planes[b * plane_words + pos / 64] >> (pos % 64)) & 1) << b;
  }
  return u;
}

TEST(Levels, PackMatchesTheContractAtEveryOffsetAndWidth) {
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int p = kMinLevelBits; p <= kMaxLevelBits; ++p) {
    const int s = level_span(p);
    for (size_t n : {0, 1, 7, 63, 64, 65, 130, 1000}) {
      for (size_t offset : {0, 1, 63, 64, 100}) {
        std::vector<float> c(n);
        for (auto& v : c) {
          v = normal(rng);
        }
        if (n > 5) { // exact halves, round to even; specials
          c[0] = 0.5f;
          c[1] = 1.5f;
          c[2] = -2.5f;
          c[3] = std::numeric_limits<float>::infinity();
          c[4] = std::numeric_limits<float>::quiet_NaN();
        }
        const double factor = n > 5 ? 1.0 : 0.7;
        const size_t plane_words = (offset + n + 63) / 64 + 1;
        std::vector<uint64_t> planes(plane_words * static_cast<size_t>(p), 0);
        // Bits before the offset are someone else's: they must survive.
        if (offset > 0) {
          for (int b = 0; b < p; ++b) {
            planes[b * plane_words] |= 1; // element 0 of each plane set
          }
        }
        const uint64_t bad = pack_levels(
            c.data(), n, factor, p, planes.data(), plane_words, offset);
        EXPECT_EQ(bad, n > 5 ? 2u : 0u);
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(level_at(planes, plane_words, p, offset + i), naive_q(c[i], factor, s) + s)
              << "p=" << p << " n=" << n << " offset=" << offset << " i=" << i;
        }
        if (offset > 0) {
          EXPECT_EQ(level_at(planes, plane_words, p, 0), (1 << p) - 1);
        }
        for (size_t pos = offset + n; pos < plane_words * 64; ++pos) {
          ASSERT_EQ(level_at(planes, plane_words, p, pos), 0) << pos;
        }
      }
    }
  }
}

TEST(Levels, RoundsHalfToEvenAndClips) {
  const int p = 3, s = level_span(p); // s = 3
  std::vector<float> c = {0.5f, 1.5f, 2.5f, -0.5f, -1.5f, 3.49f, 100.f, -100.f};
  std::vector<uint64_t> planes(p, 0);
  pack_levels(c.data(), c.size(), 1.0, p, planes.data(), 1, 0);
  const int want[] = {0, 2, 2, 0, -2, 3, 3, -3};
  for (size_t i = 0; i < c.size(); ++i) {
    EXPECT_EQ(level_at(planes, 1, p, i) - s, want[i]) << i;
  }
}

TEST(Levels, VoteIsTheSignOfTheExactSum) {
  std::mt19937_64 rng(2);
  for (int p = kMinLevelBits; p <= kMaxLevelBits; ++p) {
    const int s = level_span(p);
    for (int n : {1, 2, 3, 4, 5, 8, 16, 33, 64}) {
      const size_t words = 3;
      std::vector<std::vector<uint64_t>> ranks(static_cast<size_t>(n));
      std::vector<std::vector<int>> q(static_cast<size_t>(n), std::vector<int>(words * 64));
      std::vector<const uint64_t*> in;
      for (int i = 0; i < n; ++i) {
        auto& planes = ranks[static_cast<size_t>(i)];
        planes.assign(words * static_cast<size_t>(p), 0);
        for (size_t e = 0; e < words * 64; ++e) {
          // Mostly small values, so that ties happen at every n.
          const int v = rng() % 4 == 0 ? static_cast<int>(rng() % (2 * s + 1)) - s
                                       : static_cast<int>(rng() % 3) - 1;
          q[static_cast<size_t>(i)][e] = v;
          const int u = v + s;
          for (int b = 0; b < p; ++b) {
            planes[b * words + e / 64] |= static_cast<uint64_t>((u >> b) & 1) << (e % 64);
          }
        }
        in.push_back(planes.data());
      }
      std::vector<uint64_t> sign(words), tie(words);
      vote_levels(in.data(), n, p, words, sign.data(), tie.data());
      int ties = 0;
      for (size_t e = 0; e < words * 64; ++e) {
        int sum = 0;
        for (int i = 0; i < n; ++i) {
          sum += q[static_cast<size_t>(i)][e];
        }
        ties += sum == 0;
        ASSERT_EQ((sign[e / 64] >> (e % 64)) & 1, sum > 0 ? 1u : 0u) << "p=" << p << " n=" << n;
        ASSERT_EQ((tie[e / 64] >> (e % 64)) & 1, sum == 0 ? 1u : 0u) << "p=" << p << " n=" << n;
      }
      if (n % 2 == 0 && n <= 8) {
        EXPECT_GT(ties, 0) << "the test must exercise ties";
      }
    }
  }
}

TEST(Levels, ExtremesDoNotOverflowTheAccumulator) {
  const int p = kMaxLevelBits, s = level_span(p), n = 1000;
  std::vector<uint64_t> all_max(p, 0), all_min(p, 0);
  for (int b = 0; b < p; ++b) {
    all_max[b] = ((2 * s) >> b) & 1 ? ~0ull : 0; // u = 2s: q = +s
  }
  std::vector<const uint64_t*> in(n, all_max.data());
  in[0] = all_min.data(); // q = -s once: the sum is (n - 2) * s > 0
  uint64_t sign = 0, tie = 0;
  vote_levels(in.data(), n, p, 1, &sign, &tie);
  EXPECT_EQ(sign, ~0ull);
  EXPECT_EQ(tie, 0u);
}

} // namespace
} // namespace lionbit::bits
