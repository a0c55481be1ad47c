// The list kernels' tables and per-unit logic (optimizer/lion_cuda_list.cu):
// host+device, so that tests/cpp/test_cuda_host.cpp runs the very same
// functions on the CPU, emulating the warps and blocks. No CUDA headers when
// compiled by a plain C++ compiler.
#pragma once

#include <cstddef>
#include <cstdint>

#include "signbits/cuda/element.cuh"

namespace lionbit::optim::cuda {

// One tensor of lion_direction_list: gradient and momentum (`n` elements,
// the list's dtypes; m only read), where its new momentum goes (`m_out`, n
// elements of the momentum dtype: m itself for in place, another buffer not
// overlapping m, or nullptr for no momentum write), its bits at `bit_offset`
// of the shared planes, its first work unit (direction_units fills it in).
struct DirectionSeg {
  const void* g;
  const void* m;
  void* m_out;
  uint64_t n;
  uint64_t bit_offset;
  uint64_t first;
};

// One tensor of lion_apply_list: parameter and delta of `n` elements; of
// lion_apply_planes_list: the parameter (delta unused) and its Delta's first
// bit in the planes.
struct ApplySeg {
  void* x;
  const void* delta;
  uint64_t n;
  uint64_t bit_offset;
  uint64_t first;
};

namespace list_detail {

// A direction unit: a warp's kDirGroups groups of plane words (as
// lion_cuda.cu's grid loop, optimizer/lion_warp.cuh); an apply unit: one
// block's kApplyUnit elements (element.cuh).
constexpr size_t kDirUnitWords = size_t{lionbit::cuda::detail::kDirGroups} *
    lionbit::cuda::detail::kWordsPerWarpIter;
constexpr unsigned kApplyThreads = lionbit::cuda::detail::kApplyThreads;
constexpr uint64_t kApplyUnit = lionbit::cuda::detail::kApplyUnit;

} // namespace list_detail

// Fills in each tensor's first unit and returns the list's units.
inline uint64_t direction_units(DirectionSeg* segs, size_t count) {
  uint64_t units = 0;
  for (size_t i = 0; i < count; ++i) {
    segs[i].first = units;
    if (segs[i].n > 0) {
      const size_t words = lionbit::cuda::detail::words_out(
          static_cast<unsigned>(segs[i].bit_offset % 64), static_cast<size_t>(segs[i].n));
      units += (words + list_detail::kDirUnitWords - 1) / list_detail::kDirUnitWords;
    }
  }
  return units;
}

inline uint64_t apply_units(ApplySeg* segs, size_t count) {
  uint64_t units = 0;
  for (size_t i = 0; i < count; ++i) {
    segs[i].first = units;
    units += (segs[i].n + list_detail::kApplyUnit - 1) / list_detail::kApplyUnit;
  }
  return units;
}

// Where unit u of a direction list lies: its tensor (`seg`, the walk's
// SegmentWalk::at(u)), the bit offset within the tensor's first plane word,
// its words, and the unit's first word.
struct DirectionUnit {
  DirectionSeg seg;
  unsigned o;
  size_t nwords;
  size_t k0;
};

LIONBIT_HD DirectionUnit direction_unit(const DirectionSeg& seg, uint64_t u) {
  DirectionUnit d;
  d.seg = seg;
  d.o = static_cast<unsigned>(d.seg.bit_offset % 64);
  d.nwords = lionbit::cuda::detail::words_out(d.o, static_cast<size_t>(d.seg.n));
  d.k0 = static_cast<size_t>(u - d.seg.first) * list_detail::kDirUnitWords;
  return d;
}

// The first element of apply unit u (of tensor s).
LIONBIT_HD size_t apply_first(const ApplySeg& s, uint64_t u) {
  return static_cast<size_t>((u - s.first) * list_detail::kApplyUnit);
}

} // namespace lionbit::optim::cuda
