// Phase 1 of the sign collectives, shared by the all-reduce (once per
// pipelined chunk) and the reduce-scatter: every rank's direction bits, cut
// into N shards of `sw` words (shard k at words [k * sw, (k + 1) * sw) of the
// sign and zero planes), go to their owners in one all-to-all. Rank k gets
// [sign_k | zeros_k] from every rank j, zeros_k encoded for the zero code
// rank j announced to rank k (signbits/zeros.h: a list of offsets or of
// runs when sparse, a plane when dense, nothing when shard k of rank j
// holds no zero). The owner then has every rank's
// contribution to its shard. Written once for every device: the planes live
// on the call's device and its kernel set encodes and decodes them.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "backend/sign_common.hpp"
#include "signbits/types.h"
#include "signbits/zeros.h"

namespace lionbit {

// The most zeros and the most runs of zeros any one of the N shards of
// `zero` (N * sw words) holds: this rank's zero code.
bits::ZeroCode max_shard_zeros(const SignCall& call, const at::Tensor& zero, size_t sw);

// One all-to-all of shards in flight.
struct Phase1 {
  size_t sw = 0;
  std::vector<int64_t> recv_splits; // bytes from each rank
  Inflight f;
  at::Tensor recv; // after wait_shards
};

// Encodes this rank's shards (shard j's zeros for the code announced to
// rank j, hs.sent[j]) and issues the all-to-all; counts its bytes. `sign` and `zero` hold
// N * sw words each (`zero` is not read when this rank holds no zero).
// `exchange` (two ranks only): every shard goes to the other rank, none to
// this one, so that each rank holds both ranks' whole planes (the exchange
// of the two-party vote: each rank then votes every shard itself).
Phase1 send_shards(
    const SignCall& call,
    const bits::HeaderSummary& hs,
    const at::Tensor& sign,
    const at::Tensor& zero,
    size_t sw,
    bool exchange = false);

// The exchange in two sendings, for chunks whose signs left before the
// round that gave their zeros' capacities (hs): send_zeros sends the other
// rank this rank's zeros of every shard of every chunk in `zero` (chunks of
// sw words a shard) in one message, each encoded as send_shards would
// (code hs.sent[other], nothing when it has no zeros), and counts the
// bytes;
// once both are waited for, join_zeros makes `signs` (the chunk at `index`
// of them) what one sending with hs would have brought ([sign_k | zeros_k]
// a shard, for exchanged_shard).
Phase1 send_zeros(
    const SignCall& call,
    const bits::HeaderSummary& hs,
    const std::vector<at::Tensor>& zero,
    size_t sw);
void join_zeros(
    const SignCall& call,
    const bits::HeaderSummary& hs,
    Phase1& signs,
    const Phase1& zeros,
    size_t index);

// Waits for the exchange (a failure raises naming the step).
void wait_shards(const SignCall& call, Phase1& p);

// After wait_shards: every rank's contribution to this rank's shard (views
// of p.recv, or of `scratch` for zero lists, decoded there). Raises naming
// the sender when a list is corrupt. Where some rank has a zero (hs.any_zero)
// at least one contribution has a zero plane, so that the count code is as
// wide on every owner.
std::vector<PlaneIn> receive_shards(
    const SignCall& call,
    const bits::HeaderSummary& hs,
    Phase1& p,
    at::Tensor& scratch);

// After wait_shards of an exchange: both ranks' contributions to shard
// `shard`, exactly what its owner would have received in phase 1 (this
// rank's from its own `sign` and `zero` planes, the other's decoded from the
// exchange; `scratch` holds decoded zero lists, one plane per shard).
std::vector<PlaneIn> exchanged_shard(
    const SignCall& call,
    const bits::HeaderSummary& hs,
    Phase1& p,
    const at::Tensor& sign,
    const at::Tensor& zero,
    int shard,
    at::Tensor& scratch);

} // namespace lionbit
