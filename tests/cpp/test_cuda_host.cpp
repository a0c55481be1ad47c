// The logic of the GPU kernels, run on the host: signbits/cuda/element.cuh is
// compiled here by g++ (-ffp-contract=off) and every per-element, per-lane and
// per-word function the kernels call is checked against the CPU kernels. The
// word-per-warp kernels are emulated with the same grid loop as the .cu files
// (warps, kWordsPerWarpIter words per iteration, 32 lanes, the two ballots per
// plane as ballot_planes_host), so the index math, the bit offsets and the
// read-modify-write of the boundary words are verified without a GPU.
#include "signbits/cuda/element.cuh"
#include "signbits/cuda/trits.cuh"
#include "optimizer/lion_list.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda_test_ref.h"
#include "signbits/levels.h"
#include "signbits/trits.h"
#include "lion_test_util.h"

namespace lionbit::cuda_test {
namespace {

namespace cd = lionbit::cuda::detail;
using cd::Elem;
using cd::FloatStore;

std::string dname(DType d) {
  return bits::dtype_name(d);
}

// ----------------------------------------------------- emulated kernels ----

// Vector groups the emulated kernels took (element.cuh, "vector groups"),
// and units whose groups went as one batch (several groups' loads in flight):
// the tests check that their data reaches every path.
size_t g_vec_groups = 0;
size_t g_vec_batches = 0;

// The stores of a vector group from word k0: lane 8w's word w (join_fragments
// on the device), written as `commit` writes it.
template <typename Commit>
void emu_vec_words(const cd::Frag (&fr)[32], size_t k0, Commit commit) {
  for (unsigned w = 0; w < static_cast<unsigned>(cd::kWordsPerWarpIter); ++w) {
    commit(k0 + w, cd::join_fragments_host(fr, w));
  }
  ++g_vec_groups;
}

// B vector groups from word k0 as the kernels make them: lane l's Frags from
// frags(l, fr) (the kernel's batch function), tallied, joined and stored
// (warp_planes.cuh's commit_frags) as `commit` writes a word; `batched`: the
// groups' loads went at once (counted in g_vec_batches).
template <int B, typename Frags, typename Commit>
void emu_vec_groups(
    Frags frags,
    size_t k0,
    Commit commit,
    unsigned long long* zeros,
    unsigned long long* nans,
    bool batched) {
  cd::Frag fr[32][B];
  for (unsigned lane = 0; lane < 32; ++lane) {
    frags(lane, fr[lane]);
    for (int b = 0; b < B; ++b) {
      cd::tally_frag(fr[lane][b], zeros, nans);
    }
  }
  for (int b = 0; b < B; ++b) {
    cd::Frag one[32];
    for (unsigned lane = 0; lane < 32; ++lane) {
      one[lane] = fr[lane][b];
    }
    emu_vec_words(one, k0 + static_cast<size_t>(b) * cd::kWordsPerWarpIter, commit);
  }
  g_vec_batches += batched ? 1 : 0;
}

// pack_kernel of signbits/cuda/pack.cu with `nwarps` warps in the grid.
template <DType D>
bits::PackCounts emu_pack(
    const void* src,
    size_t n,
    uint64_t* sign,
    uint64_t* zero,
    size_t bit_offset,
    size_t nwarps) {
  const unsigned o = static_cast<unsigned>(bit_offset % 64);
  uint64_t* s = sign + bit_offset / 64;
  uint64_t* z = zero + bit_offset / 64;
  const size_t nwords = cd::words_out(o, n);
  constexpr int U = cd::kWordsPerWarpIter;
  constexpr int B = cd::kPackGroups<D>;
  constexpr size_t W = size_t{B} * U;
  unsigned long long zeros = 0, nans = 0;
  const auto* sp = static_cast<const typename Elem<D>::U*>(src);
  const bool vec = cd::kVecDtype<D> && cd::vec_aligned<sizeof(typename Elem<D>::U)>(src, o);
  const auto commit = [&](size_t k, const cd::WordPair& wp) {
    cd::commit_word(s, k, o, n, wp.sign);
    cd::commit_word(z, k, o, n, wp.zero);
  };
  // C vector groups from word k0, every lane's Frags.
  const auto vec_groups = [&](auto batch, size_t k0) {
    constexpr int C = decltype(batch)::value;
    const auto frags = [&](unsigned lane, cd::Frag* fr) {
      cd::pack_vec_batch<D, C>(sp, o, k0, lane, fr);
    };
    emu_vec_groups<C>(frags, k0, commit, &zeros, &nans, C > 1);
  };
  for (size_t warp = 0; warp < nwarps; ++warp) {
    for (size_t k0 = warp * W; k0 < nwords; k0 += nwarps * W) {
      if constexpr (cd::kVecDtype<D>) {
        if (vec && cd::groups_full(k0, o, n, B)) {
          vec_groups(std::integral_constant<int, B>{}, k0);
          continue;
        }
      }
      for (int b = 0; b < B; ++b) {
        const size_t k = k0 + static_cast<size_t>(b) * U;
        if (k >= nwords) {
          break;
        }
        if constexpr (cd::kVecDtype<D>) {
          if (vec && cd::group_full(k, o, n)) {
            vec_groups(std::integral_constant<int, 1>{}, k);
            continue;
          }
        }
        unsigned f[U][32];
        for (unsigned lane = 0; lane < 32; ++lane) {
          unsigned fl[U];
          cd::pack_group<D>(sp, n, o, k, nwords, lane, fl);
          for (int u = 0; u < U; ++u) {
            f[u][lane] = fl[u];
          }
        }
        for (int u = 0; u < U; ++u) {
          for (unsigned lane = 0; lane < 32; ++lane) {
            cd::tally_flags(f[u][lane], &zeros, &nans);
          }
          if (k + u < nwords) { // lane u's store
            commit(k + u, cd::ballot_planes_host(f[u]));
          }
        }
      }
    }
  }
  return {zeros, nans};
}

bits::PackCounts emu_pack_any(
    DType d,
    const void* src,
    size_t n,
    uint64_t* sign,
    uint64_t* zero,
    size_t bit_offset,
    size_t nwarps) {
  switch (d) {
    case DType::kFloat32:
      return emu_pack<DType::kFloat32>(src, n, sign, zero, bit_offset, nwarps);
    case DType::kFloat16:
      return emu_pack<DType::kFloat16>(src, n, sign, zero, bit_offset, nwarps);
    case DType::kBFloat16:
      return emu_pack<DType::kBFloat16>(src, n, sign, zero, bit_offset, nwarps);
    case DType::kFloat64:
      return emu_pack<DType::kFloat64>(src, n, sign, zero, bit_offset, nwarps);
    case DType::kInt8:
      return emu_pack<DType::kInt8>(src, n, sign, zero, bit_offset, nwarps);
  }
  return {};
}

// count_code_kernel / vote_kernel of signbits/cuda/count.cu (one thread per
// word; the grid order does not matter, each word is independent).
template <int P>
void emu_count(const RanksData& d, bool zeros, uint64_t* out) {
  const uint64_t* zp = zeros ? d.zero.data() : nullptr;
  const int planes = cd::width_of(static_cast<uint32_t>(zeros ? 2 * d.n : d.n));
  for (size_t w = 0; w < d.words; ++w) {
    uint64_t code[P + 1];
    cd::code_word<P>(d.sign.data(), zp, d.stride, d.n, w, code);
    for (int b = 0; b <= P; ++b) {
      if (b < planes) {
        out[static_cast<size_t>(b) * d.words + w] = code[b];
      }
    }
  }
}

template <int P>
void emu_vote(const RanksData& d, bool zeros, uint64_t* out_sign, uint64_t* out_zero) {
  const uint64_t* zp = zeros ? d.zero.data() : nullptr;
  for (size_t w = 0; w < d.words; ++w) {
    cd::vote_word<P>(d.sign.data(), zp, d.stride, d.n, w, out_sign + w, out_zero + w);
  }
}

#define LIONBIT_FOR_PLANES(P, FN, ...)   \
  switch (P) {                           \
    case 1:                              \
      FN<1>(__VA_ARGS__);                \
      break;                             \
    case 2:                              \
      FN<2>(__VA_ARGS__);                \
      break;                             \
    case 3:                              \
      FN<3>(__VA_ARGS__);                \
      break;                             \
    case 4:                              \
      FN<4>(__VA_ARGS__);                \
      break;                             \
    case 5:                              \
      FN<5>(__VA_ARGS__);                \
      break;                             \
    case 6:                              \
      FN<6>(__VA_ARGS__);                \
      break;                             \
    case 7:                              \
      FN<7>(__VA_ARGS__);                \
      break;                             \
    case 8:                              \
      FN<8>(__VA_ARGS__);                \
      break;                             \
    case 11:                             \
      FN<11>(__VA_ARGS__);               \
      break;                             \
    default:                             \
      FAIL() << "no kernel for P=" << P; \
  }

// unpack_kernel of signbits/cuda/unpack.cu.
template <typename S, int NP = -1>
void emu_unpack(
    const uint64_t* base,
    int nplanes,
    size_t shard_words,
    size_t n,
    const void* lut,
    void* dst,
    size_t nwarps) {
  const size_t nwords = (n + 63) / 64;
  constexpr int U = cd::kWordsPerWarpIter;
  const bool vec = reinterpret_cast<uintptr_t>(dst) % 16u == 0u;
  constexpr size_t W = size_t{cd::kUnpackVec<S, NP> ? cd::kUnpackGroups : 1} * U;
  // The vector path's LUT entries in registers (NP < 0, planes counted at run time: none).
  constexpr int kEntries = cd::kUnpackVec<S, NP> ? 1 << NP : 1;
  S regs[kEntries] = {};
  if constexpr (cd::kUnpackVec<S, NP>) {
    std::memcpy(regs, lut, sizeof regs);
  }
  // C vector groups from word k0, every lane's stores.
  const auto vec_groups = [&](auto groups, size_t k0) {
    constexpr int C = decltype(groups)::value;
    for (unsigned lane = 0; lane < 32; ++lane) {
      cd::unpack_vec_batch<S, NP, C>(base, shard_words, k0, lane, regs, static_cast<S*>(dst));
    }
    g_vec_groups += C;
    g_vec_batches += C > 1 ? 1 : 0;
  };
  for (size_t warp = 0; warp < nwarps; ++warp) {
    for (size_t k0 = warp * W; k0 < nwords; k0 += nwarps * W) {
      if constexpr (cd::kUnpackVec<S, NP>) {
        if (vec && (k0 + W) * 64 <= n) {
          vec_groups(std::integral_constant<int, cd::kUnpackGroups>{}, k0);
          continue;
        }
      }
      for (size_t k = k0; k < k0 + W && k < nwords; k += U) {
        if constexpr (cd::kUnpackVec<S, NP>) {
          if (vec && (k + U) * 64 <= n) {
            vec_groups(std::integral_constant<int, 1>{}, k);
            continue;
          }
        }
        for (unsigned lane = 0; lane < 32; ++lane) {
          cd::unpack_group<S, NP>(
              base, nplanes, shard_words, n, k, lane, static_cast<const S*>(lut),
              static_cast<S*>(dst));
        }
      }
    }
  }
}

// One warp's unit of the direction kernels (optimizer/lion_warp.cuh's
// direction_words): words k0 .. k0 + kDirGroups * kWordsPerWarpIter - 1 of
// one tensor, below nwords, the new momentum into m_out (m in place, another
// buffer, or nullptr); `shared`: the list kernel's stores.
template <DType G, DType M>
void emu_direction_words(
    const typename FloatStore<G>::U* g,
    const typename FloatStore<M>::U* m,
    typename FloatStore<M>::U* m_out,
    size_t n,
    unsigned o,
    size_t k0,
    size_t nwords,
    bool vec,
    const cd::LionCoefs& k,
    uint64_t* s,
    uint64_t* z,
    bool shared,
    unsigned long long* zeros,
    unsigned long long* nans) {
  constexpr int U = cd::kWordsPerWarpIter;
  const auto commit = [&](size_t kw, const cd::WordPair& wp) {
    if (s == nullptr) {
      return;
    }
    if (shared) {
      cd::commit_word_shared(s, kw, o, n, wp.sign);
      cd::commit_word_shared(z, kw, o, n, wp.zero);
    } else {
      cd::commit_word(s, kw, o, n, wp.sign);
      cd::commit_word(z, kw, o, n, wp.zero);
    }
  };
  const auto vec_groups = [&](auto groups, size_t kv) {
    constexpr int C = decltype(groups)::value;
    const auto frags = [&](unsigned lane, cd::Frag* fr) {
      cd::lion_direction_vec_groups<G, M, C>(g, m, m_out, o, kv, lane, k, fr);
    };
    // a batch where the kernel loads its groups at once (kDirBatch: not float32 / float32)
    emu_vec_groups<C>(frags, kv, commit, zeros, nans, C > 1 && (cd::kDirBatch<G, M> > 1));
  };

  if (vec && cd::groups_full(k0, o, n, cd::kDirGroups)) {
    vec_groups(std::integral_constant<int, cd::kDirGroups>{}, k0);
    return;
  }
  for (int b = 0; b < cd::kDirGroups; ++b) {
    const size_t kb = k0 + static_cast<size_t>(b) * U;
    if (kb >= nwords) {
      return;
    }
    if (vec && cd::group_full(kb, o, n)) {
      vec_groups(std::integral_constant<int, 1>{}, kb);
      continue;
    }
    unsigned f[U][32];
    for (unsigned lane = 0; lane < 32; ++lane) {
      unsigned fl[U];
      cd::lion_direction_group<G, M>(g, m, m_out, n, o, kb, nwords, lane, k, fl);
      for (int u = 0; u < U; ++u) {
        f[u][lane] = fl[u];
      }
    }
    for (int u = 0; u < U; ++u) {
      for (unsigned lane = 0; lane < 32; ++lane) {
        cd::tally_flags(f[u][lane], zeros, nans);
      }
      if (kb + u < nwords) {
        commit(kb + u, cd::ballot_planes_host(f[u]));
      }
    }
  }
}

// direction_kernel of optimizer/lion_cuda.cu with `nwarps` warps in the grid:
// the new momentum into m_out (m in place, another buffer, or nullptr: m only
// read).
template <DType G, DType M>
bits::PackCounts emu_direction(
    const void* g,
    const void* m,
    void* m_out,
    size_t n,
    const cd::LionCoefs& k,
    uint64_t* sign,
    uint64_t* zero,
    size_t bit_offset,
    size_t nwarps) {
  const unsigned o = static_cast<unsigned>(bit_offset % 64);
  const size_t nwords = cd::words_out(o, n);
  constexpr size_t W = size_t{cd::kDirGroups} * cd::kWordsPerWarpIter;
  unsigned long long zeros = 0, nans = 0;
  const bool vec = cd::direction_vec_aligned<G, M>(g, m, m_out, o);
  for (size_t warp = 0; warp < nwarps; ++warp) {
    for (size_t k0 = warp * W; k0 < nwords; k0 += nwarps * W) {
      emu_direction_words<G, M>(
          static_cast<const typename FloatStore<G>::U*>(g),
          static_cast<const typename FloatStore<M>::U*>(m),
          static_cast<typename FloatStore<M>::U*>(m_out), n, o, k0, nwords, vec, k,
          sign + bit_offset / 64, zero + bit_offset / 64, false, &zeros, &nans);
    }
  }
  return {zeros, nans};
}

// One block's apply unit from element `first`: its threads' shares, the
// unit counted in g_vec_groups where it takes the vector path.
template <DType X, DType Dl>
void emu_apply_unit(void* x, const void* delta, size_t n, size_t first, float lr, float decay) {
  const bool vec = cd::apply_vec_aligned(x, delta);
  g_vec_groups += vec && first + cd::kApplyUnit <= n ? 1 : 0;
  for (unsigned t = 0; t < cd::kApplyThreads; ++t) {
    cd::lion_apply_unit<X, Dl>(
        static_cast<typename FloatStore<X>::U*>(x),
        static_cast<const typename FloatStore<Dl>::U*>(delta), n, first, t, vec, lr, decay);
  }
}

// apply_dense_kernel of optimizer/lion_cuda.cu: its grid loop with a grid of
// `blocks` blocks.
template <DType X, DType Dl>
void emu_apply_dense(void* x, const void* delta, size_t n, float lr, float decay, size_t blocks) {
  const size_t units = (n + cd::kApplyUnit - 1) / cd::kApplyUnit;
  for (size_t b = 0; b < blocks; ++b) {
    for (size_t u = b; u < units; u += blocks) {
      emu_apply_unit<X, Dl>(x, delta, n, u * cd::kApplyUnit, lr, decay);
    }
  }
}

// ----------------------------------------------------------- test data ----

// Random float-storage buffer (float32, bfloat16, float16) of n elements:
// ordinary values, signed zeros, denormals, Inf, NaN, rounding edge cases.
std::vector<uint8_t> random_floats(DType d, size_t n, std::mt19937_64& rng, bool nan = true) {
  std::vector<uint8_t> buf(n * bits::dtype_size(d) + 16);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  const auto specials = special_f32();
  for (size_t i = 0; i < n; ++i) {
    const unsigned pick = static_cast<unsigned>(rng() % 100);
    float f;
    uint32_t bitsv = 0;
    if (pick < 70) {
      f = u(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20);
      std::memcpy(&bitsv, &f, 4);
    } else if (pick < 85) {
      bitsv = specials[rng() % specials.size()];
    } else {
      bitsv = static_cast<uint32_t>(rng());
    }
    if (!nan && (bitsv & 0x7fffffffu) > 0x7f800000u) {
      bitsv &= 0xff7fffffu; // finite
    }
    if (d == DType::kFloat32) {
      std::memcpy(buf.data() + 4 * i, &bitsv, 4);
    } else {
      uint16_t h = static_cast<uint16_t>(pick < 85 ? (bitsv >> 16) : bitsv);
      if (d == DType::kFloat16 && pick < 85) {
        float ff;
        std::memcpy(&ff, &bitsv, 4);
        h = lionbit::optim::lion_test::ref_narrow(DType::kFloat16, ff);
      }
      if (!nan) {
        const uint16_t inf = d == DType::kFloat16 ? 0x7c00 : 0x7f80;
        if ((h & 0x7fff) > inf) {
          h = static_cast<uint16_t>(h & 0x83ff);
        }
      }
      std::memcpy(buf.data() + 2 * i, &h, 2);
    }
  }
  return buf;
}

std::vector<size_t> small_sizes() {
  return {1, 2, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 4097};
}

// ---------------------------------------------------------- conversions ----

TEST(CudaHostConvert, Float16WideningAllPatterns) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = cd::f16_to_f32(static_cast<uint16_t>(h));
    const float want = bits::test::f16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << h;
    } else {
      ASSERT_EQ(cd::f32_bits(got), cd::f32_bits(want)) << std::hex << h;
    }
  }
}

