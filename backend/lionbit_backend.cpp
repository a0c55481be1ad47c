#include "backend/lionbit_backend.hpp"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/ThreadLocalState.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>
#include <unordered_set>

#include "backend/sign_common.hpp"
#include "backend/sign_hierarchy.hpp"
#include "backend/sign_reduce_scatter.hpp"
#include "backend/sign_work.hpp"
#include "backend/torch_adapter.hpp"
#include "signbits/count.h"
#include "signbits/levels.h"
#include "signbits/unpack.h"
#ifdef LIONBIT_WITH_CUDA
#include "backend/cuda_stream.hpp"
#endif

namespace lionbit {

namespace {
// Every live backend, so that shutdown_all_workers() can stop their threads
// before the interpreter finalizes.
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_set<LionBitBackend*>& registry() {
  static std::unordered_set<LionBitBackend*> r;
  return r;
}
} // namespace

LionBitBackend::LionBitBackend(
    c10::intrusive_ptr<c10d::Backend> forward,
    c10::intrusive_ptr<c10d::Backend> sign,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    c10::intrusive_ptr<c10d::Backend> forward_cuda,
    c10::intrusive_ptr<c10d::Backend> sign_cuda)
    : c10d::Backend(rank, size),
      forward_(std::move(forward)),
      sign_(std::move(sign)),
      forward_cuda_(std::move(forward_cuda)),
      sign_cuda_(std::move(sign_cuda)),
      timeout_(timeout) {
  TORCH_CHECK_VALUE(forward_, "lionbit: argument 'forward' is None");
  TORCH_CHECK_VALUE(sign_, "lionbit: argument 'sign' is None");
  TORCH_CHECK_VALUE(
      forward_->getRank() == rank && forward_->getSize() == size && sign_->getRank() == rank &&
          sign_->getSize() == size,
      "lionbit: inner backends span rank ", forward_->getRank(), "/", forward_->getSize(), " and ",
      sign_->getRank(), "/", sign_->getSize(), ", expected rank ", rank, " of ", size);
  for (const auto* b : {&forward_cuda_, &sign_cuda_}) {
    TORCH_CHECK_VALUE(
        !*b || ((*b)->getRank() == rank && (*b)->getSize() == size),
        "lionbit: the inner CUDA backends must span rank ", rank, " of ", size);
  }
  init(); // c10d's usage logging, as Backend.hpp asks of implementations
  // Last: a constructor that throws never runs the destructor, which would
  // have unregistered it.
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().insert(this);
}

// Joins the worker and, through the inner backends, their threads. Python's
// reference is dropped without the GIL (bindings/python_module.cpp), as for
// torch's own backends: a thread joined here may need it.
LionBitBackend::~LionBitBackend() {
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry().erase(this);
  }
  executor_.shutdown();
}

SignComm LionBitBackend::signComm() {
  return SignComm{sign_, rank_, size_, &stats_, sign_cuda_, &tie_hint_};
}

void LionBitBackend::setHierarchy(
    const c10::intrusive_ptr<c10d::Backend>& node,
    const c10::intrusive_ptr<c10d::Backend>& cross,
    const std::vector<int64_t>& order,
    const std::vector<int64_t>& node_ranks) {
  auto* n = dynamic_cast<LionBitBackend*>(node.get());
  auto* x = dynamic_cast<LionBitBackend*>(cross.get());
  const std::string at = "lionbit set_hierarchy on rank " + std::to_string(rank_) + ": ";
  TORCH_CHECK_VALUE(
      n != nullptr && x != nullptr, at, "'node' and 'cross' must be lionbit backends");
  const int L = n->getSize();
  const int M = x->getSize();
  TORCH_CHECK_VALUE(
      L * M == size_ && order.size() == static_cast<size_t>(size_) &&
          node_ranks.size() == static_cast<size_t>(L),
      at, "a hierarchy of ", M, " nodes of ", L, " ranks (order: ", order.size(),
      " ranks, node_ranks: ", node_ranks.size(), ") does not cover the group's ", size_, " ranks");
  std::vector<int> seen(static_cast<size_t>(size_), 0);
  for (const int64_t r : order) {
    TORCH_CHECK_VALUE(
        r >= 0 && r < size_ && seen[static_cast<size_t>(r)]++ == 0, at,
        "'order' must hold every rank of the group once");
  }
  TORCH_CHECK_VALUE(
      order[static_cast<size_t>(n->getRank() * M + x->getRank())] == rank_ &&
          node_ranks[static_cast<size_t>(n->getRank())] == rank_,
      at, "this rank is not where 'order' and 'node_ranks' place it");
  std::lock_guard<std::mutex> lock(hierarchy_mutex_);
  TORCH_CHECK_VALUE(!node_, at, "the hierarchy is already set");
  node_ = c10::intrusive_ptr<LionBitBackend>::reclaim_copy(n);
  cross_ = c10::intrusive_ptr<LionBitBackend>::reclaim_copy(x);
  order_.assign(order.begin(), order.end());
  node_ranks_.assign(node_ranks.begin(), node_ranks.end());
}

