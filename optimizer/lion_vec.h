// Internal: the vector types of the Lion kernels, compiled into each
// instruction set's copy (optimizer/lion_impl.h, optimizer/lion_levels_impl.h).
//
// A vector type V (Sc: one float, the reference every vector path matches;
// Vec: the widest vector of this ISA) gives loads that widen each dtype to
// float32 exactly, stores that round to the dtype (nearest even), mul / add /
// sub as separate instructions (never a fused multiply-add: the header
// lion.h states the contract) and the comparisons that give the bits of c.
//
// Everything here has internal linkage (an anonymous namespace): each
// translation unit that includes this file gets its own copy, compiled with
// that unit's flags, so no inline function compiled with one ISA's flags can
// be picked by the linker for another.
#pragma once

#include <cstddef>
#include <cstdint>

#include "signbits/float16.h"
#include "signbits/types.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
// g++ 12 warns "'__Y' may be used uninitialized" inside its own AVX-512
// headers wherever an intrinsic built on _mm512_undefined_* is inlined (GCC
// PR 105593, fixed in 13). Silenced for this copy only (for the rest of the
// translation unit: the kernels that inline these types); the scalar and AVX2
// copies of the same code keep the warning.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace lionbit::optim::vec {
namespace {

using bits::DType;

// ------------------------------------------------ scalar conversions ----

// Exact widening and round-to-nearest-even narrowing: signbits/float16.h.
using bits::bf16_to_f32;
using bits::bits_f32;
using bits::f16_to_f32;
using bits::f32_bits;
using bits::f32_to_bf16;
using bits::f32_to_f16;

template <DType D>
inline float load1(const void* p, size_t i) {
  if constexpr (D == DType::kFloat32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (D == DType::kBFloat16) {
    return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  } else {
    return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}

template <DType D>
inline void store1(void* p, size_t i, float v) {
  if constexpr (D == DType::kFloat32) {
    static_cast<float*>(p)[i] = v;
  } else if constexpr (D == DType::kBFloat16) {
    static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
  } else {
    static_cast<uint16_t*>(p)[i] = f32_to_f16(v);
  }
}

// ------------------------------------------------------- vector types ----

// One element at a time.
struct Sc {
  static constexpr unsigned kW = 1;
  using F = float;
  static F set1(float v) { return v; }
  static F mul(F a, F b) { return a * b; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  template <DType D>
  static F load(const void* p, size_t i) {
    return load1<D>(p, i);
  }
  template <DType D>
  static void store(void* p, size_t i, F v) {
    store1<D>(p, i, v);
  }
  static uint64_t gt0(F c) { return c > 0.0f ? 1u : 0u; }
  static uint64_t eq0(F c) { return c == 0.0f ? 1u : 0u; }
  static uint64_t nan(F c) { return c != c ? 1u : 0u; }
};

#if defined(__AVX512F__)
// 16 floats in a zmm; comparisons straight into mask registers.
struct Vec {
  static constexpr unsigned kW = 16;
  using F = __m512;
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  template <DType D>
  static F load(const void* p, size_t i) {
    if constexpr (D == DType::kFloat32) {
      return _mm512_loadu_ps(static_cast<const float*>(p) + i);
    } else {
      const __m256i h = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
      if constexpr (D == DType::kBFloat16) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      } else {
        return _mm512_cvtph_ps(h);
      }
    }
  }
  template <DType D>
  static void store(void* p, size_t i, F v) {
    if constexpr (D == DType::kFloat32) {
      _mm512_storeu_ps(static_cast<float*>(p) + i, v);
    } else {
      __m256i h;
      if constexpr (D == DType::kBFloat16) {
        const __m512i u = _mm512_castps_si512(v);
        const __m512i hi = _mm512_srli_epi32(u, 16);
        const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
        const __mmask16 isnan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        r = _mm512_mask_or_epi32(r, isnan, hi, _mm512_set1_epi32(0x40));
        h = _mm512_cvtepi32_epi16(r);
      } else {
        h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i), h);
    }
  }
  static uint64_t gt0(F c) { return _mm512_cmp_ps_mask(c, _mm512_setzero_ps(), _CMP_GT_OQ); }
  static uint64_t eq0(F c) { return _mm512_cmp_ps_mask(c, _mm512_setzero_ps(), _CMP_EQ_OQ); }
  static uint64_t nan(F c) { return _mm512_cmp_ps_mask(c, c, _CMP_UNORD_Q); }
};
#elif defined(__AVX2__)
// 8 floats in a ymm; comparisons, then movemask.
struct Vec {
  static constexpr unsigned kW = 8;
  using F = __m256;
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  template <DType D>
  static F load(const void* p, size_t i) {
    if constexpr (D == DType::kFloat32) {
      return _mm256_loadu_ps(static_cast<const float*>(p) + i);
    } else {
      const __m128i h = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
      if constexpr (D == DType::kBFloat16) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      } else {
        return _mm256_cvtph_ps(h);
      }
    }
  }
  template <DType D>
  static void store(void* p, size_t i, F v) {
    if constexpr (D == DType::kFloat32) {
      _mm256_storeu_ps(static_cast<float*>(p) + i, v);
    } else {
      __m128i h;
      if constexpr (D == DType::kBFloat16) {
        const __m256i u = _mm256_castps_si256(v);
        const __m256i hi = _mm256_srli_epi32(u, 16);
        const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
        const __m256i isnan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), isnan);
        // 8 x u32 (each <= 0xffff) -> 8 x u16 in element order.
        const __m256i packed = _mm256_packus_epi32(r, r);
        h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
      } else {
        h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), h);
    }
  }
  static uint64_t gt0(F c) {
    return static_cast<uint32_t>(
        _mm256_movemask_ps(_mm256_cmp_ps(c, _mm256_setzero_ps(), _CMP_GT_OQ)));
  }
  static uint64_t eq0(F c) {
    return static_cast<uint32_t>(
        _mm256_movemask_ps(_mm256_cmp_ps(c, _mm256_setzero_ps(), _CMP_EQ_OQ)));
  }
  static uint64_t nan(F c) {
    return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(c, c, _CMP_UNORD_Q)));
  }
};
#else
using Vec = Sc;
#endif

} // namespace
} // namespace lionbit::optim::vec
