#include "backend/lionbit_backend.hpp"

#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>
#include <unordered_set>

#include "backend/sign_common.hpp"
#include "backend/sign_hierarchy.hpp"
#include "backend/sign_reduce_scatter.hpp"
#include "backend/sign_request.hpp"
#include "backend/sign_work.hpp"
#include "backend/torch_adapter.hpp"
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
    c10::intrusive_ptr<c10d::Backend> sign_cuda,
    const std::vector<int>& global_ranks)
    : ForwardingBackend(
          std::move(forward),
          std::move(forward_cuda),
          rank,
          size,
          timeout,
          global_ranks),
      sign_(std::move(sign)),
      sign_cuda_(std::move(sign_cuda)) {
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
  return SignComm{sign_, rank_, size_, &stats_, sign_cuda_, &tie_hint_, rankNames()};
}

void LionBitBackend::setHierarchy(
    const c10::intrusive_ptr<c10d::Backend>& node,
    const c10::intrusive_ptr<c10d::Backend>& cross,
    const std::vector<int64_t>& order,
    const std::vector<int64_t>& node_ranks) {
  auto* n = dynamic_cast<LionBitBackend*>(node.get());
  auto* x = dynamic_cast<LionBitBackend*>(cross.get());
  const std::string at = "lionbit set_hierarchy on " + here() + ": ";
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

std::vector<c10::intrusive_ptr<c10d::Backend>> LionBitBackend::takeCpuInners() {
  auto taken = ForwardingBackend::takeCpuInners();
  taken.push_back(std::move(sign_));
  return taken;
}

std::vector<c10d::Backend*> LionBitBackend::inners() {
  auto all = ForwardingBackend::inners();
  for (auto* b : {&sign_, &sign_cuda_}) {
    if (*b) {
      all.push_back(b->get());
    }
  }
  return all;
}

void LionBitBackend::stopOwnWork() {
  executor_.shutdown();
}

namespace {
LionBitBackend::Maker& maker() {
  static LionBitBackend::Maker make;
  return make;
}
} // namespace

void LionBitBackend::setMaker(Maker make) {
  maker() = std::move(make);
}

bool LionBitBackend::supportsSplitting() const {
  return static_cast<bool>(maker());
}

c10::intrusive_ptr<c10d::Backend::Options> LionBitBackend::getBackendOptions() {
  auto opts = c10::make_intrusive<Options>(getBackendName(), timeout_);
  opts->group_name = getGroupUid();
  opts->global_ranks_in_group.assign(rankNames()->table().begin(), rankNames()->table().end());
  return opts;
}

c10::intrusive_ptr<c10d::Backend> LionBitBackend::split(
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::vector<int>& ranks,
    const c10::intrusive_ptr<Options>& opts) {
  const std::string at = "lionbit split_group on " + here() + ": ";
  TORCH_CHECK(maker(), at, "no maker of lionbit backends (lionbit's Python module sets it)");
  std::vector<int> members = ranks;
  std::sort(members.begin(), members.end());
  for (size_t i = 0; i < members.size(); ++i) {
    TORCH_CHECK_VALUE(
        members[i] >= 0 && members[i] < size_ && (i == 0 || members[i] != members[i - 1]), at,
        "the new group's ranks must be distinct ranks of this group of ", size_, "; it has ",
        members[i]);
  }
  const auto mine = std::find(members.begin(), members.end(), rank_);
  if (mine == members.end()) {
    return {}; // not a member: no backend, as torch expects
  }
  const std::string name = opts ? opts->group_name : std::string();
  std::lock_guard<std::mutex> lock(split_mutex_);
  if (store.get() == split_store_ && name == split_name_) {
    if (auto child = split_child_.lock()) {
      return child; // the same split, asked for another device type
    }
  }
  auto child = maker()(
      store, static_cast<int>(mine - members.begin()), static_cast<int>(members.size()),
      opts ? opts->timeout : timeout_, rankNames()->of(members));
  TORCH_CHECK(child, at, "the maker returned no backend");
  split_store_ = store.get();
  split_name_ = name;
  split_child_ = c10::weak_intrusive_ptr<c10d::Backend>(child);
  return child;
}

namespace {

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

bits::SignOp LionBitBackend::validate(const SignRequest& r, TieSpec& tie, HierarchyMode& mode) {
  const auto op = parse_op(r.op);
  const auto rule = parse_tie(r.tie_break);
  std::string reason;
  if (!op) {
    reason = "argument 'op' is '" + r.op + "'; expected 'vote', 'avg' or 'sum'";
  } else if (!rule) {
    reason = "argument 'tie_break' is '" + r.tie_break +
        "'; expected 'zero', 'alternate' or 'random'";
  } else if (
      *rule != bits::TieBreak::kZero && *op != bits::SignOp::kVote &&
      *op != bits::SignOp::kLevels) {
    reason = "argument 'tie_break' is '" + r.tie_break + "', which applies to op 'vote' ('" + r.op +
        "' has no ties)";
  } else {
    reason = request_problem(r, *op, size_, hasHierarchy(), mode);
  }
  if (rule) {
    tie = TieSpec{*rule, r.tie_seed};
  }
  if (!reason.empty()) {
    // Tell the peers in the header round so they fail now, not at timeout.
    const SignComm comm = signComm();
    const bits::SignOp announced = op.value_or(bits::SignOp::kVote);
    const Collective kind = r.kind;
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
        false, "lionbit ", collective_name(r.kind), "(op=", r.op, ") on ", here(), ": ", reason);
  }
  return *op;
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::enqueue(
    Collective kind,
    bits::SignOp op,
    at::Tensor out,
    SignJob body,
    std::shared_ptr<Agreement> agreement) {
  auto work = c10::make_intrusive<SignWork>(rank_, rankNames(), kind, std::vector<at::Tensor>{out});
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
  executor_.submit([this, held = std::move(held), kind, op, work,
                    agreement = std::move(agreement)](bool cancelled) mutable {
    std::exception_ptr error;
    if (cancelled) {
      error = std::make_exception_ptr(c10::DistBackendError(
          {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
          c10::str(
              "lionbit ", collective_name(kind), "(op=", bits::sign_op_name(op), ") on ",
              held->comm.here(), ": the backend was shut down before the call ran")));
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
    if (agreement) {
      // (before the Work: a caller waits for the agreement first)
      if (error) {
        agreement->fail(error);
      } else {
        agreement->agree(false);
      }
      agreement.reset();
    }
    if (error) {
      work->fail(error);
    } else {
      work->complete();
    }
  });
  return work;
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::call(SignRequest r) {
  TieSpec tie;
  HierarchyMode mode = HierarchyMode::kFlat;
  const bits::SignOp op = validate(r, tie, mode);
  std::vector<at::Tensor> uses{r.result()};
  for (const at::Tensor* t : {&r.sign, &r.zero, &r.planes, &r.nans_tally}) {
    if (t->defined()) {
      uses.push_back(*t);
    }
  }
  const Collective kind = r.kind;
  at::Tensor result = r.result();
  std::shared_ptr<Agreement> agreement = r.agreement;
  return enqueue(
      kind, op, std::move(result),
      on_device(
          std::move(uses),
          [r = std::move(r), op, tie, mode,
           h = mode == HierarchyMode::kFlat ? Hierarchy{} : hierarchy()](
              const SignComm& comm, uint64_t seq) mutable {
            run_request(comm, h, r, op, tie.at(seq), mode, seq);
          }),
      std::move(agreement));
}

} // namespace lionbit
