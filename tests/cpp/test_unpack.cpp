#include "signbits/unpack.h"

#include <gtest/gtest.h>

#include <tuple>

#include "test_util.h"

namespace lionbit::bits {
namespace {

using test::bit;

const size_t kSizes[] = {0, 1, 63, 64, 65, 1000, 4099, 1000003};

class UnpackTest : public ::testing::TestWithParam<std::tuple<DType, int, size_t>> {};

TEST_P(UnpackTest, MatchesNaiveLookupOnEveryIsa) {
  const auto [dtype, nplanes, n] = GetParam();
  std::mt19937_64 rng(n * 13 + static_cast<size_t>(nplanes));
  const size_t words = words_for(n);
  const size_t es = dtype_size(dtype);
  std::vector<std::vector<uint64_t>> planes(
      static_cast<size_t>(nplanes), std::vector<uint64_t>(words));
  std::vector<const uint64_t*> ptrs;
  for (auto& p : planes) {
    for (auto& w : p) {
      w = rng();
    }
    ptrs.push_back(p.data());
  }
  const size_t entries = size_t{1} << nplanes;
  std::vector<uint8_t> lut(entries * es);
  for (auto& b : lut) {
    b = static_cast<uint8_t>(rng());
  }
  for (Isa isa : test::supported_isas()) {
    SCOPED_TRACE(isa_name(isa));
    std::vector<uint8_t> dst(n * es + 8, 0x5a);
    unpack(dtype, ptrs.data(), nplanes, n, lut.data(), dst.data(), isa);
    for (size_t i = 0; i < n; ++i) {
      size_t code = 0;
      for (int b = 0; b < nplanes; ++b) {
        code |= static_cast<size_t>(bit(ptrs[static_cast<size_t>(b)], i)) << b;
      }
      ASSERT_EQ(0, std::memcmp(dst.data() + i * es, lut.data() + code * es, es)) << "element " << i;
    }
    for (size_t k = n * es; k < dst.size(); ++k) {
      ASSERT_EQ(dst[k], 0x5a) << "wrote past the end";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllDtypesPlanesSizes,
    UnpackTest,
    ::testing::Combine(
        ::testing::ValuesIn(test::all_dtypes()),
        ::testing::Values(1, 2, 3, 4, 5, 7, 12, 16),
        ::testing::ValuesIn(kSizes)),
    [](const auto& info) {
      return std::string(dtype_name(std::get<0>(info.param))) + "_p" +
          std::to_string(std::get<1>(info.param)) + "_n" + std::to_string(std::get<2>(info.param));
    });

TEST(MakeLut, Float16RoundTripsEveryFiniteValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = test::f16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      continue;
    }
    const double d = f;
    uint16_t out = 0;
    make_lut(DType::kFloat16, &d, 1, &out);
    ASSERT_EQ(out, h) << "pattern " << h;
  }
}

TEST(MakeLut, BFloat16RoundTripsEveryFiniteValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = test::bf16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      continue;
    }
    const double d = f;
    uint16_t out = 0;
    make_lut(DType::kBFloat16, &d, 1, &out);
    ASSERT_EQ(out, h) << "pattern " << h;
  }
}

TEST(MakeLut, RoundsToNearestEven) {
  // Halfway between float16 1.0 (0x3c00) and the next value (0x3c01): even.
  const double half_ulp = std::ldexp(1.0, -11);
  double v[4] = {1.0 + half_ulp, 1.0 + 3 * half_ulp, 1.0 / 3.0, -2.0 / 3.0};
  uint16_t h[4];
  make_lut(DType::kFloat16, v, 4, h);
  EXPECT_EQ(h[0], 0x3c00);
  EXPECT_EQ(h[1], 0x3c02);
  EXPECT_EQ(h[2], 0x3555);
  EXPECT_EQ(h[3], 0xb955);
  uint16_t b[4];
  make_lut(DType::kBFloat16, v + 2, 2, b);
  EXPECT_EQ(b[0], 0x3eab);
  EXPECT_EQ(b[1], 0xbf2b);
  // Subnormal float16 and overflow to Inf.
  double tiny[2] = {std::ldexp(1.0, -24), 70000.0};
  uint16_t t[2];
  make_lut(DType::kFloat16, tiny, 2, t);
  EXPECT_EQ(t[0], 0x0001);
  EXPECT_EQ(t[1], 0x7c00);
}

TEST(MakeLut, Int8AndWideFloats) {
  const double v[3] = {-3.0, 0.0, 5.0};
  int8_t i8[3];
  make_lut(DType::kInt8, v, 3, i8);
  EXPECT_EQ(i8[0], -3);
  EXPECT_EQ(i8[1], 0);
  EXPECT_EQ(i8[2], 5);
  const double third = 1.0 / 3.0;
  float f;
  double d;
  make_lut(DType::kFloat32, &third, 1, &f);
  make_lut(DType::kFloat64, &third, 1, &d);
  EXPECT_EQ(f, static_cast<float>(third));
  EXPECT_EQ(d, third);
}

} // namespace
} // namespace lionbit::bits
