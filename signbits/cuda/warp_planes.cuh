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

// The words of a vector group (element.cuh, "vector groups"): lane l holds
// the bytes of bits 8(l % 8) .. 8(l % 8) + 7 of word l / 8; lanes 8w .. 8w + 3
// make the word's low half, 8w + 4 .. 8w + 7 its high half, and every lane of
// the eight returns word w (join_fragments_host on the host).
__device__ __forceinline__ WordPair join_fragments(const Frag& f) {
  const unsigned lane = threadIdx.x & 31u;
  const unsigned shift = 8u * (lane & 3u);
  uint32_t s = f.sign << shift;
  uint32_t z = f.zero << shift;
  for (int d = 1; d <= 2; d <<= 1) {
    s |= __shfl_xor_sync(kFullMask, s, d);
    z |= __shfl_xor_sync(kFullMask, z, d);
  }
  const uint32_t s_other = __shfl_xor_sync(kFullMask, s, 4);
  const uint32_t z_other = __shfl_xor_sync(kFullMask, z, 4);
  if ((lane & 4u) == 0) {
    return {join_halves(s, s_other), join_halves(z, z_other)};
  }
  return {join_halves(s_other, s), join_halves(z_other, z)};
}

} // namespace lionbit::cuda::detail
