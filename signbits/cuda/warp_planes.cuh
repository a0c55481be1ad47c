// Warp-level assembly of bit-plane words (nvcc only): lane l holds the flags
// (element.cuh: kPos / kZero in the low byte for bit l, in the second byte for
// bit l + 32); two 32-bit ballots per plane give the 64-bit words, in every
// lane. ballot_planes_host in element.cuh is the same function on the host.
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

} // namespace lionbit::cuda::detail
