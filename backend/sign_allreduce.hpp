// The two-phase 1-bit sign all-reduce:
//   0. header round: an all-gather of a 72-byte header per rank (order, op,
//      dtype, size, NaN flag, zero capacity), checked before anything else
//      is used;
//   1. pack signs to bit-planes; all-to-all of packed shards (zero positions
//      travel only from ranks whose input holds a zero: a list of offsets
//      when sparse, a plane when dense, see signbits/zeros.h);
//   2. each rank counts and votes its own shard with bit-sliced counters;
//   3. all-gather of the shard results (vote: 1 bit, plus the tie positions
//      only when a shard has a tie, encoded like zeros, in a further round;
//      or, when the last vote had a dense tie plane and every rank says so
//      in its header (kTieHint), results and ties together in base 3 in this
//      one, 1.625 bits an element (signbits/trits.h); avg/sum: the count's
//      bit-planes, with a list of the elements that hold a zero when a few
//      do, signbits/zero_counts.h); unpack in place.
#pragma once

#include <ATen/core/Tensor.h>
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "signbits/wire.h"
#include "backend/agreement.hpp"
#include "backend/rank_names.hpp"
#include "backend/stats.hpp"

namespace lionbit {

struct SignComm {
  c10::intrusive_ptr<c10d::Backend> comm; // used by the worker thread only
  int rank;
  int world_size;
  Stats* stats;
  // CUDA tensors' data: the device communicator (NCCL), or null to stage
  // through host memory over `comm`. Used by the worker thread only.
  c10::intrusive_ptr<c10d::Backend> device_comm = {};
  // The CPU vote's tie-plane hint (bits::kTieHint): set when this backend's
  // last vote sent a dense tie plane, so the next one offers to carry its tie
  // plane inline in phase 2. Null: never offered. Worker thread only.
  std::atomic<bool>* tie_hint = nullptr;
  // How errors name ranks: their global ranks (null: as the group numbers them).
  std::shared_ptr<const RankNames> names = {};

  // The name of the group's rank r in errors.
  int name(int r) const { return names ? (*names)(r) : r; }
  // Where this rank's errors are raised: "rank 5 (group of ranks [4, 5])".
  std::string here() const { return names ? names->here(rank) : "rank " + std::to_string(rank); }
};

// The tie rule a caller asks for: its seed, or (seed < 0) the call's number
// in the order every rank runs the calls (every rank agrees on it).
struct TieSpec {
  bits::TieBreak mode = bits::TieBreak::kZero;
  int64_t seed = -1;
  bits::TieRule at(uint64_t seq) const {
    return bits::TieRule{mode, seed < 0 ? seq : static_cast<uint64_t>(seed)};
  }
};

// What the backend's worker runs for one call: the communicators and the
// call's number in the order every rank runs them.
using SignJob = std::function<void(const SignComm&, uint64_t seq)>;

// Runs the whole collective on `tensor` (CPU or CUDA, a supported dtype, no
// internal overlap: the caller has checked; on CUDA the worker's stream is
// current and ordered after the caller's work) and writes the result into it. `rule`:
// the vote's tie rule (signbits/ties.h). Throws c10::Error naming lionbit,
// the op and the rank on any failure.
void sign_allreduce(
    const SignComm& c,
    at::Tensor& tensor,
    bits::SignOp op,
    const bits::CallRule& rule,
    uint64_t seq);

// Direction bits packed by the caller (the fused Lion kernel): uint8 planes
// of at least words_for(numel) words laid out like bits::pack_signs, on the
// device of `out`; bits past numel are ignored. The result is unpacked into
// `out` (contiguous, numel elements, a supported dtype).
struct PackedSigns {
  at::Tensor sign;
  at::Tensor zero;
  uint64_t numel;
  uint64_t nans; // NaNs the packer saw (an error on every rank if > 0)
};

// `agreed` (or null): resolved by the call's last header round
// (backend/agreement.hpp), the same in the two functions below.
void sign_allreduce_packed(
    const SignComm& c,
    const PackedSigns& in,
    at::Tensor& out,
    bits::SignOp op,
    const bits::CallRule& rule,
    uint64_t seq,
    Agreement* agreed = nullptr);

// The same vote (op vote, flat) with its result as planes in `out` (uint8,
// sign plane then zero plane, words_for(numel) words each; see
// SignRequest::out_planes), not unpacked into values.
void sign_allreduce_packed_planes(
    const SignComm& c,
    const PackedSigns& in,
    at::Tensor& out,
    const bits::TieRule& tie,
    uint64_t seq,
    Agreement* agreed = nullptr);

// Lion Cub's L1 aggregation: p-bit levels packed by the caller
// (signbits/levels.h: plane b at word b * plane_words, at least
// words_for(numel) words each; bits past numel ignored). Phase 1 sends each
// owner its shard's p planes; the owner sums them exactly and votes
// (bits::vote_levels); phase 2 is a vote's, with the tie rule `tie`. The
// sign of the sum (or the tie rule's answer) is unpacked into `out`.
struct PackedLevels {
  at::Tensor planes; // uint8, on the device of `out`
  size_t plane_words;
  int bits; // p
  uint64_t numel;
  uint64_t nans; // non-finite values the packer saw (an error on every rank if > 0)
};

void levels_allreduce_packed(
    const SignComm& c,
    const PackedLevels& in,
    at::Tensor& out,
    const bits::TieRule& tie,
    uint64_t seq,
    Agreement* agreed = nullptr);

} // namespace lionbit
