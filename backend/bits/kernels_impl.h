// The bit kernels, written once and compiled once per instruction set.
//
// The including file defines LIONBIT_KERNELS_NS (the namespace of this copy)
// and is compiled with that ISA's flags (-mavx2 ... / -mavx512bw ...). Explicit
// intrinsics are used where the compiler cannot find the vector form by
// itself (pack: compare + movemask; unpack: mask blends); the bit-sliced
// counters are written as fixed-width lane loops that the compiler vectorizes
// for whatever ISA this copy is built for. Every copy computes exactly the
// same function; tests/cpp compare them bit for bit.
#include <algorithm>
#include <cstring>

#include "kernels.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifndef LIONBIT_KERNELS_NS
#error "define LIONBIT_KERNELS_NS before including kernels_impl.h"
#endif

namespace lionbit::bits::detail::LIONBIT_KERNELS_NS {
namespace {

// ---------------------------------------------------------------- pack ----

// Bit-pattern view of each dtype: magnitude mask and the pattern of +Inf (a
// magnitude above it is NaN).
template <DType D>
struct Traits;
template <>
struct Traits<DType::kFloat32> {
  using U = uint32_t;
  static constexpr U kMag = 0x7fffffffu;
  static constexpr U kInf = 0x7f800000u;
  static constexpr bool kFloat = true;
};
template <>
struct Traits<DType::kFloat64> {
  using U = uint64_t;
  static constexpr U kMag = 0x7fffffffffffffffull;
  static constexpr U kInf = 0x7ff0000000000000ull;
  static constexpr bool kFloat = true;
};
template <>
struct Traits<DType::kFloat16> {
  using U = uint16_t;
  static constexpr U kMag = 0x7fff;
  static constexpr U kInf = 0x7c00;
  static constexpr bool kFloat = true;
};
template <>
struct Traits<DType::kBFloat16> {
  using U = uint16_t;
  static constexpr U kMag = 0x7fff;
  static constexpr U kInf = 0x7f80;
  static constexpr bool kFloat = true;
};
template <>
struct Traits<DType::kInt8> {
  using U = uint8_t;
  static constexpr bool kFloat = false;
};

struct WordBits {
  uint64_t sign = 0;
  uint64_t zero = 0;
  uint64_t nan = 0;
};

// Up to 64 elements, one at a time: the reference every vector path matches.
template <DType D>
inline WordBits pack_word_scalar(const typename Traits<D>::U* p, size_t cnt) {
  using T = Traits<D>;
  WordBits r;
  for (size_t j = 0; j < cnt; ++j) {
    bool pos, zero, nan;
    if constexpr (T::kFloat) {
      const auto u = p[j];
      const auto mag = static_cast<typename T::U>(u & T::kMag);
      zero = mag == 0;
      nan = mag > T::kInf;
      pos = !zero && !nan && u == mag; // sign bit clear
    } else {
      const auto v = static_cast<int8_t>(p[j]);
      zero = v == 0;
      nan = false;
      pos = v > 0;
    }
    r.sign |= static_cast<uint64_t>(pos) << j;
    r.zero |= static_cast<uint64_t>(zero) << j;
    r.nan |= static_cast<uint64_t>(nan) << j;
  }
  return r;
}

#if defined(__AVX512BW__)
// 64 elements from p, AVX-512: integer compares straight into mask registers.
template <DType D>
inline WordBits pack_word_vec(const typename Traits<D>::U* p) {
  WordBits r;
  if constexpr (D == DType::kFloat32) {
    const __m512i mag_mask = _mm512_set1_epi32(0x7fffffff);
    const __m512i inf = _mm512_set1_epi32(0x7f800000);
    const __m512i zero = _mm512_setzero_si512();
    for (int k = 0; k < 4; ++k) {
      const __m512i x = _mm512_loadu_si512(p + 16 * k);
      const __m512i mag = _mm512_and_si512(x, mag_mask);
      const uint64_t z = _mm512_cmpeq_epi32_mask(mag, zero);
      const uint64_t n = _mm512_cmpgt_epi32_mask(mag, inf);
      const uint64_t neg = _mm512_cmplt_epi32_mask(x, zero);
      r.zero |= z << (16 * k);
      r.nan |= n << (16 * k);
      r.sign |= (~(z | n | neg) & 0xffffull) << (16 * k);
    }
  } else if constexpr (D == DType::kFloat64) {
    const __m512i mag_mask = _mm512_set1_epi64(0x7fffffffffffffffll);
    const __m512i inf = _mm512_set1_epi64(0x7ff0000000000000ll);
    const __m512i zero = _mm512_setzero_si512();
    for (int k = 0; k < 8; ++k) {
      const __m512i x = _mm512_loadu_si512(p + 8 * k);
      const __m512i mag = _mm512_and_si512(x, mag_mask);
      const uint64_t z = _mm512_cmpeq_epi64_mask(mag, zero);
      const uint64_t n = _mm512_cmpgt_epi64_mask(mag, inf);
      const uint64_t neg = _mm512_cmplt_epi64_mask(x, zero);
      r.zero |= z << (8 * k);
      r.nan |= n << (8 * k);
      r.sign |= (~(z | n | neg) & 0xffull) << (8 * k);
    }
  } else if constexpr (D == DType::kFloat16 || D == DType::kBFloat16) {
    const __m512i mag_mask = _mm512_set1_epi16(0x7fff);
    const __m512i inf = _mm512_set1_epi16(static_cast<short>(Traits<D>::kInf));
    const __m512i zero = _mm512_setzero_si512();
    for (int k = 0; k < 2; ++k) {
      const __m512i x = _mm512_loadu_si512(p + 32 * k);
      const __m512i mag = _mm512_and_si512(x, mag_mask);
      const uint64_t z = _mm512_cmpeq_epi16_mask(mag, zero);
      const uint64_t n = _mm512_cmpgt_epi16_mask(mag, inf);
      const uint64_t neg = _mm512_cmplt_epi16_mask(x, zero);
      r.zero |= z << (32 * k);
      r.nan |= n << (32 * k);
      r.sign |= (~(z | n | neg) & 0xffffffffull) << (32 * k);
    }
  } else {
    const __m512i x = _mm512_loadu_si512(p);
    const __m512i zero = _mm512_setzero_si512();
    r.zero = _mm512_cmpeq_epi8_mask(x, zero);
    r.sign = _mm512_cmpgt_epi8_mask(x, zero);
  }
  return r;
}
#define LIONBIT_HAVE_PACK_VEC 1
#elif defined(__AVX2__)
// 64 elements from p, AVX2: integer compares, then movemask per lane width.
inline uint32_t mask16x32(__m256i a, __m256i b) {
  // a, b: 16 lanes of 0 / 0xffff each -> 32 bits in element order.
  const __m256i packed = _mm256_packs_epi16(a, b); // lanes interleaved
  return static_cast<uint32_t>(
      _mm256_movemask_epi8(_mm256_permute4x64_epi64(packed, 0xD8)));
}

template <DType D>
inline WordBits pack_word_vec(const typename Traits<D>::U* p) {
  WordBits r;
  if constexpr (D == DType::kFloat32) {
    const __m256i mag_mask = _mm256_set1_epi32(0x7fffffff);
    const __m256i inf = _mm256_set1_epi32(0x7f800000);
    const __m256i zero = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {
      const __m256i x =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8 * k));
      const __m256i mag = _mm256_and_si256(x, mag_mask);
      const uint64_t z = static_cast<uint32_t>(
          _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, zero))));
      const uint64_t n = static_cast<uint32_t>(
          _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(mag, inf))));
      const uint64_t neg =
          static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(x)));
      r.zero |= z << (8 * k);
      r.nan |= n << (8 * k);
      r.sign |= (~(z | n | neg) & 0xffull) << (8 * k);
    }
  } else if constexpr (D == DType::kFloat64) {
    const __m256i mag_mask = _mm256_set1_epi64x(0x7fffffffffffffffll);
    const __m256i inf = _mm256_set1_epi64x(0x7ff0000000000000ll);
    const __m256i zero = _mm256_setzero_si256();
    for (int k = 0; k < 16; ++k) {
      const __m256i x =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 4 * k));
      const __m256i mag = _mm256_and_si256(x, mag_mask);
      const uint64_t z = static_cast<uint32_t>(
          _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(mag, zero))));
      const uint64_t n = static_cast<uint32_t>(
          _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(mag, inf))));
      const uint64_t neg =
          static_cast<uint32_t>(_mm256_movemask_pd(_mm256_castsi256_pd(x)));
      r.zero |= z << (4 * k);
      r.nan |= n << (4 * k);
      r.sign |= (~(z | n | neg) & 0xfull) << (4 * k);
    }
  } else if constexpr (D == DType::kFloat16 || D == DType::kBFloat16) {
    const __m256i mag_mask = _mm256_set1_epi16(0x7fff);
    const __m256i inf = _mm256_set1_epi16(static_cast<short>(Traits<D>::kInf));
    const __m256i zero = _mm256_setzero_si256();
    for (int k = 0; k < 2; ++k) {
      const __m256i x0 =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * k));
      const __m256i x1 =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * k + 16));
      const __m256i m0 = _mm256_and_si256(x0, mag_mask);
      const __m256i m1 = _mm256_and_si256(x1, mag_mask);
      const uint64_t z = mask16x32(
          _mm256_cmpeq_epi16(m0, zero), _mm256_cmpeq_epi16(m1, zero));
      const uint64_t n =
          mask16x32(_mm256_cmpgt_epi16(m0, inf), _mm256_cmpgt_epi16(m1, inf));
      const uint64_t neg =
          mask16x32(_mm256_srai_epi16(x0, 15), _mm256_srai_epi16(x1, 15));
      r.zero |= z << (32 * k);
      r.nan |= n << (32 * k);
      r.sign |= (~(z | n | neg) & 0xffffffffull) << (32 * k);
    }
  } else {
    const __m256i zero = _mm256_setzero_si256();
    for (int k = 0; k < 2; ++k) {
      const __m256i x =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * k));
      const uint64_t z = static_cast<uint32_t>(
          _mm256_movemask_epi8(_mm256_cmpeq_epi8(x, zero)));
      const uint64_t pos = static_cast<uint32_t>(
          _mm256_movemask_epi8(_mm256_cmpgt_epi8(x, zero)));
      r.zero |= z << (32 * k);
      r.sign |= pos << (32 * k);
    }
  }
  return r;
}
#define LIONBIT_HAVE_PACK_VEC 1
#endif

