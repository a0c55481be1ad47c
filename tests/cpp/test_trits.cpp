#include "signbits/trits.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "signbits/unpack.h"
#include "test_util.h"

namespace lionbit::bits {
namespace {

using test::bit;

// Every dtype and size: base 3 decodes to what unpack gives for the same sign
// and tie planes (code = sign + 2 * tie: -1, +1, 0, 0), ties of every density.
TEST(Trits, DecodeMatchesThePlanesOnEveryDtypeAndSize) {
  for (DType dtype : test::all_dtypes()) {
    for (size_t n :
         {size_t{0}, size_t{1}, size_t{4}, size_t{5}, size_t{59}, size_t{60}, size_t{63},
          size_t{64}, size_t{65}, size_t{1000}, size_t{4099}, size_t{100003}}) {
      for (double tie_rate : {0.0, 0.1, 0.375, 1.0}) {
        SCOPED_TRACE(
            std::string(dtype_name(dtype)) + " n " + std::to_string(n) + " ties " +
            std::to_string(tie_rate));
        std::mt19937_64 rng(n * 31 + static_cast<size_t>(tie_rate * 1000));
        std::bernoulli_distribution is_tie(tie_rate);
        const size_t words = words_for(n);
        std::vector<uint64_t> sign(words), tie(words);
        for (size_t w = 0; w < words; ++w) {
          sign[w] = rng();
          for (unsigned j = 0; j < 64; ++j) {
            tie[w] |= static_cast<uint64_t>(is_tie(rng)) << j;
          }
        }
        std::vector<uint8_t> trits(words * kTritBytesPerWord, 0xee);
        encode_trits(sign.data(), tie.data(), words, trits.data());
        for (uint8_t b : trits) {
          ASSERT_LT(b, 243);
        }
        const size_t es = dtype_size(dtype);
        const double values[4] = {-1, 1, 0, 0};
        std::vector<uint8_t> lut(4 * es);
        make_lut(dtype, values, 4, lut.data());
        std::vector<uint8_t> want(n * es + 8, 0x5a), got(n * es + 8, 0x5a);
        const uint64_t* planes[2] = {sign.data(), tie.data()};
        unpack(dtype, planes, 2, n, lut.data(), want.data());
        ASSERT_TRUE(decode_trits(dtype, trits.data(), n, lut.data(), got.data()));
        ASSERT_EQ(0, std::memcmp(want.data(), got.data(), got.size()))
            << "differs (or wrote past the end)";
      }
    }
  }
}

TEST(Trits, FiveElementsToAByte) {
  // -1, +1, 0, +1, -1 -> trits 0, 1, 2, 1, 0 -> 0 + 3 + 18 + 27 + 0 = 48.
  const uint64_t sign = 0b01010, tie = 0b00100;
  uint8_t out[kTritBytesPerWord];
  encode_trits(&sign, &tie, 1, out);
  EXPECT_EQ(out[0], 48);
  for (size_t b = 1; b < kTritBytesPerWord; ++b) {
    EXPECT_EQ(out[b], 0); // all -1
  }
}

TEST(Trits, ACodeAbove242IsRejected) {
  std::vector<uint8_t> trits(2 * kTritBytesPerWord, 0);
  std::vector<float> dst(128);
  const float lut[3] = {-1, 1, 0};
  ASSERT_TRUE(decode_trits(DType::kFloat32, trits.data(), 128, lut, dst.data()));
  for (size_t at : {size_t{3}, size_t{12}, size_t{kTritBytesPerWord + 12}}) {
    trits[at] = 243;
    EXPECT_FALSE(decode_trits(DType::kFloat32, trits.data(), 128, lut, dst.data())) << at;
    trits[at] = 0;
  }
  // in the tail past the last whole word too
  trits[kTritBytesPerWord + 1] = 255;
  EXPECT_FALSE(decode_trits(DType::kFloat32, trits.data(), 70, lut, dst.data()));
}

} // namespace
} // namespace lionbit::bits
