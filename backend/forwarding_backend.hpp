// ForwardingBackend: a c10d::Backend that hands every standard collective to
// an inner backend of a real transport: CUDA tensors to `forward_cuda` when
// there is one (ProcessGroupNCCL), everything else to `forward`
// (ProcessGroupGloo, which handles CUDA tensors too). LionBitBackend adds the
// sign collectives on top of it; this class knows nothing of them.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "backend/rank_names.hpp"

namespace lionbit {

class ForwardingBackend : public c10d::Backend {
 public:
  ForwardingBackend(
      c10::intrusive_ptr<c10d::Backend> forward,
      c10::intrusive_ptr<c10d::Backend> forward_cuda,
      int rank,
      int size,
      std::chrono::milliseconds timeout,
      const std::vector<int>& global_ranks = {});

  // How errors name ranks (global_ranks: the group's ranks in the default
  // group's numbers, empty for the default group; see RankNames).
  const std::shared_ptr<const RankNames>& rankNames() const { return names_; }
  // Where this rank's errors say they are raised: "rank 5 (group of ranks [4, 5])".
  std::string here() const { return names_->here(rank_); }

  // The backend that carries standard collectives on CUDA tensors.
  const c10::intrusive_ptr<c10d::Backend>& forwardCudaBackend() const {
    return forward_cuda_ ? forward_cuda_ : forward_;
  }

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& output_split_sizes,
      std::vector<int64_t>& input_split_sizes,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag)
      override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag)
      override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;

  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;
  bool supportsCoalescing() const override;
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  void abort() override;
  void shutdown() override;

 protected:
  // Every inner backend: setTimeout, abort and shutdown reach them all.
  virtual std::vector<c10d::Backend*> inners();
  // Stops what the subclass runs itself, before the inner backends abort or
  // shut down.
  virtual void stopOwnWork() {}
  // Moves the inner CPU backends out (the members are null after): dropping
  // the last reference joins their worker threads. Not while calls run.
  virtual std::vector<c10::intrusive_ptr<c10d::Backend>> takeCpuInners();
  // forward_, or an error once shutdown() or exit released it.
  c10d::Backend& forwardInner();
  // The inner backend for a collective on `t` (by device type).
  c10d::Backend& inner(const at::Tensor& t);
  c10d::Backend& inner(const std::vector<at::Tensor>& ts);
  // True where CUDA tensors among `ts` go to Gloo (no NCCL transport).
  bool glooOnCuda(const std::vector<at::Tensor>& ts) const;
  // True where a collective on `ts` goes to Gloo (CPU tensors, or CUDA ones without NCCL).
  bool toGloo(const std::vector<at::Tensor>& ts) const;

  c10::intrusive_ptr<c10d::Backend> forward_;
  c10::intrusive_ptr<c10d::Backend> forward_cuda_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<const RankNames> names_;
};

} // namespace lionbit
