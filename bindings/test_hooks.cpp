// lionbit._test_hooks: what the tests (and bench/kernel_sets.py) call that
// the product never does, kept out of lionbit._C: the kernel check with a
// planted fault, and single kernels of a named set.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>

#include "backend/kernel_check.hpp"
#include "backend/kernel_set.hpp"
#include "backend/torch_adapter.hpp"
#include "bindings/kernel_bindings.hpp"
#include "signbits/count.h"
#include "signbits/unpack.h"

namespace py = pybind11;

namespace lionbit {
namespace {

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

  std::vector<bits::ZeroCode> zero_codes(const at::Tensor& plane, size_t block) const override {
    std::vector<bits::ZeroCode> out = base_.zero_codes(plane, block);
    if (is(Kernel::kZeroCodes) && !out.empty()) {
      out[0].runs ^= 1;
    }
    return out;
  }

  void encode_zeros(const at::Tensor& plane, const bits::ZeroCode& code, at::Tensor& out)
      const override {
    base_.encode_zeros(plane, code, out);
    if (is(Kernel::kEncodeZeros)) {
      flip(out);
    }
  }

  bool decode_zeros(const at::Tensor& in, const bits::ZeroCode& code, at::Tensor& plane)
      const override {
    return base_.decode_zeros(in, code, plane) != is(Kernel::kDecodeZeros);
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


// The check of the ATen set with the kernel named `kernel` made wrong (one
// output bit flipped, or its verdict on a message negated) against the SIMD
// set, on the CPU: shows that the check sees a wrong kernel.
std::vector<std::tuple<std::string, std::string>> check_kernel_sets_with_fault(
    const std::string& kernel,
    int64_t seed) {
  int k = 0;
  while (k < static_cast<int>(Kernel::kCount) && kernel != kernel_name(static_cast<Kernel>(k))) {
    ++k;
  }
  TORCH_CHECK_VALUE(
      k < static_cast<int>(Kernel::kCount),
      "lionbit._test_hooks.check_kernel_sets_with_fault: no kernel '", kernel, "'");
  const FaultySet faulty(aten_kernels(), static_cast<Kernel>(k));
  return as_pairs(check_kernels(faulty, simd_kernels(), at::kCPU, static_cast<uint64_t>(seed)));
}

// Single kernels of a named set, as the KernelSet methods take them (zeros:
// None where a rank has no zero plane), on the tensors' device, arguments
// checked.
std::tuple<int64_t, int64_t> kernel_pack(
    const std::string& set,
    const at::Tensor& src,
    at::Tensor& sign,
    at::Tensor& zero,
    int64_t bit_offset) {
  const char* op = "_test_hooks.kernel_pack";
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
  const char* op = "_test_hooks.kernel_count_code";
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
  const char* op = "_test_hooks.kernel_vote";
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
  const char* op = "_test_hooks.kernel_unpack";
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

} // namespace
} // namespace lionbit

PYBIND11_MODULE(_test_hooks, m) {
  m.doc() = "lionbit's test hooks (not part of the product module lionbit._C)";
  m.def(
      "check_kernel_sets_with_fault", &lionbit::check_kernel_sets_with_fault, py::arg("kernel"),
      py::arg("seed") = 0, py::call_guard<py::gil_scoped_release>());
  m.def(
      "kernel_pack", &lionbit::kernel_pack, py::arg("set"), py::arg("src"), py::arg("sign"),
      py::arg("zero"), py::arg("bit_offset"));
  m.def(
      "kernel_count_code", &lionbit::kernel_count_code, py::arg("set"), py::arg("signs"),
      py::arg("zeros"), py::arg("out"));
  m.def(
      "kernel_vote", &lionbit::kernel_vote, py::arg("set"), py::arg("signs"), py::arg("zeros"),
      py::arg("sign"), py::arg("tie"));
  m.def(
      "kernel_unpack", &lionbit::kernel_unpack, py::arg("set"), py::arg("planes"), py::arg("lut"),
      py::arg("dst"));
}
