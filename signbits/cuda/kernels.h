// The bit kernels of backend/bits on the GPU: pack, count / vote, unpack and
// the zero and tie planes' tallies and lists.
// Same bit layouts and bitwise the same results as the CPU kernels. No torch
// here; compiled by nvcc into the static library lionbit_bits_cuda.
//
// Every function only enqueues work on `stream` and returns: no host
// synchronisation, no allocation. Pointers are device pointers (the caller
// keeps them alive until the stream has passed the work). n == 0 (or
// words == 0) enqueues nothing. A launch failure throws std::runtime_error
// naming the kernel and the CUDA error.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "signbits/ties.h"
#include "signbits/types.h"

namespace lionbit::cuda {

// Tallies that pack kernels ADD to (the caller zeroes them first): elements
// equal to zero (-0.0 included) and NaN elements (whose sign and zero bits are
// both 0), exactly as bits::PackCounts.
struct Counts {
  unsigned long long zeros;
  unsigned long long nans;
};

// Code bit-planes of gathered shards. The words of shard r are words
// [r * shard_words, (r + 1) * shard_words) of every plane; plane b of shard r
// starts at base + (r * nplanes + b) * shard_words. With shard_words equal to
// the total number of words this is plain plane-major storage (plane b at
// base + b * shard_words). This is what an all-gather of per-shard results
// (each rank's message: its nplanes planes of its shard) produces.
struct ShardedPlanes {
  const uint64_t* base;
  int nplanes; // 0 .. bits::kMaxUnpackPlanes (16)
  size_t shard_words;
};

// Writes the signs of src[0..n) (contiguous, `dtype`) into bits
// [bit_offset, bit_offset + n) of `sign` (bit set: x > 0) and `zero` (bit
// set: x == 0), bit i of the planes being bit i % 64 of word i / 64. All other
// bits of both planes are left as they are (so several tensors can be packed
// end to end into one buffer by successive calls on one stream). The test is
// on the bit pattern as in bits::pack_signs: denormals are nonzero, -0.0 is
// zero, +-Inf is +-1, NaN sets neither bit and is counted.
void pack_signs(
    bits::DType dtype,
    const void* src,
    size_t n,
    uint64_t* sign,
    uint64_t* zero,
    size_t bit_offset,
    Counts* counts,
    cudaStream_t stream);

// bits::pack_levels on the GPU: the p-bit levels of c[0..n) (float32) with
// `factor` ORed into bits [bit_offset, bit_offset + n) of p planes (plane b
// at planes + b * plane_words); other bits are left as they are. Adds the
// number of non-finite values to counts->nans (counts->zeros untouched).
void pack_levels(
    const float* c,
    size_t n,
    double factor,
    int p,
    uint64_t* planes,
    size_t plane_words,
    size_t bit_offset,
    Counts* counts,
    cudaStream_t stream);

// Contributions of n ranks to one shard of `words` words: rank i's sign plane
// at sign + i * stride, its zero plane at zero + i * stride (zero == nullptr:
// no rank has a zero; a rank without zeros may also send an all-zero plane).
// count_code writes bits::code_planes(n, zero != nullptr) planes of `words`
// words, plane b at out + b * words, with exactly the code of
// bits::count_code. n is 1 .. 1024.
void count_code(
    const uint64_t* sign,
    const uint64_t* zero,
    size_t stride,
    int n,
    size_t words,
    uint64_t* out,
    cudaStream_t stream);

// Majority vote as bits::vote: out_sign bit set where Sum > 0, out_zero bit
// set where Sum == 0. Inputs as count_code.
void vote(
    const uint64_t* sign,
    const uint64_t* zero,
    size_t stride,
    int n,
    size_t words,
    uint64_t* out_sign,
    uint64_t* out_zero,
    cudaStream_t stream);

// bits::break_ties on the GPU: sign |= tie & ~still & tie_word(rule, first_word + w).
void break_ties(
    uint64_t* sign,
    const uint64_t* tie,
    const uint64_t* still,
    size_t words,
    const bits::TieRule& rule,
    uint64_t first_word,
    cudaStream_t stream);

// dst[i] = lut[code_i] for i < n (contiguous, `dtype`), where bit b of
// code_i is bit i of plane b (planes as ShardedPlanes). lut: device memory,
// 2^nplanes entries of `dtype` (bits::make_lut builds it on the host).
void unpack(
    bits::DType dtype,
    ShardedPlanes planes,
    size_t n,
    const void* lut,
    void* dst,
    cudaStream_t stream);

// ------------------------------------------------- base 3 (trits.cu) ----

// bits::encode_trits on the GPU: the sign and tie planes (`words` words each)
// into words * 13 bytes of `out`.
void encode_trits(
    const uint64_t* sign,
    const uint64_t* tie,
    size_t words,
    uint8_t* out,
    cudaStream_t stream);

// bits::decode_trits on the GPU: dst[i] = lut[trit_i] for i < n (`dtype`;
// lut: 3 entries in device memory). Sets *bad to 1 (never clears it; the
// caller zeroes it first) where a byte holding one of the n elements is not
// a code (243 or more): a corrupt message, dst then partly written.
void decode_trits(
    bits::DType dtype,
    const uint8_t* trits,
    size_t n,
    const void* lut,
    void* dst,
    unsigned* bad,
    cudaStream_t stream);

// ------------------------------------------- zero and tie planes ----
// (zero_lists.cu)

// Per-block tallies of a plane: for each of `blocks` consecutive blocks of
// block_words words, out[2k] = its set bits and out[2k + 1] its runs (set
// bits whose predecessor in the block is clear), as bits::count_bits and
// bits::count_runs of the block. out: 2 * blocks counters, zeroed here.
void count_blocks(
    const uint64_t* plane,
    size_t block_words,
    size_t blocks,
    unsigned long long* out,
    cudaStream_t stream);

// The backend's clean: bits from `limit` on cleared in both planes (words
// words each), then sign &= ~zero.
void clean(uint64_t* sign, uint64_t* zero, size_t words, uint64_t limit, cudaStream_t stream);

// Which bits of a plane positions() lists: every set bit, the first bit of
// each run, the last bit of each run.
enum class PlaneEdge : int { kBits = 0, kRunFirst = 1, kRunLast = 2 };

// Counters of scratch positions() needs for a plane of `words` words.
size_t positions_scratch(size_t words);

// The positions of the plane's `edge` bits in ascending order, the j-th (+
// add) written as a little-endian uint32 into slot width * j + lane of `out`
// (4-byte slots, any alignment) for j < cap; no other byte is written.
// bits::encode_zeros' list is (kBits, 0, 1, 0), its runs (kRunFirst, 0, 2,
// 0) and (kRunLast, 1, 2, 1), each after the slots were filled with
// bits::kNoIndex. The plane must have fewer than 2^32 bits.
void positions(
    const uint64_t* plane,
    size_t words,
    PlaneEdge edge,
    uint32_t add,
    unsigned width,
    unsigned lane,
    uint64_t cap,
    uint8_t* out,
    unsigned long long* scratch,
    cudaStream_t stream);

// bits::decode_zeros of a list (width 1: `entries` offsets) or a run list
// (width 2: `entries` runs), at most `count` of them used, into `plane` of
// `words` words: the plane is zeroed, then set; *bad is set to 1 where the
// message is corrupt (the plane is then unspecified), else 0.
void decode_entries(
    const uint8_t* in,
    uint64_t entries,
    uint64_t count,
    unsigned width,
    size_t words,
    uint64_t* plane,
    unsigned* bad,
    cudaStream_t stream);

} // namespace lionbit::cuda
