// lion_apply_dense (optimizer/lion.h): x <- x*decay - lr*Delta with Delta
// from a dense buffer, against a naive scalar reference written straight from
// the contract in lion.h, on every ISA this CPU runs, bit for bit.
// (The reference helpers repeat those of test_lion_direction.cpp so that each
// test file stands alone.)
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

struct Step {
  float lr, decay;
};

// As the caller computes them: in double, rounded once.
Step step_from(double lr, double wd) {
  return {static_cast<float>(lr), static_cast<float>(1.0 - lr * wd)};
}

// Typical; large (decay far from 1); lr = 2^-12 with decay 1, which puts
// x -+ lr exactly halfway between two float16 / bfloat16 / float32 values in
// some binades (ties to even); an odd lr without decay.
const Step kSteps[] = {
    step_from(1e-4, 0.1), step_from(0.3, 1.5), step_from(1.0 / 4096, 0.0), step_from(0.01, 0.0)};

float ref_update(float x, const Step& s, float delta) {
  return ref_sub(ref_mul(x, s.decay), ref_mul(s.lr, delta));
}

// Dense Delta values: vote results {-1, 0, +1} (and -0), averages k/N for
// N = 1..8, ordinary values over many binades, specials.
std::vector<uint8_t> make_deltas(DType d, size_t n, std::mt19937_64& rng) {
  std::vector<uint8_t> buf(n * esize(d));
  const auto sp = specials(d);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  std::uniform_int_distribution<int> ex(-30, 6);
  for (size_t i = 0; i < n; ++i) {
    const double p = u01(rng);
    if (p < 0.05) {
      const uint32_t s = sp[rng() % sp.size()];
      std::memcpy(buf.data() + esize(d) * i, &s, esize(d));
      continue;
    }
    float v;
    if (p < 0.45) {
      const float votes[] = {-1.0f, 0.0f, 1.0f, -0.0f};
      v = votes[rng() % 4];
    } else if (p < 0.75) {
      const int nr = static_cast<int>(rng() % 8) + 1;
      const int k = static_cast<int>(rng() % static_cast<uint64_t>(2 * nr + 1)) - nr;
      v = static_cast<float>(static_cast<double>(k) / nr);
    } else {
      v = static_cast<float>(std::ldexp(1.0 + u01(rng), ex(rng)) * ((rng() & 1) != 0 ? -1 : 1));
    }
    ref_store(d, buf.data(), i, v);
  }
  return buf;
}

std::vector<uint8_t> reference_dense(
    DType xd,
    const std::vector<uint8_t>& x,
    DType dd,
    const std::vector<uint8_t>& delta,
    size_t n,
    const Step& s) {
  std::vector<uint8_t> out(n * esize(xd));
  for (size_t i = 0; i < n; ++i) {
    ref_store(xd, out.data(), i, ref_update(widen(xd, x.data(), i), s, widen(dd, delta.data(), i)));
  }
  return out;
}

std::vector<uint8_t> run_dense(
    DType xd,
    const std::vector<uint8_t>& x,
    DType dd,
    const std::vector<uint8_t>& delta,
    size_t n,
    const Step& s,
    Isa isa) {
  Guarded xb(n * esize(xd)), db(n * esize(dd));
  xb.fill(x);
  db.fill(delta);
  lion_apply_dense(xd, xb.bytes(), dd, db.bytes(), n, s.lr, s.decay, isa);
  EXPECT_TRUE(xb.guard_intact()) << "wrote past the end of x";
  EXPECT_TRUE(db.guard_intact()) << "wrote past the end of delta";
  EXPECT_TRUE(equal_bytes(db.bytes(), delta.data(), delta.size())) << "delta modified";
  return std::vector<uint8_t>(xb.bytes(), xb.bytes() + n * esize(xd));
}

