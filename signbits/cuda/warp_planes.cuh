// Warp-level assembly of bit-plane words (nvcc only). The ballot path: lane l
// holds the flags (element.cuh: kPos / kZero in the low byte for bit l, in the
// second byte for bit l + 32); two 32-bit ballots per plane give the 64-bit
// words, in every lane. The vector path: lane l holds 8 bits of each plane (a
// Frag), shuffles join them. ballot_planes_host and join_fragments_host in
// element.cuh are the same functions on the host.
#pragma once

#include "signbits/cuda/element.cuh"
#include "signbits/cuda/launch.cuh"

namespace lionbit::cuda::detail {

__device__ __forceinline__ WordPair ballot_planes(unsigned f) {
  WordPair r;
  r.sign = join_halves(
      __ballot_sync(kFullMask, (f & kPos) != 0), __ballot_sync(kFullMask, (f & (kPos << 8)) != 0));
  r.zero = join_halves(
      __ballot_sync(kFullMask, (f & kZero) != 0),
      __ballot_sync(kFullMask, (f & (kZero << 8)) != 0));
  return r;
}

// A word of a vector group (element.cuh, "vector groups"): lane l holds
// byte l % 8 of word l / 8 (its 8 bits of the plane); lanes 8w .. 8w + 3 make
// the word's low half, 8w + 4 .. 8w + 7 its high half, and every lane of the
// eight returns word w (join_bytes_host on the host).
__device__ __forceinline__ uint64_t join_bytes(uint32_t byte) {
  const unsigned lane = threadIdx.x & 31u;
  uint32_t h = byte << (8u * (lane & 3u));
  h |= __shfl_xor_sync(kFullMask, h, 1);
  h |= __shfl_xor_sync(kFullMask, h, 2);
  const uint32_t other = __shfl_xor_sync(kFullMask, h, 4);
  return (lane & 4u) == 0 ? join_halves(h, other) : join_halves(other, h);
}

// Both planes of the lanes' Frags.
__device__ __forceinline__ WordPair join_fragments(const Frag& f) {
  return {join_bytes(f.sign), join_bytes(f.zero)};
}

// Word k of a plane: stored (Shared: as the list kernels store a word that
// another tensor of the launch may share, commit_word_shared).
template <bool Shared>
__device__ __forceinline__ void commit(
    uint64_t* plane,
    size_t k,
    unsigned o,
    size_t n,
    uint64_t v) {
  if constexpr (Shared) {
    commit_word_shared(plane, k, o, n, v);
  } else {
    commit_word(plane, k, o, n, v);
  }
}

// The lanes' Frags of `count` vector groups from word k0 (group b from word
// k0 + b * kWordsPerWarpIter): tallied, joined and stored (without planes,
// sign null: tallied only).
template <bool Shared>
__device__ __forceinline__ void commit_frags(
    const Frag* fr,
    int count,
    size_t k0,
    unsigned o,
    size_t n,
    uint64_t* sign,
    uint64_t* zero,
    unsigned long long* zeros,
    unsigned long long* nans) {
  const unsigned lane = threadIdx.x & 31u;
#pragma unroll
  for (int b = 0; b < count; ++b) {
    tally_frag(fr[b], zeros, nans);
    const WordPair wp = join_fragments(fr[b]);
    if (sign != nullptr && (lane & 7u) == 0) {
      const size_t k = k0 + static_cast<size_t>(b) * kWordsPerWarpIter + lane / 8;
      commit<Shared>(sign, k, o, n, wp.sign);
      commit<Shared>(zero, k, o, n, wp.zero);
    }
  }
}

} // namespace lionbit::cuda::detail
