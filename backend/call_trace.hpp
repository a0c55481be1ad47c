// Per-call timelines of the CPU sign all-reduce, for profiling: with
// LIONBIT_TRACE=<prefix> set when a process makes its first sign call, every
// call appends one JSON line to <prefix>.rank<R>.jsonl (R: the job's rank,
// $RANK as torchrun sets it, else the rank in the group), e.g.
//   {"rank":0,"world_size":4,"op":"vote","seq":3,"numel":16777216,
//    "chunks":4,"start_unix_us":1763800000123456,
//    "events":[["packed",-1,5.08],["header",-1,6.70],["a2a_issued",0,6.78],...]}
// Each event is [name, chunk (-1: the whole call), ms since the call began].
// Events, in order per chunk: a2a_issued (phase 1 handed to the inner
// communicator), a2a_done, counted (own shard voted / counted), ag_done
// (phase 2 received), ties_done (only when the tie positions took a round of
// their own), unpacked; per call: packed, header, end.
// Unset (the default), a mark is one predictable branch.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace lionbit {

class CallTrace {
 public:
  CallTrace(int rank, int world_size, const char* op, uint64_t seq, uint64_t numel);
  ~CallTrace(); // writes the line (if tracing)
  CallTrace(const CallTrace&) = delete;
  CallTrace& operator=(const CallTrace&) = delete;

  void mark(const char* event, int64_t chunk = -1) {
    if (on_) {
      events_.push_back({event, chunk, std::chrono::steady_clock::now()});
    }
  }
  void set_chunks(size_t chunks) { chunks_ = chunks; }

  // The prefix LIONBIT_TRACE gave (read once per process); empty: off.
  static const std::string& prefix();

 private:
  struct Event {
    const char* name;
    int64_t chunk;
    std::chrono::steady_clock::time_point at;
  };
  bool on_;
  int rank_, world_size_;
  const char* op_;
  uint64_t seq_, numel_;
  size_t chunks_ = 0;
  std::chrono::steady_clock::time_point start_;
  int64_t start_unix_us_ = 0;
  std::vector<Event> events_;
};

} // namespace lionbit
