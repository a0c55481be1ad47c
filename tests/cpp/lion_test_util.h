// Helpers shared by the fused Lion kernel tests (test_lion_direction.cpp,
// test_lion_apply.cpp): reference float32 arithmetic one operation at a time,
// exact bfloat16 / float16 conversions worked out in double, test data, and
// guarded buffers that catch reads and writes past the end.
#pragma once

#include "optimizer/lion.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "test_util.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define LION_TEST_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define LION_TEST_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define LION_TEST_POISON(p, n) ((void)(p), (void)(n))
#define LION_TEST_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace lionbit::bits {
// Readable GetParam() in test names and messages.
inline void PrintTo(Isa isa, std::ostream* os) {
  *os << isa_name(isa);
}
} // namespace lionbit::bits

namespace lionbit::optim::lion_test {

using bits::DType;
using bits::Isa;

// ------------------------------------------------ reference arithmetic ----
// One float32 operation per statement, each result forced through memory, so
// nothing can be fused or kept in wider precision.

inline float ref_mul(float a, float b) {
  volatile float r = a * b;
  return r;
}

inline float ref_sub(float a, float b) {
  volatile float r = a - b;
  return r;
}
inline float ref_add(float a, float b) {
  volatile float r = a + b;
  return r;
}


inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// memcpy / memcmp that accept the null data() of an empty vector.
inline void copy_bytes(void* dst, const void* src, size_t len) {
  if (len != 0) {
    std::memcpy(dst, src, len);
  }
}

inline bool equal_bytes(const void* a, const void* b, size_t len) {
  return len == 0 || std::memcmp(a, b, len) == 0;
}

inline size_t esize(DType d) {
  return bits::dtype_size(d);
}

// Element i of a raw buffer, widened exactly to float (float16 via ldexp in
// test_util.h: independent of the kernels' bit manipulation).
inline float widen(DType d, const uint8_t* p, size_t i) {
  if (d == DType::kFloat32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return d == DType::kBFloat16 ? bits::test::bf16_to_float(h) : bits::test::f16_to_float(h);
}

// float -> bfloat16 / float16 bits, round to nearest even, worked out in
// double from the definition (not the kernels' bit tricks). NaN -> a NaN.
inline uint16_t ref_narrow(DType d, float f) {
  const bool half = d == DType::kFloat16;
  const int p = half ? 11 : 8; // significand bits with the implicit one
  const int emin = half ? -14 : -126; // exponent of the smallest normal
  const int emax = half ? 15 : 127;
  const int bias = half ? 15 : 127;
  const uint16_t inf = half ? 0x7c00 : 0x7f80;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(f)) {
    return static_cast<uint16_t>(inf | (half ? 0x200 : 0x40));
  }
  const double a = std::fabs(static_cast<double>(f));
  if (std::isinf(a)) {
    return static_cast<uint16_t>(sign | inf);
  }
  if (a == 0) {
    return sign;
  }
  int e;
  std::frexp(a, &e); // a in [2^(e-1), 2^e)
  const int exp = std::max(e - 1, emin);
  const double ulp = std::ldexp(1.0, exp - (p - 1));
  const double r = std::nearbyint(a / ulp) * ulp; // ties to even
  if (r >= std::ldexp(1.0, emax + 1)) {
    return static_cast<uint16_t>(sign | inf);
  }
  if (r < std::ldexp(1.0, emin)) { // subnormal (or 0): a count of ulps
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(r / ulp));
  }
  int er;
  std::frexp(r, &er);
  const auto mant = static_cast<uint32_t>((r / std::ldexp(1.0, er - 1) - 1.0) * (1 << (p - 1)));
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(er - 1 + bias) << (p - 1)) | mant);
}

// Stores v into element i of a raw buffer of dtype d (reference rounding).
inline void ref_store(DType d, uint8_t* p, size_t i, float v) {
  if (d == DType::kFloat32) {
    std::memcpy(p + 4 * i, &v, 4);
  } else {
    const uint16_t h = ref_narrow(d, v);
    std::memcpy(p + 2 * i, &h, 2);
  }
}

inline bool is_nan_at(DType d, const uint8_t* p, size_t i) {
  return std::isnan(widen(d, p, i));
}

// Equal bit patterns, or both NaN (NaN payloads are not in the contract).
inline bool same_at(DType d, const uint8_t* a, const uint8_t* b, size_t i) {
  if (is_nan_at(d, a, i) || is_nan_at(d, b, i)) {
    return is_nan_at(d, a, i) && is_nan_at(d, b, i);
  }
  return std::memcmp(a + esize(d) * i, b + esize(d) * i, esize(d)) == 0;
}