template <DType D>
PackCounts pack_typed(const void* src, size_t n, uint64_t* sign, uint64_t* zero) {
  using U = typename Traits<D>::U;
  const U* p = static_cast<const U*>(src);
  PackCounts c;
  const size_t full = n / kWordBits;
  for (size_t w = 0; w < full; ++w) {
#ifdef LIONBIT_HAVE_PACK_VEC
    const WordBits b = pack_word_vec<D>(p + w * kWordBits);
#else
    const WordBits b = pack_word_scalar<D>(p + w * kWordBits, kWordBits);
#endif
    sign[w] = b.sign;
    zero[w] = b.zero;
    c.zeros += static_cast<uint64_t>(__builtin_popcountll(b.zero));
    c.nans += static_cast<uint64_t>(__builtin_popcountll(b.nan));
  }
  const size_t rest = n - full * kWordBits;
  if (rest != 0) {
    const WordBits b = pack_word_scalar<D>(p + full * kWordBits, rest);
    sign[full] = b.sign;
    zero[full] = b.zero;
    c.zeros += static_cast<uint64_t>(__builtin_popcountll(b.zero));
    c.nans += static_cast<uint64_t>(__builtin_popcountll(b.nan));
  }
  return c;
}

PackCounts pack(
    DType dtype,
    const void* src,
    size_t n,
    uint64_t* sign,
    uint64_t* zero) {
  switch (dtype) {
    case DType::kFloat32:
      return pack_typed<DType::kFloat32>(src, n, sign, zero);
    case DType::kFloat64:
      return pack_typed<DType::kFloat64>(src, n, sign, zero);
    case DType::kFloat16:
      return pack_typed<DType::kFloat16>(src, n, sign, zero);
    case DType::kBFloat16:
      return pack_typed<DType::kBFloat16>(src, n, sign, zero);
    case DType::kInt8:
      return pack_typed<DType::kInt8>(src, n, sign, zero);
  }
  return {};
}

