#include "wire.h"

#include <algorithm>
#include <iterator>
#include <sstream>

#include "signbits/levels.h"

namespace lionbit::bits {

const char* sign_op_name(SignOp op) {
  switch (op) {
    case SignOp::kVote:
      return "vote";
    case SignOp::kAvg:
      return "avg";
    case SignOp::kSum:
      return "sum";
    case SignOp::kLevels:
      return "l1";
  }
  return "unknown";
}

WireHeader make_header(
    SignOp op,
    DType dtype,
    int rank,
    uint32_t flags,
    uint64_t seq,
    uint64_t numel,
    const ZeroCode& zeros,
    uint64_t chunk_elems,
    const CallRule& rule) {
  WireHeader h{};
  h.magic = kWireMagic;
  h.version = kWireVersion;
  h.op = static_cast<uint8_t>(op);
  h.dtype = static_cast<uint8_t>(dtype);
  h.rank = static_cast<uint32_t>(rank);
  h.flags = flags;
  h.seq = seq;
  h.numel = numel;
  h.zero_most = static_cast<uint32_t>(zeros.zeros < kNoIndex ? zeros.zeros : kNoIndex);
  h.chunk_elems = chunk_elems;
  h.tie_seed = rule.tie.seed;
  h.tie_break = static_cast<uint8_t>(rule.tie.mode);
  h.value_bits = static_cast<uint8_t>(rule.value_bits);
  return address_header(h, zeros);
}

WireHeader address_header(const WireHeader& h, const ZeroCode& to) {
  WireHeader a = h;
  a.zero_capacity = to.zeros;
  a.zero_runs = static_cast<uint32_t>(to.runs < kNoIndex ? to.runs : kNoIndex);
  a.zero_packed = to.zeros > 0 && to.packed < kNoIndex ? static_cast<uint32_t>(to.packed) : 0;
  return a;
}

uint64_t default_chunk_elems(int world_size, bool gpu) {
  const uint64_t kChunk = uint64_t{1} << (gpu ? 28 : 22);
  constexpr uint64_t kMinShard = uint64_t{1} << 18;
  const uint64_t n = world_size > 0 ? static_cast<uint64_t>(world_size) : 1;
  return kChunk > kMinShard * n ? kChunk : kMinShard * n;
}

uint64_t chunk_elems_for(uint64_t requested, int world_size) {
  const uint64_t unit = kWordBits * static_cast<uint64_t>(world_size);
  const uint64_t r = requested < unit ? unit : requested;
  return (r + unit - 1) / unit * unit;
}

namespace {

std::string ranks_list(const std::vector<int>& ranks) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    os << (i ? ", " : "") << ranks[i];
  }
  os << "]";
  return os.str();
}

bool known_op(uint8_t v) {
  return v >= 1 && v <= 4;
}

// The tie rule and the levels' bits fit the op: a tie rule other than zero
// only where there are ties (vote, levels), bits only (and always) for
// levels.
bool known_rule(const WireHeader& h) {
  const bool votes = h.op == static_cast<uint8_t>(SignOp::kVote) ||
      h.op == static_cast<uint8_t>(SignOp::kLevels);
  const bool levels = h.op == static_cast<uint8_t>(SignOp::kLevels);
  const bool reserved_clear = std::all_of(
      std::begin(h.reserved), std::end(h.reserved), [](uint8_t b) { return b == 0; });
  return h.tie_break <= 2 && (votes || h.tie_break == 0) &&
      (levels ? h.value_bits >= kMinLevelBits && h.value_bits <= kMaxLevelBits
              : h.value_bits == 0) &&
      reserved_clear;
}

std::string rule_text(const WireHeader& h) {
  std::string t = std::string("tie_break=") +
      (h.tie_break <= 2 ? tie_break_name(static_cast<TieBreak>(h.tie_break)) : "?");
  if (h.tie_break != 0) {
    t += " (seed " + std::to_string(h.tie_seed) + ")";
  }
  if (h.value_bits != 0) {
    t += ", bits=" + std::to_string(h.value_bits);
  }
  return t;
}

bool known_dtype(uint8_t v) {
  return v >= 1 && v <= 5;
}

std::string op_text(uint8_t v) {
  return known_op(v) ? sign_op_name(static_cast<SignOp>(v)) : "op#" + std::to_string(v);
}

std::string dtype_text(uint8_t v) {
  return known_dtype(v) ? dtype_name(static_cast<DType>(v)) : "dtype#" + std::to_string(v);
}

