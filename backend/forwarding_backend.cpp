#include "backend/forwarding_backend.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace lionbit {
namespace {

// Several works as one: waits on each in order (the collectives were issued
// in that order on every rank).
class WorkList : public c10d::Work {
 public:
  WorkList(std::vector<c10::intrusive_ptr<c10d::Work>> works, c10d::OpType type)
      : c10d::Work(-1, type), works_(std::move(works)) {}

  bool isCompleted() override {
    for (const auto& w : works_) {
      if (!w->isCompleted()) {
        return false;
      }
    }
    return true;
  }

  bool wait(std::chrono::milliseconds timeout) override {
    for (const auto& w : works_) {
      w->wait(timeout);
    }
    return true;
  }

  void synchronize() override {
    for (const auto& w : works_) {
      w->synchronize();
    }
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

c10::intrusive_ptr<c10d::Work> asOne(
    std::vector<c10::intrusive_ptr<c10d::Work>> works,
    c10d::OpType type) {
  if (works.size() == 1) {
    return std::move(works.front());
  }
  return c10::make_intrusive<WorkList>(std::move(works), type);
}

bool anyCuda(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) {
    if (t.defined() && t.is_cuda()) {
      return true;
    }
  }
  return false;
}

// PREMUL_SUM (each rank's input times a factor, then the sum: FSDP2's
// set_gradient_divide_factor) is NCCL's; Gloo refuses it. On Gloo lionbit
// applies the factor itself, to the tensors an all-reduce overwrites anyway
// or to copies of a reduce-scatter's inputs (which stay as they were), and
// asks Gloo for SUM: the same products, summed.
bool isPremulSum(const c10d::ReduceOp& op) {
  return op.op_ == c10d::ReduceOp::PREMUL_SUM;
}

const c10d::NCCLPreMulSumSupplement& premulFactor(
    const c10d::ReduceOp& op,
    const RankNames& names,
    int rank,
    const char* what) {
  const auto* factor = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK_VALUE(
      factor != nullptr, "lionbit on ", names.here(rank), ": ", what,
      ": ReduceOp.PREMUL_SUM without its factor");
  return *factor;
}

void scaleInPlace(at::Tensor& t, const c10d::NCCLPreMulSumSupplement& f) {
  if (f.tensor_factor.defined()) {
    t.mul_(f.tensor_factor);
  } else {
    t.mul_(f.double_factor);
  }
}

at::Tensor scaled(const at::Tensor& t, const c10d::NCCLPreMulSumSupplement& f) {
  return f.tensor_factor.defined() ? t.mul(f.tensor_factor) : t.mul(f.double_factor);
}

template <typename Options>
Options asSum(const Options& opts) {
  Options sum = opts;
  sum.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
  return sum;
}

// AVG of integer tensors is NCCL's (the sum divided by the world size,
// rounded toward zero); Gloo divides in floating point and cannot write the
// quotient back ("result type Float can't be cast to the desired output type
// Long"). Lightning's self.log(..., sync_dist=True) sends it (it replaces AVG
// by SUM only for a backend named "gloo"). On Gloo lionbit asks for SUM and
// divides when the sum is in, as NCCL would.
bool isIntegerAvg(const c10d::ReduceOp& op, const std::vector<at::Tensor>& ts) {
  return op.op_ == c10d::ReduceOp::AVG && !ts.empty() &&
      at::isIntegralType(ts.front().scalar_type(), /*includeBool=*/false);
}

c10::intrusive_ptr<c10d::Work> dividedWhenDone(
    const c10::intrusive_ptr<c10d::Work>& sum,
    std::vector<at::Tensor> tensors,
    int size) {
  auto done = sum->getFuture();
  auto divided = done->then(
      [tensors = std::move(tensors), size](c10::ivalue::Future& f) {
        f.value(); // rethrows the sum's error
        for (const auto& t : tensors) {
          t.div_(size, "trunc");
        }
        return c10::IValue(tensors);
      },
      done->elementType());
  return c10d::Work::create_from_future(divided);
}

} // namespace

ForwardingBackend::ForwardingBackend(
    c10::intrusive_ptr<c10d::Backend> forward,
    c10::intrusive_ptr<c10d::Backend> forward_cuda,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::vector<int>& global_ranks)
    : c10d::Backend(rank, size),
      forward_(std::move(forward)),
      forward_cuda_(std::move(forward_cuda)),
      timeout_(timeout),
      names_(std::make_shared<const RankNames>(size, global_ranks)) {
  TORCH_CHECK_VALUE(forward_, "lionbit: argument 'forward' is None");
}

c10d::Backend& ForwardingBackend::forwardInner() {
  TORCH_CHECK(
      forward_, "lionbit on ", here(),
      ": the backend was shut down (destroy_process_group, ProcessGroup.shutdown() "
      "or interpreter exit); create a new process group");
  return *forward_;
}

c10d::Backend& ForwardingBackend::inner(const at::Tensor& t) {
  if (forward_cuda_ && t.defined() && t.is_cuda()) {
    return *forward_cuda_;
  }
  return forwardInner();
}

c10d::Backend& ForwardingBackend::inner(const std::vector<at::Tensor>& ts) {
  return ts.empty() ? forwardInner() : inner(ts.front());
}

std::vector<c10d::Backend*> ForwardingBackend::inners() {
  std::vector<c10d::Backend*> all;
  for (auto* b : {&forward_, &forward_cuda_}) {
    if (*b) {
      all.push_back(b->get());
    }
  }
  return all;
}

std::vector<c10::intrusive_ptr<c10d::Backend>> ForwardingBackend::takeCpuInners() {
  std::vector<c10::intrusive_ptr<c10d::Backend>> taken;
  taken.push_back(std::move(forward_));
  return taken;
}


c10::intrusive_ptr<c10d::Work> ForwardingBackend::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  return inner(tensors).broadcast(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> ForwardingBackend::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  if (isPremulSum(opts.reduceOp) && toGloo(tensors)) {
    const auto& factor = premulFactor(opts.reduceOp, *names_, rank_, "allreduce");
    for (auto& t : tensors) {
      scaleInPlace(t, factor);
    }
    return inner(tensors).allreduce(tensors, asSum(opts));
  }
  if (isIntegerAvg(opts.reduceOp, tensors) && toGloo(tensors)) {
    return dividedWhenDone(inner(tensors).allreduce(tensors, asSum(opts)), tensors, size_);
  }
  return inner(tensors).allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> ForwardingBackend::allreduce_sparse(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  return inner(tensors).allreduce_sparse(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> ForwardingBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  if (isPremulSum(opts.reduceOp) && toGloo(tensors)) {
    const auto& factor = premulFactor(opts.reduceOp, *names_, rank_, "allreduce_coalesced");
    for (auto& t : tensors) {
      scaleInPlace(t, factor);
    }
    return inner(tensors).allreduce_coalesced(tensors, asSum(opts));
  }
  return inner(tensors).allreduce_coalesced(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> ForwardingBackend::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  return inner(tensors).reduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> ForwardingBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return inner(inputs).allgather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ForwardingBackend::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  return inner(input)._allgather_base(output, input, opts);
}

bool ForwardingBackend::glooOnCuda(const std::vector<at::Tensor>& ts) const {
  return !forward_cuda_ && anyCuda(ts);
}

bool ForwardingBackend::toGloo(const std::vector<at::Tensor>& ts) const {
  return !(forward_cuda_ && anyCuda(ts));
}

// ProcessGroupGloo's two coalesced all-gathers run its host algorithm on
// whatever pointers they get: on CUDA tensors they read device memory as host
// memory and crash (torch 2.11; pytorch issue 152645). torch's functional
// all_gather_into_tensor (DTensor.full_tensor(), FSDP2's state dicts) is one
// of them. On the Gloo CUDA transport lionbit issues one Gloo all-gather per
// tensor instead (that one stages CUDA tensors through host memory), in the
// same order on every rank.
c10::intrusive_ptr<c10d::Work> ForwardingBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (!glooOnCuda(inputs)) {
    return inner(inputs).allgather_coalesced(outputs, inputs, opts);
  }
  TORCH_CHECK_VALUE(
      outputs.size() == static_cast<size_t>(size_), "lionbit on ", here(),
      ": allgather_coalesced: 'output_lists' has ", outputs.size(), " lists, expected one a rank (",
      size_, ")");
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::vector<std::vector<at::Tensor>> out(1);
    for (auto& from_rank : outputs) {
      TORCH_CHECK_VALUE(
          from_rank.size() == inputs.size(), "lionbit on ", here(),
          ": allgather_coalesced: an output list has ", from_rank.size(), " tensors for ",
          inputs.size(), " inputs");
      out[0].push_back(from_rank[i]);
    }
    std::vector<at::Tensor> in{inputs[i]};
    works.push_back(forwardInner().allgather(out, in, opts));
  }
  return asOne(std::move(works), c10d::OpType::ALLGATHER_COALESCED);
}

c10::intrusive_ptr<c10d::Work> ForwardingBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (!glooOnCuda(inputs)) {
    return inner(inputs).allgather_into_tensor_coalesced(outputs, inputs, opts);
  }
  TORCH_CHECK_VALUE(
      outputs.size() == inputs.size(), "lionbit on ", here(),
      ": allgather_into_tensor_coalesced: ", outputs.size(), " outputs for ", inputs.size(),
      " inputs");
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (size_t i = 0; i < inputs.size(); ++i) {
    works.push_back(forwardInner()._allgather_base(outputs[i], inputs[i], opts));
  }
  return asOne(std::move(works), c10d::OpType::COALESCED);
}

c10::intrusive_ptr<c10d::Work> ForwardingBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  return inner(inputs).gather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ForwardingBackend::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  return inner(outputs).scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ForwardingBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (isPremulSum(opts.reduceOp) && toGloo(outputs)) {
    const auto& factor = premulFactor(opts.reduceOp, *names_, rank_, "reduce_scatter");
    std::vector<std::vector<at::Tensor>> copies(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      for (const auto& t : inputs[i]) {
        copies[i].push_back(scaled(t, factor));
      }
    }
    return inner(outputs).reduce_scatter(outputs, copies, asSum(opts));
  }
  return inner(outputs).reduce_scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ForwardingBackend::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  if (isPremulSum(opts.reduceOp) && toGloo({input})) {
    at::Tensor copy = scaled(
        input, premulFactor(opts.reduceOp, *names_, rank_, "reduce_scatter_tensor"));
    return inner(input)._reduce_scatter_base(output, copy, asSum(opts));
  }
  return inner(input)._reduce_scatter_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> ForwardingBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (isPremulSum(opts.reduceOp) && toGloo(inputs)) {
    const auto& factor = premulFactor(
        opts.reduceOp, *names_, rank_, "reduce_scatter_tensor_coalesced");
    std::vector<at::Tensor> copies;
    for (const auto& t : inputs) {
      copies.push_back(scaled(t, factor));
    }
    return inner(inputs).reduce_scatter_tensor_coalesced(outputs, copies, asSum(opts));
  }
  return inner(inputs).reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ForwardingBackend::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes,
    const c10d::AllToAllOptions& opts) {
  return inner(input).alltoall_base(output, input, output_split_sizes, input_split_sizes, opts);
}

