// Phase 1 of the CPU sign collectives, shared by the all-reduce (once per
// pipelined chunk) and the reduce-scatter: every rank's direction bits, cut
// into N shards of `sw` words (shard k at words [k * sw, (k + 1) * sw) of the
// sign and zero planes), go to their owners in one all-to-all. Rank k gets
// [sign_k | zeros_k] from every rank j, zeros_k encoded for rank j's zero
// capacity (signbits/zeros.h: a list of offsets when sparse, a plane when
// dense, nothing when rank j holds no zero). The owner then has every rank's
// contribution to its shard.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <vector>

#include "backend/sign_common.hpp"
#include "signbits/types.h"

namespace lionbit {

// Makes planes that a caller packed a valid encoding of n elements in
// {0, +1, -1}: bits past element n of `words` words cleared (not the
// caller's promise), and a zero bit wins over a sign bit.
void clean_planes(uint64_t* sign, uint64_t* zero, size_t words, size_t n);

// The most zeros any one of the N shards holds: this rank's zero capacity.
uint64_t max_shard_zeros(const uint64_t* zero, int N, size_t sw);

// One all-to-all of shards in flight.
struct Phase1 {
  size_t sw = 0;
  std::vector<int64_t> recv_splits; // bytes from each rank
  at::Tensor recv;
  c10::intrusive_ptr<c10d::Work> work;
};

// Encodes this rank's shards (its zero capacity is hs.zero_capacity[rank])
// and issues the all-to-all on call.c.comm; counts its bytes. `sign` and
// `zero` hold N * sw words; they must stay alive until the exchange is done.
Phase1 send_shards(
    const SignCall& call,
    const bits::HeaderSummary& hs,
    const at::Tensor& sign,
    const at::Tensor& zero,
    size_t sw);

// Waits for the exchange (a failure raises naming the step).
void wait_shards(const SignCall& call, Phase1& p);

// After wait_shards: every rank's contribution to this rank's shard
// (pointers into p.recv, or into `scratch` for zero lists, decoded there).
// Raises naming the sender when a list is corrupt.
std::vector<bits::Contribution> receive_shards(
    const SignCall& call,
    const bits::HeaderSummary& hs,
    Phase1& p,
    at::Tensor& scratch);

} // namespace lionbit
