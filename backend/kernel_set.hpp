// The kernels a device contributes to the sign collectives. The collectives'
// orchestration (sign_allreduce.cpp, sign_reduce_scatter.cpp, phase1.cpp,
// phase2.cpp) is written once against this interface; a device brings a
// KernelSet and the collectives run the same steps on every device:
//
//   SimdKernelSet  (kernels_simd.cpp)  the CPU's AVX-512 / AVX2 / scalar
//                                      kernels of signbits/ (the default
//                                      on CPU);
//   AtenKernelSet  (kernels_aten.cpp)  the same functions written with ATen
//                                      tensor operations: valid on any
//                                      device torch supports, bit for bit
//                                      equal to the SIMD set, slower;
//   CudaKernelSet  (kernels_cuda.cpp)  the custom CUDA kernels of
//                                      signbits/cuda, each checked against
//                                      the ATen set at first use on a
//                                      device (kernel_check.hpp).
//
// kernels_for(device) picks one (LIONBIT_KERNELS=auto|custom|aten).
//
// Planes are byte tensors: uint8, 1-D, contiguous, a whole number of 64-bit
// words, on the set's device. Bit i of a plane is bit i % 64 of word i / 64
// (little-endian words: bit i % 8 of byte i / 8). A shard's plane is a view
// (narrow) of a larger buffer. Values that the orchestration needs on the
// host (tallies, bit counts, whether a message is corrupt) are returned as
// host values: on a GPU that is a synchronisation of the worker's stream,
// never of the caller's.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "signbits/pack.h"
#include "signbits/ties.h"
#include "signbits/types.h"
#include "signbits/zeros.h"

namespace lionbit {

// The float32 coefficients of optimizer/lion.h that the L1 levels need.
struct LionLevelCoefs {
  float b1, omb1, b2, omb2;
};

// One rank's planes of a shard: its sign plane and, when it holds a zero,
// its zero plane (undefined: no zeros). Neither bit set means -1.
struct PlaneIn {
  at::Tensor sign;
  at::Tensor zero;
};

// The kernels, by name; the self-check (kernel_check.hpp) reports them so.
enum class Kernel : int {
  kPack,
  kPackLevels,
  kClean,
  kCountBits,
  kZeroCodes,
  kEncodeZeros,
  kDecodeZeros,
  kCountCode,
  kVote,
  kVoteLevels,
  kAllZero,
  kBreakTies,
  kEncodeTrits,
  kDecodeTrits,
  kEncodeZeroCounts,
  kApplyZeroCounts,
  kUnpack,
  kCount, // the number of kernels
};

const char* kernel_name(Kernel k);

class KernelSet {
 public:
  virtual ~KernelSet() = default;

  // "simd (avx2)", "aten", "cuda": what lionbit.stats() and the logs say.
  virtual std::string name() const = 0;

  // Writes the signs of src (1-D contiguous, n elements of a sign dtype)
  // into bits [bit_offset, bit_offset + n) of `sign` (set: x > 0) and
  // `zero` (set: x == 0), as bits::pack_signs: on the bit pattern, so
  // denormals are nonzero, -0.0 is zero, +-Inf is +-1, NaN sets neither bit.
  // Every other bit of both planes is left as it is. Returns the tallies
  // (zeros, nans) of src.
  virtual bits::PackCounts pack(
      const at::Tensor& src,
      at::Tensor& sign,
      at::Tensor& zero,
      uint64_t bit_offset) const = 0;

  // bits::pack_levels: c (1-D contiguous float32) quantized with `factor`
  // to p-bit levels ORed into `planes` (p planes of plane_words words each,
  // plane b at word b * plane_words) at bit_offset. Returns the number of
  // non-finite values.
  virtual uint64_t pack_levels(
      const at::Tensor& c,
      double factor,
      int p,
      at::Tensor& planes,
      size_t plane_words,
      uint64_t bit_offset) const = 0;

  // The L1 levels straight from a gradient and a momentum (aggregation
  // "l1", optimizer/lion_levels.h): g and m 1-D contiguous on the set's
  // device in lion_direction's dtypes, c = b1 m + omb1 g as optimizer/lion.h.
  //  level_abs_sum: sum |c| in float64, on the host;
  //  pack_lion_levels: pack_levels of c with `factor` (planes as there) and,
  //    with update_momentum, m <- b2 m + omb2 g in the same pass; returns the
  //    number of non-finite c.
  // The defaults form c with ATen operations on the set's device and call
  // this set's pack_levels (so a device's pack_levels, checked at first use,
  // is what packs); the SIMD set overrides both with the fused passes.
  virtual double level_abs_sum(const at::Tensor& g, const at::Tensor& m, const LionLevelCoefs& k)
      const;
  virtual uint64_t pack_lion_levels(
      const at::Tensor& g,
      at::Tensor& m,
      const LionLevelCoefs& k,
      bool update_momentum,
      double factor,
      int p,
      at::Tensor& planes,
      size_t plane_words,
      uint64_t bit_offset) const;

  // Makes planes a caller packed a valid encoding of n elements (phase1.hpp
  // clean_planes): bits past element n cleared, a zero bit wins over a
  // sign bit. sign and zero hold the same number of words.
  virtual void clean(at::Tensor& sign, at::Tensor& zero, size_t n) const = 0;

  // Set bits of each consecutive block of `block_words` words of `plane`
  // (plane.numel() / 8 a multiple of block_words), on the host.
  virtual std::vector<uint64_t> count_bits(const at::Tensor& plane, size_t block_words) const = 0;

