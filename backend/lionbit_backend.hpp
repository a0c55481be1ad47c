// LionBitBackend: a c10d::Backend that forwards every standard collective to
// an inner backend of a real transport (ForwardingBackend: ProcessGroupGloo
// for CPU tensors) and adds the 1-bit sign collectives, run on a second inner
// communicator by its own worker thread. Every sign call is one SignRequest
// (backend/sign_request.hpp): checked in one list, run as one job.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <vector>
#include <string>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "backend/forwarding_backend.hpp"
#include "backend/serial_executor.hpp"
#include "backend/sign_allreduce.hpp"
#include "backend/sign_common.hpp"
#include "backend/sign_hierarchy.hpp"
#include "backend/sign_request.hpp"
#include "backend/stats.hpp"

namespace lionbit {

class LionBitBackend : public ForwardingBackend {
 public:
  // `forward` carries the standard collectives (the caller's thread, the
  // caller's order); `sign` is used only by the sign path's worker. Both must
  // span the same ranks as this backend.
  //
  // CUDA tensors: `forward_cuda` carries their standard collectives and
  // `sign_cuda` the sign path's data (both ProcessGroupNCCL, each its own
  // communicator). Either may be null: standard collectives on CUDA tensors
  // then go to `forward` (Gloo handles CUDA tensors), and the sign path
  // stages its packed bits through host memory over `sign`. `global_ranks`:
  // the group's ranks as the default group numbers them, which every error
  // names (empty: the default group; see RankNames).
  LionBitBackend(
      c10::intrusive_ptr<c10d::Backend> forward,
      c10::intrusive_ptr<c10d::Backend> sign,
      int rank,
      int size,
      std::chrono::milliseconds timeout,
      c10::intrusive_ptr<c10d::Backend> forward_cuda = {},
      c10::intrusive_ptr<c10d::Backend> sign_cuda = {},
      const std::vector<int>& global_ranks = {});
  ~LionBitBackend() override;

  const std::string getBackendName() const override { return "lionbit"; }

  // --- the sign collectives ----------------------------------------------
  // Any of them, described by `r` (backend/sign_request.hpp: the collective,
  // op, tie rule and seed, hierarchy, and the payload with its layout). Never
  // blocks on communication: the returned Work completes when the result is
  // written. Bad arguments raise here (and peers are told, so they fail at
  // once rather than wait). Every tensor on one device, CPU or CUDA; packed
  // planes must stay unchanged until the Work completes.
  c10::intrusive_ptr<c10d::Work> call(SignRequest r);

  // The cluster's two levels for the hierarchical sign calls: `node` spans
  // this rank's node (its rank: this rank's local index), `cross` the ranks
  // with this rank's local index, one per node; both lionbit backends used
  // only by this one's worker from now on. `order` and `node_ranks` as in
  // Hierarchy (ranks of this backend's group). Checked here; set once.
  void setHierarchy(
      const c10::intrusive_ptr<c10d::Backend>& node,
      const c10::intrusive_ptr<c10d::Backend>& cross,
      const std::vector<int64_t>& order,
      const std::vector<int64_t>& node_ranks);
  bool hasHierarchy() const;
  // The byte counters of the node and cross-node communicators.
  std::map<std::string, double> hierarchyStats();
  void resetHierarchyStats();

  // --- groups split from this one ------------------------------------------
  // dist.split_group, and DeviceMesh on GPUs once init_process_group had a
  // device_id, make subgroups by splitting the parent group's backend. A
  // child here is a lionbit backend as new_group makes one: inner
  // communicators of its own, made over `store` by its members alone (never
  // an ncclCommSplit of the parent's, in which every rank of the parent
  // would have to take part). `ranks`: the child's members, ranks of this
  // group (sorted); a rank outside them gets null. torch calls split once
  // for each device type of the group: the second call gets the first's
  // child. The maker (set once by the bindings: lionbit's Python creator)
  // builds the child's inner communicators.
  using Maker = std::function<c10::intrusive_ptr<LionBitBackend>(
      const c10::intrusive_ptr<c10d::Store>& store,
      int rank,
      int size,
      std::chrono::milliseconds timeout,
      const std::vector<int>& global_ranks)>;
  static void setMaker(Maker make);
  bool supportsSplitting() const override;
  c10::intrusive_ptr<Options> getBackendOptions() override;
  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>& store,
      const std::vector<int>& ranks,
      const c10::intrusive_ptr<Options>& opts) override;

  // Stops the sign-path worker of every live backend (queued calls fail,
  // running ones finish) and releases its inner CPU backends, joining their
  // workers, as shutdown() does. lionbit registers it with atexit: no worker
  // may run while the interpreter finalizes.
  static void shutdownAllWorkers();

  Stats& stats() { return stats_; }
  // "nccl" or "gloo": what moves the sign path's data for CUDA tensors.
  std::string cudaTransport() const { return sign_cuda_ ? sign_cuda_->getBackendName() : "gloo"; }

 protected:
  std::vector<c10d::Backend*> inners() override;
  void stopOwnWork() override;
  std::vector<c10::intrusive_ptr<c10d::Backend>> takeCpuInners() override;

 private:
  SignComm signComm();
  // The op `r` names, once request_problem() finds nothing wrong with it.
  // Otherwise raises here, naming the collective, the op, the rank and the
  // argument, after queuing a header round that tells the peers this rank
  // rejected its call (they fail at once, not at timeout). `tie` and `mode`
  // receive the parsed tie rule (checked against the op) and hierarchy.
  bits::SignOp validate(const SignRequest& r, TieSpec& tie, HierarchyMode& mode);
  // Queues `body` on the worker; the returned Work completes (or fails) when
  // it has run, and so does `agreement` (if any) unless the body agreed
  // earlier (backend/agreement.hpp).
  c10::intrusive_ptr<c10d::Work> enqueue(
      Collective kind,
      bits::SignOp op,
      at::Tensor out,
      SignJob body,
      std::shared_ptr<Agreement> agreement = nullptr);

  c10::intrusive_ptr<c10d::Backend> sign_;
  c10::intrusive_ptr<c10d::Backend> sign_cuda_;
  // The number of the next sign call, taken when its job starts on the
  // executor's thread (only there): calls are numbered in the order they run,
  // even when threads race to submit them (numbering them on entry let two
  // racing threads queue #n+1 before #n, and the peers saw them out of order).
  uint64_t next_seq_ = 0;
  Stats stats_;
  std::atomic<bool> tie_hint_{false}; // SignComm::tie_hint
  // setHierarchy's communicators and layout (set once, before any
  // hierarchical call; read by callers' threads under the mutex).
  mutable std::mutex hierarchy_mutex_;
  c10::intrusive_ptr<LionBitBackend> node_, cross_;
  std::vector<int> order_, node_ranks_;
  Hierarchy hierarchy();
  // The last child split() made, and which split it was (its store and group
  // name): torch asks once for each device type.
  std::mutex split_mutex_;
  const c10d::Store* split_store_ = nullptr;
  std::string split_name_;
  c10::weak_intrusive_ptr<c10d::Backend> split_child_{c10::intrusive_ptr<c10d::Backend>()};
  // Last: destroyed first, so no job outlives the members it uses.
  SerialExecutor executor_;
};

} // namespace lionbit
