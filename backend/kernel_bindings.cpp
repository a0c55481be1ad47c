#include "backend/kernel_bindings.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "backend/bits/copy_bits.h"
#include "backend/bits/pack.h"
#include "backend/sign_allreduce.hpp"
#include "optimizer/lion.h"

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

std::optional<bits::DType> float_dtype(at::ScalarType t) {
  const auto d = bits_dtype(t);
  if (d && bits::dtype_is_floating(*d) && *d != bits::DType::kFloat64) {
    return d;
  }
  return std::nullopt;
}

namespace {

void check_dense(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(
      t.defined() && t.device().is_cpu() && t.is_contiguous() && float_dtype(t.scalar_type()),
      "lionbit.", op, ": argument '", name,
      "' must be a contiguous CPU float32, bfloat16 or float16 tensor, got ",
      t.defined() ? c10::str(t.scalar_type(), " on ", t.device(), t.is_contiguous() ? "" : " (not contiguous)")
                  : std::string("undefined"));
}

} // namespace

bool lion_fused_supported(
    at::ScalarType param,
    at::ScalarType grad,
    at::ScalarType momentum) {
  const auto p = float_dtype(param), g = float_dtype(grad), m = float_dtype(momentum);
  return p && g && m && optim::lion_direction_dtypes_supported(*g, *m) &&
      optim::lion_param_dtype_supported(*p);
}

int64_t lion_direction_into(
    const at::Tensor& g,
    at::Tensor& m,
    double b1,
    double omb1,
    double b2,
    double omb2,
    at::Tensor& sign,
    at::Tensor& zero,
    int64_t bit_offset,
    bool update_momentum) {
  check_dense(g, "lion_direction_into", "g");
  check_dense(m, "lion_direction_into", "m");
  TORCH_CHECK_VALUE(
      optim::lion_direction_dtypes_supported(*float_dtype(g.scalar_type()), *float_dtype(m.scalar_type())),
      "lionbit.lion_direction_into: momentum must be float32 or bfloat16, got ", m.scalar_type());
  TORCH_CHECK_VALUE(
      g.numel() == m.numel(), "lionbit.lion_direction_into: g has ", g.numel(),
      " elements, m ", m.numel());
  TORCH_CHECK_VALUE(bit_offset >= 0, "lionbit.lion_direction_into: negative bit_offset");
  const int64_t n = g.numel();
  check_plane(sign, "sign", bit_offset + n);
  check_plane(zero, "zero", bit_offset + n);
  if (n == 0) {
    return 0;
  }
  const size_t w = bits::words_for(static_cast<size_t>(n));
  at::Tensor tmp = at::empty({static_cast<int64_t>(2 * w * 8)}, at::kByte);
  uint64_t* ts = words(tmp);
  const auto gd = *float_dtype(g.scalar_type());
  const auto md = *float_dtype(m.scalar_type());
  const bits::PackCounts c = update_momentum
      ? optim::lion_direction(
            gd, g.data_ptr(), md, m.data_ptr(), static_cast<size_t>(n), static_cast<float>(b1),
            static_cast<float>(omb1), static_cast<float>(b2), static_cast<float>(omb2), ts, ts + w)
      : optim::lion_direction_only(
            gd, g.data_ptr(), md, m.data_ptr(), static_cast<size_t>(n), static_cast<float>(b1),
            static_cast<float>(omb1), ts, ts + w);
  bits::copy_bits(words(sign), static_cast<size_t>(bit_offset), ts, 0, static_cast<size_t>(n));
  bits::copy_bits(words(zero), static_cast<size_t>(bit_offset), ts + w, 0, static_cast<size_t>(n));
  return static_cast<int64_t>(c.nonfinite);
}

void lion_apply(at::Tensor& x, const at::Tensor& delta, double lr, double decay) {
  check_dense(x, "lion_apply", "x");
  check_dense(delta, "lion_apply", "delta");
  TORCH_CHECK_VALUE(
      x.numel() == delta.numel(), "lionbit.lion_apply: x has ", x.numel(),
      " elements, delta ", delta.numel());
  optim::lion_apply_dense(
      *float_dtype(x.scalar_type()), x.data_ptr(), *float_dtype(delta.scalar_type()),
      delta.data_ptr(), static_cast<size_t>(x.numel()), static_cast<float>(lr),
      static_cast<float>(decay));
}

} // namespace lionbit
