// The GPU kernels (lionbit_bits_cuda, lionbit_optim_cuda) against the CPU kernels, bit for bit, on
// a CUDA device (CTest label "gpu"). Without a device every test is SKIPPED with the CUDA error
// that says why. The logic inside the kernels is also checked without a GPU by test_cuda_host.cpp.
#include "signbits/cuda/kernels.h"
#include "signbits/trits.h"
#include "optimizer/lion_cuda.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_test_ref.h"
#include "lion_test_util.h"

namespace lionbit::cuda_test {
namespace {

// Empty when a device is usable, otherwise why not.
const std::string& no_gpu_reason() {
  static const std::string reason = [] {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return std::string(cudaGetErrorString(err));
    }
    if (count == 0) {
      return std::string("cudaGetDeviceCount returned 0");
    }
    return std::string();
  }();
  return reason;
}

#define REQUIRE_GPU()                                        \
  do {                                                       \
    if (!no_gpu_reason().empty()) {                          \
      GTEST_SKIP() << "no CUDA device: " << no_gpu_reason(); \
    }                                                        \
  } while (0)

#define CUDA_OK(expr)                                                      \
  do {                                                                     \
    const cudaError_t e_ = (expr);                                         \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_); \
  } while (0)

// Device buffer of bytes.
class Dev {
 public:
  explicit Dev(size_t bytes) : bytes_(bytes) {
    if (cudaMalloc(&p_, bytes == 0 ? 1 : bytes) != cudaSuccess) {
      throw std::runtime_error("cudaMalloc failed");
    }
  }
  template <typename T>
  explicit Dev(const std::vector<T>& v) : Dev(v.size() * sizeof(T)) {
    upload(v);
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  ~Dev() { cudaFree(p_); }
  template <typename T>
  void upload(const std::vector<T>& v) {
    if (!v.empty() &&
        cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice) != cudaSuccess) {
      throw std::runtime_error("cudaMemcpy H2D failed");
    }
  }
  template <typename T>
  std::vector<T> download(size_t count) const {
    std::vector<T> v(count);
    if (count != 0 &&
        cudaMemcpy(v.data(), p_, count * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess) {
      throw std::runtime_error("cudaMemcpy D2H failed");
    }
    return v;
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
  size_t bytes_;
};

// One stream per test, synchronized (and checked) at the end of each call.
class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    REQUIRE_GPU();
    CUDA_OK(cudaStreamCreate(&stream_));
  }
  void TearDown() override {
    if (stream_ != nullptr) {
      cudaStreamDestroy(stream_);
    }
  }
  void sync() {
    const cudaError_t e = cudaStreamSynchronize(stream_);
    if (e != cudaSuccess) {
      throw std::runtime_error(std::string("stream: ") + cudaGetErrorString(e));
    }
  }
  cudaStream_t stream_ = nullptr;
};

std::string dname(DType d) {
  return bits::dtype_name(d);
}

std::vector<size_t> sizes_small() {
  return {0, 1, 2, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000, 4097};
}

std::vector<size_t> sizes_large() {
  return {65537, (size_t{1} << 20) + 3, (size_t{1} << 21) + 77};
}

// ------------------------------------------------------------------ pack ----

