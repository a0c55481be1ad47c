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

namespace {

const KernelSet& named_set(const char* op, const std::string& name, const c10::Device& device) {
  if (name == "aten") {
    return aten_kernels();
  }
#ifdef LIONBIT_WITH_CUDA
  if (name == "cuda") {
    TORCH_CHECK_VALUE(
        device.is_cuda(), "lionbit.", op, ": the cuda set runs on CUDA devices only, not on ",
        device);
    return cuda_kernels(device, /*checked=*/false); // every custom kernel, unchecked
  }
#endif
  TORCH_CHECK_VALUE(
      name == "simd", "lionbit.", op,
      ": a kernel set is 'simd', 'aten' or (CUDA builds) 'cuda', got '", name, "'");
  TORCH_CHECK_VALUE(
      device.is_cpu(), "lionbit.", op, ": the simd set runs on the CPU only, not on ", device);
  return simd_kernels();
}

std::vector<std::tuple<std::string, std::string>> as_pairs(
    const std::vector<KernelMismatch>& mismatches) {
  std::vector<std::tuple<std::string, std::string>> out;
  for (const KernelMismatch& m : mismatches) {
    out.emplace_back(kernel_name(m.kernel), m.case_);
  }
  return out;
}

// Flips bit `bit` of a tensor's bytes (nothing in an empty one).
void flip(at::Tensor& t, uint64_t bit = 0) {
  if (t.numel() != 0) {
    t.view(at::kByte)
        .narrow(0, static_cast<int64_t>(bit / 8), 1)
        .bitwise_xor_(int64_t{1} << (bit % 8));
  }
}

// A kernel set that is `base` but for one wrong kernel: what the check must
// catch. Each kernel's fault changes what the check compares: one bit of an
// output, a tally, or a decoder's verdict.
class FaultySet final : public KernelSet {
 public:
  FaultySet(const KernelSet& base, Kernel fault) : base_(base), fault_(fault) {}

  std::string name() const override { return base_.name() + " (faulty)"; }

  bits::PackCounts pack(const at::Tensor& src, at::Tensor& sign, at::Tensor& zero, uint64_t off)
      const override {
    const bits::PackCounts c = base_.pack(src, sign, zero, off);
    if (is(Kernel::kPack)) {
      flip(sign, off);
    }
    return c;
  }

  uint64_t pack_levels(
      const at::Tensor& c,
      double factor,
      int p,
      at::Tensor& planes,
      size_t plane_words,
      uint64_t off) const override {
    const uint64_t bad = base_.pack_levels(c, factor, p, planes, plane_words, off);
    if (is(Kernel::kPackLevels)) {
      flip(planes, off);
    }
    return bad;
  }

  void clean(at::Tensor& sign, at::Tensor& zero, size_t n) const override {
    base_.clean(sign, zero, n);
    if (is(Kernel::kClean)) {
      flip(sign);
    }
  }

  std::vector<uint64_t> count_bits(const at::Tensor& plane, size_t block) const override {
    std::vector<uint64_t> out = base_.count_bits(plane, block);
    if (is(Kernel::kCountBits) && !out.empty()) {
      out[0] ^= 1;
    }
    return out;
  }

  void encode_zeros(const at::Tensor& plane, uint64_t cap, at::Tensor& out) const override {
    base_.encode_zeros(plane, cap, out);
    if (is(Kernel::kEncodeZeros)) {
      flip(out);
    }
  }

  bool decode_zeros(const at::Tensor& in, uint64_t cap, at::Tensor& plane) const override {
    return base_.decode_zeros(in, cap, plane) != is(Kernel::kDecodeZeros);
  }

  void count_code(const std::vector<PlaneIn>& in, at::Tensor& out) const override {
    base_.count_code(in, out);
    if (is(Kernel::kCountCode)) {
      flip(out);
    }
  }

  void vote(const std::vector<PlaneIn>& in, at::Tensor& sign, at::Tensor& tie) const override {
    base_.vote(in, sign, tie);
    if (is(Kernel::kVote)) {
      flip(tie);
    }
  }

  void vote_levels(const std::vector<at::Tensor>& in, int p, at::Tensor& sign, at::Tensor& tie)
      const override {
    base_.vote_levels(in, p, sign, tie);
    if (is(Kernel::kVoteLevels)) {
      flip(sign);
    }
  }

  void all_zero(const std::vector<PlaneIn>& in, int value_bits, at::Tensor& out) const override {
    base_.all_zero(in, value_bits, out);
    if (is(Kernel::kAllZero)) {
      flip(out);
    }
  }

  void break_ties(
      at::Tensor& sign,
      const at::Tensor& tie,
      const at::Tensor& still,
      const bits::TieRule& rule,
      uint64_t first_word) const override {
    base_.break_ties(sign, tie, still, rule, first_word);
    if (is(Kernel::kBreakTies)) {
      flip(sign);
    }
  }

  void encode_trits(const at::Tensor& sign, const at::Tensor& tie, at::Tensor& out) const override {
    base_.encode_trits(sign, tie, out);
    if (is(Kernel::kEncodeTrits)) {
      flip(out);
    }
  }

  bool decode_trits(const at::Tensor& trits, const at::Tensor& lut, at::Tensor& dst)
      const override {
    return base_.decode_trits(trits, lut, dst) != is(Kernel::kDecodeTrits);
  }

  bool encode_zero_counts(const std::vector<PlaneIn>& in, uint64_t cap, at::Tensor& out)
      const override {
    return base_.encode_zero_counts(in, cap, out) != is(Kernel::kEncodeZeroCounts);
  }

  bool apply_zero_counts(
      const at::Tensor& list,
      uint64_t cap,
      const std::vector<at::Tensor>& planes,
      int N,
      const at::Tensor& zlut,
      at::Tensor& dst) const override {
    return base_.apply_zero_counts(list, cap, planes, N, zlut, dst) != is(Kernel::kApplyZeroCounts);
  }

