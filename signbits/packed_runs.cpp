#include "packed_runs.h"

#include <cstring>
#include <deque>
#include <iterator>
#include <vector>

#include "bit_runs.h"
#include "zeros.h"

namespace lionbit::bits {
namespace {

constexpr size_t kLengthBytes = 4; // the u32 L ahead of the tokens
constexpr size_t kMaxNumberBytes = 10;

struct Run {
  uint64_t gap; // clear bits since the last run's end
  uint64_t len; // set bits, >= 1
  bool operator==(const Run& o) const { return gap == o.gap && len == o.len; }
};

size_t number_bytes(uint64_t v) {
  size_t n = 1;
  for (; v >= 0x80; v >>= 7) {
    ++n;
  }
  return n;
}

void put_number(std::vector<uint8_t>& out, uint64_t v) {
  for (; v >= 0x80; v >>= 7) {
    out.push_back(static_cast<uint8_t>(v | 0x80));
  }
  out.push_back(static_cast<uint8_t>(v));
}

size_t run_bytes(const Run& r) {
  return number_bytes(2 * r.gap) + number_bytes(r.len - 1);
}

// A plane's runs, found as the tokenizer reaches them.
class Runs {
 public:
  // `expected`: the plane's runs where known (0: not known), room made for them at once.
  Runs(const uint64_t* plane, size_t words, uint64_t expected)
      : plane_(plane), words_(words), limit_(static_cast<uint64_t>(words) * kWordBits) {
    runs_.reserve(static_cast<size_t>(expected < limit_ / 2 + 1 ? expected : limit_ / 2 + 1));
  }

  // Whether run i exists (finding the runs up to it).
  bool has(size_t i) {
    while (runs_.size() <= i && at_ < limit_) {
      const uint64_t first = next_bit(plane_, words_, at_, true);
      if (first >= limit_) {
        at_ = limit_;
        break;
      }
      const uint64_t end = next_bit(plane_, words_, first, false);
      runs_.push_back(Run{first - at_, end - first});
      at_ = end;
    }
    return i < runs_.size();
  }
  const Run& operator[](size_t i) const { return runs_[i]; }

