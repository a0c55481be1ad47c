#include "signbits/wire.h"

#include <gtest/gtest.h>

#include <tuple>
#include <vector>

namespace lionbit::bits {
namespace {

std::vector<WireHeader> agreeing(int n, uint64_t numel = 1000) {
  std::vector<WireHeader> h;
  for (int r = 0; r < n; ++r) {
    h.push_back(make_header(SignOp::kVote, DType::kFloat32, r, 0, 7, numel));
  }
  return h;
}

TEST(Wire, AgreeingHeadersPass) {
  auto h = agreeing(4);
  h[2].flags |= kHasZero;
  h[2].zero_most = 7;
  h[2].zero_capacity = 3;
  h[2].zero_runs = 2;
  h[3].flags |= kHasZero;
  h[3].zero_most = 5; // zeros elsewhere, none in what rank 3 sends this rank
  const HeaderSummary s = check_headers(h.data(), 4, h[1]);
  EXPECT_EQ(s.error, "");
  EXPECT_TRUE(s.any_zero);
  EXPECT_EQ(s.zero_codes, (std::vector<ZeroCode>{{0, 0}, {0, 0}, {3, 2}, {0, 0}}));
  EXPECT_EQ(s.zero_most, (std::vector<uint64_t>{0, 0, 7, 5}));
}

TEST(Wire, HeadersAreAddressedToEachReceiver) {
  // make_header announces the most zeros to everyone; address_header gives
  // one receiver the code of what it is sent, the rest unchanged.
  const WireHeader h = make_header(
      SignOp::kVote, DType::kFloat32, 1, kHasZero, 7, 1000, ZeroCode{40, 9, 16});
  EXPECT_EQ(h.zero_most, 40u);
  EXPECT_EQ(h.zero_capacity, 40u);
  EXPECT_EQ(h.zero_runs, 9u);
  EXPECT_EQ(h.zero_packed, 16u);
  const WireHeader a = address_header(h, ZeroCode{2, 1, 0});
  EXPECT_EQ(a.zero_most, 40u);
  EXPECT_EQ(a.zero_capacity, 2u);
  EXPECT_EQ(a.zero_runs, 1u);
  EXPECT_EQ(a.zero_packed, 0u);
  EXPECT_EQ(a.numel, h.numel);
  EXPECT_EQ(a.flags, h.flags);
  const WireHeader none = address_header(h, ZeroCode{});
  auto all = agreeing(4);
  all[1] = none; // rank 1 sends this rank nothing but signs
  const HeaderSummary s = check_headers(all.data(), 4, all[0]);
  EXPECT_EQ(s.error, "");
  EXPECT_TRUE(s.any_zero);
  EXPECT_EQ(s.zero_codes[1], ZeroCode{});
  // More zeros addressed than the sender's most: corrupt.
  all[1] = address_header(h, ZeroCode{41, 1, 0});
  EXPECT_NE(check_headers(all.data(), 4, all[0]).error.find("most zeros 40"), std::string::npos);
}

TEST(Wire, ZeroCapacityIsCheckedAgainstTheShard) {
  // 1000 elements over 4 ranks: shards of 256 elements.
  // (flag, zeros, runs): no zeros with the flag, zeros without it, more
  // zeros than the shard, zeros without runs, runs without zeros, more runs
  // than zeros.
  for (auto [flag, cap, runs] :
       {std::tuple{true, 0ull, 0u}, std::tuple{false, 5ull, 1u}, std::tuple{true, 257ull, 1u},
        std::tuple{true, 5ull, 0u}, std::tuple{false, 0ull, 1u}, std::tuple{true, 5ull, 6u}}) {
    auto h = agreeing(4);
    if (flag) h[3].flags |= kHasZero;
    h[3].zero_most = static_cast<uint32_t>(cap);
    h[3].zero_capacity = cap;
    h[3].zero_runs = runs;
    const HeaderSummary s = check_headers(h.data(), 4, h[0]);
    EXPECT_NE(s.error.find("rank 3 sent a corrupt header (zero capacity"), std::string::npos)
        << flag << " " << cap << " " << runs << ": " << s.error;
  }
  auto h = agreeing(4);
  h[3].flags |= kHasZero;
  h[3].zero_most = 256;
  h[3].zero_capacity = 256; // a whole shard of zeros is fine
  h[3].zero_runs = 1;
  EXPECT_EQ(check_headers(h.data(), 4, h[0]).error, "");
}

TEST(Wire, BadMagicNamesTheRank) {
  auto h = agreeing(3);
  h[2].magic = 0x12345678;
  const HeaderSummary s = check_headers(h.data(), 3, h[0]);
  EXPECT_NE(s.error.find("rank 2 sent a malformed header"), std::string::npos) << s.error;
}

TEST(Wire, CorruptFieldsAreCaughtBeforeUse) {
  for (int field = 0; field < 5; ++field) {
    auto h = agreeing(3);
    switch (field) {
      case 0:
        h[1].rank = 9;
        break;
      case 1:
        h[1].op = 77;
        break;
      case 2:
        h[1].dtype = 0;
        break;
      case 3:
        h[1].numel = ~0ull;
        break;
      case 4:
        h[1].flags = 0x80000000u;
        break;
    }
    const HeaderSummary s = check_headers(h.data(), 3, h[0]);
    EXPECT_NE(s.error.find("rank 1 sent a corrupt header"), std::string::npos)
        << field << ": " << s.error;
  }
}

TEST(Wire, MismatchesNameBothRanks) {
  {
    auto h = agreeing(4);
    h[3].numel = 999;
    const auto s = check_headers(h.data(), 4, h[0]);
    EXPECT_NE(s.error.find("rank 0 has 1000, rank 3 has 999"), std::string::npos) << s.error;
  }
  {
    auto h = agreeing(2);
    h[1].dtype = static_cast<uint8_t>(DType::kBFloat16);
    const auto s = check_headers(h.data(), 2, h[0]);
    EXPECT_NE(s.error.find("rank 0 has float32, rank 1 has bfloat16"), std::string::npos)
        << s.error;
  }
  {
    auto h = agreeing(2);
    h[1].op = static_cast<uint8_t>(SignOp::kSum);
    const auto s = check_headers(h.data(), 2, h[0]);
    EXPECT_NE(s.error.find("rank 0 has vote, rank 1 has sum"), std::string::npos) << s.error;
  }
  {
    auto h = agreeing(2);
    h[1].seq = 8;
    const auto s = check_headers(h.data(), 2, h[0]);
    EXPECT_NE(s.error.find("order"), std::string::npos) << s.error;
  }
}

TEST(Wire, TiePlaneInlineOnlyWhenEveryRankHintsIt) {
  auto h = agreeing(3);
  EXPECT_FALSE(check_headers(h.data(), 3, h[0]).inline_ties);
  for (auto& x : h) x.flags |= kTieHint;
  EXPECT_TRUE(check_headers(h.data(), 3, h[1]).inline_ties);
  h[2].flags &= ~kTieHint; // ranks may disagree: no error, no inline plane
  for (int r = 0; r < 3; ++r) {
    const auto s = check_headers(h.data(), 3, h[r]);
    EXPECT_EQ(s.error, "");
    EXPECT_FALSE(s.inline_ties);
  }
}

TEST(Wire, CudaAndCpuTensorsCannotMeet) {
  // The CUDA path moves dense planes, the CPU path zero lists and chunks: a
  // rank with a CUDA tensor and one with a CPU tensor must fail together,
  // before the chunk sizes (which differ between the paths) are compared.
  auto h = agreeing(3);
  for (auto& x : h) x.flags |= kDevice;
  EXPECT_EQ(check_headers(h.data(), 3, h[0]).error, "");
  h[2].flags &= ~kDevice;
  h[2].chunk_elems = 4096;
  const auto s = check_headers(h.data(), 3, h[0]);
  EXPECT_NE(
      s.error.find(
          "device type differs across ranks: rank 0 has a CUDA tensor, rank 2 a CPU tensor"),
      std::string::npos)
      << s.error;
}

TEST(Wire, ChunkSizeMustAgreeAndBoundsTheZeroCapacity) {
  auto h = agreeing(2, 10000);
  for (auto& x : h) x.chunk_elems = 1024; // shards of 512 elements
  h[1].chunk_elems = 2048;
  EXPECT_NE(check_headers(h.data(), 2, h[0]).error.find("chunk size differs"), std::string::npos);
  h[1].chunk_elems = 1024;
  h[1].flags |= kHasZero;
  h[1].zero_most = 513;
  h[1].zero_capacity = 513;
  h[1].zero_runs = 1;
  EXPECT_NE(check_headers(h.data(), 2, h[0]).error.find("zero capacity 513"), std::string::npos);
  h[1].zero_most = 512;
  h[1].zero_capacity = 512;
  EXPECT_EQ(check_headers(h.data(), 2, h[0]).error, "");
  EXPECT_EQ(chunk_elems_for(0, 4), 256u);
  EXPECT_EQ(chunk_elems_for(1000, 4), 1024u);
  EXPECT_EQ(chunk_elems_for(1 << 22, 3), 4194432u);
  // The default: 4M, and at least 256K elements a shard from N = 16 on.
  EXPECT_EQ(default_chunk_elems(1), uint64_t{1} << 22);
  EXPECT_EQ(default_chunk_elems(16), uint64_t{1} << 22);
  EXPECT_EQ(default_chunk_elems(17), uint64_t{17} << 18);
  EXPECT_EQ(default_chunk_elems(4096), uint64_t{1} << 30);
  EXPECT_EQ(default_chunk_elems(8, true), uint64_t{1} << 28);
  EXPECT_EQ(default_chunk_elems(1024, true), uint64_t{1} << 28);
  EXPECT_EQ(default_chunk_elems(2048, true), uint64_t{1} << 29);
  EXPECT_EQ(chunk_elems_for(default_chunk_elems(4096), 4096) / 4096, uint64_t{1} << 18);
}

TEST(Wire, NanAndRejectionAreReportedOnEveryRank) {
  auto h = agreeing(5);
  h[1].flags |= kHasNan;
  h[4].flags |= kHasNan;
  for (int me = 0; me < 5; ++me) {
    const auto s = check_headers(h.data(), 5, h[static_cast<size_t>(me)]);
    EXPECT_NE(s.error.find("NaN on rank(s) [1, 4]"), std::string::npos) << s.error;
    EXPECT_EQ(s.verdict, HeaderVerdict::kNonFinite);
    EXPECT_EQ(s.ranks, (std::vector<int>{1, 4}));
  }
  h[2].flags |= kRejected; // a rejection comes before the NaN
  const auto s = check_headers(h.data(), 5, h[0]);
  EXPECT_NE(s.error.find("rank(s) [2] rejected"), std::string::npos) << s.error;
  EXPECT_EQ(s.verdict, HeaderVerdict::kRejected);
  EXPECT_EQ(s.ranks, (std::vector<int>{2}));
}

// A group of global ranks [6, 2, 9] (an HSDP replica group, say): every
// message and `ranks` name them so; without names, as the group numbers them.
TEST(Wire, ErrorsNameRanksAsTheCallerNamesThem) {
  const std::vector<int> names{6, 2, 9};
  auto h = agreeing(3);
  h[1].flags |= kHasNan;
  h[2].flags |= kHasNan;
  auto s = check_headers(h.data(), 3, h[0], names);
  EXPECT_NE(s.error.find("NaN on rank(s) [2, 9]"), std::string::npos) << s.error;
  EXPECT_EQ(s.ranks, (std::vector<int>{2, 9}));
  EXPECT_EQ(check_headers(h.data(), 3, h[0]).ranks, (std::vector<int>{1, 2}));
  h[0].flags |= kRejected;
  s = check_headers(h.data(), 3, h[1], names);
  EXPECT_NE(s.error.find("rank(s) [6] rejected"), std::string::npos) << s.error;
  EXPECT_EQ(s.ranks, (std::vector<int>{6}));
  h = agreeing(3);
  h[2].numel = 7;
  s = check_headers(h.data(), 3, h[1], names);
  EXPECT_NE(s.error.find("rank 2 has 1000, rank 9 has 7"), std::string::npos) << s.error;
  h = agreeing(3);
  h[2].magic = 0;
  s = check_headers(h.data(), 3, h[0], names);
  EXPECT_NE(s.error.find("rank 9 sent a malformed header"), std::string::npos) << s.error;
}

TEST(Wire, OtherFailuresAreFaultsNamingNoRanks) {
  auto h = agreeing(3);
  EXPECT_EQ(check_headers(h.data(), 3, h[0]).verdict, HeaderVerdict::kAgree);
  h[2].numel = 7;
  h[1].flags |= kHasNan; // the mismatch is found first
  const auto s = check_headers(h.data(), 3, h[0]);
  EXPECT_EQ(s.verdict, HeaderVerdict::kFault);
  EXPECT_TRUE(s.ranks.empty());
}

TEST(Wire, ReduceScatterAndAllReduceAtTheSameCallDisagree) {
  auto h = agreeing(3, 3 * 100);
  for (auto& x : h) {
    x.flags |= kReduceScatter;
  }
  EXPECT_EQ(check_headers(h.data(), 3, h[0]).error, "");
  h[2].flags &= ~kReduceScatter;
  for (int me = 0; me < 3; ++me) {
    const auto s = check_headers(h.data(), 3, h[static_cast<size_t>(me)]);
    EXPECT_NE(s.error.find("collective differs across ranks at call #7"), std::string::npos)
        << s.error;
  }
}

TEST(Wire, TheHierarchyMustAgreeAndBeOne) {
  auto h = agreeing(4);
  for (auto& x : h) {
    x.flags |= kHierExact;
  }
  EXPECT_EQ(check_headers(h.data(), 4, h[0]).error, "");
  h[1].flags = (h[1].flags & ~kHierExact) | kHierNodeVote;
  for (int me = 0; me < 4; ++me) {
    const auto s = check_headers(h.data(), 4, h[static_cast<size_t>(me)]);
    EXPECT_NE(s.error.find("the hierarchy differs across ranks at call #7"), std::string::npos)
        << s.error;
    EXPECT_NE(s.error.find("hierarchy 'node_vote'"), std::string::npos) << s.error;
  }
  h[1].flags = 0;
  EXPECT_NE(
      check_headers(h.data(), 4, h[0]).error.find("uses hierarchy 'flat'"), std::string::npos);
  // Both flags at once: no such call.
  h[1].flags = kHierExact | kHierNodeVote;
  EXPECT_NE(
      check_headers(h.data(), 4, h[0]).error.find("rank 1 sent a corrupt header"),
      std::string::npos);
}

TEST(Wire, TheTieRuleAndTheBitsMustAgree) {
  auto h = agreeing(4);
  for (auto& x : h) {
    x.tie_break = static_cast<uint8_t>(TieBreak::kAlternate);
    x.tie_seed = 5;
  }
  EXPECT_EQ(check_headers(h.data(), 4, h[0]).error, "");
  h[3].tie_seed = 6;
  std::string e = check_headers(h.data(), 4, h[0]).error;
  EXPECT_NE(
      e.find("the tie rule's seed differs across ranks: rank 0 has 5, rank 3 has 6"),
      std::string::npos)
      << e;
  h[3].tie_seed = 5;
  h[2].tie_break = static_cast<uint8_t>(TieBreak::kRandom);
  e = check_headers(h.data(), 4, h[0]).error;
  EXPECT_NE(e.find("the tie rule or the bits differ across ranks"), std::string::npos) << e;
  EXPECT_NE(e.find("rank 2 has tie_break=random (seed 5)"), std::string::npos) << e;
}

TEST(Wire, LevelsNeedTheirBitsAndOnlyVotesBreakTies) {
  std::vector<WireHeader> h;
  for (int r = 0; r < 2; ++r) {
    h.push_back(make_header(
        SignOp::kLevels, DType::kBFloat16, r, 0, 1, 1000, {}, 0,
        CallRule{TieRule{TieBreak::kRandom, 9}, 4}));
  }
  EXPECT_EQ(check_headers(h.data(), 2, h[0]).error, "");
  auto bad = h;
  bad[1].value_bits = 9; // past kMaxLevelBits
  EXPECT_NE(check_headers(bad.data(), 2, bad[0]).error.find("corrupt header"), std::string::npos);
  bad = h;
  bad[0].value_bits = bad[1].value_bits = 0; // l1 without bits
  EXPECT_NE(check_headers(bad.data(), 2, bad[0]).error.find("corrupt header"), std::string::npos);
  auto avg = agreeing(2);
  avg[0].op = avg[1].op = static_cast<uint8_t>(SignOp::kAvg);
  avg[0].tie_break = avg[1].tie_break = static_cast<uint8_t>(TieBreak::kAlternate);
  EXPECT_NE(check_headers(avg.data(), 2, avg[0]).error.find("corrupt header"), std::string::npos);
}

} // namespace
} // namespace lionbit::bits
