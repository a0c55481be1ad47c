#include "bindings/kernel_bindings.hpp"

#include <ATen/MemoryOverlap.h>
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

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

namespace {

// Lion's coefficients as the kernels take them (float32, rounded once).
struct DirectionCoefs {
  float b1, omb1, b2, omb2;
};

// One (g, m) pair of a fused direction call on the CPU: raises ValueError
// naming the argument (`g_name`, `m_name`) that is not a CPU float tensor,
// whose dtypes the kernels do not take, or whose sizes differ.
void check_direction_pair(
    const char* op,
    const at::Tensor& g,
    const at::Tensor& m,
    const std::string& g_name,
    const std::string& m_name) {
  require(op, check_float(g, g_name.c_str(), at::kCPU));
  require(op, check_float(m, m_name.c_str(), at::kCPU));
  TORCH_CHECK_VALUE(
      optim::lion_direction_dtypes_supported(
          *float_dtype(g.scalar_type()), *float_dtype(m.scalar_type())),
      "lionbit.", op, ": ", m_name, " must be float32 or bfloat16, got ", m.scalar_type());
  TORCH_CHECK_VALUE(
      g.numel() == m.numel(), "lionbit.", op, ": ", g_name, " has ", g.numel(), " elements, ",
      m_name, " ", m.numel());
}

// A pair's momentum output (m_out of lion_direction_into / m_outs of the
// list): where the new momentum goes instead of m, so m's dtype and size, and
// no element shared with m (m_out = m is what leaving it out does).
void check_momentum_out(
    const char* op,
    const at::Tensor& g,
    const at::Tensor& m,
    const at::Tensor& m_out,
    bool update_momentum,
    const std::string& m_name,
    const std::string& out_name) {
  TORCH_CHECK_VALUE(
      update_momentum, "lionbit.", op, ": ", out_name,
      " is the new momentum's buffer; it needs update_momentum=True");
  require(op, check_float(m_out, out_name.c_str(), at::kCPU));
  TORCH_CHECK_VALUE(
      m_out.scalar_type() == m.scalar_type() && m_out.numel() == m.numel(), "lionbit.", op, ": ",
      out_name, " (", m_out.scalar_type(), ", ", m_out.numel(),
      " elements) must have the dtype and size of ", m_name, " (", m.scalar_type(), ", ", m.numel(),
      " elements)");
  TORCH_CHECK_VALUE(
      at::get_overlap_status(m, m_out) == at::MemOverlapStatus::No, "lionbit.", op, ": ", out_name,
      " overlaps ", m_name, " (leave it out to update ", m_name, " in place)");
  TORCH_CHECK_VALUE(
      at::get_overlap_status(g, m_out) == at::MemOverlapStatus::No, "lionbit.", op, ": ", out_name,
      " overlaps the gradient");
}

// Whether a pair's bits go straight into the planes: only where the kernel's
// whole words (it writes the bits past n in its last word as 0) are the
// pair's alone.
bool in_place(bool planes, size_t bit_offset, size_t n) {
  return planes && bit_offset % 64 == 0 && n % 64 == 0;
}

// Scratch for the bits of the pairs not written in place (not initialized:
// the kernels write every word they use).
std::unique_ptr<uint64_t[]> scratch_for(size_t elements) {
  return std::unique_ptr<uint64_t[]>(new uint64_t[2 * bits::words_for(elements)]);
}

// The fused direction of one checked pair: the bits of its n elements go to
// `sign` / `zero` (words; null: dropped) at `bit_offset`, through `scratch`
// (2 * words_for(n) words) unless they fill whole words in place; the new
// momentum to `m_out` (m itself: in place; null: m only read). Returns the
// non-finite count.
// The pair's elements [start, start + n) (checked by the caller).
int64_t direction_into(
    const at::Tensor& g,
    const at::Tensor& m,
    const at::Tensor* m_out,
    const DirectionCoefs& k,
    uint64_t* sign,
    uint64_t* zero,
    size_t bit_offset,
    uint64_t* scratch,
    size_t start,
    size_t n) {
  if (n == 0) {
    return 0;
  }
  const size_t w = bits::words_for(n);
  const bool direct = in_place(sign != nullptr, bit_offset, n);
  uint64_t* s = direct ? sign + bit_offset / 64 : scratch;
  uint64_t* z = direct ? zero + bit_offset / 64 : scratch + w;
  const auto gd = *float_dtype(g.scalar_type());
  const auto md = *float_dtype(m.scalar_type());
  const void* gp = static_cast<const char*>(g.data_ptr()) + start * g.element_size();
  const void* mp = static_cast<const char*>(m.data_ptr()) + start * m.element_size();
  void* op = m_out == nullptr
      ? nullptr
      : static_cast<char*>(m_out->data_ptr()) + start * m_out->element_size();
  const bits::PackCounts c = optim::lion_direction_to(
      gd, gp, md, mp, op, n, k.b1, k.omb1, k.b2, k.omb2, s, z);
  if (sign != nullptr && !direct) {
    bits::copy_bits(sign, bit_offset, s, 0, n);
    bits::copy_bits(zero, bit_offset, z, 0, n);
  }
  return static_cast<int64_t>(c.nonfinite);
}

DirectionCoefs direction_coefs(double b1, double omb1, double b2, double omb2) {
  return {
      static_cast<float>(b1), static_cast<float>(omb1), static_cast<float>(b2),
      static_cast<float>(omb2)};
}

std::string item(const char* name, size_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

} // namespace

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
    bool update_momentum,
    const std::optional<at::Tensor>& m_out) {
  const char* op = "lion_direction_into";
  check_direction_pair(op, g, m, "g", "m");
  if (m_out) {
    check_momentum_out(op, g, m, *m_out, update_momentum, "m", "m_out");
  }
  TORCH_CHECK_VALUE(bit_offset >= 0, "lionbit.", op, ": negative bit_offset");
  const int64_t n = g.numel();
  require(op, check_planes(sign, "sign", at::kCPU, bit_offset + n));
  require(op, check_planes(zero, "zero", at::kCPU, bit_offset + n));
  const auto scratch = scratch_for(
      in_place(true, static_cast<size_t>(bit_offset), static_cast<size_t>(n)) ? 0 : n);
  const at::Tensor* out = m_out ? &*m_out : (update_momentum ? &m : nullptr);
  return direction_into(
      g, m, out, direction_coefs(b1, omb1, b2, omb2), words_of(sign), words_of(zero),
      static_cast<size_t>(bit_offset), scratch.get(), 0, static_cast<size_t>(n));
}

