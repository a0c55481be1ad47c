#include "signbits/copy_bits.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace lionbit::bits {
namespace {

bool get(const std::vector<uint64_t>& p, size_t i) {
  return ((p[i / 64] >> (i % 64)) & 1u) != 0;
}

TEST(CopyBits, MatchesBitByBitCopyAtEveryOffset) {
  std::mt19937_64 rng(7);
  for (size_t src_bit : {0, 1, 31, 63, 64, 65, 130}) {
    for (size_t dst_bit : {0, 5, 63, 64, 100}) {
      for (size_t nbits : {0, 1, 7, 63, 64, 65, 127, 128, 1000}) {
        std::vector<uint64_t> src(20), dst(20), ref;
        for (auto& w : src) w = rng();
        for (auto& w : dst) w = rng();
        ref = dst;
        for (size_t i = 0; i < nbits; ++i) {
          const size_t d = dst_bit + i;
          ref[d / 64] = (ref[d / 64] & ~(1ull << (d % 64))) |
              (static_cast<uint64_t>(get(src, src_bit + i)) << (d % 64));
        }
        copy_bits(dst.data(), dst_bit, src.data(), src_bit, nbits);
        ASSERT_EQ(dst, ref) << src_bit << " " << dst_bit << " " << nbits;
      }
    }
  }
}

TEST(CopyBits, NeverReadsPastTheSourceRun) {
  // The source run ends exactly at the end of its last word: no read beyond.
  std::vector<uint64_t> src{~0ull}, dst(2, 0);
  copy_bits(dst.data(), 3, src.data(), 0, 64);
  EXPECT_EQ(dst[0], ~0ull << 3);
  EXPECT_EQ(dst[1], 7u);
  std::vector<uint64_t> src2{0, ~0ull};
  std::vector<uint64_t> dst2(1, 0);
  copy_bits(dst2.data(), 0, src2.data(), 100, 28); // the run ends at bit 128
  EXPECT_EQ(dst2[0], (1ull << 28) - 1);
}

} // namespace
} // namespace lionbit::bits