 private:
  const uint64_t* plane_;
  size_t words_;
  uint64_t limit_;
  uint64_t at_ = 0; // the last run's end
  std::vector<Run> runs_;
};

// The tokens (after the u32 L) of a plane, greedily: at each run, the
// longest copy among two distances (to this run's last occurrence, and the
// last copy's), when it takes fewer bytes than the runs it covers;
// otherwise the run. Stops (false) past `budget` bytes in all, and early
// where the plane will not fit: every 1,024 runs, when the bytes so far,
// scaled to all `total` runs, come to more than the budget (scattered zeros
// or ties, whose runs do not repeat: a dense plane is ruled out in ~1,000
// runs, not after a budget's worth; 0: no early stop; `expected`: the runs,
// where known, for their storage). A scan is either taken or no longer than
// the one taken beside it (or a few runs), so the work stays linear in the
// runs.
bool tokenize(
    const uint64_t* plane,
    size_t words,
    uint64_t budget,
    uint64_t total,
    uint64_t expected,
    std::vector<uint8_t>& out) {
  constexpr size_t kCheckEvery = 1024;
  constexpr size_t kTable = 4096;
  std::vector<int64_t> last_seen(kTable, -1);
  auto slot = [](const Run& r) {
    return static_cast<size_t>((r.gap * 0x9e3779b97f4a7c15ull) ^ (r.len * 0xc2b2ae3d27d4eb4full)) %
        kTable;
  };
  Runs runs(plane, words, expected);
  size_t last_k = 0;
  for (size_t i = 0; runs.has(i);) {
    size_t best_m = 0, best_k = 0;
    const int64_t seen = last_seen[slot(runs[i])];
    const size_t candidates[2] = {
        seen >= 0 && runs[static_cast<size_t>(seen)] == runs[i] ? i - static_cast<size_t>(seen) : 0,
        last_k};
    for (const size_t k : candidates) {
      if (k == 0 || k > i || k > kMaxCopyDistance || k == best_k) {
        continue;
      }
      size_t m = 0;
      while (runs.has(i + m) && runs[i + m] == runs[i + m - k]) {
        ++m;
      }
      if (m > best_m) {
        best_m = m;
        best_k = k;
      }
    }
    size_t take = 0; // runs a copy covers
    if (best_m > 0) {
      // The copy when it is shorter than the runs as literals (summed only
      // until they are longer: a copy's few bytes against many runs).
      const size_t copy = number_bytes(2 * (best_k - 1) + 1) + number_bytes(best_m - 1);
      size_t literal = 0;
      for (size_t j = i; j < i + best_m && literal <= copy; ++j) {
        literal += run_bytes(runs[j]);
      }
      if (copy < literal) {
        put_number(out, 2 * (best_k - 1) + 1);
        put_number(out, best_m - 1);
        take = best_m;
        last_k = best_k;
      }
    }
    if (take == 0) {
      put_number(out, 2 * runs[i].gap);
      put_number(out, runs[i].len - 1);
      take = 1;
    }
    // Each run's last occurrence. A copy's runs repeat with period best_k,
    // so each of them occurs last within its last best_k runs: only those
    // are written (the same table as writing every one in order).
    const size_t from = take > best_k && best_k > 0 ? i + take - best_k : i;
    for (size_t j = from; j < i + take; ++j) {
      last_seen[slot(runs[j])] = static_cast<int64_t>(j);
    }
    const size_t before = i;
    i += take;
    if (out.size() > budget) {
      return false;
    }
    if (i / kCheckEvery != before / kCheckEvery &&
        static_cast<double>(out.size()) * static_cast<double>(total) >
            static_cast<double>(budget) * static_cast<double>(i)) {
      return false;
    }
  }
  return true;
}

uint64_t padded(uint64_t bytes) {
  return (bytes + 7) / 8 * 8;
}

// The streams of the planes packed_runs_bytes sized last on this thread, for
// encode_packed_runs: a vote sizes each shard's plane (the offer) and soon
// after encodes those it sends, and the tokens are the same work twice. An
// encode takes the stream of a kept plane of the same content (compared
// word for word: the tokens depend on nothing else) and forgets it. At most
// kKeptBytes of planes are kept, the oldest dropped first.
struct KeptStream {
  std::vector<uint64_t> plane;
  std::vector<uint8_t> stream; // the u32 L's room, then the tokens
};
constexpr size_t kKeptBytes = size_t{32} << 20;
thread_local std::deque<KeptStream> t_kept;
thread_local size_t t_kept_bytes = 0;

void keep_stream(const uint64_t* plane, size_t words, std::vector<uint8_t>&& stream) {
  const size_t bytes = words * 8;
  if (bytes > kKeptBytes) {
    return;
  }
  while (t_kept_bytes + bytes > kKeptBytes) {
    t_kept_bytes -= t_kept.front().plane.size() * 8;
    t_kept.pop_front();
  }
  t_kept.push_back(KeptStream{std::vector<uint64_t>(plane, plane + words), std::move(stream)});
  t_kept_bytes += bytes;
}

bool take_stream(const uint64_t* plane, size_t words, std::vector<uint8_t>& stream) {
  for (auto it = t_kept.rbegin(); it != t_kept.rend(); ++it) {
    if (it->plane.size() == words && std::memcmp(it->plane.data(), plane, words * 8) == 0) {
      stream = std::move(it->stream);
      t_kept_bytes -= words * 8;
      t_kept.erase(std::next(it).base());
      return true;
    }
  }
  return false;
}

} // namespace

uint64_t packed_runs_bytes(const uint64_t* plane, size_t words, uint64_t runs, uint64_t budget) {
  std::vector<uint8_t> out(kLengthBytes);
  if (!tokenize(plane, words, budget, runs, runs, out) || padded(out.size()) > budget ||
      out.size() - kLengthBytes > 0xffffffffull) {
    return 0;
  }
  const uint64_t bytes = padded(out.size());
  keep_stream(plane, words, std::move(out));
  return bytes;
}

void encode_packed_runs(const uint64_t* plane, size_t words, uint8_t* out, size_t bytes) {
  std::vector<uint8_t> s;
  if (!take_stream(plane, words, s)) {
    s.assign(kLengthBytes, 0);
    // No early stop (the caller's size fits); the runs counted first (a pass
    // over the words, a fraction of the tokens' work) to store them at once.
    tokenize(plane, words, bytes, 0, count_runs(plane, words), s);
  }
  const uint32_t len = static_cast<uint32_t>(s.size() - kLengthBytes);
  std::memcpy(s.data(), &len, kLengthBytes);
  std::memcpy(out, s.data(), s.size() < bytes ? s.size() : bytes);
  if (s.size() < bytes) {
    std::memset(out + s.size(), 0, bytes - s.size());
  }
}

bool decode_packed_runs(const uint8_t* in, size_t bytes, size_t words, uint64_t* plane) {
  std::memset(plane, 0, words * 8);
  if (bytes < kLengthBytes) {
    return false;
  }
  uint32_t len;
  std::memcpy(&len, in, kLengthBytes);
  if (len > bytes - kLengthBytes) {
    return false;
  }
  const uint8_t* p = in + kLengthBytes;
  const uint8_t* const end = p + len;
  for (const uint8_t* q = end; q < in + bytes; ++q) {
    if (*q != 0) {
      return false; // padding that is not zero
    }
  }
  auto number = [&](uint64_t& v) {
    v = 0;
    for (size_t n = 0; n < kMaxNumberBytes && p < end; ++n) {
      const uint64_t b = *p++;
      if (n == kMaxNumberBytes - 1 && b > 1) {
        return false; // past 64 bits
      }
      v |= (b & 0x7f) << (7 * n);
      if ((b & 0x80) == 0) {
        return true;
      }
    }
    return false; // past L, or longer than 10 bytes
  };
  const uint64_t limit = static_cast<uint64_t>(words) * kWordBits;
  // The last runs, for copies: a copy reaches at most kMaxCopyDistance runs
  // back (fewer for a plane that cannot hold as many); the ring that keeps
  // them is the next power of two, indexed with a mask (a division a run
  // cost more than the run itself).
  const size_t reach = static_cast<size_t>(
      limit / 2 + 1 < kMaxCopyDistance ? limit / 2 + 1 : kMaxCopyDistance);
  size_t ring_size = 1;
  while (ring_size < reach) {
    ring_size *= 2;
  }
  const size_t mask = ring_size - 1;
  std::vector<Run> ring(ring_size);
  uint64_t count = 0, at = 0; // runs written, the last one's end
  auto append = [&](const Run& r) {
    if ((count > 0 && r.gap == 0) || r.len == 0 || r.gap > limit - at ||
        r.len > limit - at - r.gap) {
      return false;
    }
    set_bit_range(plane, at + r.gap, at + r.gap + r.len);
    at += r.gap + r.len;
    ring[count & mask] = r;
    ++count;
    return true;
  };
  while (p < end) {
    uint64_t v, w;
    if (!number(v) || !number(w)) {
      return false;
    }
    if (v % 2 == 0) {
      if (w == ~uint64_t{0} || !append(Run{v / 2, w + 1})) {
        return false;
      }
      continue;
    }
    const uint64_t k = v / 2 + 1;
    if (k > count || k > reach) {
      return false;
    }
    // w + 1 runs, each a copy of the run k before it (the copies repeat a
    // pattern of k runs when w + 1 > k). Each run sets a bit, so a copy past
    // the plane fails within `limit` runs.
    for (uint64_t c = 0;; ++c) {
      if (!append(ring[(count - k) & mask])) {
        return false;
      }
      if (c == w) {
        break;
      }
    }
  }
  return true;
}

void drop_kept_packed_runs() {
  t_kept.clear();
  t_kept_bytes = 0;
}

} // namespace lionbit::bits