TEST(CudaHostConvert, BFloat16WideningAllPatterns) {
  for (uint32_t h = 0; h < 65536; ++h) {
    ASSERT_EQ(cd::f32_bits(cd::bf16_to_f32(static_cast<uint16_t>(h))), h << 16);
  }
}

// Narrowing against the double-based reference of lion_test_util.h: every
// exponent, mantissas around every rounding boundary, random patterns.
TEST(CudaHostConvert, NarrowingMatchesReference) {
  using lionbit::optim::lion_test::ref_narrow;
  std::mt19937_64 rng(7);
  std::vector<uint32_t> pats = special_f32();
  const uint32_t lows[] = {0x0,     0x1,     0xfff,    0x1000,   0x1001,   0x1fff,
                           0x2000,  0x3000,  0x7fff,   0x8000,   0x8001,   0xffff,
                           0x10000, 0x18000, 0x7fffff, 0x400000, 0x3ff000, 0x7fe000};
  for (uint32_t sign = 0; sign < 2; ++sign) {
    for (uint32_t e = 0; e < 256; ++e) {
      for (uint32_t lo : lows) {
        for (int r = 0; r < 4; ++r) {
          const uint32_t hi = r == 0 ? 0u : static_cast<uint32_t>(rng()) & 0x7f0000u;
          const uint32_t m = (hi | lo) & 0x7fffffu;
          pats.push_back((sign << 31) | (e << 23) | m);
          // the same mantissa with the float16 rounding bits moved around
          pats.push_back((sign << 31) | (e << 23) | ((m & ~0x1fffu) | (lo & 0x1fffu)));
        }
      }
    }
  }
  for (int i = 0; i < 2000000; ++i) {
    pats.push_back(static_cast<uint32_t>(rng()));
  }
  // every float32 whose float16 result is subnormal or near the top
  for (uint32_t a = 0x33000000u - 64; a < 0x38800000u + 64; a += 97) {
    pats.push_back(a);
    pats.push_back(a | 0x80000000u);
  }
  for (uint32_t a = 0x477f0000u; a < 0x47800010u; ++a) {
    pats.push_back(a);
  }
  for (uint32_t p : pats) {
    const float f = cd::bits_f32(p);
    const uint16_t bf = cd::f32_to_bf16(f);
    const uint16_t hf = cd::f32_to_f16(f);
    if (std::isnan(f)) {
      ASSERT_GT(bf & 0x7fff, 0x7f80) << std::hex << p;
      ASSERT_GT(hf & 0x7fff, 0x7c00) << std::hex << p;
      continue;
    }
    ASSERT_EQ(bf, ref_narrow(DType::kBFloat16, f)) << std::hex << p;
    ASSERT_EQ(hf, ref_narrow(DType::kFloat16, f)) << std::hex << p;
  }
}

// ------------------------------------------------------------------ pack ----

