// Internal: Lion Cub's L1 levels (signbits/levels.h), the per-ISA part of
// the bit kernels (signbits/kernels_impl.h puts them in its table).
//
//  pack_levels   c -> p bit-planes: elements up to a word boundary and a
//                short tail one at a time (level_value), whole words through
//                quantize_any (the ISA's vector quantizer, levels_word.h);
//  vote_levels   the owner's exact sum of N ranks' values: bit-sliced
//                ripple-carry counters, 8 words side by side (one zmm, two
//                ymm or eight scalar words: lanes.h), then the comparison of
//                the sum of u = q + s with N * s, most significant plane first.
//
// Like kernels_impl.h, the including file defines LIONBIT_KERNELS_NS (the
// namespace of this copy) and is compiled with that ISA's flags; everything
// here has internal linkage.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "signbits/lanes.h"
#include "signbits/levels.h"
#include "signbits/levels_word.h"
#include "signbits/types.h"

#ifndef LIONBIT_KERNELS_NS
#error "define LIONBIT_KERNELS_NS before including levels_impl.h"
#endif

namespace lionbit::bits::detail::LIONBIT_KERNELS_NS {
namespace {

using lanes::kLanes;
using lanes::LaneType;
using lanes::load_lanes;
using lanes::store_lanes;
using word::LevelWord;
using word::or_level;
using word::or_level_word;
using word::quantize_any;

uint64_t pack_levels(
    const float* c,
    size_t n,
    double factor,
    int p,
    uint64_t* planes,
    size_t plane_words,
    size_t bit_offset) {
  const int s = level_span(p);
  const bool factor_finite = std::isfinite(factor);
  uint64_t bad = 0;
  auto one = [&](size_t k) {
    or_level(level_value(c[k], factor, s, bad), p, planes, plane_words, bit_offset + k);
  };
  size_t i = 0;
  for (; i < n && (bit_offset + i) % kWordBits != 0; ++i) {
    one(i);
  }
  LevelWord w;
  for (; i + kWordBits <= n; i += kWordBits) {
    quantize_any(c + i, factor, factor_finite, p, w, bad);
    or_level_word(w, p, planes, plane_words, (bit_offset + i) / kWordBits);
  }
  for (; i < n; ++i) {
    one(i);
  }
  return bad;
}

// The widest counter kept in registers with its plane count known at
// compile time: N * 2s < 2^12 (N <= 16 at p = 8, N <= 292 at p = 4).
constexpr int kMaxFixedLevelWidth = 12;
// bit_width(kMaxLevelRanks * 254).
constexpr int kMaxLevelWidth = 28;

// The vote of L words from w0 (see vote_levels). P: the value bits; W: the
// counter's planes (bit_width(n * 2s)), or 0 for "known at run time".
template <int L, int P, int W>
inline void vote_levels_block(
    const uint64_t* const* in,
    int n,
    size_t words,
    size_t w0,
    int width,
    uint64_t* out_sign,
    uint64_t* out_tie) {
  using T = typename LaneType<L>::T;
  constexpr int kCap = W > 0 ? W : kMaxLevelWidth;
  const int planes = W > 0 ? W : width;
  const uint64_t two_s = 2 * static_cast<uint64_t>(level_span(P));
  T acc[kCap];
  for (int b = 0; b < planes; ++b) {
    acc[b] = T{};
  }
  for (int i = 0; i < n; ++i) {
    const uint64_t* x = in[i] + w0;
    T carry{};
    for (int b = 0; b < P; ++b) { // a full adder per value bit
      const T v = load_lanes<T>(x + static_cast<size_t>(b) * words);
      const T t = acc[b] ^ v;
      const T next = (acc[b] & v) | (carry & t);
      acc[b] = t ^ carry;
      carry = next;
    }
    // The sum of i + 1 values fits bit_width((i + 1) * 2s) planes: the carry
    // stops there.
    const int top = std::min(planes, bit_width(static_cast<uint64_t>(i + 1) * two_s));
    for (int b = P; b < kCap; ++b) {
      if (b >= top) {
        break;
      }
      const T next = acc[b] & carry;
      acc[b] ^= carry;
      carry = next;
    }
  }
  // sum(q) > 0 <=> sum(u) > n * s; == likewise.
  const uint64_t threshold = static_cast<uint64_t>(n) * (two_s / 2);
  T gt{};
  T eq = ~T{};
  for (int b = planes - 1; b >= 0; --b) {
    if (((threshold >> b) & 1u) != 0) {
      eq &= acc[b];
    } else {
      gt |= eq & acc[b];
      eq &= ~acc[b];
    }
  }
  store_lanes(out_sign + w0, gt);
  store_lanes(out_tie + w0, eq);
}

// Whole blocks of kLanes words with W planes; the tail (under kLanes words)
// one word at a time with the width known at run time (W = 0): one copy of
// the tail per P, not one per (P, W).
template <int P, int W>
void vote_levels_fixed(
    const uint64_t* const* in,
    int n,
    size_t words,
    int width,
    uint64_t* out_sign,
    uint64_t* out_tie) {
  size_t w = 0;
  for (; w + kLanes <= words; w += kLanes) {
    vote_levels_block<kLanes, P, W>(in, n, words, w, width, out_sign, out_tie);
  }
  for (; w < words; ++w) {
    vote_levels_block<1, P, 0>(in, n, words, w, width, out_sign, out_tie);
  }
}

// The counter's planes as a compile-time constant W >= width: the exact width
// for N <= 4 ranks (width <= P + 2), else the next of P + 4 (N <= 16) and
// kMaxFixedLevelWidth, else known at run time. More planes than the width
// stay zero (the carry stops at the width) and compare as the threshold's
// zero bits, so any W >= width gives the same vote; rounding up costs a few
// comparisons a block and saves compiling a copy for every width (each copy
// is 8-10 KB of code on AVX2).
template <int P>
void vote_levels_width(
    const uint64_t* const* in,
    int n,
    size_t words,
    int width,
    uint64_t* out_sign,
    uint64_t* out_tie) {
  static_assert(P + 2 <= kMaxFixedLevelWidth);
  if (width == P) {
    return vote_levels_fixed<P, P>(in, n, words, width, out_sign, out_tie);
  }
  if (width == P + 1) {
    return vote_levels_fixed<P, P + 1>(in, n, words, width, out_sign, out_tie);
  }
  if (width == P + 2) {
    return vote_levels_fixed<P, P + 2>(in, n, words, width, out_sign, out_tie);
  }
  if constexpr (P + 4 < kMaxFixedLevelWidth) {
    if (width <= P + 4) {
      return vote_levels_fixed<P, P + 4>(in, n, words, width, out_sign, out_tie);
    }
  }
  if (width <= kMaxFixedLevelWidth) {
    return vote_levels_fixed<P, kMaxFixedLevelWidth>(in, n, words, width, out_sign, out_tie);
  }
  return vote_levels_fixed<P, 0>(in, n, words, width, out_sign, out_tie);
}

template <int P = kMinLevelBits>
void vote_levels_bits(
    const uint64_t* const* in,
    int n,
    int p,
    size_t words,
    int width,
    uint64_t* out_sign,
    uint64_t* out_tie) {
  if constexpr (P <= kMaxLevelBits) {
    if (p == P) {
      return vote_levels_width<P>(in, n, words, width, out_sign, out_tie);
    }
    return vote_levels_bits<P + 1>(in, n, p, words, width, out_sign, out_tie);
  }
}

void vote_levels(
    const uint64_t* const* in,
    int n,
    int p,
    size_t words,
    uint64_t* out_sign,
    uint64_t* out_tie) {
  const int width = bit_width(static_cast<uint64_t>(n) * 2 * static_cast<uint64_t>(level_span(p)));
  vote_levels_bits(in, n, p, words, width, out_sign, out_tie);
}

} // namespace
} // namespace lionbit::bits::detail::LIONBIT_KERNELS_NS
