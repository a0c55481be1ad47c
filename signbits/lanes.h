// Internal: the lanes of the bit-sliced counters, compiled into each
// instruction set's copy of the kernels (the count and vote of
// signbits/kernels_impl.h, the level vote of signbits/levels_impl.h).
//
// Everything here has internal linkage (an anonymous namespace): each
// translation unit that includes this file gets its own copy, compiled with
// that unit's instruction-set flags, so the linker can never pick one ISA's
// copy of an inline function for another's caller.
#pragma once

#include <cstdint>
#include <cstring>

namespace lionbit::bits::lanes {
namespace {

constexpr int kLanes = 8; // words counted side by side (one zmm, two ymm)

// The counters hold L words side by side in one value: for L = kLanes a GCC
// vector of 8 words (one zmm, two ymm, or scalar code, as the ISA of this
// copy allows), for L = 1 a plain word. Written with explicit vectors: left to
// the auto-vectorizer, GCC 12 vectorized the lane loops for some plane counts
// and not others (a vote at N = 8..15 ran 5x slower per input than at N = 16).
typedef uint64_t Lanes8 __attribute__((vector_size(8 * kLanes)));
// (These helpers have internal linkage: how a non-AVX-512 copy passes a
// 64-byte vector between them is nobody else's business. GCC's note on it,
// -Wpsabi, is turned off for this library in signbits/CMakeLists.txt: a
// pragma here does not reach it.)
template <int L>
struct LaneType {
  using T = uint64_t;
};
template <>
struct LaneType<kLanes> {
  using T = Lanes8;
};

template <class T>
inline T load_lanes(const uint64_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class T>
inline void store_lanes(uint64_t* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

inline uint64_t or_lanes(uint64_t v) {
  return v;
}

inline uint64_t or_lanes(Lanes8 v) {
  uint64_t r = 0;
  for (int l = 0; l < kLanes; ++l) {
    r |= v[l];
  }
  return r;
}

} // namespace
} // namespace lionbit::bits::lanes