TEST_F(CudaKernels, PackMatchesCpu) {
  std::mt19937_64 rng(101);
  for (DType d : bits::test::all_dtypes()) {
    for (size_t n : sizes_small()) {
      const auto src = bits::test::random_buffer(d, n, rng, true);
      Dev dsrc(src);
      for (size_t off = 0; off <= 130; ++off) {
        const size_t words = (off + n) / 64 + 2;
        const auto s0 = random_words(words, rng);
        const auto z0 = random_words(words, rng);
        const PackRef ref = ref_pack(d, src.data(), n, s0, z0, off);
        Dev ds(s0), dz(z0);
        Dev dc(std::vector<unsigned long long>{7, 9}); // counts are added to
        cuda::pack_signs(
            d, dsrc.as<void>(), n, ds.as<uint64_t>(), dz.as<uint64_t>(), off, dc.as<cuda::Counts>(),
            stream_);
        sync();
        ASSERT_EQ(ds.download<uint64_t>(words), ref.sign)
            << dname(d) << " n=" << n << " off=" << off;
        ASSERT_EQ(dz.download<uint64_t>(words), ref.zero)
            << dname(d) << " n=" << n << " off=" << off;
        const auto c = dc.download<unsigned long long>(2);
        ASSERT_EQ(c[0], 7 + ref.counts.zeros) << dname(d) << " n=" << n;
        ASSERT_EQ(c[1], 9 + ref.counts.nans) << dname(d) << " n=" << n;
      }
    }
    for (size_t n : sizes_large()) {
      const auto src = bits::test::random_buffer(d, n, rng, true);
      Dev dsrc(src);
      for (size_t off : {size_t{0}, size_t{1}, size_t{64}, size_t{100}}) {
        const size_t words = (off + n) / 64 + 2;
        const auto s0 = random_words(words, rng);
        const auto z0 = random_words(words, rng);
        const PackRef ref = ref_pack(d, src.data(), n, s0, z0, off);
        Dev ds(s0), dz(z0);
        Dev dc(std::vector<unsigned long long>{0, 0});
        cuda::pack_signs(
            d, dsrc.as<void>(), n, ds.as<uint64_t>(), dz.as<uint64_t>(), off, dc.as<cuda::Counts>(),
            stream_);
        // and once more without counts: the same bits
        cuda::pack_signs(
            d, dsrc.as<void>(), n, ds.as<uint64_t>(), dz.as<uint64_t>(), off, nullptr, stream_);
        sync();
        ASSERT_EQ(ds.download<uint64_t>(words), ref.sign)
            << dname(d) << " n=" << n << " off=" << off;
        ASSERT_EQ(dz.download<uint64_t>(words), ref.zero)
            << dname(d) << " n=" << n << " off=" << off;
        const auto c = dc.download<unsigned long long>(2);
        ASSERT_EQ(c[0], ref.counts.zeros);
        ASSERT_EQ(c[1], ref.counts.nans);
      }
    }
  }
}

TEST_F(CudaKernels, PackEndToEndIntoOneBuffer) {
  std::mt19937_64 rng(102);
  const std::vector<size_t> sizes = {5, 64, 1, 130, 63, 200000, 7, 3};
  std::vector<uint8_t> all;
  size_t total = 0;
  for (size_t n : sizes) total += n;
  const size_t words = total / 64 + 2;
  Dev ds(std::vector<uint64_t>(words, ~0ull)), dz(std::vector<uint64_t>(words, 0));
  std::vector<std::unique_ptr<Dev>> keep;
  size_t off = 0;
  for (size_t n : sizes) {
    const auto b = bits::test::random_buffer(DType::kBFloat16, n, rng, false);
    all.insert(all.end(), b.begin(), b.begin() + 2 * n);
    keep.push_back(std::make_unique<Dev>(b));
    cuda::pack_signs(
        DType::kBFloat16, keep.back()->as<void>(), n, ds.as<uint64_t>(), dz.as<uint64_t>(), off,
        nullptr, stream_);
    off += n;
  }
  sync();
  std::vector<uint64_t> rs(words), rz(words);
  bits::pack_signs(DType::kBFloat16, all.data(), total, rs.data(), rz.data());
  const auto s = ds.download<uint64_t>(words);
  const auto z = dz.download<uint64_t>(words);
  for (size_t i = 0; i < words * 64; ++i) {
    ASSERT_EQ(get_bit(s.data(), i), i < total ? get_bit(rs.data(), i) : true) << i;
    ASSERT_EQ(get_bit(z.data(), i), i < total ? get_bit(rz.data(), i) : false) << i;
  }
}

// ----------------------------------------------------------------- count ----

