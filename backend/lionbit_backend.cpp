#include <Python.h>

#include "backend/lionbit_backend.hpp"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <mutex>
#include <unordered_set>
#include <c10/util/Exception.h>

#include "backend/bits/count.h"
#include "backend/bits/unpack.h"
#include "backend/sign_reduce_scatter.hpp"
#include "backend/sign_work.hpp"
#ifdef LIONBIT_WITH_CUDA
#include "backend/sign_allreduce_cuda.hpp"
#endif

namespace lionbit {

namespace {
// Releases the GIL, if this thread holds it, for the scope. Tearing down
// waits for other threads - lionbit's worker, the inner Gloo backends' worker
// threads - that may need the GIL to release tensors Python also owns, while
// the thread tearing down (a Python call such as destroy_process_group, the
// ProcessGroup's deallocation, the interpreter's teardown) may hold it:
// waiting with the GIL held deadlocks. (torch binds its own backends with a
// holder that does the same.)
class WithoutGil {
 public:
  WithoutGil()
      : saved_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~WithoutGil() {
    if (saved_ != nullptr) {
      PyEval_RestoreThread(saved_);
    }
  }
  WithoutGil(const WithoutGil&) = delete;
  WithoutGil& operator=(const WithoutGil&) = delete;

 private:
  PyThreadState* saved_;
};
} // namespace

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
      forward_->getRank() == rank && forward_->getSize() == size &&
          sign_->getRank() == rank && sign_->getSize() == size,
      "lionbit: inner backends span rank ", forward_->getRank(), "/",
      forward_->getSize(), " and ", sign_->getRank(), "/", sign_->getSize(),
      ", expected rank ", rank, " of ", size);
  for (const auto* b : {&forward_cuda_, &sign_cuda_}) {
    TORCH_CHECK_VALUE(
        !*b || ((*b)->getRank() == rank && (*b)->getSize() == size),
        "lionbit: the inner CUDA backends must span rank ", rank, " of ", size);
  }
  // Last: a constructor that throws never runs the destructor, which would
  // have unregistered it.
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().insert(this);
}

LionBitBackend::~LionBitBackend() {
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry().erase(this);
  }
  WithoutGil no_gil;
  executor_.shutdown();
  // The inner Gloo backends join their worker threads when destroyed: drop
  // them here, without the GIL, not in the implicit member destructors.
  forward_.reset();
  sign_.reset();
  forward_cuda_.reset();
  sign_cuda_.reset();
}

SignComm LionBitBackend::signComm() {
  return SignComm{sign_, rank_, size_, &stats_, sign_cuda_, &tie_hint_};
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

// Why `tensor` / `op` cannot go through the sign all-reduce on a group of
// `world` ranks; empty when they can.
std::string reject_reason(
    const at::Tensor& tensor,
    const std::string& op_name,
    int world,
    bits::SignOp* op) {
#ifdef LIONBIT_WITH_CUDA
  constexpr bool cuda_built = true;
#else
  constexpr bool cuda_built = false;
#endif
  if (op_name == "vote") {
    *op = bits::SignOp::kVote;
  } else if (op_name == "avg") {
    *op = bits::SignOp::kAvg;
  } else if (op_name == "sum") {
    *op = bits::SignOp::kSum;
  } else {
    return "argument 'op' is '" + op_name + "'; expected 'vote', 'avg' or 'sum'";
  }
  if (!tensor.defined()) {
    return "argument 'tensor' is undefined";
  }
  if (tensor.layout() != at::kStrided) {
    return "argument 'tensor' has layout " + c10::str(tensor.layout()) +
        "; only dense (strided) tensors are supported";
  }
  if (tensor.device().type() != at::kCPU) {
    if (tensor.is_cuda() && cuda_built) {
      // the CUDA path
    } else if (tensor.is_cuda()) {
      return "argument 'tensor' is on " + tensor.device().str() +
          "; this build of lionbit runs the sign all-reduce on CPU tensors "
          "only (it was built without the CUDA path: no nvcc or a CPU-only "
          "torch at build time)";
    } else {
      return "argument 'tensor' is on " + tensor.device().str() +
          "; the sign all-reduce supports CPU and CUDA tensors";
    }
  }
  const auto dtype = bits_dtype(tensor.scalar_type());
  if (!dtype) {
    return "argument 'tensor' has dtype " +
        std::string(c10::toString(tensor.scalar_type())) +
        "; supported: float32, float16, bfloat16, float64, int8";
  }
  if (*op == bits::SignOp::kAvg && *dtype == bits::DType::kInt8) {
    return "op 'avg' needs a floating dtype: int8 cannot hold sum/N";
  }
  if (*op == bits::SignOp::kSum && *dtype == bits::DType::kInt8 &&
      world > 127) {
    return "op 'sum' on int8 needs a world size <= 127 (it is " +
        std::to_string(world) + ")";
  }
  if (*op != bits::SignOp::kVote &&
      bits::code_planes(world, true) > bits::kMaxUnpackPlanes) {
    return "op '" + op_name + "' supports world sizes up to 32767";
  }
  if (static_cast<uint64_t>(tensor.numel()) > bits::kMaxNumel) {
    return "argument 'tensor' has " + std::to_string(tensor.numel()) +
        " elements; at most 2^48 are supported";
  }
  const at::MemOverlap overlap = at::has_internal_overlap(tensor);
  if (overlap == at::MemOverlap::Yes ||
      (overlap == at::MemOverlap::TooHard && tensor.numel() > 1 &&
       !provably_no_overlap(tensor))) {
    return "argument 'tensor' has elements that share memory (an expand()ed "
           "or as_strided view); the result cannot be written in place";
  }
  return "";
}

} // namespace