inline std::string hex_at(DType d, const uint8_t* p, size_t i) {
  uint32_t u = 0;
  std::memcpy(&u, p + esize(d) * i, esize(d));
  char s[16];
  std::snprintf(s, sizeof s, "0x%0*x", static_cast<int>(2 * esize(d)), u);
  return s;
}

// ---------------------------------------------------------- test data ----

// Special bit patterns per dtype: zeros, infinities, NaNs (quiet, signaling,
// negative), denormals, smallest normal, largest finite.
inline std::vector<uint32_t> specials(DType d) {
  if (d == DType::kFloat32) {
    return {0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0x7f800001, 0xffc00001,
            0x00000001, 0x807fffff, 0x00800000, 0x7f7fffff, 0x00000003, 0x80000001};
  }
  if (d == DType::kBFloat16) {
    return {0x0000, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0x7f81, 0xffff,
            0x0001, 0x807f, 0x0080, 0x7f7f, 0x0003, 0x8001};
  }
  return {0x0000, 0x8000, 0x7c00, 0xfc00, 0x7e00, 0x7c01, 0xffff,
          0x0001, 0x83ff, 0x0400, 0x7bff, 0x0003, 0x8001};
}

// n values of dtype d as raw bytes: random sign, binade in [elo, ehi], random
// significand (rounded to d), and ~6% specials.
inline std::vector<uint8_t> make_values(DType d, size_t n, std::mt19937_64& rng, int elo, int ehi) {
  std::vector<uint8_t> buf(n * esize(d));
  const auto sp = specials(d);
  std::uniform_int_distribution<int> ex(elo, ehi);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  for (size_t i = 0; i < n; ++i) {
    if (u01(rng) < 0.06) {
      const uint32_t s = sp[rng() % sp.size()];
      std::memcpy(buf.data() + esize(d) * i, &s, esize(d));
      continue;
    }
    double v = std::ldexp(1.0 + u01(rng), ex(rng));
    if ((rng() & 1) != 0) {
      v = -v;
    }
    ref_store(d, buf.data(), i, static_cast<float>(v));
  }
  return buf;
}

// ---------------------------------------------------- guarded buffers ----

// `bytes` of data followed by a guard that must stay untouched. In ASan
// builds the guard is also poisoned, so any read or write of it aborts; the
// data itself is a separate heap block sized exactly, so reads past it are
// caught as well.
class Guarded {
 public:
  static constexpr size_t kGuard = 64;
  static constexpr uint8_t kPattern = 0xa5;

  explicit Guarded(size_t bytes) : bytes_(bytes), store_((bytes + kGuard + 7) / 8 + 1) {
    std::memset(guard(), kPattern, kGuard);
    LION_TEST_POISON(guard(), kGuard);
  }
  Guarded(const Guarded&) = delete;
  Guarded& operator=(const Guarded&) = delete;
  ~Guarded() { LION_TEST_UNPOISON(guard(), kGuard); }

  uint8_t* bytes() { return reinterpret_cast<uint8_t*>(store_.data()); }
  uint64_t* words() { return store_.data(); }
  void fill(const std::vector<uint8_t>& v) {
    copy_bytes(bytes(), v.data(), std::min(v.size(), bytes_));
  }
  bool guard_intact() {
    LION_TEST_UNPOISON(guard(), kGuard);
    bool ok = true;
    for (size_t i = 0; i < kGuard; ++i) {
      ok = ok && guard()[i] == kPattern;
    }
    LION_TEST_POISON(guard(), kGuard);
    return ok;
  }

 private:
  uint8_t* guard() { return bytes() + bytes_; }
  size_t bytes_;
  std::vector<uint64_t> store_;
};

// A Delta the sign collectives produce: with ranks == 1 one rank's sign or a
// vote with a tie (-1, +1, 0, -0), else an average k / N of N ranks
// (k = -N..N, float32 division).
inline float vote_like_delta(std::mt19937_64& rng, int ranks) {
  if (ranks == 1) {
    const float votes[] = {-1.0f, 1.0f, 0.0f, -0.0f};
    return votes[rng() % 4];
  }
  const int k = static_cast<int>(rng() % static_cast<uint64_t>(2 * ranks + 1)) - ranks;
  return static_cast<float>(k) / static_cast<float>(ranks);
}

} // namespace lionbit::optim::lion_test
