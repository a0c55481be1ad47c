// float16 and bfloat16 on their bit patterns, and the storage traits of
// every dtype the kernels take: written once, for the CPU kernels
// (signbits/, optimizer/), the GPU kernels (signbits/cuda, optimizer/
// lion_cuda.cu, as __host__ __device__ code) and the tables unpack builds.
//
// Conversions are exact where they widen and round to nearest even where
// they narrow (overflow to Inf, float16 subnormals correct, NaN stays a
// quiet NaN): the same functions as x86's vcvtph2ps / vcvtps2ph and as
// torch's own casts on finite values.
//
// Everything here has internal linkage: each translation unit, compiled with
// its own instruction set's flags, keeps its own copy (the linker must never
// pick an AVX-512 copy for a scalar caller).
#pragma once

#include <cstdint>
#include <cstring>

#include "signbits/types.h"

#if defined(__CUDACC__)
#define LIONBIT_HD __host__ __device__ __forceinline__
#else
#define LIONBIT_HD inline
#endif

namespace lionbit::bits {
namespace {

LIONBIT_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

LIONBIT_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// Leading zeros of a nonzero 32-bit value.
LIONBIT_HD int clz32(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __clz(static_cast<int>(x));
#else
  return __builtin_clz(x);
#endif
}

LIONBIT_HD float bf16_to_f32(uint16_t h) {
  return bits_f32(static_cast<uint32_t>(h) << 16);
}

// Exact widening, subnormals included; Inf stays Inf, NaN stays NaN (made
// quiet, payload kept).
LIONBIT_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) {
    return bits_f32(sign | 0x7f800000u | (mant << 13) | (mant != 0 ? 0x400000u : 0u));
  }
  if (exp != 0) {
    return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
  }
  if (mant == 0) {
    return bits_f32(sign);
  }
  // mant * 2^-24 with mant < 2^10: normalise so the leading one is bit 10.
  const uint32_t s = static_cast<uint32_t>(clz32(mant)) - 21u; // 1 .. 10
  return bits_f32(sign | ((113u - s) << 23) | (((mant << s) & 0x3ffu) << 13));
}

// float32 -> bfloat16, round to nearest even, overflow to Inf; NaN -> a
// quiet NaN (top payload bits kept).
LIONBIT_HD uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((u >> 16) | 0x40u);
  }
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// float32 -> float16, round to nearest even: overflow to +-Inf, correct
// subnormals, |f| <= 2^-25 to +-0; NaN -> a quiet NaN.
LIONBIT_HD uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) {
    return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  }
  if (a >= 0x477ff000u) { // 65520 = halfway past 65504 and up: Inf
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (a >= 0x38800000u) { // 2^-14 and up: a normal float16
    const uint32_t r = a - 0x38000000u; // exponent bias 127 -> 15
    return static_cast<uint16_t>(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
  }
  if (a <= 0x33000000u) { // 2^-25 and below (a tie with 0 goes to 0)
    return static_cast<uint16_t>(sign);
  }
  // Subnormal result in units of 2^-24 (may round up to the smallest normal,
  // whose pattern 0x0400 follows 0x03ff).
  const uint32_t e = a >> 23; // 102 .. 112
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e; // 14 .. 24
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  q += (rem > half || (rem == half && (q & 1u) != 0)) ? 1u : 0u;
  return static_cast<uint16_t>(sign | q);
}

} // namespace

// Storage of each dtype: the unsigned type of its bit pattern and, for the
// floating ones, the magnitude mask and the pattern of +Inf (a larger
// magnitude is NaN).
template <DType D>
struct Storage;
template <>
struct Storage<DType::kFloat32> {
  using U = uint32_t;
  static constexpr U kMag = 0x7fffffffu;
  static constexpr U kInf = 0x7f800000u;
  static constexpr bool kFloat = true;
};
template <>
struct Storage<DType::kFloat64> {
  using U = uint64_t;
  static constexpr U kMag = 0x7fffffffffffffffull;
  static constexpr U kInf = 0x7ff0000000000000ull;
  static constexpr bool kFloat = true;
};
template <>
struct Storage<DType::kFloat16> {
  using U = uint16_t;
  static constexpr U kMag = 0x7fff;
  static constexpr U kInf = 0x7c00;
  static constexpr bool kFloat = true;
};
template <>
struct Storage<DType::kBFloat16> {
  using U = uint16_t;
  static constexpr U kMag = 0x7fff;
  static constexpr U kInf = 0x7f80;
  static constexpr bool kFloat = true;
};
template <>
struct Storage<DType::kInt8> {
  using U = uint8_t;
  static constexpr bool kFloat = false;
};

} // namespace lionbit::bits
