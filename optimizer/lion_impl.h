// The Lion kernels, written once and compiled once per instruction set.
//
// The including file defines LIONBIT_OPTIM_NS (the namespace of this copy) and
// LIONBIT_OPTIM_ISA (its bits::Isa enumerator) and is compiled with that ISA's
// flags (cmake/isa.cmake) plus -ffp-contract=off for the whole
// library. Everything here lives in an anonymous namespace inside the per-ISA
// namespace, so no inline function compiled with one ISA's flags can be
// picked by the linker for another.
//
// A vector type V (Sc: one float, the reference every vector path matches;
// Vec: the widest vector of this ISA) gives loads that widen each dtype to
// float32 exactly, stores that round to the dtype (nearest even), mul / add /
// sub as separate instructions (never a fused multiply-add: the header
// lion.h states the contract) and the comparisons that give the bits of c.
// The loops are written once over V; whole 64-element words go through Vec,
// the last partial word through Sc.
#include <cstring>

#include "optimizer/lion_kernels.h"
#include "signbits/float16.h"
#include "signbits/levels.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
// g++ 12 warns "'__Y' may be used uninitialized" inside its own AVX-512
// headers wherever an intrinsic built on _mm512_undefined_* is inlined (GCC
// PR 105593, fixed in 13). Silenced for this copy only; the scalar and AVX2
// copies of the same code keep the warning.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#if !defined(LIONBIT_OPTIM_NS) || !defined(LIONBIT_OPTIM_ISA)
#error "define LIONBIT_OPTIM_NS and LIONBIT_OPTIM_ISA before including lion_impl.h"
#endif

// Nothing here calls an fmadd intrinsic, and -ffp-contract=off (set for the
// whole library in optimizer/CMakeLists.txt) keeps the compiler from fusing a
// separate mul and add even where the ISA's flags enable FMA (AVX-512F does).