TEST_F(CudaKernels, CountCodeAndVoteMatchCpu) {
  std::mt19937_64 rng(201);
  std::vector<int> ns;
  for (int n = 1; n <= 64; ++n) ns.push_back(n);
  for (int n : {100, 127, 128, 255, 256, 511, 512, 1000, 1023, 1024}) ns.push_back(n);
  for (int n : ns) {
    for (int mode = 0; mode <= 4; ++mode) {
      for (size_t words : {size_t{1}, size_t{7}, size_t{1000}}) {
        if (n > 64 && words == 1000 && mode % 2 == 1) continue;
        const RanksData d = make_ranks(n, words, mode, rng);
        const bool zeros = mode != 0;
        const auto contrib = d.contributions();
        const int planes = bits::code_planes(n, zeros);
        std::vector<uint64_t> ref(static_cast<size_t>(planes) * words);
        bits::count_code(contrib.data(), n, words, ref.data());
        std::vector<uint64_t> rs(words), rz(words);
        bits::vote(contrib.data(), n, words, rs.data(), rz.data());
        Dev dsg(d.sign);
        std::unique_ptr<Dev> dzr;
        if (zeros) dzr = std::make_unique<Dev>(d.zero);
        const uint64_t* zp = zeros ? dzr->as<uint64_t>() : nullptr;
        Dev dout(ref.size() * 8), dvs(words * 8), dvz(words * 8);
        cuda::count_code(dsg.as<uint64_t>(), zp, d.stride, n, words, dout.as<uint64_t>(), stream_);
        cuda::vote(
            dsg.as<uint64_t>(), zp, d.stride, n, words, dvs.as<uint64_t>(), dvz.as<uint64_t>(),
            stream_);
        sync();
        ASSERT_EQ(dout.download<uint64_t>(ref.size()), ref)
            << "n=" << n << " mode=" << mode << " words=" << words;
        ASSERT_EQ(dvs.download<uint64_t>(words), rs) << "n=" << n << " mode=" << mode;
        ASSERT_EQ(dvz.download<uint64_t>(words), rz) << "n=" << n << " mode=" << mode;
      }
    }
  }
}

TEST_F(CudaKernels, VoteLarge) {
  std::mt19937_64 rng(202);
  for (int n : {4, 8, 16, 3}) {
    const size_t words = (size_t{1} << 18) + 5; // 16M+ elements
    const RanksData d = make_ranks(n, words, n == 3 ? 2 : 0, rng);
    const bool zeros = !d.zero.empty();
    const auto contrib = d.contributions();
    std::vector<uint64_t> rs(words), rz(words);
    bits::vote(contrib.data(), n, words, rs.data(), rz.data());
    Dev dsg(d.sign);
    std::unique_ptr<Dev> dzr;
    if (zeros) dzr = std::make_unique<Dev>(d.zero);
    Dev dvs(words * 8), dvz(words * 8);
    cuda::vote(
        dsg.as<uint64_t>(), zeros ? dzr->as<uint64_t>() : nullptr, d.stride, n, words,
        dvs.as<uint64_t>(), dvz.as<uint64_t>(), stream_);
    sync();
    ASSERT_EQ(dvs.download<uint64_t>(words), rs) << n;
    ASSERT_EQ(dvz.download<uint64_t>(words), rz) << n;
  }
}

TEST(CudaKernelsArgs, CountRejectsBadN) {
  // Validated before anything is enqueued: no device needed.
  EXPECT_THROW(
      cuda::count_code(nullptr, nullptr, 1, 0, 1, nullptr, nullptr), std::invalid_argument);
  EXPECT_THROW(
      cuda::vote(nullptr, nullptr, 1, 1025, 1, nullptr, nullptr, nullptr), std::invalid_argument);
}

TEST_F(CudaKernels, EmptyCallsEnqueueNothing) {
  cuda::pack_signs(DType::kFloat32, nullptr, 0, nullptr, nullptr, 5, nullptr, stream_);
  cuda::count_code(nullptr, nullptr, 0, 3, 0, nullptr, stream_);
  cuda::vote(nullptr, nullptr, 0, 3, 0, nullptr, nullptr, stream_);
  cuda::unpack(DType::kFloat32, {nullptr, 2, 0}, 0, nullptr, nullptr, stream_);
  optim::cuda::lion_direction(
      DType::kFloat32, nullptr, DType::kFloat32, nullptr, 0, 0.9f, 0.1f, 0.99f, 0.01f, nullptr,
      nullptr, 0, nullptr, stream_, nullptr);
  optim::cuda::lion_apply_dense(
      DType::kFloat32, nullptr, DType::kFloat32, nullptr, 0, 1, 1, stream_);
  sync();
}

