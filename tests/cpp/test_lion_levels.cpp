// lion_level_abs_sum and lion_pack_levels (optimizer/lion_levels.h): Lion
// Cub's L1 levels straight from g and m, against a reference written here
// from the contracts (c as lion.h, one float32 operation at a time; the sum in
// the sixteen-lane order of lion_levels.h; q = clamp(rint(c * factor), -s, s)
// with the product in float64), on every ISA this CPU runs, for every p,
// dtype pair, size, offset and factor, bit for bit; the momentum too.
#include "optimizer/lion_levels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "signbits/levels.h"
#include "test_util.h"

#include "lion_test_util.h"

namespace lionbit::optim {
namespace {

using namespace lion_test;

constexpr float kB1 = 0.9f, kOmb1 = 0.1f, kB2 = 0.99f, kOmb2 = 0.01f;

float ref_c(
    DType gd,
    const std::vector<uint8_t>& g,
    DType md,
    const std::vector<uint8_t>& m,
    size_t i) {
  return ref_add(ref_mul(kB1, widen(md, m.data(), i)), ref_mul(kOmb1, widen(gd, g.data(), i)));
}

// The sum of |c| in lion_level_abs_sum's order, one double at a time.
double ref_abs_sum(const std::vector<float>& c) {
  volatile double lane[16] = {};
  for (size_t i = 0; i < c.size(); ++i) {
    lane[i % 16] = lane[i % 16] + static_cast<double>(std::fabs(c[i]));
  }
  for (size_t w = 8; w >= 1; w /= 2) {
    for (size_t j = 0; j < w; ++j) {
      lane[j] = lane[j] + lane[j + w];
    }
  }
  return lane[0];
}

// q of the contract, written without the library's level_value.
int ref_q(float c, double factor, int s) {
  if (std::isnan(c)) {
    return 0;
  }
  if (std::isinf(c)) {
    return c > 0 ? s : -s;
  }
  const double x = std::nearbyint(static_cast<double>(c) * factor);
  if (std::isnan(x)) {
    return 0;
  }
  return static_cast<int>(std::min<double>(std::max<double>(x, -s), s));
}

int level_at(const std::vector<uint64_t>& planes, size_t plane_words, int p, size_t pos) {
  int u = 0;
  for (int b = 0; b < p; ++b) {
    u |= static_cast<int>((planes[b * plane_words + pos / 64] >> (pos % 64)) & 1) << b;
  }
  return u;
}

// g and m over a wide range of binades (so that the float64 sum rounds and
// its order shows), zeros, and - when `specials` - NaN / Inf in a few
// elements.
std::vector<uint8_t> values(DType d, size_t n, bool specials, std::mt19937_64& rng) {
  std::vector<uint8_t> v = d == DType::kFloat16 ? make_values(d, n, rng, -14, 14)
                                                : make_values(d, n, rng, -40, 30);
  if (!specials) { // make_values puts ~6% specials in: replace the non-finite ones
    for (size_t i = 0; i < n; ++i) {
      if (!std::isfinite(widen(d, v.data(), i))) {
        ref_store(d, v.data(), i, 0.25f);
      }
    }
  }
  return v;
}

class LionLevels : public ::testing::TestWithParam<Isa> {};

TEST_P(LionLevels, SumAndLevelsMatchTheContract) {
  const Isa isa = GetParam();
  std::mt19937_64 rng(23);
  const DType grads[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  const DType moms[] = {DType::kFloat32, DType::kBFloat16};
  for (DType gd : grads) {
    for (DType md : moms) {
      for (size_t n :
           {size_t{1}, size_t{15}, size_t{16}, size_t{64}, size_t{100}, size_t{1031},
            size_t{4099}}) {
        for (size_t offset : {size_t{0}, size_t{3}, size_t{64}, size_t{90}}) {
          const int p = bits::kMinLevelBits + static_cast<int>(rng() % 7);
          const int s = bits::level_span(p);
          const bool specials = rng() % 3 == 0;
          const bool update = rng() % 2 == 0;
          SCOPED_TRACE(
              ::testing::Message() << bits::dtype_name(gd) << "/" << bits::dtype_name(md)
                                   << " n=" << n << " offset=" << offset << " p=" << p
                                   << " specials=" << specials << " update=" << update);
          const std::vector<uint8_t> g = values(gd, n, specials, rng);
          std::vector<uint8_t> m = values(md, n, specials, rng);
          std::vector<float> c(n);
          for (size_t i = 0; i < n; ++i) {
            c[i] = ref_c(gd, g, md, m, i);
          }
          // Pass 1, bit for bit in the contract's order.
          const double sum = lion_level_abs_sum(gd, g.data(), md, m.data(), n, kB1, kOmb1, isa);
          const double want_sum = ref_abs_sum(c);
          if (std::isnan(want_sum)) {
            EXPECT_TRUE(std::isnan(sum));
          } else {
            EXPECT_EQ(sum, want_sum);
          }
          // Pass 2 with the factor a caller forms (and, once, the scale of
          // an exact half so that rounding to even is reached).
          double factor = std::isfinite(sum) && sum > 0 ? s / (2.0 * sum / static_cast<double>(n))
                                                        : 0.0;
          if (rng() % 4 == 0) {
            factor = 2.0;
          }
          const size_t plane_words = (offset + n + 63) / 64 + 1;
          std::vector<uint64_t> planes(plane_words * static_cast<size_t>(p), 0);
          if (offset > 0) {
            for (int b = 0; b < p; ++b) {
              planes[b * plane_words] |= 1; // element 0: someone else's
            }
          }
          const std::vector<uint8_t> m_before = m;
          const uint64_t bad = lion_pack_levels(
              gd, g.data(), md, m.data(), n, kB1, kOmb1, kB2, kOmb2, update, factor,
              LevelPlanes{planes.data(), plane_words, offset, p}, isa);
          uint64_t want_bad = 0;
          for (size_t i = 0; i < n; ++i) {
            want_bad += std::isfinite(c[i]) ? 0 : 1;
            ASSERT_EQ(level_at(planes, plane_words, p, offset + i), ref_q(c[i], factor, s) + s)
                << "i=" << i << " c=" << c[i];
          }
          EXPECT_EQ(bad, want_bad);
          if (offset > 0) {
            EXPECT_EQ(level_at(planes, plane_words, p, 0), (1 << p) - 1);
          }
          for (size_t pos = offset + n; pos < plane_words * 64; ++pos) {
            ASSERT_EQ(level_at(planes, plane_words, p, pos), 0) << pos;
          }
          // The momentum: b2 m + omb2 g with the old m, or untouched.
          std::vector<uint8_t> want_m = m_before;
          if (update) {
            for (size_t i = 0; i < n; ++i) {
              ref_store(
                  md, want_m.data(), i,
                  ref_add(
                      ref_mul(kB2, widen(md, m_before.data(), i)),
                      ref_mul(kOmb2, widen(gd, g.data(), i))));
            }
          }
          for (size_t i = 0; i < n; ++i) {
            ASSERT_TRUE(same_at(md, m.data(), want_m.data(), i))
                << "m[" << i << "] " << hex_at(md, m.data(), i) << " want "
                << hex_at(md, want_m.data(), i);
          }
        }
      }
    }
  }
}

// The fused pass gives the levels that bits::pack_levels gives for the same
// c: one definition of the levels, whichever way they are reached.
TEST_P(LionLevels, FusedEqualsPackingTheDirection) {
  const Isa isa = GetParam();
  std::mt19937_64 rng(5);
  const size_t n = 70000;
  std::vector<float> g(n), m(n), c(n);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (size_t i = 0; i < n; ++i) {
    g[i] = normal(rng) * 1e-3f;
    m[i] = normal(rng) * 1e-3f;
    c[i] = ref_add(ref_mul(kB1, m[i]), ref_mul(kOmb1, g[i]));
  }
  for (int p = bits::kMinLevelBits; p <= bits::kMaxLevelBits; ++p) {
    const double sum = lion_level_abs_sum(
        DType::kFloat32, g.data(), DType::kFloat32, m.data(), n, kB1, kOmb1, isa);
    const double factor = bits::level_span(p) / (2.0 * sum / static_cast<double>(n));
    const size_t words = (n + 5 + 63) / 64;
    std::vector<uint64_t> fused(words * p, 0), plain(words * p, 0);
    lion_pack_levels(
        DType::kFloat32, g.data(), DType::kFloat32, m.data(), n, kB1, kOmb1, kB2, kOmb2, false,
        factor, LevelPlanes{fused.data(), words, 5, p}, isa);
    bits::pack_levels(c.data(), n, factor, p, plain.data(), words, 5, isa);
    ASSERT_EQ(fused, plain) << "p=" << p;
  }
}

INSTANTIATE_TEST_SUITE_P(
    EveryIsa,
    LionLevels,
    ::testing::ValuesIn(bits::test::supported_isas()),
    [](const ::testing::TestParamInfo<Isa>& info) {
      return std::string(bits::isa_name(info.param));
    });

} // namespace
} // namespace lionbit::optim
