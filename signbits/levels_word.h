// Internal: the quantizer of Lion Cub's L1 levels (signbits/levels.h) for one
// 64-element word, written once and compiled into each instruction set's
// copy: signbits/levels_impl.h (bits::pack_levels, from c) and
// optimizer/lion_levels_impl.h (optim::lion_pack_levels, from g and m), both
// compiled with that ISA's flags; every copy computes the same bits as
// bits::level_value, element by element (tests/cpp compare them).
//
// The vector form needs a finite c and a finite factor: then c * factor (in
// float64) is finite or +-Inf, never NaN, and rounding, clamping and the
// conversion to an integer are exact. Words with a non-finite c, and calls
// with a non-finite factor, take level_value one element at a time.
//
// Everything here has internal linkage (an anonymous namespace): each
// translation unit that includes this file gets its own copy, compiled with
// that unit's flags, so no inline function compiled with one ISA's flags can
// be picked by the linker for another.
#pragma once

#include <cstddef>
#include <cstdint>

#include "signbits/levels.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace lionbit::bits::word {
namespace {

// A word of levels: the p plane words of 64 consecutive elements.
struct LevelWord {
  uint64_t plane[lionbit::bits::kMaxLevelBits];
};

// Levels of c[0..cnt) (cnt <= 64) one element at a time into bit j of
// out.plane[b]; counts the non-finite values in `bad`.
inline void quantize_scalar(
    const float* c,
    unsigned cnt,
    double factor,
    int p,
    LevelWord& out,
    uint64_t& bad) {
  const int s = lionbit::bits::level_span(p);
  for (int b = 0; b < p; ++b) {
    out.plane[b] = 0;
  }
  for (unsigned j = 0; j < cnt; ++j) {
    const unsigned u = lionbit::bits::level_value(c[j], factor, s, bad);
    for (int b = 0; b < p; ++b) {
      out.plane[b] |= static_cast<uint64_t>((u >> b) & 1u) << j;
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// GCC 12's headers trip -Wmaybe-uninitialized on the inlined conversions'
// unused pass-through operand (GCC bug 105593, fixed in 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// 16 levels q of c[0..16) as int32 (c and factor finite).
inline __m512i levels16(const float* c, __m512d f, __m512d lo, __m512d hi) {
  const __m512 v = _mm512_loadu_ps(c);
  const __m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  const __m512d d1 = _mm512_cvtps_pd(
      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512d r0 = _mm512_min_pd(
      _mm512_max_pd(_mm512_roundscale_pd(_mm512_mul_pd(d0, f), kRound), lo), hi);
  const __m512d r1 = _mm512_min_pd(
      _mm512_max_pd(_mm512_roundscale_pd(_mm512_mul_pd(d1, f), kRound), lo), hi);
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm512_cvtpd_epi32(r0)), _mm512_cvtpd_epi32(r1), 1);
}

// True when every c[0..64) is finite (the exponent field is not all ones).
inline bool all_finite64(const float* c) {
  const __m512i exp = _mm512_set1_epi32(0x7f800000);
  __mmask16 any = 0;
  for (int k = 0; k < 4; ++k) {
    const __m512i x = _mm512_loadu_si512(c + 16 * k);
    any |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(x, exp), exp);
  }
  return any == 0;
}

// The levels of 64 finite values: q as bytes, then plane b is the mask of
// the bytes whose bit b of q + s is set.
inline void quantize_word(const float* c, double factor, int p, LevelWord& out) {
  const int s = lionbit::bits::level_span(p);
  const __m512d f = _mm512_set1_pd(factor);
  const __m512d lo = _mm512_set1_pd(-s);
  const __m512d hi = _mm512_set1_pd(s);
  const __m128i q0 = _mm512_cvtepi32_epi8(levels16(c, f, lo, hi));
  const __m128i q1 = _mm512_cvtepi32_epi8(levels16(c + 16, f, lo, hi));
  const __m128i q2 = _mm512_cvtepi32_epi8(levels16(c + 32, f, lo, hi));
  const __m128i q3 = _mm512_cvtepi32_epi8(levels16(c + 48, f, lo, hi));
  __m512i u = _mm512_castsi128_si512(q0);
  u = _mm512_inserti32x4(u, q1, 1);
  u = _mm512_inserti32x4(u, q2, 2);
  u = _mm512_inserti32x4(u, q3, 3);
  u = _mm512_add_epi8(u, _mm512_set1_epi8(static_cast<char>(s)));
  for (int b = 0; b < p; ++b) {
    out.plane[b] = _cvtmask64_u64(
        _mm512_test_epi8_mask(u, _mm512_set1_epi8(static_cast<char>(1 << b))));
  }
}
#pragma GCC diagnostic pop
#elif defined(__AVX2__)
// 8 levels q of c[0..8) as int16 (c and factor finite).
inline __m128i levels8(const float* c, __m256d f, __m256d lo, __m256d hi) {
  const __m256 v = _mm256_loadu_ps(c);
  const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
  const __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256d r0 = _mm256_min_pd(
      _mm256_max_pd(_mm256_round_pd(_mm256_mul_pd(d0, f), kRound), lo), hi);
  const __m256d r1 = _mm256_min_pd(
      _mm256_max_pd(_mm256_round_pd(_mm256_mul_pd(d1, f), kRound), lo), hi);
  return _mm_packs_epi32(_mm256_cvtpd_epi32(r0), _mm256_cvtpd_epi32(r1));
}

inline bool all_finite64(const float* c) {
  const __m256i exp = _mm256_set1_epi32(0x7f800000);
  __m256i any = _mm256_setzero_si256();
  for (int k = 0; k < 8; ++k) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 8 * k));
    any = _mm256_or_si256(any, _mm256_cmpeq_epi32(_mm256_and_si256(x, exp), exp));
  }
  return _mm256_testz_si256(any, any) != 0;
}