// ---------------------------------------------------------------- unpack ----

TEST_F(CudaKernels, UnpackMatchesCpu) {
  std::mt19937_64 rng(301);
  std::vector<size_t> ns = sizes_small();
  ns.push_back((size_t{1} << 20) + 17);
  for (DType d : bits::test::all_dtypes()) {
    const size_t es = bits::dtype_size(d);
    for (int nplanes : {0, 1, 2, 3, 4, 5, 8, 12, 16}) {
      for (int shards : {1, 3, 5}) {
        for (size_t n : ns) {
          if (n > 100000 && (nplanes > 5 || shards == 3)) continue;
          const size_t sw = bits::shard_words(n, shards);
          const auto sharded = random_words(static_cast<size_t>(nplanes) * sw * shards + 1, rng);
          std::vector<uint8_t> lut((size_t{1} << nplanes) * es);
          for (auto& b : lut) b = static_cast<uint8_t>(rng());
          const auto plain = unshard(sharded, nplanes, sw, shards);
          const auto ptrs = plane_ptrs(plain, nplanes, sw * shards);
          std::vector<uint8_t> ref(n * es + es, 0xa5);
          bits::unpack(d, ptrs.data(), nplanes, n, lut.data(), ref.data());
          Dev dp(sharded), dl(lut), dd(std::vector<uint8_t>(n * es + es, 0xa5));
          cuda::unpack(
              d, {dp.as<uint64_t>(), nplanes, sw}, n, dl.as<void>(), dd.as<void>(), stream_);
          sync();
          ASSERT_EQ(dd.download<uint8_t>(ref.size()), ref)
              << dname(d) << " nplanes=" << nplanes << " shards=" << shards << " n=" << n;
        }
      }
    }
  }
}

// -------------------------------------------------------------- base 3 ----

TEST_F(CudaKernels, TritsMatchCpu) {
  std::mt19937_64 rng(311);
  std::vector<size_t> ns = sizes_small();
  ns.push_back((size_t{1} << 20) + 17);
  for (size_t n : ns) {
    const size_t words = bits::words_for(n);
    const auto sign = random_words(words, rng);
    auto tie = random_words(words, rng);
    for (auto& t : tie) t &= rng();
    std::vector<uint8_t> ref(words * bits::kTritBytesPerWord + 3, 0x5a);
    bits::encode_trits(sign.data(), tie.data(), words, ref.data());
    Dev ds(sign), dt(tie), dout(std::vector<uint8_t>(ref.size(), 0x5a));
    cuda::encode_trits(ds.as<uint64_t>(), dt.as<uint64_t>(), words, dout.as<uint8_t>(), stream_);
    sync();
    ASSERT_EQ(dout.download<uint8_t>(ref.size()), ref) << "encode, n=" << n;
    for (DType d : bits::test::all_dtypes()) {
      const size_t es = bits::dtype_size(d);
      std::vector<uint8_t> lut(3 * es);
      for (auto& b : lut) b = static_cast<uint8_t>(rng());
      std::vector<uint8_t> want(n * es + es, 0xa5);
      ASSERT_TRUE(bits::decode_trits(d, ref.data(), n, lut.data(), want.data()));
      Dev dl(lut), dd(std::vector<uint8_t>(want.size(), 0xa5)), bad(std::vector<unsigned>(1, 0));
      cuda::decode_trits(
          d, dout.as<uint8_t>(), n, dl.as<void>(), dd.as<void>(), bad.as<unsigned>(), stream_);
      sync();
      ASSERT_EQ(bad.download<unsigned>(1)[0], 0u) << dname(d) << " n=" << n;
      ASSERT_EQ(dd.download<uint8_t>(want.size()), want) << dname(d) << " n=" << n;
    }
    if (n == 0) continue;
    // A byte that is not a code, where it holds an element: flagged.
    std::vector<uint8_t> corrupt = ref;
    corrupt
        [bits::words_for(n) * bits::kTritBytesPerWord - bits::kTritBytesPerWord +
         ((n - 1) % 64) / 5] = 250;
    Dev dc(corrupt), dl(std::vector<uint8_t>(12, 1)), dd(std::vector<uint8_t>(n * 4 + 4)),
        bad(std::vector<unsigned>(1, 0));
    cuda::decode_trits(
        DType::kFloat32, dc.as<uint8_t>(), n, dl.as<void>(), dd.as<void>(), bad.as<unsigned>(),
        stream_);
    sync();
    ASSERT_EQ(bad.download<unsigned>(1)[0], 1u) << "corrupt, n=" << n;
  }
}

