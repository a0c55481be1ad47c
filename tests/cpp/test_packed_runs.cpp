#include "signbits/packed_runs.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "signbits/zeros.h"

namespace lionbit::bits {
namespace {

using Plane = std::vector<uint64_t>;

void set(Plane& p, uint64_t i) {
  p.at(i / 64) |= 1ull << (i % 64);
}

// A row-major (rows, cols) matrix at bit `offset` of a plane of `words`
// words whose dead columns (one zero a row) and dead rows are set: what a
// ReLU unit dead on a batch leaves in the weights after and before it.
Plane matrix_plane(
    size_t words,
    uint64_t offset,
    uint64_t rows,
    uint64_t cols,
    const std::vector<uint64_t>& dead_cols,
    const std::vector<uint64_t>& dead_rows) {
  Plane p(words, 0);
  for (uint64_t r = 0; r < rows; ++r) {
    for (uint64_t c : dead_cols) {
      set(p, offset + r * cols + c);
    }
  }
  for (uint64_t r : dead_rows) {
    for (uint64_t c = 0; c < cols; ++c) {
      set(p, offset + r * cols + c);
    }
  }
  return p;
}

std::vector<uint8_t> encode(const Plane& p, size_t bytes) {
  std::vector<uint8_t> out(bytes + 1, 0x77);
  encode_packed_runs(p.data(), p.size(), out.data(), bytes);
  EXPECT_EQ(out.back(), 0x77) << "wrote past the end";
  out.pop_back();
  return out;
}

// Encodes, checks the size's promises, decodes into a dirty plane.
void expect_round_trip(const Plane& p, const std::string& what) {
  SCOPED_TRACE(what);
  const size_t words = p.size();
  const uint64_t bytes = packed_runs_bytes(p.data(), words, 0, ~0ull);
  ASSERT_GE(bytes, 8u);
  ASSERT_EQ(bytes % 8, 0u);
  for (const uint64_t room : {bytes, bytes + 16}) {
    const std::vector<uint8_t> wire = encode(p, room);
    Plane back(words, 0x5555aaaa5555aaaaull);
    ASSERT_TRUE(decode_packed_runs(wire.data(), room, words, back.data()));
    EXPECT_EQ(back, p);
  }
  // A budget below the size: not offered.
  EXPECT_EQ(packed_runs_bytes(p.data(), words, 0, bytes - 1), 0u);
}

TEST(PackedRuns, RoundTripsStructuredPlanes) {
  expect_round_trip(Plane(5, 0), "empty");
  expect_round_trip(Plane(5, ~0ull), "full");
  expect_round_trip(Plane(7, 0x5555555555555555ull), "alternating");
  expect_round_trip(Plane(7, 0xaaaaaaaaaaaaaaaaull), "alternating, from bit 1");
  Plane last(3, 0);
  set(last, 191);
  expect_round_trip(last, "the last bit");
  // Dead columns and rows, aligned and not, row lengths a multiple of 64 and not.
  for (const uint64_t offset : {0ull, 37ull}) {
    for (const uint64_t cols : {128ull, 100ull, 64ull, 7ull}) {
      const std::vector<uint64_t> dc = cols > 50 ? std::vector<uint64_t>{1, 5, 6, 50}
                                                 : std::vector<uint64_t>{0, 6};
      expect_round_trip(
          matrix_plane(200, offset, 64, cols, dc, {3, 4, 40}),
          "offset " + std::to_string(offset) + ", cols " + std::to_string(cols));
    }
  }
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    const size_t words = 1 + rng() % 300;
    Plane p(words, 0);
    const double density = std::uniform_real_distribution<double>(0, 1)(rng);
    const int mode = static_cast<int>(rng() % 3);
    for (uint64_t i = 0; i < words * 64; ++i) {
      if (mode == 0 && std::bernoulli_distribution(density * 0.1)(rng)) {
        set(p, i); // scattered
      } else if (mode == 1 && std::bernoulli_distribution(density * 0.01)(rng)) {
        for (uint64_t j = i; j < std::min<uint64_t>(words * 64, i + 1 + rng() % 200); ++j) {
          set(p, j); // runs
        }
      }
    }
    if (mode == 2) { // a period, with noise
      const uint64_t period = 1 + rng() % 150;
      for (uint64_t i = 0; i < words * 64; i += period) {
        set(p, i);
      }
      for (int n = 0; n < 3; ++n) {
        set(p, rng() % (words * 64));
      }
    }
    expect_round_trip(p, "random plane " + std::to_string(trial));
  }
}

TEST(PackedRuns, DeadColumnsCostAFewBytesEach) {
  // 16 dead columns of a 64 x 128 matrix (1,024 zeros in 1,024 runs: 8 KB
  // as runs, 4 KB as a list, 1 KB the plane) and 16 dead rows of the
  // 128 x 64 matrix before it.
  const std::vector<uint64_t> cols{2,  9,  11, 20, 33,  34,  47,  60,
                                   71, 77, 90, 95, 101, 110, 119, 127};
  Plane p = matrix_plane(3 * 128, 40, 64, 128, cols, {});
  const Plane rows = matrix_plane(
      3 * 128, 40 + 8192, 128, 64, {},
      {1, 8, 9, 30, 31, 32, 50, 70, 71, 88, 99, 100, 101, 110, 120, 127});
  for (size_t w = 0; w < p.size(); ++w) {
    p[w] |= rows[w];
  }
  const uint64_t bytes = packed_runs_bytes(p.data(), p.size(), 0, ~0ull);
  EXPECT_LE(bytes, 120u);
  const ZeroCode code = zero_code_of(p.data(), p.size());
  EXPECT_EQ(code.zeros, 1024u + 16u * 64u);
  EXPECT_EQ(code.packed, bytes);
  EXPECT_EQ(zero_form(code, p.size()), ZeroForm::kPacked);
  EXPECT_EQ(zero_encoding_bytes(code, p.size()), bytes);
}

// A sized plane's tokens are kept for its encoding (packed_runs.h): the
// bytes must be those of an encoding found afresh, for the plane as it is
// when encoded, whatever else was sized in between.
TEST(PackedRuns, AnEncodingAfterTheSizeIsTheFreshEncoding) {
  const std::vector<uint64_t> cols{3, 17, 18, 40, 63};
  const Plane a = matrix_plane(256, 5, 100, 64, cols, {7});
  const Plane b = matrix_plane(256, 9, 100, 64, cols, {2, 3}); // as large, other bits
  auto fresh = [](const Plane& p, size_t bytes) {
    drop_kept_packed_runs();
    return encode(p, bytes);
  };
  const uint64_t na = packed_runs_bytes(a.data(), a.size(), 0, ~0ull);
  const uint64_t nb = packed_runs_bytes(b.data(), b.size(), 0, ~0ull);
  ASSERT_GT(na, 0u);
  ASSERT_GT(nb, 0u);
  const std::vector<uint8_t> want_a = fresh(a, na), want_b = fresh(b, nb);
  // Sized both, encoded in another order: each its own bytes.
  EXPECT_EQ(packed_runs_bytes(a.data(), a.size(), 0, ~0ull), na);
  EXPECT_EQ(packed_runs_bytes(b.data(), b.size(), 0, ~0ull), nb);
  EXPECT_EQ(encode(b, nb), want_b);
  EXPECT_EQ(encode(a, na), want_a);
  // Sized, then changed in place before its encoding: the plane as it is now.
  Plane c = a;
  set(c, 64 * 200 + 1);
  const uint64_t nc = packed_runs_bytes(c.data(), c.size(), 0, ~0ull);
  const std::vector<uint8_t> want_c = fresh(c, nc);
  c = a;
  ASSERT_EQ(packed_runs_bytes(c.data(), c.size(), 0, ~0ull), na); // kept: a's bits, at c's address
  set(c, 64 * 200 + 1);
  std::vector<uint8_t> wire = encode(c, nc);
  EXPECT_EQ(wire, want_c);
  Plane back(c.size(), 0);
  ASSERT_TRUE(decode_packed_runs(wire.data(), wire.size(), back.size(), back.data()));
  EXPECT_EQ(back, c);
  // A plane is taken once: its second encoding is found afresh, the same bytes.
  EXPECT_EQ(packed_runs_bytes(b.data(), b.size(), 0, ~0ull), nb);
  EXPECT_EQ(encode(b, nb), want_b);
  EXPECT_EQ(encode(b, nb), want_b);
  drop_kept_packed_runs();
}

TEST(PackedRuns, ALayerLikeTheLastIsACopy) {
  // Three layers whose units died alike, 1,000 bits apart: after the first,
  // each is one copy token, whatever its runs.
  const std::vector<uint64_t> cols{3, 4, 9, 60, 61, 100};
  Plane one = matrix_plane(500, 0, 64, 128, cols, {});
  Plane three(500, 0);
  for (uint64_t at : {0ull, 9192ull, 18384ull}) {
    const Plane layer = matrix_plane(500, at, 64, 128, cols, {});
    for (size_t w = 0; w < three.size(); ++w) {
      three[w] |= layer[w];
    }
  }
  expect_round_trip(three, "three layers");
  EXPECT_LE(
      packed_runs_bytes(three.data(), 500, 0, ~0ull),
      packed_runs_bytes(one.data(), 500, 0, ~0ull) + 16);
}

TEST(PackedRuns, DensePlanesAreNotOffered) {
  std::mt19937_64 rng(5);
  Plane p(1000);
  for (auto& w : p) {
    w = rng();
  }
  EXPECT_EQ(
      packed_offer(p.data(), p.size(), count_runs(p.data(), p.size())),
      0u); // not within 3/4 of the plane's 8,000 bytes
  EXPECT_EQ(zero_form(zero_code_of(p.data(), p.size()), p.size()), ZeroForm::kPlane);
  Plane one(1, 1);
  EXPECT_EQ(packed_offer(one.data(), 1, 1), 0u); // a one-word plane is never smaller packed
}

// The format as documented, written by hand: the decoder's oracle.
std::vector<uint8_t> stream(const std::vector<uint8_t>& tokens, size_t bytes) {
  std::vector<uint8_t> s(bytes, 0);
  const uint32_t len = static_cast<uint32_t>(tokens.size());
  std::memcpy(s.data(), &len, 4);
  std::copy(tokens.begin(), tokens.end(), s.begin() + 4);
  return s;
}

TEST(PackedRuns, DecodesTheDocumentedFormat) {
  // Run: gap 3, length 2 (bits 3, 4); run: gap 5, length 1 (bit 10);
  // 4 runs copied from 2 back: the last two again, twice (bits 14, 15, 21,
  // 25, 26, 32); then a run with a gap of 200 (two-byte number 400) and
  // length 130 (number 129).
  const std::vector<uint8_t> s = stream({6, 1, 10, 0, 3, 3, 0x90, 0x03, 0x81, 0x01}, 16);
  Plane p(8, ~0ull);
  ASSERT_TRUE(decode_packed_runs(s.data(), s.size(), 8, p.data()));
  std::vector<uint64_t> want{3, 4, 10, 14, 15, 21, 25, 26, 32};
  for (uint64_t i = 233; i < 363; ++i) {
    want.push_back(i);
  }
  Plane expect(8, 0);
  for (uint64_t i : want) {
    set(expect, i);
  }
  EXPECT_EQ(p, expect);
  // And the encoder writes no more than these tokens for that plane.
  EXPECT_LE(packed_runs_bytes(expect.data(), 8, 0, ~0ull), 16u);
}

TEST(PackedRuns, CorruptStreamsAreRejected) {
  Plane p(2); // 128 bits
  const auto decode = [&](const std::vector<uint8_t>& tokens, size_t bytes = 16) {
    return decode_packed_runs(stream(tokens, bytes).data(), bytes, 2, p.data());
  };
  EXPECT_TRUE(decode({6, 1}));
  EXPECT_TRUE(decode({0, 127})); // the whole plane
  EXPECT_TRUE(decode({})); // no zeros
  EXPECT_FALSE(decode({0, 127, 2, 0})); // a run past the plane
  EXPECT_FALSE(decode({0, 128})); // a length past the plane
  EXPECT_TRUE(decode({0xfe, 0x01, 0})); // gap 127 (two bytes), length 1: bit 127
  EXPECT_FALSE(decode({0xfe, 0x01, 1})); // gap 127, length 2: past bit 128
  EXPECT_FALSE(decode({6, 1, 0, 0})); // a gap of 0 after the first run
  EXPECT_FALSE(decode({6, 1, 3, 0})); // a copy from 2 runs back after 1
  EXPECT_FALSE(decode({6, 1, 1, 100})); // 101 copies of 5 bits: past the plane
  EXPECT_TRUE(decode({6, 1, 1, 20})); // 21 copies: bits up to 109
  EXPECT_FALSE(decode({6})); // a run without its length
  EXPECT_FALSE(decode({6, 0x80})); // a number cut by L
  EXPECT_FALSE(
      decode({0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0, 1}, 24)); // 11 bytes
  EXPECT_FALSE(
      decode({0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x02, 1}, 24)); // past 64 bits
  EXPECT_FALSE(decode(
      {0x02, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01}, 24)); // length 2^64
  // L past the message; padding not zero; a message shorter than L's word.
  std::vector<uint8_t> s = stream({6, 1}, 16);
  s[0] = 13;
  EXPECT_FALSE(decode_packed_runs(s.data(), 16, 2, p.data()));
  s = stream({6, 1}, 16);
  s[15] = 1;
  EXPECT_FALSE(decode_packed_runs(s.data(), 16, 2, p.data()));
  EXPECT_FALSE(decode_packed_runs(s.data(), 3, 2, p.data()));
}

TEST(PackedRuns, NoiseIsDecodedInBoundsOrRejected) {
  // Valid streams with bytes changed, and noise: every outcome stays inside
  // the plane (ASan, valgrind), and an accepted one is a plane.
  std::mt19937_64 rng(11);
  const Plane src = matrix_plane(40, 5, 20, 100, {3, 4, 50}, {7});
  const uint64_t bytes = packed_runs_bytes(src.data(), src.size(), 0, ~0ull);
  const std::vector<uint8_t> good = encode(src, bytes);
  int accepted = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    std::vector<uint8_t> s = good;
    if (trial % 2 == 0) {
      for (int n = 0; n < 1 + trial % 3; ++n) {
        s[4 + rng() % (s.size() - 4)] = static_cast<uint8_t>(rng());
      }
    } else {
      for (auto& b : s) {
        b = static_cast<uint8_t>(rng());
      }
      const uint32_t len = static_cast<uint32_t>(rng() % s.size());
      std::memcpy(s.data(), &len, 4);
    }
    Plane out(src.size());
    accepted += decode_packed_runs(s.data(), s.size(), out.size(), out.data()) ? 1 : 0;
  }
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, 20000);
}

} // namespace
} // namespace lionbit::bits
