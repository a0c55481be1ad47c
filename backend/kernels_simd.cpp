// The CPU's kernel set: signbits/'s AVX-512 / AVX2 / scalar kernels (picked at
// run time by signbits/isa.h) behind the KernelSet interface.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>

#include "backend/kernel_set.hpp"
#include "backend/torch_adapter.hpp"
#include "optimizer/lion_levels.h"
#include "signbits/copy_bits.h"
#include "signbits/count.h"
#include "signbits/isa.h"
#include "signbits/levels.h"
#include "signbits/trits.h"
#include "signbits/unpack.h"
#include "signbits/zero_counts.h"
#include "signbits/zeros.h"

namespace lionbit {
namespace {

std::vector<bits::Contribution> raw(const std::vector<PlaneIn>& in) {
  std::vector<bits::Contribution> out(in.size());
  for (size_t j = 0; j < in.size(); ++j) {
    out[j].sign = words_of(in[j].sign);
    out[j].zero = in[j].zero.defined() ? words_of(in[j].zero) : nullptr;
  }
  return out;
}

bits::DType dtype_of(const at::Tensor& t) {
  const auto d = bits_dtype(t.scalar_type());
  TORCH_CHECK(d.has_value(), "lionbit: internal: no kernel for dtype ", t.scalar_type());
  return *d;
}

class SimdKernelSet final : public KernelSet {
 public:
  std::string name() const override {
    return std::string("simd (") + bits::isa_name(bits::default_isa()) + ")";
  }

  bits::PackCounts pack(const at::Tensor& src, at::Tensor& sign, at::Tensor& zero, uint64_t off)
      const override {
    const size_t n = static_cast<size_t>(src.numel());
    if (n == 0) {
      return {};
    }
    const size_t w = bits::words_for(n);
    if (off % bits::kWordBits == 0) {
      // Straight into the planes; the last word's bits past n restored.
      uint64_t* s = words_of(sign) + off / bits::kWordBits;
      uint64_t* z = words_of(zero) + off / bits::kWordBits;
      const uint64_t keep = n % bits::kWordBits == 0 ? 0 : ~((uint64_t{1} << (n % 64)) - 1);
      const uint64_t s_last = s[w - 1] & keep, z_last = z[w - 1] & keep;
      const bits::PackCounts c = bits::pack_signs(dtype_of(src), src.data_ptr(), n, s, z);
      s[w - 1] |= s_last;
      z[w - 1] |= z_last;
      return c;
    }
    std::vector<uint64_t> tmp(2 * w);
    const bits::PackCounts c = bits::pack_signs(
        dtype_of(src), src.data_ptr(), n, tmp.data(), tmp.data() + w);
    bits::copy_bits(words_of(sign), off, tmp.data(), 0, n);
    bits::copy_bits(words_of(zero), off, tmp.data() + w, 0, n);
    return c;
  }

  uint64_t pack_levels(
      const at::Tensor& c,
      double factor,
      int p,
      at::Tensor& planes,
      size_t plane_words,
      uint64_t off) const override {
    return bits::pack_levels(
        c.data_ptr<float>(), static_cast<size_t>(c.numel()), factor, p, words_of(planes),
        plane_words, off);
  }

  double level_abs_sum(const at::Tensor& g, const at::Tensor& m, const LionLevelCoefs& k)
      const override {
    return optim::lion_level_abs_sum(
        *float_dtype(g.scalar_type()), g.data_ptr(), *float_dtype(m.scalar_type()), m.data_ptr(),
        static_cast<size_t>(g.numel()), k.b1, k.omb1);
  }

  uint64_t pack_lion_levels(
      const at::Tensor& g,
      at::Tensor& m,
      const LionLevelCoefs& k,
      bool update_momentum,
      double factor,
      int p,
      at::Tensor& planes,
      size_t plane_words,
      uint64_t off) const override {
    return optim::lion_pack_levels(
        *float_dtype(g.scalar_type()), g.data_ptr(), *float_dtype(m.scalar_type()), m.data_ptr(),
        static_cast<size_t>(g.numel()), k.b1, k.omb1, k.b2, k.omb2, update_momentum, factor,
        optim::LevelPlanes{words_of(planes), plane_words, static_cast<size_t>(off), p});
  }

  void clean(at::Tensor& sign, at::Tensor& zero, size_t n) const override {
    const size_t words = plane_words(sign);
    uint64_t* s = words_of(sign);
    uint64_t* z = words_of(zero);
    const size_t used = std::min(words, bits::words_for(n));
    const unsigned tail = static_cast<unsigned>(n % bits::kWordBits);
    if (tail != 0 && used == bits::words_for(n)) {
      s[used - 1] &= (uint64_t{1} << tail) - 1;
      z[used - 1] &= (uint64_t{1} << tail) - 1;
    }
    if (words > used) {
      std::memset(s + used, 0, (words - used) * 8);
      std::memset(z + used, 0, (words - used) * 8);
    }
    for (size_t w = 0; w < used; ++w) {
      s[w] &= ~z[w];
    }
  }

