#include "signbits/zeros.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

namespace lionbit::bits {
namespace {

std::vector<uint64_t> random_plane(size_t words, double density, std::mt19937_64& rng) {
  std::vector<uint64_t> p(words, 0);
  std::bernoulli_distribution b(density);
  for (size_t i = 0; i < words * 64; ++i) {
    if (b(rng)) {
      p[i / 64] |= 1ull << (i % 64);
    }
  }
  return p;
}

TEST(Zeros, SizesPickTheSmallerEncoding) {
  EXPECT_EQ(zero_encoding_bytes(0, 100), 0u);
  EXPECT_EQ(zero_encoding_bytes(1, 100), 8u); // one stray zero: one word
  EXPECT_EQ(zero_encoding_bytes(3, 100), 16u);
  EXPECT_EQ(zero_encoding_bytes(198, 100), 792u);
  EXPECT_EQ(zero_encoding_bytes(199, 100), 800u); // as large as the plane: dense
  EXPECT_EQ(zero_encoding_bytes(5000, 100), 800u);
  EXPECT_EQ(zero_encoding_bytes(1, 1), 8u); // a one-word plane is never a list
  EXPECT_FALSE(zeros_as_list(0, 100));
  EXPECT_FALSE(zeros_as_list(1, 1));
  EXPECT_TRUE(zeros_as_list(1, 2));
}

class ZerosRoundTrip : public ::testing::TestWithParam<std::tuple<size_t, double, int>> {};

TEST_P(ZerosRoundTrip, DecodeGivesThePlaneBack) {
  const auto [words, density, slack] = GetParam();
  std::mt19937_64 rng(words * 977 + static_cast<uint64_t>(density * 1000) + slack);
  const auto plane = random_plane(words, density, rng);
  const uint64_t bits = count_bits(plane.data(), words);
  const uint64_t capacity = bits + static_cast<uint64_t>(slack); // padding when slack > 0
  std::vector<uint8_t> wire(zero_encoding_bytes(capacity, words) + 1, 0x77);
  encode_zeros(plane.data(), words, capacity, wire.data());
  EXPECT_EQ(wire.back(), 0x77) << "wrote past the end";
  std::vector<uint64_t> back(words, 0x1234);
  ASSERT_TRUE(decode_zeros(wire.data(), words, capacity, back.data()));
  EXPECT_EQ(back, plane);
}

INSTANTIATE_TEST_SUITE_P(
    SizesAndDensities,
    ZerosRoundTrip,
    ::testing::Combine(
        ::testing::Values<size_t>(1, 2, 7, 64, 1000, 15625),
        ::testing::Values(0.0, 1e-5, 1e-3, 0.02, 0.5, 1.0),
        ::testing::Values(0, 3)));

TEST(Zeros, CorruptListsAreRejected) {
  const size_t words = 10; // 640 elements
  std::vector<uint64_t> plane(words);
  auto make = [&](std::vector<uint32_t> idx) {
    std::vector<uint8_t> w(idx.size() * 4);
    std::memcpy(w.data(), idx.data(), w.size());
    return w;
  };
  EXPECT_TRUE(decode_zeros(make({3, 9, kNoIndex, kNoIndex}).data(), words, 3, plane.data()));
  EXPECT_EQ(plane[0], (1ull << 3) | (1ull << 9));
  EXPECT_FALSE(decode_zeros(make({3, 640}).data(), words, 2, plane.data())); // out of range
  EXPECT_FALSE(decode_zeros(make({9, 3}).data(), words, 2, plane.data())); // not ascending
  EXPECT_FALSE(decode_zeros(make({9, 9}).data(), words, 2, plane.data())); // repeated
  EXPECT_FALSE(
      decode_zeros(make({kNoIndex, 4}).data(), words, 2, plane.data())); // data after padding
  EXPECT_FALSE(
      decode_zeros(make({1, 2, 3, 4}).data(), words, 3, plane.data())); // more than the capacity
}

} // namespace
} // namespace lionbit::bits
