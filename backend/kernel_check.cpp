// The self-check of a kernel set (kernel_check.hpp).
//
// Inputs are built on the host from a splitmix64 stream of their own per case
// (seeded by the check's seed, the kernel and the case's number), copied to
// the device, and given to both sets; every output buffer starts as the same
// random bytes for both, so a write out of place shows up as well as a wrong
// value. Outputs are compared as bytes on the host (typed ones too: a NaN is
// compared by its bits). Sizes stay small: the check runs at first use on a
// GPU and in the CPU tests.
#include "backend/kernel_check.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>

#include "signbits/count.h"
#include "signbits/levels.h"
#include "signbits/trits.h"
#include "signbits/zero_counts.h"
#include "signbits/zeros.h"

namespace lionbit {
namespace {

using at::Tensor;
using Bytes = std::vector<uint8_t>;

class Rng {
 public:
  explicit Rng(uint64_t s) : s_(s) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  uint64_t below(uint64_t n) { return next() % n; }
  bool chance(unsigned percent) { return below(100) < percent; }

 private:
  uint64_t s_;
};

// ------------------------------------------------------------- buffers ----

Bytes random_bytes(Rng& rng, size_t n) {
  Bytes b(n);
  for (auto& x : b) {
    x = static_cast<uint8_t>(rng.next());
  }
  return b;
}

// Bits set with probability 1/4 (two random bytes ANDed): planes with runs
// and gaps, not just noise.
Bytes sparse_bytes(Rng& rng, size_t n) {
  Bytes b(n);
  for (auto& x : b) {
    x = static_cast<uint8_t>(rng.next() & rng.next());
  }
  return b;
}

void set_bit(Bytes& b, size_t i) {
  b[i / 8] |= static_cast<uint8_t>(1u << (i % 8));
}

bool get_bit(const Bytes& b, size_t i) {
  return ((b[i / 8] >> (i % 8)) & 1u) != 0;
}

// A plane of `bytes` bytes with `k` distinct bits set below `limit`.
Bytes plane_with(Rng& rng, size_t bytes, size_t k, size_t limit) {
  Bytes b(bytes, 0);
  for (size_t set = 0; set < k;) {
    const size_t i = rng.below(limit);
    if (!get_bit(b, i)) {
      set_bit(b, i);
      ++set;
    }
  }
  return b;
}

Tensor on(const Bytes& b, const c10::Device& device) {
  Tensor t = at::empty({static_cast<int64_t>(b.size())}, at::kByte);
  if (!b.empty()) {
    std::memcpy(t.data_ptr<uint8_t>(), b.data(), b.size());
  }
  return t.to(device);
}

Bytes host(const Tensor& t) {
  const Tensor h = t.cpu().contiguous();
  const auto* p = static_cast<const uint8_t*>(h.data_ptr());
  return Bytes(p, p + h.numel() * h.element_size());
}

uint32_t u32_at(const Bytes& b, size_t k) {
  uint32_t v;
  std::memcpy(&v, b.data() + 4 * k, 4);
  return v;
}

void put_u32(Bytes& b, size_t k, uint32_t v) {
  std::memcpy(b.data() + 4 * k, &v, 4);
}

// ------------------------------------------------------------- compare ----

std::string hex(uint8_t x) {
  char s[8];
  std::snprintf(s, sizeof s, "0x%02x", x);
  return s;
}

std::string same(const char* what, const Tensor& candidate, const Tensor& reference) {
  const Bytes a = host(candidate), b = host(reference);
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    if (a[i] != b[i]) {
      return c10::str(
          what, " differs at byte ", i, " (candidate ", hex(a[i]), ", reference ", hex(b[i]), ")");
    }
  }
  return a.size() == b.size() ? "" : c10::str(what, " sizes differ");
}

template <typename T>
std::string same_value(const char* what, const T& candidate, const T& reference) {
  return candidate == reference
      ? ""
      : c10::str(what, ": candidate ", candidate, ", reference ", reference);
}

std::string first_of(std::initializer_list<std::string> problems) {
  for (const std::string& p : problems) {
    if (!p.empty()) {
      return p;
    }
  }
  return "";
}

// ------------------------------------------------------------- formats ----

struct Format {
  at::ScalarType type;
  const char* name;
  size_t bytes;
  int exp_bits; // 0: int8
  int mant_bits;
};

constexpr std::array<Format, 5> kFormats{{
    {at::kFloat, "float32", 4, 8, 23},
    {at::kHalf, "float16", 2, 5, 10},
    {at::kBFloat16, "bfloat16", 2, 8, 7},
    {at::kDouble, "float64", 8, 11, 52},
    {at::kChar, "int8", 1, 0, 0},
}};

constexpr std::array<size_t, 7> kSizes{1, 63, 64, 65, 200, 1000, 4099};

// n values of f as bytes: ordinary numbers near 1, and with `specials` the
// patterns the sign test must get right (+-0, denormals, +-Inf, NaNs with any
// payload and sign, any bit pattern). zeros == false: no value is +-0.
Bytes sign_values(Rng& rng, const Format& f, size_t n, bool zeros) {
  Bytes out(n * f.bytes);
  for (size_t i = 0; i < n; ++i) {
    uint64_t v;
    if (f.exp_bits == 0) {
      v = zeros && rng.chance(15) ? 0 : 1 + rng.below(255);
    } else {
      const uint64_t mant = rng.next() & ((uint64_t{1} << f.mant_bits) - 1);
      const uint64_t exp_max = (uint64_t{1} << f.exp_bits) - 1;
      const uint64_t sign = (rng.next() & 1) << (f.exp_bits + f.mant_bits);
      const uint64_t mag_mask = (sign << 1) - 1;
      const uint64_t r = rng.below(100);
      if (r < 55) {
        v = sign | ((exp_max / 2 - 2 + rng.below(5)) << f.mant_bits) | mant;
      } else if (r < 67) {
        v = sign;
      } else if (r < 75) {
        v = sign | mant | 1; // denormal
      } else if (r < 81) {
        v = sign | (exp_max << f.mant_bits); // Inf
      } else if (r < 88) {
        v = sign | (exp_max << f.mant_bits) | mant | 1; // NaN
      } else {
        v = rng.next();
      }
      if (!zeros && (v & mag_mask) == 0) {
        v |= 1;
      }
    }
    std::memcpy(out.data() + i * f.bytes, &v, f.bytes);
  }
  return out;
}

// float32 values for pack_levels: quarters (halves after a factor of 2:
// ties of the rounding), ordinary values, huge ones (the clamp), denormals,
// +-0, +-Inf, NaN and any pattern.
Bytes level_values(Rng& rng, size_t n) {
  Bytes out(n * 4);
  for (size_t i = 0; i < n; ++i) {
    float x;
    const uint64_t r = rng.below(100);
    if (r < 40) {
      x = static_cast<float>(static_cast<int>(rng.below(81)) - 40) * 0.25f;
    } else if (r < 70) {
      x = static_cast<float>(rng.next() >> 40) * 0x1p-21f - 4.0f;
    } else if (r < 75) {
      x = std::numeric_limits<float>::quiet_NaN();
    } else if (r < 81) {
      x = rng.chance(50) ? std::numeric_limits<float>::infinity()
                         : -std::numeric_limits<float>::infinity();
    } else if (r < 85) {
      x = rng.chance(50) ? 1e38f : -1e38f;
    } else if (r < 89) {
      x = std::numeric_limits<float>::denorm_min() * static_cast<float>(1 + rng.below(1000));
    } else if (r < 95) {
      x = rng.chance(50) ? 0.0f : -0.0f;
    } else {
      const uint32_t u = static_cast<uint32_t>(rng.next());
      std::memcpy(&x, &u, 4);
    }
    std::memcpy(out.data() + 4 * i, &x, 4);
  }
  return out;
}

// ------------------------------------------------------------- checker ----

class Checker {
 public:
  Checker(const KernelSet& c, const KernelSet& r, const c10::Device& d, uint64_t seed)
      : cand(c), ref(r), dev(d), seed_(seed) {}

