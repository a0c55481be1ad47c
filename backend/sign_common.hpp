// Pieces shared by the sign collectives (sign_allreduce.cpp, the CUDA path,
// the reduce-scatter): error prefixes, timers, byte buffers, waiting for an
// inner collective and the header round.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "backend/bits/wire.h"
#include "backend/sign_allreduce.hpp"

namespace lionbit {

// Adds the time spent in its scope to a counter.
class ScopedTimer {
 public:
  explicit ScopedTimer(std::atomic<uint64_t>& into)
      : into_(into), start_(std::chrono::steady_clock::now()) {}
  ~ScopedTimer() {
    into_ += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(
            std::chrono::steady_clock::now() - start_)
            .count());
  }
  ScopedTimer(const ScopedTimer&) = delete;
  ScopedTimer& operator=(const ScopedTimer&) = delete;

 private:
  std::atomic<uint64_t>& into_;
  std::chrono::steady_clock::time_point start_;
};

// "lionbit all_reduce_sign(op=vote) on rank 3: "
std::string where(const SignComm& c, bits::SignOp op);

// A CPU uint8 tensor of n bytes (uninitialised).
at::Tensor byte_buffer(size_t n);

inline uint64_t* words_of(const at::Tensor& t) {
  return reinterpret_cast<uint64_t*>(t.data_ptr<uint8_t>());
}

inline uint8_t* bytes_of(const at::Tensor& t) {
  return t.data_ptr<uint8_t>();
}

// Elements per pipelined chunk requested by LIONBIT_CHUNK_ELEMS (default
// max(4M, 256K * world_size): every shard of a chunk at least 256K elements);
// bits::chunk_elems_for rounds it for a world size. Every rank must use the
// same value: the header round checks.
uint64_t requested_chunk_elems(int world_size);

// Waits for an inner collective; a failure (a dead peer, a timeout) becomes a
// DistBackendError naming lionbit, the op, the rank and the step.
void wait_inner(
    const SignComm& c,
    bits::SignOp op,
    const char* step,
    const c10::intrusive_ptr<c10d::Work>& work);

// Adds a ring all-gather of `chunk` bytes per rank to the byte counters.
void count_allgather(const SignComm& c, size_t chunk);

// The value of each count code of an avg / sum result (bits::count_code:
// code = #positive, or 2 * #positive + #zero when some rank sent zeros), for
// the 2^planes codes of `planes` code planes: Sum for "sum", Sum / N for
// "avg", 0 for codes that cannot occur. unpack's table is built from it.
std::vector<double> count_code_values(bits::SignOp op, int N, bool with_zeros, int planes);

// All-gathers every rank's header over c.comm (CPU) and checks them all.
bits::HeaderSummary header_round(
    const SignComm& c,
    bits::SignOp op,
    const bits::WireHeader& mine);

} // namespace lionbit