void LionBitBackend::stopWorker() {
  WithoutGil no_gil;
  executor_.shutdown();
}

// The inner Gloo backends' worker threads hold each finished collective until
// they pick up the next one, and releasing it frees its tensors: when the
// caller has dropped them already (all_gather_object's, say), a tensor's
// Python twin goes too, which takes the GIL. Were the interpreter finalizing
// by then, the GIL would end that thread (pthread_exit, unwinding through
// the tensor's noexcept destructor: "terminate called without an active
// exception", an abort at exit). So the inner CPU backends are dropped at
// shutdown and at exit, before finalization, without the GIL: the last
// reference goes, the destructor joins the workers, and whatever they still
// held is released while the interpreter is whole. (If something else still
// holds an inner backend, its threads live on as they would for plain gloo.)
// Later calls raise (forwardInner); the sign path's are cancelled already.
void LionBitBackend::shutdownAllWorkers() {
  std::vector<c10::intrusive_ptr<c10d::Backend>> inners;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    for (LionBitBackend* b : registry()) {
      b->stopWorker();
      for (auto& inner : b->takeCpuInners()) {
        inners.push_back(std::move(inner));
      }
    }
  }
  // Outside the registry lock: a worker releasing a Python object runs
  // Python code, which must not find lionbit's lock taken.
  WithoutGil no_gil;
  inners.clear();
}

