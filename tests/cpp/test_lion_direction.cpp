// lion_direction (optimizer/lion.h): c = b1*m + omb1*g -> sign/zero bit-planes,
// m <- b2*m + omb2*g, against a naive scalar reference written straight from
// the contract in lion.h, on every ISA this CPU runs, bit for bit.
#include "optimizer/lion.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "test_util.h"

#include "lion_test_util.h"

namespace lionbit::optim {
namespace {

using namespace lion_test;

// ----------------------------------------------------------- reference ----

struct Coefs {
  float b1, omb1, b2, omb2;
};

// As the caller computes them: in double, rounded once.
Coefs coefs_from(double beta1, double beta2) {
  return {
      static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
      static_cast<float>(1.0 - beta2)};
}

struct Reference {
  std::vector<int> state; // 1: c > 0, 0: c == 0, -1: c < 0, 2: NaN
  std::vector<uint8_t> m; // new momentum, dtype md
  uint64_t zeros = 0;
  uint64_t nans = 0;
  uint64_t nonfinite = 0; // c NaN or +-Inf
};

Reference reference_direction(
    DType gd,
    const std::vector<uint8_t>& g,
    DType md,
    const std::vector<uint8_t>& m,
    size_t n,
    const Coefs& k) {
  Reference r;
  r.state.resize(n);
  r.m.resize(n * esize(md));
  for (size_t i = 0; i < n; ++i) {
    const float gf = widen(gd, g.data(), i);
    const float mf = widen(md, m.data(), i);
    const float c = ref_add(ref_mul(k.b1, mf), ref_mul(k.omb1, gf));
    const float mn = ref_add(ref_mul(k.b2, mf), ref_mul(k.omb2, gf));
    r.nonfinite += std::isfinite(c) ? 0 : 1;
    if (std::isnan(c)) {
      r.state[i] = 2;
      ++r.nans;
    } else if (c == 0.0f) {
      r.state[i] = 0;
      ++r.zeros;
    } else {
      r.state[i] = c > 0.0f ? 1 : -1;
    }
    ref_store(md, r.m.data(), i, mn);
  }
  return r;
}

bool bit_of(const uint64_t* w, size_t i) {
  return ((w[i / 64] >> (i % 64)) & 1u) != 0;
}

constexpr uint64_t kPoisonWord = 0xdeadbeefdeadbeefull;

struct DirRun {
  std::vector<uint8_t> m;
  std::vector<uint64_t> sign, zero;
  bits::PackCounts counts;
};

// Runs lion_direction on guarded copies and checks that nothing past the
// ends was touched and every bit-plane word was written.
DirRun run_direction(
    DType gd,
    const std::vector<uint8_t>& g,
    DType md,
    const std::vector<uint8_t>& m,
    size_t n,
    const Coefs& k,
    Isa isa) {
  const size_t words = bits::words_for(n);
  Guarded gb(n * esize(gd)), mb(n * esize(md));
  Guarded sb(words * 8), zb(words * 8);
  gb.fill(g);
  mb.fill(m);
  for (size_t w = 0; w < words; ++w) {
    sb.words()[w] = kPoisonWord;
    zb.words()[w] = kPoisonWord;
  }
  DirRun r;
  r.counts = lion_direction(
      gd, gb.bytes(), md, mb.bytes(), n, k.b1, k.omb1, k.b2, k.omb2, sb.words(), zb.words(), isa);
  EXPECT_TRUE(gb.guard_intact()) << "wrote past the end of g";
  EXPECT_TRUE(mb.guard_intact()) << "wrote past the end of m";
  EXPECT_TRUE(sb.guard_intact()) << "wrote past the end of sign";
  EXPECT_TRUE(zb.guard_intact()) << "wrote past the end of zero";
  EXPECT_TRUE(equal_bytes(gb.bytes(), g.data(), g.size())) << "g modified";
  r.m.assign(mb.bytes(), mb.bytes() + n * esize(md));
  r.sign.assign(sb.words(), sb.words() + words);
  r.zero.assign(zb.words(), zb.words() + words);

  // lion_direction_only on the original momentum: the same bits and counts,
  // and m left as it was.
  Guarded m2(n * esize(md)), s2(words * 8), z2(words * 8);
  m2.fill(m);
  const bits::PackCounts c2 = lion_direction_only(
      gd, gb.bytes(), md, m2.bytes(), n, k.b1, k.omb1, s2.words(), z2.words(), isa);
  EXPECT_TRUE(m2.guard_intact() && s2.guard_intact() && z2.guard_intact())
      << "lion_direction_only wrote past an end";
  EXPECT_TRUE(equal_bytes(m2.bytes(), m.data(), m.size())) << "lion_direction_only modified m";
  EXPECT_EQ(c2.zeros, r.counts.zeros);
  EXPECT_EQ(c2.nans, r.counts.nans);
  EXPECT_EQ(c2.nonfinite, r.counts.nonfinite);
  EXPECT_TRUE(n == 0 || equal_bytes(s2.bytes(), sb.bytes(), words * 8))
      << "lion_direction_only sign bits differ";
  EXPECT_TRUE(n == 0 || equal_bytes(z2.bytes(), zb.bytes(), words * 8))
      << "lion_direction_only zero bits differ";

  // lion_direction_to on the original momentum: the same bits and counts, m
  // left as it was, and m_out given what lion_direction left in m.
  Guarded m3(n * esize(md)), o3(n * esize(md)), s3(words * 8), z3(words * 8);
  m3.fill(m);
  const bits::PackCounts c3 = lion_direction_to(
      gd, gb.bytes(), md, m3.bytes(), o3.bytes(), n, k.b1, k.omb1, k.b2, k.omb2, s3.words(),
      z3.words(), isa);
  EXPECT_TRUE(m3.guard_intact() && o3.guard_intact() && s3.guard_intact() && z3.guard_intact())
      << "lion_direction_to wrote past an end";
  EXPECT_TRUE(equal_bytes(m3.bytes(), m.data(), m.size())) << "lion_direction_to modified m";
  EXPECT_TRUE(equal_bytes(o3.bytes(), r.m.data(), r.m.size()))
      << "lion_direction_to's m_out differs from lion_direction's m";
  EXPECT_EQ(c3.zeros, r.counts.zeros);
  EXPECT_EQ(c3.nans, r.counts.nans);
  EXPECT_EQ(c3.nonfinite, r.counts.nonfinite);
  EXPECT_TRUE(n == 0 || equal_bytes(s3.bytes(), sb.bytes(), words * 8))
      << "lion_direction_to sign bits differ";
  EXPECT_TRUE(n == 0 || equal_bytes(z3.bytes(), zb.bytes(), words * 8))
      << "lion_direction_to zero bits differ";
  return r;
}

// Compares a run with the reference; stops at the first difference.
void expect_matches(const Reference& ref, const DirRun& run, DType md, size_t n) {
  EXPECT_EQ(run.counts.zeros, ref.zeros);
  EXPECT_EQ(run.counts.nans, ref.nans);
  EXPECT_EQ(run.counts.nonfinite, ref.nonfinite);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(bit_of(run.sign.data(), i), ref.state[i] == 1)
        << "sign bit of element " << i << " (state " << ref.state[i] << ")";
    ASSERT_EQ(bit_of(run.zero.data(), i), ref.state[i] == 0)
        << "zero bit of element " << i << " (state " << ref.state[i] << ")";
    ASSERT_TRUE(same_at(md, run.m.data(), ref.m.data(), i))
        << "momentum of element " << i << ": got " << hex_at(md, run.m.data(), i) << ", want "
        << hex_at(md, ref.m.data(), i);
  }
  for (size_t i = n; i < run.sign.size() * 64; ++i) {
    ASSERT_FALSE(bit_of(run.sign.data(), i)) << "tail bit " << i;
    ASSERT_FALSE(bit_of(run.zero.data(), i)) << "tail bit " << i;
  }
}

// ---------------------------------------------- parameterized: random ----

struct Combo {
  DType g, m;
};
const Combo kCombos[] = {
    {DType::kFloat32, DType::kFloat32},   {DType::kBFloat16, DType::kFloat32},
    {DType::kFloat16, DType::kFloat32},   {DType::kFloat32, DType::kBFloat16},
    {DType::kBFloat16, DType::kBFloat16}, {DType::kFloat16, DType::kBFloat16},
};
const size_t kSizes[] = {0, 1, 63, 64, 65, 1000, 4097, 100003, 1000000};
const Isa kIsas[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512};

class LionDirection : public ::testing::TestWithParam<std::tuple<int, size_t, Isa>> {};

TEST_P(LionDirection, MatchesNaiveReferenceBitForBit) {
  const auto [ci, n, isa] = GetParam();
  if (!bits::isa_supported(isa)) {
    GTEST_SKIP() << bits::isa_name(isa) << " not supported on this CPU";
  }
  ASSERT_EQ(lion_kernel_isa(isa), isa)
      << "the " << bits::isa_name(isa) << " kernels are not the ones run";
  const Combo c = kCombos[ci];
  ASSERT_TRUE(lion_direction_dtypes_supported(c.g, c.m));
  std::mt19937_64 rng(1000003 * n + 17 * static_cast<uint64_t>(ci));
  // Gradients and momenta over many binades (denormal results included).
  const auto g = make_values(c.g, n, rng, -40, 8);
  const auto m = make_values(c.m, n, rng, -40, 8);
  // Typical betas, and ones whose complements are not short binary fractions.
  for (const Coefs& k :
       {coefs_from(0.9, 0.99), coefs_from(0.95, 0.98), coefs_from(1.0 / 3.0, 0.7)}) {
    SCOPED_TRACE(::testing::Message() << "b1 " << k.b1 << " b2 " << k.b2);
    const Reference ref = reference_direction(c.g, g, c.m, m, n, k);
    const DirRun run = run_direction(c.g, g, c.m, m, n, k, isa);
    expect_matches(ref, run, c.m, n);
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllCombosSizesIsas,
    LionDirection,
    ::testing::Combine(
        ::testing::Range(0, static_cast<int>(std::size(kCombos))),
        ::testing::ValuesIn(kSizes),
        ::testing::ValuesIn(kIsas)),
    [](const auto& info) {
      const Combo c = kCombos[std::get<0>(info.param)];
      return std::string("g_") + bits::dtype_name(c.g) + "_m_" + bits::dtype_name(c.m) + "_n" +
          std::to_string(std::get<1>(info.param)) + "_" + bits::isa_name(std::get<2>(info.param));
    });

std::vector<Isa> supported() {
  return bits::test::supported_isas();
}

// ------------------------------------------------------ special values ----

// Hand-worked IEEE cases with b1 = omb1 = 0.5, b2 = 0.25, omb2 = 0.75 (all
// exact), at positions in whole words (vector path) and in the tail.
TEST(LionDirectionSpecial, HandWorkedSignsZerosNans) {
  const float inf = INFINITY, nan = NAN;
  const float den = from_bits(0x00000001); // 2^-149
  struct Case {
    float g, m;
    int state; // 1 +, 0 zero, -1 -, 2 NaN
  };
  const Case cases[] = {
      {1.0f, 1.0f, 1},
      {-1.0f, 1.0f, 0}, // 0.5 - 0.5 = +0
      {-0.0f, -0.0f, 0}, // -0 + -0 = -0
      {0.0f, -0.0f, 0},
      {inf, 1.0f, 1},
      {-inf, 1e30f, -1},
      {inf, -inf, 2}, // -inf + inf
      {nan, 1.0f, 2},
      {1.0f, nan, 2},
      {-nan, -nan, 2},
      {den, 0.0f, 0}, // 2^-150: a tie, rounds to even = 0
      {from_bits(0x00000003), 0.0f, 1}, // 1.5 * 2^-149 -> 2^-148
      {-den, 0.0f, 0}, // -2^-150 -> -0
      {-den, -0.0f, 0},
      {den, den, 0}, // each product rounds to 0 first: 0 + 0, not 2^-149
      {-1e-30f, 0.0f, -1},
      {from_bits(0x7f7fffff), from_bits(0x7f7fffff), 1}, // max/2 + max/2
      {-3.0f, 2.0f, -1},
  };
  const Coefs k{0.5f, 0.5f, 0.25f, 0.75f};
  const size_t ncase = std::size(cases);
  for (size_t n : {size_t{64} * 3 + 41, ncase}) {
    for (Isa isa : supported()) {
      SCOPED_TRACE(::testing::Message() << bits::isa_name(isa) << " n " << n);
      std::vector<float> g(n, 2.0f), m(n, 2.0f);
      std::vector<int> want(n, 1);
      // Cases at the start (vector path), and from 64*3 (the tail).
      for (size_t base : {size_t{5}, size_t{64} * 3}) {
        for (size_t j = 0; j < ncase && base + j < n; ++j) {
          g[base + j] = cases[j].g;
          m[base + j] = cases[j].m;
          want[base + j] = cases[j].state;
        }
      }
      std::vector<uint8_t> gb(n * 4), mb(n * 4);
      std::memcpy(gb.data(), g.data(), n * 4);
      std::memcpy(mb.data(), m.data(), n * 4);
      const Reference ref = reference_direction(DType::kFloat32, gb, DType::kFloat32, mb, n, k);
      ASSERT_EQ(ref.state, want) << "the reference itself";
      const DirRun run = run_direction(DType::kFloat32, gb, DType::kFloat32, mb, n, k, isa);
      expect_matches(ref, run, DType::kFloat32, n);
      for (size_t base : {size_t{5}, size_t{64} * 3}) {
        if (base + 2 < n) { // new m = 0.25 * 1 + 0.75 * -1 = -0.5
          float got;
          std::memcpy(&got, run.m.data() + 4 * (base + 1), 4);
          EXPECT_EQ(got, -0.5f);
        }
      }
    }
  }
}

// b2 = 0, omb2 = 1, m = -1: new m = -0 + g = g exactly, so the store of g
// itself is tested: bfloat16 round to nearest even at halfway values,
// overflow, denormals, signed zero, NaN.
TEST(LionDirectionSpecial, BFloat16MomentumRounding) {
  struct Case {
    uint32_t g;
    uint16_t want;
  };
  const Case cases[] = {
      {0x3f808000, 0x3f80}, // 1 + 2^-8: halfway, even below
      {0x3f818000, 0x3f82}, // halfway, odd below: up
      {0x3f808001, 0x3f81}, {0x3f807fff, 0x3f80}, {0xbf808000, 0xbf80},
      {0xbf818000, 0xbf82}, {0x7f7fffff, 0x7f80}, // largest float rounds to +inf
      {0x7f7f7fff, 0x7f7f}, {0x7f7f8000, 0x7f80}, // halfway to inf: even = inf
      {0xff7f8000, 0xff80}, {0x00008000, 0x0000}, // denormal halfway: even 0
      {0x00018000, 0x0002}, {0x80008001, 0x8001}, {0x00000001, 0x0000},
      {0x80000001, 0x8000}, {0x7f800000, 0x7f80}, {0xff800000, 0xff80},
      {0x00000000, 0x0000}, {0x80000000, 0x8000}, {0x3dcccccd, 0x3dcd}, // 0.1f
  };
  const size_t ncase = std::size(cases);
  const Coefs k{0.5f, 0.5f, 0.0f, 1.0f};
  for (Isa isa : supported()) {
    for (size_t base : {size_t{0}, size_t{64} + 30, size_t{128}}) {
      SCOPED_TRACE(::testing::Message() << bits::isa_name(isa) << " at " << base);
      const size_t n = base + ncase;
      std::vector<uint8_t> g(n * 4), m(n * 2);
      for (size_t i = 0; i < n; ++i) {
        const uint32_t gi = i >= base ? cases[i - base].g : 0x3f800000u;
        std::memcpy(g.data() + 4 * i, &gi, 4);
        const uint16_t mi = 0xbf80; // -1
        std::memcpy(m.data() + 2 * i, &mi, 2);
      }
      const Reference ref = reference_direction(DType::kFloat32, g, DType::kBFloat16, m, n, k);
      const DirRun run = run_direction(DType::kFloat32, g, DType::kBFloat16, m, n, k, isa);
      expect_matches(ref, run, DType::kBFloat16, n);
      for (size_t j = 0; j < ncase; ++j) {
        uint16_t got, want_ref;
        std::memcpy(&got, run.m.data() + 2 * (base + j), 2);
        std::memcpy(&want_ref, ref.m.data() + 2 * (base + j), 2);
        EXPECT_EQ(got, cases[j].want) << "case " << j;
        EXPECT_EQ(want_ref, cases[j].want) << "reference, case " << j;
      }
      // NaN stays NaN.
      std::vector<uint8_t> g2 = g;
      const uint32_t qnan = 0x7fc12345u, snan = 0xff800001u;
      std::memcpy(g2.data() + 4 * base, &qnan, 4);
      std::memcpy(g2.data() + 4 * (n - 1), &snan, 4);
      const DirRun r2 = run_direction(DType::kFloat32, g2, DType::kBFloat16, m, n, k, isa);
      EXPECT_TRUE(is_nan_at(DType::kBFloat16, r2.m.data(), base));
      EXPECT_TRUE(is_nan_at(DType::kBFloat16, r2.m.data(), n - 1));
      EXPECT_EQ(r2.counts.nans, 2u);
    }
  }
}

// Exact widening of float16 / bfloat16 gradients (subnormals included):
// b2 = 0, omb2 = 1, float32 momentum -1 gives new m = g widened.
TEST(LionDirectionSpecial, HalfGradientsWidenExactly) {
  struct Case {
    DType d;
    uint16_t g;
    uint32_t want;
  };
  const Case cases[] = {
      {DType::kFloat16, 0x0001, 0x33800000}, // 2^-24
      {DType::kFloat16, 0x8001, 0xb3800000},
      {DType::kFloat16, 0x03ff, 0x387fc000}, // largest subnormal
      {DType::kFloat16, 0x0200, 0x38000000},
      {DType::kFloat16, 0x0400, 0x38800000}, // smallest normal
      {DType::kFloat16, 0x7bff, 0x477fe000}, // 65504
      {DType::kFloat16, 0x3c01, 0x3f802000},
      {DType::kFloat16, 0x7c00, 0x7f800000},
      {DType::kFloat16, 0xfc00, 0xff800000},
      {DType::kFloat16, 0x8000, 0x80000000},
      {DType::kBFloat16, 0x0001, 0x00010000}, // float32 denormal
      {DType::kBFloat16, 0x807f, 0x807f0000},
      {DType::kBFloat16, 0x7f7f, 0x7f7f0000},
      {DType::kBFloat16, 0x3f81, 0x3f810000},
      {DType::kBFloat16, 0x8000, 0x80000000},
  };
  const Coefs k{0.5f, 0.5f, 0.0f, 1.0f};
  for (DType d : {DType::kFloat16, DType::kBFloat16}) {
    for (Isa isa : supported()) {
      SCOPED_TRACE(::testing::Message() << bits::isa_name(isa) << " " << bits::dtype_name(d));
      // 64 cases in a whole word, repeated; then the same in a tail.
      std::vector<const Case*> mine;
      for (const Case& c : cases) {
        if (c.d == d) {
          mine.push_back(&c);
        }
      }
      const size_t n = 64 + 64 + mine.size();
      std::vector<uint8_t> g(n * 2), m(n * 4);
      const float minus_one = -1.0f;
      for (size_t i = 0; i < n; ++i) {
        std::memcpy(g.data() + 2 * i, &mine[i % mine.size()]->g, 2);
        std::memcpy(m.data() + 4 * i, &minus_one, 4);
      }
      const DirRun run = run_direction(d, g, DType::kFloat32, m, n, k, isa);
      const Reference ref = reference_direction(d, g, DType::kFloat32, m, n, k);
      expect_matches(ref, run, DType::kFloat32, n);
      for (size_t i = 0; i < n; ++i) {
        uint32_t got;
        std::memcpy(&got, run.m.data() + 4 * i, 4);
        ASSERT_EQ(got, mine[i % mine.size()]->want) << "element " << i;
      }
    }
  }
}

// Pairs where c is close to 0 after cancellation, kept only where a fused
// multiply-add (either product fused) would give c another sign class than
// the separately rounded products: a kernel that fused would fail here, not
// only by chance in the random tests (where the sign of c rarely depends on
// it).
TEST(LionDirectionSpecial, SeparateRoundingDecidesTheSign) {
  const Coefs k = coefs_from(0.9, 0.99);
  const auto state = [](float c) {
    return std::isnan(c) ? 2 : (c == 0.0f ? 0 : (c > 0.0f ? 1 : -1));
  };
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  std::vector<float> gv, mv;
  for (int tries = 0; tries < 200000 && gv.size() < 4096; ++tries) {
    float mf = static_cast<float>(std::ldexp(1.0 + u01(rng), static_cast<int>(rng() % 40) - 20));
    if ((rng() & 1) != 0) {
      mf = -mf;
    }
    const volatile float t = -ref_mul(k.b1, mf) / k.omb1;
    float gf = t;
    for (int d = 0; d < static_cast<int>(rng() % 3); ++d) {
      gf = std::nextafter(gf, (rng() & 1) != 0 ? INFINITY : -INFINITY);
    }
    const int separate = state(ref_add(ref_mul(k.b1, mf), ref_mul(k.omb1, gf)));
    const int fused1 = state(std::fma(k.b1, mf, ref_mul(k.omb1, gf)));
    const int fused2 = state(std::fma(k.omb1, gf, ref_mul(k.b1, mf)));
    if (separate != fused1 || separate != fused2) {
      gv.push_back(gf);
      mv.push_back(mf);
    }
  }
  ASSERT_GE(gv.size(), 1000u) << "too few cases where fusing changes the sign";
  const size_t n = gv.size();
  std::vector<uint8_t> g(n * 4), m(n * 4);
  std::memcpy(g.data(), gv.data(), n * 4);
  std::memcpy(m.data(), mv.data(), n * 4);
  const Reference ref = reference_direction(DType::kFloat32, g, DType::kFloat32, m, n, k);
  for (Isa isa : supported()) {
    SCOPED_TRACE(bits::isa_name(isa));
    const DirRun run = run_direction(DType::kFloat32, g, DType::kFloat32, m, n, k, isa);
    expect_matches(ref, run, DType::kFloat32, n);
  }
}

// ---------------------------------------------------------- contract ----

// Every ISA the CPU supports runs its own kernels (not a fall-back), and on a
// CPU with AVX-512 / AVX2 this build has those kernels: the vector paths are
// really the ones tested above.
TEST(LionDirectionIsa, VectorPathsAreExercised) {
  for (Isa isa : kIsas) {
    if (bits::isa_supported(isa)) {
      EXPECT_EQ(lion_kernel_isa(isa), isa) << bits::isa_name(isa);
    } else {
      EXPECT_LT(static_cast<int>(lion_kernel_isa(isa)), static_cast<int>(isa));
    }
  }
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
    EXPECT_EQ(lion_kernel_isa(Isa::kAvx2), Isa::kAvx2);
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    EXPECT_EQ(lion_kernel_isa(Isa::kAvx512), Isa::kAvx512);
  }
#endif
  std::string ran;
  for (Isa isa : supported()) {
    ran += std::string(ran.empty() ? "" : ",") + bits::isa_name(isa);
  }
  ::testing::Test::RecordProperty("lion_isas", ran);
  std::printf("lion kernels tested on: %s\n", ran.c_str());
}

TEST(LionDirectionContract, DtypeSupport) {
  for (DType g : bits::test::all_dtypes()) {
    for (DType m : bits::test::all_dtypes()) {
      const bool want = (g == DType::kFloat32 || g == DType::kBFloat16 || g == DType::kFloat16) &&
          (m == DType::kFloat32 || m == DType::kBFloat16);
      EXPECT_EQ(lion_direction_dtypes_supported(g, m), want)
          << bits::dtype_name(g) << " " << bits::dtype_name(m);
    }
  }
}

// An unsupported combination touches nothing and returns {}.
TEST(LionDirectionContract, UnsupportedDtypesTouchNothing) {
  const size_t n = 200;
  for (Isa isa : supported()) {
    for (auto [gd, md] :
         {std::pair{DType::kFloat64, DType::kFloat32}, std::pair{DType::kFloat32, DType::kFloat16},
          std::pair{DType::kInt8, DType::kFloat32}, std::pair{DType::kFloat32, DType::kFloat64}}) {
      std::vector<uint8_t> g(n * 8, 0x3f), m(n * 8, 0x41);
      std::vector<uint64_t> s(4, kPoisonWord), z(4, kPoisonWord);
      const auto c = lion_direction(
          gd, g.data(), md, m.data(), n, 0.9f, 0.1f, 0.99f, 0.01f, s.data(), z.data(), isa);
      EXPECT_EQ(c.zeros, 0u);
      EXPECT_EQ(c.nans, 0u);
      EXPECT_TRUE(std::all_of(m.begin(), m.end(), [](uint8_t b) { return b == 0x41; }));
      EXPECT_TRUE(std::all_of(s.begin(), s.end(), [](uint64_t w) { return w == kPoisonWord; }));
      EXPECT_TRUE(std::all_of(z.begin(), z.end(), [](uint64_t w) { return w == kPoisonWord; }));
    }
  }
}

TEST(LionDirectionContract, ZeroElementsTouchNothing) {
  for (Isa isa : supported()) {
    const auto c = lion_direction(
        DType::kFloat32, nullptr, DType::kFloat32, nullptr, 0, 0.9f, 0.1f, 0.99f, 0.01f, nullptr,
        nullptr, isa);
    EXPECT_EQ(c.zeros, 0u);
    EXPECT_EQ(c.nans, 0u);
  }
}

// Splitting a call at multiples of 64 elements (as lion.h documents for
// threads) gives the same result as one call, and ISAs can be mixed.
TEST(LionDirectionContract, SplitAtWordsEqualsOneCall) {
  const size_t n = 64 * 37 + 19;
  std::mt19937_64 rng(7);
  const auto g = make_values(DType::kBFloat16, n, rng, -20, 4);
  const auto m = make_values(DType::kFloat32, n, rng, -20, 4);
  const Coefs k = coefs_from(0.9, 0.99);
  const DirRun whole = run_direction(DType::kBFloat16, g, DType::kFloat32, m, n, k, Isa::kScalar);
  const auto isas = supported();
  std::vector<uint8_t> mm = m;
  std::vector<uint64_t> s(bits::words_for(n)), z(bits::words_for(n));
  bits::PackCounts total;
  size_t i0 = 0;
  for (size_t part = 0; i0 < n; ++part) {
    const size_t len = std::min(n - i0, size_t{64} * (part % 5 + 1));
    const auto c = lion_direction(
        DType::kBFloat16, g.data() + 2 * i0, DType::kFloat32, mm.data() + 4 * i0, len, k.b1, k.omb1,
        k.b2, k.omb2, s.data() + i0 / 64, z.data() + i0 / 64, isas[part % isas.size()]);
    total.zeros += c.zeros;
    total.nans += c.nans;
    i0 += len;
  }
  EXPECT_EQ(total.zeros, whole.counts.zeros);
  EXPECT_EQ(total.nans, whole.counts.nans);
  EXPECT_EQ(s, whole.sign);
  EXPECT_EQ(z, whole.zero);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(same_at(DType::kFloat32, mm.data(), whole.m.data(), i)) << i;
  }
}

