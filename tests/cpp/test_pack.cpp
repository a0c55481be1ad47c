#include "signbits/pack.h"

#include <gtest/gtest.h>

#include <cmath>
#include <tuple>

#include "test_util.h"

namespace lionbit::bits {
namespace {

using test::bit;

// Sizes 0 ... 10^6, odd ones and word boundaries included.
const size_t kSizes[] = {0,   1,   2,    7,    31,    63,    64,     65,      127,
                         128, 129, 1000, 4097, 65535, 65536, 100003, 1000000, 1000003};

class PackTest : public ::testing::TestWithParam<std::tuple<DType, size_t>> {};

TEST_P(PackTest, MatchesNaiveReferenceOnEveryIsa) {
  const auto [dtype, n] = GetParam();
  std::mt19937_64 rng(n * 31 + static_cast<int>(dtype));
  const auto buf = test::random_buffer(dtype, n, rng, /*with_nan=*/true);

  // Naive reference: compare the widened value.
  uint64_t ref_zeros = 0, ref_nans = 0;
  std::vector<int> ref(n);
  for (size_t i = 0; i < n; ++i) {
    const double v = test::value_at(dtype, buf, i);
    if (std::isnan(v)) {
      ref[i] = 2;
      ++ref_nans;
    } else if (v == 0) {
      ref[i] = 0;
      ++ref_zeros;
    } else {
      ref[i] = v > 0 ? 1 : -1;
    }
  }

  for (Isa isa : test::supported_isas()) {
    SCOPED_TRACE(isa_name(isa));
    const size_t words = words_for(n);
    // Poison the output: every word must be written.
    std::vector<uint64_t> sign(words + 1, 0xdeadbeefdeadbeefull);
    std::vector<uint64_t> zero(words + 1, 0xdeadbeefdeadbeefull);
    const PackCounts c = pack_signs(dtype, buf.data(), n, sign.data(), zero.data(), isa);
    EXPECT_EQ(c.zeros, ref_zeros);
    EXPECT_EQ(c.nans, ref_nans);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(bit(sign.data(), i), ref[i] == 1) << "element " << i;
      ASSERT_EQ(bit(zero.data(), i), ref[i] == 0) << "element " << i;
    }
    // Tail bits of the last word are zero in both planes.
    for (size_t i = n; i < words * 64; ++i) {
      ASSERT_FALSE(bit(sign.data(), i));
      ASSERT_FALSE(bit(zero.data(), i));
    }
    EXPECT_EQ(sign[words], 0xdeadbeefdeadbeefull) << "wrote past the end";
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllDtypesAndSizes,
    PackTest,
    ::testing::Combine(::testing::ValuesIn(test::all_dtypes()), ::testing::ValuesIn(kSizes)),
    [](const auto& info) {
      return std::string(dtype_name(std::get<0>(info.param))) + "_n" +
          std::to_string(std::get<1>(info.param));
    });

TEST(Pack, SpecialFloat32Values) {
  const float v[] = {0.0f, -0.0f, 1e-45f, -1e-45f, INFINITY, -INFINITY, 1.0f, -1.0f, NAN};
  for (Isa isa : test::supported_isas()) {
    // Put them at the end of a full word so the vector path sees them too.
    std::vector<float> x(64, 1.0f);
    std::copy(std::begin(v), std::end(v), x.begin() + 50);
    uint64_t s = 0, z = 0;
    const PackCounts c = pack_signs(DType::kFloat32, x.data(), 64, &s, &z, isa);
    EXPECT_EQ(c.zeros, 2u) << isa_name(isa);
    EXPECT_EQ(c.nans, 1u) << isa_name(isa);
    const uint64_t expect_zero = (1ull << 50) | (1ull << 51);
    EXPECT_EQ(z, expect_zero) << isa_name(isa);
    // positive: all 1.0 fillers, 1e-45 (52), +Inf (54), 1.0 (56)
    uint64_t expect_sign = (1ull << 50) - 1;
    expect_sign |= (1ull << 52) | (1ull << 54) | (1ull << 56);
    expect_sign |= ~((1ull << 59) - 1); // fillers 59..63
    EXPECT_EQ(s, expect_sign) << isa_name(isa);
  }
}

TEST(Pack, Int8Extremes) {
  std::vector<int8_t> x(64);
  for (int i = 0; i < 64; ++i) {
    x[static_cast<size_t>(i)] = static_cast<int8_t>(i % 3 == 0 ? -128 : (i % 3 == 1 ? 0 : 127));
  }
  for (Isa isa : test::supported_isas()) {
    uint64_t s = 0, z = 0;
    pack_signs(DType::kInt8, x.data(), 64, &s, &z, isa);
    for (int i = 0; i < 64; ++i) {
      EXPECT_EQ((s >> i) & 1, i % 3 == 2 ? 1u : 0u) << isa_name(isa) << " " << i;
      EXPECT_EQ((z >> i) & 1, i % 3 == 1 ? 1u : 0u) << isa_name(isa) << " " << i;
    }
  }
}

} // namespace
} // namespace lionbit::bits