// --------------------------------------------------------------- count ----

constexpr int kLanes = 8; // words counted side by side (one zmm, two ymm)
constexpr int kMaxPlanes = 33; // bit_width(2n) for n < 2^31

// Adds the bit-vectors x[0..L) into the bit-sliced counters c[0..planes).
template <int L>
inline void ripple_add(uint64_t (*c)[kLanes], int planes, const uint64_t* x) {
  uint64_t carry[L];
  for (int l = 0; l < L; ++l) {
    carry[l] = x[l];
  }
  for (int b = 0; b < planes; ++b) {
    for (int l = 0; l < L; ++l) {
      const uint64_t t = c[b][l] & carry[l];
      c[b][l] ^= carry[l];
      carry[l] = t;
    }
  }
}

// The code planes of L words starting at word w0 (see count.h).
template <int L>
inline void count_block(
    const Contribution* in,
    int n,
    size_t w0,
    bool with_zeros,
    uint64_t (*code)[kLanes]) {
  const int pos_planes = bit_width(static_cast<uint64_t>(n));
  uint64_t pos[kMaxPlanes][kLanes] = {};
  uint64_t zer[kMaxPlanes][kLanes] = {};
  for (int i = 0; i < n; ++i) {
    ripple_add<L>(pos, pos_planes, in[i].sign + w0);
    if (in[i].zero != nullptr) {
      ripple_add<L>(zer, pos_planes, in[i].zero + w0);
    }
  }
  if (!with_zeros) {
    for (int b = 0; b < pos_planes; ++b) {
      for (int l = 0; l < L; ++l) {
        code[b][l] = pos[b][l];
      }
    }
    return;
  }
  // code = 2 * pos + zer, a ripple-carry adder over the planes.
  const int planes = bit_width(2 * static_cast<uint64_t>(n));
  uint64_t carry[kLanes] = {};
  for (int l = 0; l < L; ++l) {
    code[0][l] = zer[0][l];
  }
  for (int b = 1; b < planes; ++b) {
    for (int l = 0; l < L; ++l) {
      const uint64_t a = b - 1 < pos_planes ? pos[b - 1][l] : 0;
      const uint64_t z = b < pos_planes ? zer[b][l] : 0;
      const uint64_t s = a ^ z;
      code[b][l] = s ^ carry[l];
      carry[l] = (a & z) | (carry[l] & s);
    }
  }
}

