// SignRequest: one sign collective, described once. LionBitBackend's entry
// points fill it; request_problem() checks it in one ordered list (the first
// thing wrong is what the caller reads); the backend then validates the op and
// tie rule, tells the peers of a rejection, and enqueues one job for it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

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
  std::string tie_break; // "zero", "alternate" or "random"
  int64_t tie_seed; // < 0: the call's number
  std::string hierarchy; // "flat", "node" or "node_vote" (not l1)
  // The payload, one of three: the values themselves, in place (all-reduce
  // only); or packed by the caller, direction bits `sign` / `zero` or
  // `value_bits` planes of levels, with `numel` elements (a reduce-scatter's:
  // per shard), `nans` non-finite values seen while packing, and the result
  // written into `out`. Layouts: backend/lionbit_backend.hpp.
  at::Tensor tensor;
  at::Tensor sign, zero;
  at::Tensor planes;
  int64_t value_bits = 0;
  int64_t numel = 0;
  int64_t nans = 0;
  at::Tensor out;

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