bool LionBitBackend::hasHierarchy() const {
  std::lock_guard<std::mutex> lock(hierarchy_mutex_);
  return static_cast<bool>(node_);
}

std::string LionBitBackend::hierarchyProblem(
    const std::string& name,
    bits::SignOp op,
    HierarchyMode& mode) const {
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
  if (!hasHierarchy()) {
    return "argument 'hierarchy' is '" + name +
        "' but this group has no hierarchy (lionbit sets it up on every rank: "
        "lionbit.all_reduce_sign(..., hierarchy=...) or DistributedLion(hierarchy=...))";
  }
  return "";
}

Hierarchy LionBitBackend::hierarchy() {
  std::lock_guard<std::mutex> lock(hierarchy_mutex_);
  return Hierarchy{node_->signComm(), cross_->signComm(), order_, node_ranks_};
}

std::map<std::string, double> LionBitBackend::hierarchyStats() {
  std::lock_guard<std::mutex> lock(hierarchy_mutex_);
  if (!node_) {
    return {};
  }
  return {
      {"intra_node_bytes_sent", static_cast<double>(node_->stats_.bytes_sent.load())},
      {"intra_node_bytes_received", static_cast<double>(node_->stats_.bytes_received.load())},
      {"inter_node_bytes_sent", static_cast<double>(cross_->stats_.bytes_sent.load())},
      {"inter_node_bytes_received", static_cast<double>(cross_->stats_.bytes_received.load())},
  };
}

void LionBitBackend::resetHierarchyStats() {
  std::lock_guard<std::mutex> lock(hierarchy_mutex_);
  if (node_) {
    node_->stats_.reset();
    cross_->stats_.reset();
  }
}

c10d::Backend& LionBitBackend::forwardInner() {
  TORCH_CHECK(
      forward_, "lionbit on rank ", rank_,
      ": the backend was shut down (destroy_process_group, ProcessGroup.shutdown() "
      "or interpreter exit); create a new process group");
  return *forward_;
}

c10d::Backend& LionBitBackend::inner(const at::Tensor& t) {
  if (forward_cuda_ && t.defined() && t.is_cuda()) {
    return *forward_cuda_;
  }
  return forwardInner();
}

c10d::Backend& LionBitBackend::inner(const std::vector<at::Tensor>& ts) {
  return ts.empty() ? forwardInner() : inner(ts.front());
}

std::vector<c10::intrusive_ptr<c10d::Backend>> LionBitBackend::takeCpuInners() {
  std::vector<c10::intrusive_ptr<c10d::Backend>> taken;
  taken.push_back(std::move(forward_));
  taken.push_back(std::move(sign_));
  return taken;
}

std::vector<c10d::Backend*> LionBitBackend::inners() {
  std::vector<c10d::Backend*> all;
  for (auto* b : {&forward_, &sign_, &forward_cuda_, &sign_cuda_}) {
    if (*b) {
      all.push_back(b->get());
    }
  }
  return all;
}

