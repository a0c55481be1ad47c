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
#include <cstdint>
#include <cstring>

#include "float16.h"
#include "kernels.h"
#include "lanes.h"
#include "levels.h"
#include "levels_impl.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifndef LIONBIT_KERNELS_NS
#error "define LIONBIT_KERNELS_NS before including kernels_impl.h"
#endif

namespace lionbit::bits::detail::LIONBIT_KERNELS_NS {
namespace {

// ---------------------------------------------------------------- pack ----

// Bit-pattern view of each dtype (signbits/float16.h).
template <DType D>
using Traits = Storage<D>;

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
// GCC 12's headers trip -Wmaybe-uninitialized on the inlined vpslld/vpmaxud
// intrinsics (their unused pass-through operand; GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// 64 elements from p, AVX-512, on the bit patterns, three operations a
// vector: zero = (x & kMag) == 0 (one vptestnm); positive = x - 1 < kInf
// unsigned (x in [1, kInf]: sign clear, nonzero, not NaN; a negative x or a
// NaN lands above); and a running unsigned max of x << 1 (the magnitude
// shifted up), compared with kInf << 1 once per buffer to count NaNs only
// when there are any. Masks are joined in mask registers (kunpck). The NaN
// bits of the returned word are left 0: pack_typed recounts NaNs itself.
template <DType D>
inline WordBits pack_word_vec(const typename Traits<D>::U* p, __m512i& mag2_max) {
  WordBits r;
  if constexpr (D == DType::kFloat32) {
    const __m512i mag_mask = _mm512_set1_epi32(0x7fffffff);
    const __m512i inf = _mm512_set1_epi32(0x7f800000);
    const __m512i one = _mm512_set1_epi32(1);
    __mmask16 z[4], s[4];
    for (int k = 0; k < 4; ++k) {
      const __m512i x = _mm512_loadu_si512(p + 16 * k);
      z[k] = _mm512_testn_epi32_mask(x, mag_mask);
      s[k] = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(x, one), inf);
      mag2_max = _mm512_max_epu32(mag2_max, _mm512_slli_epi32(x, 1));
    }
    r.zero = _cvtmask64_u64(
        _mm512_kunpackd(_mm512_kunpackw(z[3], z[2]), _mm512_kunpackw(z[1], z[0])));
    r.sign = _cvtmask64_u64(
        _mm512_kunpackd(_mm512_kunpackw(s[3], s[2]), _mm512_kunpackw(s[1], s[0])));
  } else if constexpr (D == DType::kFloat64) {
    const __m512i mag_mask = _mm512_set1_epi64(0x7fffffffffffffffll);
    const __m512i inf = _mm512_set1_epi64(0x7ff0000000000000ll);
    const __m512i one = _mm512_set1_epi64(1);
    // 8-lane masks are joined in mask registers too, never widened through a
    // general register: GCC 12 spilled such a mask with kmovb and reloaded
    // it as 64 bits under register pressure (the sanitizer build packed
    // garbage into the high bits).
    __mmask16 z[8], s[8];
    for (int k = 0; k < 8; ++k) {
      const __m512i x = _mm512_loadu_si512(p + 8 * k);
      z[k] = _mm512_testn_epi64_mask(x, mag_mask);
      s[k] = _mm512_cmplt_epu64_mask(_mm512_sub_epi64(x, one), inf);
      mag2_max = _mm512_max_epu64(mag2_max, _mm512_slli_epi64(x, 1));
    }
    const auto join = [](const __mmask16* m) {
      return _cvtmask64_u64(_mm512_kunpackd(
          _mm512_kunpackw(_mm512_kunpackb(m[7], m[6]), _mm512_kunpackb(m[5], m[4])),
          _mm512_kunpackw(_mm512_kunpackb(m[3], m[2]), _mm512_kunpackb(m[1], m[0]))));
    };
    r.zero = join(z);
    r.sign = join(s);
  } else if constexpr (D == DType::kFloat16 || D == DType::kBFloat16) {
    const __m512i mag_mask = _mm512_set1_epi16(0x7fff);
    const __m512i inf = _mm512_set1_epi16(static_cast<short>(Traits<D>::kInf));
    const __m512i one = _mm512_set1_epi16(1);
    __mmask32 z[2], s[2];
    for (int k = 0; k < 2; ++k) {
      const __m512i x = _mm512_loadu_si512(p + 32 * k);
      z[k] = _mm512_testn_epi16_mask(x, mag_mask);
      s[k] = _mm512_cmplt_epu16_mask(_mm512_sub_epi16(x, one), inf);
      mag2_max = _mm512_max_epu16(mag2_max, _mm512_slli_epi16(x, 1));
    }
    r.zero = _cvtmask64_u64(_mm512_kunpackd(z[1], z[0]));
    r.sign = _cvtmask64_u64(_mm512_kunpackd(s[1], s[0]));
  } else {
    const __m512i x = _mm512_loadu_si512(p);
    const __m512i zero = _mm512_setzero_si512();
    r.zero = _mm512_cmpeq_epi8_mask(x, zero);
    r.sign = _mm512_cmpgt_epi8_mask(x, zero);
  }
  return r;
}

// True iff some lane of the running max of x << 1 is above kInf << 1, i.e.
// some element seen was a NaN.
template <DType D>
inline bool saw_nan(__m512i mag2_max) {
  if constexpr (D == DType::kFloat32) {
    return _mm512_cmpgt_epu32_mask(mag2_max, _mm512_set1_epi32(static_cast<int>(0xff000000u))) != 0;
  } else if constexpr (D == DType::kFloat64) {
    return _mm512_cmpgt_epu64_mask(
               mag2_max, _mm512_set1_epi64(static_cast<long long>(0xffe0000000000000ull))) != 0;
  } else if constexpr (D == DType::kFloat16 || D == DType::kBFloat16) {
    return _mm512_cmpgt_epu16_mask(
               mag2_max, _mm512_set1_epi16(static_cast<short>(Traits<D>::kInf << 1))) != 0;
  } else {
    return false;
  }
}
#pragma GCC diagnostic pop
#define LIONBIT_PACK_NAN_BY_MAX 1
#define LIONBIT_HAVE_PACK_VEC 1
#elif defined(__AVX2__)
// 64 elements from p, AVX2: integer compares, then movemask per lane width.
inline uint32_t mask16x32(__m256i a, __m256i b) {
  // a, b: 16 lanes of 0 / 0xffff each -> 32 bits in element order.
  const __m256i packed = _mm256_packs_epi16(a, b); // lanes interleaved
  return static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_permute4x64_epi64(packed, 0xD8)));
}

