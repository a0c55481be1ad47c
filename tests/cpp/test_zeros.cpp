#include "signbits/zeros.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "test_util.h"

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

ZeroCode list_code(uint64_t zeros) {
  return ZeroCode::at_most(zeros);
}

TEST(Zeros, SizesPickTheSmallerEncoding) {
  EXPECT_EQ(zero_encoding_bytes(list_code(0), 100), 0u);
  EXPECT_EQ(zero_encoding_bytes(list_code(1), 100), 8u); // one stray zero: one word
  EXPECT_EQ(zero_encoding_bytes(list_code(3), 100), 16u);
  EXPECT_EQ(zero_encoding_bytes(list_code(198), 100), 792u);
  EXPECT_EQ(zero_encoding_bytes(list_code(199), 100), 800u); // as large as the plane: dense
  EXPECT_EQ(zero_encoding_bytes(list_code(5000), 100), 800u);
  EXPECT_EQ(zero_encoding_bytes(list_code(1), 1), 8u); // a one-word plane is never a list
  EXPECT_EQ(zero_form(list_code(0), 100), ZeroForm::kNone);
  EXPECT_EQ(zero_form(list_code(1), 1), ZeroForm::kPlane);
  EXPECT_EQ(zero_form(list_code(1), 2), ZeroForm::kList);
  // Runs: 8 bytes a run, chosen when smaller than both the list and the plane.
  EXPECT_EQ(zero_form(ZeroCode{576, 1}, 100), ZeroForm::kRuns); // a channel of zeros
  EXPECT_EQ(zero_encoding_bytes(ZeroCode{576, 1}, 100), 8u);
  EXPECT_EQ(zero_encoding_bytes(ZeroCode{6000, 40}, 100), 320u);
  EXPECT_EQ(zero_form(ZeroCode{6000, 100}, 100), ZeroForm::kPlane); // 800 bytes: the plane
  EXPECT_EQ(zero_form(ZeroCode{4, 2}, 100), ZeroForm::kList); // equal sizes: the list
  EXPECT_EQ(zero_form(ZeroCode{4, 1}, 100), ZeroForm::kRuns);
  EXPECT_EQ(zero_form(ZeroCode{64, 1}, 1), ZeroForm::kPlane); // never above a plane
}

TEST(Zeros, PackedRunsAreWorthACopyOnlyWhereZerosCost) {
  // 1M words (a 64M-element chunk: 8 MB): 7 stray zeros are a 32-byte list.
  EXPECT_FALSE(packed_worth_a_copy(7, 7, 1u << 20));
  // Lists and runs up to 1/32 of the plane (262,144 bytes) are not worth it ...
  EXPECT_FALSE(packed_worth_a_copy(65536, 65536, 1u << 20));
  EXPECT_FALSE(packed_worth_a_copy(1u << 24, 32768, 1u << 20)); // 32,768 runs: exactly 1/32
  // ... more is.
  EXPECT_TRUE(packed_worth_a_copy(65538, 65538, 1u << 20));
  EXPECT_TRUE(packed_worth_a_copy(1u << 24, 32769, 1u << 20));
  // A dense plane (its zeros' cheapest sparse form is the plane): always.
  EXPECT_TRUE(packed_worth_a_copy(6000, 100, 100));
}

TEST(Zeros, MessagesNameTheForm) {
  EXPECT_STREQ(zero_form_noun(ZeroForm::kList), "list of positions");
  EXPECT_STREQ(zero_form_noun(ZeroForm::kRuns), "list of runs");
  EXPECT_STREQ(zero_form_noun(ZeroForm::kPacked), "packed runs");
}

TEST(Zeros, CountRunsSeesRunsAcrossWords) {
  std::vector<uint64_t> p(3, 0);
  EXPECT_EQ(count_runs(p.data(), 3), 0u);
  p[0] = 0x8000000000000000ull; // the last bit of word 0 ...
  p[1] = 0x3; // ... continued in word 1
  p[2] = 0x5; // two more
  EXPECT_EQ(count_runs(p.data(), 3), 3u);
  EXPECT_EQ(count_runs(p.data() + 1, 2), 3u); // word 1 alone starts its own run
  p.assign(3, ~0ull);
  EXPECT_EQ(count_runs(p.data(), 3), 1u);
}

// Every ISA's copy of count_bits / count_runs against the definition, bit by
// bit: dense, sparse and all-set planes, runs across words and a plane's end.
TEST(Zeros, CountsAreTheSameOnEveryIsa) {
  std::mt19937_64 rng(7);
  for (const size_t words : {size_t{0}, size_t{1}, size_t{3}, size_t{257}}) {
    for (const double density : {0.0, 0.01, 0.5, 0.99, 1.0}) {
      const std::vector<uint64_t> p = random_plane(words, density, rng);
      uint64_t bits = 0, runs = 0;
      bool prev = false;
      for (size_t i = 0; i < words * 64; ++i) {
        const bool b = ((p[i / 64] >> (i % 64)) & 1) != 0;
        bits += b ? 1 : 0;
        runs += b && !prev ? 1 : 0;
        prev = b;
      }
      for (const Isa isa : test::supported_isas()) {
        EXPECT_EQ(count_bits(p.data(), words, isa), bits)
            << isa_name(isa) << " " << words << " " << density;
        EXPECT_EQ(count_runs(p.data(), words, isa), runs)
            << isa_name(isa) << " " << words << " " << density;
      }
    }
  }
}

class ZerosRoundTrip : public ::testing::TestWithParam<std::tuple<size_t, double, int, bool>> {};