bool any_zero_plane(const Contribution* in, int n) {
  for (int i = 0; i < n; ++i) {
    if (in[i].zero != nullptr) {
      return true;
    }
  }
  return false;
}

int planes_of(int n, bool with_zeros) {
  return bit_width(static_cast<uint64_t>(with_zeros ? 2 * n : n));
}

template <int L>
inline void count_code_block(
    const Contribution* in,
    int n,
    size_t words,
    size_t w0,
    bool with_zeros,
    uint64_t* out) {
  uint64_t code[kMaxPlanes][kLanes];
  count_block<L>(in, n, w0, with_zeros, code);
  const int planes = planes_of(n, with_zeros);
  for (int b = 0; b < planes; ++b) {
    for (int l = 0; l < L; ++l) {
      out[b * words + w0 + l] = code[b][l];
    }
  }
}

void count_code(const Contribution* in, int n, size_t words, uint64_t* out) {
  const bool with_zeros = any_zero_plane(in, n);
  size_t w = 0;
  for (; w + kLanes <= words; w += kLanes) {
    count_code_block<kLanes>(in, n, words, w, with_zeros, out);
  }
  for (; w < words; ++w) {
    count_code_block<1>(in, n, words, w, with_zeros, out);
  }
}

// Compares v = code << shift with the constant n, plane by plane from the top:
// gt where v > n, eq where v == n.
template <int L>
inline void compare_block(
    uint64_t (*code)[kLanes],
    int planes,
    int shift,
    uint64_t n,
    uint64_t* gt,
    uint64_t* eq) {
  for (int l = 0; l < L; ++l) {
    gt[l] = 0;
    eq[l] = ~0ull;
  }
  for (int b = planes + shift - 1; b >= 0; --b) {
    const bool cb = ((n >> b) & 1u) != 0;
    for (int l = 0; l < L; ++l) {
      const uint64_t vb = b >= shift ? code[b - shift][l] : 0;
      if (cb) {
        eq[l] &= vb;
      } else {
        gt[l] |= eq[l] & vb;
        eq[l] &= ~vb;
      }
    }
  }
}

template <int L>
inline uint64_t vote_block(
    const Contribution* in,
    int n,
    size_t w0,
    bool with_zeros,
    uint64_t* out_sign,
    uint64_t* out_zero) {
  uint64_t code[kMaxPlanes][kLanes];
  count_block<L>(in, n, w0, with_zeros, code);
  // Sum > 0  <=>  code > n (with zeros)  or  2 * code > n (without).
  uint64_t gt[kLanes], eq[kLanes];
  compare_block<L>(
      code, planes_of(n, with_zeros), with_zeros ? 0 : 1,
      static_cast<uint64_t>(n), gt, eq);
  uint64_t any = 0;
  for (int l = 0; l < L; ++l) {
    out_sign[w0 + l] = gt[l];
    out_zero[w0 + l] = eq[l];
    any |= eq[l];
  }
  return any;
}

