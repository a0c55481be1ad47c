// The ATen kernel set: the functions of signbits/ written with tensor
// operations only, so that they run on any device torch runs on (the
// fallback of kernels_for, and the reference the CUDA kernels are checked
// against at first use). Bit for bit the SIMD set's results; slower.
//
// No argument's data is read or written through a host pointer: what
// reaches the host are the values the interface returns (tallies, bit
// counts, a list's length, whether a message is corrupt), each one small
// .cpu() copy, and what goes the other way (a tie rule's words, a list's
// length) is staged in a CPU tensor of the set's own and copied over.
//
// Planes are worked on in two forms:
//  - as bytes, bit-sliced: the counters (count_code, vote, vote_levels) add
//    whole planes with bitwise full adders, as signbits/ does, 8 elements a
//    byte operation. Mirroring the C++ counters plane for plane also keeps
//    their widths, so even inputs outside the contract (a sign and a zero
//    bit both set, a level above 2s) wrap exactly as they do there;
//  - one byte (0 or 1) per element where an element needs a value of its
//    own (pack, unpack, trits, zero lists): bits_of expands, pack_bits packs.
// Typed values (tables, dst) move through same-size integer views: a copy of
// a NaN keeps its payload, and nothing is compared as a float.
//
// One exception: packed runs (signbits/packed_runs.h) are a serial code, a
// greedy search over the runs; they are coded with signbits/'s own coder on
// a host copy of the plane (here, not a second implementation: its oracle
// is its own tests, a round trip over structured and random planes).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "backend/kernel_set.hpp"
#include "backend/torch_adapter.hpp"
#include "signbits/levels.h"
#include "signbits/packed_runs.h"
#include "signbits/trits.h"
#include "signbits/zeros.h"