// ------------------------------------------------------------------ Lion ----

using lionbit::optim::lion_test::same_at;

std::vector<uint8_t> lion_floats(DType d, size_t n, std::mt19937_64& rng) {
  // test_util's buffers (zeros, denormals, Inf, NaN) for float32 / bfloat16;
  // float16 from random patterns.
  return bits::test::random_buffer(d, n, rng, true);
}

const std::pair<DType, DType> kDirPairs[] = {
    {DType::kFloat32, DType::kFloat32},  {DType::kFloat32, DType::kBFloat16},
    {DType::kBFloat16, DType::kFloat32}, {DType::kBFloat16, DType::kBFloat16},
    {DType::kFloat16, DType::kFloat32},  {DType::kFloat16, DType::kBFloat16}};

TEST_F(CudaKernels, LionDirectionMatchesCpu) {
  std::mt19937_64 rng(401);
  const float b1 = 0.9f, omb1 = static_cast<float>(1.0 - 0.9);
  const float b2 = 0.99f, omb2 = static_cast<float>(1.0 - 0.99);
  std::vector<size_t> ns = sizes_small();
  for (size_t n : sizes_large()) ns.push_back(n);
  for (auto [gd, md] : kDirPairs) {
    for (size_t n : ns) {
      const auto g = lion_floats(gd, n, rng);
      const auto m0 = lion_floats(md, n, rng);
      auto mref = m0;
      std::vector<uint64_t> rs(n / 64 + 2), rz(n / 64 + 2);
      const auto rc = optim::lion_direction(
          gd, g.data(), md, mref.data(), n, b1, omb1, b2, omb2, rs.data(), rz.data());
      for (size_t off :
           {size_t{0}, size_t{1}, size_t{33}, size_t{63}, size_t{64}, size_t{65}, size_t{130}}) {
        if (n > 100000 && off % 64 != 0 && off != 1) continue;
        const size_t words = (off + n) / 64 + 2;
        const auto s0 = random_words(words, rng);
        const auto z0 = random_words(words, rng);
        auto es = s0, ez = z0;
        insert_bits(rs.data(), n, es.data(), off);
        insert_bits(rz.data(), n, ez.data(), off);
        Dev dg(g), dm(m0), ds(s0), dz(z0), dc(std::vector<unsigned long long>{0, 0});
        optim::cuda::lion_direction(
            gd, dg.as<void>(), md, dm.as<void>(), n, b1, omb1, b2, omb2, ds.as<uint64_t>(),
            dz.as<uint64_t>(), off, dc.as<cuda::Counts>(), stream_, dm.as<void>());
        sync();
        ASSERT_EQ(ds.download<uint64_t>(words), es)
            << dname(gd) << "/" << dname(md) << " n=" << n << " off=" << off;
        ASSERT_EQ(dz.download<uint64_t>(words), ez)
            << dname(gd) << "/" << dname(md) << " n=" << n << " off=" << off;
        const auto c = dc.download<unsigned long long>(2);
        ASSERT_EQ(c[0], rc.zeros);
        ASSERT_EQ(c[1], rc.nonfinite); // the direction kernel tallies non-finite c
        // The momentum only read: the same bits and counts, m untouched.
        Dev dm2(m0), ds2(s0), dz2(z0), dc2(std::vector<unsigned long long>{0, 0});
        optim::cuda::lion_direction(
            gd, dg.as<void>(), md, dm2.as<void>(), n, b1, omb1, b2, omb2, ds2.as<uint64_t>(),
            dz2.as<uint64_t>(), off, dc2.as<cuda::Counts>(), stream_, nullptr);
        sync();
        ASSERT_EQ(ds2.download<uint64_t>(words), es);
        ASSERT_EQ(dz2.download<uint64_t>(words), ez);
        ASSERT_EQ(dc2.download<unsigned long long>(2), c);
        ASSERT_EQ(dm2.download<uint8_t>(m0.size()), m0) << "momentum written with m_out == nullptr";
        const auto m = dm.download<uint8_t>(m0.size());
        for (size_t i = 0; i < n; ++i) {
          ASSERT_TRUE(same_at(md, m.data(), mref.data(), i))
              << dname(gd) << "/" << dname(md) << " i=" << i;
        }
      }
    }
  }
}

