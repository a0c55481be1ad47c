// The sign path's worker thread (backend/serial_executor.hpp): order,
// cancellation, and an executor whose owner goes away inside one of its jobs.
#include "backend/serial_executor.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

namespace lionbit {
namespace {

TEST(SerialExecutor, RunsJobsInOrderOnOneThreadOfItsOwn) {
  std::vector<int> ran;
  std::vector<std::thread::id> threads;
  std::promise<void> done;
  {
    SerialExecutor ex;
    for (int i = 0; i < 100; ++i) {
      ex.submit([&, i](bool cancelled) {
        EXPECT_FALSE(cancelled);
        ran.push_back(i);
        threads.push_back(std::this_thread::get_id());
      });
    }
    ex.submit([&](bool) { done.set_value(); });
    done.get_future().wait();
  }
  ASSERT_EQ(ran.size(), 100u);
  for (int i = 0; i < 100; ++i) {
    EXPECT_EQ(ran[static_cast<size_t>(i)], i);
    EXPECT_EQ(threads[static_cast<size_t>(i)], threads[0]);
  }
  EXPECT_NE(threads[0], std::this_thread::get_id());
}

TEST(SerialExecutor, ShutdownFinishesTheRunningJobAndCancelsTheQueue) {
  SerialExecutor ex;
  std::promise<void> started, release;
  auto go = release.get_future().share();
  std::atomic<int> finished{0}, cancelled_jobs{0};
  ex.submit([&](bool cancelled) {
    EXPECT_FALSE(cancelled);
    started.set_value();
    go.wait();
    ++finished;
  });
  for (int i = 0; i < 5; ++i) {
    ex.submit([&](bool cancelled) { cancelled_jobs += cancelled ? 1 : 0; });
  }
  started.get_future().wait();
  std::thread stopper([&] { ex.shutdown(); });
  // Until shutdown has begun: a job submitted after it runs at once, here.
  const auto self = std::this_thread::get_id();
  std::atomic<bool> stopping{false};
  while (!stopping) {
    ex.submit([&](bool cancelled) {
      if (cancelled && std::this_thread::get_id() == self) {
        stopping = true;
      }
    });
    std::this_thread::yield();
  }
  release.set_value(); // shutdown has waited on the running job until now
  stopper.join();
  EXPECT_EQ(finished.load(), 1);
  EXPECT_EQ(cancelled_jobs.load(), 5); // (and the probes queued before shutdown: cancelled too)

  // After shutdown a job runs at once, cancelled, on the caller's thread; a
  // second shutdown (the destructor's) is harmless.
  std::thread::id where;
  bool was_cancelled = false;
  ex.submit([&](bool cancelled) {
    was_cancelled = cancelled;
    where = std::this_thread::get_id();
  });
  EXPECT_TRUE(was_cancelled);
  EXPECT_EQ(where, std::this_thread::get_id());
  ex.shutdown();
}

// The owner's last reference is dropped by a job the executor runs (as when
// a completed sign call's callback releases the last reference to its
// process group): the executor is destroyed on its own worker, which must
// then touch nothing of it. The jobs queued behind run cancelled. Under
// make test-sanitize a worker reading the destroyed executor is a
// heap-use-after-free report.
TEST(SerialExecutor, ItsOwnerMayBeReleasedByOneOfItsJobs) {
  struct Owner {
    SerialExecutor ex;
  };
  for (int round = 0; round < 50; ++round) {
    auto owner = std::make_shared<Owner>();
    std::promise<void> release;
    auto go = release.get_future().share();
    // Shared: the worker may still be inside set_value when this round ends.
    auto after = std::make_shared<std::promise<std::vector<bool>>>();
    auto seen = std::make_shared<std::vector<bool>>();
    owner->ex.submit([keep = owner, go](bool cancelled) {
      EXPECT_FALSE(cancelled);
      go.wait(); // until the test has dropped its own reference
    });
    for (int i = 0; i < 3; ++i) {
      owner->ex.submit([seen](bool cancelled) { seen->push_back(cancelled); });
    }
    owner->ex.submit([seen, after](bool cancelled) {
      seen->push_back(cancelled);
      after->set_value(*seen);
    });
    owner.reset();
    release.set_value();
    const std::vector<bool> cancelled = after->get_future().get();
    EXPECT_EQ(cancelled, std::vector<bool>(4, true));
  }
}

} // namespace
} // namespace lionbit
