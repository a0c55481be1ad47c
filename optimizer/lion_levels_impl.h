// Internal: the per-ISA part of optimizer/lion_levels.h, compiled into each
// instruction set's copy of the Lion kernels (optimizer/lion_impl.h puts them
// in its table).
//
//  level_abs_sum  one pass over g and m: c in float32 (Vec), |c| widened to
//                 float64 into sixteen lanes (lion_levels.h gives the order);
//  pack_levels    one pass over g and m: c of 64 elements at a time into a
//                 small buffer (and the new momentum stored, if asked), then
//                 the buffer's levels (quantize_any, signbits/levels_word.h)
//                 ORed into the planes. Elements before the first whole plane
//                 word and a short tail go one at a time.
//
// Like lion_impl.h, the including file defines LIONBIT_OPTIM_NS (the
// namespace of this copy) and is compiled with that ISA's flags; everything
// here has internal linkage.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "optimizer/lion_kernels.h"
#include "optimizer/lion_vec.h"
#include "signbits/levels.h"
#include "signbits/levels_word.h"
#include "signbits/types.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifndef LIONBIT_OPTIM_NS
#error "define LIONBIT_OPTIM_NS before including lion_levels_impl.h"
#endif

namespace lionbit::optim::detail::LIONBIT_OPTIM_NS {
namespace {

using bits::DType;
using bits::kWordBits;
using bits::word::LevelWord;
using bits::word::or_level;
using bits::word::or_level_word;
using bits::word::quantize_any;
using vec::load1;
using vec::Sc;
using vec::store1;
using vec::Vec;

constexpr size_t kSumLanes = 16;

template <DType G, DType M>
inline float direction1(const void* g, const void* m, size_t i, const LionCoefs& k) {
  return Sc::add(Sc::mul(k.b1, Sc::load<M>(m, i)), Sc::mul(k.omb1, Sc::load<G>(g, i)));
}

template <DType G, DType M>
double level_abs_sum_typed(const void* g, const void* m, size_t n, const LionCoefs& k) {
  double lane[kSumLanes] = {};
  size_t i = 0;
#if defined(__AVX512F__)
  {
    const __m512 b1 = _mm512_set1_ps(k.b1);
    const __m512 omb1 = _mm512_set1_ps(k.omb1);
    __m512d a0 = _mm512_setzero_pd();
    __m512d a1 = _mm512_setzero_pd();
    for (; i + kSumLanes <= n; i += kSumLanes) {
      const __m512 c = _mm512_abs_ps(
          Vec::add(Vec::mul(b1, Vec::load<M>(m, i)), Vec::mul(omb1, Vec::load<G>(g, i))));
      a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(c)));
      a1 = _mm512_add_pd(
          a1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(c), 1))));
    }
    _mm512_storeu_pd(lane, a0);
    _mm512_storeu_pd(lane + 8, a1);
  }
#elif defined(__AVX2__)
  {
    const __m256 b1 = _mm256_set1_ps(k.b1);
    const __m256 omb1 = _mm256_set1_ps(k.omb1);
    const __m256 mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256d a[4] = {
        _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    for (; i + kSumLanes <= n; i += kSumLanes) {
      for (int h = 0; h < 2; ++h) {
        const size_t e = i + 8 * static_cast<size_t>(h);
        const __m256 c = _mm256_and_ps(
            mag, Vec::add(Vec::mul(b1, Vec::load<M>(m, e)), Vec::mul(omb1, Vec::load<G>(g, e))));
        a[2 * h] = _mm256_add_pd(a[2 * h], _mm256_cvtps_pd(_mm256_castps256_ps128(c)));
        a[2 * h + 1] = _mm256_add_pd(a[2 * h + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(c, 1)));
      }
    }
    for (int h = 0; h < 4; ++h) {
      _mm256_storeu_pd(lane + 4 * h, a[h]);
    }
  }
#endif
  for (; i < n; ++i) {
    lane[i % kSumLanes] += static_cast<double>(std::fabs(direction1<G, M>(g, m, i, k)));
  }
  for (size_t w = kSumLanes / 2; w >= 1; w /= 2) {
    for (size_t j = 0; j < w; ++j) {
      lane[j] += lane[j + w];
    }
  }
  return lane[0];
}