  const KernelSet& cand;
  const KernelSet& ref;
  const c10::Device dev;

  // One case of kernel k, unless k has failed already: `body` returns "" when
  // the sets agree, else what differs. An exception is a mismatch too.
  void run(Kernel k, const std::string& params, const std::function<std::string(Rng&)>& body) {
    const size_t ki = static_cast<size_t>(k);
    if (failed_[ki]) {
      return;
    }
    const uint64_t number = cases_[ki]++;
    Rng rng(seed_ ^ (static_cast<uint64_t>(ki + 1) << 48) ^ (number << 20));
    std::string problem;
    try {
      problem = body(rng);
    } catch (const c10::Error& e) {
      problem = std::string("threw: ") + e.what_without_backtrace();
    } catch (const std::exception& e) {
      problem = std::string("threw: ") + e.what();
    }
    if (!problem.empty()) {
      failed_[ki] = true;
      mismatches_.push_back(
          {k, c10::str(params, " [seed ", seed_, ", case ", number, "]: ", problem)});
    }
  }

  Tensor bytes(const Bytes& b) const { return on(b, dev); }

  std::vector<KernelMismatch> take() { return std::move(mismatches_); }

 private:
  uint64_t seed_;
  std::array<bool, static_cast<size_t>(Kernel::kCount)> failed_{};
  std::array<uint64_t, static_cast<size_t>(Kernel::kCount)> cases_{};
  std::vector<KernelMismatch> mismatches_;
};

// -------------------------------------------------------------- kernels ----

void check_pack(Checker& ck) {
  for (const Format& f : kFormats) {
    for (size_t n : kSizes) {
      for (uint64_t off : {uint64_t{0}, uint64_t{3}, uint64_t{125}}) {
        const bool zeros = off != 3;
        ck.run(
            Kernel::kPack, c10::str(f.name, ", n=", n, ", offset=", off, zeros ? "" : ", no zeros"),
            [&](Rng& rng) {
              const Tensor src = ck.bytes(sign_values(rng, f, n, zeros)).view(f.type);
              const size_t bytes = (bits::words_for(off + n) + 1) * 8;
              const Bytes s = random_bytes(rng, bytes), z = random_bytes(rng, bytes);
              Tensor s1 = ck.bytes(s), z1 = ck.bytes(z), s2 = ck.bytes(s), z2 = ck.bytes(z);
              const bits::PackCounts a = ck.cand.pack(src, s1, z1, off);
              const bits::PackCounts b = ck.ref.pack(src, s2, z2, off);
              return first_of(
                  {same_value("zeros", a.zeros, b.zeros), same_value("nans", a.nans, b.nans),
                   same("sign plane", s1, s2), same("zero plane", z1, z2)});
            });
      }
    }
  }
}

void check_pack_levels(Checker& ck) {
  const std::array<double, 9> factors{
      2.0,
      0.37,
      1.0,
      -1.5,
      0.0,
      1e30,
      std::numeric_limits<double>::quiet_NaN(),
      std::numeric_limits<double>::infinity(),
      3.0};
  size_t i = 0;
  for (int p : {2, 3, 4, 8}) {
    for (size_t n : {size_t{1}, size_t{65}, size_t{1000}}) {
      for (uint64_t off : {uint64_t{0}, uint64_t{5}, uint64_t{131}}) {
        const double factor = factors[i++ % factors.size()];
        ck.run(
            Kernel::kPackLevels,
            c10::str("p=", p, ", n=", n, ", offset=", off, ", factor=", factor), [&](Rng& rng) {
              const Tensor c = ck.bytes(level_values(rng, n)).view(at::kFloat);
              const size_t plane_words = bits::words_for(off + n) + 1;
              const Bytes init = random_bytes(rng, (p * plane_words + 1) * 8);
              Tensor a = ck.bytes(init), b = ck.bytes(init);
              const uint64_t bad_a = ck.cand.pack_levels(c, factor, p, a, plane_words, off);
              const uint64_t bad_b = ck.ref.pack_levels(c, factor, p, b, plane_words, off);
              return first_of({same_value("non-finite", bad_a, bad_b), same("planes", a, b)});
            });
      }
    }
  }
}

void check_clean(Checker& ck) {
  for (size_t words : {size_t{1}, size_t{3}}) {
    const size_t bits = words * 64;
    for (size_t n :
         {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{65}, bits - 1, bits, bits + 70}) {
      ck.run(Kernel::kClean, c10::str("words=", words, ", n=", n), [&](Rng& rng) {
        const Bytes s = random_bytes(rng, words * 8), z = sparse_bytes(rng, words * 8);
        Tensor s1 = ck.bytes(s), z1 = ck.bytes(z), s2 = ck.bytes(s), z2 = ck.bytes(z);
        ck.cand.clean(s1, z1, n);
        ck.ref.clean(s2, z2, n);
        return first_of({same("sign plane", s1, s2), same("zero plane", z1, z2)});
      });
    }
  }
}

void check_count_bits(Checker& ck) {
  for (size_t words : {size_t{1}, size_t{4}, size_t{13}}) {
    for (size_t block : {size_t{0}, size_t{1}, size_t{2}, size_t{4}, words}) {
      ck.run(Kernel::kCountBits, c10::str("words=", words, ", block=", block), [&](Rng& rng) {
        const Tensor plane = ck.bytes(random_bytes(rng, words * 8));
        const std::vector<uint64_t> a = ck.cand.count_bits(plane, block);
        const std::vector<uint64_t> b = ck.ref.count_bits(plane, block);
        if (a.size() != b.size()) {
          return same_value("blocks", a.size(), b.size());
        }
        for (size_t k = 0; k < a.size(); ++k) {
          if (a[k] != b[k]) {
            return c10::str("block ", k, ": candidate ", a[k], ", reference ", b[k]);
          }
        }
        return std::string();
      });
    }
  }
}

// A plane of `runs` runs of `len` set bits each (runs * (len + 1) <= the
// plane's bits): each in its own stretch of the plane, at a random place in
// it, a clear bit after it.
Bytes plane_of_runs(Rng& rng, size_t bytes, size_t runs, size_t len) {
  Bytes b(bytes, 0);
  const size_t stretch = runs == 0 ? 0 : bytes * 8 / runs;
  for (size_t r = 0; r < runs; ++r) {
    const size_t at = r * stretch + rng.below(stretch - len);
    for (size_t i = at; i < at + len; ++i) {
      set_bit(b, i);
    }
  }
  return b;
}

// Zero planes and their codes, from one bit in a word to a dense plane:
// scattered bits announced without their runs (bits::ZeroCode::at_most, as
// a list or a plane), and runs announced exactly and with room to spare
// (the runs form; one run of some 60 inner words: a warp's lanes fill
// two each in decode_entries), in planes of 1, 4 and 70 words.
struct ZeroCase {
  size_t words, k; // scattered: k bits
  size_t runs, len; // clustered: runs of len bits (runs > 0)
  bits::ZeroCode code;
  Bytes fixed; // columns: this plane (not empty)

