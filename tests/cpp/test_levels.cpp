// pack_levels and vote_levels (signbits/levels.h) against naive references
// written from the contract: q = clamp(rint(c * factor), -s, s), u = q + s,
// bit b of u in plane b; the vote is the sign of sum(q), the tie where it is 0.
#include "signbits/levels.h"

#include <gtest/gtest.h>

#include "test_util.h"

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

// Values that reach every branch of the quantizer: normal values at a few
// scales, exact halves after scaling (round to even), values beyond the
// clamp, zeros of both signs, denormals, and - when `specials` - a NaN or an
// infinity in some words (those words take the element-by-element path).
std::vector<float> level_inputs(size_t n, double factor, bool specials, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> c(n);
  for (size_t i = 0; i < n; ++i) {
    switch (rng() % 8) {
      case 0: // an exact half of the grid: (k + 0.5) / factor
        c[i] = static_cast<float>(
            (static_cast<double>(rng() % 15) - 7.0 + 0.5) /
            (factor != 0.0 && std::isfinite(factor) ? factor : 1.0));
        break;
      case 1:
        c[i] = 50.f * normal(rng); // mostly clamped
        break;
      case 2:
        c[i] = (rng() & 1) ? 0.f : -0.f;
        break;
      case 3:
        c[i] = std::numeric_limits<float>::denorm_min() * static_cast<float>(rng() % 7);
        break;
      default:
        c[i] = normal(rng);
    }
  }
  if (specials) {
    const float sp[] = {
        std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity()};
    for (size_t i = 37; i < n; i += 389) {
      c[i] = sp[(i / 389) % 3];
    }
  }
  return c;
}

// Every ISA's pack_levels against naive_q for every p, sizes around whole
// words and 8-word blocks, offsets, factors (finite, 0, +-Inf, NaN) and
// non-finite inputs; the bits around the packed range are kept.
TEST(Levels, PackOnEveryIsaMatchesTheContract) {
  std::mt19937_64 rng(7);
  const double factors[] = {
      1.0,
      0.37,
      3.5,
      1e-3,
      0.0,
      std::numeric_limits<double>::infinity(),
      -std::numeric_limits<double>::infinity(),
      std::numeric_limits<double>::quiet_NaN(),
      1e300};
  for (Isa isa : test::supported_isas()) {
    SCOPED_TRACE(isa_name(isa));
    for (int p = kMinLevelBits; p <= kMaxLevelBits; ++p) {
      const int s = level_span(p);
      for (size_t n :
           {size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{128}, size_t{511}, size_t{1000},
            size_t{4113}}) {
        for (size_t offset : {size_t{0}, size_t{1}, size_t{31}, size_t{64}, size_t{127}}) {
          const double factor = factors[rng() % (sizeof factors / sizeof factors[0])];
          const bool specials = rng() % 2 == 0;
          const std::vector<float> c = level_inputs(n, factor, specials, rng);
          const size_t plane_words = (offset + n + 63) / 64 + 1;
          std::vector<uint64_t> planes(plane_words * static_cast<size_t>(p));
          for (auto& w : planes) { // someone else's bits, kept where they lie outside the range
            w = rng();
          }
          std::vector<uint64_t> before = planes;
          for (int b = 0; b < p; ++b) { // the range starts cleared, as a caller's buffer is
            for (size_t pos = offset; pos < offset + n; ++pos) {
              planes[b * plane_words + pos / 64] &= ~(1ull << (pos % 64));
            }
          }
          before = planes;
          const uint64_t bad = pack_levels(
              c.data(), n, factor, p, planes.data(), plane_words, offset, isa);
          uint64_t want_bad = 0;
          for (size_t i = 0; i < n; ++i) {
            want_bad += std::isfinite(c[i]) ? 0 : 1;
            int q = naive_q(c[i], factor, s);
            if (std::isfinite(c[i]) && std::isnan(static_cast<double>(c[i]) * factor)) {
              q = 0; // a NaN product (0 * Inf, or a NaN factor)
            }
            ASSERT_EQ(level_at(planes, plane_words, p, offset + i), q + s)
                << "p=" << p << " n=" << n << " offset=" << offset << " i=" << i << " c=" << c[i]
                << " factor=" << factor;
          }
          EXPECT_EQ(bad, want_bad);
          for (int b = 0; b < p; ++b) {
            for (size_t pos = 0; pos < plane_words * 64; ++pos) {
              if (pos >= offset && pos < offset + n) {
                continue;
              }
              const size_t w = b * plane_words + pos / 64;
              ASSERT_EQ((planes[w] >> (pos % 64)) & 1, (before[w] >> (pos % 64)) & 1) << pos;
            }
          }
        }
      }
    }
  }
}

// Every ISA's vote_levels against the exact sum, for counters kept in
// registers (n * 2s < 4096) and beyond, on whole 8-word blocks and a tail.
TEST(Levels, VoteOnEveryIsaIsTheSignOfTheExactSum) {
  std::mt19937_64 rng(11);
  const size_t words = 19; // two 8-word blocks and three single words
  for (int p = kMinLevelBits; p <= kMaxLevelBits; ++p) {
    const int s = level_span(p);
    for (int n : {1, 2, 3, 7, 8, 16, 17, 64, 300}) {
      std::vector<std::vector<uint64_t>> ranks(static_cast<size_t>(n));
      std::vector<int64_t> sum(words * 64, 0);
      std::vector<const uint64_t*> in;
      for (int i = 0; i < n; ++i) {
        auto& planes = ranks[static_cast<size_t>(i)];
        planes.assign(words * static_cast<size_t>(p), 0);
        for (size_t e = 0; e < words * 64; ++e) {
          // Extremes in some words (the top counter planes), small values
          // elsewhere (ties).
          int v;
          if (e / 64 % 5 == 1) {
            v = (rng() % 3 == 0) ? -s : s;
          } else if (rng() % 4 == 0) {
            v = static_cast<int>(rng() % (2 * s + 1)) - s;
          } else {
            v = static_cast<int>(rng() % 3) - 1;
          }
          sum[e] += v;
          const int u = v + s;
          for (int b = 0; b < p; ++b) {
            planes[b * words + e / 64] |= static_cast<uint64_t>((u >> b) & 1) << (e % 64);
          }
        }
        in.push_back(planes.data());
      }
      for (Isa isa : test::supported_isas()) {
        SCOPED_TRACE(isa_name(isa));
        std::vector<uint64_t> sign(words, 0xdead), tie(words, 0xbeef);
        vote_levels(in.data(), n, p, words, sign.data(), tie.data(), isa);
        for (size_t e = 0; e < words * 64; ++e) {
          ASSERT_EQ((sign[e / 64] >> (e % 64)) & 1, sum[e] > 0 ? 1u : 0u)
              << "p=" << p << " n=" << n << " e=" << e;
          ASSERT_EQ((tie[e / 64] >> (e % 64)) & 1, sum[e] == 0 ? 1u : 0u)
              << "p=" << p << " n=" << n << " e=" << e;
        }
      }
    }
  }
}

} // namespace
} // namespace lionbit::bits