template <DType D>
inline WordBits pack_word_vec(const typename Traits<D>::U* p) {
  WordBits r;
  if constexpr (D == DType::kFloat32) {
    const __m256i mag_mask = _mm256_set1_epi32(0x7fffffff);
    const __m256i inf = _mm256_set1_epi32(0x7f800000);
    const __m256i zero = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8 * k));
      const __m256i mag = _mm256_and_si256(x, mag_mask);
      const uint64_t z = static_cast<uint32_t>(
          _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, zero))));
      const uint64_t n = static_cast<uint32_t>(
          _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(mag, inf))));
      const uint64_t neg = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(x)));
      r.zero |= z << (8 * k);
      r.nan |= n << (8 * k);
      r.sign |= (~(z | n | neg) & 0xffull) << (8 * k);
    }
  } else if constexpr (D == DType::kFloat64) {
    const __m256i mag_mask = _mm256_set1_epi64x(0x7fffffffffffffffll);
    const __m256i inf = _mm256_set1_epi64x(0x7ff0000000000000ll);
    const __m256i zero = _mm256_setzero_si256();
    for (int k = 0; k < 16; ++k) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 4 * k));
      const __m256i mag = _mm256_and_si256(x, mag_mask);
      const uint64_t z = static_cast<uint32_t>(
          _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(mag, zero))));
      const uint64_t n = static_cast<uint32_t>(
          _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(mag, inf))));
      const uint64_t neg = static_cast<uint32_t>(_mm256_movemask_pd(_mm256_castsi256_pd(x)));
      r.zero |= z << (4 * k);
      r.nan |= n << (4 * k);
      r.sign |= (~(z | n | neg) & 0xfull) << (4 * k);
    }
  } else if constexpr (D == DType::kFloat16 || D == DType::kBFloat16) {
    const __m256i mag_mask = _mm256_set1_epi16(0x7fff);
    const __m256i inf = _mm256_set1_epi16(static_cast<short>(Traits<D>::kInf));
    const __m256i zero = _mm256_setzero_si256();
    for (int k = 0; k < 2; ++k) {
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * k));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * k + 16));
      const __m256i m0 = _mm256_and_si256(x0, mag_mask);
      const __m256i m1 = _mm256_and_si256(x1, mag_mask);
      const uint64_t z = mask16x32(_mm256_cmpeq_epi16(m0, zero), _mm256_cmpeq_epi16(m1, zero));
      const uint64_t n = mask16x32(_mm256_cmpgt_epi16(m0, inf), _mm256_cmpgt_epi16(m1, inf));
      const uint64_t neg = mask16x32(_mm256_srai_epi16(x0, 15), _mm256_srai_epi16(x1, 15));
      r.zero |= z << (32 * k);
      r.nan |= n << (32 * k);
      r.sign |= (~(z | n | neg) & 0xffffffffull) << (32 * k);
    }
  } else {
    const __m256i zero = _mm256_setzero_si256();
    for (int k = 0; k < 2; ++k) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * k));
      const uint64_t z = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(x, zero)));
      const uint64_t pos = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpgt_epi8(x, zero)));
      r.zero |= z << (32 * k);
      r.sign |= pos << (32 * k);
    }
  }
  return r;
}
#define LIONBIT_HAVE_PACK_VEC 1
#endif