namespace lionbit {
namespace {

using at::Tensor;

at::TensorOptions opts(const Tensor& like, at::ScalarType dtype) {
  return at::TensorOptions().dtype(dtype).device(like.device());
}

// ------------------------------------------------------- bits and bytes ----

// Bit i of a plane is bit i % 8 of byte i / 8: bytes [..., m] expand to
// 0/1 bytes [..., 8 m] (uint8) by shifts.
Tensor bits_of(const Tensor& bytes) {
  const Tensor shifts = at::arange(8, opts(bytes, at::kByte));
  return bytes.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and_(1).flatten(-2);
}

// The inverse: 0/1 bytes (uint8 or bool) [..., 8 m] -> bytes [..., m]. Eight
// 0/1 bytes read as one little-endian int64 hold bit j at 8 j; three
// shift-ORs gather them into its low byte (x | x >> 7 puts bits j, j + 1 in
// byte j; >> 14 and >> 28 double that twice), and nothing lands twice on a
// bit of that byte. Only right shifts of values below 2^57: no overflow, and
// the arithmetic shift of int64 never sees a sign bit. (A sum over the
// bytes' place values does the same, 5x slower: a reduction over 8.)
Tensor pack_bits(const Tensor& bits) {
  Tensor b = bits.view(at::kByte);
  if (b.storage_offset() % 8 != 0 || !b.is_contiguous()) {
    b = b.clone(at::MemoryFormat::Contiguous);
  }
  Tensor x = b.view(at::kLong);
  x = x.bitwise_or(x.bitwise_right_shift(7));
  x.bitwise_or_(x.bitwise_right_shift(14));
  x.bitwise_or_(x.bitwise_right_shift(28));
  return x.bitwise_and_(0xff).to(at::kByte);
}

// Bits [off, off + n) of `plane` (bytes) from bits (n 0/1 bytes); the
// neighbours sharing the first and last byte are read back and kept.
void write_bits(Tensor& plane, uint64_t off, const Tensor& bits) {
  const int64_t n = bits.numel();
  const int64_t first = static_cast<int64_t>(off / 8), lead = static_cast<int64_t>(off % 8);
  const int64_t end = lead + n, nbytes = (end + 7) / 8;
  Tensor region = plane.narrow(0, first, nbytes);
  std::vector<Tensor> parts;
  if (lead != 0) {
    parts.push_back(bits_of(region.narrow(0, 0, 1)).narrow(0, 0, lead));
  }
  parts.push_back(bits);
  if (end % 8 != 0) {
    parts.push_back(bits_of(region.narrow(0, nbytes - 1, 1)).narrow(0, end % 8, 8 - end % 8));
  }
  region.copy_(pack_bits(parts.size() == 1 ? bits : at::cat(parts)));
}

// planes[b] |= bits[b] at bits [off, off + n) (planes: [p, bytes], bits:
// [p, n] 0/1 bytes).
void or_bits(Tensor planes, uint64_t off, const Tensor& bits) {
  const int64_t n = bits.size(1);
  const int64_t first = static_cast<int64_t>(off / 8), lead = static_cast<int64_t>(off % 8);
  const int64_t nbytes = (lead + n + 7) / 8;
  const Tensor padded = at::constant_pad_nd(bits, {lead, nbytes * 8 - lead - n}, 0);
  planes.narrow(1, first, nbytes).bitwise_or_(pack_bits(padded));
}

// Positions (int64, ascending) of the set bits of `bytes`: the nonzero bytes
// first, so a sparse plane expands only where it has bits.
Tensor set_bits(const Tensor& bytes) {
  const Tensor nz = bytes.nonzero().select(1, 0);
  const Tensor rc = bits_of(bytes.index_select(0, nz)).view({nz.size(0), 8}).nonzero();
  return nz.index_select(0, rc.select(1, 0)).mul_(8).add_(rc.select(1, 1));
}

// Bit (pos % 8) of byte pos / 8 of `bytes`, as int64 0/1.
Tensor bit_at(const Tensor& bytes, const Tensor& pos) {
  return bytes.index_select(0, pos.div(8, "floor"))
      .to(at::kLong)
      .bitwise_right_shift(pos.bitwise_and(7))
      .bitwise_and_(1);
}

// Non-negative int64 values as k little-endian bytes each (the low 8k bits):
// [m] -> [m, k] uint8. The mask after the shift makes it a logical one.
Tensor le_bytes(const Tensor& v, int k) {
  const Tensor shifts = at::arange(0, 8 * k, 8, opts(v, at::kLong));
  return v.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(0xff).to(at::kByte);
}

// [m, k] little-endian bytes (k <= 4) -> [m] int64.
Tensor le_value(const Tensor& bytes) {
  const Tensor shifts = at::arange(0, 8 * bytes.size(1), 8, opts(bytes, at::kLong));
  return bytes.to(at::kLong).bitwise_left_shift(shifts).sum(1);
}

// Set bits of each 64-bit word of `bytes` (a whole number of words), as
// int64: a per-byte popcount (the SWAR halving steps on uint8), the 8 bytes
// of a word added within an int64 (at most 64: no carry leaves a byte, no
// sign bit).
Tensor popcounts(const Tensor& bytes) {
  Tensor x = bytes - bytes.bitwise_right_shift(1).bitwise_and_(0x55);
  x = x.bitwise_and(0x33) + x.bitwise_right_shift(2).bitwise_and_(0x33);
  x = (x + x.bitwise_right_shift(4)).bitwise_and_(0x0f).view(at::kLong);
  x = x + x.bitwise_right_shift(8);
  x.add_(x.bitwise_right_shift(16));
  x.add_(x.bitwise_right_shift(32));
  return x.bitwise_and_(0xff);
}

// The first (`first`) or last bits of the runs of set bits of `bytes`, as a
// plane of the same size, each block of `block` bytes on its own (a run
// never continues across a block's edge). Bit i is bit i % 8 of byte i / 8,
// so a neighbour in the next byte is its bit 0, in the previous its bit 7.
Tensor run_edges(const Tensor& bytes, int64_t block, bool first) {
  const int64_t n = bytes.numel();
  const Tensor x = bytes.to(at::kInt);
  Tensor carry = at::zeros({n}, opts(bytes, at::kInt));
  if (n > 1) {
    if (first) {
      carry.narrow(0, 1, n - 1).copy_(x.narrow(0, 0, n - 1).bitwise_right_shift(7));
    } else {
      carry.narrow(0, 0, n - 1).copy_(x.narrow(0, 1, n - 1).bitwise_and(1).bitwise_left_shift(7));
    }
    // No neighbour across a block's edge.
    carry.view({n / block, block}).select(1, first ? 0 : block - 1).zero_();
  }
  const Tensor neighbour = first ? x.bitwise_left_shift(1).bitwise_or_(carry)
                                 : x.bitwise_right_shift(1).bitwise_or_(carry);
  return x.bitwise_and(neighbour.bitwise_not()).bitwise_and_(0xff).to(at::kByte);
}

} // namespace

// The packed runs of each block of `plane` whose code has zeros; off the
// CPU only where they are worth the plane's copy to the host
// (bits::packed_worth_a_copy).
void offer_packed(const Tensor& plane, size_t block, std::vector<bits::ZeroCode>& codes) {
  Tensor host; // the plane on the host, copied at most once
  for (size_t k = 0; k < codes.size(); ++k) {
    bits::ZeroCode& c = codes[k];
    if (c.zeros == 0 || (!plane.is_cpu() && !bits::packed_worth_a_copy(c.zeros, c.runs, block))) {
      continue;
    }
    if (!host.defined()) {
      host = plane.cpu().contiguous();
    }
    c.packed = bits::packed_offer(
        reinterpret_cast<const uint64_t*>(host.data_ptr<uint8_t>()) + k * block, block, c.runs);
  }
}

namespace {

// A small host copy of an on-device value's bytes (a list's length).
uint64_t host_u64(const Tensor& eight_bytes) {
  const Tensor h = eight_bytes.cpu().contiguous();
  uint64_t v = 0;
  std::memcpy(&v, h.data_ptr<uint8_t>(), 8);
  return v;
}

// A host value's bytes on `like`'s device.
Tensor device_u64(uint64_t v, const Tensor& like) {
  Tensor h = at::empty({8}, at::kByte);
  std::memcpy(h.data_ptr<uint8_t>(), &v, 8);
  return h.to(like.device());
}

// The same-size integer view of a typed tensor.
Tensor as_bits(const Tensor& t) {
  switch (t.element_size()) {
    case 1:
      return t.view(at::kByte);
    case 2:
      return t.view(at::kShort);
    case 4:
      return t.view(at::kInt);
    default:
      return t.view(at::kLong);
  }
}

// ------------------------------------------------------ bit-sliced sums ----
//
// A counter is a vector of planes (plane b: bit b of every element's count),
// each a byte tensor or undefined for all zeros, which is what a fresh
// counter holds: adding the first ranks costs nothing. Values are never
// modified in place, so an input plane can be a counter's plane.

Tensor and_(const Tensor& a, const Tensor& b) {
  return a.defined() && b.defined() ? at::bitwise_and(a, b) : Tensor();
}

Tensor xor_(const Tensor& a, const Tensor& b) {
  if (!a.defined()) {
    return b;
  }
  return b.defined() ? at::bitwise_xor(a, b) : a;
}

Tensor or_(const Tensor& a, const Tensor& b) {
  if (!a.defined()) {
    return b;
  }
  return b.defined() ? at::bitwise_or(a, b) : a;
}

// c += x over c's planes; a carry out of the top plane is dropped.
void ripple_add(std::vector<Tensor>& c, Tensor x) {
  for (size_t b = 0; b < c.size() && x.defined(); ++b) {
    const Tensor t = and_(c[b], x);
    c[b] = xor_(c[b], x);
    x = t;
  }
}

// The code of count.h: #positive (bit_width(N) planes) or, with a zero plane
// anywhere, 2 * #positive + #zero (one plane more, the carry out dropped).
std::vector<Tensor> count_planes(const std::vector<PlaneIn>& in, int64_t bytes, bool& with_zeros) {
  const int n = static_cast<int>(in.size());
  with_zeros = std::any_of(in.begin(), in.end(), [](const PlaneIn& p) { return p.zero.defined(); });
  const size_t width = static_cast<size_t>(bits::bit_width(static_cast<uint64_t>(n)));
  std::vector<Tensor> pos(width), zer(width);
  for (const PlaneIn& p : in) {
    ripple_add(pos, p.sign.narrow(0, 0, bytes));
    if (p.zero.defined()) {
      ripple_add(zer, p.zero.narrow(0, 0, bytes));
    }
  }
  if (!with_zeros) {
    return pos;
  }
  std::vector<Tensor> code(width + 1);
  code[0] = zer[0];
  Tensor carry;
  for (size_t b = 1; b <= width; ++b) {
    const Tensor& a = pos[b - 1];
    const Tensor z = b < width ? zer[b] : Tensor();
    const Tensor s = xor_(a, z);
    code[b] = xor_(s, carry);
    carry = or_(and_(a, z), and_(carry, s));
  }
  return code;
}

// gt / eq of (code << shift) against the constant v, plane by plane from the
// top (count.h's compare).
void compare(
    const std::vector<Tensor>& code,
    int shift,
    uint64_t v,
    const Tensor& like,
    Tensor& gt,
    Tensor& eq) {
  gt = at::zeros_like(like);
  eq = at::full_like(like, 0xff);
  for (int b = static_cast<int>(code.size()) + shift - 1; b >= 0; --b) {
    const Tensor vb = b >= shift ? code[static_cast<size_t>(b - shift)] : Tensor();
    if (((v >> b) & 1u) != 0) {
      eq = vb.defined() ? at::bitwise_and(eq, vb) : at::zeros_like(like);
    } else if (vb.defined()) {
      gt = at::bitwise_or(gt, at::bitwise_and(eq, vb));
      eq = at::bitwise_and(eq, at::bitwise_not(vb));
    }
  }
}

void store(Tensor& out, const Tensor& v) {
  if (v.defined()) {
    out.copy_(v);
  } else {
    out.zero_();
  }
}

// ------------------------------------------------------------ the set ----

class AtenKernelSet final : public KernelSet {
 public:
  std::string name() const override { return "aten"; }