std::vector<Span> list_spans(
    const char* op,
    const std::vector<at::Tensor>& gs,
    const std::optional<std::vector<int64_t>>& starts,
    const std::optional<std::vector<int64_t>>& lengths,
    const char* name) {
  TORCH_CHECK_VALUE(
      starts.has_value() == lengths.has_value(), "lionbit.", op,
      ": starts and lengths are given together or not at all");
  TORCH_CHECK_VALUE(
      !starts || (starts->size() == gs.size() && lengths->size() == gs.size()), "lionbit.", op,
      ": ", gs.size(), " entries of '", name, "', ", starts ? starts->size() : 0, " starts and ",
      lengths ? lengths->size() : 0, " lengths");
  std::vector<Span> spans(gs.size());
  for (size_t i = 0; i < gs.size(); ++i) {
    const int64_t numel = gs[i].defined() ? gs[i].numel() : 0;
    if (!starts) {
      spans[i] = Span{0, static_cast<size_t>(numel)};
      continue;
    }
    const int64_t a = (*starts)[i], k = (*lengths)[i];
    TORCH_CHECK_VALUE(
        a >= 0 && k >= 0 && a <= numel && k <= numel - a, "lionbit.", op, ": elements [", a, ", ",
        a, " + ", k, ") of ", name, "[", i, "] (", numel, " elements) are out of range");
    spans[i] = Span{static_cast<size_t>(a), static_cast<size_t>(k)};
  }
  return spans;
}

