// Helpers shared by the kernel tests: ISAs to compare, random inputs, and
// exact widening of float16 / bfloat16 (independent of the kernels).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "signbits/isa.h"
#include "signbits/types.h"

namespace lionbit::bits::test {

inline std::vector<Isa> supported_isas() {
  std::vector<Isa> v;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (isa_supported(isa)) {
      v.push_back(isa);
    }
  }
  return v;
}

inline std::vector<DType> all_dtypes() {
  return {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64, DType::kInt8};
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float f16_to_float(uint16_t h) {
  const int sign = (h >> 15) & 1;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  double v;
  if (exp == 0) {
    v = std::ldexp(static_cast<double>(mant), -24);
  } else if (exp == 31) {
    v = mant ? std::nan("") : INFINITY;
  } else {
    v = std::ldexp(1.0 + mant / 1024.0, exp - 15);
  }
  return static_cast<float>(sign ? -v : v);
}

// Element i of a raw buffer of `dtype`, widened to double exactly.
inline double value_at(DType dtype, const std::vector<uint8_t>& buf, size_t i) {
  switch (dtype) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, buf.data() + 4 * i, 4);
      return f;
    }
    case DType::kFloat64: {
      double d;
      std::memcpy(&d, buf.data() + 8 * i, 8);
      return d;
    }
    case DType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, buf.data() + 2 * i, 2);
      return f16_to_float(h);
    }
    case DType::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, buf.data() + 2 * i, 2);
      return bf16_to_float(h);
    }
    case DType::kInt8:
      return static_cast<int8_t>(buf[i]);
  }
  return 0;
}

// n random elements: mostly ordinary values, with zeros (both signs),
// denormals, infinities and (if with_nan) NaNs mixed in.
inline std::vector<uint8_t> random_buffer(
    DType dtype,
    size_t n,
    std::mt19937_64& rng,
    bool with_nan,
    double zero_rate = 0.05) {
  std::vector<uint8_t> buf(n * dtype_size(dtype) + 64);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (size_t i = 0; i < n; ++i) {
    const double p = u(rng);
    const bool neg = (rng() & 1) != 0;
    uint64_t bits = rng();
    switch (dtype) {
      case DType::kFloat32: {
        float f = static_cast<float>(u(rng) * 8.0 - 4.0);
        if (p < zero_rate)
          f = neg ? -0.0f : 0.0f;
        else if (p < zero_rate + 0.01)
          f = neg ? -1e-42f : 1e-42f; // denormal
        else if (p < zero_rate + 0.02)
          f = neg ? -INFINITY : INFINITY;
        else if (with_nan && p > 0.995) {
          const uint32_t nanb = 0x7f800001u | static_cast<uint32_t>(bits & 0x7fffff) |
              (neg ? 0x80000000u : 0);
          std::memcpy(&f, &nanb, 4);
        }
        std::memcpy(buf.data() + 4 * i, &f, 4);
        break;
      }
      case DType::kFloat64: {
        double d = u(rng) * 8.0 - 4.0;
        if (p < zero_rate)
          d = neg ? -0.0 : 0.0;
        else if (p < zero_rate + 0.01)
          d = neg ? -4e-320 : 4e-320;
        else if (p < zero_rate + 0.02)
          d = neg ? -INFINITY : INFINITY;
        else if (with_nan && p > 0.995)
          d = std::nan("");
        std::memcpy(buf.data() + 8 * i, &d, 8);
        break;
      }
      case DType::kFloat16:
      case DType::kBFloat16: {
        const uint16_t inf = dtype == DType::kFloat16 ? 0x7c00 : 0x7f80;
        uint16_t h = static_cast<uint16_t>(bits);
        const uint16_t mag = h & 0x7fff;
        if (p < zero_rate)
          h = neg ? 0x8000 : 0;
        else if (!with_nan && mag > inf)
          h = static_cast<uint16_t>(h & 0x83ff); // make finite
        std::memcpy(buf.data() + 2 * i, &h, 2);
        break;
      }
      case DType::kInt8: {
        int8_t v = static_cast<int8_t>(bits);
        if (p < zero_rate) v = 0;
        buf[i] = static_cast<uint8_t>(v);
        break;
      }
    }
  }
  return buf;
}

inline bool bit(const uint64_t* words, size_t i) {
  return ((words[i / 64] >> (i % 64)) & 1u) != 0;
}

} // namespace lionbit::bits::test