TEST(CudaHostPack, ClassifyMatchesCpuOnEveryHalfPattern) {
  for (DType d : {DType::kFloat16, DType::kBFloat16}) {
    std::vector<uint16_t> all(65536);
    for (uint32_t h = 0; h < 65536; ++h) {
      all[h] = static_cast<uint16_t>(h);
    }
    std::vector<uint64_t> s(1024), z(1024);
    const auto c = bits::pack_signs(d, all.data(), all.size(), s.data(), z.data());
    uint64_t zeros = 0, nans = 0;
    for (uint32_t h = 0; h < 65536; ++h) {
      const unsigned f = d == DType::kFloat16 ? cd::classify<DType::kFloat16>(all[h])
                                              : cd::classify<DType::kBFloat16>(all[h]);
      ASSERT_EQ((f & cd::kPos) != 0, get_bit(s.data(), h)) << dname(d) << std::hex << h;
      ASSERT_EQ((f & cd::kZero) != 0, get_bit(z.data(), h)) << dname(d) << std::hex << h;
      zeros += (f & cd::kZero) != 0;
      nans += (f & cd::kNan) != 0;
    }
    EXPECT_EQ(zeros, c.zeros);
    EXPECT_EQ(nans, c.nans);
  }
  for (uint32_t v = 0; v < 256; ++v) {
    const unsigned f = cd::classify<DType::kInt8>(static_cast<uint8_t>(v));
    const auto s = static_cast<int8_t>(v);
    EXPECT_EQ(f, s > 0 ? cd::kPos : (s == 0 ? cd::kZero : 0u));
  }
}

// classify8 (the vector groups' 8 values on whole words) against classify,
// value by value: every 2-byte pattern in every position of the 8, float32
// specials and random patterns.
template <DType D>
void check_classify8(const std::vector<typename Elem<D>::U>& vals) {
  using U = typename Elem<D>::U;
  for (size_t at = 0; at < 8; ++at) { // vals[j] at position (j + at) % 8
    for (size_t j0 = 0; j0 + 8 <= vals.size(); j0 += 8) {
      U v[8];
      for (size_t i = 0; i < 8; ++i) {
        v[(i + at) % 8] = vals[j0 + i];
      }
      uint32_t w[2 * sizeof(U)];
      std::memcpy(w, v, sizeof v);
      const cd::Frag f = cd::classify8<D>(w);
      uint32_t nans = 0;
      for (unsigned i = 0; i < 8; ++i) {
        const unsigned c = cd::classify<D>(v[i]);
        ASSERT_EQ((f.sign >> i) & 1u, (c & cd::kPos) != 0 ? 1u : 0u)
            << dname(D) << std::hex << " value " << +v[i] << " at " << i;
        ASSERT_EQ((f.zero >> i) & 1u, (c & cd::kZero) != 0 ? 1u : 0u)
            << dname(D) << std::hex << " value " << +v[i] << " at " << i;
        nans += (c & cd::kNan) != 0 ? 1u : 0u;
      }
      ASSERT_EQ(f.sign >> 8, 0u);
      ASSERT_EQ(f.zero >> 8, 0u);
      ASSERT_EQ(f.nans, nans) << dname(D) << " values from " << j0;
    }
  }
}

TEST(CudaHostPack, Classify8MatchesClassify) {
  std::vector<uint16_t> halves(65536);
  for (uint32_t h = 0; h < 65536; ++h) {
    halves[h] = static_cast<uint16_t>(h);
  }
  check_classify8<DType::kBFloat16>(halves);
  check_classify8<DType::kFloat16>(halves);
  std::mt19937_64 rng(13);
  std::vector<uint32_t> words;
  for (uint32_t sp : special_f32()) {
    words.push_back(sp);
  }
  for (uint32_t e :
       {0x00000000u, 0x00000001u, 0x007fffffu, 0x7f7fffffu, 0x7f800000u, 0x7f800001u, 0x7fc00000u,
        0x7fffffffu}) {
    words.push_back(e);
    words.push_back(e | 0x80000000u);
  }
  while (words.size() % 8 != 0 || words.size() < 200000) {
    words.push_back(static_cast<uint32_t>(rng()));
  }
  check_classify8<DType::kFloat32>(words);
}

// The emulated pack kernel at every bit offset 0..130, all dtypes, sizes
// around word boundaries, several grid sizes, against bits::pack_signs; the
// bits around the written range (random) must be unchanged.
TEST(CudaHostPack, EmulatedKernelMatchesCpuAtEveryOffset) {
  std::mt19937_64 rng(11);
  size_t runs = 0;
  for (DType d : bits::test::all_dtypes()) {
    const size_t vec0 = g_vec_groups, batch0 = g_vec_batches;
    for (size_t n : small_sizes()) {
      const auto src = bits::test::random_buffer(d, n, rng, true);
      for (size_t off = 0; off <= 130; ++off) {
        if (n > 300 && off % 7 != 0 && off < 128) {
          continue; // large sizes: a sample of the offsets
        }
        const size_t words = (off + n) / 64 + 3;
        const auto s0 = random_words(words, rng);
        const auto z0 = random_words(words, rng);
        const PackRef ref = ref_pack(d, src.data(), n, s0, z0, off);
        for (size_t nwarps : {size_t{1}, size_t{3}, size_t{64}}) {
          auto s = s0, z = z0;
          const auto c = emu_pack_any(d, src.data(), n, s.data(), z.data(), off, nwarps);
          ASSERT_EQ(s, ref.sign) << dname(d) << " n=" << n << " off=" << off << " warps=" << nwarps;
          ASSERT_EQ(z, ref.zero) << dname(d) << " n=" << n << " off=" << off;
          ASSERT_EQ(c.zeros, ref.counts.zeros) << dname(d) << " n=" << n;
          ASSERT_EQ(c.nans, ref.counts.nans) << dname(d) << " n=" << n;
          ++runs;
        }
      }
    }
    // Every path ran: the aligned offsets' whole groups by vectors, and
    // whole units of kPackGroups groups as one batch.
    const bool vectors = d == DType::kFloat32 || d == DType::kBFloat16 || d == DType::kFloat16;
    EXPECT_EQ(g_vec_groups > vec0, vectors) << dname(d);
    EXPECT_EQ(g_vec_batches > batch0, vectors) << dname(d);
  }
  RecordProperty("runs", static_cast<int>(runs));
}

// Successive packs end to end into one buffer (what the backend does with a
// bucket of tensors) give the concatenation.
TEST(CudaHostPack, EndToEndPacksConcatenate) {
  std::mt19937_64 rng(12);
  const std::vector<size_t> sizes = {5, 64, 1, 130, 63, 200, 7};
  size_t total = 0;
  std::vector<std::vector<uint8_t>> bufs;
  std::vector<uint8_t> all;
  for (size_t n : sizes) {
    bufs.push_back(bits::test::random_buffer(DType::kFloat32, n, rng, true));
    all.insert(all.end(), bufs.back().begin(), bufs.back().begin() + 4 * n);
    total += n;
  }
  std::vector<uint64_t> s(total / 64 + 2, ~0ull), z(total / 64 + 2, 0);
  size_t off = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    emu_pack<DType::kFloat32>(bufs[i].data(), sizes[i], s.data(), z.data(), off, 2);
    off += sizes[i];
  }
  std::vector<uint64_t> rs(total / 64 + 2), rz(total / 64 + 2);
  bits::pack_signs(DType::kFloat32, all.data(), total, rs.data(), rz.data());
  for (size_t i = 0; i < total; ++i) {
    ASSERT_EQ(get_bit(s.data(), i), get_bit(rs.data(), i)) << i;
    ASSERT_EQ(get_bit(z.data(), i), get_bit(rz.data(), i)) << i;
  }
  for (size_t i = total; i < s.size() * 64; ++i) {
    ASSERT_TRUE(get_bit(s.data(), i)) << "bit past the end changed: " << i;
  }
}

TEST(CudaHostPack, WordMask) {
  for (unsigned o = 0; o < 64; ++o) {
    for (size_t n = 1; n < 200; ++n) {
      const size_t K = cd::words_out(o, n);
      for (size_t k = 0; k < K; ++k) {
        uint64_t want = 0;
        for (unsigned j = 0; j < 64; ++j) {
          size_t e;
          if (cd::element_of(k, j, o, n, &e)) {
            want |= 1ull << j;
            ASSERT_EQ(e, k * 64 + j - o);
          }
        }
        ASSERT_NE(want, 0u) << "empty word " << k << " o=" << o << " n=" << n;
        ASSERT_EQ(cd::word_mask(k, o, n), want) << "k=" << k << " o=" << o << " n=" << n;
      }
    }
  }
}

// ---------------------------------------------------------------- levels ----

// pack_levels_kernel of signbits/cuda/pack.cu with `nwarps` warps: the same
// grid loop, each warp's 32 lanes through levels_lane, each plane's word from
// the two ballots, ORed in by lane b.
uint64_t emu_pack_levels(
    const float* c,
    size_t n,
    double factor,
    int p,
    uint64_t* planes,
    size_t plane_words,
    size_t bit_offset,
    size_t nwarps) {
  const unsigned o = static_cast<unsigned>(bit_offset % 64);
  uint64_t* base = planes + bit_offset / 64;
  const size_t nwords = cd::words_out(o, n);
  const int s = bits::level_span(p);
  constexpr size_t U = cd::kWordsPerWarpIter;
  const bool vec = cd::vec_aligned<4>(c, o);
  constexpr int B = cd::kLevelGroups;
  uint64_t bad = 0;
  // C vector groups from word k0: every lane's bytes, each plane's words ORed in.
  const auto vec_groups = [&](auto groups, size_t k0) {
    constexpr int C = decltype(groups)::value;
    uint64_t bytes[32][C];
    for (unsigned lane = 0; lane < 32; ++lane) {
      unsigned nonfinite = 0;
      cd::levels_vec_batch<C>(c, o, k0, lane, factor, s, &nonfinite, bytes[lane]);
      bad += nonfinite;
    }
    for (int g = 0; g < C; ++g) {
      for (int b = 0; b < p; ++b) {
        uint32_t plane[32];
        for (unsigned lane = 0; lane < 32; ++lane) {
          plane[lane] = static_cast<uint32_t>(bytes[lane][g] >> (8 * b)) & 0xffu;
        }
        for (unsigned w = 0; w < U; ++w) { // lane 8w's store
          cd::or_word(base + b * plane_words, k0 + g * U + w, o, n, cd::join_bytes_host(plane, w));
        }
      }
      ++g_vec_groups;
    }
    g_vec_batches += C > 1 ? 1 : 0;
  };
  for (size_t warp = 0; warp < nwarps; ++warp) {
    for (size_t k0 = warp * U * B; k0 < nwords; k0 += nwarps * U * B) {
      if (vec && cd::groups_full(k0, o, n, B)) {
        vec_groups(std::integral_constant<int, B>{}, k0);
        continue;
      }
      for (size_t kg = k0; kg < k0 + U * B && kg < nwords; kg += U) {
        if (vec && cd::group_full(kg, o, n)) {
          vec_groups(std::integral_constant<int, 1>{}, kg);
          continue;
        }
        for (size_t k = kg; k < kg + U && k < nwords; ++k) {
          unsigned f[32];
          for (unsigned lane = 0; lane < 32; ++lane) {
            f[lane] = cd::levels_lane(c, n, o, k, lane, factor, s);
            bad += ((f[lane] >> 16) & 1u) + ((f[lane] >> 17) & 1u);
          }
          for (int b = 0; b < p; ++b) { // lane b's store
            cd::or_word(base + b * plane_words, k, o, n, cd::level_plane_host(f, b));
          }
        }
      }
    }
  }
  return bad;
}

