// References and inputs shared by test_cuda_host.cpp (the GPU kernels' logic
// run on the host) and test_cuda_kernels.cpp (the kernels on a GPU). The
// references are the CPU kernels (bits/, optimizer/lion.h) plus naive
// bit shuffling around them: bit offsets and the ShardedPlanes layout.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "signbits/count.h"
#include "signbits/pack.h"
#include "signbits/types.h"
#include "signbits/unpack.h"
#include "optimizer/lion.h"

namespace lionbit::cuda_test {

using bits::DType;

inline bool get_bit(const uint64_t* w, size_t i) {
  return ((w[i / 64] >> (i % 64)) & 1u) != 0;
}

inline void set_bit(uint64_t* w, size_t i, bool v) {
  const uint64_t m = 1ull << (i % 64);
  w[i / 64] = v ? (w[i / 64] | m) : (w[i / 64] & ~m);
}

// Copies bits [0, n) of `src` to bits [offset, offset + n) of `dst`.
inline void insert_bits(const uint64_t* src, size_t n, uint64_t* dst, size_t offset) {
  for (size_t i = 0; i < n; ++i) {
    set_bit(dst, offset + i, get_bit(src, i));
  }
}

inline std::vector<uint64_t> random_words(size_t count, std::mt19937_64& rng) {
  std::vector<uint64_t> v(count);
  for (auto& w : v) {
    w = rng();
  }
  return v;
}

// Reference pack at a bit offset: bits::pack_signs into scratch planes, then
// the bits inserted into copies of the original planes.
struct PackRef {
  std::vector<uint64_t> sign, zero;
  bits::PackCounts counts;
};

inline PackRef ref_pack(
    DType dtype,
    const void* src,
    size_t n,
    const std::vector<uint64_t>& sign0,
    const std::vector<uint64_t>& zero0,
    size_t bit_offset) {
  PackRef r{sign0, zero0, {}};
  std::vector<uint64_t> s(bits::words_for(n) + 1), z(bits::words_for(n) + 1);
  r.counts = bits::pack_signs(dtype, src, n, s.data(), z.data());
  insert_bits(s.data(), n, r.sign.data(), bit_offset);
  insert_bits(z.data(), n, r.zero.data(), bit_offset);
  return r;
}

// Plane-major copy (plane b at b * total_words) of ShardedPlanes storage of
// `shards` shards of shard_words words each.
inline std::vector<uint64_t> unshard(
    const std::vector<uint64_t>& sharded,
    int nplanes,
    size_t shard_words,
    int shards) {
  const size_t total = shard_words * static_cast<size_t>(shards);
  std::vector<uint64_t> out(static_cast<size_t>(nplanes) * total + 1);
  for (int r = 0; r < shards; ++r) {
    for (int b = 0; b < nplanes; ++b) {
      for (size_t w = 0; w < shard_words; ++w) {
        out[static_cast<size_t>(b) * total + static_cast<size_t>(r) * shard_words + w] =
            sharded[(static_cast<size_t>(r) * nplanes + b) * shard_words + w];
      }
    }
  }
  return out;
}

inline std::vector<const uint64_t*> plane_ptrs(
    const std::vector<uint64_t>& plane_major,
    int nplanes,
    size_t total_words) {
  std::vector<const uint64_t*> p;
  for (int b = 0; b < nplanes; ++b) {
    p.push_back(plane_major.data() + static_cast<size_t>(b) * total_words);
  }
  return p;
}

// n ranks' contributions to `words` words, stored as the GPU kernels take
// them (rank i at i * stride). zero_mode: 0 no zero planes, 1 zero planes
// with ~1/8 zeros on odd ranks and all-zero planes on even ranks, 2 every
// rank ~1/8 zeros, 3 every element zero, 4 dense zeros (~1/2).
struct RanksData {
  int n;
  size_t words, stride;
  std::vector<uint64_t> sign, zero; // zero empty: no zero planes
  std::vector<bits::Contribution> contributions() const {
    std::vector<bits::Contribution> c;
    for (int i = 0; i < n; ++i) {
      c.push_back(
          {sign.data() + static_cast<size_t>(i) * stride,
           zero.empty() ? nullptr : zero.data() + static_cast<size_t>(i) * stride});
    }
    return c;
  }
};

inline RanksData make_ranks(int n, size_t words, int zero_mode, std::mt19937_64& rng) {
  RanksData d;
  d.n = n;
  d.words = words;
  d.stride = words + (rng() % 3); // a stride larger than words too
  d.sign.assign(static_cast<size_t>(n) * d.stride, 0);
  if (zero_mode != 0) {
    d.zero.assign(static_cast<size_t>(n) * d.stride, 0);
  }
  for (int i = 0; i < n; ++i) {
    for (size_t w = 0; w < d.stride; ++w) {
      uint64_t z = 0;
      switch (zero_mode) {
        case 1:
          z = (i % 2 == 1) ? (rng() & rng() & rng()) : 0;
          break;
        case 2:
          z = rng() & rng() & rng();
          break;
        case 3:
          z = ~0ull;
          break;
        case 4:
          z = rng();
          break;
        default:
          break;
      }
      const size_t at = static_cast<size_t>(i) * d.stride + w;
      d.sign[at] = rng() & ~z;
      if (zero_mode != 0) {
        d.zero[at] = z;
      }
    }
  }
  return d;
}

// Bit patterns of float32 values that exercise every path of the float
// contract: signed zeros, denormals, Inf, NaN, the largest finite values,
// values near the float16 / bfloat16 rounding and overflow thresholds.
inline std::vector<uint32_t> special_f32() {
  std::vector<uint32_t> v = {
      0x00000000u, 0x80000000u, 0x00000001u, 0x80000001u, 0x007fffffu, 0x807fffffu, 0x00800000u,
      0x80800000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7f7fffffu,
      0xff7fffffu, 0x3f800000u, 0xbf800000u, 0x477fe000u, 0x477fefffu, 0x477ff000u, 0x477ff001u,
      0xc77ff000u, 0x38800000u, 0x387fffffu, 0x33000000u, 0x33000001u, 0xb3000000u, 0x33800000u,
      0x337fffffu, 0x3f801000u, 0x3f803000u, 0x3f808000u, 0x3f818000u, 0x7f7f8000u, 0x7f7f7fffu,
  };
  return v;
}

} // namespace lionbit::cuda_test
