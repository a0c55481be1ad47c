// Pieces shared by the sign collectives (sign_allreduce.cpp, the CUDA path,
// the reduce-scatter): what a call is, its error prefix, timers, waiting for
// an inner collective and the header round.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "backend/kernel_set.hpp"
#include "backend/sign_allreduce.hpp"
#include "backend/torch_adapter.hpp"
#include "signbits/wire.h"

namespace lionbit {

// Which sign collective a call is.
enum class Collective { kAllReduce, kReduceScatter };

// "all_reduce_sign" or "reduce_scatter_sign", as users call them.
const char* collective_name(Collective kind);

// One sign call as its steps see it: the communicators, the op, which
// collective, its number in the order every rank runs the calls, the device
// its data lives on and that device's kernels.
struct SignCall {
  const SignComm& c;
  bits::SignOp op;
  Collective kind;
  uint64_t seq;
  c10::Device device = c10::Device(c10::kCPU);
  const KernelSet* k = nullptr; // kernels_for(device)

  SignCall(const SignComm& comm, bits::SignOp o, Collective kd, uint64_t s)
      : c(comm), op(o), kind(kd), seq(s) {}
  SignCall(const SignComm& comm, bits::SignOp o, Collective kd, uint64_t s, c10::Device d)
      : c(comm), op(o), kind(kd), seq(s), device(d), k(&kernels_for(d)) {}

  // A buffer of n bytes on the call's device (uninitialised).
  at::Tensor bytes(size_t n) const { return device_bytes(n, device); }
};

// An inner collective on the call's data in flight. The data moves over the
// communicator of its device (SignComm): the CPU one for CPU tensors; for
// CUDA tensors the NCCL one, or, without it (several ranks on one GPU, the
// Gloo CUDA transport), the CPU one through host copies.
struct Inflight {
  c10::intrusive_ptr<c10d::Work> work;
  const c10d::Backend* via = nullptr;
  at::Tensor out; // where the result must end up, on the call's device
  at::Tensor host_out; // staged through host memory: where it lands first
};

// All-to-all of `in` into `out` with per-rank byte splits (empty: equal).
Inflight issue_alltoall(
    const SignCall& call,
    at::Tensor out,
    const at::Tensor& in,
    std::vector<int64_t> out_splits,
    std::vector<int64_t> in_splits);

// All-gather of `in` (the same size on every rank) into `out`. Over the CPU
// communicator, when `out` (N pieces, 1-D) is at most kDirectAllgatherBytes,
// each rank's piece goes to every peer at once: an all-to-all of N copies,
// one round trip where a ring of N ranks waits for N - 1 in a row, and a
// round trip is what a small piece costs. A larger one, or N = 2, goes round
// the ring. Each rank sends and receives (N - 1) pieces either way; what
// crosses between nodes differs: the ring takes each piece over each node
// boundary once, the direct way to every rank of every other node, so the
// bound is on the whole result (at most that much leaves a rank).
constexpr size_t kDirectAllgatherBytes = size_t{64} << 10;
Inflight issue_allgather(const SignCall& call, at::Tensor out, const at::Tensor& in);

// Waits for the collective (a failure raises naming `step`, see wait_inner)
// and returns its output on the call's device.
at::Tensor wait_data(const SignCall& call, const char* step, Inflight& f);

// "lionbit reduce_scatter_sign(op=vote) on rank 3: "
std::string where(const SignCall& call);

// Adds the time spent in its scope to a counter of lionbit.stats(), and
// shows the scope as a span named `span` (a string literal) in a
// torch.profiler trace: the worker runs with the caller's profiler state.
class ScopedTimer {
 public:
  ScopedTimer(std::atomic<uint64_t>& into, const char* span)
      : into_(into), span_(at::RecordScope::USER_SCOPE), start_(std::chrono::steady_clock::now()) {
    if (span_.isActive()) {
      span_.before(span);
    }
  }
  ~ScopedTimer() {
    into_ += static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                       std::chrono::steady_clock::now() - start_)
                                       .count());
  }
  ScopedTimer(const ScopedTimer&) = delete;
  ScopedTimer& operator=(const ScopedTimer&) = delete;

 private:
  std::atomic<uint64_t>& into_;
  at::RecordFunction span_;
  std::chrono::steady_clock::time_point start_;
};

// Elements per pipelined chunk requested by LIONBIT_CHUNK_ELEMS (default
// bits::default_chunk_elems: max(4M, 256K * world_size) on the CPU, 256M on a
// GPU; every shard of a chunk at least 256K elements);
// bits::chunk_elems_for rounds it for a world size. Every rank must use the
// same value: the header round checks.
uint64_t requested_chunk_elems(int world_size, const c10::Device& device);

// Waits for a collective issued on the inner backend `via`; a failure (a dead
// peer, a timeout) becomes a DistBackendError naming lionbit, the collective,
// the op, the rank, the step and the transport.
void wait_inner(
    const SignCall& call,
    const char* step,
    const c10d::Backend& via,
    const c10::intrusive_ptr<c10d::Work>& work);

// Adds an all-gather of `chunk` bytes per rank to the byte counters.
void count_allgather(const SignComm& c, size_t chunk);

// Counts `messages` zero encodings this rank sent, each of a plane of
// `words` words announced with `code` (Stats::zero_bytes_sent and the
// form's count; nothing for kNone).
void count_zero_encodings(
    const SignComm& c,
    const bits::ZeroCode& code,
    size_t words,
    int64_t messages);

// The value of each count code of an avg / sum result (bits::count_code:
// code = #positive, or 2 * #positive + #zero when some rank sent zeros), for
// the 2^planes codes of `planes` code planes: Sum for "sum", Sum / N for
// "avg", 0 for codes that cannot occur. unpack's table is built from it.
std::vector<double> count_code_values(bits::SignOp op, int N, bool with_zeros, int planes);

// Whether two ranks may exchange whole chunks (LIONBIT_SIGN_EXCHANGE != "0").
bool two_rank_exchange_allowed();

// The header flags every call sets from what this rank holds (its zeros,
// NaNs and device: a call whose ranks hold tensors on different device types
// fails on every rank, bits::kDevice) and from LIONBIT_SIGN_EXCHANGE=0
// (bits::kTwoPhase: no two-rank exchange, read once per process).
uint32_t header_flags(const SignCall& call, uint64_t zero_capacity, uint64_t nans);

// Sends every rank its header over c.comm (CPU; an all-to-all: `mine`
// addressed to rank j with `to[j]`, the code of the zeros this rank sends j,
// or with mine's own code for every rank when `to` is empty) and checks them
// all; raises the call's error on every rank when they disagree (or a rank
// rejected its input: PeerRejectedError, or holds a NaN:
// NonFiniteInputError; backend/sign_errors.hpp). The summary's `sent` holds
// the codes announced.
bits::HeaderSummary header_round(
    const SignCall& call,
    const bits::WireHeader& mine,
    const std::vector<bits::ZeroCode>& to = {});

// The header round alone, announcing that this rank rejected call #seq (its
// own error is raised by the caller): peers fail at once instead of waiting.
void reject_round(const SignCall& call);

} // namespace lionbit