// The new momentum into a separate buffer m_out (double-buffered momentum):
// the CPU in-place kernel's bits and counts, m unchanged, m_out what the CPU
// kernel leaves in m; m_out 16-byte aligned as m (the vector path) and one
// element off (the ballot path).
TEST_F(CudaKernels, LionDirectionMomentumOutMatchesCpu) {
  std::mt19937_64 rng(402);
  const float b1 = 0.9f, omb1 = static_cast<float>(1.0 - 0.9);
  const float b2 = 0.99f, omb2 = static_cast<float>(1.0 - 0.99);
  std::vector<size_t> ns = sizes_small();
  ns.push_back(sizes_large()[1]);
  for (auto [gd, md] : kDirPairs) {
    const size_t sm = bits::dtype_size(md);
    for (size_t n : ns) {
      const auto g = lion_floats(gd, n, rng);
      const auto m0 = lion_floats(md, n, rng);
      auto mref = m0;
      std::vector<uint64_t> rs(n / 64 + 2), rz(n / 64 + 2);
      const auto rc = optim::lion_direction(
          gd, g.data(), md, mref.data(), n, b1, omb1, b2, omb2, rs.data(), rz.data());
      for (size_t off : {size_t{0}, size_t{1}, size_t{65}}) {
        const size_t words = (off + n) / 64 + 2;
        const auto s0 = random_words(words, rng);
        const auto z0 = random_words(words, rng);
        auto es = s0, ez = z0;
        insert_bits(rs.data(), n, es.data(), off);
        insert_bits(rz.data(), n, ez.data(), off);
        for (size_t shift : {size_t{0}, size_t{1}}) {
          const auto out0 = lion_floats(md, n + shift, rng);
          Dev dg(g), dm(m0), dout(out0), ds(s0), dz(z0), dc(std::vector<unsigned long long>{0, 0});
          optim::cuda::lion_direction(
              gd, dg.as<void>(), md, dm.as<void>(), n, b1, omb1, b2, omb2, ds.as<uint64_t>(),
              dz.as<uint64_t>(), off, dc.as<cuda::Counts>(), stream_,
              dout.as<uint8_t>() + shift * sm);
          sync();
          const std::string what = dname(gd) + "/" + dname(md) + " n=" + std::to_string(n) +
              " off=" + std::to_string(off) + " shift=" + std::to_string(shift);
          ASSERT_EQ(ds.download<uint64_t>(words), es) << what;
          ASSERT_EQ(dz.download<uint64_t>(words), ez) << what;
          const auto c = dc.download<unsigned long long>(2);
          ASSERT_EQ(c[0], rc.zeros) << what;
          ASSERT_EQ(c[1], rc.nonfinite) << what;
          ASSERT_EQ(dm.download<uint8_t>(m0.size()), m0) << what << ": m written";
          const auto out = dout.download<uint8_t>(out0.size());
          for (size_t i = 0; i < n; ++i) {
            ASSERT_TRUE(same_at(md, out.data() + shift * sm, mref.data(), i)) << what << " i=" << i;
          }
          ASSERT_TRUE(std::equal(out.begin(), out.begin() + shift * sm, out0.begin())) << what;
          ASSERT_TRUE(std::equal(
              out.begin() + (shift + n) * sm, out.end(), out0.begin() + (shift + n) * sm))
              << what << ": written past m_out";
        }
      }
    }
  }
}