int64_t lion_direction_list(
    const std::vector<at::Tensor>& gs,
    std::vector<at::Tensor>& ms,
    double b1,
    double omb1,
    double b2,
    double omb2,
    const std::optional<at::Tensor>& sign,
    const std::optional<at::Tensor>& zero,
    const std::vector<int64_t>& bit_offsets,
    bool update_momentum,
    const std::optional<std::vector<int64_t>>& starts,
    const std::optional<std::vector<int64_t>>& lengths,
    const std::optional<std::vector<at::Tensor>>& m_outs) {
  const char* op = "lion_direction_list";
  TORCH_CHECK_VALUE(
      gs.size() == ms.size() && gs.size() == bit_offsets.size(), "lionbit.", op, ": ", gs.size(),
      " gradients, ", ms.size(), " momenta and ", bit_offsets.size(), " bit offsets");
  const std::vector<Span> spans = list_spans(op, gs, starts, lengths);
  const bool planes = sign.has_value();
  TORCH_CHECK_VALUE(
      planes == zero.has_value(), "lionbit.", op,
      ": sign and zero are given together or not at all");
  TORCH_CHECK_VALUE(
      planes || update_momentum, "lionbit.", op,
      ": without planes only the momentum update is left to do");
  TORCH_CHECK_VALUE(
      !m_outs || m_outs->size() == gs.size(), "lionbit.", op, ": ", gs.size(), " gradients and ",
      m_outs ? m_outs->size() : 0, " entries of m_outs");
  // Every check before any momentum changes.
  size_t biggest = 0;
  for (size_t i = 0; i < gs.size(); ++i) {
    check_direction_pair(op, gs[i], ms[i], item("gs", i), item("ms", i));
    if (m_outs) {
      check_momentum_out(
          op, gs[i], ms[i], (*m_outs)[i], update_momentum, item("ms", i), item("m_outs", i));
    }
    TORCH_CHECK_VALUE(bit_offsets[i] >= 0, "lionbit.", op, ": negative bit_offsets[", i, "]");
    const auto n = static_cast<int64_t>(spans[i].count);
    if (planes) {
      require(op, check_planes(*sign, "sign", at::kCPU, bit_offsets[i] + n));
      require(op, check_planes(*zero, "zero", at::kCPU, bit_offsets[i] + n));
    }
    if (!in_place(planes, static_cast<size_t>(bit_offsets[i]), spans[i].count)) {
      biggest = std::max(biggest, spans[i].count);
    }
  }
  const auto scratch = scratch_for(biggest);
  const DirectionCoefs k = direction_coefs(b1, omb1, b2, omb2);
  int64_t nonfinite = 0;
  for (size_t i = 0; i < gs.size(); ++i) {
    const at::Tensor* out = m_outs ? &(*m_outs)[i] : (update_momentum ? &ms[i] : nullptr);
    nonfinite += direction_into(
        gs[i], ms[i], out, k, planes ? words_of(*sign) : nullptr,
        planes ? words_of(*zero) : nullptr, static_cast<size_t>(bit_offsets[i]), scratch.get(),
        spans[i].start, spans[i].count);
  }
  return nonfinite;
}