  // The set bits and runs of set bits (bits::count_bits, bits::count_runs)
  // of each consecutive block of `block_words` words of `plane`, on the
  // host: each block's bits::ZeroCode.
  virtual std::vector<bits::ZeroCode> zero_codes(const at::Tensor& plane, size_t block_words)
      const = 0;

  // bits::encode_zeros of `plane` (its words) announced with `code` into
  // `out` (bits::zero_encoding_bytes(code, words) bytes).
  virtual void encode_zeros(const at::Tensor& plane, const bits::ZeroCode& code, at::Tensor& out)
      const = 0;

  // bits::decode_zeros of `in` into `plane` (its words). False: corrupt.
  virtual bool decode_zeros(const at::Tensor& in, const bits::ZeroCode& code, at::Tensor& plane)
      const = 0;

  // bits::count_code of the contributions (every plane the same number of
  // words) into `out`: code_planes(N, any zero plane defined) planes.
  virtual void count_code(const std::vector<PlaneIn>& in, at::Tensor& out) const = 0;

  // bits::vote of the contributions into `sign` and `tie`.
  virtual void vote(const std::vector<PlaneIn>& in, at::Tensor& sign, at::Tensor& tie) const = 0;

  // bits::vote_levels: in[i] holds rank i's p planes of `words` words one
  // after the other (words = sign.numel() / 8).
  virtual void vote_levels(
      const std::vector<at::Tensor>& in,
      int p,
      at::Tensor& sign,
      at::Tensor& tie) const = 0;

  // Where every contribution votes 0 (value_bits 0: bits::all_zero of the
  // zero planes; p: bits::all_zero_levels, in[i].sign holding rank i's p
  // planes one after the other) into `out` (out.numel() / 8 words a plane).
  virtual void all_zero(const std::vector<PlaneIn>& in, int value_bits, at::Tensor& out) const = 0;

  // bits::break_ties: sign |= tie & ~still & tie_word(rule, first_word + w).
  virtual void break_ties(
      at::Tensor& sign,
      const at::Tensor& tie,
      const at::Tensor& still,
      const bits::TieRule& rule,
      uint64_t first_word) const = 0;

  // bits::encode_trits of (sign, tie) into `out` (13 bytes a word).
  virtual void encode_trits(const at::Tensor& sign, const at::Tensor& tie, at::Tensor& out)
      const = 0;

  // bits::decode_trits into dst (1-D contiguous, n = dst.numel() elements of
  // a sign dtype; lut: 3 values of that dtype on the set's device). False:
  // corrupt (a code above 242).
  virtual bool decode_trits(const at::Tensor& trits, const at::Tensor& lut, at::Tensor& dst)
      const = 0;

  // bits::encode_zero_counts of the contributions into `out`
  // (bits::zero_count_list_bytes(capacity) bytes). False: more elements with
  // a zero than `capacity`.
  virtual bool encode_zero_counts(
      const std::vector<PlaneIn>& in,
      uint64_t capacity,
      at::Tensor& out) const = 0;

  // bits::apply_zero_counts: the listed elements of dst (n = dst.numel())
  // rewritten from the zero-aware code's table `zlut`; `planes` the P
  // zero-free code planes, N the ranks. False: corrupt.
  virtual bool apply_zero_counts(
      const at::Tensor& list,
      uint64_t capacity,
      const std::vector<at::Tensor>& planes,
      int N,
      const at::Tensor& zlut,
      at::Tensor& dst) const = 0;

  // bits::unpack: dst[i] = lut[code_i] for i < dst.numel(), bit b of code_i
  // bit i of planes[b]; lut: 2^planes.size() values of dst's dtype on the
  // set's device.
  virtual void unpack(const std::vector<at::Tensor>& planes, const at::Tensor& lut, at::Tensor& dst)
      const = 0;
};

// Which set LIONBIT_KERNELS asks for: "auto" (default), "custom" (the
// device's own kernels, unchecked) or "aten". Anything else raises, naming
// the variable.
enum class KernelChoice { kAuto, kCustom, kAten };
KernelChoice requested_kernels();

// The set the sign collectives use on `device` (CPU: SIMD, or ATen when
// asked; CUDA: the custom kernels checked at first use, or as asked; any
// other device: ATen). Lives as long as the process.
const KernelSet& kernels_for(const c10::Device& device);

// The ATen set and the CPU's SIMD set themselves (for tests and the check).
const KernelSet& aten_kernels();
const KernelSet& simd_kernels();

// The set Python names `name` ("simd", "aten", or in CUDA builds "cuda":
// every custom CUDA kernel, unchecked) for tensors on `device`: the kernel
// check's candidate and reference, the tests' single kernels. Raises
// ValueError naming `op` for an unknown name or a set that does not run on
// `device`.
const KernelSet& named_set(const char* op, const std::string& name, const c10::Device& device);

// A table of `values` as `dtype` (bits::make_lut's rounding) on `device`.
at::Tensor lut_tensor(
    bits::DType dtype,
    const std::vector<double>& values,
    const c10::Device& device);

// Fills in the packed runs' bytes (bits::packed_offer) of each of `codes`
// (the codes of consecutive blocks of `block` words of `plane`, their zeros
// and runs counted) that has zeros: from a host copy of the plane, made once;
// off the CPU only for blocks where bits::packed_worth_a_copy says so.
void offer_packed(const at::Tensor& plane, size_t block, std::vector<bits::ZeroCode>& codes);

// A uint8 tensor of n bytes on `device` (uninitialised).
at::Tensor device_bytes(size_t n, const c10::Device& device);

} // namespace lionbit