  void unpack(const std::vector<at::Tensor>& planes, const at::Tensor& lut, at::Tensor& dst)
      const override {
    base_.unpack(planes, lut, dst);
    if (is(Kernel::kUnpack)) {
      flip(dst);
    }
  }

 private:
  bool is(Kernel k) const { return k == fault_; }

  const KernelSet& base_;
  Kernel fault_;
};

// Contributions from Python's lists, checked: sign planes of one size,
// zero planes (or None) of the same size.
std::vector<PlaneIn> contributions(
    const char* op,
    const std::vector<at::Tensor>& signs,
    const std::vector<std::optional<at::Tensor>>& zeros,
    const c10::Device& device) {
  TORCH_CHECK_VALUE(
      !signs.empty() && signs.size() == zeros.size(), "lionbit.", op,
      ": 'signs' and 'zeros' must be lists of the same nonzero length");
  std::vector<PlaneIn> in(signs.size());
  for (size_t i = 0; i < signs.size(); ++i) {
    require(op, check_planes(signs[i], "signs", device, signs[0].numel() * 8));
    in[i].sign = signs[i];
    if (zeros[i].has_value()) {
      require(op, check_planes(*zeros[i], "zeros", device, signs[0].numel() * 8));
      in[i].zero = *zeros[i];
    }
  }
  return in;
}

void check_typed(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(
      t.defined() && bits_dtype(t.scalar_type()).has_value() && t.is_contiguous(), "lionbit.", op,
      ": argument '", name,
      "' must be a contiguous tensor of float32, float16, bfloat16, float64 or int8, got ",
      describe(t));
}

} // namespace

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

std::vector<std::tuple<std::string, std::string>> check_kernel_sets_with_fault(
    const std::string& kernel,
    int64_t seed) {
  int k = 0;
  while (k < static_cast<int>(Kernel::kCount) && kernel != kernel_name(static_cast<Kernel>(k))) {
    ++k;
  }
  TORCH_CHECK_VALUE(
      k < static_cast<int>(Kernel::kCount), "lionbit._check_kernel_sets_with_fault: no kernel '",
      kernel, "'");
  const FaultySet faulty(aten_kernels(), static_cast<Kernel>(k));
  return as_pairs(check_kernels(faulty, simd_kernels(), at::kCPU, static_cast<uint64_t>(seed)));
}

std::string kernel_set_name(const std::string& device) {
  return kernels_for(c10::Device(device)).name();
}

std::tuple<int64_t, int64_t> kernel_pack(
    const std::string& set,
    const at::Tensor& src,
    at::Tensor& sign,
    at::Tensor& zero,
    int64_t bit_offset) {
  const char* op = "_kernel_pack";
  check_typed(op, src, "src");
  TORCH_CHECK_VALUE(bit_offset >= 0, "lionbit.", op, ": negative bit_offset");
  const c10::Device d = src.device();
  require(op, check_planes(sign, "sign", d, bit_offset + src.numel()));
  require(op, check_planes(zero, "zero", d, bit_offset + src.numel()));
  const bits::PackCounts c =
      named_set(op, set, d).pack(src.view({-1}), sign, zero, static_cast<uint64_t>(bit_offset));
  return {static_cast<int64_t>(c.zeros), static_cast<int64_t>(c.nans)};
}

void kernel_count_code(
    const std::string& set,
    const std::vector<at::Tensor>& signs,
    const std::vector<std::optional<at::Tensor>>& zeros,
    at::Tensor& out) {
  const char* op = "_kernel_count_code";
  const c10::Device d = out.device();
  const std::vector<PlaneIn> in = contributions(op, signs, zeros, d);
  bool with_zeros = false;
  for (const PlaneIn& p : in) {
    with_zeros = with_zeros || p.zero.defined();
  }
  const int planes = bits::code_planes(static_cast<int>(in.size()), with_zeros);
  require(op, check_planes(out, "out", d, planes * signs[0].numel() * 8));
  named_set(op, set, d).count_code(in, out);
}

void kernel_vote(
    const std::string& set,
    const std::vector<at::Tensor>& signs,
    const std::vector<std::optional<at::Tensor>>& zeros,
    at::Tensor& sign,
    at::Tensor& tie) {
  const char* op = "_kernel_vote";
  const c10::Device d = sign.device();
  const std::vector<PlaneIn> in = contributions(op, signs, zeros, d);
  require(op, check_planes(sign, "sign", d, 0));
  require(op, check_planes(tie, "tie", d, sign.numel() * 8));
  TORCH_CHECK_VALUE(
      sign.numel() <= signs[0].numel(), "lionbit.", op,
      ": 'sign' is longer than the contributions");
  named_set(op, set, d).vote(in, sign, tie);
}

void kernel_unpack(
    const std::string& set,
    const std::vector<at::Tensor>& planes,
    const at::Tensor& lut,
    at::Tensor& dst) {
  const char* op = "_kernel_unpack";
  check_typed(op, dst, "dst");
  const c10::Device d = dst.device();
  TORCH_CHECK_VALUE(
      planes.size() <= static_cast<size_t>(bits::kMaxUnpackPlanes), "lionbit.", op, ": at most ",
      bits::kMaxUnpackPlanes, " planes");
  for (const at::Tensor& p : planes) {
    require(op, check_planes(p, "planes", d, dst.numel()));
  }
  require(op, check_buffer(lut, "lut", dst.scalar_type(), d, int64_t{1} << planes.size()));
  at::Tensor flat = dst.view({-1});
  named_set(op, set, d).unpack(planes, lut, flat);
}

} // namespace lionbit