namespace {

#ifdef LIONBIT_WITH_CUDA
constexpr bool kCudaBuilt = true;
#else
constexpr bool kCudaBuilt = false;
#endif

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

// `body` as the worker runs it for tensors on the device of uses[0]: as it
// is on CPU; on CUDA ordered after the caller's stream (cuda_stream.hpp).
SignJob on_device(std::vector<at::Tensor> uses, SignJob body) {
#ifdef LIONBIT_WITH_CUDA
  if (uses.at(0).is_cuda()) {
    return cuda_ordered_job(std::move(uses), std::move(body));
  }
#endif
  return body;
}

} // namespace

// The inner Gloo backends' worker threads hold each finished collective until
// they pick up the next one, and releasing it frees its tensors: when the
// caller has dropped them already (all_gather_object's, say), a tensor's
// Python twin goes too, which takes the GIL. Were the interpreter finalizing
// by then, the GIL would end that thread (pthread_exit, unwinding through
// the tensor's noexcept destructor: "terminate called without an active
// exception", an abort at exit). So the inner CPU backends are dropped at
// shutdown and at exit, before finalization (the bindings call this without
// the GIL): the last reference goes, the destructor joins the workers, and
// whatever they still held is released while the interpreter is whole. (If
// something else still holds an inner backend, its threads live on as they
// would for plain gloo.) Later calls raise (forwardInner); the sign path's
// are cancelled already.
void LionBitBackend::shutdownAllWorkers() {
  std::vector<c10::intrusive_ptr<c10d::Backend>> inners;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    for (LionBitBackend* b : registry()) {
      b->executor_.shutdown();
      for (auto& inner : b->takeCpuInners()) {
        inners.push_back(std::move(inner));
      }
    }
  }
  // Outside the registry lock: a worker releasing a Python object runs
  // Python code, which must not find lionbit's lock taken.
  inners.clear();
}

