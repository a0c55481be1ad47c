// The per-element and per-word logic of the GPU bit kernels, written once as
// host+device inline functions. nvcc compiles them into the kernels
// (signbits/cuda/*.cu); g++ compiles the very same functions into
// tests/cpp/test_cuda_host.cpp, which checks them against the CPU kernels on a
// machine without a GPU. The kernels keep only what cannot run on a host (the
// warp ballots, the grid loop) and the tests emulate those with plain loops
// over "lanes" calling the same bodies.
//
// Nothing here includes CUDA headers when compiled by a plain C++ compiler.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "signbits/float16.h"
#include "signbits/types.h"

// Full unrolling of loops with compile-time trip counts in device code (so
// that small arrays stay in registers); nothing on the host.
#if defined(__CUDA_ARCH__)
#define LIONBIT_UNROLL _Pragma("unroll")
#else
#define LIONBIT_UNROLL
#endif

namespace lionbit::cuda::detail {

using bits::DType;

// ---------------------------------------------------------- primitives ----

using bits::bf16_to_f32;
using bits::bits_f32;
using bits::clz32;
using bits::f16_to_f32;
using bits::f32_bits;
using bits::f32_to_bf16;
using bits::f32_to_f16;

LIONBIT_HD int popc64(uint64_t x) {
#if defined(__CUDA_ARCH__)
  return __popcll(x);
#else
  return __builtin_popcountll(x);
#endif
}

// float32 operations rounded one at a time (never contracted into an FMA).
// Device: the _rn intrinsics, which nvcc never fuses whatever --fmad says.
// Host: plain operators in translation units built with -ffp-contract=off
// (SSE arithmetic: no excess precision on x86-64).
LIONBIT_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

LIONBIT_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

LIONBIT_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// Number of bits needed to hold every integer in [0, v] (bits::bit_width).
LIONBIT_HD constexpr int width_of(uint32_t v) {
  int b = 0;
  while (v != 0) {
    ++b;
    v >>= 1;
  }
  return b;
}

// ------------------------------------------------------- sign of a value ----

// Storage type of each dtype and its bit-pattern constants.
template <DType D>
using Elem = bits::Storage<D>;

// Flags of one element: bit 0 positive, bit 1 zero, bit 2 NaN (at most one
// set; none: negative, or no element).
enum : unsigned { kPos = 1u, kZero = 2u, kNan = 4u };

// The sign of a stored value, on its bit pattern (denormals nonzero, -0 is
// zero, +-Inf is +-1): exactly bits::pack_signs.
template <DType D>
LIONBIT_HD unsigned classify(typename Elem<D>::U u) {
  using E = Elem<D>;
  if constexpr (E::kFloat) {
    const auto mag = static_cast<typename E::U>(u & E::kMag);
    if (mag == 0) {
      return kZero;
    }
    if (mag > E::kInf) {
      return kNan;
    }
    return u == mag ? kPos : 0u;
  } else {
    const auto v = static_cast<int8_t>(u);
    return v == 0 ? kZero : (v > 0 ? kPos : 0u);
  }
}

// Sign of a float32 result by float comparisons (lion.h): c > 0 positive,
// c == 0 (either sign) zero, c != c NaN. FTZ is off in this library, so a
// denormal c is nonzero on both host and device.
LIONBIT_HD unsigned classify_float(float c) {
  return c > 0.0f ? kPos : (c == 0.0f ? kZero : (c != c ? kNan : 0u));
}

// -------------------------------------------------- float conversions ----

// float16 / bfloat16 conversions: signbits/float16.h.

// Float storage of the Lion buffers: float32, bfloat16, float16.
template <DType D>
struct FloatStore;
template <>
struct FloatStore<DType::kFloat32> {
  using U = float;
  static LIONBIT_HD float load(U v) { return v; }
  static LIONBIT_HD U store(float v) { return v; }
};
template <>
struct FloatStore<DType::kBFloat16> {
  using U = uint16_t;
  static LIONBIT_HD float load(U v) { return bf16_to_f32(v); }
  static LIONBIT_HD U store(float v) { return f32_to_bf16(v); }
};
template <>
struct FloatStore<DType::kFloat16> {
  using U = uint16_t;
  static LIONBIT_HD float load(U v) { return f16_to_f32(v); }
  static LIONBIT_HD U store(float v) { return f32_to_f16(v); }
};

// ------------------------------------------------------------- Lion math ----

struct LionCoefs {
  float b1, omb1, b2, omb2;
};

// One element of step 1: returns the flags of c and writes the new momentum.
// kNan marks a non-finite c (NaN or +-Inf: the step must not be applied, as
// PackCounts::nonfinite of the CPU kernel); +-Inf keeps its sign bit.
LIONBIT_HD unsigned lion_direction_math(float g, float m, const LionCoefs& k, float* m_new) {
  const float c = add_rn(mul_rn(k.b1, m), mul_rn(k.omb1, g));
  *m_new = add_rn(mul_rn(k.b2, m), mul_rn(k.omb2, g));
  const bool infinite = c - c != 0.0f && c == c; // Inf - Inf is NaN; a finite c gives 0
  return classify_float(c) | (infinite ? kNan : 0u);
}

// x * decay - step, step = fl(lr * Delta) already rounded.
LIONBIT_HD float lion_apply_math(float x, float decay, float step) {
  return sub_rn(mul_rn(x, decay), step);
}

// ------------------------------------------------- bit offsets, words ----

// A launch writes bits [o, o + n) of the words starting at `base` (o < 64,
// the bit offset within the first word): words_out(o, n) words. Bit j of
// word k holds element k * 64 + j - o.
LIONBIT_HD size_t words_out(unsigned o, size_t n) {
  return (static_cast<size_t>(o) + n + 63) / 64;
}

// Element of bit j of word k, or false if that bit holds no element.
LIONBIT_HD bool element_of(size_t k, unsigned j, unsigned o, size_t n, size_t* e) {
  const size_t pos = k * 64 + j;
  if (pos < o) {
    return false;
  }
  *e = pos - o;
  return *e < n;
}

// Bits of word k that hold elements (all others must be left as they are).
LIONBIT_HD uint64_t word_mask(size_t k, unsigned o, size_t n) {
  const size_t first = k * 64;
  const size_t end = static_cast<size_t>(o) + n; // one past the last bit
  const unsigned lo = first < o ? o - static_cast<unsigned>(first) : 0u;
  const size_t hi_s = end - first; // > 0 for every word of the launch
  const unsigned hi = hi_s >= 64 ? 64u : static_cast<unsigned>(hi_s);
  const uint64_t below_hi = hi == 64 ? ~0ull : ((1ull << hi) - 1ull);
  const uint64_t below_lo = lo == 0 ? 0ull : ((1ull << lo) - 1ull);
  return below_hi & ~below_lo;
}

// Writes the bits of word k: a plain store where the whole word is the
// launch's, a read-modify-write of the masked bits at the two ends. Each word
// is written by exactly one thread of a launch.
LIONBIT_HD void commit_word(uint64_t* words, size_t k, unsigned o, size_t n, uint64_t v) {
  const uint64_t mask = word_mask(k, o, n);
  if (mask == ~0ull) {
    words[k] = v;
  } else {
    words[k] = (words[k] & ~mask) | (v & mask);
  }
}

// commit_word where several launches' worth of tensors share the planes in
// one launch (the list kernels): a word whose bits are all this tensor's is
// stored, an edge word, whose other bits another tensor's thread may be
// writing, has its bits replaced with two atomics (plainly on the host).
LIONBIT_HD void commit_word_shared(uint64_t* words, size_t k, unsigned o, size_t n, uint64_t v) {
  const uint64_t mask = word_mask(k, o, n);
  if (mask == ~0ull) {
    words[k] = v;
    return;
  }
#if defined(__CUDA_ARCH__)
  auto* w = reinterpret_cast<unsigned long long*>(words + k);
  atomicAnd(w, static_cast<unsigned long long>(~mask));
  atomicOr(w, static_cast<unsigned long long>(v & mask));
#else
  words[k] = (words[k] & ~mask) | (v & mask);
#endif
}

// The list kernels' tensor of work unit u: the last s < count with
// first_of(s) <= u (the firsts ascending from 0; tensors without units
// share their first with the next and are never found).
template <typename Seg>
LIONBIT_HD size_t segment_of(const Seg* segs, size_t count, uint64_t u) {
  size_t lo = 0, hi = count; // segs[lo].first <= u < segs[hi].first (hi == count: past the end)
  while (hi - lo > 1) {
    const size_t mid = lo + (hi - lo) / 2;
    if (segs[mid].first <= u) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// A grid loop's walk over a list's work units: a warp's (the direction) or a
// block's (the applies) units, u increasing by the grid's size. The tensor
// of each unit, searched for (segment_of, among the tensors from the last
// one on) only when u has left the last one's units: a large tensor is many
// of a warp's units in a row, and each search is log2(tensors) dependent
// loads before the unit's own loads can start. Two registers of state: the
// direction kernels are at their register limit.
template <typename Seg>
class SegmentWalk {
 public:
  LIONBIT_HD SegmentWalk(const Seg* segs, size_t count, uint64_t units)
      : segs_(segs), count_(count), units_(units) {}

  // The index of unit u's tensor; u at least the last call's.
  LIONBIT_HD size_t at(uint64_t u) {
    if (u >= end_) {
      at_ += static_cast<unsigned>(segment_of(segs_ + at_, count_ - at_, u));
      end_ = at_ + 1 < count_ ? segs_[at_ + 1].first : units_;
    }
    return at_;
  }

 private:
  const Seg* segs_;
  size_t count_;
  uint64_t units_;
  unsigned at_ = 0; // the tensor of the last unit (a list has fewer than 2^32)
  uint64_t end_ = 0; // the first unit past it (0: none yet)
};

// Words each warp handles per iteration of its grid loop in the word-per-warp
// kernels (pack, lion_direction, unpack): enough
// independent loads in flight per thread.
constexpr int kWordsPerWarpIter = 4;

// --------------------------------------------------- per-lane bodies ----
// Kernels that produce bit-planes run one warp per output word: lane l owns
// bits l and l + 32 (two coalesced loads per word), two 32-bit ballots make
// the 64-bit word. The lane bodies below return the flags of both bits:
// low byte bit l, second byte bit l + 32.

// pack_signs: flags of the lane's two elements of word k.
template <DType D>
LIONBIT_HD unsigned pack_lane(
    const typename Elem<D>::U* src,
    size_t n,
    unsigned o,
    size_t k,
    unsigned lane) {
  unsigned f = 0;
  size_t e;
  if (element_of(k, lane, o, n, &e)) {
    f |= classify<D>(src[e]);
  }
  if (element_of(k, lane + 32, o, n, &e)) {
    f |= classify<D>(src[e]) << 8;
  }
  return f;
}

// lion_direction: the lane's two elements of word k (reads g, m; writes the
// new momentum to m_out unless it is nullptr). m_out is m itself (in place)
// or a buffer that does not overlap m: each element is read before the same
// thread stores it, so neither pointer may carry __restrict__.
template <DType G, DType M>
LIONBIT_HD unsigned lion_direction_lane(
    const typename FloatStore<G>::U* g,
    const typename FloatStore<M>::U* m,
    typename FloatStore<M>::U* m_out,
    size_t n,
    unsigned o,
    size_t k,
    unsigned lane,
    const LionCoefs& c) {
  unsigned f = 0;
  for (unsigned h = 0; h < 2; ++h) {
    size_t e;
    if (element_of(k, lane + 32 * h, o, n, &e)) {
      float mn;
      const unsigned fl = lion_direction_math(
          FloatStore<G>::load(g[e]), FloatStore<M>::load(m[e]), c, &mn);
      if (m_out != nullptr) {
        m_out[e] = FloatStore<M>::store(mn);
      }
      f |= fl << (8 * h);
    }
  }
  return f;
}

// True when the kWordsPerWarpIter-word group from word k0 (groups_full: the
// `groups` groups from word k0) is made of whole words inside the launch (every bit an element):
// the kernels then issue all the group's loads before using any (memory-level parallelism), without
// per-element bounds checks. Element of bit lane + 32 * i of the group:
// k0 * 64 - o + lane + 32 * i.
LIONBIT_HD bool groups_full(size_t k0, unsigned o, size_t n, int groups) {
  return (k0 > 0 || o == 0) &&
      (k0 + static_cast<size_t>(groups) * kWordsPerWarpIter) * 64 <= static_cast<size_t>(o) + n;
}

LIONBIT_HD bool group_full(size_t k0, unsigned o, size_t n) {
  return groups_full(k0, o, n, 1);
}

// pack: the lane's flags for the words k0 .. k0 + kWordsPerWarpIter - 1.
template <DType D>
LIONBIT_HD void pack_group(
    const typename Elem<D>::U* src,
    size_t n,
    unsigned o,
    size_t k0,
    size_t nwords,
    unsigned lane,
    unsigned (&f)[kWordsPerWarpIter]) {
  constexpr int U = kWordsPerWarpIter;
  if (group_full(k0, o, n)) {
    const typename Elem<D>::U* p = src + (k0 * 64 - o + lane);
    typename Elem<D>::U v[2 * U];
    LIONBIT_UNROLL
    for (int i = 0; i < 2 * U; ++i) {
      v[i] = p[32 * i];
    }
    LIONBIT_UNROLL
    for (int u = 0; u < U; ++u) {
      f[u] = classify<D>(v[2 * u]) | (classify<D>(v[2 * u + 1]) << 8);
    }
    return;
  }
  LIONBIT_UNROLL
  for (int u = 0; u < U; ++u) {
    f[u] = k0 + u < nwords ? pack_lane<D>(src, n, o, k0 + u, lane) : 0u;
  }
}

// lion_direction: the lane's flags for the group's words (and the new
// momentum into m_out unless it is nullptr; m_out == m: in place, every load
// before the stores).
template <DType G, DType M>
LIONBIT_HD void lion_direction_group(
    const typename FloatStore<G>::U* g,
    const typename FloatStore<M>::U* m,
    typename FloatStore<M>::U* m_out,
    size_t n,
    unsigned o,
    size_t k0,
    size_t nwords,
    unsigned lane,
    const LionCoefs& c,
    unsigned (&f)[kWordsPerWarpIter]) {
  constexpr int U = kWordsPerWarpIter;
  if (group_full(k0, o, n)) {
    const size_t e0 = k0 * 64 - o + lane;
    typename FloatStore<G>::U gv[2 * U];
    typename FloatStore<M>::U mv[2 * U];
    LIONBIT_UNROLL
    for (int i = 0; i < 2 * U; ++i) {
      gv[i] = g[e0 + 32 * i];
      mv[i] = m[e0 + 32 * i];
    }
    unsigned fl[2 * U];
    LIONBIT_UNROLL
    for (int i = 0; i < 2 * U; ++i) {
      float mn;
      fl[i] = lion_direction_math(FloatStore<G>::load(gv[i]), FloatStore<M>::load(mv[i]), c, &mn);
      if (m_out != nullptr) {
        m_out[e0 + 32 * i] = FloatStore<M>::store(mn);
      }
    }
    LIONBIT_UNROLL
    for (int u = 0; u < U; ++u) {
      f[u] = fl[2 * u] | (fl[2 * u + 1] << 8);
    }
    return;
  }
  LIONBIT_UNROLL
  for (int u = 0; u < U; ++u) {
    f[u] = k0 + u < nwords ? lion_direction_lane<G, M>(g, m, m_out, n, o, k0 + u, lane, c) : 0u;
  }
}

// The sign and zero words of one warp's word.
struct WordPair {
  uint64_t sign;
  uint64_t zero;
};

// Adds the zero and NaN flags of a lane's two elements to its tallies.
LIONBIT_HD void tally_flags(unsigned f, unsigned long long* zeros, unsigned long long* nans) {
  *zeros += ((f & kZero) != 0 ? 1u : 0u) + ((f & (kZero << 8)) != 0 ? 1u : 0u);
  *nans += ((f & kNan) != 0 ? 1u : 0u) + ((f & (kNan << 8)) != 0 ? 1u : 0u);
}

// What the two pairs of ballots of a warp give (the host emulation; the device
// does the same with __ballot_sync in warp_planes.cuh).
inline WordPair ballot_planes_host(const unsigned (&f)[32]) {
  WordPair r{0, 0};
  for (unsigned l = 0; l < 32; ++l) {
    r.sign |= static_cast<uint64_t>((f[l] & kPos) != 0) << l;
    r.sign |= static_cast<uint64_t>((f[l] & (kPos << 8)) != 0) << (l + 32);
    r.zero |= static_cast<uint64_t>((f[l] & kZero) != 0) << l;
    r.zero |= static_cast<uint64_t>((f[l] & (kZero << 8)) != 0) << (l + 32);
  }
  return r;
}

// Word of a bit-plane from two 32-bit halves.
LIONBIT_HD uint64_t join_halves(uint32_t lo, uint32_t hi) {
  return static_cast<uint64_t>(lo) | (static_cast<uint64_t>(hi) << 32);
}

// ------------------------------------------------------- vector groups ----
// A group of kWordsPerWarpIter words whose bits are all elements (group_full)
// and whose first element is 16-byte aligned in every buffer a kernel reads
// or writes (vec_aligned) is read in 16-byte loads: lane l takes the group's
// elements 8l .. 8l + 7 (one load of 2-byte values, two of float32) and makes
// their sign and zero bits, a byte each (a Frag); the 8 lanes of a word join
// their bytes into it (warp_planes.cuh's join_fragments, three shuffles a
// plane; join_fragments_host below). The ballot path classifies two elements
// a lane and takes four ballots a word; the per-word kernels ran at the same
// elements per second in float32 and bfloat16, so they were bound by
// instructions, not by memory.

// Elements a lane takes of a vector group.
constexpr int kVecLane = 8;
static_assert(32 * kVecLane == kWordsPerWarpIter * 64, "a vector group is the warp's words");

// A lane's 8 elements of a vector group: bit i of sign / zero is element i;
// nans counts its NaN (pack) or non-finite (direction) elements.
struct Frag {
  uint32_t sign;
  uint32_t zero;
  uint32_t nans;
};

// The dtypes the vector path reads (2- and 4-byte floats).
template <DType D>
constexpr bool kVecDtype = D == DType::kFloat32 || D == DType::kBFloat16 || D == DType::kFloat16;

// True when element -o of p (the first element of word 0) lies on a 16-byte
// boundary: then the first element of every word does, each lane's 8 too.
template <size_t S>
LIONBIT_HD bool vec_aligned(const void* p, unsigned o) {
  return ((reinterpret_cast<uintptr_t>(p) - static_cast<uintptr_t>(o) * S) % 16u) == 0u;
}

#if !defined(__CUDA_ARCH__)
// The host emulation of a 16-byte access: the GPU faults on an unaligned one,
// so the emulation stops the test where the kernel would fail.
inline void check_vec_address(const void* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16u != 0u) {
    std::abort();
  }
}
#endif

// The 8 S-byte values at p (16-byte aligned) as 2 * S 32-bit words: a 2-byte
// value 2i + h is half h (low, high) of word i. Device: S / 2 16-byte loads.
template <size_t S>
LIONBIT_HD void load8(const void* p, uint32_t (&w)[2 * S]) {
#if defined(__CUDA_ARCH__)
  LIONBIT_UNROLL
  for (size_t i = 0; i < S / 2; ++i) {
    const uint4 v = static_cast<const uint4*>(p)[i];
    w[4 * i] = v.x;
    w[4 * i + 1] = v.y;
    w[4 * i + 2] = v.z;
    w[4 * i + 3] = v.w;
  }
#else
  check_vec_address(p);
  std::memcpy(w, p, 8 * S);
#endif
}

template <size_t S>
LIONBIT_HD void store8(void* p, const uint32_t (&w)[2 * S]) {
#if defined(__CUDA_ARCH__)
  LIONBIT_UNROLL
  for (size_t i = 0; i < S / 2; ++i) {
    static_cast<uint4*>(p)[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
  }
#else
  check_vec_address(p);
  std::memcpy(p, w, 8 * S);
#endif
}

// Signs of 8 stored values (load8's words), as classify<D> element by
// element: on whole words, two 2-byte values at a time. For a 2-byte half
// with magnitude m (<= 0x7fff, so no sum below carries into the next half):
// m + 0x7fff sets the half's top bit iff m != 0; m + 0x7fff - kInf iff
// m > kInf (NaN).
template <DType D>
LIONBIT_HD Frag classify8(const uint32_t (&w)[2 * sizeof(typename Elem<D>::U)]) {
  using E = Elem<D>;
  Frag f{0, 0, 0};
  if constexpr (sizeof(typename E::U) == 2) {
    constexpr uint32_t kTop = 0x80008000u;
    constexpr uint32_t kNanAdd = (0x7fffu - E::kInf) * 0x10001u;
    uint32_t pos = 0, zer = 0;
    LIONBIT_UNROLL
    for (int i = 0; i < 4; ++i) {
      const uint32_t m = w[i] & 0x7fff7fffu;
      const uint32_t nz = (m + 0x7fff7fffu) & kTop;
      const uint32_t nan = (m + kNanAdd) & kTop;
      pos |= (nz & ~nan & ~w[i]) >> (15 - 2 * i); // bits 2i and 16 + 2i
      zer |= (~nz & kTop) >> (15 - 2 * i);
      f.nans += static_cast<uint32_t>(popc64(nan));
    }
    f.sign = (pos | (pos >> 15)) & 0xffu;
    f.zero = (zer | (zer >> 15)) & 0xffu;
  } else {
    static_assert(D == DType::kFloat32, "vector groups read 2- and 4-byte floats");
    LIONBIT_UNROLL
    for (int i = 0; i < 8; ++i) {
      const uint32_t m = w[i] & 0x7fffffffu;
      const uint32_t nz = (m + 0x7fffffffu) >> 31;
      const uint32_t nan = (m + (0x7fffffffu - E::kInf)) >> 31;
      f.sign |= (nz & ~nan & ~(w[i] >> 31)) << i;
      f.zero |= (nz ^ 1u) << i;
      f.nans += nan;
    }
  }
  return f;
}

// Value i of load8's words as float32 (FloatStore<D>::load).
template <DType D>
LIONBIT_HD float value8(const uint32_t (&w)[2 * sizeof(typename FloatStore<D>::U)], int i) {
  if constexpr (sizeof(typename FloatStore<D>::U) == 4) {
    return bits_f32(w[i]);
  } else {
    return FloatStore<D>::load(static_cast<uint16_t>(w[i / 2] >> (16 * (i & 1))));
  }
}

// Sets value i of load8-shaped words to the stored form of v (2-byte values:
// set in order 0 .. 7, an even one clears its word's high half).
template <DType D>
LIONBIT_HD void put8(uint32_t (&w)[2 * sizeof(typename FloatStore<D>::U)], int i, float v) {
  if constexpr (sizeof(typename FloatStore<D>::U) == 4) {
    w[i] = f32_bits(v);
  } else {
    const uint32_t h = FloatStore<D>::store(v);
    w[i / 2] = (i & 1) != 0 ? (w[i / 2] & 0xffffu) | (h << 16) : h;
  }
}

// Vector groups a lane loads before it uses any (the word-per-warp kernels'
// batches: group b from word k0 + b * kWordsPerWarpIter), from the bytes its
// loads of one group take: at least 64 bytes in flight a lane. On an H200
// (4 blocks of 256 threads an SM) these kernels ran at a share of the copy
// bandwidth that followed the bytes a lane had in flight: 16 bytes 21 %, 32
// bytes 40 %, 64 bytes 87-92 % (docs/benchmarks/gpu_check_h200_5.json): the
// memory's latency under load wants about 64 KB in flight an SM.
template <size_t LaneBytes>
constexpr int kVecBatch = LaneBytes >= 64 ? 1 : (LaneBytes >= 32 ? 2 : 4);

// Vector groups a warp of pack_signs takes per iteration of its grid loop
// (signbits/cuda/pack.cu), their loads in flight at once: 4 of 2-byte
// values, 2 of float32, 1 where only the ballot path runs.
template <DType D>
constexpr int kPackGroups = kVecDtype<D> ? kVecBatch<kVecLane * sizeof(typename Elem<D>::U)> : 1;

// The first of lane `lane`'s 8 elements in vector group b of a batch from
// word k0 (group b from word k0 + b * kWordsPerWarpIter).
LIONBIT_HD size_t vec_elem(size_t k0, int b, unsigned o, unsigned lane) {
  return (k0 + static_cast<size_t>(b) * kWordsPerWarpIter) * 64 - o + kVecLane * lane;
}

// pack: lane `lane`'s Frags of the B vector groups from word k0, every
// group's loads issued before any is classified.
template <DType D, int B>
LIONBIT_HD void pack_vec_batch(
    const typename Elem<D>::U* src,
    unsigned o,
    size_t k0,
    unsigned lane,
    Frag* fr) {
  constexpr size_t S = sizeof(typename Elem<D>::U);
  uint32_t w[B][2 * S];
  LIONBIT_UNROLL
  for (int b = 0; b < B; ++b) {
    load8<S>(src + vec_elem(k0, b, o, lane), w[b]);
  }
  LIONBIT_UNROLL
  for (int b = 0; b < B; ++b) {
    fr[b] = classify8<D>(w[b]);
  }
}

// lion_direction: lane `lane`'s Frags of the B vector groups from word k0
// (the new momentum written to m_out unless it is nullptr; m_out == m: in
// place), every group's loads issued before any math or store; nans counts
// non-finite c, as the flags.
template <DType G, DType M, int B>
LIONBIT_HD void lion_direction_vec_batch(
    const typename FloatStore<G>::U* g,
    const typename FloatStore<M>::U* m,
    typename FloatStore<M>::U* m_out,
    unsigned o,
    size_t k0,
    unsigned lane,
    const LionCoefs& c,
    Frag* fr) {
  constexpr size_t SG = sizeof(typename FloatStore<G>::U);
  constexpr size_t SM = sizeof(typename FloatStore<M>::U);
  uint32_t gw[B][2 * SG], mw[B][2 * SM];
  LIONBIT_UNROLL
  for (int b = 0; b < B; ++b) {
    load8<SG>(g + vec_elem(k0, b, o, lane), gw[b]);
    load8<SM>(m + vec_elem(k0, b, o, lane), mw[b]);
  }
  LIONBIT_UNROLL
  for (int b = 0; b < B; ++b) {
    uint32_t out[2 * SM];
    Frag f{0, 0, 0};
    LIONBIT_UNROLL
    for (int i = 0; i < kVecLane; ++i) {
      float mn;
      const unsigned fl = lion_direction_math(value8<G>(gw[b], i), value8<M>(mw[b], i), c, &mn);
      put8<M>(out, i, mn);
      f.sign |= (fl & kPos) << i;
      f.zero |= ((fl & kZero) >> 1) << i;
      f.nans += (fl & kNan) >> 2;
    }
    if (m_out != nullptr) {
      store8<SM>(m_out + vec_elem(k0, b, o, lane), out);
    }
    fr[b] = f;
  }
}

// Vector groups a lion_direction batch loads at once (kVecBatch of g's and
// m's bytes a lane): 1 for float32 / float32, 2 otherwise.
template <DType G, DType M>
constexpr size_t kDirLaneBytes =
    kVecLane*(sizeof(typename FloatStore<G>::U) + sizeof(typename FloatStore<M>::U));
template <DType G, DType M>
constexpr int kDirBatch = kVecBatch<kDirLaneBytes<G, M>>;

// Vector groups of a lion_direction work unit (a warp's, per iteration of
// the grid loop; optimizer/lion_warp.cuh): kDirBatch groups at a time.
constexpr int kDirGroups = 2;

// lion_direction: lane `lane`'s Frags of the `Groups` vector groups from word
// k0, kDirBatch<G, M> groups' loads at a time.
template <DType G, DType M, int Groups>
LIONBIT_HD void lion_direction_vec_groups(
    const typename FloatStore<G>::U* g,
    const typename FloatStore<M>::U* m,
    typename FloatStore<M>::U* m_out,
    unsigned o,
    size_t k0,
    unsigned lane,
    const LionCoefs& c,
    Frag* fr) {
  constexpr int B = kDirBatch<G, M> < Groups ? kDirBatch<G, M> : Groups;
  static_assert(Groups % B == 0, "a unit is whole batches");
  LIONBIT_UNROLL
  for (int b = 0; b < Groups; b += B) {
    lion_direction_vec_batch<G, M, B>(
        g, m, m_out, o, k0 + static_cast<size_t>(b) * kWordsPerWarpIter, lane, c, fr + b);
  }
}

// The vector path's condition for lion_direction's buffers: g, m and the
// momentum's destination m_out (unless nullptr; m itself when in place) all
// aligned.
template <DType G, DType M>
LIONBIT_HD bool direction_vec_aligned(const void* g, const void* m, const void* m_out, unsigned o) {
  return vec_aligned<sizeof(typename FloatStore<G>::U)>(g, o) &&
      vec_aligned<sizeof(typename FloatStore<M>::U)>(m, o) &&
      (m_out == nullptr || vec_aligned<sizeof(typename FloatStore<M>::U)>(m_out, o));
}

// Adds a Frag's zeros and NaNs to a lane's tallies.
LIONBIT_HD void tally_frag(const Frag& f, unsigned long long* zeros, unsigned long long* nans) {
  *zeros += static_cast<unsigned>(popc64(f.zero));
  *nans += f.nans;
}

// Word w (< kWordsPerWarpIter) of a vector group from the lanes' bytes (the
// host emulation; the device joins them with shuffles, join_bytes).
inline uint64_t join_bytes_host(const uint32_t (&bytes)[32], unsigned w) {
  uint64_t r = 0;
  for (unsigned q = 0; q < 8; ++q) {
    r |= static_cast<uint64_t>(bytes[8 * w + q]) << (8 * q);
  }
  return r;
}

// The same for both planes of the warp's Frags (join_fragments).
inline WordPair join_fragments_host(const Frag (&f)[32], unsigned w) {
  uint32_t s[32], z[32];
  for (unsigned l = 0; l < 32; ++l) {
    s[l] = f[l].sign;
    z[l] = f[l].zero;
  }
  return {join_bytes_host(s, w), join_bytes_host(z, w)};
}

// -------------------------------------------------------------- levels ----

// u = q + s of one value, exactly bits::level_value (signbits/levels.h):
// q = clamp(rint(c * factor), -s, s), the product in float64, rounding half
// to even; a NaN product gives q = 0; a non-finite c gives q = 0 (NaN) or
// +-s (+-Inf) whatever the factor, and sets *bad.
LIONBIT_HD unsigned level_of(float c, double factor, int s, unsigned* bad) {
  const uint32_t u = f32_bits(c);
  if ((u & 0x7f800000u) == 0x7f800000u) {
    *bad = 1u;
    if ((u & 0x007fffffu) != 0u) {
      return static_cast<unsigned>(s); // NaN
    }
    return (u >> 31) != 0u ? 0u : 2u * static_cast<unsigned>(s);
  }
#if defined(__CUDA_ARCH__)
  double x = rint(__dmul_rn(static_cast<double>(c), factor));
#else
  double x = std::nearbyint(static_cast<double>(c) * factor);
#endif
  if (!(x == x)) {
    x = 0.0;
  }
  if (x < -s) {
    x = -s;
  }
  if (x > s) {
    x = s;
  }
  return static_cast<unsigned>(static_cast<int>(x) + s);
}

// pack_levels: the lane's two values of word k. Low byte: u of bit lane;
// second byte: u of bit lane + 32; bits 16 and 17: those values were not
// finite. A bit that holds no element gives u = 0 (its plane bits are
// outside the launch's mask anyway).
LIONBIT_HD unsigned levels_lane(
    const float* c,
    size_t n,
    unsigned o,
    size_t k,
    unsigned lane,
    double factor,
    int s) {
  unsigned f = 0;
  for (unsigned h = 0; h < 2; ++h) {
    size_t e;
    if (element_of(k, lane + 32 * h, o, n, &e)) {
      unsigned bad = 0;
      f |= level_of(c[e], factor, s, &bad) << (8 * h);
      f |= bad << (16 + h);
    }
  }
  return f;
}

// The 8 x 8 bit matrix x (byte i = row i, bit j of it = column j)
// transposed: bit i of byte j of the result is bit j of byte i of x.
LIONBIT_HD uint64_t transpose8x8(uint64_t x) {
  uint64_t t = (x ^ (x >> 7)) & 0x00aa00aa00aa00aaull;
  x ^= t ^ (t << 7);
  t = (x ^ (x >> 14)) & 0x0000cccc0000ccccull;
  x ^= t ^ (t << 14);
  t = (x ^ (x >> 28)) & 0x00000000f0f0f0f0ull;
  x ^= t ^ (t << 28);
  return x;
}

// pack_levels' vector path (vector groups, above): lane `lane`'s 8 values of
// each of the B groups from word k0 (group b from word k0 + b *
// kWordsPerWarpIter; c + k0 * 64 - o on a 16-byte boundary), every group's
// loads issued before any is quantized. Byte b of bytes[g] holds bit b of
// each value's level u in group g (bit i: value i), the planes' bits; *bad
// counts the non-finite values.
template <int B>
LIONBIT_HD void levels_vec_batch(
    const float* c,
    unsigned o,
    size_t k0,
    unsigned lane,
    double factor,
    int s,
    unsigned* bad,
    uint64_t* bytes) {
  uint32_t w[B][8];
  LIONBIT_UNROLL
  for (int g = 0; g < B; ++g) {
    load8<4>(c + vec_elem(k0, g, o, lane), w[g]);
  }
  LIONBIT_UNROLL
  for (int g = 0; g < B; ++g) {
    uint64_t rows = 0; // byte i: value i's level (< 2^8: p <= 8)
    LIONBIT_UNROLL
    for (int i = 0; i < kVecLane; ++i) {
      unsigned b = 0;
      rows |= static_cast<uint64_t>(level_of(bits_f32(w[g][i]), factor, s, &b)) << (8 * i);
      *bad += b;
    }
    bytes[g] = transpose8x8(rows);
  }
}

// Vector groups a warp of pack_levels takes per iteration of its grid loop,
// their loads in flight at once (kVecBatch of float32's 32 bytes a lane).
constexpr int kLevelGroups = kVecBatch<kVecLane * sizeof(float)>;

// Plane b's word of one warp's level flags (the host emulation of the two
// ballots the kernel takes per plane).
inline uint64_t level_plane_host(const unsigned (&f)[32], int b) {
  uint64_t w = 0;
  for (unsigned l = 0; l < 32; ++l) {
    w |= static_cast<uint64_t>((f[l] >> b) & 1u) << l;
    w |= static_cast<uint64_t>((f[l] >> (8 + b)) & 1u) << (l + 32);
  }
  return w;
}

// ORs the launch's bits of v into word k (as bits::pack_levels: the range
// starts clear; bits outside [o, o + n) are left as they are).
LIONBIT_HD void or_word(uint64_t* words, size_t k, unsigned o, size_t n, uint64_t v) {
  words[k] |= v & word_mask(k, o, n);
}

// ------------------------------------------------------ sharded planes ----

// Where the words of word index W lie in ShardedPlanes storage: plane b of
// word W is at base[first + b * shard_words].
LIONBIT_HD size_t sharded_first(size_t word, int nplanes, size_t shard_words) {
  if (nplanes == 0 || shard_words == 0) {
    return 0; // nothing is read
  }
  const size_t r = word / shard_words;
  const size_t w = word - r * shard_words;
  return r * static_cast<size_t>(nplanes) * shard_words + w;
}

// Code of bit j of word W: bit b of the code is bit j of plane b.
LIONBIT_HD uint32_t
code_at(const uint64_t* base, int nplanes, size_t shard_words, size_t first, unsigned j) {
  uint32_t code = 0;
  for (int b = 0; b < nplanes; ++b) {
    const uint64_t word = base[first + static_cast<size_t>(b) * shard_words];
    code |= static_cast<uint32_t>((word >> j) & 1u) << b;
  }
  return code;
}

// Codes of bits `lane` (low 16 bits of the result) and `lane + 32` (high 16
// bits) of word W, whose planes start at base[first] (sharded_first): each
// plane word is read once.
// NP: the number of planes when fixed at compile time (the loop unrolls and
// the loads of several words can be issued together), -1: nplanes.
template <int NP = -1>
LIONBIT_HD uint32_t
code_pair_at(const uint64_t* base, int nplanes, size_t shard_words, size_t first, unsigned lane) {
  const int np = NP >= 0 ? NP : nplanes;
  uint32_t lo = 0, hi = 0;
  for (int b = 0; b < np; ++b) {
    const uint64_t word = base[first + static_cast<size_t>(b) * shard_words];
    lo |= static_cast<uint32_t>((word >> lane) & 1u) << b;
    hi |= static_cast<uint32_t>((word >> (lane + 32)) & 1u) << b;
  }
  return lo | (hi << 16);
}

// unpack: the lane's two elements of word k, dst[e] = lut[code_e]. S is the
// element's storage (1, 2, 4 or 8 bytes).
template <typename S>
LIONBIT_HD void unpack_lane(
    const uint64_t* base,
    int nplanes,
    size_t shard_words,
    size_t n,
    size_t k,
    unsigned lane,
    const S* lut,
    S* dst) {
  const size_t e0 = k * 64 + lane;
  if (e0 >= n) {
    return;
  }
  const uint32_t codes = code_pair_at(
      base, nplanes, shard_words, sharded_first(k, nplanes, shard_words), lane);
  dst[e0] = lut[codes & 0xffffu];
  if (e0 + 32 < n) {
    dst[e0 + 32] = lut[codes >> 16];
  }
}

// unpack: the group of words from k0. Whole groups read all plane words
// first, then write.
template <typename S, int NP>
LIONBIT_HD void unpack_group(
    const uint64_t* base,
    int nplanes,
    size_t shard_words,
    size_t n,
    size_t k0,
    unsigned lane,
    const S* lut,
    S* dst) {
  constexpr int U = kWordsPerWarpIter;
  if ((k0 + U) * 64 <= n) {
    uint32_t codes[U];
    LIONBIT_UNROLL
    for (int u = 0; u < U; ++u) {
      codes[u] = code_pair_at<NP>(
          base, nplanes, shard_words, sharded_first(k0 + u, nplanes, shard_words), lane);
    }
    S* p = dst + (k0 * 64 + lane);
    LIONBIT_UNROLL
    for (int u = 0; u < U; ++u) {
      p[64 * u] = lut[codes[u] & 0xffffu];
      p[64 * u + 32] = lut[codes[u] >> 16];
    }
    return;
  }
  LIONBIT_UNROLL
  for (int u = 0; u < U; ++u) {
    unpack_lane<S>(base, nplanes, shard_words, n, k0 + u, lane, lut, dst);
  }
}

// unpack's vector path: NP = 1 or 2 planes (a sign, a vote) and 2- or 4-byte
// values.
template <typename S, int NP>
constexpr bool kUnpackVec = (NP == 1 || NP == 2) && (sizeof(S) == 2 || sizeof(S) == 4);

// LUT entry `code` (< 2^NP) of the entries held in registers: selects, since
// a register array indexed at run time would live in local memory.
template <typename S, int NP>
LIONBIT_HD S lut_pick(const S (&lut)[1 << NP], unsigned code) {
  if constexpr (NP == 1) {
    return code != 0 ? lut[1] : lut[0];
  } else {
    const S lo = (code & 1u) != 0 ? lut[1] : lut[0];
    const S hi = (code & 1u) != 0 ? lut[3] : lut[2];
    return (code & 2u) != 0 ? hi : lo;
  }
}

// Vector groups a warp of unpack takes per iteration of its grid loop: each
// group's loads are 2 plane bytes a lane, its stores 16-32 bytes, so four
// groups' plane words are read before any value is written (the one-group
// kernel waited a load's latency for each 1 KB a warp wrote: 59 % of copy).
constexpr int kUnpackGroups = 4;

// unpack, vector path (vector groups, above), every group's plane words
// read first, the values from the LUT's entries in registers. Each store
// instruction of a warp writes 512 bytes end to end (whole 32-byte sectors):
//  2-byte values: lane `lane` writes the elements 8l .. 8l + 7 of each of the
//    B groups from word k0 (group b from word k0 + b * kWordsPerWarpIter;
//    all whole, dst + k0 * 64 on a 16-byte boundary) in one 16-byte store,
//    their codes from its byte of each plane word;
//  4-byte values: lane l writes elements 4l .. 4l + 3 and 128 + 4l .. 128 +
//    4l + 3 of each group, a 16-byte store each, their codes from a nibble of
//    each plane word. (Its 8 contiguous elements as two 16-byte stores 32
//    bytes apart halved every sector a store touched: unpack to float32 ran
//    at 45 % of the copy where bfloat16 ran at 77 %, gpu_check_h200_6.json.)
template <typename S, int NP, int B>
LIONBIT_HD void unpack_vec_batch(
    const uint64_t* base,
    size_t shard_words,
    size_t k0,
    unsigned lane,
    const S (&lut)[1 << NP],
    S* dst) {
  if constexpr (sizeof(S) == 4) {
    const unsigned sh = 4u * (lane % 16u);
    uint32_t nibbles[B][2][NP];
    LIONBIT_UNROLL
    for (int g = 0; g < B; ++g) {
      LIONBIT_UNROLL
      for (int h = 0; h < 2; ++h) {
        const size_t k = k0 + static_cast<size_t>(g) * kWordsPerWarpIter + 2 * h + lane / 16;
        const size_t first = sharded_first(k, NP, shard_words);
        LIONBIT_UNROLL
        for (int b = 0; b < NP; ++b) {
          const uint64_t word = base[first + static_cast<size_t>(b) * shard_words];
          nibbles[g][h][b] = static_cast<uint32_t>(word >> sh);
        }
      }
    }
    LIONBIT_UNROLL
    for (int g = 0; g < B; ++g) {
      LIONBIT_UNROLL
      for (int h = 0; h < 2; ++h) {
        uint32_t w[4];
        LIONBIT_UNROLL
        for (int i = 0; i < 4; ++i) {
          unsigned code = 0;
          LIONBIT_UNROLL
          for (int b = 0; b < NP; ++b) {
            code |= ((nibbles[g][h][b] >> i) & 1u) << b;
          }
          w[i] = lut_pick<S, NP>(lut, code);
        }
        store8<2>(dst + vec_elem(k0, g, 0, 0) + 128 * h + 4 * lane, w); // (16 bytes)
      }
    }
    return;
  }
  const unsigned sh = 8u * (lane % 8u);
  uint32_t bytes[B][NP];
  LIONBIT_UNROLL
  for (int g = 0; g < B; ++g) {
    const size_t k = k0 + static_cast<size_t>(g) * kWordsPerWarpIter + lane / 8;
    const size_t first = sharded_first(k, NP, shard_words);
    LIONBIT_UNROLL
    for (int b = 0; b < NP; ++b) {
      bytes[g][b] = static_cast<uint32_t>(base[first + static_cast<size_t>(b) * shard_words] >> sh);
    }
  }
  LIONBIT_UNROLL
  for (int g = 0; g < B; ++g) {
    uint32_t w[2 * sizeof(S)];
    LIONBIT_UNROLL
    for (int i = 0; i < kVecLane; ++i) {
      unsigned code = 0;
      LIONBIT_UNROLL
      for (int b = 0; b < NP; ++b) {
        code |= ((bytes[g][b] >> i) & 1u) << b;
      }
      const uint32_t v = lut_pick<S, NP>(lut, code);
      w[i / 2] = (i & 1) != 0 ? w[i / 2] | (v << 16) : v;
    }
    store8<sizeof(S)>(dst + vec_elem(k0, g, 0, lane), w);
  }
}

// lion_apply_dense works in units of kApplyUnit elements, a block's
// (kApplyThreads threads) per iteration of its grid loop. A whole unit of
// 16-byte aligned x and delta: thread t updates kApplyGroups groups of 8
// elements, group b at elements 8 (b * kApplyThreads + t) .. + 7 of the unit
// (apply_vec_first; a warp's 16-byte accesses of one group side by side),
// every group's loads issued before any math (as kVecBatch: a bfloat16 pair
// has 64 bytes in flight a thread); any other unit (a tensor's last, or
// unaligned buffers) elements t + u * kApplyThreads, a group's
// (kApplyDenseUnroll of them) at a time.
constexpr unsigned kApplyThreads = 256;
constexpr int kApplyGroups = 2;
constexpr int kApplyDenseUnroll = kVecLane; // the other units: elements a thread a group
constexpr size_t kApplyUnit = size_t{kApplyThreads} * kVecLane * kApplyGroups;

// The first element of thread t's group b of the apply unit from `first`.
LIONBIT_HD size_t apply_vec_first(size_t first, int b, unsigned t) {
  return first + (static_cast<size_t>(b) * kApplyThreads + t) * kVecLane;
}

// The elements i0 + u * step, u < kApplyDenseUnroll (loads first, then the
// math and the stores).
template <DType X, DType Dl>
LIONBIT_HD void lion_apply_dense_group(
    typename FloatStore<X>::U* x,
    const typename FloatStore<Dl>::U* delta,
    size_t n,
    size_t i0,
    size_t step,
    float lr,
    float decay) {
  constexpr int U = kApplyDenseUnroll;
  if (i0 + (U - 1) * step < n) {
    typename FloatStore<X>::U xv[U];
    typename FloatStore<Dl>::U dv[U];
    LIONBIT_UNROLL
    for (int u = 0; u < U; ++u) {
      xv[u] = x[i0 + u * step];
      dv[u] = delta[i0 + u * step];
    }
    LIONBIT_UNROLL
    for (int u = 0; u < U; ++u) {
      x[i0 + u * step] = FloatStore<X>::store(lion_apply_math(
          FloatStore<X>::load(xv[u]), decay, mul_rn(lr, FloatStore<Dl>::load(dv[u]))));
    }
    return;
  }
  for (int u = 0; u < U; ++u) {
    const size_t i = i0 + u * step;
    if (i < n) {
      x[i] = FloatStore<X>::store(lion_apply_math(
          FloatStore<X>::load(x[i]), decay, mul_rn(lr, FloatStore<Dl>::load(delta[i]))));
    }
  }
}

// The vector path's condition for lion_apply_dense's buffers.
LIONBIT_HD bool apply_vec_aligned(const void* x, const void* delta) {
  return (reinterpret_cast<uintptr_t>(x) % 16u) == 0u &&
      (reinterpret_cast<uintptr_t>(delta) % 16u) == 0u;
}

// Thread t's share of the unit from element `first` (vec: apply_vec_aligned).
template <DType X, DType Dl>
LIONBIT_HD void lion_apply_unit(
    typename FloatStore<X>::U* x,
    const typename FloatStore<Dl>::U* delta,
    size_t n,
    size_t first,
    unsigned t,
    bool vec,
    float lr,
    float decay) {
  if (vec && first + kApplyUnit <= n) {
    constexpr size_t SX = sizeof(typename FloatStore<X>::U);
    constexpr size_t SD = sizeof(typename FloatStore<Dl>::U);
    uint32_t xw[kApplyGroups][2 * SX], dw[kApplyGroups][2 * SD];
    LIONBIT_UNROLL
    for (int b = 0; b < kApplyGroups; ++b) {
      load8<SX>(x + apply_vec_first(first, b, t), xw[b]);
      load8<SD>(delta + apply_vec_first(first, b, t), dw[b]);
    }
    LIONBIT_UNROLL
    for (int b = 0; b < kApplyGroups; ++b) {
      uint32_t out[2 * SX];
      LIONBIT_UNROLL
      for (int i = 0; i < kVecLane; ++i) {
        put8<X>(
            out, i, lion_apply_math(value8<X>(xw[b], i), decay, mul_rn(lr, value8<Dl>(dw[b], i))));
      }
      store8<SX>(x + apply_vec_first(first, b, t), out);
    }
    return;
  }
  LIONBIT_UNROLL
  for (int b = 0; b < kApplyGroups; ++b) {
    lion_apply_dense_group<X, Dl>(
        x, delta, n, first + size_t{kApplyThreads} * kVecLane * b + t, kApplyThreads, lr, decay);
  }
}

// Delta from a vote's result planes (the sign all-reduce's out_planes): the
// code sign + 2 * zero of an element reads {-1, +1, 0, 0}, the float32 values
// the CPU's lion_apply_planes unpacks before its dense apply.
LIONBIT_HD float planes_delta(unsigned sign, unsigned zero) {
  return (zero & 1u) != 0u ? 0.0f : ((sign & 1u) != 0u ? 1.0f : -1.0f);
}

// Bits bit .. bit + 7 of a plane (the word after bit's only where they reach into it).
LIONBIT_HD uint32_t plane_byte(const uint64_t* plane, uint64_t bit) {
  const uint64_t* w = plane + bit / 64;
  const unsigned s = static_cast<unsigned>(bit % 64);
  uint64_t v = w[0] >> s;
  if (s > 56u) {
    v |= w[1] << (64u - s);
  }
  return static_cast<uint32_t>(v & 0xffu);
}

// lion_apply_unit with Delta from the planes: element i's code at bit
// bit0 + i. The vector path (vec: x on a 16-byte boundary) reads each of a
// thread's groups' 8 codes as a byte of each plane and its 8 values in
// 16-byte loads, every group's before any math; the planes are 1/8 of a
// bfloat16 Delta's bytes.
template <DType X>
LIONBIT_HD void lion_apply_planes_unit(
    typename FloatStore<X>::U* x,
    size_t n,
    size_t first,
    unsigned t,
    bool vec,
    const uint64_t* sign,
    const uint64_t* zero,
    uint64_t bit0,
    float lr,
    float decay) {
  if (vec && first + kApplyUnit <= n) {
    constexpr size_t SX = sizeof(typename FloatStore<X>::U);
    uint32_t s[kApplyGroups], z[kApplyGroups], xw[kApplyGroups][2 * SX];
    LIONBIT_UNROLL
    for (int b = 0; b < kApplyGroups; ++b) {
      const size_t e = apply_vec_first(first, b, t);
      s[b] = plane_byte(sign, bit0 + e);
      z[b] = plane_byte(zero, bit0 + e);
      load8<SX>(x + e, xw[b]);
    }
    LIONBIT_UNROLL
    for (int b = 0; b < kApplyGroups; ++b) {
      uint32_t out[2 * SX];
      LIONBIT_UNROLL
      for (int i = 0; i < kVecLane; ++i) {
        put8<X>(
            out, i,
            lion_apply_math(
                value8<X>(xw[b], i), decay, mul_rn(lr, planes_delta(s[b] >> i, z[b] >> i))));
      }
      store8<SX>(x + apply_vec_first(first, b, t), out);
    }
    return;
  }
  for (int u = 0; u < kApplyGroups * kVecLane; ++u) {
    const size_t i = first + t + static_cast<size_t>(u) * kApplyThreads;
    if (i < n) {
      const uint64_t b = bit0 + i;
      const float d = planes_delta(
          static_cast<unsigned>(sign[b / 64] >> (b % 64)),
          static_cast<unsigned>(zero[b / 64] >> (b % 64)));
      x[i] = FloatStore<X>::store(lion_apply_math(FloatStore<X>::load(x[i]), decay, mul_rn(lr, d)));
    }
  }
}

// ------------------------------------------------- bit-sliced counting ----
// One 64-bit word position, n contributions. P counter planes (a compile-time
// bound, P >= width_of(n), so the counters live in registers): c[b] holds bit b
// of the per-bit count. Contributions are taken two at a time: a full adder
// folds them into plane 0 and its carry ripples up from plane 1.

template <int P>
struct Counter {
  uint64_t c[P];

  LIONBIT_HD void clear() {
    LIONBIT_UNROLL
    for (int b = 0; b < P; ++b) {
      c[b] = 0;
    }
  }
  // Adds carry (weight 2^from) into planes [from, P).
  LIONBIT_HD void ripple(uint64_t carry, int from) {
    LIONBIT_UNROLL
    for (int b = 0; b < P; ++b) {
      if (b >= from) {
        const uint64_t t = c[b] & carry;
        c[b] ^= carry;
        carry = t;
      }
    }
  }
  LIONBIT_HD void add1(uint64_t x) { ripple(x, 0); }
  LIONBIT_HD void add2(uint64_t x, uint64_t y) {
    const uint64_t s = c[0] ^ x ^ y;
    const uint64_t carry = (c[0] & x) | (c[0] & y) | (x & y);
    c[0] = s;
    ripple(carry, 1);
  }
};

// Counts words[i * stride + w] for i < n into cnt.
template <int P>
LIONBIT_HD void count_planes(
    const uint64_t* words,
    size_t stride,
    int n,
    size_t w,
    Counter<P>& cnt) {
  cnt.clear();
  const uint64_t* p = words + w;
  int i = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll 4
#endif
  for (; i + 2 <= n; i += 2) {
    const uint64_t x = p[0];
    const uint64_t y = p[stride];
    p += 2 * stride;
    cnt.add2(x, y);
  }
  if (i < n) {
    cnt.add1(p[0]);
  }
}

// Code planes of one word, as bits::count_code: without zeros the count of
// positives (P planes); with zeros 2 * #pos + #zero (P + 1 planes). Q = P + 1
// planes are always filled (the top one 0 without zeros).
template <int P>
LIONBIT_HD void code_word(
    const uint64_t* sign,
    const uint64_t* zero,
    size_t stride,
    int n,
    size_t w,
    uint64_t (&code)[P + 1]) {
  Counter<P> pos;
  count_planes<P>(sign, stride, n, w, pos);
  if (zero == nullptr) {
    LIONBIT_UNROLL
    for (int b = 0; b < P; ++b) {
      code[b] = pos.c[b];
    }
    code[P] = 0;
    return;
  }
  Counter<P> zer;
  count_planes<P>(zero, stride, n, w, zer);
  // 2 * pos + zer: ripple-carry adder over the planes.
  code[0] = zer.c[0];
  uint64_t carry = 0;
  LIONBIT_UNROLL
  for (int b = 1; b <= P; ++b) {
    const uint64_t a = pos.c[b - 1];
    const uint64_t z = b < P ? zer.c[b] : 0;
    const uint64_t s = a ^ z;
    code[b] = s ^ carry;
    carry = (a & z) | (carry & s);
  }
}

// Vote of one word: sign bit where Sum > 0, zero bit where Sum == 0.
// Sum > 0  <=>  code > n (with zeros)  or  2 * code > n (without).
template <int P>
LIONBIT_HD void vote_word(
    const uint64_t* sign,
    const uint64_t* zero,
    size_t stride,
    int n,
    size_t w,
    uint64_t* out_sign,
    uint64_t* out_zero) {
  uint64_t code[P + 1];
  code_word<P>(sign, zero, stride, n, w, code);
  const bool shift = zero == nullptr;
  const uint32_t un = static_cast<uint32_t>(n);
  // Compare v = code << shift (< 2^(P+1)) with n from the top bit down.
  // (Both candidate planes are indexed with constants, a select picks one:
  // a run-time index would put code[] in local memory.)
  uint64_t gt = 0;
  uint64_t eq = ~0ull;
  LIONBIT_UNROLL
  for (int b = P; b >= 0; --b) {
    const uint64_t below = b >= 1 ? code[b >= 1 ? b - 1 : 0] : 0;
    const uint64_t vb = shift ? below : code[b];
    if (((un >> b) & 1u) != 0) {
      eq &= vb;
    } else {
      gt |= eq & vb;
      eq &= ~vb;
    }
  }
  // Bits of n above P are 0 since n < 2^P, so nothing is lost above.
  *out_sign = gt;
  *out_zero = eq;
}

// Counter planes the kernels are compiled for; pick_planes(n) is the smallest
// of them that holds n (n = 1 .. 1024).
constexpr int kCounterPlanes[] = {1, 2, 3, 4, 5, 6, 7, 8, 11};

LIONBIT_HD int pick_planes(int n) {
  const int w = width_of(static_cast<uint32_t>(n));
  return w <= 8 ? w : 11;
}

} // namespace lionbit::cuda::detail