void expect_same(
    DType xd,
    const std::vector<uint8_t>& got,
    const std::vector<uint8_t>& want,
    size_t n) {
  for (size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(same_at(xd, got.data(), want.data(), i))
        << "element " << i << ": got " << hex_at(xd, got.data(), i) << ", want "
        << hex_at(xd, want.data(), i);
  }
}

// ---------------------------------------------- parameterized: random ----

const DType kParams[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
const size_t kSizes[] = {0, 1, 63, 64, 65, 1000, 4097, 100003, 1000000};
const Isa kIsas[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512};

std::string isa_check(Isa isa) {
  if (!bits::isa_supported(isa)) {
    return std::string(bits::isa_name(isa)) + " not supported on this CPU";
  }
  return "";
}

class LionApplyDense : public ::testing::TestWithParam<std::tuple<int, int, size_t, Isa>> {};

TEST_P(LionApplyDense, MatchesNaiveReferenceBitForBit) {
  const auto [xi, di, n, isa] = GetParam();
  if (!bits::isa_supported(isa)) {
    GTEST_SKIP() << isa_check(isa);
  }
  ASSERT_EQ(lion_kernel_isa(isa), isa);
  const DType xd = kParams[xi], dd = kParams[di];
  ASSERT_TRUE(lion_apply_dtypes_supported(xd, dd));
  std::mt19937_64 rng(1000003 * n + 31 * static_cast<uint64_t>(xi) + static_cast<uint64_t>(di));
  const auto x = make_values(xd, n, rng, -20, 12);
  const auto delta = make_deltas(dd, n, rng);
  for (const Step& s : kSteps) {
    SCOPED_TRACE(::testing::Message() << "lr " << s.lr << " decay " << s.decay);
    const auto want = reference_dense(xd, x, dd, delta, n, s);
    const auto got = run_dense(xd, x, dd, delta, n, s, isa);
    expect_same(xd, got, want, n);
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllCombosSizesIsas,
    LionApplyDense,
    ::testing::Combine(
        ::testing::Range(0, 3),
        ::testing::Range(0, 3),
        ::testing::ValuesIn(kSizes),
        ::testing::ValuesIn(kIsas)),
    [](const auto& info) {
      return std::string("x_") + bits::dtype_name(kParams[std::get<0>(info.param)]) + "_delta_" +
          bits::dtype_name(kParams[std::get<1>(info.param)]) + "_n" +
          std::to_string(std::get<2>(info.param)) + "_" + bits::isa_name(std::get<3>(info.param));
    });

std::vector<Isa> supported() {
  return bits::test::supported_isas();
}

// ------------------------------------------------------ rounding edges ----

// x = -0, decay = 1, lr = 1, Delta = -v: x_new = -0 - (-v) = v exactly, so
// the store of v itself is tested: round to nearest even at halfway values,
// overflow to Inf, float16 subnormals, signed zeros.
struct Edge {
  uint32_t v;
  uint16_t want;
};

const Edge kF16Edges[] = {
    {0x3f801000, 0x3c00}, // 1 + 2^-11: halfway, even below
    {0x3f803000, 0x3c02}, // halfway, odd below: up
    {0x3f801001, 0x3c01}, {0x477fe000, 0x7bff}, // 65504, the largest float16
    {0x477fefff, 0x7bff}, // just below 65520
    {0x477ff000, 0x7c00}, // 65520: halfway to 65536, ties to Inf
    {0xc77ff000, 0xfc00}, {0x501502f9, 0x7c00}, // 1e10
    {0x38800000, 0x0400}, // 2^-14, the smallest normal
    {0x387fe000, 0x0400}, // 1023.5 * 2^-24: tie, up to the smallest normal
    {0x387fa000, 0x03fe}, // 1022.5 * 2^-24: tie, even below
    {0x33800000, 0x0001}, // 2^-24, the smallest subnormal
    {0x33000000, 0x0000}, // 2^-25: tie between 0 and 2^-24, even = 0
    {0x33000001, 0x0001}, // just above: up
    {0x33c00000, 0x0002}, // 1.5 * 2^-24: tie, even = 2
    {0xb3400000, 0x8001}, // -0.75 * 2^-24
    {0xb2800000, 0x8000}, // -2^-26
    {0x00000001, 0x0000}, // float32 denormal
    {0x80000001, 0x8000}, {0x7f800000, 0x7c00}, {0xff800000, 0xfc00},
    {0x00000000, 0x0000}, {0x80000000, 0x8000}, {0x3dcccccd, 0x2e66}, // 0.1f
};

const Edge kBF16Edges[] = {
    {0x3f808000, 0x3f80}, // 1 + 2^-8: halfway, even below
    {0x3f818000, 0x3f82}, // halfway, odd below: up
    {0x3f808001, 0x3f81}, {0x3f807fff, 0x3f80}, {0xbf818000, 0xbf82},
    {0x7f7fffff, 0x7f80}, // the largest float32 rounds to Inf
    {0x7f7f7fff, 0x7f7f}, {0x7f7f8000, 0x7f80}, // halfway to Inf, odd below: Inf
    {0x00008000, 0x0000}, // denormal halfway: even 0
    {0x00018000, 0x0002}, {0x80008001, 0x8001}, {0x00000001, 0x0000},
    {0x80000001, 0x8000}, {0x7f800000, 0x7f80}, {0xff800000, 0xff80},
    {0x00000000, 0x0000}, {0x80000000, 0x8000}, {0x3dcccccd, 0x3dcd}, // 0.1f
};

void check_edges(DType xd, const Edge* edges, size_t count) {
  const Step one{1.0f, 1.0f};
  const uint16_t minus_zero = 0x8000;
  for (Isa isa : supported()) {
    // At the start (vector path), across a vector boundary and in the tail.
    for (size_t base : {size_t{0}, size_t{64} + 3, size_t{128}}) {
      SCOPED_TRACE(::testing::Message() << bits::isa_name(isa) << " at " << base);
      const size_t n = std::max(base + count, size_t{128});
      std::vector<uint8_t> x(n * 2), delta(n * 4);
      for (size_t i = 0; i < n; ++i) {
        std::memcpy(x.data() + 2 * i, &minus_zero, 2);
        const float v = i >= base && i < base + count ? from_bits(edges[i - base].v) : 1.0f;
        const float minus_v = -v;
        std::memcpy(delta.data() + 4 * i, &minus_v, 4);
      }
      const auto ref = reference_dense(xd, x, DType::kFloat32, delta, n, one);
      const auto dense = run_dense(xd, x, DType::kFloat32, delta, n, one, isa);
      expect_same(xd, dense, ref, n);
      for (size_t j = 0; j < count; ++j) {
        uint16_t got, want_ref;
        std::memcpy(&got, dense.data() + 2 * (base + j), 2);
        std::memcpy(&want_ref, ref.data() + 2 * (base + j), 2);
        EXPECT_EQ(got, edges[j].want) << "dense, edge " << j;
        EXPECT_EQ(want_ref, edges[j].want) << "reference, edge " << j;
      }
    }
  }
}

TEST(LionApplyRounding, Float16Store) {
  check_edges(DType::kFloat16, kF16Edges, std::size(kF16Edges));
}

TEST(LionApplyRounding, BFloat16Store) {
  check_edges(DType::kBFloat16, kBF16Edges, std::size(kBF16Edges));
}

// NaN x or NaN Delta gives NaN; Inf Delta gives -+Inf.
TEST(LionApplyRounding, NanAndInf) {
  for (DType xd : kParams) {
    for (Isa isa : supported()) {
      const size_t n = 64 + 5;
      std::vector<uint8_t> x(n * esize(xd)), delta(n * 4);
      for (size_t i = 0; i < n; ++i) {
        ref_store(xd, x.data(), i, i % 5 == 0 ? NAN : 1.0f);
        const float d = i % 5 == 1 ? NAN : (i % 5 == 2 ? INFINITY : 1.0f);
        std::memcpy(delta.data() + 4 * i, &d, 4);
      }
      const auto got = run_dense(xd, x, DType::kFloat32, delta, n, step_from(1e-3, 0.1), isa);
      for (size_t i = 0; i < n; ++i) {
        const float v = widen(xd, got.data(), i);
        if (i % 5 <= 1) {
          EXPECT_TRUE(std::isnan(v)) << i;
        } else if (i % 5 == 2) {
          EXPECT_EQ(v, -INFINITY) << i;
        } else {
          EXPECT_TRUE(std::isfinite(v)) << i;
        }
      }
    }
  }
}

// ---------------------------------------------------------- contract ----

TEST(LionApplyContract, DtypeSupport) {
  for (DType x : bits::test::all_dtypes()) {
    const bool px = x == DType::kFloat32 || x == DType::kBFloat16 || x == DType::kFloat16;
    EXPECT_EQ(lion_param_dtype_supported(x), px) << bits::dtype_name(x);
    for (DType d : bits::test::all_dtypes()) {
      const bool pd = d == DType::kFloat32 || d == DType::kBFloat16 || d == DType::kFloat16;
      EXPECT_EQ(lion_apply_dtypes_supported(x, d), px && pd)
          << bits::dtype_name(x) << " " << bits::dtype_name(d);
    }
  }
}

TEST(LionApplyContract, UnsupportedInputsTouchNothing) {
  const size_t n = 200;
  for (Isa isa : supported()) {
    std::vector<uint8_t> x(n * 8, 0x41), d(n * 8, 0x3f);
    const auto untouched = [&] {
      return std::all_of(x.begin(), x.end(), [](uint8_t b) { return b == 0x41; }) &&
          std::all_of(d.begin(), d.end(), [](uint8_t b) { return b == 0x3f; });
    };
    lion_apply_dense(DType::kFloat64, x.data(), DType::kFloat32, d.data(), n, 0.1f, 0.9f, isa);
    lion_apply_dense(DType::kFloat32, x.data(), DType::kFloat64, d.data(), n, 0.1f, 0.9f, isa);
    lion_apply_dense(DType::kInt8, x.data(), DType::kFloat32, d.data(), n, 0.1f, 0.9f, isa);
    EXPECT_TRUE(untouched()) << bits::isa_name(isa);
    // Every unsupported (param, delta) pair, a supported param with an
    // unsupported delta included.
    for (DType xd : bits::test::all_dtypes()) {
      for (DType dd : bits::test::all_dtypes()) {
        if (lion_apply_dtypes_supported(xd, dd)) {
          // n == 0 touches nothing; the pointers may be null.
          lion_apply_dense(xd, nullptr, dd, nullptr, 0, 0.1f, 0.9f, isa);
          continue;
        }
        lion_apply_dense(xd, x.data(), dd, d.data(), n, 0.1f, 0.9f, isa);
        EXPECT_TRUE(untouched()) << bits::isa_name(isa) << " x " << bits::dtype_name(xd)
                                 << " delta " << bits::dtype_name(dd);
      }
    }
    lion_apply_dense(DType::kFloat32, nullptr, DType::kFloat32, nullptr, 0, 0.1f, 0.9f, isa);
  }
}

// Splitting at multiples of 64 elements (x and delta offset by i0) gives the
// same result as one call, whatever ISA each part runs on. Delta holds what
// the backend applies: vote results -1, +1, 0 (and -0), averages k/N,
// ordinary values and specials (make_deltas).
TEST(LionApplyContract, SplitAtWordsEqualsOneCall) {
  const size_t n = 64 * 41 + 27;
  const Step s = step_from(0.05, 0.2);
  const auto isas = supported();
  for (DType xd : kParams) {
    for (DType dd : kParams) {
      SCOPED_TRACE(
          ::testing::Message() << "x " << bits::dtype_name(xd) << " delta "
                               << bits::dtype_name(dd));
      std::mt19937_64 rng(5);
      const auto x = make_values(xd, n, rng, -10, 4);
      const auto delta = make_deltas(dd, n, rng);
      const auto whole = run_dense(xd, x, dd, delta, n, s, Isa::kScalar);
      expect_same(xd, whole, reference_dense(xd, x, dd, delta, n, s), n);
      std::vector<uint8_t> xx = x;
      size_t i0 = 0;
      for (size_t part = 0; i0 < n; ++part) {
        const size_t len = std::min(n - i0, size_t{64} * (part % 4 + 1));
        lion_apply_dense(
            xd, xx.data() + esize(xd) * i0, dd, delta.data() + esize(dd) * i0, len, s.lr, s.decay,
            isas[part % isas.size()]);
        i0 += len;
      }
      expect_same(xd, xx, whole, n);
    }
  }
}

// lion_apply_planes: Delta from a vote's result planes (zero bit: 0, else
// sign bit: +1, else -1; both bits set: 0) at any bit offset, across block
// boundaries, on every ISA, against the naive reference with that Delta.
TEST(LionApplyPlanes, MatchesTheReferenceAtAnyBitOffset) {
  const size_t sizes[] = {1, 63, 64, 65, 2047, 2048, 2049, 5000};
  const uint64_t offsets[] = {0, 1, 37, 63, 64, 130};
  const Step s = step_from(0.05, 0.2);
  for (Isa isa : supported()) {
    for (DType xd : kParams) {
      for (size_t n : sizes) {
        for (uint64_t off : offsets) {
          SCOPED_TRACE(
              ::testing::Message() << bits::isa_name(isa) << " x " << bits::dtype_name(xd) << " n "
                                   << n << " bit offset " << off);
          std::mt19937_64 rng(7 * n + off);
          const auto x = make_values(xd, n, rng, -10, 4);
          const size_t words = bits::words_for(off + n) + 1;
          std::vector<uint64_t> sign(words), zero(words);
          for (size_t w = 0; w < words; ++w) {
            sign[w] = rng();
            zero[w] = rng() & rng(); // a quarter of the bits: some both set
          }
          std::vector<uint8_t> delta(n * 4);
          for (size_t i = 0; i < n; ++i) {
            const uint64_t b = off + i;
            const bool z = ((zero[b / 64] >> (b % 64)) & 1) != 0;
            const bool p = ((sign[b / 64] >> (b % 64)) & 1) != 0;
            ref_store(DType::kFloat32, delta.data(), i, z ? 0.0f : (p ? 1.0f : -1.0f));
          }
          const auto want = reference_dense(xd, x, DType::kFloat32, delta, n, s);
          Guarded xb(n * esize(xd));
          xb.fill(x);
          const std::vector<uint64_t> sign0 = sign, zero0 = zero;
          lion_apply_planes(xd, xb.bytes(), sign.data(), zero.data(), off, n, s.lr, s.decay, isa);
          EXPECT_TRUE(xb.guard_intact()) << "wrote past the end of x";
          EXPECT_EQ(sign, sign0) << "sign plane modified";
          EXPECT_EQ(zero, zero0) << "zero plane modified";
          expect_same(xd, std::vector<uint8_t>(xb.bytes(), xb.bytes() + n * esize(xd)), want, n);
        }
      }
    }
  }
}

// A zero count or an unsupported dtype touches nothing.
TEST(LionApplyPlanes, NothingToDoTouchesNothing) {
  std::vector<uint64_t> sign(2, ~0ull), zero(2, 0);
  std::vector<uint8_t> x(64, 0x5a);
  const std::vector<uint8_t> x0 = x;
  lion_apply_planes(DType::kFloat32, x.data(), sign.data(), zero.data(), 3, 0, 1.0f, 1.0f);
  lion_apply_planes(DType::kInt8, x.data(), sign.data(), zero.data(), 0, 16, 1.0f, 1.0f);
  EXPECT_EQ(x, x0);
}

} // namespace
} // namespace lionbit::optim
