#include "bindings/kernel_bindings.hpp"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <optional>

#include "backend/kernel_check.hpp"
#include "backend/kernel_set.hpp"
#ifdef LIONBIT_WITH_CUDA
#include "backend/kernels_cuda.hpp"
#endif
#include "backend/torch_adapter.hpp"
#include "optimizer/lion.h"
#include "signbits/copy_bits.h"
#include "signbits/count.h"
#include "signbits/levels.h"
#include "signbits/pack.h"
#include "signbits/ties.h"
#include "signbits/unpack.h"

namespace lionbit {

namespace {

// The tensors of one call live on one device: `t`'s. Raises ValueError naming
// the argument that is elsewhere.
void require_device_of(
    const char* op,
    const at::Tensor& t,
    const char* name,
    const at::Tensor& ref,
    const char* ref_name) {
  TORCH_CHECK_VALUE(
      !t.defined() || t.device() == ref.device(), "lionbit.", op, ": argument '", name, "' is on ",
      t.device(), " but argument '", ref_name, "' is on ", ref.device(),
      "; every tensor of the call must be on one device");
}

// The device to make current for a call on `device` (a GPU's kernels run on
// its current stream): none on the CPU.
std::optional<c10::Device> current_for(const c10::Device& device) {
  return device.is_cpu() ? std::nullopt : std::optional<c10::Device>(device);
}

} // namespace

std::tuple<int64_t, int64_t> pack_signs_into(
    const at::Tensor& t,
    at::Tensor& sign,
    at::Tensor& zero,
    int64_t bit_offset) {
  const char* op = "pack_signs_into";
  const auto dtype = t.defined() ? bits_dtype(t.scalar_type()) : std::nullopt;
  TORCH_CHECK_VALUE(
      dtype.has_value() && t.is_contiguous(), "lionbit.", op,
      ": argument 't' must be a contiguous tensor of "
      "float32, float16, bfloat16, float64 or int8, got ",
      describe(t));
  TORCH_CHECK_VALUE(bit_offset >= 0, "lionbit.", op, ": negative bit_offset");
  require_device_of(op, sign, "sign", t, "t");
  require_device_of(op, zero, "zero", t, "t");
  const int64_t n = t.numel();
  require(op, check_planes(sign, "sign", t.device(), bit_offset + n));
  require(op, check_planes(zero, "zero", t.device(), bit_offset + n));
  if (n == 0) {
    return {0, 0};
  }
  const c10::OptionalDeviceGuard guard(current_for(t.device()));
  const bits::PackCounts c =
      kernels_for(t.device()).pack(t.view({-1}), sign, zero, static_cast<uint64_t>(bit_offset));
  return {static_cast<int64_t>(c.zeros), static_cast<int64_t>(c.nans)};
}

namespace {
// The checks of the level planes both level packers make (bits, offset,
// device of `like`, room for n = like.numel() elements at bit_offset);
// returns the words of one plane.
size_t level_plane_words(
    const char* op,
    const at::Tensor& planes,
    int64_t value_bits,
    int64_t bit_offset,
    const at::Tensor& like,
    const char* like_name) {
  TORCH_CHECK_VALUE(
      value_bits >= bits::kMinLevelBits && value_bits <= bits::kMaxLevelBits, "lionbit.", op,
      ": argument 'bits' must be ", bits::kMinLevelBits, " to ", bits::kMaxLevelBits, ", got ",
      value_bits);
  TORCH_CHECK_VALUE(bit_offset >= 0, "lionbit.", op, ": negative bit_offset");
  require_device_of(op, planes, "planes", like, like_name);
  const int64_t n = like.numel();
  require(op, check_planes(planes, "planes", like.device(), 0));
  const int64_t plane_bytes = planes.numel() / value_bits;
  TORCH_CHECK_VALUE(
      planes.numel() % value_bits == 0 && plane_bytes % 8 == 0 && plane_bytes * 8 >= bit_offset + n,
      "lionbit.", op, ": argument 'planes' must hold ", value_bits,
      " planes of a whole number of 64-bit words with room for ", bit_offset + n, " bits, got ",
      planes.numel(), " bytes");
  return static_cast<size_t>(plane_bytes / 8);
}
} // namespace

int64_t pack_levels_into(
    const at::Tensor& c,
    double factor,
    int64_t value_bits,
    at::Tensor& planes,
    int64_t bit_offset) {
  const char* op = "pack_levels_into";
  TORCH_CHECK_VALUE(
      c.defined() && c.scalar_type() == at::kFloat && c.is_contiguous(), "lionbit.", op,
      ": argument 'c' must be a contiguous float32 tensor, got ", describe(c));
  const int64_t n = c.numel();
  const size_t plane_words = level_plane_words(op, planes, value_bits, bit_offset, c, "c");
  if (n == 0) {
    return 0;
  }
  const c10::OptionalDeviceGuard guard(current_for(c.device()));
  const uint64_t bad = kernels_for(c.device())
                           .pack_levels(
                               c.view({-1}), factor, static_cast<int>(value_bits), planes,
                               plane_words, static_cast<uint64_t>(bit_offset));
  return static_cast<int64_t>(bad);
}

namespace {
// The checks both L1 passes make of g and m; their coefficients as floats.
LionLevelCoefs check_level_inputs(
    const char* op,
    const at::Tensor& g,
    const at::Tensor& m,
    double b1,
    double omb1,
    double b2,
    double omb2) {
  require(op, check_float(g, "g", g.device()));
  require(op, check_float(m, "m", g.device()));
  TORCH_CHECK_VALUE(
      optim::lion_direction_dtypes_supported(
          *float_dtype(g.scalar_type()), *float_dtype(m.scalar_type())),
      "lionbit.", op, ": argument 'm' must be float32 or bfloat16, got ", m.scalar_type());
  TORCH_CHECK_VALUE(
      g.numel() == m.numel(), "lionbit.", op, ": argument 'g' has ", g.numel(),
      " elements, argument 'm' ", m.numel());
  return {
      static_cast<float>(b1), static_cast<float>(omb1), static_cast<float>(b2),
      static_cast<float>(omb2)};
}
} // namespace

double lion_level_abs_sum(const at::Tensor& g, const at::Tensor& m, double b1, double omb1) {
  const LionLevelCoefs k = check_level_inputs("lion_level_abs_sum", g, m, b1, omb1, 0.0, 0.0);
  if (g.numel() == 0) {
    return 0.0;
  }
  const c10::OptionalDeviceGuard guard(current_for(g.device()));
  return kernels_for(g.device()).level_abs_sum(g.view({-1}), m.view({-1}), k);
}

int64_t lion_pack_levels_into(
    const at::Tensor& g,
    at::Tensor& m,
    double b1,
    double omb1,
    double b2,
    double omb2,
    double factor,
    int64_t value_bits,
    at::Tensor& planes,
    int64_t bit_offset,
    bool update_momentum) {
  const char* op = "lion_pack_levels_into";
  const LionLevelCoefs k = check_level_inputs(op, g, m, b1, omb1, b2, omb2);
  const int64_t n = g.numel();
  const size_t plane_words = level_plane_words(op, planes, value_bits, bit_offset, g, "g");
  if (n == 0) {
    return 0;
  }
  const c10::OptionalDeviceGuard guard(current_for(g.device()));
  at::Tensor mv = m.view({-1});
  return static_cast<int64_t>(kernels_for(g.device())
                                  .pack_lion_levels(
                                      g.view({-1}), mv, k, update_momentum, factor,
                                      static_cast<int>(value_bits), planes, plane_words,
                                      static_cast<uint64_t>(bit_offset)));
}

at::Tensor tie_words(
    int64_t words,
    const std::string& tie_break,
    int64_t seed,
    int64_t first_word) {
  const char* op = "tie_words";
  bits::TieRule rule;
  if (tie_break == "alternate") {
    rule.mode = bits::TieBreak::kAlternate;
  } else if (tie_break == "random") {
    rule.mode = bits::TieBreak::kRandom;
  }
  TORCH_CHECK_VALUE(
      rule.mode != bits::TieBreak::kZero, "lionbit.", op,
      ": argument 'tie_break' must be 'alternate' or 'random', got '", tie_break, "'");
  TORCH_CHECK_VALUE(
      words >= 0 && seed >= 0 && first_word >= 0, "lionbit.", op, ": negative argument");
  rule.seed = static_cast<uint64_t>(seed);
  at::Tensor out = at::empty({words}, at::kLong);
  auto* w = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  for (int64_t i = 0; i < words; ++i) {
    w[i] = bits::tie_word(rule, static_cast<uint64_t>(first_word + i));
  }
  return out;
}

bool lion_fused_supported(at::ScalarType param, at::ScalarType grad, at::ScalarType momentum) {
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
  const char* op = "lion_direction_into";
  require(op, check_float(g, "g", at::kCPU));
  require(op, check_float(m, "m", at::kCPU));
  TORCH_CHECK_VALUE(
      optim::lion_direction_dtypes_supported(
          *float_dtype(g.scalar_type()), *float_dtype(m.scalar_type())),
      "lionbit.", op, ": momentum must be float32 or bfloat16, got ", m.scalar_type());
  TORCH_CHECK_VALUE(
      g.numel() == m.numel(), "lionbit.", op, ": g has ", g.numel(), " elements, m ", m.numel());
  TORCH_CHECK_VALUE(bit_offset >= 0, "lionbit.", op, ": negative bit_offset");
  const int64_t n = g.numel();
  require(op, check_planes(sign, "sign", at::kCPU, bit_offset + n));
  require(op, check_planes(zero, "zero", at::kCPU, bit_offset + n));
  if (n == 0) {
    return 0;
  }
  const size_t w = bits::words_for(static_cast<size_t>(n));
  at::Tensor tmp = at::empty({static_cast<int64_t>(2 * w * 8)}, at::kByte);
  uint64_t* ts = words_of(tmp);
  const auto gd = *float_dtype(g.scalar_type());
  const auto md = *float_dtype(m.scalar_type());
  const bits::PackCounts c = update_momentum
      ? optim::lion_direction(
            gd, g.data_ptr(), md, m.data_ptr(), static_cast<size_t>(n), static_cast<float>(b1),
            static_cast<float>(omb1), static_cast<float>(b2), static_cast<float>(omb2), ts, ts + w)
      : optim::lion_direction_only(
            gd, g.data_ptr(), md, m.data_ptr(), static_cast<size_t>(n), static_cast<float>(b1),
            static_cast<float>(omb1), ts, ts + w);
  bits::copy_bits(words_of(sign), static_cast<size_t>(bit_offset), ts, 0, static_cast<size_t>(n));
  bits::copy_bits(
      words_of(zero), static_cast<size_t>(bit_offset), ts + w, 0, static_cast<size_t>(n));
  return static_cast<int64_t>(c.nonfinite);
}

void lion_apply(at::Tensor& x, const at::Tensor& delta, double lr, double decay) {
  const char* op = "lion_apply";
  require(op, check_float(x, "x", at::kCPU));
  require(op, check_float(delta, "delta", at::kCPU));
  TORCH_CHECK_VALUE(
      x.numel() == delta.numel(), "lionbit.", op, ": x has ", x.numel(), " elements, delta ",
      delta.numel());
  optim::lion_apply_dense(
      *float_dtype(x.scalar_type()), x.data_ptr(), *float_dtype(delta.scalar_type()),
      delta.data_ptr(), static_cast<size_t>(x.numel()), static_cast<float>(lr),
      static_cast<float>(decay));
}

void lion_apply_planes(
    at::Tensor& x,
    const at::Tensor& sign,
    const at::Tensor& zero,
    int64_t bit_offset,
    double lr,
    double decay) {
  const char* op = "lion_apply_planes";
  require(op, check_float(x, "x", at::kCPU));
  TORCH_CHECK_VALUE(bit_offset >= 0, "lionbit.", op, ": negative bit_offset");
  require(op, check_planes(sign, "sign", at::kCPU, bit_offset + x.numel()));
  require(op, check_planes(zero, "zero", at::kCPU, bit_offset + x.numel()));
  optim::lion_apply_planes(
      *float_dtype(x.scalar_type()), x.data_ptr(), words_of(sign), words_of(zero),
      static_cast<uint64_t>(bit_offset), static_cast<size_t>(x.numel()), static_cast<float>(lr),
      static_cast<float>(decay));
}

std::vector<std::tuple<std::string, std::string>> check_kernel_sets(
    const std::string& candidate,
    const std::string& reference,
    const std::string& device,
    int64_t seed) {
  const char* op = "check_kernel_sets";
  const c10::Device d(device);
  return as_pairs(check_kernels(
      named_set(op, candidate, d), named_set(op, reference, d), d, static_cast<uint64_t>(seed)));
}

std::string kernel_set_name(const std::string& device) {
  return kernels_for(c10::Device(device)).name();
}

} // namespace lionbit