TEST(CudaHostLevels, Transpose8x8) {
  std::mt19937_64 rng(33);
  for (int t = 0; t < 2000; ++t) {
    const uint64_t x = t < 64 ? 1ull << t : rng();
    const uint64_t y = cd::transpose8x8(x);
    for (unsigned i = 0; i < 8; ++i) {
      for (unsigned j = 0; j < 8; ++j) {
        ASSERT_EQ((y >> (8 * j + i)) & 1u, (x >> (8 * i + j)) & 1u) << std::hex << x;
      }
    }
  }
}

// Every element's level (level_of) against the CPU's definition, on values
// around the rounding points and the specials.
TEST(CudaHostLevels, LevelOfIsLevelValue) {
  std::mt19937_64 rng(31);
  const double factors[] = {2.0, 0.37, 0.0, -1.5, 1e300, std::nan(""), INFINITY};
  for (int p = bits::kMinLevelBits; p <= bits::kMaxLevelBits; ++p) {
    const int s = bits::level_span(p);
    for (double factor : factors) {
      for (int i = 0; i < 2000; ++i) {
        float c;
        switch (i % 5) {
          case 0:
            c = static_cast<float>(static_cast<int>(rng() % 300) - 150) *
                0.25f; // halves at factor 2
            break;
          case 1:
            c = lionbit::optim::lion_test::from_bits(static_cast<uint32_t>(rng())); // any pattern
            break;
          default:
            c = static_cast<float>(static_cast<int64_t>(rng() % 2001) - 1000) / 37.f;
        }
        uint64_t want_bad = 0;
        unsigned bad = 0;
        const unsigned want = bits::level_value(c, factor, s, want_bad);
        ASSERT_EQ(cd::level_of(c, factor, s, &bad), want) << "c=" << c << " factor=" << factor;
        ASSERT_EQ(bad, want_bad) << "c=" << c;
      }
    }
  }
}

// The emulated kernel at many offsets and grid sizes against
// bits::pack_levels; bits outside the range (random) must be unchanged.
TEST(CudaHostLevels, EmulatedKernelMatchesCpuAtEveryOffset) {
  const size_t vec0 = g_vec_groups, batch0 = g_vec_batches;
  std::mt19937_64 rng(37);
  std::normal_distribution<float> normal(0.f, 2.f);
  for (int p : {2, 3, 4, 8}) {
    for (size_t n : small_sizes()) {
      std::vector<float> c(n);
      for (auto& v : c) {
        v = normal(rng);
      }
      if (n > 10) {
        c[3] = NAN;
        c[n - 2] = -INFINITY;
      }
      for (size_t off = 0; off <= 130; off += (n > 300 ? 13 : 1)) {
        const size_t plane_words = (off + n) / 64 + 2;
        const auto init = random_words(plane_words * static_cast<size_t>(p), rng);
        auto want = init;
        for (int b = 0; b < p; ++b) { // the range starts clear, as in a caller's buffer
          for (size_t pos = off; pos < off + n; ++pos) {
            want[b * plane_words + pos / 64] &= ~(1ull << (pos % 64));
          }
        }
        auto got = want;
        const double factor = (n + off) % 3 == 0 ? 2.0 : 0.6;
        const uint64_t want_bad = bits::pack_levels(
            c.data(), n, factor, p, want.data(), plane_words, off);
        for (size_t nwarps : {size_t{1}, size_t{5}}) {
          auto g = got;
          const uint64_t bad = emu_pack_levels(
              c.data(), n, factor, p, g.data(), plane_words, off, nwarps);
          ASSERT_EQ(g, want) << "p=" << p << " n=" << n << " off=" << off << " warps=" << nwarps;
          ASSERT_EQ(bad, want_bad) << "p=" << p << " n=" << n;
        }
      }
    }
  }
  EXPECT_GT(g_vec_groups, vec0) << "no vector group";
  EXPECT_GT(g_vec_batches, batch0) << "no batch of groups";
}

// ----------------------------------------------------------------- count ----

std::vector<int> count_ns() {
  std::vector<int> v;
  for (int n = 1; n <= 64; ++n) {
    v.push_back(n);
  }
  for (int n : {100, 127, 128, 129, 255, 256, 257, 511, 512, 700, 1023, 1024}) {
    v.push_back(n);
  }
  return v;
}

// Every n 1..64 and a few large, every zero mode, the kernel's own P and
// every larger P the library compiles: count_code and vote against the CPU.
TEST(CudaHostCount, CodeAndVoteMatchCpu) {
  std::mt19937_64 rng(21);
  size_t runs = 0;
  for (int n : count_ns()) {
    const int p0 = cd::pick_planes(n);
    ASSERT_GE(p0, cd::width_of(static_cast<uint32_t>(n)));
    for (int mode = 0; mode <= 4; ++mode) {
      const size_t words = n > 128 ? 3 : 1 + rng() % 11;
      const RanksData d = make_ranks(n, words, mode, rng);
      const bool zeros = mode != 0;
      const auto contrib = d.contributions();
      const int planes = bits::code_planes(n, zeros);
      std::vector<uint64_t> ref(static_cast<size_t>(planes) * words);
      bits::count_code(contrib.data(), n, words, ref.data());
      std::vector<uint64_t> rs(words), rz(words);
      bits::vote(contrib.data(), n, words, rs.data(), rz.data());
      for (int P : cd::kCounterPlanes) {
        if (P < cd::width_of(static_cast<uint32_t>(n))) {
          continue;
        }
        std::vector<uint64_t> out(ref.size(), 0x5555);
        LIONBIT_FOR_PLANES(P, emu_count, d, zeros, out.data());
        ASSERT_EQ(out, ref) << "count n=" << n << " mode=" << mode << " P=" << P;
        std::vector<uint64_t> vs(words), vz(words);
        LIONBIT_FOR_PLANES(P, emu_vote, d, zeros, vs.data(), vz.data());
        ASSERT_EQ(vs, rs) << "vote sign n=" << n << " mode=" << mode << " P=" << P;
        ASSERT_EQ(vz, rz) << "vote zero n=" << n << " mode=" << mode << " P=" << P;
        ++runs;
      }
    }
  }
  RecordProperty("runs", static_cast<int>(runs));
}

// Ties and unanimity: exactly half the ranks positive, everyone zero, all
// positive, all negative.
TEST(CudaHostCount, TiesAndUnanimity) {
  for (int n = 1; n <= 64; ++n) {
    RanksData d;
    d.n = n;
    d.words = 4;
    d.stride = 4;
    d.sign.assign(static_cast<size_t>(n) * 4, 0);
    d.zero.assign(static_cast<size_t>(n) * 4, 0);
    for (int i = 0; i < n; ++i) {
      uint64_t* s = d.sign.data() + i * 4;
      uint64_t* z = d.zero.data() + i * 4;
      s[0] = i < n / 2 ? ~0ull : 0; // tie for even n
      s[1] = ~0ull; // all positive
      s[2] = 0; // all negative
      z[3] = ~0ull; // all zero
    }
    for (bool zeros : {false, true}) {
      const auto contrib = d.contributions();
      std::vector<bits::Contribution> c2 = contrib;
      if (!zeros) {
        for (auto& c : c2) c.zero = nullptr;
      }
      std::vector<uint64_t> rs(4), rz(4), vs(4), vz(4);
      bits::vote(c2.data(), n, 4, rs.data(), rz.data());
      LIONBIT_FOR_PLANES(cd::pick_planes(n), emu_vote, d, zeros, vs.data(), vz.data());
      ASSERT_EQ(vs, rs) << n;
      ASSERT_EQ(vz, rz) << n;
      if (n % 2 == 0) {
        ASSERT_EQ(vz[0], ~0ull) << "tie not seen, n=" << n;
      }
    }
  }
}

// ---------------------------------------------------------------- unpack ----

template <typename S>
void check_unpack(DType d, std::mt19937_64& rng) {
  for (int nplanes : {0, 1, 2, 3, 4, 5, 7, 9, 12, 16}) {
    for (int shards : {1, 2, 3, 5}) {
      for (size_t n :
           {size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{200}, size_t{1000},
            size_t{4200}}) { // the last: batches of kUnpackGroups groups, and edges
        const size_t sw = bits::shard_words(n, shards);
        const auto sharded = random_words(static_cast<size_t>(nplanes) * sw * shards + 1, rng);
        const size_t entries = size_t{1} << nplanes;
        std::vector<S> lut(entries);
        for (auto& v : lut) {
          v = static_cast<S>(rng());
        }
        const auto plain = unshard(sharded, nplanes, sw, shards);
        const auto ptrs = plane_ptrs(plain, nplanes, sw * shards);
        std::vector<S> ref(n + 4, S(0x5a)), got(n + 4, S(0x5a));
        // dst at a 16-byte boundary (the vector path) and one value past it
        for (size_t at : {size_t{0}, size_t{1}}) {
          std::fill(ref.begin(), ref.end(), S(0x5a));
          bits::unpack(d, ptrs.data(), nplanes, n, lut.data(), ref.data() + at);
          for (size_t nwarps : {size_t{1}, size_t{5}}) {
            std::fill(got.begin(), got.end(), S(0x5a));
            S* dst = got.data() + at;
            if (nplanes == 1) {
              emu_unpack<S, 1>(sharded.data(), nplanes, sw, n, lut.data(), dst, nwarps);
            } else if (nplanes == 2) {
              emu_unpack<S, 2>(sharded.data(), nplanes, sw, n, lut.data(), dst, nwarps);
            } else {
              emu_unpack<S>(sharded.data(), nplanes, sw, n, lut.data(), dst, nwarps);
            }
            ASSERT_EQ(got, ref) << dname(d) << " nplanes=" << nplanes << " shards=" << shards
                                << " n=" << n << " at=" << at;
          }
        }
      }
    }
  }
}

TEST(CudaHostUnpack, EmulatedKernelMatchesCpu) {
  std::mt19937_64 rng(31);
  const size_t vec0 = g_vec_groups, batch0 = g_vec_batches;
  check_unpack<uint8_t>(DType::kInt8, rng);
  check_unpack<unsigned long long>(DType::kFloat64, rng);
  EXPECT_EQ(g_vec_groups, vec0) << "1- and 8-byte values take the word path";
  check_unpack<uint16_t>(DType::kFloat16, rng);
  check_unpack<uint16_t>(DType::kBFloat16, rng);
  check_unpack<uint32_t>(DType::kFloat32, rng);
  EXPECT_GT(g_vec_groups, vec0) << "no vector group";
  EXPECT_GT(g_vec_batches, batch0) << "no batch of groups";
}

