#include "backend/kernel_bindings.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "backend/bits/copy_bits.h"
#include "backend/bits/pack.h"
#include "backend/sign_allreduce.hpp"

namespace lionbit {
namespace {

uint64_t* words(at::Tensor& t) {
  return reinterpret_cast<uint64_t*>(t.data_ptr<uint8_t>());
}

void check_plane(const at::Tensor& p, const char* name, int64_t bits_needed) {
  TORCH_CHECK_VALUE(
      p.defined() && p.device().is_cpu() && p.scalar_type() == at::kByte &&
          p.is_contiguous() && p.numel() % 8 == 0 &&
          p.numel() * 8 >= bits_needed,
      "lionbit: argument '", name,
      "' must be a contiguous CPU uint8 tensor of a whole number of 64-bit "
      "words holding at least ", bits_needed, " bits");
}

} // namespace

std::tuple<int64_t, int64_t> pack_signs_into(
    const at::Tensor& t,
    at::Tensor& sign,
    at::Tensor& zero,
    int64_t bit_offset) {
  const auto dtype = bits_dtype(t.scalar_type());
  TORCH_CHECK_VALUE(
      dtype.has_value() && t.device().is_cpu() && t.is_contiguous(),
      "lionbit.pack_signs_into: argument 't' must be a contiguous CPU tensor of "
      "float32, float16, bfloat16, float64 or int8, got ", t.scalar_type(),
      " on ", t.device());
  TORCH_CHECK_VALUE(bit_offset >= 0, "lionbit.pack_signs_into: negative bit_offset");
  const int64_t n = t.numel();
  check_plane(sign, "sign", bit_offset + n);
  check_plane(zero, "zero", bit_offset + n);
  if (n == 0) {
    return {0, 0};
  }
  const size_t w = bits::words_for(static_cast<size_t>(n));
  at::Tensor tmp = at::empty({static_cast<int64_t>(2 * w * 8)}, at::kByte);
  uint64_t* ts = words(tmp);
  const bits::PackCounts c = bits::pack_signs(*dtype, t.data_ptr(), static_cast<size_t>(n), ts, ts + w);
  bits::copy_bits(words(sign), static_cast<size_t>(bit_offset), ts, 0, static_cast<size_t>(n));
  bits::copy_bits(words(zero), static_cast<size_t>(bit_offset), ts + w, 0, static_cast<size_t>(n));
  return {static_cast<int64_t>(c.zeros), static_cast<int64_t>(c.nans)};
}

} // namespace lionbit
