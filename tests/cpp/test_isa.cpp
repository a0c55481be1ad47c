#include "signbits/isa.h"

#include <gtest/gtest.h>

#include "signbits/types.h"

namespace lionbit::bits {
namespace {

TEST(Isa, ScalarAlwaysSupported) {
  EXPECT_TRUE(isa_supported(Isa::kScalar));
}

TEST(Isa, DefaultIsSupported) {
  EXPECT_TRUE(isa_supported(default_isa()));
}

TEST(Isa, Names) {
  EXPECT_STREQ(isa_name(Isa::kScalar), "scalar");
  EXPECT_STREQ(isa_name(Isa::kAvx2), "avx2");
  EXPECT_STREQ(isa_name(Isa::kAvx512), "avx512");
}

TEST(Isa, AvxImpliesAvx2) {
  if (isa_supported(Isa::kAvx512)) {
    EXPECT_TRUE(isa_supported(Isa::kAvx2));
  }
}

TEST(Types, DtypeSizesAndNames) {
  EXPECT_EQ(dtype_size(DType::kFloat32), 4u);
  EXPECT_EQ(dtype_size(DType::kFloat16), 2u);
  EXPECT_EQ(dtype_size(DType::kBFloat16), 2u);
  EXPECT_EQ(dtype_size(DType::kFloat64), 8u);
  EXPECT_EQ(dtype_size(DType::kInt8), 1u);
  EXPECT_STREQ(dtype_name(DType::kBFloat16), "bfloat16");
  EXPECT_FALSE(dtype_is_floating(DType::kInt8));
  EXPECT_TRUE(dtype_is_floating(DType::kFloat16));
}

TEST(Types, Padding) {
  EXPECT_EQ(padded_numel(0, 4), 0u);
  EXPECT_EQ(padded_numel(1, 4), 256u);
  EXPECT_EQ(padded_numel(256, 4), 256u);
  EXPECT_EQ(padded_numel(257, 4), 512u);
  EXPECT_EQ(shard_words(257, 4), 2u);
  EXPECT_EQ(shard_words(3, 64), 1u); // d < N: one word per rank
  EXPECT_EQ(bit_width(0), 0);
  EXPECT_EQ(bit_width(1), 1);
  EXPECT_EQ(bit_width(8), 4);
  EXPECT_EQ(bit_width(128), 8);
}

} // namespace
} // namespace lionbit::bits