// The same layout as bits::pack_signs: with b1 = 0, omb1 = 1, c = 0*m + g,
// so the planes equal pack_signs(g) wherever m is finite.
TEST(LionDirectionContract, SameLayoutAsPackSigns) {
  const size_t n = 64 * 50 + 33;
  std::mt19937_64 rng(11);
  const auto g = make_values(DType::kFloat32, n, rng, -130, 10);
  std::vector<uint8_t> m(n * 4);
  const float one = 1.0f;
  for (size_t i = 0; i < n; ++i) {
    std::memcpy(m.data() + 4 * i, &one, 4);
  }
  std::vector<uint64_t> ps(bits::words_for(n)), pz(bits::words_for(n));
  const auto pc = bits::pack_signs(DType::kFloat32, g.data(), n, ps.data(), pz.data());
  for (Isa isa : supported()) {
    const DirRun run = run_direction(
        DType::kFloat32, g, DType::kFloat32, m, n, Coefs{0.0f, 1.0f, 0.5f, 0.5f}, isa);
    EXPECT_EQ(run.sign, ps) << bits::isa_name(isa);
    EXPECT_EQ(run.zero, pz) << bits::isa_name(isa);
    EXPECT_EQ(run.counts.zeros, pc.zeros);
    EXPECT_EQ(run.counts.nans, pc.nans);
  }
}

} // namespace
} // namespace lionbit::optim