c10::intrusive_ptr<c10d::Work> ForwardingBackend::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  return inner(inputs).alltoall(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ForwardingBackend::send(
    std::vector<at::Tensor>& tensors,
    int dst_rank,
    int tag) {
  return inner(tensors).send(tensors, dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> ForwardingBackend::recv(
    std::vector<at::Tensor>& tensors,
    int src_rank,
    int tag) {
  return inner(tensors).recv(tensors, src_rank, tag);
}

c10::intrusive_ptr<c10d::Work> ForwardingBackend::recvAnysource(
    std::vector<at::Tensor>& tensors,
    int tag) {
  return inner(tensors).recvAnysource(tensors, tag);
}

c10::intrusive_ptr<c10d::Work> ForwardingBackend::barrier(const c10d::BarrierOptions& opts) {
  return forwardInner().barrier(opts);
}

void ForwardingBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  forwardInner().monitoredBarrier(opts, wait_all_ranks);
}

void ForwardingBackend::setSequenceNumberForGroup() {
  forwardInner().setSequenceNumberForGroup();
}

uint64_t ForwardingBackend::getSequenceNumberForGroup() {
  return forwardInner().getSequenceNumberForGroup();
}

bool ForwardingBackend::supportsCoalescing() const {
  const auto& b = forwardCudaBackend();
  return b && b->supportsCoalescing();
}

void ForwardingBackend::startCoalescing() {
  (forward_cuda_ ? *forward_cuda_ : forwardInner()).startCoalescing();
}

c10::intrusive_ptr<c10d::Work> ForwardingBackend::endCoalescing() {
  return (forward_cuda_ ? *forward_cuda_ : forwardInner()).endCoalescing();
}

void ForwardingBackend::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  for (c10d::Backend* b : inners()) {
    b->setTimeout(timeout);
  }
}

void ForwardingBackend::abort() {
  stopOwnWork();
  for (c10d::Backend* b : inners()) {
    b->abort();
  }
}

void ForwardingBackend::shutdown() {
  stopOwnWork();
  for (c10d::Backend* b : inners()) {
    b->shutdown();
  }
  // Joins the inner Gloo workers now (LionBitBackend::shutdownAllWorkers).
  takeCpuInners();
}

} // namespace lionbit
