#include "signbits/count.h"

#include <gtest/gtest.h>

#include <tuple>

#include "test_util.h"

namespace lionbit::bits {
namespace {

using test::bit;

// n ranks' random planes over `words` words. Ranks in `zero_ranks` mode get a
// zero plane (about zero_rate of their elements are 0).
struct Ranks {
  std::vector<std::vector<uint64_t>> sign, zero;
  std::vector<Contribution> in;
};

Ranks make_ranks(int n, size_t words, int zero_mode, std::mt19937_64& rng) {
  Ranks r;
  r.sign.resize(static_cast<size_t>(n));
  r.zero.resize(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    auto& s = r.sign[static_cast<size_t>(i)];
    auto& z = r.zero[static_cast<size_t>(i)];
    s.resize(words);
    // zero_mode: 0 none, 1 some ranks, 2 all ranks, 3 all ranks all zero
    const bool has_zero = zero_mode == 2 || zero_mode == 3 || (zero_mode == 1 && i % 2 == 1);
    if (has_zero) {
      z.resize(words);
    }
    for (size_t w = 0; w < words; ++w) {
      uint64_t zw = 0;
      if (zero_mode == 3) {
        zw = ~0ull;
      } else if (has_zero) {
        zw = rng() & rng() & rng(); // ~1/8 zeros
      }
      s[w] = rng() & ~zw; // a zero element has its sign bit clear
      if (has_zero) {
        z[w] = zw;
      }
    }
    r.in.push_back({s.data(), has_zero ? z.data() : nullptr});
  }
  return r;
}

int naive_sum(const Ranks& r, size_t i) {
  int sum = 0;
  for (const auto& c : r.in) {
    if (c.zero && bit(c.zero, i)) {
      continue;
    }
    sum += bit(c.sign, i) ? 1 : -1;
  }
  return sum;
}

class CountTest : public ::testing::TestWithParam<std::tuple<int, size_t, int>> {};

TEST_P(CountTest, VoteAndCodeMatchNaiveSumOnEveryIsa) {
  const auto [n, words, zero_mode] = GetParam();
  std::mt19937_64 rng(
      static_cast<uint64_t>(n) * 1000003 + words * 7 + static_cast<uint64_t>(zero_mode));
  const Ranks r = make_ranks(n, words, zero_mode, rng);
  bool with_zeros = false; // as the kernel decides: some rank sends zeros
  for (const auto& c : r.in) {
    with_zeros = with_zeros || c.zero != nullptr;
  }
  const int planes = code_planes(n, with_zeros);

  std::vector<uint64_t> first_sign, first_zero, first_code;
  for (Isa isa : test::supported_isas()) {
    SCOPED_TRACE(isa_name(isa));
    std::vector<uint64_t> vs(words + 1, 0xabababababababab);
    std::vector<uint64_t> vz(words + 1, 0xabababababababab);
    const bool any = vote(r.in.data(), n, words, vs.data(), vz.data(), isa);
    std::vector<uint64_t> code(static_cast<size_t>(planes) * words + 1, 0xcdcdcdcdcdcdcdcd);
    count_code(r.in.data(), n, words, code.data(), isa);

    bool saw_zero = false;
    for (size_t i = 0; i < words * 64; ++i) {
      const int sum = naive_sum(r, i);
      ASSERT_EQ(bit(vs.data(), i), sum > 0) << "element " << i;
      ASSERT_EQ(bit(vz.data(), i), sum == 0) << "element " << i;
      saw_zero = saw_zero || sum == 0;
      uint64_t c = 0;
      for (int b = 0; b < planes; ++b) {
        c |= static_cast<uint64_t>(bit(code.data() + static_cast<size_t>(b) * words, i)) << b;
      }
      const int decoded = with_zeros ? static_cast<int>(c) - n : 2 * static_cast<int>(c) - n;
      ASSERT_EQ(decoded, sum) << "element " << i;
    }
    EXPECT_EQ(any, saw_zero);
    EXPECT_EQ(vs[words], 0xabababababababab) << "wrote past the end";
    EXPECT_EQ(code[static_cast<size_t>(planes) * words], 0xcdcdcdcdcdcdcdcd);
    // Bitwise identical across ISAs.
    vs.pop_back();
    vz.pop_back();
    code.pop_back();
    if (first_sign.empty()) {
      first_sign = vs;
      first_zero = vz;
      first_code = code;
    } else {
      EXPECT_EQ(vs, first_sign);
      EXPECT_EQ(vz, first_zero);
      EXPECT_EQ(code, first_code);
    }
  }
}

// "n<N>_w<words>_z<zeros>", appended piece by piece: GCC 12 warns
// (-Wrestrict, a false positive) on "literal" + std::string.
std::string case_name(const ::testing::TestParamInfo<std::tuple<int, size_t, int>>& info) {
  std::string name = "n";
  name += std::to_string(std::get<0>(info.param));
  name += "_w";
  name += std::to_string(std::get<1>(info.param));
  name += "_z";
  name += std::to_string(std::get<2>(info.param));
  return name;
}

std::vector<int> all_n() {
  std::vector<int> v;
  for (int n = 1; n <= 64; ++n) {
    v.push_back(n);
  }
  return v;
}

// Every N from 1 to 64 at sizes around the 8-word vector block.
INSTANTIATE_TEST_SUITE_P(
    AllN,
    CountTest,
    ::testing::Combine(
        ::testing::ValuesIn(all_n()),
        ::testing::Values<size_t>(1, 9, 17),
        ::testing::Values(0, 1, 3)),
    case_name);

// Large shards (10^6 elements) at a few N.
INSTANTIATE_TEST_SUITE_P(
    Large,
    CountTest,
    ::testing::Combine(
        ::testing::Values(1, 2, 3, 4, 5, 8, 16, 33, 64),
        ::testing::Values<size_t>(15625),
        ::testing::Values(0, 2)),
    case_name);

TEST(Count, CodePlanes) {
  EXPECT_EQ(code_planes(1, false), 1);
  EXPECT_EQ(code_planes(1, true), 2);
  EXPECT_EQ(code_planes(4, false), 3);
  EXPECT_EQ(code_planes(4, true), 4);
  EXPECT_EQ(code_planes(64, true), 8);
}

TEST(Count, TieAtEvenNIsZero) {
  const uint64_t a = 0xff00ff00ff00ff00ull, b = ~a;
  const Contribution in[2] = {{&a, nullptr}, {&b, nullptr}};
  for (Isa isa : test::supported_isas()) {
    uint64_t s = 1, z = 0;
    EXPECT_TRUE(vote(in, 2, 1, &s, &z, isa));
    EXPECT_EQ(s, 0u);
    EXPECT_EQ(z, ~0ull);
  }
}

} // namespace
} // namespace lionbit::bits
