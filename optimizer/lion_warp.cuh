// One warp's work unit of the lion_direction kernels (the per-tensor kernel of
// lion_cuda.cu and the list kernel of lion_cuda_list.cu; nvcc only): the
// plane words k0 .. k0 + kDirGroups * kWordsPerWarpIter - 1 of one tensor
// (those below nwords), the new momentum stored to m_out (m itself in place,
// a buffer not overlapping m, or nullptr: m only read; hence no __restrict__
// on m or m_out). Where all of the unit's vector groups are whole and g, m and
// m_out aligned (the caller's `vec`: direction_vec_aligned), the vector path
// with kDirBatch<G, M> groups' loads in flight at a time; else group by
// group, each by the vector path where it is whole, by the ballot path where
// it is not (the tensor's edges, or unaligned buffers). tests/cpp/test_cuda_host.cpp emulates it
// (emu_direction_words).
#pragma once

#include "signbits/cuda/element.cuh"
#include "signbits/cuda/launch.cuh"
#include "signbits/cuda/warp_planes.cuh"

namespace lionbit::optim::cuda::warp_unit {

namespace cd = lionbit::cuda::detail;

template <bits::DType G, bits::DType M, bool Shared>
__device__ __forceinline__ void direction_words(
    const typename cd::FloatStore<G>::U* __restrict__ g,
    const typename cd::FloatStore<M>::U* m,
    typename cd::FloatStore<M>::U* m_out,
    size_t n,
    unsigned o,
    size_t k0,
    size_t nwords,
    bool vec,
    const cd::LionCoefs& c,
    uint64_t* sign,
    uint64_t* zero,
    unsigned long long* zeros,
    unsigned long long* nans) {
  constexpr int U = cd::kWordsPerWarpIter;
  const unsigned lane = threadIdx.x & 31u;
  if (vec && cd::groups_full(k0, o, n, cd::kDirGroups)) { // warp-uniform
    cd::Frag fr[cd::kDirGroups];
    cd::lion_direction_vec_groups<G, M, cd::kDirGroups>(g, m, m_out, o, k0, lane, c, fr);
    cd::commit_frags<Shared>(fr, cd::kDirGroups, k0, o, n, sign, zero, zeros, nans);
    return;
  }
#pragma unroll 1 // the edges' path: one copy of its body
  for (int b = 0; b < cd::kDirGroups; ++b) {
    const size_t k = k0 + static_cast<size_t>(b) * U;
    if (k >= nwords) {
      return;
    }
    if (vec && cd::group_full(k, o, n)) {
      cd::Frag fr[1];
      cd::lion_direction_vec_groups<G, M, 1>(g, m, m_out, o, k, lane, c, fr);
      cd::commit_frags<Shared>(fr, 1, k, o, n, sign, zero, zeros, nans);
      continue;
    }
    unsigned f[U];
    cd::lion_direction_group<G, M>(g, m, m_out, n, o, k, nwords, lane, c, f);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      cd::tally_flags(f[u], zeros, nans);
      const cd::WordPair wp = cd::ballot_planes(f[u]);
      if (sign != nullptr && lane == static_cast<unsigned>(u) && k + u < nwords) {
        cd::commit<Shared>(sign, k + u, o, n, wp.sign);
        cd::commit<Shared>(zero, k + u, o, n, wp.zero);
      }
    }
  }
}

} // namespace lionbit::optim::cuda::warp_unit
