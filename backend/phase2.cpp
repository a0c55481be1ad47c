#include "backend/phase2.hpp"

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "backend/sign_common.hpp"
#include "backend/torch_adapter.hpp"
#include "signbits/count.h"
#include "signbits/levels.h"
#include "signbits/ties.h"
#include "signbits/trits.h"
#include "signbits/unpack.h"
#include "signbits/zero_counts.h"
#include "signbits/zeros.h"

namespace lionbit {
namespace {

constexpr size_t kTieCountBytes = 16; // the two u64 ahead of a vote message

// The two u64 ahead of a vote message: the code of its shard's ties. The
// first holds the count in its low 32 bits and the runs in its high ones
// where a shard has fewer than 2^32 elements (the only shards whose zeros
// can travel as runs), the count alone otherwise (runs unknown:
// ZeroCode::at_most); the second the packed runs' bytes (0: not offered).
bool runs_fit(size_t sw) {
  return sw * bits::kWordBits < (uint64_t{1} << 32);
}

std::array<uint64_t, 2> tie_words(const bits::ZeroCode& ties, size_t sw) {
  return {
      runs_fit(sw) ? ties.zeros | (ties.runs << 32) : ties.zeros, runs_fit(sw) ? ties.packed : 0};
}

// False: not a code a shard of sw words can have.
bool tie_code(const uint64_t* words, size_t sw, bits::ZeroCode& ties) {
  ties = runs_fit(sw) ? bits::ZeroCode{words[0] & 0xffffffffu, words[0] >> 32, words[1]}
                      : bits::ZeroCode::at_most(words[0]);
  return ties.zeros <= sw * bits::kWordBits && ties.runs <= ties.zeros &&
      (ties.runs == 0) == (ties.zeros == 0) && (runs_fit(sw) || words[1] == 0) &&
      (ties.packed == 0 || (ties.zeros > 0 && ties.packed % 8 == 0 && ties.packed < sw * 8));
}

} // namespace

Phase2 Phase2::choose(
    bits::SignOp op,
    const bits::CallRule& rule,
    int N,
    size_t sw,
    bool inline_ties,
    const std::vector<uint64_t>& zero_most) {
  if (op == bits::SignOp::kVote || op == bits::SignOp::kLevels) {
    Phase2 fmt{inline_ties ? Phase2Format::kVoteTrits : Phase2Format::kVoteSigns, N, sw};
    fmt.op = op;
    fmt.rule = rule;
    return fmt;
  }
  uint64_t zeros = 0; // no shard holds more elements with a zero than this
  for (const uint64_t z : zero_most) {
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
    case Phase2Format::kCounts:
      return static_cast<size_t>(planes) * sb;
    case Phase2Format::kCountsZeroList:
      return static_cast<size_t>(planes) * sb + bits::zero_count_list_bytes(list_cap);
  }
  return 0;
}

namespace {

// Writes the tie code's words into the head of a message on any device
// (off the CPU from pinned memory, without waiting for the stream).
void put_words(at::Tensor& msg, const std::array<uint64_t, 2>& words) {
  if (msg.is_cpu()) {
    std::memcpy(bytes_of(msg), words.data(), kTieCountBytes);
    return;
  }
  at::Tensor host = at::empty(
      {static_cast<int64_t>(kTieCountBytes)},
      at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(bytes_of(host), words.data(), kTieCountBytes);
  msg.narrow(0, 0, static_cast<int64_t>(kTieCountBytes)).copy_(host, /*non_blocking=*/true);
}

// The code of a shard's ties (ZeroCode{} without any): one read of the
// plane's tallies, a host round trip on a GPU.
bits::ZeroCode ties_code(const KernelSet& k, const at::Tensor& ties, size_t sw) {
  return k.zero_codes(ties, sw).at(0);
}

} // namespace

std::string Phase2::ties_in(
    const at::Tensor& gathered,
    std::vector<bits::ZeroCode>& ties,
    int& sender) const {
  const int64_t msg = static_cast<int64_t>(message_bytes());
  const int64_t head = static_cast<int64_t>(kTieCountBytes);
  const at::Tensor heads =
      gathered.narrow(0, 0, msg * N).view({N, msg}).narrow(1, 0, head).contiguous().cpu();
  std::vector<uint64_t> words(2 * static_cast<size_t>(N));
  std::memcpy(words.data(), bytes_of(heads), kTieCountBytes * static_cast<size_t>(N));
  ties.assign(static_cast<size_t>(N), bits::ZeroCode{});
  for (int k = 0; k < N; ++k) {
    if (!tie_code(words.data() + 2 * k, sw, ties[k])) {
      sender = k;
      return c10::str(
          "a corrupt vote message (", ties[k].zeros, " ties in ", ties[k].runs, " runs, ",
          ties[k].packed, " bytes packed, a shard of ", sw * bits::kWordBits, " elements)");
    }
  }
  return "";
}

void Phase2::vote_shard(
    const KernelSet& k,
    bits::SignOp op,
    const bits::CallRule& rule,
    const std::vector<PlaneIn>& in,
    uint64_t first_word,
    at::Tensor& sign,
    at::Tensor& zeros) {
  const bool breaks = rule.tie.mode != bits::TieBreak::kZero;
  at::Tensor tie = breaks ? at::empty_like(zeros) : zeros;
  if (op != bits::SignOp::kLevels) {
    k.vote(in, sign, tie);
  } else {
    std::vector<at::Tensor> planes(in.size());
    for (size_t j = 0; j < in.size(); ++j) {
      planes[j] = in[j].sign; // [plane 0 | plane 1 | ...], sw words each
    }
    k.vote_levels(planes, rule.value_bits, sign, tie);
  }
  if (breaks) {
    k.all_zero(in, op == bits::SignOp::kLevels ? rule.value_bits : 0, zeros);
    k.break_ties(sign, tie, zeros, rule.tie, first_word);
  }
}

std::string Phase2::encode(
    const KernelSet& k,
    const std::vector<PlaneIn>& in,
    uint64_t first_word,
    at::Tensor& msg,
    at::Tensor& ties) const {
  const int64_t sb = static_cast<int64_t>(sw * 8);
  const int64_t head = static_cast<int64_t>(kTieCountBytes);
  switch (format) {
    case Phase2Format::kVoteSigns: {
      at::Tensor sign = msg.narrow(0, head, sb);
      vote_shard(k, op, rule, in, first_word, sign, ties);
      // The runs too where there are ties: their round's form needs them.
      put_words(msg, tie_words(ties_code(k, ties, sw), sw));
      return "";
    }
    case Phase2Format::kVoteTrits: {
      at::Tensor planes = at::empty({2 * sb}, msg.options());
      at::Tensor sign = planes.narrow(0, 0, sb);
      at::Tensor zeros = planes.narrow(0, sb, sb);
      vote_shard(k, op, rule, in, first_word, sign, zeros);
      // The ties ride inline, but their code decides whether they still
      // should next time (kTieHint): the runs and packed runs too, or
      // zeros that have become cheap (a dead unit's columns) would ride
      // inline at 1.625 bits an element for good.
      put_words(msg, tie_words(ties_code(k, zeros, sw), sw));
      msg.narrow(0, static_cast<int64_t>(message_bytes()) - 8, 8).zero_(); // the padding
      at::Tensor trits = msg.narrow(0, head, static_cast<int64_t>(bits::kTritBytesPerWord * sw));
      k.encode_trits(sign, zeros, trits);
      return "";
    }
    case Phase2Format::kCounts: {
      at::Tensor out = msg.narrow(0, 0, static_cast<int64_t>(planes) * sb);
      k.count_code(in, out);
      return "";
    }
    case Phase2Format::kCountsZeroList: {
      std::vector<PlaneIn> signs(in.size());
      for (size_t j = 0; j < in.size(); ++j) {
        signs[j].sign = in[j].sign; // a zero's sign bit is 0: counted as not positive
      }
      at::Tensor out = msg.narrow(0, 0, static_cast<int64_t>(planes) * sb);
      k.count_code(signs, out);
      // list_cap bounds this shard's zeros summed over the senders.
      at::Tensor list = msg.narrow(
          0, static_cast<int64_t>(planes) * sb,
          static_cast<int64_t>(bits::zero_count_list_bytes(list_cap)));
      return k.encode_zero_counts(in, list_cap, list)
          ? ""
          : "internal: more elements with a zero than announced";
    }
  }
  return "internal: unknown phase-2 format";
}

Phase2Decoder::Phase2Decoder(
    const Phase2& fmt,
    bits::SignOp op,
    bits::DType dtype,
    bool tie_planes,
    const c10::Device& device)
    : fmt_(fmt), tie_planes_(tie_planes) {
  switch (fmt.format) {
    case Phase2Format::kVoteSigns: // code = sign bit + 2 * tie bit
      lut_ = lut_tensor(
          dtype, tie_planes ? std::vector<double>{-1, 1, 0, 0} : std::vector<double>{-1, 1},
          device);
      break;
    case Phase2Format::kVoteTrits: // trit 0, 1, 2
      lut_ = lut_tensor(dtype, {-1, 1, 0}, device);
      break;
    case Phase2Format::kCounts:
      lut_ = lut_tensor(dtype, count_code_values(op, fmt.N, fmt.with_zeros, fmt.planes), device);
      break;
    case Phase2Format::kCountsZeroList:
      lut_ = lut_tensor(dtype, count_code_values(op, fmt.N, false, fmt.planes), device);
      zero_lut_ = lut_tensor(dtype, count_code_values(op, fmt.N, true, fmt.planes + 1), device);
      break;
  }
}

std::string Phase2Decoder::decode(
    const KernelSet& k,
    const at::Tensor& msg,
    const at::Tensor& tie_plane,
    at::Tensor& dst) const {
  const int64_t sb = static_cast<int64_t>(fmt_.sw * 8);
  const int64_t head = static_cast<int64_t>(kTieCountBytes);
  switch (fmt_.format) {
    case Phase2Format::kVoteSigns: {
      std::vector<at::Tensor> planes{msg.narrow(0, head, sb)};
      if (tie_planes_) {
        planes.push_back(tie_plane);
      }
      k.unpack(planes, lut_, dst);
      return "";
    }
    case Phase2Format::kVoteTrits: {
      const at::Tensor trits = msg.narrow(
          0, head, static_cast<int64_t>(bits::kTritBytesPerWord * bits::words_for(dst.numel())));
      return k.decode_trits(trits, lut_, dst) ? ""
                                              : "a corrupt vote message (a base-3 code above 242)";
    }
    case Phase2Format::kCounts:
    case Phase2Format::kCountsZeroList: {
      std::vector<at::Tensor> planes(static_cast<size_t>(fmt_.planes));
      for (int b = 0; b < fmt_.planes; ++b) {
        planes[b] = msg.narrow(0, b * sb, sb);
      }
      k.unpack(planes, lut_, dst);
      // The listed elements (a zero somewhere) rewritten from the zero-aware
      // code 2 * positives + zeros.
      if (fmt_.format == Phase2Format::kCountsZeroList) {
        const at::Tensor list = msg.narrow(
            0, fmt_.planes * sb, static_cast<int64_t>(bits::zero_count_list_bytes(fmt_.list_cap)));
        if (!k.apply_zero_counts(list, fmt_.list_cap, planes, fmt_.N, zero_lut_, dst)) {
          return "a corrupt count message (its list of elements with a zero)";
        }
      }
      return "";
    }
  }
  return "a message of an unknown phase-2 format";
}

std::string Phase2Decoder::decode_planes(
    const KernelSet& k,
    const at::Tensor& msg,
    const at::Tensor& tie_plane,
    at::Tensor& sign,
    at::Tensor& zero,
    uint64_t bit_offset,
    size_t n) const {
  if (n == 0) {
    return "";
  }
  TORCH_CHECK(bit_offset % bits::kWordBits == 0, "internal: a shard's planes start on a word");
  const int64_t from = static_cast<int64_t>(bit_offset / 8);
  const int64_t bytes = static_cast<int64_t>(bits::words_for(n) * 8);
  at::Tensor s_out = sign.narrow(0, from, bytes);
  at::Tensor z_out = zero.narrow(0, from, bytes);
  if (fmt_.format == Phase2Format::kVoteSigns) {
    // Values lut[sign + 2 * tie] = {-1, +1, 0, 0}: a tie is a 0 whatever its sign bit.
    const at::Tensor s = msg.narrow(0, static_cast<int64_t>(kTieCountBytes), bytes);
    if (tie_planes_) {
      const at::Tensor t = tie_plane.narrow(0, 0, bytes);
      at::bitwise_and_out(s_out, s, at::bitwise_not(t));
      z_out.copy_(t);
    } else {
      s_out.copy_(s);
      z_out.zero_();
    }
    return "";
  }
  at::Tensor values = at::empty({static_cast<int64_t>(n)}, lut_.options());
  std::string corrupt = decode(k, msg, tie_plane, values);
  if (corrupt.empty()) {
    k.pack(values, sign, zero, bit_offset);
  }
  return corrupt;
}

} // namespace lionbit
