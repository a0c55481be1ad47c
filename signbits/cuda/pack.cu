// pack_signs on the GPU: a warp makes kPackGroups groups of kWordsPerWarpIter
// output words at a time. Whole groups of float32 / bfloat16 / float16
// values at a 16-byte boundary take the vector path (element.cuh, "vector
// groups": lane l reads 8 elements a group in 16-byte loads, every group's
// loads in flight at once (kVecBatch), shuffles join the lanes' bytes, lane
// 8w writes word w); any other group (the launch's edges, int8, float64, an
// unaligned tensor) the ballot path: lane l classifies elements l and l + 32
// of each word (two coalesced loads), two 32-bit ballots give the word, lane u
// writes word u. Only the first and last word of a launch are
// read-modify-written (bits outside [bit_offset, bit_offset + n) keep their
// values).
#include "signbits/cuda/element.cuh"
#include "signbits/cuda/kernels.h"
#include "signbits/cuda/launch.cuh"
#include "signbits/cuda/warp_planes.cuh"

namespace lionbit::cuda {
namespace detail {
namespace {

constexpr int kPackUnroll = kWordsPerWarpIter;

template <DType D>
__global__ void __launch_bounds__(kBlockThreads, kMinBlocksPerSm) pack_kernel(
    const typename Elem<D>::U* __restrict__ src,
    size_t n,
    uint64_t* __restrict__ sign,
    uint64_t* __restrict__ zero,
    unsigned o,
    size_t nwords,
    Counts* counts) {
  constexpr int B = kPackGroups<D>;
  constexpr size_t kUnitWords = size_t{B} * kPackUnroll;
  const unsigned lane = threadIdx.x & 31u;
  const size_t warp = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const size_t nwarps = static_cast<size_t>(gridDim.x) * blockDim.x / 32;
  unsigned long long zeros = 0, nans = 0;
  const bool vec = kVecDtype<D> && vec_aligned<sizeof(typename Elem<D>::U)>(src, o);
  for (size_t k0 = warp * kUnitWords; k0 < nwords; k0 += nwarps * kUnitWords) {
    if constexpr (kVecDtype<D>) {
      if (vec && groups_full(k0, o, n, B)) { // warp-uniform
        Frag fr[B];
        pack_vec_batch<D, B>(src, o, k0, lane, fr);
        commit_frags<false>(fr, B, k0, o, n, sign, zero, &zeros, &nans);
        continue;
      }
    }
#pragma unroll 1 // the edges' path: one copy of its body
    for (int b = 0; b < B; ++b) {
      const size_t k = k0 + static_cast<size_t>(b) * kPackUnroll;
      if (k >= nwords) {
        break;
      }
      if constexpr (kVecDtype<D>) {
        if (vec && group_full(k, o, n)) {
          Frag fr[1];
          pack_vec_batch<D, 1>(src, o, k, lane, fr);
          commit_frags<false>(fr, 1, k, o, n, sign, zero, &zeros, &nans);
          continue;
        }
      }
      unsigned f[kPackUnroll];
      pack_group<D>(src, n, o, k, nwords, lane, f);
#pragma unroll
      for (int u = 0; u < kPackUnroll; ++u) {
        tally_flags(f[u], &zeros, &nans);
        const WordPair wp = ballot_planes(f[u]);
        if (lane == static_cast<unsigned>(u) && k + u < nwords) {
          commit_word(sign, k + u, o, n, wp.sign);
          commit_word(zero, k + u, o, n, wp.zero);
        }
      }
    }
  }
  if (counts != nullptr) {
    add_counts(counts, zeros, nans);
  }
}

template <DType D>
void launch_pack(
    const void* src,
    size_t n,
    uint64_t* sign,
    uint64_t* zero,
    size_t bit_offset,
    Counts* counts,
    cudaStream_t stream) {
  const unsigned o = static_cast<unsigned>(bit_offset % 64);
  const size_t first = bit_offset / 64;
  const size_t nwords = words_out(o, n);
  static const int resident = resident_blocks(pack_kernel<D>);
  const unsigned grid = grid_for(
      nwords, size_t{kWarpsPerBlock} * kPackUnroll * kPackGroups<D>, resident);
  pack_kernel<D><<<grid, kBlockThreads, 0, stream>>>(
      static_cast<const typename Elem<D>::U*>(src), n, sign + first, zero + first, o, nwords,
      counts);
  check_launch("pack_signs");
}

// The lanes' level bytes of `count` vector groups from word k0 (levels_vec_batch):
// each plane's bytes joined, and lane 8w ORs word w of the group in.
__device__ __forceinline__ void or_level_groups(
    const uint64_t* bytes,
    int count,
    size_t k0,
    int p,
    uint64_t* planes,
    size_t plane_words,
    unsigned o,
    size_t n) {
  const unsigned lane = threadIdx.x & 31u;
#pragma unroll
  for (int g = 0; g < count; ++g) {
    for (int b = 0; b < p; ++b) {
      const uint64_t w = join_bytes(static_cast<uint32_t>(bytes[g] >> (8 * b)) & 0xffu);
      if ((lane & 7u) == 0) {
        or_word(
            planes + b * plane_words, k0 + static_cast<size_t>(g) * kWordsPerWarpIter + lane / 8, o,
            n, w);
      }
    }
  }
}

// pack_levels: a warp makes kLevelGroups groups of kWordsPerWarpIter words of
// each plane at a time. Whole groups of values from a 16-byte boundary: lane
// l reads 8 values a group in two 16-byte loads, every group's loads in
// flight at once, transposes their levels into a byte a plane
// (levels_vec_batch), shuffles join each plane's bytes (join_bytes) and lane
// 8w ORs word w in. Other groups, word by word: lane l quantizes elements l
// and l + 32 of the word, two ballots per plane give plane b's word, and lane
// b ORs it in (p <= 8 lanes store).
__global__ void __launch_bounds__(kBlockThreads, kMinBlocksPerSm) pack_levels_kernel(
    const float* __restrict__ c,
    size_t n,
    double factor,
    int p,
    uint64_t* __restrict__ planes,
    size_t plane_words,
    unsigned o,
    size_t nwords,
    Counts* counts) {
  constexpr size_t kUnitWords = size_t{kLevelGroups} * kWordsPerWarpIter;
  const unsigned lane = threadIdx.x & 31u;
  const size_t warp = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const size_t nwarps = static_cast<size_t>(gridDim.x) * blockDim.x / 32;
  const int s = (1 << (p - 1)) - 1;
  const bool vec = vec_aligned<4>(c, o);
  unsigned long long bad = 0;
  for (size_t k0 = warp * kUnitWords; k0 < nwords; k0 += nwarps * kUnitWords) {
    if (vec && groups_full(k0, o, n, kLevelGroups)) { // warp-uniform
      unsigned nonfinite = 0;
      uint64_t bytes[kLevelGroups];
      levels_vec_batch<kLevelGroups>(c, o, k0, lane, factor, s, &nonfinite, bytes);
      bad += nonfinite;
      or_level_groups(bytes, kLevelGroups, k0, p, planes, plane_words, o, n);
      continue;
    }
#pragma unroll 1 // the edges' path: one copy of its body
    for (int g = 0; g < kLevelGroups; ++g) {
      const size_t kg = k0 + static_cast<size_t>(g) * kWordsPerWarpIter;
      if (kg >= nwords) {
        break;
      }
      if (vec && group_full(kg, o, n)) {
        unsigned nonfinite = 0;
        uint64_t bytes[1];
        levels_vec_batch<1>(c, o, kg, lane, factor, s, &nonfinite, bytes);
        bad += nonfinite;
        or_level_groups(bytes, 1, kg, p, planes, plane_words, o, n);
        continue;
      }
      for (size_t k = kg; k < kg + kWordsPerWarpIter && k < nwords; ++k) {
        const unsigned f = levels_lane(c, n, o, k, lane, factor, s);
        bad += ((f >> 16) & 1u) + ((f >> 17) & 1u);
        uint64_t mine = 0;
        for (int b = 0; b < p; ++b) {
          const uint64_t w = join_halves(
              __ballot_sync(kFullMask, ((f >> b) & 1u) != 0),
              __ballot_sync(kFullMask, ((f >> (8 + b)) & 1u) != 0));
          if (lane == static_cast<unsigned>(b)) {
            mine = w;
          }
        }
        if (lane < static_cast<unsigned>(p)) {
          or_word(planes + lane * plane_words, k, o, n, mine);
        }
      }
    }
  }
  if (counts != nullptr) {
    add_counts(counts, 0, bad);
  }
}

} // namespace
} // namespace detail

void pack_levels(
    const float* c,
    size_t n,
    double factor,
    int p,
    uint64_t* planes,
    size_t plane_words,
    size_t bit_offset,
    Counts* counts,
    cudaStream_t stream) {
  if (n == 0) {
    return;
  }
  const unsigned o = static_cast<unsigned>(bit_offset % 64);
  const size_t nwords = detail::words_out(o, n);
  static const int resident = detail::resident_blocks(detail::pack_levels_kernel);
  const unsigned grid = detail::grid_for(
      nwords, size_t{detail::kWarpsPerBlock} * detail::kWordsPerWarpIter * detail::kLevelGroups,
      resident);
  detail::pack_levels_kernel<<<grid, detail::kBlockThreads, 0, stream>>>(
      c, n, factor, p, planes + bit_offset / 64, plane_words, o, nwords, counts);
  detail::check_launch("pack_levels");
}

void pack_signs(
    bits::DType dtype,
    const void* src,
    size_t n,
    uint64_t* sign,
    uint64_t* zero,
    size_t bit_offset,
    Counts* counts,
    cudaStream_t stream) {
  if (n == 0) {
    return;
  }
  using bits::DType;
  switch (dtype) {
    case DType::kFloat32:
      return detail::launch_pack<DType::kFloat32>(src, n, sign, zero, bit_offset, counts, stream);
    case DType::kFloat16:
      return detail::launch_pack<DType::kFloat16>(src, n, sign, zero, bit_offset, counts, stream);
    case DType::kBFloat16:
      return detail::launch_pack<DType::kBFloat16>(src, n, sign, zero, bit_offset, counts, stream);
    case DType::kFloat64:
      return detail::launch_pack<DType::kFloat64>(src, n, sign, zero, bit_offset, counts, stream);
    case DType::kInt8:
      return detail::launch_pack<DType::kInt8>(src, n, sign, zero, bit_offset, counts, stream);
  }
  throw std::runtime_error("lionbit: pack_signs: unknown dtype");
}

} // namespace lionbit::cuda
