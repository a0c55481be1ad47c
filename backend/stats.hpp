// Counters of a lionbit backend's sign path, read by lionbit.stats().
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <string>

namespace lionbit {

struct Stats {
  std::atomic<uint64_t> bytes_sent{0};
  std::atomic<uint64_t> bytes_received{0};
  std::atomic<uint64_t> sign_allreduce_calls{0};
  std::atomic<uint64_t> sign_reduce_scatter_calls{0};
  std::atomic<uint64_t> elements{0};
  std::atomic<uint64_t> pack_ns{0};
  std::atomic<uint64_t> comm_ns{0};
  std::atomic<uint64_t> vote_ns{0};
  std::atomic<uint64_t> unpack_ns{0};
  // Vote chunks whose ties took a round of their own (a list or a plane),
  // and those whose tie plane rode inline in phase 2 (kTieHint).
  std::atomic<uint64_t> tie_rounds{0};
  std::atomic<uint64_t> inline_tie_chunks{0};
  // Two ranks: chunks whose zeros followed their signs in a message of
  // their own (signs sent before the round that gave the zeros' capacity).
  std::atomic<uint64_t> late_zero_chunks{0};
  // The encodings of zero and tie planes this rank sent (signbits/zeros.h):
  // their bytes (part of bytes_sent), and how many went as a list of
  // positions, a list of runs, a dense plane and packed runs (by ZeroForm - 1).
  std::atomic<uint64_t> zero_bytes_sent{0};
  std::atomic<uint64_t> zero_encodings[4] = {0, 0, 0, 0};

  void reset() {
    for (auto* c :
         {&bytes_sent, &bytes_received, &sign_allreduce_calls, &sign_reduce_scatter_calls,
          &elements, &pack_ns, &comm_ns, &vote_ns, &unpack_ns, &tie_rounds, &inline_tie_chunks,
          &late_zero_chunks, &zero_bytes_sent, &zero_encodings[0], &zero_encodings[1],
          &zero_encodings[2], &zero_encodings[3]}) {
      c->store(0);
    }
  }

  // Byte counts and calls as integers, times in seconds.
  std::map<std::string, double> snapshot() const {
    return {
        {"bytes_sent", static_cast<double>(bytes_sent.load())},
        {"bytes_received", static_cast<double>(bytes_received.load())},
        {"sign_allreduce_calls", static_cast<double>(sign_allreduce_calls.load())},
        {"sign_reduce_scatter_calls", static_cast<double>(sign_reduce_scatter_calls.load())},
        {"elements", static_cast<double>(elements.load())},
        {"pack_seconds", pack_ns.load() * 1e-9},
        {"comm_seconds", comm_ns.load() * 1e-9},
        {"vote_seconds", vote_ns.load() * 1e-9},
        {"unpack_seconds", unpack_ns.load() * 1e-9},
        {"tie_rounds", static_cast<double>(tie_rounds.load())},
        {"inline_tie_chunks", static_cast<double>(inline_tie_chunks.load())},
        {"late_zero_chunks", static_cast<double>(late_zero_chunks.load())},
        {"zero_bytes_sent", static_cast<double>(zero_bytes_sent.load())},
        {"zero_lists_sent", static_cast<double>(zero_encodings[0].load())},
        {"zero_runs_sent", static_cast<double>(zero_encodings[1].load())},
        {"zero_planes_sent", static_cast<double>(zero_encodings[2].load())},
        {"zero_packed_sent", static_cast<double>(zero_encodings[3].load())},
    };
  }
};

} // namespace lionbit