void LionBitBackend::reject(
    bits::SignOp op,
    const std::string& op_name,
    const std::string& reason,
    bool reduce_scatter) {
  // Tell the peers in the header round so they fail now, not at timeout.
  const SignComm comm = signComm();
  executor_.submit([this, comm, op, reduce_scatter](bool cancelled) {
    if (cancelled) {
      return;
    }
    const uint64_t seq = next_seq_++;
    try {
      if (reduce_scatter) {
        sign_reduce_scatter_reject(comm, op, seq);
      } else {
        sign_allreduce_reject(comm, op, seq);
      }
    } catch (...) {
      // The caller already has its error.
    }
  });
  TORCH_CHECK_VALUE(
      false, "lionbit ", reduce_scatter ? "reduce_scatter_sign" : "all_reduce_sign",
      "(op=", op_name, ") on rank ", rank_, ": ", reason);
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::enqueue(
    bits::SignOp op,
    at::Tensor out,
    std::function<void(const SignComm&, uint64_t)> body) {
  auto work = c10::make_intrusive<SignWork>(rank_, std::vector<at::Tensor>{out});
  out = at::Tensor();
  // What the job holds that Python may own too (tensors, the inner Gloo
  // backend): released before the Work completes, while the caller still
  // waits, never afterwards on this thread (see SignWork::complete).
  struct Held {
    SignComm comm;
    std::function<void(const SignComm&, uint64_t)> body;
  };
  auto held = std::make_shared<Held>(Held{signComm(), std::move(body)});
  const int rank = rank_;
  executor_.submit([this, held = std::move(held), op, rank, work](bool cancelled) mutable {
    std::exception_ptr error;
    if (cancelled) {
      error = std::make_exception_ptr(c10::DistBackendError(
          {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
          c10::str(
              "lionbit all_reduce_sign(op=", bits::sign_op_name(op), ") on rank ",
              rank, ": the backend was shut down before the call ran")));
    } else {
      try {
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
    const std::string& op_name) {
  bits::SignOp op = bits::SignOp::kVote;
  const std::string reason = reject_reason(tensor, op_name, size_, &op);
  if (!reason.empty()) {
    reject(op, op_name, reason);
  }
#ifdef LIONBIT_WITH_CUDA
  if (tensor.is_cuda()) {
    auto ready = cuda_mark_ready(tensor);
    return enqueue(op, tensor, [tensor, op, ready](const SignComm& comm, uint64_t seq) mutable {
      sign_allreduce_cuda(comm, tensor, op, seq, ready);
    });
  }
#endif
  return enqueue(op, tensor, [tensor, op](const SignComm& comm, uint64_t seq) mutable {
    sign_allreduce(comm, tensor, op, seq);
  });
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::allreduceSignPacked(
    at::Tensor sign,
    at::Tensor zero,
    int64_t numel,
    int64_t nans,
    at::Tensor out,
    const std::string& op_name) {
  bits::SignOp op = bits::SignOp::kVote;
  std::string reason = reject_reason(out, op_name, size_, &op);
  const int64_t need = static_cast<int64_t>(bits::words_for(static_cast<size_t>(std::max<int64_t>(numel, 0))) * 8);
  auto plane_problem = [&](const at::Tensor& t, const char* name) -> std::string {
    if (!t.defined() || t.device().type() != at::kCPU || t.scalar_type() != at::kByte ||
        !t.is_contiguous() || t.numel() < need) {
      return std::string("argument '") + name + "' must be a contiguous CPU uint8 tensor of at least " +
          std::to_string(need) + " bytes";
    }
    return "";
  };
  if (reason.empty() && (numel < 0 || nans < 0)) {
    reason = "arguments 'numel' and 'nans' must be >= 0";
  }
  if (reason.empty() && (out.numel() != numel || !out.is_contiguous())) {
    reason = "argument 'out' must be contiguous with numel elements (" + std::to_string(numel) + ")";
  }
  if (reason.empty()) {
    reason = plane_problem(sign, "sign");
  }
  if (reason.empty()) {
    reason = plane_problem(zero, "zero");
  }
  if (!reason.empty()) {
    reject(op, op_name, reason);
  }
  return enqueue(op, out, [sign, zero, numel, nans, out, op](const SignComm& comm, uint64_t seq) mutable {
    const PackedSigns in{
        reinterpret_cast<const uint64_t*>(sign.data_ptr<uint8_t>()),
        reinterpret_cast<const uint64_t*>(zero.data_ptr<uint8_t>()),
        static_cast<uint64_t>(numel), static_cast<uint64_t>(nans)};
    sign_allreduce_packed(comm, in, out, op, seq);
  });
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::allreduceSignPackedDevice(
    at::Tensor sign,
    at::Tensor zero,
    at::Tensor counts,
    int64_t numel,
    at::Tensor out,
    const std::string& op_name) {
  bits::SignOp op = bits::SignOp::kVote;
  std::string reason = reject_reason(out, op_name, size_, &op);
  if (reason.empty() && !out.is_cuda()) {
    reason = "argument 'out' must be a CUDA tensor (planes packed on the GPU)";
  }
  if (reason.empty() && (numel < 0 || out.numel() != numel || !out.is_contiguous())) {
    reason = "argument 'out' must be contiguous with numel elements (" + std::to_string(numel) + ")";
  }
  const int64_t need = static_cast<int64_t>(bits::words_for(static_cast<size_t>(std::max<int64_t>(numel, 0))) * 8);
  auto problem = [&](const at::Tensor& t, const char* name, at::ScalarType dt, int64_t at_least) -> std::string {
    if (!t.defined() || t.device() != out.device() || t.scalar_type() != dt || !t.is_contiguous() ||
        t.numel() < at_least) {
      return std::string("argument '") + name + "' must be a contiguous " + c10::toString(dt) +
          " tensor on " + out.device().str() + " of at least " + std::to_string(at_least) + " elements";
    }
    return "";
  };
  if (reason.empty()) {
    reason = problem(sign, "sign", at::kByte, need);
  }
  if (reason.empty()) {
    reason = problem(zero, "zero", at::kByte, need);
  }
  if (reason.empty()) {
    reason = problem(counts, "counts", at::kLong, 2);
  }
  if (!reason.empty()) {
    reject(op, op_name, reason);
  }
#ifdef LIONBIT_WITH_CUDA
  auto ready = cuda_mark_ready(out);
  return enqueue(op, out, [sign, zero, counts, numel, out, op, ready](const SignComm& comm, uint64_t seq) mutable {
    sign_allreduce_cuda_packed(comm, sign, zero, counts, numel, out, op, seq, ready);
  });
#else
  reject(op, op_name, "this build of lionbit has no CUDA path");
#endif
}

c10::intrusive_ptr<c10d::Work> LionBitBackend::reduceScatterSignPacked(
    at::Tensor sign,
    at::Tensor zero,
    int64_t shard_numel,
    int64_t nans,
    at::Tensor out,
    const std::string& op_name) {
  bits::SignOp op = bits::SignOp::kVote;
  std::string reason = reject_reason(out, op_name, size_, &op);
  if (reason.empty() && (shard_numel < 0 || nans < 0)) {
    reason = "arguments 'shard_numel' and 'nans' must be >= 0";
  }
  if (reason.empty() && static_cast<uint64_t>(shard_numel) * static_cast<uint64_t>(size_) > bits::kMaxNumel) {
    reason = "argument 'shard_numel' is too large (" + std::to_string(shard_numel) + " per rank)";
  }
  if (reason.empty() && (out.numel() != shard_numel || !out.is_contiguous())) {
    reason = "argument 'out' must be contiguous with shard_numel elements (" +
        std::to_string(shard_numel) + "), got " + std::to_string(out.numel());
  }
  const int64_t need = reason.empty()
      ? static_cast<int64_t>(reduce_scatter_plane_bytes(static_cast<uint64_t>(shard_numel), size_))
      : 0;
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{sign, "sign"}, {zero, "zero"}}) {
    if (reason.empty() &&
        (!t.defined() || t.device().type() != at::kCPU || t.scalar_type() != at::kByte ||
         !t.is_contiguous() || t.numel() < need)) {
      reason = std::string("argument '") + name + "' must be a contiguous CPU uint8 tensor of at least " +
          std::to_string(need) + " bytes (" + std::to_string(size_) + " shards of ceil(" +
          std::to_string(shard_numel) + " / 64) words)";
    }
  }
  if (!reason.empty()) {
    reject(op, op_name, reason, /*reduce_scatter=*/true);
  }
  return enqueue(op, out, [sign, zero, shard_numel, nans, out, op](const SignComm& comm, uint64_t seq) mutable {
    const PackedShards in{
        reinterpret_cast<const uint64_t*>(sign.data_ptr<uint8_t>()),
        reinterpret_cast<const uint64_t*>(zero.data_ptr<uint8_t>()),
        static_cast<uint64_t>(shard_numel), static_cast<uint64_t>(nans)};
    sign_reduce_scatter_packed(comm, in, out, op, seq);
  });
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
  return inner(input).alltoall_base(
      output, input, output_split_sizes, input_split_sizes, opts);
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

c10::intrusive_ptr<c10d::Work> LionBitBackend::barrier(
    const c10d::BarrierOptions& opts) {
  return forwardInner().barrier(opts);
}

void LionBitBackend::monitoredBarrier(
    const c10d::BarrierOptions& opts,
    bool wait_all_ranks) {
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
  WithoutGil no_gil;
  executor_.shutdown();
  for (c10d::Backend* b : inners()) {
    b->abort();
  }
}

void LionBitBackend::shutdown() {
  WithoutGil no_gil;
  executor_.shutdown();
  for (c10d::Backend* b : inners()) {
    b->shutdown();
  }
  // Joins the inner Gloo workers now (see shutdownAllWorkers).
  takeCpuInners();
}

} // namespace lionbit