  Bytes plane(Rng& rng) const {
    if (!fixed.empty()) {
      return fixed;
    }
    return runs > 0 ? plane_of_runs(rng, words * 8, runs, len)
                    : plane_with(rng, words * 8, k, words * 64);
  }
};

// The columns `cols` of a row-major matrix with `width` columns filling a
// plane of `words` words (dead ReLU units' zeros: packed runs).
Bytes plane_of_columns(size_t words, size_t width, const std::vector<size_t>& cols) {
  Bytes b(words * 8, 0);
  for (size_t row = 0; row * width < words * 64; ++row) {
    for (size_t c : cols) {
      if (row * width + c < words * 64) {
        set_bit(b, row * width + c);
      }
    }
  }
  return b;
}

std::vector<ZeroCase> zero_cases() {
  std::vector<ZeroCase> out;
  for (size_t words : {size_t{1}, size_t{4}, size_t{70}}) {
    for (size_t k : {size_t{0}, size_t{1}, size_t{3}, size_t{16}}) {
      for (uint64_t cap : {uint64_t{k}, uint64_t{k + 1}, uint64_t{words * 64}}) {
        out.push_back({words, k, 0, 0, bits::ZeroCode::at_most(cap)});
      }
    }
  }
  for (const auto& [words, runs, len] : std::vector<std::tuple<size_t, size_t, size_t>>{
           {1, 1, 40},
           {4, 1, 100},
           {4, 2, 50},
           {70, 1, 2000},
           {70, 1, 4000},
           {70, 3, 300},
           {70, 9, 17}}) {
    const uint64_t bits = runs * len;
    for (uint64_t spare : {uint64_t{0}, uint64_t{1}}) {
      out.push_back({words, 0, runs, len, bits::ZeroCode{bits + spare, runs + spare}});
    }
  }
  for (const auto& [words, width, cols] :
       std::vector<std::tuple<size_t, size_t, std::vector<size_t>>>{
           {4, 20, {0, 7}}, {70, 100, {3, 4, 50}}, {70, 128, {1, 64, 127}}}) {
    const Bytes plane = plane_of_columns(words, width, cols);
    std::vector<uint64_t> w(words);
    std::memcpy(w.data(), plane.data(), words * 8);
    const bits::ZeroCode code = bits::zero_code_of(w.data(), words);
    for (uint64_t spare : {uint64_t{0}, uint64_t{1}}) {
      bits::ZeroCode c{code.zeros + spare, code.runs + spare, code.packed + 8 * spare};
      out.push_back({words, 0, 0, 0, c, plane});
    }
  }
  return out;
}

std::string zero_params(const ZeroCase& z, const char* variant) {
  return c10::str(
      "words=", z.words,
      z.runs > 0 ? c10::str(", runs=", z.runs, "x", z.len) : c10::str(", bits=", z.k), ", code=(",
      z.code.zeros, ", ", z.code.runs, ", ", z.code.packed, ") (",
      bits::zero_form_name(bits::zero_form(z.code, z.words)), ")", variant);
}

void check_zero_codes(Checker& ck) {
  for (size_t words : {size_t{1}, size_t{4}, size_t{13}}) {
    for (size_t block : {size_t{0}, size_t{1}, size_t{2}, size_t{4}, words}) {
      for (const char* kind : {"random bits", "runs", "columns"}) {
        ck.run(
            Kernel::kZeroCodes, c10::str("words=", words, ", block=", block, ", ", kind),
            [&](Rng& rng) {
              const std::string k(kind);
              const Tensor plane = ck.bytes(
                  k == "runs"          ? plane_of_runs(rng, words * 8, words * 2, 5)
                      : k == "columns" ? plane_of_columns(words, 20, {0, 7})
                                       : random_bytes(rng, words * 8));
              const std::vector<bits::ZeroCode> a = ck.cand.zero_codes(plane, block);
              const std::vector<bits::ZeroCode> b = ck.ref.zero_codes(plane, block);
              if (a.size() != b.size()) {
                return same_value("blocks", a.size(), b.size());
              }
              for (size_t k = 0; k < a.size(); ++k) {
                if (a[k] != b[k]) {
                  return c10::str(
                      "block ", k, ": candidate (", a[k].zeros, ", ", a[k].runs, ", ", a[k].packed,
                      "), reference (", b[k].zeros, ", ", b[k].runs, ", ", b[k].packed, ")");
                }
              }
              return std::string();
            });
      }
    }
  }
}

void check_encode_zeros(Checker& ck) {
  for (const ZeroCase& z : zero_cases()) {
    ck.run(Kernel::kEncodeZeros, zero_params(z, ""), [&](Rng& rng) {
      const Tensor plane = ck.bytes(z.plane(rng));
      const Bytes init = random_bytes(rng, bits::zero_encoding_bytes(z.code, z.words) + 8);
      Tensor a = ck.bytes(init), b = ck.bytes(init);
      ck.cand.encode_zeros(plane, z.code, a);
      ck.ref.encode_zeros(plane, z.code, b);
      return same("encoding", a, b);
    });
  }
}

// How an encoding is spoilt (e: its uint32 slots, k of them used; lim: the
// plane's bits). min_k: the used slots it needs; spare: it needs a slot past
// them. The last bit is valid; an index in the slot past an odd capacity is
// not, one below an even capacity is. A run is two slots (first, end).
struct ListFault {
  const char* name;
  size_t min_k;
  bool spare;
  std::function<void(std::vector<uint32_t>& e, size_t k, uint32_t lim)> apply;
};

std::vector<ListFault> list_faults() {
  return {
      {", entries swapped", 2, false, [](auto& e, size_t, uint32_t) { std::swap(e[0], e[1]); }},
      {", an entry repeated", 2, false, [](auto& e, size_t, uint32_t) { e[1] = e[0]; }},
      {", an entry past the plane", 1, false,
       [](auto& e, size_t k, uint32_t lim) { e[k - 1] = lim; }},
      {", the last bit", 1, false, [](auto& e, size_t k, uint32_t lim) { e[k - 1] = lim - 1; }},
      {", an entry after padding", 1, true,
       [](auto& e, size_t k, uint32_t) {
         e.back() = e[k - 1];
         e[k - 1] = bits::kNoIndex;
       }},
      {", the spare slots used", 1, true,
       [](auto& e, size_t k, uint32_t lim) {
         for (size_t j = k; j < e.size(); ++j) {
           e[j] = lim - static_cast<uint32_t>(e.size() - j);
         }
       }},
  };
}

// The same for runs (k runs used: slots 2k).
std::vector<ListFault> run_faults() {
  return {
      {", a run empty", 1, false, [](auto& e, size_t, uint32_t) { e[1] = e[0]; }},
      {", a run reversed", 1, false, [](auto& e, size_t, uint32_t) { std::swap(e[0], e[1]); }},
      {", a run to the plane's end", 1, false,
       [](auto& e, size_t k, uint32_t lim) { e[2 * k - 1] = lim; }},
      {", a run past the plane", 1, false,
       [](auto& e, size_t k, uint32_t lim) { e[2 * k - 1] = lim + 1; }},
      {", runs touching", 2, false, [](auto& e, size_t, uint32_t) { e[2] = e[1]; }},
      {", runs overlapping", 2, false, [](auto& e, size_t, uint32_t) { e[2] = e[1] - 1; }},
      {", half a padding", 1, true,
       [](auto& e, size_t k, uint32_t) { e[2 * k + 1] = e[2 * k - 1] + 1; }},
      {", a run after padding", 1, true,
       [](auto& e, size_t k, uint32_t) {
         std::swap(e[2 * k - 2], e[2 * k]);
         std::swap(e[2 * k - 1], e[2 * k + 1]);
       }},
  };
}

void check_decode_zeros(Checker& ck) {
  for (const ZeroCase& z : zero_cases()) {
    const bits::ZeroForm form = bits::zero_form(z.code, z.words);
    const bool runs = form == bits::ZeroForm::kRuns;
    const size_t slots = bits::zero_encoding_bytes(z.code, z.words) / 4;
    const size_t used = runs ? z.runs : z.k;
    std::vector<const ListFault*> variants{nullptr};
    static const std::vector<ListFault> faults = list_faults(), rfaults = run_faults();
    if (form == bits::ZeroForm::kList || runs) {
      for (const ListFault& f : runs ? rfaults : faults) {
        if (used >= f.min_k && (!f.spare || slots > (runs ? 2 : 1) * used)) {
          variants.push_back(&f);
        }
      }
    }
    for (const ListFault* fault : variants) {
      ck.run(Kernel::kDecodeZeros, zero_params(z, fault ? fault->name : ""), [&](Rng& rng) {
        const Tensor plane = ck.bytes(z.plane(rng));
        Tensor enc = ck.bytes(Bytes(bits::zero_encoding_bytes(z.code, z.words)));
        ck.ref.encode_zeros(plane, z.code, enc);
        if (fault != nullptr) {
          Bytes b = host(enc);
          std::vector<uint32_t> e(slots);
          for (size_t j = 0; j < slots; ++j) {
            e[j] = u32_at(b, j);
          }
          fault->apply(e, used, static_cast<uint32_t>(z.words * 64));
          for (size_t j = 0; j < slots; ++j) {
            put_u32(b, j, e[j]);
          }
          enc = ck.bytes(b);
        }
        const Bytes init = random_bytes(rng, z.words * 8);
        Tensor a = ck.bytes(init), b = ck.bytes(init);
        const bool ok_a = ck.cand.decode_zeros(enc, z.code, a);
        const bool ok_b = ck.ref.decode_zeros(enc, z.code, b);
        return first_of(
            {same_value("accepted", ok_a, ok_b), ok_a && ok_b ? same("plane", a, b) : ""});
      });
    }
  }
  // Noise in an encoding's place: lists, runs, packed runs.
  for (const bits::ZeroCode code :
       {bits::ZeroCode::at_most(3), bits::ZeroCode::at_most(8), bits::ZeroCode{400, 3},
        bits::ZeroCode{400, 8}, bits::ZeroCode{400, 400, 64}}) {
    ck.run(
        Kernel::kDecodeZeros,
        c10::str(
            "words=70, code=(", code.zeros, ", ", code.runs, ", ", code.packed, "), random bytes"),
        [&](Rng& rng) {
          const Tensor enc = ck.bytes(random_bytes(rng, bits::zero_encoding_bytes(code, 70)));
          const Bytes init = random_bytes(rng, 70 * 8);
          Tensor a = ck.bytes(init), b = ck.bytes(init);
          const bool ok_a = ck.cand.decode_zeros(enc, code, a);
          const bool ok_b = ck.ref.decode_zeros(enc, code, b);
          return first_of(
              {same_value("accepted", ok_a, ok_b), ok_a && ok_b ? same("plane", a, b) : ""});
        });
  }
}

// N ranks' contributions for count_code / vote / the zero counts: sign
// planes (clean: no bit where the rank has a zero) as views into one buffer
// at a word offset, as shards are: each rank's [sign | zero], or with
// `back_to_back` every sign plane and then every zero plane (a device set
// may read planes laid out so in place). zeros: "none", "all" (dense, 1/4),
// "some" (odd ranks; rank 2's plane present but empty), "sparse" (a few
// bits below `limit` on ranks i % 3 != 1; rank 0 at least two).
std::vector<PlaneIn> contributions(
    Checker& ck,
    Rng& rng,
    int N,
    size_t words,
    const std::string& zeros,
    size_t limit,
    bool back_to_back = false) {
  const size_t bytes = words * 8;
  Bytes buf = random_bytes(rng, (2 * N * words + 1) * 8);
  std::vector<bool> has(static_cast<size_t>(N), false);
  const auto sign_at = [&](int i) { return 8 + (back_to_back ? i : 2 * i) * bytes; };
  const auto zero_at = [&](int i) {
    return back_to_back ? 8 + (N + i) * bytes : sign_at(i) + bytes;
  };
  for (int i = 0; i < N; ++i) {
    uint8_t* s = buf.data() + sign_at(i);
    uint8_t* z = buf.data() + zero_at(i);
    Bytes zb(bytes, 0);
    if (zeros == "all" || (zeros == "some" && i % 2 == 1)) {
      zb = sparse_bytes(rng, bytes);
      has[i] = true;
    } else if (zeros == "some" && i == 2) {
      has[i] = true;
    } else if (zeros == "sparse" && i % 3 != 1) {
      zb = plane_with(rng, bytes, (i == 0 ? 2 : 0) + rng.below(5), limit);
      has[i] = true;
    }
    std::memcpy(z, zb.data(), bytes);
    for (size_t j = 0; j < bytes; ++j) {
      s[j] &= static_cast<uint8_t>(~z[j]);
    }
  }
  const Tensor all = ck.bytes(buf);
  std::vector<PlaneIn> in(static_cast<size_t>(N));
  for (int i = 0; i < N; ++i) {
    in[i].sign = all.narrow(0, static_cast<int64_t>(sign_at(i)), static_cast<int64_t>(bytes));
    if (has[i]) {
      in[i].zero = all.narrow(0, static_cast<int64_t>(zero_at(i)), static_cast<int64_t>(bytes));
    }
  }
  return in;
}

bool any_zero(const std::vector<PlaneIn>& in) {
  for (const PlaneIn& p : in) {
    if (p.zero.defined()) {
      return true;
    }
  }
  return false;
}

void check_count_and_vote(Checker& ck) {
  size_t i = 0;
  for (int N : {1, 2, 3, 4, 7, 8, 9}) {
    for (const char* zeros : {"none", "all", "some"}) {
      const size_t words = i % 2 == 0 ? 1 : 11;
      const bool b2b = i++ % 4 < 2; // each layout with both sizes, every N and zeros mode
      const std::string params = c10::str(
          "N=", N, ", words=", words, ", zero planes: ", zeros, b2b ? ", planes back to back" : "");
      ck.run(Kernel::kCountCode, params, [&](Rng& rng) {
        const auto in = contributions(ck, rng, N, words, zeros, words * 64, b2b);
        const int planes = bits::code_planes(N, any_zero(in));
        const Bytes init = random_bytes(rng, (planes * words + 1) * 8);
        Tensor a = ck.bytes(init), b = ck.bytes(init);
        ck.cand.count_code(in, a);
        ck.ref.count_code(in, b);
        return same("code planes", a, b);
      });
      ck.run(Kernel::kVote, params, [&](Rng& rng) {
        const auto in = contributions(ck, rng, N, words, zeros, words * 64, b2b);
        const Bytes s = random_bytes(rng, words * 8), t = random_bytes(rng, words * 8);
        Tensor s1 = ck.bytes(s), t1 = ck.bytes(t), s2 = ck.bytes(s), t2 = ck.bytes(t);
        ck.cand.vote(in, s1, t1);
        ck.ref.vote(in, s2, t2);
        return first_of({same("sign", s1, s2), same("tie", t1, t2)});
      });
    }
  }
}

void check_vote_levels(Checker& ck) {
  size_t i = 0;
  for (int N : {1, 2, 3, 5, 8}) {
    for (int p : {2, 3, 4, 8}) {
      const size_t words = i++ % 2 == 0 ? 1 : 9;
      ck.run(Kernel::kVoteLevels, c10::str("N=", N, ", p=", p, ", words=", words), [&](Rng& rng) {
        // Levels in [0, 2s]; on about half the elements the ranks cancel
        // (pairs u, 2s - u; an odd rank out at s), so ties are common.
        const uint64_t s = static_cast<uint64_t>(bits::level_span(p));
        const size_t bytes = words * 8, elems = words * 64;
        std::vector<Bytes> planes(static_cast<size_t>(N), Bytes(p * bytes, 0));
        for (size_t e = 0; e < elems; ++e) {
          const bool tie = rng.chance(50);
          uint64_t prev = 0;
          for (int r = 0; r < N; ++r) {
            uint64_t u = rng.below(2 * s + 1);
            if (tie) {
              u = r % 2 == 1 ? 2 * s - prev : (r == N - 1 ? s : u);
            }
            prev = u;
            for (int b = 0; b < p; ++b) {
              if ((u >> b) & 1u) {
                set_bit(planes[r], b * elems + e);
              }
            }
          }
        }
        std::vector<Tensor> in;
        for (const Bytes& pl : planes) {
          in.push_back(ck.bytes(pl));
        }
        const Bytes sb = random_bytes(rng, bytes), tb = random_bytes(rng, bytes);
        Tensor s1 = ck.bytes(sb), t1 = ck.bytes(tb), s2 = ck.bytes(sb), t2 = ck.bytes(tb);
        ck.cand.vote_levels(in, p, s1, t1);
        ck.ref.vote_levels(in, p, s2, t2);
        return first_of({same("sign", s1, s2), same("tie", t1, t2)});
      });
    }
  }
}

// Planes of N ranks in which about half the elements are voted 0 (signs: a
// zero bit; levels: u = s) on every rank and the rest at random, some of
// those 0 on some ranks only. Signs (p == 0): per rank [sign | zero], and
// with `no_zero_rank` rank N - 1 sends no zero plane. Levels: p planes.
std::vector<PlaneIn> still_votes(
    Checker& ck,
    Rng& rng,
    int N,
    int p,
    size_t words,
    bool no_zero_rank) {
  const size_t bytes = words * 8, elems = words * 64;
  const int per_rank = p == 0 ? 2 : p;
  const uint64_t s = p == 0 ? 0 : static_cast<uint64_t>(bits::level_span(p));
  std::vector<Bytes> planes(static_cast<size_t>(N), Bytes(per_rank * bytes, 0));
  for (size_t e = 0; e < elems; ++e) {
    const bool still = rng.chance(50);
    for (int r = 0; r < N; ++r) {
      const bool zero = still || rng.chance(30);
      if (p == 0) {
        if (zero) {
          set_bit(planes[r], elems + e); // the zero plane
        } else if (rng.chance(50)) {
          set_bit(planes[r], e);
        }
        continue;
      }
      const uint64_t u = zero ? s : rng.below(2 * s + 1);
      for (int b = 0; b < p; ++b) {
        if ((u >> b) & 1u) {
          set_bit(planes[r], b * elems + e);
        }
      }
    }
  }
  std::vector<PlaneIn> in(static_cast<size_t>(N));
  for (int r = 0; r < N; ++r) {
    const Tensor t = ck.bytes(planes[r]);
    if (p != 0) {
      in[r].sign = t;
      continue;
    }
    in[r].sign = t.narrow(0, 0, static_cast<int64_t>(bytes));
    if (!(no_zero_rank && r == N - 1)) {
      in[r].zero = t.narrow(0, static_cast<int64_t>(bytes), static_cast<int64_t>(bytes));
    }
  }
  return in;
}

void check_all_zero(Checker& ck) {
  size_t i = 0;
  for (int N : {1, 2, 3, 8}) {
    for (int p : {0, 2, 3, 8}) {
      for (bool no_zero_rank : {false, true}) {
        if (p != 0 && no_zero_rank) {
          continue;
        }
        const size_t words = i++ % 2 == 0 ? 1 : 5;
        ck.run(
            Kernel::kAllZero,
            c10::str(
                "N=", N, ", p=", p, ", words=", words, ", a rank without zeros: ", no_zero_rank),
            [&](Rng& rng) {
              const auto in = still_votes(ck, rng, N, p, words, no_zero_rank);
              const Bytes init = random_bytes(rng, words * 8);
              Tensor a = ck.bytes(init), b = ck.bytes(init);
              ck.cand.all_zero(in, p, a);
              ck.ref.all_zero(in, p, b);
              return same("still", a, b);
            });
      }
    }
  }
}

void check_break_ties(Checker& ck) {
  struct Rule {
    bits::TieBreak mode;
    uint64_t seed;
  };
  const std::array<Rule, 9> rules{{
      {bits::TieBreak::kZero, 0},
      {bits::TieBreak::kAlternate, 0},
      {bits::TieBreak::kAlternate, 1},
      {bits::TieBreak::kAlternate, 6},
      {bits::TieBreak::kAlternate, 7},
      {bits::TieBreak::kRandom, 0},
      {bits::TieBreak::kRandom, 1},
      {bits::TieBreak::kRandom, 42},
      {bits::TieBreak::kRandom, 0xdeadbeefcafef00dull},
  }};
  size_t i = 0;
  for (const Rule& r : rules) {
    for (uint64_t first : {uint64_t{0}, uint64_t{1}, uint64_t{99991}, uint64_t{1} << 40}) {
      if (r.mode != bits::TieBreak::kRandom && (first == 1 || first == uint64_t{1} << 40)) {
        continue;
      }
      const size_t words = i++ % 2 == 0 ? 1 : 5;
      ck.run(
          Kernel::kBreakTies,
          c10::str(
              "rule=", bits::tie_break_name(r.mode), ", seed=", r.seed, ", first_word=", first,
              ", words=", words),
          [&](Rng& rng) {
            Bytes s = random_bytes(rng, words * 8);
            const Bytes t = random_bytes(rng, words * 8);
            Bytes z = random_bytes(rng, words * 8);
            for (size_t j = 0; j < s.size(); ++j) {
              s[j] &= static_cast<uint8_t>(~t[j]); // a tie's sign bit is 0
              z[j] &= t[j]; // every still element is a tie
            }
            const bits::TieRule rule{r.mode, r.seed};
            Tensor s1 = ck.bytes(s), t1 = ck.bytes(t), s2 = ck.bytes(s), t2 = ck.bytes(t);
            const Tensor still = ck.bytes(z);
            ck.cand.break_ties(s1, t1, still, rule, first);
            ck.ref.break_ties(s2, t2, still, rule, first);
            return first_of({same("sign", s1, s2), same("tie", t1, t2)});
          });
    }
  }
}

// Random sign and tie planes of `words` words, ties: 0 none, 1 some, 2 all.
std::pair<Tensor, Tensor> result_planes(Checker& ck, Rng& rng, size_t words, int ties) {
  const Bytes s = random_bytes(rng, words * 8);
  const Bytes t = ties == 0 ? Bytes(words * 8, 0)
                            : (ties == 1 ? sparse_bytes(rng, words * 8) : Bytes(words * 8, 0xff));
  return {ck.bytes(s), ck.bytes(t)};
}

void check_encode_trits(Checker& ck) {
  for (size_t words : {size_t{1}, size_t{2}, size_t{9}}) {
    for (int ties : {0, 1, 2}) {
      ck.run(Kernel::kEncodeTrits, c10::str("words=", words, ", ties=", ties), [&](Rng& rng) {
        const auto [s, t] = result_planes(ck, rng, words, ties);
        const Bytes init = random_bytes(rng, words * bits::kTritBytesPerWord + 5);
        Tensor a = ck.bytes(init), b = ck.bytes(init);
        ck.cand.encode_trits(s, t, a);
        ck.ref.encode_trits(s, t, b);
        return same("trits", a, b);
      });
    }
  }
}

void check_decode_trits(Checker& ck) {
  // Valid codes, then bad bytes where the C++ looks (a whole word's 13th
  // byte, a partial word's used byte) and where it does not (a partial
  // word's unused byte: accepted), and a valid 13th byte whose spare 5th
  // trit is not 0 (accepted, the trit ignored).
  struct Variant {
    const char* name;
    size_t n;
  };
  std::vector<Variant> variants;
  for (size_t n : kSizes) {
    variants.push_back({"", n});
  }
  for (size_t n : {size_t{64}, size_t{130}}) {
    variants.push_back({", bad 13th byte", n});
    variants.push_back({", spare trit set", n});
  }
  for (size_t n : {size_t{65}, size_t{200}}) {
    variants.push_back({", bad used byte", n});
    variants.push_back({", bad unused byte", n});
  }
  size_t i = 0;
  for (const Variant& v : variants) {
    const Format& f = kFormats[i++ % kFormats.size()];
    ck.run(Kernel::kDecodeTrits, c10::str(f.name, ", n=", v.n, v.name), [&](Rng& rng) {
      const size_t words = bits::words_for(v.n);
      const auto [s, t] = result_planes(ck, rng, words, 1);
      Tensor trits = ck.bytes(Bytes(words * bits::kTritBytesPerWord + 3));
      ck.ref.encode_trits(s, t, trits);
      const std::string name = v.name;
      if (!name.empty()) {
        Bytes b = host(trits);
        const size_t last = (words - 1) * bits::kTritBytesPerWord;
        const size_t used = ((v.n % 64) - 1) / 5 + 1; // bytes of the partial word
        const uint8_t bad = static_cast<uint8_t>(243 + rng.below(13));
        if (name == ", bad 13th byte") {
          b[12] = bad; // word 0: a whole word
        } else if (name == ", spare trit set") {
          b[12] = static_cast<uint8_t>(b[12] % 81 + 81 * (1 + rng.below(2)));
        } else if (name == ", bad used byte") {
          b[last + rng.below(used)] = bad;
        } else {
          b[last + used + rng.below(bits::kTritBytesPerWord - used)] = bad;
        }
        trits = ck.bytes(b);
      }
      const Tensor lut = ck.bytes(random_bytes(rng, 3 * f.bytes)).view(f.type);
      const Bytes init = random_bytes(rng, v.n * f.bytes);
      Tensor a = ck.bytes(init).view(f.type), b = ck.bytes(init).view(f.type);
      const bool ok_a = ck.cand.decode_trits(trits, lut, a);
      const bool ok_b = ck.ref.decode_trits(trits, lut, b);
      return first_of({same_value("accepted", ok_a, ok_b), ok_a && ok_b ? same("dst", a, b) : ""});
    });
  }
}

// Elements with a zero on some rank.
uint64_t zero_elements(const std::vector<PlaneIn>& in) {
  Bytes any;
  for (const PlaneIn& p : in) {
    if (p.zero.defined()) {
      const Bytes z = host(p.zero);
      any.resize(z.size(), 0);
      for (size_t j = 0; j < z.size(); ++j) {
        any[j] |= z[j];
      }
    }
  }
  uint64_t c = 0;
  for (uint8_t x : any) {
    c += static_cast<uint64_t>(__builtin_popcount(x));
  }
  return c;
}

void check_encode_zero_counts(Checker& ck) {
  size_t i = 0;
  for (int N : {1, 2, 3, 7, 9}) {
    for (const char* cap_rule : {"exact", "exact+2", "exact-1", "0"}) {
      const size_t words = i++ % 2 == 0 ? 1 : 5;
      const char* zeros = N == 3 && std::string(cap_rule) == "0" ? "none" : "sparse";
      ck.run(
          Kernel::kEncodeZeroCounts,
          c10::str("N=", N, ", words=", words, ", zero planes: ", zeros, ", capacity ", cap_rule),
          [&](Rng& rng) {
            const auto in = contributions(ck, rng, N, words, zeros, words * 64 - 5);
            const uint64_t count = zero_elements(in);
            const std::string rule = cap_rule;
            const uint64_t cap = rule == "exact" ? count
                : rule == "exact+2"              ? count + 2
                : rule == "exact-1"              ? count - 1
                                                 : 0;
            const Bytes init = random_bytes(rng, bits::zero_count_list_bytes(cap) + 8);
            Tensor a = ck.bytes(init), b = ck.bytes(init);
            const bool ok_a = ck.cand.encode_zero_counts(in, cap, a);
            const bool ok_b = ck.ref.encode_zero_counts(in, cap, b);
            return first_of(
                {same_value("accepted", ok_a, ok_b), ok_a && ok_b ? same("list", a, b) : ""});
          });
    }
  }
}

void check_apply_zero_counts(Checker& ck) {
  const std::array<const char*, 9> variants{
      "",
      ", empty list",
      ", count above capacity",
      ", an offset past dst",
      ", offsets swapped",
      ", an offset repeated",
      ", no zeros in the 2nd entry",
      ", more zeros than ranks",
      ", 2nd entry past dst"};
  size_t i = 0;
  for (int N : {1, 2, 3, 7, 9}) {
    for (const char* variant : variants) {
      const Format& f = kFormats[i % kFormats.size()];
      const size_t words = i++ % 2 == 0 ? 1 : 5;
      const size_t n = words * 64 - 3;
      ck.run(
          Kernel::kApplyZeroCounts, c10::str(f.name, ", N=", N, ", n=", n, variant), [&](Rng& rng) {
            const std::string v = variant;
            const auto in = contributions(ck, rng, N, words, "sparse", n);
            const int P = bits::code_planes(N, false);
            std::vector<PlaneIn> signs(in.size());
            for (size_t r = 0; r < in.size(); ++r) {
              signs[r].sign = in[r].sign;
            }
            Tensor code = ck.bytes(Bytes(P * words * 8));
            ck.ref.count_code(signs, code);
            std::vector<Tensor> planes;
            for (int b = 0; b < P; ++b) {
              planes.push_back(code.narrow(0, b * static_cast<int64_t>(words) * 8, words * 8));
            }
            const uint64_t cap = zero_elements(in) + 1;
            Tensor list = ck.bytes(Bytes(bits::zero_count_list_bytes(cap)));
            ck.ref.encode_zero_counts(in, cap, list);
            Bytes l = host(list);
            uint64_t count;
            std::memcpy(&count, l.data(), 8);
            auto entry = [&](size_t e) { return l.data() + 8 * (1 + e); };
            if (v == ", empty list") {
              count = 0;
            } else if (v == ", count above capacity") {
              count = cap + 1;
            } else if (v == ", an offset past dst") {
              put_u32(l, 2 * count + 1, static_cast<uint32_t>(n));
            } else if (v == ", 2nd entry past dst") {
              put_u32(l, 2 * 2 + 1, static_cast<uint32_t>(n + 64));
            } else if (v == ", offsets swapped") {
              std::swap_ranges(entry(0), entry(1), entry(1));
            } else if (v == ", an offset repeated") {
              std::memcpy(entry(1) + 4, entry(0) + 4, 4);
            } else if (v == ", no zeros in the 2nd entry") {
              put_u32(l, 2 * 2, 0);
            } else if (v == ", more zeros than ranks") {
              put_u32(l, 2 * 1, static_cast<uint32_t>(N + 1));
            }
            std::memcpy(l.data(), &count, 8);
            list = ck.bytes(l);
            const int zplanes = bits::code_planes(N, true);
            const Tensor zlut =
                ck.bytes(random_bytes(rng, (size_t{1} << zplanes) * f.bytes)).view(f.type);
            const Bytes init = random_bytes(rng, n * f.bytes);
            Tensor a = ck.bytes(init).view(f.type), b = ck.bytes(init).view(f.type);
            const bool ok_a = ck.cand.apply_zero_counts(list, cap, planes, N, zlut, a);
            const bool ok_b = ck.ref.apply_zero_counts(list, cap, planes, N, zlut, b);
            return first_of(
                {same_value("accepted", ok_a, ok_b), ok_a && ok_b ? same("dst", a, b) : ""});
          });
    }
  }
}

void check_unpack(Checker& ck) {
  size_t i = 0;
  for (int P : {1, 2, 3, 4, 5, 9}) {
    for (const Format& f : kFormats) {
      // one size per case, in turn; one and two planes (the CUDA kernel's
      // vector path) also at 1000, several whole groups of 256
      for (size_t n : {kSizes[i++ % kSizes.size()], P <= 2 ? size_t{1000} : size_t{0}}) {
        if (n == 0) {
          continue;
        }
        ck.run(Kernel::kUnpack, c10::str(f.name, ", planes=", P, ", n=", n), [&](Rng& rng) {
          // The planes as views into one buffer, one spare word apart.
          const size_t words = bits::words_for(n) + 1;
          const Tensor buf = ck.bytes(random_bytes(rng, (P * words + 1) * 8));
          std::vector<Tensor> planes;
          for (int b = 0; b < P; ++b) {
            planes.push_back(buf.narrow(0, (b * static_cast<int64_t>(words) + 1) * 8, words * 8));
          }
          const Tensor lut = ck.bytes(random_bytes(rng, (size_t{1} << P) * f.bytes)).view(f.type);
          const Bytes init = random_bytes(rng, n * f.bytes);
          Tensor a = ck.bytes(init).view(f.type), b = ck.bytes(init).view(f.type);
          ck.cand.unpack(planes, lut, a);
          ck.ref.unpack(planes, lut, b);
          return same("dst", a, b);
        });
      }
    }
  }
}

} // namespace

std::vector<KernelMismatch> check_kernels(
    const KernelSet& candidate,
    const KernelSet& reference,
    const c10::Device& device,
    uint64_t seed) {
  Checker ck(candidate, reference, device, seed);
  check_pack(ck);
  check_pack_levels(ck);
  check_clean(ck);
  check_count_bits(ck);
  check_zero_codes(ck);
  check_encode_zeros(ck);
  check_decode_zeros(ck);
  check_count_and_vote(ck);
  check_vote_levels(ck);
  check_all_zero(ck);
  check_break_ties(ck);
  check_encode_trits(ck);
  check_decode_trits(ck);
  check_encode_zero_counts(ck);
  check_apply_zero_counts(ck);
  check_unpack(ck);
  return ck.take();
}

std::vector<std::tuple<std::string, std::string>> as_pairs(
    const std::vector<KernelMismatch>& mismatches) {
  std::vector<std::tuple<std::string, std::string>> out;
  for (const KernelMismatch& m : mismatches) {
    out.emplace_back(kernel_name(m.kernel), m.case_);
  }
  return out;
}

} // namespace lionbit
