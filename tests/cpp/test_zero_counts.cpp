#include "signbits/zero_counts.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "signbits/count.h"
#include "test_util.h"

namespace lionbit::bits {
namespace {

using test::bit;

// n ranks over `words` words; rank i has zeros_per_rank[i] zeros at random
// places (some shared by several ranks: `shared` of them at the same places
// on every rank that has zeros). Zeros carry no sign bit.
struct Ranks {
  std::vector<std::vector<uint64_t>> sign, zero;
  std::vector<Contribution> in;
};

Ranks make_ranks(
    int n,
    size_t words,
    const std::vector<int>& zeros_per_rank,
    int shared,
    std::mt19937_64& rng) {
  Ranks r;
  r.sign.resize(static_cast<size_t>(n));
  r.zero.resize(static_cast<size_t>(n));
  const size_t elems = words * kWordBits;
  std::vector<size_t> common;
  for (int s = 0; s < shared; ++s) {
    common.push_back(rng() % elems);
  }
  for (int i = 0; i < n; ++i) {
    auto& sg = r.sign[static_cast<size_t>(i)];
    auto& z = r.zero[static_cast<size_t>(i)];
    sg.resize(words);
    for (auto& w : sg) {
      w = rng();
    }
    const int nz = zeros_per_rank[static_cast<size_t>(i)];
    if (nz > 0) {
      z.assign(words, 0);
      for (int k = 0; k < nz; ++k) {
        const size_t e = k < shared ? common[static_cast<size_t>(k)] : rng() % elems;
        z[e / kWordBits] |= uint64_t{1} << (e % kWordBits);
      }
      for (size_t w = 0; w < words; ++w) {
        sg[w] &= ~z[w];
      }
    }
    r.in.push_back({sg.data(), nz > 0 ? z.data() : nullptr});
  }
  return r;
}

// The reference: the zero-aware code of every element (count_code with the
// zero planes), looked up in a table of distinct 4-byte entries.
std::vector<uint32_t> reference(const Ranks& r, int n, size_t words) {
  const int P = code_planes(n, true);
  std::vector<uint64_t> code(static_cast<size_t>(P) * words);
  // An empty zero plane on rank 0 forces the zero-aware code even when no
  // rank has a zero.
  std::vector<uint64_t> none(words, 0);
  std::vector<Contribution> in = r.in;
  if (in[0].zero == nullptr) {
    in[0].zero = none.data();
  }
  count_code(in.data(), n, words, code.data());
  std::vector<uint32_t> out(words * kWordBits);
  for (size_t i = 0; i < out.size(); ++i) {
    uint32_t c = 0;
    for (int b = 0; b < P; ++b) {
      c |= static_cast<uint32_t>(bit(code.data() + static_cast<size_t>(b) * words, i)) << b;
    }
    out[i] = 1000 + c; // entry c of the zero-aware table
  }
  return out;
}

struct Result {
  bool encoded = false, applied = false;
  std::vector<uint32_t> out;
};

// What a receiver writes: the zero-free code's entries (2 * pos in zero-aware
// terms: a zero-free element's code is 2 * pos + 0), then the list applied.
Result round_trip(const Ranks& r, int n, size_t words, uint64_t cap, size_t elems) {
  Result res;
  std::vector<Contribution> signs = r.in;
  for (auto& c : signs) {
    c.zero = nullptr;
  }
  const int P = code_planes(n, false);
  std::vector<uint64_t> planes(static_cast<size_t>(P) * words);
  count_code(signs.data(), n, words, planes.data());
  std::vector<uint8_t> list(zero_count_list_bytes(cap), 0xa5);
  res.encoded = encode_zero_counts(r.in.data(), n, words, cap, list.data());
  if (!res.encoded) {
    return res;
  }
  std::vector<const uint64_t*> ptrs;
  for (int b = 0; b < P; ++b) {
    ptrs.push_back(planes.data() + static_cast<size_t>(b) * words);
  }
  res.out.resize(elems);
  for (size_t i = 0; i < elems; ++i) {
    uint32_t pos = 0;
    for (int b = 0; b < P; ++b) {
      pos |= static_cast<uint32_t>(bit(ptrs[static_cast<size_t>(b)], i)) << b;
    }
    res.out[i] = 1000 + 2 * pos;
  }
  std::vector<uint32_t> zlut(size_t{1} << code_planes(n, true));
  for (size_t c = 0; c < zlut.size(); ++c) {
    zlut[c] = 1000 + static_cast<uint32_t>(c);
  }
  res.applied = apply_zero_counts(
      list.data(), cap, ptrs.data(), P, elems, n, zlut.data(), 4, res.out.data());
  return res;
}

TEST(ZeroCounts, ListPlusZeroFreePlanesEqualsTheZeroAwareCode) {
  std::mt19937_64 rng(7);
  for (int n : {1, 2, 3, 4, 5, 8, 9, 16, 33}) {
    for (size_t words : {size_t{1}, size_t{3}, size_t{64}, size_t{1000}}) {
      for (int shared : {0, 2}) {
        std::vector<int> zeros(static_cast<size_t>(n));
        uint64_t cap = 0;
        for (int i = 0; i < n; ++i) {
          zeros[static_cast<size_t>(i)] = i % 3 == 1 ? 0 : 1 + static_cast<int>(rng() % 4);
          cap += static_cast<uint64_t>(zeros[static_cast<size_t>(i)]);
        }
        const Ranks r = make_ranks(n, words, zeros, shared, rng);
        const Result res = round_trip(r, n, words, cap, words * kWordBits);
        ASSERT_TRUE(res.encoded && res.applied) << n << " ranks, " << words << " words";
        EXPECT_EQ(res.out, reference(r, n, words)) << n << " ranks, " << words << " words";
      }
    }
  }
}

TEST(ZeroCounts, AnElementZeroOnEveryRankAndNoZerosAtAll) {
  std::mt19937_64 rng(8);
  const int n = 4;
  const Ranks all = make_ranks(n, 8, {1, 1, 1, 1}, 1, rng); // one element zero everywhere
  const Result a = round_trip(all, n, 8, 4, 8 * kWordBits);
  ASSERT_TRUE(a.encoded && a.applied);
  EXPECT_EQ(a.out, reference(all, n, 8));
  const Ranks none = make_ranks(n, 8, {0, 0, 0, 0}, 0, rng);
  const Result b = round_trip(none, n, 8, 3, 8 * kWordBits);
  ASSERT_TRUE(b.encoded && b.applied);
  EXPECT_EQ(b.out, reference(none, n, 8));
}

TEST(ZeroCounts, MoreElementsThanTheCapacityIsRefused) {
  std::mt19937_64 rng(9);
  const Ranks r = make_ranks(3, 4, {3, 3, 3}, 0, rng); // up to 9 elements
  std::vector<uint8_t> list(zero_count_list_bytes(2));
  EXPECT_FALSE(encode_zero_counts(r.in.data(), 3, 4, 2, list.data()));
}

TEST(ZeroCounts, UnusedEntriesAreZero) {
  std::mt19937_64 rng(10);
  const Ranks r = make_ranks(2, 4, {1, 0}, 0, rng);
  std::vector<uint8_t> list(zero_count_list_bytes(5), 0xa5);
  ASSERT_TRUE(encode_zero_counts(r.in.data(), 2, 4, 5, list.data()));
  uint64_t count = 0;
  std::memcpy(&count, list.data(), 8);
  EXPECT_EQ(count, 1u);
  for (size_t k = 16; k < list.size(); ++k) {
    EXPECT_EQ(list[k], 0) << "byte " << k;
  }
}

// A list as a peer might corrupt it: every malformed one is refused.
TEST(ZeroCounts, CorruptListsAreRefused) {
  const int n = 4, P = code_planes(n, false);
  const size_t words = 2, elems = 100;
  std::vector<uint64_t> planes(static_cast<size_t>(P) * words, 0);
  planes[0] = ~0ull; // pos = 1 everywhere in word 0
  std::vector<const uint64_t*> ptrs;
  for (int b = 0; b < P; ++b) {
    ptrs.push_back(planes.data() + static_cast<size_t>(b) * words);
  }
  std::vector<uint32_t> zlut(size_t{1} << code_planes(n, true), 7);
  std::vector<uint32_t> dst(elems);
  auto apply = [&](std::vector<uint64_t> entries, uint64_t cap) {
    std::vector<uint64_t> list(1 + cap, 0);
    list[0] = entries.size();
    for (size_t k = 0; k < entries.size() && k < cap; ++k) {
      list[1 + k] = entries[k];
    }
    return apply_zero_counts(
        reinterpret_cast<const uint8_t*>(list.data()), cap, ptrs.data(), P, elems, n, zlut.data(),
        4, dst.data());
  };
  auto e = [](uint64_t off, uint64_t zeros) { return (off << 32) | zeros; };
  EXPECT_TRUE(apply({e(3, 1), e(70, 2)}, 4));
  EXPECT_TRUE(apply({e(3, 3)}, 1)); // pos 1 + 3 zeros = N
  EXPECT_FALSE(apply({e(3, 1), e(4, 1)}, 1)); // count above the capacity
  EXPECT_FALSE(apply({e(5, 1), e(3, 1)}, 4)); // not ascending
  EXPECT_FALSE(apply({e(5, 1), e(5, 1)}, 4)); // repeated
  EXPECT_FALSE(apply({e(100, 1)}, 4)); // past the shard's elements
  EXPECT_FALSE(apply({e(~0ull >> 32, 1)}, 4)); // far past
  EXPECT_FALSE(apply({e(3, 0)}, 4)); // an element with no zero
  EXPECT_FALSE(apply({e(3, 4)}, 4)); // pos 1 + 4 zeros > N
  EXPECT_FALSE(apply({e(70, 5)}, 4)); // 5 zeros > N
}

TEST(ZeroCounts, RandomBytesNeverReadOrWriteOutOfBounds) {
  std::mt19937_64 rng(11);
  const int n = 5, P = code_planes(n, false);
  const size_t words = 3, elems = 150;
  std::vector<uint64_t> planes(static_cast<size_t>(P) * words);
  for (auto& w : planes) {
    w = rng();
  }
  std::vector<const uint64_t*> ptrs;
  for (int b = 0; b < P; ++b) {
    ptrs.push_back(planes.data() + static_cast<size_t>(b) * words);
  }
  std::vector<uint32_t> zlut(size_t{1} << code_planes(n, true), 1);
  std::vector<uint32_t> dst(elems);
  int accepted = 0;
  for (int t = 0; t < 20000; ++t) {
    const uint64_t cap = rng() % 6;
    std::vector<uint64_t> list(1 + cap);
    list[0] = rng() % 8;
    for (size_t k = 1; k <= cap; ++k) {
      // offsets mostly in range, ascending by chance; zeros 0..7
      list[k] = ((rng() % 200) << 32) | (rng() % 8);
    }
    accepted += apply_zero_counts(
        reinterpret_cast<const uint8_t*>(list.data()), cap, ptrs.data(), P, elems, n, zlut.data(),
        4, dst.data());
  }
  EXPECT_GT(accepted, 0); // some random lists are well formed
}

} // namespace
} // namespace lionbit::bits
