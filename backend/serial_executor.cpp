#include "backend/serial_executor.hpp"

#include <utility>

namespace lionbit {

SerialExecutor::SerialExecutor()
    : state_(std::make_shared<State>()), thread_([state = state_] { loop(state); }) {}

SerialExecutor::~SerialExecutor() {
  shutdown();
}

void SerialExecutor::submit(Job job) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->stopping) {
      state_->queue.push_back(std::move(job));
      state_->cv.notify_one();
      return;
    }
  }
  job(/*cancelled=*/true);
}

void SerialExecutor::shutdown() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stopping = true;
    state_->cv.notify_all();
  }
  std::lock_guard<std::mutex> join_lock(join_mu_);
  if (!thread_.joinable()) {
    return;
  }
  if (thread_.get_id() == std::this_thread::get_id()) {
    thread_.detach();
  } else {
    thread_.join();
  }
}

void SerialExecutor::loop(const std::shared_ptr<State>& state) {
  for (;;) {
    Job job;
    bool cancelled;
    {
      std::unique_lock<std::mutex> lock(state->mu);
      state->cv.wait(lock, [&] { return state->stopping || !state->queue.empty(); });
      if (state->queue.empty()) {
        return; // stopping and drained
      }
      job = std::move(state->queue.front());
      state->queue.pop_front();
      cancelled = state->stopping;
    }
    job(cancelled);
  }
}

} // namespace lionbit
