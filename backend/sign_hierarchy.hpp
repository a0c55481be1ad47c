// The sign collectives over a cluster's two levels: M nodes of L ranks each
// (N = L * M), a fast link inside a node and a slow one between nodes.
//
//   0. Header round over all N ranks: the flat call's 72-byte header, with
//      kHierExact or kHierNodeVote (every rank must agree).
//   1. Inside the node, an all-to-all of packed shards (phase 1 over the
//      node's L ranks, backend/phase1.hpp): local rank l receives from each
//      rank of its node the slice it owns: the shards of the M ranks that
//      have local index l, one on each node (shard r is the one that rank r
//      owns in the flat collective: N shards of sw words).
//   2a. Exact ("node"): local rank l counts its node's signs on its slice as
//      the count code of signbits/count.h (#positive, or 2 #positive + #zero
//      when some rank of the cluster sent a zero; an element the whole node
//      sent 0 for gets the otherwise unused all-ones code), P = the fewest
//      planes that hold 0..L (0..2L with zeros). An all-to-all across nodes
//      sends each rank with local index l its own shard's P planes from
//      every node; the rank adds the M nodes' codes (backend/code_sum.hpp)
//      and votes, averages or sums its shard from the totals exactly as the
//      flat collective's owner does from N ranks' signs: the same bits.
//   2b. Node vote ("node_vote", op vote only, approximate): local rank l
//      votes its node's signs on its slice (the tie rule applied); the M
//      node votes of each shard then go through phase 1 across nodes and are
//      voted again like M ranks' signs (a node's 0 abstains).
//   3. All-reduce only: each shard's result (a vote: 1 bit an element and
//      the number of its zeros, the zeros' plane in a second round when some
//      shard has any, or, under "zero" at even N, where ties are common, the
//      results in base 3, 1.625 bits an element (signbits/trits.h); avg /
//      sum: the count code's planes) is all-gathered
//      across nodes (local rank l gathers its slice), then inside the node
//      (every rank gathers every slice), and unpacked.
//
// Bytes each node sends over its slow link per call, d elements, a vote:
//   exact: (M - 1)/M * d/8 * (P + 1), plus (M - 1)/M * d/8 for the zeros'
//          round when the result has zeros; (P + 1.625) under "zero" at
//          even N;
//   node vote: (M - 1)/M * d/8 * (1 + z + 1), z = 1 when the node votes can
//          hold a 0 (a zero anywhere, or "zero" ties with L even), plus the
//          zeros' round as above.
// The flat vote's ranks send L * (N - 1)/N * d/8 in phase 1 alone. A
// reduce-scatter sends only step 2's share. The byte counters of the node
// and cross-node communicators (their own backends' stats) count the two
// levels apart.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "backend/sign_allreduce.hpp"
#include "backend/sign_reduce_scatter.hpp"

namespace lionbit {

enum class HierarchyMode : uint8_t { kFlat = 0, kExact = 1, kNodeVote = 2 };

// "flat", "node" or "node_vote".
const char* hierarchy_name(HierarchyMode mode);

// The two communicators of this rank and the cluster's layout.
struct Hierarchy {
  SignComm node; // the L ranks of this rank's node; node.rank = local index
  SignComm cross; // the M ranks whose local index is this rank's, one per node
  // order[l * M + c]: the rank (of the collective's group) that is rank c of
  // the cross-node communicator of local index l. Slice l = those M shards.
  std::vector<int> order;
  // node_ranks[j]: the rank (of the collective's group) that is rank j of
  // this node's communicator.
  std::vector<int> node_ranks;
};

// All-reduce of `tensor` (in place) or, with `packed`, of the caller's
// direction bits into `tensor`, over the hierarchy (mode exact or node
// vote). Throws c10::Error naming lionbit, the op and the rank on any
// failure.
void sign_allreduce_hierarchical(
    const SignComm& c,
    const Hierarchy& h,
    HierarchyMode mode,
    at::Tensor& tensor,
    const PackedSigns* packed,
    bits::SignOp op,
    const bits::CallRule& rule,
    uint64_t seq);

// The reduce-scatter of sign_reduce_scatter_packed over the hierarchy.
void sign_reduce_scatter_hierarchical(
    const SignComm& c,
    const Hierarchy& h,
    HierarchyMode mode,
    const PackedShards& in,
    at::Tensor& out,
    bits::SignOp op,
    const bits::TieRule& tie,
    uint64_t seq);

} // namespace lionbit
