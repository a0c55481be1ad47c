// Fused kernels of the Distributed Lion optimizer (CPU, SIMD). No torch here.
//
// Per parameter element i, with gradient g, momentum m and parameter x:
//
//   step 1 (lion_direction, before the vote; one pass over g and m):
//     c_i     = b1 * m_i + omb1 * g_i          the update direction
//     sign, zero bit-planes of c_i             what the sign all-reduce sends
//     m_i    <- b2 * m_i + omb2 * g_i          (uses the old m_i)
//   step 2 (lion_apply_*, after the vote gives Delta_i):
//     x_i    <- x_i * decay - lr * Delta_i
//
// ---------------------------------------------------------------------------
// EXACT FLOAT SEMANTICS (a contract: a pure-torch path reproduces it bit for
// bit, and every ISA below computes exactly the same bits):
//
//  * Coefficients are float32 values computed by the caller in double and
//    rounded once to float (round to nearest even):
//        b1    = (float)beta1          omb1  = (float)(1.0 - beta1)
//        b2    = (float)beta2          omb2  = (float)(1.0 - beta2)
//        lr    = (float)lr             decay = (float)(1.0 - lr * wd)
//    (lr * wd and 1.0 - beta are double operations.) The kernels only see
//    these floats.
//  * Inputs are widened exactly to float32: float32 as is, bfloat16 by
//    appending 16 zero bits, float16 exactly (subnormals included).
//  * All arithmetic is float32, every operation rounded on its own (round to
//    nearest even), never a fused multiply-add; in torch terms, with float32
//    tensors and float32 scalars:
//        c     = (b1 * m) + (omb1 * g)
//        m_new = (b2 * m) + (omb2 * g)
//        x_new = (x * decay) - (lr * Delta)
//    i.e. fl(fl(b1*m) + fl(omb1*g)), fl(fl(b2*m) + fl(omb2*g)),
//    fl(fl(x*decay) - fl(lr*Delta)).
//  * Results are stored in the buffer's dtype: float32 as is; bfloat16 and
//    float16 by round to nearest even from float32 (float16: overflow to
//    +-Inf, correct subnormals, values below half the smallest subnormal to
//    +-0; bfloat16: overflow to +-Inf). Signed zeros are kept as IEEE gives
//    them (e.g. -0 - 0 = -0).
//  * Sign of c, taken with float comparisons: c > 0 sets the sign bit; c == 0
//    (+0 or -0) sets the zero bit; c < 0 sets neither; c NaN (g or m NaN, or
//    Inf - Inf) sets neither and is counted in PackCounts::nans. +-Inf is +-1.
//    PackCounts::zeros counts the elements with c == 0.
//  * NaN: wherever a result is NaN a NaN is stored; its sign and payload are
//    NOT part of the contract (x86 propagates one operand's payload, and which
//    one is not fixed when both are NaN; torch's own conversions to
//    bfloat16/float16 disagree on NaN patterns too). Compare NaNs as NaNs.
//  * These are the results under the default floating-point environment
//    (round to nearest, no flush-to-zero / denormals-are-zero). Under FTZ/DAZ
//    the float operations and comparisons flush the way every other float
//    operation in the process does; the conversions from/to bfloat16 and
//    float16 never flush.
// ---------------------------------------------------------------------------
//
// Bit layout of sign/zero/planes: exactly bits::pack_signs / bits::unpack:
// words_for(n) 64-bit words, element i is bit i % 64 of word i / 64; the bits
// past n in the last word are written as 0 by lion_direction.
//
// Preconditions (the caller validates; the kernels do not check):
//  * dtypes: see lion_direction_dtypes_supported / lion_apply_dtypes_supported;
//    an unsupported dtype makes a kernel return without touching anything
//    (lion_direction then returns {}).
//  * every pointer is aligned to its element size and holds n elements (the
//    bit-planes words_for(n) words); n == 0 touches nothing, pointers may be
//    null then.
//  * buffers written do not overlap any other buffer of the same call.
// The kernels are single-threaded. To split a call across threads, cut at
// multiples of 64 elements and offset the bit-plane pointers by i0 / 64.
#pragma once

