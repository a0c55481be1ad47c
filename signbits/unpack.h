// Unpack per-element codes held in bit-planes into a typed buffer.
#pragma once

#include "types.h"
#include "isa.h"

namespace lionbit::bits {

// Largest number of planes unpack() accepts (a table of 2^16 entries).
constexpr int kMaxUnpackPlanes = 16;

// dst[i] = lut[code_i] for i < n, where bit b of code_i is bit i of planes[b].
// lut holds 2^nplanes entries of `dtype`; dst holds n of them.
void unpack(
    DType dtype,
    const uint64_t* const* planes,
    int nplanes,
    size_t n,
    const void* lut,
    void* dst,
    Isa isa = default_isa());

// Writes values[0..count) into lut as `dtype`, rounding the way torch casts a
// float64 tensor: float64 -> float32 -> float16/bfloat16 (round to nearest
// even at each step); int8 truncates toward zero (values are integers here).
void make_lut(DType dtype, const double* values, size_t count, void* lut);

} // namespace lionbit::bits