// A vote unpacked with make_lut tables: the path the backend takes.
TEST(CudaHostUnpack, VoteLutAllDtypes) {
  std::mt19937_64 rng(32);
  const double vals[4] = {-1.0, 1.0, 0.0, 0.0};
  for (DType d : bits::test::all_dtypes()) {
    std::vector<uint8_t> lut(4 * 8);
    bits::make_lut(d, vals, 4, lut.data());
    const size_t n = 333;
    const auto planes = random_words(2 * 6, rng);
    const auto ptrs = plane_ptrs(planes, 2, 6);
    std::vector<uint8_t> ref(n * 8), got(n * 8);
    bits::unpack(d, ptrs.data(), 2, n, lut.data(), ref.data());
    switch (bits::dtype_size(d)) {
      case 1:
        emu_unpack<uint8_t, 2>(planes.data(), 2, 6, n, lut.data(), got.data(), 2);
        break;
      case 2:
        emu_unpack<uint16_t, 2>(planes.data(), 2, 6, n, lut.data(), got.data(), 2);
        break;
      case 4:
        emu_unpack<uint32_t, 2>(planes.data(), 2, 6, n, lut.data(), got.data(), 2);
        break;
      default:
        emu_unpack<unsigned long long, 2>(planes.data(), 2, 6, n, lut.data(), got.data(), 2);
        break;
    }
    ASSERT_EQ(got, ref) << dname(d);
  }
}

// -------------------------------------------------------------- base 3 ----

// trits.cu's kernels emulated: a byte a "thread" for the encode, an element a
// "thread" for the decode, with its flag for a byte that is not a code.
void emu_encode_trits(const uint64_t* sign, const uint64_t* tie, size_t words, uint8_t* out) {
  for (size_t k = 0; k < words * bits::kTritBytesPerWord; ++k) {
    const size_t w = k / bits::kTritBytesPerWord;
    out[k] = cd::trit_byte(sign[w], tie[w], static_cast<unsigned>(k % bits::kTritBytesPerWord));
  }
}

template <typename S>
bool emu_decode_trits(const uint8_t* trits, size_t n, const S* lut, S* dst) {
  bool bad = false;
  for (size_t i = 0; i < n; ++i) {
    const unsigned t = cd::trit_of(trits[cd::trit_byte_of(i)], i);
    if (t == 3u) {
      bad = true;
      continue;
    }
    dst[i] = lut[t];
  }
  return !bad;
}

TEST(CudaHostTrits, EncodeMatchesCpuEveryTieDensity) {
  std::mt19937_64 rng(41);
  for (size_t words : {size_t{1}, size_t{2}, size_t{7}, size_t{100}}) {
    for (int ties : {0, 1, 2, 3}) {
      const auto sign = random_words(words, rng);
      std::vector<uint64_t> tie = random_words(words, rng);
      for (auto& t : tie) {
        t = ties == 0 ? 0 : (ties == 1 ? t & rng() & rng() : (ties == 2 ? t : ~uint64_t{0}));
      }
      std::vector<uint8_t> ref(words * bits::kTritBytesPerWord), got(ref.size());
      bits::encode_trits(sign.data(), tie.data(), words, ref.data());
      emu_encode_trits(sign.data(), tie.data(), words, got.data());
      ASSERT_EQ(got, ref) << "words=" << words << " ties=" << ties;
    }
  }
}

// Every byte value at every position of a word: the valid codes' values, and
// which bytes make a message corrupt (those holding one of the n elements),
// as bits::decode_trits says.
TEST(CudaHostTrits, DecodeMatchesCpuOnEveryByteAndPosition) {
  const uint32_t lut[3] = {0xaaaa0001u, 0xbbbb0002u, 0xcccc0003u};
  for (size_t n :
       {size_t{1}, size_t{5}, size_t{59}, size_t{60}, size_t{63}, size_t{64}, size_t{65},
        size_t{130}}) {
    const size_t bytes = bits::words_for(n) * bits::kTritBytesPerWord;
    for (size_t at = 0; at < bytes; ++at) {
      for (unsigned code = 0; code < 256; ++code) {
        std::vector<uint8_t> trits(bytes, 121); // 11111 in base 3: every trit +1
        trits[at] = static_cast<uint8_t>(code);
        std::vector<uint32_t> ref(n, 7u), got(n, 7u);
        const bool ok_ref = bits::decode_trits(DType::kFloat32, trits.data(), n, lut, ref.data());
        const bool ok_got = emu_decode_trits<uint32_t>(trits.data(), n, lut, got.data());
        ASSERT_EQ(ok_got, ok_ref) << "n=" << n << " byte " << at << " = " << code;
        if (ok_ref) {
          ASSERT_EQ(got, ref) << "n=" << n << " byte " << at << " = " << code;
        }
      }
    }
  }
}

TEST(CudaHostTrits, RoundTripEveryDtype) {
  std::mt19937_64 rng(43);
  for (DType d : bits::test::all_dtypes()) {
    const size_t es = bits::dtype_size(d), n = 1000;
    const size_t words = bits::words_for(n);
    const auto sign = random_words(words, rng);
    const auto tie = random_words(words, rng);
    std::vector<uint8_t> trits(words * bits::kTritBytesPerWord);
    emu_encode_trits(sign.data(), tie.data(), words, trits.data());
    std::vector<uint8_t> lut(3 * es);
    for (auto& b : lut) b = static_cast<uint8_t>(rng());
    std::vector<uint8_t> ref(n * es), got(n * es);
    ASSERT_TRUE(bits::decode_trits(d, trits.data(), n, lut.data(), ref.data()));
    bool ok = false;
    switch (es) {
      case 1:
        ok = emu_decode_trits(trits.data(), n, lut.data(), got.data());
        break;
      case 2:
        ok = emu_decode_trits(
            trits.data(), n, reinterpret_cast<const uint16_t*>(lut.data()),
            reinterpret_cast<uint16_t*>(got.data()));
        break;
      case 4:
        ok = emu_decode_trits(
            trits.data(), n, reinterpret_cast<const uint32_t*>(lut.data()),
            reinterpret_cast<uint32_t*>(got.data()));
        break;
      default:
        ok = emu_decode_trits(
            trits.data(), n, reinterpret_cast<const uint64_t*>(lut.data()),
            reinterpret_cast<uint64_t*>(got.data()));
        break;
    }
    ASSERT_TRUE(ok) << dname(d);
    ASSERT_EQ(got, ref) << dname(d);
  }
}

// ------------------------------------------------------------------ Lion ----

using lionbit::optim::lion_test::same_at;

struct Coefs {
  float b1, omb1, b2, omb2;
};

std::vector<Coefs> coef_sets() {
  return {
      {0.9f, static_cast<float>(1.0 - 0.9), 0.99f, static_cast<float>(1.0 - 0.99)},
      {0.95f, static_cast<float>(1.0 - 0.95), 0.98f, static_cast<float>(1.0 - 0.98)},
      {0.3f, 0.7f, 0.123456f, 0.876544f}, // products that round often
      {1.0f, 0.0f, 0.0f, 1.0f},
  };
}

template <DType G, DType M>
void check_direction(std::mt19937_64& rng, size_t& runs) {
  const size_t vec0 = g_vec_groups, batch0 = g_vec_batches;
  for (const Coefs& cf : coef_sets()) {
    const cd::LionCoefs k{cf.b1, cf.omb1, cf.b2, cf.omb2};
    for (size_t n : small_sizes()) {
      const auto g = random_floats(G, n, rng);
      const auto m0 = random_floats(M, n, rng);
      for (size_t off :
           {size_t{0}, size_t{1}, size_t{31}, size_t{32}, size_t{63}, size_t{64}, size_t{65},
            size_t{100}, size_t{127}, size_t{128}, size_t{130}}) {
        const size_t words = (off + n) / 64 + 3;
        const auto s0 = random_words(words, rng);
        const auto z0 = random_words(words, rng);
        // CPU reference: words_for(n) words at offset 0, then inserted.
        auto mref = m0;
        std::vector<uint64_t> rs(n / 64 + 2), rz(n / 64 + 2);
        const auto rc = optim::lion_direction(
            G, g.data(), M, mref.data(), n, cf.b1, cf.omb1, cf.b2, cf.omb2, rs.data(), rz.data());
        auto es = s0, ez = z0;
        insert_bits(rs.data(), n, es.data(), off);
        insert_bits(rz.data(), n, ez.data(), off);
        for (size_t nwarps : {size_t{1}, size_t{7}}) {
          auto m = m0;
          auto s = s0, z = z0;
          const auto c = emu_direction<G, M>(
              g.data(), m.data(), m.data(), n, k, s.data(), z.data(), off, nwarps);
          ASSERT_EQ(s, es) << dname(G) << "/" << dname(M) << " n=" << n << " off=" << off;
          ASSERT_EQ(z, ez) << dname(G) << "/" << dname(M) << " n=" << n << " off=" << off;
          ASSERT_EQ(c.zeros, rc.zeros);
          ASSERT_EQ(c.nans, rc.nonfinite); // the direction kernel tallies non-finite c
          for (size_t i = 0; i < n; ++i) {
            ASSERT_TRUE(same_at(M, m.data(), mref.data(), i))
                << dname(G) << "/" << dname(M) << " momentum " << i;
          }
          // The momentum only read (the step's vote before any state changes).
          auto mo = m0;
          auto so = s0, zo = z0;
          const auto co = emu_direction<G, M>(
              g.data(), mo.data(), nullptr, n, k, so.data(), zo.data(), off, nwarps);
          ASSERT_EQ(so, es);
          ASSERT_EQ(zo, ez);
          ASSERT_EQ(co.zeros, rc.zeros);
          ASSERT_EQ(co.nans, rc.nonfinite);
          ASSERT_EQ(mo, m0) << dname(G) << "/" << dname(M) << " n=" << n << ": momentum written";
          ++runs;
        }
      }
    }
  }
  EXPECT_GT(g_vec_groups, vec0) << dname(G) << "/" << dname(M) << ": no vector group";
  EXPECT_EQ(g_vec_batches > batch0, (cd::kDirBatch<G, M> > 1)) << dname(G) << "/" << dname(M);
}

TEST(CudaHostLion, DirectionMatchesCpu) {
  std::mt19937_64 rng(41);
  size_t runs = 0;
  check_direction<DType::kFloat32, DType::kFloat32>(rng, runs);
  check_direction<DType::kFloat32, DType::kBFloat16>(rng, runs);
  check_direction<DType::kBFloat16, DType::kFloat32>(rng, runs);
  check_direction<DType::kBFloat16, DType::kBFloat16>(rng, runs);
  check_direction<DType::kFloat16, DType::kFloat32>(rng, runs);
  check_direction<DType::kFloat16, DType::kBFloat16>(rng, runs);
  RecordProperty("runs", static_cast<int>(runs));
}

