// Fuzz tests of everything a peer sends that lionbit parses: the 64-byte
// headers of the header round (bits::check_headers) and the encoded zero /
// tie positions (bits::decode_zeros). Random and corrupted inputs must give
// an error (or `false`) or a result that satisfies every invariant the sign
// all-reduce relies on afterwards - never a read or write out of bounds
// (run under ASan/UBSan by `make test-sanitize`, under valgrind by
// `make test-valgrind`).
//
// LIONBIT_FUZZ_ITERS scales the number of cases (default 1: a few seconds).
#include "signbits/packed_runs.h"
#include "signbits/wire.h"
#include "signbits/zeros.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace lionbit::bits {
namespace {

uint64_t scale() {
  const char* env = std::getenv("LIONBIT_FUZZ_ITERS");
  const long v = env ? std::atol(env) : 1;
  return v > 0 ? static_cast<uint64_t>(v) : 1;
}

// --- headers ----------------------------------------------------------------

// What must hold of headers that check_headers accepts, written from the
// wire contract (wire.h), not from check_headers' code.
bool acceptable(const std::vector<WireHeader>& h, int n, const WireHeader& mine) {
  const uint64_t largest_chunk = mine.chunk_elems == 0 ? mine.numel
                                                       : std::min(mine.numel, mine.chunk_elems);
  const uint64_t shard_elems = shard_words(largest_chunk, n) * kWordBits;
  for (int r = 0; r < n; ++r) {
    const WireHeader& x = h[static_cast<size_t>(r)];
    if (x.magic != kWireMagic || x.version != kWireVersion || x.rank != static_cast<uint32_t>(r))
      return false;
    if (x.op < 1 || x.op > 4 || x.dtype < 1 || x.dtype > 5) return false;
    // The tie rule: 0..2, not zero only for vote (1) and l1 (4); the bits:
    // 2..8 for l1, 0 otherwise; the reserved bytes clear; all as this rank's.
    const bool votes = x.op == 1 || x.op == 4;
    if (x.tie_break > 2 || (!votes && x.tie_break != 0)) return false;
    if (x.op == 4 ? (x.value_bits < 2 || x.value_bits > 8) : x.value_bits != 0) return false;
    for (uint8_t b : x.reserved)
      if (b != 0) return false;
    if (x.tie_break != mine.tie_break || x.tie_seed != mine.tie_seed ||
        x.value_bits != mine.value_bits)
      return false;
    if (x.flags &
        ~(kHasZero | kHasNan | kRejected | kReduceScatter | kDevice | kTieHint | kHierExact |
          kHierNodeVote | kTwoPhase))
      return false;
    // One hierarchy at most.
    if ((x.flags & kHierExact) && (x.flags & kHierNodeVote)) return false;
    if (x.flags & (kRejected | kHasNan)) return false;
    // The kind of collective, the tensor's device type, the hierarchy and the
    // two-rank exchange setting must match this rank's.
    if ((x.flags ^ mine.flags) &
        (kReduceScatter | kDevice | kHierExact | kHierNodeVote | kTwoPhase))
      return false;
    if (x.seq != mine.seq || x.op != mine.op || x.dtype != mine.dtype || x.numel != mine.numel ||
        x.chunk_elems != mine.chunk_elems || x.numel > kMaxNumel)
      return false;
    // The most zeros of any shard: with the flag, at most a shard (or
    // saturated); what this rank is sent: at most that and a shard.
    const bool has_zero = (x.flags & kHasZero) != 0;
    if (has_zero != (x.zero_most > 0) || x.zero_most > shard_elems) return false;
    if (x.zero_capacity > shard_elems || (x.zero_capacity > x.zero_most && x.zero_most != ~0u))
      return false;
    if ((x.zero_runs > 0) != (x.zero_capacity > 0) || x.zero_runs > x.zero_capacity) return false;
    // Packed runs: none, or a whole number of words below the shard's plane,
    // only with zeros.
    if (x.zero_packed > 0 &&
        (x.zero_capacity == 0 || x.zero_packed % 8 != 0 || x.zero_packed >= shard_elems / 8))
      return false;
  }
  return true;
}

struct HeaderCase {
  int n;
  int me;
  std::vector<WireHeader> h;
};

HeaderCase agreeing_case(std::mt19937_64& rng) {
  HeaderCase c;
  c.n = std::uniform_int_distribution<int>(1, 64)(rng);
  c.me = std::uniform_int_distribution<int>(0, c.n - 1)(rng);
  const auto op = static_cast<SignOp>(std::uniform_int_distribution<int>(1, 4)(rng));
  CallRule rule;
  if (op == SignOp::kVote || op == SignOp::kLevels) {
    rule.tie.mode = static_cast<TieBreak>(rng() % 3);
    rule.tie.seed = rng() % 2 ? rng() % 100 : rng();
  }
  if (op == SignOp::kLevels) {
    rule.value_bits = std::uniform_int_distribution<int>(2, 8)(rng);
  }
  const auto dtype = static_cast<DType>(std::uniform_int_distribution<int>(1, 5)(rng));
  const uint64_t seq = rng() % 1000;
  const uint64_t numel = rng() % 4 == 0 ? rng() % 200 : rng() % 20000000;
  const uint64_t chunk = chunk_elems_for(rng() % 2 ? (uint64_t{1} << 22) : 1 + rng() % 100000, c.n);
  const uint64_t largest = std::min(numel, chunk);
  const uint64_t shard_elems = shard_words(largest, c.n) * kWordBits;
  for (int r = 0; r < c.n; ++r) {
    ZeroCode code;
    if (shard_elems > 0 && rng() % 3 == 0) {
      code.zeros = 1 + rng() % shard_elems;
      code.runs = 1 + rng() % code.zeros;
      if (shard_elems >= 128 && rng() % 2) {
        code.packed = 8 * (1 + rng() % (shard_elems / 64 - 1));
      }
    }
    const uint32_t hint = rng() % 2 ? kTieHint : 0u; // a rank's own expectation
    WireHeader h = make_header(
        op, dtype, r, (code.zeros ? kHasZero : 0u) | hint, seq, numel, code, chunk, rule);
    if (code.zeros > 0 && rng() % 2) { // this rank's shard has fewer zeros, or none
      ZeroCode to;
      to.zeros = rng() % (code.zeros + 1);
      to.runs = to.zeros > 0 ? 1 + rng() % std::min(to.zeros, code.runs) : 0;
      to.packed = to.zeros > 0 && code.packed > 8 ? 8 * (1 + rng() % (code.packed / 8 - 1)) : 0;
      h = address_header(h, to);
    }
    c.h.push_back(h);
  }
  return c;
}

void mutate(HeaderCase& c, std::mt19937_64& rng) {
  const int times = std::uniform_int_distribution<int>(1, 3)(rng);
  for (int t = 0; t < times; ++t) {
    WireHeader& x = c.h[rng() % c.h.size()];
    auto* bytes = reinterpret_cast<uint8_t*>(&x);
    switch (rng() % 8) {
      case 0: // one flipped bit
        bytes[rng() % sizeof x] ^= static_cast<uint8_t>(1u << (rng() % 8));
        break;
      case 1: // one random byte
        bytes[rng() % sizeof x] = static_cast<uint8_t>(rng());
        break;
      case 2: // a whole random header
        for (size_t i = 0; i < sizeof x; ++i) bytes[i] = static_cast<uint8_t>(rng());
        break;
      case 3: // boundary sizes
        x.numel = std::vector<uint64_t>{0, 1, kMaxNumel, kMaxNumel + 1, ~0ull}[rng() % 5];
        break;
      case 4: // zero capacity and runs at and past the shard, with or without the flag
        if (rng() % 4 == 0) {
          x.zero_most = std::vector<uint32_t>{
              0,
              1,
              static_cast<uint32_t>(x.zero_capacity),
              static_cast<uint32_t>(x.zero_capacity) - 1,
              static_cast<uint32_t>(x.numel),
              ~0u}[rng() % 6];
        } else if (rng() % 2) {
          x.zero_capacity = std::vector<uint64_t>{
              0, 1, x.numel, x.numel + 1, ~0ull, 1ull << 32}[rng() % 6];
        } else if (rng() % 2) {
          x.zero_runs = std::vector<uint32_t>{
              0, 1, static_cast<uint32_t>(x.zero_capacity),
              static_cast<uint32_t>(x.zero_capacity + 1), ~0u}[rng() % 5];
        } else {
          x.zero_packed = std::vector<uint32_t>{
              0, 4, 8, 9, static_cast<uint32_t>(x.numel / 8), ~0u, 1u << 20}[rng() % 7];
        }
        if (rng() % 2) x.flags ^= kHasZero;
        break;
      case 5: // a peer's chunking, or its tie rule and bits
        if (rng() % 2) {
          x.chunk_elems = rng() % 2 ? 0 : rng();
        } else {
          x.tie_break = static_cast<uint8_t>(rng() % 4);
          x.value_bits = static_cast<uint8_t>(rng() % 10);
          if (rng() % 2) x.tie_seed ^= 1;
        }
        break;
      case 6: // all-ones or all-zero header
        std::memset(bytes, rng() % 2 ? 0xff : 0x00, sizeof x);
        break;
      default: // flags
        x.flags = static_cast<uint32_t>(rng() % 64);
        break;
    }
  }
}

void check_one(const HeaderCase& c) {
  const WireHeader mine = c.h[static_cast<size_t>(c.me)];
  // The received headers live in a buffer of exactly n headers: ASan sees
  // any read past it.
  std::vector<WireHeader> recv(c.h);
  const HeaderSummary s = check_headers(recv.data(), c.n, mine);
  const bool ok = acceptable(c.h, c.n, mine);
  ASSERT_EQ(s.error.empty(), ok) << "n=" << c.n << " me=" << c.me << " error: " << s.error;
  if (!ok) {
    return;
  }
  // What the collective computes from an accepted summary stays in bounds:
  // every peer's zero encoding of every chunk is at most a dense plane.
  ASSERT_EQ(s.zero_codes.size(), static_cast<size_t>(c.n));
  bool any = false;
  const uint64_t chunk = mine.chunk_elems == 0 ? mine.numel : mine.chunk_elems;
  for (int r = 0; r < c.n; ++r) {
    const ZeroCode cap = s.zero_codes[static_cast<size_t>(r)];
    EXPECT_EQ(cap.zeros, c.h[static_cast<size_t>(r)].zero_capacity);
    EXPECT_EQ(cap.runs, c.h[static_cast<size_t>(r)].zero_runs);
    EXPECT_EQ(cap.packed, c.h[static_cast<size_t>(r)].zero_packed);
    any = any || cap.zeros > 0;
    if (mine.numel > 0) {
      for (uint64_t len :
           {std::min(mine.numel, chunk), mine.numel % std::max<uint64_t>(chunk, 1), uint64_t{1}}) {
        if (len == 0) continue;
        const size_t sw = shard_words(len, c.n);
        EXPECT_LE(zero_encoding_bytes(cap, sw), sw * 8)
            << "cap " << cap.zeros << "/" << cap.runs << "/" << cap.packed << " sw " << sw;
      }
    }
  }
  for (int r = 0; r < c.n; ++r) {
    EXPECT_EQ(s.zero_most[static_cast<size_t>(r)], c.h[static_cast<size_t>(r)].zero_most);
    any = any || s.zero_most[static_cast<size_t>(r)] > 0;
  }
  EXPECT_EQ(s.any_zero, any);
  // The tie plane travels inline iff every rank hinted it: one answer on
  // every rank, whatever each one expected.
  bool all_hint = true;
  for (const auto& x : c.h) all_hint = all_hint && (x.flags & kTieHint) != 0;
  EXPECT_EQ(s.inline_ties, all_hint);
}

TEST(FuzzHeaders, CorruptedHeadersAreRejectedOrFullyValid) {
  std::mt19937_64 rng(20240607);
  uint64_t accepted = 0, rejected = 0;
  for (uint64_t i = 0; i < 20000 * scale(); ++i) {
    HeaderCase c = agreeing_case(rng);
    if (rng() % 8 != 0) {
      mutate(c, rng);
    }
    const WireHeader mine = c.h[static_cast<size_t>(c.me)];
    check_one(c);
    if (HasFatalFailure()) return;
    (check_headers(c.h.data(), c.n, mine).error.empty() ? accepted : rejected) += 1;
  }
  // Both outcomes are exercised.
  EXPECT_GT(accepted, 1000u);
  EXPECT_GT(rejected, 10000u);
}

TEST(FuzzHeaders, RandomBytesAreRejected) {
  std::mt19937_64 rng(77);
  for (uint64_t i = 0; i < 20000 * scale(); ++i) {
    const int n = std::uniform_int_distribution<int>(1, 16)(rng);
    std::vector<WireHeader> h(static_cast<size_t>(n));
    auto* bytes = reinterpret_cast<uint8_t*>(h.data());
    for (size_t b = 0; b < sizeof(WireHeader) * h.size(); ++b)
      bytes[b] = static_cast<uint8_t>(rng());
    const int me = static_cast<int>(rng() % static_cast<uint64_t>(n));
    WireHeader mine = make_header(
        SignOp::kVote, DType::kFloat32, me, 0, 0, 100, {}, chunk_elems_for(1 << 22, n));
    h[static_cast<size_t>(me)] = mine;
    const HeaderSummary s = check_headers(h.data(), n, mine);
    if (n > 1) {
      EXPECT_NE(s.error.find("rank "), std::string::npos) << s.error;
    } else {
      EXPECT_EQ(s.error, "");
    }
  }
}

// --- zero / tie position lists and runs -------------------------------------

// Decodes `wire` (exactly zero_encoding_bytes(code, words) bytes) into a
// plane of exactly `words` words; if accepted, checks the plane is
// canonical: at most code.zeros bits in at most code.runs runs (lists: the
// bits), and encoding it again gives the same bytes back.
bool decode_and_check(const std::vector<uint8_t>& wire, size_t words, const ZeroCode& code) {
  // Own heap blocks of the exact sizes: ASan / valgrind catch any overrun.
  std::unique_ptr<uint8_t[]> in(new uint8_t[std::max<size_t>(wire.size(), 1)]);
  std::memcpy(in.get(), wire.data(), wire.size());
  std::unique_ptr<uint64_t[]> plane(new uint64_t[words]);
  std::fill(plane.get(), plane.get() + words, 0x5a5a5a5a5a5a5a5aull);
  const ZeroForm form = zero_form(code, words);
  if (!decode_zeros(in.get(), words, code, plane.get())) {
    EXPECT_TRUE(form == ZeroForm::kList || form == ZeroForm::kRuns || form == ZeroForm::kPacked)
        << "a dense plane is never rejected";
    return false;
  }
  if (form == ZeroForm::kPlane) {
    EXPECT_EQ(std::memcmp(plane.get(), wire.data(), words * 8), 0);
    return true;
  }
  if (form == ZeroForm::kPacked) {
    // Packed runs have many spellings (a repeat or the runs it stands for):
    // what was accepted is a plane, and its own packing, where it fits the
    // code, decodes to it.
    const uint64_t bytes = packed_runs_bytes(plane.get(), words, 0, code.packed);
    if (bytes > 0) {
      std::vector<uint8_t> again(code.packed, 0);
      encode_zeros(plane.get(), words, code, again.data());
      std::vector<uint64_t> back(words);
      EXPECT_TRUE(decode_zeros(again.data(), words, code, back.data()));
      EXPECT_EQ(std::memcmp(back.data(), plane.get(), words * 8), 0);
    }
    return true;
  }
  if (form == ZeroForm::kList) {
    EXPECT_LE(count_bits(plane.get(), words), code.zeros);
  } else {
    EXPECT_LE(count_runs(plane.get(), words), code.runs);
  }
  std::vector<uint8_t> again(wire.size(), 0);
  encode_zeros(plane.get(), words, code, again.data());
  EXPECT_EQ(again, wire) << "accepted a non-canonical " << zero_form_name(form) << " (words "
                         << words << ", code " << code.zeros << "/" << code.runs << ")";
  return true;
}

uint64_t random_capacity(size_t words, std::mt19937_64& rng) {
  const uint64_t limit = words * kWordBits;
  switch (rng() % 4) {
    case 0:
      return 1 + rng() % 4;
    case 1:
      return 1 + rng() % std::max<uint64_t>(words, 1);
    case 2:
      return 1 + rng() % (limit + 8); // past the plane too
    default:
      return 1 + rng() % (2 * words + 2); // around the list/plane switch
  }
}

// A code as a peer could announce it: without runs (a list), or with up to
// as many runs as zeros, around the runs/plane switch too.
ZeroCode random_code(size_t words, std::mt19937_64& rng) {
  const uint64_t zeros = random_capacity(words, rng);
  switch (rng() % (words >= 2 ? 4 : 3)) {
    case 3: // packed runs, of a few bytes up to just below the plane
      return ZeroCode{
          zeros, zeros, 8 * (1 + rng() % std::min<uint64_t>(words - 1, rng() % 2 ? 4 : words))};
    case 0:
      return ZeroCode::at_most(zeros);
    case 1:
      return ZeroCode{zeros, 1 + rng() % std::min<uint64_t>(zeros, 6)};
    default:
      return ZeroCode{zeros, 1 + rng() % std::min<uint64_t>(zeros, words + 2)};
  }
}

TEST(FuzzZeros, RandomBytesDecodeToACanonicalPlaneOrFail) {
  std::mt19937_64 rng(4242);
  uint64_t lists = 0, runs = 0, packed = 0;
  for (uint64_t i = 0; i < 30000 * scale(); ++i) {
    const size_t words = 1 + rng() % 300;
    const ZeroCode code = random_code(words, rng);
    std::vector<uint8_t> wire(zero_encoding_bytes(code, words));
    for (auto& b : wire) b = static_cast<uint8_t>(rng());
    lists += zero_form(code, words) == ZeroForm::kList;
    runs += zero_form(code, words) == ZeroForm::kRuns;
    packed += zero_form(code, words) == ZeroForm::kPacked;
    if (packed % 3 == 0 && zero_form(code, words) == ZeroForm::kPacked && wire.size() >= 8) {
      // A plausible L (random bytes give one rarely), so the tokens are read.
      const uint32_t len = static_cast<uint32_t>(rng() % (wire.size() - 3));
      std::memcpy(wire.data(), &len, 4);
      std::fill(wire.begin() + 4 + len, wire.end(), 0);
    }
    decode_and_check(wire, words, code);
    if (HasFailure()) return;
  }
  EXPECT_GT(lists, 5000u);
  EXPECT_GT(runs, 5000u);
  EXPECT_GT(packed, 2000u);
}

// A plane of bits (scattered) or of runs (clustered) no larger than `words`
// words allow.
std::vector<uint64_t> random_plane(size_t words, bool clustered, std::mt19937_64& rng) {
  std::vector<uint64_t> plane(words, 0);
  const uint64_t limit = words * kWordBits;
  const uint64_t pieces = rng() % (words / 2 + 2);
  for (uint64_t b = 0; b < pieces; ++b) {
    const uint64_t at = rng() % limit;
    const uint64_t len = clustered ? 1 + rng() % 200 : 1;
    for (uint64_t i = at; i < std::min(limit, at + len); ++i) {
      plane[i / 64] |= 1ull << (i % 64);
    }
  }
  return plane;
}

TEST(FuzzZeros, MutatedValidEncodingsDecodeCanonicallyOrFail) {
  std::mt19937_64 rng(99);
  uint64_t accepted = 0, rejected = 0, runs = 0;
  for (uint64_t i = 0; i < 30000 * scale(); ++i) {
    const size_t words = 2 + rng() % 300;
    const bool clustered = rng() % 2;
    const std::vector<uint64_t> plane = random_plane(words, clustered, rng);
    const uint64_t have = count_bits(plane.data(), words);
    const uint64_t have_runs = count_runs(plane.data(), words);
    const ZeroCode code = clustered
        ? ZeroCode{std::max<uint64_t>(1, have + rng() % 3), std::max<uint64_t>(1, have_runs + rng() % 2)}
        : ZeroCode::at_most(std::max<uint64_t>(1, have + rng() % 3));
    std::vector<uint8_t> wire(zero_encoding_bytes(code, words));
    encode_zeros(plane.data(), words, code, wire.data());
    const ZeroForm form = zero_form(code, words);
    if (form != ZeroForm::kList && form != ZeroForm::kRuns) continue;
    runs += form == ZeroForm::kRuns;
    // The valid message itself decodes, to the plane.
    std::vector<uint64_t> back(words);
    ASSERT_TRUE(decode_zeros(wire.data(), words, code, back.data()));
    ASSERT_EQ(back, plane);
    ASSERT_TRUE(decode_and_check(wire, words, code));
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) {
      const size_t byte = rng() % wire.size();
      if (rng() % 2) {
        wire[byte] ^= static_cast<uint8_t>(1u << (rng() % 8));
      } else {
        wire[byte] = rng() % 2 ? 0xff : 0x00;
      }
    }
    (decode_and_check(wire, words, code) ? accepted : rejected) += 1;
    if (HasFailure()) return;
  }
  EXPECT_GT(rejected, 1000u);
  EXPECT_GT(accepted, 100u); // a changed offset or run still in range and in order
  EXPECT_GT(runs, 3000u);
}

TEST(FuzzZeros, HugePlanesNeverUseListsTheyCannotIndex) {
  // 32-bit offsets: a plane of 2^32 elements or more must go dense whatever
  // code a peer announces; no encoding may exceed the plane.
  for (size_t words :
       {size_t{1} << 26, (size_t{1} << 26) - 1, (size_t{1} << 26) + 1, size_t{1} << 30}) {
    for (uint64_t cap : {uint64_t{1}, uint64_t{2}, uint64_t{1} << 20, uint64_t{words}}) {
      for (const ZeroCode code : {ZeroCode::at_most(cap), ZeroCode{cap, 1}}) {
        if (words * kWordBits >= kNoIndex) {
          EXPECT_EQ(zero_form(code, words), ZeroForm::kPlane) << words << " " << cap;
        }
        EXPECT_LE(zero_encoding_bytes(code, words), words * 8);
      }
    }
  }
}

} // namespace
} // namespace lionbit::bits