bool vote(
    const Contribution* in,
    int n,
    size_t words,
    uint64_t* out_sign,
    uint64_t* out_zero) {
  const bool with_zeros = any_zero_plane(in, n);
  uint64_t any = 0;
  size_t w = 0;
  for (; w + kLanes <= words; w += kLanes) {
    any |= vote_block<kLanes>(in, n, w, with_zeros, out_sign, out_zero);
  }
  for (; w < words; ++w) {
    any |= vote_block<1>(in, n, w, with_zeros, out_sign, out_zero);
  }
  return any != 0;
}

// -------------------------------------------------------------- unpack ----

template <typename U>
inline void unpack_scalar_range(
    const uint64_t* const* planes,
    int nplanes,
    size_t begin,
    size_t end,
    const U* lut,
    U* dst) {
  for (size_t i = begin; i < end; ++i) {
    const size_t w = i / kWordBits;
    const unsigned j = static_cast<unsigned>(i % kWordBits);
    uint32_t code = 0;
    for (int b = 0; b < nplanes; ++b) {
      code |= static_cast<uint32_t>((planes[b][w] >> j) & 1u) << b;
    }
    dst[i] = lut[code];
  }
}

#if defined(__AVX512BW__)
template <typename U>
inline __m512i broadcast_lut(U v) {
  if constexpr (sizeof(U) == 1) {
    return _mm512_set1_epi8(static_cast<char>(v));
  } else if constexpr (sizeof(U) == 2) {
    return _mm512_set1_epi16(static_cast<short>(v));
  } else if constexpr (sizeof(U) == 4) {
    return _mm512_set1_epi32(static_cast<int>(v));
  } else {
    return _mm512_set1_epi64(static_cast<long long>(v));
  }
}

template <typename U>
inline __m512i blend_lanes(uint64_t m, __m512i a, __m512i b) {
  if constexpr (sizeof(U) == 1) {
    return _mm512_mask_blend_epi8(m, a, b);
  } else if constexpr (sizeof(U) == 2) {
    return _mm512_mask_blend_epi16(static_cast<__mmask32>(m), a, b);
  } else if constexpr (sizeof(U) == 4) {
    return _mm512_mask_blend_epi32(static_cast<__mmask16>(m), a, b);
  } else {
    return _mm512_mask_blend_epi64(static_cast<__mmask8>(m), a, b);
  }
}

// Whole words [0, full) with masks; 64 / lanes vectors per word.
template <typename U>
inline void unpack_vec_words(
    const uint64_t* const* planes,
    int nplanes,
    size_t full,
    const U* lut,
    U* dst) {
  constexpr int kPerVec = 64 / sizeof(U);
  constexpr uint64_t kMask = kPerVec == 64 ? ~0ull : ((1ull << kPerVec) - 1);
  __m512i table[16];
  for (int e = 0; e < (1 << nplanes); ++e) {
    table[e] = broadcast_lut<U>(lut[e]);
  }
  for (size_t w = 0; w < full; ++w) {
    for (int k = 0; k < 64 / kPerVec; ++k) {
      uint64_t m[4];
      for (int b = 0; b < nplanes; ++b) {
        m[b] = (planes[b][w] >> (k * kPerVec)) & kMask;
      }
      // Level b of the tree picks, per lane, entry 2e or 2e+1 by code bit b.
      __m512i level[16];
      int entries = 1 << nplanes;
      for (int e = 0; e < entries; ++e) {
        level[e] = table[e];
      }
      for (int b = 0; b < nplanes; ++b) {
        entries >>= 1;
        for (int e = 0; e < entries; ++e) {
          level[e] = blend_lanes<U>(m[b], level[2 * e], level[2 * e + 1]);
        }
      }
      _mm512_storeu_si512(dst + w * 64 + k * kPerVec, level[0]);
    }
  }
}
#define LIONBIT_HAVE_UNPACK_VEC 1
#elif defined(__AVX2__)
// A lane mask from kPerVec bits of m: broadcast, isolate one bit per lane,
// compare. Then blendv (byte granular) picks per lane.
template <typename U>
inline __m256i lane_mask(uint64_t m) {
  if constexpr (sizeof(U) == 4) {
    const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i v = _mm256_set1_epi32(static_cast<int>(m & 0xff));
    return _mm256_cmpeq_epi32(_mm256_and_si256(v, bits), bits);
  } else if constexpr (sizeof(U) == 8) {
    const __m256i bits = _mm256_setr_epi64x(1, 2, 4, 8);
    const __m256i v = _mm256_set1_epi64x(static_cast<long long>(m & 0xf));
    return _mm256_cmpeq_epi64(_mm256_and_si256(v, bits), bits);
  } else if constexpr (sizeof(U) == 2) {
    const __m256i bits = _mm256_setr_epi16(
        1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
        static_cast<short>(0x8000));
    const __m256i v = _mm256_set1_epi16(static_cast<short>(m & 0xffff));
    return _mm256_cmpeq_epi16(_mm256_and_si256(v, bits), bits);
  } else {
    // 32 bytes: replicate each of the 4 mask bytes over 8 lanes.
    const __m256i v = _mm256_set1_epi32(static_cast<int>(m & 0xffffffffu));
    const __m256i shuf = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
        3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bytes = _mm256_shuffle_epi8(v, shuf);
    const __m256i bits = _mm256_set1_epi64x(0x8040201008040201ll);
    return _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bits), bits);
  }
}