#include <cstddef>
#include <cstdint>

#include "signbits/isa.h"
#include "signbits/pack.h"
#include "signbits/types.h"

namespace lionbit::optim {

// grad: float32, bfloat16 or float16; momentum: float32 or bfloat16.
bool lion_direction_dtypes_supported(bits::DType grad, bits::DType momentum);

// param: float32, bfloat16 or float16; delta (lion_apply_dense only):
// float32, bfloat16 or float16.
bool lion_param_dtype_supported(bits::DType param);
bool lion_apply_dtypes_supported(bits::DType param, bits::DType delta);

// Step 1, one pass: reads g[0..n) and m[0..n) once, writes m[0..n) (new
// momentum) and words_for(n) words of `sign` and `zero` (the signs of c, see
// above). Returns the number of c == 0, c NaN and c non-finite (NaN or
// +-Inf: an infinite g or m) elements.
bits::PackCounts lion_direction(
    bits::DType grad_dtype,
    const void* g,
    bits::DType momentum_dtype,
    void* m,
    size_t n,
    float b1,
    float omb1,
    float b2,
    float omb2,
    uint64_t* sign,
    uint64_t* zero,
    bits::Isa isa = bits::default_isa());

// Step 1 with the new momentum written elsewhere: the same bits and counts as
// lion_direction, m only read, and m_out[0..n) (m's dtype) given exactly the
// values lion_direction would leave in m. m_out may be m (lion_direction
// itself) or nullptr (lion_direction_only) but must not overlap m otherwise.
// A caller that keeps two momentum buffers computes the next momentum in the
// direction's pass and makes it the momentum (a swap) once every rank has
// agreed to the step: two passes over memory fewer than lion_direction_only
// now and the momentum update after the agreement.
bits::PackCounts lion_direction_to(
    bits::DType grad_dtype,
    const void* g,
    bits::DType momentum_dtype,
    const void* m,
    void* m_out,
    size_t n,
    float b1,
    float omb1,
    float b2,
    float omb2,
    uint64_t* sign,
    uint64_t* zero,
    bits::Isa isa = bits::default_isa());

// Step 1 without the momentum: the same bits and counts as lion_direction,
// m only read. With lion_direction run later on the same g and m (its bits
// discarded), the two give exactly lion_direction's results; the caller can
// look at the counts (and at the other ranks') before any state changes.
bits::PackCounts lion_direction_only(
    bits::DType grad_dtype,
    const void* g,
    bits::DType momentum_dtype,
    const void* m,
    size_t n,
    float b1,
    float omb1,
    uint64_t* sign,
    uint64_t* zero,
    bits::Isa isa = bits::default_isa());

// Step 2 with Delta from a dense buffer (Delta widened exactly to float):
// x[i] = fl(fl(x[i] * decay) - fl(lr * delta[i])) for i < n.
void lion_apply_dense(
    bits::DType param_dtype,
    void* x,
    bits::DType delta_dtype,
    const void* delta,
    size_t n,
    float lr,
    float decay,
    bits::Isa isa = bits::default_isa());

// Step 2 with Delta from a vote's result planes (the sign all-reduce's
// out_planes): element i's Delta is bit bit_offset + i of the planes, 0 where
// its `zero` bit is set, else +1 where its `sign` bit is set, else -1 (as the
// unpack's table {-1, +1, 0, 0} of code sign + 2 * zero). Exactly
// lion_apply_dense with that Delta in any float dtype: the same bits of x.
// The planes need not start on a word: bit_offset is any bit.
void lion_apply_planes(
    bits::DType param_dtype,
    void* x,
    const uint64_t* sign,
    const uint64_t* zero,
    uint64_t bit_offset,
    size_t n,
    float lr,
    float decay,
    bits::Isa isa = bits::default_isa());

// The instruction set whose kernels a call with `isa` runs: `isa` itself when
// this build and CPU support it, otherwise the best supported one below it
// (the same fall-back as the bits kernels; AVX2 also needs F16C).
bits::Isa lion_kernel_isa(bits::Isa isa = bits::default_isa());

} // namespace lionbit::optim