  // pack: the sign classes from the bit pattern (an integer view: zero is a
  // zero magnitude, NaN a magnitude above Inf's, positive a nonnegative
  // pattern in (0, Inf]), so denormals count whatever the FPU flushes.
  bits::PackCounts pack(const Tensor& src, Tensor& sign, Tensor& zero, uint64_t off)
      const override {
    if (src.numel() == 0) {
      return {};
    }
    Tensor pos, zer, nan;
    if (src.scalar_type() == at::kChar) {
      pos = src.gt(0);
      zer = src.eq(0);
    } else {
      int64_t mag_mask = 0, inf = 0;
      switch (src.scalar_type()) {
        case at::kFloat:
          mag_mask = 0x7fffffff, inf = 0x7f800000;
          break;
        case at::kHalf:
          mag_mask = 0x7fff, inf = 0x7c00;
          break;
        case at::kBFloat16:
          mag_mask = 0x7fff, inf = 0x7f80;
          break;
        case at::kDouble:
          mag_mask = 0x7fffffffffffffffll, inf = 0x7ff0000000000000ll;
          break;
        default:
          TORCH_CHECK(false, "lionbit: internal: no kernel for dtype ", src.scalar_type());
      }
      const Tensor u = as_bits(src);
      const Tensor mag = u.bitwise_and(mag_mask);
      zer = mag.eq(0);
      nan = mag.gt(inf);
      pos = u.gt(0).logical_and_(u.le(inf));
    }
    const Tensor zeros = at::count_nonzero(zer);
    const Tensor tallies =
        at::stack({zeros, nan.defined() ? at::count_nonzero(nan) : at::zeros_like(zeros)}).cpu();
    write_bits(sign, off, pos.view(at::kByte));
    write_bits(zero, off, zer.view(at::kByte));
    bits::PackCounts c;
    c.zeros = static_cast<uint64_t>(tallies[0].item<int64_t>());
    c.nans = static_cast<uint64_t>(tallies[1].item<int64_t>());
    return c;
  }

