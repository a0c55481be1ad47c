#include "backend/call_trace.hpp"

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>

namespace lionbit {

const std::string& CallTrace::prefix() {
  static const std::string p = [] {
    const char* v = std::getenv("LIONBIT_TRACE");
    return std::string(v != nullptr ? v : "");
  }();
  return p;
}

CallTrace::CallTrace(int rank, int world_size, const char* op, uint64_t seq, uint64_t numel)
    : on_(!prefix().empty()),
      rank_(rank),
      world_size_(world_size),
      op_(op),
      seq_(seq),
      numel_(numel),
      start_(std::chrono::steady_clock::now()) {
  if (on_) {
    start_unix_us_ = std::chrono::duration_cast<std::chrono::microseconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
    events_.reserve(64);
  }
}

CallTrace::~CallTrace() {
  if (!on_) {
    return;
  }
  mark("end");
  std::string line;
  line.reserve(64 + events_.size() * 32);
  char buf[160];
  std::snprintf(
      buf, sizeof buf,
      "{\"rank\":%d,\"world_size\":%d,\"op\":\"%s\",\"seq\":%llu,\"numel\":%llu,\"chunks\":%zu,"
      "\"start_unix_us\":%lld,\"events\":[",
      rank_, world_size_, op_, static_cast<unsigned long long>(seq_),
      static_cast<unsigned long long>(numel_), chunks_, static_cast<long long>(start_unix_us_));
  line += buf;
  for (size_t i = 0; i < events_.size(); ++i) {
    const double ms = std::chrono::duration<double, std::milli>(events_[i].at - start_).count();
    std::snprintf(
        buf, sizeof buf, "%s[\"%s\",%lld,%.3f]", i == 0 ? "" : ",", events_[i].name,
        static_cast<long long>(events_[i].chunk), ms);
    line += buf;
  }
  line += "]}\n";
  // One process may hold several groups (several backends): one lock for
  // the appends; each file stays open, flushed after every line.
  static std::mutex m;
  static std::map<std::string, std::FILE*> files;
  const std::lock_guard<std::mutex> lock(m);
  // Named by the job's rank (RANK, as torchrun sets it), else the group's.
  static const std::string job_rank = [] {
    const char* r = std::getenv("RANK");
    return std::string(r != nullptr ? r : "");
  }();
  const std::string path = prefix() + ".rank" +
      (job_rank.empty() ? std::to_string(rank_) : job_rank) + ".jsonl";
  std::FILE*& f = files[path];
  if (f == nullptr) {
    f = std::fopen(path.c_str(), "a");
  }
  if (f != nullptr) {
    std::fwrite(line.data(), 1, line.size(), f);
    std::fflush(f);
  }
}

} // namespace lionbit
