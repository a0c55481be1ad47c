#include "backend/phase2.hpp"

#include <algorithm>
#include <cstring>

#include "backend/sign_common.hpp"
#include "signbits/count.h"
#include "signbits/levels.h"
#include "signbits/ties.h"
#include "signbits/trits.h"
#include "signbits/unpack.h"
#include "signbits/zero_counts.h"
#include "signbits/zeros.h"

namespace lionbit {
namespace {

constexpr size_t kTieCountBytes = 8; // the u64 ahead of a vote message

std::vector<uint8_t> lut_of(bits::DType dtype, const std::vector<double>& values) {
  std::vector<uint8_t> lut(values.size() * bits::dtype_size(dtype));
  bits::make_lut(dtype, values.data(), values.size(), lut.data());
  return lut;
}

} // namespace

Phase2 Phase2::choose(
    bits::SignOp op,
    const bits::CallRule& rule,
    int N,
    size_t sw,
    bool inline_ties,
    const std::vector<uint64_t>& zero_capacity) {
  if (op == bits::SignOp::kVote || op == bits::SignOp::kLevels) {
    Phase2 fmt{Phase2Format::kVoteSigns, N, sw};
    if (rule.tie.mode != bits::TieBreak::kZero) {
      fmt.format = Phase2Format::kVoteBits;
    } else if (inline_ties) {
      fmt.format = Phase2Format::kVoteTrits;
    }
    fmt.op = op;
    fmt.rule = rule;
    return fmt;
  }
  uint64_t zeros = 0; // no shard holds more elements with a zero than this
  for (const uint64_t z : zero_capacity) {
    zeros += z;
  }
  const uint64_t shard_elems = sw * bits::kWordBits;
  zeros = std::min<uint64_t>(zeros, shard_elems);
  // A list of the elements with a zero when it is smaller than the extra
  // plane of the zero-aware code (offsets are 32 bits).
  if (zeros > 0 && shard_elems <= (uint64_t{1} << 32) &&
      bits::zero_count_list_bytes(zeros) < sw * 8) {
    return Phase2{Phase2Format::kCountsZeroList, N, sw, bits::code_planes(N, false), false, zeros};
  }
  return Phase2{Phase2Format::kCounts, N, sw, bits::code_planes(N, zeros > 0), zeros > 0};
}

size_t Phase2::message_bytes() const {
  const size_t sb = sw * 8;
  switch (format) {
    case Phase2Format::kVoteSigns:
      return kTieCountBytes + sb;
    case Phase2Format::kVoteTrits:
      return kTieCountBytes + (bits::kTritBytesPerWord * sw + 7) / 8 * 8;
    case Phase2Format::kVoteBits:
      return sb;
    case Phase2Format::kCounts:
      return static_cast<size_t>(planes) * sb;
    case Phase2Format::kCountsZeroList:
      return static_cast<size_t>(planes) * sb + bits::zero_count_list_bytes(list_cap);
  }
  return 0;
}

uint64_t Phase2::ties_in(const uint8_t* msg) {
  uint64_t ties;
  std::memcpy(&ties, msg, sizeof ties);
  return ties;
}

void Phase2::vote_shard(
    bits::SignOp op,
    int value_bits,
    const bits::Contribution* in,
    int N,
    size_t sw,
    uint64_t* sign,
    uint64_t* tie) {
  if (op != bits::SignOp::kLevels) {
    bits::vote(in, N, sw, sign, tie);
    return;
  }
  std::vector<const uint64_t*> planes(static_cast<size_t>(N));
  for (int j = 0; j < N; ++j) {
    planes[static_cast<size_t>(j)] = in[j].sign; // [plane 0 | plane 1 | ...], sw words each
  }
  bits::vote_levels(planes.data(), N, value_bits, sw, sign, tie);
}

std::string Phase2::encode(
    const bits::Contribution* in,
    uint64_t first_word,
    uint8_t* msg,
    uint64_t* ties) const {
  const size_t sb = sw * 8;
  auto* words = reinterpret_cast<uint64_t*>(msg);
  switch (format) {
    case Phase2Format::kVoteSigns:
      vote_shard(op, rule.value_bits, in, N, sw, words + 1, ties);
      words[0] = bits::count_bits(ties, sw);
      return "";
    case Phase2Format::kVoteBits: {
      std::vector<uint64_t> tie(sw);
      vote_shard(op, rule.value_bits, in, N, sw, words, tie.data());
      bits::break_ties(words, tie.data(), sw, rule.tie, first_word);
      return "";
    }
    case Phase2Format::kVoteTrits: {
      std::vector<uint64_t> planes(2 * sw);
      uint64_t* sign = planes.data();
      uint64_t* tie = sign + sw;
      vote_shard(op, rule.value_bits, in, N, sw, sign, tie);
      words[0] = bits::count_bits(tie, sw);
      words[message_bytes() / 8 - 1] = 0; // the padding
      bits::encode_trits(sign, tie, sw, msg + kTieCountBytes);
      return "";
    }
    case Phase2Format::kCounts:
      bits::count_code(in, N, sw, words);
      return "";
    case Phase2Format::kCountsZeroList: {
      std::vector<bits::Contribution> signs(in, in + N);
      for (auto& c : signs) {
        c.zero = nullptr; // a zero's sign bit is 0: counted as not positive
      }
      bits::count_code(signs.data(), N, sw, words);
      // list_cap bounds this shard's zeros summed over the senders.
      return bits::encode_zero_counts(in, N, sw, list_cap, msg + planes * sb)
          ? ""
          : "internal: more elements with a zero than announced";
    }
  }
  return "internal: unknown phase-2 format";
}

Phase2Decoder::Phase2Decoder(const Phase2& fmt, bits::SignOp op, bits::DType dtype, bool tie_planes)
    : fmt_(fmt), dtype_(dtype), tie_planes_(tie_planes) {
  switch (fmt.format) {
    case Phase2Format::kVoteSigns: // code = sign bit + 2 * tie bit
      lut_ = lut_of(
          dtype, tie_planes ? std::vector<double>{-1, 1, 0, 0} : std::vector<double>{-1, 1});
      break;
    case Phase2Format::kVoteTrits: // trit 0, 1, 2
      lut_ = lut_of(dtype, {-1, 1, 0});
      break;
    case Phase2Format::kVoteBits:
      lut_ = lut_of(dtype, {-1, 1});
      break;
    case Phase2Format::kCounts:
      lut_ = lut_of(dtype, count_code_values(op, fmt.N, fmt.with_zeros, fmt.planes));
      break;
    case Phase2Format::kCountsZeroList:
      lut_ = lut_of(dtype, count_code_values(op, fmt.N, false, fmt.planes));
      zero_lut_ = lut_of(dtype, count_code_values(op, fmt.N, true, fmt.planes + 1));
      break;
  }
}

std::string Phase2Decoder::decode(
    const uint8_t* msg,
    const uint64_t* tie_plane,
    size_t n,
    void* dst) const {
  const size_t sw = fmt_.sw;
  const auto* words = reinterpret_cast<const uint64_t*>(msg);
  switch (fmt_.format) {
    case Phase2Format::kVoteSigns: {
      const uint64_t* planes[2] = {words + 1, tie_plane};
      bits::unpack(dtype_, planes, tie_planes_ ? 2 : 1, n, lut_.data(), dst);
      return "";
    }
    case Phase2Format::kVoteBits:
      bits::unpack(dtype_, &words, 1, n, lut_.data(), dst);
      return "";
    case Phase2Format::kVoteTrits:
      return bits::decode_trits(dtype_, msg + kTieCountBytes, n, lut_.data(), dst)
          ? ""
          : "a corrupt vote message (a base-3 code above 242)";
    case Phase2Format::kCounts:
    case Phase2Format::kCountsZeroList: {
      std::vector<const uint64_t*> planes(static_cast<size_t>(fmt_.planes));
      for (int b = 0; b < fmt_.planes; ++b) {
        planes[b] = words + static_cast<size_t>(b) * sw;
      }
      bits::unpack(dtype_, planes.data(), fmt_.planes, n, lut_.data(), dst);
      // The listed elements (a zero somewhere) rewritten from the zero-aware
      // code 2 * positives + zeros.
      if (fmt_.format == Phase2Format::kCountsZeroList &&
          !bits::apply_zero_counts(
              msg + fmt_.planes * sw * 8, fmt_.list_cap, planes.data(), fmt_.planes, n, fmt_.N,
              zero_lut_.data(), bits::dtype_size(dtype_), dst)) {
        return "a corrupt count message (its list of elements with a zero)";
      }
      return "";
    }
  }
  return "a message of an unknown phase-2 format";
}

} // namespace lionbit
