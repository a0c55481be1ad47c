// One worker thread running jobs in the order they were submitted. The sign
// all-reduce runs here, on its own inner communicator, so its collectives are
// issued in call order on every rank and never interleave with the caller's.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace lionbit {

class SerialExecutor {
 public:
  using Job = std::function<void(bool cancelled)>;

  SerialExecutor();
  ~SerialExecutor(); // runs what is queued with cancelled = true, then joins

  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  // Queues a job. After shutdown() the job runs at once, cancelled.
  void submit(Job job);

  // Stops taking work: queued jobs run cancelled; the running one finishes;
  // then the worker is joined. Safe to call from several threads and more
  // than once. Called from the worker itself (a job dropping the last
  // reference to its owner), the worker is detached instead.
  void shutdown();

 private:
  void loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  bool stopping_ = false;
  std::mutex join_mu_;
  std::thread thread_;
};

} // namespace lionbit