// Software prefetch of `bytes` bytes starting 4 KB past `p`, into L1
// (Locality 3) or L2 (2): the hardware prefetcher alone left pack at ~1/3 of
// a core's read bandwidth on large buffers (bench/cpu_kernels.cpp, BM_pack).
// Prefetching past the end of a buffer is harmless (prefetches do not fault).
template <int Locality>
inline void prefetch_ahead(const void* p, size_t bytes) {
  const char* q = static_cast<const char*>(p) + 4096;
  for (size_t off = 0; off < bytes; off += 64) {
    __builtin_prefetch(q + off, 0, Locality);
  }
}

template <DType D>
PackCounts pack_typed(const void* src, size_t n, uint64_t* sign, uint64_t* zero) {
  using U = typename Traits<D>::U;
  const U* p = static_cast<const U*>(src);
  PackCounts c;
  const size_t full = n / kWordBits;
#ifdef LIONBIT_PACK_NAN_BY_MAX
  __m512i mag2_max = _mm512_setzero_si512();
#endif
  for (size_t w = 0; w < full; ++w) {
    prefetch_ahead<3>(p + w * kWordBits, kWordBits * sizeof(U));
#if defined(LIONBIT_PACK_NAN_BY_MAX)
    const WordBits b = pack_word_vec<D>(p + w * kWordBits, mag2_max);
#elif defined(LIONBIT_HAVE_PACK_VEC)
    const WordBits b = pack_word_vec<D>(p + w * kWordBits);
#else
    const WordBits b = pack_word_scalar<D>(p + w * kWordBits, kWordBits);
#endif
    sign[w] = b.sign;
    zero[w] = b.zero;
    c.zeros += static_cast<uint64_t>(__builtin_popcountll(b.zero));
    c.nans += static_cast<uint64_t>(__builtin_popcountll(b.nan));
  }
#ifdef LIONBIT_PACK_NAN_BY_MAX
  // NaNs are rare (an error for the caller): count them in a second pass over
  // the whole words only when the running max says there are some.
  if (saw_nan<D>(mag2_max)) {
    for (size_t w = 0; w < full; ++w) {
      c.nans += static_cast<uint64_t>(
          __builtin_popcountll(pack_word_scalar<D>(p + w * kWordBits, kWordBits).nan));
    }
  }
#endif
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

PackCounts pack(DType dtype, const void* src, size_t n, uint64_t* sign, uint64_t* zero) {
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

constexpr int kMaxPlanes = 33; // bit_width(2n) for n < 2^31

// The counters' lanes: signbits/lanes.h.
using lanes::kLanes;
using lanes::Lanes8;
using lanes::LaneType;
using lanes::load_lanes;
using lanes::or_lanes;
using lanes::store_lanes;

// Adds the bit-vector x into the bit-sliced counters c[0..planes). P > 0:
// the number of planes is the compile-time constant P (the loop unrolls and
// the counters stay in registers); P == 0: `planes` at run time.
template <int P, class T>
inline void ripple_add(T* c, int planes, T x) {
  const int np = P > 0 ? P : planes;
  for (int b = 0; b < np; ++b) {
    const T t = c[b] & x;
    c[b] ^= x;
    x = t;
  }
}

// Planes of the counter of n contributions (bit_width(n)); P as above.
template <int P>
inline int pos_planes_of(int n) {
  return P > 0 ? P : bit_width(static_cast<uint64_t>(n));
}

// Planes of the code (see count.h); Z: some contribution has a zero plane.
template <int P, bool Z>
inline int code_planes_of(int n) {
  return pos_planes_of<P>(n) + (Z ? 1 : 0); // bit_width(2n) = bit_width(n) + 1
}

// The vote prefetches (prefetch_ahead, above) only when there are at most
// kPrefetchMaxStreams planes: the planes of a shard lie a multiple of 4 KB
// apart, so their lines share cache sets, and with more streams the
// prefetched lines evicted each other (BM_vote: N = 4 ran ~1.6x faster with
// them, N = 8 ~2x slower, N = 16 ~3x slower).
constexpr int kPrefetchMaxStreams = 4;

// The code planes of L words starting at word w0 (see count.h), into
// code[0..code_planes_of<P, Z>(n)).
template <int L, int P, bool Z>
inline void count_block(const Contribution* in, int n, size_t w0, typename LaneType<L>::T* code) {
  using T = typename LaneType<L>::T;
  constexpr int kCap = P > 0 ? P : kMaxPlanes;
  const int pos_planes = pos_planes_of<P>(n);
  T pos[kCap];
  T zer[Z ? kCap : 1] = {}; // small unless P == 0 (n >= 32)
  for (int b = 0; b < pos_planes; ++b) {
    pos[b] = T{};
  }
  const bool prefetch = n <= kPrefetchMaxStreams;
  for (int i = 0; i < n; ++i) {
    if (prefetch) {
      prefetch_ahead<2>(in[i].sign + w0, 64);
    }
    ripple_add<P>(pos, pos_planes, load_lanes<T>(in[i].sign + w0));
    if constexpr (Z) {
      if (in[i].zero != nullptr) {
        if (prefetch) {
          prefetch_ahead<2>(in[i].zero + w0, 64);
        }
        ripple_add<P>(zer, pos_planes, load_lanes<T>(in[i].zero + w0));
      }
    }
  }
  if constexpr (!Z) {
    for (int b = 0; b < pos_planes; ++b) {
      code[b] = pos[b];
    }
  } else {
    // code = 2 * pos + zer, a ripple-carry adder over the planes.
    T carry{};
    code[0] = zer[0];
    for (int b = 1; b <= pos_planes; ++b) {
      const T a = pos[b - 1];
      const T z = b < pos_planes ? zer[b] : T{};
      const T s = a ^ z;
      code[b] = s ^ carry;
      carry = (a & z) | (carry & s);
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

template <int L, int P, bool Z>
inline void count_code_block(
    const Contribution* in,
    int n,
    size_t words,
    size_t w0,
    uint64_t* out) {
  typename LaneType<L>::T code[(P > 0 ? P : kMaxPlanes - 1) + 1];
  count_block<L, P, Z>(in, n, w0, code);
  const int planes = code_planes_of<P, Z>(n);
  for (int b = 0; b < planes; ++b) {
    store_lanes(out + b * words + w0, code[b]);
  }
}

template <int P, bool Z>
void count_code_fixed(const Contribution* in, int n, size_t words, uint64_t* out) {
  size_t w = 0;
  for (; w + kLanes <= words; w += kLanes) {
    count_code_block<kLanes, P, Z>(in, n, words, w, out);
  }
  for (; w < words; ++w) { // the tail: one copy for every P (see vote_levels_fixed)
    count_code_block<1, 0, Z>(in, n, words, w, out);
  }
}

// Calls F<P, Z>::run(args...) with P = bit_width(n) when n < 32 (the
// counters' plane count as a compile-time constant), else P = 0.
template <template <int, bool> class F, typename... A>
inline auto dispatch_planes(int n, bool with_zeros, A... args) {
  const int p = bit_width(static_cast<uint64_t>(n));
#define LIONBIT_PLANES_CASE(P) \
  case P:                      \
    return with_zeros ? F<P, true>::run(args...) : F<P, false>::run(args...);
  switch (p) {
    LIONBIT_PLANES_CASE(1)
    LIONBIT_PLANES_CASE(2)
    LIONBIT_PLANES_CASE(3)
    LIONBIT_PLANES_CASE(4)
    LIONBIT_PLANES_CASE(5)
    default:
      return with_zeros ? F<0, true>::run(args...) : F<0, false>::run(args...);
  }
#undef LIONBIT_PLANES_CASE
}

template <int P, bool Z>
struct CountCodeFn {
  static void run(const Contribution* in, int n, size_t words, uint64_t* out) {
    count_code_fixed<P, Z>(in, n, words, out);
  }
};

void count_code(const Contribution* in, int n, size_t words, uint64_t* out) {
  dispatch_planes<CountCodeFn>(n, any_zero_plane(in, n), in, n, words, out);
}

// Compares v = code << shift with the constant n, plane by plane from the top:
// gt where v > n, eq where v == n.
template <class T>
inline void compare_block(const T* code, int planes, int shift, uint64_t n, T& gt, T& eq) {
  gt = T{};
  eq = ~T{};
  for (int b = planes + shift - 1; b >= 0; --b) {
    const bool cb = ((n >> b) & 1u) != 0;
    const T vb = b >= shift ? code[b - shift] : T{};
    if (cb) {
      eq &= vb;
    } else {
      gt |= eq & vb;
      eq &= ~vb;
    }
  }
}

template <int L, int P, bool Z>
inline uint64_t vote_block(
    const Contribution* in,
    int n,
    size_t w0,
    uint64_t* out_sign,
    uint64_t* out_zero) {
  using T = typename LaneType<L>::T;
  T code[(P > 0 ? P : kMaxPlanes - 1) + 1];
  count_block<L, P, Z>(in, n, w0, code);
  // Sum > 0  <=>  code > n (with zeros)  or  2 * code > n (without).
  T gt, eq;
  compare_block<T>(code, code_planes_of<P, Z>(n), Z ? 0 : 1, static_cast<uint64_t>(n), gt, eq);
  store_lanes(out_sign + w0, gt);
  store_lanes(out_zero + w0, eq);
  return or_lanes(eq);
}

template <int P, bool Z>
struct VoteFn {
  static bool run(
      const Contribution* in,
      int n,
      size_t words,
      uint64_t* out_sign,
      uint64_t* out_zero) {
    uint64_t any = 0;
    size_t w = 0;
    for (; w + kLanes <= words; w += kLanes) {
      any |= vote_block<kLanes, P, Z>(in, n, w, out_sign, out_zero);
    }
    for (; w < words; ++w) { // the tail, as in count_code_fixed
      any |= vote_block<1, 0, Z>(in, n, w, out_sign, out_zero);
    }
    return any != 0;
  }
};

bool vote(const Contribution* in, int n, size_t words, uint64_t* out_sign, uint64_t* out_zero) {
  return dispatch_planes<VoteFn>(n, any_zero_plane(in, n), in, n, words, out_sign, out_zero);
}

// -------------------------------------------------------------- levels ----
// pack_levels and vote_levels: signbits/levels_impl.h.

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

// The vector paths take the plane count as a compile-time constant (1..4:
// 2..16 table entries) so that the blend tree and the plane words live in
// registers (with a run-time count GCC keeps them on the stack, several
// times slower even in L2).
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

using VecI = __m512i;
constexpr size_t kVecBytes = 64;

template <typename U>
inline void store_vec(U* p, __m512i v) {
  _mm512_storeu_si512(p, v);
}

// Lanes of vector k of a word: bit k * lanes + i of the plane word picks lane
// i's entry.
template <typename U>
inline __m512i pick(uint64_t word, int k, __m512i a, __m512i b) {
  constexpr int kLanes = 64 / sizeof(U);
  return blend_lanes<U>(kLanes == 64 ? word : word >> (k * kLanes), a, b);
}
#define LIONBIT_HAVE_UNPACK_VEC 1
#elif defined(__AVX2__)
// A lane mask from the lane count's bits of m: broadcast, isolate one bit per
// lane, compare. Then blendv (byte granular) picks per lane.
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
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3,
        3);
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

using VecI = __m256i;
constexpr size_t kVecBytes = 32;

template <typename U>
inline void store_vec(U* p, __m256i v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
}

template <typename U>
inline __m256i pick(uint64_t word, int k, __m256i a, __m256i b) {
  constexpr int kLanes = 32 / sizeof(U);
  return _mm256_blendv_epi8(a, b, lane_mask<U>(word >> (k * kLanes)));
}
#define LIONBIT_HAVE_UNPACK_VEC 1
#endif

#ifdef LIONBIT_HAVE_UNPACK_VEC
// Whole words [0, full): per vector of lanes, a binary tree of blends; level
// b picks, per lane, entry 2e or 2e + 1 by code bit b.
template <typename U, int NP>
inline void unpack_vec_words(const uint64_t* const* planes, size_t full, const U* lut, U* dst) {
  constexpr int kLanes = static_cast<int>(kVecBytes / sizeof(U));
  constexpr int kVecsPerWord = 64 / kLanes;
  constexpr int kEntries = 1 << NP;
  VecI table[kEntries];
  for (int e = 0; e < kEntries; ++e) {
    table[e] = broadcast_lut<U>(lut[e]);
  }
  const uint64_t* pl[NP > 0 ? NP : 1] = {};
  for (int b = 0; b < NP; ++b) {
    pl[b] = planes[b];
  }
  for (size_t w = 0; w < full; ++w) {
    uint64_t word[NP > 0 ? NP : 1] = {};
    for (int b = 0; b < NP; ++b) {
      word[b] = pl[b][w];
    }
    U* out = dst + w * kWordBits;
    for (int k = 0; k < kVecsPerWord; ++k) {
      VecI level[kEntries];
      for (int e = 0; e < kEntries; ++e) {
        level[e] = table[e];
      }
      int entries = kEntries;
      for (int b = 0; b < NP; ++b) {
        entries >>= 1;
        for (int e = 0; e < entries; ++e) {
          level[e] = pick<U>(word[b], k, level[2 * e], level[2 * e + 1]);
        }
      }
      store_vec<U>(out + k * kLanes, level[0]);
    }
  }
}

template <typename U>
inline bool unpack_vec_dispatch(
    const uint64_t* const* planes,
    int nplanes,
    size_t full,
    const U* lut,
    U* dst) {
  switch (nplanes) {
    case 1:
      unpack_vec_words<U, 1>(planes, full, lut, dst);
      return true;
    case 2:
      unpack_vec_words<U, 2>(planes, full, lut, dst);
      return true;
    case 3:
      unpack_vec_words<U, 3>(planes, full, lut, dst);
      return true;
    case 4:
      unpack_vec_words<U, 4>(planes, full, lut, dst);
      return true;
    default:
      return false;
  }
}
#endif

// More planes than the blend tree takes (5..16: the counts of avg and sum at
// larger N, or N = 8 with zeros), and every count on the scalar ISA: per word
// the 64 codes are assembled first, 16 bits each, then looked up one by one.
// Per element that is one table load (a gather of 16 or 8 on AVX-512 for
// 4- and 8-byte types) and one store, against a shift, a mask and an or per
// plane for an element-by-element loop (about 5x faster at 5 planes,
// BM_unpack_counts).
//
// Bits 4g..4g+3 of a plane word, spread to bits 0, 16, 32, 48: the four
// copies of x (at shifts 0, 15, 30, 45) do not overlap, so no carries, and
// copy k puts bit k at 16k.
inline uint64_t spread4(uint64_t x) {
  return ((x & 0xFu) * 0x0000200040008001ull) & 0x0001000100010001ull;
}

inline void codes_of_word(const uint64_t* const* planes, int nplanes, size_t w, uint16_t* code) {
#if defined(__AVX512BW__)
  __m512i lo = _mm512_setzero_si512();
  __m512i hi = lo;
  for (int b = 0; b < nplanes; ++b) {
    const uint64_t word = planes[b][w];
    const __m512i bit = _mm512_set1_epi16(static_cast<short>(1u << b));
    // Bit b is not yet set in any lane, so adding it is or-ing it (AVX-512BW
    // has a masked add on 16-bit lanes, no masked or).
    lo = _mm512_mask_add_epi16(lo, static_cast<__mmask32>(word), lo, bit);
    hi = _mm512_mask_add_epi16(hi, static_cast<__mmask32>(word >> 32), hi, bit);
  }
  _mm512_storeu_si512(code, lo);
  _mm512_storeu_si512(code + 32, hi);
#else
  uint64_t lanes[kWordBits / 4] = {}; // codes 4g..4g+3 in lane g, 16 bits each
  for (int b = 0; b < nplanes; ++b) {
    const uint64_t word = planes[b][w];
    for (size_t g = 0; g < kWordBits / 4; ++g) {
      lanes[g] |= spread4(word >> (4 * g)) << b;
    }
  }
  for (size_t g = 0; g < kWordBits / 4; ++g) {
    for (size_t i = 0; i < 4; ++i) {
      code[4 * g + i] = static_cast<uint16_t>(lanes[g] >> (16 * i));
    }
  }
#endif
}

template <typename U>
inline void unpack_code_words(
    const uint64_t* const* planes,
    int nplanes,
    size_t full,
    const U* lut,
    U* dst) {
  alignas(64) uint16_t code[kWordBits];
  for (size_t w = 0; w < full; ++w) {
    codes_of_word(planes, nplanes, w, code);
    U* out = dst + w * kWordBits;
#if defined(__AVX512BW__)
    if constexpr (sizeof(U) == 4) {
      for (size_t k = 0; k < kWordBits; k += 16) {
        // The masked forms with a zero source: the plain ones start from
        // _mm512_undefined_*, which GCC 12 flags as maybe-uninitialized.
        const __m512i idx = _mm512_maskz_cvtepu16_epi32(
            0xFFFF, _mm256_load_si256(reinterpret_cast<const __m256i*>(code + k)));
        _mm512_storeu_si512(
            out + k, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), 0xFFFF, idx, lut, 4));
      }
      continue;
    }
    if constexpr (sizeof(U) == 8) {
      for (size_t k = 0; k < kWordBits; k += 8) {
        const __m256i idx = _mm256_cvtepu16_epi32(
            _mm_load_si128(reinterpret_cast<const __m128i*>(code + k)));
        _mm512_storeu_si512(
            out + k, _mm512_mask_i32gather_epi64(_mm512_setzero_si512(), 0xFF, idx, lut, 8));
      }
      continue;
    }
#endif
    for (size_t i = 0; i < kWordBits; ++i) {
      out[i] = lut[code[i]];
    }
  }
}

template <typename U>
void unpack_typed(
    const uint64_t* const* planes,
    int nplanes,
    size_t n,
    const void* lut_v,
    void* dst_v) {
  const U* lut = static_cast<const U*>(lut_v);
  U* dst = static_cast<U*>(dst_v);
  const size_t full = n / kWordBits;
  bool done = false;
#ifdef LIONBIT_HAVE_UNPACK_VEC
  done = unpack_vec_dispatch<U>(planes, nplanes, full, lut, dst);
#endif
  if (!done) {
    unpack_code_words<U>(planes, nplanes, full, lut, dst);
  }
  unpack_scalar_range<U>(planes, nplanes, full * kWordBits, n, lut, dst);
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

// The set bits of a plane, and its runs of set bits (a set bit whose
// predecessor, the previous word's top bit for bit 0, is clear). A copy per
// ISA for the popcnt instruction: compiled for the baseline x86-64, as the
// scalar copy is, each word is a call into libgcc (in zeros.cpp these two took
// about a tenth of a 26M-element vote at N = 2).
uint64_t count_bits(const uint64_t* words, size_t n) {
  uint64_t c = 0;
  for (size_t w = 0; w < n; ++w) {
    c += static_cast<uint64_t>(__builtin_popcountll(words[w]));
  }
  return c;
}

uint64_t count_runs(const uint64_t* words, size_t n) {
  uint64_t c = 0, carry = 0;
  for (size_t w = 0; w < n; ++w) {
    const uint64_t x = words[w];
    c += static_cast<uint64_t>(__builtin_popcountll(x & ~((x << 1) | carry)));
    carry = x >> 63;
  }
  return c;
}

} // namespace

const Kernels& table() {
  static const Kernels k{&pack,        &count_code,  &vote,       &unpack,
                         &pack_levels, &vote_levels, &count_bits, &count_runs};
  return k;
}

} // namespace lionbit::bits::detail::LIONBIT_KERNELS_NS
