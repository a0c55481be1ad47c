// One worker thread running jobs in the order they were submitted. The sign
// all-reduce runs here, on its own inner communicator, so its collectives are
// issued in call order on every rank and never interleave with the caller's.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
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
  // than once. Called from the worker itself (a job, or a callback a job
  // runs, dropping the last reference to the executor's owner), the worker is
  // detached instead: it runs the rest of the queue cancelled and ends,
  // touching nothing of the executor but the queue it shares (State).
  void shutdown();

 private:
  // What the worker reads: shared with it, so it outlives an executor
  // destroyed from inside a job.
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Job> queue;
    bool stopping = false;
  };
  static void loop(const std::shared_ptr<State>& state);

  std::shared_ptr<State> state_;
  std::mutex join_mu_;
  std::thread thread_;
};

} // namespace lionbit
