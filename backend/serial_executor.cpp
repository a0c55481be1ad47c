#include "backend/serial_executor.hpp"

#include <utility>

namespace lionbit {

SerialExecutor::SerialExecutor() : thread_([this] { loop(); }) {}

SerialExecutor::~SerialExecutor() {
  shutdown();
}

void SerialExecutor::submit(Job job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      queue_.push_back(std::move(job));
      cv_.notify_one();
      return;
    }
  }
  job(/*cancelled=*/true);
}

void SerialExecutor::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    cv_.notify_all();
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

void SerialExecutor::loop() {
  for (;;) {
    Job job;
    bool cancelled;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) {
        return; // stopping and drained
      }
      job = std::move(queue_.front());
      queue_.pop_front();
      cancelled = stopping_;
    }
    job(cancelled);
  }
}

} // namespace lionbit