// The new momentum into a separate buffer m_out (double-buffered momentum):
// the bits and counts of the in-place run, m unchanged, m_out's n elements
// bitwise what the in-place run left in m (a NaN any NaN, as same_at: the
// host's NaN payloads follow the compiler's operand order; the GPU's NaNs are
// canonical) and its bytes around them untouched. m_out 16-byte aligned as m
// is (the vector path) and `shift` elements off (the ballot path only: there
// the vector path's 16-byte stores would fault, which check_vec_address turns
// into an abort).
template <DType G, DType M>
void check_direction_m_out(std::mt19937_64& rng, size_t& runs) {
  constexpr size_t SM = sizeof(typename FloatStore<M>::U);
  size_t vec_out = 0; // vector groups with a separate m_out
  for (const Coefs& cf : {coef_sets()[0], coef_sets()[2]}) {
    const cd::LionCoefs k{cf.b1, cf.omb1, cf.b2, cf.omb2};
    for (size_t n :
         {size_t{1}, size_t{3}, size_t{31}, size_t{33}, size_t{64}, size_t{65}, size_t{255},
          size_t{257}, size_t{1001}, size_t{4097}, size_t{9001}}) {
      const auto g = random_floats(G, n, rng);
      const auto m0 = random_floats(M, n, rng);
      for (size_t off :
           {size_t{0}, size_t{1}, size_t{33}, size_t{63}, size_t{64}, size_t{65}, size_t{127},
            size_t{130}}) {
        const size_t words = (off + n) / 64 + 3;
        const auto s0 = random_words(words, rng);
        const auto z0 = random_words(words, rng);
        for (size_t nwarps : {size_t{1}, size_t{5}}) {
          // In place: m_out == m.
          auto mi = m0;
          auto si = s0, zi = z0;
          const auto ci = emu_direction<G, M>(
              g.data(), mi.data(), mi.data(), n, k, si.data(), zi.data(), off, nwarps);
          for (size_t shift : {size_t{0}, size_t{1}, size_t{3}}) {
            const std::string what = dname(G) + "/" + dname(M) + " n=" + std::to_string(n) +
                " off=" + std::to_string(off) + " shift=" + std::to_string(shift) +
                " nwarps=" + std::to_string(nwarps);
            const auto out0 = random_floats(M, n + shift, rng); // n + shift + 16 / SM elements
            auto out_buf = out0;
            uint8_t* out = out_buf.data() + shift * SM;
            auto m = m0;
            auto s = s0, z = z0;
            const size_t vec_before = g_vec_groups;
            const auto c = emu_direction<G, M>(
                g.data(), m.data(), out, n, k, s.data(), z.data(), off, nwarps);
            ASSERT_EQ(s, si) << what;
            ASSERT_EQ(z, zi) << what;
            ASSERT_EQ(c.zeros, ci.zeros) << what;
            ASSERT_EQ(c.nans, ci.nans) << what;
            ASSERT_EQ(m, m0) << what << ": m written";
            // bitwise; a NaN any NaN (the host compiler may take either NaN operand's payload)
            for (size_t i = 0; i < n; ++i) {
              ASSERT_TRUE(same_at(M, out, mi.data(), i)) << what << ": m_out " << i;
            }
            ASSERT_EQ(std::memcmp(out_buf.data(), out0.data(), shift * SM), 0)
                << what << ": written before m_out";
            ASSERT_EQ(
                std::memcmp(
                    out + n * SM, out0.data() + (shift + n) * SM, out0.size() - (shift + n) * SM),
                0)
                << what << ": written past m_out";
            if (shift * SM % 16 != 0) {
              ASSERT_EQ(g_vec_groups, vec_before) << what << ": vector path, m_out misaligned";
            }
            vec_out += g_vec_groups - vec_before;
            ++runs;
          }
        }
      }
    }
  }
  EXPECT_GT(vec_out, 0u) << dname(G) << "/" << dname(M) << ": no vector group";
}

TEST(CudaHostLion, DirectionMomentumOutMatchesInPlace) {
  std::mt19937_64 rng(43);
  size_t runs = 0;
  check_direction_m_out<DType::kFloat32, DType::kFloat32>(rng, runs);
  check_direction_m_out<DType::kFloat32, DType::kBFloat16>(rng, runs);
  check_direction_m_out<DType::kBFloat16, DType::kFloat32>(rng, runs);
  check_direction_m_out<DType::kBFloat16, DType::kBFloat16>(rng, runs);
  check_direction_m_out<DType::kFloat16, DType::kFloat32>(rng, runs);
  check_direction_m_out<DType::kFloat16, DType::kBFloat16>(rng, runs);
  EXPECT_GT(runs, 1000u);
}

// Every pair of special values for g and m, float32, element by element.
TEST(CudaHostLion, DirectionSpecialPairs) {
  const auto sp = special_f32();
  const size_t n = sp.size() * sp.size();
  std::vector<float> g(n), m(n);
  for (size_t i = 0; i < sp.size(); ++i) {
    for (size_t j = 0; j < sp.size(); ++j) {
      g[i * sp.size() + j] = cd::bits_f32(sp[i]);
      m[i * sp.size() + j] = cd::bits_f32(sp[j]);
    }
  }
  for (const Coefs& cf : coef_sets()) {
    auto mref = m, mg = m;
    std::vector<uint64_t> rs(n / 64 + 1), rz(n / 64 + 1), s(n / 64 + 1), z(n / 64 + 1);
    const auto rc = optim::lion_direction(
        DType::kFloat32, g.data(), DType::kFloat32, mref.data(), n, cf.b1, cf.omb1, cf.b2, cf.omb2,
        rs.data(), rz.data());
    const auto c = emu_direction<DType::kFloat32, DType::kFloat32>(
        g.data(), mg.data(), mg.data(), n, {cf.b1, cf.omb1, cf.b2, cf.omb2}, s.data(), z.data(), 0,
        3);
    EXPECT_EQ(s, rs);
    EXPECT_EQ(z, rz);
    EXPECT_EQ(c.zeros, rc.zeros);
    EXPECT_EQ(c.nans, rc.nonfinite);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(same_at(
          DType::kFloat32, reinterpret_cast<const uint8_t*>(mg.data()),
          reinterpret_cast<const uint8_t*>(mref.data()), i))
          << i;
    }
  }
}

template <DType X, DType Dl>
void check_apply_dense(std::mt19937_64& rng) {
  const size_t vec0 = g_vec_groups;
  std::vector<size_t> sizes = small_sizes();
  sizes.push_back(3 * cd::kApplyUnit + 5);
  for (size_t n : sizes) {
    const auto x0 = random_floats(X, n, rng);
    const auto delta_buf = random_floats(Dl, n + 1, rng);
    // delta from a 16-byte boundary (whole units by vectors) and one value on
    for (size_t shift : {size_t{0}, size_t{1}}) {
      const uint8_t* delta = delta_buf.data() + shift * bits::dtype_size(Dl);
      for (float lr : {3e-4f, 0.5f, 1e-30f}) {
        for (float decay : {1.0f, 0.99997f, 0.5f}) {
          auto xr = x0, xg = x0;
          optim::lion_apply_dense(X, xr.data(), Dl, delta, n, lr, decay);
          emu_apply_dense<X, Dl>(xg.data(), delta, n, lr, decay, 1 + n % 7);
          for (size_t i = 0; i < n; ++i) {
            ASSERT_TRUE(same_at(X, xg.data(), xr.data(), i))
                << dname(X) << "/" << dname(Dl) << " n=" << n << " shift=" << shift << " i=" << i
                << " lr=" << lr;
          }
        }
      }
    }
  }
  EXPECT_GT(g_vec_groups, vec0) << dname(X) << "/" << dname(Dl) << ": no vector unit";
}

TEST(CudaHostLion, ApplyDenseMatchesCpu) {
  std::mt19937_64 rng(51);
  check_apply_dense<DType::kFloat32, DType::kFloat32>(rng);
  check_apply_dense<DType::kFloat32, DType::kBFloat16>(rng);
  check_apply_dense<DType::kFloat32, DType::kFloat16>(rng);
  check_apply_dense<DType::kBFloat16, DType::kFloat32>(rng);
  check_apply_dense<DType::kBFloat16, DType::kBFloat16>(rng);
  check_apply_dense<DType::kBFloat16, DType::kFloat16>(rng);
  check_apply_dense<DType::kFloat16, DType::kFloat32>(rng);
  check_apply_dense<DType::kFloat16, DType::kBFloat16>(rng);
  check_apply_dense<DType::kFloat16, DType::kFloat16>(rng);
}

// The Delta values the backend applies, as a dense buffer: vote results
// -1, +1, 0 (one rank's sign, or a majority with ties) and averages k/N of N
// ranks, k = -N..N (float32 k / N, then stored in Dl).
template <DType X, DType Dl>
void check_apply_dense_votes(std::mt19937_64& rng) {
  using lionbit::optim::lion_test::ref_store;
  for (int ranks : {1, 2, 3, 5, 8}) {
    for (size_t n : {size_t{1}, size_t{64}, size_t{65}, size_t{129}, size_t{1000}}) {
      std::vector<uint8_t> delta(n * bits::dtype_size(Dl) + 16);
      for (size_t i = 0; i < n; ++i) {
        ref_store(Dl, delta.data(), i, lionbit::optim::lion_test::vote_like_delta(rng, ranks));
      }
      const auto x0 = random_floats(X, n, rng);
      for (float lr : {3e-4f, 0.1f}) {
        const float decay = 1.0f - lr * 0.1f;
        auto xr = x0;
        optim::lion_apply_dense(X, xr.data(), Dl, delta.data(), n, lr, decay);
        for (size_t threads : {size_t{1}, size_t{3}, size_t{64}}) {
          auto xg = x0;
          emu_apply_dense<X, Dl>(xg.data(), delta.data(), n, lr, decay, threads);
          for (size_t i = 0; i < n; ++i) {
            ASSERT_TRUE(same_at(X, xg.data(), xr.data(), i))
                << dname(X) << "/" << dname(Dl) << " ranks=" << ranks << " n=" << n
                << " threads=" << threads << " i=" << i;
          }
        }
      }
    }
  }
}

TEST(CudaHostLion, ApplyDenseVoteDeltasMatchesCpu) {
  std::mt19937_64 rng(61);
  check_apply_dense_votes<DType::kFloat32, DType::kFloat32>(rng);
  check_apply_dense_votes<DType::kBFloat16, DType::kFloat32>(rng);
  check_apply_dense_votes<DType::kBFloat16, DType::kBFloat16>(rng);
  check_apply_dense_votes<DType::kFloat16, DType::kFloat32>(rng);
  check_apply_dense_votes<DType::kFloat16, DType::kFloat16>(rng);
}

// ------------------------------------------------------ list kernels ----

using optim::cuda::ApplySeg;
using optim::cuda::DirectionSeg;

// direction_list_kernel of optimizer/lion_cuda_list.cu with `nwarps` warps:
// each warp's units in its grid loop, the lanes' bodies, the ballots, the
// edge words written as commit_word_shared writes them; each tensor's new
// momentum into its seg's m_out.
template <DType G, DType M>
bits::PackCounts emu_direction_list(
    std::vector<DirectionSeg> segs,
    const cd::LionCoefs& k,
    uint64_t* sign,
    uint64_t* zero,
    size_t nwarps) {
  const uint64_t units = optim::cuda::direction_units(segs.data(), segs.size());
  unsigned long long zeros = 0, nans = 0;
  for (size_t warp = 0; warp < nwarps; ++warp) {
    cd::SegmentWalk<DirectionSeg> walk(segs.data(), segs.size(), units);
    for (uint64_t u = warp; u < units; u += nwarps) {
      const optim::cuda::DirectionUnit d = optim::cuda::direction_unit(segs[walk.at(u)], u);
      const size_t first = static_cast<size_t>(d.seg.bit_offset / 64);
      emu_direction_words<G, M>(
          static_cast<const typename FloatStore<G>::U*>(d.seg.g),
          static_cast<const typename FloatStore<M>::U*>(d.seg.m),
          static_cast<typename FloatStore<M>::U*>(d.seg.m_out), static_cast<size_t>(d.seg.n), d.o,
          d.k0, d.nwords, cd::direction_vec_aligned<G, M>(d.seg.g, d.seg.m, d.seg.m_out, d.o), k,
          sign != nullptr ? sign + first : nullptr, zero != nullptr ? zero + first : nullptr, true,
          &zeros, &nans);
    }
  }
  return {zeros, nans};
}