// The list kernel with per-tensor m_out (in place, a separate buffer aligned
// or one element off, none), with and without the planes, against the CPU
// in-place kernel tensor by tensor.
TEST_F(CudaKernels, LionDirectionListMomentumOutMatchesCpu) {
  std::mt19937_64 rng(403);
  const float b1 = 0.9f, omb1 = static_cast<float>(1.0 - 0.9);
  const float b2 = 0.99f, omb2 = static_cast<float>(1.0 - 0.99);
  const std::vector<size_t> sizes{1, 0, 63, 64, 65, 5, 1000, 2, 130, 0, 4097, 31, 1, 65537};
  for (auto [gd, md] : kDirPairs) {
    const size_t sm = bits::dtype_size(md);
    for (size_t rot = 0; rot < 4; ++rot) {
      const size_t at = rot * 37;
      const auto mode = [&](size_t t) { return (t + rot) % 4; };
      std::vector<std::vector<uint8_t>> gs, m0s, mrefs, out0s;
      size_t total = at;
      for (size_t t = 0; t < sizes.size(); ++t) {
        gs.push_back(lion_floats(gd, sizes[t], rng));
        m0s.push_back(lion_floats(md, sizes[t], rng));
        out0s.push_back(lion_floats(md, sizes[t] + 1, rng));
        total += sizes[t];
      }
      const size_t words = total / 64 + 2;
      const auto s0 = random_words(words, rng);
      const auto z0 = random_words(words, rng);
      auto es = s0, ez = z0;
      mrefs = m0s;
      unsigned long long rzeros = 0, rnans = 0;
      size_t off = at;
      for (size_t t = 0; t < sizes.size(); ++t) {
        std::vector<uint64_t> rs(sizes[t] / 64 + 2), rz(sizes[t] / 64 + 2);
        const auto rc = optim::lion_direction(
            gd, gs[t].data(), md, mrefs[t].data(), sizes[t], b1, omb1, b2, omb2, rs.data(),
            rz.data());
        insert_bits(rs.data(), sizes[t], es.data(), off);
        insert_bits(rz.data(), sizes[t], ez.data(), off);
        rzeros += rc.zeros;
        rnans += rc.nonfinite;
        off += sizes[t];
      }
      for (bool planes : {true, false}) {
        std::vector<std::unique_ptr<Dev>> dgs, dms, douts;
        std::vector<optim::cuda::DirectionSeg> segs;
        off = at;
        for (size_t t = 0; t < sizes.size(); ++t) {
          dgs.push_back(std::make_unique<Dev>(gs[t]));
          dms.push_back(std::make_unique<Dev>(m0s[t]));
          douts.push_back(std::make_unique<Dev>(out0s[t]));
          void* m_out = mode(t) == 0 ? dms[t]->as<void>()
              : mode(t) == 1         ? douts[t]->as<void>()
              : mode(t) == 2         ? static_cast<void*>(douts[t]->as<uint8_t>() + sm)
                                     : nullptr;
          segs.push_back(optim::cuda::DirectionSeg{
              dgs[t]->as<void>(), dms[t]->as<void>(), m_out, sizes[t], off, 0});
          off += sizes[t];
        }
        const uint64_t units = optim::cuda::direction_units(segs.data(), segs.size());
        Dev table(segs), ds(s0), dz(z0), dc(std::vector<unsigned long long>{0, 0});
        optim::cuda::lion_direction_list(
            gd, md, table.as<optim::cuda::DirectionSeg>(), segs.size(), units, b1, omb1, b2, omb2,
            planes ? ds.as<uint64_t>() : nullptr, planes ? dz.as<uint64_t>() : nullptr,
            planes ? dc.as<cuda::Counts>() : nullptr, stream_);
        sync();
        const std::string what = dname(gd) + "/" + dname(md) + " rot=" + std::to_string(rot) +
            (planes ? "" : " momentum only");
        ASSERT_EQ(ds.download<uint64_t>(words), planes ? es : s0) << what;
        ASSERT_EQ(dz.download<uint64_t>(words), planes ? ez : z0) << what;
        const auto c = dc.download<unsigned long long>(2);
        ASSERT_EQ(c[0], planes ? rzeros : 0u) << what;
        ASSERT_EQ(c[1], planes ? rnans : 0u) << what;
        for (size_t t = 0; t < sizes.size(); ++t) {
          const size_t n = sizes[t];
          const auto m = dms[t]->download<uint8_t>(m0s[t].size());
          for (size_t i = 0; i < n; ++i) {
            ASSERT_TRUE(same_at(md, m.data(), (mode(t) == 0 ? mrefs : m0s)[t].data(), i))
                << what << " tensor " << t << " m " << i;
          }
          const auto out = douts[t]->download<uint8_t>(out0s[t].size());
          if (mode(t) == 1 || mode(t) == 2) {
            const size_t shift = mode(t) == 2 ? 1 : 0;
            for (size_t i = 0; i < n; ++i) {
              ASSERT_TRUE(same_at(md, out.data() + shift * sm, mrefs[t].data(), i))
                  << what << " tensor " << t << " m_out " << i;
            }
            ASSERT_TRUE(std::equal(out.begin(), out.begin() + shift * sm, out0s[t].begin()));
            ASSERT_TRUE(std::equal(
                out.begin() + (shift + n) * sm, out.end(), out0s[t].begin() + (shift + n) * sm))
                << what << " tensor " << t << ": written past m_out";
          } else {
            ASSERT_EQ(out, out0s[t]) << what << " tensor " << t;
          }
        }
      }
    }
  }
}