  // pack_levels: levels.cpp's level_of on the whole tensor. The product and
  // rint in float64 (torch's round is half to even), a NaN product (NaN
  // factor, 0 * Inf) is 0, then the clamp; a non-finite c is 0 (NaN) or +-s
  // (+-Inf) whatever the factor.
  uint64_t pack_levels(
      const Tensor& c,
      double factor,
      int p,
      Tensor& planes,
      size_t plane_words,
      uint64_t off) const override {
    if (c.numel() == 0) {
      return 0;
    }
    const int s = bits::level_span(p);
    const Tensor cd = c.to(at::kDouble);
    Tensor q = cd.mul(factor).round_().nan_to_num_(0.0).clamp_(-s, s);
    q = at::where(cd.isinf(), cd.sign().mul_(s), q);
    const Tensor u = q.add_(s).to(at::kByte);
    const Tensor shifts = at::arange(p, opts(c, at::kByte)).unsqueeze(1);
    const Tensor level_bits = u.unsqueeze(0).bitwise_right_shift(shifts).bitwise_and_(1);
    const int64_t plane_bytes = static_cast<int64_t>(plane_words) * 8;
    or_bits(planes.narrow(0, 0, p * plane_bytes).view({p, plane_bytes}), off, level_bits);
    return static_cast<uint64_t>(at::count_nonzero(cd.isfinite().logical_not_()).item<int64_t>());
  }

  // clean: bits from n on cleared (from the end of the planes' words when n
  // lies past them, as the SIMD set), then a zero bit wins.
  void clean(Tensor& sign, Tensor& zero, size_t n) const override {
    const size_t words = plane_words(sign);
    const size_t limit = words >= bits::words_for(n) ? n : words * bits::kWordBits;
    const int64_t full = static_cast<int64_t>(limit / 8);
    const int64_t bytes = sign.numel();
    int64_t cleared = full;
    if (limit % 8 != 0) {
      const int64_t keep = (1 << (limit % 8)) - 1;
      sign.narrow(0, full, 1).bitwise_and_(keep);
      zero.narrow(0, full, 1).bitwise_and_(keep);
      ++cleared;
    }
    sign.narrow(0, cleared, bytes - cleared).zero_();
    zero.narrow(0, cleared, bytes - cleared).zero_();
    sign.bitwise_and_(zero.bitwise_not());
  }