// A model's tensors end to end in one chunk's planes: sizes from one
// element to a few words, none, and a larger one, from a bit offset `at`.
std::vector<size_t> list_sizes() {
  return {1, 0, 63, 64, 65, 5, 1000, 2, 130, 0, 4097, 31, 1};
}

template <DType G, DType M>
void check_direction_list(std::mt19937_64& rng, size_t& runs) {
  const size_t vec0 = g_vec_groups, batch0 = g_vec_batches;
  const std::vector<size_t> sizes = list_sizes();
  for (const Coefs& cf : coef_sets()) {
    const cd::LionCoefs k{cf.b1, cf.omb1, cf.b2, cf.omb2};
    for (size_t at : {size_t{0}, size_t{3}, size_t{58}, size_t{64}, size_t{127}}) {
      std::vector<std::vector<uint8_t>> gs, m0s;
      size_t total = at;
      for (size_t n : sizes) {
        gs.push_back(random_floats(G, n, rng));
        m0s.push_back(random_floats(M, n, rng));
        total += n;
      }
      const size_t words = total / 64 + 3;
      const auto s0 = random_words(words, rng);
      const auto z0 = random_words(words, rng);
      // Reference: each tensor by the CPU kernel, its bits inserted at its offset.
      auto es = s0, ez = z0;
      auto mrefs = m0s;
      uint64_t rzeros = 0, rnans = 0;
      size_t off = at;
      for (size_t t = 0; t < sizes.size(); ++t) {
        const size_t n = sizes[t];
        std::vector<uint64_t> rs(n / 64 + 2), rz(n / 64 + 2);
        const auto rc = optim::lion_direction(
            G, gs[t].data(), M, mrefs[t].data(), n, cf.b1, cf.omb1, cf.b2, cf.omb2, rs.data(),
            rz.data());
        insert_bits(rs.data(), n, es.data(), off);
        insert_bits(rz.data(), n, ez.data(), off);
        rzeros += rc.zeros;
        rnans += rc.nonfinite;
        off += n;
      }
      for (size_t nwarps : {size_t{1}, size_t{5}, size_t{64}}) {
        for (bool write_m : {true, false}) {
          auto ms = m0s;
          auto s = s0, z = z0;
          std::vector<DirectionSeg> segs;
          off = at;
          for (size_t t = 0; t < sizes.size(); ++t) {
            segs.push_back(DirectionSeg{
                gs[t].data(), ms[t].data(), write_m ? ms[t].data() : nullptr, sizes[t], off, 0});
            off += sizes[t];
          }
          const auto c = emu_direction_list<G, M>(segs, k, s.data(), z.data(), nwarps);
          ASSERT_EQ(s, es) << dname(G) << "/" << dname(M) << " at=" << at << " nwarps=" << nwarps;
          ASSERT_EQ(z, ez) << dname(G) << "/" << dname(M) << " at=" << at << " nwarps=" << nwarps;
          ASSERT_EQ(c.zeros, rzeros);
          ASSERT_EQ(c.nans, rnans);
          for (size_t t = 0; t < sizes.size(); ++t) {
            for (size_t i = 0; i < sizes[t]; ++i) {
              ASSERT_TRUE(same_at(M, ms[t].data(), (write_m ? mrefs : m0s)[t].data(), i))
                  << dname(G) << "/" << dname(M) << " tensor " << t << " momentum " << i;
            }
          }
          // The momentum update alone: no planes.
          if (write_m) {
            auto mo = m0s;
            for (size_t t = 0; t < sizes.size(); ++t) {
              segs[t].m = mo[t].data();
              segs[t].m_out = mo[t].data();
            }
            emu_direction_list<G, M>(segs, k, nullptr, nullptr, nwarps);
            for (size_t t = 0; t < sizes.size(); ++t) {
              for (size_t i = 0; i < sizes[t]; ++i) {
                ASSERT_TRUE(same_at(M, mo[t].data(), mrefs[t].data(), i));
              }
            }
          }
          ++runs;
        }
      }
    }
  }
  EXPECT_GT(g_vec_groups, vec0) << dname(G) << "/" << dname(M) << ": no vector group";
  EXPECT_EQ(g_vec_batches > batch0, (cd::kDirBatch<G, M> > 1)) << dname(G) << "/" << dname(M);
}

// The list kernel with each tensor's own m_out: tensor t's new momentum, by
// its mode (t + rot) % 4, in place (0), into a separate buffer 16-byte
// aligned as m (1), one element off (2: the ballot path only), or not
// written (3: m_out nullptr); rot turns every tensor through every mode.
// With the planes: the bits and counts of the CPU kernel; without (sign ==
// nullptr): the momentum update alone. Every m as the CPU kernel leaves it
// in place where m_out == m, else unchanged; every m_out what the CPU kernel
// leaves in m, its bytes around untouched.
template <DType G, DType M>
void check_direction_list_m_out(std::mt19937_64& rng, size_t& runs) {
  constexpr size_t SM = sizeof(typename FloatStore<M>::U);
  const std::vector<size_t> sizes = list_sizes();
  const Coefs cf = coef_sets()[2];
  const cd::LionCoefs k{cf.b1, cf.omb1, cf.b2, cf.omb2};
  // the list's first bit: tensor 6 (1000 elements) and 10 (4097) then start
  // 16-byte aligned (the vector path) from 58, 2, 122 and 66 and off it from
  // 0, 3, 127
  const size_t ats[] = {58, 2, 122, 66, 0, 3, 127};
  for (size_t r = 0; r < std::size(ats); ++r) {
    const size_t at = ats[r], rot = r % 4;
    const auto mode = [&](size_t t) { return (t + rot) % 4; };
    std::vector<std::vector<uint8_t>> gs, m0s;
    size_t total = at;
    for (size_t n : sizes) {
      gs.push_back(random_floats(G, n, rng));
      m0s.push_back(random_floats(M, n, rng));
      total += n;
    }
    const size_t words = total / 64 + 3;
    const auto s0 = random_words(words, rng);
    const auto z0 = random_words(words, rng);
    auto es = s0, ez = z0;
    auto mrefs = m0s;
    uint64_t rzeros = 0, rnans = 0;
    size_t off = at;
    for (size_t t = 0; t < sizes.size(); ++t) {
      const size_t n = sizes[t];
      std::vector<uint64_t> rs(n / 64 + 2), rz(n / 64 + 2);
      const auto rc = optim::lion_direction(
          G, gs[t].data(), M, mrefs[t].data(), n, cf.b1, cf.omb1, cf.b2, cf.omb2, rs.data(),
          rz.data());
      insert_bits(rs.data(), n, es.data(), off);
      insert_bits(rz.data(), n, ez.data(), off);
      rzeros += rc.zeros;
      rnans += rc.nonfinite;
      off += n;
    }
    for (size_t nwarps : {size_t{1}, size_t{5}, size_t{64}}) {
      for (bool planes : {true, false}) {
        auto ms = m0s;
        std::vector<std::vector<uint8_t>> out0s, outs;
        outs.reserve(sizes.size()); // segs point into its buffers
        std::vector<DirectionSeg> segs;
        off = at;
        for (size_t t = 0; t < sizes.size(); ++t) {
          const size_t shift = mode(t) == 2 ? 1 : 0;
          out0s.push_back(random_floats(M, sizes[t] + shift, rng));
          outs.push_back(out0s[t]);
          void* m_out = mode(t) == 0 ? static_cast<void*>(ms[t].data())
              : mode(t) == 3         ? nullptr
                                     : static_cast<void*>(outs[t].data() + shift * SM);
          segs.push_back(DirectionSeg{gs[t].data(), ms[t].data(), m_out, sizes[t], off, 0});
          off += sizes[t];
        }
        auto s = s0, z = z0;
        const auto c = emu_direction_list<G, M>(
            segs, k, planes ? s.data() : nullptr, planes ? z.data() : nullptr, nwarps);
        const std::string what = dname(G) + "/" + dname(M) + " at=" + std::to_string(at) +
            " nwarps=" + std::to_string(nwarps) + (planes ? "" : " momentum only");
        ASSERT_EQ(s, planes ? es : s0) << what;
        ASSERT_EQ(z, planes ? ez : z0) << what;
        ASSERT_EQ(c.zeros, rzeros) << what;
        ASSERT_EQ(c.nans, rnans) << what;
        for (size_t t = 0; t < sizes.size(); ++t) {
          const size_t n = sizes[t];
          const size_t shift = mode(t) == 2 ? 1 : 0;
          for (size_t i = 0; i < n; ++i) {
            ASSERT_TRUE(same_at(M, ms[t].data(), (mode(t) == 0 ? mrefs : m0s)[t].data(), i))
                << what << " tensor " << t << " m " << i;
          }
          if (mode(t) == 1 || mode(t) == 2) {
            const uint8_t* out = outs[t].data() + shift * SM;
            for (size_t i = 0; i < n; ++i) {
              ASSERT_TRUE(same_at(M, out, mrefs[t].data(), i))
                  << what << " tensor " << t << " m_out " << i;
            }
            ASSERT_EQ(std::memcmp(outs[t].data(), out0s[t].data(), shift * SM), 0) << what;
            ASSERT_EQ(
                std::memcmp(
                    out + n * SM, out0s[t].data() + (shift + n) * SM,
                    out0s[t].size() - (shift + n) * SM),
                0)
                << what << " tensor " << t << ": written past m_out";
          } else {
            ASSERT_EQ(outs[t], out0s[t]) << what << " tensor " << t;
          }
        }
        ++runs;
      }
    }
  }
}

TEST(CudaHostLionList, DirectionListMomentumOut) {
  std::mt19937_64 rng(62);
  size_t runs = 0;
  const size_t vec0 = g_vec_groups;
  check_direction_list_m_out<DType::kFloat32, DType::kFloat32>(rng, runs);
  check_direction_list_m_out<DType::kFloat32, DType::kBFloat16>(rng, runs);
  check_direction_list_m_out<DType::kBFloat16, DType::kBFloat16>(rng, runs);
  check_direction_list_m_out<DType::kBFloat16, DType::kFloat32>(rng, runs);
  check_direction_list_m_out<DType::kFloat16, DType::kFloat32>(rng, runs);
  check_direction_list_m_out<DType::kFloat16, DType::kBFloat16>(rng, runs);
  EXPECT_GT(g_vec_groups, vec0);
  EXPECT_GT(runs, 100u);
}

