// Lion Cub's L1 levels (aggregation "l1", signbits/levels.h) straight from
// the gradient and the momentum: two fused passes, no float32 copy of the
// direction. No torch here.
//
//   pass 1, lion_level_abs_sum:  S = sum_i |c_i|, c_i = b1 m_i + omb1 g_i
//   (the caller forms factor = s / (2 S / numel) over the whole tensor,
//   summing the pieces' S when a tensor comes in pieces)
//   pass 2, lion_pack_levels:    q_i = clamp(rint(c_i * factor), -s, s)
//                                ORed into p bit-planes (bits::pack_levels),
//                                and, when asked, m_i <- b2 m_i + omb2 g_i
//
// c_i follows optimizer/lion.h's contract exactly (float32, each operation
// rounded, no fused multiply-add); the levels are bits::level_value of it.
//
// The sum is in float64, in one order on every instruction set: sixteen
// lanes, lane j summing |c_i| (widened exactly) for i = j mod 16 in
// increasing i, then lane j += lane j + 8, j + 4, j + 2, j + 1 (a fixed
// tree). So the scalar, AVX2 and AVX-512 copies agree bit for bit. Other
// kernel sets (ATen, CUDA) sum in their own order: a factor that differs in
// its last bit moves a level only where c * factor lies within an ulp of a
// half.
#pragma once

#include <cstddef>
#include <cstdint>

#include "signbits/isa.h"
#include "signbits/types.h"

namespace lionbit::optim {

// Where the levels go: p planes of plane_words words (plane b at word
// b * plane_words), the tensor's elements at bits [bit_offset, bit_offset + n).
struct LevelPlanes {
  uint64_t* planes;
  size_t plane_words;
  size_t bit_offset;
  int p; // bits::kMinLevelBits .. bits::kMaxLevelBits
};

// Pass 1: sum |c_i| over n elements (see above). A non-finite c makes the
// sum non-finite (the caller's factor is then 0 and the step is refused).
// Dtypes as lion_direction_dtypes_supported; 0 for n == 0 or others.
double lion_level_abs_sum(
    bits::DType grad_dtype,
    const void* g,
    bits::DType momentum_dtype,
    const void* m,
    size_t n,
    float b1,
    float omb1,
    bits::Isa isa = bits::default_isa());

// Pass 2: the levels of c with `factor` ORed into `out` (bits outside the
// tensor's range kept); with update_momentum, m_i <- b2 m_i + omb2 g_i
// (lion.h) in the same pass. Returns the number of non-finite c.
uint64_t lion_pack_levels(
    bits::DType grad_dtype,
    const void* g,
    bits::DType momentum_dtype,
    void* m,
    size_t n,
    float b1,
    float omb1,
    float b2,
    float omb2,
    bool update_momentum,
    double factor,
    const LevelPlanes& out,
    bits::Isa isa = bits::default_isa());

} // namespace lionbit::optim