  // count_bits: popcounts() per block, summed on the device, one copy back.
  std::vector<uint64_t> count_bits(const Tensor& plane, size_t block) const override {
    const int64_t blocks = block == 0
        ? 0
        : static_cast<int64_t>(plane_words(plane)) / static_cast<int64_t>(block);
    std::vector<uint64_t> out(static_cast<size_t>(blocks));
    if (blocks == 0) {
      return out;
    }
    const Tensor x = plane.narrow(0, 0, blocks * static_cast<int64_t>(block) * 8);
    const Tensor sums = popcounts(x).view({blocks, -1}).sum(1, false, at::kLong).cpu().contiguous();
    std::memcpy(out.data(), sums.data_ptr<int64_t>(), out.size() * 8);
    return out;
  }

  // zero_codes: the bits of each block and of its run starts (a set bit
  // whose predecessor in the block is clear), counted in one reduction.
  std::vector<bits::ZeroCode> zero_codes(const Tensor& plane, size_t block) const override {
    const int64_t blocks = block == 0
        ? 0
        : static_cast<int64_t>(plane_words(plane)) / static_cast<int64_t>(block);
    std::vector<bits::ZeroCode> out(static_cast<size_t>(blocks));
    if (blocks == 0) {
      return out;
    }
    const int64_t bytes = blocks * static_cast<int64_t>(block) * 8;
    const Tensor x = plane.narrow(0, 0, bytes);
    const Tensor both = at::cat({x, run_edges(x, static_cast<int64_t>(block) * 8, true)});
    const Tensor sums =
        popcounts(both).view({2, blocks, -1}).sum(2, false, at::kLong).cpu().contiguous();
    const int64_t* v = sums.data_ptr<int64_t>();
    for (int64_t k = 0; k < blocks; ++k) {
      out[static_cast<size_t>(k)] = bits::ZeroCode{
          static_cast<uint64_t>(v[k]), static_cast<uint64_t>(v[blocks + k])};
    }
    offer_packed(x, block, out);
    return out;
  }

  // The zero encodings (zeros.h): a list is nonzero()'s positions as
  // uint32, runs the positions of the run edges paired, both padded with
  // kNoIndex; decoding checks what zeros.cpp checks, on the device, and
  // reads one boolean back.
  void encode_zeros(const Tensor& plane, const bits::ZeroCode& code, Tensor& out) const override {
    const int64_t words = static_cast<int64_t>(plane_words(plane));
    const bits::ZeroForm form = bits::zero_form(code, static_cast<size_t>(words));
    const Tensor x = plane.narrow(0, 0, words * 8);
    if (form == bits::ZeroForm::kNone) {
      return;
    }
    if (form == bits::ZeroForm::kPlane) {
      out.narrow(0, 0, words * 8).copy_(x);
      return;
    }
    if (form == bits::ZeroForm::kPacked) {
      const Tensor host = x.cpu().contiguous();
      Tensor enc = at::empty({static_cast<int64_t>(code.packed)}, host.options());
      bits::encode_packed_runs(
          words_of(host), static_cast<size_t>(words), bytes_of(enc), enc.numel());
      out.narrow(0, 0, enc.numel()).copy_(enc);
      return;
    }
    Tensor idx;
    int64_t slots;
    if (form == bits::ZeroForm::kList) {
      slots = static_cast<int64_t>((code.zeros + 1) & ~uint64_t{1});
      idx = set_bits(x);
      idx = idx.narrow(0, 0, std::min<int64_t>(idx.numel(), static_cast<int64_t>(code.zeros)));
    } else {
      slots = 2 * static_cast<int64_t>(code.runs);
      const Tensor first = set_bits(run_edges(x, words * 8, true));
      const Tensor end = set_bits(run_edges(x, words * 8, false)).add_(1);
      const int64_t r = std::min<int64_t>(first.numel(), static_cast<int64_t>(code.runs));
      idx = at::stack({first.narrow(0, 0, r), end.narrow(0, 0, r)}, 1).view({-1});
    }
    Tensor entries = at::full({slots}, int64_t{bits::kNoIndex}, opts(plane, at::kLong));
    entries.narrow(0, 0, idx.numel()).copy_(idx);
    out.narrow(0, 0, slots * 4).copy_(le_bytes(entries, 4).view({-1}));
  }