TEST_F(CudaKernels, LionApplyDenseMatchesCpu) {
  std::mt19937_64 rng(501);
  const DType fl[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  std::vector<size_t> ns = sizes_small();
  ns.push_back((size_t{1} << 20) + 9);
  for (DType xd : fl) {
    for (DType dd : fl) {
      for (size_t n : ns) {
        const auto x0 = lion_floats(xd, n, rng);
        const auto delta = lion_floats(dd, n, rng);
        const float lr = 3e-4f, decay = static_cast<float>(1.0 - 3e-4 * 0.1);
        auto xr = x0;
        optim::lion_apply_dense(xd, xr.data(), dd, delta.data(), n, lr, decay);
        Dev dx(x0), ddl(delta);
        optim::cuda::lion_apply_dense(xd, dx.as<void>(), dd, ddl.as<void>(), n, lr, decay, stream_);
        sync();
        const auto x = dx.download<uint8_t>(x0.size());
        for (size_t i = 0; i < n; ++i) {
          ASSERT_TRUE(same_at(xd, x.data(), xr.data(), i))
              << dname(xd) << "/" << dname(dd) << " i=" << i;
        }
      }
    }
  }
}

// The Delta values the backend applies, as a dense buffer: vote results
// -1, +1, 0 and averages k/N of N ranks, k = -N..N (float32 k / N, stored in
// the delta dtype).
TEST_F(CudaKernels, LionApplyDenseVoteDeltasMatchesCpu) {
  using lionbit::optim::lion_test::ref_store;
  std::mt19937_64 rng(601);
  const DType fl[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  std::vector<size_t> ns = sizes_small();
  ns.push_back((size_t{1} << 20) + 5);
  for (DType xd : fl) {
    for (DType dd : fl) {
      for (int ranks : {1, 2, 3, 5}) {
        for (size_t n : ns) {
          if (n > 100000 && ranks > 2) continue;
          std::vector<uint8_t> delta(n * bits::dtype_size(dd));
          for (size_t i = 0; i < n; ++i) {
            ref_store(dd, delta.data(), i, lionbit::optim::lion_test::vote_like_delta(rng, ranks));
          }
          const auto x0 = lion_floats(xd, n, rng);
          const float lr = 1e-3f, decay = static_cast<float>(1.0 - 1e-3 * 0.1);
          auto xr = x0;
          optim::lion_apply_dense(xd, xr.data(), dd, delta.data(), n, lr, decay);
          Dev dx(x0), ddl(delta);
          optim::cuda::lion_apply_dense(
              xd, dx.as<void>(), dd, ddl.as<void>(), n, lr, decay, stream_);
          sync();
          const auto x = dx.download<uint8_t>(x0.size());
          for (size_t i = 0; i < n; ++i) {
            ASSERT_TRUE(same_at(xd, x.data(), xr.data(), i))
                << dname(xd) << "/" << dname(dd) << " ranks=" << ranks << " n=" << n << " i=" << i;
          }
        }
      }
    }
  }
}

} // namespace
} // namespace lionbit::cuda_test