// The checks of check_headers, in order: the first that fails gives the
// call's error, and later ones are not run.
class Checks {
 public:
  explicit Checks(HeaderSummary& s) : s_(s) {}
  // True (and the message kept) when `bad` and no earlier check failed. The
  // verdict is kFault unless the caller names a typed one.
  template <typename... Parts>
  bool fail(bool bad, const Parts&... parts) {
    if (bad && s_.error.empty()) {
      std::ostringstream os;
      (os << ... << parts);
      s_.error = os.str();
      s_.verdict = HeaderVerdict::kFault;
    }
    return !s_.error.empty();
  }

 private:
  HeaderSummary& s_;
};

std::string hex(uint64_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

const char* collective_text(uint32_t flags) {
  return (flags & kReduceScatter) ? "a sign reduce-scatter" : "a sign all-reduce";
}

const char* hierarchy_text(uint32_t flags) {
  if (flags & kHierExact) {
    return "hierarchy 'node'";
  }
  return (flags & kHierNodeVote) ? "hierarchy 'node_vote'" : "hierarchy 'flat'";
}

const char* device_text(uint32_t flags) {
  return (flags & kDevice) ? "CUDA" : "CPU";
}

// The ranks whose header has `flag`.
std::vector<int> ranks_with(const WireHeader* headers, int world_size, uint32_t flag) {
  std::vector<int> ranks;
  for (int r = 0; r < world_size; ++r) {
    if (headers[r].flags & flag) {
      ranks.push_back(r);
    }
  }
  return ranks;
}

} // namespace

