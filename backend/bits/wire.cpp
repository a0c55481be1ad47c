#include "wire.h"

#include <algorithm>
#include <sstream>

namespace lionbit::bits {

const char* sign_op_name(SignOp op) {
  switch (op) {
    case SignOp::kVote:
      return "vote";
    case SignOp::kAvg:
      return "avg";
    case SignOp::kSum:
      return "sum";
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
    uint64_t zero_capacity,
    uint64_t chunk_elems) {
  WireHeader h{};
  h.magic = kWireMagic;
  h.version = kWireVersion;
  h.op = static_cast<uint8_t>(op);
  h.dtype = static_cast<uint8_t>(dtype);
  h.rank = static_cast<uint32_t>(rank);
  h.flags = flags;
  h.seq = seq;
  h.numel = numel;
  h.zero_capacity = zero_capacity;
  h.chunk_elems = chunk_elems;
  return h;
}

uint64_t default_chunk_elems(int world_size) {
  constexpr uint64_t kChunk = uint64_t{1} << 22;
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
  return v >= 1 && v <= 3;
}

bool known_dtype(uint8_t v) {
  return v >= 1 && v <= 5;
}

std::string op_text(uint8_t v) {
  return known_op(v) ? sign_op_name(static_cast<SignOp>(v))
                     : "op#" + std::to_string(v);
}

std::string dtype_text(uint8_t v) {
  return known_dtype(v) ? dtype_name(static_cast<DType>(v))
                        : "dtype#" + std::to_string(v);
}

} // namespace

HeaderSummary check_headers(
    const WireHeader* headers,
    int world_size,
    const WireHeader& mine) {
  HeaderSummary s;
  std::ostringstream err;
  // 1. Well-formed: magic, version, rank field, known enums, sane size.
  for (int r = 0; r < world_size; ++r) {
    const WireHeader& h = headers[r];
    if (h.magic != kWireMagic || h.version != kWireVersion) {
      err << "rank " << r << " sent a malformed header (magic 0x" << std::hex
          << h.magic << std::dec << ", version " << h.version
          << "): is every rank running the same lionbit version?";
      s.error = err.str();
      return s;
    }
    if (h.rank != static_cast<uint32_t>(r) || !known_op(h.op) ||
        !known_dtype(h.dtype) || h.numel > kMaxNumel ||
        (h.flags & ~(kHasZero | kHasNan | kRejected | kReduceScatter | kDevice | kTieHint)) != 0) {
      err << "rank " << r << " sent a corrupt header (rank field " << h.rank
          << ", op " << static_cast<int>(h.op) << ", dtype "
          << static_cast<int>(h.dtype) << ", numel " << h.numel << ", flags 0x"
          << std::hex << h.flags << std::dec << ")";
      s.error = err.str();
      return s;
    }
  }
  // 2. A rank that rejected its own arguments: it raised there; fail here too
  //    instead of waiting for it.
  std::vector<int> rejected;
  for (int r = 0; r < world_size; ++r) {
    if (headers[r].flags & kRejected) {
      rejected.push_back(r);
    }
  }
  if (!rejected.empty()) {
    err << "rank(s) " << ranks_list(rejected)
        << " rejected their input to this call (their own error says why)";
    s.error = err.str();
    return s;
  }
  // 3. Same call on every rank: order, op, dtype, size.
  for (int r = 0; r < world_size; ++r) {
    const WireHeader& h = headers[r];
    if (h.seq != mine.seq) {
      err << "ranks disagree on the order of sign all-reduce calls: this rank ("
          << mine.rank << ") is at call #" << mine.seq << ", rank " << r
          << " at call #" << h.seq;
      s.error = err.str();
      return s;
    }
    if ((h.flags & kReduceScatter) != (mine.flags & kReduceScatter)) {
      const auto name = [](uint32_t f) {
        return (f & kReduceScatter) ? "a sign reduce-scatter" : "a sign all-reduce";
      };
      err << "collective differs across ranks at call #" << mine.seq << ": rank "
          << mine.rank << " runs " << name(mine.flags) << ", rank " << r
          << " runs " << name(h.flags);
      s.error = err.str();
      return s;
    }
    if ((h.flags & kDevice) != (mine.flags & kDevice)) {
      err << "tensor device type differs across ranks: rank " << mine.rank
          << " has a " << ((mine.flags & kDevice) ? "CUDA" : "CPU") << " tensor, rank " << r
          << " a " << ((h.flags & kDevice) ? "CUDA" : "CPU") << " tensor";
      s.error = err.str();
      return s;
    }
    if (h.op != mine.op) {
      err << "op differs across ranks: rank " << mine.rank << " has "
          << op_text(mine.op) << ", rank " << r << " has " << op_text(h.op);
      s.error = err.str();
      return s;
    }
    if (h.dtype != mine.dtype) {
      err << "dtype differs across ranks: rank " << mine.rank << " has "
          << dtype_text(mine.dtype) << ", rank " << r << " has "
          << dtype_text(h.dtype);
      s.error = err.str();
      return s;
    }
    if (h.numel != mine.numel) {
      err << "number of elements differs across ranks: rank " << mine.rank
          << " has " << mine.numel << ", rank " << r << " has " << h.numel;
      s.error = err.str();
      return s;
    }
    if (h.chunk_elems != mine.chunk_elems) {
      err << "pipeline chunk size differs across ranks (LIONBIT_CHUNK_ELEMS?): rank "
          << mine.rank << " uses " << mine.chunk_elems << ", rank " << r
          << " uses " << h.chunk_elems;
      s.error = err.str();
      return s;
    }
  }
  // 4. NaN anywhere poisons the result on every rank.
  std::vector<int> nan_ranks;
  for (int r = 0; r < world_size; ++r) {
    if (headers[r].flags & kHasNan) {
      nan_ranks.push_back(r);
    }
  }
  if (!nan_ranks.empty()) {
    err << "input contains NaN on rank(s) " << ranks_list(nan_ranks)
        << "; the sign of NaN is undefined";
    s.error = err.str();
    return s;
  }
  // 5. Zero capacities: consistent with the flag, at most a shard's size.
  const uint64_t largest_chunk =
      mine.chunk_elems == 0 ? mine.numel : std::min(mine.numel, mine.chunk_elems);
  const uint64_t shard_elems = shard_words(largest_chunk, world_size) * kWordBits;
  s.zero_capacity.resize(static_cast<size_t>(world_size));
  s.inline_ties = true;
  for (int r = 0; r < world_size; ++r) {
    const WireHeader& h = headers[r];
    const bool flag = (h.flags & kHasZero) != 0;
    if (flag != (h.zero_capacity > 0) || h.zero_capacity > shard_elems) {
      err << "rank " << r << " sent a corrupt header (zero capacity "
          << h.zero_capacity << ", shard of " << shard_elems << " elements)";
      s.error = err.str();
      s.zero_capacity.clear();
      return s;
    }
    s.zero_capacity[static_cast<size_t>(r)] = h.zero_capacity;
    s.any_zero = s.any_zero || flag;
    s.inline_ties = s.inline_ties && (h.flags & kTieHint) != 0;
  }
  return s;
}

} // namespace lionbit::bits