  bool decode_zeros(const Tensor& in, const bits::ZeroCode& code, Tensor& plane) const override {
    const int64_t words = static_cast<int64_t>(plane_words(plane));
    const bits::ZeroForm form = bits::zero_form(code, static_cast<size_t>(words));
    if (form == bits::ZeroForm::kNone) {
      plane.zero_();
      return true;
    }
    if (form == bits::ZeroForm::kPlane) {
      plane.copy_(in.narrow(0, 0, words * 8));
      return true;
    }
    if (form == bits::ZeroForm::kPacked) {
      const Tensor enc = in.narrow(0, 0, static_cast<int64_t>(code.packed)).cpu().contiguous();
      Tensor host = at::empty({words * 8}, enc.options());
      if (!bits::decode_packed_runs(
              bytes_of(enc), static_cast<size_t>(enc.numel()), static_cast<size_t>(words),
              words_of(host))) {
        return false;
      }
      plane.copy_(host);
      return true;
    }
    const bool list = form == bits::ZeroForm::kList;
    // Entries: [e, w] offsets (w = 1) or runs' (first, end) (w = 2).
    const int64_t w = list ? 1 : 2;
    const int64_t e = list ? static_cast<int64_t>((code.zeros + 1) & ~uint64_t{1})
                           : static_cast<int64_t>(code.runs);
    const Tensor v = le_value(in.narrow(0, 0, e * w * 4).view({e * w, 4})).view({e, w});
    const Tensor first = v.select(1, 0), last = v.select(1, w - 1);
    const Tensor pad = first.eq(int64_t{bits::kNoIndex});
    const Tensor after_pad = pad.cumsum(0).gt(0); // at or after the first padding
    const Tensor real = after_pad.logical_not();
    // An entry after padding, or padding that is not all kNoIndex.
    Tensor bad = after_pad.logical_and(
        last.ne(int64_t{bits::kNoIndex}).logical_or(pad.logical_not()));
    bad.logical_or_(real.logical_and(last.ge(words * 64 + (list ? 0 : 1))));
    if (list) {
      const Tensor k = at::arange(e, opts(in, at::kLong));
      bad.logical_or_(real.logical_and(k.ge(static_cast<int64_t>(code.zeros))));
    } else {
      bad.logical_or_(real.logical_and(last.le(first)));
    }
    if (e > 1) {
      // Ascending with a gap: an offset above the one before, a run's first
      // above the end of the one before.
      const Tensor close = first.narrow(0, 1, e - 1).le(last.narrow(0, 0, e - 1));
      bad.narrow(0, 1, e - 1).logical_or_(real.narrow(0, 1, e - 1).logical_and(close));
    }
    if (bad.any().item<bool>()) {
      return false;
    }
    Tensor bits;
    if (list) {
      bits = at::zeros({words * 64}, opts(in, at::kByte));
      bits.index_fill_(0, first.masked_select(real), 1);
    } else {
      // +1 at each run's first, -1 at its end: the running sum is 1 inside.
      const Tensor starts = first.masked_select(real), ends = last.masked_select(real);
      Tensor delta = at::zeros({words * 64 + 1}, opts(in, at::kLong));
      delta.index_add_(0, starts, at::ones_like(starts));
      delta.index_add_(0, ends, at::full_like(ends, -1));
      bits = delta.cumsum(0).narrow(0, 0, words * 64).to(at::kByte);
    }
    plane.copy_(pack_bits(bits));
    return true;
  }

  // count_code / vote: the bit-sliced counters above; vote compares the
  // code with N (Sum > 0: code > N with zeros, 2 code > N without).
  void count_code(const std::vector<PlaneIn>& in, Tensor& out) const override {
    const int64_t bytes = in[0].sign.numel();
    bool with_zeros = false;
    const std::vector<Tensor> code = count_planes(in, bytes, with_zeros);
    for (size_t b = 0; b < code.size(); ++b) {
      Tensor o = out.narrow(0, static_cast<int64_t>(b) * bytes, bytes);
      store(o, code[b]);
    }
  }

  void vote(const std::vector<PlaneIn>& in, Tensor& sign, Tensor& tie) const override {
    const int64_t bytes = sign.numel();
    bool with_zeros = false;
    const std::vector<Tensor> code = count_planes(in, bytes, with_zeros);
    Tensor gt, eq;
    compare(code, with_zeros ? 0 : 1, in.size(), sign, gt, eq);
    sign.copy_(gt);
    tie.copy_(eq);
  }

  // vote_levels: levels.cpp's accumulator (bit_width(N * 2s) planes, full
  // adders over the p planes of each rank, then the carry rippled up) and
  // its comparison with N * s.
  void vote_levels(const std::vector<Tensor>& in, int p, Tensor& sign, Tensor& tie) const override {
    const int64_t bytes = sign.numel();
    const uint64_t s = static_cast<uint64_t>(bits::level_span(p));
    const uint64_t n = in.size();
    std::vector<Tensor> acc(static_cast<size_t>(bits::bit_width(n * 2 * s)));
    for (const Tensor& rank : in) {
      Tensor carry;
      size_t b = 0;
      for (; b < static_cast<size_t>(p); ++b) {
        const Tensor x = rank.narrow(0, static_cast<int64_t>(b) * bytes, bytes);
        const Tensor t = xor_(acc[b], x);
        const Tensor next = or_(and_(acc[b], x), and_(carry, t));
        acc[b] = xor_(t, carry);
        carry = next;
      }
      for (; carry.defined() && b < acc.size(); ++b) {
        const Tensor next = and_(acc[b], carry);
        acc[b] = xor_(acc[b], carry);
        carry = next;
      }
    }
    Tensor gt, eq;
    compare(acc, 0, n * s, sign, gt, eq);
    sign.copy_(gt);
    tie.copy_(eq);
  }