template <typename U>
inline __m256i broadcast_lut(U v) {
  if constexpr (sizeof(U) == 1) {
    return _mm256_set1_epi8(static_cast<char>(v));
  } else if constexpr (sizeof(U) == 2) {
    return _mm256_set1_epi16(static_cast<short>(v));
  } else if constexpr (sizeof(U) == 4) {
    return _mm256_set1_epi32(static_cast<int>(v));
  } else {
    return _mm256_set1_epi64x(static_cast<long long>(v));
  }
}

template <typename U>
inline void unpack_vec_words(
    const uint64_t* const* planes,
    int nplanes,
    size_t full,
    const U* lut,
    U* dst) {
  constexpr int kPerVec = 32 / sizeof(U);
  __m256i table[16];
  for (int e = 0; e < (1 << nplanes); ++e) {
    table[e] = broadcast_lut<U>(lut[e]);
  }
  for (size_t w = 0; w < full; ++w) {
    for (int k = 0; k < 64 / kPerVec; ++k) {
      __m256i m[4];
      for (int b = 0; b < nplanes; ++b) {
        m[b] = lane_mask<U>(planes[b][w] >> (k * kPerVec));
      }
      __m256i level[16];
      int entries = 1 << nplanes;
      for (int e = 0; e < entries; ++e) {
        level[e] = table[e];
      }
      for (int b = 0; b < nplanes; ++b) {
        entries >>= 1;
        for (int e = 0; e < entries; ++e) {
          level[e] = _mm256_blendv_epi8(level[2 * e], level[2 * e + 1], m[b]);
        }
      }
      _mm256_storeu_si256(
          reinterpret_cast<__m256i*>(dst + w * 64 + k * kPerVec), level[0]);
    }
  }
}
#define LIONBIT_HAVE_UNPACK_VEC 1
#endif

template <typename U>
void unpack_typed(
    const uint64_t* const* planes,
    int nplanes,
    size_t n,
    const void* lut_v,
    void* dst_v) {
  const U* lut = static_cast<const U*>(lut_v);
  U* dst = static_cast<U*>(dst_v);
  size_t begin = 0;
#ifdef LIONBIT_HAVE_UNPACK_VEC
  if (nplanes <= 4) {
    const size_t full = n / kWordBits;
    unpack_vec_words<U>(planes, nplanes, full, lut, dst);
    begin = full * kWordBits;
  }
#endif
  unpack_scalar_range<U>(planes, nplanes, begin, n, lut, dst);
}

void unpack(
    size_t elem_size,
    const uint64_t* const* planes,
    int nplanes,
    size_t n,
    const void* lut,
    void* dst) {
  switch (elem_size) {
    case 1:
      return unpack_typed<uint8_t>(planes, nplanes, n, lut, dst);
    case 2:
      return unpack_typed<uint16_t>(planes, nplanes, n, lut, dst);
    case 4:
      return unpack_typed<uint32_t>(planes, nplanes, n, lut, dst);
    default:
      return unpack_typed<uint64_t>(planes, nplanes, n, lut, dst);
  }
}

} // namespace

const Kernels& table() {
  static const Kernels k{&pack, &count_code, &vote, &unpack};
  return k;
}

} // namespace lionbit::bits::detail::LIONBIT_KERNELS_NS
