#include "backend/kernel_bindings_cuda.hpp"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <optional>

#include "backend/cuda/kernels.h"
#include "backend/kernel_bindings.hpp"
#include "backend/sign_allreduce.hpp"
#include "optimizer/lion.h"
#include "optimizer/lion_cuda.h"

namespace lionbit {
namespace {

uint64_t* words(at::Tensor& t) {
  return reinterpret_cast<uint64_t*>(t.data_ptr<uint8_t>());
}

std::string describe(const at::Tensor& t) {
  if (!t.defined()) {
    return "undefined";
  }
  return c10::str(t.scalar_type(), " on ", t.device(), t.is_contiguous() ? "" : " (not contiguous)");
}

void check_plane(const at::Tensor& p, const at::Tensor& like, const char* op, const char* name, int64_t bits_needed) {
  TORCH_CHECK_VALUE(
      p.defined() && p.device() == like.device() && p.scalar_type() == at::kByte &&
          p.is_contiguous() && p.numel() % 8 == 0 && p.numel() * 8 >= bits_needed,
      "lionbit.", op, ": argument '", name, "' must be a contiguous uint8 tensor on ",
      like.device(), " of a whole number of 64-bit words holding at least ", bits_needed,
      " bits, got ", describe(p));
}

void check_counts(const at::Tensor& c, const at::Tensor& like, const char* op) {
  TORCH_CHECK_VALUE(
      c.defined() && c.device() == like.device() && c.scalar_type() == at::kLong &&
          c.is_contiguous() && c.numel() >= 2,
      "lionbit.", op, ": argument 'counts' must be a contiguous int64 tensor of 2 elements on ",
      like.device(), ", got ", describe(c));
}

void check_dense(const at::Tensor& t, const at::Tensor& like, const char* op, const char* name) {
  TORCH_CHECK_VALUE(
      t.defined() && t.is_cuda() && t.device() == like.device() && t.is_contiguous() &&
          float_dtype(t.scalar_type()),
      "lionbit.", op, ": argument '", name, "' must be a contiguous float32, bfloat16 or float16 tensor on ",
      like.device(), ", got ", describe(t));
}

cuda::Counts* counts_of(at::Tensor& c) {
  return reinterpret_cast<cuda::Counts*>(c.data_ptr<int64_t>());
}

} // namespace

void pack_signs_into_device(
    const at::Tensor& t,
    at::Tensor& sign,
    at::Tensor& zero,
    at::Tensor& counts,
    int64_t bit_offset) {
  const auto dtype = bits_dtype(t.scalar_type());
  TORCH_CHECK_VALUE(
      dtype.has_value() && t.is_cuda() && t.is_contiguous(),
      "lionbit.pack_signs_into_device: argument 't' must be a contiguous CUDA tensor of "
      "float32, float16, bfloat16, float64 or int8, got ", describe(t));
  TORCH_CHECK_VALUE(bit_offset >= 0, "lionbit.pack_signs_into_device: negative bit_offset");
  check_plane(sign, t, "pack_signs_into_device", "sign", bit_offset + t.numel());
  check_plane(zero, t, "pack_signs_into_device", "zero", bit_offset + t.numel());
  check_counts(counts, t, "pack_signs_into_device");
  c10::cuda::CUDAGuard guard(t.device());
  cuda::pack_signs(
      *dtype, t.data_ptr(), static_cast<size_t>(t.numel()), words(sign), words(zero),
      static_cast<size_t>(bit_offset), counts_of(counts),
      c10::cuda::getCurrentCUDAStream(t.device().index()).stream());
}

void lion_direction_into_device(
    const at::Tensor& g,
    at::Tensor& m,
    double b1,
    double omb1,
    double b2,
    double omb2,
    at::Tensor& sign,
    at::Tensor& zero,
    at::Tensor& counts,
    int64_t bit_offset) {
  const char* op = "lion_direction_into_device";
  check_dense(g, g, op, "g");
  check_dense(m, g, op, "m");
  TORCH_CHECK_VALUE(
      optim::lion_direction_dtypes_supported(*float_dtype(g.scalar_type()), *float_dtype(m.scalar_type())),
      "lionbit.", op, ": momentum must be float32 or bfloat16, got ", m.scalar_type());
  TORCH_CHECK_VALUE(
      g.numel() == m.numel(), "lionbit.", op, ": g has ", g.numel(), " elements, m ", m.numel());
  TORCH_CHECK_VALUE(bit_offset >= 0, "lionbit.", op, ": negative bit_offset");
  check_plane(sign, g, op, "sign", bit_offset + g.numel());
  check_plane(zero, g, op, "zero", bit_offset + g.numel());
  check_counts(counts, g, op);
  c10::cuda::CUDAGuard guard(g.device());
  optim::cuda::lion_direction(
      *float_dtype(g.scalar_type()), g.data_ptr(), *float_dtype(m.scalar_type()), m.data_ptr(),
      static_cast<size_t>(g.numel()), static_cast<float>(b1), static_cast<float>(omb1),
      static_cast<float>(b2), static_cast<float>(omb2), words(sign), words(zero),
      static_cast<size_t>(bit_offset), counts_of(counts),
      c10::cuda::getCurrentCUDAStream(g.device().index()).stream());
}

void lion_apply_device(at::Tensor& x, const at::Tensor& delta, double lr, double decay) {
  const char* op = "lion_apply_device";
  check_dense(x, x, op, "x");
  check_dense(delta, x, op, "delta");
  TORCH_CHECK_VALUE(
      x.numel() == delta.numel(), "lionbit.", op, ": x has ", x.numel(), " elements, delta ",
      delta.numel());
  c10::cuda::CUDAGuard guard(x.device());
  optim::cuda::lion_apply_dense(
      *float_dtype(x.scalar_type()), x.data_ptr(), *float_dtype(delta.scalar_type()),
      delta.data_ptr(), static_cast<size_t>(x.numel()), static_cast<float>(lr),
      static_cast<float>(decay), c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
}

} // namespace lionbit