  // all_zero: the zero planes ANDed (a rank without one: none), or every
  // rank's level planes compared with u = s (bit p - 1 clear, the rest set).
  void all_zero(const std::vector<PlaneIn>& in, int value_bits, Tensor& out) const override {
    const int64_t bytes = out.numel();
    Tensor acc = at::full({bytes}, in.empty() ? 0 : 0xff, opts(out, at::kByte));
    for (const PlaneIn& rank : in) {
      if (value_bits == 0) {
        if (!rank.zero.defined()) {
          acc.zero_();
          break;
        }
        acc.bitwise_and_(rank.zero.narrow(0, 0, bytes));
        continue;
      }
      for (int b = 0; b < value_bits; ++b) {
        const Tensor x = rank.sign.narrow(0, static_cast<int64_t>(b) * bytes, bytes);
        acc.bitwise_and_(b < value_bits - 1 ? x : x.bitwise_not());
      }
    }
    out.copy_(acc);
  }

  // break_ties: the rule's words computed on the host (a function of the
  // rule and the word's position only) and sent over once.
  void break_ties(
      Tensor& sign,
      const Tensor& tie,
      const Tensor& still,
      const bits::TieRule& rule,
      uint64_t first_word) const override {
    const int64_t words = static_cast<int64_t>(plane_words(sign));
    if (rule.mode == bits::TieBreak::kZero || words == 0) {
      return;
    }
    const Tensor t =
        tie.narrow(0, 0, words * 8).bitwise_and(still.narrow(0, 0, words * 8).bitwise_not());
    if (rule.mode == bits::TieBreak::kAlternate) {
      if (bits::tie_word(rule, first_word) != 0) {
        sign.bitwise_or_(t);
      }
      return;
    }
    Tensor host = at::empty({words * 8}, at::kByte);
    auto* w = reinterpret_cast<uint64_t*>(host.data_ptr<uint8_t>());
    for (int64_t i = 0; i < words; ++i) {
      w[i] = bits::tie_word(rule, first_word + static_cast<uint64_t>(i));
    }
    sign.bitwise_or_(t.bitwise_and(host.to(sign.device())));
  }

  // Trits (trits.h): a word's 64 elements and a 65th that is 0 (-1), five
  // per byte, sum of trit_j 3^j; decoding checks the bytes the C++ checks
  // (every byte of a whole word, the used bytes of a partial one).
  void encode_trits(const Tensor& sign, const Tensor& tie, Tensor& out) const override {
    const int64_t words = static_cast<int64_t>(plane_words(sign));
    if (words == 0) {
      return;
    }
    const Tensor s = bits_of(sign.narrow(0, 0, words * 8)).view({words, 64});
    const Tensor t = bits_of(tie.narrow(0, 0, words * 8)).view({words, 64});
    const Tensor trit = at::constant_pad_nd(s.bitwise_or(t).add_(t), {0, 1}, 0);
    const Tensor place = at::tensor({1, 3, 9, 27, 81}, at::kByte).to(sign.device());
    const Tensor code = trit.view({words, static_cast<int64_t>(bits::kTritBytesPerWord), 5})
                            .mul(place)
                            .sum(-1, false, at::kByte);
    out.narrow(0, 0, words * static_cast<int64_t>(bits::kTritBytesPerWord)).copy_(code.view({-1}));
  }

  bool decode_trits(const Tensor& trits, const Tensor& lut, Tensor& dst) const override {
    const int64_t n = dst.numel();
    if (n == 0) {
      return true;
    }
    const int64_t per_word = static_cast<int64_t>(bits::kTritBytesPerWord);
    const int64_t full = n / 64, rest = n % 64;
    const int64_t checked = full * per_word + (rest == 0 ? 0 : (rest - 1) / 5 + 1);
    if (trits.narrow(0, 0, checked).ge(243).any().item<bool>()) {
      return false;
    }
    const int64_t words = (n + 63) / 64;
    const Tensor code = trits.narrow(0, 0, words * per_word).to(at::kInt).unsqueeze(1);
    const Tensor place = at::tensor({1, 3, 9, 27, 81}, at::kInt).to(trits.device());
    const Tensor trit =
        code.div(place, "floor").remainder_(3).view({words, 65}).narrow(1, 0, 64).reshape({-1});
    as_bits(dst).copy_(as_bits(lut).index_select(0, trit.narrow(0, 0, n)));
    return true;
  }