HeaderSummary check_headers(
    const WireHeader* headers,
    int world_size,
    const WireHeader& mine,
    const std::vector<int>& names) {
  HeaderSummary s;
  Checks check(s);
  const auto name = [&names](int64_t r) -> int64_t {
    return r >= 0 && static_cast<size_t>(r) < names.size() ? names[static_cast<size_t>(r)] : r;
  };
  const auto named = [&name](std::vector<int> ranks) {
    for (int& r : ranks) {
      r = static_cast<int>(name(r));
    }
    return ranks;
  };
  constexpr uint32_t kKnownFlags = kHasZero | kHasNan | kRejected | kReduceScatter | kDevice |
      kTieHint | kHierExact | kHierNodeVote | kTwoPhase;
  // 1. Well-formed: magic, version, rank field, known enums, sane size.
  for (int r = 0; r < world_size; ++r) {
    const WireHeader& h = headers[r];
    if (check.fail(
            h.magic != kWireMagic || h.version != kWireVersion, "rank ", name(r),
            " sent a malformed header (magic ", hex(h.magic), ", version ", h.version,
            "): is every rank running the same lionbit version?") ||
        check.fail(
            h.rank != static_cast<uint32_t>(r) || !known_op(h.op) || !known_dtype(h.dtype) ||
                h.numel > kMaxNumel || (h.flags & ~kKnownFlags) != 0 ||
                (h.flags & (kHierExact | kHierNodeVote)) == (kHierExact | kHierNodeVote) ||
                !known_rule(h),
            "rank ", name(r), " sent a corrupt header (rank field ", h.rank, ", op ",
            static_cast<int>(h.op), ", dtype ", static_cast<int>(h.dtype), ", numel ", h.numel,
            ", flags ", hex(h.flags), ", tie rule ", static_cast<int>(h.tie_break), ", bits ",
            static_cast<int>(h.value_bits), ")")) {
      return s;
    }
  }
  // 2. A rank that rejected its own arguments: it raised there; fail here too
  //    instead of waiting for it.
  const std::vector<int> rejected = named(ranks_with(headers, world_size, kRejected));
  if (check.fail(
          !rejected.empty(), "rank(s) ", ranks_list(rejected),
          " rejected their input to this call (their own error says why)")) {
    s.verdict = HeaderVerdict::kRejected;
    s.ranks = rejected;
    return s;
  }
  // 3. Same call on every rank: order, collective, device, op, dtype, size,
  //    chunking.
  const int64_t me = name(mine.rank);
  for (int r = 0; r < world_size; ++r) {
    const WireHeader& h = headers[r];
    const int64_t them = name(r);
    if (check.fail(
            h.seq != mine.seq, "ranks disagree on the order of sign all-reduce calls: this rank (",
            me, ") is at call #", mine.seq, ", rank ", them, " at call #", h.seq) ||
        check.fail(
            (h.flags & kReduceScatter) != (mine.flags & kReduceScatter),
            "collective differs across ranks at call #", mine.seq, ": rank ", me, " runs ",
            collective_text(mine.flags), ", rank ", them, " runs ", collective_text(h.flags)) ||
        check.fail(
            (h.flags & (kHierExact | kHierNodeVote)) != (mine.flags & (kHierExact | kHierNodeVote)),
            "the hierarchy differs across ranks at call #", mine.seq, ": rank ", me, " uses ",
            hierarchy_text(mine.flags), ", rank ", them, " uses ", hierarchy_text(h.flags)) ||
        check.fail(
            (h.flags & kTwoPhase) != (mine.flags & kTwoPhase),
            "LIONBIT_SIGN_EXCHANGE differs across ranks: rank ", me, " ",
            (mine.flags & kTwoPhase) ? "runs two phases" : "exchanges", ", rank ", them, " ",
            (h.flags & kTwoPhase) ? "runs two phases" : "exchanges") ||
        check.fail(
            (h.flags & kDevice) != (mine.flags & kDevice),
            "tensor device type differs across ranks: rank ", me, " has a ",
            device_text(mine.flags), " tensor, rank ", them, " a ", device_text(h.flags),
            " tensor") ||
        check.fail(
            h.op != mine.op, "op differs across ranks: rank ", me, " has ", op_text(mine.op),
            ", rank ", them, " has ", op_text(h.op)) ||
        check.fail(
            h.tie_break != mine.tie_break || h.value_bits != mine.value_bits,
            "the tie rule or the bits differ across ranks: rank ", me, " has ", rule_text(mine),
            ", rank ", them, " has ", rule_text(h)) ||
        check.fail(
            h.tie_seed != mine.tie_seed, "the tie rule's seed differs across ranks: rank ", me,
            " has ", mine.tie_seed, ", rank ", them, " has ", h.tie_seed,
            " (a caller that seeds each call with its step count has ranks at different steps)") ||
        check.fail(
            h.dtype != mine.dtype, "dtype differs across ranks: rank ", me, " has ",
            dtype_text(mine.dtype), ", rank ", them, " has ", dtype_text(h.dtype)) ||
        check.fail(
            h.numel != mine.numel, "number of elements differs across ranks: rank ", me, " has ",
            mine.numel, ", rank ", them, " has ", h.numel) ||
        check.fail(
            h.chunk_elems != mine.chunk_elems,
            "pipeline chunk size differs across ranks (LIONBIT_CHUNK_ELEMS?): rank ", me, " uses ",
            mine.chunk_elems, ", rank ", them, " uses ", h.chunk_elems)) {
      return s;
    }
  }
  // 4. NaN anywhere poisons the result on every rank.
  const std::vector<int> nan_ranks = named(ranks_with(headers, world_size, kHasNan));
  if (check.fail(
          !nan_ranks.empty(), "input contains NaN on rank(s) ", ranks_list(nan_ranks),
          "; the sign of NaN is undefined")) {
    s.verdict = HeaderVerdict::kNonFinite;
    s.ranks = nan_ranks;
    return s;
  }
  // 5. Zeros: the most consistent with the flag and at most a shard's
  //    size; the addressed code within the most, no more runs than zeros, packed runs (if any) a
  //    multiple of 8 below the shard's plane.
  const uint64_t largest_chunk = mine.chunk_elems == 0 ? mine.numel
                                                       : std::min(mine.numel, mine.chunk_elems);
  const uint64_t shard_elems = shard_words(largest_chunk, world_size) * kWordBits;
  s.zero_codes.resize(static_cast<size_t>(world_size));
  s.zero_most.resize(static_cast<size_t>(world_size));
  s.inline_ties = true;
  for (int r = 0; r < world_size; ++r) {
    const WireHeader& h = headers[r];
    const bool flag = (h.flags & kHasZero) != 0;
    if (check.fail(
            flag != (h.zero_most > 0) || h.zero_most > shard_elems ||
                (h.zero_capacity > h.zero_most && h.zero_most != kNoIndex) ||
                h.zero_capacity > shard_elems || (h.zero_runs > 0) != (h.zero_capacity > 0) ||
                h.zero_runs > h.zero_capacity ||
                (h.zero_packed > 0 &&
                 (h.zero_capacity == 0 || h.zero_packed % 8 != 0 ||
                  h.zero_packed >= shard_elems / 8)),
            "rank ", name(r), " sent a corrupt header (zero capacity ", h.zero_capacity, " in ",
            h.zero_runs, " runs, ", h.zero_packed, " bytes packed, most zeros ", h.zero_most,
            ", shard of ", shard_elems, " elements)")) {
      s.zero_codes.clear();
      s.zero_most.clear();
      return s;
    }
    s.zero_codes[static_cast<size_t>(r)] = ZeroCode{h.zero_capacity, h.zero_runs, h.zero_packed};
    s.zero_most[static_cast<size_t>(r)] = h.zero_most;
    s.any_zero = s.any_zero || flag;
    s.inline_ties = s.inline_ties && (h.flags & kTieHint) != 0;
  }
  return s;
}

} // namespace lionbit::bits
