// SignRequest: one sign collective, described once. Python fills it
// (lionbit._C.SignRequest, bindings/python_module.cpp) and passes it to
// LionBitBackend::call, the one binding of the sign path; request_problem()
// checks it in one ordered list (the first thing wrong is what the caller
// reads); the backend then validates the op and tie rule, tells the peers of
// a rejection, and enqueues one job for it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "backend/agreement.hpp"
#include "backend/sign_common.hpp"
#include "backend/sign_hierarchy.hpp"
#include "signbits/ties.h"
#include "signbits/wire.h"

namespace lionbit {

struct SignRequest {
  SignRequest(
      Collective kind,
      std::string op,
      std::string tie_break,
      int64_t tie_seed,
      std::string hierarchy = "flat")
      : kind(kind),
        op(std::move(op)),
        tie_break(std::move(tie_break)),
        tie_seed(tie_seed),
        hierarchy(std::move(hierarchy)) {}

  Collective kind;
  std::string op; // "vote", "avg" or "sum"; "l1" with levels
  // The vote's tie rule (signbits/ties.h): "zero", "alternate" or "random"
  // (not "zero": vote and l1 only), and its seed, < 0 for the call's number.
  std::string tie_break;
  int64_t tie_seed;
  // "flat", or over the cluster's two levels once setHierarchy has run (not
  // l1): "node" (exact, the flat result bit for bit) or "node_vote" (a vote
  // of node votes); backend/sign_hierarchy.hpp.
  std::string hierarchy;
  // The payload, one of three:
  //  - `tensor`: the values themselves, the result written in place
  //    (all-reduce only);
  //  - direction bits packed by the caller: uint8 `sign` and `zero` planes of
  //    at least ceil(numel / 64) * 8 bytes, laid out like bits::pack_signs;
  //  - Lion Cub's L1 levels (op "l1"): uint8 `planes`, `value_bits` planes of
  //    equal size, the p-bit levels of signbits/levels.h.
  // Packed payloads: `numel` elements, `nans` non-finite values seen while
  // packing, and the result (the sign of the vote / avg / sum, ties by the
  // tie rule) written into `out`, contiguous. A reduce-scatter's planes hold
  // N shards of `numel` elements each, shard r from bit r * 64 * ceil(numel /
  // 64) (lion_math.shard_bit in Python); `out` receives this rank's shard.
  at::Tensor tensor;
  at::Tensor sign, zero;
  at::Tensor planes;
  int64_t value_bits = 0;
  int64_t numel = 0;
  int64_t nans = 0;
  at::Tensor out;
  // The vote as bit-planes instead of values (an all-reduce or a
  // reduce-scatter of packed signs, op "vote", hierarchy "flat"): `out` is
  // uint8, two planes of ceil(numel / 64) * 8 bytes one after the other
  // (a reduce-scatter: of this rank's shard), sign then zero; element i is
  // +1 where bit i of the sign plane is set, 0 where bit i of the zero
  // plane is (never both), -1 where neither is;
  // bits past numel are unspecified. What lionbit.DistributedLion applies
  // (optim::lion_apply_planes, its CUDA list kernel): 2 bits an element
  // written, not a value.
  bool out_planes = false;
  // Non-finite values the caller's kernels are still counting (packed calls):
  // a one-element int64 tensor on out's device, added to `nans` when the
  // collective runs. The sign path's worker reads it (on CUDA on its stream,
  // which follows the caller's): a GPU caller never waits for its pack
  // kernels to learn the count.
  at::Tensor nans_tally;
  // Resolved when every rank has agreed to the call (backend/agreement.hpp):
  // by the header round for a flat all-reduce of packed signs or levels, at
  // the call's end otherwise. None: nobody waits for it.
  std::shared_ptr<Agreement> agreement;

  bool packed() const { return !tensor.defined(); }
  bool levels() const { return planes.defined(); }
  // The tensor the result is written into.
  const at::Tensor& result() const { return packed() ? out : tensor; }
};

// The names users pass, parsed; nullopt for an unknown name.
std::optional<bits::SignOp> parse_op(const std::string& name);
std::optional<bits::TieBreak> parse_tie(const std::string& name);

// Why `r` cannot run as `op` on a group of `world` ranks (`has_hierarchy`:
// whether setHierarchy has run), naming the argument; "" when it can. The
// checks in order: the op (or the levels' bits), the hierarchy, the result
// buffer and the counts, the packed planes. `mode` receives the hierarchy.
std::string request_problem(
    const SignRequest& r,
    bits::SignOp op,
    int world,
    bool has_hierarchy,
    HierarchyMode& mode);

// Runs the collective `r` describes (checked by request_problem), as the
// sign path's worker does: `h` for a hierarchical call, `tie` the call's tie
// rule, `seq` its number.
void run_request(
    const SignComm& comm,
    const Hierarchy& h,
    SignRequest& r,
    bits::SignOp op,
    bits::TieRule tie,
    HierarchyMode mode,
    uint64_t seq);

} // namespace lionbit
