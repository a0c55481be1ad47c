// Phase 2 of the sign all-reduce (every device: the buffers live on the
// call's device, its kernel set does the work): the owner of each shard sends every
// rank its shard's result in one all-gather message. One format per case,
// each with its size, its encoder (run by the owner) and its decoder (run by
// every rank for every shard) side by side in phase2.cpp, so that a change
// of the wire touches one place:
//
//   kVoteSigns       [zeros: 2 u64][sign plane]; the positions of the
//                    result's zeros (ties under the "zero" rule, elements
//                    every rank voted 0 for under every rule: ties.h), when
//                    some shard has any, follow in a round of their own
//                    (zeros.h); the u64s are their ZeroCode (tie_words)
//   kVoteTrits       [zeros: 2 u64][results in base 3, 13 bytes a word,
//                    padded to 8 bytes] (trits.h): every rank expects dense
//                    zeros (kTieHint), so they ride inline at 1.625 bits an
//                    element
//   kCounts          [P code planes] (count.h: code = #positive, or
//                    2 * #positive + #zero when some rank sent a zero)
//   kCountsZeroList  [P zero-free code planes][the elements with a zero, as
//                    a list] (zero_counts.h): avg / sum with a few zeros
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/kernel_set.hpp"
#include "signbits/types.h"
#include "signbits/wire.h"

namespace lionbit {

enum class Phase2Format { kVoteSigns, kVoteTrits, kCounts, kCountsZeroList };

struct Phase2 {
  Phase2Format format;
  int N; // ranks
  size_t sw; // words per shard
  int planes = 0; // count formats: the code planes P
  bool with_zeros = false; // kCounts: the zero-aware code
  uint64_t list_cap = 0; // kCountsZeroList: room of the list
  bits::SignOp op = bits::SignOp::kVote;
  bits::CallRule rule{}; // vote formats: the tie rule; kLevels: the bits

  // The format of one chunk of an all-reduce: `zero_most` the most zeros in
  // any shard of each rank (the header round's: the same on every rank),
  // `inline_ties` whether every rank expects dense ties.
  static Phase2 choose(
      bits::SignOp op,
      const bits::CallRule& rule,
      int N,
      size_t sw,
      bool inline_ties,
      const std::vector<uint64_t>& zero_most);

  size_t message_bytes() const;

  // The owner's vote of its shard from the N contributions to it (signs, or
  // for kLevels p planes of levels each), the tie rule applied: the sign
  // plane and the plane of the result's zeros (ties under "zero"; under the
  // other rules the elements every rank voted 0 for), sw words each.
  // `first_word`: the shard's first word in the call's tensor (the random
  // rule's position).
  static void vote_shard(
      const KernelSet& k,
      bits::SignOp op,
      const bits::CallRule& rule,
      const std::vector<PlaneIn>& in,
      uint64_t first_word,
      at::Tensor& sign,
      at::Tensor& zeros);

  // The owner's message about its shard (msg: message_bytes() bytes), from
  // the N contributions to it. `first_word`: the shard's first word in the
  // call's tensor (the random tie rule's position). kVoteSigns also writes
  // the shard's plane of zeros (sw words) into `ties`. Returns "" or what went
  // wrong (an internal inconsistency).
  std::string encode(
      const KernelSet& k,
      const std::vector<PlaneIn>& in,
      uint64_t first_word,
      at::Tensor& msg,
      at::Tensor& ties) const;

  // Whether the message starts with the code of its shard's ties
  // (kVoteSigns, kVoteTrits).
  bool counts_ties() const {
    return format == Phase2Format::kVoteSigns || format == Phase2Format::kVoteTrits;
  }
  // The code of the ties (the result's zeros) each of the N messages of
  // `gathered` announces (read on the host); "" or what rank `sender` sent
  // that was corrupt.
  std::string ties_in(const at::Tensor& gathered, std::vector<bits::ZeroCode>& ties, int& sender)
      const;
};

// Decodes the messages of one chunk, shard by shard, into values of `dtype`.
class Phase2Decoder {
 public:
  // `tie_planes`: kVoteSigns when some shard has ties (they were fetched).
  // The tables are built for `device`.
  Phase2Decoder(
      const Phase2& fmt,
      bits::SignOp op,
      bits::DType dtype,
      bool tie_planes,
      const c10::Device& device);

  // Writes the results of one shard into dst (n = dst.numel() elements).
  // `tie_plane`: that shard's tie plane (kVoteSigns with tie planes), else
  // undefined. Returns "" or what is corrupt in the message (named in the
  // caller's error with the sender).
  std::string decode(
      const KernelSet& k,
      const at::Tensor& msg,
      const at::Tensor& tie_plane,
      at::Tensor& dst) const;

  // A vote's results of one shard as bits [bit_offset, bit_offset + n) of
  // `sign` and `zero` (SignRequest::out_planes: +1 a sign bit, 0 a zero bit,
  // -1 neither; bit_offset a multiple of 64): kVoteSigns's planes as they
  // are (a tie is a 0), any other format decoded to values and packed.
  // Returns as decode.
  std::string decode_planes(
      const KernelSet& k,
      const at::Tensor& msg,
      const at::Tensor& tie_plane,
      at::Tensor& sign,
      at::Tensor& zero,
      uint64_t bit_offset,
      size_t n) const;

 private:
  Phase2 fmt_;
  bool tie_planes_;
  at::Tensor lut_; // the message's codes as values of the dtype
  at::Tensor zero_lut_; // kCountsZeroList: the zero-aware code's
};

} // namespace lionbit
