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

} // namespace lionbit::cuda::detail
