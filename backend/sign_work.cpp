#include "backend/sign_work.hpp"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <utility>

namespace lionbit {

namespace {
// A future over CUDA tensors carries their devices: it then records events
// on the completing thread's current streams and makes whoever waits on it
// (wait(), value(), then()) order their current streams after them.
std::vector<c10::Device> devices_of(const std::vector<at::Tensor>& ts) {
  std::vector<c10::Device> devices;
  for (const auto& t : ts) {
    if (t.defined() && t.is_cuda() &&
        std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
      devices.push_back(t.device());
    }
  }
  return devices;
}
} // namespace

SignWork::SignWork(
    int rank,
    std::shared_ptr<const RankNames> names,
    Collective kind,
    std::vector<at::Tensor> outputs)
    : c10d::Work(
          rank,
          kind == Collective::kReduceScatter ? c10d::OpType::REDUCE_SCATTER
                                             : c10d::OpType::ALLREDUCE,
          // Static strings: the profiler keeps the pointer.
          kind == Collective::kReduceScatter ? "lionbit:reduce_scatter_sign"
                                             : "lionbit:all_reduce_sign",
          outputs),
      names_(std::move(names)),
      kind_(kind),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()),
          devices_of(outputs_))) {}

void SignWork::end_profiling() {
  if (recordFunctionEndCallback_) {
    recordFunctionEndCallback_();
    recordFunctionEndCallback_ = nullptr;
  }
}

void SignWork::complete() {
  end_profiling();
  // The future keeps the outputs from here on: this Work holds no tensor
  // after completion, so releasing it (on the worker thread, perhaps while
  // the interpreter finalizes) never touches a Python object.
  future_->markCompleted(c10::IValue(take_outputs()));
}

void SignWork::fail(std::exception_ptr error) {
  end_profiling();
  take_outputs();
  future_->setError(std::move(error));
}

std::vector<at::Tensor> SignWork::take_outputs() {
  std::lock_guard<std::mutex> lock(outputs_mu_);
  handed_over_ = true;
  return std::exchange(outputs_, {});
}

bool SignWork::isCompleted() {
  return future_->completed();
}

bool SignWork::isSuccess() const {
  return future_->completed() && !future_->hasError();
}

std::exception_ptr SignWork::exception() const {
  return future_->completed() ? future_->exception_ptr() : nullptr;
}

std::vector<at::Tensor> SignWork::result() {
  {
    std::lock_guard<std::mutex> lock(outputs_mu_);
    if (!handed_over_) {
      return outputs_;
    }
  }
  // The worker has taken them: the future has them (or an error) at once.
  future_->wait();
  return future_->hasError() ? std::vector<at::Tensor>{} : future_->value().toTensorVector();
}

bool SignWork::wait(std::chrono::milliseconds timeout) {
  // Without a timeout: the worker always completes the future, as every inner
  // collective it waits on is bounded by the process group's timeout.
  if (timeout != kNoTimeout) {
    auto state = std::make_shared<std::pair<std::mutex, std::condition_variable>>();
    future_->addCallback([state](c10::ivalue::Future&) {
      std::lock_guard<std::mutex> lock(state->first);
      state->second.notify_all();
    });
    std::unique_lock<std::mutex> lock(state->first);
    const bool done = state->second.wait_for(
        lock, timeout, [this] { return future_->completed(); });
    TORCH_CHECK(
        done, "lionbit ", collective_name(kind_), " on ", names_->here(rank_),
        ": Work.wait() timed out after ", timeout.count(), " ms");
  }
  // Also with a timeout, once completed: the caller's current streams wait
  // for the worker's, so a GPU result is ordered before what the caller
  // queues next.
  future_->wait();
  if (future_->hasError()) {
    std::rethrow_exception(future_->exception_ptr());
  }
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> SignWork::getFuture() {
  return future_;
}

} // namespace lionbit
