#include "bindings/kernel_bindings_cuda.hpp"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <optional>

#include "signbits/cuda/kernels.h"
#include "backend/torch_adapter.hpp"
#include "bindings/kernel_bindings.hpp"
#include "optimizer/lion.h"
#include "optimizer/lion_cuda.h"

namespace lionbit {
namespace {

cuda::Counts* counts_of(at::Tensor& c) {
  return reinterpret_cast<cuda::Counts*>(c.data_ptr<int64_t>());
}

} // namespace

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
    int64_t bit_offset,
    bool update_momentum) {
  const char* op = "lion_direction_into_device";
  TORCH_CHECK_VALUE(
      g.defined() && g.is_cuda(), "lionbit.", op, ": argument 'g' must be a CUDA tensor, got ",
      describe(g));
  require(op, check_float(g, "g", g.device()));
  require(op, check_float(m, "m", g.device()));
  TORCH_CHECK_VALUE(
      optim::lion_direction_dtypes_supported(
          *float_dtype(g.scalar_type()), *float_dtype(m.scalar_type())),
      "lionbit.", op, ": momentum must be float32 or bfloat16, got ", m.scalar_type());
  TORCH_CHECK_VALUE(
      g.numel() == m.numel(), "lionbit.", op, ": g has ", g.numel(), " elements, m ", m.numel());
  TORCH_CHECK_VALUE(bit_offset >= 0, "lionbit.", op, ": negative bit_offset");
  require(op, check_planes(sign, "sign", g.device(), bit_offset + g.numel()));
  require(op, check_planes(zero, "zero", g.device(), bit_offset + g.numel()));
  require(op, check_buffer(counts, "counts", at::kLong, g.device(), 2));
  c10::cuda::CUDAGuard guard(g.device());
  optim::cuda::lion_direction(
      *float_dtype(g.scalar_type()), g.data_ptr(), *float_dtype(m.scalar_type()), m.data_ptr(),
      static_cast<size_t>(g.numel()), static_cast<float>(b1), static_cast<float>(omb1),
      static_cast<float>(b2), static_cast<float>(omb2), words_of(sign), words_of(zero),
      static_cast<size_t>(bit_offset), counts_of(counts),
      c10::cuda::getCurrentCUDAStream(g.device().index()).stream(), update_momentum);
}

void lion_apply_device(at::Tensor& x, const at::Tensor& delta, double lr, double decay) {
  const char* op = "lion_apply_device";
  TORCH_CHECK_VALUE(
      x.defined() && x.is_cuda(), "lionbit.", op, ": argument 'x' must be a CUDA tensor, got ",
      describe(x));
  require(op, check_float(x, "x", x.device()));
  require(op, check_float(delta, "delta", x.device()));
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