  std::vector<uint64_t> count_bits(const at::Tensor& plane, size_t block) const override {
    const size_t words = plane_words(plane);
    std::vector<uint64_t> out(block == 0 ? 0 : words / block);
    for (size_t k = 0; k < out.size(); ++k) {
      out[k] = bits::count_bits(words_of(plane) + k * block, block);
    }
    return out;
  }

  std::vector<bits::ZeroCode> zero_codes(const at::Tensor& plane, size_t block) const override {
    const size_t words = plane_words(plane);
    std::vector<bits::ZeroCode> out(block == 0 ? 0 : words / block);
    for (size_t k = 0; k < out.size(); ++k) {
      out[k] = bits::zero_code_of(words_of(plane) + k * block, block);
    }
    return out;
  }

  void encode_zeros(const at::Tensor& plane, const bits::ZeroCode& code, at::Tensor& out)
      const override {
    bits::encode_zeros(words_of(plane), plane_words(plane), code, bytes_of(out));
  }

  bool decode_zeros(const at::Tensor& in, const bits::ZeroCode& code, at::Tensor& plane)
      const override {
    return bits::decode_zeros(bytes_of(in), plane_words(plane), code, words_of(plane));
  }

  void count_code(const std::vector<PlaneIn>& in, at::Tensor& out) const override {
    const auto r = raw(in);
    bits::count_code(r.data(), static_cast<int>(r.size()), plane_words(in[0].sign), words_of(out));
  }

  void vote(const std::vector<PlaneIn>& in, at::Tensor& sign, at::Tensor& tie) const override {
    const auto r = raw(in);
    bits::vote(
        r.data(), static_cast<int>(r.size()), plane_words(sign), words_of(sign), words_of(tie));
  }

  void vote_levels(const std::vector<at::Tensor>& in, int p, at::Tensor& sign, at::Tensor& tie)
      const override {
    std::vector<const uint64_t*> planes(in.size());
    for (size_t j = 0; j < in.size(); ++j) {
      planes[j] = words_of(in[j]);
    }
    bits::vote_levels(
        planes.data(), static_cast<int>(in.size()), p, plane_words(sign), words_of(sign),
        words_of(tie));
  }

  void all_zero(const std::vector<PlaneIn>& in, int value_bits, at::Tensor& out) const override {
    if (value_bits == 0) {
      const auto r = raw(in);
      bits::all_zero(r.data(), static_cast<int>(r.size()), plane_words(out), words_of(out));
      return;
    }
    std::vector<const uint64_t*> planes(in.size());
    for (size_t j = 0; j < in.size(); ++j) {
      planes[j] = words_of(in[j].sign);
    }
    bits::all_zero_levels(
        planes.data(), static_cast<int>(in.size()), value_bits, plane_words(out), words_of(out));
  }

  void break_ties(
      at::Tensor& sign,
      const at::Tensor& tie,
      const at::Tensor& still,
      const bits::TieRule& rule,
      uint64_t first_word) const override {
    bits::break_ties(
        words_of(sign), words_of(tie), words_of(still), plane_words(sign), rule, first_word);
  }

  void encode_trits(const at::Tensor& sign, const at::Tensor& tie, at::Tensor& out) const override {
    bits::encode_trits(words_of(sign), words_of(tie), plane_words(sign), bytes_of(out));
  }

  bool decode_trits(const at::Tensor& trits, const at::Tensor& lut, at::Tensor& dst)
      const override {
    return bits::decode_trits(
        dtype_of(dst), bytes_of(trits), static_cast<size_t>(dst.numel()), lut.data_ptr(),
        dst.data_ptr());
  }

  bool encode_zero_counts(const std::vector<PlaneIn>& in, uint64_t cap, at::Tensor& out)
      const override {
    const auto r = raw(in);
    return bits::encode_zero_counts(
        r.data(), static_cast<int>(r.size()), plane_words(in[0].sign), cap, bytes_of(out));
  }

  bool apply_zero_counts(
      const at::Tensor& list,
      uint64_t cap,
      const std::vector<at::Tensor>& planes,
      int N,
      const at::Tensor& zlut,
      at::Tensor& dst) const override {
    std::vector<const uint64_t*> p(planes.size());
    for (size_t b = 0; b < planes.size(); ++b) {
      p[b] = words_of(planes[b]);
    }
    return bits::apply_zero_counts(
        bytes_of(list), cap, p.data(), static_cast<int>(p.size()), static_cast<size_t>(dst.numel()),
        N, zlut.data_ptr(), bits::dtype_size(dtype_of(dst)), dst.data_ptr());
  }

  void unpack(const std::vector<at::Tensor>& planes, const at::Tensor& lut, at::Tensor& dst)
      const override {
    std::vector<const uint64_t*> p(planes.size());
    for (size_t b = 0; b < planes.size(); ++b) {
      p[b] = words_of(planes[b]);
    }
    bits::unpack(
        dtype_of(dst), p.data(), static_cast<int>(p.size()), static_cast<size_t>(dst.numel()),
        lut.data_ptr(), dst.data_ptr());
  }
};

} // namespace

const KernelSet& simd_kernels() {
  static const SimdKernelSet set;
  return set;
}

} // namespace lionbit