  // Zero counts (zero_counts.h): the listed elements are the set bits of the
  // OR of the zero planes; applying checks each entry as the C++ does and
  // writes the entries before the first bad one, as it does.
  bool encode_zero_counts(const std::vector<PlaneIn>& in, uint64_t cap, Tensor& out)
      const override {
    const int64_t bytes = in[0].sign.numel();
    Tensor any;
    for (const PlaneIn& p : in) {
      if (p.zero.defined()) {
        any = or_(any, p.zero.narrow(0, 0, bytes));
      }
    }
    const Tensor idx = any.defined() ? set_bits(any) : at::empty({0}, opts(out, at::kLong));
    const int64_t count = idx.numel();
    if (static_cast<uint64_t>(count) > cap) {
      return false;
    }
    out.narrow(0, 0, 8).copy_(device_u64(static_cast<uint64_t>(count), out));
    if (count > 0) {
      Tensor zeros = at::zeros({count}, opts(out, at::kLong));
      for (const PlaneIn& p : in) {
        if (p.zero.defined()) {
          zeros.add_(bit_at(p.zero, idx));
        }
      }
      const Tensor entries = at::cat({le_bytes(zeros, 4), le_bytes(idx, 4)}, 1);
      out.narrow(0, 8, 8 * count).copy_(entries.view({-1}));
    }
    out.narrow(0, 8 + 8 * count, 8 * (static_cast<int64_t>(cap) - count)).zero_();
    return true;
  }

  bool apply_zero_counts(
      const Tensor& list,
      uint64_t cap,
      const std::vector<Tensor>& planes,
      int N,
      const Tensor& zlut,
      Tensor& dst) const override {
    const uint64_t count = host_u64(list.narrow(0, 0, 8));
    if (count > cap) {
      return false;
    }
    if (count == 0) {
      return true;
    }
    const int64_t elems = dst.numel();
    if (elems == 0) {
      return false;
    }
    const int64_t m = static_cast<int64_t>(count);
    const Tensor entries = list.narrow(0, 8, 8 * m).view({m, 8});
    const Tensor zeros = le_value(entries.narrow(1, 0, 4));
    const Tensor off = le_value(entries.narrow(1, 4, 4));
    const Tensor at_off = off.clamp_max(elems - 1); // in range even where off is bad
    Tensor pos = at::zeros({m}, opts(list, at::kLong));
    for (size_t b = 0; b < planes.size(); ++b) {
      pos.bitwise_or_(bit_at(planes[b], at_off).bitwise_left_shift(static_cast<int64_t>(b)));
    }
    Tensor bad = off.ge(elems).logical_or_(zeros.eq(0)).logical_or_(pos.add(zeros).gt(N));
    if (m > 1) {
      bad.narrow(0, 1, m - 1).logical_or_(off.narrow(0, 1, m - 1).le(off.narrow(0, 0, m - 1)));
    }
    const Tensor k = at::arange(m, opts(list, at::kLong));
    const int64_t first_bad = at::where(bad, k, m).min().item<int64_t>();
    if (first_bad > 0) {
      const Tensor entry = pos.narrow(0, 0, first_bad).mul(2).add_(zeros.narrow(0, 0, first_bad));
      as_bits(dst).index_copy_(
          0, off.narrow(0, 0, first_bad), as_bits(zlut).index_select(0, entry));
    }
    return first_bad == m;
  }

  // unpack: each element's code from its bits of the planes (uint8 up to 8
  // planes, int32 past), then a lookup of the table's integer view (an int64
  // index: index_select's fast path on CPU).
  void unpack(const std::vector<Tensor>& planes, const Tensor& lut, Tensor& dst) const override {
    const int64_t n = dst.numel();
    if (n == 0) {
      return;
    }
    const int64_t bytes = (n + 7) / 8;
    Tensor code = at::zeros({bytes * 8}, opts(dst, planes.size() > 8 ? at::kInt : at::kByte));
    for (size_t b = 0; b < planes.size(); ++b) {
      code.bitwise_or_(bits_of(planes[b].narrow(0, 0, bytes))
                           .to(code.scalar_type())
                           .bitwise_left_shift_(static_cast<int64_t>(b)));
    }
    as_bits(dst).copy_(as_bits(lut).index_select(0, code.narrow(0, 0, n).to(at::kLong)));
  }
};

} // namespace

const KernelSet& aten_kernels() {
  static const AtenKernelSet set;
  return set;
}

} // namespace lionbit
