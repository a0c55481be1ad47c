#include "backend/sign_request.hpp"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <functional>
#include <initializer_list>

#include "backend/sign_allreduce.hpp"
#include "backend/sign_reduce_scatter.hpp"
#include "backend/torch_adapter.hpp"
#include "signbits/count.h"
#include "signbits/levels.h"
#include "signbits/unpack.h"

namespace lionbit {

std::optional<bits::SignOp> parse_op(const std::string& name) {
  if (name == "vote") {
    return bits::SignOp::kVote;
  }
  if (name == "avg") {
    return bits::SignOp::kAvg;
  }
  if (name == "sum") {
    return bits::SignOp::kSum;
  }
  if (name == "l1") { // the levels methods only
    return bits::SignOp::kLevels;
  }
  return std::nullopt;
}

std::optional<bits::TieBreak> parse_tie(const std::string& name) {
  if (name == "zero") {
    return bits::TieBreak::kZero;
  }
  if (name == "alternate") {
    return bits::TieBreak::kAlternate;
  }
  if (name == "random") {
    return bits::TieBreak::kRandom;
  }
  return std::nullopt;
}

namespace {

#ifdef LIONBIT_WITH_CUDA
constexpr bool kCudaBuilt = true;
#else
constexpr bool kCudaBuilt = false;
#endif

// The op of a sign method (vote / avg / sum): "l1" is the levels methods'.
std::string sign_op_problem(bits::SignOp op) {
  return op == bits::SignOp::kLevels
      ? "argument 'op' is 'l1'; expected 'vote', 'avg' or 'sum' (l1 takes packed levels)"
      : "";
}

// The levels' bits p.
std::string bits_problem(int64_t value_bits) {
  if (value_bits < bits::kMinLevelBits || value_bits > bits::kMaxLevelBits) {
    return "argument 'bits' must be " + std::to_string(bits::kMinLevelBits) + " to " +
        std::to_string(bits::kMaxLevelBits) + ", got " + std::to_string(value_bits);
  }
  return "";
}

// Whether the elements of a strided tensor provably occupy distinct memory:
// ordered by stride, every dimension's stride exceeds the furthest offset the
// smaller ones reach. (at::has_internal_overlap only answers "too hard" for
// views such as x[::3] or an as_strided window.) Some exotic non-overlapping
// layouts fail this test; they get a clear error, never a wrong result.
bool provably_no_overlap(const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims; // (stride, size)
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (t.size(i) > 1) {
      dims.emplace_back(t.stride(i), t.size(i));
    }
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;
  for (const auto& [stride, size] : dims) {
    if (stride <= span) {
      return false;
    }
    span += stride * (size - 1);
  }
  return true;
}

// Why `tensor` (argument `name`) cannot receive the result of `op` on a group
// of `world` ranks; "" when it can.
std::string result_problem(const at::Tensor& tensor, const char* name, bits::SignOp op, int world) {
  const std::string arg = std::string("argument '") + name + "'";
  if (!tensor.defined()) {
    return arg + " is undefined";
  }
  if (tensor.layout() != at::kStrided) {
    return arg + " has layout " + c10::str(tensor.layout()) +
        "; only dense (strided) tensors are supported";
  }
  if (!in_own_memory(tensor)) {
    return arg +
        " is a tensor subclass with no memory of its own (its values live in a tensor it "
        "wraps, as a float8 training weight's do); pass the tensor that holds them";
  }
  if (tensor.is_cuda() && !kCudaBuilt) {
    return arg + " is on " + tensor.device().str() +
        "; this build of lionbit runs the sign collectives on CPU tensors "
        "only (it was built without the CUDA path: no nvcc or a CPU-only "
        "torch at build time)";
  }
  if (!tensor.is_cuda() && !tensor.is_cpu()) {
    return arg + " is on " + tensor.device().str() +
        "; the sign collectives support CPU and CUDA tensors";
  }
  const auto dtype = bits_dtype(tensor.scalar_type());
  if (!dtype) {
    return arg + " has dtype " + std::string(c10::toString(tensor.scalar_type())) +
        "; supported: float32, float16, bfloat16, float64, int8";
  }
  if (op == bits::SignOp::kAvg && *dtype == bits::DType::kInt8) {
    return "op 'avg' needs a floating dtype: int8 cannot hold sum/N";
  }
  if (op == bits::SignOp::kSum && *dtype == bits::DType::kInt8 && world > 127) {
    return "op 'sum' on int8 needs a world size <= 127 (it is " + std::to_string(world) + ")";
  }
  if (op != bits::SignOp::kVote && bits::code_planes(world, true) > bits::kMaxUnpackPlanes) {
    return std::string("op '") + bits::sign_op_name(op) + "' supports world sizes up to 32767";
  }
  if (static_cast<uint64_t>(tensor.numel()) > bits::kMaxNumel) {
    return arg + " has " + std::to_string(tensor.numel()) + " elements; at most 2^48 are supported";
  }
  const at::MemOverlap overlap = at::has_internal_overlap(tensor);
  if (overlap == at::MemOverlap::Yes ||
      (overlap == at::MemOverlap::TooHard && tensor.numel() > 1 && !provably_no_overlap(tensor))) {
    return arg +
        " has elements that share memory (an expand()ed or as_strided view); "
        "the result cannot be written in place";
  }
  return "";
}

// A result buffer of exactly `numel` contiguous elements.
std::string exact_size_problem(const at::Tensor& out, const char* what, int64_t numel) {
  if (out.numel() != numel || !out.is_contiguous()) {
    return std::string("argument 'out' must be contiguous with ") + what + " elements (" +
        std::to_string(numel) + "), got " + std::to_string(out.numel());
  }
  return "";
}

// The first non-empty reason.
std::string first_problem(std::initializer_list<std::function<std::string()>> checks) {
  for (const auto& check : checks) {
    std::string reason = check();
    if (!reason.empty()) {
      return reason;
    }
  }
  return "";
}

// The checks every packed call makes of its result buffer and counts, in
// order: `out` can hold op's result, the counts are >= 0 (`what` names the
// element count), N * numel is in range (a reduce-scatter's per-rank count),
// `out` has exactly numel contiguous elements. The planes must then be on
// out's device (the callers check them).
std::string packed_out_problem(
    const at::Tensor& out,
    bits::SignOp op,
    int world,
    const char* what,
    int64_t numel,
    int64_t nans,
    bool per_rank) {
  return first_problem({
      [&] { return result_problem(out, "out", op, world); },
      [&]() -> std::string {
        if (numel < 0 || nans < 0) {
          return std::string("arguments '") + what + "' and 'nans' must be >= 0";
        }
        return "";
      },
      [&]() -> std::string {
        if (per_rank &&
            static_cast<uint64_t>(numel) * static_cast<uint64_t>(world) > bits::kMaxNumel) {
          return "argument '" + std::string(what) + "' is too large (" + std::to_string(numel) +
              " per rank)";
        }
        return "";
      },
      [&] { return exact_size_problem(out, what, numel); },
  });
}

// The checks of a vote into planes (SignRequest::out_planes), in order: what
// the call is, the counts, then `out` itself.
std::string out_planes_problem(const SignRequest& r, bits::SignOp op, int world) {
  const bool scatter = r.kind == Collective::kReduceScatter;
  if (r.levels() || !r.packed()) {
    return "argument 'out_planes' takes an all-reduce or a reduce-scatter of packed signs (sign, zero)";
  }
  if (op != bits::SignOp::kVote) {
    return std::string("argument 'out_planes' takes op 'vote' (a result of -1, 0 or +1), not '") +
        bits::sign_op_name(op) + "'";
  }
  if (r.hierarchy != "flat") {
    return "argument 'out_planes' takes hierarchy 'flat', not '" + r.hierarchy + "'";
  }
  const char* count = scatter ? "shard_numel" : "numel";
  if (r.numel < 0 || r.nans < 0) {
    return std::string("arguments '") + count + "' and 'nans' must be >= 0";
  }
  if (static_cast<uint64_t>(r.numel) * static_cast<uint64_t>(scatter ? world : 1) >
      bits::kMaxNumel) {
    return std::string("argument '") + count + "' is too large (" + std::to_string(r.numel) +
        (scatter ? " per rank)" : ")");
  }
  const at::Tensor& out = r.out;
  const int64_t bytes = 16 * static_cast<int64_t>(bits::words_for(static_cast<uint64_t>(r.numel)));
  if (!out.defined() || out.scalar_type() != at::kByte || !out.is_contiguous() ||
      out.numel() != bytes || !word_aligned(out)) {
    return c10::str(
        "argument 'out' (out_planes) must be a contiguous uint8 tensor of exactly ", bytes,
        " bytes (two planes of ", bytes / 2, ") starting on an 8-byte boundary, got ",
        describe_planes(out));
  }
  return "";
}

// The hierarchy `name` asks for, or an error naming the argument.
std::string hierarchy_problem(
    const std::string& name,
    bits::SignOp op,
    bool has_hierarchy,
    HierarchyMode& mode) {
  if (name == "flat") {
    mode = HierarchyMode::kFlat;
    return "";
  }
  if (name == "node") {
    mode = HierarchyMode::kExact;
  } else if (name == "node_vote") {
    mode = HierarchyMode::kNodeVote;
  } else {
    return "argument 'hierarchy' is '" + name + "'; expected 'flat', 'node' or 'node_vote'";
  }
  if (mode == HierarchyMode::kNodeVote && op != bits::SignOp::kVote) {
    return "argument 'hierarchy' is 'node_vote', a vote of node votes: op must be 'vote', not '" +
        std::string(bits::sign_op_name(op)) + "'";
  }
  if (!has_hierarchy) {
    return "argument 'hierarchy' is '" + name +
        "' but this group has no hierarchy (lionbit sets it up on every rank: "
        "lionbit.all_reduce_sign(..., hierarchy=...) or DistributedLion(hierarchy=...))";
  }
  return "";
}

// The packed planes: on out's device, large enough for numel elements (a
// reduce-scatter's: N shards, each starting on a word), levels' planes a
// whole number of words each (all-reduce) or exactly N shards' (reduce-scatter).
std::string planes_problem(const SignRequest& r, int world) {
  const auto count = static_cast<uint64_t>(std::max<int64_t>(r.numel, 0));
  const bool scatter = r.kind == Collective::kReduceScatter;
  const int64_t plane_bits = scatter
      ? 8 * static_cast<int64_t>(reduce_scatter_plane_bytes(count, world))
      : static_cast<int64_t>(count);
  const at::Device device = r.out.device();
  if (!r.levels()) {
    return first_problem({
        [&] { return check_planes(r.sign, "sign", device, plane_bits); },
        [&] { return check_planes(r.zero, "zero", device, plane_bits); },
    });
  }
  const int64_t p = r.value_bits;
  const int64_t bytes = r.planes.defined() ? r.planes.numel() : 0;
  if (scatter) {
    std::string why = check_planes(r.planes, "planes", device, plane_bits * p);
    if (why.empty() && bytes * 8 != plane_bits * p) {
      why = "argument 'planes' must hold exactly " + std::to_string(p) + " planes of " +
          std::to_string(plane_bits / 8) + " bytes, got " + std::to_string(bytes) + " bytes";
    }
    return why;
  }
  const int64_t words = static_cast<int64_t>(bits::words_for(count));
  std::string why = check_planes(r.planes, "planes", device, 64 * words * p);
  if (why.empty() && bytes % (8 * p) != 0) {
    why = "argument 'planes' must hold " + std::to_string(p) +
        " planes of a whole number of 64-bit words, got " + std::to_string(bytes) + " bytes";
  }
  return why;
}

// The deferred non-finite count (SignRequest::nans_tally), if any.
std::string nans_tally_problem(const SignRequest& r) {
  const at::Tensor& t = r.nans_tally;
  if (!t.defined()) {
    return "";
  }
  if (!r.packed()) {
    return "argument 'nans_tally' takes packed signs or levels, not 'tensor'";
  }
  if (t.scalar_type() != at::kLong || t.numel() != 1 || t.device() != r.out.device()) {
    return c10::str(
        "argument 'nans_tally' must be a one-element int64 tensor on ", r.out.device(), ", got ",
        describe(t), t.numel() != 1 ? c10::str(" of ", t.numel(), " elements") : "");
  }
  return "";
}

} // namespace

std::string request_problem(
    const SignRequest& r,
    bits::SignOp op,
    int world,
    bool has_hierarchy,
    HierarchyMode& mode) {
  const bool scatter = r.kind == Collective::kReduceScatter;
  const char* count = scatter ? "shard_numel" : "numel";
  return first_problem({
      [&] { return r.levels() ? bits_problem(r.value_bits) : sign_op_problem(op); },
      [&] { return hierarchy_problem(r.hierarchy, op, has_hierarchy, mode); },
      [&] {
        if (r.out_planes) {
          return out_planes_problem(r, op, world);
        }
        return r.packed() ? packed_out_problem(r.out, op, world, count, r.numel, r.nans, scatter)
                          : result_problem(r.tensor, "tensor", op, world);
      },
      [&] { return r.packed() ? planes_problem(r, world) : ""; },
      [&] { return nans_tally_problem(r); },
  });
}

void run_request(
    const SignComm& comm,
    const Hierarchy& h,
    SignRequest& r,
    bits::SignOp op,
    bits::TieRule tie,
    HierarchyMode mode,
    uint64_t seq) {
  const bool flat = mode == HierarchyMode::kFlat;
  const auto numel = static_cast<uint64_t>(r.numel);
  auto nans = static_cast<uint64_t>(r.nans);
  if (r.nans_tally.defined()) {
    nans += static_cast<uint64_t>(std::max<int64_t>(r.nans_tally.item<int64_t>(), 0));
  }
  if (r.kind == Collective::kReduceScatter) {
    PackedShards in{r.levels() ? r.planes : r.sign, r.zero, numel, nans};
    in.value_bits = static_cast<int>(r.value_bits);
    if (flat) {
      sign_reduce_scatter_packed(comm, in, r.out, op, tie, seq, r.out_planes, r.agreement.get());
    } else {
      sign_reduce_scatter_hierarchical(comm, h, mode, in, r.out, op, tie, seq);
    }
  } else if (r.levels()) {
    const size_t plane_words = static_cast<size_t>(r.planes.numel()) / 8 /
        static_cast<size_t>(r.value_bits);
    const PackedLevels in{r.planes, plane_words, static_cast<int>(r.value_bits), numel, nans};
    levels_allreduce_packed(comm, in, r.out, tie, seq, r.agreement.get());
  } else if (!r.packed()) {
    if (flat) {
      sign_allreduce(comm, r.tensor, op, bits::CallRule{tie, 0}, seq);
    } else {
      sign_allreduce_hierarchical(
          comm, h, mode, r.tensor, nullptr, op, bits::CallRule{tie, 0}, seq);
    }
  } else {
    const PackedSigns in{r.sign, r.zero, numel, nans};
    if (r.out_planes) {
      sign_allreduce_packed_planes(comm, in, r.out, tie, seq, r.agreement.get());
    } else if (flat) {
      sign_allreduce_packed(comm, in, r.out, op, bits::CallRule{tie, 0}, seq, r.agreement.get());
    } else {
      sign_allreduce_hierarchical(comm, h, mode, r.out, &in, op, bits::CallRule{tie, 0}, seq);
    }
  }
}

} // namespace lionbit