namespace lionbit::optim::detail::LIONBIT_OPTIM_NS {
namespace {

using bits::DType;
using bits::PackCounts;
constexpr size_t kWordBits = bits::kWordBits;

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

// --------------------------------------------------------- direction ----

struct WordBits {
  uint64_t sign = 0;
  uint64_t zero = 0;
  uint64_t nan = 0;
  uint64_t nonfinite = 0;
};

// cnt (<= 64, a multiple of V::kW) elements from i0: new momentum stored
// (if Update), the bits of c returned (bit j for element i0 + j).
template <class V, DType G, DType M, bool Update>
inline WordBits direction_run(const void* g, void* m, size_t i0, unsigned cnt, const LionCoefs& k) {
  const typename V::F b1 = V::set1(k.b1);
  const typename V::F omb1 = V::set1(k.omb1);
  const typename V::F b2 = V::set1(k.b2);
  const typename V::F omb2 = V::set1(k.omb2);
  WordBits r;
  for (unsigned j = 0; j < cnt; j += V::kW) {
    const typename V::F gv = V::template load<G>(g, i0 + j);
    const typename V::F mv = V::template load<M>(m, i0 + j);
    const typename V::F c = V::add(V::mul(b1, mv), V::mul(omb1, gv));
    if constexpr (Update) {
      const typename V::F mn = V::add(V::mul(b2, mv), V::mul(omb2, gv));
      V::template store<M>(m, i0 + j, mn);
    }
    r.sign |= V::gt0(c) << j;
    r.zero |= V::eq0(c) << j;
    r.nan |= V::nan(c) << j;
    r.nonfinite |= V::nan(V::sub(c, c)) << j; // c - c is NaN iff c is NaN or +-Inf
  }
  return r;
}

inline void count_word(const WordBits& b, PackCounts& c) {
  if (b.zero != 0) {
    c.zeros += static_cast<uint64_t>(__builtin_popcountll(b.zero));
  }
  if (b.nan != 0) {
    c.nans += static_cast<uint64_t>(__builtin_popcountll(b.nan));
  }
  if (b.nonfinite != 0) {
    c.nonfinite += static_cast<uint64_t>(__builtin_popcountll(b.nonfinite));
  }
}

template <DType G, DType M, bool Update>
PackCounts direction_typed(
    const void* g,
    void* m,
    size_t n,
    const LionCoefs& k,
    uint64_t* sign,
    uint64_t* zero) {
  PackCounts c;
  const size_t full = n / kWordBits;
  for (size_t w = 0; w < full; ++w) {
    const WordBits b = direction_run<Vec, G, M, Update>(g, m, w * kWordBits, kWordBits, k);
    sign[w] = b.sign;
    zero[w] = b.zero;
    count_word(b, c);
  }
  const unsigned rest = static_cast<unsigned>(n - full * kWordBits);
  if (rest != 0) {
    const WordBits b = direction_run<Sc, G, M, Update>(g, m, full * kWordBits, rest, k);
    sign[full] = b.sign;
    zero[full] = b.zero;
    count_word(b, c);
  }
  return c;
}

template <DType G>
PackCounts direction_grad(
    const void* g,
    DType md,
    void* m,
    size_t n,
    const LionCoefs& k,
    uint64_t* sign,
    uint64_t* zero,
    bool update) {
  switch (md) {
    case DType::kFloat32:
      return update ? direction_typed<G, DType::kFloat32, true>(g, m, n, k, sign, zero)
                    : direction_typed<G, DType::kFloat32, false>(g, m, n, k, sign, zero);
    case DType::kBFloat16:
      return update ? direction_typed<G, DType::kBFloat16, true>(g, m, n, k, sign, zero)
                    : direction_typed<G, DType::kBFloat16, false>(g, m, n, k, sign, zero);
    default:
      return {};
  }
}

PackCounts direction(
    DType gd,
    const void* g,
    DType md,
    void* m,
    size_t n,
    const LionCoefs& k,
    uint64_t* sign,
    uint64_t* zero,
    bool update) {
  switch (gd) {
    case DType::kFloat32:
      return direction_grad<DType::kFloat32>(g, md, m, n, k, sign, zero, update);
    case DType::kBFloat16:
      return direction_grad<DType::kBFloat16>(g, md, m, n, k, sign, zero, update);
    case DType::kFloat16:
      return direction_grad<DType::kFloat16>(g, md, m, n, k, sign, zero, update);
    default:
      return {};
  }
}

// ------------------------------------------------------------- apply ----

template <class V, DType X, DType D>
inline void apply_dense_one(
    void* x,
    const void* delta,
    size_t i,
    typename V::F lr,
    typename V::F decay) {
  const typename V::F xv = V::template load<X>(x, i);
  const typename V::F dv = V::template load<D>(delta, i);
  V::template store<X>(x, i, V::sub(V::mul(xv, decay), V::mul(lr, dv)));
}

template <DType X, DType D>
void apply_dense_typed(void* x, const void* delta, size_t n, float lr, float decay) {
  size_t i = 0;
  {
    const Vec::F lrv = Vec::set1(lr);
    const Vec::F dv = Vec::set1(decay);
    constexpr unsigned kW = Vec::kW;
    for (; i + 4 * kW <= n; i += 4 * kW) {
      apply_dense_one<Vec, X, D>(x, delta, i, lrv, dv);
      apply_dense_one<Vec, X, D>(x, delta, i + kW, lrv, dv);
      apply_dense_one<Vec, X, D>(x, delta, i + 2 * kW, lrv, dv);
      apply_dense_one<Vec, X, D>(x, delta, i + 3 * kW, lrv, dv);
    }
    for (; i + kW <= n; i += kW) {
      apply_dense_one<Vec, X, D>(x, delta, i, lrv, dv);
    }
  }
  for (; i < n; ++i) {
    apply_dense_one<Sc, X, D>(x, delta, i, lr, decay);
  }
}

template <DType X>
void apply_dense_param(void* x, DType dd, const void* delta, size_t n, float lr, float decay) {
  switch (dd) {
    case DType::kFloat32:
      return apply_dense_typed<X, DType::kFloat32>(x, delta, n, lr, decay);
    case DType::kBFloat16:
      return apply_dense_typed<X, DType::kBFloat16>(x, delta, n, lr, decay);
    case DType::kFloat16:
      return apply_dense_typed<X, DType::kFloat16>(x, delta, n, lr, decay);
    default:
      return;
  }
}

void apply_dense(DType xd, void* x, DType dd, const void* delta, size_t n, float lr, float decay) {
  switch (xd) {
    case DType::kFloat32:
      return apply_dense_param<DType::kFloat32>(x, dd, delta, n, lr, decay);
    case DType::kBFloat16:
      return apply_dense_param<DType::kBFloat16>(x, dd, delta, n, lr, decay);
    case DType::kFloat16:
      return apply_dense_param<DType::kFloat16>(x, dd, delta, n, lr, decay);
    default:
      return;
  }
}

// ------------------------------------------------------------ levels ----

#include "signbits/levels_word.h"
// (after levels_word.h: it quantizes with quantize_any)
#include "optimizer/lion_levels_impl.h"

} // namespace

const LionKernels& table() {
  static const LionKernels k{
      bits::Isa::LIONBIT_OPTIM_ISA, &direction, &apply_dense, &level_abs_sum, &pack_levels};
  return k;
}

} // namespace lionbit::optim::detail::LIONBIT_OPTIM_NS
