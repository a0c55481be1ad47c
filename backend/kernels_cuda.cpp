// The CUDA kernel set: the custom kernels of signbits/cuda where there is one
// (pack, pack_levels, clean, the zero and tie planes' tallies and their
// lists of positions and runs, count_code, vote, break_ties, base 3,
// unpack), the ATen set for the rest (packed runs, lists of counts, the
// owner's sum of levels: small or rare work), all on the current stream. The L1
// levels from g and m (KernelSet's level_abs_sum and pack_lion_levels) are
// the interface's defaults: c and sum |c| with ATen, then this set's
// pack_levels. In checked mode the first use on a device runs every custom
// kernel against the ATen set (kernel_check.hpp) and keeps the ATen kernel
// for any that disagrees.
#include "backend/kernels_cuda.hpp"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "backend/kernel_check.hpp"
#include "backend/torch_adapter.hpp"
#include "signbits/count.h"
#include "signbits/cuda/kernels.h"

namespace lionbit {
namespace {

cudaStream_t current_stream(const at::Tensor& t) {
  return at::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

const uint64_t* cwords(const at::Tensor& t) {
  return reinterpret_cast<const uint64_t*>(t.data_ptr<uint8_t>());
}

uint64_t* mwords(const at::Tensor& t) {
  return reinterpret_cast<uint64_t*>(t.data_ptr<uint8_t>());
}

// The contributions as the strided layout the CUDA count kernels read:
// rank j's plane at word j * words of one buffer (zeros: undefined when no
// rank holds one; a rank without zeros gets an all-zero plane).
struct Strided {
  at::Tensor sign, zero;
};

// The contributions' sign (or zero) planes as one buffer, rank j's at byte
// j * (plane bytes): read in place where they already lie so (one rank;
// shards received one after another; each word read belongs to one of the
// planes), else copied (a rank without a zero plane: an all-zero one).
at::Tensor one_buffer(const std::vector<PlaneIn>& in, bool zero) {
  const int64_t bytes = in[0].sign.numel();
  const auto plane = [&](size_t j) -> const at::Tensor& { return zero ? in[j].zero : in[j].sign; };
  bool in_place = plane(0).defined();
  for (size_t j = 0; in_place && j < in.size(); ++j) {
    in_place = plane(j).defined() && plane(j).numel() == bytes &&
        static_cast<const uint8_t*>(plane(j).data_ptr()) ==
            static_cast<const uint8_t*>(plane(0).data_ptr()) + static_cast<int64_t>(j) * bytes;
  }
  if (in_place) {
    return plane(0);
  }
  std::vector<at::Tensor> all;
  for (size_t j = 0; j < in.size(); ++j) {
    all.push_back(plane(j).defined() ? plane(j) : at::zeros_like(in[j].sign));
  }
  return at::cat(all);
}

Strided stride_of(const std::vector<PlaneIn>& in) {
  const bool any_zero = std::any_of(
      in.begin(), in.end(), [](const PlaneIn& c) { return c.zero.defined(); });
  return Strided{one_buffer(in, false), any_zero ? one_buffer(in, true) : at::Tensor()};
}

unsigned long long* counters(const at::Tensor& t) {
  return reinterpret_cast<unsigned long long*>(t.data_ptr<int64_t>());
}

// cuda::count_blocks of `plane`'s whole blocks of `block` words, on the host:
// (set bits, runs) of block k at [2k], [2k + 1].
std::vector<uint64_t> block_tallies(const at::Tensor& plane, size_t block) {
  const size_t blocks = block == 0 ? 0 : plane_words(plane) / block;
  std::vector<uint64_t> out(2 * blocks);
  if (blocks == 0) {
    return out;
  }
  const at::Tensor dev = at::empty(
      {static_cast<int64_t>(2 * blocks)}, plane.options().dtype(at::kLong));
  cuda::count_blocks(cwords(plane), block, blocks, counters(dev), current_stream(plane));
  const at::Tensor host = dev.cpu();
  std::memcpy(out.data(), host.data_ptr<int64_t>(), out.size() * 8);
  return out;
}

// bits::encode_zeros' list (width 1) or runs (width 2) of `plane` with at
// most `cap` entries into `out`, padded with kNoIndex to `bytes`.
void encode_entries(
    const at::Tensor& plane,
    uint64_t cap,
    unsigned width,
    size_t bytes,
    at::Tensor& out) {
  const size_t words = plane_words(plane);
  out.narrow(0, 0, static_cast<int64_t>(bytes)).fill_(0xff);
  const at::Tensor scratch = at::empty(
      {static_cast<int64_t>(cuda::positions_scratch(words))}, plane.options().dtype(at::kLong));
  uint8_t* dst = out.data_ptr<uint8_t>();
  const cudaStream_t stream = current_stream(plane);
  if (width == 1) {
    cuda::positions(
        cwords(plane), words, cuda::PlaneEdge::kBits, 0, 1, 0, cap, dst, counters(scratch), stream);
    return;
  }
  cuda::positions(
      cwords(plane), words, cuda::PlaneEdge::kRunFirst, 0, 2, 0, cap, dst, counters(scratch),
      stream);
  cuda::positions(
      cwords(plane), words, cuda::PlaneEdge::kRunLast, 1, 2, 1, cap, dst, counters(scratch),
      stream);
}

class CudaKernelSet final : public KernelSet {
 public:
  CudaKernelSet() { custom_.fill(true); }

  // Uses the ATen kernel for `k` from now on.
  void fall_back(Kernel k) { custom_[static_cast<size_t>(k)] = false; }

  std::string name() const override {
    std::string fallen;
    for (size_t i = 0; i < custom_.size(); ++i) {
      if (has_custom(static_cast<Kernel>(i)) && !custom_[i]) {
        fallen += (fallen.empty() ? "" : ", ") + std::string(kernel_name(static_cast<Kernel>(i)));
      }
    }
    return fallen.empty() ? "cuda" : "cuda (aten for " + fallen + ")";
  }

  bits::PackCounts pack(const at::Tensor& src, at::Tensor& sign, at::Tensor& zero, uint64_t off)
      const override {
    if (!use(Kernel::kPack)) {
      return aten_kernels().pack(src, sign, zero, off);
    }
    at::Tensor counts = at::zeros({2}, src.options().dtype(at::kLong));
    cuda::pack_signs(
        *bits_dtype(src.scalar_type()), src.data_ptr(), static_cast<size_t>(src.numel()),
        mwords(sign), mwords(zero), off, reinterpret_cast<cuda::Counts*>(counts.data_ptr()),
        current_stream(src));
    const at::Tensor host = counts.cpu();
    bits::PackCounts c;
    c.zeros = static_cast<uint64_t>(host.data_ptr<int64_t>()[0]);
    c.nans = static_cast<uint64_t>(host.data_ptr<int64_t>()[1]);
    return c;
  }

  uint64_t pack_levels(
      const at::Tensor& c,
      double factor,
      int p,
      at::Tensor& planes,
      size_t plane_words,
      uint64_t off) const override {
    if (!use(Kernel::kPackLevels)) {
      return aten_kernels().pack_levels(c, factor, p, planes, plane_words, off);
    }
    at::Tensor counts = at::zeros({2}, c.options().dtype(at::kLong));
    cuda::pack_levels(
        c.data_ptr<float>(), static_cast<size_t>(c.numel()), factor, p, mwords(planes), plane_words,
        off, reinterpret_cast<cuda::Counts*>(counts.data_ptr()), current_stream(c));
    return static_cast<uint64_t>(counts.cpu().data_ptr<int64_t>()[1]);
  }

  void clean(at::Tensor& sign, at::Tensor& zero, size_t n) const override {
    if (!use(Kernel::kClean)) {
      return aten_kernels().clean(sign, zero, n);
    }
    const size_t words = plane_words(sign);
    const uint64_t all = static_cast<uint64_t>(words) * bits::kWordBits;
    cuda::clean(
        mwords(sign), mwords(zero), words, std::min<uint64_t>(n, all), current_stream(sign));
  }

  std::vector<uint64_t> count_bits(const at::Tensor& plane, size_t block) const override {
    if (!use(Kernel::kCountBits)) {
      return aten_kernels().count_bits(plane, block);
    }
    const std::vector<uint64_t> t = block_tallies(plane, block);
    std::vector<uint64_t> out(t.size() / 2);
    for (size_t k = 0; k < out.size(); ++k) {
      out[k] = t[2 * k];
    }
    return out;
  }

  std::vector<bits::ZeroCode> zero_codes(const at::Tensor& plane, size_t block) const override {
    if (!use(Kernel::kZeroCodes)) {
      return aten_kernels().zero_codes(plane, block);
    }
    const std::vector<uint64_t> t = block_tallies(plane, block);
    std::vector<bits::ZeroCode> out(t.size() / 2);
    for (size_t k = 0; k < out.size(); ++k) {
      out[k] = bits::ZeroCode{t[2 * k], t[2 * k + 1]};
    }
    offer_packed(plane, block, out);
    return out;
  }

  void encode_zeros(const at::Tensor& plane, const bits::ZeroCode& code, at::Tensor& out)
      const override {
    const size_t words = plane_words(plane);
    const bits::ZeroForm form = bits::zero_form(code, words);
    if (!use(Kernel::kEncodeZeros) ||
        (form != bits::ZeroForm::kList && form != bits::ZeroForm::kRuns)) {
      return aten_kernels().encode_zeros(plane, code, out);
    }
    const bool list = form == bits::ZeroForm::kList;
    encode_entries(
        plane, list ? code.zeros : code.runs, list ? 1 : 2, bits::zero_encoding_bytes(code, words),
        out);
  }

  bool decode_zeros(const at::Tensor& in, const bits::ZeroCode& code, at::Tensor& plane)
      const override {
    const size_t words = plane_words(plane);
    const bits::ZeroForm form = bits::zero_form(code, words);
    if (!use(Kernel::kDecodeZeros) ||
        (form != bits::ZeroForm::kList && form != bits::ZeroForm::kRuns)) {
      return aten_kernels().decode_zeros(in, code, plane);
    }
    const bool list = form == bits::ZeroForm::kList;
    const at::Tensor bad = at::empty({1}, plane.options().dtype(at::kInt));
    cuda::decode_entries(
        in.data_ptr<uint8_t>(), list ? (code.zeros + 1) & ~uint64_t{1} : code.runs,
        list ? code.zeros : code.runs, list ? 1 : 2, words, mwords(plane),
        reinterpret_cast<unsigned*>(bad.data_ptr<int32_t>()), current_stream(plane));
    return bad.cpu().data_ptr<int32_t>()[0] == 0;
  }

  void count_code(const std::vector<PlaneIn>& in, at::Tensor& out) const override {
    if (!use(Kernel::kCountCode)) {
      return aten_kernels().count_code(in, out);
    }
    const Strided s = stride_of(in);
    const size_t words = plane_words(in[0].sign);
    cuda::count_code(
        cwords(s.sign), s.zero.defined() ? cwords(s.zero) : nullptr, words,
        static_cast<int>(in.size()), words, mwords(out), current_stream(out));
  }

  void vote(const std::vector<PlaneIn>& in, at::Tensor& sign, at::Tensor& tie) const override {
    if (!use(Kernel::kVote)) {
      return aten_kernels().vote(in, sign, tie);
    }
    const Strided s = stride_of(in);
    cuda::vote(
        cwords(s.sign), s.zero.defined() ? cwords(s.zero) : nullptr, plane_words(in[0].sign),
        static_cast<int>(in.size()), plane_words(sign), mwords(sign), mwords(tie),
        current_stream(sign));
  }

  void vote_levels(const std::vector<at::Tensor>& in, int p, at::Tensor& sign, at::Tensor& tie)
      const override {
    aten_kernels().vote_levels(in, p, sign, tie);
  }

  void all_zero(const std::vector<PlaneIn>& in, int value_bits, at::Tensor& out) const override {
    aten_kernels().all_zero(in, value_bits, out);
  }

  void break_ties(
      at::Tensor& sign,
      const at::Tensor& tie,
      const at::Tensor& still,
      const bits::TieRule& rule,
      uint64_t first_word) const override {
    if (!use(Kernel::kBreakTies)) {
      return aten_kernels().break_ties(sign, tie, still, rule, first_word);
    }
    cuda::break_ties(
        mwords(sign), cwords(tie), cwords(still), plane_words(sign), rule, first_word,
        current_stream(sign));
  }

  void encode_trits(const at::Tensor& sign, const at::Tensor& tie, at::Tensor& out) const override {
    if (!use(Kernel::kEncodeTrits)) {
      return aten_kernels().encode_trits(sign, tie, out);
    }
    cuda::encode_trits(
        cwords(sign), cwords(tie), plane_words(sign), out.data_ptr<uint8_t>(), current_stream(out));
  }

  bool decode_trits(const at::Tensor& trits, const at::Tensor& lut, at::Tensor& dst)
      const override {
    if (!use(Kernel::kDecodeTrits)) {
      return aten_kernels().decode_trits(trits, lut, dst);
    }
    const at::Tensor bad = at::zeros({1}, dst.options().dtype(at::kInt));
    cuda::decode_trits(
        *bits_dtype(dst.scalar_type()), trits.data_ptr<uint8_t>(), static_cast<size_t>(dst.numel()),
        lut.data_ptr(), dst.data_ptr(), reinterpret_cast<unsigned*>(bad.data_ptr<int32_t>()),
        current_stream(dst));
    return bad.cpu().data_ptr<int32_t>()[0] == 0;
  }

  bool encode_zero_counts(const std::vector<PlaneIn>& in, uint64_t cap, at::Tensor& out)
      const override {
    return aten_kernels().encode_zero_counts(in, cap, out);
  }

  bool apply_zero_counts(
      const at::Tensor& list,
      uint64_t cap,
      const std::vector<at::Tensor>& planes,
      int N,
      const at::Tensor& zlut,
      at::Tensor& dst) const override {
    return aten_kernels().apply_zero_counts(list, cap, planes, N, zlut, dst);
  }

  void unpack(const std::vector<at::Tensor>& planes, const at::Tensor& lut, at::Tensor& dst)
      const override {
    if (!use(Kernel::kUnpack)) {
      return aten_kernels().unpack(planes, lut, dst);
    }
    // The kernel reads plane b at base + b * words: make them so.
    const int64_t bytes = planes.empty() ? 0 : planes[0].numel();
    bool consecutive = true;
    for (size_t b = 1; b < planes.size(); ++b) {
      consecutive = consecutive &&
          planes[b].data_ptr<uint8_t>() ==
              planes[0].data_ptr<uint8_t>() + static_cast<int64_t>(b) * bytes;
    }
    const at::Tensor base = planes.empty() ? at::Tensor()
        : consecutive                      ? planes[0]
                                           : at::cat(planes);
    cuda::unpack(
        *bits_dtype(dst.scalar_type()),
        cuda::ShardedPlanes{
            base.defined() ? cwords(base) : nullptr, static_cast<int>(planes.size()),
            static_cast<size_t>(bytes) / 8},
        static_cast<size_t>(dst.numel()), lut.data_ptr(), dst.data_ptr(), current_stream(dst));
  }

 private:
  static bool has_custom(Kernel k) {
    return k == Kernel::kPack || k == Kernel::kPackLevels || k == Kernel::kClean ||
        k == Kernel::kCountBits || k == Kernel::kZeroCodes || k == Kernel::kEncodeZeros ||
        k == Kernel::kDecodeZeros || k == Kernel::kCountCode || k == Kernel::kVote ||
        k == Kernel::kBreakTies || k == Kernel::kEncodeTrits || k == Kernel::kDecodeTrits ||
        k == Kernel::kUnpack;
  }
  bool use(Kernel k) const { return custom_[static_cast<size_t>(k)]; }

  std::array<bool, static_cast<size_t>(Kernel::kCount)> custom_{};
};

// The first use on a device: every custom kernel against the ATen set.
void check_once(CudaKernelSet& set, const c10::Device& device) {
  // Its launches go to `device` whichever device the caller has current
  // (lionbit.kernels("cuda:1") from a process on cuda:0).
  const c10::cuda::CUDAGuard guard(device);
  const auto start = std::chrono::steady_clock::now();
  const std::vector<KernelMismatch> bad = check_kernels(set, aten_kernels(), device, 0);
  for (const KernelMismatch& m : bad) {
    TORCH_WARN(
        "lionbit: the custom CUDA kernel '", kernel_name(m.kernel), "' on ", device.str(),
        " disagrees with the ATen kernels (", m.case_,
        "); lionbit uses the ATen kernel for it on this device");
    set.fall_back(m.kernel);
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  TORCH_WARN_ONCE(
      "lionbit: sign collectives on ", device.str(), " run with kernels '", set.name(),
      "' (custom CUDA kernels checked against ATen in ", ms,
      " ms; LIONBIT_KERNELS=custom|aten forces a choice)");
}

} // namespace

const KernelSet& cuda_kernels(const c10::Device& device, bool checked) {
  static std::mutex mutex;
  static std::map<std::pair<c10::DeviceIndex, bool>, std::unique_ptr<CudaKernelSet>> sets;
  const std::lock_guard<std::mutex> lock(mutex);
  auto& set = sets[{device.index(), checked}];
  if (!set) {
    auto fresh = std::make_unique<CudaKernelSet>();
    if (checked) {
      check_once(*fresh, device);
    }
    set = std::move(fresh);
  }
  return *set;
}

} // namespace lionbit