TEST(CudaHostLionList, DirectionListMatchesCpuPerTensor) {
  std::mt19937_64 rng(61);
  size_t runs = 0;
  check_direction_list<DType::kFloat32, DType::kFloat32>(rng, runs);
  check_direction_list<DType::kBFloat16, DType::kBFloat16>(rng, runs);
  check_direction_list<DType::kBFloat16, DType::kFloat32>(rng, runs);
  check_direction_list<DType::kFloat16, DType::kBFloat16>(rng, runs);
  EXPECT_GT(runs, 50u);
}

// apply_list_kernel with `blocks` blocks of kApplyThreads threads.
template <DType X, DType Dl>
void emu_apply_list(std::vector<ApplySeg> segs, float lr, float decay, size_t blocks) {
  const uint64_t units = optim::cuda::apply_units(segs.data(), segs.size());
  for (size_t b = 0; b < blocks; ++b) {
    cd::SegmentWalk<ApplySeg> walk(segs.data(), segs.size(), units);
    for (uint64_t u = b; u < units; u += blocks) {
      const ApplySeg s = segs[walk.at(u)];
      emu_apply_unit<X, Dl>(
          s.x, s.delta, static_cast<size_t>(s.n), optim::cuda::apply_first(s, u), lr, decay);
    }
  }
}

template <DType X, DType Dl>
void check_apply_list(std::mt19937_64& rng) {
  const size_t vec0 = g_vec_groups;
  std::vector<size_t> sizes = list_sizes();
  sizes.push_back(3 * cd::kApplyUnit + 100); // several units, by vectors
  sizes.push_back(2 * cd::kApplyUnit); // the same with delta one value off a boundary
  std::vector<std::vector<uint8_t>> x0s, deltas;
  for (size_t n : sizes) {
    x0s.push_back(random_floats(X, n, rng));
    deltas.push_back(random_floats(Dl, n + 1, rng));
  }
  std::vector<const uint8_t*> dptr;
  for (const auto& d : deltas) {
    dptr.push_back(d.data());
  }
  dptr.back() += bits::dtype_size(Dl);
  for (size_t blocks : {size_t{1}, size_t{2}, size_t{9}}) {
    auto xs = x0s, xr = x0s;
    std::vector<ApplySeg> segs;
    for (size_t t = 0; t < sizes.size(); ++t) {
      segs.push_back(ApplySeg{xs[t].data(), dptr[t], sizes[t], 0, 0});
      optim::lion_apply_dense(X, xr[t].data(), Dl, dptr[t], sizes[t], 3e-4f, 0.99997f);
    }
    emu_apply_list<X, Dl>(segs, 3e-4f, 0.99997f, blocks);
    for (size_t t = 0; t < sizes.size(); ++t) {
      for (size_t i = 0; i < sizes[t]; ++i) {
        ASSERT_TRUE(same_at(X, xs[t].data(), xr[t].data(), i))
            << dname(X) << "/" << dname(Dl) << " tensor " << t << " i=" << i;
      }
    }
  }
  EXPECT_GT(g_vec_groups, vec0) << dname(X) << "/" << dname(Dl) << ": no vector unit";
}

TEST(CudaHostLionList, ApplyListMatchesCpuPerTensor) {
  std::mt19937_64 rng(67);
  check_apply_list<DType::kFloat32, DType::kFloat32>(rng);
  check_apply_list<DType::kBFloat16, DType::kBFloat16>(rng);
  check_apply_list<DType::kBFloat16, DType::kFloat32>(rng);
  check_apply_list<DType::kFloat16, DType::kFloat16>(rng);
}

// apply_planes_list_kernel with `blocks` blocks of kApplyThreads threads;
// a unit counted in g_vec_groups where it takes the vector path.
template <DType X>
void emu_apply_planes_list(
    const std::vector<ApplySeg>& segs,
    const uint64_t* sign,
    const uint64_t* zero,
    float lr,
    float decay,
    size_t blocks) {
  std::vector<ApplySeg> table = segs;
  const uint64_t units = optim::cuda::apply_units(table.data(), table.size());
  for (size_t b = 0; b < blocks; ++b) {
    cd::SegmentWalk<ApplySeg> walk(table.data(), table.size(), units);
    for (uint64_t u = b; u < units; u += blocks) {
      const ApplySeg s = table[walk.at(u)];
      const size_t first = optim::cuda::apply_first(s, u);
      const bool vec = cd::apply_vec_aligned(s.x, s.x);
      g_vec_groups += vec && first + cd::kApplyUnit <= s.n ? 1 : 0;
      for (unsigned t = 0; t < cd::kApplyThreads; ++t) {
        cd::lion_apply_planes_unit<X>(
            static_cast<typename FloatStore<X>::U*>(s.x), static_cast<size_t>(s.n), first, t, vec,
            sign, zero, s.bit_offset, lr, decay);
      }
    }
  }
}

// The list's tensors end to end in a vote's result planes from bit `at`
// (random codes: -1, +1 and both kinds of 0), against the CPU's
// lion_apply_planes tensor by tensor; the last tensor's x one value off a
// 16-byte boundary (no vector unit).
template <DType X>
void check_apply_planes_list(std::mt19937_64& rng) {
  const size_t vec0 = g_vec_groups;
  std::vector<size_t> sizes = list_sizes();
  sizes.push_back(3 * cd::kApplyUnit + 100);
  sizes.push_back(2 * cd::kApplyUnit);
  const size_t esize = bits::dtype_size(X);
  for (size_t at : {size_t{0}, size_t{3}, size_t{57}, size_t{64}, size_t{127}}) {
    size_t total = at;
    for (size_t n : sizes) {
      total += n;
    }
    std::vector<uint64_t> sign(total / 64 + 2), zero(total / 64 + 2);
    for (size_t w = 0; w < sign.size(); ++w) {
      sign[w] = rng();
      zero[w] = rng() & rng(); // a quarter of the codes 0
    }
    std::vector<std::vector<uint8_t>> x0s;
    for (size_t n : sizes) {
      x0s.push_back(random_floats(X, n + 1, rng));
    }
    for (float lr : {3e-4f, 0.5f}) {
      const float decay = lr > 0.1f ? 1.0f : 0.99997f;
      for (size_t blocks : {size_t{1}, size_t{2}, size_t{9}}) {
        auto xs = x0s, xr = x0s;
        std::vector<ApplySeg> segs;
        size_t bit = at;
        for (size_t t = 0; t < sizes.size(); ++t) {
          const size_t shift = t + 1 == sizes.size() ? esize : 0;
          segs.push_back(ApplySeg{xs[t].data() + shift, nullptr, sizes[t], bit, 0});
          optim::lion_apply_planes(
              X, xr[t].data() + shift, sign.data(), zero.data(), bit, sizes[t], lr, decay);
          bit += sizes[t];
        }
        emu_apply_planes_list<X>(segs, sign.data(), zero.data(), lr, decay, blocks);
        for (size_t t = 0; t < sizes.size(); ++t) {
          ASSERT_EQ(xs[t], xr[t]) << dname(X) << " at=" << at << " tensor " << t
                                  << " (n=" << sizes[t] << ") lr=" << lr << " blocks=" << blocks;
        }
      }
    }
  }
  EXPECT_GT(g_vec_groups, vec0) << dname(X) << ": no vector unit";
}

TEST(CudaHostLionList, ApplyPlanesListMatchesCpuPerTensor) {
  std::mt19937_64 rng(71);
  check_apply_planes_list<DType::kFloat32>(rng);
  check_apply_planes_list<DType::kBFloat16>(rng);
  check_apply_planes_list<DType::kFloat16>(rng);
}

// plane_byte reads 8 bits from any bit, the next word only past bit 56.
TEST(CudaHostLionList, PlaneByteAtEveryBit) {
  std::mt19937_64 rng(73);
  const uint64_t words[3] = {rng(), rng(), rng()};
  for (uint64_t bit = 0; bit + 8 <= 192; ++bit) {
    uint32_t want = 0;
    for (unsigned i = 0; i < 8; ++i) {
      want |= static_cast<uint32_t>((words[(bit + i) / 64] >> ((bit + i) % 64)) & 1u) << i;
    }
    ASSERT_EQ(cd::plane_byte(words, bit), want) << bit;
  }
}

TEST(CudaHostLionList, SegmentOfSkipsEmptyTensors) {
  std::vector<DirectionSeg> segs{
      {nullptr, nullptr, nullptr, 0, 0, 0},
      {nullptr, nullptr, nullptr, 300, 0, 0},
      {nullptr, nullptr, nullptr, 0, 300, 0},
      {nullptr, nullptr, nullptr, 1, 300, 0}};
  const uint64_t units = optim::cuda::direction_units(segs.data(), segs.size());
  // 300 elements: 5 words, one unit of kDirGroups groups; 1 element at bit 300: one unit
  ASSERT_EQ(cd::kDirGroups * cd::kWordsPerWarpIter, 8);
  ASSERT_EQ(units, 1u + 1u);
  EXPECT_EQ(cd::segment_of(segs.data(), segs.size(), 0), 1u);
  EXPECT_EQ(cd::segment_of(segs.data(), segs.size(), 1), 3u);
}

// The grid loops' walk finds, for each of a warp's or block's units, the
// tensor a search of the whole table finds: lists with tensors of no units
// first, between others and last, one tensor, a unit a tensor, every stride
// (grid size) from 1 to past the units, and every starting unit.
TEST(CudaHostLionList, SegmentWalkFindsWhatTheSearchFinds) {
  std::mt19937_64 rng(74);
  const std::vector<std::vector<size_t>> lists{
      {5000}, {1, 1, 1, 1, 1}, {0, 0, 700, 0, 1, 0}, {300, 0, 0, 2048, 1, 64 * 9, 0}, {0}};
  std::vector<std::vector<size_t>> all = lists;
  for (int r = 0; r < 20; ++r) {
    std::vector<size_t> sizes(1 + rng() % 12);
    for (size_t& n : sizes) {
      n = rng() % 3 == 0 ? 0 : rng() % 3000;
    }
    all.push_back(sizes);
  }
  size_t checked = 0;
  for (const std::vector<size_t>& sizes : all) {
    std::vector<ApplySeg> segs;
    for (const size_t n : sizes) {
      segs.push_back(ApplySeg{nullptr, nullptr, n * 700, 0, 0}); // 700 elements make units vary
    }
    const uint64_t units = optim::cuda::apply_units(segs.data(), segs.size());
    for (uint64_t stride = 1; stride <= units + 1; stride += stride < 8 ? 1 : 1 + stride / 3) {
      for (uint64_t start = 0; start < std::min<uint64_t>(stride, units); ++start) {
        cd::SegmentWalk<ApplySeg> walk(segs.data(), segs.size(), units);
        for (uint64_t u = start; u < units; u += stride) {
          const ApplySeg& got = segs[walk.at(u)];
          const ApplySeg& want = segs[cd::segment_of(segs.data(), segs.size(), u)];
          ASSERT_EQ(got.first, want.first) << "unit " << u << " stride " << stride;
          ASSERT_EQ(got.n, want.n) << "unit " << u << " stride " << stride;
          ASSERT_LE(got.first, u);
          ASSERT_LT(u - got.first, (got.n + cd::kApplyUnit - 1) / cd::kApplyUnit);
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 10000u);
}

} // namespace
} // namespace lionbit::cuda_test