// q as bytes (saturating packs keep the order within 128 bits; |q| <= 127),
// u = q + s, then plane b is the byte mask of bit b moved to each byte's top.
inline void quantize_word(const float* c, double factor, int p, LevelWord& out) {
  const int s = lionbit::bits::level_span(p);
  const __m256d f = _mm256_set1_pd(factor);
  const __m256d lo = _mm256_set1_pd(-s);
  const __m256d hi = _mm256_set1_pd(s);
  __m128i b[4];
  for (int k = 0; k < 4; ++k) {
    b[k] = _mm_packs_epi16(levels8(c + 16 * k, f, lo, hi), levels8(c + 16 * k + 8, f, lo, hi));
  }
  const __m256i add = _mm256_set1_epi8(static_cast<char>(s));
  const __m256i u0 = _mm256_add_epi8(_mm256_set_m128i(b[1], b[0]), add);
  const __m256i u1 = _mm256_add_epi8(_mm256_set_m128i(b[3], b[2]), add);
  for (int k = 0; k < p; ++k) {
    const __m128i shift = _mm_cvtsi32_si128(7 - k);
    const uint32_t m0 = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_sll_epi16(u0, shift)));
    const uint32_t m1 = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_sll_epi16(u1, shift)));
    out.plane[k] = m0 | static_cast<uint64_t>(m1) << 32;
  }
}
#endif

// The levels of 64 values c[0..64) into `out`, counting non-finite values in
// `bad`: the vector form where it applies, else quantize_scalar.
inline void quantize_any(
    const float* c,
    double factor,
    bool factor_finite,
    int p,
    LevelWord& out,
    uint64_t& bad) {
#if defined(__AVX2__) || defined(__AVX512F__)
  if (factor_finite && all_finite64(c)) {
    quantize_word(c, factor, p, out);
    return;
  }
#else
  (void)factor_finite; // the scalar copy has no vector form
#endif
  quantize_scalar(c, 64, factor, p, out, bad);
}

// ORs the p bits of one value u = q + s into bit `pos` of the planes.
inline void or_level(unsigned u, int p, uint64_t* planes, size_t plane_words, size_t pos) {
  for (int b = 0; b < p; ++b) {
    planes[static_cast<size_t>(b) * plane_words + pos / 64] |= static_cast<uint64_t>((u >> b) & 1u)
        << (pos % 64);
  }
}

// ORs the p plane words of `w` into word `word` of each plane.
inline void or_level_word(
    const LevelWord& w,
    int p,
    uint64_t* planes,
    size_t plane_words,
    size_t word) {
  for (int b = 0; b < p; ++b) {
    planes[static_cast<size_t>(b) * plane_words + word] |= w.plane[b];
  }
}

} // namespace
} // namespace lionbit::bits::word
