// The Work a sign all-reduce returns: backed by a c10::ivalue::Future that the
// worker completes with the output tensor list (or an error).
#pragma once

#include <ATen/core/ivalue.h>
#include <memory>
#include <mutex>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "backend/sign_common.hpp"

namespace lionbit {

class SignWork : public c10d::Work {
 public:
  // torch.profiler shows the call as a span "lionbit:all_reduce_sign" (or
  // "lionbit:reduce_scatter_sign") from this constructor, on the caller's
  // thread, to complete() / fail().
  // `names`: how its errors name this rank (see RankNames).
  SignWork(
      int rank,
      std::shared_ptr<const RankNames> names,
      Collective kind,
      std::vector<at::Tensor> outputs);

  // Called by the worker.
  void complete();
  void fail(std::exception_ptr error);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  void end_profiling();

  // Handed to the future by complete() (or dropped by fail()) on the worker
  // while the caller may read them through result(): under outputs_mu_.
  std::vector<at::Tensor> take_outputs();

  const std::shared_ptr<const RankNames> names_;
  const Collective kind_;
  std::mutex outputs_mu_;
  std::vector<at::Tensor> outputs_;
  bool handed_over_ = false;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

} // namespace lionbit