// c of the 64 elements from i0 into cbuf; the new momentum stored if Update.
template <DType G, DType M, bool Update>
inline void direction_word(const void* g, void* m, size_t i0, const LionCoefs& k, float* cbuf) {
  const Vec::F b1 = Vec::set1(k.b1);
  const Vec::F omb1 = Vec::set1(k.omb1);
  const Vec::F b2 = Vec::set1(k.b2);
  const Vec::F omb2 = Vec::set1(k.omb2);
  for (unsigned j = 0; j < kWordBits; j += Vec::kW) {
    const Vec::F gv = Vec::load<G>(g, i0 + j);
    const Vec::F mv = Vec::load<M>(m, i0 + j);
    Vec::store<DType::kFloat32>(cbuf, j, Vec::add(Vec::mul(b1, mv), Vec::mul(omb1, gv)));
    if constexpr (Update) {
      Vec::store<M>(m, i0 + j, Vec::add(Vec::mul(b2, mv), Vec::mul(omb2, gv)));
    }
  }
}

template <DType G, DType M, bool Update>
uint64_t pack_levels_typed(
    const void* g,
    void* m,
    size_t n,
    const LionCoefs& k,
    double factor,
    const LevelPlanes& out) {
  const int p = out.p;
  const int s = bits::level_span(p);
  const bool factor_finite = std::isfinite(factor);
  uint64_t bad = 0;
  auto one = [&](size_t e) {
    const float gv = load1<G>(g, e);
    const float mv = load1<M>(m, e);
    const float c = Sc::add(Sc::mul(k.b1, mv), Sc::mul(k.omb1, gv));
    if constexpr (Update) {
      store1<M>(m, e, Sc::add(Sc::mul(k.b2, mv), Sc::mul(k.omb2, gv)));
    }
    or_level(
        bits::level_value(c, factor, s, bad), p, out.planes, out.plane_words, out.bit_offset + e);
  };
  size_t i = 0;
  for (; i < n && (out.bit_offset + i) % kWordBits != 0; ++i) {
    one(i);
  }
  alignas(64) float cbuf[kWordBits];
  LevelWord w;
  for (; i + kWordBits <= n; i += kWordBits) {
    direction_word<G, M, Update>(g, m, i, k, cbuf);
    quantize_any(cbuf, factor, factor_finite, p, w, bad);
    or_level_word(w, p, out.planes, out.plane_words, (out.bit_offset + i) / kWordBits);
  }
  for (; i < n; ++i) {
    one(i);
  }
  return bad;
}

template <DType G>
double level_abs_sum_grad(const void* g, DType md, const void* m, size_t n, const LionCoefs& k) {
  switch (md) {
    case DType::kFloat32:
      return level_abs_sum_typed<G, DType::kFloat32>(g, m, n, k);
    case DType::kBFloat16:
      return level_abs_sum_typed<G, DType::kBFloat16>(g, m, n, k);
    default:
      return 0.0;
  }
}

double level_abs_sum(
    DType gd,
    const void* g,
    DType md,
    const void* m,
    size_t n,
    const LionCoefs& k) {
  switch (gd) {
    case DType::kFloat32:
      return level_abs_sum_grad<DType::kFloat32>(g, md, m, n, k);
    case DType::kBFloat16:
      return level_abs_sum_grad<DType::kBFloat16>(g, md, m, n, k);
    case DType::kFloat16:
      return level_abs_sum_grad<DType::kFloat16>(g, md, m, n, k);
    default:
      return 0.0;
  }
}

template <DType G, DType M>
uint64_t pack_levels_update(
    const void* g,
    void* m,
    size_t n,
    const LionCoefs& k,
    bool update,
    double factor,
    const LevelPlanes& out) {
  return update ? pack_levels_typed<G, M, true>(g, m, n, k, factor, out)
                : pack_levels_typed<G, M, false>(g, m, n, k, factor, out);
}

template <DType G>
uint64_t pack_levels_grad(
    const void* g,
    DType md,
    void* m,
    size_t n,
    const LionCoefs& k,
    bool update,
    double factor,
    const LevelPlanes& out) {
  switch (md) {
    case DType::kFloat32:
      return pack_levels_update<G, DType::kFloat32>(g, m, n, k, update, factor, out);
    case DType::kBFloat16:
      return pack_levels_update<G, DType::kBFloat16>(g, m, n, k, update, factor, out);
    default:
      return 0;
  }
}

uint64_t pack_levels(
    DType gd,
    const void* g,
    DType md,
    void* m,
    size_t n,
    const LionCoefs& k,
    bool update,
    double factor,
    const LevelPlanes& out) {
  switch (gd) {
    case DType::kFloat32:
      return pack_levels_grad<DType::kFloat32>(g, md, m, n, k, update, factor, out);
    case DType::kBFloat16:
      return pack_levels_grad<DType::kBFloat16>(g, md, m, n, k, update, factor, out);
    case DType::kFloat16:
      return pack_levels_grad<DType::kFloat16>(g, md, m, n, k, update, factor, out);
    default:
      return 0;
  }
}

} // namespace
} // namespace lionbit::optim::detail::LIONBIT_OPTIM_NS