namespace {

// How a call's errors name its op and arguments: the one-tensor entry points
// "x", "delta", "bit_offset"; the list forms "xs[i]", "deltas[i]", ...
struct ArgNames {
  const char* op;
  bool single;
  std::string operator()(const char* one, const char* many, size_t i) const {
    return single ? std::string(one) : item(many, i);
  }
};

void apply_dense(
    const ArgNames& names,
    std::vector<at::Tensor>& xs,
    const std::vector<at::Tensor>& deltas,
    double lr,
    double decay) {
  const char* op = names.op;
  TORCH_CHECK_VALUE(
      xs.size() == deltas.size(), "lionbit.", op, ": ", xs.size(), " parameters and ",
      deltas.size(), " deltas");
  for (size_t i = 0; i < xs.size(); ++i) {
    const std::string x_name = names("x", "xs", i), d_name = names("delta", "deltas", i);
    require(op, check_float(xs[i], x_name.c_str(), at::kCPU));
    require(op, check_float(deltas[i], d_name.c_str(), at::kCPU));
    TORCH_CHECK_VALUE(
        xs[i].numel() == deltas[i].numel(), "lionbit.", op, ": ", x_name, " has ", xs[i].numel(),
        " elements, ", d_name, " ", deltas[i].numel());
  }
  for (size_t i = 0; i < xs.size(); ++i) {
    optim::lion_apply_dense(
        *float_dtype(xs[i].scalar_type()), xs[i].data_ptr(), *float_dtype(deltas[i].scalar_type()),
        deltas[i].data_ptr(), static_cast<size_t>(xs[i].numel()), static_cast<float>(lr),
        static_cast<float>(decay));
  }
}

void apply_planes(
    const ArgNames& names,
    std::vector<at::Tensor>& xs,
    const at::Tensor& sign,
    const at::Tensor& zero,
    const std::vector<int64_t>& bit_offsets,
    double lr,
    double decay,
    const std::vector<Span>& spans) {
  const char* op = names.op;
  TORCH_CHECK_VALUE(
      xs.size() == bit_offsets.size(), "lionbit.", op, ": ", xs.size(), " parameters and ",
      bit_offsets.size(), " bit offsets");
  for (size_t i = 0; i < xs.size(); ++i) {
    require(op, check_float(xs[i], names("x", "xs", i).c_str(), at::kCPU));
    TORCH_CHECK_VALUE(
        bit_offsets[i] >= 0, "lionbit.", op, ": negative ", names("bit_offset", "bit_offsets", i));
    const auto n = static_cast<int64_t>(spans[i].count);
    require(op, check_planes(sign, "sign", at::kCPU, bit_offsets[i] + n));
    require(op, check_planes(zero, "zero", at::kCPU, bit_offsets[i] + n));
  }
  for (size_t i = 0; i < xs.size(); ++i) {
    optim::lion_apply_planes(
        *float_dtype(xs[i].scalar_type()),
        static_cast<char*>(xs[i].data_ptr()) + spans[i].start * xs[i].element_size(),
        words_of(sign), words_of(zero), static_cast<uint64_t>(bit_offsets[i]), spans[i].count,
        static_cast<float>(lr), static_cast<float>(decay));
  }
}

} // namespace

void lion_apply(at::Tensor& x, const at::Tensor& delta, double lr, double decay) {
  std::vector<at::Tensor> xs{x};
  apply_dense({"lion_apply", true}, xs, {delta}, lr, decay);
}

void lion_apply_list(
    std::vector<at::Tensor>& xs,
    const std::vector<at::Tensor>& deltas,
    double lr,
    double decay) {
  apply_dense({"lion_apply_list", false}, xs, deltas, lr, decay);
}

void lion_apply_planes(
    at::Tensor& x,
    const at::Tensor& sign,
    const at::Tensor& zero,
    int64_t bit_offset,
    double lr,
    double decay) {
  std::vector<at::Tensor> xs{x};
  const char* op = "lion_apply_planes";
  apply_planes(
      {op, true}, xs, sign, zero, {bit_offset}, lr, decay,
      list_spans(op, xs, std::nullopt, std::nullopt, "xs"));
}

void lion_apply_planes_list(
    std::vector<at::Tensor>& xs,
    const at::Tensor& sign,
    const at::Tensor& zero,
    const std::vector<int64_t>& bit_offsets,
    double lr,
    double decay,
    const std::optional<std::vector<int64_t>>& starts,
    const std::optional<std::vector<int64_t>>& lengths) {
  const char* op = "lion_apply_planes_list";
  apply_planes(
      {op, false}, xs, sign, zero, bit_offsets, lr, decay,
      list_spans(op, xs, starts, lengths, "xs"));
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
