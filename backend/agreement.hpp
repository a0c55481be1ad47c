// The moment a sign collective's outcome is settled: every rank's header
// round has agreed (the same call on every rank, every input accepted, no
// NaN anywhere), so from then on the call either completes or fails for a
// fault (a lost peer, a timeout, a corrupt message); no rank skips it any
// more. A caller that changes state only after a successful vote
// (DistributedLion's momentum update, which does not read the vote's
// result) can start then, while the vote's data still moves.
//
// Resolved once, by the worker: by the flat all-reduce's last header round
// or the flat reduce-scatter's header round (at_header), or, on every other
// path, when the call ends (its own outcome: done, or its error). An error
// after agreeing is the call's alone (its Work raises it); a cancelled call
// fails the agreement as it fails the Work, so a waiter never waits for a
// call that will not run.
#pragma once

#include <condition_variable>
#include <exception>
#include <mutex>

namespace lionbit {

class Agreement {
 public:
  // Every rank has agreed (at_header: by the header round, before the data
  // moved; else by the call's end). Only the first resolution counts.
  void agree(bool at_header) {
    {
      std::lock_guard<std::mutex> lock(m_);
      if (done_) {
        return;
      }
      done_ = true;
      at_header_ = at_header;
    }
    cv_.notify_all();
  }

  // The call failed before agreeing.
  void fail(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(m_);
      if (done_) {
        return;
      }
      done_ = true;
      error_ = std::move(error);
    }
    cv_.notify_all();
  }

  // Blocks until resolved; rethrows the call's error where it failed first.
  void wait() {
    std::unique_lock<std::mutex> lock(m_);
    cv_.wait(lock, [this] { return done_; });
    if (error_) {
      std::rethrow_exception(error_);
    }
  }

  // Whether the header round resolved it (the data had not moved yet).
  bool at_header() const {
    std::lock_guard<std::mutex> lock(m_);
    return at_header_;
  }

 private:
  mutable std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  bool at_header_ = false;
  std::exception_ptr error_;
};

} // namespace lionbit