// A plane of bits with probability `density`, or (clustered) of runs of 1 to
// 300 set bits starting with that probability.
std::vector<uint64_t> test_plane(
    size_t words,
    double density,
    bool clustered,
    std::mt19937_64& rng) {
  if (!clustered) {
    return random_plane(words, density, rng);
  }
  std::vector<uint64_t> p(words, 0);
  std::bernoulli_distribution b(density);
  for (size_t i = 0; i < words * 64; ++i) {
    if (b(rng)) {
      const size_t len = 1 + rng() % 300;
      for (size_t j = i; j < std::min(words * 64, i + len); ++j) {
        p[j / 64] |= 1ull << (j % 64);
      }
      i += len;
    }
  }
  return p;
}

TEST_P(ZerosRoundTrip, DecodeGivesThePlaneBack) {
  const auto [words, density, slack, clustered] = GetParam();
  std::mt19937_64 rng(words * 977 + static_cast<uint64_t>(density * 1000) + slack + clustered);
  const auto plane = test_plane(words, density, clustered, rng);
  const uint64_t bits = count_bits(plane.data(), words);
  const uint64_t runs = count_runs(plane.data(), words);
  // Padding when slack > 0; lists when the runs are not announced.
  for (const ZeroCode code :
       {ZeroCode::at_most(bits + slack), ZeroCode{bits + slack, runs + slack}}) {
    if (code.zeros > 0 && code.runs == 0) continue;
    std::vector<uint8_t> wire(zero_encoding_bytes(code, words) + 1, 0x77);
    encode_zeros(plane.data(), words, code, wire.data());
    EXPECT_EQ(wire.back(), 0x77) << "wrote past the end";
    std::vector<uint64_t> back(words, 0x1234);
    ASSERT_TRUE(decode_zeros(wire.data(), words, code, back.data()))
        << zero_form_name(zero_form(code, words));
    EXPECT_EQ(back, plane) << zero_form_name(zero_form(code, words));
  }
}

INSTANTIATE_TEST_SUITE_P(
    SizesAndDensities,
    ZerosRoundTrip,
    ::testing::Combine(
        ::testing::Values<size_t>(1, 2, 7, 64, 1000, 15625),
        ::testing::Values(0.0, 1e-5, 1e-3, 0.02, 0.5, 1.0),
        ::testing::Values(0, 3),
        ::testing::Bool()));

TEST(Zeros, CorruptListsAreRejected) {
  const size_t words = 10; // 640 elements
  std::vector<uint64_t> plane(words);
  auto make = [&](std::vector<uint32_t> idx) {
    std::vector<uint8_t> w(idx.size() * 4);
    std::memcpy(w.data(), idx.data(), w.size());
    return w;
  };
  const auto decode = [&](std::vector<uint32_t> idx, uint64_t cap) {
    return decode_zeros(make(idx).data(), words, list_code(cap), plane.data());
  };
  EXPECT_TRUE(decode({3, 9, kNoIndex, kNoIndex}, 3));
  EXPECT_EQ(plane[0], (1ull << 3) | (1ull << 9));
  EXPECT_FALSE(decode({3, 640}, 2)); // out of range
  EXPECT_FALSE(decode({9, 3}, 2)); // not ascending
  EXPECT_FALSE(decode({9, 9}, 2)); // repeated
  EXPECT_FALSE(decode({kNoIndex, 4}, 2)); // data after padding
  EXPECT_FALSE(decode({1, 2, 3, 4}, 3)); // more than the capacity
}

TEST(Zeros, CorruptRunsAreRejected) {
  const size_t words = 10; // 640 elements; code (zeros 600, runs 3): runs
  std::vector<uint64_t> plane(words);
  const auto decode = [&](std::vector<uint32_t> ends) {
    std::vector<uint8_t> w(ends.size() * 4);
    std::memcpy(w.data(), ends.data(), w.size());
    return decode_zeros(w.data(), words, ZeroCode{600, 3}, plane.data());
  };
  ASSERT_EQ(zero_form(ZeroCode{600, 3}, words), ZeroForm::kRuns);
  EXPECT_TRUE(decode({3, 70, 100, 640, kNoIndex, kNoIndex}));
  EXPECT_EQ(plane[0], ~0ull << 3);
  EXPECT_EQ(plane[1], ((1ull << 6) - 1) | (~0ull << 36)); // 64..69, then 100..
  EXPECT_EQ(plane[2], ~0ull);
  EXPECT_EQ(plane[9], ~0ull);
  EXPECT_FALSE(decode({3, 3, kNoIndex, kNoIndex, kNoIndex, kNoIndex})); // empty
  EXPECT_FALSE(decode({9, 3, kNoIndex, kNoIndex, kNoIndex, kNoIndex})); // reversed
  EXPECT_FALSE(decode({3, 641, kNoIndex, kNoIndex, kNoIndex, kNoIndex})); // past the plane
  EXPECT_FALSE(decode({3, 70, 70, 80, kNoIndex, kNoIndex})); // touching: not maximal
  EXPECT_FALSE(decode({3, 70, 60, 80, kNoIndex, kNoIndex})); // overlapping
  EXPECT_FALSE(decode({100, 110, 3, 70, kNoIndex, kNoIndex})); // not ascending
  EXPECT_FALSE(decode({3, 70, kNoIndex, 5, kNoIndex, kNoIndex})); // half a padding
  EXPECT_FALSE(decode({kNoIndex, kNoIndex, 3, 70, kNoIndex, kNoIndex})); // a run after padding
}

} // namespace
} // namespace lionbit::bits