bits::SignOp LionBitBackend::validate(
    Collective kind,
    const std::string& op_name,
    const std::string& tie_break,
    int64_t tie_seed,
    TieSpec& tie,
    const std::function<std::string(bits::SignOp)>& problem) {
  const auto op = parse_op(op_name);
  const auto mode = parse_tie(tie_break);
  std::string reason;
  if (!op) {
    reason = "argument 'op' is '" + op_name + "'; expected 'vote', 'avg' or 'sum'";
  } else if (!mode) {
    reason = "argument 'tie_break' is '" + tie_break +
        "'; expected 'zero', 'alternate' or 'random'";
  } else if (
      *mode != bits::TieBreak::kZero && *op != bits::SignOp::kVote &&
      *op != bits::SignOp::kLevels) {
    reason = "argument 'tie_break' is '" + tie_break + "', which applies to op 'vote' ('" +
        op_name + "' has no ties)";
  } else {
    reason = problem(*op);
  }
  if (mode) {
    tie = TieSpec{*mode, tie_seed};
  }
  if (!reason.empty()) {
    // Tell the peers in the header round so they fail now, not at timeout.
    const SignComm comm = signComm();
    const bits::SignOp announced = op.value_or(bits::SignOp::kVote);
    executor_.submit([this, comm, announced, kind](bool cancelled) {
      if (cancelled) {
        return;
      }
      try {
        reject_round(SignCall{comm, announced, kind, next_seq_++});
      } catch (...) {
        // The caller already has its error.
      }
    });
    TORCH_CHECK_VALUE(
        false, "lionbit ", collective_name(kind), "(op=", op_name, ") on rank ", rank_, ": ",
        reason);
  }
  return *op;
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::enqueue(
    Collective kind,
    bits::SignOp op,
    at::Tensor out,
    SignJob body) {
  auto work = c10::make_intrusive<SignWork>(rank_, kind, std::vector<at::Tensor>{out});
  out = at::Tensor();
  // What the job holds that Python may own too (tensors, the inner Gloo
  // backend, the Python parts of the caller's thread-local state): released
  // before the Work completes, while the caller still waits, never
  // afterwards on this thread (see SignWork::complete).
  // The caller's thread-local state (the profiler's, among others) goes
  // with it: the job's steps show in a trace as part of the caller's step.
  struct Held {
    SignComm comm;
    SignJob body;
    at::ThreadLocalState caller_state;
  };
  auto held = std::make_shared<Held>(Held{signComm(), std::move(body), at::ThreadLocalState()});
  const int rank = rank_;
  executor_.submit([this, held = std::move(held), kind, op, rank, work](bool cancelled) mutable {
    std::exception_ptr error;
    if (cancelled) {
      error = std::make_exception_ptr(c10::DistBackendError(
          {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
          c10::str(
              "lionbit ", collective_name(kind), "(op=", bits::sign_op_name(op), ") on rank ", rank,
              ": the backend was shut down before the call ran")));
    } else {
      try {
        at::ThreadLocalStateGuard state(held->caller_state);
        at::AutoGradMode no_grad(false);
        held->body(held->comm, next_seq_++);
      } catch (...) {
        error = std::current_exception();
      }
    }
    held.reset();
    if (error) {
      work->fail(error);
    } else {
      work->complete();
    }
  });
  return work;
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::allreduceSign(
    at::Tensor tensor,
    const std::string& op_name,
    const std::string& tie_break,
    int64_t tie_seed,
    const std::string& hierarchy_name) {
  TieSpec tie;
  HierarchyMode mode = HierarchyMode::kFlat;
  const bits::SignOp op = validate(
      Collective::kAllReduce, op_name, tie_break, tie_seed, tie, [&](bits::SignOp op) {
        return first_problem({
            [&] { return sign_op_problem(op); },
            [&] { return hierarchyProblem(hierarchy_name, op, mode); },
            [&] { return result_problem(tensor, "tensor", op, size_); },
        });
      });
  if (mode != HierarchyMode::kFlat) {
    return enqueue(
        Collective::kAllReduce, op, tensor,
        on_device(
            {tensor},
            [tensor, op, tie, mode, h = hierarchy()](const SignComm& comm, uint64_t seq) mutable {
              sign_allreduce_hierarchical(
                  comm, h, mode, tensor, nullptr, op, bits::CallRule{tie.at(seq), 0}, seq);
            }));
  }
  return enqueue(
      Collective::kAllReduce, op, tensor,
      on_device({tensor}, [tensor, op, tie](const SignComm& comm, uint64_t seq) mutable {
        sign_allreduce(comm, tensor, op, bits::CallRule{tie.at(seq), 0}, seq);
      }));
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::allreduceSignPacked(
    at::Tensor sign,
    at::Tensor zero,
    int64_t numel,
    int64_t nans,
    at::Tensor out,
    const std::string& op_name,
    const std::string& tie_break,
    int64_t tie_seed,
    const std::string& hierarchy_name) {
  TieSpec tie;
  HierarchyMode mode = HierarchyMode::kFlat;
  const bits::SignOp op = validate(
      Collective::kAllReduce, op_name, tie_break, tie_seed, tie, [&](bits::SignOp op) {
        const int64_t bits_needed = std::max<int64_t>(numel, 0);
        return first_problem({
            [&] { return sign_op_problem(op); },
            [&] { return hierarchyProblem(hierarchy_name, op, mode); },
            [&] { return packed_out_problem(out, op, size_, "numel", numel, nans, false); },
            [&] { return check_planes(sign, "sign", out.device(), bits_needed); },
            [&] { return check_planes(zero, "zero", out.device(), bits_needed); },
        });
      });
  return enqueue(
      Collective::kAllReduce, op, out,
      on_device(
          {out, sign, zero},
          [sign, zero, numel, nans, out, op, tie, mode,
           h = mode == HierarchyMode::kFlat ? Hierarchy{} : hierarchy()](
              const SignComm& comm, uint64_t seq) mutable {
            const PackedSigns in{
                sign, zero, static_cast<uint64_t>(numel), static_cast<uint64_t>(nans)};
            const bits::CallRule rule{tie.at(seq), 0};
            if (mode == HierarchyMode::kFlat) {
              sign_allreduce_packed(comm, in, out, op, rule, seq);
            } else {
              sign_allreduce_hierarchical(comm, h, mode, out, &in, op, rule, seq);
            }
          }));
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::allreduceLevelsPacked(
    at::Tensor planes,
    int64_t value_bits,
    int64_t numel,
    int64_t nans,
    at::Tensor out,
    const std::string& tie_break,
    int64_t tie_seed) {
  TieSpec tie;
  const bits::SignOp op = validate(
      Collective::kAllReduce, "l1", tie_break, tie_seed, tie, [&](bits::SignOp op) {
        const int64_t bits_needed = std::max<int64_t>(numel, 0);
        return first_problem({
            [&] { return bits_problem(value_bits); },
            [&] { return packed_out_problem(out, op, size_, "numel", numel, nans, false); },
            [&]() -> std::string {
              // `bits` planes of the same whole number of words, at least
              // ceil(numel / 64) each.
              const int64_t words = static_cast<int64_t>(bits::words_for(bits_needed));
              std::string why = check_planes(
                  planes, "planes", out.device(), 64 * words * value_bits);
              if (why.empty() && planes.numel() % (8 * value_bits) != 0) {
                why = "argument 'planes' must hold " + std::to_string(value_bits) +
                    " planes of a whole number of 64-bit words, got " +
                    std::to_string(planes.numel()) + " bytes";
              }
              return why;
            },
        });
      });
  return enqueue(
      Collective::kAllReduce, op, out,
      on_device(
          {out, planes},
          [planes, value_bits, numel, nans, out, tie](const SignComm& comm, uint64_t seq) mutable {
            const size_t plane_words = static_cast<size_t>(planes.numel()) / 8 /
                static_cast<size_t>(value_bits);
            const PackedLevels in{
                planes, plane_words, static_cast<int>(value_bits), static_cast<uint64_t>(numel),
                static_cast<uint64_t>(nans)};
            levels_allreduce_packed(comm, in, out, tie.at(seq), seq);
          }));
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::reduceScatterSignPacked(
    at::Tensor sign,
    at::Tensor zero,
    int64_t shard_numel,
    int64_t nans,
    at::Tensor out,
    const std::string& op_name,
    const std::string& tie_break,
    int64_t tie_seed,
    const std::string& hierarchy_name) {
  TieSpec tie;
  HierarchyMode mode = HierarchyMode::kFlat;
  const bits::SignOp op = validate(
      Collective::kReduceScatter, op_name, tie_break, tie_seed, tie, [&](bits::SignOp op) {
        // N shards, each starting on a word (checked once shard_numel is).
        const auto plane_bits = 8 *
            static_cast<int64_t>(reduce_scatter_plane_bytes(
                static_cast<uint64_t>(std::max<int64_t>(shard_numel, 0)), size_));
        return first_problem({
            [&] { return sign_op_problem(op); },
            [&] { return hierarchyProblem(hierarchy_name, op, mode); },
            [&] {
              return packed_out_problem(out, op, size_, "shard_numel", shard_numel, nans, true);
            },
            [&] { return check_planes(sign, "sign", out.device(), plane_bits); },
            [&] { return check_planes(zero, "zero", out.device(), plane_bits); },
        });
      });
  return enqueue(
      Collective::kReduceScatter, op, out,
      on_device(
          {out, sign, zero},
          [sign, zero, shard_numel, nans, out, op, tie, mode,
           h = mode == HierarchyMode::kFlat ? Hierarchy{} : hierarchy()](
              const SignComm& comm, uint64_t seq) mutable {
            const PackedShards in{
                sign, zero, static_cast<uint64_t>(shard_numel), static_cast<uint64_t>(nans)};
            if (mode == HierarchyMode::kFlat) {
              sign_reduce_scatter_packed(comm, in, out, op, tie.at(seq), seq);
            } else {
              sign_reduce_scatter_hierarchical(comm, h, mode, in, out, op, tie.at(seq), seq);
            }
          }));
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::reduceScatterLevelsPacked(
    at::Tensor planes,
    int64_t value_bits,
    int64_t shard_numel,
    int64_t nans,
    at::Tensor out,
    const std::string& tie_break,
    int64_t tie_seed) {
  TieSpec tie;
  const bits::SignOp op = validate(
      Collective::kReduceScatter, "l1", tie_break, tie_seed, tie, [&](bits::SignOp op) {
        const auto plane_bits = 8 *
            static_cast<int64_t>(reduce_scatter_plane_bytes(
                static_cast<uint64_t>(std::max<int64_t>(shard_numel, 0)), size_));
        return first_problem({
            [&] { return bits_problem(value_bits); },
            [&] {
              return packed_out_problem(out, op, size_, "shard_numel", shard_numel, nans, true);
            },
            [&]() -> std::string {
              std::string why = check_planes(
                  planes, "planes", out.device(), plane_bits * value_bits);
              if (why.empty() && planes.numel() * 8 != plane_bits * value_bits) {
                why = "argument 'planes' must hold exactly " + std::to_string(value_bits) +
                    " planes of " + std::to_string(plane_bits / 8) + " bytes, got " +
                    std::to_string(planes.numel()) + " bytes";
              }
              return why;
            },
        });
      });
  return enqueue(
      Collective::kReduceScatter, op, out,
      on_device(
          {out, planes},
          [planes, value_bits, shard_numel, nans, out, op, tie](
              const SignComm& comm, uint64_t seq) mutable {
            PackedShards in{
                planes, at::Tensor(), static_cast<uint64_t>(shard_numel),
                static_cast<uint64_t>(nans)};
            in.value_bits = static_cast<int>(value_bits);
            sign_reduce_scatter_packed(comm, in, out, op, tie.at(seq), seq);
          }));
}

// --- forwarding ------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> LionBitBackend::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  return inner(tensors).broadcast(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  return inner(tensors).allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::allreduce_sparse(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  return inner(tensors).allreduce_sparse(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  return inner(tensors).allreduce_coalesced(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  return inner(tensors).reduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return inner(inputs).allgather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  return inner(input)._allgather_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return inner(inputs).allgather_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return inner(inputs).allgather_into_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  return inner(inputs).gather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  return inner(outputs).scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return inner(outputs).reduce_scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  return inner(input)._reduce_scatter_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return inner(inputs).reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes,
    const c10d::AllToAllOptions& opts) {
  return inner(input).alltoall_base(output, input, output_split_sizes, input_split_sizes, opts);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  return inner(inputs).alltoall(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::send(
    std::vector<at::Tensor>& tensors,
    int dst_rank,
    int tag) {
  return inner(tensors).send(tensors, dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::recv(
    std::vector<at::Tensor>& tensors,
    int src_rank,
    int tag) {
  return inner(tensors).recv(tensors, src_rank, tag);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::recvAnysource(
    std::vector<at::Tensor>& tensors,
    int tag) {
  return inner(tensors).recvAnysource(tensors, tag);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::barrier(const c10d::BarrierOptions& opts) {
  return forwardInner().barrier(opts);
}

void LionBitBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  forwardInner().monitoredBarrier(opts, wait_all_ranks);
}

void LionBitBackend::setSequenceNumberForGroup() {
  forwardInner().setSequenceNumberForGroup();
}

uint64_t LionBitBackend::getSequenceNumberForGroup() {
  return forwardInner().getSequenceNumberForGroup();
}

bool LionBitBackend::supportsCoalescing() const {
  const auto& b = forwardCudaBackend();
  return b && b->supportsCoalescing();
}

void LionBitBackend::startCoalescing() {
  (forward_cuda_ ? *forward_cuda_ : forwardInner()).startCoalescing();
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::endCoalescing() {
  return (forward_cuda_ ? *forward_cuda_ : forwardInner()).endCoalescing();
}

void LionBitBackend::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  for (c10d::Backend* b : inners()) {
    b->setTimeout(timeout);
  }
}

void LionBitBackend::abort() {
  executor_.shutdown();
  for (c10d::Backend* b : inners()) {
    b->abort();
  }
}

void LionBitBackend::shutdown() {
  executor_.shutdown();
  for (c10d::Backend* b : inners()) {
    b->shutdown();
  }
  // Joins the inner Gloo workers now (see shutdownAllWorkers).
  takeCpuInners();
}

} // namespace lionbit
