// The per-word logic of the GPU kernels for zero and tie planes
// (signbits/cuda/zero_lists.cu): the bits a list or a run list names, the
// positions written in order, and the checks a received list passes, as
// bits::encode_zeros / decode_zeros (signbits/zeros.h) define them. Written
// once as host+device inline functions: nvcc compiles them into the kernels,
// g++ into tests/cpp/test_cuda_host_zero_lists.cpp, which emulates the
// kernels' tiles and checks them against the CPU coder without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include "signbits/float16.h" // LIONBIT_HD

namespace lionbit::cuda::detail {

// Which bits of a plane a list names: every set bit (a list of positions),
// the first bit of each run, or the last bit of each run (a run list's ends
// are those positions + 1).
enum class Edge : int { kBits = 0, kRunFirst = 1, kRunLast = 2 };

// Words a tile of the zero-list kernels covers: 256 threads, 8 consecutive
// words each.
constexpr unsigned kTileThreads = 256;
constexpr unsigned kTileWordsPerThread = 8;
constexpr size_t kTileWords = static_cast<size_t>(kTileThreads) * kTileWordsPerThread;

LIONBIT_HD int popc64z(uint64_t x) {
#if defined(__CUDA_ARCH__)
  return __popcll(x);
#else
  return __builtin_popcountll(x);
#endif
}

LIONBIT_HD int ctz64(uint64_t x) {
#if defined(__CUDA_ARCH__)
  return __ffsll(static_cast<long long>(x)) - 1;
#else
  return __builtin_ctzll(x);
#endif
}

// The `edge` bits of word i of a plane of `words` words, runs counted
// within blocks of `block_words` words (a block's first bit has no
// predecessor, its last no successor; block_words == words: the whole plane).
LIONBIT_HD uint64_t
edge_word(Edge edge, const uint64_t* plane, size_t words, size_t block_words, size_t i) {
  const uint64_t w = plane[i];
  if (edge == Edge::kBits || w == 0) {
    return w;
  }
  if (edge == Edge::kRunFirst) {
    const uint64_t prev = i % block_words != 0 ? plane[i - 1] : 0;
    return w & ~((w << 1) | (prev >> 63));
  }
  const uint64_t next = (i + 1) % block_words != 0 && i + 1 < words ? plane[i + 1] : 0;
  return w & ~((w >> 1) | (next << 63));
}

// Little-endian uint32 slot `slot` of a byte buffer (any alignment).
LIONBIT_HD void put_slot(uint8_t* out, size_t slot, uint32_t v) {
  uint8_t* p = out + 4 * slot;
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
  p[2] = static_cast<uint8_t>(v >> 16);
  p[3] = static_cast<uint8_t>(v >> 24);
}

LIONBIT_HD uint32_t get_slot(const uint8_t* in, size_t slot) {
  const uint8_t* p = in + 4 * slot;
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
      (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

// Writes the positions of the set bits of `bits` (word i of the plane), the
// `index`-th of the plane's selected bits first: position p (+ add) into slot
// width * index + lane while index < cap. Returns the next index.
LIONBIT_HD uint64_t emit_positions(
    uint64_t bits,
    size_t i,
    uint64_t index,
    uint32_t add,
    unsigned width,
    unsigned lane,
    uint64_t cap,
    uint8_t* out) {
  while (bits != 0 && index < cap) {
    const uint32_t at = static_cast<uint32_t>(i * 64 + static_cast<size_t>(ctz64(bits)));
    put_slot(out, width * index + lane, at + add);
    ++index;
    bits &= bits - 1;
  }
  return index + static_cast<uint64_t>(popc64z(bits));
}

constexpr uint32_t kNoSlot = 0xffffffffu; // bits::kNoIndex

// Whether entry k of a received list makes it corrupt, exactly as
// bits::decode_zeros reads it (every entry checked on its own; the message
// is corrupt if any is): `entries` entries of `width` slots (1: offsets, 2:
// runs [first, end)), at most `count` of them used, then padding (every slot
// kNoSlot) to the end; offsets below `limit` (the plane's bits) and
// ascending; runs not empty, inside the plane, each after the last one's end
// with a gap.
LIONBIT_HD bool entry_corrupt(
    const uint8_t* in,
    uint64_t entries,
    uint64_t count,
    unsigned width,
    uint64_t limit,
    uint64_t k) {
  const uint32_t a = get_slot(in, width * k);
  const uint32_t b = width == 2 ? get_slot(in, width * k + 1) : a;
  if (a == kNoSlot) {
    // Padding: whole, and followed by padding only.
    return b != kNoSlot || (k + 1 < entries && get_slot(in, width * (k + 1)) != kNoSlot);
  }
  if (k >= count) {
    return true;
  }
  // The entry before (a padding entry before a used one reads kNoSlot here,
  // which no entry is above: corrupt, as the CPU decoder's "entry after
  // padding").
  const bool has_prev = k > 0;
  const uint32_t prev = has_prev ? get_slot(in, width * k - 1) : 0;
  if (width == 1) {
    return a >= limit || (has_prev && a <= prev);
  }
  return b <= a || b > limit || (has_prev && a <= prev);
}

// ORs v into *word: atomically on the GPU (neighbouring entries may share a
// word), plainly in the host emulation.
LIONBIT_HD void or_into(uint64_t* word, uint64_t v) {
#if defined(__CUDA_ARCH__)
  atomicOr(reinterpret_cast<unsigned long long*>(word), static_cast<unsigned long long>(v));
#else
  *word |= v;
#endif
}

// The callers that share a run in decode_entries_kernel (a warp).
constexpr unsigned kEntryLanes = 32;

// Sets what entry k of a received list names in `plane` (zeroed before):
// its offset, or its run's bits [first, end); nothing for padding or an
// entry out of the plane's `limit` bits (the message is then corrupt and
// the plane unspecified; no write leaves it). A run's inner words are its
// own (runs are disjoint with gaps) and are stored; its edge words are
// ORed. `parts` callers share the entry (a warp: one long run, a plane of
// zeros from a rank that abstains, is millions of words): part 0 sets the
// offset or the run's edges, part p every parts-th inner word from p.
LIONBIT_HD void set_entry(
    const uint8_t* in,
    unsigned width,
    uint64_t limit,
    uint64_t k,
    uint64_t* plane,
    unsigned part = 0,
    unsigned parts = 1) {
  if (width == 1 && part != 0) {
    return;
  }
  const uint32_t a = get_slot(in, width * k);
  if (a == kNoSlot || a >= limit) {
    return;
  }
  if (width == 1) {
    or_into(plane + a / 64, uint64_t{1} << (a % 64));
    return;
  }
  const uint32_t b = get_slot(in, width * k + 1);
  if (b <= a || b > limit) {
    return;
  }
  const size_t first = a / 64, last = (static_cast<size_t>(b) - 1) / 64;
  const uint64_t head = ~uint64_t{0} << (a % 64);
  const uint64_t tail = ~uint64_t{0} >> (63 - (static_cast<size_t>(b) - 1) % 64);
  if (part == 0) {
    if (first == last) {
      or_into(plane + first, head & tail);
      return;
    }
    or_into(plane + first, head);
    or_into(plane + last, tail);
  }
  for (size_t w = first + 1 + part; w < last; w += parts) {
    plane[w] = ~uint64_t{0};
  }
}

// clean (backend's KernelSet::clean): word k of the planes with the bits
// from `limit` on cleared and a zero bit winning over a sign bit.
LIONBIT_HD void clean_word(uint64_t* sign, uint64_t* zero, size_t k, uint64_t limit) {
  const uint64_t first = static_cast<uint64_t>(k) * 64;
  const uint64_t keep = first >= limit ? 0
      : limit - first >= 64            ? ~uint64_t{0}
                                       : (uint64_t{1} << (limit - first)) - 1;
  const uint64_t z = zero[k] & keep;
  zero[k] = z;
  sign[k] = sign[k] & keep & ~z;
}

} // namespace lionbit::cuda::detail
