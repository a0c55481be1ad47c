#include "unpack.h"

#include <cmath>
#include <cstring>

#include "kernels.h"

namespace lionbit::bits {

void unpack(
    DType dtype,
    const uint64_t* const* planes,
    int nplanes,
    size_t n,
    const void* lut,
    void* dst,
    Isa isa) {
  if (n == 0) {
    return;
  }
  detail::kernels_for(isa).unpack(
      dtype_size(dtype), planes, nplanes, n, lut, dst);
}

namespace {

// float32 -> 16-bit float, round to nearest even. `mant_bits` is the stored
// mantissa width (10 for float16, 7 for bfloat16), `exp_bits` the exponent's.
uint16_t round_float(float f, int exp_bits, int mant_bits) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t sign = (u >> 16) & 0x8000u;
  if (std::isnan(f)) {
    return static_cast<uint16_t>(sign | (((1u << exp_bits) - 1) << mant_bits) |
                                 (1u << (mant_bits - 1)));
  }
  if (exp_bits == 8) { // bfloat16: same exponent range as float32
    const uint32_t lsb = (u >> 16) & 1u;
    return static_cast<uint16_t>((u + 0x7fffu + lsb) >> 16);
  }
  // float16 via exact double arithmetic on the magnitude.
  const double a = std::fabs(static_cast<double>(f));
  const int bias = (1 << (exp_bits - 1)) - 1;
  const double min_normal = std::ldexp(1.0, 1 - bias);
  uint32_t out;
  if (a == 0.0) {
    out = 0;
  } else if (std::isinf(a)) {
    out = ((1u << exp_bits) - 1) << mant_bits;
  } else if (a < min_normal) {
    // subnormal: units of 2^(1 - bias - mant_bits)
    const double q = std::nearbyint(std::ldexp(a, bias - 1 + mant_bits));
    out = static_cast<uint32_t>(q); // may round up into the smallest normal
  } else {
    int e;
    const double m = std::frexp(a, &e); // a = m * 2^e, m in [0.5, 1)
    double q = std::nearbyint(std::ldexp(m, mant_bits + 1)); // [2^m, 2^(m+1)]
    if (q == std::ldexp(1.0, mant_bits + 1)) {
      q /= 2;
      ++e;
    }
    const int biased = e - 1 + bias;
    if (biased >= (1 << exp_bits) - 1) {
      out = ((1u << exp_bits) - 1) << mant_bits; // rounds past the top: Inf
    } else {
      out = (static_cast<uint32_t>(biased) << mant_bits) |
          (static_cast<uint32_t>(q) & ((1u << mant_bits) - 1));
    }
  }
  return static_cast<uint16_t>(sign | out);
}

} // namespace

void make_lut(DType dtype, const double* values, size_t count, void* lut) {
  for (size_t i = 0; i < count; ++i) {
    const double v = values[i];
    switch (dtype) {
      case DType::kFloat64:
        static_cast<double*>(lut)[i] = v;
        break;
      case DType::kFloat32:
        static_cast<float*>(lut)[i] = static_cast<float>(v);
        break;
      case DType::kFloat16:
        static_cast<uint16_t*>(lut)[i] =
            round_float(static_cast<float>(v), 5, 10);
        break;
      case DType::kBFloat16:
        static_cast<uint16_t*>(lut)[i] =
            round_float(static_cast<float>(v), 8, 7);
        break;
      case DType::kInt8:
        static_cast<int8_t*>(lut)[i] = static_cast<int8_t>(v);
        break;
    }
  }
}

} // namespace lionbit::bits
